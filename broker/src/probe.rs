//! Instrumentation of the broker client: which threads call it.
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Counts broker client calls by the name of the calling thread. Cheap to clone.
///
/// The acceptance suite uses it to prove that no executor thread ever calls the broker.
#[derive(Clone, Debug, Default)]
pub struct CallProbe {
    calls: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl CallProbe {
    /// An empty probe.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one call from the current thread.
    pub fn record(&self) {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>").to_owned();
        // A poisoned lock only means another recorder panicked; the counts are still usable.
        let mut calls = self
            .calls
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        *calls.entry(name).or_default() += 1;
    }

    /// Calls so far, by thread name.
    pub fn calls_by_thread(&self) -> BTreeMap<String, u64> {
        self.calls
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }
}

//! What the publishers last learned about the broker, for readiness probes.
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// The broker as the relay's publishers last saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerState {
    /// No publisher has talked to the broker yet.
    Unknown,
    /// The last session opened or batch confirmed without a fault.
    Up,
    /// The last attempt failed: unreachable, refused, or confirms did not come.
    Down,
}

/// Shared by every publisher of a relay; cheap to clone and to read.
#[derive(Clone, Debug, Default)]
pub struct BrokerHealth(Arc<AtomicU8>);

impl BrokerHealth {
    /// A fresh health, [`BrokerState::Unknown`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The last state reported.
    pub fn state(&self) -> BrokerState {
        match self.0.load(Ordering::Acquire) {
            1 => BrokerState::Up,
            2 => BrokerState::Down,
            _ => BrokerState::Unknown,
        }
    }

    pub(crate) fn report(&self, up: bool) {
        self.0.store(if up { 1 } else { 2 }, Ordering::Release);
    }
}

//! A timer table keyed by what each timer is for: one deadline per key. Setting a key again
//! replaces its deadline and stopping it cancels it, so a timer set for an earlier state never
//! fires into a later one (quinn-proto's `TimerTable` is the model). The supervisor's core and
//! each drainer's window keep theirs in one.
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// Deadlines keyed by what each is for; see the module docs.
#[derive(Debug)]
pub struct Timers<K: Ord + Clone> {
    deadlines: BTreeMap<K, Instant>,
    queue: BTreeSet<(Instant, K)>,
}

impl<K: Ord + Clone> Default for Timers<K> {
    fn default() -> Self {
        Self {
            deadlines: BTreeMap::new(),
            queue: BTreeSet::new(),
        }
    }
}

impl<K: Ord + Clone> Timers<K> {
    /// Sets `key` to fire at `at`, replacing any deadline it had.
    pub fn set(&mut self, key: K, at: Instant) {
        if let Some(old) = self.deadlines.insert(key.clone(), at) {
            self.queue.remove(&(old, key.clone()));
        }
        self.queue.insert((at, key));
    }

    /// Cancels `key`; its deadline, if it was set.
    pub fn stop(&mut self, key: &K) -> Option<Instant> {
        let at = self.deadlines.remove(key)?;
        self.queue.remove(&(at, key.clone()));
        Some(at)
    }

    /// The earliest deadline.
    pub fn next(&self) -> Option<Instant> {
        self.queue.first().map(|(at, _)| *at)
    }

    /// Takes the earliest timer due at `now`, if any.
    pub fn pop_due(&mut self, now: Instant) -> Option<K> {
        let (at, _) = self.queue.first()?;
        if *at > now {
            return None;
        }
        let (_, key) = self.queue.pop_first()?;
        self.deadlines.remove(&key);
        Some(key)
    }

    /// Every timer set, with its deadline.
    pub fn iter(&self) -> impl Iterator<Item = (&K, Instant)> {
        self.deadlines.iter().map(|(key, at)| (key, *at))
    }

    /// Cancels every timer `keep` refuses.
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.deadlines.retain(|key, _| keep(key));
        let deadlines = &self.deadlines;
        self.queue.retain(|(_, key)| deadlines.contains_key(key));
    }

    /// Cancels every timer.
    pub fn clear(&mut self) {
        self.deadlines.clear();
        self.queue.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    /// One key, one deadline: a set replaces, a stop cancels, and due timers come out in
    /// deadline order, each once.
    #[test]
    fn a_key_has_one_deadline_that_set_replaces_and_stop_cancels() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        let mut timers = Timers::default();
        timers.set("a", at(100));
        timers.set("b", at(50));
        timers.set("a", at(300));
        assert_eq!(timers.next(), Some(at(50)));
        assert_eq!(timers.pop_due(at(200)), Some("b"));
        assert_eq!(timers.pop_due(at(200)), None, "a moved to 300");
        assert_eq!(timers.stop(&"a"), Some(at(300)));
        assert_eq!(timers.next(), None);
        assert_eq!(timers.pop_due(at(1_000)), None);
    }

    proptest! {
        /// Against a map of the last deadline set per key: the table fires exactly those, in
        /// order, whatever the sets, stops and retains before.
        #[test]
        fn the_table_fires_the_last_deadline_of_each_key_in_order(
            ops in prop::collection::vec((0u8..6, 0u64..1_000, 0u8..3), 0..60)
        ) {
            let now = Instant::now();
            let mut timers = Timers::default();
            let mut model: BTreeMap<u8, u64> = BTreeMap::new();
            for (key, ms, op) in ops {
                match op {
                    0 | 1 => {
                        timers.set(key, now + Duration::from_millis(ms));
                        model.insert(key, ms);
                    }
                    _ => {
                        timers.retain(|k| *k != key);
                        model.remove(&key);
                    }
                }
            }
            let mut want: Vec<(u64, u8)> = model.into_iter().map(|(k, ms)| (ms, k)).collect();
            want.sort();
            let mut fired = Vec::new();
            while let Some(key) = timers.pop_due(now + Duration::from_secs(1)) {
                fired.push(key);
            }
            prop_assert_eq!(fired, want.into_iter().map(|(_, k)| k).collect::<Vec<_>>());
            prop_assert_eq!(timers.next(), None);
        }
    }
}

//! A store call as the supervisor's tasks make it: under a time limit ([`store::within`]), its
//! failures in a row logged at WARN the 1st, 2nd, 4th, 8th... time and its recovery once
//! ([`Failures`]). The lease runner and the poller both call PostgreSQL this way.

/// One kind of call's failures in a row: logged at WARN the 1st, 2nd, 4th, 8th... time, else
/// at DEBUG, and its recovery once.
#[derive(Debug)]
pub(crate) struct Failures {
    what: &'static str,
    count: u64,
}

impl Failures {
    pub(crate) fn new(what: &'static str) -> Self {
        Self { what, count: 0 }
    }

    /// The call's value, or `None` after logging its failure.
    pub(crate) fn seen<T>(&mut self, result: Result<T, store::Error>) -> Option<T> {
        let what = self.what;
        match result {
            Ok(value) => {
                if self.count > 0 {
                    tracing::info!(failures = self.count, "{what} recovered");
                }
                self.count = 0;
                Some(value)
            }
            Err(err) => {
                self.count += 1;
                if broker::warn_worthy(self.count) {
                    tracing::warn!(failures = self.count, error = %err, "{what} failed; will retry");
                } else {
                    tracing::debug!(failures = self.count, error = %err, "{what} failed; will retry");
                }
                None
            }
        }
    }
}

//! A store call as the supervisor's tasks make it: under a time limit ([`within`]), its
//! failures in a row logged at WARN the 1st, 2nd, 4th, 8th... time and its recovery once
//! ([`Failures`]). The lease runner and the poller both call PostgreSQL this way.
use std::time::Duration;

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
    pub(crate) fn seen<T>(&mut self, result: Result<T, String>) -> Option<T> {
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

/// A store call under `limit`: its error, or "no answer within", as text for the log.
pub(crate) async fn within<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, store::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {} ms", limit.as_millis())),
    }
}

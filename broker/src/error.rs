//! The broker's one error type.

/// What went wrong talking to the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker could not be reached (refused, reset, or no answer in time).
    #[error("broker unreachable: {0}")]
    Unreachable(String),
    /// A broker operation did not finish within its timeout.
    #[error("broker did not answer {operation} within {timeout_ms} ms")]
    Timeout {
        /// What was awaited.
        operation: &'static str,
        /// The timeout, in milliseconds.
        timeout_ms: u64,
    },
    /// The connection or channel failed mid-use; it is closed and will be reopened. The
    /// source is the broker client's own error (an adapter may look into it).
    #[error("broker channel failed: {0}")]
    Channel(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The configuration is unusable.
    #[error("invalid broker configuration: {0}")]
    InvalidConfig(String),
    /// The broker answered and refused: wrong credentials, an unknown vhost, a reserved or
    /// conflicting topology. Retrying does not help; an operator must act.
    #[error("broker refused: {0}")]
    Refused(String),
    /// The fold's store failed.
    #[error("fold store: {0}")]
    Store(#[from] store::Error),
    /// A stream consumer's stored offset fell out of the stream's retention: the messages from
    /// `expected` up to `first` were removed before this consumer read them. It does not go
    /// on past the gap on its own.
    #[error(
        "stream {queue}: offsets {expected} to {first} were removed by the stream's retention \
         before this consumer folded them; rebuild the group from the first retained offset \
         (`distribution group reset`) or store a later offset (relay_fold_save_offset)"
    )]
    OffsetLost {
        /// The stream queue.
        queue: String,
        /// The offset the consumer stored (the next it had to read).
        expected: u64,
        /// The first offset the stream delivered.
        first: u64,
    },
}

impl Error {
    /// A client's error of a failed connection or channel ([`Error::Channel`]).
    pub fn channel(err: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Channel(Box::new(err))
    }

    /// [`Error::Timeout`]: `operation` did not finish within `limit`.
    pub fn timed_out(operation: &'static str, limit: std::time::Duration) -> Self {
        Error::Timeout {
            operation,
            timeout_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// Whether retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Unreachable(_) | Error::Timeout { .. } | Error::Channel(_) => true,
            Error::InvalidConfig(_) | Error::Refused(_) | Error::OffsetLost { .. } => false,
            Error::Store(err) => err.is_transient(),
        }
    }
}

/// Awaits a broker operation under `limit`: its own result, or [`Error::Timeout`] naming
/// `operation`. The one way the adapters bound a call to their broker.
pub async fn within<T>(
    operation: &'static str,
    limit: std::time::Duration,
    future: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| Err(Error::timed_out(operation, limit)))
}

/// A delivered message that does not follow the wire contract.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// A required header is missing or has the wrong type.
    #[error("header {0:?} is missing or not of the contract's type")]
    Header(&'static str),
    /// A header's id is not a valid tenant, run or branch id.
    #[error("header {header:?} is not a valid id: {reason}")]
    Id {
        /// Which header.
        header: &'static str,
        /// Why.
        reason: String,
    },
}

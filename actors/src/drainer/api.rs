//! What a drainer is given, what it is told, and what it reports.
use std::sync::Arc;
use std::time::Duration;

use store::{Fence, Outbox, TenantId};
use tokio::sync::Semaphore;

use broker::RetryPolicy;

use crate::directory::PublisherDirectory;

/// How a drainer works.
#[derive(Clone, Copy, Debug)]
pub struct DrainerConfig {
    /// Largest number of events drained and published at once. Default 1000.
    pub batch_size: u32,
    /// Longest wait for any one database call of the drainer before failing it (see
    /// [`store::within`]). Default 30 s. (A batch's outcomes need no timeout here: the publisher
    /// answers every part it was given, bounded by the broker's confirm timeout, and at once if
    /// it dies; only a broker that blocked the connection makes it wait, for as long as the
    /// broker holds what was written.)
    pub batch_timeout: Duration,
    /// Delays between retries after a batch had failures.
    pub retry: RetryPolicy,
    /// Batches of one tenant in flight at once. Default 1: on the 2-core reference machine a
    /// window of 4 raised load without lowering latency (benches/DECISIONS.md); a wider window
    /// pays where the broker round trip, not CPU, dominates.
    pub max_batches_in_flight: usize,
    /// A drainer with nothing to do for this long stops and frees what it holds; the next
    /// wake-up or poll starts a new one. Default 30 s.
    pub idle_retire: Duration,
    /// Most payload bytes drained into one batch (the first event always comes, however
    /// large). Default 4 MiB.
    pub batch_max_bytes: u32,
    /// A branch whose events the broker refused (returned, nacked) this many times in a row
    /// is parked in PostgreSQL. Until then it is retried alone, with backoff. Default 5.
    pub park_after_attempts: u32,
    /// How long a parked branch is skipped before it is tried again. Default 60 s.
    pub park_retry: Duration,
    /// A branch the broker keeps nacking is parked only once the nacks have lasted this long
    /// too (and `park_after_attempts` is reached): a quorum queue nacks while it elects a
    /// leader, which takes seconds. Default 30 s.
    pub nack_grace: Duration,
    /// Batches of at most this many events (and 256 KiB) go through each shard's express
    /// publisher when nothing else of their tenant is in flight, so quiet tenants never queue
    /// behind another tenant's backlog. Default 32; 0: one publisher per shard, no lanes.
    pub express_max_events: u32,
}

impl Default for DrainerConfig {
    fn default() -> Self {
        Self {
            batch_size: 1000,
            batch_timeout: Duration::from_secs(30),
            retry: RetryPolicy::default(),
            max_batches_in_flight: 1,
            idle_retire: Duration::from_secs(30),
            batch_max_bytes: 4 << 20,
            park_after_attempts: 5,
            park_retry: Duration::from_secs(60),
            nack_grace: Duration::from_secs(30),
            express_max_events: 32,
        }
    }
}

/// Why a drainer stopped on its own: the supervisor restarts none of these. It travels as the
/// text of ractor's stop reason ([`StopReason::as_str`]); [`StopReason::parse`] is the one place
/// that reads it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// Graceful shutdown finished its batches.
    Finished,
    /// Its tenant's lease is gone: another relay may own the tenant now.
    Fenced,
    /// Nothing to do for `idle_retire`.
    Idle,
}

impl StopReason {
    const ALL: [StopReason; 3] = [StopReason::Finished, StopReason::Fenced, StopReason::Idle];

    /// Its text, as the drainer gives it to ractor.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Finished => "finished",
            StopReason::Fenced => "fenced",
            StopReason::Idle => "idle",
        }
    }

    /// The orderly stop a stopped actor's reason names, or `None` for anything else (a failure,
    /// or a stop of another kind).
    pub fn parse(reason: &str) -> Option<StopReason> {
        Self::ALL.into_iter().find(|stop| stop.as_str() == reason)
    }
}

#[cfg(test)]
mod stop_tests {
    use super::StopReason;

    #[test]
    fn each_stop_reason_reads_back_as_itself_and_nothing_else_does() {
        for stop in StopReason::ALL {
            assert_eq!(StopReason::parse(stop.as_str()), Some(stop));
        }
        for other in [
            "",
            "stopped",
            "Idle",
            "idle ",
            "database down",
            "panicked: idle",
        ] {
            assert_eq!(StopReason::parse(other), None, "{other:?}");
        }
    }
}

/// Arguments of a drainer.
#[derive(Clone)]
pub struct DrainerArgs {
    /// The tenant it drains (the supervisor holds the tenant's lease).
    pub tenant: TenantId,
    /// The outbox.
    pub outbox: Outbox,
    /// The live publisher of each shard when it starts: the drainer's own copy, kept up to
    /// date by [`crate::DrainerMessage::Publisher`].
    pub publishers: PublisherDirectory,
    /// Events in flight across the whole relay, shared by every drainer: one permit per event.
    pub budget: Arc<Semaphore>,
    /// Payload bytes in flight across the whole relay (drained, in a publisher's mailbox, or
    /// awaiting confirms), shared by every drainer: one permit per byte.
    pub byte_budget: Arc<Semaphore>,
    /// The tenant's lease: every publish and ack is fenced by it.
    pub fence: Fence,
    /// Where the drainer reports to its supervisor (a message, never shared state): that it
    /// took a wake-up, and that it found nothing to do.
    pub report: DrainerReporter,
    /// Batch size, timeouts, retry delays.
    pub config: DrainerConfig,
}

impl std::fmt::Debug for DrainerArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainerArgs")
            .field("tenant", &self.tenant)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What a drainer tells its supervisor, whose core decides what follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainerReport {
    /// It took a `Drain` (its drain starts now): a later wake-up needs a `Drain` of its own.
    WakeTaken,
    /// Its drain found nothing and nothing is in flight, at this activity number: it retires
    /// after `idle_retire`, or sooner when told to ([`crate::DrainerMessage::Retire`]).
    Idle {
        /// The window's activity count then.
        activity: u64,
    },
}

/// Sends a drainer's reports (with its actor id) to its supervisor.
pub type DrainerReporter = Arc<dyn Fn(ractor::ActorId, DrainerReport) + Send + Sync>;

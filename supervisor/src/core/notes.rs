//! What the core tells an operator, as data: the core decides that something is worth a log
//! line or a metric, the actor records it (`tree::record`), as quinn-proto's connection hands
//! its events and stats to its caller instead of logging them itself.
use std::time::Duration;

use actors::ShardId;
use store::TenantId;

/// One thing worth telling, in the order the core decided it ([`super::Core::poll_note`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Note {
    /// A check found the broker taking connections again: publishers restart now.
    BrokerAnswers,
    /// A check found the broker not taking connections; `again` says whether another is
    /// scheduled (while the broker is in doubt: a publisher failed, and nothing was confirmed
    /// nor answered since).
    BrokerSilent { again: bool },
    /// A shard's publisher had a publish confirmed after `failures` failures.
    PublisherRecovered { shard: ShardId, failures: u64 },
    /// A shard's publisher ended; it restarts after `retry_in` (its `failures`-th failure).
    PublisherRestarting {
        shard: ShardId,
        failures: u64,
        retry_in: Duration,
        reason: String,
    },
    /// A tenant's drainer stopped for good (retired, fenced or finished).
    DrainerStopped { tenant: TenantId, reason: String },
    /// A tenant's drainer ended; it restarts after `retry_in` (its `failures`-th failure).
    DrainerRestarting {
        tenant: TenantId,
        failures: u64,
        retry_in: Duration,
        reason: String,
    },
    /// Leases lost: expired before a renewal reached PostgreSQL, or taken over.
    LeasesLost { buckets: usize },
    /// Handovers forced: their batches did not settle within `grace`.
    HandoversForced { buckets: usize, grace: Duration },
    /// Buckets handed over toward an even share of `members`, once their batches settle.
    HandingOver { buckets: usize, members: u32 },
    /// The leases held now, and the relays sharing them.
    Leases { held: usize, members: u32 },
}

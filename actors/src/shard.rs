//! Which publisher owns a branch.
use store::BranchKey;

/// A publisher shard. Every event of a `BranchKey` goes through the same shard, so one actor's
/// mailbox and one AMQP channel carry a branch in Lsn order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardId(pub u16);

impl std::fmt::Display for ShardId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Which of a shard's two publishers carries a batch. A tenant's batches in flight are always
/// on one lane (see the drainer's window), so a branch's order holds across lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Large batches (a backlog being drained).
    Bulk,
    /// Small batches, so that a quiet tenant never waits behind another tenant's backlog in a
    /// publisher's mailbox or AMQP channel.
    Express,
}

/// The lanes a relay runs: the bulk lane alone, or an express lane beside it (each shard then
/// has two publishers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lanes {
    /// Every batch on the bulk lane.
    BulkOnly,
    /// Small batches on the express lane, the rest on the bulk lane.
    BulkAndExpress,
}

/// How branches are spread over publisher shards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sharding {
    /// By a hash of the whole `BranchKey` (the default).
    #[default]
    Branch,
    /// One shard per broker partition, a branch on its run's partition's shard (the shards
    /// are then the partitions): each publisher's channel writes to one queue only. Streams
    /// need it: RabbitMQ before 4.0.x, when a stream's leader changes under a channel that
    /// survives, resends that channel's unconfirmed messages under the channel's own sequence
    /// numbers instead of the stream's (rabbitmq-server#9457, fixed by #12236); the stream's
    /// deduplication then drops the channel's next messages and confirms them, lost. With one
    /// stream per channel, and a fresh channel after any returned message, the two sequences
    /// are one and the resend is right.
    Partition,
}

/// The shard of a branch: FNV-1a 64 over `tenant 0x00 run 0x00 branch`, modulo `shards`.
pub(crate) fn shard_of(key: &BranchKey, shards: u16) -> ShardId {
    let hash = store::fnv1a(&[key.tenant.as_str(), key.run.as_str(), key.branch.as_str()]);
    ShardId((hash % u64::from(shards.max(1))) as u16)
}

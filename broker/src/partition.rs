//! Partitions and groups, the same on every broker.
//!
//! Broker partition key = `(TenantId, RunId)`: every event of a run goes to one partition, so a
//! consumer of that partition sees the run's events in publish order. The map is stable across
//! processes and versions: FNV-1a 64 over `tenant bytes, 0x00, run bytes`, modulo the partition
//! count. Changing the partition count remaps runs; do it only with the relay drained.
use store::{RunId, TenantId};

use crate::error::Error;

/// A partition of the topology (on RabbitMQ, a queue per group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Partition(pub u16);

/// The partition of a run among `partitions`: FNV-1a 64 over
/// `tenant 0x00 run` ([`store::fnv1a`]), modulo `partitions`.
pub fn partition_of(tenant: &TenantId, run: &RunId, partitions: u16) -> Partition {
    let hash = store::fnv1a(&[tenant.as_str(), run.as_str()]);
    Partition((hash % u64::from(partitions.max(1))) as u16)
}

/// A consumer group: one consumer service's own copy of the history. Each group has its own
/// partition queues, bound to the topology's exchange with the same routing keys (so order per
/// `(TenantId, RunId)` holds in every group), and its own dead-letter queue. A group sees the
/// events published after its queues exist.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    /// The unnamed group of earlier versions: queues `<topology>.p<N>`, `<topology>.dead`.
    #[default]
    Default,
    /// A named group: queues `<topology>.<name>.p<N>`, `<topology>.<name>.dead`.
    Named(String),
}

impl Group {
    /// `default` is the unnamed group; any other name is 1 to 64 bytes of `[a-z0-9_-]`, and
    /// not `dead` nor `p<digits>` (which would read as a queue of the unnamed group).
    pub fn parse(name: &str) -> Result<Self, Error> {
        if name == "default" {
            return Ok(Self::Default);
        }
        let fine = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-';
        let queue_like = name == "dead"
            || (name.len() > 1
                && name.starts_with('p')
                && name[1..].bytes().all(|b| b.is_ascii_digit()));
        if name.is_empty() || name.len() > 64 || !name.bytes().all(fine) || queue_like {
            return Err(Error::InvalidConfig(format!(
                "consumer group {name:?} must be `default` or 1 to 64 bytes of a-z 0-9 _ -, \
                 and not `dead` or p<N>"
            )));
        }
        Ok(Self::Named(name.to_owned()))
    }

    /// The group's name (`default` for the unnamed one).
    pub fn name(&self) -> &str {
        match self {
            Self::Default => "default",
            Self::Named(name) => name,
        }
    }
}

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

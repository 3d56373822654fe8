//! The live publisher of each shard and lane. The supervisor keeps the one it changes; each
//! drainer keeps a copy of its own, given at its start and updated by messages
//! ([`crate::DrainerMessage::Publisher`]): no memory is shared between them.
//!
//! Slots `0..shards` are the bulk lane's publishers; with an express lane, slots
//! `shards..2 * shards` are its publishers, shard for shard.
use ractor::ActorRef;

use store::BranchKey;

use crate::mailbox::PublisherMessage;
use crate::shard::{Lane, Lanes, ShardId, Sharding, shard_of};

/// Slot -> live publisher (or none while it is being restarted): a plain value, each copy
/// its own.
#[derive(Clone, Debug)]
pub struct PublisherDirectory {
    shards: u16,
    express: bool,
    sharding: Sharding,
    slots: Vec<Option<ActorRef<PublisherMessage>>>,
}

impl PublisherDirectory {
    /// A directory of `shards` empty slots, twice as many with an express lane; branches
    /// go to shards as `sharding` says (with [`Sharding::Partition`], `shards` is the number
    /// of partitions).
    pub fn new(shards: u16, lanes: Lanes, sharding: Sharding) -> Self {
        let shards = shards.max(1);
        let express = lanes == Lanes::BulkAndExpress;
        let slots = usize::from(shards) * if express { 2 } else { 1 };
        Self {
            shards,
            express,
            sharding,
            slots: vec![None; slots],
        }
    }

    /// Number of shards (branches are hashed over these).
    pub fn shards(&self) -> u16 {
        self.shards
    }

    /// The shard that carries `branch`: the same for every event of it.
    pub fn shard_of(&self, branch: &BranchKey) -> ShardId {
        match self.sharding {
            Sharding::Branch => shard_of(branch, self.shards),
            Sharding::Partition => {
                ShardId(broker::partition_of(&branch.tenant, &branch.run, self.shards).0)
            }
        }
    }

    /// Number of publishers (shards times lanes).
    pub fn slots(&self) -> u16 {
        self.slots.len() as u16
    }

    /// The slot of `shard` on `lane` (the bulk lane when there is no express lane).
    pub fn slot(&self, shard: ShardId, lane: Lane) -> ShardId {
        match lane {
            Lane::Express if self.express => ShardId(self.shards + shard.0),
            _ => shard,
        }
    }

    /// The live publisher of `shard`, if any.
    pub fn get(&self, shard: ShardId) -> Option<ActorRef<PublisherMessage>> {
        self.slots.get(usize::from(shard.0)).cloned().flatten()
    }

    /// Sets (or clears) the publisher of `shard`.
    pub fn set(&mut self, shard: ShardId, publisher: Option<ActorRef<PublisherMessage>>) {
        if let Some(slot) = self.slots.get_mut(usize::from(shard.0)) {
            *slot = publisher;
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use store::{BranchId, BranchKey, RunId, TenantId};

    use super::*;

    proptest! {
        /// With one shard per partition, every branch of a run is on its run's partition's
        /// shard (its publisher's channel writes to that partition's queue only), and every
        /// lane keeps it there.
        #[test]
        fn partition_sharding_puts_a_branch_on_its_runs_partition(
            tenant in "[a-z0-9]{1,12}", run in "[a-z0-9]{1,12}", branch in "[a-z0-9]{1,12}",
            partitions in 1u16..64,
        ) {
            let key = BranchKey::new(
                TenantId::new(tenant).unwrap(),
                RunId::new(run).unwrap(),
                BranchId::new(branch).unwrap(),
            );
            let directory = PublisherDirectory::new(partitions, Lanes::BulkAndExpress, Sharding::Partition);
            let shard = directory.shard_of(&key);
            prop_assert_eq!(shard.0, broker::partition_of(&key.tenant, &key.run, partitions).0);
            prop_assert_eq!(directory.slot(shard, Lane::Express).0, partitions + shard.0);
            let by_branch = PublisherDirectory::new(partitions, Lanes::BulkAndExpress, Sharding::Branch);
            prop_assert_eq!(by_branch.shard_of(&key), shard_of(&key, partitions));
        }
    }
}

//! The live publisher of each shard and lane, written by the supervisor, read by drainers.
//!
//! Slots `0..shards` are the bulk lane's publishers; with an express lane, slots
//! `shards..2 * shards` are its publishers, shard for shard.
use std::sync::{Arc, RwLock};

use ractor::ActorRef;

use crate::{Lane, PublisherMessage, ShardId};

/// Slot -> live publisher (or none while it is being restarted). Cheap to clone.
#[derive(Clone, Debug)]
pub struct PublisherDirectory {
    shards: u16,
    express: bool,
    slots: Arc<RwLock<Vec<Option<ActorRef<PublisherMessage>>>>>,
}

impl PublisherDirectory {
    /// A directory of `shards` empty slots, twice as many with an `express` lane.
    pub fn new(shards: u16, express: bool) -> Self {
        let shards = shards.max(1);
        let slots = usize::from(shards) * if express { 2 } else { 1 };
        Self {
            shards,
            express,
            slots: Arc::new(RwLock::new(vec![None; slots])),
        }
    }

    /// Number of shards (branches are hashed over these).
    pub fn shards(&self) -> u16 {
        self.shards
    }

    /// Number of publishers (shards times lanes).
    pub fn slots(&self) -> u16 {
        self.read().len() as u16
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
        self.read().get(usize::from(shard.0)).cloned().flatten()
    }

    /// Sets (or clears) the publisher of `shard`.
    pub fn set(&self, shard: ShardId, publisher: Option<ActorRef<PublisherMessage>>) {
        // A poisoned lock only means a writer panicked mid-assignment of one slot; the vector is intact.
        let mut slots = self
            .slots
            .write()
            .unwrap_or_else(|poison| poison.into_inner());
        if let Some(slot) = slots.get_mut(usize::from(shard.0)) {
            *slot = publisher;
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Option<ActorRef<PublisherMessage>>>> {
        self.slots
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
    }
}

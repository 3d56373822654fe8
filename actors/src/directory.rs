//! The live publisher of each shard, written by the supervisor, read by drainers.
use std::sync::{Arc, RwLock};

use ractor::ActorRef;

use crate::{PublisherMessage, ShardId};

/// Shard -> live publisher (or none while it is being restarted). Cheap to clone.
#[derive(Clone, Debug)]
pub struct PublisherDirectory {
    slots: Arc<RwLock<Vec<Option<ActorRef<PublisherMessage>>>>>,
}

impl PublisherDirectory {
    /// A directory of `shards` empty slots.
    pub fn new(shards: u16) -> Self {
        Self {
            slots: Arc::new(RwLock::new(vec![None; usize::from(shards.max(1))])),
        }
    }

    /// Number of shards.
    pub fn shards(&self) -> u16 {
        self.read().len() as u16
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

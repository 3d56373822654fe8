//! What drainers and publishers say to each other: a drainer's mailbox ([`DrainerMessage`]), a
//! publisher's ([`PublisherMessage`]), and the [`Reply`] that carries a part of a batch's
//! outcomes back. Both actors import this file and neither imports the other.
use broker::Outcome;
use ractor::ActorRef;
use store::{Fence, OutboxEvent};

use crate::shard::ShardId;

/// Messages to a drainer.
#[derive(Debug)]
pub enum DrainerMessage {
    /// There may be pending work: drain unless a batch is in flight or a retry is scheduled.
    Drain,
    /// The drainer's one timer fired: the window says what is due.
    Tick,
    /// A publisher's outcomes for the part of batch `batch` it was given.
    Confirmed {
        /// Batch number.
        batch: u64,
        /// The shard that answered.
        shard: ShardId,
        /// One outcome per event sent to that shard, in order.
        outcomes: Vec<Outcome>,
    },
    /// A batch none of whose parts could be sent (no live publisher): settle it.
    Unsent,
    /// The broker is back (a publisher recovered): a tenant backing off after a failed batch
    /// drains now ([`crate::window`]'s `resume`); otherwise nothing.
    Resume,
    /// Graceful shutdown: finish the batch in flight (or abandon it to a timeout), then stop.
    Finish,
    /// The publisher of `slot` changed: send its events to `publisher` from now on (none: it is
    /// being restarted; batches for it are not sent, and retried after backoff).
    Publisher {
        /// The slot (shard and lane, [`crate::PublisherDirectory::slot`]).
        slot: ShardId,
        /// Its live publisher, if any.
        publisher: Option<ActorRef<PublisherMessage>>,
    },
    /// Retire now if still idle since `activity` (tenants wait for a drainer slot).
    Retire {
        /// The activity count of the [`crate::DrainerReport::Idle`] this answers.
        activity: u64,
    },
}

/// Where the outcomes of one part of a drainer's batch go: answered exactly once, by
/// [`Reply::answer`], or, if it is dropped unanswered (the publisher died with the part in its
/// mailbox or in flight, or gave up on it), at once with every event unconfirmed. So a drainer
/// never waits on a timer for a publisher that is gone, and only the drainers with parts on a
/// dead publisher hear of it.
#[derive(Debug)]
pub struct Reply {
    drainer: ActorRef<DrainerMessage>,
    batch: u64,
    shard: ShardId,
    answered: bool,
}

impl Reply {
    /// The answer for part `shard` of `drainer`'s batch `batch`.
    pub fn new(drainer: ActorRef<DrainerMessage>, batch: u64, shard: ShardId) -> Self {
        Self {
            drainer,
            batch,
            shard,
            answered: false,
        }
    }

    /// Sends `outcomes` (one per event of the part, in order). The drainer may have died
    /// meanwhile; it re-drains from the store, so a lost answer is safe.
    pub fn answer(mut self, outcomes: Vec<Outcome>) {
        self.answered = true;
        let _ = self.drainer.cast(DrainerMessage::Confirmed {
            batch: self.batch,
            shard: self.shard,
            outcomes,
        });
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.answered {
            // No outcomes: every event of the part counts as unconfirmed.
            let _ = self.drainer.cast(DrainerMessage::Confirmed {
                batch: self.batch,
                shard: self.shard,
                outcomes: Vec::new(),
            });
        }
    }
}

/// Messages to a publisher.
#[derive(Debug)]
pub enum PublisherMessage {
    /// Publish `events` (each branch's events in Lsn order) and answer `reply`.
    Publish {
        /// Events in the order to publish.
        events: Vec<OutboxEvent>,
        /// Who gets the outcomes (answered even if this publisher dies first).
        reply: Reply,
        /// The tenant's lease: nothing is written once it is closed.
        fence: Fence,
    },
}

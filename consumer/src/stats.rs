//! What a consumer did: per partition, summed, readable while it runs.
use std::sync::{Arc, Mutex};

use broker::Partition;
use store::FoldOutcome;

/// What a consumer did (per partition, or summed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FoldStats {
    /// Intents applied (parked successors they released are counted too).
    pub applied: u64,
    /// Redeliveries of messages already folded, and abandoned intents (no-ops).
    pub duplicates: u64,
    /// Deliveries parked until their predecessor (or their parent's rewind) arrives.
    pub parked: u64,
    /// Messages dead-lettered (contract breaks, broken chains, permanent handler errors).
    pub rejected: u64,
    /// Rewind markers folded.
    pub rewinds: u64,
    /// End markers folded (runs complete) when delivered in order; one released from being
    /// held back is not counted here.
    pub ended: u64,
    /// Sessions lost (broker gone, channel failed) and opened again.
    pub reconnects: u64,
    /// Times a stream partition stopped at a gap: messages its stored offset pointed at were
    /// removed by the stream's retention before it read them (metric
    /// `relay_consumer_offset_lost_total`). Nothing past the gap is folded.
    pub gaps: u64,
    /// Times a silent stream partition was subscribed to again
    /// ([`ConsumerConfig::stream_resubscribe`]).
    pub resubscribes: u64,
    /// Copies of history the outbox's database replaced after a failover (WIRE.md, "Epochs"):
    /// nothing applied (metric `relay_consumer_superseded_total`).
    pub superseded: u64,
    /// Diverged deliveries adopted after an operator armed their branch: the history the
    /// database lost was undone, then they were folded (metric `relay_consumer_adopted_total`).
    pub adopted: u64,
    /// Transactions committed: each folded one batch of deliveries (`applied / batches` is
    /// about the mean batch; [`crate::FoldBatch`]).
    pub batches: u64,
    /// Times a NATS partition found another consumer of its group reading it and stood by
    /// until that one's session ended.
    pub standbys: u64,
}

impl FoldStats {
    pub(crate) fn add(&mut self, outcome: FoldOutcome) {
        match outcome {
            FoldOutcome::Applied { released } => self.applied += 1 + u64::from(released),
            FoldOutcome::Rewound { released } => {
                self.rewinds += 1;
                self.applied += u64::from(released);
            }
            FoldOutcome::Duplicate | FoldOutcome::Abandoned => self.duplicates += 1,
            FoldOutcome::Parked => self.parked += 1,
            FoldOutcome::Ended => self.ended += 1,
            FoldOutcome::Superseded => self.superseded += 1,
            FoldOutcome::Adopted { released, .. } => {
                self.adopted += 1;
                self.applied += u64::from(released);
            }
        }
    }

    /// The sum of two tallies.
    pub fn plus(self, other: FoldStats) -> FoldStats {
        FoldStats {
            applied: self.applied + other.applied,
            duplicates: self.duplicates + other.duplicates,
            parked: self.parked + other.parked,
            rejected: self.rejected + other.rejected,
            rewinds: self.rewinds + other.rewinds,
            ended: self.ended + other.ended,
            reconnects: self.reconnects + other.reconnects,
            gaps: self.gaps + other.gaps,
            resubscribes: self.resubscribes + other.resubscribes,
            superseded: self.superseded + other.superseded,
            adopted: self.adopted + other.adopted,
            batches: self.batches + other.batches,
            standbys: self.standbys + other.standbys,
        }
    }
}

/// Running totals of a [`Consumer`], readable from elsewhere. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ConsumerProgress(pub(crate) Arc<Mutex<Vec<FoldStats>>>);

impl ConsumerProgress {
    /// The totals so far.
    pub fn totals(&self) -> FoldStats {
        totals(&self.0)
    }

    /// Each partition's totals, in the order of [`ConsumerConfig::partitions`].
    pub fn partitions(&self) -> Vec<FoldStats> {
        self.0
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }
}

/// Called with a partition's running totals after each of its deliveries.
pub(crate) type Observer = Arc<dyn Fn(Partition, FoldStats) + Send + Sync>;

pub(crate) fn totals(progress: &Mutex<Vec<FoldStats>>) -> FoldStats {
    progress
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .iter()
        .fold(FoldStats::default(), |sum, stats| sum.plus(*stats))
}

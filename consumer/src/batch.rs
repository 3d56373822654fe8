//! What a batch of deliveries becomes (pure): which are folded in its one transaction, which
//! are dead-lettered, and when it is taken from the broker.
//!
//! A batch is folded in one transaction, each delivery in order, and committed once; then every
//! delivery of it is acked at once. A delivery the fold refuses for good (a dead letter) is
//! taken out and the batch is folded again without it, from the start, in a new transaction:
//! the rolled-back attempt left nothing, so what the others fold is what one transaction per
//! delivery would have folded (a refused delivery changes nothing in either). Its dead letter is
//! published, and confirmed, before the commit that moves past it (on a stream, the stored
//! offset does), so a crash anywhere leaves it redelivered or dead-lettered, never neither; a
//! retry after a failed commit does not publish it again.
use std::time::Duration;

use crate::verdict::DeadReason;

/// How many deliveries one transaction folds at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FoldBatch {
    /// Most deliveries per transaction (1: a transaction per delivery). Default 128. Keep it
    /// at most [`ConsumerConfig::prefetch`](crate::ConsumerConfig::prefetch): a batch is
    /// made of what the broker pushed ahead; at half of it, the broker pushes the next batch
    /// while this one folds.
    pub events: u16,
    /// Most body bytes per transaction (the first delivery always comes, however large).
    /// Default 4 MiB.
    pub bytes: usize,
    /// How long to wait for more deliveries once one arrived, when fewer than `events` are
    /// there. Default zero: a batch is what arrived while the last one folded, so a quiet
    /// partition folds each delivery at once and a busy one folds in large batches.
    pub linger: Duration,
}

impl Default for FoldBatch {
    fn default() -> Self {
        Self {
            events: 128,
            bytes: 4 * 1024 * 1024,
            linger: Duration::ZERO,
        }
    }
}

impl FoldBatch {
    /// Whether a batch of `events` deliveries holding `bytes` takes no more.
    pub(crate) fn full(&self, events: usize, bytes: usize) -> bool {
        events >= usize::from(self.events.max(1)) || bytes >= self.bytes
    }
}

/// What becomes of one delivery of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Folded in the batch's transaction.
    Fold,
    /// Already folded before (a stream read again from an earlier offset): acked, nothing else.
    Skip,
    /// Dead-lettered: why, the reason text, and whether its dead letter is confirmed.
    Dead {
        why: DeadReason,
        reason: String,
        sent: bool,
    },
}

/// The slots of one batch, in delivery order.
#[derive(Debug, Default)]
pub(crate) struct BatchPlan {
    slots: Vec<Slot>,
}

impl BatchPlan {
    pub(crate) fn new(slots: Vec<Slot>) -> Self {
        Self { slots }
    }

    /// The deliveries the next attempt folds, in order.
    pub(crate) fn to_fold(&self) -> Vec<usize> {
        self.indices(|slot| *slot == Slot::Fold)
    }

    /// The fold refused delivery `at` for good: the next attempt folds the batch without it.
    pub(crate) fn refuse(&mut self, at: usize, why: DeadReason, reason: String) {
        debug_assert_eq!(
            self.slots[at],
            Slot::Fold,
            "only a folded delivery is refused"
        );
        self.slots[at] = Slot::Dead {
            why,
            reason,
            sent: false,
        };
    }

    /// Dead letters to publish (and have confirmed) before the commit: those not yet sent.
    pub(crate) fn unsent(&self) -> Vec<usize> {
        self.indices(|slot| matches!(slot, Slot::Dead { sent: false, .. }))
    }

    /// The dead letter of delivery `at` is confirmed.
    pub(crate) fn sent(&mut self, at: usize) {
        if let Slot::Dead { sent, .. } = &mut self.slots[at] {
            *sent = true;
        }
    }

    pub(crate) fn slot(&self, at: usize) -> &Slot {
        &self.slots[at]
    }

    fn indices(&self, wanted: impl Fn(&Slot) -> bool) -> Vec<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| wanted(slot))
            .map(|(at, _)| at)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_refused_delivery_is_folded_no_more_and_dead_lettered_once() {
        let mut plan = BatchPlan::new(vec![Slot::Fold, Slot::Skip, Slot::Fold, Slot::Fold]);
        assert_eq!(plan.to_fold(), [0, 2, 3]);
        plan.refuse(2, DeadReason::Handler, "handler: no".into());
        assert_eq!(plan.to_fold(), [0, 3]);
        assert_eq!(plan.unsent(), [2]);
        plan.sent(2);
        assert!(plan.unsent().is_empty());
        assert_eq!(
            plan.slot(2),
            &Slot::Dead {
                why: DeadReason::Handler,
                reason: "handler: no".into(),
                sent: true
            }
        );
    }

    #[test]
    fn a_batch_is_full_at_its_count_or_its_bytes() {
        let batch = FoldBatch {
            events: 3,
            bytes: 100,
            linger: Duration::ZERO,
        };
        assert!(!batch.full(2, 99));
        assert!(batch.full(3, 0));
        assert!(batch.full(1, 100));
        // Zero events would never fold: it means one.
        let one = FoldBatch { events: 0, ..batch };
        assert!(one.full(1, 0));
    }

    /// The consumer's loop over attempts (`Serve::handle_batch`), against a fold that refuses
    /// the `poison` deliveries for good and fails now and then: each of `transient` is an
    /// attempt that fails after that many folds (at the commit, once its dead letters are
    /// confirmed, if that is past its last fold). Each attempt folds in a fresh transaction:
    /// only the committed one counts. Returns what it folded and the dead letters published.
    fn run(
        len: usize,
        poison: &BTreeSet<usize>,
        mut transient: Vec<usize>,
    ) -> (Vec<usize>, Vec<usize>) {
        let mut plan = BatchPlan::new(vec![Slot::Fold; len]);
        let mut published = Vec::new();
        loop {
            let failure = transient.pop();
            let mut folded = Vec::new();
            let mut refused = None;
            let mut failed = false;
            for at in plan.to_fold() {
                if failure == Some(folded.len()) {
                    failed = true;
                    break;
                }
                if poison.contains(&at) {
                    refused = Some(at);
                    break;
                }
                folded.push(at);
            }
            if let Some(at) = refused {
                plan.refuse(at, DeadReason::Handler, format!("poison {at}"));
                continue;
            }
            if failed {
                continue;
            }
            for at in plan.unsent() {
                published.push(at);
                plan.sent(at);
            }
            if failure.is_some() {
                // The commit failed: rolled back, folded again.
                continue;
            }
            return (folded, published);
        }
    }

    proptest! {
        /// Whatever the poison deliveries and the failures on the way: the committed
        /// transaction folds every other delivery, in order, and each poison delivery is
        /// dead-lettered once, as one transaction per delivery would.
        #[test]
        fn a_batch_folds_what_one_delivery_at_a_time_folds(
            len in 1usize..40,
            poison in proptest::collection::btree_set(0usize..40, 0..8),
            transient in proptest::collection::vec(0usize..45, 0..6),
        ) {
            let poison: BTreeSet<usize> = poison.into_iter().filter(|at| *at < len).collect();
            let (folded, dead) = run(len, &poison, transient);
            let want: Vec<usize> = (0..len).filter(|at| !poison.contains(at)).collect();
            prop_assert_eq!(folded, want);
            prop_assert_eq!(dead, poison.into_iter().collect::<Vec<_>>());
        }
    }
}

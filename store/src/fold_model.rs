//! WIRE.md's consumer rules ("What a consumer must do") as an in-memory state machine, written
//! from the text alone: no database, no I/O. It is the oracle the real fold (`relay_fold`,
//! through [`crate::fold`]) is tested against (`store/tests/rewind_fold.rs`: the same
//! deliveries, the same outcome for each, the same projection), and a fold for consumers that
//! keep their state in memory.
//!
//! Each numbered rule of WIRE.md is one branch of [`FoldModel::deliver`], in the text's order;
//! "catch up" and "hand over" are [`FoldModel::catch_up`].
use std::collections::{BTreeMap, HashMap};

use crate::{BranchId, BranchKey, Error, EventKey, EventKind, FoldOutcome, Lsn, OutboxEvent};

/// What the model keeps of one branch (WIRE.md: "Keep per branch").
#[derive(Clone, Debug)]
struct BranchState {
    applied: Lsn,
    abandoned_at: Option<Lsn>,
    rewound_to: Option<BranchId>,
    started: bool,
    /// Held-back intents by Lsn.
    held: BTreeMap<Lsn, OutboxEvent>,
}

impl BranchState {
    fn new(base: Lsn, started: bool) -> Self {
        Self {
            applied: base,
            abandoned_at: None,
            rewound_to: None,
            started,
            held: BTreeMap::new(),
        }
    }
}

/// The fold of WIRE.md in memory: feed it deliveries in any order, with duplicates; its
/// [`FoldModel::projection`] is what a consumer following the text holds.
#[derive(Clone, Debug, Default)]
pub struct FoldModel {
    branches: HashMap<BranchKey, BranchState>,
    /// What was applied and not undone, in the order it was applied.
    projection: Vec<(EventKey, Vec<u8>)>,
    /// The live branches whose end marker was folded (their runs are complete), in that order.
    ended: Vec<BranchKey>,
}

impl FoldModel {
    /// A consumer that has seen nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The projection: every intent applied and not undone, in the order it was applied.
    pub fn projection(&self) -> &[(EventKey, Vec<u8>)] {
        &self.projection
    }

    /// The runs folded to their end marker, as their live branch, in the order they completed.
    pub fn ended(&self) -> &[BranchKey] {
        &self.ended
    }

    /// How many intents are held back, over every branch.
    pub fn held_back(&self) -> usize {
        self.branches.values().map(|state| state.held.len()).sum()
    }

    /// Folds one delivery. `Err(Error::BrokenChain)` is rule 4 (dead-letter it); nothing
    /// changed then.
    pub fn deliver(&mut self, event: &OutboxEvent) -> Result<FoldOutcome, Error> {
        let key = &event.key.branch;
        // Created on the first message of the branch, intent or marker.
        let state = self
            .branches
            .entry(key.clone())
            .or_insert_with(|| BranchState::new(event.base_lsn, event.parent.is_none()));
        // Rule 1: a marker.
        if let EventKind::Rewind { to } = &event.kind {
            if state.abandoned_at.is_some() {
                return Ok(FoldOutcome::Duplicate);
            }
            let fork = event.prev_lsn;
            self.projection
                .retain(|(applied, _)| !(applied.branch == *key && applied.lsn > fork));
            state.held.retain(|lsn, _| *lsn <= fork);
            state.abandoned_at = Some(fork);
            state.rewound_to = Some(to.clone());
            state.applied = state.applied.min(fork);
            let released = if state.started {
                self.catch_up(key.clone())
            } else {
                0
            };
            return Ok(FoldOutcome::Rewound { released });
        }
        let lsn = event.key.lsn;
        // Rule 2: abandoned.
        if state.abandoned_at.is_some_and(|at| lsn > at) {
            return Ok(FoldOutcome::Abandoned);
        }
        // Rule 3: a redelivery.
        if lsn <= state.applied {
            return Ok(FoldOutcome::Duplicate);
        }
        // Rule 4: a broken chain.
        if event.prev_lsn < state.applied {
            return Err(Error::BrokenChain {
                branch: key.clone(),
                lsn,
                prev: event.prev_lsn,
                applied: state.applied,
            });
        }
        // Rule 5: hold back.
        if !state.started || event.prev_lsn > state.applied {
            state.held.insert(lsn, event.clone());
            return Ok(FoldOutcome::Parked);
        }
        // Rule 6: apply, then catch up. An end marker applies nothing: its run is complete.
        state.applied = lsn;
        if event.is_end() {
            self.ended.push(key.clone());
            return Ok(FoldOutcome::Ended);
        }
        self.projection
            .push((event.key.clone(), event.payload.clone()));
        let released = self.catch_up(key.clone());
        Ok(FoldOutcome::Applied { released })
    }

    /// "Catch up" `branch` (a started branch): applies its held-back successors (an end marker
    /// among them completes the run), then hands over to the branch it was rewound to once it
    /// is applied up to its fork, and so on down a chain of rewinds. Returns how many held-back
    /// intents it applied.
    fn catch_up(&mut self, branch: BranchKey) -> u32 {
        let mut released = 0;
        let mut branch = branch;
        loop {
            let state = self
                .branches
                .get_mut(&branch)
                .expect("a branch caught up has a state");
            while let Some(next) = state
                .held
                .values()
                .find(|held| held.prev_lsn == state.applied)
                .map(|held| held.key.lsn)
            {
                let event = state.held.remove(&next).expect("found just above");
                state.applied = next;
                if event.is_end() {
                    self.ended.push(event.key.branch);
                } else {
                    self.projection.push((event.key, event.payload));
                    released += 1;
                }
            }
            let (Some(fork), Some(to)) = (state.abandoned_at, state.rewound_to.clone()) else {
                return released;
            };
            if state.applied != fork {
                return released;
            }
            // The hand-over: the new branch starts, with or without intents of its own yet.
            let next = BranchKey::new(branch.tenant.clone(), branch.run.clone(), to);
            let child = self
                .branches
                .entry(next.clone())
                .or_insert_with(|| BranchState::new(fork, false));
            if child.started {
                return released;
            }
            child.started = true;
            branch = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::Utc;

    use super::*;
    use crate::{RunId, TenantId};

    fn branch(name: &str) -> BranchKey {
        BranchKey::new(
            TenantId::new("t").unwrap(),
            RunId::new("r").unwrap(),
            BranchId::new(name).unwrap(),
        )
    }

    fn intent(name: &str, lsn: u64, prev: u64, base: u64, parent: Option<&str>) -> OutboxEvent {
        OutboxEvent {
            key: EventKey {
                branch: branch(name),
                lsn: Lsn::new(lsn),
            },
            prev_lsn: Lsn::new(prev),
            base_lsn: Lsn::new(base),
            payload: format!("{name}@{lsn}").into_bytes(),
            created_at: Utc::now(),
            kind: EventKind::Intent,
            parent: parent.map(|parent| BranchId::new(parent).unwrap()),
            meta: Default::default(),
        }
    }

    fn marker(
        name: &str,
        lsn: u64,
        fork: u64,
        base: u64,
        parent: Option<&str>,
        to: &str,
    ) -> OutboxEvent {
        OutboxEvent {
            kind: EventKind::Rewind {
                to: BranchId::new(to).unwrap(),
            },
            payload: Vec::new(),
            ..intent(name, lsn, fork, base, parent)
        }
    }

    fn applied(model: &FoldModel) -> Vec<String> {
        model
            .projection()
            .iter()
            .map(|(key, _)| format!("{}@{}", key.branch.branch, key.lsn))
            .collect()
    }

    /// The fault campaign's case (issue 16, defect 1): a branch rewound at its own base before
    /// any of its intents shipped still hands over, so the branch forked from it is not held
    /// for ever. A consumer that starts a branch only when its first intent applies parks b2.
    #[test]
    fn a_branch_rewound_at_its_base_before_shipping_hands_over_to_the_next() {
        let mut model = FoldModel::new();
        for lsn in 1..=25 {
            model.deliver(&intent("b0", lsn, lsn - 1, 0, None)).unwrap();
        }
        // b0 wrote up to 27 (26, 27 abandoned, never shipped); rewound at 25 to b1.
        let outcome = model.deliver(&marker("b0", 28, 25, 0, None, "b1")).unwrap();
        assert_eq!(outcome, FoldOutcome::Rewound { released: 0 });
        // b1 wrote 26 (never shipped) and was rewound at 25, its base, to b2.
        let outcome = model
            .deliver(&marker("b1", 27, 25, 25, Some("b0"), "b2"))
            .unwrap();
        assert_eq!(outcome, FoldOutcome::Rewound { released: 0 });
        for lsn in 26..=27 {
            let outcome = model
                .deliver(&intent("b2", lsn, lsn - 1, 25, Some("b1")))
                .unwrap();
            assert_eq!(outcome, FoldOutcome::Applied { released: 0 });
        }
        assert_eq!(model.held_back(), 0);
        assert_eq!(applied(&model).last().unwrap(), "b2@27");
        assert_eq!(model.projection().len(), 27);
    }

    /// The same chain delivered backwards: everything waits for b0, then cascades at once
    /// through the branch that never shipped an intent.
    #[test]
    fn a_chain_of_rewinds_at_one_fork_cascades_once_the_root_reaches_it() {
        let mut model = FoldModel::new();
        let later = [
            intent("b2", 3, 2, 2, Some("b1")),
            marker("b1", 3, 2, 2, Some("b0"), "b2"),
            marker("b0", 4, 2, 0, None, "b1"),
            intent("b0", 2, 1, 0, None),
        ];
        for event in &later {
            assert_ne!(model.deliver(event).unwrap(), FoldOutcome::Duplicate);
        }
        assert!(applied(&model).is_empty(), "nothing before b0@1");
        let outcome = model.deliver(&intent("b0", 1, 0, 0, None)).unwrap();
        assert_eq!(outcome, FoldOutcome::Applied { released: 2 });
        assert_eq!(applied(&model), ["b0@1", "b0@2", "b2@3"]);
    }

    /// A marker undoes what was applied above its fork; late abandoned intents never apply.
    #[test]
    fn a_marker_undoes_above_its_fork_and_ignores_late_abandoned_intents() {
        let mut model = FoldModel::new();
        for lsn in 1..=3 {
            model.deliver(&intent("a", lsn, lsn - 1, 0, None)).unwrap();
        }
        model.deliver(&marker("a", 5, 1, 0, None, "b")).unwrap();
        assert_eq!(
            model.deliver(&intent("a", 4, 3, 0, None)).unwrap(),
            FoldOutcome::Abandoned
        );
        assert_eq!(
            model.deliver(&intent("b", 2, 1, 1, Some("a"))).unwrap(),
            FoldOutcome::Applied { released: 0 }
        );
        assert_eq!(applied(&model), ["a@1", "b@2"]);
        assert!(matches!(
            model.deliver(&intent("b", 4, 1, 1, Some("a"))),
            Err(Error::BrokenChain { .. })
        ));
    }
}

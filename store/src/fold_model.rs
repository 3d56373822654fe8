//! WIRE.md's consumer rules ("What a consumer must do", with "Epochs") as an in-memory state
//! machine, written from the text alone: no database, no I/O. It is the oracle the real fold
//! (`relay_fold`, through [`crate::fold::fold`]) is tested against (`store/tests/rewind_fold.rs`: the
//! same deliveries, the same outcome for each, the same projection), and a fold for consumers
//! that keep their state in memory.
//!
//! Each numbered rule of WIRE.md is one branch of [`FoldModel::deliver`], in the text's order;
//! "catch up" and "hand over" are [`FoldModel::catch_up`]; adopting is [`FoldModel::adopt`] and
//! the steps a to c in `deliver`. A delivery is all or nothing, as in a transaction: one that
//! is refused changes nothing.
use std::collections::{BTreeMap, HashMap};

use crate::error::Error;
use crate::fold::FoldOutcome;
use crate::key::{BranchId, BranchKey, EventKey, Lsn};
use crate::outbox::{Epoch, EventKind, OutboxEvent};

/// What the model keeps of one branch (WIRE.md: "Keep per branch").
#[derive(Clone, Debug)]
struct BranchState {
    /// Where the branch starts, as its first message (or its parent's hand-over) said.
    base: Lsn,
    applied: Lsn,
    abandoned_at: Option<Lsn>,
    rewound_to: Option<BranchId>,
    started: bool,
    /// `(epoch, from)`: what was applied from `from` on was written in `epoch`; ascending.
    epochs: Vec<(Epoch, Lsn)>,
    marker_epoch: Option<Epoch>,
    /// Armed by an operator: the next diverged message that begins its epoch is adopted.
    adopt: bool,
}

impl BranchState {
    fn new(base: Lsn, started: bool) -> Self {
        Self {
            base,
            applied: base,
            abandoned_at: None,
            rewound_to: None,
            started,
            epochs: Vec::new(),
            marker_epoch: None,
            adopt: false,
        }
    }

    /// `E(lsn)`: the epoch of the last pair beginning at or below `lsn`; below every pair, the
    /// first pair's; none without pairs.
    fn epoch_at(&self, lsn: Lsn) -> Option<Epoch> {
        self.epochs
            .iter()
            .rev()
            .find(|(_, from)| *from <= lsn)
            .or(self.epochs.first())
            .map(|(epoch, _)| *epoch)
    }

    /// Applied `lsn`, written in `epoch`: a new pair if it is above the last one's epoch.
    fn applied_at(&mut self, lsn: Lsn, epoch: Option<Epoch>) {
        self.applied = lsn;
        if let Some(epoch) = epoch
            && self.epochs.last().is_none_or(|(last, _)| epoch > *last)
        {
            self.epochs.push((epoch, lsn));
        }
    }
}

/// The outcome of an adopted delivery.
fn adopted(undone: u32, outcome: FoldOutcome) -> FoldOutcome {
    match outcome {
        FoldOutcome::Applied { released } | FoldOutcome::Rewound { released } => {
            FoldOutcome::Adopted { undone, released }
        }
        _ => FoldOutcome::Adopted {
            undone,
            released: 0,
        },
    }
}

/// Both known and `a > b`.
fn above(a: Option<Epoch>, b: Option<Epoch>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a > b)
}

/// Both known and different.
fn differ(a: Option<Epoch>, b: Option<Epoch>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a != b)
}

/// The fold of WIRE.md in memory: feed it deliveries in any order, with duplicates; its
/// [`FoldModel::projection`] is what a consumer following the text holds.
#[derive(Clone, Debug, Default)]
pub struct FoldModel {
    branches: HashMap<BranchKey, BranchState>,
    /// Held-back intents (and end markers) per branch, by Lsn: kept apart from the branches'
    /// state, as `relay_fold_parked` is (a branch forgotten by an adopt keeps what it holds of
    /// the database's history, for the branch of that name to come).
    held: HashMap<BranchKey, BTreeMap<Lsn, OutboxEvent>>,
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
        self.held.values().map(BTreeMap::len).sum()
    }

    /// Arms `branch` (the operator's step after a divergence): its next diverged message that
    /// begins its epoch is adopted. False if the branch has no state.
    pub fn adopt(&mut self, branch: &BranchKey) -> bool {
        match self.branches.get_mut(branch) {
            Some(state) => {
                state.adopt = true;
                true
            }
            None => false,
        }
    }

    /// Folds one delivery. `Err(Error::BrokenChain)` is rule 4 and `Err(Error::Diverged)` a
    /// divergence (dead-letter either); nothing changed then.
    pub fn deliver(&mut self, event: &OutboxEvent) -> Result<FoldOutcome, Error> {
        let mut next = self.clone();
        let outcome = next.fold(event)?;
        *self = next;
        Ok(outcome)
    }

    fn fold(&mut self, event: &OutboxEvent) -> Result<FoldOutcome, Error> {
        let key = &event.key.branch;
        let lsn = event.key.lsn;
        let (epoch, prev_epoch) = (event.epochs.epoch, event.epochs.prev);
        let diverged = |reason: &str| Error::Diverged {
            branch: key.clone(),
            lsn,
            reason: reason.to_owned(),
        };
        // Created on the first message of the branch, intent or marker.
        let state = self
            .branches
            .entry(key.clone())
            .or_insert_with(|| BranchState::new(event.base_lsn, event.parent.is_none()));
        // Rule 0: superseded (for a branch forked again elsewhere under its name: anything newer
        // was folded on it).
        let forked_again = epoch.is_some() && state.base != event.base_lsn;
        if forked_again {
            let newest = state
                .epochs
                .last()
                .map(|(epoch, _)| *epoch)
                .max(state.marker_epoch);
            if above(newest, epoch) {
                return Ok(FoldOutcome::Superseded);
            }
        } else if above(state.epoch_at(lsn), epoch)
            || (event.is_rewind() && above(state.marker_epoch, epoch))
        {
            return Ok(FoldOutcome::Superseded);
        }
        let diverges = if forked_again {
            true
        } else if event.is_rewind() {
            state.abandoned_at.is_some() && above(epoch, state.marker_epoch)
        } else if state.abandoned_at.is_some_and(|at| lsn > at) {
            above(epoch, state.marker_epoch)
        } else if lsn <= state.applied {
            above(epoch, state.epoch_at(lsn))
        } else if event.prev_lsn < state.applied {
            above(epoch, state.epoch_at(state.applied))
        } else if event.prev_lsn == state.applied && state.started {
            differ(prev_epoch, state.epoch_at(state.applied))
        } else {
            false
        };
        let mut undone = None;
        if diverges {
            let begins_epoch = event.is_rewind()
                || prev_epoch.is_none()
                || matches!((prev_epoch, epoch), (Some(prev), Some(epoch)) if prev < epoch);
            if !(state.adopt && begins_epoch) {
                return Err(diverged(
                    "what the fold applied is not the database's history",
                ));
            }
            if forked_again {
                // Adopted: the branch it knew is forgotten (as one a lost rewind led to), and
                // this is the first message of its branch.
                let base = state.base;
                let undone = self.forget_chain(key, Some((key.branch.clone(), base)), epoch, true);
                self.branches
                    .entry(key.clone())
                    .or_insert_with(|| BranchState::new(event.base_lsn, event.parent.is_none()));
                let outcome = self.rules(event)?;
                return Ok(adopted(undone, outcome));
            }
            // Adopted. b: the point to keep.
            let keep = event.prev_lsn;
            if keep > state.applied {
                return Err(diverged(
                    "cannot be adopted: the fold keeps less of the branch",
                ));
            }
            if !event.is_rewind() && differ(prev_epoch, state.epoch_at(keep)) {
                return Err(diverged(
                    "cannot be adopted: the history differs below it too",
                ));
            }
            undone = Some(self.forget_lost_history(key, keep, epoch));
        }
        let outcome = self.rules(event)?;
        Ok(match undone {
            None => outcome,
            Some(undone) => adopted(undone, outcome),
        })
    }

    /// Adopting, step a: `first` and each branch rewound from it in turn are undone above their
    /// base and forgotten, with what they hold of epochs below `epoch`; a branch that applied
    /// only history of `epoch` or later stays (and the ones after it), but `first` goes if
    /// `force_first`; one whose rewind marker is of `epoch` or later is undone above its base
    /// but keeps that rewind (and the ones after it stay). Returns how many had history undone.
    fn forget_chain(
        &mut self,
        branch: &BranchKey,
        first: Option<(BranchId, Lsn)>,
        epoch: Option<Epoch>,
        force_first: bool,
    ) -> u32 {
        let mut undone = 0;
        let mut child = first;
        let mut force = force_first;
        while let Some((name, base)) = child {
            let lost = BranchKey::new(branch.tenant.clone(), branch.run.clone(), name);
            let new = |state: &BranchState| matches!((state.epochs.first(), epoch), (Some((first, _)), Some(epoch)) if *first >= epoch);
            match self.branches.get(&lost) {
                None => break,
                Some(state) if !force && new(state) => break,
                Some(_) => {}
            }
            force = false;
            let gone = self.branches.remove(&lost).expect("checked just above");
            if let Some(held) = self.held.get_mut(&lost) {
                held.retain(|_, held| !above(epoch, held.epochs.epoch));
            }
            if gone.applied > base {
                undone += 1;
                self.projection
                    .retain(|(applied, _)| !(applied.branch == lost && applied.lsn > base));
            }
            if !above(epoch, gone.marker_epoch) && gone.marker_epoch.is_some() && epoch.is_some() {
                // Rewound in the database's history: the branch of that name begins anew
                // from its base, rewound as it was.
                let mut kept = BranchState::new(base, false);
                kept.abandoned_at = gone.abandoned_at;
                kept.rewound_to = gone.rewound_to;
                kept.marker_epoch = gone.marker_epoch;
                self.branches.insert(lost, kept);
                break;
            }
            child = gone.rewound_to.zip(gone.abandoned_at);
        }
        undone
    }

    /// Adopting, steps a and c: forgets the rewind of `branch` (every branch it led to is
    /// undone and forgotten) and keeps `branch` up to `keep` (what it holds back above it of an
    /// epoch below `epoch` goes too). Returns how many branches had history undone.
    fn forget_lost_history(&mut self, branch: &BranchKey, keep: Lsn, epoch: Option<Epoch>) -> u32 {
        let state = self
            .branches
            .get_mut(branch)
            .expect("a diverged branch has a state");
        let mut child = None;
        if above(epoch, state.marker_epoch) {
            child = state.rewound_to.take().zip(state.abandoned_at.take());
            state.marker_epoch = None;
        }
        let mut undone = self.forget_chain(branch, child, epoch, false);
        let state = self
            .branches
            .get_mut(branch)
            .expect("a diverged branch has a state");
        if state.applied > keep {
            undone += 1;
            self.projection
                .retain(|(applied, _)| !(applied.branch == *branch && applied.lsn > keep));
        }
        state.applied = state.applied.min(keep);
        if let Some(held) = self.held.get_mut(branch) {
            held.retain(|lsn, held| *lsn <= keep || !above(epoch, held.epochs.epoch));
        }
        state.epochs.retain(|(_, from)| *from <= keep);
        state.adopt = false;
        undone
    }

    /// Rules 1 to 6 (rule 0 and divergences are checked before).
    fn rules(&mut self, event: &OutboxEvent) -> Result<FoldOutcome, Error> {
        let key = &event.key.branch;
        let lsn = event.key.lsn;
        let epoch = event.epochs.epoch;
        let state = self.branches.get_mut(key).expect("created above");
        // Rule 1: a marker.
        if let EventKind::Rewind { to } = &event.kind {
            if state.abandoned_at.is_some() {
                return Ok(FoldOutcome::Duplicate);
            }
            let fork = event.prev_lsn;
            if let Some(held) = self.held.get_mut(key) {
                held.retain(|lsn, _| *lsn <= fork);
            }
            state.abandoned_at = Some(fork);
            state.rewound_to = Some(to.clone());
            state.marker_epoch = epoch;
            state.applied = state.applied.min(fork);
            let started = state.started;
            self.projection
                .retain(|(applied, _)| !(applied.branch == *key && applied.lsn > fork));
            let released = if started {
                self.catch_up(key.clone())?
            } else {
                0
            };
            return Ok(FoldOutcome::Rewound { released });
        }
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
        // Rule 5: hold back; of two held at one place, the lower epoch's is superseded.
        if !state.started || event.prev_lsn > state.applied {
            let same_place =
                |held: &OutboxEvent| held.key.lsn == lsn || held.prev_lsn == event.prev_lsn;
            let held = self.held.entry(key.clone()).or_default();
            if held
                .values()
                .any(|held| same_place(held) && above(held.epochs.epoch, epoch))
            {
                return Ok(FoldOutcome::Superseded);
            }
            held.retain(|_, held| !(same_place(held) && above(epoch, held.epochs.epoch)));
            if !held.values().any(same_place) {
                held.insert(lsn, event.clone());
            }
            return Ok(FoldOutcome::Parked);
        }
        // Rule 6: apply, then catch up. An end marker applies nothing: its run is complete.
        state.applied_at(lsn, epoch);
        if event.is_end() {
            self.ended.push(key.clone());
            self.catch_up(key.clone())?;
            return Ok(FoldOutcome::Ended);
        }
        self.projection
            .push((event.key.clone(), event.payload.clone()));
        let released = self.catch_up(key.clone())?;
        Ok(FoldOutcome::Applied { released })
    }

    /// "Catch up" `branch` (a started branch): applies its held-back successors (an end marker
    /// among them completes the run), then hands over to the branch it was rewound to once it
    /// is applied up to its fork, and so on down a chain of rewinds. Returns how many held-back
    /// intents it applied; a successor whose `prev_epoch` differs from what was applied before
    /// it makes the delivery diverge.
    fn catch_up(&mut self, branch: BranchKey) -> Result<u32, Error> {
        let mut released = 0;
        let mut branch = branch;
        loop {
            let state = self
                .branches
                .get_mut(&branch)
                .expect("a branch caught up has a state");
            let held = self.held.entry(branch.clone()).or_default();
            while let Some(next) = held.values().find(|held| held.prev_lsn == state.applied) {
                if differ(next.epochs.prev, state.epoch_at(state.applied)) {
                    return Err(Error::Diverged {
                        branch: next.key.branch.clone(),
                        lsn: next.key.lsn,
                        reason: "a held-back successor names another predecessor".into(),
                    });
                }
                let next = next.key.lsn;
                let event = held.remove(&next).expect("found just above");
                state.applied_at(next, event.epochs.epoch);
                if event.is_end() {
                    self.ended.push(event.key.branch);
                } else {
                    self.projection.push((event.key, event.payload));
                    released += 1;
                }
            }
            let (Some(fork), Some(to)) = (state.abandoned_at, state.rewound_to.clone()) else {
                return Ok(released);
            };
            if state.applied != fork {
                return Ok(released);
            }
            // The hand-over: the new branch starts, with or without intents of its own yet.
            let next = BranchKey::new(branch.tenant.clone(), branch.run.clone(), to);
            let child = self
                .branches
                .entry(next.clone())
                .or_insert_with(|| BranchState::new(fork, false));
            if child.started {
                return Ok(released);
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
    use crate::key::{RunId, TenantId};

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
            epochs: Default::default(),
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

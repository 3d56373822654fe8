//! A drainer's in-flight window as a pure state machine: which batches are out, what the
//! broker said about each event, what may be acked, which branches cool down or park, and
//! whether the tenant may start a batch, must back off, or may stop, and when the drainer must
//! wake up next (one timer table: the tenant's retry, cooling branches' retries, the idle
//! check). No I/O and no clock of its own (callers pass `now`): the drainer actor carries
//! messages to it, keeps one timer at [`Window::poll_timeout`], and does the SQL.
//!
//! Invariants (unit- and property-tested below):
//! - A key is acked only if the broker accepted it and no earlier event of its branch in the
//!   window failed (the prefix rule, across every batch of the window).
//! - Batches settle strictly in the order they were opened.
//! - A branch the broker refused (returned, nacked) cools down alone: the tenant's other
//!   branches keep flowing. After `park_after_attempts` refusals in a row it is parked.
//! - An unanswered event (the session failed) stops new batches until the window is empty;
//!   then the whole tenant backs off.
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use broker::Outcome;
use chrono::{DateTime, Utc};
use store::{BranchKey, EventKey, Lsn};

use broker::{Backoff, RetryPolicy};

use crate::shard::{Lane, ShardId};
use crate::timers::Timers;

mod refusal;
mod settle;
mod stall;
use refusal::Cooling;
pub(crate) use refusal::{Refusal, RefusalAction};
pub(crate) use settle::Next;
#[cfg(test)]
use settle::Settlement;
use stall::Stall;
pub(crate) use stall::{StallCause, StallNotice};

/// What the window's timers are set for (one deadline each, [`Timers`]): the drainer keeps one
/// timer, at the earliest.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    /// The tenant's retry after a window that failed ([`Next::Retry`]).
    Retry,
    /// A cooling branch's retry ([`RefusalAction::RetryAfter`]): drain again.
    Drain(BranchKey),
    /// Retire if nothing happened since this activity number.
    IdleCheck(u64),
}

/// What the timers due at some instant ask of the drainer (retiring wins over draining).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Woken {
    /// Nothing is due.
    Nothing,
    /// Drain (a retry is due).
    Drain,
    /// Stop: idle since the check was set.
    Retire,
}

/// Where a part of a batch went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dispatch {
    /// To its shard's publisher, which will answer.
    Sent,
    /// Nowhere: no live publisher (it is being restarted); settled as not sent.
    NotSent,
}

/// Number of a batch within one drainer's life.
pub(crate) type BatchId = u64;

/// What a drainer is doing, as far as starting batches goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Batches start whenever the window has room.
    Flowing,
    /// An event went unanswered: no new batch; once the window is empty the tenant backs off.
    Failed,
    /// The tenant's retry is scheduled: no new batch until it is due ([`Window::handle_timeout`]).
    BackingOff,
    /// Graceful shutdown: no new batch; stop once the window is empty.
    Finishing,
}

/// Bounds of a window.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WindowConfig {
    /// Batches in flight at once (at least 1).
    pub(crate) max_batches: usize,
    /// Refusals in a row after which a branch is parked (at least 1).
    pub(crate) park_after_attempts: u32,
    /// A branch the broker nacks is parked only once its refusals have lasted this long too.
    pub(crate) nack_grace: Duration,
    /// Delays of the tenant's retry and of each cooling branch's.
    pub(crate) retry: RetryPolicy,
    /// Batches of at most this many events (and [`EXPRESS_MAX_BYTES`]) take the express lane
    /// when nothing of the tenant is in flight; 0: no express lane.
    pub(crate) express_max_events: u32,
}

/// Most payload bytes of a batch on the express lane.
pub(crate) const EXPRESS_MAX_BYTES: usize = 256 * 1024;

/// A drain after one that did not fill its reservation reserves this many events...
pub(crate) const SMALL_RESERVATION_EVENTS: u32 = 32;
/// ...and this many payload bytes (the writer's default largest payload).
pub(crate) const SMALL_RESERVATION_BYTES: u32 = 256 * 1024;

/// A batch in flight. Only keys are kept: payloads travel to the publishers. `H` is what the
/// batch holds until it settles (the drainer's budget permits).
struct Batch<H> {
    id: BatchId,
    keys: Vec<EventKey>,
    written: Vec<DateTime<Utc>>,
    outcomes: Vec<Option<Outcome>>,
    /// Parts sent to a publisher and not answered yet: shard -> indexes in `keys`. Every part
    /// sent is answered (a publisher that dies drops the batch's reply, which answers it with
    /// every event unconfirmed), so nothing here waits on a timer.
    pending: HashMap<ShardId, Vec<usize>>,
    lane: Lane,
    _held: H,
}

/// The in-flight window of one drainer.
pub(crate) struct Window<H> {
    config: WindowConfig,
    batches: VecDeque<Batch<H>>,
    /// Branches with a failure in the current window: nothing later of theirs is acked.
    blocked: HashSet<BranchKey>,
    cooling: HashMap<BranchKey, Cooling>,
    phase: Phase,
    next_batch: BatchId,
    backoff: Backoff,
    /// Counts batches opened; an idle check compares it.
    activity: u64,
    /// The last drain filled its reservation: the tenant has a backlog.
    backlogged: bool,
    /// When the drainer must wake up, and why.
    timers: Timers<Due>,
    /// The tenant's batches have gone unanswered since then.
    stalled: Option<Stall>,
}

impl<H> std::fmt::Debug for Window<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("phase", &self.phase)
            .field("batches", &self.batches.len())
            .field("blocked", &self.blocked.len())
            .field("cooling", &self.cooling.len())
            .finish()
    }
}

impl<H> Window<H> {
    pub(crate) fn new(config: WindowConfig) -> Self {
        Self {
            backoff: Backoff::new(config.retry),
            config,
            batches: VecDeque::new(),
            blocked: HashSet::new(),
            cooling: HashMap::new(),
            phase: Phase::Flowing,
            next_batch: 0,
            activity: 0,
            backlogged: false,
            timers: Timers::default(),
            stalled: None,
        }
    }

    /// When [`Window::handle_timeout`] is next due: the drainer keeps one timer, at this.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    /// Fires every timer due at `now` and says what the drainer must do.
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> Woken {
        let (mut drain, mut retire) = (false, false);
        while let Some(due) = self.timers.pop_due(now) {
            match due {
                Due::Retry => {
                    self.retry_due();
                    drain = true;
                }
                Due::Drain(_) => drain = true,
                Due::IdleCheck(activity) => retire |= self.idle_since(activity),
            }
        }
        match (retire, drain) {
            (true, _) => Woken::Retire,
            (false, true) => Woken::Drain,
            (false, false) => Woken::Nothing,
        }
    }

    /// The last drain found nothing and nothing is in flight: retire at `now + after` unless
    /// something happens meanwhile. A check already set for this same idle spell keeps its
    /// earlier deadline; one set for an older spell could not retire the drainer and goes.
    pub(crate) fn idle(&mut self, now: Instant, after: Duration) {
        let activity = self.activity;
        let mut same_spell = false;
        self.timers.retain(|due| match due {
            Due::IdleCheck(checks) if *checks == activity => {
                same_spell = true;
                true
            }
            Due::IdleCheck(_) => false,
            Due::Retry | Due::Drain(_) => true,
        });
        if !same_spell {
            self.timers.set(Due::IdleCheck(activity), now + after);
        }
    }

    /// Timers set, for tests.
    #[cfg(test)]
    fn timers(&self) -> usize {
        self.timers.iter().count()
    }

    #[cfg(test)]
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    /// How many events and payload bytes of the relay-wide budgets the next drain reserves
    /// (and so at most takes): a full batch (`batch_events`, `batch_bytes`) while the tenant
    /// has a backlog, else a small one, so that thousands of tenants with a few intents each
    /// drain side by side instead of a full batch's reservation each, a few at a time.
    pub(crate) fn reservation(&self, batch_events: u32, batch_bytes: u32) -> (u32, u32) {
        if self.backlogged {
            (batch_events, batch_bytes)
        } else {
            (
                batch_events.min(SMALL_RESERVATION_EVENTS),
                batch_bytes.min(SMALL_RESERVATION_BYTES),
            )
        }
    }

    /// A drain reserved `reserved_events` and `reserved_bytes` and got `events` events of
    /// `bytes` bytes: if it filled either, the tenant has a backlog.
    pub(crate) fn drained(
        &mut self,
        events: usize,
        reserved_events: usize,
        bytes: usize,
        reserved_bytes: usize,
    ) {
        self.backlogged = events >= reserved_events || bytes >= reserved_bytes;
    }

    /// Whether nothing is in flight.
    pub(crate) fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Whether a new batch may start now.
    pub(crate) fn may_start(&self) -> bool {
        self.phase == Phase::Flowing && self.batches.len() < self.config.max_batches.max(1)
    }

    /// Whether graceful shutdown may stop the drainer now.
    pub(crate) fn finished(&self) -> bool {
        self.phase == Phase::Finishing && self.batches.is_empty()
    }

    /// Graceful shutdown: no new batch from now on.
    pub(crate) fn finish(&mut self) {
        self.phase = Phase::Finishing;
    }

    /// The broker is back (a publisher of this relay had a publish confirmed after failing):
    /// a tenant backing off after a failed batch drains now, with its backoff started over,
    /// instead of at a retry drawn while the broker was down (up to the policy's longest).
    /// True when the drainer should drain now. Cooling branches keep their own retries: the
    /// broker refused them, it was not away.
    pub(crate) fn resume(&mut self) -> bool {
        if self.phase != Phase::BackingOff {
            return false;
        }
        self.timers.stop(&Due::Retry);
        self.backoff.reset();
        self.phase = Phase::Flowing;
        true
    }

    /// The tenant's scheduled retry is due.
    fn retry_due(&mut self) {
        if self.phase == Phase::BackingOff {
            self.phase = Phase::Flowing;
        }
    }

    /// The current activity count: [`Window::idle_since`] with it is true only if no batch
    /// opened meanwhile.
    pub(crate) fn activity(&self) -> u64 {
        self.activity
    }

    /// Whether the drainer may retire: nothing opened since `activity`, nothing in flight, no
    /// retry pending.
    pub(crate) fn idle_since(&self, activity: u64) -> bool {
        activity == self.activity && self.batches.is_empty() && self.phase == Phase::Flowing
    }

    /// Where the next drain starts: after the newest in-flight event of each branch, and past
    /// every cooling branch whose retry is not due (given as its branch at the largest Lsn).
    pub(crate) fn skip(&self, now: Instant) -> Vec<EventKey> {
        let mut newest: HashMap<&BranchKey, &EventKey> = HashMap::new();
        for key in self.batches.iter().flat_map(|batch| &batch.keys) {
            newest.insert(&key.branch, key);
        }
        let mut skip: Vec<EventKey> = newest.into_values().cloned().collect();
        skip.extend(
            self.cooling
                .iter()
                .filter(|(_, cooling)| cooling.retry_at > now)
                .map(|(branch, _)| EventKey {
                    branch: branch.clone(),
                    lsn: Lsn::new(i64::MAX as u64),
                }),
        );
        skip
    }

    /// The lane of the next batch: the lane of the batches in flight, if any (so a branch
    /// never has batches on two channels at once, whose writes could overtake each other);
    /// else express for a small batch, bulk otherwise.
    pub(crate) fn lane_for(&self, events: usize, bytes: usize) -> Lane {
        if let Some(in_flight) = self.batches.front() {
            return in_flight.lane;
        }
        let small = events <= self.config.express_max_events as usize && bytes <= EXPRESS_MAX_BYTES;
        if small { Lane::Express } else { Lane::Bulk }
    }

    /// The id the next [`Window::open`] returns.
    pub(crate) fn next_id(&self) -> BatchId {
        self.next_batch
    }

    /// Opens a batch of `keys` (drain order), holding `held` until it settles. Its parts are
    /// then given with [`Window::dispatched`]; a part never dispatched is never settled, so
    /// every index must be dispatched.
    pub(crate) fn open(
        &mut self,
        keys: Vec<EventKey>,
        written: Vec<DateTime<Utc>>,
        lane: Lane,
        held: H,
    ) -> BatchId {
        debug_assert_eq!(keys.len(), written.len());
        self.activity += 1;
        let id = self.next_batch;
        self.next_batch += 1;
        self.batches.push_back(Batch {
            id,
            outcomes: vec![None; keys.len()],
            keys,
            written,
            pending: HashMap::new(),
            lane,
            _held: held,
        });
        id
    }

    /// The events at `indexes` of batch `batch` went to the shard's publisher, or could not be
    /// sent (no live publisher): then they are settled as not sent.
    pub(crate) fn dispatched(
        &mut self,
        batch: BatchId,
        shard: ShardId,
        dispatch: Dispatch,
        indexes: Vec<usize>,
    ) {
        let Some(batch) = self.batches.iter_mut().find(|b| b.id == batch) else {
            return;
        };
        match dispatch {
            Dispatch::Sent => {
                batch.pending.insert(shard, indexes);
            }
            Dispatch::NotSent => {
                for index in indexes {
                    batch.outcomes[index] = Some(Outcome::NotSent);
                }
            }
        }
    }

    /// Whether batch `batch` waits on no publisher (every part answered or never sent).
    pub(crate) fn is_answered(&self, batch: BatchId) -> bool {
        self.batches
            .iter()
            .find(|b| b.id == batch)
            .is_none_or(|b| b.pending.is_empty())
    }

    /// A publisher's outcomes for the part of `batch` it was given (one per event, in order;
    /// missing ones count as unconfirmed: an empty answer is a publisher that died with the
    /// part). Unknown batches and shards, and a second answer for a part, are ignored.
    pub(crate) fn confirmed(&mut self, batch: BatchId, shard: ShardId, outcomes: Vec<Outcome>) {
        let Some(batch) = self.batches.iter_mut().find(|b| b.id == batch) else {
            return;
        };
        let Some(indexes) = batch.pending.remove(&shard) else {
            return;
        };
        for (position, index) in indexes.into_iter().enumerate() {
            let outcome = outcomes
                .get(position)
                .copied()
                .unwrap_or(Outcome::Unconfirmed);
            batch.outcomes[index] = Some(outcome);
        }
    }
}

#[cfg(test)]
mod tests;

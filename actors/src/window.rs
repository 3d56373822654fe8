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
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use broker::Outcome;
use chrono::{DateTime, Utc};
use store::{BranchKey, EventKey, Lsn};

use crate::{Backoff, Lane, RetryPolicy, ShardId};

/// What the drainer's one timer is set for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    /// The tenant's retry after a window that failed ([`Next::Retry`]).
    Retry,
    /// A cooling branch's retry ([`RefusalAction::RetryAfter`]): drain again.
    Drain,
    /// Retire if nothing happened since this activity number.
    IdleCheck(u64),
}

/// What the timers due at some instant ask of the drainer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Woken {
    /// Drain (a retry is due).
    pub(crate) drain: bool,
    /// Stop: idle since the check was set.
    pub(crate) retire: bool,
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

/// A branch the broker refused events of, retried alone with its own backoff.
#[derive(Debug)]
struct Cooling {
    attempts: u32,
    first_failed: Instant,
    retry_at: Instant,
    backoff: Backoff,
}

/// What to do about a branch the broker refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RefusalAction {
    /// Drain it again after this delay (it is skipped until then).
    RetryAfter(Duration),
    /// Park it in PostgreSQL: it has been refused `attempts` times over `failing_for`.
    Park {
        /// Time since its first refusal in this run of refusals.
        failing_for: Duration,
    },
}

/// A branch the broker refused in the batches just settled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) branch: BranchKey,
    pub(crate) reason: &'static str,
    /// Refusals in a row, this one included.
    pub(crate) attempts: u32,
    pub(crate) action: RefusalAction,
}

/// What the drainer does after acking a settlement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Carry on: drain the next batch (in the same round trip as the ack) if
    /// [`Window::may_start`] says so, else only ack.
    Flow,
    /// Only ack: earlier failures wait for the rest of the window to settle.
    Wait,
    /// Ack, then retry the tenant after this delay.
    Retry(Duration),
    /// Ack, then stop: graceful shutdown has nothing left in flight.
    Stop,
}

/// How long a tenant's batches may go unanswered (its publisher down, or the broker away)
/// before the drainer says which tenant waits and why: short outages pass in silence, since
/// the publishers' own warnings say the broker is away.
pub(crate) const STALL_NOTICE_AFTER: Duration = Duration::from_secs(5);

/// Why a tenant's batches went unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StallCause {
    /// Sent, and the session failed before the broker confirmed them.
    Unconfirmed,
    /// Never sent: its shard's publisher was down or its session had failed.
    NotSent,
}

impl StallCause {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StallCause::Unconfirmed => "the broker did not confirm its batch",
            StallCause::NotSent => "its shard's publisher was down",
        }
    }
}

/// A streak of failed sessions of one tenant, and whether the drainer has said so.
#[derive(Clone, Copy, Debug)]
struct Stall {
    since: Instant,
    failures: u32,
    cause: StallCause,
    told: bool,
}

/// What the drainer logs about a tenant's stall ([`Settlement::stall`]): once when it has
/// lasted [`STALL_NOTICE_AFTER`], once when the tenant ships again after that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StallNotice {
    /// The tenant's batches have gone unanswered for `waited`.
    Waiting {
        waited: Duration,
        failures: u32,
        cause: StallCause,
    },
    /// The tenant ships again after a stall it was told of.
    Shipping { waited: Duration, failures: u32 },
}

/// The outcome of settling the complete batches at the front of the window.
#[derive(Debug)]
pub(crate) struct Settlement {
    /// Keys to delete from the outbox (every one accepted, each a prefix of its branch).
    pub(crate) acks: Vec<EventKey>,
    /// When the host wrote each acked event (parallel to `acks`).
    pub(crate) acked_written: Vec<DateTime<Utc>>,
    /// Events settled but not acked (to be drained again).
    pub(crate) failed: usize,
    /// Branches refused by the broker, each with its next step (at most one per branch).
    pub(crate) refusals: Vec<Refusal>,
    pub(crate) next: Next,
    /// A stall to log, if this settlement begins or ends one worth telling.
    pub(crate) stall: Option<StallNotice>,
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
    timers: BTreeSet<(Instant, Due)>,
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
            timers: BTreeSet::new(),
            stalled: None,
        }
    }

    /// When [`Window::handle_timeout`] is next due: the drainer keeps one timer, at this.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.timers.first().map(|(at, _)| *at)
    }

    /// Fires every timer due at `now` and says what the drainer must do.
    pub(crate) fn handle_timeout(&mut self, now: Instant) -> Woken {
        let mut woken = Woken::default();
        while let Some(&(at, due)) = self.timers.first()
            && at <= now
        {
            self.timers.pop_first();
            match due {
                Due::Retry => {
                    self.retry_due();
                    woken.drain = true;
                }
                Due::Drain => woken.drain = true,
                Due::IdleCheck(activity) => woken.retire |= self.idle_since(activity),
            }
        }
        if woken.retire {
            woken.drain = false;
        }
        woken
    }

    /// The last drain found nothing and nothing is in flight: retire at `now + after` unless
    /// something happens meanwhile. A check already set for this same idle spell keeps its
    /// earlier deadline; one set for an older spell could not retire the drainer and goes.
    pub(crate) fn idle(&mut self, now: Instant, after: Duration) {
        let activity = self.activity;
        let mut same_spell = false;
        self.timers.retain(|(_, due)| match due {
            Due::IdleCheck(checks) if *checks == activity => {
                same_spell = true;
                true
            }
            Due::IdleCheck(_) => false,
            Due::Retry | Due::Drain => true,
        });
        if !same_spell {
            self.timers.insert((now + after, Due::IdleCheck(activity)));
        }
    }

    /// Timers set, for tests.
    #[cfg(test)]
    fn timers(&self) -> usize {
        self.timers.len()
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
        self.timers.retain(|(_, due)| *due != Due::Retry);
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

    /// The events at `indexes` of batch `batch` went to the shard's publisher (`sent`), or
    /// could not be sent (no live publisher): they are settled as not sent.
    pub(crate) fn dispatched(
        &mut self,
        batch: BatchId,
        shard: ShardId,
        sent: bool,
        indexes: Vec<usize>,
    ) {
        let Some(batch) = self.batches.iter_mut().find(|b| b.id == batch) else {
            return;
        };
        if sent {
            batch.pending.insert(shard, indexes);
        } else {
            for index in indexes {
                batch.outcomes[index] = Some(Outcome::NotSent);
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

    /// Settles the complete batches at the front of the window, in the order they opened, and
    /// says what to ack and what comes next. `None` if the front batch is still unanswered.
    pub(crate) fn settle(&mut self, now: Instant) -> Option<Settlement> {
        let mut acks = Vec::new();
        let mut acked_written = Vec::new();
        let mut failed = 0;
        let mut settled = 0;
        let mut session_failed = None;
        let mut refused: Vec<(BranchKey, &'static str)> = Vec::new();
        while self
            .batches
            .front()
            .is_some_and(|batch| batch.pending.is_empty())
        {
            let batch = self.batches.pop_front().expect("front batch exists");
            settled += 1;
            let events = batch
                .keys
                .into_iter()
                .zip(batch.written)
                .zip(batch.outcomes);
            for ((key, written), outcome) in events {
                let blocked = self.blocked.contains(&key.branch);
                if outcome == Some(Outcome::Accepted) && !blocked {
                    self.cooling.remove(&key.branch);
                    acks.push(key);
                    acked_written.push(written);
                    continue;
                }
                failed += 1;
                let reason = match outcome {
                    Some(Outcome::Accepted) => None,
                    // The broker answered about this event: its branch alone cools down, even
                    // behind an unanswered event of its own (a refusal that closes the channel
                    // leaves the events before it unconfirmed).
                    Some(Outcome::Returned) => Some("returned"),
                    Some(Outcome::Nacked) => Some("nacked"),
                    Some(Outcome::TooLarge) => Some("too_large"),
                    // No answer: the session, not the branch, failed; the tenant backs off.
                    Some(Outcome::NotSent) => {
                        session_failed.get_or_insert(StallCause::NotSent);
                        None
                    }
                    Some(Outcome::Unconfirmed) | None => {
                        session_failed.get_or_insert(StallCause::Unconfirmed);
                        None
                    }
                };
                if let Some(reason) = reason
                    && !refused.iter().any(|(branch, _)| *branch == key.branch)
                {
                    refused.push((key.branch.clone(), reason));
                }
                self.blocked.insert(key.branch);
            }
        }
        if settled == 0 {
            return None;
        }
        // A branch is refused at most once per settle (its first refusal).
        let refusals = refused
            .into_iter()
            .map(|(branch, reason)| self.refused(branch, reason, now))
            .collect();
        if session_failed.is_some() && self.phase != Phase::Finishing {
            self.phase = Phase::Failed;
        }
        let stall = self.stall(session_failed, !acks.is_empty(), now);
        let next = match self.phase {
            Phase::Finishing if self.batches.is_empty() => Next::Stop,
            Phase::Finishing => Next::Wait,
            Phase::Failed if self.batches.is_empty() => {
                self.blocked.clear();
                self.phase = Phase::BackingOff;
                let delay = self.backoff.next_delay();
                self.timers.insert((now + delay, Due::Retry));
                Next::Retry(delay)
            }
            Phase::Failed => Next::Wait,
            Phase::Flowing | Phase::BackingOff => {
                self.backoff.reset();
                if self.batches.is_empty() {
                    // The window is empty: a refused branch's later events were not acked and
                    // are drained again (after its retry), in order.
                    self.blocked.clear();
                }
                Next::Flow
            }
        };
        Some(Settlement {
            acks,
            acked_written,
            failed,
            refusals,
            next,
            stall,
        })
    }

    /// Follows the tenant's streak of failed sessions: one started or went on (`failed`), or
    /// the broker confirmed something of it (`shipped`) and it ended.
    fn stall(
        &mut self,
        failed: Option<StallCause>,
        shipped: bool,
        now: Instant,
    ) -> Option<StallNotice> {
        if let Some(cause) = failed {
            let stall = self.stalled.get_or_insert(Stall {
                since: now,
                failures: 0,
                cause,
                told: false,
            });
            stall.failures += 1;
            stall.cause = cause;
            let waited = now.saturating_duration_since(stall.since);
            if !stall.told && waited >= STALL_NOTICE_AFTER {
                stall.told = true;
                return Some(StallNotice::Waiting {
                    waited,
                    failures: stall.failures,
                    cause,
                });
            }
            return None;
        }
        if !shipped {
            return None;
        }
        let stall = self.stalled.take()?;
        stall.told.then(|| StallNotice::Shipping {
            waited: now.saturating_duration_since(stall.since),
            failures: stall.failures,
        })
    }

    /// The broker refused an event of `branch`: retry it alone after its backoff, or park it
    /// after `park_after_attempts` refusals in a row.
    fn refused(&mut self, branch: BranchKey, reason: &'static str, now: Instant) -> Refusal {
        let retry = self.config.retry;
        let cooling = self
            .cooling
            .entry(branch.clone())
            .or_insert_with(|| Cooling {
                attempts: 0,
                first_failed: now,
                retry_at: now,
                backoff: Backoff::new(retry),
            });
        cooling.attempts += 1;
        let attempts = cooling.attempts;
        let action = if attempts >= self.config.park_after_attempts.max(1) {
            let failing_for = now.saturating_duration_since(cooling.first_failed);
            self.cooling.remove(&branch);
            RefusalAction::Park { failing_for }
        } else {
            let delay = cooling.backoff.next_delay();
            cooling.retry_at = now + delay;
            self.timers.insert((now + delay, Due::Drain));
            RefusalAction::RetryAfter(delay)
        };
        Refusal {
            branch,
            reason,
            attempts,
            action,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use store::{BranchId, RunId, TenantId};

    use super::*;

    fn branch(name: &str) -> BranchKey {
        BranchKey::new(
            TenantId::new("t").unwrap(),
            RunId::new("r").unwrap(),
            BranchId::new(name).unwrap(),
        )
    }

    fn key(name: &str, lsn: u64) -> EventKey {
        EventKey {
            branch: branch(name),
            lsn: Lsn::new(lsn),
        }
    }

    fn config(max_batches: usize, park_after_attempts: u32) -> WindowConfig {
        WindowConfig {
            max_batches,
            park_after_attempts,
            retry: RetryPolicy {
                min: Duration::from_millis(100),
                max: Duration::from_secs(1),
            },
            express_max_events: 2,
        }
    }

    const SHARD: ShardId = ShardId(0);

    /// Opens a batch of `keys`, all sent to one publisher, and answers it with `outcomes`.
    fn answered(window: &mut Window<()>, keys: &[EventKey], outcomes: &[Outcome]) -> BatchId {
        let id = sent(window, keys);
        window.confirmed(id, SHARD, outcomes.to_vec());
        id
    }

    fn sent(window: &mut Window<()>, keys: &[EventKey]) -> BatchId {
        let lane = window.lane_for(keys.len(), 0);
        let id = window.open(keys.to_vec(), vec![Utc::now(); keys.len()], lane, ());
        window.dispatched(id, SHARD, true, (0..keys.len()).collect());
        id
    }

    use Outcome::{Accepted, Nacked, NotSent, Returned, TooLarge, Unconfirmed};

    /// A tenant that backed off through an outage (its retry grown to the policy's longest)
    /// drains at once when the broker is back, with its backoff started over; a tenant that is
    /// not backing off, or a cooling branch (a refusal, not an outage), is left as it was.
    #[test]
    fn the_broker_back_ends_a_tenants_backoff_and_only_that() {
        let now = Instant::now();
        let mut window = Window::new(config(1, 5));
        assert!(!window.resume(), "nothing to resume while flowing");
        let mut delay = Duration::ZERO;
        for _ in 0..6 {
            answered(&mut window, &[key("a", 1)], &[Unconfirmed]);
            let Some(Settlement {
                next: Next::Retry(next),
                ..
            }) = window.settle(now)
            else {
                panic!("the tenant backs off");
            };
            delay = next;
            window.handle_timeout(now + delay);
        }
        assert!(delay >= Duration::from_millis(500), "grown: {delay:?}");
        answered(&mut window, &[key("a", 1)], &[Unconfirmed]);
        window.settle(now).unwrap();
        assert!(!window.may_start());
        assert!(window.resume(), "the broker is back: drain now");
        assert!(window.may_start());
        assert_eq!(window.poll_timeout(), None, "its retry is gone");
        assert!(!window.resume(), "once");
        // Its backoff starts over: the next failure waits about the shortest delay.
        answered(&mut window, &[key("a", 1)], &[Unconfirmed]);
        let Some(Settlement {
            next: Next::Retry(next),
            ..
        }) = window.settle(now)
        else {
            panic!("the tenant backs off");
        };
        // (The policy's shortest, 100 ms, plus at most as much jitter.)
        assert!(next <= Duration::from_millis(200), "{next:?}");

        // A refused branch cools on its own timer, which the broker's return leaves.
        let mut window = Window::new(config(1, 5));
        answered(&mut window, &[key("b", 1)], &[Nacked]);
        let settled = window.settle(now).unwrap();
        assert_eq!(settled.refusals.len(), 1);
        let cooling = window.poll_timeout();
        assert!(cooling.is_some());
        assert!(!window.resume());
        assert_eq!(window.poll_timeout(), cooling);
    }

    /// A tenant whose batches go unanswered is named once its stall has lasted
    /// [`STALL_NOTICE_AFTER`] (with why), once more when it ships again, and never for a short
    /// outage.
    #[test]
    fn a_long_stall_is_told_once_and_its_end_once_a_short_one_never() {
        let start = Instant::now();
        let mut window = Window::new(config(1, 5));
        let mut fail = |window: &mut Window<()>, at: Duration, outcome| {
            answered(window, &[key("a", 1)], &[outcome]);
            let settled = window.settle(start + at).unwrap();
            window.resume();
            settled.stall
        };
        // A short outage: failures, then a confirm within the notice's delay.
        assert_eq!(fail(&mut window, Duration::ZERO, Unconfirmed), None);
        assert_eq!(fail(&mut window, Duration::from_secs(2), NotSent), None);
        answered(&mut window, &[key("a", 1)], &[Accepted]);
        let settled = window.settle(start + Duration::from_secs(3)).unwrap();
        assert_eq!(settled.stall, None, "short: nothing said");

        // A long one: told once, past the delay, with the latest cause.
        let at = |secs| Duration::from_secs(secs);
        assert_eq!(fail(&mut window, at(10), Unconfirmed), None);
        assert_eq!(fail(&mut window, at(13), NotSent), None);
        assert_eq!(
            fail(&mut window, at(15), NotSent),
            Some(StallNotice::Waiting {
                waited: at(5),
                failures: 3,
                cause: StallCause::NotSent
            })
        );
        assert_eq!(fail(&mut window, at(20), Unconfirmed), None, "once");
        // A settlement with nothing shipped ends nothing.
        answered(&mut window, &[key("a", 1)], &[Nacked]);
        assert_eq!(window.settle(start + at(21)).unwrap().stall, None);
        answered(&mut window, &[key("b", 1)], &[Accepted]);
        assert_eq!(
            window.settle(start + at(22)).unwrap().stall,
            Some(StallNotice::Shipping {
                waited: at(12),
                failures: 4
            })
        );
        answered(&mut window, &[key("b", 2)], &[Accepted]);
        assert_eq!(window.settle(start + at(23)).unwrap().stall, None, "once");
    }

    /// The window's one timer table: the tenant's retry, a cooling branch's retry and the idle
    /// check each wake the drainer when due, not before, and for what is due.
    #[test]
    fn the_window_owns_its_timers_and_wakes_the_drainer_for_what_is_due() {
        let now = Instant::now();
        let mut window = Window::new(config(1, 5));
        assert_eq!(window.poll_timeout(), None);
        // A session failure: the tenant backs off, its retry is the one timer.
        answered(&mut window, &[key("a", 1)], &[Unconfirmed]);
        let Some(Settlement {
            next: Next::Retry(delay),
            ..
        }) = window.settle(now)
        else {
            panic!("the tenant backs off");
        };
        assert_eq!(window.poll_timeout(), Some(now + delay));
        assert!(!window.may_start());
        let early = window.handle_timeout(now + delay - Duration::from_millis(1));
        assert_eq!(early, Woken::default(), "nothing before it is due");
        let due = window.handle_timeout(now + delay);
        assert_eq!(
            due,
            Woken {
                drain: true,
                retire: false
            }
        );
        assert!(window.may_start(), "the retry ends the backoff");
        assert_eq!(window.poll_timeout(), None);
        // A refusal: its branch's retry wakes the drainer to drain again.
        answered(&mut window, &[key("b", 1)], &[Nacked]);
        let settled = window.settle(now).unwrap();
        let RefusalAction::RetryAfter(delay) = settled.refusals[0].action else {
            panic!("the branch cools");
        };
        assert_eq!(window.poll_timeout(), Some(now + delay));
        assert!(window.handle_timeout(now + delay).drain);
    }

    #[test]
    fn an_idle_spell_keeps_one_check_and_a_busy_one_retires_nothing() {
        let now = Instant::now();
        let idle = Duration::from_secs(30);
        let mut window: Window<()> = Window::new(config(1, 5));
        window.idle(now, idle);
        // Checked again and again in the same spell: one timer, the first deadline.
        for later in 1..100 {
            window.idle(now + Duration::from_millis(later), idle);
        }
        assert_eq!(window.timers(), 1);
        assert_eq!(window.poll_timeout(), Some(now + idle));
        assert_eq!(
            window.handle_timeout(now + idle),
            Woken {
                drain: false,
                retire: true
            }
        );
        // A batch opened in between: the old spell's check cannot retire the drainer, and a
        // new spell's check replaces it.
        window.idle(now, idle);
        answered(&mut window, &[key("a", 1)], &[Accepted]);
        window.settle(now).unwrap();
        assert!(!window.handle_timeout(now + idle).retire, "busy since");
        window.idle(now, idle);
        answered(&mut window, &[key("a", 2)], &[Accepted]);
        window.settle(now).unwrap();
        window.idle(now + idle, idle);
        assert_eq!(window.timers(), 1, "the older spell's check went");
        assert_eq!(window.poll_timeout(), Some(now + idle + idle));
        assert!(window.handle_timeout(now + idle + idle).retire);
    }

    #[test]
    fn the_prefix_rule_holds_across_the_window() {
        let mut window = Window::new(config(2, 5));
        answered(
            &mut window,
            &[key("a", 1), key("a", 2), key("a", 3), key("b", 1)],
            &[Accepted, Nacked, Accepted, Accepted],
        );
        answered(
            &mut window,
            &[key("a", 4), key("b", 2)],
            &[Accepted, Accepted],
        );
        let settled = window.settle(Instant::now()).unwrap();
        assert_eq!(settled.acks, vec![key("a", 1), key("b", 1), key("b", 2)]);
        assert_eq!(settled.failed, 3);
        assert_eq!(settled.refusals.len(), 1);
        assert_eq!(settled.refusals[0].branch, branch("a"));
    }

    #[test]
    fn batches_settle_in_the_order_they_opened() {
        let mut window = Window::new(config(2, 5));
        let first = sent(&mut window, &[key("a", 1)]);
        answered(&mut window, &[key("a", 2)], &[Accepted]);
        assert!(
            window.settle(Instant::now()).is_none(),
            "the first is unanswered"
        );
        window.confirmed(first, SHARD, vec![Accepted]);
        let settled = window.settle(Instant::now()).unwrap();
        assert_eq!(settled.acks, vec![key("a", 1), key("a", 2)]);
        assert!(window.is_empty());
    }

    /// The mutation "a failing branch blocks its tenant" fails here.
    #[test]
    fn a_refused_branch_cools_alone_while_its_tenant_flows() {
        let mut window = Window::new(config(1, 5));
        let now = Instant::now();
        answered(
            &mut window,
            &[key("bad", 1), key("bad", 2), key("good", 1)],
            &[Returned, Accepted, Accepted],
        );
        let settled = window.settle(now).unwrap();
        assert_eq!(settled.acks, vec![key("good", 1)]);
        assert_eq!(settled.next, Next::Flow);
        assert!(window.may_start(), "the tenant keeps draining");
        let [refusal] = settled.refusals.as_slice() else {
            panic!("one refusal: {:?}", settled.refusals)
        };
        assert_eq!(refusal.reason, "returned");
        let RefusalAction::RetryAfter(delay) = refusal.action else {
            panic!("retried, not parked: {refusal:?}")
        };
        // The next drain skips the cooling branch until its retry is due, and only it.
        let skip = window.skip(now);
        assert_eq!(skip.len(), 1);
        assert_eq!(skip[0].branch, branch("bad"));
        assert!(window.skip(now + delay).is_empty());
    }

    #[test]
    fn a_branch_refused_again_and_again_parks_and_an_accepted_event_forgives_it() {
        let mut window = Window::new(config(1, 3));
        let now = Instant::now();
        for attempt in 1..=2 {
            answered(&mut window, &[key("bad", 1)], &[Nacked]);
            let settled = window.settle(now).unwrap();
            assert_eq!(settled.refusals[0].attempts, attempt);
            assert!(matches!(
                settled.refusals[0].action,
                RefusalAction::RetryAfter(_)
            ));
        }
        // One success starts the count over.
        answered(&mut window, &[key("bad", 1)], &[Accepted]);
        window.settle(now).unwrap();
        for _ in 1..=2 {
            answered(&mut window, &[key("bad", 2)], &[Nacked]);
            window.settle(now).unwrap();
        }
        answered(&mut window, &[key("bad", 2)], &[Nacked]);
        let later = now + Duration::from_secs(4);
        let settled = window.settle(later).unwrap();
        assert_eq!(settled.refusals[0].attempts, 3);
        assert_eq!(
            settled.refusals[0].action,
            RefusalAction::Park {
                failing_for: Duration::from_secs(4)
            }
        );
        // Parked branches are skipped by the store, not by the window.
        assert!(window.skip(later).is_empty());
    }

    /// A message the broker refused for its size is a refusal of its branch (reason
    /// `too_large`): the branch cools alone, its tenant's other branches are acked and flow.
    #[test]
    fn a_message_too_large_for_the_broker_cools_its_branch_alone() {
        let mut window = Window::new(config(1, 5));
        answered(
            &mut window,
            &[key("big", 1), key("ok", 1)],
            &[TooLarge, Accepted],
        );
        let settled = window.settle(Instant::now()).unwrap();
        assert_eq!(settled.acks, [key("ok", 1)]);
        assert_eq!(settled.refusals.len(), 1);
        assert_eq!(settled.refusals[0].branch, branch("big"));
        assert_eq!(settled.refusals[0].reason, "too_large");
        assert_eq!(settled.next, Next::Flow);
        assert_eq!(window.phase(), Phase::Flowing);
    }

    /// The broker closes the channel at a message too large for it: the events before it are
    /// left unconfirmed, yet the refusal still counts against its branch (else it would never
    /// cool or park, and its tenant would back off on it for ever).
    #[test]
    fn a_refusal_behind_an_unconfirmed_event_of_its_branch_still_counts() {
        let mut window = Window::new(config(1, 5));
        answered(
            &mut window,
            &[key("big", 1), key("big", 2), key("ok", 1)],
            &[Unconfirmed, TooLarge, Unconfirmed],
        );
        let settled = window.settle(Instant::now()).unwrap();
        assert!(settled.acks.is_empty());
        assert_eq!(settled.refusals.len(), 1);
        assert_eq!(settled.refusals[0].branch, branch("big"));
        assert_eq!(settled.refusals[0].reason, "too_large");
        assert!(
            matches!(settled.next, Next::Retry(_)),
            "the session failed too"
        );
    }

    #[test]
    fn an_unanswered_event_backs_the_tenant_off_once_the_window_is_empty() {
        let mut window = Window::new(config(2, 5));
        let lost = sent(&mut window, &[key("a", 1), key("b", 1)]);
        let later = sent(&mut window, &[key("c", 1)]);
        // The publisher died with both: each batch's dropped reply answers it, empty.
        window.confirmed(lost, SHARD, Vec::new());
        window.confirmed(later, SHARD, Vec::new());
        // Both settle, nothing acked.
        let settled = window.settle(Instant::now()).unwrap();
        assert!(settled.acks.is_empty());
        assert!(matches!(settled.next, Next::Retry(_)));
        assert_eq!(window.phase(), Phase::BackingOff);
        assert!(!window.may_start());
        assert!(window.is_answered(lost) && window.is_answered(later));
        window.handle_timeout(Instant::now() + Duration::from_secs(10));
        assert!(window.may_start());
    }

    #[test]
    fn a_failed_window_waits_for_its_later_batches_before_backing_off() {
        let mut window = Window::new(config(2, 5));
        answered(&mut window, &[key("a", 1)], &[Unconfirmed]);
        let second = sent(&mut window, &[key("a", 2), key("b", 1)]);
        let settled = window.settle(Instant::now()).unwrap();
        assert_eq!(settled.next, Next::Wait);
        assert!(!window.may_start(), "no new batch after a session failure");
        window.confirmed(second, SHARD, Vec::new());
        let settled = window.settle(Instant::now()).unwrap();
        assert!(settled.acks.is_empty());
        assert!(matches!(settled.next, Next::Retry(_)));
    }

    #[test]
    fn a_part_that_could_not_be_sent_is_not_sent() {
        let mut window = Window::new(config(1, 5));
        let id = window.open(
            vec![key("a", 1), key("b", 1)],
            vec![Utc::now(); 2],
            Lane::Bulk,
            (),
        );
        window.dispatched(id, ShardId(0), false, vec![0]);
        window.dispatched(id, ShardId(1), true, vec![1]);
        assert!(!window.is_answered(id));
        window.confirmed(id, ShardId(1), vec![Accepted]);
        let settled = window.settle(Instant::now()).unwrap();
        assert_eq!(settled.acks, vec![key("b", 1)]);
        assert!(matches!(settled.next, Next::Retry(_)));
        let _ = NotSent;
    }

    #[test]
    fn shutdown_stops_once_the_window_is_empty() {
        let mut window = Window::new(config(2, 5));
        let first = sent(&mut window, &[key("a", 1)]);
        window.finish();
        assert!(!window.may_start() && !window.finished());
        window.confirmed(first, SHARD, vec![Accepted]);
        let settled = window.settle(Instant::now()).unwrap();
        assert_eq!(settled.acks, vec![key("a", 1)]);
        assert_eq!(settled.next, Next::Stop);
        assert!(window.finished());
    }

    #[test]
    fn an_idle_check_sees_any_batch_opened_since() {
        let mut window = Window::new(config(1, 5));
        let activity = window.activity();
        assert!(window.idle_since(activity));
        answered(&mut window, &[key("a", 1)], &[Accepted]);
        window.settle(Instant::now()).unwrap();
        assert!(!window.idle_since(activity));
        assert!(window.idle_since(window.activity()));
    }

    /// A quiet tenant's small batch takes the express lane; a large one, or any batch while
    /// another of the tenant is in flight on the other lane, does not switch lanes.
    #[test]
    fn small_batches_take_the_express_lane_but_never_beside_a_bulk_batch() {
        let mut window = Window::new(config(3, 5));
        assert_eq!(window.lane_for(1, 100), Lane::Express);
        assert_eq!(
            window.lane_for(3, 100),
            Lane::Bulk,
            "over express_max_events"
        );
        assert_eq!(window.lane_for(1, EXPRESS_MAX_BYTES + 1), Lane::Bulk);
        let big = sent(&mut window, &[key("a", 1), key("a", 2), key("a", 3)]);
        assert_eq!(
            window.lane_for(1, 1),
            Lane::Bulk,
            "sticks to the lane in flight"
        );
        window.confirmed(big, SHARD, vec![Accepted; 3]);
        window.settle(Instant::now()).unwrap();
        let small = sent(&mut window, &[key("a", 4)]);
        assert_eq!(
            window.lane_for(3, 1),
            Lane::Express,
            "sticks to the lane in flight"
        );
        window.confirmed(small, SHARD, vec![Accepted]);
        window.settle(Instant::now()).unwrap();
        let mut no_lane = Window::<()>::new(WindowConfig {
            express_max_events: 0,
            ..config(1, 5)
        });
        assert_eq!(no_lane.lane_for(1, 1), Lane::Bulk);
        let _ = &mut no_lane;
    }

    /// A tenant with a few intents reserves a small share of the budgets; one whose drain came
    /// back full reserves a whole batch until a drain comes back short.
    #[test]
    fn a_full_drain_reserves_a_whole_batch_next_time() {
        let mut window = Window::<()>::new(config(1, 5));
        assert_eq!(window.reservation(1000, 4 << 20), (32, 256 << 10));
        assert_eq!(
            window.reservation(10, 1024),
            (10, 1024),
            "never above the batch"
        );
        window.drained(32, 32, 100, 256 << 10);
        assert_eq!(window.reservation(1000, 4 << 20), (1000, 4 << 20));
        window.drained(3, 1000, 100, 4 << 20);
        assert_eq!(window.reservation(1000, 4 << 20), (32, 256 << 10));
        window.drained(1, 32, 300 << 10, 256 << 10);
        assert_eq!(
            window.reservation(1000, 4 << 20),
            (1000, 4 << 20),
            "bytes filled"
        );
    }

    fn any_outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![
            6 => Just(Accepted),
            1 => Just(Nacked),
            1 => Just(Returned),
            1 => Just(TooLarge),
            1 => Just(Unconfirmed),
            1 => Just(NotSent),
        ]
    }

    proptest! {
        /// Over any outcomes in any window: per branch, what is acked is a prefix of what was
        /// sent, made only of accepted events; everything else is left pending.
        #[test]
        fn acks_are_accepted_prefixes_of_each_branch(
            batches in prop::collection::vec(
                prop::collection::vec((0..3usize, any_outcome()), 1..6), 1..5),
        ) {
            let mut window = Window::new(config(batches.len(), 100));
            let mut next_lsn = [1u64; 3];
            let mut sent_by_branch: BTreeMap<usize, Vec<(u64, Outcome)>> = BTreeMap::new();
            for batch in &batches {
                let keys: Vec<EventKey> = batch.iter().map(|(b, _)| {
                    let lsn = next_lsn[*b];
                    next_lsn[*b] += 1;
                    key(&format!("b{b}"), lsn)
                }).collect();
                for ((b, outcome), key) in batch.iter().zip(&keys) {
                    sent_by_branch.entry(*b).or_default().push((key.lsn.get(), *outcome));
                }
                let outcomes: Vec<Outcome> = batch.iter().map(|(_, o)| *o).collect();
                answered(&mut window, &keys, &outcomes);
            }
            let settled = window.settle(Instant::now()).unwrap();
            prop_assert!(window.is_empty());
            for (b, sent) in sent_by_branch {
                let acked: Vec<u64> = settled.acks.iter()
                    .filter(|k| k.branch == branch(&format!("b{b}")))
                    .map(|k| k.lsn.get())
                    .collect();
                let prefix: Vec<u64> = sent.iter()
                    .take_while(|(_, outcome)| *outcome == Accepted)
                    .map(|(lsn, _)| *lsn)
                    .collect();
                prop_assert_eq!(acked, prefix);
            }
        }
    }
}

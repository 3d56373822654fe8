//! The supervisor's decisions, without I/O: which drainers and publishers run, wait, restart,
//! finish or stop.
//!
//! The actor (`tree`) feeds [`Core`] events (leases changed, pending tenants, a wake-up, a child
//! started or ended, a timeout with `now`), performs the [`Command`]s it then returns from
//! [`Core::poll`], and arms one timer at [`Core::poll_timeout`]. quinn-proto's `Connection`
//! (`poll_transmit`/`poll_timeout`/`handle_timeout`) is the model. Everything here is unit and
//! property tested with fake handles and made-up instants (`tests` below).
//!
//! One table holds every tenant this relay knows a drainer for ([`TenantSlot`]), one every
//! publisher shard, and one book every lease held or being handed over (`leases`: the only
//! owner of bucket ownership in the relay; the actor runs its SQL and writes its fences); a
//! tenant's backoff, wake-up flag and child id move with its slot, so no removal has to touch
//! parallel maps in step.
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

use actors::ShardId;
use broker::{Backoff, RetryPolicy};
use store::{Bucket, TenantId, bucket_of};

use crate::waiting::Waiting;

mod drainers;
mod leases;
mod notes;
mod publishers;
mod shutdown;
use actors::Timers;
pub(crate) use leases::{Held, LeaseCall, Sightings};
pub use leases::{LeaseConfig, LeasesAt};
use leases::{LeaseStage, Leases};
pub(crate) use notes::Note;

/// What the core needs of a running child: an id to recognise its end by.
pub(crate) trait Handle: Clone + std::fmt::Debug {
    /// The id a supervision event carries.
    type Id: Copy + Eq + Hash + std::fmt::Debug;
    /// This child's id.
    fn id(&self) -> Self::Id;
}

/// What the actor does for the core, in the order returned.
#[derive(Debug)]
pub(crate) enum Command<H> {
    /// Start a drainer for `tenant` under its bucket's fence; then report
    /// [`Core::drainer_started`] or [`Core::drainer_failed_to_start`].
    SpawnDrainer { tenant: TenantId },
    /// Start the shard's publisher; then report [`Core::publisher_started`] or
    /// [`Core::publisher_failed_to_start`].
    SpawnPublisher(ShardId),
    /// The shard has no publisher now: drainers must not send to the old one.
    PublisherGone(ShardId),
    /// See whether the broker takes a connection again; then report
    /// [`Core::broker_checked`].
    CheckBroker,
    /// Tell a drainer there is work (wake-ups coalesce: one queued at a time).
    Drain(H),
    /// Tell an idle drainer to retire if it still is (tenants wait for a slot): the
    /// activity count of its [`Core::drainer_idle`] report.
    Retire(H, u64),
    /// Tell a drainer the broker is back: if it backs off after a failed batch, drain now.
    Resume(H),
    /// Ask a drainer to finish its batches in flight and stop.
    Finish(H),
    /// Stop a drainer now (its lease is gone, or the grace ran out).
    Kill(H),
    /// Run a call against the lease tables (in order; answers come back as events).
    Lease(LeaseCall),
    /// A lease was gained: open its bucket's fence until `held.until` (closing any older one).
    OpenFence { bucket: Bucket, held: Held },
    /// A renewal came back: these buckets' fences stay open until `until` (never earlier).
    ExtendFences {
        buckets: Vec<Bucket>,
        until: Instant,
    },
    /// The bucket left the book: close its fence now, for good (before any release of it).
    CloseFence(Bucket),
    /// Buckets were gained: poll the tenants with pending intents now.
    PollNow,
    /// Every drainer is done after [`Core::finish`]: answer and stop.
    Finished,
}

/// Timings and bounds the core decides with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CoreConfig {
    /// Publisher slots.
    pub(crate) publishers: u16,
    /// Most drainers alive (starting or running) at once.
    pub(crate) max_drainers: usize,
    /// Restart delays of failed children.
    pub(crate) restart: RetryPolicy,
    /// How long [`Core::finish`] waits before killing what is left.
    pub(crate) finish_grace: Duration,
    /// Once a publisher's restart delay outgrows this, the broker is checked this often
    /// ([`Command::CheckBroker`]) until it answers or a publish is confirmed; `None`: never
    /// (no check was given).
    pub(crate) broker_check: Option<Duration>,
    /// Lease TTL and heartbeat.
    pub(crate) lease: LeaseConfig,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    RespawnDrainer(TenantId),
    RespawnPublisher(ShardId),
    CheckBroker,
    FinishDeadline,
    LeaseBeat,
}

/// Whether a running drainer has a `Drain` it has not taken yet: wake-ups coalesce to one
/// queued at a time, and one that comes while a `Drain` is queued is sent once that one is
/// taken (its drain may have read before the commit that woke it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    /// No `Drain` queued.
    Idle,
    /// One queued, not taken yet.
    Queued,
    /// One queued, and another wake-up came since: send another once it is taken.
    QueuedAgain,
}

/// A tenant this relay keeps something for.
#[derive(Debug)]
enum TenantSlot<H> {
    /// Spawn commanded, result not reported yet.
    Starting { backoff: Option<Backoff> },
    Running {
        drainer: H,
        spawned: Instant,
        wake: Wake,
        /// Present once it failed before: carried to the next restart.
        backoff: Option<Backoff>,
    },
    /// Failed; its respawn timer ([`Timer::RespawnDrainer`]) restarts it. A wake-up before
    /// then does not: the work waits for the backoff, which is what the backoff is for.
    Restarting { backoff: Backoff },
}

impl<H> TenantSlot<H> {
    fn alive(&self) -> bool {
        !matches!(self, TenantSlot::Restarting { .. })
    }
}

#[derive(Debug)]
enum PublisherState<Id> {
    Starting,
    Up(Id),
    Down,
}

#[derive(Debug)]
struct PublisherSlot<Id> {
    state: PublisherState<Id>,
    backoff: Backoff,
}

#[derive(Clone, Debug)]
enum Child {
    Drainer(TenantId),
    Publisher(ShardId),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    Finishing,
    Finished,
}

/// The supervisor's state machine.
#[derive(Debug)]
pub(crate) struct Core<H: Handle> {
    config: CoreConfig,
    tenants: HashMap<TenantId, TenantSlot<H>>,
    /// Slots that are starting or running: what `max_drainers` bounds.
    alive: usize,
    children: HashMap<H::Id, Child>,
    publishers: Vec<PublisherSlot<H::Id>>,
    leases: Leases,
    waiting: Waiting,
    timers: Timers<Timer>,
    phase: Phase,
    commands: VecDeque<Command<H>>,
    /// What to tell an operator, for the actor to record ([`Core::poll_note`]).
    notes: VecDeque<Note>,
    check: CheckState,
    /// A check found the broker answering, and since then no check found it silent and no
    /// publish was confirmed: a further answer is no news (a broker that takes connections but
    /// fails publishes is left to the publishers' own backoff, never restarted at the check's
    /// pace).
    answered: bool,
    /// A publisher failed, and since then no publish was confirmed and the broker did not
    /// answer a check: while so, a check that finds the broker silent is followed by another.
    doubt: bool,
}

/// Where the broker check is: never two at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CheckState {
    /// None scheduled nor running: one may be scheduled.
    Ready,
    /// One is scheduled (its timer is set).
    Scheduled,
    /// One was commanded and has not reported.
    Running,
}

impl<H: Handle> Core<H> {
    /// A core that starts every publisher.
    pub(crate) fn new(config: CoreConfig) -> Self {
        let publishers = (0..config.publishers.max(1))
            .map(|_| PublisherSlot {
                state: PublisherState::Starting,
                backoff: Backoff::new(config.restart),
            })
            .collect();
        let mut core = Self {
            config,
            tenants: HashMap::new(),
            alive: 0,
            children: HashMap::new(),
            publishers,
            leases: Leases::new(config.lease),
            waiting: Waiting::default(),
            timers: Timers::default(),
            phase: Phase::Running,
            commands: VecDeque::new(),
            notes: VecDeque::new(),
            check: CheckState::Ready,
            answered: false,
            doubt: false,
        };
        for slot in 0..core.publishers.len() {
            core.commands
                .push_back(Command::SpawnPublisher(ShardId(slot as u16)));
        }
        core
    }

    /// The next thing to do.
    pub(crate) fn poll(&mut self) -> Option<Command<H>> {
        self.commands.pop_front()
    }

    /// The next thing to tell an operator (a log line, a metric). The actor takes them all
    /// after each event, so they never pile up.
    pub(crate) fn poll_note(&mut self) -> Option<Note> {
        self.notes.pop_front()
    }

    /// When [`Core::handle_timeout`] is next due.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    /// Fires every timer due at `now`.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        while let Some(timer) = self.timers.pop_due(now) {
            match timer {
                Timer::RespawnDrainer(tenant) => {
                    if matches!(
                        self.tenants.get(&tenant),
                        Some(TenantSlot::Restarting { .. })
                    ) {
                        self.spawn(tenant, now);
                    }
                }
                Timer::RespawnPublisher(shard) => {
                    let slot = &mut self.publishers[usize::from(shard.0)];
                    if matches!(slot.state, PublisherState::Down) && self.phase == Phase::Running {
                        slot.state = PublisherState::Starting;
                        self.commands.push_back(Command::SpawnPublisher(shard));
                    }
                }
                Timer::CheckBroker => {
                    if self.doubt && self.phase == Phase::Running {
                        self.check = CheckState::Running;
                        self.commands.push_back(Command::CheckBroker);
                    } else {
                        self.check = CheckState::Ready;
                    }
                }
                Timer::FinishDeadline => self.finish_deadline(),
                Timer::LeaseBeat => {
                    if self.leases.stage == LeaseStage::Waiting {
                        self.beat(leases::Beat::Later, now);
                    }
                }
            }
        }
    }

    // ----- Work -----

    /// Every tenant with pending intents, from the poller: waiting tenants it no longer lists
    /// leave the queue; those in buckets held are drained.
    pub(crate) fn pending(&mut self, tenants: Vec<TenantId>, now: Instant) {
        if self.phase != Phase::Running {
            return;
        }
        self.waiting.keep_only(&tenants);
        self.wake(tenants, now);
    }

    /// A tenant's intents just committed.
    pub(crate) fn notified(&mut self, tenant: TenantId, now: Instant) {
        if self.phase == Phase::Running {
            self.wake(vec![tenant], now);
        }
    }

    /// Drains `tenants` (in buckets held): wakes their drainers, starts missing ones.
    fn wake(&mut self, tenants: Vec<TenantId>, now: Instant) {
        self.admit_waiting(now);
        for tenant in tenants {
            if !self.staying(bucket_of(&tenant)) {
                continue;
            }
            match self.tenants.get_mut(&tenant) {
                Some(TenantSlot::Running { drainer, wake, .. }) => {
                    // Coalesced: a drainer busy for a while gets one wake-up, not one per poll.
                    *wake = match wake {
                        Wake::Idle => {
                            self.commands.push_back(Command::Drain(drainer.clone()));
                            Wake::Queued
                        }
                        Wake::Queued | Wake::QueuedAgain => Wake::QueuedAgain,
                    };
                }
                // A drainer about to start drains at once; a restarting one when its backoff
                // is over (its timer), not at the host's commit rate.
                Some(TenantSlot::Starting { .. } | TenantSlot::Restarting { .. }) => {}
                None => self.spawn(tenant, now),
            }
        }
    }

    /// A child ended; `stop` when it stopped by itself for a reason that needs no restart
    /// (a drainer retired idle, finished or fenced).
    pub(crate) fn child_ended(
        &mut self,
        id: H::Id,
        why: &str,
        stop: Option<actors::StopReason>,
        now: Instant,
    ) {
        match self.children.remove(&id) {
            Some(Child::Publisher(shard)) => self.publisher_ended(shard, why, now),
            Some(Child::Drainer(tenant)) => self.drainer_ended(tenant, why, stop, now),
            None => {}
        }
    }

    fn publisher_ended(&mut self, shard: ShardId, why: &str, now: Instant) {
        let slot = &mut self.publishers[usize::from(shard.0)];
        slot.state = PublisherState::Down;
        // Drainers with batches on it hear of it from each batch's reply as the publisher's
        // mailbox and tasks drop them.
        self.commands.push_back(Command::PublisherGone(shard));
        if self.phase != Phase::Running {
            return;
        }
        let delay = slot.backoff.next_delay();
        let failures = slot.backoff.failures();
        self.notes.push_back(Note::PublisherRestarting {
            shard,
            failures,
            retry_in: delay,
            reason: why.to_owned(),
        });
        self.timers.set(Timer::RespawnPublisher(shard), now + delay);
        self.check_broker_later(delay, now);
    }
}

#[cfg(test)]
mod tests;

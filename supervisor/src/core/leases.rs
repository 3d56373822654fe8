//! The core's leases: the one [`LeaseBook`] of this relay, the heartbeat that renews it, the
//! claims and handovers that move it toward its share, and what each change does to drainers.
//!
//! The heartbeat is a protocol of steps the core drives with its own timer: [`Timer::LeaseBeat`]
//! commands a [`LeaseCall::Beat`] (membership and renewal); its answer ([`Core::lease_beaten`])
//! extends, loses, expires or forces leases out of the book and takes the share's next step: a
//! [`LeaseCall::Claim`] (answered by [`Core::lease_claimed`]) or a handover, whose buckets are
//! released ([`LeaseCall::Release`]) once their drainers are done. One call is in flight at a
//! time; the next beat is due a heartbeat after the last one began (a quarter heartbeat after
//! the first, which left room for a relay starting beside this one). The actor only runs the
//! calls and writes the fence cells ([`Command::OpenFence`], [`Command::ExtendFences`],
//! [`Command::CloseFence`]): a fence is always closed before its bucket's release is commanded.
//!
//! Every lease rule lives here, pure; `store` keeps only their SQL and the fence cell:
//! - `plan`: the share rule (`ceil(buckets / members)`) and the next step toward it.
//! - `book`: [`LeaseBook`], the leases held, their fences' deadlines, handovers and expiry.
//! - `sightings`: [`Sightings`], the lease rows and members as this relay saw them on its own
//!   clock: which buckets a claim may take, how many relays live (the lease runner feeds it).
//! - `tables` (tests): the book and the share rule against the real lease tables.
use std::time::{Duration, Instant};

use store::{Bucket, LeaseEpoch, TenantId, bucket_of};

use super::*;

mod book;
mod plan;
mod sightings;
#[cfg(test)]
mod tables;
pub(crate) use book::{Held, LeaseBook};
use plan::{LeasePlan, LeaseStep};
pub(crate) use sightings::Sightings;

/// Lease timings.
#[derive(Clone, Copy, Debug)]
pub struct LeaseConfig {
    /// How long a lease (and a membership) lasts without renewal: the longest a dead relay's
    /// tenants wait for another relay. Default 5 s.
    pub ttl: Duration,
    /// How often leases are renewed, shares rebalanced and pending tenants polled. Must be well
    /// below `ttl` (at most a third). Default 1 s.
    pub heartbeat: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(5),
            heartbeat: Duration::from_secs(1),
        }
    }
}

/// Leases as a renewal or claim left them, with the instant its statement was sent: a
/// fence's deadline counts from `sent` (PostgreSQL's `now()` in the statement is no earlier),
/// never from when the call was commanded, so time a call spends queued behind others is
/// never counted as lease time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeasesAt {
    /// `(bucket, epoch)` of each lease.
    pub leases: Vec<(Bucket, LeaseEpoch)>,
    /// When the statement was sent.
    pub sent: std::time::Instant,
}

/// A call the actor runs against the lease tables for the core, in the order commanded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum LeaseCall {
    /// Renew this relay's membership and the leases `held`; answer with
    /// [`Core::lease_beaten`].
    Beat { held: Vec<(Bucket, LeaseEpoch)> },
    /// Claim up to this many free or stale buckets ([`Sightings`]); answer with
    /// [`Core::lease_claimed`].
    Claim(u16),
    /// Release these leases (their fences are closed already). No answer: a release that
    /// fails leaves the rows to go stale.
    Release(Vec<(Bucket, LeaseEpoch)>),
}

/// Which heartbeat of this relay's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Beat {
    /// The first: it leaves room for a relay starting beside this one
    /// ([`LeasePlan::first_step`]).
    First,
    /// Any later one.
    Later,
}

/// Where the heartbeat is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LeaseStage {
    /// Not started yet ([`Core::start_leases`]), or left ([`Core::leave_all`]).
    Idle,
    /// Between beats: [`Timer::LeaseBeat`] is set.
    Waiting,
    /// A [`LeaseCall::Beat`] is out, commanded at `began` (the next beat is due a heartbeat
    /// after it; the fences count from when the lease runner sent the renewal, [`LeasesAt::sent`]).
    Beating { began: Instant, beat: Beat },
    /// The beat that began at `began` claims: a [`LeaseCall::Claim`] is out.
    Claiming { began: Instant, beat: Beat },
}

/// The core's lease state: the book, the share rule, the members last seen, the heartbeat.
#[derive(Debug)]
pub(super) struct Leases {
    pub(super) book: LeaseBook,
    plan: LeasePlan,
    members: u32,
    pub(super) stage: LeaseStage,
    heartbeat: Duration,
}

impl Leases {
    pub(super) fn new(config: LeaseConfig) -> Self {
        Self {
            book: LeaseBook::new(config.ttl),
            plan: LeasePlan::new(),
            members: 1,
            stage: LeaseStage::Idle,
            heartbeat: config.heartbeat,
        }
    }
}

impl<H: Handle> Core<H> {
    /// Begins the heartbeat: the first [`LeaseCall::Beat`] now.
    pub(crate) fn start_leases(&mut self, now: Instant) {
        if self.leases.stage == LeaseStage::Idle {
            self.beat(Beat::First, now);
        }
    }

    pub(super) fn beat(&mut self, beat: Beat, now: Instant) {
        let held = self.leases.book.held();
        self.commands
            .push_back(Command::Lease(LeaseCall::Beat { held }));
        self.leases.stage = LeaseStage::Beating { began: now, beat };
    }

    /// The answer to [`LeaseCall::Beat`]: the live relays and the leases renewed (`None` for
    /// a call that failed or timed out: the book keeps what it had, and fences close on time).
    /// `broker_blocked`: the broker holds a connection of this relay blocked, so no handover
    /// is forced (what was written on it may still land).
    pub(crate) fn lease_beaten(
        &mut self,
        members: Option<u32>,
        renewed: Option<LeasesAt>,
        broker_blocked: bool,
        now: Instant,
    ) {
        let LeaseStage::Beating { began, beat } = self.leases.stage else {
            return;
        };
        if let Some(members) = members {
            self.leases.members = members;
        }
        let mut lost = Vec::new();
        if let Some(renewed) = renewed {
            // The deadline counts from when the renewal was sent, not from when it was
            // commanded (`began`: that is the next beat's schedule).
            let (until, taken) = self.leases.book.renewed(&renewed.leases, renewed.sent);
            // What the book still holds is exactly what was renewed.
            let buckets: Vec<Bucket> = self.leases.book.buckets().collect();
            if !buckets.is_empty() {
                self.commands
                    .push_back(Command::ExtendFences { buckets, until });
            }
            lost.extend(taken);
        }
        let lapsed = self.leases.book.expire(now);
        lost.extend(lapsed.iter().map(|(bucket, _)| *bucket));
        if !lost.is_empty() {
            self.notes.push_back(Note::LeasesLost {
                buckets: lost.len(),
            });
        }
        // Handovers that did not settle in time are forced: the fence decides, as after a
        // crash (duplicates bounded by what was in flight).
        let forced = self
            .leases
            .book
            .overdue(now, self.config.finish_grace, broker_blocked);
        if !forced.is_empty() {
            self.notes.push_back(Note::HandoversForced {
                buckets: forced.len(),
                grace: self.config.finish_grace,
            });
        }
        lost.extend(forced.iter().map(|(bucket, _)| *bucket));
        self.buckets_lost(&lost);
        // Lapsed leases are released too: claimable at once instead of after the TTL.
        let release: Vec<(Bucket, LeaseEpoch)> = lapsed.into_iter().chain(forced).collect();
        if !release.is_empty() {
            self.commands
                .push_back(Command::Lease(LeaseCall::Release(release)));
        }
        // The share's next step (none while finishing: nothing more starts then).
        let step = match (self.phase, beat) {
            (Phase::Running, Beat::First) => self
                .leases
                .plan
                .first_step(self.leases.book.staying(), self.leases.members),
            (Phase::Running, Beat::Later) => self
                .leases
                .plan
                .step(self.leases.book.staying(), self.leases.members),
            _ => LeaseStep::Hold,
        };
        match step {
            LeaseStep::Claim(n) => {
                self.commands.push_back(Command::Lease(LeaseCall::Claim(n)));
                self.leases.stage = LeaseStage::Claiming { began, beat };
            }
            LeaseStep::Shed(n) => {
                // A planned move: the buckets stay held (fences open) while their drainers
                // finish what they have in flight; each is released once settled.
                let leaving = self.leases.book.hand_over(n, now);
                self.notes.push_back(Note::HandingOver {
                    buckets: leaving.len(),
                    members: self.leases.members,
                });
                self.hand_over(leaving);
                self.beat_done(began, beat, now);
            }
            LeaseStep::Hold => self.beat_done(began, beat, now),
        }
        self.lease_gauges();
    }

    /// The answer to [`LeaseCall::Claim`]: the buckets claimed with their epochs (`None` for
    /// a call that failed: claimed again at the next beat).
    pub(crate) fn lease_claimed(&mut self, claimed: Option<LeasesAt>, now: Instant) {
        let LeaseStage::Claiming { began, beat, .. } = self.leases.stage else {
            return;
        };
        let gained = match claimed {
            Some(claimed) => self.leases.book.claimed(&claimed.leases, claimed.sent),
            None => Vec::new(),
        };
        for (bucket, held) in &gained {
            self.commands.push_back(Command::OpenFence {
                bucket: *bucket,
                held: *held,
            });
        }
        if !gained.is_empty() {
            // Their tenants are polled at once rather than at the next poll.
            self.commands.push_back(Command::PollNow);
        }
        self.beat_done(began, beat, now);
        self.lease_gauges();
    }

    /// The beat that began at `began` is done: the next one is due a heartbeat after it (a
    /// quarter heartbeat after the first: relays started within that quarter have registered
    /// by then, so a lone relay holds its whole share at once; a later one joins by a planned
    /// handover).
    fn beat_done(&mut self, began: Instant, beat: Beat, now: Instant) {
        let every = match beat {
            Beat::First => self.leases.heartbeat / 4,
            Beat::Later => self.leases.heartbeat,
        };
        self.leases.stage = LeaseStage::Waiting;
        self.timers.set(Timer::LeaseBeat, (began + every).max(now));
    }

    /// `lost` left the book (taken over, lapsed or forced): their fences close and their
    /// drainers stop now, not restarted.
    fn buckets_lost(&mut self, lost: &[Bucket]) {
        if lost.is_empty() {
            return;
        }
        for bucket in lost {
            self.commands.push_back(Command::CloseFence(*bucket));
        }
        let tenants: Vec<TenantId> = self
            .tenants
            .keys()
            .filter(|tenant| lost.contains(&bucket_of(tenant)))
            .cloned()
            .collect();
        for tenant in tenants {
            // A starting drainer is stopped as it reports (not commanded any more), a
            // restarting one's timer goes with its slot.
            if let Some(TenantSlot::Running { drainer, .. }) = self.remove_slot(&tenant) {
                self.children.remove(&drainer.id());
                self.commands.push_back(Command::Kill(drainer));
            }
        }
        // A finish waiting on those drainers is done if they were the last.
        self.finish_if_done();
    }

    /// A planned handover of `buckets` (already leaving the book's share): no drainer starts
    /// on them (nor restarts, nor leaves the waiting queue); their drainers finish their
    /// batches in flight under fences still open (one starting is told as it reports). A
    /// bucket with no drainer alive is settled at once.
    fn hand_over(&mut self, buckets: Vec<Bucket>) {
        for bucket in buckets {
            for (tenant, slot) in &self.tenants {
                if let TenantSlot::Running { drainer, .. } = slot
                    && bucket_of(tenant) == bucket
                {
                    self.commands.push_back(Command::Finish(drainer.clone()));
                }
            }
            self.settle_if_idle(bucket);
        }
    }

    /// If `bucket` is being handed over and no drainer is alive on it: its fence closes and
    /// it is released now, not at the next heartbeat.
    pub(super) fn settle_if_idle(&mut self, bucket: Bucket) {
        if !self.leaving(bucket)
            || self
                .tenants
                .iter()
                .any(|(tenant, slot)| slot.alive() && bucket_of(tenant) == bucket)
        {
            return;
        }
        if let Some(lease) = self.leases.book.handed_over(bucket) {
            // Buckets settled by one message are released by one call: its fence closes
            // before the release commanded last, which takes this lease too.
            if let Some(Command::Lease(LeaseCall::Release(leases))) = self.commands.back_mut() {
                leases.push(lease);
                let release = self.commands.pop_back();
                self.commands.push_back(Command::CloseFence(bucket));
                self.commands.extend(release);
            } else {
                self.commands.push_back(Command::CloseFence(bucket));
                self.commands
                    .push_back(Command::Lease(LeaseCall::Release(vec![lease])));
            }
            self.lease_gauges();
        }
    }

    /// Shutdown: every lease leaves the book; returns them, to release once their fences are
    /// closed.
    pub(crate) fn leave_all(&mut self) -> Vec<(Bucket, LeaseEpoch)> {
        self.timers.stop(&Timer::LeaseBeat);
        self.leases.stage = LeaseStage::Idle;
        let all = self.leases.book.revoke_all();
        self.lease_gauges();
        all
    }

    fn lease_gauges(&mut self) {
        self.notes.push_back(Note::Leases {
            held: self.leases.book.len(),
            members: self.leases.members,
        });
    }

    /// Buckets held, not being handed over.
    pub(crate) fn buckets_held(&self) -> usize {
        self.leases.book.staying()
    }

    /// Whether drainers may keep running in `bucket`.
    pub(super) fn staying(&self, bucket: Bucket) -> bool {
        self.leases.book.is_staying(bucket)
    }

    /// Whether a drainer may start in `bucket` at `now`: staying, and its fence open (a lease
    /// not renewed in time is dropped from the book only at the next beat's answer).
    pub(super) fn staying_open(&self, bucket: Bucket, now: Instant) -> bool {
        self.staying(bucket)
            && self
                .leases
                .book
                .get(bucket)
                .is_some_and(|held| now < held.until)
    }

    /// Whether `bucket` is being handed over.
    pub(super) fn leaving(&self, bucket: Bucket) -> bool {
        self.leases.book.is_leaving(bucket)
    }
}

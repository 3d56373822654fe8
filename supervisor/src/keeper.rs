//! The lease keeper: a task beside the supervisor that owns this relay's leases.
//!
//! Every heartbeat it renews its membership and its leases and claims or sheds buckets to reach
//! its share ([`store::LeasePlan`]); beside it, a poller finds the tenants with pending intents
//! (the supervisor drains those in buckets it holds). It tells the supervisor what changed by message; no database call ever runs on
//! the supervisor's mailbox, and each one here is under a timeout. A failed call is logged
//! (rate-limited) and tried again on the next heartbeat; leases that could not be renewed in
//! time close their fences on their own ([`store::LeaseBook::expire`]).
use std::time::{Duration, Instant};

use ractor::ActorRef;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use store::{Bucket, LeaseBook, LeaseChanges, LeasePlan, LeaseStep, LeaseStore, Outbox, RelayId};

use tokio::sync::{Notify, watch};

use crate::SupervisorMessage;

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

/// Logs a repeated failure at WARN the 1st, 2nd, 4th, 8th... time, else at DEBUG.
#[derive(Debug, Default)]
struct Failures(u64);

impl Failures {
    fn failed(&mut self, what: &str, err: &dyn std::fmt::Display) {
        self.0 += 1;
        if self.0.is_power_of_two() {
            tracing::warn!(failures = self.0, error = %err, "{what} failed; will retry");
        } else {
            tracing::debug!(failures = self.0, error = %err, "{what} failed; will retry");
        }
    }

    fn ok(&mut self, what: &str) {
        if self.0 > 0 {
            tracing::info!(failures = self.0, "{what} recovered");
        }
        self.0 = 0;
    }
}

#[derive(Debug, Default)]
struct KeeperFailures {
    membership: Failures,
    renewal: Failures,
    claims: Failures,
}

async fn within<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, store::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {} ms", limit.as_millis())),
    }
}

/// What the keeper needs.
#[derive(Clone, Debug)]
pub(crate) struct Keeper {
    pub(crate) leases: LeaseStore,
    pub(crate) outbox: Outbox,
    pub(crate) me: RelayId,
    pub(crate) config: LeaseConfig,
    pub(crate) poll_interval: Duration,
    /// Set while the supervisor has not handled the last batch of pending tenants.
    pub(crate) poll_busy: Arc<AtomicBool>,
    /// Longest a planned handover waits for a bucket's batches to settle before it is forced.
    pub(crate) handover_grace: Duration,
    /// The publishers' view of the broker: while it holds a connection blocked, what was
    /// written on it may still be routed, so no handover is forced (the next owner's publishes
    /// could land before it).
    pub(crate) broker: broker::BrokerHealth,
}

/// Polls the tenants with pending intents every `interval` (or at once when `early` fires)
/// and hands them to the supervisor, which drains those in buckets it holds. Ends with the
/// supervisor.
async fn poll_pending(
    outbox: Outbox,
    supervisor: ActorRef<SupervisorMessage>,
    interval: Duration,
    early: Arc<Notify>,
    busy: Arc<AtomicBool>,
) {
    let limit = interval.max(Duration::from_secs(5));
    let mut failures = Failures::default();
    loop {
        // Backpressure: no new batch before the supervisor handled the last one, so a slow
        // supervisor never finds a queue of stale polls in its mailbox.
        if !busy.load(Ordering::Acquire) {
            match within(limit, outbox.tenants_with_pending()).await {
                Ok(tenants) => {
                    failures.ok("pending-tenant poll");
                    // Sent even when empty: the supervisor prunes its waiting queue with it.
                    busy.store(true, Ordering::Release);
                    if supervisor
                        .cast(SupervisorMessage::Pending(tenants))
                        .is_err()
                    {
                        return;
                    }
                }
                Err(err) => failures.failed("pending-tenant poll", &err),
            }
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = early.notified() => {}
        }
        if supervisor.get_status() > ractor::ActorStatus::Running {
            return;
        }
    }
}

impl Keeper {
    /// Runs until `stop` turns true (then revokes, releases and leaves) or the supervisor is
    /// gone (then the same, as far as the database answers).
    ///
    /// A bucket handed over (a planned move: shedding toward an even share) stays held and
    /// renewed while the supervisor finishes its drainers; `settled` brings each one whose
    /// drainers are done, and it is released at once, so the next owner starts from what was
    /// acked and nothing is sent twice.
    pub(crate) async fn run(
        self,
        supervisor: ActorRef<SupervisorMessage>,
        mut stop: watch::Receiver<bool>,
        mut settled: tokio::sync::mpsc::UnboundedReceiver<Bucket>,
    ) {
        let mut book = LeaseBook::new(self.me.clone(), self.config.ttl);
        let plan = LeasePlan::new();
        let limit = self.config.heartbeat.max(Duration::from_millis(100));
        let mut members = 1;
        let mut failures = KeeperFailures::default();
        // The poll runs beside the heartbeats, so a slow poll never delays a renewal.
        let early = Arc::new(Notify::new());
        let poller = tokio::spawn(poll_pending(
            self.outbox.clone(),
            supervisor.clone(),
            self.poll_interval,
            early.clone(),
            self.poll_busy.clone(),
        ));
        let mut ticker = tokio::time::interval(self.config.heartbeat);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut beat = Beat::First;
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.changed() => break,
                Some(bucket) = settled.recv() => {
                    self.handed_over(&supervisor, &mut book, bucket, limit).await;
                    continue;
                }
            }
            if *stop.borrow() {
                break;
            }
            let this = std::mem::replace(&mut beat, Beat::Later);
            let beaten = self.heartbeat(
                &supervisor,
                &mut book,
                &plan,
                &mut members,
                &mut failures,
                limit,
                this,
            );
            match beaten.await {
                Beaten::SupervisorGone => break,
                Beaten::Gained => early.notify_one(),
                Beaten::Held => {}
            }
            if this == Beat::First {
                // The first beat left room for a relay starting beside this one; the second
                // comes a quarter heartbeat later, so a lone relay holds its whole share then
                // rather than a heartbeat later (relays started within that quarter have
                // registered by then; a later one joins by a planned handover).
                ticker.reset_after(self.config.heartbeat / 4);
            }
        }
        poller.abort();
        let released = book.revoke_all();
        let lost: Vec<Bucket> = released.iter().map(|(bucket, _)| *bucket).collect();
        let _ = supervisor.cast(SupervisorMessage::Leases(LeaseChanges {
            gained: Vec::new(),
            lost,
        }));
        let _ = within(limit, self.leases.release(&self.me, &released)).await;
        let _ = within(limit, self.leases.leave(&self.me)).await;
        metrics::gauge!("relay_lease_buckets_held").set(0.0);
    }

    /// A bucket being handed over has no drainer left: its fence closes and it is released
    /// now, not at the next heartbeat.
    async fn handed_over(
        &self,
        supervisor: &ActorRef<SupervisorMessage>,
        book: &mut LeaseBook,
        bucket: Bucket,
        limit: Duration,
    ) {
        let Some(lease) = book.handed_over(bucket) else {
            return;
        };
        let _ = supervisor.cast(SupervisorMessage::Leases(LeaseChanges {
            gained: Vec::new(),
            lost: vec![bucket],
        }));
        metrics::gauge!("relay_lease_buckets_held").set(book.len() as f64);
        if let Err(err) = within(limit, self.leases.release(&self.me, &[lease])).await {
            tracing::warn!(error = %err, "could not release a bucket handed over; it expires instead");
        }
    }

    /// Renews membership and leases and moves toward this relay's share (`beat`: the relay's
    /// first heartbeat leaves room for a relay starting beside it).
    #[allow(clippy::too_many_arguments)]
    async fn heartbeat(
        &self,
        supervisor: &ActorRef<SupervisorMessage>,
        book: &mut LeaseBook,
        plan: &LeasePlan,
        members: &mut u32,
        failures: &mut KeeperFailures,
        limit: Duration,
        beat: Beat,
    ) -> Beaten {
        {
            let mut changes = LeaseChanges::default();
            match within(limit, self.leases.heartbeat(&self.me, self.config.ttl)).await {
                Ok(live) => {
                    *members = live;
                    failures.membership.ok("relay membership");
                }
                Err(err) => failures.membership.failed("relay membership", &err),
            }
            let sent = Instant::now();
            let holding = book.held();
            match within(
                limit,
                self.leases.renew(&self.me, self.config.ttl, &holding),
            )
            .await
            {
                Ok(held) => {
                    changes.lost.extend(book.renewed(&held, sent));
                    failures.renewal.ok("lease renewal");
                }
                Err(err) => failures.renewal.failed("lease renewal", &err),
            }
            let lapsed = book.expire(Instant::now());
            changes
                .lost
                .extend(lapsed.iter().map(|(bucket, _)| *bucket));
            if !changes.lost.is_empty() {
                tracing::warn!(
                    buckets = changes.lost.len(),
                    "leases lost (expired or taken over)"
                );
                metrics::counter!("relay_leases_lost_total").increment(changes.lost.len() as u64);
            }
            let mut release = Vec::new();
            // Handovers that did not settle in time are forced: the fence decides, as after a
            // crash (duplicates bounded by what was in flight).
            let forced = book.overdue(Instant::now(), self.handover_grace, self.broker.blocked());
            if !forced.is_empty() {
                tracing::warn!(
                    buckets = forced.len(),
                    grace_ms = self.handover_grace.as_millis() as u64,
                    "buckets handed over without their batches settling in time"
                );
                changes
                    .lost
                    .extend(forced.iter().map(|(bucket, _)| *bucket));
                release.extend(forced);
            }
            let step = match beat {
                Beat::First => plan.first_step(book.staying(), *members),
                Beat::Later => plan.step(book.staying(), *members),
            };
            match step {
                LeaseStep::Claim(n) => {
                    let sent = Instant::now();
                    match within(limit, self.leases.claim(&self.me, self.config.ttl, n)).await {
                        Ok(claimed) => {
                            changes.gained.extend(book.claimed(&claimed, sent));
                            failures.claims.ok("lease claim");
                        }
                        Err(err) => failures.claims.failed("lease claim", &err),
                    }
                }
                LeaseStep::Shed(n) => {
                    // A planned move: the buckets stay held (fences open) while their drainers
                    // finish what they have in flight; each is released once settled.
                    let leaving = book.hand_over(n, Instant::now());
                    tracing::info!(
                        buckets = leaving.len(),
                        members = *members,
                        "handing buckets over once their batches settle"
                    );
                    if supervisor
                        .cast(SupervisorMessage::HandOver(leaving))
                        .is_err()
                    {
                        return Beaten::SupervisorGone;
                    }
                }
                LeaseStep::Hold => {}
            }
            metrics::gauge!("relay_lease_buckets_held").set(book.len() as f64);
            metrics::gauge!("relay_members").set(f64::from(*members));
            let gained = !changes.gained.is_empty();
            if !changes.is_empty() && supervisor.cast(SupervisorMessage::Leases(changes)).is_err() {
                return Beaten::SupervisorGone;
            }
            // Lapsed leases are released too: claimable at once instead of after the TTL.
            release.extend(lapsed);
            if !release.is_empty()
                && let Err(err) = within(limit, self.leases.release(&self.me, &release)).await
            {
                // They expire by themselves within the TTL.
                tracing::warn!(error = %err, "could not release buckets; they expire instead");
            }
            if gained { Beaten::Gained } else { Beaten::Held }
        }
    }
}

/// Which heartbeat of this relay's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Beat {
    /// The first: it leaves room for a relay starting beside this one (`LeasePlan::first_step`).
    First,
    /// Any later one.
    Later,
}

/// What a heartbeat did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Beaten {
    /// Buckets were gained: their tenants are polled at once.
    Gained,
    /// Nothing gained.
    Held,
    /// The supervisor is gone: the keeper ends.
    SupervisorGone,
}

//! The lease keeper: the task beside the supervisor that runs its core's lease calls against
//! PostgreSQL, and the poller that finds tenants with pending intents.
//!
//! The keeper decides nothing: the core's [`store::LeaseBook`] (in `core/leases.rs`) owns which
//! buckets this relay holds and when to renew, claim, hand over and release; the keeper runs each
//! [`LeaseCall`] it is given, in order, under a timeout, and casts the answer back. No database
//! call ever runs on the supervisor's mailbox. A failed call is logged (rate-limited) and
//! answered as failed; the core tries again at the next heartbeat, and leases that could not be
//! renewed in time close their fences on their own.
use std::time::Duration;

use ractor::ActorRef;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use store::{LeaseStore, Outbox, RelayId};

use tokio::sync::{Notify, mpsc};

use crate::SupervisorMessage;
use crate::core::LeaseCall;

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

/// One kind of call's failures in a row: logged at WARN the 1st, 2nd, 4th, 8th... time, else
/// at DEBUG, and its recovery once.
#[derive(Debug)]
struct Failures {
    what: &'static str,
    count: u64,
}

impl Failures {
    fn new(what: &'static str) -> Self {
        Self { what, count: 0 }
    }

    /// The call's value, or `None` after logging its failure.
    fn seen<T>(&mut self, result: Result<T, String>) -> Option<T> {
        let what = self.what;
        match result {
            Ok(value) => {
                if self.count > 0 {
                    tracing::info!(failures = self.count, "{what} recovered");
                }
                self.count = 0;
                Some(value)
            }
            Err(err) => {
                self.count += 1;
                if self.count.is_power_of_two() {
                    tracing::warn!(failures = self.count, error = %err, "{what} failed; will retry");
                } else {
                    tracing::debug!(failures = self.count, error = %err, "{what} failed; will retry");
                }
                None
            }
        }
    }
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
    pub(crate) me: RelayId,
    pub(crate) config: LeaseConfig,
}

/// What the keeper is told.
#[derive(Debug)]
pub(crate) enum KeeperCall {
    /// One of the core's lease calls.
    Lease(LeaseCall),
    /// Shutdown: release these (their fences are closed), leave the membership, end.
    Leave(Vec<(store::Bucket, i64)>),
}

impl Keeper {
    /// Runs `calls` in order until told to leave, or until the supervisor is gone (then it
    /// leaves too, as far as the database answers: the fences close on their own).
    pub(crate) async fn run(
        self,
        supervisor: ActorRef<SupervisorMessage>,
        mut calls: mpsc::UnboundedReceiver<KeeperCall>,
    ) {
        let limit = self.config.heartbeat.max(Duration::from_millis(100));
        let mut membership = Failures::new("relay membership");
        let mut renewal = Failures::new("lease renewal");
        let mut claims = Failures::new("lease claim");
        while let Some(call) = calls.recv().await {
            let answer = match call {
                KeeperCall::Lease(LeaseCall::Beat { held }) => {
                    let beat = self.leases.heartbeat(&self.me, self.config.ttl);
                    let members = membership.seen(within(limit, beat).await);
                    let renew = self.leases.renew(&self.me, self.config.ttl, &held);
                    let renewed = renewal.seen(within(limit, renew).await);
                    SupervisorMessage::LeaseBeaten { members, renewed }
                }
                KeeperCall::Lease(LeaseCall::Claim(n)) => {
                    let claim = self.leases.claim(&self.me, self.config.ttl, n);
                    SupervisorMessage::LeaseClaimed(claims.seen(within(limit, claim).await))
                }
                KeeperCall::Lease(LeaseCall::Release(leases)) => {
                    if let Err(err) = within(limit, self.leases.release(&self.me, &leases)).await {
                        // They expire by themselves within the TTL.
                        tracing::warn!(error = %err, "could not release buckets; they expire instead");
                    }
                    continue;
                }
                KeeperCall::Leave(leases) => {
                    let _ = within(limit, self.leases.release(&self.me, &leases)).await;
                    let _ = within(limit, self.leases.leave(&self.me)).await;
                    return;
                }
            };
            if supervisor.cast(answer).is_err() {
                break;
            }
        }
        let _ = within(limit, self.leases.leave(&self.me)).await;
    }
}

/// Polls the tenants with pending intents every `interval` (or at once when `early` fires)
/// and hands them to the supervisor, which drains those in buckets it holds. Ends with the
/// supervisor.
pub(crate) async fn poll_pending(
    outbox: Outbox,
    supervisor: ActorRef<SupervisorMessage>,
    interval: Duration,
    early: Arc<Notify>,
    busy: Arc<AtomicBool>,
) {
    let limit = interval.max(Duration::from_secs(5));
    let mut failures = Failures::new("pending-tenant poll");
    loop {
        // Backpressure: no new batch before the supervisor handled the last one, so a slow
        // supervisor never finds a queue of stale polls in its mailbox.
        if !busy.load(Ordering::Acquire)
            && let Some(tenants) = failures.seen(within(limit, outbox.tenants_with_pending()).await)
        {
            // Sent even when empty: the supervisor prunes its waiting queue with it.
            busy.store(true, Ordering::Release);
            if supervisor
                .cast(SupervisorMessage::Pending(tenants))
                .is_err()
            {
                return;
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

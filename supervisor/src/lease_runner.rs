//! The lease runner: the task beside the supervisor that runs its core's lease calls against
//! PostgreSQL (the poller beside it, `poller`, finds tenants with pending intents).
//!
//! The runner decides nothing: the core's `LeaseBook` (in `core/leases/book.rs`) owns which
//! buckets this relay holds and when to renew, claim, hand over and release; the runner runs each
//! [`LeaseCall`] it is given under a timeout, and casts the answer back, with the instant the
//! renewal or claim was sent (the fences' deadlines count from it). What it reads of the lease
//! rows and members goes into its [`Sightings`] (pure), which say, on this relay's own
//! clock, how many relays live and which buckets a claim may take. No database call ever runs
//! on the supervisor's mailbox. A failed call is logged (rate-limited) and answered as failed;
//! the core tries again at the next heartbeat, and leases that could not be renewed in time
//! close their fences on their own.
//!
//! Calls run in the order given, but for two things ([`next`]): a heartbeat never waits behind
//! releases (a handover settles dozens of buckets at once, each release a synchronous commit:
//! queued ahead of the renewal they once kept it from PostgreSQL for longer than the fences'
//! margin, and a planned handover sent events twice), and releases waiting together run as one
//! call.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ractor::ActorRef;
use store::{LeaseStore, RelayId, within};
use tokio::sync::mpsc;

use crate::calls::Failures;
use crate::core::{LeaseCall, LeaseConfig, LeasesAt, Sightings};
use crate::messages::SupervisorMessage;

/// What the runner needs.
#[derive(Clone, Debug)]
pub(crate) struct LeaseRunner {
    pub(crate) leases: LeaseStore,
    pub(crate) me: RelayId,
    pub(crate) config: LeaseConfig,
    /// The lease rows and members as this relay saw them, on its own clock: what it may
    /// claim and how many relays live ([`Sightings`]).
    pub(crate) sightings: Sightings,
}

/// What the runner is told.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RunnerCall {
    /// One of the core's lease calls.
    Lease(LeaseCall),
    /// Shutdown: release these (their fences are closed), leave the membership, end.
    Leave(Vec<(store::Bucket, store::LeaseEpoch)>),
}

impl LeaseRunner {
    /// Runs `calls` in order until told to leave, or until the supervisor is gone (then it
    /// leaves too, as far as the database answers: the fences close on their own).
    pub(crate) async fn run(
        mut self,
        supervisor: ActorRef<SupervisorMessage>,
        mut calls: mpsc::UnboundedReceiver<RunnerCall>,
    ) {
        let limit = self.config.heartbeat.max(Duration::from_millis(100));
        let mut membership = Failures::new("relay membership");
        let mut renewal = Failures::new("lease renewal");
        let mut claims = Failures::new("lease claim");
        let mut survey = Failures::new("lease survey");
        let mut queue = VecDeque::new();
        loop {
            if queue.is_empty() {
                match calls.recv().await {
                    Some(call) => queue.push_back(call),
                    None => break,
                }
            }
            while let Ok(call) = calls.try_recv() {
                queue.push_back(call);
            }
            let Some(call) = next(&mut queue) else {
                continue;
            };
            let answer = match call {
                RunnerCall::Lease(LeaseCall::Beat { held }) => {
                    let beat = self.leases.heartbeat(&self.me, self.config.ttl);
                    let members = membership.seen(within(limit, beat).await).map(|rows| {
                        let now = Instant::now();
                        self.sightings.saw_members(&rows, now);
                        self.sightings.members(&self.me, now)
                    });
                    let sent = Instant::now();
                    let renew = self.leases.renew(&self.me, self.config.ttl, &held);
                    let renewed = renewal
                        .seen(within(limit, renew).await)
                        .map(|leases| LeasesAt { leases, sent });
                    // What a claim may take, read after the renewal (this relay's own rows
                    // move with it).
                    if let Some(rows) = survey.seen(within(limit, self.leases.survey()).await) {
                        self.sightings.saw_leases(&rows, Instant::now());
                    }
                    SupervisorMessage::LeaseBeaten { members, renewed }
                }
                RunnerCall::Lease(LeaseCall::Claim(n)) => {
                    let candidates = self.sightings.claimable(Instant::now());
                    let sent = Instant::now();
                    let claim = self.leases.claim(&self.me, self.config.ttl, n, &candidates);
                    let claimed = claims
                        .seen(within(limit, claim).await)
                        .map(|leases| LeasesAt { leases, sent });
                    SupervisorMessage::LeaseClaimed(claimed)
                }
                RunnerCall::Lease(LeaseCall::Release(leases)) => {
                    if let Err(err) = within(limit, self.leases.release(&self.me, &leases)).await {
                        // They expire by themselves within the TTL.
                        tracing::warn!(error = %err, "could not release buckets; they expire instead");
                    }
                    continue;
                }
                RunnerCall::Leave(leases) => {
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

/// The call to run next from those waiting: a heartbeat first (its renewal keeps the fences
/// open; nothing else is as urgent), then the oldest call, every release waiting merged into
/// the first (no call is reordered past a [`RunnerCall::Leave`], which comes last).
fn next(queue: &mut VecDeque<RunnerCall>) -> Option<RunnerCall> {
    let leave = queue
        .iter()
        .position(|call| matches!(call, RunnerCall::Leave(_)))
        .unwrap_or(queue.len());
    if let Some(beat) = queue
        .iter()
        .take(leave)
        .position(|call| matches!(call, RunnerCall::Lease(LeaseCall::Beat { .. })))
    {
        return queue.remove(beat);
    }
    let mut call = queue.pop_front()?;
    if let RunnerCall::Lease(LeaseCall::Release(leases)) = &mut call {
        let mut others = Vec::new();
        for waiting in queue.drain(..leave.saturating_sub(1)) {
            match waiting {
                RunnerCall::Lease(LeaseCall::Release(more)) => leases.extend(more),
                other => others.push(other),
            }
        }
        for other in others.into_iter().rev() {
            queue.push_front(other);
        }
    }
    Some(call)
}

#[cfg(test)]
mod tests {
    use super::*;
    use store::{Bucket, LeaseEpoch};

    fn release(buckets: &[u16]) -> RunnerCall {
        RunnerCall::Lease(LeaseCall::Release(
            buckets
                .iter()
                .map(|&bucket| (Bucket(bucket), LeaseEpoch(1)))
                .collect(),
        ))
    }

    fn beat() -> RunnerCall {
        RunnerCall::Lease(LeaseCall::Beat { held: Vec::new() })
    }

    fn order(calls: Vec<RunnerCall>) -> Vec<RunnerCall> {
        let mut queue: VecDeque<RunnerCall> = calls.into();
        std::iter::from_fn(|| next(&mut queue)).collect()
    }

    /// The shed of a handover queues a release per settled bucket; the renewal that follows
    /// runs first, and the releases as one call.
    #[test]
    fn a_beat_goes_before_releases_and_releases_waiting_together_are_one_call() {
        let claim = RunnerCall::Lease(LeaseCall::Claim(3));
        let got = order(vec![
            release(&[1]),
            release(&[2]),
            claim,
            release(&[3]),
            beat(),
        ]);
        assert_eq!(
            got,
            vec![
                beat(),
                release(&[1, 2, 3]),
                RunnerCall::Lease(LeaseCall::Claim(3))
            ]
        );
    }

    /// A leave is the runner's last call: nothing waiting after it moves before it, and
    /// nothing before it moves after it.
    #[test]
    fn nothing_crosses_a_leave() {
        let leave = RunnerCall::Leave(vec![(Bucket(9), LeaseEpoch(1))]);
        let got = order(vec![release(&[1]), leave, beat(), release(&[2])]);
        assert_eq!(
            got,
            vec![
                release(&[1]),
                RunnerCall::Leave(vec![(Bucket(9), LeaseEpoch(1))]),
                beat(),
                release(&[2])
            ]
        );
        assert_eq!(order(Vec::new()), Vec::new());
    }
}

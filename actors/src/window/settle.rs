//! Settling: the complete batches at the front of the window, in the order they opened,
//! become acks (each a prefix of its branch), refusals and the drainer's next step.
use std::time::{Duration, Instant};

use broker::Outcome;
use chrono::{DateTime, Utc};
use store::{BranchKey, EventKey};

use super::{Due, Phase, Refusal, StallCause, StallNotice, Window};

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

impl<H> Window<H> {
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
                    // Its label is the park's stored reason (`store::ParkCause::of_reason`).
                    Some(
                        refused @ (Outcome::Returned
                        | Outcome::Nacked
                        | Outcome::NoRoom
                        | Outcome::TooLarge
                        | Outcome::Unwritable),
                    ) => Some(refused.label()),
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
                self.timers.set(Due::Retry, now + delay);
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
}

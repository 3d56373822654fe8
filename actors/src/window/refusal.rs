//! A branch the broker refused: retried alone on its own backoff, parked after repeated
//! refusals, while its tenant flows.
use std::time::{Duration, Instant};

use broker::Outcome;
use store::BranchKey;

use super::{Due, Window};
use broker::Backoff;

/// A branch the broker refused events of, retried alone with its own backoff.
#[derive(Debug)]
pub(super) struct Cooling {
    /// Why it was refused last: a refusal for another reason starts a new run of refusals.
    pub(super) reason: &'static str,
    pub(super) attempts: u32,
    pub(super) first_failed: Instant,
    pub(super) retry_at: Instant,
    pub(super) backoff: Backoff,
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

impl<H> Window<H> {
    /// The broker refused an event of `branch`: retry it alone after its backoff, or park it
    /// after `park_after_attempts` refusals in a row (a nack: and once the refusals have lasted
    /// `nack_grace`: RabbitMQ nacks while a quorum queue elects a leader, and 3.10 nacks a new
    /// channel's first publishes to a queue until it finds the new leader, for seconds). A
    /// broker with no room (`no_room`) never parks it: nothing is wrong with the branch, and
    /// every branch ships again once room is made, with no operator releasing each.
    pub(super) fn refused(
        &mut self,
        branch: BranchKey,
        reason: &'static str,
        now: Instant,
    ) -> Refusal {
        let retry = self.config.retry;
        let cooling = self
            .cooling
            .entry(branch.clone())
            .or_insert_with(|| Cooling {
                reason,
                attempts: 0,
                first_failed: now,
                retry_at: now,
                backoff: Backoff::new(retry),
            });
        if cooling.reason != reason {
            // A new cause (a full store emptied, then a nack): its own attempts and grace.
            cooling.reason = reason;
            cooling.attempts = 0;
            cooling.first_failed = now;
        }
        cooling.attempts = cooling.attempts.saturating_add(1);
        let attempts = cooling.attempts;
        let failing_for = now.saturating_duration_since(cooling.first_failed);
        let patient = if reason == Outcome::NoRoom.label() {
            true
        } else if reason == Outcome::Nacked.label() {
            failing_for < self.config.nack_grace
        } else {
            false
        };
        let action = if attempts >= self.config.park_after_attempts.max(1) && !patient {
            self.cooling.remove(&branch);
            RefusalAction::Park { failing_for }
        } else {
            let delay = cooling.backoff.next_delay();
            cooling.retry_at = now + delay;
            self.timers.set(Due::Drain(branch.clone()), now + delay);
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

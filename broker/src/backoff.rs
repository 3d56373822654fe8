//! Retry delays that never give up (backon's default stops after 3 retries).
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// Bounds of an exponential backoff with jitter.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// First delay. Default 100 ms.
    pub min: Duration,
    /// Largest delay, jitter included. Default 5 s.
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            min: Duration::from_millis(100),
            max: Duration::from_secs(5),
        }
    }
}

/// An endless sequence of delays; `reset` after a success.
#[derive(Debug)]
pub struct Backoff {
    policy: RetryPolicy,
    delays: backon::ExponentialBackoff,
    failures: u64,
}

impl Backoff {
    /// A fresh backoff.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            delays: Self::build(policy),
            failures: 0,
        }
    }

    fn build(policy: RetryPolicy) -> backon::ExponentialBackoff {
        ExponentialBuilder::default()
            .with_min_delay(policy.min)
            .with_max_delay(policy.max)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// The next delay, counting one more consecutive failure: at most the policy's `max`.
    pub fn next_delay(&mut self) -> Duration {
        self.failures += 1;
        // Invariant: `without_max_times` makes the iterator endless; `max` is a safe fallback.
        let delay = self.delays.next().unwrap_or(self.policy.max);
        // backon's jitter adds up to the delay again on top of its own cap (a 5 s policy drew
        // up to 10 s). Past the cap the excess folds back below it, so delays at the cap stay
        // spread over [max / 2, max] instead of all retrying at once.
        let max = self.policy.max.max(self.policy.min);
        if delay > max {
            max.saturating_sub((delay - max) / 2)
        } else {
            delay
        }
    }

    /// Consecutive failures since the last reset.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// Starts over after a success.
    pub fn reset(&mut self) {
        self.delays = Self::build(self.policy);
        self.failures = 0;
    }
}

/// The house's rule for repeated failures: WARN on the 1st, 2nd, 4th, 8th ... in a row, and
/// at most DEBUG between, so an hour-long outage logs a dozen lines, not one per attempt.
pub fn warn_worthy(failures: u64) -> bool {
    failures.is_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No delay exceeds the policy's `max`, jitter included (backon's jitter alone went up to
    /// twice it); the delays at the cap stay spread rather than all equal.
    #[test]
    fn delays_never_exceed_the_max_and_stay_spread_at_it() {
        let policy = RetryPolicy {
            min: Duration::from_millis(100),
            max: Duration::from_secs(1),
        };
        let mut backoff = Backoff::new(policy);
        let delays: Vec<Duration> = (0..2_000).map(|_| backoff.next_delay()).collect();
        assert!(
            delays.iter().all(|delay| *delay <= policy.max),
            "{delays:?}"
        );
        assert!(delays[0] >= policy.min && delays[0] <= 2 * policy.min);
        let capped = &delays[20..];
        let shortest = capped.iter().min().unwrap();
        assert!(*shortest >= policy.max / 2, "{shortest:?}");
        assert!(*shortest < policy.max * 9 / 10, "spread: {shortest:?}");
        backoff.reset();
        assert!(backoff.next_delay() <= 2 * policy.min);
    }
}

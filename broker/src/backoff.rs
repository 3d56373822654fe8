//! Retry delays that never give up (backon's default stops after 3 retries).
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// Bounds of an exponential backoff with jitter.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    /// First delay. Default 100 ms.
    pub min: Duration,
    /// Largest delay before jitter (jitter can add up to as much again). Default 5 s.
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

    /// The next delay, counting one more consecutive failure.
    pub fn next_delay(&mut self) -> Duration {
        self.failures += 1;
        // Invariant: `without_max_times` makes the iterator endless; `max` is a safe fallback.
        self.delays.next().unwrap_or(self.policy.max)
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

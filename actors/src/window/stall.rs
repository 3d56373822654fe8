//! When the drainer names a tenant whose batches go unanswered, and when it ships again.
use std::time::{Duration, Instant};

use super::Window;

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
pub(super) struct Stall {
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

impl<H> Window<H> {
    /// Follows the tenant's streak of failed sessions: one started or went on (`failed`), or
    /// the broker confirmed something of it (`shipped`) and it ended.
    pub(super) fn stall(
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
}

//! The share rule: how many buckets each live relay should hold, and the next step toward it.
//! Pure: no clock, no database.
use store::LEASE_BUCKETS;

/// What the core should do next with its leases. Pure: no clock, no database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeaseStep {
    /// Claim up to this many free or stale buckets.
    Claim(u16),
    /// Give up this many buckets (revoke, then release).
    Shed(u16),
    /// At its share.
    Hold,
}

/// The share rule: `ceil(buckets / members)` each; the sum of shares covers every bucket, so no
/// bucket stays unowned while a relay lives, and no relay holds more than one above another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LeasePlan {
    /// Buckets in all.
    pub(crate) buckets: u16,
}

impl LeasePlan {
    /// The plan over [`LEASE_BUCKETS`].
    pub(crate) fn new() -> Self {
        Self {
            buckets: LEASE_BUCKETS,
        }
    }

    /// A relay's share when `members` relays are live (itself included).
    pub(crate) fn share(&self, members: u32) -> u16 {
        let members = members.max(1);
        u32::from(self.buckets)
            .div_ceil(members)
            .min(u32::from(self.buckets)) as u16
    }

    /// The step of a relay's first heartbeat: [`LeasePlan::step`] as if one more relay were
    /// starting beside it, so relays started together do not claim buckets they would hand
    /// over a heartbeat later. Costs a lone relay half its buckets until its second heartbeat,
    /// which the lease runner runs a quarter heartbeat after the first.
    pub(crate) fn first_step(&self, owned: usize, members: u32) -> LeaseStep {
        self.step(owned, members.max(1).saturating_add(1))
    }

    /// The next step for a relay holding `owned` buckets among `members` live relays.
    pub(crate) fn step(&self, owned: usize, members: u32) -> LeaseStep {
        let share = usize::from(self.share(members));
        if owned < share {
            LeaseStep::Claim((share - owned) as u16)
        } else if owned > share {
            LeaseStep::Shed((owned - share) as u16)
        } else {
            LeaseStep::Hold
        }
    }
}

impl Default for LeasePlan {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_bucket_and_differ_by_at_most_one() {
        let plan = LeasePlan::new();
        for members in 1..=200u32 {
            let share = u32::from(plan.share(members));
            assert!(share * members >= u32::from(LEASE_BUCKETS), "{members}");
            assert!(share >= 1);
        }
        assert_eq!(plan.share(1), 128);
        assert_eq!(plan.share(3), 43);
        assert_eq!(plan.step(0, 2), LeaseStep::Claim(64));
        assert_eq!(plan.step(128, 2), LeaseStep::Shed(64));
        assert_eq!(plan.step(43, 3), LeaseStep::Hold);
        assert_eq!(plan.step(5, 0), LeaseStep::Claim(123));
        // A first heartbeat leaves room for one more relay starting beside it.
        assert_eq!(plan.first_step(0, 1), LeaseStep::Claim(64));
        assert_eq!(plan.first_step(0, 2), LeaseStep::Claim(43));
        assert_eq!(plan.first_step(0, 0), LeaseStep::Claim(64));
    }
}

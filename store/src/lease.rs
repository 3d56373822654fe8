//! Ownership of tenants across relays: lease buckets with epochs and expiry, in a table.
//!
//! Tenants hash into [`LEASE_BUCKETS`] buckets (FNV-1a 64 of the tenant id). A relay owns a
//! bucket while its row in `relay_lease` names it at its epoch; it renews every heartbeat
//! (each change of the row draws it a new beat). Another relay claims the bucket only once it
//! has seen the row unchanged for the longer of its TTL and the holder's, on its own monotonic
//! clock (the supervisor's sightings, `supervisor/src/core/leases/sightings.rs`), so no step of
//! PostgreSQL's clock moves a lease. Each change of owner increments the bucket's epoch
//! ([`LeaseEpoch`]). Nothing here is held in PostgreSQL's shared lock table, so the number of
//! tenants never touches the host.
//!
//! Fencing, two ways:
//! - **In PostgreSQL**: every ack and drain of the relay presents `(bucket, owner, epoch)`;
//!   `relay_ack_and_drain` refuses it ([`crate::Error::Fenced`]) once the lease is not current.
//! - **In time**: a relay's own view of a lease ([`Fence`]) is valid until the instant it sent
//!   its last successful renewal plus 90% of the TTL; another relay claims it no earlier than
//!   a TTL after it first read the row that renewal wrote. Publishers check the fence before
//!   every write, so a relay stops publishing a tenant before any other relay may claim it.
//!
//! Sharing: each relay registers in `relay_member`; its share is `ceil(buckets / members)`. A
//! relay above its share revokes its fences first and then releases the surplus; one below it
//! claims free or stale buckets. Those rules (the share, the book of leases held, the sightings)
//! are pure and live beside the supervisor's core that drives them (`supervisor/src/core/leases`);
//! this module keeps the fence cell ([`Lease`], [`Fence`]) and the SQL ([`LeaseStore`]).
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::key::TenantId;

mod sql;
pub use sql::{Claimable, LeaseRow, LeaseStore, MemberRow};

/// Number of lease buckets (rows of `relay_lease`, fixed by the migration).
pub const LEASE_BUCKETS: u16 = 128;

/// A lease bucket: the unit of ownership.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bucket(pub u16);

/// A bucket's lease epoch: raised by every change of its owner. A relay presents the epoch it
/// claimed with every fenced ack and drain, and PostgreSQL refuses it once the bucket has
/// moved on. (Not the database's [`crate::Epoch`], which rises when commits may have been lost.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseEpoch(pub i64);

impl std::fmt::Display for LeaseEpoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The bucket of a tenant: FNV-1a 64 over the tenant id's bytes, modulo [`LEASE_BUCKETS`].
pub fn bucket_of(tenant: &TenantId) -> Bucket {
    Bucket((crate::hash::fnv1a(&[tenant.as_str()]) % u64::from(LEASE_BUCKETS)) as u16)
}

/// The identity of one relay process (host, pid, start time): unique per start.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RelayId(Arc<str>);

impl RelayId {
    /// A fresh id for this process start.
    pub fn generate() -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "relay".into());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        Self(format!("{host}-{}-{nanos:x}-{seq}", std::process::id()).into())
    }

    /// The id as stored in `relay_lease.owner`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for RelayId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// Milliseconds since the process base, rounded down (0 means "revoked").
fn to_ms(at: Instant) -> u64 {
    at.saturating_duration_since(base()).as_millis() as u64
}

#[derive(Debug)]
struct LeaseInner {
    bucket: Bucket,
    owner: RelayId,
    epoch: LeaseEpoch,
    /// Valid strictly before this many ms after `base()`; 0 once revoked.
    valid_until_ms: AtomicU64,
}

/// One relay's view of one lease: what publishers and drainers check before each write and
/// ack. Cheap to clone. [`Fence::open`] is the fence of a caller without ownership (tests,
/// tools), always open.
#[derive(Clone, Debug)]
pub struct Fence {
    lease: Option<Arc<LeaseInner>>,
}

impl Fence {
    /// A fence that is always open and presents no lease to PostgreSQL.
    pub fn open() -> Self {
        Self { lease: None }
    }

    /// Whether work under this fence may still be published and drained now. (What the broker
    /// confirmed is acked under a closed fence too, if PostgreSQL finds the lease current:
    /// [`crate::Outbox::ack_and_drain`].)
    pub fn is_open(&self) -> bool {
        self.is_open_at(Instant::now())
    }

    /// Whether the fence is open at `now`.
    pub fn is_open_at(&self, now: Instant) -> bool {
        match &self.lease {
            None => true,
            Some(lease) => to_ms(now) < lease.valid_until_ms.load(Ordering::Acquire),
        }
    }

    /// `(bucket, owner, epoch)` presented to PostgreSQL, if this fence is a lease.
    pub fn lease(&self) -> Option<(Bucket, &RelayId, LeaseEpoch)> {
        self.lease
            .as_ref()
            .map(|lease| (lease.bucket, &lease.owner, lease.epoch))
    }
}

/// The writer's side of a fence: the supervisor's actor keeps one per lease its core's
/// book of leases holds, and extends or revokes it as the book decides. Drainers and publishers
/// read it through [`Fence`]s: a fence closes by time on its own, so no message has to reach a
/// publisher for it to stop writing under a lease that was not renewed.
#[derive(Debug)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

impl Lease {
    /// A lease of `bucket` at `epoch`, valid before `until`.
    pub fn new(bucket: Bucket, owner: RelayId, epoch: LeaseEpoch, until: Instant) -> Self {
        Self {
            inner: Arc::new(LeaseInner {
                bucket,
                owner,
                epoch,
                valid_until_ms: AtomicU64::new(to_ms(until).max(1)),
            }),
        }
    }

    /// The fence to hand to drainers and publishers.
    pub fn fence(&self) -> Fence {
        Fence {
            lease: Some(self.inner.clone()),
        }
    }

    /// Moves the validity forward to `until` (never backward, never after a revoke).
    pub fn extend(&self, until: Instant) {
        let until = to_ms(until).max(1);
        let _ = self.inner.valid_until_ms.fetch_update(
            Ordering::AcqRel,
            Ordering::Acquire,
            |current| (current != 0 && until > current).then_some(until),
        );
    }

    /// Closes the fence for good: nothing more is published or drained under it (an ack of
    /// what was confirmed still goes to PostgreSQL, which checks the lease itself).
    pub fn revoke(&self) {
        self.inner.valid_until_ms.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The fence cell a carried-out decision writes: extended forward only, closed for good.
    #[test]
    fn a_closed_fence_is_never_reopened_and_never_moves_backward() {
        let t0 = Instant::now();
        let lease = Lease::new(
            Bucket(3),
            RelayId::generate(),
            LeaseEpoch(2),
            t0 + Duration::from_secs(9),
        );
        let fence = lease.fence();
        assert!(fence.is_open_at(t0 + Duration::from_millis(8_900)));
        lease.extend(t0 + Duration::from_secs(1));
        assert!(
            fence.is_open_at(t0 + Duration::from_millis(8_900)),
            "never backward"
        );
        lease.extend(t0 + Duration::from_secs(20));
        assert!(fence.is_open_at(t0 + Duration::from_secs(19)));
        lease.revoke();
        assert!(!fence.is_open_at(t0));
        lease.extend(t0 + Duration::from_secs(30));
        assert!(!fence.is_open_at(t0), "never reopened");
        assert_eq!(
            fence.lease().map(|(bucket, _, epoch)| (bucket, epoch)),
            Some((Bucket(3), LeaseEpoch(2)))
        );
    }

    #[test]
    fn buckets_spread_tenants() {
        let mut counts = vec![0u32; usize::from(LEASE_BUCKETS)];
        for i in 0..12_800 {
            let tenant = TenantId::new(format!("tenant-{i}")).unwrap();
            counts[usize::from(bucket_of(&tenant).0)] += 1;
        }
        let (min, max) = (*counts.iter().min().unwrap(), *counts.iter().max().unwrap());
        assert!(min > 50 && max < 150, "min {min} max {max}");
        assert_eq!(Fence::open().lease(), None);
        assert!(Fence::open().is_open());
    }
}

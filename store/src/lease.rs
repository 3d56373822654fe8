//! Ownership of tenants across relays: lease buckets with epochs and expiry, in a table.
//!
//! Tenants hash into [`LEASE_BUCKETS`] buckets (FNV-1a 64 of the tenant id). A relay owns a
//! bucket while its row in `relay_lease` names it at its epoch; it renews every heartbeat
//! (each change of the row draws it a new beat). Another relay claims the bucket only once it
//! has seen the row unchanged for the longer of its TTL and the holder's, on its own monotonic
//! clock ([`Sightings`]), so no step of PostgreSQL's clock moves a lease. Each change of owner increments the bucket's epoch. Nothing here is
//! held in PostgreSQL's shared lock table, so the number of tenants never touches the host.
//!
//! Fencing, two ways:
//! - **In PostgreSQL**: every ack and drain of the relay presents `(bucket, owner, epoch)`;
//!   `relay_ack_and_drain` refuses it ([`crate::Error::Fenced`]) once the lease is not current.
//! - **In time**: a relay's own view of a lease ([`Fence`]) is valid until the instant it sent
//!   its last successful renewal plus 90% of the TTL; another relay claims it no earlier than
//!   a TTL after it first read the row that renewal wrote ([`Sightings`]). Publishers check the
//!   fence before every write, so a relay stops publishing a tenant before any other relay may
//!   claim it.
//!
//! Sharing: each relay registers in `relay_member`; its share is `ceil(buckets / members)`. A
//! relay above its share revokes its fences first and then releases the surplus; one below it
//! claims free or stale buckets ([`LeasePlan`], pure and unit-tested). Which leases a relay
//! holds, and when their fences open, extend and close, is decided by one pure [`LeaseBook`]
//! (the supervisor's core owns it); [`LeaseStore`] only runs the SQL.
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::key::TenantId;

mod sightings;
mod sql;
pub use sightings::{Claimable, LeaseRow, MemberRow, Sightings};
pub use sql::{BucketHolder, LeaseStore};

/// Number of lease buckets (rows of `relay_lease`, fixed by the migration).
pub const LEASE_BUCKETS: u16 = 128;

/// A lease bucket: the unit of ownership.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bucket(pub u16);

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
    epoch: i64,
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
    pub fn lease(&self) -> Option<(Bucket, &RelayId, i64)> {
        self.lease
            .as_ref()
            .map(|lease| (lease.bucket, &lease.owner, lease.epoch))
    }
}

/// The writer's side of a fence: the supervisor's actor keeps one per lease its core's
/// [`LeaseBook`] holds, and extends or revokes it as the book decides. Drainers and publishers
/// read it through [`Fence`]s: a fence closes by time on its own, so no message has to reach a
/// publisher for it to stop writing under a lease that was not renewed.
#[derive(Debug)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

impl Lease {
    /// A lease of `bucket` at `epoch`, valid before `until`.
    pub fn new(bucket: Bucket, owner: RelayId, epoch: i64, until: Instant) -> Self {
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

/// What a keeper should do next with its leases. Pure: no clock, no database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseStep {
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
pub struct LeasePlan {
    /// Buckets in all.
    pub buckets: u16,
}

impl LeasePlan {
    /// The plan over [`LEASE_BUCKETS`].
    pub fn new() -> Self {
        Self {
            buckets: LEASE_BUCKETS,
        }
    }

    /// A relay's share when `members` relays are live (itself included).
    pub fn share(&self, members: u32) -> u16 {
        let members = members.max(1);
        u32::from(self.buckets)
            .div_ceil(members)
            .min(u32::from(self.buckets)) as u16
    }

    /// The step of a relay's first heartbeat: [`LeasePlan::step`] as if one more relay were
    /// starting beside it, so relays started together do not claim buckets they would hand
    /// over a heartbeat later. Costs a lone relay half its buckets until its second heartbeat,
    /// which the keeper runs a quarter heartbeat after the first.
    pub fn first_step(&self, owned: usize, members: u32) -> LeaseStep {
        self.step(owned, members.max(1).saturating_add(1))
    }

    /// The next step for a relay holding `owned` buckets among `members` live relays.
    pub fn step(&self, owned: usize, members: u32) -> LeaseStep {
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

/// The leases one relay holds, and how renewals, claims, handovers and sheds change them. Pure:
/// instants are passed in and the book holds plain values, so the rules are unit-tested without
/// a database or a clock. The fences publishers and drainers read ([`Lease`], [`Fence`]) are
/// written by whoever carries the book's decisions out, as the book says: a lease gained opens
/// one ([`Held::until`]), a renewal extends every one still held, and a lease that leaves the
/// book closes its fence before it is released.
#[derive(Debug)]
pub struct LeaseBook {
    ttl: Duration,
    held: BTreeMap<Bucket, Held>,
    /// Held buckets being handed over (a planned move), since when: still renewed, fences
    /// open, so what is in flight under them settles and is acked; no new drainer starts on
    /// them. Each is released once its drainers are done, or after the grace.
    leaving: BTreeMap<Bucket, Instant>,
}

/// A lease the book holds: its epoch, and the instant its fence closes unless renewed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// The bucket's epoch when this relay claimed it (presented to PostgreSQL).
    pub epoch: i64,
    /// The fence is open strictly before this.
    pub until: Instant,
}

impl LeaseBook {
    /// An empty book of leases of `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            held: BTreeMap::new(),
            leaving: BTreeMap::new(),
        }
    }

    /// Buckets held and not being handed over: what counts toward this relay's share.
    pub fn staying(&self) -> usize {
        self.held.len() - self.leaving.len()
    }

    /// Whether `bucket` is held and not being handed over: drainers may start on it.
    pub fn is_staying(&self, bucket: Bucket) -> bool {
        self.held.contains_key(&bucket) && !self.leaving.contains_key(&bucket)
    }

    /// Whether `bucket` is being handed over: its drainers finish, none starts.
    pub fn is_leaving(&self, bucket: Bucket) -> bool {
        self.leaving.contains_key(&bucket)
    }

    /// Buckets being handed over.
    pub fn leaving(&self) -> Vec<Bucket> {
        self.leaving.keys().copied().collect()
    }

    /// Drops `bucket` from the book (its fence must close now); its epoch, to release it.
    fn drop_lease(&mut self, bucket: Bucket) -> Option<(Bucket, i64)> {
        self.leaving.remove(&bucket);
        self.held.remove(&bucket).map(|held| (bucket, held.epoch))
    }

    /// A planned move of `n` buckets (the highest-numbered of those staying) starts at `now`:
    /// they stay held, renewed and fenced open until [`LeaseBook::handed_over`] (their drainers
    /// settled what they had in flight) or [`LeaseBook::overdue`]. Returns them.
    pub fn hand_over(&mut self, n: u16, now: Instant) -> Vec<Bucket> {
        let chosen: Vec<Bucket> = self
            .held
            .keys()
            .rev()
            .filter(|bucket| !self.leaving.contains_key(bucket))
            .take(usize::from(n))
            .copied()
            .collect();
        for bucket in &chosen {
            self.leaving.insert(*bucket, now);
        }
        chosen
    }

    /// Everything in flight under `bucket` (being handed over) settled: it leaves the book
    /// (close its fence). Returns it with its epoch, to release; `None` if it is not leaving
    /// (lost meanwhile, say).
    pub fn handed_over(&mut self, bucket: Bucket) -> Option<(Bucket, i64)> {
        if !self.leaving.contains_key(&bucket) {
            return None;
        }
        self.drop_lease(bucket)
    }

    /// Buckets handed over for `grace` or longer by `now` without settling: they leave the
    /// book (close their fences; what was in flight is sent again by the next owner: at most
    /// what was in flight). Returned with their epochs, to release. None while the broker holds
    /// a connection of this relay blocked (`broker_blocked`): what was written on it may still
    /// land, so no other relay may send those events yet (the handover waits for the alarm).
    pub fn overdue(
        &mut self,
        now: Instant,
        grace: Duration,
        broker_blocked: bool,
    ) -> Vec<(Bucket, i64)> {
        if broker_blocked {
            return Vec::new();
        }
        let late: Vec<Bucket> = self
            .leaving
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) >= grace)
            .map(|(bucket, _)| *bucket)
            .collect();
        late.into_iter()
            .filter_map(|bucket| self.drop_lease(bucket))
            .collect()
    }

    /// Buckets held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// What is held: (bucket, epoch), the input of [`LeaseStore::renew`].
    pub fn held(&self) -> Vec<(Bucket, i64)> {
        self.held
            .iter()
            .map(|(bucket, held)| (*bucket, held.epoch))
            .collect()
    }

    /// The buckets held, ascending.
    pub fn buckets(&self) -> impl Iterator<Item = Bucket> + '_ {
        self.held.keys().copied()
    }

    /// The lease on `bucket`, if held.
    pub fn get(&self, bucket: Bucket) -> Option<Held> {
        self.held.get(&bucket).copied()
    }

    /// The local deadline of a renewal sent at `sent`: 90% of the TTL, so clock-rate
    /// differences between this host and a claimant's cannot let the fence outlive the wait of
    /// a claimant that saw the renewal's beat stand still a TTL ([`Sightings`]).
    fn deadline(&self, sent: Instant) -> Instant {
        sent + self.ttl.mul_f64(0.9)
    }

    /// A renewal sent at `sent` came back with `renewed` `(bucket, epoch)`: those still held
    /// are extended to the returned instant (never backward), every other held lease is lost
    /// (expired or taken over: close its fence) and returned.
    pub fn renewed(&mut self, renewed: &[(Bucket, i64)], sent: Instant) -> (Instant, Vec<Bucket>) {
        let until = self.deadline(sent);
        let current: BTreeMap<Bucket, i64> = renewed.iter().copied().collect();
        let mut lost = Vec::new();
        self.held.retain(|bucket, held| {
            if current.get(bucket) == Some(&held.epoch) {
                held.until = held.until.max(until);
                true
            } else {
                lost.push(*bucket);
                false
            }
        });
        for bucket in &lost {
            self.leaving.remove(bucket);
        }
        (until, lost)
    }

    /// Claims sent at `sent` came back with `claimed` `(bucket, epoch)`: each is held now, its
    /// fence open until the returned lease's `until` (one held at an older epoch is replaced:
    /// close that fence first).
    pub fn claimed(&mut self, claimed: &[(Bucket, i64)], sent: Instant) -> Vec<(Bucket, Held)> {
        let until = self.deadline(sent);
        let mut gained = Vec::new();
        for &(bucket, epoch) in claimed {
            self.leaving.remove(&bucket);
            let held = Held { epoch, until };
            self.held.insert(bucket, held);
            gained.push((bucket, held));
        }
        gained
    }

    /// Leases whose fence closed by `now` without a renewal (e.g. PostgreSQL slow or
    /// unreachable): dropped from the book and returned with their epochs (release them, so
    /// they are claimable at once; they are never renewed again either way).
    pub fn expire(&mut self, now: Instant) -> Vec<(Bucket, i64)> {
        let lapsed: Vec<Bucket> = self
            .held
            .iter()
            .filter(|(_, held)| now >= held.until)
            .map(|(bucket, _)| *bucket)
            .collect();
        lapsed
            .into_iter()
            .filter_map(|bucket| self.drop_lease(bucket))
            .collect()
    }

    /// Everything leaves the book (shutdown: close every fence); returns what was held, to
    /// release.
    pub fn revoke_all(&mut self) -> Vec<(Bucket, i64)> {
        self.leaving.clear();
        std::mem::take(&mut self.held)
            .into_iter()
            .map(|(bucket, held)| (bucket, held.epoch))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(ttl_ms: u64) -> LeaseBook {
        LeaseBook::new(Duration::from_millis(ttl_ms))
    }

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

    #[test]
    fn a_renewal_extends_what_came_back_and_loses_the_rest() {
        let mut book = book(10_000);
        let t0 = Instant::now();
        let gained = book.claimed(&[(Bucket(1), 7), (Bucket(2), 3)], t0);
        assert_eq!(gained.len(), 2);
        assert!(gained.iter().all(|(_, held)| held.until > t0));
        // Bucket 2 was taken over (epoch moved on): lost.
        let later = t0 + Duration::from_secs(5);
        let (until, lost) = book.renewed(&[(Bucket(1), 7), (Bucket(2), 4)], later);
        assert_eq!(lost, vec![Bucket(2)]);
        assert_eq!(book.get(Bucket(1)).map(|held| held.until), Some(until));
        assert_eq!(until, later + Duration::from_secs(9));
        assert_eq!(book.get(Bucket(2)), None);
        assert_eq!(book.len(), 1);
        // A late answer to an older renewal never moves a fence backward.
        let (_, lost) = book.renewed(&[(Bucket(1), 7)], t0);
        assert!(lost.is_empty());
        assert_eq!(book.get(Bucket(1)).map(|held| held.until), Some(until));
    }

    #[test]
    fn a_fence_closes_before_the_row_can_be_claimed() {
        let mut book = book(10_000);
        let sent = Instant::now();
        let gained = book.claimed(&[(Bucket(0), 1)], sent);
        // A claimant waits 10 s from its first read of the row (after the commit, so after
        // `sent`); the fence closes at sent + 9 s.
        assert_eq!(gained[0].1.until, sent + Duration::from_millis(9_000));
        // Without renewals the book drops it and reports it lost.
        assert!(book.expire(sent + Duration::from_secs(5)).is_empty());
        assert_eq!(book.held(), vec![(Bucket(0), 1)]);
        assert_eq!(
            book.expire(sent + Duration::from_secs(9)),
            vec![(Bucket(0), 1)]
        );
        assert!(book.is_empty());
        assert!(
            book.held().is_empty(),
            "a lapsed lease is never renewed again"
        );
    }

    #[test]
    fn a_lease_that_left_the_book_never_comes_back_by_a_renewal() {
        let mut book = book(10_000);
        let t0 = Instant::now();
        book.claimed(&[(Bucket(5), 1), (Bucket(9), 1)], t0);
        book.hand_over(1, t0);
        assert_eq!(book.handed_over(Bucket(9)), Some((Bucket(9), 1)));
        // A late renewal that still lists the released bucket does not bring it back.
        let (_, lost) = book.renewed(&[(Bucket(5), 1), (Bucket(9), 1)], t0);
        assert!(lost.is_empty());
        assert_eq!(book.get(Bucket(9)), None);
        assert!(book.get(Bucket(5)).is_some());
        assert_eq!(book.revoke_all(), vec![(Bucket(5), 1)]);
        assert!(book.is_empty() && book.leaving().is_empty());
    }

    /// A planned move keeps the bucket held and renewed (what is in flight under it is acked),
    /// no longer counts toward the share, and leaves the book only once handed over.
    #[test]
    fn a_bucket_handed_over_stays_held_until_its_batches_settle() {
        let mut book = book(10_000);
        let t0 = Instant::now();
        book.claimed(&[(Bucket(1), 1), (Bucket(2), 1), (Bucket(3), 1)], t0);
        assert_eq!(book.hand_over(1, t0), vec![Bucket(3)]);
        assert_eq!(
            book.hand_over(1, t0),
            vec![Bucket(2)],
            "never the same bucket twice"
        );
        assert_eq!((book.len(), book.staying()), (3, 1));
        assert!(book.is_leaving(Bucket(3)) && !book.is_staying(Bucket(3)));
        assert!(book.is_staying(Bucket(1)) && !book.is_leaving(Bucket(1)));
        // Still renewed while leaving.
        let later = t0 + Duration::from_secs(5);
        let (until, lost) = book.renewed(&book.held(), later);
        assert!(lost.is_empty());
        assert_eq!(book.get(Bucket(3)).map(|held| held.until), Some(until));
        // Settled: it leaves the book, to be released.
        assert_eq!(book.handed_over(Bucket(3)), Some((Bucket(3), 1)));
        assert_eq!(book.handed_over(Bucket(3)), None, "once");
        assert_eq!(book.handed_over(Bucket(1)), None, "not leaving");
        assert_eq!(book.leaving(), vec![Bucket(2)]);
    }

    /// A handover that does not settle within the grace is forced (and what was in flight is
    /// the next owner's to send again); never while the broker blocks a connection.
    #[test]
    fn a_handover_that_does_not_settle_is_forced_after_the_grace() {
        let mut book = book(10_000);
        let t0 = Instant::now();
        book.claimed(&[(Bucket(1), 4)], t0);
        book.hand_over(1, t0);
        let grace = Duration::from_secs(3);
        assert!(
            book.overdue(t0 + Duration::from_secs(2), grace, false)
                .is_empty()
        );
        // Never while the broker blocks a connection: what was written on it may still land.
        assert!(
            book.overdue(t0 + Duration::from_secs(60), grace, true)
                .is_empty()
        );
        assert_eq!(book.leaving(), vec![Bucket(1)], "still handing over");
        assert_eq!(
            book.overdue(t0 + Duration::from_secs(3), grace, false),
            vec![(Bucket(1), 4)]
        );
        assert!(book.is_empty() && book.leaving().is_empty());
        // A bucket lost while leaving leaves both sets.
        book.claimed(&[(Bucket(7), 1)], t0);
        book.hand_over(1, t0);
        assert_eq!(book.renewed(&[], t0).1, vec![Bucket(7)]);
        assert!(book.leaving().is_empty());
    }

    /// The fence cell a carried-out decision writes: extended forward only, closed for good.
    #[test]
    fn a_closed_fence_is_never_reopened_and_never_moves_backward() {
        let t0 = Instant::now();
        let lease = Lease::new(
            Bucket(3),
            RelayId::generate(),
            2,
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
            Some((Bucket(3), 2))
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

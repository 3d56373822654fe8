//! The leases one relay holds ([`LeaseBook`]): renewals, claims, handovers, expiry and sheds.
//! Pure: instants are passed in.
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use store::{Bucket, LeaseEpoch};

/// The leases one relay holds, and how renewals, claims, handovers and sheds change them. Pure:
/// instants are passed in and the book holds plain values, so the rules are unit-tested without
/// a database or a clock. The fences publishers and drainers read ([`store::Lease`], [`store::Fence`]) are
/// written by whoever carries the book's decisions out, as the book says: a lease gained opens
/// one ([`Held::until`]), a renewal extends every one still held, and a lease that leaves the
/// book closes its fence before it is released.
#[derive(Debug)]
pub(crate) struct LeaseBook {
    ttl: Duration,
    held: BTreeMap<Bucket, Held>,
    /// Held buckets being handed over (a planned move), since when: still renewed, fences
    /// open, so what is in flight under them settles and is acked; no new drainer starts on
    /// them. Each is released once its drainers are done, or after the grace.
    leaving: BTreeMap<Bucket, Instant>,
}

/// A lease the book holds: its epoch, and the instant its fence closes unless renewed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Held {
    /// The bucket's epoch when this relay claimed it (presented to PostgreSQL).
    pub(crate) epoch: LeaseEpoch,
    /// The fence is open strictly before this.
    pub(crate) until: Instant,
}

impl LeaseBook {
    /// An empty book of leases of `ttl`.
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            held: BTreeMap::new(),
            leaving: BTreeMap::new(),
        }
    }

    /// Buckets held and not being handed over: what counts toward this relay's share.
    pub(crate) fn staying(&self) -> usize {
        self.held.len() - self.leaving.len()
    }

    /// Whether `bucket` is held and not being handed over: drainers may start on it.
    pub(crate) fn is_staying(&self, bucket: Bucket) -> bool {
        self.held.contains_key(&bucket) && !self.leaving.contains_key(&bucket)
    }

    /// Whether `bucket` is being handed over: its drainers finish, none starts.
    pub(crate) fn is_leaving(&self, bucket: Bucket) -> bool {
        self.leaving.contains_key(&bucket)
    }

    /// Buckets being handed over.
    #[cfg(test)]
    pub(crate) fn leaving(&self) -> Vec<Bucket> {
        self.leaving.keys().copied().collect()
    }

    /// Drops `bucket` from the book (its fence must close now); its epoch, to release it.
    fn drop_lease(&mut self, bucket: Bucket) -> Option<(Bucket, LeaseEpoch)> {
        self.leaving.remove(&bucket);
        self.held.remove(&bucket).map(|held| (bucket, held.epoch))
    }

    /// A planned move of `n` buckets (the highest-numbered of those staying) starts at `now`:
    /// they stay held, renewed and fenced open until [`LeaseBook::handed_over`] (their drainers
    /// settled what they had in flight) or [`LeaseBook::overdue`]. Returns them.
    pub(crate) fn hand_over(&mut self, n: u16, now: Instant) -> Vec<Bucket> {
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
    pub(crate) fn handed_over(&mut self, bucket: Bucket) -> Option<(Bucket, LeaseEpoch)> {
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
    pub(crate) fn overdue(
        &mut self,
        now: Instant,
        grace: Duration,
        broker_blocked: bool,
    ) -> Vec<(Bucket, LeaseEpoch)> {
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
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether nothing is held.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// What is held: (bucket, epoch), the input of [`store::LeaseStore::renew`].
    pub(crate) fn held(&self) -> Vec<(Bucket, LeaseEpoch)> {
        self.held
            .iter()
            .map(|(bucket, held)| (*bucket, held.epoch))
            .collect()
    }

    /// The buckets held, ascending.
    pub(crate) fn buckets(&self) -> impl Iterator<Item = Bucket> + '_ {
        self.held.keys().copied()
    }

    /// The lease on `bucket`, if held.
    pub(crate) fn get(&self, bucket: Bucket) -> Option<Held> {
        self.held.get(&bucket).copied()
    }

    /// The local deadline of a renewal sent at `sent`: 90% of the TTL, so clock-rate
    /// differences between this host and a claimant's cannot let the fence outlive the wait of
    /// a claimant that saw the renewal's beat stand still a TTL ([`super::Sightings`]).
    fn deadline(&self, sent: Instant) -> Instant {
        sent + self.ttl.mul_f64(0.9)
    }

    /// A renewal sent at `sent` came back with `renewed` `(bucket, epoch)`: those still held
    /// are extended to the returned instant (never backward), every other held lease is lost
    /// (expired or taken over: close its fence) and returned.
    pub(crate) fn renewed(
        &mut self,
        renewed: &[(Bucket, LeaseEpoch)],
        sent: Instant,
    ) -> (Instant, Vec<Bucket>) {
        let until = self.deadline(sent);
        let current: BTreeMap<Bucket, LeaseEpoch> = renewed.iter().copied().collect();
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
    pub(crate) fn claimed(
        &mut self,
        claimed: &[(Bucket, LeaseEpoch)],
        sent: Instant,
    ) -> Vec<(Bucket, Held)> {
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
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<(Bucket, LeaseEpoch)> {
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
    pub(crate) fn revoke_all(&mut self) -> Vec<(Bucket, LeaseEpoch)> {
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
    fn a_renewal_extends_what_came_back_and_loses_the_rest() {
        let mut book = book(10_000);
        let t0 = Instant::now();
        let gained = book.claimed(
            &[(Bucket(1), LeaseEpoch(7)), (Bucket(2), LeaseEpoch(3))],
            t0,
        );
        assert_eq!(gained.len(), 2);
        assert!(gained.iter().all(|(_, held)| held.until > t0));
        // Bucket 2 was taken over (epoch moved on): lost.
        let later = t0 + Duration::from_secs(5);
        let (until, lost) = book.renewed(
            &[(Bucket(1), LeaseEpoch(7)), (Bucket(2), LeaseEpoch(4))],
            later,
        );
        assert_eq!(lost, vec![Bucket(2)]);
        assert_eq!(book.get(Bucket(1)).map(|held| held.until), Some(until));
        assert_eq!(until, later + Duration::from_secs(9));
        assert_eq!(book.get(Bucket(2)), None);
        assert_eq!(book.len(), 1);
        // A late answer to an older renewal never moves a fence backward.
        let (_, lost) = book.renewed(&[(Bucket(1), LeaseEpoch(7))], t0);
        assert!(lost.is_empty());
        assert_eq!(book.get(Bucket(1)).map(|held| held.until), Some(until));
    }

    #[test]
    fn a_fence_closes_before_the_row_can_be_claimed() {
        let mut book = book(10_000);
        let sent = Instant::now();
        let gained = book.claimed(&[(Bucket(0), LeaseEpoch(1))], sent);
        // A claimant waits 10 s from its first read of the row (after the commit, so after
        // `sent`); the fence closes at sent + 9 s.
        assert_eq!(gained[0].1.until, sent + Duration::from_millis(9_000));
        // Without renewals the book drops it and reports it lost.
        assert!(book.expire(sent + Duration::from_secs(5)).is_empty());
        assert_eq!(book.held(), vec![(Bucket(0), LeaseEpoch(1))]);
        assert_eq!(
            book.expire(sent + Duration::from_secs(9)),
            vec![(Bucket(0), LeaseEpoch(1))]
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
        book.claimed(
            &[(Bucket(5), LeaseEpoch(1)), (Bucket(9), LeaseEpoch(1))],
            t0,
        );
        book.hand_over(1, t0);
        assert_eq!(
            book.handed_over(Bucket(9)),
            Some((Bucket(9), LeaseEpoch(1)))
        );
        // A late renewal that still lists the released bucket does not bring it back.
        let (_, lost) = book.renewed(
            &[(Bucket(5), LeaseEpoch(1)), (Bucket(9), LeaseEpoch(1))],
            t0,
        );
        assert!(lost.is_empty());
        assert_eq!(book.get(Bucket(9)), None);
        assert!(book.get(Bucket(5)).is_some());
        assert_eq!(book.revoke_all(), vec![(Bucket(5), LeaseEpoch(1))]);
        assert!(book.is_empty() && book.leaving().is_empty());
    }

    /// A planned move keeps the bucket held and renewed (what is in flight under it is acked),
    /// no longer counts toward the share, and leaves the book only once handed over.
    #[test]
    fn a_bucket_handed_over_stays_held_until_its_batches_settle() {
        let mut book = book(10_000);
        let t0 = Instant::now();
        book.claimed(
            &[
                (Bucket(1), LeaseEpoch(1)),
                (Bucket(2), LeaseEpoch(1)),
                (Bucket(3), LeaseEpoch(1)),
            ],
            t0,
        );
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
        assert_eq!(
            book.handed_over(Bucket(3)),
            Some((Bucket(3), LeaseEpoch(1)))
        );
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
        book.claimed(&[(Bucket(1), LeaseEpoch(4))], t0);
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
            vec![(Bucket(1), LeaseEpoch(4))]
        );
        assert!(book.is_empty() && book.leaving().is_empty());
        // A bucket lost while leaving leaves both sets.
        book.claimed(&[(Bucket(7), LeaseEpoch(1))], t0);
        book.hand_over(1, t0);
        assert_eq!(book.renewed(&[], t0).1, vec![Bucket(7)]);
        assert!(book.leaving().is_empty());
    }
}

//! What this relay saw of the lease table and of the membership, on its own monotonic clock:
//! the rule that keeps leases safe and live whatever PostgreSQL's wall clock does.
//!
//! A bucket is claimable from another relay only once this relay has seen its row unchanged
//! (the same owner, epoch and beat, a number every change of the row draws anew) for the
//! longer of its own TTL and the one the row's writer gave it, on its own clock, counted from
//! the first time it saw those values; a free (released) bucket is claimable at once. The claim presents the epoch and beat seen, and PostgreSQL takes the
//! bucket only if both are still the same. Why that is safe: the holder's fence closes 0.9 TTL
//! after it sent the renewal that wrote that beat ([`super::book::LeaseBook`]), that renewal
//! committed before the row was read, and the row was read before this relay first saw it: so
//! the holder's fence is closed before the claim. No wall clock takes part, so a step of
//! PostgreSQL's clock (forward or back, by any amount) neither lets a bucket be claimed early
//! nor holds a dead relay's buckets for the length of the step. What remains is the rate of
//! the two relays' monotonic clocks, which the 10% margin covers. What it assumes of the
//! database: a commit it reported is never taken back (the lease pool commits synchronously;
//! an asynchronous failover can break that, docs/operations.md), and a beat once replaced never
//! comes back (beats are random, so even a history taken back draws new ones).
//!
//! Membership likewise: another relay counts as live while its member row's beat moved within
//! a TTL of this relay's clock (a relay seen for the first time counts as live).
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use store::{Bucket, Claimable, LeaseRow, MemberRow, RelayId};

#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen<T> {
    value: T,
    /// When this relay first saw `value` (unchanged since).
    since: Instant,
}

/// This relay's sightings of the lease rows and the members. Pure: the caller passes the rows
/// it read and the instant it had them (any instant after the read; later is safer).
#[derive(Clone, Debug)]
pub(crate) struct Sightings {
    ttl: Duration,
    /// Each lease row as last read (every change of a row draws a new beat, so a row equal to
    /// the one seen before has not changed since).
    buckets: BTreeMap<Bucket, Seen<LeaseRow>>,
    members: HashMap<String, Seen<i64>>,
}

impl Sightings {
    /// No sightings yet, for leases of `ttl`.
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            buckets: BTreeMap::new(),
            members: HashMap::new(),
        }
    }

    /// The lease table read (every row), had at `now`.
    pub(crate) fn saw_leases(&mut self, rows: &[LeaseRow], now: Instant) {
        let mut buckets = BTreeMap::new();
        for row in rows {
            let since = match self.buckets.get(&row.bucket) {
                Some(seen) if seen.value == *row => seen.since,
                _ => now,
            };
            buckets.insert(
                row.bucket,
                Seen {
                    value: row.clone(),
                    since,
                },
            );
        }
        self.buckets = buckets;
    }

    /// The membership read (every row), had at `now`.
    pub(crate) fn saw_members(&mut self, rows: &[MemberRow], now: Instant) {
        let mut members = HashMap::with_capacity(rows.len());
        for row in rows {
            let since = match self.members.get(&row.relay) {
                Some(seen) if seen.value == row.beat => seen.since,
                _ => now,
            };
            members.insert(
                row.relay.clone(),
                Seen {
                    value: row.beat,
                    since,
                },
            );
        }
        self.members = members;
    }

    /// The live relays at `now`, `me` included: itself, and each other relay whose beat moved
    /// within a TTL.
    pub(crate) fn members(&self, me: &RelayId, now: Instant) -> u32 {
        let others = self
            .members
            .iter()
            .filter(|(relay, seen)| relay.as_str() != me.as_str() && now < seen.since + self.ttl)
            .count();
        u32::try_from(others).unwrap_or(u32::MAX).saturating_add(1)
    }

    /// The buckets claimable at `now`, in bucket order: free ones, and those seen unchanged for
    /// the longer of this relay's TTL and the row's.
    pub(crate) fn claimable(&self, now: Instant) -> Vec<Claimable> {
        self.buckets
            .values()
            .map(|seen| (&seen.value, seen.since))
            .filter(|(row, since)| row.owner.is_none() || now >= *since + self.ttl.max(row.ttl))
            .map(|(row, _)| Claimable {
                bucket: row.bucket,
                epoch: row.epoch,
                beat: row.beat,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use store::LeaseEpoch;

    use super::*;

    const TTL: Duration = Duration::from_millis(1000);

    fn row(bucket: u16, owner: Option<&str>, epoch: i64, beat: i64) -> LeaseRow {
        LeaseRow {
            bucket: Bucket(bucket),
            owner: owner.map(str::to_owned),
            epoch: LeaseEpoch(epoch),
            beat,
            ttl: TTL,
        }
    }

    /// A holder with a longer TTL than this relay's is waited for as long as its own TTL.
    #[test]
    fn a_holder_with_a_longer_ttl_is_waited_for_its_ttl() {
        let t0 = Instant::now();
        let mut seen = Sightings::new(TTL);
        let long = LeaseRow {
            ttl: TTL * 3,
            ..row(1, Some("a"), 2, 9)
        };
        seen.saw_leases(&[long], t0);
        assert!(seen.claimable(t0 + TTL * 2).is_empty());
        assert_eq!(buckets(&seen.claimable(t0 + TTL * 3)), vec![1]);
    }

    fn buckets(claimable: &[Claimable]) -> Vec<u16> {
        claimable.iter().map(|c| c.bucket.0).collect()
    }

    #[test]
    fn a_free_bucket_is_claimable_at_once_and_a_held_one_after_a_ttl_unchanged() {
        let t0 = Instant::now();
        let mut seen = Sightings::new(TTL);
        seen.saw_leases(&[row(0, None, 3, 7), row(1, Some("a"), 2, 9)], t0);
        assert_eq!(buckets(&seen.claimable(t0)), vec![0]);
        seen.saw_leases(&[row(0, None, 3, 7), row(1, Some("a"), 2, 9)], t0 + TTL / 2);
        assert_eq!(
            buckets(&seen.claimable(t0 + TTL - Duration::from_millis(1))),
            vec![0]
        );
        let at = seen.claimable(t0 + TTL);
        assert_eq!(
            at,
            vec![
                Claimable {
                    bucket: Bucket(0),
                    epoch: LeaseEpoch(3),
                    beat: 7
                },
                Claimable {
                    bucket: Bucket(1),
                    epoch: LeaseEpoch(2),
                    beat: 9
                }
            ],
            "the claim presents what was seen"
        );
    }

    #[test]
    fn a_renewal_seen_starts_the_count_again() {
        let t0 = Instant::now();
        let mut seen = Sightings::new(TTL);
        seen.saw_leases(&[row(1, Some("a"), 2, 9)], t0);
        seen.saw_leases(&[row(1, Some("a"), 2, 10)], t0 + TTL / 2);
        assert!(seen.claimable(t0 + TTL).is_empty());
        assert_eq!(buckets(&seen.claimable(t0 + TTL / 2 + TTL)), vec![1]);
    }

    #[test]
    fn a_new_owner_seen_starts_the_count_again() {
        let t0 = Instant::now();
        let mut seen = Sightings::new(TTL);
        seen.saw_leases(&[row(1, Some("a"), 2, 9)], t0);
        // Taken by b (epoch and beat move), or released and claimed again between two reads.
        seen.saw_leases(&[row(1, Some("b"), 3, 10)], t0 + TTL);
        assert!(seen.claimable(t0 + TTL).is_empty());
    }

    #[test]
    fn members_are_live_while_their_beat_moves_and_never_fewer_than_one() {
        let t0 = Instant::now();
        let me = RelayId::generate();
        let mut seen = Sightings::new(TTL);
        assert_eq!(seen.members(&me, t0), 1);
        let rows = |a: i64, b: i64| {
            vec![
                MemberRow {
                    relay: me.as_str().to_owned(),
                    beat: 0,
                },
                MemberRow {
                    relay: "a".into(),
                    beat: a,
                },
                MemberRow {
                    relay: "b".into(),
                    beat: b,
                },
            ]
        };
        seen.saw_members(&rows(1, 1), t0);
        assert_eq!(seen.members(&me, t0), 3, "seen for the first time: live");
        seen.saw_members(&rows(2, 1), t0 + TTL / 2);
        assert_eq!(seen.members(&me, t0 + TTL), 2, "b's beat stood still a TTL");
        seen.saw_members(&rows(2, 1), t0 + TTL * 3);
        assert_eq!(seen.members(&me, t0 + TTL * 3), 1);
        seen.saw_members(&rows(2, 2), t0 + TTL * 4);
        assert_eq!(seen.members(&me, t0 + TTL * 4), 2, "b beats again");
    }

    /// One holder renewing on its own schedule with a TTL of its own (fences from `LeaseBook`:
    /// 0.9 of it after each renewal it sent), PostgreSQL committing each renewal some time after it was sent and
    /// a claimant reading the row at arbitrary instants, possibly after the holder stopped:
    /// whenever the claimant finds the bucket claimable and the claim's (epoch, beat) is still
    /// the row's, the holder's fence is closed. No wall clock is involved, so nothing a step
    /// of PostgreSQL's clock does can appear here.
    #[derive(Clone, Debug)]
    enum Event {
        /// The holder sends a renewal, committed `delay_ms` later.
        Renew { delay_ms: u16 },
        /// The claimant reads the row, `lag_ms` after the read before it has the answer.
        Read { lag_ms: u16 },
        /// Time passes.
        Wait { ms: u16 },
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            (0u16..1500).prop_map(|delay_ms| Event::Renew { delay_ms }),
            (0u16..300).prop_map(|lag_ms| Event::Read { lag_ms }),
            (1u16..800).prop_map(|ms| Event::Wait { ms }),
        ]
    }

    /// The row as PostgreSQL has it, and the holder's fence.
    struct Holder {
        /// Its TTL (its own setting, not necessarily the claimant's).
        ttl: Duration,
        beat: i64,
        /// Renewals sent and not committed yet: (sent, commits at).
        pending: Vec<(Instant, Instant)>,
        fence_until: Instant,
    }

    impl Holder {
        /// Renewals whose commit instant came are in the row; the holder's fence counts from
        /// when each was sent (extended at the commit: no later than its answer arrives).
        fn settle(&mut self, now: Instant) {
            let (done, waiting): (Vec<_>, Vec<_>) = self
                .pending
                .iter()
                .partition(|(_, commits)| *commits <= now);
            for (sent, _) in done {
                self.beat += 1;
                self.fence_until = self.fence_until.max(sent + self.ttl.mul_f64(0.9));
            }
            self.pending = waiting;
        }
    }

    proptest! {
        #[test]
        fn a_claim_never_meets_an_open_fence(
            holder_ttl_ms in 300u64..3000,
            events in proptest::collection::vec(event(), 1..80),
        ) {
            let holder_ttl = Duration::from_millis(holder_ttl_ms);
            let t0 = Instant::now();
            let ms = |ms: u16| Duration::from_millis(u64::from(ms));
            let mut now = t0;
            let mut seen = Sightings::new(TTL);
            let mut holder = Holder {
                ttl: holder_ttl,
                beat: 0,
                pending: Vec::new(),
                fence_until: t0 + holder_ttl.mul_f64(0.9),
            };
            for event in events {
                holder.settle(now);
                match event {
                    Event::Renew { delay_ms } => holder.pending.push((now, now + ms(delay_ms))),
                    Event::Read { lag_ms } => {
                        let read = LeaseRow { ttl: holder.ttl, ..row(0, Some("holder"), 1, holder.beat) };
                        now += ms(lag_ms);
                        seen.saw_leases(&[read], now);
                        // The claim commits now, and only if the row still has the beat seen.
                        holder.settle(now);
                        for claim in seen.claimable(now) {
                            if claim.beat == holder.beat {
                                prop_assert!(
                                    now >= holder.fence_until,
                                    "claimed at {:?} while the fence is open until {:?}",
                                    now - t0,
                                    holder.fence_until - t0
                                );
                            }
                        }
                    }
                    Event::Wait { ms: wait } => now += ms(wait),
                }
            }
        }
    }
}

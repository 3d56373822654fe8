//! The lease rules (share, book, sightings) run against the real lease tables, as the lease runner
//! runs them: each relay's heartbeats in turn, no sleeps (instants are passed to the rules).
use std::time::{Duration, Instant};

use sqlx::PgPool;
use store::{Bucket, LEASE_BUCKETS, LeaseEpoch, LeaseStore, RelayId};

use super::{LeaseBook, LeasePlan, LeaseStep, Sightings};

/// Claims for `relay` up to `n` free buckets, as its runner would once it has read the rows.
async fn claim_free(
    leases: &LeaseStore,
    relay: &RelayId,
    ttl: Duration,
    n: u16,
) -> Vec<(Bucket, LeaseEpoch)> {
    let mut seen = Sightings::new(ttl);
    let now = Instant::now();
    seen.saw_leases(&leases.survey().await.unwrap(), now);
    leases
        .claim(relay, ttl, n, &seen.claimable(now))
        .await
        .unwrap()
}

/// Relays share the buckets evenly through the lease tables: a second relay's arrival makes
/// the first shed half, a third makes each hold a third, and a release frees at once.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn relays_share_buckets_evenly(pool: PgPool) {
    let leases = LeaseStore::new(pool.clone());
    let plan = LeasePlan::new();
    let ttl = Duration::from_secs(60);
    let relays: Vec<RelayId> = (0..3).map(|_| RelayId::generate()).collect();
    let mut books: Vec<LeaseBook> = relays.iter().map(|_| LeaseBook::new(ttl)).collect();
    for joined in 1..=3 {
        // The new relay registers (its runner's first heartbeat).
        leases.heartbeat(&relays[joined - 1], ttl).await.unwrap();
        // A few heartbeats of every joined relay, in turn, as their runners would run them.
        for _ in 0..3 {
            for (relay, book) in relays.iter().zip(books.iter_mut()).take(joined) {
                let members = leases.heartbeat(relay, ttl).await.unwrap().len() as u32;
                assert_eq!(members as usize, joined);
                let sent = Instant::now();
                let held = leases.renew(relay, ttl, &book.held()).await.unwrap();
                assert!(book.renewed(&held, sent).1.is_empty());
                match plan.step(book.len(), members) {
                    LeaseStep::Claim(n) => {
                        let claimed = claim_free(&leases, relay, ttl, n).await;
                        book.claimed(&claimed, sent);
                    }
                    LeaseStep::Shed(n) => {
                        let leaving = book.hand_over(n, sent);
                        let shed: Vec<_> = leaving
                            .into_iter()
                            .filter_map(|bucket| book.handed_over(bucket))
                            .collect();
                        leases.release(relay, &shed).await.unwrap();
                    }
                    LeaseStep::Hold => {}
                }
            }
        }
        let held: Vec<usize> = books.iter().take(joined).map(LeaseBook::len).collect();
        assert_eq!(
            held.iter().sum::<usize>(),
            usize::from(LEASE_BUCKETS),
            "{held:?}"
        );
        let share = usize::from(plan.share(joined as u32));
        assert!(
            held.iter().all(|&n| n + 1 >= share && n <= share),
            "{held:?}"
        );
        // Each bucket has an owner in the table (the row as written: no lease decision reads
        // PostgreSQL's clock, so neither does this check).
        let rows = leases.survey().await.unwrap();
        assert!(rows.iter().all(|row| row.owner.is_some()), "{rows:?}");
    }
    // A relay leaving releases at once; the others' next heartbeats take its share.
    let gone = books[2].revoke_all();
    leases.release(&relays[2], &gone).await.unwrap();
    leases.leave(&relays[2]).await.unwrap();
    let members = leases.heartbeat(&relays[0], ttl).await.unwrap().len() as u32;
    assert_eq!(members, 2);
    let step = plan.step(books[0].len(), members);
    let LeaseStep::Claim(n) = step else {
        panic!("expected a claim, got {step:?}");
    };
    let claimed = claim_free(&leases, &relays[0], ttl, n).await;
    assert_eq!(claimed.len(), usize::from(n));
}

/// Only the leases a relay still holds are renewed: one it dropped (its fence lapsed while
/// renewals were slow) stands still and becomes claimable a TTL after another relay first saw
/// it, instead of being kept alive forever by the next renewal with nobody draining it; the
/// one renewed meanwhile does not.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_lapsed_lease_is_not_renewed_and_becomes_claimable(pool: PgPool) {
    let leases = LeaseStore::new(pool.clone());
    let ttl = Duration::from_secs(60);
    let (me, other) = (RelayId::generate(), RelayId::generate());
    let claimed = claim_free(&leases, &me, ttl, 2).await;
    assert_eq!(claimed.len(), 2);
    let mut seen = Sightings::new(ttl);
    let t0 = Instant::now();
    seen.saw_leases(&leases.survey().await.unwrap(), t0);
    // The relay still holds the first only; renewing must not touch the second.
    let renewed = leases.renew(&me, ttl, &claimed[..1]).await.unwrap();
    assert_eq!(renewed, claimed[..1].to_vec());
    seen.saw_leases(&leases.survey().await.unwrap(), t0 + ttl / 2);
    let stale: Vec<_> = seen
        .claimable(t0 + ttl)
        .into_iter()
        .filter(|claimable| {
            claimed
                .iter()
                .any(|(bucket, _)| *bucket == claimable.bucket)
        })
        .collect();
    assert_eq!(stale.len(), 1, "{stale:?}");
    assert_eq!(stale[0].bucket, claimed[1].0);
    let taken = leases.claim(&other, ttl, 2, &stale).await.unwrap();
    assert_eq!(taken, vec![(claimed[1].0, LeaseEpoch(claimed[1].1.0 + 1))]);
}

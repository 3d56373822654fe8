//! A branch whose events the broker keeps refusing parks alone: the rest of its tenant flows,
//! the branch shows as parked with its reason, and ships in order after a release.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distribution::Relay;
use distribution::store::{BranchId, BranchKey, FoldStore, IntentWriter, Outbox, ParkCause, RunId};

use crate::double::{Double, Refuse, Script};
use crate::harness::*;

/// A relay on the real broker whose publishers refuse the bad branch's events while
/// poisoned (poisoned from the start, no branch named yet), a fold consuming it, and the outbox.
struct Poisoned {
    pool: sqlx::PgPool,
    config: distribution::RelayConfig,
    fold: FoldStore,
    folding: Folding,
    relay: distribution::RelayHandle,
    outbox: Outbox,
    bad_branch: Arc<Mutex<Option<BranchKey>>>,
    poisoned: Arc<AtomicBool>,
}

async fn poisoned_relay(label: &str, park_retry: Duration) -> Poisoned {
    let (pool, url) = fresh_database(label).await;
    let mut config = relay_config(&url, &amqp_url(), &unique("relay-poison"));
    config.supervisor.drainer.park_after_attempts = 3;
    config.supervisor.drainer.park_retry = park_retry;
    // The poison is refused for good: parked after the attempts, without the grace an
    // election's nacks get.
    config.supervisor.drainer.nack_grace = Duration::ZERO;
    let fold = FoldStore::new(pool.clone());
    let folding = Folding::start(direct_rabbit(&config), &fold);
    let bad_branch = Arc::new(Mutex::new(None));
    let poisoned = Arc::new(AtomicBool::new(true));
    let rabbit = config.rabbit_config().unwrap();
    let factory = {
        let (bad_branch, poisoned) = (bad_branch.clone(), poisoned.clone());
        // The bad branch's intents (its markers are empty: the broker takes them).
        let refuse: Refuse = Arc::new(move |event| {
            poisoned.load(Ordering::SeqCst)
                && !event.is_rewind()
                && bad_branch.lock().unwrap().as_ref() == Some(&event.key.branch)
        });
        Arc::new(move |_shard| {
            Double::rabbit(
                rabbit.clone(),
                Script {
                    refuse: Some(refuse.clone()),
                    ..Script::default()
                },
            )
        })
    };
    let relay = Relay::start_with(config.clone(), factory).await.unwrap();
    let outbox = Outbox::new(pool.clone());
    Poisoned {
        pool,
        config,
        fold,
        folding,
        relay,
        outbox,
        bad_branch,
        poisoned,
    }
}

#[test]
fn a_refused_branch_parks_alone_and_ships_in_order_after_release() {
    host_runtime().block_on(async {
        let Poisoned {
            pool,
            config,
            fold,
            folding,
            relay,
            outbox,
            bad_branch,
            poisoned,
        } = poisoned_relay("poison", Duration::from_secs(600)).await;

        // Tenant "sick" has three runs, one of them poisoned; tenant "calm" has three too.
        let sick = Workload::new("sick", 1, 3, 1).run(&pool).await;
        let calm = Workload::new("calm", 1, 3, 1).run(&pool).await;
        let bad = sick.live[0].0.clone();
        let mut all = sick.expected.clone();
        merge(&mut all, &calm.expected);
        wait_until("the first step folded", Duration::from_secs(30), || async {
            folded_count(&fold, &all).await == count(&all)
        })
        .await;

        // Steps 2..=30 on every branch; the bad branch's are refused from now on.
        *bad_branch.lock().unwrap() = Some(bad.clone());
        let started = Instant::now();
        let sick_more = Workload::new("sick", 1, 3, 30).steps(&pool, sick.live.clone(), 2..=30).await;
        let calm_more = Workload::new("calm", 1, 3, 30).steps(&pool, calm.live.clone(), 2..=30).await;
        let written = started.elapsed();
        merge(&mut all, &sick_more.expected);
        merge(&mut all, &calm_more.expected);
        let mut healthy = all.clone();
        healthy.remove(&bad);
        let bad_pending = sick_more.expected[&bad].len();

        // The healthy branches of the sick tenant ship while the bad one is refused.
        wait_until("healthy branches folded", Duration::from_secs(30), || async {
            let mut folded = 0;
            for tenant in tenants_of(&healthy) {
                folded += fold
                    .folded(&tenant)
                    .await
                    .unwrap()
                    .iter()
                    .filter(|event| event.key.branch != bad)
                    .count();
            }
            folded == count(&healthy)
        })
        .await;
        let healthy_done = started.elapsed();
        wait_until("the bad branch parked", Duration::from_secs(30), || async {
            !outbox.parked_branches().await.unwrap().is_empty()
        })
        .await;
        let parked = outbox.parked_branches().await.unwrap();
        assert_eq!(parked.len(), 1, "{parked:?}");
        assert_eq!(parked[0].branch, bad);
        assert_eq!(parked[0].reason, "nacked");
        assert!(parked[0].attempts >= 3);
        assert_eq!(parked[0].pending as usize, bad_pending, "its events wait, none acked");
        println!(
            "host wrote for {:.2} s; healthy branches of the refused tenant all folded {:.2} s after the host started; the bad branch parked after {} attempts",
            written.as_secs_f64(),
            healthy_done.as_secs_f64(),
            parked[0].attempts
        );

        // The cause is fixed and an operator releases the branch: it ships, in order.
        poisoned.store(false, Ordering::SeqCst);
        let released = outbox.release(&bad.tenant, Some(&bad.run), None).await.unwrap();
        assert_eq!(released, 1);
        wait_until("everything folded after release", Duration::from_secs(30), || async {
            folded_count(&fold, &all).await == count(&all)
        })
        .await;
        assert_folded_exactly(&fold, &all).await;
        assert!(outbox.parked_branches().await.unwrap().is_empty());
        assert_eq!(pending(&outbox).await, 0);
        relay.shutdown().await;
        folding.stop().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

/// A parked branch is tried again after `RELAY_PARK_RETRY_MS` by itself: once the broker
/// takes its events it unparks and ships, in order, exactly once at the fold, with no
/// operator's release.
#[test]
fn a_parked_branch_is_tried_again_after_its_retry_and_unparks_itself() {
    host_runtime().block_on(async {
        let Poisoned {
            pool,
            config,
            fold,
            folding,
            relay,
            outbox,
            bad_branch,
            poisoned,
        } = poisoned_relay("poisonretry", Duration::from_secs(2)).await;
        let run = Workload::new("retry", 1, 2, 1).run(&pool).await;
        let bad = run.live[0].0.clone();
        let mut all = run.expected.clone();
        wait_until("the first step folded", Duration::from_secs(30), || async {
            folded_count(&fold, &all).await == count(&all)
        })
        .await;
        *bad_branch.lock().unwrap() = Some(bad.clone());
        let more = Workload::new("retry", 1, 2, 1)
            .steps(&pool, run.live.clone(), 2..=5)
            .await;
        merge(&mut all, &more.expected);
        wait_until("the bad branch parked", Duration::from_secs(30), || async {
            !outbox.parked_branches().await.unwrap().is_empty()
        })
        .await;
        // The cause goes away; nobody releases the branch.
        poisoned.store(false, Ordering::SeqCst);
        let fixed = Instant::now();
        wait_until(
            "the parked branch ships by itself",
            Duration::from_secs(30),
            || async { folded_count(&fold, &all).await == count(&all) },
        )
        .await;
        println!(
            "shipped {:.2} s after the broker took it again (park retry 2 s)",
            fixed.elapsed().as_secs_f64()
        );
        assert_folded_exactly(&fold, &all).await;
        assert!(
            outbox.parked_branches().await.unwrap().is_empty(),
            "unparked"
        );
        assert_eq!(pending(&outbox).await, 0);
        relay.shutdown().await;
        folding.stop().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

/// A branch the broker will never take is discarded by the operator (`Outbox::discard_branch`,
/// `distribution discard`): its waiting events go, consumers get a rewind marker at its last
/// shipped Lsn (no silent gap), and the run goes on on a new branch that ships as ever. The fold
/// ends with exactly that live history.
#[test]
fn a_parked_branch_discarded_for_good_ends_on_the_wire_and_its_run_goes_on() {
    host_runtime().block_on(async {
        let Poisoned {
            pool,
            config,
            fold,
            folding,
            relay,
            outbox,
            bad_branch,
            poisoned: _,
        } = poisoned_relay("poisondiscard", Duration::from_secs(600)).await;
        let first = Workload::new("discard", 1, 2, 1).run(&pool).await;
        let bad = first.live[0].0.clone();
        let mut live = first.expected.clone();
        wait_until("the first step folded", Duration::from_secs(30), || async {
            folded_count(&fold, &live).await == count(&live)
        })
        .await;
        *bad_branch.lock().unwrap() = Some(bad.clone());
        let more = Workload::new("discard", 1, 2, 5)
            .steps(&pool, first.live.clone(), 2..=5)
            .await;
        wait_until("the bad branch parked", Duration::from_secs(30), || async {
            !outbox.parked_branches().await.unwrap().is_empty()
        })
        .await;

        let to = distribution::store::BranchId::new("after").unwrap();
        let discarded = outbox.discard_branch(&bad, &to).await.unwrap();
        assert_eq!(
            discarded.fork.get(),
            1,
            "only step 1 of the bad branch shipped"
        );
        assert_eq!(discarded.discarded, 4);
        // The host goes on on the new branch.
        let writer = distribution::store::IntentWriter::default();
        let mut conn = pool.acquire().await.unwrap();
        for lsn in 2..=3 {
            let payload = format!("after@{lsn}").into_bytes();
            writer
                .append(
                    &mut conn,
                    &discarded.live,
                    distribution::store::Lsn::new(lsn),
                    &payload,
                )
                .await
                .unwrap();
            live.entry(discarded.live.clone())
                .or_default()
                .push((distribution::store::Lsn::new(lsn), payload));
        }
        let mut others = more.expected.clone();
        others.remove(&bad);
        merge(&mut live, &others);
        wait_until(
            "the live history folded",
            Duration::from_secs(30),
            || async { folded_count(&fold, &live).await == count(&live) },
        )
        .await;
        assert_folded_exactly(&fold, &live).await;
        let stats = folding.stop().await;
        assert!(
            stats.rewinds >= 1,
            "the consumers got the marker: {stats:?}"
        );
        assert!(outbox.parked_branches().await.unwrap().is_empty());
        assert_eq!(pending(&outbox).await, 0);
        relay.shutdown().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

/// A pending row the relay cannot read (metadata written past `relay_append`: a field this
/// relay does not know) parks its branch with the reason, naming the row; the rest of its
/// tenant ships (before, every drain of the tenant failed and nothing of it shipped again),
/// and so does what its branch wrote before it: the branch parks at the first intent it
/// cannot ship (before, the valid intent drained with it waited too). Repaired and released,
/// the branch ships in order, exactly once at the fold.
#[test]
fn a_row_the_relay_cannot_read_parks_its_branch_and_the_tenant_ships() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("unreadable").await;
        let config = relay_config(&url, &amqp_url(), &unique("relay-unreadable"));
        let fold = FoldStore::new(pool.clone());
        let folding = Folding::start(direct_rabbit(&config), &fold);
        let sick = write_first_intent(&pool, "mixed", b"a1").await;
        append_intent(&pool, &sick, 2, b"a2").await;
        append_intent(&pool, &sick, 3, b"a3").await;
        let well = BranchKey::new(
            sick.tenant.clone(),
            RunId::new("r2").unwrap(),
            BranchId::new("b").unwrap(),
        );
        let writer = IntentWriter::default();
        let mut tx = pool.begin().await.unwrap();
        writer.open_run(&mut tx, &well).await.unwrap();
        tx.commit().await.unwrap();
        for lsn in 1..=3 {
            append_intent(&pool, &well, lsn, format!("w{lsn}").as_bytes()).await;
        }
        // A field no version of the contract has, written past `relay_append`.
        let corrupted = sqlx::query(
            "UPDATE relay_outbox SET meta = '{\"priority\": 1}'::jsonb
              WHERE tenant_id = 'mixed' AND run_id = 'r' AND branch_id = 'b' AND lsn = 2",
        )
        .execute(&pool)
        .await
        .unwrap();
        assert_eq!(corrupted.rows_affected(), 1);

        let relay = Relay::start(config.clone()).await.unwrap();
        let outbox = Outbox::new(pool.clone());
        wait_until(
            "the sick branch parked",
            Duration::from_secs(30),
            || async { !outbox.parked_branches().await.unwrap().is_empty() },
        )
        .await;
        let parked = outbox.parked_branches().await.unwrap();
        assert_eq!(parked.len(), 1, "{parked:?}");
        assert_eq!(parked[0].branch, sick);
        assert!(
            parked[0]
                .reason
                .starts_with("unreadable: lsn 2: metadata: unknown field `priority`"),
            "the reason names the row and what does not decode: {}",
            parked[0].reason
        );
        assert_eq!(parked[0].cause, ParkCause::Unreadable);
        // The rest of the tenant ships, and the sick branch's intent before the bad row; the
        // bad row and what follows it wait, in order.
        wait_until("the other run folded", Duration::from_secs(30), || async {
            fold.folded(&sick.tenant).await.unwrap().len() == 4
        })
        .await;
        let folded = fold.folded(&sick.tenant).await.unwrap();
        let sick_lsns: Vec<u64> = folded
            .iter()
            .filter(|e| e.key.branch == sick)
            .map(|e| e.key.lsn.get())
            .collect();
        assert_eq!(sick_lsns, [1], "{folded:?}");
        assert_eq!(
            pending(&outbox).await,
            2,
            "the bad row and the one after it wait"
        );
        assert_eq!(outbox.parked_branches().await.unwrap()[0].pending, 2);

        // Repaired and released: it ships, in order.
        sqlx::query("UPDATE relay_outbox SET meta = NULL WHERE tenant_id = 'mixed' AND lsn = 2")
            .execute(&pool)
            .await
            .unwrap();
        assert_eq!(outbox.release(&sick.tenant, None, None).await.unwrap(), 1);
        wait_until("everything folded", Duration::from_secs(30), || async {
            fold.folded(&sick.tenant).await.unwrap().len() == 6
        })
        .await;
        let folded = fold.folded(&sick.tenant).await.unwrap();
        let lsns: Vec<u64> = folded
            .iter()
            .filter(|e| e.key.branch == sick)
            .map(|e| e.key.lsn.get())
            .collect();
        assert_eq!(lsns, [1, 2, 3], "in order, once each");
        assert!(outbox.parked_branches().await.unwrap().is_empty());
        relay.shutdown().await;
        folding.stop().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

//! A tenant draining a backlog cannot queue quiet tenants behind it: their small batches take
//! each shard's express publisher, so they ship even while every bulk publisher is busy.

use std::sync::Arc;
use std::time::Duration;

use distribution::store::{
    self, BranchId, BranchKey, FoldStore, IntentWriter, Lsn, Outbox, RunId, TenantId,
};
use distribution::{PublisherFactory, Relay};
use tokio::sync::watch;

use crate::double::{Double, Script};
use crate::harness::*;

fn run(express_max_events: u32) -> bool {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("fair").await;
        let mut config = relay_config(&url, &amqp_url(), &unique("relay-fair"));
        config.supervisor.drainer.express_max_events = express_max_events;
        config.supervisor.drainer.batch_size = 500;
        let shards = config.supervisor.shards;
        let rabbit = config.rabbit_config().unwrap();
        let (open, gate) = watch::channel(false);
        let factory: PublisherFactory = Arc::new(move |slot| {
            // The real broker, but a bulk-lane publisher (slots below `shards`) writes nothing
            // until the gate opens: a channel busy with someone else's backlog.
            Double::rabbit(
                rabbit.clone(),
                Script {
                    gate: (slot.0 < shards).then(|| gate.clone()),
                    ..Script::default()
                },
            )
        });
        let fold = FoldStore::new(pool.clone());
        let folding = Folding::start(direct_rabbit(&config), &fold);

        // The hot tenant: a backlog of 2,000 intents (batches of 500: the bulk lane).
        let per_run = 2_000;
        store::fixtures::fill_backlog(&pool, "hot", 1, 1, per_run, 64)
            .await
            .unwrap();
        let hot = BranchKey::new(
            TenantId::new("hot0").unwrap(),
            RunId::new("r0").unwrap(),
            BranchId::new("main").unwrap(),
        );
        let mut hot_expected = Expected::new();
        hot_expected.insert(
            hot.clone(),
            (1..=u64::from(per_run))
                .map(|lsn| (Lsn::new(lsn), vec![b'x'; 64]))
                .collect(),
        );
        let relay = Relay::start_with(config.clone(), factory).await.unwrap();

        // Quiet tenants: a few intents each, on several runs (so several shards).
        let writer = IntentWriter::default();
        let mut quiet = Expected::new();
        for tenant in 0..3 {
            for run in 0..3 {
                let branch = BranchKey::new(
                    TenantId::new(format!("quiet{tenant}")).unwrap(),
                    RunId::new(format!("r{run}")).unwrap(),
                    BranchId::new("main").unwrap(),
                );
                let mut tx = pool.begin().await.unwrap();
                writer.open_run(&mut tx, &branch).await.unwrap();
                for lsn in 1..=3u64 {
                    let payload = format!("{branch}@{lsn}").into_bytes();
                    writer
                        .append(&mut tx, &branch, Lsn::new(lsn), &payload)
                        .await
                        .unwrap();
                    quiet
                        .entry(branch.clone())
                        .or_default()
                        .push((Lsn::new(lsn), payload));
                }
                tx.commit().await.unwrap();
            }
        }
        // While every bulk publisher is stuck, the quiet tenants' intents fold or not.
        let shipped = holds_within(Duration::from_secs(8), || async {
            folded_count(&fold, &quiet).await == count(&quiet)
        })
        .await;
        let outbox = Outbox::new(pool.clone());
        // The hot tenant's first drain is a small one (an express batch of up to 32
        // intents); everything after it waits on the stuck bulk lane.
        let hot_pending = outbox.tenant_backlog(&hot.tenant).await.unwrap().pending;
        assert!(
            hot_pending >= u64::from(per_run) - 32,
            "the bulk lane was not stuck: {hot_pending} of {per_run} pending"
        );

        open.send_replace(true);
        let mut all = hot_expected;
        merge(&mut all, &quiet);
        wait_until("everything folded", Duration::from_secs(60), || async {
            folded_count(&fold, &all).await == count(&all)
        })
        .await;
        assert_folded_exactly(&fold, &all).await;
        relay.shutdown().await;
        folding.stop().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
        shipped
    })
}

#[test]
fn quiet_tenants_ship_while_a_backlog_holds_every_bulk_publisher() {
    assert!(
        run(32),
        "quiet tenants waited behind the hot tenant's backlog"
    );
}

/// The mutation: without the express lane the quiet tenants wait behind the backlog.
#[test]
fn without_the_express_lane_quiet_tenants_wait_behind_the_backlog() {
    assert!(
        !run(0),
        "quiet tenants shipped although every publisher was stuck"
    );
}

//! Runs end, and storage follows, end to end: a host opens, writes, rewinds and closes runs
//! while other runs of the same tenants stay open and keep being written; the relay
//! (`RELAY_RETENTION_SECS`) and the consumer (`ConsumerConfig::retention`) retire the closed
//! runs on their own. At the end the host's database and the fold's keep exactly the open runs'
//! rows, the fold's projection is exactly the live history of every run (closed ones included),
//! and nothing was dead-lettered.
use std::time::Duration;

use distribution::Relay;
use distribution::consumer::{Consumer, ConsumerConfig};
use futures_util::FutureExt;
use sqlx::{PgConnection, PgPool};
use store::{
    BranchId, BranchKey, EventTable, FoldStore, IntentWriter, Lsn, OutboxEvent, Projection,
    Retention, RewindNotice, RunId, TenantId,
};

use crate::harness::{
    Expected, amqp_url, assert_folded_exactly, declare_topology, drop_topology, fold_database,
    fresh_database, relay_config, unique, until_stopped, wait_until,
};

/// The project's event table, and a row per run the fold said has ended (a second end of one
/// run would fail its primary key).
#[derive(Clone)]
struct WithEnds;

impl Projection for WithEnds {
    type Error = store::Error;

    async fn apply(
        &mut self,
        tx: &mut PgConnection,
        event: &OutboxEvent,
    ) -> Result<(), store::Error> {
        EventTable.apply(tx, event).await
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &RewindNotice,
    ) -> Result<(), store::Error> {
        EventTable.rewind(tx, rewind).await
    }

    async fn end(&mut self, tx: &mut PgConnection, end: &OutboxEvent) -> Result<(), store::Error> {
        sqlx::query("INSERT INTO ended_runs (tenant, run) VALUES ($1, $2)")
            .bind(end.key.branch.tenant.as_str())
            .bind(end.key.branch.run.as_str())
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// Rows of `table` (a `tenant_id`, `run_id` table) per run kind: (closed runs', open runs').
async fn rows_by_kind(pool: &PgPool, table: &str) -> (i64, i64) {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FILTER (WHERE run_id LIKE 'closed%'),
                count(*) FILTER (WHERE run_id LIKE 'open%')
           FROM {table}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

fn branch(tenant: usize, run: &str, branch: &str) -> BranchKey {
    BranchKey::new(
        TenantId::new(format!("ret-t{tenant}")).unwrap(),
        RunId::new(run).unwrap(),
        BranchId::new(branch).unwrap(),
    )
}

/// The host: per tenant, one run that stays open and 20 runs that are written, every fourth
/// rewound, and closed; the open run gets a step after each closed run, so it is written
/// while the closed runs retire around it.
async fn host(pool: &PgPool, tenants: usize) -> Expected {
    let writer = IntentWriter::default();
    let mut expected = Expected::new();
    let mut conn = pool.acquire().await.unwrap();
    let mut open: Vec<(BranchKey, u64)> = Vec::new();
    for tenant in 0..tenants {
        let key = branch(tenant, "open", "main");
        writer.open_run(&mut conn, &key).await.unwrap();
        open.push((key, 0));
    }
    for run in 0..20 {
        for tenant in 0..tenants {
            let main = branch(tenant, &format!("closed{run}"), "main");
            let mut tx = pool.begin().await.unwrap();
            writer.open_run(&mut tx, &main).await.unwrap();
            let mut live = main.clone();
            for lsn in 1..=5 {
                writer
                    .append(
                        &mut tx,
                        &live,
                        Lsn::new(lsn),
                        format!("{live}@{lsn}").as_bytes(),
                    )
                    .await
                    .unwrap();
            }
            let mut history: Vec<(BranchKey, u64)> =
                (1..=5).map(|lsn| (main.clone(), lsn)).collect();
            if run % 4 == 0 {
                live = writer
                    .rewind(&mut tx, &main, Lsn::new(3), BranchId::new("b").unwrap())
                    .await
                    .unwrap()
                    .live;
                history.truncate(3);
                for lsn in 4..=6 {
                    writer
                        .append(
                            &mut tx,
                            &live,
                            Lsn::new(lsn),
                            format!("{live}@{lsn}").as_bytes(),
                        )
                        .await
                        .unwrap();
                    history.push((live.clone(), lsn));
                }
            }
            writer
                .close_run(&mut tx, &main.tenant, &main.run)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            for (key, lsn) in history {
                let payload = format!("{key}@{lsn}").into_bytes();
                expected
                    .entry(key)
                    .or_default()
                    .push((Lsn::new(lsn), payload));
            }
        }
        for (key, lsn) in open.iter_mut() {
            *lsn += 1;
            let payload = format!("{key}@{lsn}").into_bytes();
            writer
                .append(&mut conn, key, Lsn::new(*lsn), &payload)
                .await
                .unwrap();
            expected
                .entry(key.clone())
                .or_default()
                .push((Lsn::new(*lsn), payload));
        }
    }
    expected
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn closed_runs_are_retired_on_both_sides_while_open_runs_go_on() {
    let (pool, url) = fresh_database("retention").await;
    let (fold_pool, _) = fold_database("retention_fold").await;
    sqlx::query("CREATE TABLE ended_runs (tenant text, run text, PRIMARY KEY (tenant, run))")
        .execute(&fold_pool)
        .await
        .unwrap();
    let topology = unique("retention");
    let mut config = relay_config(&url, &amqp_url(), &topology);
    config.retention = Some(Duration::from_secs(1));
    let rabbit = config.rabbit_config().unwrap();
    let tenants = 3;

    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology(&rabbit.topology).await;
        let relay = Relay::start(config.clone()).await.unwrap();
        let mut consumer_config = ConsumerConfig::new(rabbit.clone());
        // Kept well above any delivery delay here: a run is retired at the fold only after
        // its end marker was folded this long ago (see WIRE.md, "Runs end").
        consumer_config.retention = Some(Retention::new(Duration::from_secs(3)));
        let consumer = Consumer::new(consumer_config, fold_pool.clone(), WithEnds);
        let progress = consumer.progress();
        let consuming = until_stopped(|stopped| consumer.run(stopped));

        let expected = host(&pool, tenants).await;

        wait_until(
            "the closed runs to be retired in the host's database",
            Duration::from_secs(60),
            || async { rows_by_kind(&pool, "relay_branch").await == (0, tenants as i64) },
        )
        .await;
        wait_until(
            "the closed runs to be retired in the fold's database",
            Duration::from_secs(60),
            || async { rows_by_kind(&fold_pool, "relay_fold_cursor").await.0 == 0 },
        )
        .await;
        // Every run's live history, closed ones included, folded exactly once.
        assert_folded_exactly(&FoldStore::new(fold_pool.clone()), &expected).await;
        let totals = progress.totals();
        assert_eq!(totals.rejected, 0, "nothing dead-lettered: {totals:?}");
        let ended: i64 =
            sqlx::query_scalar("SELECT count(*) FROM ended_runs WHERE run LIKE 'closed%'")
                .fetch_one(&fold_pool)
                .await
                .unwrap();
        assert_eq!(ended, 20 * tenants as i64, "each closed run ended once");
        // The open runs keep their rows and go on.
        assert_eq!(
            rows_by_kind(&fold_pool, "relay_fold_cursor").await,
            (0, tenants as i64)
        );
        assert_eq!(rows_by_kind(&pool, "relay_outbox").await, (0, 0));
        assert_eq!(rows_by_kind(&fold_pool, "relay_fold_parked").await, (0, 0));
        let writer = IntentWriter::default();
        let mut conn = pool.acquire().await.unwrap();
        writer
            .append(&mut conn, &branch(0, "open", "main"), Lsn::new(21), b"21")
            .await
            .unwrap();

        consuming.stop().await.unwrap();
        relay.shutdown().await;
    })
    .catch_unwind()
    .await;
    drop_topology(&rabbit.topology).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

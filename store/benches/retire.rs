//! Soak: a million runs opened, written, closed, shipped, folded and retired, on this machine's
//! PostgreSQL. Does what the relay and the fold keep return to its baseline, and do the append
//! and drain rates stay flat from the first 100k runs to the last?
//!
//! `cargo bench -p store --bench retire` (BENCH_RUNS, default 1,000,000; BENCH_WRITERS, default
//! 8; BENCH_REPORT, default 100,000). Each writer is a host on its own tenant: per run, one
//! transaction opens it, appends two 64-byte intents and closes it (one round trip, NOTIFY off).
//! Per tenant a drainer acks what it drained last and drains the next 1,000 rows
//! (`relay_ack_and_drain`, the relay's own step, without broker), and hands them to a folder
//! that calls `relay_fold` for each, 1,000 deliveries per transaction, in a second database
//! (a consumer's). A retirer calls `retire_runs` and `retire_folded_runs` with a retention of
//! 2 s every 500 ms. Every `BENCH_REPORT` runs written, one line: rates over that slice and the
//! rows and on-disk sizes of the tables that hold per-run state.
//!
//! Every table here is delete-heavy; PostgreSQL reclaims their space by (auto)vacuum. When
//! autovacuum is off on the server (it is on this machine), the bench vacuums those tables
//! itself every BENCH_VACUUM_SECS (default 10), as autovacuum would; it says which it did.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use store::Retention;
use tokio::sync::mpsc;

mod support;
use support::{database, drop_database, setting};

/// One drained row, as a delivery.
type Delivery = (
    String,
    String,
    i64,
    i64,
    i64,
    i16,
    Vec<u8>,
    chrono::DateTime<chrono::Utc>,
);

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    drained: AtomicU64,
    folded: AtomicU64,
    retired: AtomicU64,
    fold_retired: AtomicU64,
}

async fn writer(pool: PgPool, tenant: String, runs: u64, counters: Arc<Counters>) {
    let mut conn = pool.acquire().await.expect("connection");
    let body = "\\x".to_owned() + &"ab".repeat(64);
    for run in 0..runs {
        let sql = format!(
            "BEGIN;
             SELECT relay_open_run('{tenant}', 'r{run}', 'main');
             SELECT relay_append('{tenant}', 'r{run}', 'main', 1, '{body}'::bytea, false);
             SELECT relay_append('{tenant}', 'r{run}', 'main', 2, '{body}'::bytea, false);
             SELECT * FROM relay_close_run('{tenant}', 'r{run}', false);
             COMMIT;"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&mut *conn)
            .await
            .expect("host transaction");
        counters.written.fetch_add(1, Ordering::Relaxed);
    }
}

async fn drainer(
    pool: PgPool,
    tenant: String,
    done: Arc<AtomicBool>,
    deliveries: mpsc::Sender<Vec<Delivery>>,
    counters: Arc<Counters>,
) {
    let mut acked: (Vec<String>, Vec<String>, Vec<i64>) = Default::default();
    loop {
        let writers_done = done.load(Ordering::Acquire);
        let rows: Vec<Delivery> = sqlx::query_as(
            "SELECT run_id, branch_id, lsn, prev_lsn, base_lsn, kind, payload, created_at
               FROM relay_ack_and_drain(0, NULL, 0, $1, $2, $3, $4, 1000, 16777216,
                                        '{}', '{}', '{}')",
        )
        .bind(&tenant)
        .bind(&acked.0)
        .bind(&acked.1)
        .bind(&acked.2)
        .fetch_all(&pool)
        .await
        .expect("ack and drain");
        acked = (
            rows.iter().map(|row| row.0.clone()).collect(),
            rows.iter().map(|row| row.1.clone()).collect(),
            rows.iter().map(|row| row.2).collect(),
        );
        if rows.is_empty() {
            if writers_done {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        counters
            .drained
            .fetch_add(rows.len() as u64, Ordering::Relaxed);
        deliveries.send(rows).await.expect("folder alive");
    }
}

async fn folder(
    pool: PgPool,
    tenant: String,
    mut deliveries: mpsc::Receiver<Vec<Delivery>>,
    counters: Arc<Counters>,
) {
    while let Some(batch) = deliveries.recv().await {
        let kinds: Vec<&str> = batch
            .iter()
            .map(|row| match row.5 {
                2 => "end",
                1 => "rewind",
                _ => "intent",
            })
            .collect();
        let mut tx = pool.begin().await.expect("fold transaction");
        let folded: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bigint[],
                                         $6::bigint[], $7::text[], $8::bytea[], $9::timestamptz[])
                        WITH ORDINALITY AS d(run, branch, lsn, prev, base, kind, body, created, n),
                    LATERAL relay_fold($1, d.run, d.branch, d.kind, d.lsn, d.prev, d.base, NULL,
                                       NULL, d.created, d.body) AS f",
        )
        .bind(&tenant)
        .bind(batch.iter().map(|row| row.0.clone()).collect::<Vec<_>>())
        .bind(batch.iter().map(|row| row.1.clone()).collect::<Vec<_>>())
        .bind(batch.iter().map(|row| row.2).collect::<Vec<_>>())
        .bind(batch.iter().map(|row| row.3).collect::<Vec<_>>())
        .bind(batch.iter().map(|row| row.4).collect::<Vec<_>>())
        .bind(&kinds)
        .bind(batch.iter().map(|row| row.6.clone()).collect::<Vec<_>>())
        .bind(batch.iter().map(|row| row.7).collect::<Vec<_>>())
        .fetch_one(&mut *tx)
        .await
        .expect("relay_fold");
        tx.commit().await.expect("fold commit");
        assert!(folded >= batch.len() as i64);
        counters
            .folded
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
    }
}

/// Stands in for autovacuum when the server has it off: VACUUM of the per-run tables.
async fn vacuumer(outbox: PgPool, fold: PgPool, every: Duration, stop: Arc<AtomicBool>) {
    let mut ticks = tokio::time::interval(every);
    ticks.tick().await;
    while !stop.load(Ordering::Acquire) {
        ticks.tick().await;
        sqlx::raw_sql("VACUUM relay_branch, relay_outbox, relay_parked_branch")
            .execute(&outbox)
            .await
            .expect("vacuum outbox");
        sqlx::raw_sql("VACUUM relay_fold_cursor, relay_fold_parked")
            .execute(&fold)
            .await
            .expect("vacuum fold");
    }
}

async fn retirer(outbox: PgPool, fold: PgPool, stop: Arc<AtomicBool>, counters: Arc<Counters>) {
    let retention = Retention {
        keep: Duration::from_secs(2),
        batch: 5_000,
    };
    let mut ticks = tokio::time::interval(Duration::from_millis(500));
    while !stop.load(Ordering::Acquire) {
        ticks.tick().await;
        let runs = store::retire_runs(&outbox, retention)
            .await
            .expect("retire");
        counters.retired.fetch_add(runs, Ordering::Relaxed);
        let runs = store::retire_folded_runs(&fold, retention)
            .await
            .expect("fold retire");
        counters.fold_retired.fetch_add(runs, Ordering::Relaxed);
    }
}

/// Rows and on-disk bytes (heap, indexes, TOAST) of `tables`.
async fn footprint(pool: &PgPool, tables: &[&str]) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    for table in tables {
        let row: (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM {table}), pg_total_relation_size('{table}')"
        )))
        .fetch_one(pool)
        .await
        .expect("footprint");
        out.push(row);
    }
    out
}

const OUTBOX_TABLES: [&str; 3] = ["relay_branch", "relay_outbox", "relay_parked_branch"];
const FOLD_TABLES: [&str; 2] = ["relay_fold_cursor", "relay_fold_parked"];

fn kib(bytes: i64) -> String {
    format!("{} KiB", bytes / 1024)
}

async fn report_sizes(label: &str, outbox: &PgPool, fold: &PgPool) {
    let mut line = format!("{label:>10}");
    for (table, (rows, bytes)) in OUTBOX_TABLES
        .iter()
        .zip(footprint(outbox, &OUTBOX_TABLES).await)
        .chain(FOLD_TABLES.iter().zip(footprint(fold, &FOLD_TABLES).await))
    {
        line.push_str(&format!(
            " | {}: {rows} rows {}",
            table.trim_start_matches("relay_"),
            kib(bytes)
        ));
    }
    println!("{line}");
}

fn main() {
    let runs = setting("BENCH_RUNS", 1_000_000);
    let writers = setting("BENCH_WRITERS", 8);
    let every = setting("BENCH_REPORT", 100_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(8)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let (outbox, outbox_name) = database("retire", false).await;
        let (fold, fold_name) = database("retire_fold", true).await;
        let autovacuum: String = sqlx::query_scalar("SHOW autovacuum")
            .fetch_one(&outbox)
            .await
            .expect("autovacuum setting");
        let vacuum_every = Duration::from_secs(setting("BENCH_VACUUM_SECS", 10));
        println!(
            "# {runs} runs by {writers} writers (2 intents and an end marker each), retention 2 s; autovacuum {autovacuum}{}",
            if autovacuum == "off" {
                format!(", so the bench vacuums the per-run tables every {} s", vacuum_every.as_secs())
            } else {
                String::new()
            }
        );
        report_sizes("baseline", &outbox, &fold).await;
        let counters = Arc::new(Counters::default());
        let writing_done = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let per_writer = runs / writers;
        let mut writing = Vec::new();
        let mut pipeline = Vec::new();
        for w in 0..writers {
            let tenant = format!("t{w}");
            let (tx, rx) = mpsc::channel(4);
            writing.push(tokio::spawn(writer(
                outbox.clone(),
                tenant.clone(),
                per_writer,
                counters.clone(),
            )));
            pipeline.push(tokio::spawn(drainer(
                outbox.clone(),
                tenant.clone(),
                writing_done.clone(),
                tx,
                counters.clone(),
            )));
            pipeline.push(tokio::spawn(folder(fold.clone(), tenant, rx, counters.clone())));
        }
        let vacuuming = (autovacuum == "off").then(|| {
            tokio::spawn(vacuumer(
                outbox.clone(),
                fold.clone(),
                vacuum_every,
                stop.clone(),
            ))
        });
        let retiring = tokio::spawn(retirer(
            outbox.clone(),
            fold.clone(),
            stop.clone(),
            counters.clone(),
        ));
        let total = per_writer * writers;
        let started = Instant::now();
        let (mut last_at, mut last_written, mut last_drained) = (Instant::now(), 0u64, 0u64);
        let mut next = every;
        println!(
            "{:>10} | runs/s written | events/s drained | runs retired (outbox, fold) | state held",
            "runs"
        );
        while next <= total {
            let written = counters.written.load(Ordering::Relaxed);
            if written < next {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let drained = counters.drained.load(Ordering::Relaxed);
            let slice = last_at.elapsed().as_secs_f64();
            print!(
                "{written:>10} | {:>14.0} | {:>16.0} | {:>10} {:>10} | ",
                (written - last_written) as f64 / slice,
                (drained - last_drained) as f64 / slice,
                counters.retired.load(Ordering::Relaxed),
                counters.fold_retired.load(Ordering::Relaxed),
            );
            report_sizes("", &outbox, &fold).await;
            (last_at, last_written, last_drained) = (Instant::now(), written, drained);
            next += every;
        }
        for task in writing {
            task.await.expect("writer");
        }
        writing_done.store(true, Ordering::Release);
        for task in pipeline {
            task.await.expect("drain and fold");
        }
        let written_in = started.elapsed();
        // Everything retired: at most 2 s of retention and a tick after the last fold.
        let drained_all = Instant::now();
        while counters.fold_retired.load(Ordering::Relaxed) < total
            || counters.retired.load(Ordering::Relaxed) < total
        {
            assert!(
                drained_all.elapsed() < Duration::from_secs(120),
                "not everything retired"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stop.store(true, Ordering::Release);
        retiring.await.expect("retirer");
        if let Some(vacuuming) = vacuuming {
            vacuuming.await.expect("vacuumer");
        }
        println!(
            "# all {total} runs written, shipped and folded in {:.0} s; all retired {:.1} s later",
            written_in.as_secs_f64(),
            drained_all.elapsed().as_secs_f64()
        );
        report_sizes("retired", &outbox, &fold).await;
        for pool in [&outbox, &fold] {
            sqlx::raw_sql("VACUUM").execute(pool).await.expect("vacuum");
        }
        report_sizes("vacuumed", &outbox, &fold).await;
        outbox.close().await;
        fold.close().await;
        drop_database(&outbox_name).await;
        drop_database(&fold_name).await;
    });
}

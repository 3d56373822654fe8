//! Host commits per second through the write API, before and after it moved into SQL functions,
//! measured side by side in one run on this machine's PostgreSQL.
//!
//! `cargo bench -p store --bench append` (BENCH_SECONDS=N per round, default 3; BENCH_WRITERS,
//! default 8; BENCH_ROUNDS, default 4). Each host transaction is what a host does per step: update its own state row and
//! append one 256-byte intent, then commit. "statement" is the former writer (one CTE statement
//! that locks the branch row, moves its head and inserts the intent); "function" is today's
//! `IntentWriter::append`, one call of `relay_append`. Both run against the same tables, in
//! alternating rounds (statement, function, statement, function, ...), with NOTIFY off and on;
//! the table gives the median of the rounds and the ratio function / statement.
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};
use store::{BranchId, BranchKey, IntentWriter, Lsn, RunId, TenantId};

/// The former append (before `relay_append`), kept here as the reference: one statement that
/// locks the live branch row, moves its head and inserts the intent; `$from` ends it.
macro_rules! statement {
    ($from:literal) => {
        concat!(
            "WITH old AS (
                 SELECT head_lsn, base_lsn, parent_branch_id FROM relay_branch
                  WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3
                    AND abandoned_at_lsn IS NULL
                  FOR UPDATE
             ), moved AS (
                 UPDATE relay_branch b SET head_lsn = $4
                   FROM old
                  WHERE b.tenant_id = $1 AND b.run_id = $2 AND b.branch_id = $3
                    AND old.head_lsn < $4
              RETURNING old.head_lsn AS prev_lsn, old.base_lsn, old.parent_branch_id
             )
             INSERT INTO relay_outbox
                 (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, parent_branch_id)
             SELECT $1, $2, $3, $4, prev_lsn, base_lsn, $5, parent_branch_id ",
            $from
        )
    };
}

const STATEMENT: &str = statement!("FROM moved");

const STATEMENT_NOTIFY: &str =
    statement!("FROM moved, LATERAL (SELECT pg_notify('relay_outbox', $1)) AS wake");

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Way {
    Statement,
    Function,
}

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

async fn fresh_database() -> (PgPool, String) {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL (set in .cargo/config.toml)");
    let name = format!("relay_bench_append_{}", std::process::id());
    let mut admin = PgConnection::connect(&url).await.expect("PostgreSQL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create database");
    let base = url.rsplit_once('/').expect("a database in the URL").0;
    let url = format!("{base}/{name}");
    let pool = PgPool::connect(&url).await.expect("bench database");
    store::migrate(&pool).await.expect("migrate");
    sqlx::query("CREATE TABLE host_state (run text PRIMARY KEY, step bigint NOT NULL)")
        .execute(&pool)
        .await
        .expect("host table");
    (pool, name)
}

/// One round: `writers` hosts, each on its own run, committing steps for `seconds`; returns
/// commits per second. `next` holds each writer's next Lsn across rounds.
async fn round(
    url: &str,
    way: Way,
    notify: bool,
    seconds: u64,
    next: &mut [u64],
    runs: &[BranchKey],
) -> f64 {
    let writer = IntentWriter::default().with_notify(notify);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let payload = vec![7u8; 256];
    let mut tasks = Vec::new();
    for (index, branch) in runs.iter().enumerate() {
        let (url, writer, branch, payload) = (
            url.to_owned(),
            writer.clone(),
            branch.clone(),
            payload.clone(),
        );
        let mut lsn = next[index];
        tasks.push(tokio::spawn(async move {
            let mut conn = PgConnection::connect(&url)
                .await
                .expect("writer connection");
            let mut commits = 0u64;
            while Instant::now() < deadline {
                let mut tx = sqlx::Connection::begin(&mut conn).await.expect("begin");
                sqlx::query("UPDATE host_state SET step = $2 WHERE run = $1")
                    .bind(branch.run.as_str())
                    .bind(lsn as i64)
                    .execute(&mut *tx)
                    .await
                    .expect("host state");
                match way {
                    Way::Function => writer
                        .append(&mut tx, &branch, Lsn::new(lsn), &payload)
                        .await
                        .expect("append"),
                    Way::Statement => {
                        let sql = if notify { STATEMENT_NOTIFY } else { STATEMENT };
                        let done = sqlx::query(sql)
                            .bind(branch.tenant.as_str())
                            .bind(branch.run.as_str())
                            .bind(branch.branch.as_str())
                            .bind(lsn as i64)
                            .bind(&payload)
                            .execute(&mut *tx)
                            .await
                            .expect("append statement");
                        assert_eq!(done.rows_affected(), 1);
                    }
                }
                tx.commit().await.expect("commit");
                commits += 1;
                lsn += 1;
            }
            (commits, lsn)
        }));
    }
    let started = Instant::now();
    let mut total = 0;
    for (index, task) in tasks.into_iter().enumerate() {
        let (commits, lsn) = task.await.expect("writer");
        total += commits;
        next[index] = lsn;
    }
    total as f64 / started.elapsed().as_secs_f64().max(seconds as f64)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main]
async fn main() {
    let seconds = setting("BENCH_SECONDS", 3);
    let writers = setting("BENCH_WRITERS", 8) as usize;
    let rounds = setting("BENCH_ROUNDS", 4) as usize;
    let (pool, name) = fresh_database().await;
    let url = format!(
        "{}/{name}",
        std::env::var("DATABASE_URL")
            .unwrap()
            .rsplit_once('/')
            .unwrap()
            .0
    );
    let writer = IntentWriter::default();
    let mut runs = Vec::new();
    for index in 0..writers {
        let branch = BranchKey::new(
            TenantId::new(format!("t{}", index % 4)).unwrap(),
            RunId::new(format!("r{index}")).unwrap(),
            BranchId::new("main").unwrap(),
        );
        writer
            .open_run(&mut pool.acquire().await.unwrap(), &branch)
            .await
            .expect("open run");
        sqlx::query("INSERT INTO host_state VALUES ($1, 0)")
            .bind(branch.run.as_str())
            .execute(&pool)
            .await
            .unwrap();
        runs.push(branch);
    }
    let mut next = vec![1u64; writers];
    println!(
        "| host commits/s, {writers} writers, 256 B | statement (before) | function (after) | after / before |"
    );
    println!("|---|---|---|---|");
    for notify in [false, true] {
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for index in 0..rounds {
            // Alternate which way goes first, and start every round on an empty outbox (it
            // grows by every commit), so neither way sees a larger table or a warmer cache.
            let order = if index % 2 == 0 {
                [Way::Statement, Way::Function]
            } else {
                [Way::Function, Way::Statement]
            };
            for way in order {
                let rate = round(&url, way, notify, seconds, &mut next, &runs).await;
                match way {
                    Way::Statement => before.push(rate),
                    Way::Function => after.push(rate),
                }
                sqlx::query("DELETE FROM relay_outbox")
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
        let (before, after) = (median(&mut before), median(&mut after));
        println!(
            "| NOTIFY {} | {before:.0} | {after:.0} | {:.2} |",
            if notify { "on" } else { "off" },
            after / before
        );
    }
    pool.close().await;
    let mut admin = PgConnection::connect(&std::env::var("DATABASE_URL").unwrap())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {name} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
}

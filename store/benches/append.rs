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
//!
//! A second table (issue 36) gives what the outbox costs a host at all, by payload size: the same
//! transaction with `relay_append` against a plain `INSERT` of the same bytes into a table of the
//! host's own (`host_event`, a `bytea` column with PostgreSQL's default storage), at 256 B,
//! 64 KiB and 256 KiB of incompressible bytes, NOTIFY off and on, alternating rounds, the tables
//! emptied before each. `BENCH_SIZES=off` skips it; `BENCH_SIZES=only` runs it alone.
//!
//! A third table (issue 50) gives what epochs cost the host: today's `relay_append` (which
//! stamps each row with its epoch and its predecessor's, and keeps the head's epoch on the
//! branch) against version 3's (`migrations/0008_metadata.sql`'s, installed in the bench
//! database as `relay_append_v3` and writing no epoch), at 256 B, 64 KiB and 256 KiB,
//! alternating rounds. `BENCH_EPOCHS=only` runs it alone, `off` skips it.
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
    /// A plain insert into the host's own table: no outbox at all.
    Plain,
    /// Version 3's `relay_append` (no epochs), as `relay_append_v3`.
    BeforeEpochs,
    /// Today's `relay_append`, called as `BeforeEpochs` calls version 3's (the same arguments,
    /// no client-side checks): the two differ by what the SQL does alone.
    AfterEpochs,
}

/// Version 3's `relay_append` (0008), renamed and writing the epoch column as NULL explicitly
/// (so its default, today's epoch function, is not called), its search_path pinned as 0008
/// pinned it: what a host paid before epochs.
fn append_before_epochs() -> String {
    let migration = include_str!("../migrations/0008_metadata.sql");
    let start = migration
        .find("CREATE FUNCTION relay_append(")
        .expect("0008 defines relay_append");
    let end = migration[start..]
        .find("\n$$;")
        .map(|at| start + at + "\n$$;".len())
        .expect("its body ends");
    let function = migration[start..end]
        .replace("CREATE FUNCTION relay_append(", "CREATE FUNCTION relay_append_v3(")
        .replace(
            "(tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, parent_branch_id, meta)",
            "(tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, parent_branch_id, meta, epoch)",
        )
        .replace(
            "nullif(p_meta, '{}'::jsonb)\n      FROM moved m;",
            "nullif(p_meta, '{}'::jsonb), NULL\n      FROM moved m;",
        );
    assert!(
        function.contains(", epoch)") && function.contains("), NULL"),
        "{function}"
    );
    // As 0008 (and 0012 for today's) pins the function's search_path: a function with a SET
    // clause pays for it on every call, so without it version 3 would look about 4 % cheaper at
    // 256 B than it ever was.
    let pinned = "ALTER FUNCTION relay_append(text, text, text, bigint, bytea, boolean, bigint, jsonb) SET search_path";
    assert!(
        migration.contains(pinned),
        "0008 pins relay_append's search_path"
    );
    format!(
        "{function}\nDO $pin$ BEGIN EXECUTE format('ALTER FUNCTION relay_append_v3(text, text, text, bigint, bytea, boolean, bigint, jsonb) SET search_path = %I, pg_temp', current_schema()); END $pin$;"
    )
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
    sqlx::raw_sql(
        "CREATE TABLE host_state (run text PRIMARY KEY, step bigint NOT NULL);
         CREATE TABLE host_event (run text NOT NULL, lsn bigint NOT NULL, payload bytea NOT NULL,
                                  PRIMARY KEY (run, lsn));",
    )
    .execute(&pool)
    .await
    .expect("host tables");
    sqlx::raw_sql(sqlx::AssertSqlSafe(append_before_epochs()))
        .execute(&pool)
        .await
        .expect("version 3's relay_append");
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
    payload: &[u8],
) -> f64 {
    let writer = IntentWriter::default().with_notify(notify);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let payload = payload.to_vec();
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
                    Way::BeforeEpochs | Way::AfterEpochs => {
                        let sql = if way == Way::BeforeEpochs {
                            "SELECT relay_append_v3($1, $2, $3, $4, $5, $6)"
                        } else {
                            "SELECT relay_append($1, $2, $3, $4, $5, $6)"
                        };
                        sqlx::query(sql)
                            .bind(branch.tenant.as_str())
                            .bind(branch.run.as_str())
                            .bind(branch.branch.as_str())
                            .bind(lsn as i64)
                            .bind(&payload)
                            .bind(notify)
                            .execute(&mut *tx)
                            .await
                            .expect("relay_append");
                    }
                    Way::Plain => {
                        sqlx::query("INSERT INTO host_event VALUES ($1, $2, $3)")
                            .bind(branch.run.as_str())
                            .bind(lsn as i64)
                            .bind(&payload)
                            .execute(&mut *tx)
                            .await
                            .expect("plain insert");
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
    let sizes = std::env::var("BENCH_SIZES").unwrap_or_default();
    let epochs = std::env::var("BENCH_EPOCHS").unwrap_or_default();
    let mut bench = Bench {
        pool: &pool,
        url: &url,
        runs: &runs,
        next: &mut next,
        rounds,
        seconds,
    };
    if epochs != "only" {
        if sizes != "only" {
            statement_and_function(&mut bench, writers).await;
        }
        if sizes != "off" {
            outbox_and_plain(&mut bench, writers).await;
        }
    }
    if epochs != "off" {
        before_and_after_epochs(&mut bench, writers).await;
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

/// Empties the outbox and the host's event table (between rounds: each starts on empty tables).
async fn empty(pool: &PgPool) {
    sqlx::raw_sql("TRUNCATE relay_outbox, host_event")
        .execute(pool)
        .await
        .unwrap();
}

/// Where the writers are and what they run: the database, its URL, the runs, each writer's
/// next Lsn, and the rounds.
struct Bench<'a> {
    pool: &'a PgPool,
    url: &'a str,
    runs: &'a [BranchKey],
    next: &'a mut [u64],
    rounds: usize,
    seconds: u64,
}

impl Bench<'_> {
    /// The median commits/s of `first` and of `second` over the rounds, alternating which goes
    /// first; every round starts on empty tables (they grow by every commit), so neither way sees
    /// a larger table or a warmer cache.
    async fn pair(
        &mut self,
        [first, second]: [Way; 2],
        notify: bool,
        payload: &[u8],
    ) -> (f64, f64) {
        let (mut firsts, mut seconds) = (Vec::new(), Vec::new());
        for index in 0..self.rounds {
            let order = if index % 2 == 0 {
                [first, second]
            } else {
                [second, first]
            };
            for way in order {
                let rate = round(
                    self.url,
                    way,
                    notify,
                    self.seconds,
                    self.next,
                    self.runs,
                    payload,
                )
                .await;
                if way == first {
                    firsts.push(rate);
                } else {
                    seconds.push(rate);
                }
                empty(self.pool).await;
            }
        }
        (median(&mut firsts), median(&mut seconds))
    }
}

fn notify_label(notify: bool) -> &'static str {
    if notify { "on" } else { "off" }
}

/// The first table: the former statement against `relay_append`, 256 B.
async fn statement_and_function(bench: &mut Bench<'_>, writers: usize) {
    let payload = vec![7u8; 256];
    println!(
        "| host commits/s, {writers} writers, 256 B | statement (before) | function (after) | after / before |"
    );
    println!("|---|---|---|---|");
    for notify in [false, true] {
        let (before, after) = bench
            .pair([Way::Statement, Way::Function], notify, &payload)
            .await;
        println!(
            "| NOTIFY {} | {before:.0} | {after:.0} | {:.2} |",
            notify_label(notify),
            after / before
        );
    }
}

/// The second table: `relay_append` against a plain insert of the same bytes, by size.
async fn outbox_and_plain(bench: &mut Bench<'_>, writers: usize) {
    by_size(
        bench,
        writers,
        [Way::Plain, Way::Function],
        "plain insert into the host's table | `relay_append` | outbox / plain",
    )
    .await;
}

/// The third table: today's `relay_append` (epochs) against version 3's, by size.
async fn before_and_after_epochs(bench: &mut Bench<'_>, writers: usize) {
    by_size(
        bench,
        writers,
        [Way::BeforeEpochs, Way::AfterEpochs],
        "`relay_append` v3 (no epochs) | `relay_append` v4 (epochs) | v4 / v3",
    )
    .await;
}

/// A table of `ways` side by side at 256 B, 64 KiB and 256 KiB of incompressible payload,
/// NOTIFY off and on; `columns` heads the first way, the second and their ratio.
async fn by_size(bench: &mut Bench<'_>, writers: usize, ways: [Way; 2], columns: &str) {
    println!();
    println!("| host commits/s, {writers} writers, incompressible payload | {columns} |");
    println!("|---|---|---|---|");
    for (bytes, label) in [(256, "256 B"), (64 << 10, "64 KiB"), (256 << 10, "256 KiB")] {
        let payload = store::fixtures::Incompressible::default().bytes(bytes);
        for notify in [false, true] {
            let (first, second) = bench.pair(ways, notify, &payload).await;
            println!(
                "| {label}, NOTIFY {} | {first:.0} | {second:.0} | {:.3} |",
                notify_label(notify),
                second / first
            );
        }
    }
}

//! Drain+ack throughput of the outbox on this machine's PostgreSQL, and the measurement behind
//! retiring shipped rows by DELETE rather than by marking them.
//!
//! `cargo bench -p store --bench drain_ack` (BENCH_ROWS=N to change the backlog, default 200000).
//! Each strategy drains the same backlog twice (round 2 runs on top of round 1's shipped rows),
//! 50 tenants x 20 runs, 256-byte payloads, batches of 1000. The relay's step also runs with
//! `RELAY_PUBLISH_REPLICATED=local` (each drain that read rows then waits until the WAL up to
//! now is on this server's disk: one more round trip; against a standby its replication lag
//! comes on top, which a bench on one server cannot show).
use std::time::Instant;

use sqlx::{Connection, PgConnection, PgPool};
use std::time::Duration;

use store::{
    Bucket, Claimable, EventKey, Fence, LEASE_BUCKETS, Lease, LeaseStore, Outbox, RelayId,
    TenantId, bucket_of,
};

const TENANTS: usize = 50;
const BATCH: u32 = 1000;

fn fill_sql(table: &str, rows: u64, round: u64) -> String {
    format!(
        "INSERT INTO {table} (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload)
         SELECT 't' || (g % {TENANTS}), 'r' || ((g / {TENANTS}) % 20), 'main',
                {round} * 1000000 + g / 1000 + 1, {round} * 1000000 + g / 1000, 0,
                decode(repeat('ab', 256), 'hex')
           FROM generate_series(0, {rows} - 1) g"
    )
}

async fn exec(pool: &PgPool, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .expect("bench SQL");
}

async fn drain_with_delete(outbox: &Outbox, tenants: &[TenantId]) -> u64 {
    let mut moved = 0;
    for tenant in tenants {
        loop {
            let batch = outbox.drain_outbox(tenant, BATCH).await.expect("drain");
            if batch.is_empty() {
                break;
            }
            let keys: Vec<EventKey> = batch.into_iter().map(|event| event.key).collect();
            moved += outbox.ack_outbox(&keys).await.expect("ack");
        }
    }
    moved
}

/// The relay's steady state: retire the last batch and drain the next in one call.
/// With `fences`, each call presents the tenant's lease (the relay's fenced path).
async fn drain_with_ack_and_drain(
    outbox: &Outbox,
    tenants: &[TenantId],
    fences: Option<&std::collections::BTreeMap<Bucket, Lease>>,
) -> u64 {
    let mut moved = 0;
    for tenant in tenants {
        let fence = match fences {
            Some(fences) => fences[&bucket_of(tenant)].fence(),
            None => Fence::open(),
        };
        let mut shipped: Vec<EventKey> = Vec::new();
        loop {
            let batch = outbox
                .ack_and_drain(&fence, &shipped, tenant, BATCH, &[])
                .await
                .expect("ack_and_drain");
            moved += shipped.len() as u64;
            if batch.is_empty() {
                break;
            }
            shipped = batch.into_iter().map(|event| event.key).collect();
        }
    }
    moved
}

/// The alternative: keep shipped rows, mark them, drain through a partial index.
async fn drain_with_mark(pool: &PgPool, tenants: &[TenantId]) -> u64 {
    let mut moved = 0;
    for tenant in tenants {
        loop {
            let rows: Vec<(String, String, i64, Vec<u8>)> = sqlx::query_as(
                "SELECT run_id, branch_id, lsn, payload FROM bench_outbox_mark
                  WHERE tenant_id = $1 AND shipped_at IS NULL ORDER BY seq LIMIT $2",
            )
            .bind(tenant.as_str())
            .bind(i64::from(BATCH))
            .fetch_all(pool)
            .await
            .expect("drain");
            if rows.is_empty() {
                break;
            }
            let runs: Vec<&str> = rows.iter().map(|row| row.0.as_str()).collect();
            let branches: Vec<&str> = rows.iter().map(|row| row.1.as_str()).collect();
            let lsns: Vec<i64> = rows.iter().map(|row| row.2).collect();
            moved += sqlx::query(
                "UPDATE bench_outbox_mark o SET shipped_at = now()
                   FROM unnest($2::text[], $3::text[], $4::bigint[]) AS k(run_id, branch_id, lsn)
                  WHERE o.tenant_id = $1 AND o.run_id = k.run_id AND o.branch_id = k.branch_id
                    AND o.lsn = k.lsn AND o.shipped_at IS NULL",
            )
            .bind(tenant.as_str())
            .bind(&runs)
            .bind(&branches)
            .bind(&lsns)
            .execute(pool)
            .await
            .expect("ack")
            .rows_affected();
        }
    }
    moved
}

#[tokio::main]
async fn main() {
    let rows: u64 = std::env::var("BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let name = format!("relay_bench_{}", std::process::id());
    let mut admin = PgConnection::connect(&url)
        .await
        .expect("connect to DATABASE_URL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create db");
    let base = url
        .rsplit_once('/')
        .map(|(base, _)| base.to_owned())
        .expect("URL has a database");
    let pool = PgPool::connect(&format!("{base}/{name}"))
        .await
        .expect("connect bench db");
    store::migrate(&pool).await.expect("migrate");
    exec(&pool, "CREATE TABLE bench_outbox_mark (LIKE relay_outbox INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING CONSTRAINTS)".into()).await;
    exec(&pool, "ALTER TABLE bench_outbox_mark ADD PRIMARY KEY (tenant_id, run_id, branch_id, lsn), ADD COLUMN shipped_at timestamptz".into()).await;
    exec(
        &pool,
        "CREATE INDEX ON bench_outbox_mark (tenant_id, seq) WHERE shipped_at IS NULL".into(),
    )
    .await;
    let tenants: Vec<TenantId> = (0..TENANTS)
        .map(|i| TenantId::new(format!("t{i}")).expect("valid id"))
        .collect();
    let outbox = Outbox::new(pool.clone());
    // One relay holding every lease bucket for the whole run.
    let me = RelayId::generate();
    let ttl = Duration::from_secs(3600);
    let leases = LeaseStore::new(pool.clone());
    // Every bucket is free in a fresh database: claimable at once.
    let free: Vec<Claimable> = leases
        .survey()
        .await
        .expect("survey")
        .into_iter()
        .map(|row| Claimable {
            bucket: row.bucket,
            epoch: row.epoch,
            beat: row.beat,
        })
        .collect();
    let until = Instant::now() + ttl;
    let claimed = leases
        .claim(&me, ttl, LEASE_BUCKETS, &free)
        .await
        .expect("claim");
    let fences: std::collections::BTreeMap<Bucket, Lease> = claimed
        .into_iter()
        .map(|(bucket, epoch)| (bucket, Lease::new(bucket, me.clone(), epoch, until)))
        .collect();

    println!(
        "drain+ack, {rows} rows per round, {TENANTS} tenants, batch {BATCH}, 256-byte payloads"
    );
    println!("| strategy | round | rows/s |");
    println!("|---|---|---|");
    for round in 1..=2u64 {
        exec(&pool, fill_sql("relay_outbox", rows, round)).await;
        exec(&pool, fill_sql("bench_outbox_mark", rows, round)).await;
        exec(&pool, "VACUUM ANALYZE relay_outbox".into()).await;
        exec(&pool, "VACUUM ANALYZE bench_outbox_mark".into()).await;

        let started = Instant::now();
        let moved = drain_with_delete(&outbox, &tenants).await;
        assert_eq!(moved, rows);
        println!(
            "| delete (shipped) | {round} | {:.0} |",
            moved as f64 / started.elapsed().as_secs_f64()
        );

        let local = Outbox::new(pool.clone())
            .replicated(store::Replication::Local, Duration::from_secs(10));
        for (label, book, offset, outbox) in [
            ("delete, ack_and_drain unfenced", None, 10, &outbox),
            (
                "delete, ack_and_drain fenced (relay's step)",
                Some(&fences),
                20,
                &outbox,
            ),
            (
                "delete, ack_and_drain fenced, RELAY_PUBLISH_REPLICATED=local",
                Some(&fences),
                30,
                &local,
            ),
        ] {
            exec(&pool, fill_sql("relay_outbox", rows, round + offset)).await;
            exec(&pool, "VACUUM ANALYZE relay_outbox".into()).await;
            let started = Instant::now();
            let moved = drain_with_ack_and_drain(outbox, &tenants, book).await;
            assert_eq!(moved, rows);
            println!(
                "| {label} | {round} | {:.0} |",
                moved as f64 / started.elapsed().as_secs_f64()
            );
        }

        let started = Instant::now();
        let moved = drain_with_mark(&pool, &tenants).await;
        assert_eq!(moved, rows);
        println!(
            "| mark shipped_at | {round} | {:.0} |",
            moved as f64 / started.elapsed().as_secs_f64()
        );
    }
    pool.close().await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("drop db");
}

//! Bulk fixtures for benchmarks (feature `fixtures`): a backlog written in one statement, far
//! faster than appending intent by intent. Never compiled into the relay.
use sqlx::PgPool;

use crate::Error;

/// Opens `tenants x runs` runs (`<prefix><t>` / `r<n>` / `main`) and appends `per_run` intents
/// to each, with `payload_bytes`-byte payloads, interleaved across runs in insertion order.
/// Returns the number of intents written.
pub async fn fill_backlog(
    pool: &PgPool,
    prefix: &str,
    tenants: u32,
    runs: u32,
    per_run: u32,
    payload_bytes: u32,
) -> Result<u64, Error> {
    sqlx::query(
        "INSERT INTO relay_branch (tenant_id, run_id, branch_id, base_lsn, head_lsn)
         SELECT $1 || t, 'r' || r, 'main', 0, $4
           FROM generate_series(0, $2 - 1) t, generate_series(0, $3 - 1) r",
    )
    .bind(prefix)
    .bind(i64::from(tenants))
    .bind(i64::from(runs))
    .bind(i64::from(per_run))
    .execute(pool)
    .await?;
    let written = sqlx::query(
        "INSERT INTO relay_outbox (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload)
         SELECT $1 || t, 'r' || r, 'main', l, l - 1, 0, convert_to(repeat('x', $5), 'UTF8')
           FROM generate_series(1, $4) l, generate_series(0, $2 - 1) t, generate_series(0, $3 - 1) r
          ORDER BY l, t, r",
    )
    .bind(prefix)
    .bind(i64::from(tenants))
    .bind(i64::from(runs))
    .bind(i64::from(per_run))
    .bind(payload_bytes as i32)
    .execute(pool)
    .await?
    .rows_affected();
    sqlx::query("ANALYZE relay_outbox").execute(pool).await?;
    Ok(written)
}

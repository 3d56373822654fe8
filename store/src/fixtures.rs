//! Bulk fixtures for benchmarks (feature `fixtures`): a backlog written in one statement, far
//! faster than appending intent by intent. Never compiled into the relay.
use sqlx::PgPool;

use crate::error::Error;

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
    fill_backlog_with(pool, prefix, tenants, runs, per_run, payload_bytes, None).await
}

/// Like [`fill_backlog`], every intent carrying `meta` as the writer stores it (rows written
/// once, laid out as a host appending with metadata leaves them).
pub async fn fill_backlog_with(
    pool: &PgPool,
    prefix: &str,
    tenants: u32,
    runs: u32,
    per_run: u32,
    payload_bytes: u32,
    meta: Option<&crate::meta::Metadata>,
) -> Result<u64, Error> {
    open_branches(pool, prefix, tenants, runs, per_run).await?;
    let meta = meta.filter(|meta| !meta.is_empty()).map(sqlx::types::Json);
    let written = sqlx::query(
        "INSERT INTO relay_outbox (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, meta)
         SELECT $1 || t, 'r' || r, 'main', l, l - 1, 0, convert_to(repeat('x', $5), 'UTF8'), $6
           FROM generate_series(1, $4) l, generate_series(0, $2 - 1) t, generate_series(0, $3 - 1) r
          ORDER BY l, t, r",
    )
    .bind(prefix)
    .bind(i64::from(tenants))
    .bind(i64::from(runs))
    .bind(i64::from(per_run))
    .bind(payload_bytes as i32)
    .bind(meta)
    .execute(pool)
    .await?
    .rows_affected();
    sqlx::query("ANALYZE relay_outbox").execute(pool).await?;
    Ok(written)
}

/// Like [`fill_backlog`], but every payload is `payload_bytes` of pseudo-random bytes
/// (incompressible: PostgreSQL's TOAST compression and the broker see full-size payloads), in
/// chunks of a few megabytes. Returns the number of intents written.
pub async fn fill_backlog_random(
    pool: &PgPool,
    prefix: &str,
    tenants: u32,
    runs: u32,
    per_run: u32,
    payload_bytes: u32,
) -> Result<u64, Error> {
    // One transaction: a relay already running sees the whole backlog at once.
    let mut tx = pool.begin().await?;
    open_branches(&mut *tx, prefix, tenants, runs, per_run).await?;
    let mut random = Incompressible::default();
    let chunk = (8 << 20) / (payload_bytes as usize).max(1);
    let rows: Vec<(String, String, i64)> = (1..=i64::from(per_run))
        .flat_map(|lsn| {
            (0..tenants).flat_map(move |t| {
                (0..runs).map(move |r| (format!("{prefix}{t}"), format!("r{r}"), lsn))
            })
        })
        .collect();
    let mut written = 0;
    for part in rows.chunks(chunk.max(1)) {
        let tenant_ids: Vec<&str> = part.iter().map(|(t, _, _)| t.as_str()).collect();
        let run_ids: Vec<&str> = part.iter().map(|(_, r, _)| r.as_str()).collect();
        let lsns: Vec<i64> = part.iter().map(|(_, _, l)| *l).collect();
        let payloads: Vec<Vec<u8>> = part
            .iter()
            .map(|_| random.bytes(payload_bytes as usize))
            .collect();
        written += sqlx::query(
            "INSERT INTO relay_outbox (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload)
             SELECT t, r, 'main', l, l - 1, 0, p
               FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bytea[]) AS x(t, r, l, p)",
        )
        .bind(&tenant_ids)
        .bind(&run_ids)
        .bind(&lsns)
        .bind(&payloads)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    }
    tx.commit().await?;
    sqlx::query("ANALYZE relay_outbox").execute(pool).await?;
    Ok(written)
}

/// The branches `<prefix><t>` / `r<n>` / `main`, their head at `per_run`.
async fn open_branches<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    prefix: &str,
    tenants: u32,
    runs: u32,
    per_run: u32,
) -> Result<(), Error> {
    sqlx::query(
        "INSERT INTO relay_branch (tenant_id, run_id, branch_id, base_lsn, head_lsn)
         SELECT $1 || t, 'r' || r, 'main', 0, $4
           FROM generate_series(0, $2 - 1) t, generate_series(0, $3 - 1) r",
    )
    .bind(prefix)
    .bind(i64::from(tenants))
    .bind(i64::from(runs))
    .bind(i64::from(per_run))
    .execute(executor)
    .await?;
    Ok(())
}

/// Pseudo-random bytes, incompressible enough for pglz and any broker (xorshift64*): payloads
/// that PostgreSQL's TOAST compression and the broker see at full size.
#[derive(Debug)]
pub struct Incompressible(u64);

impl Default for Incompressible {
    fn default() -> Self {
        Self(0x9e37_79b9_7f4a_7c15)
    }
}

impl Incompressible {
    /// The next `len` bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(len + 8);
        while bytes.len() < len {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            bytes.extend_from_slice(&self.0.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
        }
        bytes.truncate(len);
        bytes
    }
}

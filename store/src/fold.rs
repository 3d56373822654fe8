//! The consumer's fold: applies each delivered event exactly once, in Lsn order per branch.
//!
//! Exactly-once is achieved here, not in transport. Each delivery runs one transaction that
//! locks the branch's cursor and then:
//! - `lsn <= applied`: a redelivery, a no-op;
//! - `prev_lsn == applied`: the next event, applied; then any parked successors it unblocks;
//! - `prev_lsn > applied`: its predecessor has not been applied, so it is parked, not applied.
//!
//! The consumer acks the delivery only after this transaction commits.
use sqlx::{PgConnection, PgPool};

use crate::{BranchKey, Error, EventKey, Lsn, OutboxEvent, TenantId};

/// What applying one delivery did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FoldOutcome {
    /// The event was applied, followed by `released` parked successors.
    Applied {
        /// Parked successors applied after it.
        released: u32,
    },
    /// Already applied: a redelivery, nothing changed.
    Duplicate,
    /// Delivered ahead of its predecessor: kept until the gap closes.
    Parked,
}

/// One event of the folded state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoldedEvent {
    /// `(BranchKey, Lsn)`.
    pub key: EventKey,
    /// The body applied.
    pub payload: Vec<u8>,
}

/// The fold's tables. Cheap to clone.
#[derive(Clone, Debug)]
pub struct FoldStore {
    pool: PgPool,
}

impl FoldStore {
    /// The fold on `pool` (migrated with [`crate::migrate`]).
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Applies one delivered event in its own transaction; see the module docs for the rules.
    pub async fn apply(&self, event: &OutboxEvent) -> Result<FoldOutcome, Error> {
        let key = &event.key.branch;
        let lsn = event.key.lsn.to_db()?;
        let prev = event.prev_lsn.to_db()?;
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO relay_fold_cursor (tenant_id, run_id, branch_id, applied_lsn)
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(event.base_lsn.to_db()?)
        .execute(&mut *tx)
        .await?;
        let applied: i64 = sqlx::query_scalar(
            "SELECT applied_lsn FROM relay_fold_cursor
              WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 FOR UPDATE",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .fetch_one(&mut *tx)
        .await?;

        let outcome = if lsn <= applied {
            FoldOutcome::Duplicate
        } else if prev == applied {
            insert_folded(&mut tx, key, lsn, &event.payload).await?;
            let mut cursor = lsn;
            let mut released = 0;
            while let Some((next_lsn, payload)) =
                take_parked_successor(&mut tx, key, cursor).await?
            {
                insert_folded(&mut tx, key, next_lsn, &payload).await?;
                cursor = next_lsn;
                released += 1;
            }
            set_cursor(&mut tx, key, cursor).await?;
            FoldOutcome::Applied { released }
        } else if prev > applied {
            sqlx::query(
                "INSERT INTO relay_fold_parked (tenant_id, run_id, branch_id, lsn, prev_lsn, payload)
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
            )
            .bind(key.tenant.as_str())
            .bind(key.run.as_str())
            .bind(key.branch.as_str())
            .bind(lsn)
            .bind(prev)
            .bind(&event.payload)
            .execute(&mut *tx)
            .await?;
            FoldOutcome::Parked
        } else {
            return Err(Error::BrokenChain {
                branch: key.clone(),
                lsn: event.key.lsn,
                prev: event.prev_lsn,
                applied: Lsn::from_db(applied),
            });
        };
        tx.commit().await?;
        Ok(outcome)
    }

    /// The folded state of `tenant`, in the order the fold applied it.
    pub async fn folded(&self, tenant: &TenantId) -> Result<Vec<FoldedEvent>, Error> {
        let rows: Vec<(String, String, i64, Vec<u8>)> = sqlx::query_as(
            "SELECT run_id, branch_id, lsn, payload FROM relay_fold_event
              WHERE tenant_id = $1 ORDER BY applied_seq",
        )
        .bind(tenant.as_str())
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(run, branch, lsn, payload)| {
                Ok(FoldedEvent {
                    key: EventKey::from_db(tenant, run, branch, lsn)?,
                    payload,
                })
            })
            .collect()
    }

    /// How many events of `tenant` are parked waiting for a predecessor.
    pub async fn parked(&self, tenant: &TenantId) -> Result<u64, Error> {
        let parked: i64 =
            sqlx::query_scalar("SELECT count(*) FROM relay_fold_parked WHERE tenant_id = $1")
                .bind(tenant.as_str())
                .fetch_one(&self.pool)
                .await?;
        Ok(parked.max(0) as u64)
    }
}

async fn insert_folded(
    conn: &mut PgConnection,
    key: &BranchKey,
    lsn: i64,
    payload: &[u8],
) -> Result<(), Error> {
    sqlx::query(
        "INSERT INTO relay_fold_event (tenant_id, run_id, branch_id, lsn, payload)
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(lsn)
    .bind(payload)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn take_parked_successor(
    conn: &mut PgConnection,
    key: &BranchKey,
    applied: i64,
) -> Result<Option<(i64, Vec<u8>)>, Error> {
    Ok(sqlx::query_as(
        "DELETE FROM relay_fold_parked
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 AND prev_lsn = $4
         RETURNING lsn, payload",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(applied)
    .fetch_optional(&mut *conn)
    .await?)
}

async fn set_cursor(conn: &mut PgConnection, key: &BranchKey, applied: i64) -> Result<(), Error> {
    sqlx::query(
        "UPDATE relay_fold_cursor SET applied_lsn = $4
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(applied)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

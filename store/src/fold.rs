//! The consumer's fold: applies each delivered event exactly once, in Lsn order per branch, and
//! only on live history.
//!
//! Exactly-once is achieved here, not in transport. [`fold`] runs inside the caller's
//! transaction (the consumer commits it, then acks the delivery), locks the branch's cursor, and:
//! - an intent with `lsn <= applied` is a redelivery: a no-op;
//! - an intent with `prev_lsn == applied` is the next one: handed to the [`Projection`], then
//!   any parked successors it unblocks, in order, into the same projection;
//! - an intent with `prev_lsn > applied` arrived ahead of its predecessor: parked;
//! - a **rewind marker** abandons the branch above its fork point: whatever the projection
//!   applied above it is undone by [`Projection::rewind`] in the same transaction, parked
//!   intents above it are dropped, and no intent above it is ever applied afterwards;
//! - the first intent of a branch forked by a rewind waits (parked) until the parent's marker
//!   is folded and the parent is applied up to the fork point, so the projection sees exactly
//!   the host's live history, in its order: parent up to the fork, then the new branch.
//!
//! Only cursors and parked intents are stored by the fold itself; [`EventTable`] is the
//! project's demonstration projection that also keeps every applied event.
use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

use crate::{BranchId, BranchKey, Error, EventKey, EventKind, Lsn, OutboxEvent, TenantId};

/// What folding one delivery did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FoldOutcome {
    /// The intent was applied, followed by `released` parked intents it unblocked.
    Applied {
        /// Parked intents applied after it (of its branch, or of a branch forked from it).
        released: u32,
    },
    /// Already applied (or the marker already folded): a redelivery, nothing changed.
    Duplicate,
    /// Delivered ahead of its predecessor (or of its parent's rewind): kept until then.
    Parked,
    /// A rewind marker: the branch is closed above its fork point; `released` intents of the
    /// new branch that were waiting for it were applied.
    Rewound {
        /// Parked intents of the new branch applied after the marker.
        released: u32,
    },
    /// An intent above the fork point of a branch whose marker was folded: never applied.
    Abandoned,
}

/// A rewind, as the fold hands it to a [`Projection`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RewindNotice {
    /// The abandoned branch.
    pub branch: BranchKey,
    /// The fork point: intents of `branch` up to it are live history, above it they are not.
    pub fork: Lsn,
    /// The highest Lsn of `branch` applied before the marker. If it is above `fork`, the
    /// projection must undo what it applied for Lsns in `(fork, applied]`.
    pub applied: Lsn,
    /// The branch that live history continues on (its intents come after this call).
    pub to: BranchId,
}

/// What a consumer does with events: writes in the fold's open transaction, so the writes
/// commit atomically with the fold's cursor (or not at all).
pub trait Projection: Send {
    /// The projection's own error. Any error rolls the whole delivery back.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Applies one intent of live history, in Lsn order per branch.
    fn apply(
        &mut self,
        tx: &mut PgConnection,
        event: &OutboxEvent,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// A branch was rewound: undo what was applied above `rewind.fork` (see [`RewindNotice`]).
    fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &RewindNotice,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Whether `error` will fail again however often the delivery is retried. A consumer
    /// dead-letters such a delivery (the branch waits behind it) and retries any other error
    /// with backoff. Default: every error is transient.
    fn is_permanent(error: &Self::Error) -> bool {
        let _ = error;
        false
    }
}

/// Why folding a delivery failed. Either way nothing of it was committed.
#[derive(Debug, thiserror::Error)]
pub enum FoldError<E> {
    /// The fold's own tables, or a delivery that breaks the chain ([`Error::BrokenChain`]).
    #[error(transparent)]
    Store(#[from] Error),
    /// The projection refused or failed.
    #[error("projection failed: {0}")]
    Projection(#[source] E),
}

struct Cursor {
    applied: i64,
    abandoned_at: Option<i64>,
    rewound_to: Option<String>,
    /// A forked branch starts once its parent is folded up to the fork and rewound.
    started: bool,
}

/// Locks `key`'s cursor, creating it at `base` (started unless the branch has a parent).
async fn lock_cursor(
    tx: &mut PgConnection,
    key: &BranchKey,
    base: i64,
    has_parent: bool,
) -> Result<Cursor, Error> {
    sqlx::query(
        "INSERT INTO relay_fold_cursor (tenant_id, run_id, branch_id, applied_lsn, started)
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(base)
    .bind(!has_parent)
    .execute(&mut *tx)
    .await?;
    let (applied, abandoned_at, rewound_to, started): (i64, Option<i64>, Option<String>, bool) =
        sqlx::query_as(
            "SELECT applied_lsn, abandoned_at_lsn, rewound_to, started FROM relay_fold_cursor
              WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 FOR UPDATE",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .fetch_one(&mut *tx)
        .await?;
    Ok(Cursor {
        applied,
        abandoned_at,
        rewound_to,
        started,
    })
}

/// Whether a forked branch's parent is ready for it: started itself, folded up to its fork
/// point, and its marker folded. FOR SHARE waits for a marker being folded concurrently.
async fn parent_ready(tx: &mut PgConnection, parent: &BranchKey) -> Result<bool, Error> {
    let row: Option<(i64, Option<i64>, bool)> = sqlx::query_as(
        "SELECT applied_lsn, abandoned_at_lsn, started FROM relay_fold_cursor
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 FOR SHARE",
    )
    .bind(parent.tenant.as_str())
    .bind(parent.run.as_str())
    .bind(parent.branch.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    Ok(matches!(row, Some((applied, Some(at), true)) if applied >= at))
}

fn sibling(key: &BranchKey, branch: BranchId) -> BranchKey {
    BranchKey::new(key.tenant.clone(), key.run.clone(), branch)
}

/// Folds one delivered event in `tx` (see the module docs). The caller commits `tx`, then acks.
pub async fn fold<P: Projection>(
    tx: &mut PgConnection,
    event: &OutboxEvent,
    projection: &mut P,
) -> Result<FoldOutcome, FoldError<P::Error>> {
    let key = &event.key.branch;
    let lsn = event.key.lsn.to_db()?;
    let prev = event.prev_lsn.to_db()?;
    let base = event.base_lsn.to_db()?;
    let mut cursor = lock_cursor(tx, key, base, event.parent.is_some()).await?;
    if let EventKind::Rewind { to } = &event.kind {
        return fold_rewind(tx, key, prev, to, cursor, projection).await;
    }
    if cursor.abandoned_at.is_some_and(|at| lsn > at) {
        return Ok(FoldOutcome::Abandoned);
    }
    if lsn <= cursor.applied {
        return Ok(FoldOutcome::Duplicate);
    }
    if prev < cursor.applied {
        return Err(Error::BrokenChain {
            branch: key.clone(),
            lsn: event.key.lsn,
            prev: event.prev_lsn,
            applied: Lsn::from_db(cursor.applied),
        }
        .into());
    }
    // The first intent of a forked branch may only follow its parent's marker.
    if !cursor.started && prev == cursor.applied {
        let parent = event.parent.clone().map(|parent| sibling(key, parent));
        cursor.started = match parent {
            Some(parent) => parent_ready(tx, &parent).await?,
            None => true,
        };
    }
    if prev > cursor.applied || !cursor.started {
        park(tx, event).await?;
        return Ok(FoldOutcome::Parked);
    }
    projection
        .apply(tx, event)
        .await
        .map_err(FoldError::Projection)?;
    let released = advance(tx, key, lsn, cursor, projection).await?;
    Ok(FoldOutcome::Applied { released })
}

/// After applying up to `applied` on a started branch `key`: applies its parked successors,
/// stores the cursor, and once a rewound branch reaches its fork point, starts the branch
/// forked from it and does the same there.
async fn advance<P: Projection>(
    tx: &mut PgConnection,
    key: &BranchKey,
    applied: i64,
    cursor: Cursor,
    projection: &mut P,
) -> Result<u32, FoldError<P::Error>> {
    let mut released = 0;
    let mut key = key.clone();
    let mut applied = applied;
    let mut cursor = cursor;
    loop {
        while cursor.abandoned_at.is_none_or(|at| applied < at)
            && let Some(next) = take_parked_successor(tx, &key, applied).await?
        {
            projection
                .apply(tx, &next)
                .await
                .map_err(FoldError::Projection)?;
            applied = next.key.lsn.to_db()?;
            released += 1;
        }
        set_cursor(tx, &key, applied, true).await?;
        // A rewound branch folded up to its fork: the branch forked from it starts.
        let (Some(at), Some(to)) = (cursor.abandoned_at, cursor.rewound_to.take()) else {
            return Ok(released);
        };
        if applied != at {
            return Ok(released);
        }
        key = sibling(&key, BranchId::new(to)?);
        cursor = lock_cursor(tx, &key, at, true).await?;
        if cursor.started {
            return Ok(released);
        }
        applied = cursor.applied;
    }
}

async fn fold_rewind<P: Projection>(
    tx: &mut PgConnection,
    key: &BranchKey,
    fork: i64,
    to: &BranchId,
    cursor: Cursor,
    projection: &mut P,
) -> Result<FoldOutcome, FoldError<P::Error>> {
    if cursor.abandoned_at.is_some() {
        return Ok(FoldOutcome::Duplicate);
    }
    let notice = RewindNotice {
        branch: key.clone(),
        fork: Lsn::from_db(fork),
        applied: Lsn::from_db(cursor.applied),
        to: to.clone(),
    };
    projection
        .rewind(tx, &notice)
        .await
        .map_err(FoldError::Projection)?;
    sqlx::query(
        "DELETE FROM relay_fold_parked
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 AND lsn > $4",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(fork)
    .execute(&mut *tx)
    .await
    .map_err(Error::from)?;
    let applied = cursor.applied.min(fork);
    sqlx::query(
        "UPDATE relay_fold_cursor SET applied_lsn = $4, abandoned_at_lsn = $5, rewound_to = $6
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(applied)
    .bind(fork)
    .bind(to.as_str())
    .execute(&mut *tx)
    .await
    .map_err(Error::from)?;
    if !cursor.started {
        // Nothing of this branch applies before its own parent is ready; it is started (and
        // its successors released) from there.
        return Ok(FoldOutcome::Rewound { released: 0 });
    }
    let closed = Cursor {
        applied,
        abandoned_at: Some(fork),
        rewound_to: Some(to.as_str().to_owned()),
        started: true,
    };
    let released = advance(tx, key, applied, closed, projection).await?;
    Ok(FoldOutcome::Rewound { released })
}

async fn park(tx: &mut PgConnection, event: &OutboxEvent) -> Result<(), Error> {
    let key = &event.key.branch;
    sqlx::query(
        "INSERT INTO relay_fold_parked
             (tenant_id, run_id, branch_id, lsn, prev_lsn, payload, base_lsn, created_at,
              parent_branch_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(event.key.lsn.to_db()?)
    .bind(event.prev_lsn.to_db()?)
    .bind(&event.payload)
    .bind(event.base_lsn.to_db()?)
    .bind(event.created_at)
    .bind(event.parent.as_ref().map(BranchId::as_str))
    .execute(&mut *tx)
    .await?;
    Ok(())
}

type ParkedRow = (i64, i64, Vec<u8>, i64, DateTime<Utc>, Option<String>);

async fn take_parked_successor(
    tx: &mut PgConnection,
    key: &BranchKey,
    applied: i64,
) -> Result<Option<OutboxEvent>, Error> {
    let row: Option<ParkedRow> = sqlx::query_as(
        "DELETE FROM relay_fold_parked
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 AND prev_lsn = $4
         RETURNING lsn, prev_lsn, payload, base_lsn, created_at, parent_branch_id",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(applied)
    .fetch_optional(&mut *tx)
    .await?;
    row.map(|(lsn, prev, payload, base, created_at, parent)| {
        Ok(OutboxEvent {
            key: EventKey {
                branch: key.clone(),
                lsn: Lsn::from_db(lsn),
            },
            prev_lsn: Lsn::from_db(prev),
            base_lsn: Lsn::from_db(base),
            payload,
            created_at,
            kind: EventKind::Intent,
            parent: parent.map(BranchId::new).transpose()?,
        })
    })
    .transpose()
}

async fn set_cursor(
    tx: &mut PgConnection,
    key: &BranchKey,
    applied: i64,
    started: bool,
) -> Result<(), Error> {
    sqlx::query(
        "UPDATE relay_fold_cursor SET applied_lsn = $4, started = $5
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(applied)
    .bind(started)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The project's demonstration projection: keeps every applied event in `relay_fold_event`
/// and deletes the abandoned ones on a rewind.
#[derive(Clone, Copy, Debug, Default)]
pub struct EventTable;

impl Projection for EventTable {
    type Error = Error;

    fn is_permanent(error: &Error) -> bool {
        !error.is_transient()
    }

    async fn apply(&mut self, tx: &mut PgConnection, event: &OutboxEvent) -> Result<(), Error> {
        let key = &event.key.branch;
        sqlx::query(
            "INSERT INTO relay_fold_event (tenant_id, run_id, branch_id, lsn, payload)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(event.key.lsn.to_db()?)
        .bind(&event.payload)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    async fn rewind(&mut self, tx: &mut PgConnection, rewind: &RewindNotice) -> Result<(), Error> {
        let key = &rewind.branch;
        sqlx::query(
            "DELETE FROM relay_fold_event
              WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 AND lsn > $4",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(rewind.fork.to_db()?)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// One event of the folded state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoldedEvent {
    /// `(BranchKey, Lsn)`.
    pub key: EventKey,
    /// The body applied.
    pub payload: Vec<u8>,
}

/// The fold with the [`EventTable`] projection, each delivery in its own transaction.
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct FoldStore {
    pool: PgPool,
}

fn flatten(err: FoldError<Error>) -> Error {
    match err {
        FoldError::Store(err) | FoldError::Projection(err) => err,
    }
}

impl FoldStore {
    /// The fold on `pool` (migrated with [`crate::migrate`]).
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// The pool it folds on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies one delivered event in its own transaction; see the module docs for the rules.
    pub async fn apply(&self, event: &OutboxEvent) -> Result<FoldOutcome, Error> {
        let mut tx = self.pool.begin().await?;
        let outcome = fold(&mut tx, event, &mut EventTable)
            .await
            .map_err(flatten)?;
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

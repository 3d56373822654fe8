//! The host's write API: every call runs inside the host's own transaction.
//!
//! Pass the host's transaction as `&mut tx` (any `&mut PgConnection` works): the intent then
//! commits or rolls back with the host's state. A plain pooled connection runs each call in its
//! own implicit transaction. Bad input is refused before any SQL runs, and a
//! refused append leaves the host's transaction usable (no statement failed).
use std::borrow::Cow;

use sqlx::PgConnection;

use crate::{BranchId, BranchKey, Error, Lsn, Schema};

/// Default largest payload, 256 KiB: far below RabbitMQ's 128 MiB `max_message_size` and small
/// enough that a relay batch of 1,000 intents stays bounded in memory.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 256 * 1024;

/// What a rewind did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rewound {
    /// The new live branch.
    pub live: BranchKey,
    /// How many unshipped intents of the old branch's tail were abandoned (never exported).
    pub abandoned: u64,
}

/// Writes export intents in the host's transaction.
#[derive(Clone, Debug)]
pub struct IntentWriter {
    /// Largest payload accepted, in bytes. Default: [`DEFAULT_MAX_PAYLOAD_BYTES`].
    max_payload_bytes: usize,
    /// Whether each append NOTIFYs relays on commit. Default on. Measured cost: PostgreSQL
    /// serialises the commits of notifying transactions, which halved commit throughput at 8
    /// concurrent writers on the reference machine (see ARCHITECTURE.md). An embedded relay can
    /// be woken in-process instead (`RelayHandle::waker`); polling catches everything regardless.
    notify: bool,
    /// The schema of the relay's tables (`relay_branch`, `relay_outbox`), named in every
    /// statement; `None`: the host connection's `search_path` finds them (normally `public`).
    schema: Option<Schema>,
}

impl Default for IntentWriter {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_PAYLOAD_BYTES)
    }
}

struct BranchRow {
    base_lsn: i64,
    head_lsn: i64,
    abandoned_at_lsn: Option<i64>,
    parent_branch_id: Option<String>,
}

async fn branch_row(
    writer: &IntentWriter,
    conn: &mut PgConnection,
    key: &BranchKey,
    lock: bool,
) -> Result<Option<BranchRow>, Error> {
    let sql = if lock {
        "SELECT base_lsn, head_lsn, abandoned_at_lsn, parent_branch_id FROM relay_branch
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 FOR UPDATE"
    } else {
        "SELECT base_lsn, head_lsn, abandoned_at_lsn, parent_branch_id FROM relay_branch
          WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3"
    };
    let row: Option<(i64, i64, Option<i64>, Option<String>)> = sqlx::query_as(writer.sql(sql))
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .fetch_optional(&mut *conn)
        .await?;
    Ok(row.map(
        |(base_lsn, head_lsn, abandoned_at_lsn, parent_branch_id)| BranchRow {
            base_lsn,
            head_lsn,
            abandoned_at_lsn,
            parent_branch_id,
        },
    ))
}

impl IntentWriter {
    /// A writer refusing payloads above `max_payload_bytes`. Keep it below the broker's
    /// largest message (RabbitMQ's `max_message_size`, 128 MiB by default, compared with the
    /// body): an intent above that is refused by the broker for ever, and its branch parks
    /// (reason `too_large`) until the limit is raised.
    pub fn new(max_payload_bytes: usize) -> Self {
        Self {
            max_payload_bytes,
            notify: true,
            schema: None,
        }
    }

    /// Names the relay's tables in `schema` (created by [`crate::create_schema`] and
    /// [`crate::migrate`] on connections with [`Schema::apply`]) instead of
    /// relying on the host's `search_path`; the host's own statements are not affected.
    pub fn with_schema(mut self, schema: Schema) -> Self {
        self.schema = Some(schema);
        self
    }

    /// `statement` with the relay's tables qualified by the schema, if any.
    fn sql(&self, statement: &'static str) -> sqlx::AssertSqlSafe<Cow<'static, str>> {
        sqlx::AssertSqlSafe(match &self.schema {
            None => Cow::Borrowed(statement),
            Some(schema) => Cow::Owned(schema.qualify(statement)),
        })
    }

    /// Whether appends NOTIFY relays on commit (default on; see the field's documentation).
    pub fn with_notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// The configured payload limit.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// Opens a run with its first (live) branch, starting at Lsn 0.
    pub async fn open_run(&self, conn: &mut PgConnection, key: &BranchKey) -> Result<(), Error> {
        // A run that already has a branch (live or abandoned) is refused. Two concurrent opens of
        // one run are stopped by the one-live-branch-per-run unique index.
        let inserted = sqlx::query(self.sql(
            "INSERT INTO relay_branch (tenant_id, run_id, branch_id, base_lsn, head_lsn)
             SELECT $1, $2, $3, 0, 0
              WHERE NOT EXISTS (SELECT 1 FROM relay_branch WHERE tenant_id = $1 AND run_id = $2)",
        ))
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .execute(&mut *conn)
        .await
        .map_err(|err| unique_violation_as(err, || run_open(key)))?;
        if inserted.rows_affected() == 0 {
            return Err(run_open(key));
        }
        Ok(())
    }

    /// Appends the export intent `(key, lsn)` with `payload`, in the host's transaction: it
    /// commits or rolls back with the host's own writes.
    ///
    /// ```no_run
    /// use store::{BranchId, BranchKey, IntentWriter, Lsn, RunId, TenantId};
    ///
    /// # async fn host(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let branch = BranchKey::new(TenantId::new("acme")?, RunId::new("run-1")?, BranchId::new("main")?);
    /// let writer = IntentWriter::default();
    /// let mut tx = pool.begin().await?;
    /// writer.open_run(&mut tx, &branch).await?; // once, when the run starts
    /// // ... the host's own state writes in `tx` ...
    /// writer.append(&mut tx, &branch, Lsn::new(1), br#"{"step":1}"#).await?;
    /// tx.commit().await?; // the intent is visible to relays from here on
    /// # Ok(()) }
    /// ```
    ///
    /// Invariant: appends to one branch are serialised on the branch row's lock, held until the
    /// host commits, so a branch's intents commit in Lsn order and a reader only ever sees a
    /// gap-free prefix of each branch.
    pub async fn append(
        &self,
        conn: &mut PgConnection,
        key: &BranchKey,
        lsn: Lsn,
        payload: &[u8],
    ) -> Result<(), Error> {
        if payload.len() > self.max_payload_bytes {
            return Err(Error::PayloadTooLarge {
                size: payload.len(),
                max: self.max_payload_bytes,
            });
        }
        let lsn_db = lsn.to_db()?;
        let sql = if self.notify {
            APPEND_AND_NOTIFY
        } else {
            APPEND
        };
        let inserted = sqlx::query(self.sql(sql))
            .bind(key.tenant.as_str())
            .bind(key.run.as_str())
            .bind(key.branch.as_str())
            .bind(lsn_db)
            .bind(payload)
            .execute(&mut *conn)
            .await?;
        if inserted.rows_affected() == 1 {
            return Ok(());
        }
        // Refused: say why. Nothing was written.
        Err(match branch_row(self, conn, key, false).await? {
            None => Error::UnknownBranch {
                branch: key.clone(),
            },
            Some(BranchRow {
                abandoned_at_lsn: Some(at),
                ..
            }) => Error::BranchAbandoned {
                branch: key.clone(),
                at: Lsn::from_db(at),
            },
            Some(row) => Error::LsnNotAboveHead {
                branch: key.clone(),
                lsn,
                head: Lsn::from_db(row.head_lsn),
            },
        })
    }

    /// Rewinds: forks a new live branch `new_branch` from the live branch `from` at Lsn `at`.
    /// The old branch's intents after `at` that are not yet shipped are abandoned (deleted, never
    /// exported); its intents up to `at` stay on live history and still ship under its key.
    ///
    /// A rewind marker is written on the old branch after all its intents: consumers learn that
    /// the branch ends at `at` (undoing anything above it they applied, since intents already in
    /// flight when the rewind commits may still arrive) and continues on `new_branch`.
    pub async fn rewind(
        &self,
        conn: &mut PgConnection,
        from: &BranchKey,
        at: Lsn,
        new_branch: BranchId,
    ) -> Result<Rewound, Error> {
        let at_db = at.to_db()?;
        let live = BranchKey::new(from.tenant.clone(), from.run.clone(), new_branch);
        let row =
            branch_row(self, conn, from, true)
                .await?
                .ok_or_else(|| Error::UnknownBranch {
                    branch: from.clone(),
                })?;
        if let Some(abandoned_at) = row.abandoned_at_lsn {
            return Err(Error::BranchAbandoned {
                branch: from.clone(),
                at: Lsn::from_db(abandoned_at),
            });
        }
        if at_db < row.base_lsn || at_db > row.head_lsn {
            return Err(Error::ForkOutsideBranch {
                branch: from.clone(),
                at,
                base: Lsn::from_db(row.base_lsn),
                head: Lsn::from_db(row.head_lsn),
            });
        }
        if branch_row(self, conn, &live, false).await?.is_some() {
            return Err(Error::BranchExists { branch: live });
        }
        let marker_lsn = row
            .head_lsn
            .checked_add(1)
            .ok_or_else(|| Error::NoRoomForMarker {
                branch: from.clone(),
            })?;
        sqlx::query(self.sql(
            "UPDATE relay_branch SET abandoned_at_lsn = $4
              WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3",
        ))
        .bind(from.tenant.as_str())
        .bind(from.run.as_str())
        .bind(from.branch.as_str())
        .bind(at_db)
        .execute(&mut *conn)
        .await?;
        let abandoned = sqlx::query(self.sql(
            "DELETE FROM relay_outbox
              WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 AND lsn > $4",
        ))
        .bind(from.tenant.as_str())
        .bind(from.run.as_str())
        .bind(from.branch.as_str())
        .bind(at_db)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        // The marker: after every intent of the old branch (highest Lsn and seq), so it reaches
        // the broker after each of them that still can, on the same shard and partition.
        sqlx::query(self.sql(
            "INSERT INTO relay_outbox
                 (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, kind, rewound_to,
                  parent_branch_id)
             VALUES ($1, $2, $3, $4, $5, $6, '', 1, $7, $8)",
        ))
        .bind(from.tenant.as_str())
        .bind(from.run.as_str())
        .bind(from.branch.as_str())
        .bind(marker_lsn)
        .bind(at_db)
        .bind(row.base_lsn)
        .bind(live.branch.as_str())
        .bind(row.parent_branch_id.as_deref())
        .execute(&mut *conn)
        .await?;
        sqlx::query(self.sql(
            "INSERT INTO relay_branch
                 (tenant_id, run_id, branch_id, base_lsn, head_lsn, parent_branch_id)
             VALUES ($1, $2, $3, $4, $4, $5)",
        ))
        .bind(live.tenant.as_str())
        .bind(live.run.as_str())
        .bind(live.branch.as_str())
        .bind(at_db)
        .bind(from.branch.as_str())
        .execute(&mut *conn)
        .await
        .map_err(|err| {
            unique_violation_as(err, || Error::BranchExists {
                branch: live.clone(),
            })
        })?;
        Ok(Rewound { live, abandoned })
    }
}

/// Lock the live branch row, move its head, insert the intent: one statement, so an append is
/// one round trip. Refused (0 rows) when the branch is unknown, abandoned, or the Lsn is not
/// above its head. `$from` ends the statement.
macro_rules! append_sql {
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

const APPEND: &str = append_sql!("FROM moved");

/// [`APPEND`], plus a wake-up for relays, delivered on commit (deduplicated per transaction).
const APPEND_AND_NOTIFY: &str =
    append_sql!("FROM moved, LATERAL (SELECT pg_notify('relay_outbox', $1)) AS wake");

fn run_open(key: &BranchKey) -> Error {
    Error::RunAlreadyOpen {
        tenant: key.tenant.clone(),
        run: key.run.clone(),
    }
}

fn unique_violation_as(err: sqlx::Error, refusal: impl FnOnce() -> Error) -> Error {
    match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => refusal(),
        _ => Error::Database(err),
    }
}

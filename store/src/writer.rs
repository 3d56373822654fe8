//! The host's write API: every call runs inside the host's own transaction.
//!
//! Pass the host's transaction as `&mut tx` (any `&mut PgConnection` works): the intent then
//! commits or rolls back with the host's state. A plain pooled connection runs each call in its
//! own implicit transaction.
//!
//! Every call is one call of the SQL write API (`relay_open_run`, `relay_append`,
//! `relay_rewind`, `relay_close_run`, in `store/migrations/0003_write_api.sql` and
//! `0005_close_and_retire.sql`), the one implementation of the rules, which hosts in any
//! language call too. Refusals come back as typed [`Error`]s:
//! - input this writer can judge alone (an Lsn out of range, a payload above the limit) is
//!   refused before any SQL runs, and the host's transaction stays usable;
//! - a refusal only the database can judge (unknown or abandoned branch, Lsn not above the
//!   head, a run already open) fails the statement, which aborts the host's transaction like
//!   any failed statement: state written beside a refused intent cannot commit without it. To
//!   go on after such a refusal, call inside a savepoint (`(&mut tx).begin()`, sqlx's `Acquire`).
use std::borrow::Cow;

use sqlx::PgConnection;

use crate::error::Error;
use crate::error::{closed, fork_refusal, refusal, sql_state};
use crate::key::{BranchId, BranchKey, Lsn, RunId, TenantId};
use crate::meta::Intent;
use crate::schema::Schema;

/// Default largest payload, 256 KiB: far below RabbitMQ's default `max_message_size` (16 MiB
/// since 4.0, 128 MiB on 3.x) and small
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

/// What closing a run did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Closed {
    /// The live branch the end marker follows.
    pub live: BranchKey,
    /// The end marker's Lsn (one above the live branch's last intent).
    pub end: Lsn,
}

/// Writes export intents in the host's transaction.
#[derive(Clone, Debug)]
pub struct IntentWriter {
    /// Largest payload accepted, in bytes. Default: [`DEFAULT_MAX_PAYLOAD_BYTES`].
    max_payload_bytes: usize,
    /// Whether each append NOTIFYs relays on commit. Default on. Its cost: PostgreSQL
    /// serialises the commits of notifying transactions, which lowers commit throughput with
    /// several concurrent writers (measured in benches/DECISIONS.md). An embedded relay can
    /// be woken in-process instead (`RelayHandle::waker`), a standalone relay after the commit
    /// ([`IntentWriter::wake_relays`]); polling catches everything regardless.
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

impl IntentWriter {
    /// A writer refusing payloads above `max_payload_bytes`. Keep it below the broker's
    /// largest message (RabbitMQ's `max_message_size`, by default 16 MiB since 4.0 and 128 MiB
    /// on 3.x, compared with the body): an intent above that is refused by the broker for ever, and its branch parks
    /// (reason `too_large`) until the limit is raised.
    pub fn new(max_payload_bytes: usize) -> Self {
        Self {
            max_payload_bytes,
            notify: true,
            schema: None,
        }
    }

    /// Names the relay's tables in `schema` (created by [`crate::schema::create_schema`] and
    /// [`crate::migrations::migrate`] on connections with [`Schema::apply`]) instead of
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

    /// Wakes the relays for `tenant` now, in a statement of its own: call it on a connection
    /// outside any transaction, right after committing appends made `with_notify(false)`. A
    /// standalone relay then ships them at once, as with the default in-transaction NOTIFY, but
    /// without its cost: PostgreSQL holds a cluster-wide lock from a notifying transaction's
    /// commit until its WAL is flushed, so the default serialises the host's commits; this
    /// statement's transaction wrote nothing before its commit record, so PostgreSQL does not
    /// wait for that record's flush, and the lock is held only while the notification is
    /// queued.
    /// Measured side by side, 8 writers: `benches/HISTORY.md`, "Waking relays after the commit".
    ///
    /// Called inside a transaction it is sent when that transaction commits, and the cost
    /// comes back. A host that dies between its commit and this call leaves the wake-up
    /// unsent: the relay's poll (`RELAY_POLL_MS`) finds those intents.
    pub async fn wake_relays(
        &self,
        conn: &mut PgConnection,
        tenant: &TenantId,
    ) -> Result<(), Error> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(crate::NOTIFY_CHANNEL)
            .bind(tenant.as_str())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// The configured payload limit.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// Opens a run with its first (live) branch, starting at Lsn 0 (`relay_open_run`).
    pub async fn open_run(&self, conn: &mut PgConnection, key: &BranchKey) -> Result<(), Error> {
        sqlx::query(self.sql("SELECT relay_open_run($1, $2, $3)"))
            .bind(key.tenant.as_str())
            .bind(key.run.as_str())
            .bind(key.branch.as_str())
            .execute(&mut *conn)
            .await
            .map_err(|err| refusal(err, key, None))?;
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
        self.append_intent(conn, key, lsn, Intent::new(payload))
            .await
    }

    /// Appends `(key, lsn)` with `intent`'s payload and metadata (event type, content type,
    /// correlation and causation ids, headers, trace context; see [`Intent`]), in the host's
    /// transaction, like [`IntentWriter::append`].
    ///
    /// Metadata that breaks a rule ([`crate::Metadata::validate`]) is refused with
    /// [`Error::InvalidMetadata`] before any SQL runs: nothing is written and the host's
    /// transaction stays usable. With the cargo feature `otel`, an intent without a
    /// `traceparent` gets the OpenTelemetry context of the current `tracing` span, if it has one.
    ///
    /// ```no_run
    /// use store::{BranchKey, EventType, Intent, IntentWriter, Lsn};
    ///
    /// # async fn host(pool: sqlx::PgPool, branch: BranchKey) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// let intent = Intent::new(br#"{"order":7}"#)
    ///     .event_type(EventType::new("order.created")?)
    ///     .content_type("application/json")
    ///     .correlation_id("req-42");
    /// IntentWriter::default().append_intent(&mut tx, &branch, Lsn::new(2), intent).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn append_intent(
        &self,
        conn: &mut PgConnection,
        key: &BranchKey,
        lsn: Lsn,
        mut intent: Intent<'_>,
    ) -> Result<(), Error> {
        let payload = intent.payload();
        if payload.len() > self.max_payload_bytes {
            return Err(Error::PayloadTooLarge {
                size: payload.len(),
                max: self.max_payload_bytes,
            });
        }
        let lsn_db = lsn.to_db()?;
        crate::trace::fill_from_current_span(intent.metadata_mut());
        let meta = intent.metadata();
        meta.validate()?;
        let meta = (!meta.is_empty()).then_some(sqlx::types::Json(meta));
        sqlx::query(self.sql("SELECT relay_append($1, $2, $3, $4, $5, $6, $7, $8)"))
            .bind(key.tenant.as_str())
            .bind(key.run.as_str())
            .bind(key.branch.as_str())
            .bind(lsn_db)
            .bind(payload)
            .bind(self.notify)
            .bind(i64::try_from(self.max_payload_bytes).unwrap_or(i64::MAX))
            .bind(meta)
            .execute(&mut *conn)
            .await
            .map_err(|err| refusal(err, key, Some(lsn)))?;
        Ok(())
    }

    /// Closes the run `(tenant, run)` in the host's transaction (`relay_close_run`): later
    /// appends and rewinds are refused ([`Error::RunClosed`]), and an end marker is written after
    /// the live branch's last intent, so consumers learn that the run is complete once they have
    /// folded all of it. A closed run is retired (its branches removed, here and at the fold)
    /// after the retention the relay and the consumers are given (`RELAY_RETENTION_SECS`,
    /// `relay_fold_retire`); its ids must not be used again.
    pub async fn close_run(
        &self,
        conn: &mut PgConnection,
        tenant: &TenantId,
        run: &RunId,
    ) -> Result<Closed, Error> {
        let (branch, end): (String, i64) =
            sqlx::query_as(self.sql("SELECT branch_id, end_lsn FROM relay_close_run($1, $2, $3)"))
                .bind(tenant.as_str())
                .bind(run.as_str())
                .bind(self.notify)
                .fetch_one(&mut *conn)
                .await
                .map_err(|err| match sql_state(&err).as_deref() {
                    Some("RL104") => Error::UnknownRun {
                        tenant: tenant.clone(),
                        run: run.clone(),
                    },
                    Some("RL110") => closed(&err, tenant, run),
                    _ => Error::Database(err),
                })?;
        Ok(Closed {
            live: BranchKey::new(tenant.clone(), run.clone(), BranchId::new(branch)?),
            end: Lsn::from_db(end),
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
        let abandoned: i64 =
            sqlx::query_scalar(self.sql("SELECT relay_rewind($1, $2, $3, $4, $5)"))
                .bind(from.tenant.as_str())
                .bind(from.run.as_str())
                .bind(from.branch.as_str())
                .bind(at_db)
                .bind(live.branch.as_str())
                .fetch_one(&mut *conn)
                .await
                .map_err(|err| fork_refusal(err, from, &live, Some(at)))?;
        Ok(Rewound {
            live,
            abandoned: abandoned.max(0) as u64,
        })
    }
}

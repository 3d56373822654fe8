//! The relay's side of the outbox: drain what is committed, retire what the broker confirmed.
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::error::Error;
use crate::key::{BranchId, EventKey, Lsn, TenantId};
use crate::lease::Fence;
use crate::meta::Metadata;

mod backlog;
mod parked;
pub use parked::ParkCause;

/// What an outbox row carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// An export intent: the host's payload.
    Intent,
    /// A rewind marker: the branch is abandoned above `prev_lsn` (the fork point) and live
    /// history continues on `to`. Written by [`crate::IntentWriter::rewind`] after every
    /// intent of the branch, so it reaches the broker after all of them that still can.
    Rewind {
        /// The new live branch.
        to: BranchId,
    },
    /// An end marker: the run was closed after `prev_lsn` ([`crate::IntentWriter::close_run`]);
    /// written after every intent of the run's live branch, it is the run's last message.
    End,
}

/// One committed export intent, as the relay ships it.
#[derive(Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// `(BranchKey, Lsn)`.
    pub key: EventKey,
    /// Lsn of the previous intent on the branch (the branch's base for its first intent).
    pub prev_lsn: Lsn,
    /// Where the branch starts: 0 for a run's first branch, the fork point after a rewind.
    pub base_lsn: Lsn,
    /// The host's bytes, unchanged (empty for a rewind or end marker).
    pub payload: Vec<u8>,
    /// When the host wrote the intent (clock time inside its transaction).
    pub created_at: DateTime<Utc>,
    /// An intent, a rewind marker or an end marker.
    pub kind: EventKind,
    /// For a branch forked by a rewind: the branch it was forked from (at `base_lsn`).
    pub parent: Option<BranchId>,
    /// The intent's metadata (empty for markers and for intents appended without it).
    pub meta: Metadata,
    /// The epochs it was written in, and its predecessor (WIRE.md, "Epochs").
    pub epochs: Epochs,
}

/// An epoch of the outbox's database (WIRE.md, "Epochs"): it rises whenever the database may
/// have lost commits a relay read (a promoted standby, a cluster moved to a new one). Within one
/// epoch a `(BranchKey, Lsn)` is written at most once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Epoch(u64);

impl Epoch {
    /// Epoch `n`.
    pub const fn new(n: u64) -> Self {
        Self(n)
    }

    /// Its number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// From a database column (never negative; a negative value reads as none).
    pub(crate) fn from_db(value: Option<i64>) -> Option<Self> {
        value.and_then(|n| u64::try_from(n).ok()).map(Self)
    }

    /// As a database value.
    pub fn to_db(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }
}

impl std::fmt::Display for Epoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The epochs of a row: the one it was written in, and the one its predecessor (the intent at
/// `prev_lsn`) was written in. Either may be unknown: rows written before epochs, a branch's
/// first intent (its predecessor is the base), a marker's predecessor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Epochs {
    /// The row's own.
    pub epoch: Option<Epoch>,
    /// Its predecessor's.
    pub prev: Option<Epoch>,
}

impl OutboxEvent {
    /// Whether this is a rewind marker.
    pub fn is_rewind(&self) -> bool {
        matches!(self.kind, EventKind::Rewind { .. })
    }

    /// Whether this is the end marker of a closed run.
    pub fn is_end(&self) -> bool {
        matches!(self.kind, EventKind::End)
    }
}

impl std::fmt::Debug for OutboxEvent {
    // Never print the payload: logs carry keys and sizes, not user data.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxEvent")
            .field("key", &self.key)
            .field("prev_lsn", &self.prev_lsn)
            .field("kind", &self.kind)
            .field("event_type", &self.meta.event_type)
            .field("payload_bytes", &self.payload.len())
            .finish_non_exhaustive()
    }
}

/// What discarding a parked branch did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discarded {
    /// The new live branch the run goes on on.
    pub live: crate::key::BranchKey,
    /// The last shipped Lsn of the discarded branch: live history ends there on it.
    pub fork: Lsn,
    /// How many waiting intents were discarded (never exported).
    pub discarded: u64,
}

/// Backlog of one tenant: what the relay still has to ship.
#[derive(Clone, Debug, PartialEq)]
pub struct Backlog {
    /// The tenant.
    pub tenant: TenantId,
    /// Pending intents.
    pub pending: u64,
    /// Age of the oldest pending intent.
    pub oldest_age: Duration,
}

impl Backlog {
    /// From a row of `(tenant, pending, age of the oldest in seconds)`.
    fn from_row(tenant: String, pending: i64, age_secs: f64) -> Result<Self, Error> {
        Ok(Self {
            tenant: TenantId::new(tenant)?,
            pending: pending.max(0) as u64,
            oldest_age: Duration::from_secs_f64(age_secs.max(0.0)),
        })
    }
}

/// Backlog of one branch: what waits on it, from which Lsn to which.
#[derive(Clone, Debug, PartialEq)]
pub struct BranchBacklog {
    /// The branch.
    pub branch: crate::key::BranchKey,
    /// Pending intents.
    pub pending: u64,
    /// The first waiting Lsn (the next to ship).
    pub first: Lsn,
    /// The last waiting Lsn.
    pub last: Lsn,
    /// Age of the oldest pending intent.
    pub oldest_age: Duration,
}

/// How much one drain may return: at most `events` rows holding at most `bytes` of payload in
/// all; the first row always comes, however large (so a drain never stalls on a big payload).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainLimit {
    /// Most rows.
    pub events: u32,
    /// Most payload bytes in all (unless the first row alone is larger).
    pub bytes: u64,
}

impl From<u32> for DrainLimit {
    /// At most `events` rows, whatever their size.
    fn from(events: u32) -> Self {
        Self {
            events,
            bytes: i64::MAX as u64,
        }
    }
}

/// A branch parked after repeated broker refusals, as `distribution status` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParkedBranch {
    /// The branch.
    pub branch: crate::key::BranchKey,
    /// Why it is parked, by cause (with the way out).
    pub cause: ParkCause,
    /// The stored reason: the broker's last refusal, or the row that cannot be read and why.
    pub reason: String,
    /// Failed attempts so far.
    pub attempts: u32,
    /// Since the first failure of this streak.
    pub failing_for: Duration,
    /// Until the next attempt (zero: due).
    pub retry_in: Duration,
    /// Its events waiting in the outbox.
    pub pending: u64,
}

/// A relay alive and its share of the lease buckets.
#[derive(Clone, Debug, PartialEq)]
pub struct RelayShare {
    /// Its id (host, process and start time).
    pub relay: String,
    /// Since it joined.
    pub member_for: Duration,
    /// Lease buckets it holds now (of 128).
    pub buckets: u64,
}

/// Where a drained row must be durable before the relay may publish it
/// (`RELAY_PUBLISH_REPLICATED`; docs/operations.md, "Failover of the outbox's database").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Replication {
    /// Wherever its commit put it (the default).
    #[default]
    Off,
    /// On this server's disk (a host committing with `synchronous_commit = off` can lose, in a
    /// crash, what a relay already read).
    Local,
    /// On every synchronous standby: what any failover candidate has (what the database's own
    /// synchronous replication promises, never less: a commit whose wait was cancelled is not
    /// taken for replicated). On a server whose `synchronous_standby_names` names none: on its
    /// disk, as [`Replication::Local`].
    Sync,
    /// On every streaming standby.
    All,
}

impl Replication {
    /// Its name in the setting and in `relay_wait_replicated`.
    pub fn as_str(self) -> &'static str {
        match self {
            Replication::Off => "off",
            Replication::Local => "local",
            Replication::Sync => "sync",
            Replication::All => "all",
        }
    }
}

/// Since when the relay's drains have been held back by [`Outbox::replicated`] (none since the
/// last drain that was not): what `/readyz` reports. Cheap to clone; shared.
#[derive(Clone, Debug, Default)]
pub struct HeldBack(std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>);

impl HeldBack {
    fn set(&self, held: bool) {
        let mut since = self.0.lock().unwrap_or_else(|poison| poison.into_inner());
        match (held, *since) {
            (true, None) => *since = Some(std::time::Instant::now()),
            (false, Some(_)) => *since = None,
            _ => {}
        }
    }

    /// How long drains have been held back without one getting through; `None`: they are not.
    pub fn for_how_long(&self) -> Option<Duration> {
        self.0
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .map(|since| since.elapsed())
    }
}

/// Reads and retires committed intents. Cheap to clone (a pool handle).
#[derive(Clone, Debug)]
pub struct Outbox {
    pool: PgPool,
    replication: Replication,
    replication_timeout: Duration,
    held_back: HeldBack,
}

/// An outbox row as drained.
#[derive(sqlx::FromRow)]
struct EventRow {
    run_id: String,
    branch_id: String,
    lsn: i64,
    prev_lsn: i64,
    base_lsn: i64,
    payload: Vec<u8>,
    created_at: DateTime<Utc>,
    kind: i16,
    parent_branch_id: Option<String>,
    rewound_to: Option<String>,
    meta: Option<sqlx::types::Json<serde_json::Value>>,
    epoch: Option<i64>,
    prev_epoch: Option<i64>,
}

/// `relay_outbox.kind`: an intent.
const KIND_INTENT: i16 = 0;
/// `relay_outbox.kind`: a rewind marker.
const KIND_REWIND: i16 = 1;
/// `relay_outbox.kind`: an end marker.
const KIND_END: i16 = 2;

/// Columns of [`EventRow`].
macro_rules! event_columns {
    () => {
        "run_id, branch_id, lsn, prev_lsn, base_lsn, payload, created_at, kind, \
         parent_branch_id, rewound_to, meta, epoch, prev_epoch"
    };
}

impl Outbox {
    /// The outbox on `pool` (migrated with [`crate::migrations::migrate`]).
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            replication: Replication::Off,
            replication_timeout: Duration::from_secs(1),
            held_back: HeldBack::default(),
        }
    }

    /// Reports into `held_back` since when its drains are held back (see [`HeldBack`]).
    pub fn reporting(mut self, held_back: HeldBack) -> Self {
        self.held_back = held_back;
        self
    }

    /// The outbox whose drains for the relay ([`Outbox::ack_and_drain`], [`Outbox::drain_after`])
    /// return rows only once they are durable as `replication` says, waiting at most `timeout`
    /// each time ([`Error::NotReplicated`] then: the rows stay, and are drained again).
    pub fn replicated(mut self, replication: Replication, timeout: Duration) -> Self {
        self.replication = replication;
        self.replication_timeout = timeout;
        self
    }

    /// Up to `limit` pending intents of `tenant`, oldest first; each branch's in ascending Lsn.
    ///
    /// The task card's unfenced read, for tests and benches only (feature `fixtures`): without
    /// a lease, two relays could ship one tenant at once. The relay drains through
    /// [`Outbox::drain_after`] and [`Outbox::ack_and_drain`], under a [`Fence`].
    #[cfg(feature = "fixtures")]
    pub async fn drain_outbox(
        &self,
        tenant: &TenantId,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>, Error> {
        let rows: Vec<EventRow> = sqlx::query_as(concat!(
            "SELECT ",
            event_columns!(),
            " FROM relay_outbox WHERE tenant_id = $1 ORDER BY seq LIMIT $2"
        ))
        .bind(tenant.as_str())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        events_of(tenant, rows)
    }

    /// Retires exactly the intents in `shipped`; unknown or already-acked keys are a no-op.
    /// Returns how many rows were retired.
    ///
    /// The task card's unfenced ack, for tests and benches only (feature `fixtures`); the relay
    /// acks through [`Outbox::ack_and_drain`] and [`Outbox::ack_fenced`], under a [`Fence`].
    /// Invariant: callers pass only keys the broker confirmed.
    #[cfg(feature = "fixtures")]
    pub async fn ack_outbox(&self, shipped: &[EventKey]) -> Result<u64, Error> {
        if shipped.is_empty() {
            return Ok(0);
        }
        let keys = KeyArrays::new(shipped.iter())?;
        let retired = sqlx::query(
            "DELETE FROM relay_outbox o
              USING unnest($1::text[], $2::text[], $3::text[], $4::bigint[])
                    AS k(tenant_id, run_id, branch_id, lsn)
              WHERE o.tenant_id = k.tenant_id AND o.run_id = k.run_id
                AND o.branch_id = k.branch_id AND o.lsn = k.lsn",
        )
        .bind(&keys.tenants)
        .bind(&keys.runs)
        .bind(&keys.branches)
        .bind(&keys.lsns)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(retired)
    }

    /// Up to `limit` pending intents of `tenant` under `fence`, oldest first; each branch's in
    /// ascending Lsn. Skips, for each branch named in `in_flight`, its intents up to and
    /// including that key's Lsn (the newest of the branch already in flight): a relay drains the
    /// next batch of a tenant while earlier ones await their confirms.
    ///
    /// Only live history is ever returned: a rewind deletes its abandoned tail in the same
    /// transaction that forks the new branch. What is returned per branch is a gap-free prefix
    /// of its pending intents (appends are serialised, see [`crate::IntentWriter::append`]).
    pub async fn drain_after(
        &self,
        fence: &Fence,
        tenant: &TenantId,
        limit: impl Into<DrainLimit>,
        in_flight: &[EventKey],
    ) -> Result<Vec<OutboxEvent>, Error> {
        self.ack_and_drain(fence, &[], tenant, limit, in_flight)
            .await
    }

    /// Retires `shipped` (confirmed keys of `tenant`) and drains the next `limit` pending
    /// intents of `tenant` after `in_flight` (see [`Outbox::drain_after`]), in one round trip:
    /// the relay's steady-state step. The ack retires exactly the keys in `shipped` (unknown or
    /// already-acked keys are a no-op; callers pass only keys the broker confirmed), and:
    /// - the drain reads after the ack, on a fresh snapshot: it never returns a row that a
    ///   transaction deleted and committed while the ack waited for it (another relay's ack, a
    ///   rewind);
    /// - with a lease `fence`, nothing is acked or drained unless the lease is still current in
    ///   PostgreSQL ([`Error::Fenced`] otherwise), and a takeover of the bucket waits for the call;
    /// - under a fence closed in this process (by time, ahead of the row's expiry, or revoked)
    ///   nothing is drained, but `shipped` is still acked if PostgreSQL finds the lease current,
    ///   then [`Error::Fenced`] is returned: the broker confirmed those events, and while the row
    ///   is this relay's no other relay can have drained them, so sending them again would be a
    ///   duplicate the lease did not call for.
    pub async fn ack_and_drain(
        &self,
        fence: &Fence,
        shipped: &[EventKey],
        tenant: &TenantId,
        limit: impl Into<DrainLimit>,
        in_flight: &[EventKey],
    ) -> Result<Vec<OutboxEvent>, Error> {
        let mut limit = limit.into();
        let mut in_flight = in_flight;
        let open = fence.is_open();
        let keys = KeyArrays::new(shipped.iter().filter(|key| key.branch.tenant == *tenant))?;
        if !open {
            if keys.lsns.is_empty() {
                return Err(fenced(fence));
            }
            limit = DrainLimit::from(0u32);
            in_flight = &[];
        }
        let flying = KeyArrays::new(in_flight.iter())?;
        let (bucket, owner, epoch) = match fence.lease() {
            Some((bucket, owner, epoch)) => (
                Some(i32::from(bucket.0)),
                Some(owner.as_str()),
                Some(epoch.0),
            ),
            None => (None, None, None),
        };
        let rows: Vec<EventRow> = sqlx::query_as(concat!(
            "SELECT ",
            event_columns!(),
            " FROM relay_ack_and_drain($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
        ))
        .bind(bucket)
        .bind(owner)
        .bind(epoch)
        .bind(tenant.as_str())
        .bind(&keys.runs)
        .bind(&keys.branches)
        .bind(&keys.lsns)
        .bind(i64::from(limit.events))
        .bind(i64::try_from(limit.bytes).unwrap_or(i64::MAX))
        .bind(&flying.runs)
        .bind(&flying.branches)
        .bind(&flying.lsns)
        .fetch_all(&self.pool)
        .await
        .map_err(|err| fenced_or(err, fence))?;
        if !open {
            return Err(fenced(fence));
        }
        if !rows.is_empty() && self.replication != Replication::Off {
            self.wait_replicated().await?;
        }
        events_of(tenant, rows)
    }

    /// Waits until what was just read is durable as [`Outbox::replicated`] says.
    async fn wait_replicated(&self) -> Result<(), Error> {
        let timeout_ms = i32::try_from(self.replication_timeout.as_millis()).unwrap_or(i32::MAX);
        let done: bool = sqlx::query_scalar("SELECT relay_wait_replicated($1, $2)")
            .bind(self.replication.as_str())
            .bind(timeout_ms)
            .fetch_one(&self.pool)
            .await?;
        self.held_back.set(!done);
        if done {
            Ok(())
        } else {
            Err(Error::NotReplicated {
                replication: self.replication.as_str(),
                waited: self.replication_timeout,
            })
        }
    }

    /// Retires `shipped` (confirmed keys of `tenant`; unknown or already-acked keys are a no-op)
    /// under a lease `fence`, refused with [`Error::Fenced`] once the lease is gone.
    pub async fn ack_fenced(
        &self,
        fence: &Fence,
        tenant: &TenantId,
        shipped: &[EventKey],
    ) -> Result<(), Error> {
        if shipped.is_empty() {
            return Ok(());
        }
        self.ack_and_drain(fence, shipped, tenant, 0u32, &[])
            .await?;
        Ok(())
    }
}

/// Keys as the parallel arrays `unnest` takes.
struct KeyArrays<'a> {
    tenants: Vec<&'a str>,
    runs: Vec<&'a str>,
    branches: Vec<&'a str>,
    lsns: Vec<i64>,
}

impl<'a> KeyArrays<'a> {
    fn new(keys: impl IntoIterator<Item = &'a EventKey>) -> Result<Self, Error> {
        let mut arrays = Self {
            tenants: Vec::new(),
            runs: Vec::new(),
            branches: Vec::new(),
            lsns: Vec::new(),
        };
        for key in keys {
            arrays.tenants.push(key.branch.tenant.as_str());
            arrays.runs.push(key.branch.run.as_str());
            arrays.branches.push(key.branch.branch.as_str());
            arrays.lsns.push(key.lsn.to_db()?);
        }
        Ok(arrays)
    }
}

/// SQLSTATE `relay_ack_and_drain` raises when the caller's lease is not current.
const FENCED_SQLSTATE: &str = "RL001";

fn fenced(fence: &Fence) -> Error {
    let (bucket, epoch) = fence
        .lease()
        .map(|(bucket, _, epoch)| (bucket.0, epoch.0))
        .unwrap_or_default();
    Error::Fenced { bucket, epoch }
}

fn fenced_or(err: sqlx::Error, fence: &Fence) -> Error {
    match &err {
        sqlx::Error::Database(db) if db.code().as_deref() == Some(FENCED_SQLSTATE) => fenced(fence),
        _ => Error::Database(err),
    }
}

/// The drained rows as events, oldest first. A row that cannot be read stops its branch
/// there: if the batch holds readable rows of that branch before it, they are returned and
/// the branch's later rows are left for the next drain (which then starts at the unreadable
/// row); if it is the first row of its branch here, the drain fails with
/// [`Error::Unreadable`] and the relay parks that branch. So a branch parks at the first
/// intent it cannot ship, and whatever came before ships.
fn events_of(tenant: &TenantId, rows: Vec<EventRow>) -> Result<Vec<OutboxEvent>, Error> {
    let mut events: Vec<OutboxEvent> = Vec::with_capacity(rows.len());
    let mut stopped: Vec<crate::key::BranchKey> = Vec::new();
    for row in rows {
        let event = match event_of(tenant, row) {
            Ok(event) if stopped.contains(&event.key.branch) => continue,
            Ok(event) => event,
            Err(Error::Unreadable { branch, .. })
                if events.iter().any(|event| event.key.branch == branch) =>
            {
                if !stopped.contains(&branch) {
                    stopped.push(branch);
                }
                continue;
            }
            Err(err) => return Err(err),
        };
        events.push(event);
    }
    Ok(events)
}

fn event_of(tenant: &TenantId, row: EventRow) -> Result<OutboxEvent, Error> {
    let key = EventKey::from_db(tenant, row.run_id, row.branch_id, row.lsn)?;
    // Decoded row by row: a row whose key reads but whose other columns do not names
    // that row (`Error::Unreadable`, its branch is then parked) instead of failing the
    // whole batch unnamed.
    let unreadable = |what: &str, err: &dyn std::fmt::Display| Error::Unreadable {
        branch: key.branch.clone(),
        lsn: key.lsn,
        reason: format!("{what}: {err}"),
    };
    let kind = match (row.kind, row.rewound_to) {
        (KIND_INTENT, _) => EventKind::Intent,
        (KIND_REWIND, Some(to)) => EventKind::Rewind {
            to: BranchId::new(to).map_err(|err| unreadable("rewound_to", &err))?,
        },
        (KIND_REWIND, None) => {
            return Err(unreadable("rewound_to", &"missing on a marker"));
        }
        (KIND_END, _) => EventKind::End,
        (other, _) => return Err(unreadable("kind", &other)),
    };
    let parent = row
        .parent_branch_id
        .map(BranchId::new)
        .transpose()
        .map_err(|err| unreadable("parent_branch_id", &err))?;
    let meta = match row.meta {
        None => Metadata::default(),
        Some(json) => serde_json::from_value(json.0).map_err(|err| unreadable("metadata", &err))?,
    };
    Ok(OutboxEvent {
        key,
        prev_lsn: Lsn::from_db(row.prev_lsn),
        base_lsn: Lsn::from_db(row.base_lsn),
        payload: row.payload,
        created_at: row.created_at,
        kind,
        parent,
        meta,
        epochs: Epochs {
            epoch: Epoch::from_db(row.epoch),
            prev: Epoch::from_db(row.prev_epoch),
        },
    })
}

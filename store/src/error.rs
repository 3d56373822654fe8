//! The store's one error type, in the caller's words.
use crate::key::{BranchKey, InvalidId, Lsn, LsnOutOfRange, RunId, TenantId};

/// What went wrong in the outbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tenant, run or branch id (or a schema name) is malformed. Nothing was written.
    #[error(transparent)]
    InvalidId(#[from] InvalidId),
    /// An intent's metadata breaks a rule of [`crate::meta::Metadata`] (SQLSTATE `RL112` from
    /// `relay_append`). Nothing was written.
    #[error("invalid metadata {field}: {reason}")]
    InvalidMetadata {
        /// The field (`type`, `content_type`, `header <name>`, `traceparent`, ...).
        field: String,
        /// Why it was refused.
        reason: String,
    },
    /// The payload is larger than the configured maximum. Nothing was written.
    #[error("payload of {size} bytes exceeds the maximum of {max} bytes")]
    PayloadTooLarge {
        /// Payload size.
        size: usize,
        /// Configured maximum.
        max: usize,
    },
    /// The Lsn does not fit PostgreSQL's bigint. Nothing was written.
    #[error("lsn {lsn} is out of range (at most {})", i64::MAX)]
    LsnOutOfRange {
        /// The offending Lsn.
        lsn: u64,
    },
    /// The Lsn is not above the branch's head. Nothing was written.
    #[error("lsn {lsn} on {branch} is not above the branch head {head}")]
    LsnNotAboveHead {
        /// The branch.
        branch: BranchKey,
        /// The refused Lsn.
        lsn: Lsn,
        /// The branch's current head.
        head: Lsn,
    },
    /// The branch was never opened. Nothing was written.
    #[error("branch {branch} does not exist (open the run or rewind first)")]
    UnknownBranch {
        /// The branch.
        branch: BranchKey,
    },
    /// The branch was abandoned by a rewind. Nothing was written.
    #[error("branch {branch} was abandoned by a rewind at lsn {at}")]
    BranchAbandoned {
        /// The branch.
        branch: BranchKey,
        /// Where it was forked.
        at: Lsn,
    },
    /// The run already has a branch. Nothing was written.
    #[error("run {tenant}/{run} is already open")]
    RunAlreadyOpen {
        /// Tenant of the run.
        tenant: crate::key::TenantId,
        /// The run.
        run: crate::key::RunId,
    },
    /// The run was closed ([`crate::IntentWriter::close_run`]): nothing more is appended or
    /// rewound. Nothing was written.
    #[error("run {tenant}/{run} was closed at lsn {head}")]
    RunClosed {
        /// Tenant of the run.
        tenant: crate::key::TenantId,
        /// The run.
        run: crate::key::RunId,
        /// The live branch's last intent before the end marker.
        head: Lsn,
    },
    /// The run was never opened (or was retired after it closed). Nothing was written.
    #[error("run {tenant}/{run} does not exist (open it first)")]
    UnknownRun {
        /// Tenant of the run.
        tenant: crate::key::TenantId,
        /// The run.
        run: crate::key::RunId,
    },
    /// A delivery of a run the fold has retired (`relay_fold_retire`): a redelivery after the
    /// retention, or an event held up for longer than it. Never applied: dead-letter it.
    #[error(
        "event {lsn} on {branch} belongs to a retired run (written at {created_at}, retired through {retired_through})"
    )]
    RetiredRun {
        /// The branch.
        branch: BranchKey,
        /// The event's Lsn.
        lsn: Lsn,
        /// When the host wrote it.
        created_at: chrono::DateTime<chrono::Utc>,
        /// The latest end marker of a retired run.
        retired_through: chrono::DateTime<chrono::Utc>,
    },
    /// Only a parked live branch with events waiting can be discarded
    /// ([`crate::Outbox::discard_branch`]). Nothing was changed.
    #[error("branch {branch} is not parked with events waiting: nothing to discard")]
    NotParked {
        /// The branch.
        branch: BranchKey,
    },
    /// A rewind named a branch id the run already uses. Nothing was written.
    #[error("branch {branch} already exists")]
    BranchExists {
        /// The branch.
        branch: BranchKey,
    },
    /// A rewind's fork point lies outside the branch (below its base or above its head).
    #[error("cannot fork {branch} at lsn {at}: the branch spans ({base}, {head}]")]
    ForkOutsideBranch {
        /// The branch.
        branch: BranchKey,
        /// The requested fork point.
        at: Lsn,
        /// The branch's base.
        base: Lsn,
        /// The branch's head.
        head: Lsn,
    },
    /// A delivered event does not continue the chain the fold has applied (a broken producer).
    #[error(
        "event {lsn} on {branch} claims predecessor {prev} but the fold has applied up to {applied}"
    )]
    BrokenChain {
        /// The branch.
        branch: BranchKey,
        /// The event's Lsn.
        lsn: Lsn,
        /// The predecessor the event names.
        prev: Lsn,
        /// What the fold has applied.
        applied: Lsn,
    },
    /// A delivery shows that the fold's history is not the database's (WIRE.md, "Epochs": an
    /// Lsn written again after a failover, a rewind the database lost): refused (SQLSTATE
    /// `RL203`), never applied or dropped. Dead-letter it; the way out is
    /// `relay_fold_adopt` and a replay (docs/operations.md, "After a failover").
    #[error("{branch}@{lsn} diverges: {reason}")]
    Diverged {
        /// The branch.
        branch: BranchKey,
        /// The delivery's Lsn.
        lsn: Lsn,
        /// What `relay_fold` found.
        reason: String,
    },
    /// What a drain read is not yet durable where `RELAY_PUBLISH_REPLICATED` requires (a
    /// synchronous standby down or behind): nothing may be published; the rows stay and are
    /// drained again. What the call acked is committed.
    #[error(
        "what was drained is not yet flushed ({replication}) after {waited:?}: not published yet"
    )]
    NotReplicated {
        /// The mode waited for.
        replication: &'static str,
        /// How long it waited.
        waited: std::time::Duration,
    },
    /// This relay's lease on the tenant's bucket is gone (expired or taken over): nothing was
    /// acked or drained. The caller must stop working on the tenant.
    #[error("lease of bucket {bucket} (epoch {epoch}) is no longer held")]
    Fenced {
        /// The lease bucket.
        bucket: u16,
        /// The epoch presented.
        epoch: i64,
    },
    /// A rewind cannot fork a branch whose head is the largest Lsn (no room for its marker).
    #[error("cannot rewind {branch}: its head is the largest Lsn, no room for the rewind marker")]
    NoRoomForMarker {
        /// The branch.
        branch: BranchKey,
    },
    /// A retention longer than PostgreSQL's interval holds, or a batch of 0 or above
    /// 2,147,483,647 runs.
    #[error("retention out of range: keep at most about 292,000 years, batch 1 to 2147483647 runs")]
    RetentionOutOfRange,
    /// Applying the migrations failed.
    #[error("migrating the outbox schema failed: {0}")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// The relay's tables or functions are not in the database (or not on its `search_path`):
    /// the schema was never applied, or only an older version of it.
    #[error(
        "the outbox schema is missing or out of date: {} not found; apply `distribution migrate` or the SQL of `distribution sql`",
        .0.join(", ")
    )]
    SchemaMissing(Vec<&'static str>),
    /// A pending row the relay cannot read (its metadata does not decode: written past
    /// `relay_append`, or by a newer schema): the relay parks its branch with this reason, and
    /// the rest of the tenant ships.
    #[error("the row {branch} lsn {lsn} cannot be read: {reason}")]
    Unreadable {
        /// Its branch.
        branch: BranchKey,
        /// Its Lsn.
        lsn: Lsn,
        /// What does not decode.
        reason: String,
    },
    /// The database failed or is unreachable.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// No answer within `after` (a connection lost without a reset stays silent until the
    /// kernel gives up on it, about 15 minutes): whether the call took effect is unknown.
    #[error("no answer from PostgreSQL within {after:?}")]
    NoAnswer {
        /// How long the caller waited.
        after: std::time::Duration,
    },
}

impl From<LsnOutOfRange> for Error {
    fn from(LsnOutOfRange(lsn): LsnOutOfRange) -> Self {
        Error::LsnOutOfRange { lsn }
    }
}

impl Error {
    /// Whether retrying the same call later may succeed (the database, not the input, failed).
    pub fn is_transient(&self) -> bool {
        match self {
            // The relay's own refusals (SQLSTATE class RL) judge the input: they repeat.
            Error::Database(err) if sql_state(err).is_some_and(|code| code.starts_with("RL")) => {
                false
            }
            Error::Database(err) => !matches!(
                err,
                sqlx::Error::ColumnDecode { .. }
                    | sqlx::Error::Decode(_)
                    | sqlx::Error::TypeNotFound { .. }
                    | sqlx::Error::ColumnNotFound(_)
            ),
            Error::Migrate(_) | Error::NoAnswer { .. } | Error::NotReplicated { .. } => true,
            _ => false,
        }
    }
}

/// The SQLSTATE of a database error (the relay's own refusals are class `RL`).
pub(crate) fn sql_state(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
        _ => None,
    }
}

/// The value of `name` in a refusal's DETAIL (`name=value` pairs, space-separated).
pub(crate) fn detail_value(err: &sqlx::Error, name: &str) -> Option<i64> {
    let sqlx::Error::Database(db) = err else {
        return None;
    };
    let detail = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?
        .detail()?;
    detail.split_whitespace().find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key == name).then(|| value.parse().ok()).flatten()
    })
}

/// The text of a refusal's DETAIL when it is the one pair `name=<text>` (the text may hold
/// spaces: `field=header colour`).
pub(crate) fn detail_text(err: &sqlx::Error, name: &str) -> Option<String> {
    let sqlx::Error::Database(db) = err else {
        return None;
    };
    let detail = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?
        .detail()?;
    detail
        .strip_prefix(name)?
        .strip_prefix('=')
        .map(str::to_owned)
}

/// The database's own message of an error (no SQLSTATE, no detail).
pub(crate) fn database_message(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Database(db) => db.message().to_owned(),
        other => other.to_string(),
    }
}

/// A refusal of a call that forks `live` from `from` (a rewind, a discard): `live` already
/// existing (`RL107`, or a unique violation of a racing fork) is [`Error::BranchExists`];
/// the rest as [`refusal`] says.
pub(crate) fn fork_refusal(
    err: sqlx::Error,
    from: &BranchKey,
    live: &BranchKey,
    lsn: Option<Lsn>,
) -> Error {
    match sql_state(&err).as_deref() {
        Some("RL107") | Some("23505") => Error::BranchExists {
            branch: live.clone(),
        },
        _ => refusal(err, from, lsn),
    }
}

/// The SQL functions' refusals of a branch (their SQLSTATEs: `0003_write_api.sql`,
/// `0007_discard_branch.sql`) as typed errors, in one table; anything else is a database
/// error. `lsn` is the Lsn appended or the fork point, if any.
pub(crate) fn refusal(err: sqlx::Error, key: &BranchKey, lsn: Option<Lsn>) -> Error {
    let lsn_of = |name| detail_value(&err, name).map(Lsn::from_db);
    let known = match sql_state(&err).as_deref() {
        Some("RL103") => lsn_of("head_lsn")
            .zip(lsn)
            .map(|(head, lsn)| Error::LsnNotAboveHead {
                branch: key.clone(),
                lsn,
                head,
            }),
        Some("RL104") => Some(Error::UnknownBranch {
            branch: key.clone(),
        }),
        Some("RL105") => lsn_of("abandoned_at_lsn").map(|at| Error::BranchAbandoned {
            branch: key.clone(),
            at,
        }),
        Some("RL106") => Some(Error::RunAlreadyOpen {
            tenant: key.tenant.clone(),
            run: key.run.clone(),
        }),
        Some("RL108") => {
            lsn_of("base_lsn")
                .zip(lsn_of("head_lsn"))
                .zip(lsn)
                .map(|((base, head), at)| Error::ForkOutsideBranch {
                    branch: key.clone(),
                    at,
                    base,
                    head,
                })
        }
        Some("RL109") => Some(Error::NoRoomForMarker {
            branch: key.clone(),
        }),
        Some("RL110") => Some(closed(&err, &key.tenant, &key.run)),
        Some("RL111") => Some(Error::NotParked {
            branch: key.clone(),
        }),
        Some("RL112") => Some(Error::InvalidMetadata {
            field: detail_text(&err, "field").unwrap_or_else(|| "meta".to_owned()),
            reason: database_message(&err),
        }),
        _ => None,
    };
    known.unwrap_or(Error::Database(err))
}

/// `RL110`, a closed run, as [`Error::RunClosed`].
pub(crate) fn closed(err: &sqlx::Error, tenant: &TenantId, run: &RunId) -> Error {
    Error::RunClosed {
        tenant: tenant.clone(),
        run: run.clone(),
        head: Lsn::from_db(detail_value(err, "head_lsn").unwrap_or(0)),
    }
}

/// A store call under `limit`: its own result, or [`Error::NoAnswer`]. How the relay's drainers,
/// lease runner, poller, gauges and readiness probe bound a call to PostgreSQL (the consumer
/// bounds a whole batch's fold its own way): a connection that goes silent mid-call (a network
/// or a middlebox that lost it without a reset) would otherwise hold its caller until the
/// kernel gives up on the socket, about 15 minutes. The call may have taken effect.
pub async fn within<T>(
    limit: std::time::Duration,
    call: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or(Err(Error::NoAnswer { after: limit }))
}

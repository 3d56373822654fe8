//! The consumer's fold: applies each delivered event exactly once, in Lsn order per branch, and
//! only on live history.
//!
//! Exactly-once is achieved here, not in transport. The rules (broker/WIRE.md, "What a consumer
//! must do") live in one SQL function, `relay_fold` (`store/fold_migrations/0002_fold_function.sql`),
//! which consumers in any language call; [`fold`] runs it inside the caller's transaction (the
//! consumer commits it, then acks the delivery) and hands what it returns to the
//! [`Projection`], in order:
//! - an intent with `lsn <= applied` is a redelivery: a no-op;
//! - an intent with `prev_lsn == applied` is the next one: applied, then any held-back
//!   successors it unblocks, in order, into the same projection;
//! - an intent with `prev_lsn > applied` arrived ahead of its predecessor: held back;
//! - a **rewind marker** abandons the branch above its fork point: whatever the projection
//!   applied above it is undone by [`Projection::rewind`] in the same transaction, held-back
//!   intents above it are dropped, and no intent above it is ever applied afterwards;
//! - a branch forked by a rewind starts only when its parent is applied up to the fork and its
//!   marker is folded (the hand-over), so the projection sees exactly the host's live history,
//!   in its order: parent up to the fork, then the new branch.
//!
//! Only cursors and held-back intents are stored by the fold itself; [`EventTable`] is the
//! project's demonstration projection that also keeps every applied event.
use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

use crate::error::Error;
use crate::error::{detail_value, sql_state};
use crate::key::{BranchId, BranchKey, EventKey, Lsn, TenantId};
use crate::meta::Metadata;
use crate::outbox::{EventKind, OutboxEvent};

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
    /// The run's end marker, folded after all of the run: the run is complete
    /// ([`Projection::end`] was called). Nothing of it was held back, so nothing was released.
    Ended,
    /// A copy of history the database replaced after a failover (a later epoch was folded at or
    /// below its Lsn): nothing applied (WIRE.md, "Epochs").
    Superseded,
    /// A diverged delivery of a branch an operator armed (`relay_fold_adopt`): the history the
    /// database lost was undone ([`Projection::rewind`] for `undone` branches), then the
    /// delivery folded as usual (applied, with `released` held-back intents after it, or held,
    /// ended, rewound).
    Adopted {
        /// Branches whose lost history was undone.
        undone: u32,
        /// Held-back intents applied after the delivery.
        released: u32,
    },
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
/// commit atomically with the fold's cursor (or not at all). `consumer::Consumer` asks the fold
/// for its verdicts on a whole batch first ([`verdicts`]), then calls the projection for each
/// delivery in order: a projection writes its own tables and never reads the fold's
/// (`relay_fold_*`).
pub trait Projection: Send {
    /// The projection's own error. Any error rolls the delivery's transaction back (with the
    /// consumer's batches, the batch's: the others of it are folded again).
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

    /// The run `end.key.branch`'s tenant and run was closed, and everything of it has been
    /// applied: `end` is its end marker (no payload). Called once per run, after its last
    /// intent; a projection may finalise the run here. Default: nothing.
    fn end(
        &mut self,
        tx: &mut PgConnection,
        end: &OutboxEvent,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = (tx, end);
        async { Ok(()) }
    }

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

/// What `relay_fold` says of a delivery or of an intent it releases (its `action` column;
/// docs/sql-api.md, the table of actions under "Consuming").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    Apply,
    Undo,
    End,
    Hold,
    Duplicate,
    Abandoned,
    Superseded,
    Adopt,
}

impl Action {
    /// The action `relay_fold` named; an unknown one (a fold function newer than this relay)
    /// is a protocol error, retried as a database fault, never a delivery's fault.
    fn of(action: &str) -> Result<Self, Error> {
        Ok(match action {
            "apply" => Self::Apply,
            "undo" => Self::Undo,
            "end" => Self::End,
            "hold" => Self::Hold,
            "duplicate" => Self::Duplicate,
            "abandoned" => Self::Abandoned,
            "superseded" => Self::Superseded,
            "adopt" => Self::Adopt,
            other => {
                return Err(Error::Database(sqlx::Error::Protocol(format!(
                    "relay_fold returned the unknown action {other:?}"
                ))));
            }
        })
    }
}

/// One row of `relay_fold`'s answer.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct Step {
    action: String,
    branch_id: String,
    lsn: i64,
    prev_lsn: i64,
    base_lsn: i64,
    parent_branch: Option<String>,
    rewound_to: Option<String>,
    created_at: Option<DateTime<Utc>>,
    payload: Option<Vec<u8>>,
    meta: Option<sqlx::types::Json<Metadata>>,
}

/// Folds one delivered event in `tx` (see the module docs): one call of the SQL function
/// `relay_fold`, which keeps the fold's state and says what to apply, then the projection's
/// calls, in that order. The caller commits `tx`, then acks.
pub async fn fold<P: Projection>(
    tx: &mut PgConnection,
    event: &OutboxEvent,
    projection: &mut P,
) -> Result<FoldOutcome, FoldError<P::Error>> {
    let key = &event.key.branch;
    let (kind, rewound_to) = kind_argument(event);
    // The verdict's row is the delivery itself: its body is not sent back (n = 1).
    let steps: Vec<Step> = sqlx::query_as(
        "SELECT action, branch_id, lsn, prev_lsn, base_lsn, parent_branch, rewound_to, created_at,
                CASE WHEN n > 1 THEN payload END AS payload, CASE WHEN n > 1 THEN meta END AS meta
           FROM relay_fold($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
                WITH ORDINALITY AS f(
                action, branch_id, lsn, prev_lsn, base_lsn, parent_branch, rewound_to,
                created_at, payload, meta, n)
          ORDER BY n",
    )
    .bind(key.tenant.as_str())
    .bind(key.run.as_str())
    .bind(key.branch.as_str())
    .bind(kind)
    .bind(event.key.lsn.to_db().map_err(Error::from)?)
    .bind(event.prev_lsn.to_db().map_err(Error::from)?)
    .bind(event.base_lsn.to_db().map_err(Error::from)?)
    .bind(event.parent.as_ref().map(BranchId::as_str))
    .bind(rewound_to)
    .bind(event.created_at)
    .bind(&event.payload)
    .bind((!event.meta.is_empty()).then_some(sqlx::types::Json(&event.meta)))
    .bind(event.epochs.epoch.map(crate::Epoch::to_db))
    .bind(event.epochs.prev.map(crate::Epoch::to_db))
    .fetch_all(&mut *tx)
    .await
    .map_err(|err| fold_refusal(err, event))?;
    apply(tx, event, FoldSteps(steps), projection).await
}

/// What `relay_fold` answered for one delivery (its rows, in order), to be applied with
/// [`apply`]; from [`verdicts`].
#[derive(Debug)]
pub struct FoldSteps(Vec<Step>);

/// The fold's answers for a batch of deliveries, in one `relay_fold_batch` call (one round
/// trip; `relay_fold` for each, in order, so the same answers as one call per delivery): each
/// delivery's steps, in order. Apply each with [`apply`], in order, in the same transaction.
/// A refusal names the delivery refused (its index in `events`): roll back, dead-letter it,
/// and fold the others again.
pub async fn verdicts(
    tx: &mut PgConnection,
    events: &[&OutboxEvent],
) -> Result<Vec<FoldSteps>, (Option<usize>, Error)> {
    let mut tenant = Vec::with_capacity(events.len());
    let mut run = Vec::with_capacity(events.len());
    let mut branch = Vec::with_capacity(events.len());
    let mut kind = Vec::with_capacity(events.len());
    let mut lsn = Vec::with_capacity(events.len());
    let mut prev_lsn = Vec::with_capacity(events.len());
    let mut base_lsn = Vec::with_capacity(events.len());
    let mut parent = Vec::with_capacity(events.len());
    let mut rewound_to = Vec::with_capacity(events.len());
    let mut created_at = Vec::with_capacity(events.len());
    let mut payload = Vec::with_capacity(events.len());
    let mut meta = Vec::with_capacity(events.len());
    let mut epoch = Vec::with_capacity(events.len());
    let mut prev_epoch = Vec::with_capacity(events.len());
    for (at, event) in events.iter().enumerate() {
        let key = &event.key.branch;
        let (this_kind, to) = kind_argument(event);
        let db = |lsn: Lsn| lsn.to_db().map_err(|err| (Some(at), Error::from(err)));
        tenant.push(key.tenant.as_str());
        run.push(key.run.as_str());
        branch.push(key.branch.as_str());
        kind.push(this_kind);
        lsn.push(db(event.key.lsn)?);
        prev_lsn.push(db(event.prev_lsn)?);
        base_lsn.push(db(event.base_lsn)?);
        parent.push(event.parent.as_ref().map(BranchId::as_str));
        rewound_to.push(to);
        created_at.push(event.created_at);
        payload.push(event.payload.as_slice());
        meta.push((!event.meta.is_empty()).then_some(sqlx::types::Json(&event.meta)));
        epoch.push(event.epochs.epoch.map(crate::Epoch::to_db));
        prev_epoch.push(event.epochs.prev.map(crate::Epoch::to_db));
    }
    // Each delivery's own row (step 1) is not sent back with its body.
    let rows: Vec<(i32, Step)> = sqlx::query_as::<_, NumberedStep>(
        "SELECT delivery, action, branch_id, lsn, prev_lsn, base_lsn, parent_branch, rewound_to,
                created_at, CASE WHEN step > 1 THEN payload END AS payload,
                CASE WHEN step > 1 THEN meta END AS meta
           FROM relay_fold_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
          ORDER BY delivery, step",
    )
    .bind(tenant)
    .bind(run)
    .bind(branch)
    .bind(kind)
    .bind(lsn)
    .bind(prev_lsn)
    .bind(base_lsn)
    .bind(parent)
    .bind(rewound_to)
    .bind(created_at)
    .bind(payload)
    .bind(meta)
    .bind(epoch)
    .bind(prev_epoch)
    .fetch_all(&mut *tx)
    .await
    .map_err(|err| match refused_delivery(&err, events.len()) {
        Some(at) => (Some(at), fold_refusal(err, events[at])),
        None => (None, Error::Database(err)),
    })?
    .into_iter()
    .map(|NumberedStep { delivery, step }| (delivery, step))
    .collect();
    let mut answers: Vec<FoldSteps> = events.iter().map(|_| FoldSteps(Vec::new())).collect();
    for (delivery, step) in rows {
        let at = usize::try_from(delivery - 1)
            .ok()
            .filter(|at| *at < answers.len())
            .ok_or_else(|| {
                let text = format!("relay_fold_batch answered for delivery {delivery}");
                (None, Error::Database(sqlx::Error::Protocol(text)))
            })?;
        answers[at].0.push(step);
    }
    Ok(answers)
}

/// The delivery a `relay_fold_batch` refusal names (its hint: `delivery N of the batch`).
fn refused_delivery(err: &sqlx::Error, deliveries: usize) -> Option<usize> {
    let sqlx::Error::Database(db) = err else {
        return None;
    };
    let hint = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?
        .hint()?;
    let n: usize = hint
        .strip_prefix("delivery ")?
        .strip_suffix(" of the batch")?
        .parse()
        .ok()?;
    (1..=deliveries).contains(&n).then(|| n - 1)
}

/// A row of `relay_fold_batch`'s answer: the delivery it answers, then `relay_fold`'s columns.
#[derive(sqlx::FromRow)]
struct NumberedStep {
    delivery: i32,
    #[sqlx(flatten)]
    step: Step,
}

/// `relay_fold`'s `p_kind` and `p_rewound_to` for `event`.
fn kind_argument(event: &OutboxEvent) -> (&'static str, Option<&str>) {
    match &event.kind {
        EventKind::Intent => ("intent", None),
        EventKind::Rewind { to } => ("rewind", Some(to.as_str())),
        EventKind::End => ("end", None),
    }
}

/// Applies what the fold answered for `event` (see [`fold`]) through `projection`, in order.
pub async fn apply<P: Projection>(
    tx: &mut PgConnection,
    event: &OutboxEvent,
    steps: FoldSteps,
    projection: &mut P,
) -> Result<FoldOutcome, FoldError<P::Error>> {
    let key = &event.key.branch;
    let steps = steps.0;
    let mut steps = steps.into_iter().peekable();
    let no_verdict = || {
        Error::Database(sqlx::Error::Protocol(
            "relay_fold returned no verdict".into(),
        ))
    };
    let mut verdict = steps.next().ok_or_else(no_verdict)?;
    // An adopted delivery: first the history the database lost is undone (undo rows whose
    // `rewound_to` is the delivery's branch), then the delivery's own verdict follows.
    let mut undone = None;
    if Action::of(&verdict.action)? == Action::Adopt {
        let mut count = 0u32;
        while let Some(step) = steps.next_if(|step| {
            step.action == "undo" && step.rewound_to.as_deref() == Some(key.branch.as_str())
        }) {
            let notice = RewindNotice {
                branch: BranchKey::new(
                    key.tenant.clone(),
                    key.run.clone(),
                    BranchId::new(&step.branch_id).map_err(Error::from)?,
                ),
                fork: Lsn::from_db(step.lsn),
                applied: Lsn::from_db(step.prev_lsn),
                to: key.branch.clone(),
            };
            projection
                .rewind(tx, &notice)
                .await
                .map_err(FoldError::Projection)?;
            count += 1;
        }
        undone = Some(count);
        verdict = steps.next().ok_or_else(no_verdict)?;
    }
    // The steps after the verdict: the intents (and end markers) it released, in order.
    let steps: Vec<(Action, Step)> = steps
        .map(|step| Ok((Action::of(&step.action)?, step)))
        .collect::<Result<_, Error>>()?;
    // Released intents (an end marker released with them is not counted).
    let released = steps
        .iter()
        .filter(|(action, _)| *action == Action::Apply)
        .count();
    let released = u32::try_from(released).unwrap_or(u32::MAX);
    let outcome = match Action::of(&verdict.action)? {
        Action::Apply => {
            projection
                .apply(tx, event)
                .await
                .map_err(FoldError::Projection)?;
            FoldOutcome::Applied { released }
        }
        Action::Undo => {
            let notice = RewindNotice {
                branch: key.clone(),
                fork: Lsn::from_db(verdict.lsn),
                applied: Lsn::from_db(verdict.prev_lsn),
                to: BranchId::new(verdict.rewound_to.unwrap_or_default()).map_err(Error::from)?,
            };
            projection
                .rewind(tx, &notice)
                .await
                .map_err(FoldError::Projection)?;
            FoldOutcome::Rewound { released }
        }
        Action::End => {
            projection
                .end(tx, event)
                .await
                .map_err(FoldError::Projection)?;
            FoldOutcome::Ended
        }
        Action::Hold => FoldOutcome::Parked,
        Action::Duplicate => FoldOutcome::Duplicate,
        Action::Abandoned => FoldOutcome::Abandoned,
        Action::Superseded => FoldOutcome::Superseded,
        Action::Adopt => {
            return Err(Error::Database(sqlx::Error::Protocol(
                "relay_fold said adopt twice for one delivery".into(),
            ))
            .into());
        }
    };
    // Intents held back earlier that this delivery released, in the order to apply them.
    for (action, step) in steps {
        let released_event = OutboxEvent {
            key: EventKey {
                branch: BranchKey::new(
                    key.tenant.clone(),
                    key.run.clone(),
                    BranchId::new(&step.branch_id).map_err(Error::from)?,
                ),
                lsn: Lsn::from_db(step.lsn),
            },
            prev_lsn: Lsn::from_db(step.prev_lsn),
            base_lsn: Lsn::from_db(step.base_lsn),
            payload: step.payload.unwrap_or_default(),
            created_at: step.created_at.unwrap_or(event.created_at),
            kind: if action == Action::End {
                EventKind::End
            } else {
                EventKind::Intent
            },
            parent: step
                .parent_branch
                .map(BranchId::new)
                .transpose()
                .map_err(Error::from)?,
            meta: step.meta.map(|json| json.0).unwrap_or_default(),
            epochs: crate::Epochs::default(),
        };
        if released_event.is_end() {
            projection.end(tx, &released_event).await
        } else {
            projection.apply(tx, &released_event).await
        }
        .map_err(FoldError::Projection)?;
    }
    Ok(match undone {
        Some(undone) => FoldOutcome::Adopted { undone, released },
        None => outcome,
    })
}

/// `relay_fold`'s refusals of a broken chain (RL200), of a retired run (RL202) and of a
/// diverged delivery (RL203) as [`Error::BrokenChain`], [`Error::RetiredRun`] and
/// [`Error::Diverged`].
fn fold_refusal(err: sqlx::Error, event: &OutboxEvent) -> Error {
    let micros = |name| detail_value(&err, name).and_then(DateTime::from_timestamp_micros);
    match sql_state(&err).as_deref() {
        Some("RL200") => match detail_value(&err, "applied_lsn") {
            Some(applied) => Error::BrokenChain {
                branch: event.key.branch.clone(),
                lsn: event.key.lsn,
                prev: event.prev_lsn,
                applied: Lsn::from_db(applied),
            },
            None => Error::Database(err),
        },
        Some("RL203") => match &err {
            sqlx::Error::Database(db) => Error::Diverged {
                branch: event.key.branch.clone(),
                lsn: event.key.lsn,
                reason: db.message().to_owned(),
            },
            _ => Error::Database(err),
        },
        Some("RL202") => match micros("retired_through_us") {
            Some(retired_through) => Error::RetiredRun {
                branch: event.key.branch.clone(),
                lsn: event.key.lsn,
                created_at: event.created_at,
                retired_through,
            },
            None => Error::Database(err),
        },
        _ => Error::Database(err),
    }
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
    /// The fold on `pool` (migrated with [`crate::migrations::migrate`]).
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

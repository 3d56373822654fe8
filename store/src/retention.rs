//! Runs end, and storage follows: retirement of closed runs, in bounded batches.
//!
//! A run closed with [`crate::IntentWriter::close_run`] is retired in two places, each on its
//! own schedule and with its own retention:
//! - in the host's database ([`retire_runs`], `relay_retire_runs`): its branches and
//!   parked-branch rows, once it was closed longer than the retention ago and every row of it
//!   has shipped (a run whose end marker is still in the outbox is never retired);
//! - in a consumer's database ([`retire_folded_runs`], `relay_fold_retire`): its cursors and
//!   held-back events, once its end marker was folded longer than the retention ago. Inside the
//!   retention a redelivery is a duplicate, as ever; after it, a delivery of the run is refused
//!   with [`crate::Error::RetiredRun`] (SQLSTATE `RL202`), never applied twice.
//!
//! Each batch is one short transaction that skips rows others hold (`SKIP LOCKED`): it never
//! waits for a host's transaction or a fold, and holds no lock a host needs.
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::types::PgInterval;

use crate::error::Error;

/// How much is retired per batch, and after how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// How long a closed run (or a folded end marker) is kept before it is retired.
    pub keep: Duration,
    /// Most runs retired in one transaction.
    pub batch: u32,
}

impl Retention {
    /// Keep closed runs for `keep`, retiring at most 1,000 runs per transaction.
    pub fn new(keep: Duration) -> Self {
        Self { keep, batch: 1_000 }
    }

    /// How often a retirer checks for due runs: a quarter of the retention, between 100 ms and
    /// 60 s (the relay's and the consumer's loops both use it).
    pub fn every(&self) -> Duration {
        (self.keep / 4).clamp(Duration::from_millis(100), Duration::from_secs(60))
    }

    fn interval(&self) -> Result<PgInterval, Error> {
        let micros =
            i64::try_from(self.keep.as_micros()).map_err(|_| Error::RetentionOutOfRange)?;
        Ok(PgInterval {
            months: 0,
            days: 0,
            microseconds: micros,
        })
    }

    fn batch(&self) -> Result<i32, Error> {
        i32::try_from(self.batch)
            .ok()
            .filter(|batch| *batch > 0)
            .ok_or(Error::RetentionOutOfRange)
    }
}

/// Retires closed runs in the host's database (`relay_retire_runs`), batch after batch until a
/// batch comes back short; returns how many runs were retired.
pub async fn retire_runs(pool: &PgPool, retention: Retention) -> Result<u64, Error> {
    retire_all(pool, retention, "SELECT relay_retire_runs($1, $2)").await
}

/// Retires the fold's state of completed runs in a consumer's database (`relay_fold_retire`),
/// batch after batch until a batch comes back short; returns how many runs were retired.
pub async fn retire_folded_runs(pool: &PgPool, retention: Retention) -> Result<u64, Error> {
    retire_all(pool, retention, "SELECT relay_fold_retire($1, $2)").await
}

/// Which database a retirer keeps: the host's outbox ([`retire_runs`]) or a consumer's fold
/// ([`retire_folded_runs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retiring {
    /// Closed and shipped runs in the host's database (the relay's loop).
    Outbox,
    /// Folded runs' state in a consumer's database (the consumer's loop).
    Fold,
}

/// Retires due runs every [`Retention::every`] until dropped (the caller ends it: an aborted
/// task, a `select!` on its stop signal). Each pass's result goes to `report`, which records it
/// (a metric, a log line); a failure is tried again at the next tick. The first pass runs at
/// once. Every process runs one; batches skip what another holds, so they never contend.
pub async fn retire_every(
    pool: PgPool,
    retention: Retention,
    retiring: Retiring,
    mut report: impl FnMut(Result<u64, Error>),
) {
    let mut ticks = tokio::time::interval(retention.every());
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        report(match retiring {
            Retiring::Outbox => retire_runs(&pool, retention).await,
            Retiring::Fold => retire_folded_runs(&pool, retention).await,
        });
    }
}

async fn retire_all(
    pool: &PgPool,
    retention: Retention,
    statement: &'static str,
) -> Result<u64, Error> {
    let (interval, batch) = (retention.interval()?, retention.batch()?);
    let mut total = 0u64;
    loop {
        let retired: i32 = sqlx::query_scalar(statement)
            .bind(interval)
            .bind(batch)
            .fetch_one(pool)
            .await?;
        total += u64::try_from(retired).unwrap_or(0);
        if retired < batch {
            return Ok(total);
        }
    }
}

//! The consumer: folds deliveries into the user's own tables, exactly once, in order.
//!
//! [`Consumer`] serves every partition of a topology (or a chosen subset, to scale out over
//! several consumer processes), one task per partition. Deliveries are folded in batches (what
//! the broker pushed ahead, up to [`FoldBatch`]'s bounds), each delivery with [`store::fold`]
//! into the user's [`Projection`], the batch inside one database transaction, committed before
//! its deliveries are acked: a crash anywhere means a redelivery, which the fold turns into a
//! no-op. Exactly once at the fold, at least once in transport.
//!
//! On NATS JetStream ([`Consumer::on_nats`], [`NatsConsumerConfig`]) the same fold reads each
//! partition's subject in stream order; the group's position is stored in the fold's
//! transaction (nothing is acked to the server), one process of the group reads a partition at
//! a time (a PostgreSQL advisory lock on the connection its folds run on; the others stand by),
//! and dead letters are kept in the stream `<stream>_dead` (WIRE.md, "On NATS JetStream").
//!
//! Failures, by kind:
//! - broker or database gone: the partition reconnects with backoff (the delivery in hand is
//!   not acked, so it comes back);
//! - the projection fails with a transient error ([`Projection::is_permanent`] false): the same
//!   batch is retried with backoff;
//! - a permanent projection error, a message that breaks the wire contract, or a
//!   [`store::Error::BrokenChain`]: the message goes to the dead-letter queue (`<topology>.dead`)
//!   with the reason in header `x-relay-dead-letter-reason` (confirmed before the batch
//!   commits), the rest of its batch is folded without it, and the partition keeps flowing.
//!   Later intents of that branch wait (parked) behind it: re-publish it to the exchange once
//!   the cause is fixed and the branch resumes in order.
//!
//! The modules:
//! - `config`: [`ConsumerConfig`] (RabbitMQ), [`NatsConsumerConfig`], [`StreamStart`].
//! - `batch`: [`FoldBatch`], a batch's bounds, and `BatchPlan`, which deliveries of a batch the
//!   next attempt folds and which are dead-lettered (pure).
//! - `verdict`: a fold's result to ack, retry or dead-letter, with its reason (pure).
//! - `stream`: on streams, skip, fold or stop at a retention gap (pure).
//! - `settle`: a batch's fold, whatever the broker, behind a small transport (dead-letter one
//!   delivery, ack a batch).
//! - `serve`: the RabbitMQ partition loop; `nats_serve`: the NATS one.
//! - `stats`: [`FoldStats`] and [`ConsumerProgress`], the running totals.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use store::Projection;
use tokio::sync::watch;

use broker::{Error, Partition};

mod batch;
mod config;
mod nats_serve;
mod serve;
mod settle;
mod stats;
mod stream;
mod verdict;

pub use batch::FoldBatch;
pub use broker::DEAD_LETTER_REASON;
pub use config::{ConsumerConfig, NatsConsumerConfig, StreamStart};
pub use stats::{ConsumerProgress, FoldStats};

use nats_serve::NatsServe;
use serve::Serve;
use settle::{Db, Folder};
use stats::{Observer, totals};

/// Folds the relay's messages into a user's [`Projection`], exactly once, in order.
///
/// ```no_run
/// # async fn example(pool: sqlx::PgPool, rabbit: rabbit::RabbitConfig) -> Result<(), broker::Error> {
/// use consumer::{Consumer, ConsumerConfig};
///
/// // `EventTable` keeps every event; implement `store::Projection` to write your own tables.
/// let consumer = Consumer::new(ConsumerConfig::new(rabbit), pool, store::EventTable);
/// let (stop, stopped) = tokio::sync::watch::channel(false);
/// let running = tokio::spawn(consumer.run(async move {
///     let mut stopped = stopped;
///     let _ = stopped.wait_for(|stop| *stop).await;
/// }));
/// // ... later: stop gracefully (the delivery in hand finishes first).
/// stop.send(true).ok();
/// let totals = running.await.expect("consumer task")?;
/// println!("applied {}", totals.applied);
/// # Ok(()) }
/// ```
pub struct Consumer<P> {
    source: Source,
    pool: PgPool,
    projection: P,
    progress: Arc<Mutex<Vec<FoldStats>>>,
    observer: Option<Observer>,
}

/// What a consumer reads.
#[derive(Debug)]
enum Source {
    Rabbit(ConsumerConfig),
    Nats(NatsConsumerConfig),
}

impl<P> std::fmt::Debug for Consumer<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl<P> Consumer<P>
where
    P: Projection + Clone + Sync + 'static,
{
    /// A consumer folding into `projection` on `pool` (migrated with `store::migrate_fold`
    /// or `store::migrate`).
    pub fn new(config: ConsumerConfig, pool: PgPool, projection: P) -> Self {
        let partitions = config.partitions().len();
        Self {
            source: Source::Rabbit(config),
            pool,
            projection,
            progress: Arc::new(Mutex::new(vec![FoldStats::default(); partitions])),
            observer: None,
        }
    }

    /// A consumer folding `config`'s NATS JetStream stream into `projection` on `pool`, one
    /// process of the group per partition at a time ([`NatsConsumerConfig`]).
    pub fn on_nats(config: NatsConsumerConfig, pool: PgPool, projection: P) -> Self {
        let partitions = config.partitions().len();
        Self {
            source: Source::Nats(config),
            pool,
            projection,
            progress: Arc::new(Mutex::new(vec![FoldStats::default(); partitions])),
            observer: None,
        }
    }

    /// Calls `observer` with a partition's running totals after each of its deliveries
    /// (progress reports, tests). It runs on the partition's task: keep it quick.
    pub fn with_observer(
        mut self,
        observer: impl Fn(Partition, FoldStats) + Send + Sync + 'static,
    ) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// The running totals of every partition served, summed.
    pub fn totals(&self) -> FoldStats {
        totals(&self.progress)
    }

    /// A handle on the running totals (readable while `run` runs).
    pub fn progress(&self) -> ConsumerProgress {
        ConsumerProgress(self.progress.clone())
    }

    /// Serves the partitions until `stop` completes; each batch in hand is finished first.
    /// Never returns early on a broker or database failure: it reconnects with backoff.
    pub async fn run(
        self,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> Result<FoldStats, Error> {
        let (stop_tx, stop_rx) = watch::channel(false);
        // Dropping `run` (a killed consumer) aborts every partition task with it: their
        // connections close (`rabbit::ClosingConnection`, which also holds each
        // subscription's handles until then: lapin 4.12.3 can deadlock otherwise) and the
        // broker redelivers whatever they had not acked
        // (`batches::batches_killed_inside_and_between_leave_the_fold_exact`).
        let mut tasks = tokio::task::JoinSet::new();
        let retention = match &self.source {
            Source::Rabbit(config) => {
                self.spawn_rabbit(config, &mut tasks, &stop_rx);
                config.retention
            }
            Source::Nats(config) => {
                self.spawn_nats(config, &mut tasks, &stop_rx);
                config.retention
            }
        };
        if let Some(retention) = retention {
            tasks.spawn(retire_loop(self.pool.clone(), retention, stop_rx.clone()));
        }
        stop.await;
        let _ = stop_tx.send(true);
        while tasks.join_next().await.is_some() {}
        Ok(totals(&self.progress))
    }

    /// One task per RabbitMQ partition, and the dead-letter depth gauge.
    fn spawn_rabbit(
        &self,
        config: &ConsumerConfig,
        tasks: &mut tokio::task::JoinSet<()>,
        stop_rx: &watch::Receiver<bool>,
    ) {
        for (index, partition) in config.partitions().into_iter().enumerate() {
            let topology = &config.rabbit.topology;
            let folder = Folder {
                db: Db::Pool(self.pool.clone()),
                projection: self.projection.clone(),
                event_types: config.event_types.clone(),
                fold_timeout: config.fold_timeout,
                retry: config.retry,
                partition,
                progress: self.progress.clone(),
                index,
                observer: self.observer.clone(),
                system: "rabbitmq",
                destination: topology.queue(partition).to_string(),
                group: topology.group().name().to_owned(),
            };
            let serve = Serve {
                config: config.clone(),
                pool: self.pool.clone(),
                partition,
                folder,
                stream: None,
            };
            tasks.spawn(serve.run(stop_rx.clone()));
        }
        tasks.spawn(dead_letter_depth(config.rabbit.clone(), stop_rx.clone()));
    }

    /// One task per NATS partition.
    fn spawn_nats(
        &self,
        config: &NatsConsumerConfig,
        tasks: &mut tokio::task::JoinSet<()>,
        stop_rx: &watch::Receiver<bool>,
    ) {
        for (index, partition) in config.partitions().into_iter().enumerate() {
            let folder = Folder {
                db: Db::None,
                projection: self.projection.clone(),
                event_types: config.event_types.clone(),
                fold_timeout: config.fold_timeout,
                retry: config.retry,
                partition,
                progress: self.progress.clone(),
                index,
                observer: self.observer.clone(),
                system: "nats",
                destination: config.nats.subject(partition),
                group: config.group.clone(),
            };
            let serve = NatsServe {
                config: config.clone(),
                pool: self.pool.clone(),
                partition,
                folder,
            };
            tasks.spawn(serve.run(stop_rx.clone()));
        }
    }
}

/// Retires completed runs' fold state every quarter of the retention until `stop`; a failure
/// is logged and tried again at the next tick.
async fn retire_loop(pool: PgPool, retention: store::Retention, mut stop: watch::Receiver<bool>) {
    let retiring = store::retire_every(
        pool,
        retention,
        store::Retiring::Fold,
        |result| match result {
            Ok(runs) => metrics::counter!("relay_fold_runs_retired_total").increment(runs),
            Err(err) => {
                tracing::warn!(error = %err, "retiring completed runs' fold state failed; trying again later")
            }
        },
    );
    tokio::select! {
        () = retiring => {}
        _ = stop.wait_for(|stopped| *stopped) => {}
    }
}

/// How often the dead-letter depth gauge is read.
const DEAD_DEPTH_EVERY: Duration = Duration::from_secs(10);

/// Sets `relay_dead_letters{queue}` to the dead-letter queue's depth every 10 s until `stop`
/// (on a connection of its own, opened again after a failure).
async fn dead_letter_depth(rabbit: rabbit::RabbitConfig, mut stop: watch::Receiver<bool>) {
    let queue = rabbit.topology.dead_letter_queue().to_string();
    let mut ticks = tokio::time::interval(DEAD_DEPTH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut session: Option<rabbit::DeadLetters> = None;
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        if session.is_none() {
            session = rabbit::DeadLetters::open(&rabbit).await.ok();
        }
        let Some(dead) = &session else { continue };
        match dead.depth().await {
            Ok(depth) => {
                metrics::gauge!("relay_dead_letters", "queue" => queue.clone())
                    .set(f64::from(depth));
            }
            Err(_) => session = None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rabbit::StreamOffset;
    use store::{BranchId, BranchKey, FoldError, FoldOutcome, Lsn, RunId, TenantId};

    use super::*;
    use crate::stream::{StreamStep, stream_step, subscribe_at};
    use crate::verdict::{DeadReason, Verdict, verdict};

    #[derive(Debug, thiserror::Error)]
    #[error("handler says {0}")]
    struct Handler(&'static str);

    fn permanent(err: &Handler) -> bool {
        err.0 == "never"
    }

    fn store_error(err: store::Error) -> Result<FoldOutcome, FoldError<Handler>> {
        Err(FoldError::Store(err))
    }

    fn label(verdict: &Verdict) -> (&'static str, String) {
        match verdict {
            Verdict::Folded(_) => ("folded", String::new()),
            Verdict::DeadLetter(why, reason) => {
                assert!(
                    reason.starts_with(&format!("{}: ", why.label())),
                    "{reason}"
                );
                ("dead_letter", reason.clone())
            }
            Verdict::Retry(reason) => ("retry", reason.clone()),
        }
    }

    /// Each fold result maps to exactly one fate: what folded is committed and acked; a broken
    /// chain, a refusal by the store and a handler's permanent error are dead-lettered (the
    /// branch waits behind them), with the reason's first word as the metric's label; every
    /// transient error (a database that did not answer, a handler that may pass later) is
    /// retried, never dead-lettered.
    #[test]
    fn every_fold_result_maps_to_one_fate() {
        let outcome = FoldOutcome::Applied { released: 2 };
        assert_eq!(verdict(Ok(outcome), permanent), Verdict::Folded(outcome));
        let broken = store_error(store::Error::BrokenChain {
            branch: BranchKey::new(
                TenantId::new("t").unwrap(),
                RunId::new("r").unwrap(),
                BranchId::new("b").unwrap(),
            ),
            lsn: Lsn::new(5),
            prev: Lsn::new(1),
            applied: Lsn::new(3),
        });
        let (fate, reason) = label(&verdict(broken, permanent));
        assert_eq!(fate, "dead_letter");
        assert!(reason.starts_with("broken_chain: "), "{reason}");
        let silent = store_error(store::Error::NoAnswer {
            after: Duration::from_secs(1),
        });
        let (fate, reason) = label(&verdict(silent, permanent));
        assert_eq!(fate, "retry");
        assert!(reason.starts_with("database: "), "{reason}");
        let refused = store_error(store::Error::LsnOutOfRange { lsn: u64::MAX });
        let (fate, reason) = label(&verdict(refused, permanent));
        assert_eq!(fate, "dead_letter");
        assert!(reason.starts_with("contract: "), "{reason}");
        let never: Result<FoldOutcome, FoldError<Handler>> =
            Err(FoldError::Projection(Handler("never")));
        assert_eq!(
            verdict(never, permanent),
            Verdict::DeadLetter(DeadReason::Handler, "handler: handler says never".into())
        );
        let later: Result<FoldOutcome, FoldError<Handler>> =
            Err(FoldError::Projection(Handler("later")));
        assert_eq!(
            verdict(later, permanent),
            Verdict::Retry("handler: handler says later".into())
        );
        // The fold span's `error.type`: the dead letter's reason, `retry`, or none.
        assert_eq!(Verdict::Folded(outcome).error_type(), None);
        assert_eq!(
            Verdict::Retry("database: x".into()).error_type(),
            Some("retry")
        );
        for (why, label) in [
            (DeadReason::Contract, "contract"),
            (DeadReason::BrokenChain, "broken_chain"),
            (DeadReason::Retired, "retired"),
            (DeadReason::Handler, "handler"),
        ] {
            assert_eq!(
                Verdict::DeadLetter(why, String::new()).error_type(),
                Some(label)
            );
        }
    }

    /// A stream consumer folds the message it expects and the one after it (a segment's
    /// tracking chunk takes one offset), skips what it already folded, and stops at a gap of
    /// two or more (retention removed messages it never read). With nothing stored, whatever
    /// comes first is folded.
    #[test]
    fn a_stream_gap_of_two_or_more_is_a_loss_never_skipped() {
        assert_eq!(stream_step(None, 0), StreamStep::Fold);
        assert_eq!(stream_step(None, 1_850), StreamStep::Fold);
        assert_eq!(stream_step(Some(10), 10), StreamStep::Fold);
        assert_eq!(stream_step(Some(77), 78), StreamStep::Fold);
        assert_eq!(stream_step(Some(10), 9), StreamStep::Skip);
        assert_eq!(stream_step(Some(10), 0), StreamStep::Skip);
        assert_eq!(stream_step(Some(10), 12), StreamStep::Lost);
        assert_eq!(stream_step(Some(0), 1_850), StreamStep::Lost);
        assert_eq!(
            StreamStart::At(std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000)).offset(),
            StreamOffset::Timestamp(1_700_000_000)
        );
        assert_eq!(StreamStart::default().offset(), StreamOffset::First);
        assert_eq!(StreamStart::Offset(7).offset(), StreamOffset::Offset(7));
    }

    /// A subscription, first or made again after a silence, starts at the offset expected
    /// next once there is one; before that at the group's start, except that `next` is never
    /// asked twice (it would skip what the first subscription was not told of).
    #[test]
    fn a_subscription_made_again_starts_where_the_fold_expects() {
        let at = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        for start in [StreamStart::First, StreamStart::Next, StreamStart::At(at)] {
            for again in [false, true] {
                assert_eq!(
                    subscribe_at(Some(42), start, again),
                    Some(StreamOffset::Offset(42))
                );
            }
            assert_eq!(subscribe_at(None, start, false), Some(start.offset()));
        }
        assert_eq!(
            subscribe_at(None, StreamStart::First, true),
            Some(StreamOffset::First)
        );
        assert_eq!(
            subscribe_at(None, StreamStart::At(at), true),
            Some(StreamOffset::Timestamp(1_700_000_000))
        );
        assert_eq!(subscribe_at(None, StreamStart::Next, true), None);
    }
}

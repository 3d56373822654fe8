//! A batch's fate, whatever the broker: folded in one transaction (a delivery refused for good
//! dead-lettered, the rest folded again without it; anything that may pass retried with
//! backoff), the stream position stored with it, committed, then acked at once. The broker is a
//! [`Transport`]: how to dead-letter one delivery and how to ack a batch.
use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use store::{EventType, FoldError, FoldOutcome, OutboxEvent, Projection};
use tokio::sync::watch;
use tracing::Instrument;

use broker::{Backoff, Error, Partition, RetryPolicy, WireError};

use crate::batch::{BatchPlan, Slot};
use crate::stats::{FoldStats, Observer};
use crate::verdict::{DeadReason, Verdict, verdict};

mod fold;
use fold::{Subscribed, fold_span};

/// What the fold needs of a broker.
pub(crate) trait Transport {
    /// One delivery as the broker hands it over.
    type Delivery: Send + Sync;

    /// Its body's length.
    fn bytes(delivery: &Self::Delivery) -> usize;

    /// Its message id, for log lines.
    fn message_id(delivery: &Self::Delivery) -> Option<String>;

    /// Keeps `delivery` as a dead letter with `reason`; `Ok` only once the broker stored it
    /// (an error ends the session: the batch is not committed, it comes back).
    fn dead_letter(
        &self,
        delivery: &Self::Delivery,
        reason: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Acks every delivery up to `last` (after the commit).
    fn ack_through(&self, last: &Self::Delivery) -> impl Future<Output = Result<(), Error>> + Send;
}

/// One delivery of a batch: on a stream its position, and the event it carries (`None`: a
/// message folded before, acked only).
pub(crate) struct Incoming<D> {
    pub(crate) delivery: D,
    pub(crate) offset: Option<u64>,
    pub(crate) event: Option<Result<OutboxEvent, WireError>>,
}

impl<D> Incoming<D> {
    /// What the batch first makes of it: folded, skipped, or (not an event) dead-lettered.
    fn slot(&self) -> Slot {
        match &self.event {
            None => Slot::Skip,
            Some(Ok(_)) => Slot::Fold,
            Some(Err(err)) => Slot::Dead {
                why: DeadReason::Contract,
                reason: DeadReason::Contract.reason(err),
                sent: false,
            },
        }
    }
}

/// How one attempt at a batch ended.
enum Attempt {
    /// Done: what each folded delivery (by its index) came to, and whether a transaction was
    /// committed (none for a batch with nothing to fold, dead-letter or store).
    Committed(Vec<(usize, FoldOutcome)>, bool),
    /// The delivery at this index is refused for good: fold the batch again without it.
    Refused(usize, DeadReason, String),
    /// Rolled back by something that may pass: try the batch again after a delay.
    Failed(String),
}

/// Where the fold's transactions run: any connection of the pool, or one held for the
/// partition, out of the pool (its session lock makes its reader the group's only one, and
/// goes with it: see `nats_serve`).
pub(crate) enum Db {
    Pool(PgPool),
    Held(PgConnection),
    /// Between sessions.
    None,
}

/// One partition's fold: its database, the user's projection, its bounds and its totals.
pub(crate) struct Folder<P> {
    pub(crate) db: Db,
    pub(crate) projection: P,
    pub(crate) event_types: Option<BTreeSet<EventType>>,
    pub(crate) fold_timeout: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) partition: Partition,
    pub(crate) progress: Arc<Mutex<Vec<FoldStats>>>,
    pub(crate) index: usize,
    pub(crate) observer: Option<Observer>,
    /// The fold span's labels: the broker (`messaging.system`), the queue or subject, the group.
    pub(crate) system: &'static str,
    pub(crate) destination: String,
    pub(crate) group: String,
}

impl<P> Folder<P>
where
    P: Projection + Clone + Sync + 'static,
{
    /// Folds a batch in one transaction (a delivery refused for good is taken out and the rest
    /// folded again; anything that may pass later is retried with backoff: see `batch`), with
    /// the position past its last delivery stored under `offset_key` (a stream), then acks it
    /// at once. A broker failure returns (the batch comes back). Returns the stored position's
    /// delivery offset, if any.
    pub(crate) async fn settle<T: Transport>(
        &mut self,
        transport: &T,
        batch: Vec<Incoming<T::Delivery>>,
        offset_key: Option<&str>,
        stop: &watch::Receiver<bool>,
    ) -> Result<Option<u64>, Error> {
        let partition = self.partition.0;
        let mut plan = BatchPlan::new(batch.iter().map(Incoming::slot).collect());
        // On a stream, where to resume: past the batch's last message.
        let offset = batch.iter().filter_map(|incoming| incoming.offset).max();
        let stored = offset_key.zip(offset);
        let mut retry = Backoff::new(self.retry);
        let (outcomes, committed) = loop {
            let timeout = self.fold_timeout;
            let attempt = tokio::time::timeout(
                timeout,
                self.fold_batch(transport, &batch, &mut plan, stored),
            )
            .await
            .unwrap_or_else(|_| {
                Ok(Attempt::Failed(format!(
                    "database: no answer within {timeout:?}"
                )))
            })?;
            match attempt {
                Attempt::Committed(outcomes, committed) => break (outcomes, committed),
                Attempt::Refused(at, why, reason) => plan.refuse(at, why, reason),
                Attempt::Failed(why) if matches!(self.db, Db::Held(_)) => {
                    // The held connection may be the cause (broken, ended by the server, a
                    // statement still running after the fold's timeout): it is never used
                    // again. The session ends, its lock with it; the next reads again from the
                    // stored position on a fresh connection, after the session's backoff.
                    metrics::counter!("relay_consumer_retries_total").increment(1);
                    return Err(Error::Unreachable(format!(
                        "the batch's fold failed ({why}); reading again from the stored position"
                    )));
                }
                Attempt::Failed(why) => {
                    let delay = retry.next_delay();
                    if broker::warn_worthy(retry.failures()) {
                        let first = plan
                            .to_fold()
                            .first()
                            .and_then(|&at| T::message_id(&batch[at].delivery));
                        tracing::warn!(partition, first = first.as_deref().unwrap_or("?"), deliveries = batch.len(), failures = retry.failures(), reason = %why, "fold failed; retrying the batch");
                    }
                    metrics::counter!("relay_consumer_retries_total").increment(1);
                    if *stop.borrow() {
                        // Not acked: redelivered to whoever consumes next.
                        return Ok(None);
                    }
                    tokio::time::sleep(delay).await;
                }
            }
        };
        if committed {
            self.record(|stats| stats.batches += 1);
            metrics::histogram!("relay_consumer_batch_deliveries").record(batch.len() as f64);
        }
        for (at, outcome) in outcomes {
            match outcome {
                FoldOutcome::Superseded => {
                    metrics::counter!("relay_consumer_superseded_total").increment(1);
                }
                FoldOutcome::Adopted { undone, .. } => {
                    let message = T::message_id(&batch[at].delivery);
                    tracing::warn!(
                        partition,
                        message = message.as_deref().unwrap_or("?"),
                        undone,
                        "adopted the database's history: what a failover lost was undone"
                    );
                    metrics::counter!("relay_consumer_adopted_total").increment(1);
                }
                _ => {}
            }
            self.record(|stats| stats.add(outcome));
        }
        for at in 0..batch.len() {
            if let Slot::Dead { why, .. } = plan.slot(at) {
                metrics::counter!("relay_consumer_dead_letters_total", "reason" => why.label())
                    .increment(1);
                self.record(|stats| stats.rejected += 1);
            }
        }
        // Invariant: acked only after the fold committed (and every dead letter was
        // confirmed): the whole batch at once.
        if let Some(last) = batch.last() {
            transport.ack_through(&last.delivery).await?;
        }
        Ok(offset)
    }

    /// One attempt at a batch: its foldable deliveries in order in one transaction, stopping
    /// at the first refused for good or failing; then the dead letters not yet confirmed are
    /// kept (a broker failure ends the session), the stream position stored, and the
    /// transaction committed.
    async fn fold_batch<T: Transport>(
        &mut self,
        transport: &T,
        batch: &[Incoming<T::Delivery>],
        plan: &mut BatchPlan,
        stored: Option<(&str, u64)>,
    ) -> Result<Attempt, Error> {
        let to_fold = plan.to_fold();
        let unsent = plan.unsent();
        if to_fold.is_empty() && unsent.is_empty() && stored.is_none() {
            return Ok(Attempt::Committed(Vec::new(), false));
        }
        // Should this connection vanish mid-fold (a network losing it without a reset),
        // PostgreSQL ends the orphaned transaction after the same limit and releases the
        // branch's cursor lock; else every retry would wait on that lock until the server
        // noticed the dead client (hours, with default TCP keepalives).
        let idle_ms = self.fold_timeout.as_millis().max(1);
        let begin = format!("BEGIN; SET LOCAL idle_in_transaction_session_timeout = {idle_ms}");
        let begun = match &mut self.db {
            Db::Pool(pool) => pool.begin_with(sqlx::AssertSqlSafe(begin)).await,
            Db::Held(conn) => sqlx::Connection::begin_with(conn, sqlx::AssertSqlSafe(begin)).await,
            Db::None => return Err(Error::Unreachable("no database connection held".into())),
        };
        let mut tx = match begun {
            Ok(tx) => tx,
            Err(err) => return Ok(Attempt::Failed(format!("database: {err}"))),
        };
        let span_of = |event: &OutboxEvent| {
            fold_span(event, self.system, self.destination.as_str(), &self.group)
        };
        // The fold's verdicts on the whole batch in one call (`relay_fold_batch`), then each
        // delivery's application through the projection, in order, each in its own span.
        let folded: Vec<(usize, &OutboxEvent)> = to_fold
            .iter()
            .filter_map(|&at| match &batch[at].event {
                Some(Ok(event)) => Some((at, event)),
                _ => None,
            })
            .collect();
        let mut outcomes = Vec::with_capacity(folded.len());
        if !folded.is_empty() {
            let events: Vec<&OutboxEvent> = folded.iter().map(|(_, event)| *event).collect();
            let answers = match store::fold_verdicts(&mut tx, &events).await {
                Ok(answers) => answers,
                Err((refused, err)) => {
                    let verdict = verdict::<P::Error>(Err(FoldError::Store(err)), P::is_permanent);
                    if let (Some(at), Some(failed)) = (refused, verdict.error_type()) {
                        let span = span_of(folded[at].1);
                        span.record("error.type", failed);
                        span.record("otel.status_code", "error");
                    }
                    return Ok(match (verdict, refused) {
                        (Verdict::DeadLetter(why, reason), Some(at)) => {
                            Attempt::Refused(folded[at].0, why, reason)
                        }
                        (Verdict::DeadLetter(_, why) | Verdict::Retry(why), _) => {
                            Attempt::Failed(why)
                        }
                        (Verdict::Folded(_), _) => {
                            Attempt::Failed("the batched fold failed without an error".into())
                        }
                    });
                }
            };
            for (&(at, event), steps) in folded.iter().zip(answers) {
                let span = span_of(event);
                let mut projection = Subscribed {
                    inner: &mut self.projection,
                    types: self.event_types.as_ref(),
                };
                let applied = store::apply_fold(&mut tx, event, steps, &mut projection)
                    .instrument(span.clone())
                    .await;
                let verdict = verdict(applied, P::is_permanent);
                if let Some(failed) = verdict.error_type() {
                    span.record("error.type", failed);
                    span.record("otel.status_code", "error");
                }
                match verdict {
                    Verdict::Folded(outcome) => outcomes.push((at, outcome)),
                    Verdict::DeadLetter(why, reason) => {
                        return Ok(Attempt::Refused(at, why, reason));
                    }
                    Verdict::Retry(why) => return Ok(Attempt::Failed(why)),
                }
            }
        }
        for at in unsent {
            let Slot::Dead { reason, .. } = plan.slot(at) else {
                continue;
            };
            let delivery = &batch[at].delivery;
            // Logged without the body: a payload never reaches a log line.
            tracing::error!(partition = self.partition.0, reason = %reason, bytes = T::bytes(delivery), "dead-lettering a message");
            transport.dead_letter(delivery, reason).await?;
            plan.sent(at);
        }
        // On a stream, where to resume is part of what this transaction commits.
        if let Some((key, offset)) = stored
            && let Err(err) = store::save_stream_offset(&mut tx, key, offset + 1).await
        {
            return Ok(Attempt::Failed(format!("database: {err}")));
        }
        Ok(match tx.commit().await {
            Ok(()) => Attempt::Committed(outcomes, true),
            Err(err) => Attempt::Failed(format!("commit: {err}")),
        })
    }

    /// After a failed session: counted, logged (an error that needs an operator on every
    /// attempt, anything else on the 1st, 2nd, 4th, 8th... failure), then the backoff's delay.
    /// `false` when `stop` came first.
    pub(crate) async fn after_failure(
        &self,
        err: &Error,
        backoff: &mut Backoff,
        stop: &mut watch::Receiver<bool>,
    ) -> bool {
        self.record(|stats| stats.reconnects += 1);
        let delay = backoff.next_delay();
        let (partition, retry_in_ms) = (self.partition.0, delay.as_millis() as u64);
        if !err.is_transient() {
            // Never read past silently (a gap, a stream created again): said on every attempt
            // until an operator acts.
            tracing::error!(partition, system = self.system, error = %err, retry_in_ms, "consumer cannot go on");
        } else if broker::warn_worthy(backoff.failures()) {
            tracing::warn!(partition, system = self.system, error = %err, retry_in_ms, "consumer session failed; reconnecting");
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => true,
            _ = stop.wait_for(|stop| *stop) => false,
        }
    }

    /// Changes this partition's running totals and tells the observer.
    pub(crate) fn record(&self, change: impl FnOnce(&mut FoldStats)) {
        let stats = {
            let mut progress = self
                .progress
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            change(&mut progress[self.index]);
            progress[self.index]
        };
        if let Some(observer) = &self.observer {
            observer(self.partition, stats);
        }
    }
}

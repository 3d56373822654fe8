//! One partition's loop: subscribe, fold each batch of deliveries in its transaction,
//! dead-letter what is refused, ack, reconnect.
use std::sync::{Arc, Mutex};

use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Confirmation};
use sqlx::PgPool;
use store::{FoldError, FoldOutcome, OutboxEvent, Projection};
use tokio::sync::watch;
use tracing::Instrument;

use broker::{Backoff, Error, Partition};

use rabbit::{QueueType, open, within};

mod fold;
pub(crate) use fold::{Subscribed, fold_span};

use crate::batch::{BatchPlan, Slot};
use crate::stream::{StreamStep, delivery_offset, stream_step, subscribe_at};
use crate::verdict::{DeadReason, Verdict, verdict};
use crate::{ConsumerConfig, DEAD_LETTER_REASON, FoldStats, Observer};

/// One delivery of a batch: on a stream its offset, and the event it carries (`None`: a
/// stream message folded before, acked only).
pub(crate) struct Incoming {
    delivery: Delivery,
    offset: Option<u64>,
    event: Option<Result<OutboxEvent, broker::WireError>>,
}

impl Incoming {
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

    fn message_id(&self) -> Option<String> {
        self.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
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

/// One partition's loop.
pub(crate) struct Serve<P> {
    pub(crate) config: ConsumerConfig,
    pub(crate) pool: PgPool,
    pub(crate) projection: P,
    pub(crate) partition: Partition,
    pub(crate) progress: Arc<Mutex<Vec<FoldStats>>>,
    pub(crate) index: usize,
    pub(crate) observer: Option<Observer>,
    /// On a stream: the queue and the offset expected next (`None`: nothing stored yet).
    pub(crate) stream: Option<StreamCursor>,
}

/// Where a stream consumer is: its queue (the key of its stored offset) and the offset it
/// expects next, the same as the one stored in the fold's database.
pub(crate) struct StreamCursor {
    queue: String,
    expected: Option<u64>,
}

pub(crate) struct Session {
    connection: rabbit::ClosingConnection,
    channel: Channel,
    /// A confirming channel for dead letters: a message is acked only once its dead letter is
    /// confirmed.
    dead: Channel,
}

impl<P> Serve<P>
where
    P: Projection + Clone + Sync + 'static,
{
    pub(crate) async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(self.config.retry);
        let partition = self.partition.0;
        while !*stop.borrow() {
            match self.session(&mut stop, &mut backoff).await {
                Ok(()) => return,
                Err(err) => {
                    self.record(|stats| stats.reconnects += 1);
                    let delay = backoff.next_delay();
                    if matches!(err, Error::OffsetLost { .. }) {
                        // Never skipped silently: said on every attempt until an operator acts.
                        tracing::error!(partition, error = %err, retry_in_ms = delay.as_millis() as u64, "stream consumer stopped at a gap");
                    } else if backoff.failures().is_power_of_two() {
                        tracing::warn!(partition, error = %err, retry_in_ms = delay.as_millis() as u64, "consumer session failed; reconnecting");
                    }
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = stop.wait_for(|stop| *stop) => return,
                    }
                }
            }
        }
    }

    async fn open(&self) -> Result<Session, Error> {
        let rabbit = &self.config.rabbit;
        let limit = rabbit.connect_timeout;
        let (mut connection, channel) = open(rabbit, "outbox-consumer").await?;
        within(
            "basic.qos",
            limit,
            channel.basic_qos(self.config.prefetch, BasicQosOptions::default()),
        )
        .await?;
        connection.hold("channel", channel.clone());
        let dead = within("channel.open", limit, connection.create_channel()).await?;
        connection.hold("dead", dead.clone());
        within(
            "confirm.select",
            limit,
            dead.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(Session {
            connection,
            channel,
            dead,
        })
    }

    /// `basic.consume` on `session`'s channel; on a stream, at the offset expected next (or
    /// the group's start). `again` is a subscription made again after a silence: it replaces
    /// the channel with a fresh one (whose prefetch is free; the old one's unacked deliveries
    /// are read again from the expected offset) and returns `None` when it must not be made
    /// (see [`subscribe_at`]).
    async fn subscribe(
        &self,
        session: &mut Session,
        again: bool,
    ) -> Result<Option<lapin::Consumer>, Error> {
        let rabbit = &self.config.rabbit;
        let limit = rabbit.connect_timeout;
        let queue = rabbit.topology.queue(self.partition);
        let mut arguments = FieldTable::default();
        if let Some(cursor) = &self.stream {
            let Some(at) = subscribe_at(cursor.expected, self.config.stream_start, again) else {
                return Ok(None);
            };
            arguments.insert("x-stream-offset".into(), at);
        }
        if again {
            let fresh = within("channel.open", limit, session.connection.create_channel()).await?;
            within(
                "basic.qos",
                limit,
                fresh.basic_qos(self.config.prefetch, BasicQosOptions::default()),
            )
            .await?;
            let old = std::mem::replace(&mut session.channel, fresh.clone());
            within(
                "channel.close",
                limit,
                old.close(200, "subscribing again".into()),
            )
            .await?;
            session.connection.hold("channel", fresh);
        }
        let deliveries = within(
            "basic.consume",
            limit,
            session.channel.basic_consume(
                queue,
                "".into(),
                BasicConsumeOptions::default(),
                arguments,
            ),
        )
        .await?;
        // Held until the connection has closed (see `rabbit::ClosingConnection`).
        session.connection.hold("deliveries", deliveries.clone());
        Ok(Some(deliveries))
    }

    /// One connection's life: consume until stopped (`Ok`) or a failure (`Err`, reconnect).
    async fn session(
        &mut self,
        stop: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
    ) -> Result<(), Error> {
        let mut session = self.open().await?;
        let rabbit = &self.config.rabbit;
        let queue = rabbit.topology.queue(self.partition);
        let on_stream = rabbit.topology.queue_type() == QueueType::Stream;
        if on_stream {
            // Resume exactly after what the fold committed: the offset is stored with it.
            let stored = {
                let mut conn = self.pool.acquire().await.map_err(store::Error::from)?;
                store::stream_offset(&mut conn, queue.as_str()).await?
            };
            self.stream = Some(StreamCursor {
                queue: queue.to_string(),
                expected: stored,
            });
        }
        let mut deliveries = self
            .subscribe(&mut session, false)
            .await?
            .expect("a first subscription is always made");
        let silence = self.config.stream_resubscribe;
        let quiet = tokio::time::sleep(silence);
        tokio::pin!(quiet);
        loop {
            let heard = tokio::select! {
                _ = stop.wait_for(|stop| *stop) => return Ok(()),
                () = &mut quiet, if on_stream => None,
                next = deliveries.next() => Some(next),
            };
            let delivery = match heard {
                None => {
                    // Heard nothing for a while: ask again, in case the broker did not tell
                    // this subscription of what it holds (see `stream_resubscribe`).
                    if let Some(fresh) = self.subscribe(&mut session, true).await? {
                        deliveries = fresh;
                        self.record(|stats| stats.resubscribes += 1);
                        metrics::counter!("relay_consumer_stream_resubscribes_total", "queue" => queue.to_string())
                            .increment(1);
                        tracing::debug!(
                            partition = self.partition.0,
                            "stream partition silent; subscribed again"
                        );
                    }
                    quiet.as_mut().reset(tokio::time::Instant::now() + silence);
                    continue;
                }
                Some(Some(delivery)) => delivery.map_err(Error::channel)?,
                Some(None) => {
                    return Err(Error::Unreachable(
                        "the broker cancelled the consumer".into(),
                    ));
                }
            };
            if on_stream {
                quiet.as_mut().reset(tokio::time::Instant::now() + silence);
            }
            backoff.reset();
            // A batch: this delivery and what else the broker has pushed ahead (up to the
            // batch's bounds, after waiting at most its linger). Whatever ends the session
            // on the way ends it after the batch taken so far is folded and acked.
            let mut expected = self.stream.as_ref().and_then(|cursor| cursor.expected);
            let mut batch = vec![self.admit(delivery, &mut expected)?];
            let mut bytes = batch[0].delivery.data.len();
            let mut ended = None;
            let bounds = self.config.batch;
            let linger_until = tokio::time::Instant::now() + bounds.linger;
            while !bounds.full(batch.len(), bytes) {
                let next = match deliveries.next().now_or_never() {
                    Some(next) => next,
                    None if bounds.linger.is_zero() => break,
                    None => match tokio::time::timeout_at(linger_until, deliveries.next()).await {
                        Ok(next) => next,
                        Err(_) => break,
                    },
                };
                let admitted = match next {
                    Some(Ok(delivery)) => self.admit(delivery, &mut expected),
                    Some(Err(err)) => Err(Error::channel(err)),
                    None => Err(Error::Unreachable(
                        "the broker cancelled the consumer".into(),
                    )),
                };
                match admitted {
                    Ok(incoming) => {
                        bytes += incoming.delivery.data.len();
                        batch.push(incoming);
                    }
                    Err(err) => {
                        ended = Some(err);
                        break;
                    }
                }
            }
            self.handle_batch(&session, batch, stop).await?;
            if let Some(err) = ended {
                return Err(err);
            }
        }
    }

    /// A delivery as a batch takes it: on a stream, checked against the offset expected next
    /// (`expected`, moved past it); a stream that lost messages to retention ends the session.
    fn admit(&self, delivery: Delivery, expected: &mut Option<u64>) -> Result<Incoming, Error> {
        let offset = match &self.stream {
            None => None,
            Some(cursor) => {
                let Some(offset) = delivery_offset(&delivery) else {
                    return Err(Error::Refused(format!(
                        "stream {} delivered a message without x-stream-offset",
                        cursor.queue
                    )));
                };
                match stream_step(*expected, offset) {
                    StreamStep::Fold => {
                        *expected = Some(offset + 1);
                        Some(offset)
                    }
                    StreamStep::Skip => {
                        return Ok(Incoming {
                            delivery,
                            offset: None,
                            event: None,
                        });
                    }
                    StreamStep::Lost => {
                        let queue = cursor.queue.clone();
                        metrics::counter!("relay_consumer_offset_lost_total", "queue" => queue.clone())
                            .increment(1);
                        self.record(|stats| stats.gaps += 1);
                        return Err(Error::OffsetLost {
                            queue,
                            expected: expected.unwrap_or(0),
                            first: offset,
                        });
                    }
                }
            }
        };
        let event = rabbit::decode(&delivery.properties, &delivery.data);
        Ok(Incoming {
            delivery,
            offset,
            event: Some(event),
        })
    }

    /// Folds a batch in one transaction (a delivery refused for good is taken out and the rest
    /// folded again; anything that may pass later is retried with backoff: see `batch`), then
    /// acks every delivery of it at once. A broker failure returns (the batch comes back).
    async fn handle_batch(
        &mut self,
        session: &Session,
        batch: Vec<Incoming>,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), Error> {
        let limit = self.config.rabbit.connect_timeout;
        let partition = self.partition.0;
        let mut plan = BatchPlan::new(batch.iter().map(Incoming::slot).collect());
        // On a stream, where to resume: past the batch's last message.
        let offset = batch.iter().filter_map(|incoming| incoming.offset).max();
        let mut retry = Backoff::new(self.config.retry);
        let (outcomes, committed) = loop {
            let timeout = self.config.fold_timeout;
            let attempt =
                tokio::time::timeout(timeout, self.fold_batch(session, &batch, &mut plan, offset))
                    .await
                    .unwrap_or_else(|_| {
                        Ok(Attempt::Failed(format!(
                            "database: no answer within {timeout:?}"
                        )))
                    })?;
            match attempt {
                Attempt::Committed(outcomes, committed) => break (outcomes, committed),
                Attempt::Refused(at, why, reason) => plan.refuse(at, why, reason),
                Attempt::Failed(why) => {
                    let delay = retry.next_delay();
                    if retry.failures().is_power_of_two() {
                        let first =
                            batch[plan.to_fold().first().copied().unwrap_or(0)].message_id();
                        tracing::warn!(partition, first = first.as_deref().unwrap_or("?"), deliveries = batch.len(), failures = retry.failures(), reason = %why, "fold failed; retrying the batch");
                    }
                    metrics::counter!("relay_consumer_retries_total").increment(1);
                    if *stop.borrow() {
                        // Not acked: redelivered to whoever consumes next.
                        return Ok(());
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
                    let message = batch[at].message_id();
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
        // confirmed): the whole batch at once, every delivery on this channel up to its last.
        if let Some(last) = batch.last() {
            within(
                "basic.ack",
                limit,
                last.delivery.ack(BasicAckOptions { multiple: true }),
            )
            .await?;
        }
        if let (Some(cursor), Some(offset)) = (&mut self.stream, offset) {
            cursor.expected = Some(offset + 1);
        }
        Ok(())
    }

    /// One attempt at a batch: its foldable deliveries in order in one transaction, stopping
    /// at the first refused for good or failing; then the dead letters not yet confirmed are
    /// published (and confirmed: a broker failure ends the session), the stream offset stored,
    /// and the transaction committed.
    async fn fold_batch(
        &mut self,
        session: &Session,
        batch: &[Incoming],
        plan: &mut BatchPlan,
        offset: Option<u64>,
    ) -> Result<Attempt, Error> {
        let to_fold = plan.to_fold();
        let unsent = plan.unsent();
        if to_fold.is_empty() && unsent.is_empty() && offset.is_none() {
            return Ok(Attempt::Committed(Vec::new(), false));
        }
        // Should this connection vanish mid-fold (a network losing it without a reset),
        // PostgreSQL ends the orphaned transaction after the same limit and releases the
        // branch's cursor lock; else every retry would wait on that lock until the server
        // noticed the dead client (hours, with default TCP keepalives).
        let idle_ms = self.config.fold_timeout.as_millis().max(1);
        let begin = format!("BEGIN; SET LOCAL idle_in_transaction_session_timeout = {idle_ms}");
        let mut tx = match self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await {
            Ok(tx) => tx,
            Err(err) => return Ok(Attempt::Failed(format!("database: {err}"))),
        };
        let topology = &self.config.rabbit.topology;
        let queue = topology.queue(self.partition);
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
                        let (_, event) = folded[at];
                        let span = fold_span(event, queue.as_str(), topology.group().name());
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
                let span = fold_span(event, queue.as_str(), topology.group().name());
                let mut projection = Subscribed {
                    inner: &mut self.projection,
                    types: self.config.event_types.as_ref(),
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
            tracing::error!(partition = self.partition.0, reason = %reason, bytes = delivery.data.len(), "dead-lettering a message");
            self.dead_letter(session, delivery, reason).await?;
            plan.sent(at);
        }
        // On a stream, where to resume is part of what this transaction commits.
        if let (Some(cursor), Some(offset)) = (&self.stream, offset)
            && let Err(err) = store::save_stream_offset(&mut tx, &cursor.queue, offset + 1).await
        {
            return Ok(Attempt::Failed(format!("database: {err}")));
        }
        Ok(match tx.commit().await {
            Ok(()) => Attempt::Committed(outcomes, true),
            Err(err) => Attempt::Failed(format!("commit: {err}")),
        })
    }

    fn record(&self, change: impl FnOnce(&mut FoldStats)) {
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

    async fn dead_letter(
        &self,
        session: &Session,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<(), Error> {
        let rabbit = &self.config.rabbit;
        // The broker's own delivery headers do not belong to the message.
        let mut headers: FieldTable = delivery
            .properties
            .headers()
            .as_ref()
            .map(|headers| {
                headers
                    .inner()
                    .iter()
                    .filter(|(name, _)| !rabbit::BROKER_HEADERS.contains(&name.as_str()))
                    .map(|(name, value)| (name.clone(), value.clone()))
                    .collect::<std::collections::BTreeMap<_, _>>()
                    .into()
            })
            .unwrap_or_default();
        headers.insert(
            DEAD_LETTER_REASON.into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        let properties = delivery.properties.clone().with_headers(headers);
        let confirm = within(
            "basic.publish",
            rabbit.connect_timeout,
            session.dead.basic_publish(
                "".into(),
                rabbit.topology.dead_letter_queue(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                properties,
            ),
        )
        .await?;
        match within("dead-letter confirm", rabbit.confirm_timeout, confirm).await? {
            Confirmation::Ack(None) => Ok(()),
            other => Err(Error::Unreachable(format!(
                "the dead-letter queue did not take the message: {other:?}"
            ))),
        }
    }
}

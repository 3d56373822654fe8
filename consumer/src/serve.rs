//! One partition's loop: subscribe, fold each delivery in its transaction, ack, dead-letter,
//! reconnect.
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Confirmation};
use sqlx::PgPool;
use store::{FoldOutcome, OutboxEvent, Projection};
use tokio::sync::watch;
use tracing::Instrument;

use broker::{Backoff, Error, Partition, QueueType, open, within};

mod fold;
pub(crate) use fold::{Subscribed, fold_span};

use crate::stream::{StreamStep, delivery_offset, stream_step, subscribe_at};
use crate::verdict::{DeadReason, Verdict, verdict};
use crate::{ConsumerConfig, DEAD_LETTER_REASON, FoldStats, Observer};

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
    connection: broker::ClosingConnection,
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
        let (connection, channel) = open(rabbit, "outbox-consumer").await?;
        within(
            "basic.qos",
            limit,
            channel.basic_qos(self.config.prefetch, BasicQosOptions::default()),
        )
        .await?;
        let dead = within("channel.open", limit, connection.create_channel()).await?;
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
            let old = std::mem::replace(&mut session.channel, fresh);
            within(
                "channel.close",
                limit,
                old.close(200, "subscribing again".into()),
            )
            .await?;
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
                Some(Some(delivery)) => delivery?,
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
            let offset = match &self.stream {
                None => None,
                Some(cursor) => {
                    let Some(offset) = delivery_offset(&delivery) else {
                        return Err(Error::Refused(format!(
                            "stream {} delivered a message without x-stream-offset",
                            cursor.queue
                        )));
                    };
                    match stream_step(cursor.expected, offset) {
                        StreamStep::Fold => Some(offset),
                        StreamStep::Skip => {
                            let limit = self.config.rabbit.connect_timeout;
                            within("basic.ack", limit, delivery.ack(BasicAckOptions::default()))
                                .await?;
                            continue;
                        }
                        StreamStep::Lost => {
                            let (queue, expected) =
                                (cursor.queue.clone(), cursor.expected.unwrap_or(0));
                            metrics::counter!("relay_consumer_offset_lost_total", "queue" => queue.clone())
                                .increment(1);
                            self.record(|stats| stats.gaps += 1);
                            return Err(Error::OffsetLost {
                                queue,
                                expected,
                                first: offset,
                            });
                        }
                    }
                }
            };
            self.handle(&session, delivery, offset, stop).await?;
        }
    }

    /// Folds one delivery, retrying transient failures with backoff; then acks it, or
    /// dead-letters it and acks it. A broker failure returns (the delivery comes back).
    async fn handle(
        &mut self,
        session: &Session,
        delivery: Delivery,
        offset: Option<u64>,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), Error> {
        let limit = self.config.rabbit.connect_timeout;
        let partition = self.partition.0;
        let mut retry = Backoff::new(self.config.retry);
        let verdict = match broker::decode(&delivery.properties, &delivery.data) {
            Err(err) => DeadReason::Contract.because(err),
            Ok(event) => loop {
                let topology = &self.config.rabbit.topology;
                let span = fold_span(
                    &event,
                    topology.queue(self.partition).as_str(),
                    topology.group().name(),
                );
                let verdict = self.fold(&event, offset).instrument(span.clone()).await;
                if let Some(failed) = verdict.error_type() {
                    span.record("error.type", failed);
                    span.record("otel.status_code", "error");
                }
                drop(span);
                match verdict {
                    Verdict::Retry(why) => {
                        let delay = retry.next_delay();
                        if retry.failures().is_power_of_two() {
                            tracing::warn!(partition, event = %event.key, failures = retry.failures(), reason = %why, "fold failed; retrying the delivery");
                        }
                        metrics::counter!("relay_consumer_retries_total").increment(1);
                        if *stop.borrow() {
                            // Not acked: redelivered to whoever consumes next.
                            return Ok(());
                        }
                        tokio::time::sleep(delay).await;
                    }
                    verdict => break verdict,
                }
            },
        };
        match verdict {
            Verdict::Folded(outcome) => {
                match outcome {
                    FoldOutcome::Superseded => {
                        metrics::counter!("relay_consumer_superseded_total").increment(1);
                    }
                    FoldOutcome::Adopted { undone, .. } => {
                        let message = delivery
                            .properties
                            .message_id()
                            .as_ref()
                            .map(|id| id.to_string());
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
            Verdict::DeadLetter(why, reason) => {
                // Logged without the body: a payload never reaches a log line.
                tracing::error!(partition, reason = %reason, bytes = delivery.data.len(), "dead-lettering a message");
                let label = why.label();
                self.dead_letter(session, &delivery, &reason).await?;
                if let Some(offset) = offset {
                    self.save_offset_alone(offset).await?;
                }
                metrics::counter!("relay_consumer_dead_letters_total", "reason" => label)
                    .increment(1);
                self.record(|stats| stats.rejected += 1);
            }
            Verdict::Retry(_) => unreachable!("retries loop above"),
        }
        // Invariant: acked only after the fold committed (or the dead letter was confirmed).
        within("basic.ack", limit, delivery.ack(BasicAckOptions::default())).await?;
        if let (Some(cursor), Some(offset)) = (&mut self.stream, offset) {
            cursor.expected = Some(offset + 1);
        }
        Ok(())
    }

    /// Stores a stream offset past a dead-lettered message (its dead letter is confirmed), in
    /// a transaction of its own; a failure ends the session, and the message is dead-lettered
    /// again after the reconnect (a duplicate in the dead-letter queue, never a loss).
    async fn save_offset_alone(&self, offset: u64) -> Result<(), Error> {
        let Some(cursor) = &self.stream else {
            return Ok(());
        };
        let mut conn = self.pool.acquire().await.map_err(store::Error::from)?;
        store::save_stream_offset(&mut conn, &cursor.queue, offset + 1).await?;
        Ok(())
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

    async fn fold(&mut self, event: &OutboxEvent, offset: Option<u64>) -> Verdict {
        let limit = self.config.fold_timeout;
        tokio::time::timeout(limit, self.fold_once(event, offset))
            .await
            .unwrap_or_else(|_| Verdict::Retry(format!("database: no answer within {limit:?}")))
    }

    async fn fold_once(&mut self, event: &OutboxEvent, offset: Option<u64>) -> Verdict {
        // Should this connection vanish mid-fold (a network losing it without a reset),
        // PostgreSQL ends the orphaned transaction after the same limit and releases the
        // branch's cursor lock; else every retry would wait on that lock until the server
        // noticed the dead client (hours, with default TCP keepalives).
        let idle_ms = self.config.fold_timeout.as_millis().max(1);
        let begin = format!("BEGIN; SET LOCAL idle_in_transaction_session_timeout = {idle_ms}");
        let mut tx = match self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await {
            Ok(tx) => tx,
            Err(err) => return Verdict::Retry(format!("database: {err}")),
        };
        let mut projection = Subscribed {
            inner: &mut self.projection,
            types: self.config.event_types.as_ref(),
        };
        let folded = store::fold(&mut tx, event, &mut projection).await;
        match verdict(folded, P::is_permanent) {
            Verdict::Folded(outcome) => {
                // On a stream, where to resume is part of what this transaction commits.
                if let (Some(cursor), Some(offset)) = (&self.stream, offset)
                    && let Err(err) =
                        store::save_stream_offset(&mut tx, &cursor.queue, offset + 1).await
                {
                    return Verdict::Retry(format!("database: {err}"));
                }
                match tx.commit().await {
                    Ok(()) => Verdict::Folded(outcome),
                    Err(err) => Verdict::Retry(format!("commit: {err}")),
                }
            }
            refused => refused,
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
                    .filter(|(name, _)| !broker::BROKER_HEADERS.contains(&name.as_str()))
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

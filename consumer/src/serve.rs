//! One partition's loop: subscribe, fold each batch of deliveries in its transaction,
//! dead-letter what is refused, ack, reconnect.
use futures_util::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Confirmation};
use sqlx::PgPool;
use store::Projection;
use tokio::sync::watch;

use broker::{Backoff, Error, Partition};

use rabbit::{QueueType, open, within};

use crate::settle::{Folder, Incoming, Transport};
use crate::stream::{StreamStep, delivery_offset, stream_step, subscribe_at};
use crate::{ConsumerConfig, DEAD_LETTER_REASON};

/// One partition's loop.
pub(crate) struct Serve<P> {
    pub(crate) config: ConsumerConfig,
    pub(crate) pool: PgPool,
    pub(crate) partition: Partition,
    /// The partition's fold.
    pub(crate) folder: Folder<P>,
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
                    self.folder.record(|stats| stats.reconnects += 1);
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
                        self.folder.record(|stats| stats.resubscribes += 1);
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
            let transport = RabbitTransport {
                session: &session,
                rabbit: &self.config.rabbit,
            };
            let key = self.stream.as_ref().map(|cursor| cursor.queue.clone());
            let settled = self
                .folder
                .settle(&transport, batch, key.as_deref(), stop)
                .await?;
            if let (Some(cursor), Some(offset)) = (&mut self.stream, settled) {
                cursor.expected = Some(offset + 1);
            }
            if let Some(err) = ended {
                return Err(err);
            }
        }
    }

    /// A delivery as a batch takes it: on a stream, checked against the offset expected next
    /// (`expected`, moved past it); a stream that lost messages to retention ends the session.
    fn admit(
        &self,
        delivery: Delivery,
        expected: &mut Option<u64>,
    ) -> Result<Incoming<Delivery>, Error> {
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
                        self.folder.record(|stats| stats.gaps += 1);
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
}

/// RabbitMQ as the fold's transport: dead letters published on the session's confirming
/// channel to the group's dead-letter queue, a batch acked with one `multiple` ack.
struct RabbitTransport<'a> {
    session: &'a Session,
    rabbit: &'a rabbit::RabbitConfig,
}

impl Transport for RabbitTransport<'_> {
    type Delivery = Delivery;

    fn bytes(delivery: &Delivery) -> usize {
        delivery.data.len()
    }

    fn message_id(delivery: &Delivery) -> Option<String> {
        delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
    }

    async fn ack_through(&self, last: &Delivery) -> Result<(), Error> {
        within(
            "basic.ack",
            self.rabbit.connect_timeout,
            last.ack(BasicAckOptions { multiple: true }),
        )
        .await?;
        Ok(())
    }

    async fn dead_letter(&self, delivery: &Delivery, reason: &str) -> Result<(), Error> {
        let rabbit = self.rabbit;
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
            self.session.dead.basic_publish(
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

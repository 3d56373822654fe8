//! One partition's loop on RabbitMQ: subscribe, fold each batch of deliveries in its
//! transaction, dead-letter what is refused, ack, reconnect. What it asks of the broker goes
//! through `rabbit::RabbitReading`; this decides when.
use futures_util::FutureExt;
use sqlx::PgPool;
use store::Projection;
use tokio::sync::watch;

use broker::{Backoff, Error, Partition};

use rabbit::{QueueType, RabbitDelivery, RabbitReading};

use crate::config::ConsumerConfig;
use crate::settle::{Folder, Incoming, Transport};
use crate::stream::{StreamStep, stream_step, subscribe_at};

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

impl<P> Serve<P>
where
    P: Projection + Clone + Sync + 'static,
{
    pub(crate) async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(self.config.retry);
        while !*stop.borrow() {
            match self.session(&mut stop, &mut backoff).await {
                Ok(()) => return,
                Err(err) => {
                    if !self
                        .folder
                        .after_failure(&err, &mut backoff, &mut stop)
                        .await
                    {
                        return;
                    }
                }
            }
        }
    }

    /// `partition`'s subscription on `reading`, on a stream at the offset expected next (or
    /// the group's start); `None` when a subscription made `again` after a silence must not
    /// be made (see [`subscribe_at`]).
    async fn subscribe(
        &self,
        reading: &mut RabbitReading,
        again: bool,
    ) -> Result<Option<rabbit::Deliveries>, Error> {
        let at = match &self.stream {
            None => None,
            Some(cursor) => {
                let Some(at) = subscribe_at(cursor.expected, self.config.stream_start, again)
                else {
                    return Ok(None);
                };
                Some(at)
            }
        };
        Ok(Some(reading.subscribe(self.partition, at, again).await?))
    }

    /// One connection's life: consume until stopped (`Ok`) or a failure (`Err`, reconnect).
    async fn session(
        &mut self,
        stop: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
    ) -> Result<(), Error> {
        let mut reading = RabbitReading::open(&self.config.rabbit, self.config.prefetch).await?;
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
            .subscribe(&mut reading, false)
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
                    if let Some(fresh) = self.subscribe(&mut reading, true).await? {
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
            // A batch: this delivery and what else the broker has pushed ahead (up to the
            // batch's bounds, after waiting at most its linger). Whatever ends the session
            // on the way ends it after the batch taken so far is folded and acked.
            let mut expected = self.stream.as_ref().and_then(|cursor| cursor.expected);
            let mut batch = vec![self.admit(delivery, &mut expected)?];
            let mut bytes = batch[0].delivery.bytes();
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
                    Some(Err(err)) => Err(err),
                    None => Err(Error::Unreachable(
                        "the broker cancelled the consumer".into(),
                    )),
                };
                match admitted {
                    Ok(incoming) => {
                        bytes += incoming.delivery.bytes();
                        batch.push(incoming);
                    }
                    Err(err) => {
                        ended = Some(err);
                        break;
                    }
                }
            }
            let transport = RabbitTransport(&reading);
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
        delivery: RabbitDelivery,
        expected: &mut Option<u64>,
    ) -> Result<Incoming<RabbitDelivery>, Error> {
        let offset = match &self.stream {
            None => None,
            Some(cursor) => {
                let Some(offset) = delivery.stream_offset() else {
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
        let event = delivery.decode();
        Ok(Incoming {
            delivery,
            offset,
            event: Some(event),
        })
    }
}

/// RabbitMQ as the fold's transport: dead letters published on the session's confirming
/// channel to the group's dead-letter queue, a batch acked with one `multiple` ack.
struct RabbitTransport<'a>(&'a RabbitReading);

impl Transport for RabbitTransport<'_> {
    type Delivery = RabbitDelivery;

    fn bytes(delivery: &RabbitDelivery) -> usize {
        delivery.bytes()
    }

    fn message_id(delivery: &RabbitDelivery) -> Option<String> {
        delivery.message_id()
    }

    async fn ack_through(&self, last: &RabbitDelivery) -> Result<(), Error> {
        self.0.ack_through(last).await
    }

    async fn dead_letter(&self, delivery: &RabbitDelivery, reason: &str) -> Result<(), Error> {
        self.0.dead_letter(delivery, reason).await
    }
}

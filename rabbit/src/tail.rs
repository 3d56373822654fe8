//! Watching events arrive (`distribution tail`): a queue of the watcher's own, exclusive and
//! deleted with its connection, bound to the topology's exchange beside the consumers' queues,
//! read without acks. It takes nothing from any consumer (each bound queue gets its own copy)
//! and never holds the relay back: it keeps at most `capacity` messages and drops its oldest
//! beyond that (`x-overflow: drop-head`), so a slow terminal neither fills the broker nor makes
//! it refuse a publish (`reject-publish` would nack the relay's).
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use store::OutboxEvent;

use broker::{Error, TailFilter, WireError};

use crate::rabbit::{RabbitConfig, within};

/// One message the tail saw.
#[derive(Debug)]
pub struct Tailed {
    /// The partition's routing key it was published with (`p<N>`).
    pub routing_key: String,
    /// Its `message_id` (`tenant/run/branch/lsn`), if it has one.
    pub message_id: Option<String>,
    /// The event it carries, or why it is not one.
    pub event: Result<OutboxEvent, WireError>,
    /// The message's headers, as delivered.
    pub headers: FieldTable,
    /// The body, as delivered.
    pub body: Vec<u8>,
}

impl Tailed {
    /// What it carries: `intent`, `rewind`, `end`, or `not an event`.
    pub fn kind(&self) -> &'static str {
        crate::dead::event_kind(&self.event)
    }

    /// When it was written and the properties its metadata travelled in, those it has.
    pub fn properties(&self) -> Vec<(&'static str, String)> {
        crate::dead::event_properties(&self.event)
    }

    /// Its headers as a person reads them.
    pub fn header_texts(&self) -> Vec<(String, String)> {
        crate::dead::header_texts(&self.headers)
    }
}

/// A watcher's queue on the topology's exchange.
#[derive(Debug)]
pub struct Tail {
    // Held for the queue's life: the exclusive queue goes with the connection.
    _connection: crate::connect::ClosingConnection,
    deliveries: lapin::Consumer,
    filter: TailFilter,
    queue: String,
}

impl Tail {
    /// Declares the watcher's queue (server-named, exclusive, auto-deleted, at most `capacity`
    /// messages, the oldest dropped beyond), binds it to the exchange for the filter's
    /// partitions and starts reading. The exchange must exist (a relay or consumer declared the
    /// topology): a tail declares nothing else.
    pub async fn open(
        config: &RabbitConfig,
        filter: TailFilter,
        capacity: u32,
    ) -> Result<Self, Error> {
        let limit = config.connect_timeout;
        let mut connection = config.connect_named("outbox-relay-tail").await?;
        let channel = within("channel.open", limit, connection.create_channel()).await?;
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-max-length".into(),
            AMQPValue::LongLongInt(i64::from(capacity.max(1))),
        );
        arguments.insert(
            "x-overflow".into(),
            AMQPValue::LongString("drop-head".into()),
        );
        let declared = within(
            "queue.declare",
            limit,
            channel.queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                arguments,
            ),
        )
        .await?;
        let queue = declared.name().clone();
        for partition in filter.partitions(config.topology.partitions()) {
            within(
                "queue.bind",
                limit,
                channel.queue_bind(
                    queue.clone(),
                    config.topology.exchange().clone(),
                    config.topology.routing_key(partition),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                ),
            )
            .await?;
        }
        let deliveries = within(
            "basic.consume",
            limit,
            channel.basic_consume(
                queue.clone(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    exclusive: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            ),
        )
        .await?;
        connection.hold("channel", channel.clone());
        connection.hold("deliveries", deliveries.clone());
        Ok(Self {
            _connection: connection,
            deliveries,
            filter,
            queue: queue.to_string(),
        })
    }

    /// The watcher's queue (server-named).
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The next message the filter takes; `None` when the broker ended the subscription.
    pub async fn next(&mut self) -> Result<Option<Tailed>, Error> {
        while let Some(delivery) = self.deliveries.next().await {
            let delivery = delivery.map_err(crate::connect::amqp_error)?;
            let event = crate::wire::decode(&delivery.properties, &delivery.data);
            if !self.filter.matches(&event) {
                continue;
            }
            return Ok(Some(Tailed {
                routing_key: delivery.routing_key.to_string(),
                message_id: delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.to_string()),
                event,
                headers: delivery.properties.headers().clone().unwrap_or_default(),
                body: delivery.data,
            }));
        }
        Ok(None)
    }
}

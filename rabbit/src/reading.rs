//! Reading a topology's partition queues, for a consumer: a session (a connection, a channel
//! with the consumer's prefetch, a confirming channel for dead letters), subscriptions (on a
//! stream at an offset), deliveries as the contract's events, a batch acked at once, dead
//! letters confirmed. The consumer's loop (`consumer::serve`) decides; this carries out.
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Confirmation};
use store::OutboxEvent;

use broker::{DEAD_LETTER_REASON, Error, Partition, WireError};

use crate::connect::ClosingConnection;
use crate::dead::BROKER_HEADERS;
use crate::rabbit::{RabbitConfig, open, within};

/// Where a stream subscription starts (`x-stream-offset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamOffset {
    /// The first retained message.
    First,
    /// The next message published.
    Next,
    /// The first chunk published at or after this Unix time, in seconds.
    Timestamp(u64),
    /// This offset.
    Offset(u64),
}

impl StreamOffset {
    /// `basic.consume`'s `x-stream-offset` argument.
    fn argument(self) -> AMQPValue {
        match self {
            StreamOffset::First => AMQPValue::LongString("first".into()),
            StreamOffset::Next => AMQPValue::LongString("next".into()),
            StreamOffset::Timestamp(secs) => AMQPValue::Timestamp(secs),
            StreamOffset::Offset(offset) => {
                AMQPValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX))
            }
        }
    }
}

/// One delivery of a partition queue.
#[derive(Debug)]
pub struct RabbitDelivery(Delivery);

impl RabbitDelivery {
    /// On a stream, its offset (header `x-stream-offset`).
    pub fn stream_offset(&self) -> Option<u64> {
        let headers = self.0.properties.headers().as_ref()?;
        match headers.inner().get("x-stream-offset")? {
            AMQPValue::LongLongInt(offset) => u64::try_from(*offset).ok(),
            AMQPValue::LongUInt(offset) => Some(u64::from(*offset)),
            AMQPValue::LongInt(offset) => u64::try_from(*offset).ok(),
            _ => None,
        }
    }

    /// Its `message_id`.
    pub fn message_id(&self) -> Option<String> {
        self.0
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
    }

    /// Its body's length.
    pub fn bytes(&self) -> usize {
        self.0.data.len()
    }

    /// The event it carries, or why it is not one.
    pub fn decode(&self) -> Result<OutboxEvent, WireError> {
        crate::wire::decode(&self.0.properties, &self.0.data)
    }
}

/// A subscription's deliveries, in the order the broker pushes them.
#[derive(Debug)]
pub struct Deliveries(lapin::Consumer);

impl Deliveries {
    /// The next delivery; `None` once the broker cancelled the subscription.
    pub async fn next(&mut self) -> Option<Result<RabbitDelivery, Error>> {
        Some(
            self.0
                .next()
                .await?
                .map(RabbitDelivery)
                .map_err(Error::channel),
        )
    }
}

/// A consumer's session on a topology's queues.
#[derive(Debug)]
pub struct RabbitReading {
    config: RabbitConfig,
    prefetch: u16,
    connection: ClosingConnection,
    channel: Channel,
    /// A confirming channel for dead letters: a message is acked only once its dead letter is
    /// confirmed.
    dead: Channel,
}

impl RabbitReading {
    /// Connects, with `prefetch` deliveries pushed ahead per subscription.
    pub async fn open(config: &RabbitConfig, prefetch: u16) -> Result<Self, Error> {
        let limit = config.connect_timeout;
        let (mut connection, channel) = open(config, "outbox-consumer").await?;
        within(
            "basic.qos",
            limit,
            channel.basic_qos(prefetch, BasicQosOptions::default()),
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
        Ok(Self {
            config: config.clone(),
            prefetch,
            connection,
            channel,
            dead,
        })
    }

    /// `basic.consume` on `partition`'s queue, on a stream at `at`. `again`: a subscription
    /// made again after a silence, on a fresh channel (whose prefetch is free; the old one's
    /// unacked deliveries are read again from where the consumer asks).
    pub async fn subscribe(
        &mut self,
        partition: Partition,
        at: Option<StreamOffset>,
        again: bool,
    ) -> Result<Deliveries, Error> {
        let limit = self.config.connect_timeout;
        let queue = self.config.topology.queue(partition);
        let mut arguments = FieldTable::default();
        if let Some(at) = at {
            arguments.insert("x-stream-offset".into(), at.argument());
        }
        if again {
            let fresh = within("channel.open", limit, self.connection.create_channel()).await?;
            within(
                "basic.qos",
                limit,
                fresh.basic_qos(self.prefetch, BasicQosOptions::default()),
            )
            .await?;
            let old = std::mem::replace(&mut self.channel, fresh.clone());
            within(
                "channel.close",
                limit,
                old.close(200, "subscribing again".into()),
            )
            .await?;
            self.connection.hold("channel", fresh);
        }
        let deliveries = within(
            "basic.consume",
            limit,
            self.channel
                .basic_consume(queue, "".into(), BasicConsumeOptions::default(), arguments),
        )
        .await?;
        // Held until the connection has closed (see `ClosingConnection`).
        self.connection.hold("deliveries", deliveries.clone());
        Ok(Deliveries(deliveries))
    }

    /// Acks every delivery of the subscription's channel up to `last`, at once.
    pub async fn ack_through(&self, last: &RabbitDelivery) -> Result<(), Error> {
        within(
            "basic.ack",
            self.config.connect_timeout,
            last.0.ack(BasicAckOptions { multiple: true }),
        )
        .await?;
        Ok(())
    }

    /// Publishes `delivery` to the group's dead-letter queue with `reason` in
    /// [`DEAD_LETTER_REASON`] (the broker's own delivery headers left out) and returns once the
    /// broker confirmed it.
    pub async fn dead_letter(&self, delivery: &RabbitDelivery, reason: &str) -> Result<(), Error> {
        let delivery = &delivery.0;
        let mut headers: FieldTable = delivery
            .properties
            .headers()
            .as_ref()
            .map(|headers| {
                headers
                    .inner()
                    .iter()
                    .filter(|(name, _)| !BROKER_HEADERS.contains(&name.as_str()))
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
            self.config.connect_timeout,
            self.dead.basic_publish(
                "".into(),
                self.config.topology.dead_letter_queue(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                properties,
            ),
        )
        .await?;
        match within("dead-letter confirm", self.config.confirm_timeout, confirm).await? {
            Confirmation::Ack(None) => Ok(()),
            other => Err(Error::Unreachable(format!(
                "the dead-letter queue did not take the message: {other:?}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each start is the `x-stream-offset` RabbitMQ reads.
    #[test]
    fn each_stream_offset_is_the_argument_rabbitmq_reads() {
        assert_eq!(
            StreamOffset::First.argument(),
            AMQPValue::LongString("first".into())
        );
        assert_eq!(
            StreamOffset::Next.argument(),
            AMQPValue::LongString("next".into())
        );
        assert_eq!(
            StreamOffset::Timestamp(1_700_000_000).argument(),
            AMQPValue::Timestamp(1_700_000_000)
        );
        assert_eq!(
            StreamOffset::Offset(42).argument(),
            AMQPValue::LongLongInt(42)
        );
        assert_eq!(
            StreamOffset::Offset(u64::MAX).argument(),
            AMQPValue::LongLongInt(i64::MAX)
        );
    }
}

//! The dead-letter queue (`<topology>.dead`), read back: list and show what a consumer could not
//! fold, replay it into its partition (through the fold's rules again, in its original order),
//! or purge it. `distribution dead` is the command line over this.
//!
//! Every operation takes messages with `basic.get` on a channel of its own and never acks one it
//! does not act on: when the channel closes, the broker puts every unacked message back where it
//! was, so a listing (or an operation that stops half-way) changes nothing else. A replayed
//! message is acked in the dead-letter queue only after its partition's queue confirmed it, so
//! a crash between the two leaves it in both (a duplicate, which the fold ignores), never in
//! neither.
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation};
use store::OutboxEvent;

use broker::{Error, WireError};

use crate::rabbit::{RabbitConfig, within};

pub use broker::DEAD_LETTER_REASON;

/// Headers RabbitMQ adds when it dead-letters or delivers a message (`x-death`, the delivery
/// count, a stream offset): not the message's own, so a dead letter or a replay leaves them out.
pub const BROKER_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-delivery-count",
    "x-stream-offset",
];

/// One message of the dead-letter queue.
#[derive(Debug)]
pub struct DeadLetter {
    /// Its position in the queue, from 1 (at the time it was read).
    pub position: u64,
    /// Its `message_id` (`tenant/run/branch/lsn`), if it has one.
    pub message_id: Option<String>,
    /// Why it was dead-lettered: the consumer's `x-relay-dead-letter-reason`, else the
    /// broker's `x-first-death-reason` (`broker: delivery_limit ...`).
    pub reason: Option<String>,
    /// The event it carries, or why it is not one (a message that broke the contract).
    pub event: Result<OutboxEvent, WireError>,
    /// The message's headers, as delivered.
    pub headers: FieldTable,
    /// The body, as delivered.
    pub body: Vec<u8>,
}

pub use broker::DeadFilter;

impl DeadLetter {
    /// Its headers as a person reads them ([`header_texts`]).
    pub fn header_texts(&self) -> Vec<(String, String)> {
        header_texts(&self.headers)
    }

    /// What a person looks for first ([`event_properties`]).
    pub fn properties(&self) -> Vec<(&'static str, String)> {
        event_properties(&self.event)
    }

    /// What it carries: `intent`, `rewind`, `end`, or `not an event`.
    pub fn kind(&self) -> &'static str {
        event_kind(&self.event)
    }
}

impl From<DeadLetter> for broker::DeadLetterView {
    fn from(letter: DeadLetter) -> Self {
        Self {
            position: letter.position,
            headers: letter.header_texts(),
            message_id: letter.message_id,
            reason: letter.reason,
            event: letter.event,
            body: letter.body,
        }
    }
}

/// Headers as a person reads them, in order: strings as text (invalid UTF-8 replaced),
/// numbers and booleans as such, anything else (tables, arrays) as lapin shows it.
pub(crate) fn header_texts(headers: &FieldTable) -> Vec<(String, String)> {
    headers
        .inner()
        .iter()
        .map(|(name, value)| (name.to_string(), header_text(value)))
        .collect()
}

pub(crate) use broker::{event_kind, event_properties};

/// One header value as text.
fn header_text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(text) => String::from_utf8_lossy(text.as_bytes()).into_owned(),
        AMQPValue::ShortString(text) => text.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Timestamp(n) => n.to_string(),
        AMQPValue::Float(n) => n.to_string(),
        AMQPValue::Double(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// A session on the dead-letter queue of a topology.
#[derive(Debug)]
pub struct DeadLetters {
    config: RabbitConfig,
    connection: crate::connect::ClosingConnection,
}

/// Closes `channel` politely, but gives up after the connect timeout: a node that went away
/// mid-close would otherwise hold the caller (and whoever waits for it to stop) for ever.
async fn close_within(config: &RabbitConfig, channel: &Channel, why: &str) {
    let _ = tokio::time::timeout(config.connect_timeout, channel.close(200, why.into())).await;
}

impl DeadLetters {
    /// Connects (under the config's timeouts, TLS as configured). Declares nothing: the queue
    /// must exist (a consumer or the relay declared the topology).
    pub async fn open(config: &RabbitConfig) -> Result<Self, Error> {
        let connection = config.connect_named("outbox-relay-dead").await?;
        Ok(Self {
            config: config.clone(),
            connection,
        })
    }

    async fn channel(&self) -> Result<Channel, Error> {
        within(
            "channel.open",
            self.config.connect_timeout,
            self.connection.create_channel(),
        )
        .await
    }

    /// How many messages the dead-letter queue holds (ready, not counting any a client holds).
    pub async fn depth(&self) -> Result<u32, Error> {
        let channel = self.channel().await?;
        let queue = within(
            "queue.declare",
            self.config.connect_timeout,
            channel.queue_declare(
                self.config.topology.dead_letter_queue(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            ),
        )
        .await?;
        close_within(&self.config, &channel, "done").await;
        Ok(queue.message_count())
    }

    /// Waits until the queue holds `ready` messages again (or more: letters keep arriving),
    /// at most the connect timeout: a quorum queue takes back what a closed channel held
    /// through its log, after the close is answered, so a read straight after another could
    /// miss the letters the first gave back (seen: `find` after `list` found nothing). Every
    /// operation returns once what it gave back is readable again.
    async fn settle(&self, ready: u64) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + self.config.connect_timeout;
        while u64::from(self.depth().await?) < ready && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// The first `limit` dead letters, in queue order; nothing is removed.
    pub async fn list(&self, limit: u64) -> Result<Vec<DeadLetter>, Error> {
        let held = u64::from(self.depth().await?);
        let channel = self.channel().await?;
        let mut letters = Vec::new();
        while (letters.len() as u64) < limit {
            let Some((letter, _)) = self.next(&channel, letters.len() as u64 + 1).await? else {
                break;
            };
            letters.push(letter);
        }
        // Closing the channel puts every message read back, in place.
        close_within(&self.config, &channel, "listed").await;
        self.settle(held).await?;
        Ok(letters)
    }

    /// The first dead letter with `message_id`, scanning the queue once and keeping only it in
    /// memory; nothing is removed.
    pub async fn find(&self, message_id: &str) -> Result<Option<DeadLetter>, Error> {
        let held = u64::from(self.depth().await?);
        let channel = self.channel().await?;
        let mut found = None;
        for position in 1..=held {
            let Some((letter, _)) = self.next(&channel, position).await? else {
                break;
            };
            if letter.message_id.as_deref() == Some(message_id) {
                found = Some(letter);
                break;
            }
        }
        close_within(&self.config, &channel, "found").await;
        self.settle(held).await?;
        Ok(found)
    }

    /// Publishes every dead letter `filter` takes back to its partition's queue, in queue order
    /// (the order it was dead-lettered), without the dead-letter reason; each is removed from
    /// the dead-letter queue once its partition confirmed it. The consumer then folds it again:
    /// duplicates are ignored, held-back successors released, as for any delivery. Returns how
    /// many were replayed. A message that is not an event cannot be routed and is left.
    pub async fn replay(&self, filter: &DeadFilter) -> Result<u64, Error> {
        let publish = self.channel().await?;
        within(
            "confirm.select",
            self.config.connect_timeout,
            publish.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        let replayed = self.take(filter, Some(&publish)).await?;
        close_within(&self.config, &publish, "replayed").await;
        Ok(replayed)
    }

    /// Removes every dead letter `filter` takes, for good. Returns how many.
    pub async fn purge(&self, filter: &DeadFilter) -> Result<u64, Error> {
        self.take(filter, None).await
    }

    /// Publishes `letter` back to its partition's queue on `publish` (a confirming channel)
    /// with `properties`; `false` if it is not an event (it cannot be routed).
    async fn republish(
        &self,
        publish: &Channel,
        letter: &DeadLetter,
        properties: BasicProperties,
    ) -> Result<bool, Error> {
        let Ok(event) = &letter.event else {
            return Ok(false);
        };
        let topology = &self.config.topology;
        let partition = topology.partition_of(&event.key.branch.tenant, &event.key.branch.run);
        let confirm = within(
            "basic.publish",
            self.config.connect_timeout,
            // Straight to this group's queue of the partition (the default exchange): other
            // consumer groups folded the message already.
            publish.basic_publish(
                "".into(),
                topology.queue(partition),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &letter.body,
                properties,
            ),
        )
        .await?;
        match within("publish confirm", self.config.confirm_timeout, confirm).await? {
            Confirmation::Ack(None) => Ok(true),
            other => Err(Error::Unreachable(format!(
                "the partition queue did not take the replayed message: {other:?}"
            ))),
        }
    }

    /// Reads the whole queue once (as many messages as it held when this started); each
    /// message `filter` takes is republished on `replay` (if given) with its properties minus
    /// the dead-letter reason, and acked (removed) once republished, or at once without
    /// `replay`; every other message goes back in place when the channel closes. (A plain
    /// option, not a closure: a closure over `&DeadLetter` makes the future not `Send` for a
    /// web handler.)
    async fn take(&self, filter: &DeadFilter, replay: Option<&Channel>) -> Result<u64, Error> {
        let held = u64::from(self.depth().await?);
        let channel = self.channel().await?;
        let mut taken = 0;
        for position in 1..=held {
            let Some((letter, delivery)) = self.next(&channel, position).await? else {
                break;
            };
            if !filter.takes(letter.message_id.as_deref(), &letter.event) {
                continue;
            }
            let mut headers = letter.headers.inner().clone();
            // What the consumer or the broker added when it dead-lettered the message.
            headers.retain(|name, _| !BROKER_HEADERS.contains(&name.as_str()));
            headers.remove(DEAD_LETTER_REASON);
            let headers = FieldTable::from(headers);
            let properties = delivery.properties.clone().with_headers(headers);
            let remove = match replay {
                Some(publish) => self.republish(publish, &letter, properties).await?,
                None => true,
            };
            if remove {
                within(
                    "basic.ack",
                    self.config.connect_timeout,
                    delivery.ack(BasicAckOptions::default()),
                )
                .await?;
                taken += 1;
            }
        }
        close_within(&self.config, &channel, "done").await;
        self.settle(held.saturating_sub(taken)).await?;
        Ok(taken)
    }

    async fn next(
        &self,
        channel: &Channel,
        position: u64,
    ) -> Result<Option<(DeadLetter, lapin::message::Delivery)>, Error> {
        let got = within(
            "basic.get",
            self.config.connect_timeout,
            channel.basic_get(
                self.config.topology.dead_letter_queue(),
                BasicGetOptions { no_ack: false },
            ),
        )
        .await?;
        let Some(got) = got else {
            return Ok(None);
        };
        let delivery = got.delivery;
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let text = |name: &str| match headers.inner().get(name) {
            Some(AMQPValue::LongString(text)) => {
                Some(String::from_utf8_lossy(text.as_bytes()).into_owned())
            }
            _ => None,
        };
        // The consumer's reason, else the broker's (a quorum queue past its delivery limit).
        let reason = text(DEAD_LETTER_REASON).or_else(|| {
            text("x-first-death-reason").map(|why| match why.as_str() {
                "delivery_limit" => "broker: delivery_limit (redelivered past the queue's \
                                     delivery limit: a consumer kept failing on it)"
                    .to_owned(),
                other => format!("broker: {other}"),
            })
        });
        let letter = DeadLetter {
            position,
            message_id: delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.to_string()),
            reason,
            event: crate::wire::decode(&delivery.properties, &delivery.data),
            headers,
            body: delivery.data.clone(),
        };
        Ok(Some((letter, delivery)))
    }
}

//! Where events go on RabbitMQ: one durable direct exchange, one durable queue per partition
//! and group (the partition map itself is `broker::partition_of`).
use broker::{Error, Group, Partition, partition_of};
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};

use crate::connect::Amqp;
use store::{RunId, TenantId};

/// The kind of RabbitMQ queue the topology declares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum QueueType {
    /// A classic queue (declared without `x-queue-type`, as earlier versions did).
    #[default]
    Classic,
    /// A quorum queue (`x-queue-type: quorum`): replicated across a RabbitMQ cluster. A
    /// message redelivered more than [`Topology::with_delivery_limit`] times (a consumer that
    /// crashes on it over and over) is dead-lettered by the broker to the group's dead-letter
    /// queue (at-least-once), never dropped.
    Quorum,
    /// A stream (`x-queue-type: stream`): a replicated, append-only log that consumers read
    /// from an offset they keep themselves (in the fold's database), so a group can replay
    /// history. Kept as [`StreamRetention`] says. Dead-letter queues are quorum queues.
    Stream,
}

/// How much history a stream partition keeps. RabbitMQ removes whole segments, oldest first,
/// when a segment fills: what is kept is at least the limits (the newest segment always stays).
/// `None` everywhere (the default): a stream keeps everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamRetention {
    /// `x-max-age`: a number and a unit of `Y M D h m s`, e.g. `7D` or `12h`.
    pub max_age: Option<String>,
    /// `x-max-length-bytes`: the most bytes a partition keeps.
    pub max_bytes: Option<u64>,
    /// `x-stream-max-segment-size-bytes`: the unit retention removes (RabbitMQ's default is
    /// 500 MB).
    pub segment_bytes: Option<u64>,
}

impl StreamRetention {
    /// Refuses a `max_age` RabbitMQ would not take, and zero sizes.
    pub fn validate(&self) -> Result<(), Error> {
        if let Some(age) = &self.max_age {
            let (digits, unit) = age.split_at(age.len().saturating_sub(1));
            let number_ok = !digits.is_empty()
                && digits.len() <= 9
                && digits.bytes().all(|b| b.is_ascii_digit())
                && digits.bytes().any(|b| b != b'0');
            if !number_ok || !matches!(unit, "Y" | "M" | "D" | "h" | "m" | "s") {
                return Err(Error::InvalidConfig(format!(
                    "stream max age {age:?} must be a positive number and one of Y M D h m s \
                     (e.g. 7D)"
                )));
            }
        }
        if self.max_bytes == Some(0) || self.segment_bytes == Some(0) {
            return Err(Error::InvalidConfig(
                "stream max bytes and segment bytes must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn arguments(&self, arguments: &mut FieldTable) {
        if let Some(age) = &self.max_age {
            arguments.insert(
                "x-max-age".into(),
                AMQPValue::LongString(age.as_str().into()),
            );
        }
        if let Some(bytes) = self.max_bytes {
            arguments.insert(
                "x-max-length-bytes".into(),
                AMQPValue::LongLongInt(i64::try_from(bytes).unwrap_or(i64::MAX)),
            );
        }
        if let Some(bytes) = self.segment_bytes {
            arguments.insert(
                "x-stream-max-segment-size-bytes".into(),
                AMQPValue::LongLongInt(i64::try_from(bytes).unwrap_or(i64::MAX)),
            );
        }
    }
}

/// Redeliveries of one message a quorum queue allows before it dead-letters it (RabbitMQ 4's
/// default, declared explicitly so that every version behaves the same).
pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

/// The delivery limit of every quorum dead-letter queue: `i32::MAX`, declared explicitly.
/// Without one, RabbitMQ 4.0 applies its default of 20 to a queue that has no dead-letter
/// target, so a letter read 20 times (by `distribution dead list`, `show`, `replay` or `purge`
/// with a filter, which return what they do not act on) is dropped: every return counts on
/// 4.0.5, a closed channel's included. `-1`, which 4.x reads as "no limit", means 0 on 3.x (the
/// letter is dropped on its first return; both seen on 3.10.8 and 4.0.5), so no value but a
/// large one behaves the same on every version and through an upgrade.
pub const DEAD_LETTER_DELIVERY_LIMIT: i64 = i32::MAX as i64;

/// Names and shape of the broker topology.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    exchange: ShortString,
    partitions: u16,
    queue_type: QueueType,
    stream: StreamRetention,
    delivery_limit: u32,
    replicas: Option<u16>,
    /// The group whose queues [`Topology::queue`] and [`Topology::dead_letter_queue`] name.
    group: Group,
    /// The groups whose queues [`Topology::declare`] creates.
    declared: Vec<Group>,
}

impl Topology {
    /// A topology named `name` (the exchange; queues are `name.p<N>`) with `partitions` queues.
    pub fn new(name: &str, partitions: u16) -> Result<Self, Error> {
        if partitions == 0 {
            return Err(Error::InvalidConfig("partitions must be at least 1".into()));
        }
        if name.is_empty() || name.len() > 200 || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::InvalidConfig(format!(
                "topology name {name:?} must be 1 to 200 printable ASCII characters"
            )));
        }
        if name.starts_with("amq.") {
            return Err(Error::InvalidConfig(format!(
                "topology name {name:?} is reserved by RabbitMQ (amq.*)"
            )));
        }
        Ok(Self {
            exchange: ShortString::from(name),
            partitions,
            queue_type: QueueType::Classic,
            stream: StreamRetention::default(),
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
            replicas: None,
            group: Group::Default,
            declared: vec![Group::Default],
        })
    }

    /// The same topology read (and declared) as consumer group `group`.
    pub fn with_group(mut self, group: Group) -> Self {
        self.declared = vec![group.clone()];
        self.group = group;
        self
    }

    /// The same topology declaring the queues of exactly `groups` (the relay's
    /// `RELAY_GROUPS`; none: the exchange alone, each group's consumer declares its queues).
    pub fn declaring(mut self, groups: Vec<Group>) -> Self {
        self.declared = groups;
        self
    }

    /// The group this topology reads.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// The groups whose queues [`Topology::declare`] creates.
    pub fn declared_groups(&self) -> &[Group] {
        &self.declared
    }

    /// The same topology with queues of `queue_type`. Queues that exist with another type
    /// make the declare fail (`PRECONDITION_FAILED`): RabbitMQ cannot convert a queue.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// The type of queue declared.
    pub fn queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// The same topology whose stream partitions keep `retention` (streams only; it must
    /// pass [`StreamRetention::validate`]). Changing it on existing streams fails the declare
    /// (`PRECONDITION_FAILED`): use a RabbitMQ policy for that.
    pub fn with_stream_retention(mut self, retention: StreamRetention) -> Self {
        self.stream = retention;
        self
    }

    /// The same topology whose quorum queues dead-letter a message after `limit` redeliveries
    /// (quorum queues only; default [`DEFAULT_DELIVERY_LIMIT`]; at least 1).
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit.max(1);
        self
    }

    /// The same topology whose quorum queues and streams start with `replicas` members
    /// (`x-quorum-initial-group-size`, `x-initial-cluster-size`); `None` (the default):
    /// RabbitMQ's choice, every node of the cluster.
    pub fn with_replicas(mut self, replicas: Option<u16>) -> Self {
        self.replicas = replicas.map(|replicas| replicas.max(1));
        self
    }

    /// What a stream partition keeps.
    pub fn stream_retention(&self) -> &StreamRetention {
        &self.stream
    }

    /// The arguments of `group`'s partition queues (WIRE.md, "Declares, exactly"): what a
    /// consumer that declares them must pass.
    pub fn partition_arguments(&self, group: &Group) -> FieldTable {
        let mut arguments = FieldTable::default();
        let text = |value: &str| AMQPValue::LongString(value.into());
        match self.queue_type {
            QueueType::Classic => {}
            QueueType::Quorum => {
                arguments.insert("x-queue-type".into(), text("quorum"));
                if let Some(replicas) = self.replicas {
                    arguments.insert(
                        "x-quorum-initial-group-size".into(),
                        AMQPValue::LongLongInt(i64::from(replicas)),
                    );
                }
                arguments.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
                );
                // Past the limit, to the group's own dead-letter queue, confirmed by it
                // (at-least-once needs `reject-publish`): RabbitMQ 4 would drop it otherwise.
                arguments.insert("x-dead-letter-exchange".into(), text(""));
                arguments.insert(
                    "x-dead-letter-routing-key".into(),
                    text(self.dead_letter_queue_of(group).as_str()),
                );
                arguments.insert("x-dead-letter-strategy".into(), text("at-least-once"));
                arguments.insert("x-overflow".into(), text("reject-publish"));
            }
            QueueType::Stream => {
                arguments.insert("x-queue-type".into(), text("stream"));
                if let Some(replicas) = self.replicas {
                    arguments.insert(
                        "x-initial-cluster-size".into(),
                        AMQPValue::LongLongInt(i64::from(replicas)),
                    );
                }
                self.stream.arguments(&mut arguments);
                // No single-active-consumer: RabbitMQ 3.x takes it on streams only over the
                // stream protocol. Each consumer keeps its own offset; overlaps are safe.
                return arguments;
            }
        }
        // One active consumer per partition: a second fold instance waits as a hot standby
        // instead of interleaving a partition's deliveries.
        arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        arguments
    }

    /// The arguments of a dead-letter queue: a quorum queue unless the topology is classic
    /// (a stream cannot be taken from one message at a time), whose delivery limit no reader
    /// reaches ([`DEAD_LETTER_DELIVERY_LIMIT`]).
    pub fn dead_letter_arguments(&self) -> FieldTable {
        let mut arguments = FieldTable::default();
        if self.queue_type != QueueType::Classic {
            arguments.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
            arguments.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(DEAD_LETTER_DELIVERY_LIMIT),
            );
        }
        arguments
    }

    /// The exchange every event is published to.
    pub fn exchange(&self) -> &ShortString {
        &self.exchange
    }

    /// Number of partitions.
    pub fn partitions(&self) -> u16 {
        self.partitions
    }

    /// The partition of a run: stable, documented above.
    pub fn partition_of(&self, tenant: &TenantId, run: &RunId) -> Partition {
        partition_of(tenant, run, self.partitions)
    }

    /// The routing key of a partition (`p<N>`).
    pub fn routing_key(&self, partition: Partition) -> ShortString {
        ShortString::from(format!("p{}", partition.0))
    }

    /// The queue of a partition in this topology's group (`<name>.p<N>`, or
    /// `<name>.<group>.p<N>`).
    pub fn queue(&self, partition: Partition) -> ShortString {
        self.queue_of(&self.group, partition)
    }

    /// The queue of a partition in `group`. On streams every group reads the same partition
    /// streams (`<name>.p<N>`), each from the offset its fold database keeps: that is what
    /// lets a group created later replay the history.
    pub fn queue_of(&self, group: &Group, partition: Partition) -> ShortString {
        let group = match self.queue_type {
            QueueType::Stream => &Group::Default,
            _ => group,
        };
        ShortString::from(format!("{}p{}", self.prefix(group), partition.0))
    }

    /// The dead-letter queue of this topology's group (`<name>.dead`, or `<name>.<group>.dead`):
    /// messages a consumer could not fold, with the reason in header
    /// `x-relay-dead-letter-reason`. Published to through the default exchange.
    pub fn dead_letter_queue(&self) -> ShortString {
        self.dead_letter_queue_of(&self.group)
    }

    /// The dead-letter queue of `group`.
    pub fn dead_letter_queue_of(&self, group: &Group) -> ShortString {
        ShortString::from(format!("{}dead", self.prefix(group)))
    }

    fn prefix(&self, group: &Group) -> String {
        match group {
            Group::Default => format!("{}.", self.exchange),
            Group::Named(name) => format!("{}.{name}.", self.exchange),
        }
    }

    /// Declares the exchange and, for each declared group, its partition queues, their
    /// bindings and its dead-letter queue. Idempotent.
    pub async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                self.exchange.clone(),
                ExchangeKind::Direct,
                durable,
                FieldTable::default(),
            )
            .await
            .amqp()?;
        for group in &self.declared {
            self.declare_group(channel, group).await?;
        }
        Ok(())
    }

    /// Declares `group`'s partition queues, bound to the exchange (which must exist), and its
    /// dead-letter queue. Idempotent.
    pub async fn declare_group(&self, channel: &Channel, group: &Group) -> Result<(), Error> {
        let arguments = self.partition_arguments(group);
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        for index in 0..self.partitions {
            let partition = Partition(index);
            let queue = self.queue_of(group, partition);
            channel
                .queue_declare(queue.clone(), options, arguments.clone())
                .await
                .amqp()?;
            channel
                .queue_bind(
                    queue,
                    self.exchange.clone(),
                    self.routing_key(partition),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .amqp()?;
        }
        channel
            .queue_declare(
                self.dead_letter_queue_of(group),
                options,
                self.dead_letter_arguments(),
            )
            .await
            .amqp()?;
        Ok(())
    }

    /// Deletes every declared group's queues (as [`Topology::delete_group`]) and the exchange,
    /// with what they hold: the whole topology, for a tool that made it for itself (the demo).
    pub async fn delete(&self, channel: &Channel) -> Result<u32, Error> {
        let mut messages = 0;
        for group in &self.declared {
            messages += self.delete_group(channel, group).await?;
        }
        channel
            .exchange_delete(
                self.exchange.clone(),
                lapin::options::ExchangeDeleteOptions::default(),
            )
            .await
            .amqp()?;
        Ok(messages)
    }

    /// Deletes `group`'s partition queues and dead-letter queue, with what they hold. Other
    /// groups are untouched; a relay goes on publishing to them. On streams, whose partitions
    /// every group shares, only the group's dead-letter queue goes (its offsets live in its
    /// fold database).
    pub async fn delete_group(&self, channel: &Channel, group: &Group) -> Result<u32, Error> {
        let mut messages = 0;
        let shared = self.queue_type == QueueType::Stream;
        let queues = (0..self.partitions)
            .filter(|_| !shared)
            .map(|index| self.queue_of(group, Partition(index)))
            .chain([self.dead_letter_queue_of(group)]);
        for queue in queues {
            messages += channel
                .queue_delete(queue, lapin::options::QueueDeleteOptions::default())
                .await
                .amqp()?;
        }
        Ok(messages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The partition map is part of the wire contract: pin it so a change is a visible decision.
    #[test]
    fn partition_map_is_stable() {
        let topology = Topology::new("relay", 8).unwrap();
        let tenant = TenantId::new("acme").unwrap();
        let got: Vec<u16> = ["run-1", "run-2", "run-3", "run-4"]
            .iter()
            .map(|run| topology.partition_of(&tenant, &RunId::new(run).unwrap()).0)
            .collect();
        // Values computed independently (Python FNV-1a 64 over b"acme\0run-N", mod 8).
        assert_eq!(got, vec![4, 5, 2, 3]);
    }

    /// Each group has its own queues; the unnamed group keeps the names of earlier versions.
    #[test]
    fn groups_name_their_own_queues() {
        let topology = Topology::new("relay", 2).unwrap();
        assert_eq!(topology.queue(Partition(1)).as_str(), "relay.p1");
        assert_eq!(topology.dead_letter_queue().as_str(), "relay.dead");
        let search = topology.clone().with_group(Group::parse("search").unwrap());
        assert_eq!(search.queue(Partition(1)).as_str(), "relay.search.p1");
        assert_eq!(search.dead_letter_queue().as_str(), "relay.search.dead");
        assert_eq!(
            search.routing_key(Partition(1)),
            topology.routing_key(Partition(1))
        );
        assert_eq!(Group::parse("default").unwrap(), Group::Default);
        for bad in ["", "Search", "a.b", "dead", "p7", &"g".repeat(65)] {
            assert!(Group::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Group::parse("p").is_ok() && Group::parse("p7x").is_ok());
    }

    /// On streams every group reads the same partitions, each with its own dead-letter
    /// queue; a stream's arguments carry its retention and no single-active-consumer; a
    /// quorum queue dead-letters past its delivery limit into its own group's queue.
    #[test]
    fn stream_groups_share_partitions_and_quorum_queues_dead_letter_past_the_limit() {
        let search = Group::parse("search").unwrap();
        let streams = Topology::new("relay", 2)
            .unwrap()
            .with_queue_type(QueueType::Stream)
            .with_stream_retention(StreamRetention {
                max_age: Some("7D".into()),
                max_bytes: Some(1 << 30),
                segment_bytes: None,
            });
        assert_eq!(streams.queue_of(&search, Partition(1)).as_str(), "relay.p1");
        assert_eq!(
            streams.dead_letter_queue_of(&search).as_str(),
            "relay.search.dead"
        );
        let arguments = streams.partition_arguments(&search);
        let get = |arguments: &FieldTable, name: &str| arguments.inner().get(name).cloned();
        assert_eq!(
            get(&arguments, "x-queue-type"),
            Some(AMQPValue::LongString("stream".into()))
        );
        assert_eq!(
            get(&arguments, "x-max-age"),
            Some(AMQPValue::LongString("7D".into()))
        );
        assert_eq!(
            get(&arguments, "x-max-length-bytes"),
            Some(AMQPValue::LongLongInt(1 << 30))
        );
        assert_eq!(get(&arguments, "x-single-active-consumer"), None);
        let replicated = streams.clone().with_replicas(Some(3));
        assert_eq!(
            get(
                &replicated.partition_arguments(&search),
                "x-initial-cluster-size"
            ),
            Some(AMQPValue::LongLongInt(3))
        );
        let quorum = Topology::new("relay", 2)
            .unwrap()
            .with_queue_type(QueueType::Quorum)
            .with_delivery_limit(5);
        let arguments = quorum.partition_arguments(&search);
        assert_eq!(
            get(&arguments, "x-delivery-limit"),
            Some(AMQPValue::LongLongInt(5))
        );
        assert_eq!(
            get(&arguments, "x-dead-letter-routing-key"),
            Some(AMQPValue::LongString("relay.search.dead".into()))
        );
        assert_eq!(
            get(&arguments, "x-dead-letter-strategy"),
            Some(AMQPValue::LongString("at-least-once".into()))
        );
        assert_eq!(
            quorum.queue_of(&search, Partition(1)).as_str(),
            "relay.search.p1"
        );
        // A dead-letter queue's own limit is one no reader reaches, on quorum and streams
        // (RabbitMQ 4 would apply 20 and drop a letter read that often); classic has none.
        for topology in [&quorum, &streams] {
            assert_eq!(
                get(&topology.dead_letter_arguments(), "x-delivery-limit"),
                Some(AMQPValue::LongLongInt(i64::from(i32::MAX)))
            );
        }
        let classic = Topology::new("relay", 2).unwrap();
        assert!(classic.dead_letter_arguments().inner().is_empty());
        for bad in ["", "7", "D", "0D", "7d", "7 D", "-1h"] {
            let retention = StreamRetention {
                max_age: Some(bad.into()),
                ..StreamRetention::default()
            };
            assert!(retention.validate().is_err(), "{bad:?}");
        }
        assert!(StreamRetention::default().validate().is_ok());
    }

    /// Bad configuration fails fast with a readable message.
    #[test]
    fn bad_topology_is_refused() {
        assert!(Topology::new("relay", 0).is_err());
        assert!(Topology::new("has space", 1).is_err());
        assert!(Topology::new("amq.direct", 1).is_err());
    }
}

//! Where events go: one durable direct exchange, one durable queue per partition.
//!
//! Broker partition key = `(TenantId, RunId)`: every event of a run goes to one partition, so a
//! consumer of that partition sees the run's events in publish order. The map is stable across
//! processes and versions: FNV-1a 64 over `tenant bytes, 0x00, run bytes`, modulo the partition
//! count. Changing the partition count remaps runs; do it only with the relay drained.
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};
use store::{RunId, TenantId};

use crate::Error;

/// A partition of the topology (a queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Partition(pub u16);

/// The kind of RabbitMQ queue the topology declares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum QueueType {
    /// A classic queue (declared without `x-queue-type`, as earlier versions did).
    #[default]
    Classic,
    /// A quorum queue (`x-queue-type: quorum`): replicated across a RabbitMQ cluster.
    Quorum,
}

/// A consumer group: one consumer service's own copy of the history. Each group has its own
/// partition queues, bound to the topology's exchange with the same routing keys (so order per
/// `(TenantId, RunId)` holds in every group), and its own dead-letter queue. A group sees the
/// events published after its queues exist.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    /// The unnamed group of earlier versions: queues `<topology>.p<N>`, `<topology>.dead`.
    #[default]
    Default,
    /// A named group: queues `<topology>.<name>.p<N>`, `<topology>.<name>.dead`.
    Named(String),
}

impl Group {
    /// `default` is the unnamed group; any other name is 1 to 64 bytes of `[a-z0-9_-]`, and
    /// not `dead` nor `p<digits>` (which would read as a queue of the unnamed group).
    pub fn parse(name: &str) -> Result<Self, Error> {
        if name == "default" {
            return Ok(Self::Default);
        }
        let fine = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-';
        let queue_like = name == "dead"
            || (name.len() > 1
                && name.starts_with('p')
                && name[1..].bytes().all(|b| b.is_ascii_digit()));
        if name.is_empty() || name.len() > 64 || !name.bytes().all(fine) || queue_like {
            return Err(Error::InvalidConfig(format!(
                "consumer group {name:?} must be `default` or 1 to 64 bytes of a-z 0-9 _ -, \
                 and not `dead` or p<N>"
            )));
        }
        Ok(Self::Named(name.to_owned()))
    }

    /// The group's name (`default` for the unnamed one).
    pub fn name(&self) -> &str {
        match self {
            Self::Default => "default",
            Self::Named(name) => name,
        }
    }
}

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Names and shape of the broker topology.
#[derive(Clone, Debug)]
pub struct Topology {
    exchange: ShortString,
    partitions: u16,
    queue_type: QueueType,
    /// The group whose queues [`Topology::queue`] and [`Topology::dead_letter_queue`] name.
    group: Group,
    /// The groups whose queues [`Topology::declare`] creates.
    declared: Vec<Group>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

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

    /// Arguments every queue of the topology is declared with.
    fn queue_arguments(&self) -> FieldTable {
        let mut arguments = FieldTable::default();
        if self.queue_type == QueueType::Quorum {
            arguments.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
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
        let mut hash = FNV_OFFSET;
        let bytes = tenant
            .as_str()
            .bytes()
            .chain([0u8])
            .chain(run.as_str().bytes());
        for byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(FNV_PRIME);
        }
        Partition((hash % u64::from(self.partitions)) as u16)
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

    /// The queue of a partition in `group`.
    pub fn queue_of(&self, group: &Group, partition: Partition) -> ShortString {
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
            .await?;
        for group in &self.declared {
            self.declare_group(channel, group).await?;
        }
        Ok(())
    }

    /// Declares `group`'s partition queues, bound to the exchange (which must exist), and its
    /// dead-letter queue. Idempotent.
    pub async fn declare_group(&self, channel: &Channel, group: &Group) -> Result<(), Error> {
        // One active consumer per partition: a second fold instance waits as a hot standby
        // instead of interleaving a partition's deliveries.
        let mut arguments = self.queue_arguments();
        arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        for index in 0..self.partitions {
            let partition = Partition(index);
            let queue = self.queue_of(group, partition);
            channel
                .queue_declare(queue.clone(), options, arguments.clone())
                .await?;
            channel
                .queue_bind(
                    queue,
                    self.exchange.clone(),
                    self.routing_key(partition),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        channel
            .queue_declare(
                self.dead_letter_queue_of(group),
                options,
                self.queue_arguments(),
            )
            .await?;
        Ok(())
    }

    /// Deletes `group`'s partition queues and dead-letter queue, with what they hold. Other
    /// groups are untouched; a relay goes on publishing to them.
    pub async fn delete_group(&self, channel: &Channel, group: &Group) -> Result<u32, Error> {
        let mut messages = 0;
        let queues = (0..self.partitions)
            .map(|index| self.queue_of(group, Partition(index)))
            .chain([self.dead_letter_queue_of(group)]);
        for queue in queues {
            messages += channel
                .queue_delete(queue, lapin::options::QueueDeleteOptions::default())
                .await?;
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
        // Independent check against the published FNV-1a test vector for "a".
        let mut hash = FNV_OFFSET;
        hash ^= u64::from(b'a');
        hash = hash.wrapping_mul(FNV_PRIME);
        assert_eq!(hash, 0xaf63_dc4c_8601_ec8c);
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

    /// Bad configuration fails fast with a readable message.
    #[test]
    fn bad_topology_is_refused() {
        assert!(Topology::new("relay", 0).is_err());
        assert!(Topology::new("has space", 1).is_err());
        assert!(Topology::new("amq.direct", 1).is_err());
    }
}

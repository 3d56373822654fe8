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

/// Names and shape of the broker topology.
#[derive(Clone, Debug)]
pub struct Topology {
    exchange: ShortString,
    partitions: u16,
    queue_type: QueueType,
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
        })
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

    /// The queue of a partition (`<name>.p<N>`).
    pub fn queue(&self, partition: Partition) -> ShortString {
        ShortString::from(format!("{}.p{}", self.exchange, partition.0))
    }

    /// The dead-letter queue (`<name>.dead`): messages a consumer could not fold, with the
    /// reason in header `x-relay-dead-letter-reason`. Published to through the default exchange.
    pub fn dead_letter_queue(&self) -> ShortString {
        ShortString::from(format!("{}.dead", self.exchange))
    }

    /// Declares the exchange, the partition queues, their bindings and the dead-letter queue.
    /// Idempotent.
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
        // One active consumer per partition: a second fold instance waits as a hot standby
        // instead of interleaving a partition's deliveries.
        let mut arguments = self.queue_arguments();
        arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        for index in 0..self.partitions {
            let partition = Partition(index);
            let queue = self.queue(partition);
            let options = QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            };
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
        let options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(self.dead_letter_queue(), options, self.queue_arguments())
            .await?;
        Ok(())
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

    /// Bad configuration fails fast with a readable message.
    #[test]
    fn bad_topology_is_refused() {
        assert!(Topology::new("relay", 0).is_err());
        assert!(Topology::new("has space", 1).is_err());
        assert!(Topology::new("amq.direct", 1).is_err());
    }
}

//! A consumer group's dead letters on either broker, for `distribution dead` and the console:
//! RabbitMQ keeps them in the group's dead-letter queue, NATS in the group's subject of the
//! dead-letter stream; both read back as [`DeadLetterView`]s.
use distribution::broker::{self, DeadFilter, DeadLetterView};
use distribution::nats::{NatsConfig, NatsDeadLetters};
use distribution::rabbit::{DeadLetters, RabbitConfig};

/// Where a group's dead letters live.
#[derive(Clone, Debug)]
pub enum GroupBroker {
    /// The group's queues on RabbitMQ.
    Rabbit(RabbitConfig),
    /// The group's subject of the stream's dead-letter stream.
    Nats {
        /// The stream (and servers) the group reads.
        nats: NatsConfig,
        /// The group's name as its consumers give it.
        group: String,
    },
}

impl GroupBroker {
    /// Where its dead letters are kept, as an operator names it.
    pub fn place(&self) -> String {
        match self {
            GroupBroker::Rabbit(rabbit) => rabbit.topology.dead_letter_queue().to_string(),
            GroupBroker::Nats { nats, group } => format!(
                "{}.{group}",
                distribution::nats::dead_letter_stream(&nats.stream)
            ),
        }
    }
}

/// A session on a group's dead letters.
pub enum GroupLetters {
    Rabbit(DeadLetters),
    Nats(NatsDeadLetters),
}

impl GroupLetters {
    /// Connects for the group's dead letters; declares nothing.
    pub async fn open(broker: &GroupBroker) -> Result<Self, broker::Error> {
        Ok(match broker {
            GroupBroker::Rabbit(rabbit) => Self::Rabbit(DeadLetters::open(rabbit).await?),
            GroupBroker::Nats { nats, group } => {
                Self::Nats(NatsDeadLetters::open(nats, group).await?)
            }
        })
    }

    /// How many the group has.
    pub async fn depth(&self) -> Result<u64, broker::Error> {
        match self {
            Self::Rabbit(dead) => dead.depth().await.map(u64::from),
            Self::Nats(dead) => dead.depth().await,
        }
    }

    /// The first `limit`, in the order they were kept.
    pub async fn list(&self, limit: u64) -> Result<Vec<DeadLetterView>, broker::Error> {
        Ok(match self {
            Self::Rabbit(dead) => views(dead.list(limit).await?),
            Self::Nats(dead) => views(dead.list(limit).await?),
        })
    }

    /// The one with `message_id`.
    pub async fn find(&self, message_id: &str) -> Result<Option<DeadLetterView>, broker::Error> {
        Ok(match self {
            Self::Rabbit(dead) => dead.find(message_id).await?.map(Into::into),
            Self::Nats(dead) => dead.find(message_id).await?.map(Into::into),
        })
    }

    /// Publishes those `filter` takes back to their partitions; how many.
    pub async fn replay(&self, filter: &DeadFilter) -> Result<u64, broker::Error> {
        match self {
            Self::Rabbit(dead) => dead.replay(filter).await,
            Self::Nats(dead) => dead.replay(filter).await,
        }
    }

    /// Deletes those `filter` takes for good; how many.
    pub async fn purge(&self, filter: &DeadFilter) -> Result<u64, broker::Error> {
        match self {
            Self::Rabbit(dead) => dead.purge(filter).await,
            Self::Nats(dead) => dead.purge(filter).await,
        }
    }
}

fn views<L: Into<DeadLetterView>>(letters: Vec<L>) -> Vec<DeadLetterView> {
    letters.into_iter().map(Into::into).collect()
}

//! How a consumer runs.
use std::collections::BTreeSet;
use std::time::Duration;

use store::EventType;

use broker::{Partition, RetryPolicy};

use rabbit::RabbitConfig;

use crate::batch::FoldBatch;

/// How a [`Consumer`] runs.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// The broker and topology.
    pub rabbit: RabbitConfig,
    /// Partitions to serve; `None` serves all of them. Give each consumer process its own
    /// subset to scale out (each queue also has single-active-consumer, so overlaps are safe).
    pub partitions: Option<Vec<Partition>>,
    /// Deliveries the broker may push ahead per partition. Default 256.
    pub prefetch: u16,
    /// How many deliveries one transaction folds: batches of what the broker pushed ahead,
    /// committed once and acked at once ([`FoldBatch`]; default up to 128, no linger).
    pub batch: FoldBatch,
    /// Delays between reconnects and between retries of a failing delivery.
    pub retry: RetryPolicy,
    /// Longest one batch's fold (begin, your projection for each delivery, commit) may take before it is abandoned
    /// (rolled back, or committed unknown to us: the retry is then a no-op) and retried. A
    /// database connection lost mid-call without a reset would otherwise hold its partition
    /// until the kernel gives up on the socket (about 15 minutes). The fold's transaction also
    /// sets `idle_in_transaction_session_timeout` to it, so PostgreSQL ends a transaction whose
    /// client vanished and releases its locks. Default 60 s. Keep your projection's state in
    /// its transaction: a cancelled fold leaves nothing else behind.
    pub fold_timeout: Duration,
    /// Retire the fold's state of runs whose end marker was folded longer than
    /// `retention.keep` ago (`store::retire_folded_runs`), checked every quarter of it
    /// (between 100 ms and 60 s); a later delivery of such a run is dead-lettered as
    /// `retired`, never applied twice. Default `None`: the fold keeps every run's state.
    pub retention: Option<store::Retention>,
    /// Event types this consumer's projection is given; `None` (the default): every intent.
    /// Intents of other types, and untyped ones, are still folded (their branch's chain
    /// advances, so nothing waits behind them) but not handed to [`Projection::apply`];
    /// rewinds and run ends are always handed over. For a consumer group that reads a subset.
    pub event_types: Option<BTreeSet<EventType>>,
    /// Where a stream partition (`QueueType::Stream`) is first read when the fold's database
    /// holds no offset for it (a new group, or one just reset). Default
    /// [`StreamStart::First`]: the whole retained history is replayed. Once an offset is
    /// stored the consumer always resumes there. Ignored for classic and quorum queues.
    pub stream_start: StreamStart,
    /// A stream partition that delivers nothing for this long is subscribed to again, on a
    /// fresh channel, at the offset the consumer expects (metric
    /// `relay_consumer_stream_resubscribes_total{queue}`). RabbitMQ's stream replicas before
    /// osiris 1.8.5 (rabbitmq-server#12785, RabbitMQ 4.0.x) can fail to tell a consumer of
    /// committed messages while another reader of the same replica waits for a later offset
    /// (osiris#172): the consumer then hears of them only when more is written, never if
    /// writing stops. A new subscription reads what is committed at once. Default 5 s; the
    /// cost on an idle partition is one channel opened and one closed per period. Ignored for
    /// classic and quorum queues.
    pub stream_resubscribe: Duration,
}

/// Where a consumer group with no stored offset starts reading a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamStart {
    /// The first retained message: replay the history the stream keeps.
    #[default]
    First,
    /// The next message published: only what comes after the consumer attaches.
    Next,
    /// The first message published at or after this time (RabbitMQ's resolution: a chunk,
    /// so a few earlier messages may come too; the fold absorbs them).
    At(std::time::SystemTime),
    /// This offset (RabbitMQ) or stream sequence (NATS), and what follows: a replay or a
    /// rebuild from any point the stream still holds.
    Offset(u64),
}

impl StreamStart {
    /// Where a RabbitMQ stream subscription with nothing stored starts for this start.
    pub(crate) fn offset(self) -> rabbit::StreamOffset {
        match self {
            StreamStart::First => rabbit::StreamOffset::First,
            StreamStart::Next => rabbit::StreamOffset::Next,
            StreamStart::At(at) => rabbit::StreamOffset::Timestamp(
                at.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |since| since.as_secs()),
            ),
            StreamStart::Offset(offset) => rabbit::StreamOffset::Offset(offset),
        }
    }

    /// Where a NATS reader with nothing stored starts for this start.
    pub(crate) fn read_from(self) -> nats::ReadFrom {
        match self {
            StreamStart::First => nats::ReadFrom::First,
            StreamStart::Next => nats::ReadFrom::Next,
            StreamStart::At(at) => nats::ReadFrom::Time(at),
            StreamStart::Offset(sequence) => nats::ReadFrom::Sequence(sequence),
        }
    }
}

/// How a [`Consumer`](crate::Consumer) reads NATS JetStream ([`Consumer::on_nats`](crate::Consumer::on_nats)).
///
/// Each partition (subject `<stream>.p<N>`) is read in stream order by one consumer process of
/// the group at a time: the one whose database session holds the partition's lock (a
/// PostgreSQL advisory lock on the connection its folds run on). Another process of the same
/// group stands by and takes the partition over once that session ends (the process stopped
/// or died, or its connection broke), from the position the fold stored. Needs no pinned
/// consumers (NATS 2.11): the fold's database decides.
#[derive(Clone, Debug)]
pub struct NatsConsumerConfig {
    /// The server and stream (the relay's `NatsConfig`: same stream, same partitions).
    pub nats: nats::NatsConfig,
    /// The group: `[A-Za-z0-9_-]`, 1 to 64 bytes. Its position per partition is stored in the
    /// fold's database under `nats:<stream>/<group>/p<N>`; its dead letters are kept under
    /// subject `<stream>_dead.<group>`.
    pub group: String,
    /// Partitions to serve; `None` serves all of them.
    pub partitions: Option<Vec<Partition>>,
    /// How many deliveries one transaction folds ([`FoldBatch`]).
    pub batch: FoldBatch,
    /// Delays between reconnects and between retries of a failing batch.
    pub retry: RetryPolicy,
    /// As [`ConsumerConfig::fold_timeout`]. Default 60 s.
    pub fold_timeout: Duration,
    /// As [`ConsumerConfig::retention`].
    pub retention: Option<store::Retention>,
    /// As [`ConsumerConfig::event_types`].
    pub event_types: Option<BTreeSet<EventType>>,
    /// Where a partition is first read when the fold's database holds no position for it.
    /// Default [`StreamStart::First`]. Once a position is stored the consumer resumes there.
    pub start: StreamStart,
    /// How often a standing-by process tries a partition another holds. Default 1 s.
    pub standby_poll: Duration,
}

impl NatsConsumerConfig {
    /// Every partition of `nats`'s stream, read by `group`, with the defaults.
    pub fn new(nats: nats::NatsConfig, group: &str) -> Result<Self, broker::Error> {
        let config = Self {
            nats,
            group: group.to_owned(),
            partitions: None,
            batch: FoldBatch::default(),
            retry: RetryPolicy::default(),
            fold_timeout: Duration::from_secs(60),
            retention: None,
            event_types: None,
            start: StreamStart::default(),
            standby_poll: Duration::from_secs(1),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the group's name and the stream's settings.
    pub fn validate(&self) -> Result<(), broker::Error> {
        self.nats.validate()?;
        let fine = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
        if self.group.is_empty() || self.group.len() > 64 || !self.group.bytes().all(fine) {
            return Err(broker::Error::InvalidConfig(format!(
                "consumer group {:?}: 1 to 64 bytes of A-Z a-z 0-9 _ -",
                self.group
            )));
        }
        Ok(())
    }

    /// Where the fold stores a partition's position.
    pub(crate) fn offset_key(&self, partition: Partition) -> String {
        format!("nats:{}/{}/p{}", self.nats.stream, self.group, partition.0)
    }

    pub(crate) fn partitions(&self) -> Vec<Partition> {
        self.partitions
            .clone()
            .unwrap_or_else(|| (0..self.nats.partitions).map(Partition).collect())
    }
}

impl ConsumerConfig {
    /// Every partition of `rabbit`'s topology, default prefetch and retry delays.
    pub fn new(rabbit: RabbitConfig) -> Self {
        Self {
            rabbit,
            partitions: None,
            prefetch: 256,
            batch: FoldBatch::default(),
            retry: RetryPolicy::default(),
            fold_timeout: Duration::from_secs(60),
            retention: None,
            event_types: None,
            stream_start: StreamStart::default(),
            stream_resubscribe: Duration::from_secs(5),
        }
    }

    pub(crate) fn partitions(&self) -> Vec<Partition> {
        self.partitions.clone().unwrap_or_else(|| {
            (0..self.rabbit.topology.partitions())
                .map(Partition)
                .collect()
        })
    }
}

//! Reading the stream back, for a consumer: one partition's messages in stream order, and dead
//! letters kept in a stream of their own.
//!
//! A partition is read by an ordered consumer (ephemeral, no acks, recreated by the client at
//! the next sequence after a gap in its own sequence or a missed heartbeat): where a reader
//! resumes is the fold's to keep (stored in the fold's transaction), not the server's. Works on
//! NATS 2.9 and later; pinned consumers (2.11) are not needed, since the consumer keeps one
//! reader per partition and group itself.
use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::{Ordered, OrderedConfig};
use async_nats::jetstream::stream::{Config, RetentionPolicy, StorageType};
use broker::{DEAD_LETTER_REASON, Error, Partition, WireError};
use bytes::Bytes;
use futures_util::StreamExt;
use store::OutboxEvent;
use tokio::sync::watch;

use crate::config::NatsConfig;
use crate::stream::dead_letter_stream;
use crate::wire::MSG_ID;

/// Where a reader with no stored position starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFrom {
    /// The stream's first message: the whole retained history.
    First,
    /// Only what is stored after the reader attaches.
    Next,
    /// The first message stored at or after this time.
    Time(SystemTime),
    /// This stream sequence (and what follows).
    Sequence(u64),
}

/// Below what a reader yields nothing: a sequence it yielded already (or before where it was
/// told to start), nor, until it yielded something, a message published before its start time.
/// async-nats recreates an ordered consumer that has delivered nothing yet from the stream's
/// first message whatever its start (`recreate_consumer_stream` with sequence 0, after two
/// missed heartbeats or "no responders" in a leader election), and from the last sequence it
/// delivered otherwise: the floor holds the start the server was asked for either way (pure).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Floor {
    sequence: u64,
    since: Option<async_nats::datetime::DateTime>,
}

impl Floor {
    /// The floor of a reader opened `from`, on a stream whose last sequence was `last`.
    fn at_open(from: ReadFrom, last: u64) -> Result<Self, Error> {
        Ok(match from {
            ReadFrom::First => Self {
                sequence: 0,
                since: None,
            },
            ReadFrom::Next => Self {
                sequence: last + 1,
                since: None,
            },
            ReadFrom::Sequence(sequence) => Self {
                sequence,
                since: None,
            },
            ReadFrom::Time(at) => Self {
                sequence: 0,
                since: Some(start_time(at)?),
            },
        })
    }

    /// Whether the message at `sequence`, published at `published`, is yielded; if so the
    /// floor moves past it.
    fn pass(&mut self, sequence: u64, published: async_nats::datetime::DateTime) -> bool {
        let admitted =
            sequence >= self.sequence && self.since.is_none_or(|since| published >= since);
        if admitted {
            *self = Self {
                sequence: sequence + 1,
                since: None,
            };
        }
        admitted
    }
}

fn start_time(at: SystemTime) -> Result<async_nats::datetime::DateTime, Error> {
    let nanos = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    async_nats::datetime::from_nanos(nanos as i128)
        .map_err(|err| Error::InvalidConfig(format!("start time {at:?}: {err}")))
}

impl ReadFrom {
    fn policy(self) -> Result<DeliverPolicy, Error> {
        Ok(match self {
            ReadFrom::First => DeliverPolicy::All,
            ReadFrom::Next => DeliverPolicy::New,
            ReadFrom::Sequence(sequence) => DeliverPolicy::ByStartSequence {
                start_sequence: sequence.max(1),
            },
            ReadFrom::Time(at) => DeliverPolicy::ByStartTime {
                start_time: start_time(at)?,
            },
        })
    }
}

/// One message of a partition, as read.
#[derive(Debug)]
pub struct Delivery {
    sequence: u64,
    headers: HeaderMap,
    payload: Bytes,
}

impl Delivery {
    /// Its stream sequence: where a reader resumes is the one after it.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The event it carries, or why it is not one.
    pub fn decode(&self) -> Result<OutboxEvent, WireError> {
        crate::wire::decode(&self.headers, &self.payload)
    }

    /// Its `Nats-Msg-Id`.
    pub fn message_id(&self) -> Option<String> {
        self.headers.get(MSG_ID).map(|id| id.as_str().to_owned())
    }

    /// The payload's length.
    pub fn bytes(&self) -> usize {
        self.payload.len()
    }

    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

/// One partition's messages in stream order, from a starting point.
pub struct PartitionReader {
    messages: Ordered,
    first_sequence: u64,
    last_sequence: u64,
    floor: Floor,
    /// Turns true when the connection loses its server: the reader ends.
    pub(crate) lost: Option<watch::Receiver<bool>>,
}

impl std::fmt::Debug for PartitionReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartitionReader")
            .field("first_sequence", &self.first_sequence)
            .finish_non_exhaustive()
    }
}

/// A consumer's connection to the stream: partitions read, dead letters kept. Once the
/// connection loses its server every reader of it ends (the client's own reconnect is held back
/// for the relay's sake, see [`crate::connection::connect`]): the consumer opens another connection and
/// reads on from the position its fold stored.
pub struct Reading {
    _client: async_nats::Client,
    context: Context,
    config: NatsConfig,
    lost: watch::Receiver<bool>,
}

impl std::fmt::Debug for Reading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reading")
            .field("stream", &self.config.stream)
            .finish_non_exhaustive()
    }
}

impl Reading {
    /// Connects (as the relay does) and makes sure the stream (as [`crate::stream::declare`]: a
    /// consumer may start before any relay) and the dead-letter stream exist.
    pub async fn connect(config: &NatsConfig) -> Result<Self, Error> {
        let (client, context, lost) = crate::connection::open(config).await?;
        crate::stream::declare(&context, config).await?;
        declare_dead_letters(&context, config).await?;
        Ok(Self {
            _client: client,
            context,
            config: config.clone(),
            lost,
        })
    }

    /// Reads `partition` from `from`.
    pub async fn partition(
        &self,
        partition: Partition,
        from: ReadFrom,
    ) -> Result<PartitionReader, Error> {
        let mut reader =
            PartitionReader::open(&self.context, &self.config, partition, from).await?;
        reader.lost = Some(self.lost.clone());
        Ok(reader)
    }

    /// Keeps `delivery` as `group`'s dead letter ([`dead_letter`]).
    pub async fn dead_letter(
        &self,
        group: &str,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<(), Error> {
        dead_letter(&self.context, &self.config, group, delivery, reason).await
    }
}

impl PartitionReader {
    /// Reads `partition` of `config`'s stream from `from`, under the connect timeout.
    pub async fn open(
        context: &Context,
        config: &NatsConfig,
        partition: Partition,
        from: ReadFrom,
    ) -> Result<Self, Error> {
        let policy = from.policy()?;
        let limit = config.connect_timeout;
        let work = async {
            let mut stream = context.get_stream(&config.stream).await.map_err(|err| {
                Error::Unreachable(format!("reading NATS stream {}: {err}", config.stream))
            })?;
            let state = stream
                .info()
                .await
                .map_err(|err| {
                    Error::Unreachable(format!("reading NATS stream {}: {err}", config.stream))
                })?
                .state
                .clone();
            let consumer = stream
                .create_consumer(OrderedConfig {
                    filter_subject: config.subject(partition),
                    deliver_policy: policy,
                    ..OrderedConfig::default()
                })
                .await
                .map_err(|err| Error::Unreachable(format!("creating a NATS reader: {err}")))?;
            let messages = consumer
                .messages()
                .await
                .map_err(|err| Error::Unreachable(format!("reading from NATS: {err}")))?;
            Ok(Self {
                messages,
                first_sequence: state.first_sequence,
                last_sequence: state.last_sequence,
                floor: Floor::at_open(from, state.last_sequence)?,
                lost: None,
            })
        };
        broker::within("opening a NATS reader", limit, work).await
    }

    /// The stream's first sequence when the reader opened: messages before it were removed by
    /// the stream's limits.
    pub fn first_sequence(&self) -> u64 {
        self.first_sequence
    }

    /// The stream's last sequence when the reader opened.
    pub fn last_sequence(&self) -> u64 {
        self.last_sequence
    }

    /// The next message; an error ends the reader (open another where the fold expects).
    pub async fn next(&mut self) -> Result<Delivery, Error> {
        loop {
            let read = self.read().await?;
            let passed = self.floor.pass(read.delivery.sequence, read.published);
            tracing::trace!(sequence = read.delivery.sequence, passed, "read");
            if passed {
                return Ok(read.delivery);
            }
        }
    }

    async fn read(&mut self) -> Result<Read, Error> {
        let lost = async {
            match &mut self.lost {
                Some(lost) => {
                    let _ = lost.wait_for(|lost| *lost).await;
                }
                None => std::future::pending().await,
            }
        };
        let next = tokio::select! {
            biased;
            next = self.messages.next() => next,
            () = lost => return Err(Error::Unreachable("the NATS connection lost its server".into())),
        };
        match next {
            Some(Ok(message)) => {
                let info = message
                    .info()
                    .map_err(|err| Error::Refused(format!("a NATS message without info: {err}")))?;
                let (sequence, published) = (info.stream_sequence, info.published);
                let message = message.message;
                Ok(Read {
                    delivery: Delivery {
                        sequence,
                        headers: message.headers.unwrap_or_default(),
                        payload: message.payload,
                    },
                    published,
                })
            }
            Some(Err(err)) => Err(Error::Unreachable(format!("reading from NATS: {err}"))),
            None => Err(Error::Unreachable("the NATS reader ended".into())),
        }
    }
}

/// A message as read, with when the server stored it.
struct Read {
    delivery: Delivery,
    published: async_nats::datetime::DateTime,
}

/// Makes sure the dead-letter stream exists (file storage, kept until its limits: none), and
/// refuses one read back otherwise, under the connect timeout.
pub async fn declare_dead_letters(context: &Context, config: &NatsConfig) -> Result<(), Error> {
    let name = dead_letter_stream(&config.stream);
    let wanted = Config {
        name: name.clone(),
        subjects: vec![format!("{name}.*")],
        duplicate_window: config.duplicate_window,
        num_replicas: config.replicas,
        storage: StorageType::File,
        retention: RetentionPolicy::Limits,
        ..Config::default()
    };
    let limit = config.connect_timeout;
    let work = async {
        let stream = context
            .get_or_create_stream(wanted.clone())
            .await
            .map_err(|err| Error::Unreachable(format!("declaring NATS stream {name}: {err}")))?;
        let found = &stream.cached_info().config;
        if !found.subjects.contains(&wanted.subjects[0])
            || found.storage != StorageType::File
            || found.retention != RetentionPolicy::Limits
        {
            return Err(Error::Refused(format!(
                "NATS stream {name} exists with other settings (subjects {:?}, {:?}, {:?}); \
                 dead letters need subjects {:?}, file storage, limits retention",
                found.subjects, found.storage, found.retention, wanted.subjects
            )));
        }
        Ok(())
    };
    broker::within("declaring the NATS dead-letter stream", limit, work).await
}

/// Keeps `delivery` in the dead-letter stream under `group`, with `reason` in
/// [`DEAD_LETTER_REASON`], and returns once the stream stored it (within the ack timeout). Its
/// id is the group and the original sequence, so a batch retried after the write stores it once.
pub async fn dead_letter(
    context: &Context,
    config: &NatsConfig,
    group: &str,
    delivery: &Delivery,
    reason: &str,
) -> Result<(), Error> {
    let stream = dead_letter_stream(&config.stream);
    let mut headers = HeaderMap::new();
    for (name, values) in delivery.headers.iter() {
        let name: &str = name.as_ref();
        if crate::wire::is_server_header(name) {
            continue;
        }
        for value in values {
            headers.append(name, value.clone());
        }
    }
    let reason = reason.replace(['\r', '\n'], " ");
    headers.insert(DEAD_LETTER_REASON, reason.trim());
    headers.insert(MSG_ID, format!("{group}.{}", delivery.sequence));
    headers.insert(crate::wire::EXPECTED_STREAM, stream.as_str());
    let subject = format!("{stream}.{group}");
    crate::connection::publish_stored(
        context,
        subject,
        headers,
        delivery.payload.clone(),
        "dead-lettering on NATS",
        config.ack_timeout.max(Duration::from_millis(1)),
    )
    .await
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(secs: u64) -> async_nats::datetime::DateTime {
        start_time(SystemTime::UNIX_EPOCH + Duration::from_secs(secs)).unwrap()
    }

    /// A reader never yields a sequence twice, nor one before where it was told to start, nor
    /// (until it yielded one) a message stored before its start time, whatever the server
    /// sends after recreating its consumer from the stream's first message.
    #[test]
    fn a_reader_yields_nothing_below_its_start_nor_twice() {
        let mut first = Floor::at_open(ReadFrom::First, 50).unwrap();
        assert!(first.pass(1, at(1)));
        assert!(!first.pass(1, at(1)), "the same sequence again");
        assert!(first.pass(7, at(2)), "sequences of a subject are not dense");
        assert!(!first.pass(3, at(3)));

        let mut next = Floor::at_open(ReadFrom::Next, 50).unwrap();
        assert!(!next.pass(1, at(1)), "a recreate from the first message");
        assert!(!next.pass(50, at(1)));
        assert!(next.pass(51, at(1)));

        let mut offset = Floor::at_open(ReadFrom::Sequence(20), 50).unwrap();
        assert!(!offset.pass(19, at(100)));
        assert!(offset.pass(20, at(100)));

        let since = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let mut time = Floor::at_open(ReadFrom::Time(since), 50).unwrap();
        assert!(!time.pass(1, at(999)), "stored before the start time");
        assert!(time.pass(2, at(1_000)));
        assert!(
            time.pass(3, at(5)),
            "once it yielded, the order is the stream's"
        );
    }
}

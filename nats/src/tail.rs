//! Watching events arrive on NATS (`distribution tail`): an ordered consumer per watched
//! partition, from what the stream stores after the tail attaches. Ordered consumers are
//! ephemeral, acknowledge nothing and are flow-controlled by the server, so a tail takes nothing
//! from any group and never holds the relay back: a slow terminal only falls behind in the
//! stream. It declares nothing: the stream must exist.
use futures_util::StreamExt;
use futures_util::stream::{BoxStream, SelectAll};
use store::OutboxEvent;

use broker::{Error, TailFilter, WireError};

use crate::config::NatsConfig;
use crate::reader::{Delivery, PartitionReader, ReadFrom};

/// One message the tail saw.
#[derive(Debug)]
pub struct NatsTailed {
    /// The partition's subject it was stored under (`<stream>.p<N>`).
    pub subject: String,
    /// Its `Nats-Msg-Id` (`tenant/run/branch/lsn`), if it has one.
    pub message_id: Option<String>,
    /// The event it carries, or why it is not one.
    pub event: Result<OutboxEvent, WireError>,
    /// The payload, as stored.
    pub body: Vec<u8>,
}

/// A watch on the stream's partitions.
pub struct NatsTail {
    // Held for the readers' life.
    _client: async_nats::Client,
    messages: SelectAll<BoxStream<'static, (String, Result<Delivery, Error>)>>,
    filter: TailFilter,
}

impl std::fmt::Debug for NatsTail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsTail")
            .field("filter", &self.filter)
            .finish_non_exhaustive()
    }
}

impl NatsTail {
    /// Connects (as the relay does) and reads each partition the filter watches from the next
    /// message stored. The stream must exist (a relay or consumer declared it).
    pub async fn open(config: &NatsConfig, filter: TailFilter) -> Result<Self, Error> {
        let (client, context, lost) = crate::connection::open(config).await?;
        let mut messages = SelectAll::new();
        for partition in filter.partitions(config.partitions) {
            let mut reader =
                PartitionReader::open(&context, config, partition, ReadFrom::Next).await?;
            reader.lost = Some(lost.clone());
            let subject = config.subject(partition);
            let read = futures_util::stream::unfold(reader, move |mut reader| {
                let subject = subject.clone();
                async move {
                    let next = reader.next().await;
                    Some(((subject, next), reader))
                }
            });
            messages.push(read.boxed());
        }
        Ok(Self {
            _client: client,
            messages,
            filter,
        })
    }

    /// The next message the filter takes; an error ends the watch (the connection lost its
    /// server, the stream was deleted).
    pub async fn next(&mut self) -> Result<NatsTailed, Error> {
        loop {
            let Some((subject, read)) = self.messages.next().await else {
                return Err(Error::Unreachable(
                    "the NATS tail has nothing to watch".into(),
                ));
            };
            let delivery = read?;
            let event = delivery.decode();
            if !self.filter.matches(&event) {
                continue;
            }
            return Ok(NatsTailed {
                subject,
                message_id: delivery.message_id(),
                event,
                body: delivery.payload().to_vec(),
            });
        }
    }
}

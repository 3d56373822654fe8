//! A consumer group's dead letters on NATS, read back (`distribution dead`): the messages of
//! subject `<stream>_dead.<group>` in the dead-letter stream, listed, shown, replayed to their
//! partitions and purged.
use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};
use broker::{DEAD_LETTER_REASON, DeadFilter, Error, WireError};
use store::OutboxEvent;

use crate::config::NatsConfig;
use crate::stream::dead_letter_stream;
use crate::wire::{EXPECTED_STREAM, MSG_ID};

/// One dead letter of a group.
#[derive(Debug)]
pub struct NatsDeadLetter {
    /// Its sequence in the dead-letter stream.
    pub sequence: u64,
    /// The event's message id (`tenant/run/branch/lsn`, as the relay wrote it); for a message
    /// that is not an event, the dead letter's own (`<group>.<sequence>`).
    pub message_id: Option<String>,
    /// Why the consumer dead-lettered it.
    pub reason: Option<String>,
    /// The event it carries, or why it is not one.
    pub event: Result<OutboxEvent, WireError>,
    /// Its headers, as stored (each name with its value).
    pub headers: Vec<(String, String)>,
    /// The body, as stored.
    pub body: Vec<u8>,
    raw: HeaderMap,
}

impl NatsDeadLetter {
    /// What it carries: `intent`, `rewind`, `end`, or `not an event`.
    pub fn kind(&self) -> &'static str {
        broker::event_kind(&self.event)
    }

    /// What a person looks for first ([`broker::event_properties`]).
    pub fn properties(&self) -> Vec<(&'static str, String)> {
        broker::event_properties(&self.event)
    }
}

impl From<NatsDeadLetter> for broker::DeadLetterView {
    fn from(letter: NatsDeadLetter) -> Self {
        Self {
            position: letter.sequence,
            message_id: letter.message_id,
            reason: letter.reason,
            event: letter.event,
            headers: letter.headers,
            body: letter.body,
        }
    }
}

/// A session on one group's dead letters. Declares nothing: reading a stream that is not
/// there (a mistyped name, no consumer ran yet) says so rather than creating it.
pub struct NatsDeadLetters {
    _client: async_nats::Client,
    context: Context,
    config: NatsConfig,
    group: String,
}

impl std::fmt::Debug for NatsDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsDeadLetters")
            .field("stream", &self.config.stream)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

/// JetStream's "no message found".
fn missing(kind: &RawMessageErrorKind) -> bool {
    matches!(kind, RawMessageErrorKind::NoMessageFound)
}

impl NatsDeadLetters {
    /// Connects to the servers of `config` for `group`'s dead letters.
    pub async fn open(config: &NatsConfig, group: &str) -> Result<Self, Error> {
        let (client, context) = crate::connection::connect(config).await?;
        Ok(Self {
            _client: client,
            context,
            config: config.clone(),
            group: group.to_owned(),
        })
    }

    fn subject(&self) -> String {
        format!("{}.{}", dead_letter_stream(&self.config.stream), self.group)
    }

    async fn stream(&self) -> Result<Stream, Error> {
        let name = dead_letter_stream(&self.config.stream);
        self.context.get_stream(&name).await.map_err(|err| match err.kind() {
            GetStreamErrorKind::JetStream(js) if js.error_code().0 == 10059 => {
                Error::Refused(format!(
                    "NATS has no stream {name}: no consumer of stream {} has kept a dead letter \
                     (is RELAY_TOPOLOGY right?)",
                    self.config.stream
                ))
            }
            _ => Error::Unreachable(format!("reading NATS stream {name}: {err}")),
        })
    }

    /// The group's dead letters, in the order they were kept (at most `limit`), up to the
    /// stream's last sequence when the scan began (what a replay keeps again comes after).
    async fn scan(&self, limit: u64) -> Result<Vec<NatsDeadLetter>, Error> {
        let mut stream = self.stream().await?;
        let last = stream
            .info()
            .await
            .map_err(|err| Error::Unreachable(format!("reading the dead-letter stream: {err}")))?
            .state
            .last_sequence;
        let subject = self.subject();
        let mut letters = Vec::new();
        let mut from = 1;
        while (letters.len() as u64) < limit && from <= last {
            // The group's next letter at or after `from`; other groups' are never read.
            let message = match stream
                .get_first_raw_message_by_subject(&subject, from)
                .await
            {
                Ok(message) => message,
                Err(err) if missing(&err.kind()) => break,
                Err(err) => {
                    return Err(Error::Unreachable(format!(
                        "reading the dead-letter stream at {from}: {err}"
                    )));
                }
            };
            let sequence = message.sequence;
            from = sequence + 1;
            if sequence > last {
                break;
            }
            if message.subject.as_str() != subject {
                return Err(Error::Refused(format!(
                    "the NATS server answered a read of subject {subject} with {} (a server \
                     before 2.9 cannot read by subject)",
                    message.subject
                )));
            }
            let event = crate::wire::decode(&message.headers, &message.payload);
            let message_id = match &event {
                Ok(event) => Some(broker::message_id(&event.key)),
                Err(_) => message.headers.get(MSG_ID).map(|id| id.as_str().to_owned()),
            };
            let headers = message
                .headers
                .iter()
                .filter_map(|(name, values)| {
                    let name: &str = name.as_ref();
                    Some((name.to_owned(), values.first()?.as_str().to_owned()))
                })
                .collect();
            letters.push(NatsDeadLetter {
                sequence,
                message_id,
                reason: message
                    .headers
                    .get(DEAD_LETTER_REASON)
                    .map(|reason| reason.as_str().to_owned()),
                event,
                headers,
                body: message.payload.to_vec(),
                raw: message.headers,
            });
        }
        Ok(letters)
    }

    /// How many dead letters the group has: the server's count of its subject (none read).
    pub async fn depth(&self) -> Result<u64, Error> {
        use futures_util::TryStreamExt;
        let subject = self.subject();
        let mut counts = self
            .stream()
            .await?
            .info_with_subjects(&subject)
            .await
            .map_err(|err| Error::Unreachable(format!("reading the dead-letter stream: {err}")))?;
        let mut depth = 0;
        while let Some((counted, count)) = counts
            .try_next()
            .await
            .map_err(|err| Error::Unreachable(format!("reading the dead-letter stream: {err}")))?
        {
            if counted == subject {
                depth += count as u64;
            }
        }
        Ok(depth)
    }

    /// The first `limit` dead letters, in the order they were kept; nothing is removed.
    pub async fn list(&self, limit: u64) -> Result<Vec<NatsDeadLetter>, Error> {
        self.scan(limit).await
    }

    /// The first dead letter with `message_id`; nothing is removed.
    pub async fn find(&self, message_id: &str) -> Result<Option<NatsDeadLetter>, Error> {
        Ok(self
            .scan(u64::MAX)
            .await?
            .into_iter()
            .find(|letter| letter.message_id.as_deref() == Some(message_id)))
    }

    /// Publishes every dead letter `filter` takes back to its partition's subject, in the
    /// order they were kept, without the dead-letter reason, each under a message id of its
    /// own (`<message id>/replay/<dead-letter sequence>`: the original's would be dropped as a
    /// copy inside the stream's duplicate window); each is deleted from the dead-letter stream
    /// once the stream stored it again. The consumers fold it again (duplicates ignored,
    /// held-back successors released). A message that is not an event cannot be routed and is
    /// left. Returns how many were replayed.
    pub async fn replay(&self, filter: &DeadFilter) -> Result<u64, Error> {
        let stream = self.stream().await?;
        let mut replayed = 0;
        // On NATS every group reading the stream gets the replayed event again (each folds it
        // as the copy it is, or as new when it had refused it too).
        for letter in self.scan(u64::MAX).await? {
            if !filter.takes(letter.message_id.as_deref(), &letter.event) {
                continue;
            }
            let Ok(event) = &letter.event else {
                continue;
            };
            let mut headers = HeaderMap::new();
            for (name, values) in letter.raw.iter() {
                let name: &str = name.as_ref();
                if crate::wire::is_server_header(name) || name == DEAD_LETTER_REASON {
                    continue;
                }
                for value in values {
                    headers.append(name, value.clone());
                }
            }
            let id = format!(
                "{}/replay/{}",
                letter.message_id.as_deref().unwrap_or_default(),
                letter.sequence
            );
            headers.insert(MSG_ID, id);
            headers.insert(EXPECTED_STREAM, self.config.stream.as_str());
            let subject = self
                .config
                .subject_of(&event.key.branch.tenant, &event.key.branch.run);
            self.store(subject, headers, letter.body.clone()).await?;
            self.delete(&stream, letter.sequence).await?;
            replayed += 1;
        }
        Ok(replayed)
    }

    /// Deletes every dead letter `filter` takes, for good. Returns how many.
    pub async fn purge(&self, filter: &DeadFilter) -> Result<u64, Error> {
        let stream = self.stream().await?;
        if *filter == DeadFilter::All {
            // The group's subject at once, what came while it ran too; never another group's.
            let limit = self.config.connect_timeout;
            let purge = async {
                let purged = stream.purge().filter(self.subject()).await;
                purged.map(|purged| purged.purged).map_err(|err| {
                    Error::Unreachable(format!("purging NATS subject {}: {err}", self.subject()))
                })
            };
            return broker::within("purging a NATS subject", limit, purge).await;
        }
        let mut purged = 0;
        for letter in self.scan(u64::MAX).await? {
            if filter.takes(letter.message_id.as_deref(), &letter.event) {
                self.delete(&stream, letter.sequence).await?;
                purged += 1;
            }
        }
        Ok(purged)
    }

    async fn store(&self, subject: String, headers: HeaderMap, body: Vec<u8>) -> Result<(), Error> {
        crate::connection::publish_stored(
            &self.context,
            subject,
            headers,
            body.into(),
            "replaying a dead letter on NATS",
            self.config.ack_timeout,
        )
        .await
    }

    async fn delete(&self, stream: &Stream, sequence: u64) -> Result<(), Error> {
        stream
            .delete_message(sequence)
            .await
            .map(drop)
            .map_err(|err| Error::Unreachable(format!("deleting dead letter {sequence}: {err}")))
    }
}

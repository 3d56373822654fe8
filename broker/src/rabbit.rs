//! The RabbitMQ adapter of the [`Publisher`] port.
//!
//! - Lazy: constructing it does no I/O; the first publish connects. A broker that is down at
//!   start is normal: publishes report `NotSent` with a fault, never a panic or a hang.
//! - Confirms on, persistent messages, `mandatory`: a returned message is a failure.
//! - Pipelined: `send` writes a batch and returns its confirms as a future (one deadline for the
//!   batch); the caller may write further batches before awaiting it.
//! - A fault seen while awaiting confirms is reported in the batch's `PublishReport`; the owner
//!   drops this publisher (the relay restarts the actor, which builds a fresh one).
//! - No auto-recovery: any channel fault drops the connection; the next publish reconnects
//!   (and the relay's supervisor restarts the publisher with backoff).
use std::collections::HashSet;
use std::future::Future;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};
use store::{Fence, OutboxEvent};

use crate::port::{BoxFuture, Confirms, Outcome, PublishReport, Publisher};
use crate::{CallProbe, Error, Topology, wire};

/// How to reach RabbitMQ.
#[derive(Clone, Debug)]
pub struct RabbitConfig {
    /// AMQP URI, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10`.
    pub uri: String,
    /// Exchange and partition queues.
    pub topology: Topology,
    /// Longest wait for a connection (TCP, handshake, channel, topology). Default 5 s.
    pub connect_timeout: Duration,
    /// Longest wait for a batch's confirms after its last publish. Default 10 s.
    pub confirm_timeout: Duration,
}

impl RabbitConfig {
    /// A configuration with the default timeouts.
    pub fn new(uri: impl Into<String>, topology: Topology) -> Result<Self, Error> {
        let uri = uri.into();
        if !(uri.starts_with("amqp://") || uri.starts_with("amqps://")) {
            return Err(Error::InvalidConfig(format!(
                "broker URI must start with amqp:// or amqps://, got {:?}",
                uri.split('@').next_back().unwrap_or_default()
            )));
        }
        Ok(Self {
            uri,
            topology,
            connect_timeout: Duration::from_secs(5),
            confirm_timeout: Duration::from_secs(10),
        })
    }
}

pub(crate) async fn within<T>(
    operation: &'static str,
    limit: Duration,
    future: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, Error> {
    match tokio::time::timeout(limit, future).await {
        Ok(result) => result.map_err(Error::from),
        Err(_) => Err(Error::Timeout {
            operation,
            timeout_ms: limit.as_millis() as u64,
        }),
    }
}

/// Opens a connection and a channel, and declares the topology. Every step under `limit`.
pub(crate) async fn open(
    config: &RabbitConfig,
    name: &str,
) -> Result<(Connection, Channel), Error> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let connection = match tokio::time::timeout(
        config.connect_timeout,
        Connection::connect(&config.uri, properties),
    )
    .await
    {
        Ok(Ok(connection)) => connection,
        Ok(Err(err)) => return Err(Error::Unreachable(err.to_string())),
        Err(_) => {
            return Err(Error::Unreachable(format!(
                "no connection within {} ms",
                config.connect_timeout.as_millis()
            )));
        }
    };
    let channel = within(
        "channel.open",
        config.connect_timeout,
        connection.create_channel(),
    )
    .await?;
    config.topology.declare(&channel).await?;
    Ok((connection, channel))
}

/// An open connection, its confirming channel, and the pump awaiting that channel's confirms.
struct Session {
    _connection: Connection,
    channel: Channel,
    pump: tokio::sync::mpsc::UnboundedSender<PendingBatch>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").finish_non_exhaustive()
    }
}

/// Publishes to RabbitMQ with confirms. One connection and one channel per publisher.
#[derive(Debug)]
pub struct RabbitPublisher {
    config: RabbitConfig,
    session: Option<Session>,
    probe: Option<CallProbe>,
}

impl RabbitPublisher {
    /// A publisher that connects on first use.
    pub fn new(config: RabbitConfig) -> Self {
        Self {
            config,
            session: None,
            probe: None,
        }
    }

    /// Records every broker call's thread in `probe`.
    pub fn with_probe(mut self, probe: CallProbe) -> Self {
        self.probe = Some(probe);
        self
    }

    async fn session(&mut self) -> Result<&Session, Error> {
        if self.session.is_none() {
            let (connection, channel) = open(&self.config, "outbox-relay-publisher").await?;
            within(
                "confirm.select",
                self.config.connect_timeout,
                channel.confirm_select(ConfirmSelectOptions::default()),
            )
            .await?;
            let (pump, batches) = tokio::sync::mpsc::unbounded_channel();
            // The pump ends when this session (its sender) is dropped and its queue is empty.
            tokio::spawn(confirm_pump(batches, self.config.confirm_timeout));
            self.session = Some(Session {
                _connection: connection,
                channel,
                pump,
            });
        }
        // Invariant: the session was set just above if it was missing.
        Ok(self.session.as_ref().expect("session is open"))
    }

    async fn send_batch(&mut self, events: &[OutboxEvent], fence: &Fence) -> Confirms {
        if let Some(probe) = &self.probe {
            probe.record();
        }
        let n_events = events.len();
        let topology = self.config.topology.clone();
        let (connect_timeout, confirm_timeout) =
            (self.config.connect_timeout, self.config.confirm_timeout);
        if !fence.is_open() {
            let outcomes = vec![Outcome::NotSent; n_events];
            return Box::pin(std::future::ready(PublishReport {
                outcomes,
                fault: None,
            }));
        }
        let session = match self.session().await {
            Ok(session) => session,
            Err(fault) => {
                return Box::pin(std::future::ready(PublishReport::not_sent(n_events, fault)));
            }
        };
        let mut write_fault = None;
        let mut confirms = Vec::with_capacity(n_events);
        let mut ids = Vec::with_capacity(n_events);
        // Write the whole batch (ordered on one channel); its confirms are awaited by the pump.
        for event in events {
            // Fenced: the lease is gone, another relay may own the tenant now. The rest is
            // reported NotSent (no fault: the session is fine).
            if !fence.is_open() {
                break;
            }
            let partition = topology.partition_of(&event.key.branch.tenant, &event.key.branch.run);
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let publish = session.channel.basic_publish(
                topology.exchange().clone(),
                topology.routing_key(partition),
                options,
                &event.payload,
                wire::properties(event),
            );
            match within("basic.publish", connect_timeout, publish).await {
                Ok(confirm) => {
                    confirms.push(confirm);
                    ids.push(wire::message_id(&event.key));
                }
                Err(err) => {
                    write_fault = Some(err);
                    break;
                }
            }
        }
        let (reply, report) = tokio::sync::oneshot::channel();
        let batch = PendingBatch {
            confirms,
            ids,
            n_events,
            deadline: tokio::time::Instant::now() + confirm_timeout,
            write_fault,
            reply,
        };
        let broken = batch.write_fault.is_some();
        let _ = session.pump.send(batch);
        if broken {
            // Dropping the connection closes it; the next send starts a fresh one.
            self.session = None;
        }
        Box::pin(async move {
            report.await.unwrap_or_else(|_| {
                PublishReport::not_sent(
                    n_events,
                    Error::Unreachable("the confirm pump stopped".into()),
                )
            })
        })
    }
}

/// A written batch whose confirms the pump awaits.
struct PendingBatch {
    confirms: Vec<lapin::PublisherConfirm>,
    ids: Vec<ShortString>,
    n_events: usize,
    deadline: tokio::time::Instant,
    write_fault: Option<Error>,
    reply: tokio::sync::oneshot::Sender<PublishReport>,
}

/// Awaits a channel's confirms strictly in write order and decides each event's outcome.
///
/// lapin hands a returned message to whichever pending confirm an ack resolves first, not to
/// the message that was returned (with multiple-acks that is often another event). RabbitMQ
/// sends a message's `basic.return` before its `basic.ack`, and an ack resolves only tags up to
/// its own, so once every confirm of batches up to this one has resolved, every return of this
/// batch has been seen by this pump. Outcomes are therefore decided by message id against the
/// channel-wide set of returned ids, never by which confirm carried the return.
async fn confirm_pump(
    mut batches: tokio::sync::mpsc::UnboundedReceiver<PendingBatch>,
    confirm_timeout: Duration,
) {
    let mut returned: HashSet<ShortString> = HashSet::new();
    let note_return = |message: Option<lapin::message::BasicReturnMessage>,
                       returned: &mut HashSet<ShortString>| {
        if let Some(id) =
            message.and_then(|message| message.delivery.properties.message_id().clone())
        {
            returned.insert(id);
        }
    };
    while let Some(batch) = batches.recv().await {
        let mut outcomes = vec![Outcome::NotSent; batch.n_events];
        let mut fault = batch.write_fault;
        for (index, confirm) in batch.confirms.into_iter().enumerate() {
            outcomes[index] = match tokio::time::timeout_at(batch.deadline, confirm).await {
                Ok(Ok(Confirmation::Ack(message))) => {
                    note_return(message, &mut returned);
                    Outcome::Accepted
                }
                Ok(Ok(Confirmation::Nack(message))) => {
                    note_return(message, &mut returned);
                    Outcome::Nacked
                }
                Ok(Ok(Confirmation::NotRequested)) => Outcome::Unconfirmed,
                Ok(Err(err)) => {
                    fault.get_or_insert(Error::Channel(err));
                    Outcome::Unconfirmed
                }
                Err(_) => {
                    fault.get_or_insert(Error::Timeout {
                        operation: "publisher confirm",
                        timeout_ms: confirm_timeout.as_millis() as u64,
                    });
                    Outcome::Unconfirmed
                }
            };
        }
        for (outcome, id) in outcomes.iter_mut().zip(&batch.ids) {
            // Acked but returned: nothing routed it, so it was not delivered.
            if returned.remove(id) && *outcome == Outcome::Accepted {
                *outcome = Outcome::Returned;
            }
        }
        let _ = batch.reply.send(PublishReport { outcomes, fault });
    }
}

impl Publisher for RabbitPublisher {
    fn send<'a>(
        &'a mut self,
        events: &'a [OutboxEvent],
        fence: &'a Fence,
    ) -> BoxFuture<'a, Confirms> {
        Box::pin(self.send_batch(events, fence))
    }
}

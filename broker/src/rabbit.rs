//! The RabbitMQ adapter of the [`Publisher`] port.
//!
//! - Lazy: constructing it does no I/O; the first publish connects. A broker that is down at
//!   start is normal: publishes report `NotSent` with a fault, never a panic or a hang.
//! - Confirms on, persistent messages, `mandatory`: a returned message is a failure.
//! - Pipelined: a batch is written in full, then its confirms are awaited under one deadline.
//! - No auto-recovery: any channel fault drops the connection; the next publish reconnects
//!   (and the relay's supervisor restarts the publisher with backoff).
use std::future::Future;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties};
use store::OutboxEvent;

use crate::port::{BoxFuture, Outcome, PublishReport, Publisher};
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

/// Publishes to RabbitMQ with confirms. One connection and one channel per publisher.
#[derive(Debug)]
pub struct RabbitPublisher {
    config: RabbitConfig,
    session: Option<(Connection, Channel)>,
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

    async fn channel(&mut self) -> Result<&Channel, Error> {
        if self.session.is_none() {
            let (connection, channel) = open(&self.config, "outbox-relay-publisher").await?;
            within(
                "confirm.select",
                self.config.connect_timeout,
                channel.confirm_select(ConfirmSelectOptions::default()),
            )
            .await?;
            self.session = Some((connection, channel));
        }
        // Invariant: the session was set just above if it was missing.
        Ok(&self.session.as_ref().expect("session is open").1)
    }

    async fn publish_batch(&mut self, events: &[OutboxEvent]) -> PublishReport {
        if let Some(probe) = &self.probe {
            probe.record();
        }
        let topology = self.config.topology.clone();
        let (connect_timeout, confirm_timeout) =
            (self.config.connect_timeout, self.config.confirm_timeout);
        let channel = match self.channel().await {
            Ok(channel) => channel,
            Err(fault) => return PublishReport::not_sent(events.len(), fault),
        };
        let mut outcomes = vec![Outcome::NotSent; events.len()];
        let mut fault = None;
        let mut confirms = Vec::with_capacity(events.len());
        // Write the whole batch first (ordered on one channel), then await confirms.
        for event in events {
            let partition = topology.partition_of(&event.key.branch.tenant, &event.key.branch.run);
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let publish = channel.basic_publish(
                topology.exchange().clone(),
                topology.routing_key(partition),
                options,
                &event.payload,
                wire::properties(event),
            );
            match within("basic.publish", connect_timeout, publish).await {
                Ok(confirm) => confirms.push(confirm),
                Err(err) => {
                    fault = Some(err);
                    break;
                }
            }
        }
        let deadline = tokio::time::Instant::now() + confirm_timeout;
        for (index, confirm) in confirms.into_iter().enumerate() {
            outcomes[index] = match tokio::time::timeout_at(deadline, confirm).await {
                Ok(Ok(Confirmation::Ack(None))) => Outcome::Accepted,
                // Acked but returned: nothing routed it, so it was not delivered.
                Ok(Ok(Confirmation::Ack(Some(_)))) => Outcome::Returned,
                Ok(Ok(Confirmation::Nack(_))) => Outcome::Nacked,
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
        if fault.is_some() {
            // Dropping the connection closes it; the next publish starts a fresh one.
            self.session = None;
        }
        PublishReport { outcomes, fault }
    }
}

impl Publisher for RabbitPublisher {
    fn publish<'a>(&'a mut self, events: &'a [OutboxEvent]) -> BoxFuture<'a, PublishReport> {
        Box::pin(self.publish_batch(events))
    }
}

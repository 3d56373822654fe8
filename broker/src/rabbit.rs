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
//! - Flow control: while the broker holds the connection blocked (`connection.blocked`, a
//!   memory or disk alarm), nothing new is written to it (those events are `NotSent`), and
//!   what was written waits for its verdict: the write and confirm timeouts count only time
//!   the connection was not blocked. The broker stopped reading the socket, so what is in it
//!   is routed once the alarm clears, however long that takes; giving up on it and sending it
//!   again elsewhere would put the first copy after whatever followed (a rewind marker, the
//!   next owner's publishes). Closing the channel or the connection does not retract it.
//! - A message larger than the broker's `max_message_size` closes the channel
//!   (PRECONDITION_FAILED naming the limit): that event is reported `TooLarge`, not merely
//!   unconfirmed, so the relay treats it as a refusal of its branch.
use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;
use tokio::time::Instant;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{Channel, Confirmation, ConnectionProperties};

use crate::ClosingConnection;
use store::{Fence, OutboxEvent};

use crate::port::{BoxFuture, OnReport, Outcome, PublishReport, Publisher};
use crate::{AmqpTls, BrokerHealth, CallProbe, Error, QueueType, Topology, wire};

/// How to reach RabbitMQ.
#[derive(Clone, Debug)]
pub struct RabbitConfig {
    /// AMQP URI, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10`; or the URIs of
    /// several nodes of one cluster, separated by commas: a connection goes to the node that
    /// answered last, and to the next one when it fails (percent-encode a comma in a password).
    pub uri: String,
    /// Exchange and partition queues.
    pub topology: Topology,
    /// Longest wait for a connection (TCP, handshake, channel, topology). Default 5 s.
    pub connect_timeout: Duration,
    /// Longest wait for a batch's confirms after its last publish. Default 10 s.
    pub confirm_timeout: Duration,
    /// After the broker returned a message (no queue bound for it: a queue or binding was
    /// deleted), declare the topology again before the next write, so it heals by itself.
    /// Default true.
    pub redeclare_on_return: bool,
    /// Extra TLS trust and a client certificate for `amqps://`. Default none.
    pub tls: AmqpTls,
    /// What the relay writes beside the contract: nothing more, or CloudEvents attributes too.
    /// Default [`crate::WireMode::Plain`].
    pub wire_mode: crate::WireMode,
    /// Which of the addresses in `uri` to try first (the last that answered); shared by the
    /// clones of this configuration.
    next_address: std::sync::Arc<std::sync::atomic::AtomicUsize>,
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
        // Parsed once here, as lapin will parse it at every connect: a URI it cannot read is
        // a configuration error at start (exit 2), not an unreachable broker retried for ever.
        // lapin's message quotes no part of the URI, so no password can leak through it.
        for (index, address) in uri.split(',').enumerate() {
            let address = address.trim();
            if index > 0 && !(address.starts_with("amqp://") || address.starts_with("amqps://")) {
                return Err(Error::InvalidConfig(format!(
                    "broker URI {} must start with amqp:// or amqps://",
                    index + 1
                )));
            }
            if let Err(why) = address.parse::<lapin::uri::AMQPUri>() {
                return Err(Error::InvalidConfig(format!(
                    "not a valid AMQP URI{}: {why}",
                    if index > 0 {
                        format!(" (address {})", index + 1)
                    } else {
                        String::new()
                    }
                )));
            }
        }
        Ok(Self {
            uri,
            topology,
            connect_timeout: Duration::from_secs(5),
            confirm_timeout: Duration::from_secs(10),
            redeclare_on_return: true,
            tls: AmqpTls::default(),
            wire_mode: crate::WireMode::Plain,
            next_address: std::sync::Arc::default(),
        })
    }

    /// The broker addresses of `uri`, in the order given.
    pub fn addresses(&self) -> Vec<&str> {
        self.uri.split(',').map(str::trim).collect()
    }

    /// Connects to one of the addresses, each under `connect_timeout`: first to the one that
    /// answered last, then to each next one in turn; the last failure if none answers.
    pub(crate) async fn connect(
        &self,
        properties: ConnectionProperties,
    ) -> Result<ClosingConnection, ConnectFailure> {
        use std::sync::atomic::Ordering;
        let addresses = self.addresses();
        let first = self.next_address.load(Ordering::Relaxed) % addresses.len();
        let mut failure = ConnectFailure::TimedOut;
        for step in 0..addresses.len() {
            let index = (first + step) % addresses.len();
            let attempt = tokio::time::timeout(
                self.connect_timeout,
                crate::connect::connect(addresses[index], &self.tls, properties.clone()),
            )
            .await;
            match attempt {
                Ok(Ok(connection)) => {
                    self.next_address.store(index, Ordering::Relaxed);
                    if step > 0 {
                        tracing::info!(
                            address = index + 1,
                            of = addresses.len(),
                            "connected to another broker address"
                        );
                    }
                    return Ok(connection);
                }
                Ok(Err(err)) => failure = ConnectFailure::Failed(err),
                Err(_) => failure = ConnectFailure::TimedOut,
            }
        }
        self.next_address
            .store((first + 1) % addresses.len(), Ordering::Relaxed);
        Err(failure)
    }
}

/// Why no address of a [`RabbitConfig`] gave a connection (the last one's failure).
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// It answered with an error.
    Failed(lapin::Error),
    /// It did not answer within the connect timeout.
    TimedOut,
}

/// Awaits a lapin operation under `limit`: its error, or [`Error::Timeout`] naming `operation`.
pub async fn within<T>(
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

/// A connection's flow control, as the broker last said: blocked or not, and since when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Flow {
    blocked: bool,
    since: Instant,
}

impl Flow {
    fn open() -> Self {
        Self {
            blocked: false,
            since: Instant::now(),
        }
    }
}

/// A wait of `limit` that ran out at `deadline`: whether, and until when, it goes on. A wait
/// counts only time the connection was not blocked: while blocked it goes on for another
/// `limit`; after an unblock it has `limit` from the unblock. Pure, so it is unit-tested.
fn extended(deadline: Instant, limit: Duration, flow: Flow, now: Instant) -> Option<Instant> {
    if flow.blocked {
        Some(now + limit)
    } else if flow.since + limit > deadline {
        Some(flow.since + limit)
    } else {
        None
    }
}

/// Awaits `future` until `deadline`, extended while (and after) the connection is blocked;
/// `None` once it ran out.
async fn until_unless_blocked<F: Future + Unpin>(
    future: F,
    deadline: Instant,
    limit: Duration,
    flow: &watch::Receiver<Flow>,
) -> Option<F::Output> {
    let mut future = future;
    let mut deadline = deadline;
    loop {
        match tokio::time::timeout_at(deadline, &mut future).await {
            Ok(output) => return Some(output),
            Err(_) => deadline = extended(deadline, limit, *flow.borrow(), Instant::now())?,
        }
    }
}

/// Payload bytes a publisher queues on its channel ahead of the writes it awaits: a batch of
/// small events goes out in one hand-off to lapin's I/O thread, while large ones do not pile
/// up whole in lapin's frame queue (a batch may hold 4 MiB).
const QUEUED_AHEAD_BYTES: usize = 1 << 20;

/// The verdict of a write queued by its first poll (`first`; `publish` still to be awaited
/// when that was pending). A write blocked midway waits for the unblock: lapin keeps its
/// frames and would write them then, so the event stays its session's until its verdict.
async fn written<T, F>(
    first: Poll<lapin::Result<T>>,
    publish: F,
    limit: Duration,
    flow: &watch::Receiver<Flow>,
) -> Result<T, Error>
where
    F: Future<Output = lapin::Result<T>> + Unpin,
{
    let output = match first {
        Poll::Ready(output) => Some(output),
        Poll::Pending => until_unless_blocked(publish, Instant::now() + limit, limit, flow).await,
    };
    match output {
        Some(Ok(confirm)) => Ok(confirm),
        Some(Err(err)) => Err(Error::from(err)),
        None => Err(Error::Timeout {
            operation: "basic.publish",
            timeout_ms: limit.as_millis() as u64,
        }),
    }
}

/// Follows the broker's `connection.blocked` / `connection.unblocked` for one connection:
/// updates `flow`, the relay's [`BrokerHealth`], and says so in the log. Ends with the
/// connection's events (or when aborted with its session); the mark uncounts itself then.
async fn follow_flow(
    events: impl futures_util::Stream<Item = lapin::Event> + Send + 'static,
    flow: watch::Sender<Flow>,
    mark: crate::health::BlockedMark,
) {
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let blocked = match event {
            lapin::Event::ConnectionBlocked(reason) => {
                tracing::warn!(
                    reason,
                    "the broker blocked a relay connection (resource alarm): nothing new is written to it; what was written waits for its confirms"
                );
                true
            }
            lapin::Event::ConnectionUnblocked => {
                tracing::info!("the broker unblocked a relay connection");
                false
            }
            _ => continue,
        };
        mark.set(blocked);
        flow.send_replace(Flow {
            blocked,
            since: Instant::now(),
        });
    }
}

/// The broker's limit from a size refusal ("message size S is larger than configured max size
/// M", PRECONDITION_FAILED), if `err` is one.
fn size_limit(err: &lapin::Error) -> Option<usize> {
    let text = err.to_string();
    if !text.contains("PRECONDITION_FAILED") || !text.contains("larger than") {
        return None;
    }
    let after = &text[text.rfind("max size ")? + "max size ".len()..];
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Opens a connection named `name` and a channel, and declares the topology, each step under
/// the config's timeouts (TLS as configured). The consumer's sessions start here.
pub async fn open(
    config: &RabbitConfig,
    name: &str,
) -> Result<(ClosingConnection, Channel), Error> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let connection = match config.connect(properties).await {
        Ok(connection) => connection,
        Err(ConnectFailure::Failed(err)) => return Err(refused_or(err, Error::Unreachable)),
        Err(ConnectFailure::TimedOut) => {
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
    // Under the timeout too: a broker that goes silent mid-declare would otherwise hold this
    // publisher forever (it would never fault, so never restart).
    within_topology(&config.topology, &channel, config.connect_timeout)
        .await
        .map_err(|err| match err {
            Error::Channel(err) => refused_or(err, |text| {
                Error::Unreachable(format!("declaring the topology: {text}"))
            }),
            other => other,
        })?;
    Ok((connection, channel))
}

/// A refusal by the broker (an AMQP error it sent: access refused, not allowed, precondition
/// failed...) is permanent; anything else (I/O, a reset) is `otherwise`.
fn refused_or(err: lapin::Error, otherwise: impl FnOnce(String) -> Error) -> Error {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Error::Refused(explain(amqp.to_string())),
        lapin::ErrorKind::AuthProviderError(text) => Error::Refused(text.clone()),
        _ => otherwise(err.to_string()),
    }
}

/// A refusal's text, with the way out where the relay knows it: a dead-letter queue declared
/// by a relay before `x-delivery-limit` was set on it ([`crate::DEAD_LETTER_DELIVERY_LIMIT`])
/// cannot be declared again with it, and on RabbitMQ 4 it drops a letter read 20 times.
fn explain(refusal: String) -> String {
    let old_dead_queue = refusal.contains("inequivalent arg 'x-delivery-limit'")
        && refusal.contains("but current is none")
        && refusal
            .split('\'')
            .any(|part| part.ends_with(".dead") && !part.contains(' '));
    if !old_dead_queue {
        return refusal;
    }
    format!(
        "{refusal} (a dead-letter queue declared by an earlier relay, without a delivery limit: \
         on RabbitMQ 4 it drops a letter read 20 times; protect its letters now with \
         `rabbitmqctl set_policy --apply-to quorum_queues relay-dead '\\.dead$' \
         '{{\"delivery-limit\": {limit}}}'`, replay or purge them (`distribution dead`), then \
         delete the empty queue: the relay declares it again, with the limit)",
        limit = crate::DEAD_LETTER_DELIVERY_LIMIT
    )
}

/// A refusal while running (credentials revoked, vhost or queue changed under the relay): no
/// retry fixes it, so it is counted every time and logged at ERROR at most every 30 s (every
/// publisher retries it with backoff).
fn refused_at_run_time(why: &str) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    metrics::counter!("relay_broker_refusals_total").increment(1);
    let mut last = LAST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
        *last = Some(std::time::Instant::now());
        tracing::error!(
            reason = why,
            "the broker refuses the relay (credentials, vhost or topology); nothing ships until an operator fixes it"
        );
    }
}

/// What a first connection says about the broker.
#[derive(Debug, PartialEq, Eq)]
pub enum Preflight {
    /// Connected, and the topology is declared.
    Ready,
    /// Not reachable now (down, or no answer): not an error, the relay keeps trying.
    Unreachable(String),
}

/// Connects once and declares the topology: `Err(Error::Refused)` when the broker refuses
/// (credentials, vhost, a reserved or conflicting topology), which no retry will fix.
pub async fn preflight(config: &RabbitConfig) -> Result<Preflight, Error> {
    match open(config, "outbox-relay-preflight").await {
        Ok((connection, _channel)) => {
            let closing = connection.close(200, "preflight done".into());
            let _ = tokio::time::timeout(config.connect_timeout, closing).await;
            Ok(Preflight::Ready)
        }
        Err(Error::Refused(why)) => Err(Error::Refused(why)),
        Err(Error::InvalidConfig(why)) => Err(Error::InvalidConfig(why)),
        Err(other) => Ok(Preflight::Unreachable(other.to_string())),
    }
}

/// An open connection, its confirming channel, and the pump awaiting that channel's confirms.
struct Session {
    _connection: ClosingConnection,
    channel: Channel,
    pump: tokio::sync::mpsc::UnboundedSender<PendingBatch>,
    /// Batches whose writing began (read by the pump), and (watched by the pump) batches
    /// handed to the pump.
    started: Arc<AtomicU64>,
    handed: tokio::sync::watch::Sender<u64>,
    /// Set by the pump when the broker returned a message (a queue or binding is missing):
    /// the topology is declared again before the next write.
    redeclare: Arc<AtomicBool>,
    /// The connection's flow control, followed by `flow_task` (aborted with the session).
    flow: watch::Receiver<Flow>,
    flow_task: tokio::task::JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.flow_task.abort();
    }
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
    health: BrokerHealth,
    /// The confirm pump of every session opened, aborted with the publisher: the batches they
    /// hold are dropped, so each batch's [`OnReport`] is dropped uncalled at once (the actors'
    /// `Reply` answers its drainer then). A replaced session's pump finishes its batches.
    pumps: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for RabbitPublisher {
    fn drop(&mut self) {
        for pump in &self.pumps {
            pump.abort();
        }
    }
}

impl RabbitPublisher {
    /// A publisher that connects on first use.
    pub fn new(config: RabbitConfig) -> Self {
        Self {
            config,
            session: None,
            probe: None,
            health: BrokerHealth::default(),
            pumps: Vec::new(),
        }
    }

    /// Reports every session opened and every batch's fate to `health` (shared by the
    /// publishers of one relay, read by its readiness probe).
    pub fn with_health(mut self, health: BrokerHealth) -> Self {
        self.health = health;
        self
    }

    /// Records every broker call's thread in `probe`.
    pub fn with_probe(mut self, probe: CallProbe) -> Self {
        self.probe = Some(probe);
        self
    }

    async fn session(&mut self) -> Result<&Session, Error> {
        if self.session.is_none() {
            let (connection, channel) = open(&self.config, "outbox-relay-publisher")
                .await
                .inspect_err(|err| {
                    self.health.report(false);
                    if let Error::Refused(why) = err {
                        refused_at_run_time(why);
                    }
                })?;
            self.health.report(true);
            within(
                "confirm.select",
                self.config.connect_timeout,
                channel.confirm_select(ConfirmSelectOptions::default()),
            )
            .await?;
            let (pump, batches) = tokio::sync::mpsc::unbounded_channel();
            let (handed, handed_rx) = tokio::sync::watch::channel(0);
            let started = Arc::new(AtomicU64::new(0));
            let redeclare = Arc::new(AtomicBool::new(false));
            let (flow_tx, flow) = watch::channel(Flow::open());
            let flow_task = tokio::spawn(follow_flow(
                connection.events_listener(),
                flow_tx,
                self.health.flow_mark(),
            ));
            // The pump ends when this session (its sender) is dropped and its queue is empty,
            // or when this publisher is dropped.
            self.pumps.retain(|pump| !pump.is_finished());
            self.pumps.push(tokio::spawn(confirm_pump(
                batches,
                Writer {
                    started: started.clone(),
                    handed: handed_rx,
                },
                redeclare.clone(),
                self.config.confirm_timeout,
                flow.clone(),
                self.health.clone(),
            )));
            self.session = Some(Session {
                _connection: connection,
                channel,
                pump,
                started,
                handed,
                redeclare,
                flow,
                flow_task,
            });
        }
        // Invariant: the session was set just above if it was missing.
        Ok(self.session.as_ref().expect("session is open"))
    }

    /// Writes one batch inside its span `relay.publish`: with feature `otel`, a child of the
    /// first traced event's trace and linked to every other one's, so a host's trace shows
    /// where its event was shipped.
    async fn send_batch(&mut self, events: &[OutboxEvent], fence: &Fence, done: OnReport) {
        use tracing::Instrument;
        // A root span (no parent from the actor's span: its parent is the host's trace), made
        // under the global dispatcher itself (see `connect::global_dispatch`).
        let make = || {
            tracing::info_span!(
                parent: None,
                "relay.publish",
                events = events.len(),
                tenant = events.first().map(|e| e.key.branch.tenant.as_str()).unwrap_or_default(),
            )
        };
        let span = match crate::connect::global_dispatch() {
            Some(global) => tracing::dispatcher::with_default(global, make),
            None => make(),
        };
        #[cfg(feature = "otel")]
        if !span.is_disabled() {
            use opentelemetry::trace::TraceContextExt;
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let mut traced = events.iter().filter_map(|e| store::remote_context(&e.meta));
            if let Some(first) = traced.next() {
                let _ = span.set_parent(first);
            }
            for context in traced {
                span.add_link(context.span().span_context().clone());
            }
        }
        self.write_batch(events, fence, done).instrument(span).await
    }

    async fn write_batch(&mut self, events: &[OutboxEvent], fence: &Fence, done: OnReport) {
        if let Some(probe) = &self.probe {
            probe.record();
        }
        let n_events = events.len();
        let topology = self.config.topology.clone();
        let wire_mode = self.config.wire_mode;
        let (connect_timeout, confirm_timeout) =
            (self.config.connect_timeout, self.config.confirm_timeout);
        if !fence.is_open() {
            let outcomes = vec![Outcome::NotSent; n_events];
            return done(PublishReport {
                outcomes,
                fault: None,
            });
        }
        // On streams a returned message leaves the channel's publish sequence one ahead of the
        // stream's, which RabbitMQ before 4.0.x resends under after a leader change, losing
        // messages (`actors::Sharding::Partition`): a fresh session (which declares the
        // topology again) instead of the same channel.
        if topology.queue_type() == QueueType::Stream
            && self
                .session
                .as_ref()
                .is_some_and(|session| session.redeclare.load(Ordering::Acquire))
        {
            self.session = None;
        }
        if let Err(fault) = self.session().await {
            return done(PublishReport::not_sent(n_events, fault));
        }
        // Invariant: the session was opened just above.
        let session = self.session.as_mut().expect("session is open");
        // A returned message means a queue or binding is gone: declare it all again first.
        if session.redeclare.swap(false, Ordering::AcqRel)
            && self.config.redeclare_on_return
            && let Err(fault) = within_topology(&topology, &session.channel, connect_timeout).await
        {
            self.session = None;
            self.health.report(false);
            return done(PublishReport::not_sent(n_events, fault));
        }
        let session = self.session.as_mut().expect("session is open");
        let begun = session.started.fetch_add(1, Ordering::AcqRel) + 1;
        let mut write_fault = None;
        let mut confirms = Vec::with_capacity(n_events);
        let mut ids = Vec::with_capacity(n_events);
        let mut sizes = Vec::with_capacity(n_events);
        let flow = session.flow.clone();
        // Queue the batch on the channel before awaiting its writes, up to
        // `QUEUED_AHEAD_BYTES` of payload ahead: a publish takes its delivery tag and queues
        // its frames on its first poll, and resolves once lapin's I/O thread has written them,
        // so awaiting each in turn cost a hand-off to that thread per event. Polled in order,
        // the frames go out in order; the confirms are awaited by the pump.
        let mut queued: VecDeque<(&OutboxEvent, _, _)> = VecDeque::new();
        let mut queued_bytes = 0;
        let mut record = |event: &OutboxEvent, confirm| {
            confirms.push(confirm);
            ids.push(wire::message_id(&event.key));
            sizes.push(event.payload.len());
        };
        'events: for event in events {
            // Fenced: the lease is gone, another relay may own the tenant now. Blocked: the
            // broker reads nothing of this connection until its alarm clears. Either way the
            // rest is reported NotSent (no fault: the session is fine).
            if !fence.is_open() || flow.borrow().blocked {
                break;
            }
            while queued_bytes >= QUEUED_AHEAD_BYTES
                && let Some((event, first, publish)) = queued.pop_front()
            {
                queued_bytes -= event.payload.len();
                match written(first, publish, connect_timeout, &flow).await {
                    Ok(confirm) => record(event, confirm),
                    Err(fault) => {
                        write_fault = Some(fault);
                        break 'events;
                    }
                }
            }
            let partition = topology.partition_of(&event.key.branch.tenant, &event.key.branch.run);
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let mut publish = Box::pin(session.channel.basic_publish(
                topology.exchange().clone(),
                topology.routing_key(partition),
                options,
                &event.payload,
                wire::properties(event, wire_mode),
            ));
            // The first poll, with this task's waker: queued now, awaited later.
            let first = std::future::poll_fn(|cx| Poll::Ready(publish.as_mut().poll(cx))).await;
            queued_bytes += event.payload.len();
            queued.push_back((event, first, publish));
        }
        if write_fault.is_none() {
            for (event, first, publish) in queued.drain(..) {
                match written(first, publish, connect_timeout, &flow).await {
                    Ok(confirm) => record(event, confirm),
                    // The rest, queued or not, is reported NotSent; the session is dropped
                    // below.
                    Err(fault) => {
                        write_fault = Some(fault);
                        break;
                    }
                }
            }
        }
        // Writes after a failed one: reported NotSent (their frames may still go out).
        drop(queued);
        let batch = PendingBatch {
            confirms,
            ids,
            sizes,
            n_events,
            deadline: tokio::time::Instant::now() + confirm_timeout,
            write_fault,
            done,
        };
        let broken = batch.write_fault.is_some();
        // A pump that stopped drops the batch: its `done` is dropped uncalled (unconfirmed).
        let _ = session.pump.send(batch);
        session.handed.send_replace(begun);
        if broken {
            // Dropping the connection closes it; the next send starts a fresh one.
            self.session = None;
        }
    }
}

async fn within_topology(
    topology: &Topology,
    channel: &Channel,
    limit: Duration,
) -> Result<(), Error> {
    match tokio::time::timeout(limit, topology.declare(channel)).await {
        Ok(result) => result,
        Err(_) => Err(Error::Timeout {
            operation: "topology declare",
            timeout_ms: limit.as_millis() as u64,
        }),
    }
}

/// A written batch whose confirms the pump awaits.
struct PendingBatch {
    confirms: Vec<lapin::PublisherConfirm>,
    ids: Vec<ShortString>,
    /// Payload bytes of each event written (a size refusal names the limit, not the message).
    sizes: Vec<usize>,
    n_events: usize,
    deadline: tokio::time::Instant,
    write_fault: Option<Error>,
    /// Gets the batch's report from the pump.
    done: OnReport,
}

/// What the pump knows of the writer: batches begun, and batches handed over.
struct Writer {
    started: Arc<AtomicU64>,
    handed: tokio::sync::watch::Receiver<u64>,
}

/// A confirm, before and after the pump saw it resolve (returns already noted).
enum Slot {
    Waiting(lapin::PublisherConfirm),
    Seen(Outcome, Option<lapin::Error>),
}

/// A batch in the pump's hands.
struct Tracked {
    slots: Vec<Slot>,
    batch: PendingBatch,
}

/// Notes a resolved confirm: its return (if any) by message id; what it says.
fn seen(
    confirmation: Result<Confirmation, lapin::Error>,
    returned: &mut HashSet<ShortString>,
) -> Slot {
    let mut note = |message: Option<lapin::message::BasicReturnMessage>| {
        if let Some(id) =
            message.and_then(|message| message.delivery.properties.message_id().clone())
        {
            returned.insert(id);
        }
    };
    match confirmation {
        Ok(Confirmation::Ack(message)) => {
            note(message);
            Slot::Seen(Outcome::Accepted, None)
        }
        Ok(Confirmation::Nack(message)) => {
            note(message);
            Slot::Seen(Outcome::Nacked, None)
        }
        Ok(Confirmation::NotRequested) => Slot::Seen(Outcome::Unconfirmed, None),
        Err(err) => Slot::Seen(Outcome::Unconfirmed, Some(err)),
    }
}

fn track(batch: PendingBatch) -> Tracked {
    let mut batch = batch;
    let slots = std::mem::take(&mut batch.confirms)
        .into_iter()
        .map(Slot::Waiting)
        .collect();
    Tracked { slots, batch }
}

/// Awaits a channel's confirms strictly in write order and decides each event's outcome from
/// everything the broker said, not from which confirm lapin attached a return to.
///
/// lapin hands a waiting `basic.return` to whichever confirm it resolves next (for a
/// multiple-ack, in hash-map order): possibly a confirm of a later batch, even one still being
/// written. RabbitMQ sends a message's return before its ack, so by the time every confirm of
/// batch N resolved, each return of N is attached to some confirm already resolved. So, before
/// deciding N, the pump waits until every batch whose writing began has been handed over, and
/// notes the returns of every already-resolved confirm of later batches too. Outcomes are then
/// decided by message id against the channel-wide set of returned ids.
async fn confirm_pump(
    mut batches: tokio::sync::mpsc::UnboundedReceiver<PendingBatch>,
    mut writer: Writer,
    redeclare: Arc<AtomicBool>,
    confirm_timeout: Duration,
    flow: watch::Receiver<Flow>,
    health: BrokerHealth,
) {
    let mut returned: HashSet<ShortString> = HashSet::new();
    let mut ahead: VecDeque<Tracked> = VecDeque::new();
    // The broker's max_message_size, once a refusal named it (the channel is closed then).
    let mut size_limit_seen: Option<usize> = None;
    loop {
        let mut current = match ahead.pop_front() {
            Some(tracked) => tracked,
            None => match batches.recv().await {
                Some(batch) => track(batch),
                None => return,
            },
        };
        let deadline = current.batch.deadline;
        let mut timed_out = false;
        for slot in &mut current.slots {
            if let Slot::Waiting(confirm) = slot {
                // Blocked time does not count: the broker routes what it holds once unblocked.
                *slot = match until_unless_blocked(confirm, deadline, confirm_timeout, &flow).await
                {
                    Some(confirmation) => seen(confirmation, &mut returned),
                    None => {
                        timed_out = true;
                        Slot::Seen(Outcome::Unconfirmed, None)
                    }
                };
            }
        }
        // Every confirm that can carry a return of this batch is resolved now; make sure the
        // pump holds all of them (none is in a batch still being written), then look.
        let begun = writer.started.load(Ordering::Acquire);
        let _ = tokio::time::timeout_at(deadline, writer.handed.wait_for(|h| *h >= begun)).await;
        while let Ok(batch) = batches.try_recv() {
            ahead.push_back(track(batch));
        }
        for later in &mut ahead {
            for slot in &mut later.slots {
                if let Slot::Waiting(confirm) = slot
                    && let Some(confirmation) = confirm.now_or_never()
                {
                    *slot = seen(confirmation, &mut returned);
                }
            }
        }
        let batch = current.batch;
        let mut fault = batch.write_fault;
        let mut outcomes = vec![Outcome::NotSent; batch.n_events];
        for (index, slot) in current.slots.into_iter().enumerate() {
            if let Slot::Seen(outcome, err) = slot {
                outcomes[index] = outcome;
                if let Some(err) = err {
                    size_limit_seen = size_limit_seen.or(size_limit(&err));
                    fault.get_or_insert(Error::Channel(err));
                }
            }
        }
        // Refused for its size: every unconfirmed event above the limit the broker named (the
        // one it refused, and any later one it would refuse) counts against its branch.
        if let Some(limit) = size_limit_seen {
            for (outcome, size) in outcomes.iter_mut().zip(&batch.sizes) {
                if *outcome == Outcome::Unconfirmed && *size > limit {
                    *outcome = Outcome::TooLarge;
                }
            }
        }
        if timed_out {
            fault.get_or_insert(Error::Timeout {
                operation: "publisher confirm",
                timeout_ms: confirm_timeout.as_millis() as u64,
            });
        }
        for (outcome, id) in outcomes.iter_mut().zip(&batch.ids) {
            // Acked but returned: nothing routed it, so it was not delivered.
            if returned.remove(id) && *outcome == Outcome::Accepted {
                *outcome = Outcome::Returned;
                redeclare.store(true, Ordering::Release);
            }
        }
        health.report(fault.is_none());
        (batch.done)(PublishReport { outcomes, fault });
    }
}

impl Publisher for RabbitPublisher {
    fn send<'a>(
        &'a mut self,
        events: &'a [OutboxEvent],
        fence: &'a Fence,
        done: OnReport,
    ) -> BoxFuture<'a, ()> {
        Box::pin(self.send_batch(events, fence, done))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait counts only unblocked time: blocked, it goes on; unblocked recently, it has its
    /// whole limit from the unblock; otherwise it is over.
    #[test]
    fn blocked_time_does_not_count_against_a_wait() {
        let limit = Duration::from_secs(10);
        let start = Instant::now();
        let deadline = start + limit;
        let now = deadline;
        let blocked = Flow {
            blocked: true,
            since: start,
        };
        assert_eq!(extended(deadline, limit, blocked, now), Some(now + limit));
        let unblocked_late = Flow {
            blocked: false,
            since: start + Duration::from_secs(4),
        };
        assert_eq!(
            extended(deadline, limit, unblocked_late, now),
            Some(start + Duration::from_secs(14))
        );
        let never_blocked = Flow {
            blocked: false,
            since: start - Duration::from_secs(1),
        };
        assert_eq!(extended(deadline, limit, never_blocked, now), None);
    }

    /// RabbitMQ's refusal text names the limit (3.10's `rabbit_channel:check_msg_size`).
    #[test]
    fn a_size_refusal_names_the_broker_limit() {
        let refusal = |text: &str| {
            lapin::Error::from(lapin::ErrorKind::ProtocolError(
                lapin::protocol::AMQPError::new(
                    lapin::protocol::AMQPErrorKind::Soft(
                        lapin::protocol::AMQPSoftError::PRECONDITIONFAILED,
                    ),
                    text.into(),
                ),
            ))
        };
        let err = refusal(
            "PRECONDITION_FAILED - message size 8192 is larger than configured max size 4096",
        );
        assert_eq!(size_limit(&err), Some(4096));
        let err = refusal("PRECONDITION_FAILED - inequivalent arg 'x-queue-type'");
        assert_eq!(size_limit(&err), None);
    }

    /// A dead-letter queue of an earlier relay (no `x-delivery-limit`) is refused with the way
    /// out; other refusals are left as they are. The texts are 4.0.5's (3.10.8's are the same).
    #[test]
    fn an_old_dead_letter_queue_is_refused_with_the_way_out() {
        let old = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue \
                   'relay.search.dead' in vhost '/': received the value '2147483647' of type \
                   'long' but current is none";
        let explained = explain(old.to_owned());
        assert!(explained.starts_with(old), "{explained}");
        assert!(
            explained.contains("set_policy --apply-to quorum_queues relay-dead")
                && explained.contains("\"delivery-limit\": 2147483647"),
            "{explained}"
        );
        let partition = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue \
                         'relay.p1' in vhost '/': received the value '5' of type 'long' but \
                         current is none";
        assert_eq!(explain(partition.to_owned()), partition);
        let other = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'relay.dead'";
        assert_eq!(explain(other.to_owned()), other);
    }
}

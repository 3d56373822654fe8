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
use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::watch;

use lapin::Channel;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};

use crate::connect::ClosingConnection;
use store::{Fence, OutboxEvent};

use broker::{
    BoxFuture, BrokerHealth, CallProbe, Error, OnReport, Outcome, PublishReport, Publisher,
};

use crate::topology::{QueueType, Topology};
use crate::wire;
use confirms::{PendingBatch, SessionFate, Writer, confirm_pump};
use flow::{Flow, QUEUED_AHEAD_BYTES, follow_flow, written};
use session::{open_at, refused_at_run_time};

mod config;
mod confirms;
mod flow;
mod session;

pub use config::RabbitConfig;
pub use flow::within;
pub use session::{open, preflight};

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

    /// Reports every failed connect and every batch's fate to `health` (shared by the
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
            let declare = !self.config.declared();
            let (connection, channel, address) =
                open_at(&self.config, "outbox-relay-publisher", declare)
                    .await
                    .inspect_err(|err| {
                        self.health.report(false);
                        if let Error::Refused(why) = err {
                            refused_at_run_time(why);
                        }
                    })?;
            // Not reported up here: a session that opens is no proof the broker takes writes
            // (a node cut off from its cluster's majority accepts connections and confirms
            // nothing); a confirmed batch is (`confirms`).
            self.config.mark_declared();
            within(
                "confirm.select",
                self.config.connect_timeout,
                channel.confirm_select(ConfirmSelectOptions::default()),
            )
            .await
            .inspect_err(|_| self.health.report(false))?;
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
                SessionFate {
                    config: self.config.clone(),
                    address,
                },
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

    /// Writes one batch inside its span `relay.publish`, named and attributed by OpenTelemetry's
    /// messaging conventions (`send <exchange>`, kind PRODUCER, `messaging.*`, `error.type` and
    /// an error status when an event is not accepted); it ends when the batch's report is
    /// made, confirms included. With feature `otel`, a child of the first traced event's trace
    /// and linked to every other one's, so a host's trace shows where its event was shipped.
    async fn send_batch(&mut self, events: &[OutboxEvent], fence: &Fence, done: OnReport) {
        use tracing::Instrument;
        let topology = &self.config.topology;
        let exchange = topology.exchange().as_str();
        let single = (events.len() == 1).then(|| &events[0]);
        // A root span (no parent from the actor's span: its parent is the host's trace), made
        // under the global dispatcher itself (see `connect::global_dispatch`).
        let make = || {
            tracing::info_span!(
                parent: None,
                "relay.publish",
                otel.name = format!("send {exchange}"),
                otel.kind = "producer",
                otel.status_code = tracing::field::Empty,
                messaging.system = "rabbitmq",
                messaging.operation.name = "send",
                messaging.operation.type = "send",
                messaging.destination.name = exchange,
                messaging.batch.message_count = (events.len() > 1).then_some(events.len() as i64),
                messaging.message.id = single.map(|event| broker::message_id(&event.key)),
                messaging.rabbitmq.destination.routing_key = single.map(|event| {
                    let branch = &event.key.branch;
                    topology
                        .routing_key(topology.partition_of(&branch.tenant, &branch.run))
                        .to_string()
                }),
                error.type = tracing::field::Empty,
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
        let reported = span.clone();
        let done: OnReport = Box::new(move |report: PublishReport| {
            if let Some(failed) = failure_type(&report) {
                reported.record("error.type", failed);
                reported.record("otel.status_code", "error");
            }
            drop(reported);
            done(report)
        });
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
            // The fresh session is the one that declares.
            self.config.forget_declared();
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
            self.config.forget_declared();
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
            ids.push(lapin::types::ShortString::from(broker::message_id(
                &event.key,
            )));
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

pub(crate) async fn within_topology(
    topology: &Topology,
    channel: &Channel,
    limit: Duration,
) -> Result<(), Error> {
    broker::within("topology declare", limit, topology.declare(channel)).await
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

/// A failed batch's `error.type` (OpenTelemetry): the first event's outcome that was not
/// accepted (`nacked`, `returned`, `too_large`, `unconfirmed`, `not_sent`); `None` if all were.
fn failure_type(report: &PublishReport) -> Option<&'static str> {
    report
        .outcomes
        .iter()
        .find(|outcome| !outcome.is_accepted())
        .map(|outcome| outcome.label())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flow::extended;
    use session::{explain, size_limit};
    use tokio::time::Instant;

    /// The publish span's `error.type`: the first outcome not accepted, none if all were.
    #[test]
    fn a_batch_fails_with_its_first_outcome_not_accepted() {
        let report = |outcomes: Vec<Outcome>| PublishReport {
            outcomes,
            fault: None,
        };
        assert_eq!(failure_type(&report(vec![Outcome::Accepted; 3])), None);
        assert_eq!(
            failure_type(&report(vec![
                Outcome::Accepted,
                Outcome::Returned,
                Outcome::NotSent
            ])),
            Some("returned")
        );
        assert_eq!(
            failure_type(&report(vec![Outcome::TooLarge])),
            Some("too_large")
        );
    }

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

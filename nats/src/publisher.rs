//! [`NatsPublisher`]: the publisher port over JetStream. A batch's events are written in order
//! on one connection, each with its `Nats-Msg-Id`, without waiting for acks; a pump task awaits
//! the acks in order and reports each batch once, by its deadline. A publish whose ack does not
//! come is unknown, not failed: it is reported unconfirmed, the session faults, and the relay
//! sends it again with the same id, which the stream drops as a duplicate within its window.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_nats::Client;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::{self, Context};
use broker::{
    BoxFuture, BrokerHealth, CallProbe, Error, OnReport, Outcome, Preflight, PublishReport,
    Publisher,
};
use bytes::Bytes;
use store::{Fence, OutboxEvent};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::attribute::{Answer, attribute};
use crate::config::NatsConfig;
use crate::connection::{connect, open};
use crate::stream::declare;
use crate::wire;

/// A batch written, its acks awaited by the pump.
struct Pending {
    outcomes: Vec<Outcome>,
    acks: Vec<(usize, PublishAckFuture)>,
    /// Each ack's message id, in `acks`' order, kept only while TRACE is on (the ack trace
    /// names the event: a partition test that finds an event lost needs its answer).
    traced: Vec<String>,
    deadline: Instant,
    fault: Option<Error>,
    done: OnReport,
}

struct Session {
    _client: Client,
    context: Context,
    pump: mpsc::UnboundedSender<Pending>,
    pump_task: tokio::task::JoinHandle<()>,
    /// Set by the pump when an ack did not come: the next batch opens a fresh session.
    broken: Arc<AtomicBool>,
    /// True once the connection lost its server: nothing more is written on it.
    lost: watch::Receiver<bool>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Its batches' `done` go uncalled: their events count as unconfirmed (the port's rule).
        self.pump_task.abort();
    }
}

/// Publishes to JetStream with acks; one per publisher shard, like `rabbit::RabbitPublisher`.
/// Connects on first use and again after a fault.
pub struct NatsPublisher {
    config: NatsConfig,
    health: BrokerHealth,
    probe: Option<CallProbe>,
    session: Option<Session>,
}

impl std::fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsPublisher")
            .field("stream", &self.config.stream)
            .field("connected", &self.session.is_some())
            .finish()
    }
}

impl NatsPublisher {
    /// A publisher that has not connected yet.
    pub fn new(config: NatsConfig) -> Self {
        Self {
            config,
            health: BrokerHealth::new(),
            probe: None,
            session: None,
        }
    }

    /// Reports what it learns of the broker to `health` (shared by a relay's publishers).
    pub fn with_health(mut self, health: BrokerHealth) -> Self {
        self.health = health;
        self
    }

    /// Records each call into the client from the calling thread.
    pub fn with_probe(mut self, probe: CallProbe) -> Self {
        self.probe = Some(probe);
        self
    }

    async fn session(&mut self) -> Result<&Session, Error> {
        if self
            .session
            .as_ref()
            .is_some_and(|session| session.broken.load(Ordering::Acquire) || *session.lost.borrow())
        {
            self.session = None;
        }
        if self.session.is_none() {
            let (client, context, lost) = open(&self.config).await?;
            declare(&context, &self.config).await?;
            let (pump, batches) = mpsc::unbounded_channel();
            let broken = Arc::new(AtomicBool::new(false));
            let pump_task = tokio::spawn(pump_acks(
                batches,
                self.config.clone(),
                self.health.clone(),
                broken.clone(),
                lost.clone(),
            ));
            // Up only once the stream stores a batch (`pump_acks`): a server cut off from its
            // cluster's leader connects and stores nothing.
            self.session = Some(Session {
                _client: client,
                context,
                pump,
                pump_task,
                broken,
                lost,
            });
        }
        Ok(self.session.as_ref().expect("session is open"))
    }

    async fn write_batch(&mut self, events: &[OutboxEvent], fence: &Fence, done: OnReport) {
        if let Some(probe) = &self.probe {
            probe.record();
        }
        let n_events = events.len();
        if !fence.is_open() {
            return done(PublishReport {
                outcomes: vec![Outcome::NotSent; n_events],
                fault: None,
            });
        }
        let config = self.config.clone();
        let health = self.health.clone();
        let session = match self.session().await {
            Ok(session) => session,
            Err(fault) => {
                self.session = None;
                health.report(false);
                return done(PublishReport::not_sent(n_events, fault));
            }
        };
        let mut outcomes = vec![Outcome::NotSent; n_events];
        let mut acks = Vec::with_capacity(n_events);
        let trace = tracing::enabled!(tracing::Level::TRACE);
        let mut traced = Vec::new();
        let mut fault = None;
        for (index, event) in events.iter().enumerate() {
            // Fenced: the lease is gone, another relay may own the tenant now; the rest is
            // NotSent, without a fault (the session is fine).
            if !fence.is_open() {
                break;
            }
            // The connection lost its server: what is written now would go out after its
            // reconnect, behind what was lost with the old wire.
            if *session.lost.borrow() {
                fault = Some(Error::Unreachable(
                    "the NATS connection lost its server".into(),
                ));
                break;
            }
            let headers = match wire::headers(event, config.wire_mode, &config.stream) {
                Ok(headers) => headers,
                Err(unwritable) => {
                    tracing::warn!(
                        lsn = event.key.lsn.get(),
                        branch = %event.key.branch,
                        "an event NATS cannot carry unchanged: {unwritable}"
                    );
                    outcomes[index] = Outcome::Unwritable;
                    continue;
                }
            };
            let branch = &event.key.branch;
            let subject = config.subject_of(&branch.tenant, &branch.run);
            let message = jetstream::message::PublishMessage::build()
                .payload(Bytes::copy_from_slice(&event.payload))
                .headers(headers);
            // Waits only while `max_in_flight` acks are out, which the pump frees within the
            // ack timeout.
            let written = tokio::time::timeout(
                config.ack_timeout,
                session.context.send_publish(subject, message),
            )
            .await;
            match written {
                Ok(Ok(ack)) => {
                    if trace {
                        traced.push(broker::message_id(&event.key));
                    }
                    acks.push((index, ack));
                }
                Ok(Err(err)) => {
                    let verdict = attribute(answer_of(err.kind(), &err));
                    outcomes[index] = verdict.outcome;
                    if verdict.fault {
                        fault = Some(Error::Unreachable(format!("NATS publish: {err}")));
                        break;
                    }
                }
                Err(_) => {
                    fault = Some(Error::timed_out("writing to NATS", config.ack_timeout));
                    break;
                }
            }
        }
        let pending = Pending {
            outcomes,
            acks,
            traced,
            deadline: Instant::now() + config.ack_timeout,
            fault,
            done,
        };
        if let Err(mpsc::error::SendError(pending)) = session.pump.send(pending) {
            // The pump is gone (it only ends with its session): nothing of this batch has an
            // answer coming.
            let outcomes = pending
                .outcomes
                .iter()
                .map(|outcome| match outcome {
                    Outcome::NotSent => Outcome::NotSent,
                    _ => Outcome::Unconfirmed,
                })
                .collect();
            self.session = None;
            (pending.done)(PublishReport {
                outcomes,
                fault: Some(Error::Unreachable("the NATS ack pump stopped".into())),
            });
        }
    }
}

/// The answer an error of `send_publish` or of its ack gives.
fn answer_of(kind: PublishErrorKind, err: &(dyn std::error::Error + 'static)) -> Answer {
    match kind {
        PublishErrorKind::StreamNotFound => Answer::NoStream,
        PublishErrorKind::TimedOut => Answer::TimedOut,
        PublishErrorKind::BrokenPipe => Answer::Lost,
        PublishErrorKind::MaxPayloadExceeded => Answer::PayloadTooLarge,
        PublishErrorKind::WrongLastMessageId
        | PublishErrorKind::WrongLastSequence
        | PublishErrorKind::MaxAckPending
        | PublishErrorKind::Other => {
            match err
                .source()
                .and_then(|source| source.downcast_ref::<jetstream::Error>())
            {
                Some(refusal) => Answer::Refused(refusal.error_code().0),
                None => Answer::Client,
            }
        }
    }
}

/// Awaits each batch's acks in order, by its deadline, and reports it once.
async fn pump_acks(
    mut batches: mpsc::UnboundedReceiver<Pending>,
    config: NatsConfig,
    health: BrokerHealth,
    broken: Arc<AtomicBool>,
    mut lost: watch::Receiver<bool>,
) {
    while let Some(mut batch) = batches.recv().await {
        let traced = std::mem::take(&mut batch.traced);
        for (n, (index, ack)) in std::mem::take(&mut batch.acks).into_iter().enumerate() {
            // An ack already in is taken first; once the connection lost its server, no other
            // will come on it, so the batch is answered at once rather than at its deadline.
            let answer = tokio::select! {
                biased;
                acked = tokio::time::timeout_at(batch.deadline, ack.into_future()) => match acked {
                    Ok(Ok(ack)) => {
                        tracing::trace!(
                            id = traced.get(n).map(String::as_str),
                            sequence = ack.sequence,
                            duplicate = ack.duplicate,
                            "acked"
                        );
                        if !crate::attribute::ack_stored(&ack) {
                            Answer::InFlight
                        } else {
                            Answer::Stored {
                                ours: ack.stream == config.stream,
                            }
                        }
                    }
                    Ok(Err(err)) => answer_of(err.kind(), &err),
                    Err(_) => Answer::TimedOut,
                },
                _ = lost.wait_for(|lost| *lost) => Answer::Lost,
            };
            let verdict = attribute(answer);
            batch.outcomes[index] = verdict.outcome;
            if verdict.fault && batch.fault.is_none() {
                batch.fault = Some(match answer {
                    Answer::TimedOut => Error::timed_out("a NATS publish ack", config.ack_timeout),
                    other => Error::Unreachable(format!("NATS publish: {other:?}")),
                });
            }
        }
        if batch.fault.is_some() {
            broken.store(true, Ordering::Release);
        }
        // Reported after `done`, as the RabbitMQ adapter does.
        let report = PublishReport {
            outcomes: batch.outcomes,
            fault: batch.fault,
        };
        let up = report.broker_up();
        (batch.done)(report);
        if let Some(up) = up {
            health.report(up);
        }
    }
}

impl Publisher for NatsPublisher {
    fn send<'a>(
        &'a mut self,
        events: &'a [OutboxEvent],
        fence: &'a Fence,
        done: OnReport,
    ) -> BoxFuture<'a, ()> {
        Box::pin(self.write_batch(events, fence, done))
    }
}

/// The version the server `config` connects to says it runs, or why no connection opened: one
/// connection, nothing declared (`Relay::check_nats_version` holds it to
/// `RELAY_NATS_SERVER_VERSION`, before anything is declared).
pub async fn server_version(config: &NatsConfig) -> Result<String, Error> {
    let (client, _) = connect(config).await?;
    Ok(client.server_info().version)
}

/// What a first connection says about NATS, and the server's version when it answered.
/// `Err` when the stream exists with settings the relay cannot promise on, or the configuration
/// is unusable: no retry fixes those.
pub async fn preflight(config: &NatsConfig) -> Result<(Preflight, Option<String>), Error> {
    match connect(config).await {
        Ok((client, context)) => {
            let version = client.server_info().version;
            match declare(&context, config).await {
                Ok(()) => Ok((Preflight::Ready, Some(version))),
                Err(Error::Refused(why)) => Err(Error::Refused(why)),
                Err(other) => Ok((Preflight::Unreachable(other.to_string()), Some(version))),
            }
        }
        Err(Error::InvalidConfig(why)) => Err(Error::InvalidConfig(why)),
        Err(other) => Ok((Preflight::Unreachable(other.to_string()), None)),
    }
}

/// Whether a server may be used under `required` (`RELAY_NATS_SERVER_VERSION`): `Err` with one
/// line saying why not. `version` is what the server said when the connection opened, or why
/// no connection opened (then nothing can be checked, and the relay must not start on trust).
/// A release candidate or development build counts as its version (`2.11.0-RC.1` is 2.11.0):
/// a semver requirement alone would refuse every pre-release.
pub fn version_refusal(
    version: Result<&str, &Error>,
    required: &semver::VersionReq,
) -> Result<(), String> {
    let version = version.map_err(|err| {
        format!(
            "RELAY_NATS_SERVER_VERSION={required} is set and the server's version cannot be read \
             ({err}); start the relay once a server answers"
        )
    })?;
    match semver::Version::parse(version) {
        Ok(mut parsed) => {
            parsed.pre = semver::Prerelease::EMPTY;
            if required.matches(&parsed) {
                Ok(())
            } else {
                Err(format!(
                    "NATS {version} does not meet RELAY_NATS_SERVER_VERSION={required}"
                ))
            }
        }
        Err(err) => Err(format!(
            "NATS said its version is {version:?}, which is not a version ({err}); \
             RELAY_NATS_SERVER_VERSION={required} cannot be checked"
        )),
    }
}

/// What an operator should know of a server version: before 2.10 JetStream syncs its files to
/// disk every 60 s and cannot be told otherwise, so an acked message can be lost in an OS
/// crash or power cut of a single-replica stream (a process crash loses nothing); and a 2.9
/// cluster lost acked messages across partitions in the relay's partition test.
pub fn durability_note(version: &str, replicas: usize) -> Option<String> {
    let mut parts = version
        .split('.')
        .map(|part| part.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    let old = (major, minor) < (2, 10);
    match (old, replicas) {
        (true, 1) => Some(format!(
            "NATS {version} syncs JetStream to disk every 60 s, fixed: an acked event can be lost \
             in an OS crash or power cut of the server (not in a process crash); 2.10 or later \
             with `jetstream {{ sync_interval: always }}` syncs each write"
        )),
        (true, _) => Some(format!(
            "NATS {version} in a cluster loses acked events across network partitions (measured: \
             docs/operations.md, \"On NATS JetStream\") and syncs JetStream to disk every 60 s, \
             fixed; run 2.10 or later"
        )),
        (false, 1) => Some(format!(
            "NATS {version}: an ack means written to the OS, not to disk, unless the server runs \
             with `jetstream {{ sync_interval: always }}` (no client can see that setting); a \
             stream of 3 replicas survives the loss of one server"
        )),
        (false, _) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{durability_note, version_refusal};

    #[test]
    fn a_server_below_the_required_version_is_refused_in_one_line() {
        let at_least = |text: &str| semver::VersionReq::parse(text).unwrap();
        assert_eq!(version_refusal(Ok("2.10.27"), &at_least(">=2.10")), Ok(()));
        assert_eq!(version_refusal(Ok("2.11.0"), &at_least(">=2.10")), Ok(()));
        assert_eq!(
            version_refusal(Ok("2.11.0-RC.1"), &at_least(">=2.10")),
            Ok(())
        );
        let old = version_refusal(Ok("2.9.10"), &at_least(">=2.10")).unwrap_err();
        assert_eq!(
            old,
            "NATS 2.9.10 does not meet RELAY_NATS_SERVER_VERSION=>=2.10"
        );
        let candidate = version_refusal(Ok("2.10.0-RC.1"), &at_least(">=2.11")).unwrap_err();
        assert!(candidate.contains("NATS 2.10.0-RC.1"), "{candidate}");
        let down = broker::Error::Unreachable("connection refused".into());
        let silent = version_refusal(Err(&down), &at_least(">=2.10")).unwrap_err();
        assert!(
            silent.contains("cannot be read") && silent.contains("connection refused"),
            "{silent}"
        );
        let garbage = version_refusal(Ok("two"), &at_least(">=2.10")).unwrap_err();
        assert!(garbage.contains("not a version"), "{garbage}");
        for refusal in [old, candidate, silent, garbage] {
            assert!(!refusal.contains('\n'), "one line: {refusal}");
        }
    }

    #[test]
    fn a_server_that_cannot_sync_each_write_is_named() {
        assert!(durability_note("2.9.10", 1).unwrap().contains("every 60 s"));
        assert!(durability_note("2.9.10", 3).unwrap().contains("partitions"));
        assert!(
            durability_note("2.10.27", 1)
                .unwrap()
                .contains("sync_interval: always")
        );
        assert_eq!(durability_note("2.10.27", 3), None);
        assert!(
            durability_note("garbage", 3).is_some(),
            "an unknown version is not trusted"
        );
    }
}

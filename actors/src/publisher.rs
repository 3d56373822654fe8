//! One publisher actor per shard: the only place the relay calls the broker.
use std::sync::Arc;

use broker::{OnReport, Publisher};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tracing::Instrument;

use crate::mailbox::PublisherMessage;
use crate::shard::ShardId;

/// Makes the broker client of a shard. Called in `pre_start`, so it must not do I/O: the
/// RabbitMQ adapter connects lazily on its first publish.
pub type PublisherFactory = Arc<dyn Fn(ShardId) -> Box<dyn Publisher> + Send + Sync>;

/// Default bound on events written but not yet confirmed, per publisher.
pub const DEFAULT_MAX_UNCONFIRMED: usize = 20_000;

/// Arguments of a publisher.
#[derive(Clone)]
pub struct PublisherArgs {
    /// The shard it serves.
    pub shard: ShardId,
    /// Makes its broker client.
    pub factory: PublisherFactory,
    /// Called after the first successful publish of this incarnation (a recovery signal).
    pub on_healthy: Arc<dyn Fn(ShardId) + Send + Sync>,
    /// Most events written but not yet confirmed; further batches wait. Default
    /// [`DEFAULT_MAX_UNCONFIRMED`]. Bounds the publisher's memory whatever the backlog.
    pub max_unconfirmed: usize,
}

impl std::fmt::Debug for PublisherArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherArgs")
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

/// What a publisher's broker session has shown so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum SessionState {
    /// Nothing yet accepted nor faulted.
    #[default]
    Starting,
    /// A batch was accepted without fault.
    Healthy,
    /// A batch reported a broker fault: the actor stops.
    Faulted,
}

/// The session's state, shared with the confirm callbacks of its batches (they run on the
/// adapter's confirm pump, not in the actor).
#[derive(Debug, Default)]
struct Session(std::sync::Mutex<SessionState>);

impl Session {
    fn update<T>(&self, change: impl FnOnce(&mut SessionState) -> T) -> T {
        change(&mut self.0.lock().unwrap_or_else(|poison| poison.into_inner()))
    }

    /// A batch was accepted without fault; true the first time (the recovery signal).
    fn healthy(&self) -> bool {
        self.update(|state| {
            let first = *state == SessionState::Starting;
            if first {
                *state = SessionState::Healthy;
            }
            first
        })
    }

    /// A batch reported a broker fault; true the first time (the actor is stopped once).
    fn fault(&self) -> bool {
        self.update(|state| {
            std::mem::replace(state, SessionState::Faulted) != SessionState::Faulted
        })
    }

    fn is_faulted(&self) -> bool {
        self.update(|state| *state == SessionState::Faulted)
    }
}

/// State of a publisher.
pub struct PublisherState {
    args: PublisherArgs,
    /// The broker client. Dropped with the state: the batches it holds are dropped with it,
    /// and each one's [`Reply`] answers its drainer at once.
    client: Box<dyn Publisher>,
    unconfirmed: Arc<tokio::sync::Semaphore>,
    session: Arc<Session>,
}

impl std::fmt::Debug for PublisherState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherState")
            .field("shard", &self.args.shard)
            .finish_non_exhaustive()
    }
}

/// The publisher actor. Any broker fault stops it; the supervisor restarts it with backoff and
/// the drainers resend whatever it had not confirmed (its mailbox dies with it, and each
/// batch's [`Reply`] answers as it is dropped).
#[derive(Debug, Default)]
pub struct PublisherActor;

/// Every `outcome` label of `relay_publish_failures_total` (what `Outcome::label` gives for a
/// failure), for registering the counters at zero and keeping them alive.
pub const FAILURE_OUTCOMES: [&str; 7] = [
    "nacked",
    "no_room",
    "returned",
    "too_large",
    "unwritable",
    "unconfirmed",
    "not_sent",
];

const FAULTED: &str = "the broker session faulted; restarting";

impl Actor for PublisherActor {
    type Msg = PublisherMessage;
    type State = PublisherState;
    type Arguments = PublisherArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: PublisherArgs,
    ) -> Result<PublisherState, ActorProcessingErr> {
        let client = (args.factory)(args.shard);
        let unconfirmed = Arc::new(tokio::sync::Semaphore::new(args.max_unconfirmed.max(1)));
        Ok(PublisherState {
            args,
            client,
            unconfirmed,
            session: Arc::default(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: PublisherMessage,
        state: &mut PublisherState,
    ) -> Result<(), ActorProcessingErr> {
        let PublisherMessage::Publish {
            events,
            reply,
            fence,
        } = message;
        if state.session.is_faulted() {
            // This batch's reply, and those of the batches in the mailbox (which dies with the
            // actor), answer as they are dropped: their drainers retry at once.
            return Err(FAULTED.into());
        }
        let shard = state.args.shard;
        // Backpressure: wait until this batch fits under the unconfirmed bound.
        let wanted = events.len().clamp(1, state.args.max_unconfirmed.max(1)) as u32;
        let permits = state.unconfirmed.clone().acquire_many_owned(wanted).await?;
        let span = tracing::debug_span!("publish", shard = shard.0, events = events.len());
        // The verdict goes from the confirm pump straight to the drainer; a fault stops this
        // actor (a signal, not a message behind the mailbox's batches).
        let session = state.session.clone();
        let on_healthy = state.args.on_healthy.clone();
        let done: OnReport = Box::new(move |report| {
            drop(permits);
            for outcome in report
                .outcomes
                .iter()
                .filter(|outcome| !outcome.is_accepted())
            {
                metrics::counter!("relay_publish_failures_total", "shard" => shard.0.to_string(), "outcome" => outcome.label()).increment(1);
            }
            let fault = report.fault.as_ref().map(ToString::to_string);
            reply.answer(report.outcomes);
            match fault {
                Some(fault) => {
                    if session.fault() {
                        myself.stop(Some(format!("broker fault: {fault}")));
                    }
                }
                None => {
                    if session.healthy() {
                        on_healthy(shard);
                    }
                }
            }
        });
        // Invariant: batches are written in mailbox order on one channel, so each branch's
        // events reach the broker in Lsn order; only the confirms are awaited concurrently.
        state
            .client
            .send(&events, &fence, done)
            .instrument(span)
            .await;
        if state.session.is_faulted() {
            // Decided at once (not connected): fail now, before the next batch is tried.
            return Err(FAULTED.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use broker::BoxFuture;
    use chrono::Utc;
    use store::{
        BranchId, BranchKey, EventKey, EventKind, Fence, Lsn, OutboxEvent, RunId, TenantId,
    };

    use super::*;
    use crate::mailbox::{DrainerMessage, Reply};

    /// A broker that takes every write and never confirms anything: it keeps each batch's
    /// callback until it is dropped.
    #[derive(Default)]
    struct Silent(Vec<OnReport>);

    impl Publisher for Silent {
        fn send<'a>(
            &'a mut self,
            _events: &'a [OutboxEvent],
            _fence: &'a Fence,
            done: OnReport,
        ) -> BoxFuture<'a, ()> {
            self.0.push(done);
            Box::pin(async {})
        }
    }

    /// Stands in for a drainer: forwards every answer to the test.
    struct Probe;

    impl Actor for Probe {
        type Msg = DrainerMessage;
        type State = tokio::sync::mpsc::UnboundedSender<DrainerMessage>;
        type Arguments = tokio::sync::mpsc::UnboundedSender<DrainerMessage>;

        async fn pre_start(
            &self,
            _myself: ActorRef<DrainerMessage>,
            to_test: Self::Arguments,
        ) -> Result<Self::State, ActorProcessingErr> {
            Ok(to_test)
        }

        async fn handle(
            &self,
            _myself: ActorRef<DrainerMessage>,
            message: DrainerMessage,
            to_test: &mut Self::State,
        ) -> Result<(), ActorProcessingErr> {
            let _ = to_test.send(message);
            Ok(())
        }
    }

    fn event(lsn: u64) -> OutboxEvent {
        OutboxEvent {
            key: EventKey {
                branch: BranchKey::new(
                    TenantId::new("t").unwrap(),
                    RunId::new("r").unwrap(),
                    BranchId::new("b").unwrap(),
                ),
                lsn: Lsn::new(lsn),
            },
            prev_lsn: Lsn::new(lsn - 1),
            base_lsn: Lsn::new(0),
            payload: Vec::new(),
            created_at: Utc::now(),
            kind: EventKind::Intent,
            parent: None,
            meta: Default::default(),
            epochs: Default::default(),
        }
    }

    /// A publisher that dies answers every batch it held, the one awaiting confirms and the
    /// ones in its mailbox, at once and with nothing accepted: no drainer waits on a timer for
    /// a publisher that is gone (issue 16: branches stalled for multiples of the batch timeout
    /// after a broker restart), and no other drainer is told anything.
    #[tokio::test]
    async fn a_publisher_that_dies_answers_every_batch_it_held_at_once() {
        let (to_test, mut answers) = tokio::sync::mpsc::unbounded_channel();
        let (probe, _) = Actor::spawn(None, Probe, to_test).await.unwrap();
        let args = PublisherArgs {
            shard: ShardId(0),
            factory: Arc::new(|_| Box::new(Silent::default()) as Box<dyn Publisher>),
            on_healthy: Arc::new(|_| {}),
            max_unconfirmed: 1,
        };
        let (publisher, _) = Actor::spawn(None, PublisherActor, args).await.unwrap();
        // Batch 0 is written and awaits confirms; with room for one unconfirmed event, batch 1
        // waits in the actor for room, batch 2 in its mailbox.
        for batch in 0..3 {
            publisher
                .cast(PublisherMessage::Publish {
                    events: vec![event(batch + 1)],
                    reply: Reply::new(probe.clone(), batch, ShardId(0)),
                    fence: Fence::open(),
                })
                .unwrap();
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(300), answers.recv())
                .await
                .is_err(),
            "nothing is answered while the broker is silent"
        );
        publisher.kill();
        let mut answered = Vec::new();
        for _ in 0..3 {
            let answer = tokio::time::timeout(Duration::from_secs(5), answers.recv())
                .await
                .expect("answered at once")
                .expect("probe alive");
            let DrainerMessage::Confirmed {
                batch, outcomes, ..
            } = answer
            else {
                panic!("not an answer: {answer:?}");
            };
            assert!(outcomes.is_empty(), "nothing accepted");
            answered.push(batch);
        }
        answered.sort_unstable();
        assert_eq!(answered, [0, 1, 2]);
        probe.stop(None);
    }
}

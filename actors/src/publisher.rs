//! One publisher actor per shard: the only place the relay calls the broker.
use std::sync::Arc;

use broker::{Outcome, Publisher};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use store::OutboxEvent;
use tracing::Instrument;

use crate::{DrainerMessage, ShardId};

/// Makes the broker client of a shard. Called in `pre_start`, so it must not do I/O: the
/// RabbitMQ adapter connects lazily on its first publish.
pub type PublisherFactory = Arc<dyn Fn(ShardId) -> Box<dyn Publisher> + Send + Sync>;

/// Messages to a publisher.
#[derive(Debug)]
pub enum PublisherMessage {
    /// Publish `events` (one branch's events in Lsn order) and reply `Confirmed` to `reply`.
    Publish {
        /// The drainer's batch number, echoed back.
        batch: u64,
        /// Events in the order to publish.
        events: Vec<OutboxEvent>,
        /// Who gets the outcomes.
        reply: ActorRef<DrainerMessage>,
    },
}

/// Arguments of a publisher.
#[derive(Clone)]
pub struct PublisherArgs {
    /// The shard it serves.
    pub shard: ShardId,
    /// Makes its broker client.
    pub factory: PublisherFactory,
    /// Called after the first successful publish of this incarnation (a recovery signal).
    pub on_healthy: Arc<dyn Fn(ShardId) + Send + Sync>,
}

impl std::fmt::Debug for PublisherArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherArgs")
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

/// State of a publisher.
pub struct PublisherState {
    args: PublisherArgs,
    client: Box<dyn Publisher>,
    healthy: bool,
}

impl std::fmt::Debug for PublisherState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherState")
            .field("shard", &self.args.shard)
            .finish_non_exhaustive()
    }
}

/// The publisher actor. Any broker fault fails it; the supervisor restarts it with backoff and
/// the drainers resend whatever it had not confirmed (its mailbox dies with it).
#[derive(Debug, Default)]
pub struct PublisherActor;

fn outcome_label(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Accepted => "accepted",
        Outcome::Nacked => "nacked",
        Outcome::Returned => "returned",
        Outcome::Unconfirmed => "unconfirmed",
        Outcome::NotSent => "not_sent",
    }
}

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
        Ok(PublisherState {
            args,
            client,
            healthy: false,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: PublisherMessage,
        state: &mut PublisherState,
    ) -> Result<(), ActorProcessingErr> {
        let PublisherMessage::Publish {
            batch,
            events,
            reply,
        } = message;
        let shard = state.args.shard;
        let span = tracing::debug_span!("publish", shard = shard.0, events = events.len());
        let report = state.client.publish(&events).instrument(span).await;
        for outcome in report
            .outcomes
            .iter()
            .filter(|outcome| !outcome.is_accepted())
        {
            metrics::counter!("relay_publish_failures_total", "shard" => shard.0.to_string(), "outcome" => outcome_label(*outcome)).increment(1);
        }
        if report.fault.is_none() && !state.healthy && report.accepted() > 0 {
            state.healthy = true;
            (state.args.on_healthy)(shard);
        }
        // The drainer may have died meanwhile; it re-drains from the store, so a lost reply is safe.
        let _ = reply.cast(DrainerMessage::Confirmed {
            batch,
            shard,
            outcomes: report.outcomes,
        });
        match report.fault {
            Some(fault) => Err(Box::new(fault)),
            None => Ok(()),
        }
    }
}

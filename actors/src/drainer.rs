//! One drainer per tenant: drain -> publish through the shards -> ack the confirmed prefix.
//!
//! Invariant: a row is acked only after the broker confirmed it, and never past a failure in its
//! branch. Per branch, the drainer acks the longest prefix of the batch whose every event was
//! accepted; everything after the first failure stays pending and is drained (and published)
//! again, in Lsn order. Only one batch is in flight per tenant, so batches never overtake.
//!
//! Memory is bounded by configuration, not by the backlog: a batch takes permits for its events
//! from a budget shared by every drainer of the relay, and gives them back when it finishes.
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use broker::Outcome;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef};
use store::{BranchKey, EventKey, Outbox, OutboxEvent, TenantId};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

use crate::{Backoff, PublisherDirectory, PublisherMessage, RetryPolicy, ShardId, shard_of};

/// How a drainer works.
#[derive(Clone, Copy, Debug)]
pub struct DrainerConfig {
    /// Largest number of events drained and published at once. Default 1000.
    pub batch_size: u32,
    /// Longest wait for a batch's outcomes before treating the rest as unconfirmed. Default 30 s.
    pub batch_timeout: Duration,
    /// Delays between retries after a batch had failures.
    pub retry: RetryPolicy,
}

impl Default for DrainerConfig {
    fn default() -> Self {
        Self {
            batch_size: 1000,
            batch_timeout: Duration::from_secs(30),
            retry: RetryPolicy::default(),
        }
    }
}

/// Arguments of a drainer.
#[derive(Clone, Debug)]
pub struct DrainerArgs {
    /// The tenant it drains (the supervisor holds the tenant's lease).
    pub tenant: TenantId,
    /// The outbox.
    pub outbox: Outbox,
    /// The live publisher of each shard.
    pub publishers: PublisherDirectory,
    /// Events in flight across the whole relay, shared by every drainer: one permit per event.
    pub budget: Arc<Semaphore>,
    /// Batch size, timeouts, retry delays.
    pub config: DrainerConfig,
}

/// Messages to a drainer.
#[derive(Debug)]
pub enum DrainerMessage {
    /// There may be pending work: drain unless a batch is in flight or a retry is scheduled.
    Drain,
    /// The scheduled retry after a failed batch.
    Retry,
    /// A publisher's outcomes for the part of batch `batch` it was given.
    Confirmed {
        /// Batch number.
        batch: u64,
        /// The shard that answered.
        shard: ShardId,
        /// One outcome per event sent to that shard, in order.
        outcomes: Vec<Outcome>,
    },
    /// A publisher died: whatever it had not answered is unconfirmed.
    PublisherLost(ActorId),
    /// Batch `0` took too long.
    BatchTimeout(u64),
    /// Graceful shutdown: finish the batch in flight (or abandon it to a timeout), then stop.
    Finish,
}

/// A batch in flight. Only keys are kept here: the payloads travel to the publishers.
struct Batch {
    id: u64,
    keys: Vec<EventKey>,
    outcomes: Vec<Option<Outcome>>,
    pending: HashMap<ShardId, (ActorId, Vec<usize>)>,
    _permits: OwnedSemaphorePermit,
}

/// State of a drainer.
pub struct DrainerState {
    args: DrainerArgs,
    batch: Option<Batch>,
    next_batch: u64,
    backoff: Backoff,
    retry_scheduled: bool,
    finishing: bool,
}

impl std::fmt::Debug for DrainerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainerState")
            .field("tenant", &self.args.tenant)
            .field(
                "in_flight",
                &self.batch.as_ref().map(|batch| batch.keys.len()),
            )
            .finish_non_exhaustive()
    }
}

/// The drainer actor.
#[derive(Debug, Default)]
pub struct Drainer;

impl Drainer {
    /// Takes budget for a full batch (waiting while the relay is at its in-flight bound).
    async fn permits(state: &DrainerState) -> Result<OwnedSemaphorePermit, ActorProcessingErr> {
        let wanted = state.args.config.batch_size.max(1);
        Ok(state.args.budget.clone().acquire_many_owned(wanted).await?)
    }

    async fn drain(
        &self,
        myself: &ActorRef<DrainerMessage>,
        state: &mut DrainerState,
    ) -> Result<(), ActorProcessingErr> {
        if state.batch.is_some() || state.retry_scheduled {
            return Ok(());
        }
        if state.finishing {
            myself.stop(Some("finished".into()));
            return Ok(());
        }
        let permits = Self::permits(state).await?;
        let events = state
            .args
            .outbox
            .drain_outbox(&state.args.tenant, state.args.config.batch_size)
            .await?;
        self.start_batch(myself, state, events, permits).await
    }

    async fn start_batch(
        &self,
        myself: &ActorRef<DrainerMessage>,
        state: &mut DrainerState,
        events: Vec<OutboxEvent>,
        mut permits: OwnedSemaphorePermit,
    ) -> Result<(), ActorProcessingErr> {
        if events.is_empty() {
            return Ok(());
        }
        // Keep only as many permits as events; the rest go back to other drainers now.
        drop(permits.split(permits.num_permits().saturating_sub(events.len())));
        let id = state.next_batch;
        state.next_batch += 1;
        let shards = state.args.publishers.shards();
        let keys: Vec<EventKey> = events.iter().map(|event| event.key.clone()).collect();
        let mut by_shard: HashMap<ShardId, (Vec<usize>, Vec<OutboxEvent>)> = HashMap::new();
        for (index, event) in events.into_iter().enumerate() {
            let group = by_shard
                .entry(shard_of(&event.key.branch, shards))
                .or_default();
            group.0.push(index);
            group.1.push(event);
        }
        let mut batch = Batch {
            id,
            outcomes: vec![None; keys.len()],
            keys,
            pending: HashMap::new(),
            _permits: permits,
        };
        for (shard, (indexes, events)) in by_shard {
            let sent = state.args.publishers.get(shard).and_then(|publisher| {
                let message = PublisherMessage::Publish {
                    batch: id,
                    events,
                    reply: myself.clone(),
                };
                publisher.cast(message).ok().map(|()| publisher.get_id())
            });
            match sent {
                Some(publisher_id) => {
                    batch.pending.insert(shard, (publisher_id, indexes));
                }
                // No live publisher (it is being restarted): not sent, retried after backoff.
                None => {
                    for index in indexes {
                        batch.outcomes[index] = Some(Outcome::NotSent);
                    }
                }
            }
        }
        let nothing_sent = batch.pending.is_empty();
        state.batch = Some(batch);
        if nothing_sent {
            // Every part failed to send: settle it as the next message (no recursion here).
            myself.cast(DrainerMessage::BatchTimeout(id))?;
        } else {
            myself.send_after(state.args.config.batch_timeout, move || {
                DrainerMessage::BatchTimeout(id)
            });
        }
        Ok(())
    }

    async fn finish_batch(
        &self,
        myself: &ActorRef<DrainerMessage>,
        state: &mut DrainerState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(batch) = state.batch.take() else {
            return Ok(());
        };
        // Invariant: ack only the confirmed prefix of each branch.
        let mut blocked: HashSet<&BranchKey> = HashSet::new();
        let mut acks: Vec<EventKey> = Vec::with_capacity(batch.keys.len());
        for (key, outcome) in batch.keys.iter().zip(&batch.outcomes) {
            if blocked.contains(&key.branch) {
                continue;
            }
            if *outcome == Some(Outcome::Accepted) {
                acks.push(key.clone());
            } else {
                blocked.insert(&key.branch);
            }
        }
        let shipped = acks.len();
        let failed = batch.keys.len() - shipped;
        drop(batch);
        metrics::counter!("relay_events_shipped_total", "tenant" => state.args.tenant.to_string())
            .increment(shipped as u64);
        tracing::debug!(shipped, failed, "batch finished");
        if failed > 0 || state.finishing {
            state.args.outbox.ack_outbox(&acks).await?;
            if state.finishing {
                myself.stop(Some("finished".into()));
                return Ok(());
            }
            let delay = state.backoff.next_delay();
            state.retry_scheduled = true;
            myself.send_after(delay, || DrainerMessage::Retry);
            return Ok(());
        }
        state.backoff.reset();
        // The steady state: retire this batch and drain the next in one round trip.
        let permits = Self::permits(state).await?;
        let tenant = &state.args.tenant;
        let events = state
            .args
            .outbox
            .ack_and_drain(&acks, tenant, state.args.config.batch_size)
            .await?;
        self.start_batch(myself, state, events, permits).await
    }

    fn resolve(
        state: &mut DrainerState,
        batch_id: u64,
        mut settle: impl FnMut(ShardId, ActorId) -> Option<Vec<Outcome>>,
    ) -> bool {
        let Some(batch) = state.batch.as_mut().filter(|batch| batch.id == batch_id) else {
            return false;
        };
        let shards: Vec<ShardId> = batch.pending.keys().copied().collect();
        for shard in shards {
            let publisher_id = batch.pending[&shard].0;
            if let Some(outcomes) = settle(shard, publisher_id) {
                let (_, indexes) = batch.pending.remove(&shard).expect("shard is pending");
                for (position, index) in indexes.into_iter().enumerate() {
                    let outcome = outcomes
                        .get(position)
                        .copied()
                        .unwrap_or(Outcome::Unconfirmed);
                    batch.outcomes[index] = Some(outcome);
                }
            }
        }
        batch.pending.is_empty()
    }

    async fn dispatch(
        &self,
        myself: ActorRef<DrainerMessage>,
        message: DrainerMessage,
        state: &mut DrainerState,
    ) -> Result<(), ActorProcessingErr> {
        let done = match message {
            DrainerMessage::Drain => return self.drain(&myself, state).await,
            DrainerMessage::Retry => {
                state.retry_scheduled = false;
                return self.drain(&myself, state).await;
            }
            DrainerMessage::Confirmed {
                batch,
                shard,
                outcomes,
            } => {
                let mut outcomes = Some(outcomes);
                Self::resolve(state, batch, |pending_shard, _| {
                    if pending_shard == shard {
                        outcomes.take()
                    } else {
                        None
                    }
                })
            }
            DrainerMessage::PublisherLost(lost) => {
                let Some(batch_id) = state.batch.as_ref().map(|batch| batch.id) else {
                    return Ok(());
                };
                Self::resolve(state, batch_id, |_, publisher_id| {
                    (publisher_id == lost).then(Vec::new)
                })
            }
            DrainerMessage::BatchTimeout(batch_id) => {
                Self::resolve(state, batch_id, |_, _| Some(Vec::new()))
            }
            DrainerMessage::Finish => {
                state.finishing = true;
                if state.batch.is_none() {
                    myself.stop(Some("finished".into()));
                }
                return Ok(());
            }
        };
        if done {
            self.finish_batch(&myself, state).await
        } else {
            Ok(())
        }
    }
}

impl Actor for Drainer {
    type Msg = DrainerMessage;
    type State = DrainerState;
    type Arguments = DrainerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: DrainerArgs,
    ) -> Result<DrainerState, ActorProcessingErr> {
        // Start draining as soon as the actor runs; a crashed drainer resumes from the store.
        myself.cast(DrainerMessage::Drain)?;
        Ok(DrainerState {
            backoff: Backoff::new(args.config.retry),
            args,
            batch: None,
            next_batch: 0,
            retry_scheduled: false,
            finishing: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: DrainerMessage,
        state: &mut DrainerState,
    ) -> Result<(), ActorProcessingErr> {
        let span = tracing::debug_span!("drainer", tenant = %state.args.tenant);
        self.dispatch(myself, message, state).instrument(span).await
    }
}

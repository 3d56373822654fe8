//! One drainer per tenant: drain -> publish through the shards -> ack the confirmed prefix.
//!
//! Invariant: a row is acked only after the broker confirmed it, and never past a failure in its
//! branch. Per branch, the drainer acks the longest prefix of the batch whose every event was
//! accepted; everything after the first failure stays pending and is drained (and published)
//! again, in Lsn order.
//!
//! Up to `max_batches_in_flight` batches of a tenant are in flight at once (drained, published,
//! awaiting confirms), so an event committed meanwhile ships without waiting for the earlier
//! batch's round trip. Batches are settled strictly in drain order, and the prefix rule holds
//! across the whole window: once an event of a branch fails, no later event of that branch in
//! the window is acked, and no new batch starts until the window is empty and a retry is due.
//!
//! Memory is bounded by configuration, not by the backlog: a batch takes permits for its events
//! from a budget shared by every drainer of the relay, and gives them back when it finishes.
//!
//! Every store call runs under the batch timeout ([`store::within`]): a connection gone silent
//! fails the call and the drainer is restarted on a fresh one. The call may have taken effect:
//! an ack applied twice is a no-op, and what was drained but not published is drained again.
use std::collections::HashMap;
use std::time::Instant;

use broker::Outcome;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use store::{EventKey, OutboxEvent};
use tracing::Instrument;

use crate::mailbox::{DrainerMessage, PublisherMessage, Reply};
use crate::shard::ShardId;
use crate::window::{
    Dispatch, Next, Refusal, RefusalAction, StallNotice, Window, WindowConfig, Woken,
};

mod api;
mod budget;
mod no_room;
pub use api::{DrainerArgs, DrainerConfig, DrainerReport, DrainerReporter, StopReason};
use budget::{Held, Permits};

/// The drainer's one timer (a `Tick` sent later), cancelled when dropped. ractor's
/// `send_after` task holds the actor's cell (its mailbox channels) until it fires: 30 s timers
/// outliving retired drainers held about 7 KB each, 200+ MB while 100,000 tenants drained. The
/// timer is owned by the drainer's state, so it never outlives the drainer, however it stops.
#[derive(Debug)]
struct Timer(tokio::task::JoinHandle<Result<(), ractor::MessagingErr<DrainerMessage>>>);

impl Drop for Timer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// State of a drainer: its arguments and its window (every decision lives there).
pub struct DrainerState {
    args: DrainerArgs,
    window: Window<Held>,
    /// The one timer, set at the window's next timeout (retries, the idle check): a drainer
    /// woken often, or with many cooling branches, keeps one.
    timer: Option<(Instant, Timer)>,
    /// Branches of this tenant the broker had no room for in the current episode (WARN on the
    /// 1st, 2nd, 4th ... of them, not one each).
    no_room: no_room::NoRoomNotice,
}

impl DrainerState {
    /// Sets the timer at the window's next timeout, unless it is set there already.
    fn arm(&mut self, myself: &ActorRef<DrainerMessage>) {
        let Some(at) = self.window.poll_timeout() else {
            self.timer = None;
            return;
        };
        if self
            .timer
            .as_ref()
            .is_some_and(|(armed, timer)| *armed == at && !timer.0.is_finished())
        {
            return;
        }
        let delay = at.saturating_duration_since(Instant::now());
        self.timer = Some((at, Timer(myself.send_after(delay, || DrainerMessage::Tick))));
    }
}

impl std::fmt::Debug for DrainerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainerState")
            .field("tenant", &self.args.tenant)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

/// The drainer actor.
#[derive(Debug, Default)]
pub struct Drainer;

impl Drainer {
    async fn drain(
        &self,
        myself: &ActorRef<DrainerMessage>,
        state: &mut DrainerState,
    ) -> Result<(), ActorProcessingErr> {
        if state.window.finished() {
            myself.stop(Some(StopReason::Finished.as_str().into()));
            return Ok(());
        }
        if !state.window.may_start() {
            return Ok(());
        }
        let Some(permits) = Self::permits(state).await? else {
            return Ok(());
        };
        let in_flight = state.window.skip(Instant::now());
        let drained = store::within(
            state.args.config.batch_timeout,
            state.args.outbox.drain_after(
                &state.args.fence,
                &state.args.tenant,
                Self::limit(&permits),
                &in_flight,
            ),
        )
        .await;
        match drained {
            Ok(events) => self.start_batch(myself, state, events, permits),
            Err(err) => self.drain_failed(myself, state, err).await,
        }
    }

    /// A drain failed. A row it cannot read parks that row's branch, with the reason, and the
    /// drain goes on without it (released with `distribution release` once the row is
    /// repaired; tried again after `park_retry` anyway); anything else is [`Self::store_failed`].
    async fn drain_failed(
        &self,
        myself: &ActorRef<DrainerMessage>,
        state: &mut DrainerState,
        err: store::Error,
    ) -> Result<(), ActorProcessingErr> {
        let store::Error::Unreadable {
            branch,
            lsn,
            reason,
        } = &err
        else {
            return Self::store_failed(myself, err);
        };
        let park_retry = state.args.config.park_retry;
        let reason = format!("unreadable: lsn {lsn}: {reason}");
        let call = state.args.outbox.park_branch(
            branch,
            &reason,
            1,
            std::time::Duration::ZERO,
            park_retry,
        );
        if let Err(park) = store::within(state.args.config.batch_timeout, call).await {
            return Self::store_failed(myself, park);
        }
        metrics::counter!("relay_branches_parked_total", "tenant" => branch.tenant.to_string())
            .increment(1);
        tracing::warn!(branch = %branch, lsn = lsn.get(), reason = %reason, retry_in_s = park_retry.as_secs(), "branch parked: a row of it cannot be read; the rest of the tenant flows (repair the row, then `distribution release`)");
        myself.send_message(DrainerMessage::Drain)?;
        Ok(())
    }

    /// A store call failed: a lost lease stops the drainer in order; anything else fails it
    /// (the supervisor restarts it with backoff).
    fn store_failed(
        myself: &ActorRef<DrainerMessage>,
        err: store::Error,
    ) -> Result<(), ActorProcessingErr> {
        if matches!(err, store::Error::Fenced { .. }) {
            tracing::info!(error = %err, "lease lost; drainer stops");
            myself.stop(Some(StopReason::Fenced.as_str().into()));
            return Ok(());
        }
        if matches!(err, store::Error::NotReplicated { .. }) {
            // Nothing was published; the supervisor restarts the drainer on its backoff.
            metrics::counter!("relay_drains_held_back_total").increment(1);
        }
        Err(err.into())
    }

    fn start_batch(
        &self,
        myself: &ActorRef<DrainerMessage>,
        state: &mut DrainerState,
        events: Vec<OutboxEvent>,
        mut permits: Permits,
    ) -> Result<(), ActorProcessingErr> {
        if events.is_empty() {
            let activity = state.window.activity();
            if state.window.idle_since(activity) {
                // Retire after `idle_retire` unless something happens meanwhile, or sooner if
                // the supervisor says others wait for this drainer's slot.
                let idle_retire = state.args.config.idle_retire;
                state.window.idle(Instant::now(), idle_retire);
                (state.args.report)(myself.get_id(), DrainerReport::Idle { activity });
            }
            return Ok(());
        }
        let bytes: usize = events.iter().map(|event| event.payload.len()).sum();
        state.window.drained(
            events.len(),
            permits.events.num_permits(),
            bytes,
            permits.bytes.num_permits(),
        );
        // Keep only as many permits as events and bytes; the rest go back to other drainers now.
        // (A single event larger than the batch cap keeps the whole cap: the one overshoot.)
        let unused = permits.events.num_permits().saturating_sub(events.len());
        drop(permits.events.split(unused));
        let unused = permits.bytes.num_permits().saturating_sub(bytes);
        drop(permits.bytes.split(unused));
        let lane = state.window.lane_for(events.len(), bytes);
        let keys: Vec<EventKey> = events.iter().map(|event| event.key.clone()).collect();
        let written = events.iter().map(|event| event.created_at).collect();
        let mut by_shard: HashMap<ShardId, (Vec<usize>, Vec<OutboxEvent>)> = HashMap::new();
        for (index, event) in events.into_iter().enumerate() {
            let group = by_shard
                .entry(state.args.publishers.shard_of(&event.key.branch))
                .or_default();
            group.0.push(index);
            group.1.push(event);
        }
        let id = state.window.next_id();
        let held = Held { _permits: permits };
        let opened = state.window.open(keys, written, lane, held);
        debug_assert_eq!(opened, id);
        for (shard, (indexes, events)) in by_shard {
            let shard = state.args.publishers.slot(shard, lane);
            // No live publisher (it is being restarted): not sent, retried after backoff.
            // A cast that fails drops the message, whose reply then answers too: the window
            // ignores that second answer for a part it already settled as not sent.
            let sent = state.args.publishers.get(shard).is_some_and(|publisher| {
                let message = PublisherMessage::Publish {
                    events,
                    reply: Reply::new(myself.clone(), id, shard),
                    fence: state.args.fence.clone(),
                };
                publisher.cast(message).is_ok()
            });
            let dispatch = if sent {
                Dispatch::Sent
            } else {
                Dispatch::NotSent
            };
            state.window.dispatched(id, shard, dispatch, indexes);
        }
        if state.window.is_answered(id) {
            // Every part failed to send: settle it as the next message (no recursion here).
            myself.cast(DrainerMessage::Unsent)?;
        }
        Ok(())
    }

    /// Settles the complete batches at the front of the window and does what the window says:
    /// park or cool refused branches, ack, then drain on, wait, back off or stop.
    async fn settle(
        &self,
        myself: &ActorRef<DrainerMessage>,
        state: &mut DrainerState,
    ) -> Result<(), ActorProcessingErr> {
        let Some(settled) = state.window.settle(Instant::now()) else {
            return Ok(());
        };
        let tenant = state.args.tenant.clone();
        let tenant = &tenant;
        // Per relay, not per tenant: a series per tenant grows with every tenant ever seen.
        metrics::counter!("relay_events_shipped_total").increment(settled.acks.len() as u64);
        // Lag as a latency: from the host's write (inside its transaction) to the broker's
        // confirm, per shipped event. One histogram per relay, not per tenant: 14 buckets per
        // tenant made memory and scrapes grow with every tenant (8 KB per tenant measured at
        // 30,000 tenants); per-tenant lag is `relay_backlog_oldest_age_seconds{tenant}`.
        let now = chrono::Utc::now();
        let lag = metrics::histogram!("relay_write_to_confirm_seconds");
        for written in &settled.acked_written {
            lag.record((now - *written).to_std().unwrap_or_default().as_secs_f64());
        }
        tracing::debug!(shipped = settled.acks.len(), failed = settled.failed, next = ?settled.next, "batches settled");
        match settled.stall {
            Some(StallNotice::Waiting {
                waited,
                failures,
                cause,
            }) => tracing::warn!(
                tenant = %tenant,
                waited_ms = waited.as_millis() as u64,
                failures,
                cause = cause.as_str(),
                "tenant waits for the broker"
            ),
            Some(StallNotice::Shipping { waited, failures }) => tracing::info!(
                tenant = %tenant,
                waited_ms = waited.as_millis() as u64,
                failures,
                "tenant ships again"
            ),
            None => {}
        }
        if settled.refusals.is_empty() && !settled.acks.is_empty() {
            state.no_room.shipped();
        }
        for refusal in &settled.refusals {
            if let Err(err) = self.refused(state, refusal).await {
                return Self::store_failed(myself, err);
            }
        }
        let acks = &settled.acks;
        match settled.next {
            Next::Flow if state.window.may_start() => {
                // The steady state: retire what was confirmed and drain the next batch in one
                // round trip.
                if let Some(permits) = Self::permits(state).await? {
                    let in_flight = state.window.skip(Instant::now());
                    let limit = Self::limit(&permits);
                    let fence = &state.args.fence;
                    let call = state
                        .args
                        .outbox
                        .ack_and_drain(fence, acks, tenant, limit, &in_flight);
                    return match store::within(state.args.config.batch_timeout, call).await {
                        Ok(events) => self.start_batch(myself, state, events, permits),
                        // The acks committed with the call, whatever its drain returned.
                        Err(err) => self.drain_failed(myself, state, err).await,
                    };
                }
            }
            Next::Flow | Next::Wait | Next::Retry(_) | Next::Stop => {}
        }
        let fence = &state.args.fence;
        let call = state.args.outbox.ack_fenced(fence, tenant, acks);
        if let Err(err) = store::within(state.args.config.batch_timeout, call).await {
            return Self::store_failed(myself, err);
        }
        // A retry's timer is the window's (`Next::Retry`).
        if settled.next == Next::Stop {
            myself.stop(Some(StopReason::Finished.as_str().into()));
        }
        Ok(())
    }

    /// Acts on a refused branch: a WARN on its first refusal and a later drain, or parking it
    /// in PostgreSQL (with a WARN and a counter).
    async fn refused(
        &self,
        state: &mut DrainerState,
        refusal: &Refusal,
    ) -> Result<(), store::Error> {
        let Refusal {
            branch,
            reason,
            attempts,
            action,
        } = refusal;
        match *action {
            RefusalAction::RetryAfter(_) => {
                // Its timer is the window's.
                if *attempts == 1 && *reason == Outcome::NoRoom.label() {
                    let (branches, warn) = state.no_room.refused();
                    if warn {
                        tracing::warn!(branch = %branch, branches, reason, "the broker has no room for an event (its store is full, or the stream at its limits): its branches wait and are retried, never parked (branches: of this tenant so far)");
                    } else {
                        tracing::debug!(branch = %branch, branches, reason, "no room for a branch");
                    }
                } else if *attempts == 1 {
                    tracing::warn!(branch = %branch, reason, "the broker refused an event; retrying its branch alone");
                }
            }
            RefusalAction::Park { failing_for } => {
                let park_retry = state.args.config.park_retry;
                let call = state.args.outbox.park_branch(
                    branch,
                    reason,
                    *attempts,
                    failing_for,
                    park_retry,
                );
                store::within(state.args.config.batch_timeout, call).await?;
                metrics::counter!("relay_branches_parked_total", "tenant" => branch.tenant.to_string())
                    .increment(1);
                tracing::warn!(branch = %branch, reason, attempts, retry_in_s = park_retry.as_secs(), "branch parked: the broker keeps refusing its events; the rest of the tenant flows (release with `distribution release`)");
            }
        }
        Ok(())
    }

    async fn dispatch(
        &self,
        myself: ActorRef<DrainerMessage>,
        message: DrainerMessage,
        state: &mut DrainerState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            DrainerMessage::Drain => {
                (state.args.report)(myself.get_id(), DrainerReport::WakeTaken);
                return self.drain(&myself, state).await;
            }
            DrainerMessage::Retire { activity } => {
                if state.window.idle_since(activity) {
                    myself.stop(Some(StopReason::Idle.as_str().into()));
                }
                return Ok(());
            }
            DrainerMessage::Tick => {
                let woken = state.window.handle_timeout(Instant::now());
                match woken {
                    Woken::Retire => myself.stop(Some(StopReason::Idle.as_str().into())),
                    Woken::Drain => return self.drain(&myself, state).await,
                    Woken::Nothing => {}
                }
                return Ok(());
            }
            DrainerMessage::Confirmed {
                batch,
                shard,
                outcomes,
            } => state.window.confirmed(batch, shard, outcomes),
            DrainerMessage::Unsent => {}
            DrainerMessage::Publisher { slot, publisher } => {
                state.args.publishers.set(slot, publisher);
                return Ok(());
            }
            DrainerMessage::Resume => {
                if state.window.resume() {
                    return self.drain(&myself, state).await;
                }
                return Ok(());
            }
            DrainerMessage::Finish => {
                state.window.finish();
                if state.window.finished() {
                    myself.stop(Some(StopReason::Finished.as_str().into()));
                }
                return Ok(());
            }
        }
        self.settle(&myself, state).await
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
        let window = Window::new(WindowConfig {
            max_batches: args.config.max_batches_in_flight,
            park_after_attempts: args.config.park_after_attempts,
            nack_grace: args.config.nack_grace,
            retry: args.config.retry,
            express_max_events: args.config.express_max_events,
        });
        Ok(DrainerState {
            args,
            window,
            timer: None,
            no_room: no_room::NoRoomNotice::default(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: DrainerMessage,
        state: &mut DrainerState,
    ) -> Result<(), ActorProcessingErr> {
        let span = tracing::debug_span!("drainer", tenant = %state.args.tenant);
        let handled = self
            .dispatch(myself.clone(), message, state)
            .instrument(span)
            .await;
        state.arm(&myself);
        handled
    }
}

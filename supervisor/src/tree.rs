//! The supervisor actor: carries messages to the [`Core`] (`core.rs`, which decides what runs,
//! waits, restarts and stops) and performs what it returns.
//!
//! ractor has no restart strategies: a child's end arrives here as a supervision event and the
//! core decides. Publishers that fail are respawned after a per-shard backoff that never gives
//! up; drainers that fail are respawned after a per-tenant backoff and resume from the store.
//! When a publisher dies its mailbox dies with it; each batch it held answers its drainer as it
//! is dropped (`actors::Reply`), so what it had is unconfirmed at once and nothing else is told.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actors::{
    Drainer, DrainerArgs, DrainerMessage, DrainerReport, Lanes, PublisherActor, PublisherArgs,
    PublisherDirectory, PublisherMessage, ShardId, StopReason,
};
use broker::{Backoff, RetryPolicy};
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent,
};
use std::collections::HashMap;
use store::{Bucket, Lease, RelayId, Wakeups, bucket_of};
use tokio::sync::{Notify, mpsc};

use crate::core::{Command, Core, CoreConfig, Handle};
use crate::lease_runner::{LeaseRunner, RunnerCall};
use crate::messages::{SupervisorMessage, TreeSnapshot};
use crate::poller::poll_pending;

mod api;
mod gauges;
mod record;
pub use api::{BROKER_CHECK_EVERY, BrokerCheck, SupervisorArgs, SupervisorConfig};
use gauges::{Gauges, tasks_alive};
pub use gauges::{PENDING_GAUGE_CAP, TENANT_GAUGES};

/// A drainer, as the core knows it.
impl Handle for ActorRef<DrainerMessage> {
    type Id = ActorId;
    fn id(&self) -> ActorId {
        self.get_id()
    }
}

/// State of the supervisor: the [`Core`] that decides, and the handles that carry its
/// decisions out (the live publishers, of which each drainer is told, the fence of each lease
/// the core holds, the budgets drainers share, the tasks beside the tree).
pub struct SupervisorState {
    args: SupervisorArgs,
    core: Core<ActorRef<DrainerMessage>>,
    /// The core's next timeout, as armed (`Tick` is sent then).
    armed: Option<Instant>,
    directory: PublisherDirectory,
    /// Events and payload bytes in flight across all drainers.
    budget: Arc<tokio::sync::Semaphore>,
    byte_budget: Arc<tokio::sync::Semaphore>,
    /// The poller's last batch of pending tenants is not handled yet (the poller waits).
    poll_busy: Arc<AtomicBool>,
    /// The fence cell of each lease the core's book holds: written as the core commands,
    /// read by drainers and publishers.
    fences: HashMap<Bucket, Lease>,
    /// Asks the poller for the pending tenants now.
    poll_now: Arc<Notify>,
    poller: Option<tokio::task::JoinHandle<()>>,
    relay_id: RelayId,
    gauges: Arc<Gauges>,
    finishing: Option<RpcReplyPort<()>>,
    wakeups: Option<tokio::task::JoinHandle<()>>,
    lease_runner: Option<(
        mpsc::UnboundedSender<RunnerCall>,
        tokio::task::JoinHandle<()>,
    )>,
}

impl std::fmt::Debug for SupervisorState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorState")
            .field("drainers", &self.core.drainers_alive())
            .finish_non_exhaustive()
    }
}

/// The supervisor actor.
#[derive(Debug, Default)]
pub struct RelaySupervisor;

impl RelaySupervisor {
    /// Records `shard`'s live publisher (or none) and tells every drainer alive, each of which
    /// keeps its own copy of the directory (drainers started later get it at their start).
    fn announce(
        state: &mut SupervisorState,
        shard: ShardId,
        publisher: Option<ActorRef<PublisherMessage>>,
    ) {
        for (_, drainer) in state.core.drainers() {
            let slot = shard;
            let publisher = publisher.clone();
            let _ = drainer.cast(DrainerMessage::Publisher { slot, publisher });
        }
        state.directory.set(shard, publisher);
    }

    /// Carries out what the core decided, feeding it the results, then arms its timer.
    async fn perform(&self, myself: &ActorRef<SupervisorMessage>, state: &mut SupervisorState) {
        while let Some(command) = state.core.poll() {
            match command {
                Command::SpawnDrainer { tenant } => {
                    let Some(fence) = state.fences.get(&bucket_of(&tenant)).map(Lease::fence)
                    else {
                        // The core spawns only in buckets whose fence it opened.
                        tracing::error!(tenant = %tenant, "no fence for a drainer's bucket");
                        state.core.drainer_failed_to_start(tenant, Instant::now());
                        continue;
                    };
                    let supervisor = myself.clone();
                    let args = DrainerArgs {
                        tenant: tenant.clone(),
                        outbox: state.args.outbox.clone(),
                        publishers: state.directory.clone(),
                        budget: state.budget.clone(),
                        byte_budget: state.byte_budget.clone(),
                        report: Arc::new(move |drainer, report| {
                            let _ = supervisor.cast(SupervisorMessage::Drainer(drainer, report));
                        }),
                        fence,
                        config: state.args.config.drainer,
                    };
                    match Actor::spawn_linked(None, Drainer, args, myself.get_cell()).await {
                        Ok((drainer, _)) => {
                            state.core.drainer_started(tenant, drainer, Instant::now());
                        }
                        Err(err) => {
                            tracing::warn!(tenant = %tenant, error = %err, "drainer failed to start");
                            state.core.drainer_failed_to_start(tenant, Instant::now());
                        }
                    }
                }
                Command::SpawnPublisher(shard) => {
                    let supervisor = myself.clone();
                    let args = PublisherArgs {
                        shard,
                        factory: state.args.factory.clone(),
                        on_healthy: Arc::new(move |shard| {
                            let _ = supervisor.cast(SupervisorMessage::PublisherHealthy(shard));
                        }),
                        max_unconfirmed: actors::DEFAULT_MAX_UNCONFIRMED,
                    };
                    match Actor::spawn_linked(None, PublisherActor, args, myself.get_cell()).await {
                        Ok((publisher, _)) => {
                            tracing::debug!(shard = shard.0, "publisher started");
                            state.core.publisher_started(shard, publisher.get_id());
                            Self::announce(state, shard, Some(publisher));
                        }
                        Err(err) => {
                            tracing::warn!(shard = shard.0, error = %err, "publisher failed to start");
                            state.core.publisher_failed_to_start(shard, Instant::now());
                        }
                    }
                }
                Command::PublisherGone(shard) => Self::announce(state, shard, None),
                Command::CheckBroker => match &state.args.check {
                    Some(check) => {
                        let (check, myself) = (check(), myself.clone());
                        tokio::spawn(async move {
                            let answered = check.await;
                            let _ = myself.cast(SupervisorMessage::BrokerChecked(answered));
                        });
                    }
                    None => state.core.broker_checked(false, Instant::now()),
                },
                Command::Drain(drainer) => {
                    let _ = drainer.cast(DrainerMessage::Drain);
                }
                Command::Retire(drainer, activity) => {
                    let _ = drainer.cast(DrainerMessage::Retire { activity });
                }
                Command::Resume(drainer) => {
                    let _ = drainer.cast(DrainerMessage::Resume);
                }
                Command::Finish(drainer) => {
                    let _ = drainer.cast(DrainerMessage::Finish);
                }
                Command::Kill(drainer) => drainer.kill(),
                Command::Lease(call) => {
                    if let Some((runner, _)) = &state.lease_runner {
                        let _ = runner.send(RunnerCall::Lease(call));
                    }
                }
                Command::OpenFence { bucket, held } => {
                    let lease = Lease::new(bucket, state.relay_id.clone(), held.epoch, held.until);
                    if let Some(old) = state.fences.insert(bucket, lease) {
                        old.revoke();
                    }
                }
                Command::ExtendFences { buckets, until } => {
                    for bucket in buckets {
                        if let Some(lease) = state.fences.get(&bucket) {
                            lease.extend(until);
                        }
                    }
                }
                Command::CloseFence(bucket) => {
                    if let Some(lease) = state.fences.remove(&bucket) {
                        lease.revoke();
                    }
                }
                Command::PollNow => state.poll_now.notify_one(),
                Command::Finished => {
                    if let Some(reply) = state.finishing.take() {
                        let _ = reply.send(());
                    }
                    myself.stop(Some("finished".into()));
                }
            }
        }
        while let Some(note) = state.core.poll_note() {
            record::record(note);
        }
        metrics::gauge!("relay_tenants_held").set(state.core.drainers_alive() as f64);
        // One timer: re-armed only when the core's next timeout comes before the armed one
        // (a tick that finds nothing due does nothing).
        if let Some(at) = state.core.poll_timeout()
            && state.armed.is_none_or(|armed| at < armed)
        {
            state.armed = Some(at);
            myself.send_after(at.saturating_duration_since(Instant::now()), || {
                SupervisorMessage::Tick
            });
        }
    }
}

/// Forwards wake-ups to the supervisor until it is gone; reconnects with backoff on failure.
async fn forward_wakeups(
    url: String,
    supervisor: ActorRef<SupervisorMessage>,
    restart: RetryPolicy,
) {
    let mut backoff = Backoff::new(restart);
    loop {
        if let Ok(mut wakeups) = Wakeups::connect(&url).await {
            backoff.reset();
            while let Ok(tenant) = wakeups.next().await {
                if supervisor
                    .cast(SupervisorMessage::Notified(tenant))
                    .is_err()
                {
                    return;
                }
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
        if supervisor.get_status() > ractor::ActorStatus::Running {
            return;
        }
    }
}

impl Actor for RelaySupervisor {
    type Msg = SupervisorMessage;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let lanes = if args.config.drainer.express_max_events > 0 {
            Lanes::BulkAndExpress
        } else {
            Lanes::BulkOnly
        };
        let directory = PublisherDirectory::new(args.config.shards, lanes, args.config.sharding);
        let core = Core::new(CoreConfig {
            publishers: directory.slots(),
            max_drainers: args.config.max_drainers,
            restart: args.config.restart,
            finish_grace: args.config.finish_grace,
            broker_check: args.check.as_ref().map(|_| BROKER_CHECK_EVERY),
            lease: args.config.lease,
        });
        Ok(SupervisorState {
            core,
            armed: None,
            directory,
            // A budget below one batch would deadlock a drainer waiting for a full batch.
            budget: Arc::new(tokio::sync::Semaphore::new(
                args.config
                    .max_in_flight
                    .max(args.config.drainer.batch_size as usize),
            )),
            byte_budget: Arc::new(tokio::sync::Semaphore::new(
                args.config
                    .max_in_flight_bytes
                    .max(args.config.drainer.batch_max_bytes as usize),
            )),
            poll_busy: Arc::new(AtomicBool::new(false)),
            fences: HashMap::new(),
            poll_now: Arc::new(Notify::new()),
            poller: None,
            relay_id: RelayId::generate(),
            gauges: Arc::default(),
            finishing: None,
            wakeups: None,
            lease_runner: None,
            args,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        self.perform(&myself, state).await;
        state.wakeups = Some(tokio::spawn(forward_wakeups(
            state.args.database_url.clone(),
            myself.clone(),
            state.args.config.restart,
        )));
        let runner = LeaseRunner {
            leases: state.args.leases.clone(),
            me: state.relay_id.clone(),
            config: state.args.config.lease,
            sightings: crate::core::Sightings::new(state.args.config.lease.ttl),
        };
        let (calls, called) = mpsc::unbounded_channel();
        state.lease_runner = Some((calls, tokio::spawn(runner.run(myself.clone(), called))));
        // The poll runs beside the lease calls, so a slow poll never delays a renewal.
        state.poller = Some(tokio::spawn(poll_pending(
            state.args.outbox.clone(),
            myself.clone(),
            state.args.config.poll_interval,
            state.poll_now.clone(),
            state.poll_busy.clone(),
        )));
        state.core.start_leases(Instant::now());
        self.perform(&myself, state).await;
        myself.cast(SupervisorMessage::MetricsTick)?;
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(wakeups) = state.wakeups.take() {
            wakeups.abort();
        }
        if let Some(poller) = state.poller.take() {
            poller.abort();
        }
        // Hand the buckets over at once (bounded: they expire by themselves otherwise): every
        // fence closes first, then the lease runner releases and leaves.
        let leases = state.core.leave_all();
        while let Some(note) = state.core.poll_note() {
            record::record(note);
        }
        for (_, lease) in state.fences.drain() {
            lease.revoke();
        }
        if let Some((calls, runner)) = state.lease_runner.take() {
            let _ = calls.send(RunnerCall::Leave(leases));
            drop(calls);
            let _ = tokio::time::timeout(Duration::from_secs(3), runner).await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: SupervisorMessage,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let now = Instant::now();
        match message {
            SupervisorMessage::LeaseBeaten { members, renewed } => {
                let blocked = state.args.broker.blocked();
                state.core.lease_beaten(members, renewed, blocked, now);
            }
            SupervisorMessage::LeaseClaimed(claimed) => state.core.lease_claimed(claimed, now),
            SupervisorMessage::Pending(tenants) => {
                state.core.pending(tenants, now);
                state.poll_busy.store(false, Ordering::Release);
            }
            SupervisorMessage::Notified(tenant) => state.core.notified(tenant, now),
            SupervisorMessage::PublisherHealthy(shard) => state.core.publisher_healthy(shard),
            SupervisorMessage::Drainer(drainer, DrainerReport::WakeTaken) => {
                state.core.drainer_took_wake(drainer)
            }
            SupervisorMessage::Drainer(drainer, DrainerReport::Idle { activity }) => {
                state.core.drainer_idle(drainer, activity)
            }
            SupervisorMessage::BrokerChecked(answered) => state.core.broker_checked(answered, now),
            SupervisorMessage::Tick => {
                state.armed = None;
                state.core.handle_timeout(now);
            }
            SupervisorMessage::MetricsTick => {
                self.keep_series_alive(state);
                self.refresh_metrics(state);
                myself.send_after(state.args.config.metrics_interval, || {
                    SupervisorMessage::MetricsTick
                });
            }
            SupervisorMessage::Snapshot(reply) => {
                let snapshot = TreeSnapshot {
                    publishers: (0..state.directory.slots())
                        .map(|slot| state.directory.get(ShardId(slot)))
                        .collect(),
                    drainers: state
                        .core
                        .drainers()
                        .map(|(tenant, drainer)| (tenant.clone(), drainer.clone()))
                        .collect(),
                    buckets_held: state.core.buckets_held(),
                    relay_id: state.relay_id.clone(),
                    tasks_alive: tasks_alive(),
                };
                let _ = reply.send(snapshot);
            }
            SupervisorMessage::Finish(reply) => {
                state.finishing = Some(reply);
                state.core.finish(now);
            }
        }
        self.perform(&myself, state).await;
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why): (ActorCell, String) = match event {
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped".into()))
            }
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            _ => return Ok(()),
        };
        let stop = StopReason::parse(&why);
        state
            .core
            .child_ended(cell.get_id(), &why, stop, Instant::now());
        self.perform(&myself, state).await;
        Ok(())
    }
}

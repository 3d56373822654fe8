//! The supervisor actor and its restart policy.
//!
//! ractor has no restart strategies: a child's end arrives here as a supervision event and this
//! actor decides. Publishers that fail are respawned after a per-shard backoff that never gives
//! up; drainers that fail are respawned after a per-tenant backoff and resume from the store.
//! When a publisher dies its mailbox dies with it; each batch it held answers its drainer as it
//! is dropped (`actors::Reply`), so what it had is unconfirmed at once and nothing else is told.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::{
    Backoff, Drainer, DrainerArgs, DrainerConfig, DrainerMessage, PublisherActor, PublisherArgs,
    PublisherDirectory, PublisherFactory, PublisherMessage, RetryPolicy, ShardId, stop_reason,
};
use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent,
};
use store::{
    Bucket, Fence, LeaseChanges, LeaseStore, Outbox, RelayId, TenantId, Wakeups, bucket_of,
};
use tokio::sync::watch;

use crate::keeper::{Keeper, LeaseConfig};
use crate::waiting::Waiting;

/// How the tree runs.
#[derive(Clone, Copy, Debug)]
pub struct SupervisorConfig {
    /// Number of publisher shards. Each has a bulk publisher and, unless
    /// `drainer.express_max_events` is 0, an express one: an actor and an AMQP connection
    /// each ([`SupervisorConfig::publishers`]). Default 4.
    pub shards: u16,
    /// How often pending tenants are polled: the correctness path behind NOTIFY. Default 1 s.
    pub poll_interval: Duration,
    /// Lease TTL and heartbeat (ownership of tenants across relays).
    pub lease: LeaseConfig,
    /// How often backlog gauges are refreshed. Default 5 s.
    pub metrics_interval: Duration,
    /// Drainer batch size, timeouts and retry delays.
    pub drainer: DrainerConfig,
    /// Delays between restarts of a failed actor. Default 100 ms doubling to 5 s.
    pub restart: RetryPolicy,
    /// How long a graceful shutdown, and a planned lease handover, wait for batches in
    /// flight before giving them up (they are sent again by whoever drains next). Default 10 s.
    pub finish_grace: Duration,
    /// Most events in flight (drained, not yet acked) across all drainers: bounds the relay's
    /// memory whatever the backlog. At least `drainer.batch_size`. Default 10,000.
    pub max_in_flight: usize,
    /// Most payload bytes in flight across all drainers (drained, queued at a publisher, or
    /// awaiting confirms). At least `drainer.batch_max_bytes`. Default 32 MiB.
    pub max_in_flight_bytes: usize,
    /// Most drainers alive at once. Beyond it, tenants with pending intents wait their turn
    /// (first come, first served) and drainers with nothing left retire at once instead of
    /// after `drainer.idle_retire`; memory stays bounded with any number of tenants.
    /// Default 1,000.
    pub max_drainers: usize,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        Self {
            shards: 4,
            poll_interval: Duration::from_secs(1),
            lease: LeaseConfig::default(),
            metrics_interval: Duration::from_secs(5),
            drainer: DrainerConfig::default(),
            restart: RetryPolicy::default(),
            finish_grace: Duration::from_secs(10),
            max_in_flight: 10_000,
            max_in_flight_bytes: 32 << 20,
            max_drainers: 1_000,
        }
    }
}

impl SupervisorConfig {
    /// Number of publishers (actors, AMQP connections): the shards, twice with an express lane.
    pub fn publishers(&self) -> u16 {
        let lanes = if self.drainer.express_max_events > 0 {
            2
        } else {
            1
        };
        self.shards.max(1) * lanes
    }
}

/// Arguments of the supervisor.
#[derive(Clone)]
pub struct SupervisorArgs {
    /// The outbox (its pool).
    pub outbox: Outbox,
    /// The lease tables, on a pool of their own so heartbeats never queue behind drains.
    pub leases: LeaseStore,
    /// Where wake-ups (LISTEN) connect (a dedicated connection).
    pub database_url: String,
    /// Makes each shard's broker client.
    pub factory: PublisherFactory,
    /// What the publishers report about the broker (a handover is not forced while it holds a
    /// connection blocked).
    pub broker: broker::BrokerHealth,
    /// Tree shape and timings.
    pub config: SupervisorConfig,
}

impl std::fmt::Debug for SupervisorArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorArgs")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The live actors, for status and for tests that kill them.
#[derive(Clone, Debug)]
pub struct TreeSnapshot {
    /// Publisher of each slot (none while restarting): the bulk lane's shards, then the
    /// express lane's.
    pub publishers: Vec<Option<ActorRef<PublisherMessage>>>,
    /// Drainer of each tenant this relay is draining now.
    pub drainers: BTreeMap<TenantId, ActorRef<DrainerMessage>>,
    /// Lease buckets this relay holds.
    pub buckets_held: usize,
    /// This relay's id in the lease tables.
    pub relay_id: RelayId,
    /// Tasks alive on the relay's runtime (actors, timers, connections): bounded by the
    /// drainers alive, never by the tenants seen (`relay_runtime_tasks`).
    pub tasks_alive: usize,
}

/// `relay_backlog_pending` counts up to this many intents per tenant, so the gauges' read costs
/// at most `max_drainers` x this many index entries whatever the backlog (at 1M pending in 50
/// tenants, a full count took 400 ms every tick). A tenant this far behind shows it in
/// `relay_backlog_oldest_age_seconds`, which stays exact; `distribution status` counts all.
pub const PENDING_GAUGE_CAP: u32 = 1_000;

/// The backlog gauges (`relay_backlog_pending`, `relay_backlog_oldest_age_seconds`) carry at
/// most this many tenants, those with the oldest intents among the ones being drained: a series
/// per tenant drained made memory and scrapes grow with the tenants seen (3 series per tenant,
/// about 30 MB at 40,000 tenants). A tenant leaving the set is reported at 0 once, then its
/// series expires (`distribution::SERIES_IDLE_TIMEOUT`).
pub const TENANT_GAUGES: usize = 100;

/// The `limit` tenants with the oldest pending intents, oldest first, of those read: the only
/// ones given backlog gauges, so series per tenant never grow with the tenants drained (1,000
/// at a time, 100,000 within minutes at scale).
fn furthest_behind(mut backlog: Vec<store::Backlog>, limit: usize) -> Vec<store::Backlog> {
    backlog.retain(|tenant| tenant.pending > 0);
    backlog.sort_by_key(|tenant| std::cmp::Reverse(tenant.oldest_age));
    backlog.truncate(limit);
    backlog
}

/// Tasks alive on the relay's runtime (the supervisor runs on it).
fn tasks_alive() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Messages to the supervisor.
#[derive(Debug)]
pub enum SupervisorMessage {
    /// The lease keeper gained or lost buckets.
    Leases(LeaseChanges),
    /// The lease keeper hands these buckets over (a planned move): no drainer starts on them,
    /// their drainers finish what they have in flight, and each bucket is reported settled
    /// to the keeper once none is left (their fences stay open until then).
    HandOver(Vec<Bucket>),
    /// Every tenant with pending intents, from the poller (sent empty too: waiting tenants
    /// it no longer lists leave the queue); those in buckets held are drained.
    Pending(Vec<TenantId>),
    /// Refresh backlog gauges.
    MetricsTick,
    /// A tenant's intents just committed.
    Notified(TenantId),
    /// Respawn a shard's publisher (after its backoff).
    RespawnPublisher(ShardId),
    /// Respawn a tenant's drainer (after its backoff).
    RespawnDrainer(TenantId),
    /// A shard's publisher published successfully: reset its backoff.
    PublisherHealthy(ShardId),
    /// The live actors.
    Snapshot(RpcReplyPort<TreeSnapshot>),
    /// Graceful shutdown: let drainers finish their batch, then stop.
    Finish(RpcReplyPort<()>),
    /// The grace period of `Finish` ran out.
    FinishDeadline,
}

/// State of the supervisor.
pub struct SupervisorState {
    args: SupervisorArgs,
    directory: PublisherDirectory,
    publisher_ids: HashMap<ActorId, ShardId>,
    publisher_backoff: Vec<Backoff>,
    drainers: HashMap<TenantId, ActorRef<DrainerMessage>>,
    /// Per drainer: a wake-up is queued in its mailbox (wake-ups coalesce: at most one).
    woken: HashMap<TenantId, Arc<AtomicBool>>,
    /// The poller's last batch of pending tenants is not handled yet (the poller waits).
    poll_busy: Arc<AtomicBool>,
    /// Live drainers by actor id, with when each was spawned.
    drainer_ids: HashMap<ActorId, (TenantId, std::time::Instant)>,
    drainer_backoff: HashMap<TenantId, Backoff>,
    /// Fences of the buckets held (and not being handed over).
    held: HashMap<Bucket, Fence>,
    /// Buckets being handed over: their drainers finish, none starts.
    leaving: HashSet<Bucket>,
    /// Tells the keeper a bucket being handed over has no drainer left.
    settled: Option<tokio::sync::mpsc::UnboundedSender<Bucket>>,
    relay_id: RelayId,
    gauged: Arc<Mutex<HashSet<TenantId>>>,
    parked_gauged: Arc<Mutex<HashSet<TenantId>>>,
    finishing: Option<RpcReplyPort<()>>,
    wakeups: Option<tokio::task::JoinHandle<()>>,
    keeper: Option<(watch::Sender<bool>, tokio::task::JoinHandle<()>)>,
    metrics_busy: Arc<AtomicBool>,
    budget: Arc<tokio::sync::Semaphore>,
    byte_budget: Arc<tokio::sync::Semaphore>,
    /// Tenants with pending intents waiting for a drainer slot (`max_drainers`), in order.
    waiting: Waiting,
    /// Set while tenants wait: drainers with nothing to do retire at once.
    crowded: Arc<AtomicBool>,
}

impl std::fmt::Debug for SupervisorState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SupervisorState")
            .field("drainers", &self.drainers.len())
            .finish_non_exhaustive()
    }
}

/// The supervisor actor.
#[derive(Debug, Default)]
pub struct RelaySupervisor;

/// Logs a restart storm without flooding: the 1st, 2nd, 4th, 8th... consecutive failure at WARN.
fn storm_worthy(failures: u64) -> bool {
    failures.is_power_of_two()
}

impl RelaySupervisor {
    async fn spawn_publisher(
        &self,
        myself: &ActorRef<SupervisorMessage>,
        state: &mut SupervisorState,
        shard: ShardId,
    ) {
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
                state.publisher_ids.insert(publisher.get_id(), shard);
                state.directory.set(shard, Some(publisher));
            }
            Err(err) => {
                tracing::warn!(shard = shard.0, error = %err, "publisher failed to start");
                let delay = state.publisher_backoff[usize::from(shard.0)].next_delay();
                myself.send_after(delay, move || SupervisorMessage::RespawnPublisher(shard));
            }
        }
    }

    async fn spawn_drainer(
        &self,
        myself: &ActorRef<SupervisorMessage>,
        state: &mut SupervisorState,
        tenant: TenantId,
    ) {
        if state.drainers.contains_key(&tenant) || state.finishing.is_some() {
            return;
        }
        if state.drainers.len() >= state.args.config.max_drainers.max(1) {
            state.waiting.push(tenant);
            state.crowded.store(true, Ordering::Release);
            return;
        }
        let woken = Arc::new(AtomicBool::new(false));
        let Some(fence) = state
            .held
            .get(&bucket_of(&tenant))
            .filter(|fence| fence.is_open())
            .cloned()
        else {
            return;
        };
        let args = DrainerArgs {
            tenant: tenant.clone(),
            outbox: state.args.outbox.clone(),
            publishers: state.directory.clone(),
            budget: state.budget.clone(),
            byte_budget: state.byte_budget.clone(),
            woken: woken.clone(),
            crowded: state.crowded.clone(),
            fence,
            config: state.args.config.drainer,
        };
        match Actor::spawn_linked(None, Drainer, args, myself.get_cell()).await {
            Ok((drainer, _)) => {
                state.drainer_ids.insert(
                    drainer.get_id(),
                    (tenant.clone(), std::time::Instant::now()),
                );
                state.woken.insert(tenant.clone(), woken);
                state.drainers.insert(tenant, drainer);
            }
            Err(err) => {
                tracing::warn!(tenant = %tenant, error = %err, "drainer failed to start");
                self.schedule_drainer(myself, state, tenant);
            }
        }
    }

    /// Gives free drainer slots to waiting tenants, in order.
    async fn admit_waiting(
        &self,
        myself: &ActorRef<SupervisorMessage>,
        state: &mut SupervisorState,
    ) {
        while state.drainers.len() < state.args.config.max_drainers.max(1)
            && let Some(tenant) = state.waiting.pop()
        {
            self.spawn_drainer(myself, state, tenant).await;
        }
        if state.waiting.is_empty() {
            state.crowded.store(false, Ordering::Release);
        }
    }

    fn schedule_drainer(
        &self,
        myself: &ActorRef<SupervisorMessage>,
        state: &mut SupervisorState,
        tenant: TenantId,
    ) {
        let backoff = state
            .drainer_backoff
            .entry(tenant.clone())
            .or_insert_with(|| Backoff::new(state.args.config.restart));
        let delay = backoff.next_delay();
        myself.send_after(delay, move || SupervisorMessage::RespawnDrainer(tenant));
    }

    /// Drains `tenants` (in buckets this relay holds): wakes their drainers, starts missing ones.
    async fn wake(
        &self,
        myself: &ActorRef<SupervisorMessage>,
        state: &mut SupervisorState,
        tenants: Vec<TenantId>,
    ) {
        self.admit_waiting(myself, state).await;
        for tenant in tenants {
            if !state.held.contains_key(&bucket_of(&tenant)) {
                continue;
            }
            match state.drainers.get(&tenant) {
                Some(drainer) => {
                    // Coalesced: a drainer busy for a while gets one wake-up, not one per poll.
                    let queued = state
                        .woken
                        .get(&tenant)
                        .is_some_and(|woken| woken.swap(true, Ordering::AcqRel));
                    if !queued {
                        let _ = drainer.cast(DrainerMessage::Drain);
                    }
                }
                None => self.spawn_drainer(myself, state, tenant).await,
            }
        }
        metrics::gauge!("relay_tenants_held").set(state.drainers.len() as f64);
    }

    /// The keeper gained or lost buckets. Lost fences are already closed (nothing more is
    /// published or acked under them); their drainers are stopped now and not restarted.
    fn leases_changed(&self, state: &mut SupervisorState, changes: LeaseChanges) {
        for bucket in &changes.lost {
            state.held.remove(bucket);
            state.leaving.remove(bucket);
        }
        for fence in changes.gained {
            if let Some((bucket, _, _)) = fence.lease() {
                state.held.insert(bucket, fence);
            }
        }
        if changes.lost.is_empty() {
            return;
        }
        let lost: HashSet<Bucket> = changes.lost.into_iter().collect();
        let dropped: Vec<TenantId> = state
            .drainers
            .keys()
            .filter(|tenant| lost.contains(&bucket_of(tenant)))
            .cloned()
            .collect();
        for tenant in dropped {
            if let Some(drainer) = state.drainers.remove(&tenant) {
                state.drainer_ids.remove(&drainer.get_id());
                drainer.kill();
            }
            state.woken.remove(&tenant);
            state.drainer_backoff.remove(&tenant);
        }
        metrics::gauge!("relay_tenants_held").set(state.drainers.len() as f64);
    }

    /// A planned handover of `buckets`: they leave `held`, so no drainer starts on them (nor
    /// restarts, nor leaves the waiting queue); their drainers finish their batches in flight
    /// under fences still open. A bucket with no drainer is settled at once.
    fn hand_over(&self, state: &mut SupervisorState, buckets: Vec<Bucket>) {
        for bucket in &buckets {
            state.held.remove(bucket);
            state.leaving.insert(*bucket);
        }
        let leaving: HashSet<Bucket> = buckets.into_iter().collect();
        let mut busy = HashSet::new();
        for (tenant, drainer) in &state.drainers {
            let bucket = bucket_of(tenant);
            if leaving.contains(&bucket) {
                busy.insert(bucket);
                let _ = drainer.cast(DrainerMessage::Finish);
            }
        }
        for bucket in leaving.difference(&busy) {
            self.settled(state, *bucket);
        }
    }

    /// Tells the keeper `bucket` (being handed over) has no drainer left.
    fn settled(&self, state: &SupervisorState, bucket: Bucket) {
        if let Some(settled) = &state.settled {
            let _ = settled.send(bucket);
        }
    }

    /// Touches the relay's fixed series (counters registered at zero, gauges without a tenant)
    /// so that a recorder dropping idle series (`distribution::prometheus_builder`) never drops
    /// them; per-tenant series of quiet tenants do expire.
    fn keep_series_alive(&self, state: &SupervisorState) {
        metrics::gauge!("relay_tenants_held").set(state.drainers.len() as f64);
        metrics::gauge!("relay_runtime_tasks").set(tasks_alive() as f64);
        metrics::counter!("relay_drainer_restarts_total").increment(0);
        metrics::counter!("relay_leases_lost_total").increment(0);
        metrics::counter!("relay_broker_refusals_total").increment(0);
        for slot in 0..state.directory.slots() {
            let shard = slot.to_string();
            metrics::counter!("relay_publisher_restarts_total", "shard" => shard.clone())
                .increment(0);
            for outcome in actors::FAILURE_OUTCOMES {
                metrics::counter!("relay_publish_failures_total", "shard" => shard.clone(), "outcome" => outcome)
                    .increment(0);
            }
        }
    }

    /// Reads the backlog of the tenants being drained for the lag gauges, on a task of its
    /// own (a slow query never holds the supervisor's mailbox); at most one read at a time,
    /// each under a timeout. Its cost is bounded whatever the backlog: per tenant, one index
    /// probe for the oldest intent and a count that stops at [`PENDING_GAUGE_CAP`].
    fn refresh_metrics(&self, state: &mut SupervisorState) {
        if state.metrics_busy.swap(true, Ordering::AcqRel) {
            return;
        }
        let outbox = state.args.outbox.clone();
        let busy = state.metrics_busy.clone();
        let gauged = state.gauged.clone();
        let parked_gauged = state.parked_gauged.clone();
        let limit = state
            .args
            .config
            .metrics_interval
            .max(Duration::from_secs(1))
            * 5;
        let draining: Vec<TenantId> = state.drainers.keys().cloned().collect();
        tokio::spawn(async move {
            let backlog =
                tokio::time::timeout(limit, outbox.backlog_of(&draining, PENDING_GAUGE_CAP)).await;
            let backlog = match backlog {
                Ok(Ok(backlog)) => Some(backlog),
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, "cannot read the backlog for metrics");
                    None
                }
                Err(_) => {
                    tracing::warn!("backlog read for metrics timed out");
                    None
                }
            };
            if let Some(backlog) = backlog {
                let mut seen = HashSet::new();
                for tenant in furthest_behind(backlog, TENANT_GAUGES) {
                    let label = tenant.tenant.to_string();
                    metrics::gauge!("relay_backlog_pending", "tenant" => label.clone())
                        .set(tenant.pending as f64);
                    metrics::gauge!("relay_backlog_oldest_age_seconds", "tenant" => label)
                        .set(tenant.oldest_age.as_secs_f64());
                    seen.insert(tenant.tenant);
                }
                let mut gauged = gauged.lock().unwrap_or_else(|poison| poison.into_inner());
                for tenant in gauged.difference(&seen) {
                    let label = tenant.to_string();
                    metrics::gauge!("relay_backlog_pending", "tenant" => label.clone()).set(0.0);
                    metrics::gauge!("relay_backlog_oldest_age_seconds", "tenant" => label).set(0.0);
                }
                *gauged = seen;
            }
            // Parked branches per tenant (a small table: only what the broker kept refusing).
            if let Ok(Ok(parked)) = tokio::time::timeout(limit, outbox.parked_branches()).await {
                let mut counts: HashMap<TenantId, usize> = HashMap::new();
                for branch in parked {
                    *counts.entry(branch.branch.tenant).or_default() += 1;
                }
                let mut parked_gauged = parked_gauged
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner());
                for tenant in parked_gauged.iter() {
                    if !counts.contains_key(tenant) {
                        metrics::gauge!("relay_parked_branches", "tenant" => tenant.to_string())
                            .set(0.0);
                    }
                }
                for (tenant, count) in &counts {
                    metrics::gauge!("relay_parked_branches", "tenant" => tenant.to_string())
                        .set(*count as f64);
                }
                *parked_gauged = counts.into_keys().collect();
            }
            busy.store(false, Ordering::Release);
        });
    }

    fn finish_if_done(&self, myself: &ActorRef<SupervisorMessage>, state: &mut SupervisorState) {
        if state.drainers.is_empty()
            && let Some(reply) = state.finishing.take()
        {
            let _ = reply.send(());
            myself.stop(Some("finished".into()));
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
        let directory = PublisherDirectory::new(
            args.config.shards,
            args.config.drainer.express_max_events > 0,
        );
        Ok(SupervisorState {
            publisher_backoff: (0..directory.slots())
                .map(|_| Backoff::new(args.config.restart))
                .collect(),
            directory,
            publisher_ids: HashMap::new(),
            drainers: HashMap::new(),
            woken: HashMap::new(),
            poll_busy: Arc::new(AtomicBool::new(false)),
            drainer_ids: HashMap::new(),
            drainer_backoff: HashMap::new(),
            held: HashMap::new(),
            leaving: HashSet::new(),
            settled: None,
            relay_id: RelayId::generate(),
            gauged: Arc::new(Mutex::new(HashSet::new())),
            parked_gauged: Arc::new(Mutex::new(HashSet::new())),
            finishing: None,
            wakeups: None,
            keeper: None,
            metrics_busy: Arc::new(AtomicBool::new(false)),
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
            waiting: Waiting::default(),
            crowded: Arc::new(AtomicBool::new(false)),
            args,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        for slot in 0..state.directory.slots() {
            self.spawn_publisher(&myself, state, ShardId(slot)).await;
        }
        state.wakeups = Some(tokio::spawn(forward_wakeups(
            state.args.database_url.clone(),
            myself.clone(),
            state.args.config.restart,
        )));
        let keeper = Keeper {
            leases: state.args.leases.clone(),
            outbox: state.args.outbox.clone(),
            me: state.relay_id.clone(),
            config: state.args.config.lease,
            poll_interval: state.args.config.poll_interval,
            poll_busy: state.poll_busy.clone(),
            handover_grace: state.args.config.finish_grace,
            broker: state.args.broker.clone(),
        };
        let (stop, stopped) = watch::channel(false);
        let (settled, settled_rx) = tokio::sync::mpsc::unbounded_channel();
        state.settled = Some(settled);
        state.keeper = Some((
            stop,
            tokio::spawn(keeper.run(myself.clone(), stopped, settled_rx)),
        ));
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
        // Hand the buckets over at once (bounded: they expire by themselves otherwise).
        if let Some((stop, keeper)) = state.keeper.take() {
            let _ = stop.send(true);
            let _ = tokio::time::timeout(Duration::from_secs(3), keeper).await;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: SupervisorMessage,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SupervisorMessage::Leases(changes) => self.leases_changed(state, changes),
            SupervisorMessage::HandOver(buckets) => self.hand_over(state, buckets),
            SupervisorMessage::Pending(tenants) => {
                if state.finishing.is_none() {
                    state.waiting.keep_only(&tenants);
                    self.wake(&myself, state, tenants).await;
                }
                state.poll_busy.store(false, Ordering::Release);
            }
            SupervisorMessage::MetricsTick => {
                self.keep_series_alive(state);
                self.refresh_metrics(state);
                myself.send_after(state.args.config.metrics_interval, || {
                    SupervisorMessage::MetricsTick
                });
            }
            SupervisorMessage::Notified(tenant) => {
                if state.finishing.is_none() {
                    self.wake(&myself, state, vec![tenant]).await;
                }
            }
            SupervisorMessage::RespawnPublisher(shard) => {
                if state.directory.get(shard).is_none() && state.finishing.is_none() {
                    self.spawn_publisher(&myself, state, shard).await;
                }
            }
            SupervisorMessage::RespawnDrainer(tenant) => {
                self.spawn_drainer(&myself, state, tenant).await;
            }
            SupervisorMessage::PublisherHealthy(shard) => {
                let backoff = &mut state.publisher_backoff[usize::from(shard.0)];
                if backoff.failures() > 0 {
                    tracing::info!(
                        shard = shard.0,
                        failures = backoff.failures(),
                        "publisher recovered"
                    );
                }
                backoff.reset();
            }
            SupervisorMessage::Snapshot(reply) => {
                let snapshot = TreeSnapshot {
                    publishers: (0..state.directory.slots())
                        .map(|slot| state.directory.get(ShardId(slot)))
                        .collect(),
                    drainers: state
                        .drainers
                        .iter()
                        .map(|(tenant, drainer)| (tenant.clone(), drainer.clone()))
                        .collect(),
                    buckets_held: state.held.len(),
                    relay_id: state.relay_id.clone(),
                    tasks_alive: tasks_alive(),
                };
                let _ = reply.send(snapshot);
            }
            SupervisorMessage::Finish(reply) => {
                state.finishing = Some(reply);
                for drainer in state.drainers.values() {
                    let _ = drainer.cast(DrainerMessage::Finish);
                }
                myself.send_after(state.args.config.finish_grace, || {
                    SupervisorMessage::FinishDeadline
                });
                self.finish_if_done(&myself, state);
            }
            SupervisorMessage::FinishDeadline => {
                // Batches still in flight are abandoned: they were not acked, so the next relay
                // sends them again (the fold absorbs the duplicates). Nothing is lost.
                for drainer in state.drainers.values() {
                    drainer.kill();
                }
                state.drainers.clear();
                state.woken.clear();
                self.finish_if_done(&myself, state);
            }
        }
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
        let id = cell.get_id();
        if let Some(shard) = state.publisher_ids.remove(&id) {
            // Drainers with batches on it hear of it from each batch's reply as the publisher's
            // mailbox and tasks drop them.
            state.directory.set(shard, None);
            if state.finishing.is_some() {
                return Ok(());
            }
            metrics::counter!("relay_publisher_restarts_total", "shard" => shard.0.to_string())
                .increment(1);
            let backoff = &mut state.publisher_backoff[usize::from(shard.0)];
            let delay = backoff.next_delay();
            if storm_worthy(backoff.failures()) {
                tracing::warn!(shard = shard.0, failures = backoff.failures(), retry_in_ms = delay.as_millis() as u64, reason = %why, "publisher down; restarting");
            } else {
                tracing::debug!(shard = shard.0, failures = backoff.failures(), reason = %why, "publisher down; restarting");
            }
            myself.send_after(delay, move || SupervisorMessage::RespawnPublisher(shard));
        } else if let Some((tenant, spawned)) = state.drainer_ids.remove(&id) {
            state.drainers.remove(&tenant);
            state.woken.remove(&tenant);
            // A drainer that lived longer than the longest delay failed afresh: start its
            // backoff over instead of carrying an old outage's delays forward.
            if spawned.elapsed() > state.args.config.restart.max
                && let Some(backoff) = state.drainer_backoff.get_mut(&tenant)
            {
                backoff.reset();
            }
            if state.finishing.is_some() {
                self.finish_if_done(&myself, state);
                return Ok(());
            }
            metrics::gauge!("relay_tenants_held").set(state.drainers.len() as f64);
            let bucket = bucket_of(&tenant);
            if state.leaving.contains(&bucket)
                && !state
                    .drainers
                    .keys()
                    .any(|other| bucket_of(other) == bucket)
            {
                // The last drainer of a bucket being handed over is done (finished, or failed:
                // then the next owner sends its batch again).
                self.settled(state, bucket);
            }
            let held = state.held.contains_key(&bucket);
            if stop_reason::is_orderly(&why) || !held {
                // Retired (idle), fenced or finished: nothing to restart, nothing to keep.
                tracing::debug!(tenant = %tenant, reason = %why, "drainer stopped");
                state.drainer_backoff.remove(&tenant);
                self.admit_waiting(&myself, state).await;
                return Ok(());
            }
            metrics::counter!("relay_drainer_restarts_total").increment(1);
            tracing::warn!(tenant = %tenant, reason = %why, "drainer down; restarting");
            self.schedule_drainer(&myself, state, tenant);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backlog(tenant: usize, pending: u64, age_secs: u64) -> store::Backlog {
        store::Backlog {
            tenant: TenantId::new(format!("t{tenant}")).expect("valid id"),
            pending,
            oldest_age: Duration::from_secs(age_secs),
        }
    }

    #[test]
    fn only_the_tenants_furthest_behind_get_gauges() {
        // 1,000 tenants being drained, ages scattered, every tenth already empty.
        let read: Vec<_> = (0..1_000)
            .map(|n| {
                backlog(
                    n,
                    if n % 10 == 0 { 0 } else { 5 },
                    (n * 7919 % 1_000) as u64,
                )
            })
            .collect();
        let gauged = furthest_behind(read.clone(), TENANT_GAUGES);
        assert_eq!(gauged.len(), TENANT_GAUGES);
        assert!(gauged.iter().all(|tenant| tenant.pending > 0));
        assert!(
            gauged
                .windows(2)
                .all(|pair| pair[0].oldest_age >= pair[1].oldest_age)
        );
        // Nobody left out is further behind than the last one kept.
        let cut = gauged.last().expect("some").oldest_age;
        let kept: HashSet<&TenantId> = gauged.iter().map(|tenant| &tenant.tenant).collect();
        assert!(read.iter().all(|tenant| {
            kept.contains(&tenant.tenant) || tenant.pending == 0 || tenant.oldest_age <= cut
        }));
        // Fewer than the limit: every tenant with something pending.
        assert_eq!(
            furthest_behind(read[..30].to_vec(), TENANT_GAUGES).len(),
            27
        );
    }
}

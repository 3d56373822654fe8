//! The relay on its own runtime: its own failure domain inside a host process.
//!
//! [`Relay::start`] spawns an OS thread (`outbox-relay-main`) that owns a multi-thread tokio
//! runtime whose workers are named `outbox-relay`. Every actor, every database call of the relay
//! and every broker call runs there, never on a host executor thread, so a stalled host runtime
//! does not stall the relay and the broker client never runs on the execution path. Actor panics
//! are caught by ractor; if the supervisor itself ends, this thread restarts the tree with backoff.
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use actors::{PublisherFactory, ShardId};
use broker::{Backoff, BrokerHealth, Publisher};
use rabbit::RabbitPublisher;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef};
use store::{LeaseStore, Outbox};
use supervisor::{BrokerCheck, RelaySupervisor, SupervisorArgs, SupervisorMessage, TreeSnapshot};
use tokio::sync::{oneshot, watch};

use crate::{ConfigError, RelayConfig};

/// Why a relay could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// PostgreSQL did not answer at start (the database must answer; the broker may be down,
    /// except a NATS server held to a version: [`RelayError::BrokerVersion`]).
    #[error("cannot reach the outbox database: {0}")]
    DatabaseUnreachable(String),
    /// The relay's threads could not be started.
    #[error("cannot start the relay runtime: {0}")]
    Runtime(#[from] std::io::Error),
    /// The NATS server does not meet [`RelayConfig::nats_server_version`], or its version could
    /// not be read: one line saying which.
    #[error("{0}")]
    BrokerVersion(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StopMode {
    Graceful,
    Abort,
}

/// Starts relays.
#[derive(Debug)]
pub struct Relay;

/// A running relay. Dropping it asks for a graceful shutdown without waiting.
#[derive(Debug)]
pub struct RelayHandle {
    stop: Option<oneshot::Sender<StopMode>>,
    done: Option<oneshot::Receiver<()>>,
    tree: watch::Receiver<Option<ActorRef<SupervisorMessage>>>,
    broker: BrokerHealth,
    held_back: store::HeldBack,
}

/// What `/readyz` reads of a running relay (cheap to clone): its lease buckets, and whether
/// its drains are held back for replication.
#[derive(Clone, Debug)]
pub struct RelayProbe {
    tree: watch::Receiver<Option<ActorRef<SupervisorMessage>>>,
    held_back: store::HeldBack,
}

impl RelayProbe {
    /// Lease buckets the relay holds (`None` while its tree restarts, or if it does not answer
    /// within a second).
    pub async fn buckets_held(&self) -> Option<usize> {
        let supervisor = self.tree.borrow().clone()?;
        match supervisor
            .call(SupervisorMessage::Snapshot, Some(Duration::from_secs(1)))
            .await
        {
            Ok(CallResult::Success(snapshot)) => Some(snapshot.buckets_held),
            _ => None,
        }
    }

    /// How long its drains have been held back by `RELAY_PUBLISH_REPLICATED` (none: they are
    /// not).
    pub fn held_back_for(&self) -> Option<Duration> {
        self.held_back.for_how_long()
    }
}

impl Relay {
    /// Starts a relay publishing to RabbitMQ (or NATS JetStream, by [`RelayConfig::broker`]).
    /// Returns once the database answered (an unreachable database, a refused role or a
    /// missing database is an error within about two seconds, naming the cause); the broker
    /// may be down: intents wait until it is back. On NATS with
    /// [`RelayConfig::nats_server_version`] set, the server must answer and meet it first
    /// ([`RelayError::BrokerVersion`]).
    ///
    /// ```no_run
    /// use distribution::{Relay, RelayConfig};
    ///
    /// # async fn host() -> Result<(), Box<dyn std::error::Error>> {
    /// let config = RelayConfig::new(
    ///     "postgres://postgres@127.0.0.1:5432/test",
    ///     "amqp://guest:guest@127.0.0.1:5672/%2f",
    /// );
    /// let relay = Relay::start(config).await?; // its own threads, named "outbox-relay-<n>"
    /// // ... the host commits intents with `store::IntentWriter` ...
    /// relay.shutdown().await; // finishes the batches in flight
    /// # Ok(()) }
    /// ```
    pub async fn start(config: RelayConfig) -> Result<RelayHandle, RelayError> {
        if config.broker == crate::BrokerKind::Nats {
            return Self::start_on_nats(config).await;
        }
        let rabbit = config.rabbit_config()?;
        let probe = config.probe.clone();
        let health = BrokerHealth::new();
        let reported = health.clone();
        let factory: PublisherFactory = Arc::new(move |_shard: ShardId| {
            let publisher = RabbitPublisher::new(rabbit.clone()).with_health(reported.clone());
            let publisher = match &probe {
                Some(probe) => publisher.with_probe(probe.clone()),
                None => publisher,
            };
            Box::new(publisher) as Box<dyn Publisher>
        });
        // While the broker is in doubt, one connection (with the topology's declaration) tells
        // whether it is back: then every publisher restarts and every drainer resumes at once.
        let checked = config.rabbit_config()?;
        let check: BrokerCheck = Arc::new(move || {
            let rabbit = checked.clone();
            Box::pin(async move {
                matches!(
                    rabbit::preflight(&rabbit).await,
                    Ok(broker::Preflight::Ready)
                )
            })
        });
        Self::start_checking(config, factory, health, Some(check)).await
    }

    /// Holds the NATS server to [`RelayConfig::nats_server_version`], if set: one connection
    /// that asks the server its version, nothing declared. [`Relay::start`] calls it on NATS;
    /// the binary calls it before its preflight too, so that a refused relay declares nothing.
    pub async fn check_nats_version(config: &RelayConfig) -> Result<(), RelayError> {
        let Some(required) = &config.nats_server_version else {
            return Ok(());
        };
        let version = nats::server_version(&config.nats_config()?).await;
        nats::version_refusal(version.as_deref(), required).map_err(RelayError::BrokerVersion)
    }

    /// The relay on NATS JetStream: a [`nats::NatsPublisher`] per shard; while the broker is
    /// in doubt, one connection that finds the stream as the relay needs it says it is back.
    /// With [`RelayConfig::nats_server_version`] set, the server is asked its version first,
    /// and the relay does not start if it falls short or does not answer.
    async fn start_on_nats(config: RelayConfig) -> Result<RelayHandle, RelayError> {
        let nats = config.nats_config()?;
        // A configuration refused at the door before any connection.
        config.validate()?;
        Self::check_nats_version(&config).await?;
        let probe = config.probe.clone();
        let health = BrokerHealth::new();
        let reported = health.clone();
        let publishing = nats.clone();
        let factory: PublisherFactory = Arc::new(move |_shard: ShardId| {
            let publisher =
                nats::NatsPublisher::new(publishing.clone()).with_health(reported.clone());
            let publisher = match &probe {
                Some(probe) => publisher.with_probe(probe.clone()),
                None => publisher,
            };
            Box::new(publisher) as Box<dyn Publisher>
        });
        let check: BrokerCheck = Arc::new(move || {
            let nats = nats.clone();
            Box::pin(async move {
                match nats::connect(&nats).await {
                    Ok((_client, context)) => nats::declare(&context, &nats).await.is_ok(),
                    Err(_) => false,
                }
            })
        });
        Self::start_checking(config, factory, health, Some(check)).await
    }

    /// Starts a relay whose shards publish through `factory` (e.g. a fault-injecting broker).
    pub async fn start_with(
        config: RelayConfig,
        factory: PublisherFactory,
    ) -> Result<RelayHandle, RelayError> {
        Self::start_checking(config, factory, BrokerHealth::new(), None).await
    }

    /// Starts the tree; `health` is what its publishers report to (read by readiness, and by
    /// the lease runner: a handover is never forced while the broker holds a connection
    /// blocked, since what was written on it may still land).
    async fn start_checking(
        config: RelayConfig,
        factory: PublisherFactory,
        health: BrokerHealth,
        check: Option<BrokerCheck>,
    ) -> Result<RelayHandle, RelayError> {
        config.validate()?;
        let broker = health.clone();
        let held_back = store::HeldBack::default();
        let reporting = held_back.clone();
        let (ready_tx, ready_rx) = oneshot::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        let (tree_tx, tree_rx) = watch::channel(None);
        // Each relay of this process is numbered in its threads' names ("outbox-relay-2"), so
        // log lines of several relays in one process (tests, a host running two) tell apart.
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let number = STARTED.fetch_add(1, Ordering::Relaxed) + 1;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads)
            .thread_name(format!("outbox-relay-{number}"))
            // lapin logs frames (payloads) at TRACE on the threads that publish; keep them
            // from the host's subscriber on the relay's threads too.
            .on_thread_start(rabbit::quiet_lapin_payload_logs_on_this_thread)
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name(format!("outbox-relay-{number}-main"))
            .spawn(move || {
                let mode = runtime.block_on(run_tree(
                    config, factory, broker, reporting, check, ready_tx, stop_rx, tree_tx,
                ));
                match mode {
                    // A crash, as far as the outside world can tell: sockets drop, leases free.
                    StopMode::Abort => runtime.shutdown_background(),
                    StopMode::Graceful => runtime.shutdown_timeout(Duration::from_secs(5)),
                }
                let _ = done_tx.send(());
            })?;
        match ready_rx.await {
            Ok(Ok(())) => Ok(RelayHandle {
                stop: Some(stop_tx),
                done: Some(done_rx),
                held_back,
                tree: tree_rx,
                broker: health,
            }),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(RelayError::DatabaseUnreachable(
                "the relay thread ended during start".into(),
            )),
        }
    }
}

#[allow(clippy::too_many_arguments)] // the relay thread's whole world, moved in once
async fn run_tree(
    config: RelayConfig,
    factory: PublisherFactory,
    broker: BrokerHealth,
    held_back: store::HeldBack,
    check: Option<BrokerCheck>,
    ready: oneshot::Sender<Result<(), RelayError>>,
    mut stop: oneshot::Receiver<StopMode>,
    tree: watch::Sender<Option<ActorRef<SupervisorMessage>>>,
) -> StopMode {
    let schema = config.schema();
    let pool = match crate::database::relay_pool(
        &config.database_url,
        config.db_connections,
        schema.as_ref(),
    )
    .await
    {
        Ok(pool) => pool,
        Err(why) => {
            let _ = ready.send(Err(RelayError::DatabaseUnreachable(why)));
            return StopMode::Abort;
        }
    };
    let lease_pool = crate::database::lazy_pool(
        &config.database_url,
        2,
        config.supervisor.lease.heartbeat,
        schema.as_ref(),
    );
    let lease_pool = match lease_pool {
        Ok(lease_pool) => lease_pool,
        Err(why) => {
            let _ = ready.send(Err(RelayError::DatabaseUnreachable(why)));
            return StopMode::Abort;
        }
    };
    let _ = ready.send(Ok(()));
    // Retirement runs beside the tree, on the relay's runtime; it ends with this function.
    let _retiring = config.retention.map(|keep| {
        AbortOnDrop(tokio::spawn(retire_loop(
            pool.clone(),
            store::Retention::new(keep),
        )))
    });
    let mut backoff = Backoff::new(config.supervisor.restart);
    loop {
        let args = SupervisorArgs {
            outbox: Outbox::new(pool.clone())
                .replicated(config.replication, config.replication_timeout)
                .reporting(held_back.clone()),
            leases: LeaseStore::new(lease_pool.clone()),
            database_url: config.database_url.clone(),
            factory: factory.clone(),
            broker: broker.clone(),
            check: check.clone(),
            config: config.supervisor_config(),
        };
        let (supervisor, mut ended) = match Actor::spawn(None, RelaySupervisor, args).await {
            Ok(spawned) => spawned,
            Err(err) => {
                tracing::error!(error = %err, "relay supervisor failed to start; retrying");
                tokio::time::sleep(backoff.next_delay()).await;
                continue;
            }
        };
        tree.send_replace(Some(supervisor.clone()));
        tokio::select! {
            mode = &mut stop => {
                // A dropped handle means "shut down gracefully".
                let mode = mode.unwrap_or(StopMode::Graceful);
                if mode == StopMode::Graceful {
                    let grace = config.supervisor.finish_grace + Duration::from_secs(1);
                    let _ = supervisor.call(SupervisorMessage::Finish, Some(grace)).await;
                    supervisor.stop(None);
                    let _ = ended.await;
                }
                tree.send_replace(None);
                return mode;
            }
            _ = &mut ended => {
                tree.send_replace(None);
                let delay = backoff.next_delay();
                tracing::error!(retry_in_ms = delay.as_millis() as u64, "relay supervisor ended; restarting the tree");
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Retires closed and shipped runs (`store::retire_every`), counting them and logging a failure.
async fn retire_loop(pool: sqlx::PgPool, retention: store::Retention) {
    store::retire_every(
        pool,
        retention,
        store::Retiring::Outbox,
        |result| match result {
            Ok(runs) => metrics::counter!("relay_runs_retired_total").increment(runs),
            Err(err) => {
                tracing::warn!(error = %err, "retiring closed runs failed; trying again later")
            }
        },
    )
    .await
}

/// Wakes an embedded relay for a tenant whose intents just committed: the in-process
/// alternative to NOTIFY (see `IntentWriter::with_notify`). Enqueues one message; never blocks,
/// never fails, runs no relay code on the caller's thread. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RelayWaker {
    tree: watch::Receiver<Option<ActorRef<SupervisorMessage>>>,
}

impl RelayWaker {
    /// Tells the relay that `tenant` has newly committed intents.
    pub fn wake(&self, tenant: &store::TenantId) {
        if let Some(supervisor) = self.tree.borrow().as_ref() {
            let _ = supervisor.cast(SupervisorMessage::Notified(tenant.clone()));
        }
    }
}

impl RelayHandle {
    /// A waker for this relay (for hosts that append with `with_notify(false)`).
    pub fn waker(&self) -> RelayWaker {
        RelayWaker {
            tree: self.tree.clone(),
        }
    }

    /// What the relay's publishers last learned about the broker (for readiness probes).
    /// Stays [`broker::BrokerState::Unknown`] for a relay started with its own publishers
    /// ([`Relay::start_with`]).
    pub fn broker_health(&self) -> BrokerHealth {
        self.broker.clone()
    }

    /// This relay's readiness probe (the binary's `/readyz`): `outbox` is best on a small
    /// pool of its own (one connection), so a busy relay pool does not make the probe time
    /// out; more than `max_parked` parked branches is not ready. A relay started with its
    /// own publishers ([`Relay::start_with`]) has no broker health to read: build its probe
    /// with [`crate::Readiness::new`] and the health its publishers report to.
    pub fn readiness(&self, outbox: store::Outbox, max_parked: u64) -> crate::Readiness {
        crate::Readiness::new(outbox, self.broker_health(), self.probe(), max_parked)
    }

    /// What `/readyz` reads of this relay.
    pub fn probe(&self) -> RelayProbe {
        RelayProbe {
            tree: self.tree.clone(),
            held_back: self.held_back.clone(),
        }
    }

    /// The live actors (for status, and for tests that kill them). `None` while restarting.
    pub async fn snapshot(&self) -> Option<TreeSnapshot> {
        let supervisor = self.tree.borrow().clone()?;
        match supervisor
            .call(SupervisorMessage::Snapshot, Some(Duration::from_secs(5)))
            .await
        {
            Ok(CallResult::Success(snapshot)) => Some(snapshot),
            _ => None,
        }
    }

    /// Graceful shutdown: batches in flight finish (or are abandoned unacked after the grace
    /// period, to be sent again by the next relay). Nothing is lost or acked twice.
    pub async fn shutdown(mut self) {
        self.stop_with(StopMode::Graceful).await;
    }

    /// Stops at once, as a crash would: nothing is finished, sockets are dropped, leases freed.
    pub async fn abort(mut self) {
        self.stop_with(StopMode::Abort).await;
    }

    async fn stop_with(&mut self, mode: StopMode) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(mode);
        }
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
    }
}

impl Drop for RelayHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(StopMode::Graceful);
        }
    }
}

//! What the supervisor is given and told: its configuration, arguments and messages.
use std::sync::Arc;
use std::time::Duration;

use actors::{DrainerConfig, PublisherFactory, Sharding};
use broker::RetryPolicy;
use store::{LeaseStore, Outbox};

use crate::core::LeaseConfig;

/// How the tree runs.
#[derive(Clone, Copy, Debug)]
pub struct SupervisorConfig {
    /// Number of publisher shards. Each has a bulk publisher and, unless
    /// `drainer.express_max_events` is 0, an express one: an actor and an AMQP connection
    /// each ([`SupervisorConfig::publishers`]). Default 4.
    pub shards: u16,
    /// How branches are spread over the shards. Default [`Sharding::Branch`]; on streams the
    /// relay uses [`Sharding::Partition`] with one shard per partition.
    pub sharding: Sharding,
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
            sharding: Sharding::Branch,
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

/// Answers whether the broker takes a connection now (see [`SupervisorArgs::check`]).
pub type BrokerCheck = Arc<dyn Fn() -> broker::BoxFuture<'static, bool> + Send + Sync>;

/// How often the broker is checked while it is in doubt (a publisher failed and nothing was
/// confirmed since), once a publisher's restart delay outgrows it.
pub const BROKER_CHECK_EVERY: Duration = Duration::from_millis(500);

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
    /// Whether the broker takes a connection now: asked every [`BROKER_CHECK_EVERY`] while
    /// it is in doubt, so that every publisher restarts and every drainer resumes as soon as
    /// it is back.
    /// `None`: publishers learn of its return by their own restarts alone.
    pub check: Option<BrokerCheck>,
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

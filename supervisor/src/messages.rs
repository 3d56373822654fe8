//! What the supervisor is told: by the lease runner and the poller (lease answers, pending tenants),
//! by drainers and publishers, by its own timers, and by whoever asks for a snapshot. Below
//! the tree and the lease runner, so that neither imports the other for it.
use std::collections::BTreeMap;

use actors::{DrainerMessage, DrainerReport, PublisherMessage, ShardId};
use ractor::{ActorId, ActorRef, RpcReplyPort};
use store::{RelayId, TenantId};

use crate::core::LeasesAt;

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

/// Messages to the supervisor.
#[derive(Debug)]
pub enum SupervisorMessage {
    /// The runner's answer to a heartbeat: the live relays and the leases renewed, with
    /// their epochs (`None`: that call failed).
    LeaseBeaten {
        /// Relays alive, this one included.
        members: Option<u32>,
        /// Leases still this relay's.
        renewed: Option<LeasesAt>,
    },
    /// The runner's answer to a claim: the buckets claimed, with their epochs (`None`: the
    /// call failed).
    LeaseClaimed(Option<LeasesAt>),
    /// Every tenant with pending intents, from the poller (sent empty too: waiting tenants
    /// it no longer lists leave the queue); those in buckets held are drained.
    Pending(Vec<TenantId>),
    /// Refresh backlog gauges.
    MetricsTick,
    /// A tenant's intents just committed.
    Notified(TenantId),
    /// The core's next timeout may be due.
    Tick,
    /// A shard's publisher published successfully: reset its backoff.
    PublisherHealthy(ShardId),
    /// A drainer's report (it took a wake-up, or found nothing to do).
    Drainer(ActorId, DrainerReport),
    /// What a broker check found (true: it took a connection).
    BrokerChecked(bool),
    /// The live actors.
    Snapshot(RpcReplyPort<TreeSnapshot>),
    /// Graceful shutdown: let drainers finish their batch, then stop.
    Finish(RpcReplyPort<()>),
}

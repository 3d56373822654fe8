//! The relay's supervisor: spawns one publisher per shard and one drainer per leased tenant,
//! restarts what fails with backoff, notices new work (NOTIFY + polling), reports lag.
//!
//! - `core`: the decisions (drainers, publishers, leases and their heartbeat, timers), pure.
//!   The leases' settings ([`LeaseConfig`]) and answers ([`LeasesAt`]) live with them.
//! - `lease_runner`: the task that runs the core's lease calls against PostgreSQL.
//! - `calls`: a store call under a time limit, its failures logged throttled.
//! - `poller`: the task that finds tenants with pending intents.
//! - `waiting`: tenants waiting for a drainer slot, in arrival order.
//! - `messages`: what the supervisor is told ([`SupervisorMessage`], [`TreeSnapshot`]).
//! - `tree`: [`RelaySupervisor`], its [`SupervisorArgs`] and [`SupervisorConfig`]; it records
//!   the core's notes (`tree/record.rs`), the only logs and metrics of its decisions.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod calls;
mod core;
mod lease_runner;
mod messages;
mod poller;
mod tree;
mod waiting;

pub use actors::Sharding;
pub use core::LeaseConfig;
pub use core::LeasesAt;
pub use messages::SupervisorMessage;
pub use messages::TreeSnapshot;
pub use tree::RelaySupervisor;
pub use tree::SupervisorArgs;
pub use tree::SupervisorConfig;
pub use tree::{BROKER_CHECK_EVERY, BrokerCheck};
pub use tree::{PENDING_GAUGE_CAP, TENANT_GAUGES};

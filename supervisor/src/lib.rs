//! The relay's supervisor: spawns one publisher per shard and one drainer per leased tenant,
//! restarts what fails with backoff, notices new work (NOTIFY + polling), reports lag.
//!
//! - `core`: the decisions (drainers, publishers, leases and their heartbeat, timers), pure.
//! - `keeper`: the task that runs the core's lease calls against PostgreSQL, the pending-tenant
//!   poll, and [`LeaseConfig`].
//! - `tree`: [`RelaySupervisor`], its [`SupervisorArgs`], [`SupervisorConfig`], [`SupervisorMessage`].
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod core;
mod keeper;
mod tree;
mod waiting;

pub use actors::Sharding;
pub use keeper::LeaseConfig;
pub use tree::LeasesAt;
pub use tree::RelaySupervisor;
pub use tree::SupervisorArgs;
pub use tree::SupervisorConfig;
pub use tree::SupervisorMessage;
pub use tree::TreeSnapshot;
pub use tree::{BROKER_CHECK_EVERY, BrokerCheck};
pub use tree::{PENDING_GAUGE_CAP, TENANT_GAUGES};

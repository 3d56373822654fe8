//! The outbox relay's facade: start the relay from configuration, get a handle, shut it down.
//!
//! - `config`: [`RelayConfig`], read from the environment or built in code; fails fast.
//! - `relay`: [`Relay`] and [`RelayHandle`]: the actor tree on its own runtime threads.
//! - `readiness`: [`Readiness`] (and its [`NotReady`]), the rules of the binary's `/readyz`,
//!   for a host's own probe.
//! - `testing` (feature `test-tools`): `BrokerProxy`, a TCP proxy you own, to take "the broker"
//!   down in a test without stopping it.
//! - `telemetry`: [`describe_metrics`], [`prometheus_builder`] (lag histogram buckets),
//!   [`LogFormat`].
//!
//! The host writes with [`store::IntentWriter`] inside its own transactions; consumers fold into
//! their own tables with [`consumer::Consumer`] over a [`store::Projection`].
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod config;
mod database;
#[cfg(feature = "test-tools")]
mod proxy;
mod readiness;
mod relay;
mod telemetry;

pub use actors::PublisherFactory;
pub use actors::ShardId;
pub use broker;
pub use config::BrokerArgs;
pub use config::BrokerKind;
pub use config::ConfigError;
pub use config::GroupsArgs;
pub use config::QueueSettings;
pub use config::RelayConfig;
pub use config::Settings;
pub use config::unknown_relay_variables;
pub use consumer;
pub use database::connect_options;
pub use database::{APPLICATION_NAME, connect_database};
pub use nats;
pub use rabbit;
pub use readiness::{NotReady, Readiness};
pub use relay::Relay;
pub use relay::RelayError;
pub use relay::RelayHandle;
pub use relay::RelayProbe;
pub use relay::RelayWaker;
pub use store;
pub use supervisor::SupervisorConfig;
pub use supervisor::TreeSnapshot;
pub use supervisor::{PENDING_GAUGE_CAP, TENANT_GAUGES};
pub use telemetry::LAG_BUCKETS;
pub use telemetry::LogFormat;
pub use telemetry::SERIES_IDLE_TIMEOUT;
pub use telemetry::describe_metrics;
pub use telemetry::metric_names;
pub use telemetry::prometheus_builder;

/// Tools for tests of a host or consumer (feature `test-tools`; not for production).
#[cfg(feature = "test-tools")]
pub mod testing {
    pub use crate::proxy::{BrokerProxy, Direction};
}

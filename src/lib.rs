//! The outbox relay's facade: start the relay from configuration, get a handle, shut it down.
//!
//! - `config`: [`RelayConfig`], read from the environment or built in code; fails fast.
//! - `relay`: [`Relay`] and [`RelayHandle`]: the actor tree on its own runtime threads.
//! - `proxy`: [`BrokerProxy`], a TCP proxy you own, to take "the broker" down without stopping it.
//!
//! The host writes with [`store::IntentWriter`] inside its own transactions; consumers fold with
//! [`broker::FoldConsumer`] and [`store::FoldStore`].
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod config;
mod proxy;
mod relay;

pub use broker;
pub use config::ConfigError;
pub use config::RelayConfig;
pub use proxy::BrokerProxy;
pub use relay::Relay;
pub use relay::RelayError;
pub use relay::RelayHandle;
pub use relay::RelayWaker;
pub use store;
pub use supervisor::SupervisorConfig;
pub use supervisor::TreeSnapshot;

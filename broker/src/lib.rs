//! The AMQP side of the relay. The only crate that imports `lapin`.
//!
//! - `topology`: exchange, partition queues and the stable `(TenantId, RunId)` -> partition map.
//! - `wire`: the wire contract: message id, headers, body (see `broker/WIRE.md`).
//! - `port`: the [`Publisher`] port the actors drive, and its [`PublishReport`].
//! - `rabbit`: the RabbitMQ adapter ([`RabbitPublisher`]): lazy connect, confirms, pipelining.
//! - `probe`: [`CallProbe`], records which threads call the broker client.
//! - `consumer`: [`Consumer`], folding into the user's `store::Projection` exactly once (every
//!   partition or a subset, reconnects, dead letters), and [`FoldConsumer`], the same over the
//!   project's own `FoldStore`.
//! - `backoff`: [`Backoff`], retry delays that never give up (the relay's actors use it too).
//! - `error`: the one [`Error`] type.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod backoff;
mod connect;
mod consumer;
mod error;
mod health;
mod port;
mod probe;
mod rabbit;
mod topology;
mod wire;

pub use backoff::Backoff;
pub use backoff::RetryPolicy;
pub use connect::AmqpTls;
pub use connect::DEFAULT_FRAME_MAX;
pub use connect::quiet_lapin_payload_logs_on_this_thread;
pub use consumer::Consumer;
pub use consumer::ConsumerConfig;
pub use consumer::ConsumerProgress;
pub use consumer::DEAD_LETTER_REASON;
pub use consumer::FoldConsumer;
pub use consumer::FoldStats;
pub use error::Error;
pub use error::WireError;
pub use health::BrokerHealth;
pub use health::BrokerState;
pub use port::BoxFuture;
pub use port::Confirms;
pub use port::Outcome;
pub use port::PublishReport;
pub use port::Publisher;
pub use probe::CallProbe;
pub use rabbit::Preflight;
pub use rabbit::RabbitConfig;
pub use rabbit::RabbitPublisher;
pub use rabbit::preflight;
pub use topology::Partition;
pub use topology::QueueType;
pub use topology::Topology;
pub use wire::WIRE_VERSION;
pub use wire::decode;

//! The AMQP side of the relay: the publish path and the contract on the wire. `lapin` is imported
//! only here and in the `consumer` crate (which adds the fold's transactions, and so sqlx).
//!
//! - `topology`: exchange, partition queues and the stable `(TenantId, RunId)` -> partition map.
//! - `wire`: the wire contract: message id, headers, body (see `broker/WIRE.md`).
//! - `dead`: the dead-letter queue read back ([`DeadLetters`]: list, replay, purge).
//! - `tail`: watching events arrive ([`Tail`]: a queue of the watcher's own, read without acks).
//! - `checkup`: an operator's look at the broker ([`checkup`], [`partition_queues`]).
//! - `port`: the [`Publisher`] port the actors drive, and its [`PublishReport`].
//! - `rabbit`: the RabbitMQ adapter ([`RabbitPublisher`]): lazy connect, confirms, pipelining.
//! - `probe`: [`CallProbe`], records which threads call the broker client.
//! - `backoff`: [`Backoff`], retry delays that never give up (the relay's actors use it too).
//! - `error`: the one [`Error`] type.
//! - `scratch` (feature `fixtures`): test topologies deleted at the test process's exit.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod backoff;
mod checkup;
mod connect;
mod dead;
mod error;
mod health;
mod port;
mod probe;
mod rabbit;
#[cfg(feature = "fixtures")]
pub mod scratch;
mod tail;
mod topology;
mod version;
mod wire;

pub use backoff::Backoff;
pub use backoff::RetryPolicy;
pub use checkup::{Checkup, Counted, QueueCount, checkup, partition_queues};
pub use connect::AmqpTls;
pub use connect::ClosingConnection;
pub use connect::DEFAULT_FRAME_MAX;
pub use connect::quiet_lapin_payload_logs_on_this_thread;
pub use dead::BROKER_HEADERS;
pub use dead::DEAD_LETTER_REASON;
pub use dead::DeadFilter;
pub use dead::DeadLetter;
pub use dead::DeadLetters;
pub use error::Error;
pub use error::WireError;
pub use health::BrokerHealth;
pub use health::BrokerState;
pub use port::BoxFuture;
pub use port::Confirms;
pub use port::OnReport;
pub use port::Outcome;
pub use port::PublishReport;
pub use port::Publisher;
pub use port::report_future;
pub use probe::CallProbe;
pub use rabbit::Preflight;
pub use rabbit::RabbitConfig;
pub use rabbit::RabbitPublisher;
pub use rabbit::preflight;
pub use rabbit::{open, within};
pub use tail::{Tail, TailFilter, Tailed};
pub use topology::DEAD_LETTER_DELIVERY_LIMIT;
pub use topology::DEFAULT_DELIVERY_LIMIT;
pub use topology::Group;
pub use topology::Partition;
pub use topology::QueueType;
pub use topology::StreamRetention;
pub use topology::Topology;
pub use topology::partition_of;
pub use version::{BrokerVersion, STREAM_WORKAROUNDS, server_version};
pub use wire::CLOUDEVENTS_COLON_PREFIX;
pub use wire::CLOUDEVENTS_PREFIX;
pub use wire::WIRE_VERSION;
pub use wire::WireMode;
pub use wire::decode;
pub use wire::message_id;
pub use wire::properties as encode;

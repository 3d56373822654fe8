//! The RabbitMQ adapter: the only code that knows lapin (and AMQP 0-9-1). It implements the
//! core's [`broker::Publisher`] port and carries the core's wire contract as AMQP properties;
//! everything here is RabbitMQ's own (queue types, declarations, dead-letter queues, flow
//! control, the server's version and its workarounds).
//!
//! - `topology`: the exchange and the partition and dead-letter queues of each group, declared.
//! - `wire`: the wire contract as AMQP properties and headers ([`encode`], [`decode`]).
//! - `rabbit`: [`RabbitPublisher`]: lazy connect, confirms, pipelining, flow control.
//! - `connect`: connections and channels under timeouts ([`open`], [`within`]), TLS.
//! - `reading`: a consumer's session on the partition queues ([`RabbitReading`]: subscriptions,
//!   a batch acked at once, dead letters confirmed).
//! - `dead`: the dead-letter queues read back ([`DeadLetters`]: list, replay, purge).
//! - `tail`: watching events arrive ([`Tail`]: a queue of the watcher's own, read without acks).
//! - `checkup`: an operator's look at the broker ([`checkup`], [`partition_queues`]).
//! - `version`: the server's version ([`server_version`]) and what it needs worked around.
//! - `scratch` (feature `fixtures`): test topologies deleted at the test process's exit.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod checkup;
mod connect;
mod dead;
mod rabbit;
mod reading;
#[cfg(feature = "fixtures")]
pub mod scratch;
mod tail;
mod topology;
mod version;
mod wire;

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
pub use rabbit::RabbitConfig;
pub use rabbit::RabbitPublisher;
pub use rabbit::preflight;
pub use rabbit::{open, within};
pub use reading::{Deliveries, RabbitDelivery, RabbitReading, StreamOffset};
pub use tail::{Tail, Tailed};
pub use topology::DEAD_LETTER_DELIVERY_LIMIT;
pub use topology::DEFAULT_DELIVERY_LIMIT;
pub use topology::QueueType;
pub use topology::StreamRetention;
pub use topology::Topology;
pub use version::{BrokerVersion, STREAM_WORKAROUNDS, server_version};
pub use wire::decode;
pub use wire::envelope;
pub use wire::properties as encode;

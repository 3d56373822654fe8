//! The broker-neutral core: what the relay's actors and the consumers need from any broker, and
//! the contract every broker carries. No broker client crate is imported here: each broker has
//! an adapter crate of its own (`rabbit`, the RabbitMQ adapter, is the only code that knows
//! lapin), so `store`, `actors` and `supervisor` never change for a second broker.
//!
//! - `port`: the [`Publisher`] port the actors drive, its [`Outcome`]s and [`PublishReport`].
//! - `wire`: the wire contract as an [`Envelope`] (see `broker/WIRE.md`), message ids, modes.
//! - `partition`: the stable `(TenantId, RunId)` -> [`Partition`] map, consumer [`Group`]s.
//! - `health`: [`BrokerHealth`], what the publishers last learned, for readiness probes.
//! - `backoff`: [`Backoff`] and [`RetryPolicy`], retry delays that never give up, and
//!   [`warn_worthy`], which of repeated failures to WARN on.
//! - `probe`: [`CallProbe`], records which threads call the broker client.
//! - `error`: the one [`Error`] type, [`within`] (a call under a timeout), and [`WireError`]
//!   for a message off the contract.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod backoff;
mod dead;
mod error;
mod health;
mod partition;
mod port;
mod probe;
mod wire;

pub use backoff::Backoff;
pub use backoff::RetryPolicy;
pub use backoff::warn_worthy;
pub use dead::DeadFilter;
pub use dead::DeadLetterView;
pub use dead::TailFilter;
pub use dead::event_kind;
pub use dead::event_properties;
pub use error::Error;
pub use error::WireError;
pub use error::within;
pub use health::BlockedMark;
pub use health::BrokerHealth;
pub use health::BrokerState;
pub use health::Preflight;
pub use partition::Group;
pub use partition::Partition;
pub use partition::partition_of;
pub use port::BoxFuture;
pub use port::Confirms;
pub use port::OnReport;
pub use port::Outcome;
pub use port::PublishReport;
pub use port::Publisher;
pub use port::report_future;
pub use probe::CallProbe;
pub use wire::CLOUDEVENTS_COLON_PREFIX;
pub use wire::CLOUDEVENTS_PREFIX;
pub use wire::DEAD_LETTER_REASON;
pub use wire::Envelope;
pub use wire::NUMBER_HEADERS;
pub use wire::OCTET_STREAM;
pub use wire::TYPE_END;
pub use wire::TYPE_INTENT;
pub use wire::TYPE_REWIND;
pub use wire::Value;
pub use wire::WIRE_VERSION;
pub use wire::WireMode;
pub use wire::cloudevents_attributes;
pub use wire::decode;
pub use wire::envelope;
pub use wire::message_id;

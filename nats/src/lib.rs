//! The NATS JetStream adapter: the only code that knows async-nats. It implements the core's
//! [`broker::Publisher`] port over JetStream and carries the core's wire contract as NATS
//! headers.
//!
//! - `config`: [`NatsConfig`]: servers, the stream, the partitions' subjects, timeouts.
//! - `connection`: [`connect`]: the first server that answers, a JetStream context, and the
//!   flag that says the connection lost its server.
//! - `wire`: the envelope as NATS headers ([`headers`], [`decode`]); what cannot travel.
//! - `stream`: the stream declared and read back ([`declare`]), the dead letters' stream's
//!   name ([`dead_letter_stream`]).
//! - `attribute`: what the server's answer to one publish means for its event (pure).
//! - `publisher`: [`NatsPublisher`]: pipelined publishes, acks awaited by a pump, fenced.
//! - `checkup`: what an operator's console reads of the server and the stream ([`checkup`]).
//! - `dead`: a group's dead letters read back, replayed, purged ([`NatsDeadLetters`]).
//! - `reader`: for a consumer: a partition read in stream order ([`PartitionReader`]), dead
//!   letters kept in a stream of their own ([`dead_letter`]).
//! - `tail`: watching events arrive ([`NatsTail`]: ordered consumers from the next message).
//! - `scratch` (feature `fixtures`): test streams deleted at the test process's exit.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod attribute;
mod checkup;
mod config;
mod connection;
mod dead;
mod publisher;
mod reader;
#[cfg(feature = "fixtures")]
pub mod scratch;
mod stream;
mod tail;
mod wire;

pub use attribute::{Answer, Verdict, attribute};
pub use checkup::{NatsCheckup, checkup};
pub use config::{MAX_ACKS_IN_FLIGHT, NatsConfig};
pub use connection::connect;
pub use dead::{NatsDeadLetter, NatsDeadLetters};
pub use publisher::{NatsPublisher, durability_note, preflight, server_version, version_refusal};
pub use reader::{Delivery, PartitionReader, ReadFrom, Reading, dead_letter, declare_dead_letters};
pub use stream::{dead_letter_stream, declare, remove};
pub use tail::{NatsTail, NatsTailed};
pub use wire::{
    CONTENT_TYPE, CORRELATION_ID, EXPECTED_STREAM, MSG_ID, TYPE, Unwritable, decode, envelope,
    headers,
};

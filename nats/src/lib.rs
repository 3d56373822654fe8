//! The NATS JetStream adapter: the only code that knows async-nats. It implements the core's
//! [`broker::Publisher`] port over JetStream and carries the core's wire contract as NATS
//! headers.
//!
//! - `config`: [`NatsConfig`]: servers, the stream, the partitions' subjects, timeouts.
//! - `wire`: the envelope as NATS headers ([`headers`], [`decode`]); what cannot travel.
//! - `stream`: the stream declared and read back ([`declare`]).
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
pub use dead::{NatsDeadLetter, NatsDeadLetters};
pub use publisher::{
    NatsPublisher, connect, durability_note, preflight, server_version, version_refusal,
};
pub use reader::{
    Delivery, PartitionReader, ReadFrom, Reading, dead_letter, dead_letter_stream,
    declare_dead_letters,
};
pub use stream::{declare, remove};
pub use tail::{NatsTail, NatsTailed};
pub use wire::{
    CONTENT_TYPE, CORRELATION_ID, EXPECTED_STREAM, MSG_ID, TYPE, Unwritable, decode, envelope,
    headers,
};

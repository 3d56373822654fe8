//! The outbox in PostgreSQL. The only crate that writes SQL.
//!
//! - `key`: the domain words as newtypes: [`TenantId`], [`RunId`], [`BranchId`], [`BranchKey`], [`Lsn`].
//! - `writer`: the host's write API ([`IntentWriter`]): open a run, append an intent, rewind; each
//!   runs inside the host's own transaction.
//! - `outbox`: the relay's side ([`Outbox`]): drain and ack under a lease's [`Fence`], backlog
//!   for lag (the card's unfenced `drain_outbox`/`ack_outbox`: feature `fixtures`).
//! - `lease`: ownership across relays: the lease tables' SQL ([`LeaseStore`]) and the
//!   [`Fence`] checked before every publish and ack (the rules that decide ownership are the
//!   supervisor's).
//! - `wakeup`: [`Wakeups`], LISTEN for tenants whose intents just committed.
//! - `fold`: the consumer's exactly-once fold ([`FoldStore`]): idempotent on `(BranchKey, Lsn)`
//!   and proving Lsn order per branch.
//! - `fold_model`: [`FoldModel`], WIRE.md's consumer rules in memory (the fold's oracle in
//!   tests, and a fold for consumers that keep their state in memory, WIRE.md).
//! - `retention`: retirement of closed runs in the host's and the consumers' databases
//!   ([`retire_runs`], [`retire_folded_runs`]), and the loop both run ([`retire_every`]).
//! - `roles`: least-privilege grants for host, relay and consumer roles ([`roles_sql`]).
//! - `meta`: an intent's optional metadata ([`Intent`], [`Metadata`]) and its rules.
//! - `offset`: a stream consumer's stored offsets, adopting a branch, resetting a fold.
//! - `schema`: the schema the relay's tables live in ([`Schema`], [`create_schema`]).
//! - `migrations`: the embedded migrations ([`migrate`], [`migrate_fold`]) and
//!   [`check_schema`] for a schema someone else migrated.
//! - `hash`: [`fnv1a`], the one stable hash (lease buckets, shards, partitions).
//! - `trace`: W3C trace context between `tracing` spans and intents (feature `otel`).
//! - `error`: the one [`Error`] type, and [`within`], a call under a time limit.
//! - `fixtures` (feature `fixtures`): bulk backlogs for benchmarks; `scratch`: test databases
//!   dropped when the test process exits.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod error;
#[cfg(feature = "fixtures")]
pub mod fixtures;
mod fold;
mod fold_model;
mod hash;
mod key;
mod lease;
mod meta;
mod migrations;
mod offset;
mod outbox;
mod retention;
mod roles;
mod schema;
#[cfg(feature = "fixtures")]
pub mod scratch;
mod trace;
mod wakeup;
mod writer;

pub use error::Error;
pub use error::within;
pub use fold::EventTable;
pub use fold::FoldError;
pub use fold::FoldOutcome;
pub use fold::FoldStore;
pub use fold::FoldedEvent;
pub use fold::Projection;
pub use fold::RewindNotice;
pub use fold::fold;
pub use fold::{FoldSteps, apply as apply_fold, verdicts as fold_verdicts};
pub use fold_model::FoldModel;
pub use hash::fnv1a;
pub use key::BranchId;
pub use key::BranchKey;
pub use key::EventKey;
pub use key::InvalidId;
pub use key::Lsn;
pub use key::MAX_ID_BYTES;
pub use key::RunId;
pub use key::TenantId;
pub use lease::Bucket;
pub use lease::Claimable;
pub use lease::Fence;
pub use lease::LEASE_BUCKETS;
pub use lease::Lease;
pub use lease::LeaseEpoch;
pub use lease::LeaseRow;
pub use lease::LeaseStore;
pub use lease::MemberRow;
pub use lease::RelayId;
pub use lease::bucket_of;
pub use meta::EventType;
pub use meta::Intent;
pub use meta::MAX_HEADER_BYTES;
pub use meta::MAX_HEADERS;
pub use meta::Metadata;
pub use meta::RESERVED_HEADERS;
pub use meta::is_portable_header_value;
pub use meta::is_reserved_header;
pub use migrations::FOLD_MIGRATOR;
pub use migrations::MIGRATIONS_TABLE;
pub use migrations::MIGRATOR;
pub use migrations::check_schema;
pub use migrations::migrate;
pub use migrations::migrate_fold;
pub use offset::adopt_branch;
pub use offset::reset_fold;
pub use offset::save_stream_offset;
pub use offset::stream_offset;
pub use outbox::Backlog;
pub use outbox::BranchBacklog;
pub use outbox::Discarded;
pub use outbox::DrainLimit;
pub use outbox::Epoch;
pub use outbox::Epochs;
pub use outbox::EventKind;
pub use outbox::HeldBack;
pub use outbox::Outbox;
pub use outbox::OutboxEvent;
pub use outbox::RelayShare;
pub use outbox::Replication;
pub use outbox::{ParkCause, ParkedBranch};
pub use retention::Retention;
pub use retention::Retiring;
pub use retention::retire_every;
pub use retention::retire_folded_runs;
pub use retention::retire_runs;
pub use roles::Roles;
pub use roles::RolesFor;
pub use roles::roles_sql;
pub use schema::Schema;
pub use schema::create_schema;
#[cfg(feature = "otel")]
pub use trace::remote_context;
pub use wakeup::Wakeups;
pub use writer::Closed;
pub use writer::DEFAULT_MAX_PAYLOAD_BYTES;
pub use writer::IntentWriter;
pub use writer::Rewound;

/// The channel `append` notifies on commit; the payload is the tenant id.
pub const NOTIFY_CHANNEL: &str = "relay_outbox";

//! The relay's actors. They hold no SQL and no AMQP: the store and the publisher port do.
//!
//! - `shard`: [`ShardId`] and the stable `BranchKey` -> shard map.
//! - `directory`: [`PublisherDirectory`], the live publisher of each shard: the supervisor's copy and each drainer's, kept in step by message.
//! - `publisher`: [`PublisherActor`], one per shard: publishes batches, replies with outcomes.
//! - `drainer`: [`Drainer`], one per tenant: drain -> publish -> ack the confirmed prefix.
//! - `mailbox`: what drainers and publishers say to each other ([`DrainerMessage`],
//!   [`PublisherMessage`], [`Reply`]); neither actor imports the other.
//! - `window`: the drainer's in-flight window as a pure state machine (what to ack, retry, park).
//! - `timers`: [`Timers`], one deadline per key: the window's and the supervisor core's.
//! - [`broker::Backoff`] / [`broker::RetryPolicy`]: the never-giving-up retry delays both use.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

mod directory;
mod drainer;
mod mailbox;
mod publisher;
mod shard;
mod timers;
mod window;

pub use directory::PublisherDirectory;
pub use drainer::Drainer;
pub use drainer::DrainerArgs;
pub use drainer::DrainerConfig;
pub use drainer::DrainerReport;
pub use drainer::DrainerReporter;
pub use drainer::StopReason;
pub use mailbox::DrainerMessage;
pub use mailbox::PublisherMessage;
pub use mailbox::Reply;
pub use publisher::DEFAULT_MAX_UNCONFIRMED;
pub use publisher::FAILURE_OUTCOMES;
pub use publisher::PublisherActor;
pub use publisher::PublisherArgs;
pub use publisher::PublisherFactory;
pub use shard::Lane;
pub use shard::Lanes;
pub use shard::ShardId;
pub use shard::Sharding;
pub use timers::Timers;

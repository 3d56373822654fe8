//! The partition tests (`it/partitions.rs`), alone in their binary: three private RabbitMQ
//! nodes (or NATS servers) in network namespaces, cut and healed on a schedule timed against
//! `net_ticktime` (or the servers' elections), which the tests of `tests/it` running beside
//! them would blur (and which would starve them).
#[path = "it/double.rs"]
mod double;
#[path = "it/harness.rs"]
mod harness;
#[path = "it/node.rs"]
mod node;
#[path = "it/partitions.rs"]
mod partitions;
#[path = "it/recorder.rs"]
mod recorder;
#[path = "it/under_load.rs"]
mod under_load;

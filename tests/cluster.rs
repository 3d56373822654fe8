//! The cluster test (`it/cluster.rs`), alone in its binary: its three private RabbitMQ nodes
//! would starve the timing-sensitive tests of `tests/it` running beside it, and cargo runs test
//! binaries one after another.
#[path = "it/cluster.rs"]
mod cluster;
#[path = "it/double.rs"]
mod double;
#[path = "it/harness.rs"]
mod harness;
#[path = "it/node.rs"]
mod node;
#[path = "it/recorder.rs"]
mod recorder;
#[path = "it/under_load.rs"]
mod under_load;

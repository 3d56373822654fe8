//! Helpers of the broker-level tests (`rabbit/tests/publisher.rs` and, by path,
//! `consumer/tests/fold_consumer.rs`), on top of the shared `testkit`.
#![allow(dead_code, unused_imports)]

use rabbit::Topology;
use store::OutboxEvent;
pub use testkit::{amqp_url, unique_topology};

/// Intents of `tenant` / `run` / `branch` at `lsns`, chained (`testkit::intents`).
pub fn events(tenant: &str, run: &str, branch: &str, lsns: &[u64]) -> Vec<OutboxEvent> {
    testkit::intents(&testkit::branch(tenant, run, branch), lsns)
}

/// Deletes a test's queues and exchange.
pub async fn cleanup(topology: &Topology) {
    testkit::delete_topology_at(&amqp_url(), topology).await;
}

//! Helpers of the broker-level tests (`broker/tests/publisher.rs` and, by path,
//! `consumer/tests/fold_consumer.rs`): unique topologies, events, clean-up.
#![allow(dead_code)]

use broker::{Partition, Topology};
use chrono::Utc;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use store::{BranchId, BranchKey, EventKey, EventKind, Lsn, OutboxEvent, RunId, TenantId};

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").expect("AMQP_URL (set in .cargo/config.toml)")
}

/// A topology no other test uses, deleted at this process's exit if the test does not
/// delete it (`broker::scratch`).
pub fn unique_topology(label: &str, partitions: u16) -> Topology {
    Topology::new(
        &broker::scratch::unique(&format!("relay-test-{label}")),
        partitions,
    )
    .unwrap()
}

pub fn events(tenant: &str, run: &str, branch: &str, lsns: &[u64]) -> Vec<OutboxEvent> {
    let key = BranchKey::new(
        TenantId::new(tenant).unwrap(),
        RunId::new(run).unwrap(),
        BranchId::new(branch).unwrap(),
    );
    let mut prev = 0;
    lsns.iter()
        .map(|&lsn| {
            let event = OutboxEvent {
                key: EventKey {
                    branch: key.clone(),
                    lsn: Lsn::new(lsn),
                },
                prev_lsn: Lsn::new(prev),
                base_lsn: Lsn::ZERO,
                payload: format!("{key}@{lsn}").into_bytes(),
                created_at: Utc::now(),
                kind: EventKind::Intent,
                parent: None,
                meta: Default::default(),
            };
            prev = lsn;
            event
        })
        .collect()
}

/// Deletes a test's queues and exchange (best effort: the broker is shared by parallel tests).
pub async fn cleanup(topology: &Topology) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    for index in 0..topology.partitions() {
        let _ = channel
            .queue_delete(
                topology.queue(Partition(index)),
                QueueDeleteOptions::default(),
            )
            .await;
    }
    let _ = channel
        .queue_delete(topology.dead_letter_queue(), QueueDeleteOptions::default())
        .await;
    let _ = channel
        .exchange_delete(
            topology.exchange().clone(),
            ExchangeDeleteOptions::default(),
        )
        .await;
}

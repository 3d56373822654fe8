//! The fold consumer on the real broker and PostgreSQL, each test on its own names.
use std::time::Duration;

use broker::{Partition, Publisher, RabbitConfig, RabbitPublisher, Topology};
use chrono::Utc;
use consumer::FoldConsumer;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use sqlx::PgPool;
use store::{
    BranchId, BranchKey, EventKey, EventKind, FoldStore, Lsn, OutboxEvent, RunId, TenantId,
};

fn amqp_url() -> String {
    std::env::var("AMQP_URL").expect("AMQP_URL (set in .cargo/config.toml)")
}

fn unique_topology(label: &str, partitions: u16) -> Topology {
    // A per-process counter too: two tests of this binary can start in the same microsecond.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!(
        "relay-test-{label}-{}-{n}-{}",
        std::process::id(),
        Utc::now().timestamp_micros()
    );
    Topology::new(&name, partitions).unwrap()
}

fn events(tenant: &str, run: &str, branch: &str, lsns: &[u64]) -> Vec<OutboxEvent> {
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
            };
            prev = lsn;
            event
        })
        .collect()
}

/// Deletes a test's queues and exchange (best effort: the broker is shared by parallel tests).
async fn cleanup(topology: &Topology) {
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

/// The consumer folds what the broker delivers: duplicates are no-ops and an event published
/// ahead of its predecessor (a loss, then a resend) is applied only after it.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn fold_consumer_applies_once_in_order(pool: PgPool) {
    let topology = unique_topology("fold", 1);
    let config = RabbitConfig::new(amqp_url(), topology.clone()).unwrap();
    let mut publisher = RabbitPublisher::new(config.clone());
    let all = events("ta", "r1", "main", &[1, 2, 3, 4]);
    // Lost 2, then the relay resends 2.. as it does after a failure, then a full duplicate run.
    let sequence = vec![
        all[0].clone(),
        all[2].clone(),
        all[1].clone(),
        all[2].clone(),
        all[3].clone(),
    ];
    assert_eq!(
        publisher.publish(&sequence).await.accepted(),
        sequence.len()
    );
    assert_eq!(publisher.publish(&all).await.accepted(), all.len());

    let fold = FoldStore::new(pool);
    let tenant = TenantId::new("ta").unwrap();
    let consumer = FoldConsumer::new(config);
    let stop = {
        let fold = fold.clone();
        let tenant = tenant.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while fold.folded(&tenant).await.unwrap().len() < 4
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let stats = consumer
        .run(Partition(0), &fold, stop, |_| {})
        .await
        .unwrap();
    let lsns: Vec<u64> = fold
        .folded(&tenant)
        .await
        .unwrap()
        .iter()
        .map(|e| e.key.lsn.get())
        .collect();
    assert_eq!(lsns, vec![1, 2, 3, 4]);
    assert_eq!(stats.applied, 4);
    assert!(stats.parked >= 1, "{stats:?}");
    cleanup(&topology).await;
}

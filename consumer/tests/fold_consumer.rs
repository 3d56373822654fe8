//! The consumer folding into the project's own projection (`EventTable`) on the real broker and
//! PostgreSQL, each test on its own names.
use std::time::Duration;

use broker::{Partition, Publisher};

use consumer::{Consumer, ConsumerConfig};
use rabbit::{RabbitConfig, RabbitPublisher};
use sqlx::PgPool;
use store::{EventTable, FoldStore, TenantId};

#[path = "../../rabbit/tests/support/mod.rs"]
mod support;
use support::*;

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

    let fold = FoldStore::new(pool.clone());
    let tenant = TenantId::new("ta").unwrap();
    let mut config = ConsumerConfig::new(config);
    config.partitions = Some(vec![Partition(0)]);
    config.retry = broker::RetryPolicy {
        min: Duration::from_millis(20),
        max: Duration::from_millis(500),
    };
    let consumer = Consumer::new(config, pool, EventTable);
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
    let stats = consumer.run(stop).await.unwrap();
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

//! A session abandoned at any await leaves nothing open on the real broker: a task aborted or
//! a step timed out mid-`basic.consume` must not leave a subscription that takes messages
//! (up to its prefetch) and never acks or gives them back.
use std::time::Duration;

use broker::{Partition, RabbitConfig, Topology};
use futures_util::FutureExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};

mod support;
use support::*;

/// Subscribers on the topology's one partition queue, as the broker counts them.
async fn consumers(probe: &Connection, topology: &Topology) -> u32 {
    let channel = probe.create_channel().await.unwrap();
    let queue = channel
        .queue_declare(
            topology.queue(Partition(0)),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = channel.close(200, "counted".into()).await;
    queue.consumer_count()
}

/// Whether the broker counts `want` subscribers within 10 s (polled every 20 ms).
async fn settles_at(probe: &Connection, topology: &Topology, want: u32) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if consumers(probe, topology).await == want {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `basic.consume` (its future's first poll writes the frame) and abandons it before
/// the broker could answer.
fn subscribe_and_abandon(channel: &Channel, topology: &Topology) {
    let asked = channel
        .basic_consume(
            topology.queue(Partition(0)),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .now_or_never();
    assert!(
        asked.is_none(),
        "answered within one poll: nothing abandoned"
    );
}

/// Through the relay's connections (`broker::open`, which the consumer's sessions use), a
/// subscription abandoned before its `consume-ok` is gone once its connection is dropped. The
/// same done on a bare lapin connection (the control) stays subscribed: without the relay's
/// close-on-drop the scenario leaks (lapin 4.12.3), so this test exercises what it claims.
#[tokio::test]
async fn a_subscription_abandoned_before_its_consume_ok_leaves_nothing_open() {
    let topology = unique_topology("abandoned", 1);
    let config = RabbitConfig::new(amqp_url(), topology.clone()).unwrap();
    let probe = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let outcome = std::panic::AssertUnwindSafe(async {
        for _ in 0..5 {
            let (connection, channel) = broker::open(&config, "abandoned").await.unwrap();
            subscribe_and_abandon(&channel, &topology);
            drop(channel);
            drop(connection);
        }
        assert!(
            settles_at(&probe, &topology, 0).await,
            "an abandoned subscription is still open: {} consumer(s)",
            consumers(&probe, &topology).await
        );

        // The control: lapin's own connection, dropped the same way, stays subscribed (until
        // `cleanup` deletes the queue, which cancels it and lets lapin close it).
        let bare = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = bare.create_channel().await.unwrap();
        subscribe_and_abandon(&channel, &topology);
        drop(channel);
        drop(bare);
        assert!(
            settles_at(&probe, &topology, 1).await,
            "the control did not subscribe"
        );
    })
    .catch_unwind()
    .await;
    cleanup(&topology).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

//! A session abandoned at any await leaves nothing open on the real broker: a task aborted or
//! a step timed out mid-`basic.consume`, or a subscription dropped while deliveries stream in,
//! must not leave a subscription that takes messages (up to its prefetch) and never acks or
//! gives them back.
use std::time::Duration;

use broker::Partition;

use futures_util::FutureExt;
use futures_util::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use rabbit::{RabbitConfig, Topology};

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

/// Through the relay's connections (`rabbit::open`, which the consumer's sessions use), a
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
            let (connection, channel) = rabbit::open(&config, "abandoned").await.unwrap();
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

/// A subscription dropped while the broker streams deliveries to it (a consumer's task aborted
/// or stopped mid-stream), 100 times: each time its connection closes and the broker counts no
/// subscriber. Without `ClosingConnection::hold`, lapin 4.12.3 deadlocks (its I/O thread
/// against its RPC task, see `ClosingConnection`) in 1 run of this test in 8 (measured): the
/// connection stays open with the prefetch unacked and two runtime threads block for good.
/// The consumer's kill test (`tests/it/batches.rs`) meets it more often, 1 run in 3 to 4.
///
/// Its own runtime, shut down without waiting for its threads: a deadlock fails the test
/// rather than hanging it.
#[test]
fn a_subscription_dropped_while_deliveries_stream_in_leaves_nothing_open() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let outcome = runtime.block_on(dropped_while_deliveries_stream_in());
    runtime.shutdown_timeout(Duration::from_secs(5));
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn dropped_while_deliveries_stream_in() -> Result<(), Box<dyn std::any::Any + Send>> {
    let topology = unique_topology("dropped", 1);
    let config = RabbitConfig::new(amqp_url(), topology.clone()).unwrap();
    let probe = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let outcome = std::panic::AssertUnwindSafe(async {
        let (publisher, channel) = rabbit::open(&config, "dropped-publisher").await.unwrap();
        let queue = topology.queue(Partition(0));
        for n in 0..5_000u32 {
            channel
                .basic_publish(
                    "".into(),
                    queue.clone(),
                    BasicPublishOptions::default(),
                    &n.to_be_bytes(),
                    BasicProperties::default(),
                )
                .await
                .unwrap();
        }
        drop(channel);
        drop(publisher);
        for drop_number in 0..100 {
            let (mut connection, channel) = rabbit::open(&config, "dropped").await.unwrap();
            channel
                .basic_qos(256, BasicQosOptions::default())
                .await
                .unwrap();
            let mut deliveries = channel
                .basic_consume(
                    queue.clone(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            connection.hold("channel", channel.clone());
            connection.hold("deliveries", deliveries.clone());
            // Dropped mid-stream: after the first delivery, while the rest of the prefetch
            // is still arriving; in the order a task's locals go (the consumer first).
            deliveries.next().await.unwrap().unwrap();
            drop(deliveries);
            drop(connection);
            drop(channel);
            assert!(
                settles_at(&probe, &topology, 0).await,
                "drop {drop_number}: a subscription is still open: {} consumer(s)",
                consumers(&probe, &topology).await
            );
        }
    })
    .catch_unwind()
    .await;
    cleanup(&topology).await;
    outcome
}

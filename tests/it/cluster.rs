//! A real RabbitMQ cluster: three private nodes (`scripts/rabbitmq-cluster`), never the
//! machine's own. With a host writing on, two relays and a consumer, each given every node's
//! address, the node that leads every partition is stopped, brought back, then another node
//! is killed (SIGKILL) and brought back; for quorum queues and for streams with three
//! replicas. Nothing is lost, no event reaches the broker's queues out of order (a raw
//! recorder group sees each branch's first copies ascending, but for events the broker
//! refused: their first copy is the one sent again, after later events of the branch the
//! broker took), the fold equals the live history, shipping goes on while a node is down,
//! and the lag comes back within seconds.
//!
//! RabbitMQ 3.10 nacks a new channel's first publishes to a quorum queue while it looks for
//! the queue's new leader, and takes the publishes after them on the same channel: after a
//! node is killed, 13 branches once had one to three events nacked at the head of a batch and
//! the rest of it taken (first copies 1-134, 138-324, 135-137). The relay acked none of the
//! branch from the nacked event on and sent it again, as it must; the order check failed in
//! about one run in five before it exempted refused events.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use distribution::rabbit::QueueType;
use futures_util::StreamExt;

use crate::harness::oldest_pending;
use crate::node::{PrivateCluster, Rabbit};
use crate::under_load::{Scene, worst_lag};

/// What one node failure cost: the worst lag while the node was down, and after it returned.
#[derive(Debug)]
struct Cost {
    during: Duration,
    after: Duration,
    /// Intents the consumer applied while the node was down.
    applied_while_down: u64,
}

async fn failures_under_load(cluster: &PrivateCluster, queue_type: QueueType) -> [Cost; 2] {
    let scene = Scene::start(cluster, queue_type).await;
    let pool = &scene.pool;
    let mut costs = Vec::new();
    // Node 1 took every declare first, so it leads every partition: stopped gracefully. Then
    // node 2, killed.
    for (node, kill) in [(1u8, false), (2u8, true)] {
        let (down_at, _) = oldest_pending(pool).await;
        let applied = scene.folding.totals().applied;
        tokio::task::block_in_place(|| {
            if kill {
                cluster.kill_node(node);
            } else {
                cluster.stop_node(node);
            }
        });
        let during = worst_lag(pool, down_at, Duration::from_secs(5)).await;
        let applied_while_down = scene.folding.totals().applied - applied;
        tokio::task::block_in_place(|| cluster.start_node(node));
        let (back, _) = oldest_pending(pool).await;
        let after = worst_lag(pool, back, Duration::from_secs(4)).await;
        costs.push(Cost {
            during,
            after,
            applied_while_down,
        });
    }
    // Node 3 was never stopped.
    scene.finish(cluster, 3).await;
    costs.try_into().unwrap()
}

/// Runs the failures on a cluster of its own and checks what they cost.
async fn on_a_cluster(rabbit: Rabbit, queue_type: QueueType) {
    crate::harness::capture_logs();
    let cluster = tokio::task::block_in_place(|| PrivateCluster::start_on(rabbit, "failures"));
    let costs = failures_under_load(&cluster, queue_type).await;
    println!(
        "{queue_type:?}: stop node 1: {:?}; kill node 2: {:?}",
        costs[0], costs[1]
    );
    for cost in &costs {
        // One node down is not an outage: the other two go on serving.
        assert!(
            cost.applied_while_down > 0,
            "{queue_type:?}: nothing shipped while a node was down ({:?} lag)",
            cost.during
        );
        assert!(
            cost.after < Duration::from_secs(10),
            "{queue_type:?}: an intent waited {:?} after the node returned",
            cost.after
        );
    }
}

/// Quorum queues, three replicas, through a graceful stop and a kill of a node under load.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_failures_under_load_lose_nothing_on_quorum_queues() {
    on_a_cluster(Rabbit::V3_10, QueueType::Quorum).await;
}

/// The same on a RabbitMQ 4.0 cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_failures_under_load_lose_nothing_on_quorum_queues_on_rabbitmq_4_0() {
    on_a_cluster(Rabbit::V4_0, QueueType::Quorum).await;
}

/// The same on streams. Several readers share each replica here (the folding consumer and the
/// recorder), the case in which RabbitMQ 3.10 can leave one of them untold of committed
/// messages (osiris#172): the consumer's `stream_resubscribe` is what gets them to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_failures_under_load_lose_nothing_on_streams() {
    on_a_cluster(Rabbit::V3_10, QueueType::Stream).await;
}

/// Publishes numbered messages to `streams` in turn on one confirming channel of
/// `connection`, up to 200 unconfirmed, until `stop`, as the relay does: a message not
/// confirmed within 2 s is given up (the relay would send it again) and publishing goes on.
/// `sent` counts what it has published. Returns, per stream, the numbers the broker confirmed.
async fn publish_confirmed(
    connection: &lapin::Connection,
    streams: &[String],
    stop: Arc<AtomicBool>,
    sent: &std::sync::atomic::AtomicU64,
) -> Vec<std::collections::BTreeSet<u64>> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirmed = vec![std::collections::BTreeSet::new(); streams.len()];
    let mut pending = tokio::task::JoinSet::new();
    let mut n = 0u64;
    loop {
        if !stop.load(Ordering::Acquire) && pending.len() < 200 {
            let index = (n as usize) % streams.len();
            let body = n.to_string().into_bytes();
            let published = tokio::time::timeout(
                Duration::from_secs(2),
                channel.basic_publish(
                    "".into(),
                    streams[index].as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    lapin::BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await;
            let Ok(Ok(confirm)) = published else { break };
            pending.spawn(async move {
                let acked = matches!(
                    tokio::time::timeout(Duration::from_secs(2), confirm).await,
                    Ok(Ok(lapin::Confirmation::Ack(_)))
                );
                (index, n, acked)
            });
            n += 1;
            sent.store(n, Ordering::Release);
            continue;
        }
        match pending.join_next().await {
            Some(Ok((index, n, true))) => {
                confirmed[index].insert(n);
            }
            Some(_) => {}
            None => break,
        }
    }
    while let Some(done) = pending.join_next().await {
        if let Ok((index, n, true)) = done {
            confirmed[index].insert(n);
        }
    }
    confirmed
}

/// Every number in `stream` from its first offset, read through `connection`: subscribed
/// again (up to 5 times) until it holds `want` or a subscription hears nothing for 2 s.
async fn stream_numbers(
    connection: &lapin::Connection,
    stream: &str,
    want: &std::collections::BTreeSet<u64>,
) -> std::collections::BTreeSet<u64> {
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..5 {
        let channel = connection.create_channel().await.unwrap();
        channel
            .basic_qos(1000, BasicQosOptions::default())
            .await
            .unwrap();
        let mut arguments = lapin::types::FieldTable::default();
        arguments.insert(
            "x-stream-offset".into(),
            lapin::types::AMQPValue::LongString("first".into()),
        );
        let mut deliveries = channel
            .basic_consume(
                stream.into(),
                "".into(),
                BasicConsumeOptions::default(),
                arguments,
            )
            .await
            .unwrap();
        while let Ok(Some(Ok(delivery))) =
            tokio::time::timeout(Duration::from_secs(2), deliveries.next()).await
        {
            seen.insert(
                std::str::from_utf8(&delivery.data)
                    .unwrap()
                    .parse()
                    .unwrap(),
            );
            delivery.ack(BasicAckOptions::default()).await.unwrap();
        }
        let _ = channel.close(200, "read".into()).await;
        if want.is_subset(&seen) {
            break;
        }
    }
    seen
}

/// Why the relay publishes each stream partition on a channel of its own
/// (`actors::Sharding::Partition`). Three streams led by node 1 take confirmed publishes
/// through node 3 (whose channels survive node 1): two of them from one channel, in turn,
/// the third from a channel that writes to it alone. Node 1 is killed with messages in
/// flight: the lone stream's channel loses no confirmed message. RabbitMQ before 4.0.x loses
/// some of the shared channel's (rabbitmq-server#9457: the resend after the leader change
/// uses the channel's sequence numbers, the stream's deduplication then drops later messages
/// and confirms them; 3.10.8 here lost 1,377 and 1,516 of about 8,000 in two runs); that
/// count is printed, not asserted, since a fixed broker loses none. A graceful stop of the
/// leader showed no loss (no resend of unconfirmed messages).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_channel_that_writes_to_one_stream_loses_nothing_when_its_leader_dies() {
    let lost = one_stream_per_channel(Rabbit::V3_10).await;
    println!("3.10: a channel shared by two streams lost {lost} confirmed");
}

/// Runs the resend scenario above on `rabbit`'s cluster; returns what the shared channel lost.
async fn one_stream_per_channel(rabbit: Rabbit) -> usize {
    let cluster = tokio::task::block_in_place(|| PrivateCluster::start_on(rabbit, "resend"));
    let urls: Vec<String> = cluster.urls().split(',').map(str::to_owned).collect();
    let properties = lapin::ConnectionProperties::default;
    let first = lapin::Connection::connect(&urls[0], properties())
        .await
        .unwrap();
    let declaring = first.create_channel().await.unwrap();
    let streams: Vec<String> = (0..3).map(|n| format!("resend-{n}")).collect();
    for stream in &streams {
        let mut arguments = lapin::types::FieldTable::default();
        arguments.insert(
            "x-queue-type".into(),
            lapin::types::AMQPValue::LongString("stream".into()),
        );
        arguments.insert(
            "x-initial-cluster-size".into(),
            lapin::types::AMQPValue::LongInt(3),
        );
        // Declared through node 1: it leads them (`client-local`).
        declaring
            .queue_declare(
                stream.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                arguments,
            )
            .await
            .unwrap();
    }
    let third = lapin::Connection::connect(&urls[2], properties())
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (shared_sent, alone_sent) = (
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
    );
    let (shared, alone, alone_before_kill) = tokio::join!(
        publish_confirmed(&third, &streams[..2], stop.clone(), &shared_sent),
        publish_confirmed(&third, &streams[2..], stop.clone(), &alone_sent),
        async {
            // Publishing pace, not synchronisation: messages in flight when node 1 dies.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let before = alone_sent.load(Ordering::Acquire);
            tokio::task::block_in_place(|| cluster.kill_node(1));
            tokio::time::sleep(Duration::from_secs(2)).await;
            stop.store(true, Ordering::Release);
            before
        }
    );
    let mut lost = Vec::new();
    for (stream, confirmed) in streams.iter().zip(shared.iter().chain(&alone)) {
        let seen = stream_numbers(&third, stream, confirmed).await;
        lost.push(confirmed.difference(&seen).count());
        println!(
            "{stream}: {} confirmed, {} of them not in the stream",
            confirmed.len(),
            lost.last().unwrap()
        );
    }
    // Not vacuous: the lone channel's stream took confirmed writes from before the kill and
    // from after it, so its leader changed under a live channel.
    assert!(
        alone[0].first().is_some_and(|&n| n < alone_before_kill)
            && alone[0].last().is_some_and(|&n| n > alone_before_kill),
        "the lone channel published through the kill (sent {alone_before_kill} before it)"
    );
    assert_eq!(
        lost[2], 0,
        "a channel that writes to one stream lost confirmed messages"
    );
    lost[0] + lost[1]
}

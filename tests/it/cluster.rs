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

use chrono::{DateTime, Utc};
use distribution::broker::{self, Group, Partition, QueueType, RabbitConfig};
use distribution::store::{EventKey, FoldStore, Outbox};
use distribution::{Relay, RelayConfig};
use futures_util::StreamExt;
use sqlx::PgPool;

use crate::double::{Double, Observer, Script};
use crate::harness::{
    Expected, Folding, Workload, count, folded_count, fresh_database, holds_within, oldest_pending,
    pending, relay_config, tenants_of, unique, until_folded_exactly, wait_until,
};
use crate::node::{PrivateCluster, Rabbit};
use crate::recorder::keep_writing;

/// The worst lag seen over `span` (sampled every 50 ms): the age of the oldest intent not yet
/// acked, counted from `since` for intents written before it.
async fn worst_lag(pool: &PgPool, since: DateTime<Utc>, span: Duration) -> Duration {
    let until = tokio::time::Instant::now() + span;
    let mut worst = Duration::ZERO;
    while tokio::time::Instant::now() < until {
        if let (now, Some(oldest)) = oldest_pending(pool).await {
            worst = worst.max((now - oldest.max(since)).to_std().unwrap_or_default());
        }
        // Sampling pace, not synchronisation.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worst
}

/// Every message of a group's partitions in the broker's queue order, whatever node goes
/// down: a raw reader per partition (no fold). A quorum queue is read once, after the faults,
/// with acks, by a single consumer: it then delivers in the queue's order, and nothing is in
/// flight on a connection that dies. (A consumer reading during the faults without acks loses
/// what its dead connection had in flight; the relay's resend of those events then reaches it
/// after later ones, an order the queue never had.) A stream is read during the run, from its
/// first offset at each connect: its offsets are its order.
struct FirstDeliveries {
    rabbit: RabbitConfig,
    seen: Arc<std::sync::Mutex<Vec<EventKey>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl FirstDeliveries {
    fn start(rabbit: &RabbitConfig) -> Self {
        let mut rabbit = rabbit.clone();
        rabbit.topology = rabbit
            .topology
            .clone()
            .with_group(Group::parse("recorder").unwrap());
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        if rabbit.topology.queue_type() == QueueType::Stream {
            for partition in 0..rabbit.topology.partitions() {
                let (rabbit, seen, stop) = (rabbit.clone(), seen.clone(), stop.clone());
                tasks.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Acquire) {
                        // A failed session (its node gone) is opened again on the next address.
                        let _ = Self::session(&rabbit, Partition(partition), &seen, &stop).await;
                    }
                }));
            }
        }
        Self {
            rabbit,
            seen,
            stop,
            tasks,
        }
    }

    /// A consumer with acks (500 unacked at most) of `partition`, with `arguments`, and the
    /// count of messages the partition held just before it started; its connection and
    /// channel must outlive it.
    async fn consumer(
        rabbit: &RabbitConfig,
        partition: Partition,
        arguments: lapin::types::FieldTable,
    ) -> Result<
        (
            broker::ClosingConnection,
            lapin::Channel,
            u32,
            lapin::Consumer,
        ),
        broker::Error,
    > {
        let (connection, channel) = broker::open(rabbit, "first-deliveries").await?;
        let limit = rabbit.connect_timeout;
        let queue = rabbit.topology.queue(partition);
        let declared = broker::within(
            "queue.declare",
            limit,
            channel.queue_declare(
                queue.clone(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            ),
        )
        .await?;
        broker::within(
            "basic.qos",
            limit,
            channel.basic_qos(500, lapin::options::BasicQosOptions::default()),
        )
        .await?;
        let deliveries = broker::within(
            "basic.consume",
            limit,
            channel.basic_consume(
                queue,
                "".into(),
                lapin::options::BasicConsumeOptions::default(),
                arguments,
            ),
        )
        .await?;
        Ok((connection, channel, declared.message_count(), deliveries))
    }

    /// Records `delivery`'s event, then acks it.
    async fn record(
        rabbit: &RabbitConfig,
        seen: &std::sync::Mutex<Vec<EventKey>>,
        delivery: lapin::message::Delivery,
    ) -> Result<(), broker::Error> {
        let event = broker::decode(&delivery.properties, &delivery.data).unwrap();
        seen.lock().unwrap().push(event.key);
        broker::within(
            "basic.ack",
            rabbit.connect_timeout,
            delivery.ack(lapin::options::BasicAckOptions::default()),
        )
        .await
        .map(drop)
    }

    /// Reads a quorum partition whole, in its order: the count it holds, as one consumer
    /// with acks takes it.
    async fn read_queue(&self, partition: Partition) -> Result<(), broker::Error> {
        let (_connection, _channel, count, mut deliveries) =
            Self::consumer(&self.rabbit, partition, Default::default()).await?;
        for _ in 0..count {
            let delivery = deliveries
                .next()
                .await
                .expect("the recorder's consumer ended early")?;
            assert!(!delivery.redelivered, "the recorder's queue had a reader");
            Self::record(&self.rabbit, &self.seen, delivery).await?;
        }
        Ok(())
    }

    /// Reads a stream partition from its first offset until `stop`.
    async fn session(
        rabbit: &RabbitConfig,
        partition: Partition,
        seen: &std::sync::Mutex<Vec<EventKey>>,
        stop: &AtomicBool,
    ) -> Result<(), broker::Error> {
        let mut arguments = lapin::types::FieldTable::default();
        arguments.insert(
            "x-stream-offset".into(),
            lapin::types::AMQPValue::LongString("first".into()),
        );
        let (_connection, _channel, _, mut deliveries) =
            Self::consumer(rabbit, partition, arguments).await?;
        while !stop.load(Ordering::Acquire) {
            let next = tokio::time::timeout(Duration::from_millis(100), deliveries.next()).await;
            match next {
                Err(_) => continue,
                Ok(Some(delivery)) => Self::record(rabbit, seen, delivery?).await?,
                Ok(None) => return Ok(()),
            }
        }
        Ok(())
    }

    /// Stops it (a quorum queue is read now, once the faults are over and nothing more is
    /// published); per branch, the Lsns in the order of their first copies.
    async fn stop(
        mut self,
    ) -> std::collections::BTreeMap<distribution::store::BranchKey, Vec<u64>> {
        self.stop.store(true, Ordering::Release);
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
        if self.rabbit.topology.queue_type() == QueueType::Quorum {
            for partition in 0..self.rabbit.topology.partitions() {
                self.read_queue(Partition(partition))
                    .await
                    .expect("the recorder reads its queue");
            }
        }
        let mut first = std::collections::BTreeMap::<_, Vec<u64>>::new();
        let mut known = std::collections::HashSet::new();
        for key in self.seen.lock().unwrap().iter() {
            if known.insert(key.clone()) {
                first
                    .entry(key.branch.clone())
                    .or_default()
                    .push(key.lsn.get());
            }
        }
        first
    }
}

/// Every event the broker refused (nacked or returned) at least once, as `(branch, lsn)`: its
/// first copy in a queue is the one the relay sent again.
#[derive(Default)]
struct Refusals {
    calls: std::sync::Mutex<Vec<Vec<EventKey>>>,
    refused: std::sync::Mutex<std::collections::HashSet<(distribution::store::BranchKey, u64)>>,
}

impl Refusals {
    fn events(&self) -> std::collections::HashSet<(distribution::store::BranchKey, u64)> {
        self.refused.lock().unwrap().clone()
    }
}

impl Observer for Refusals {
    fn writing(&self, events: &[distribution::store::OutboxEvent]) -> usize {
        let mut calls = self.calls.lock().unwrap();
        calls.push(events.iter().map(|event| event.key.clone()).collect());
        calls.len() - 1
    }

    fn written(&self, _call: usize) {}

    fn confirmed(&self, call: usize, report: &broker::PublishReport) {
        let calls = self.calls.lock().unwrap();
        let mut refused = self.refused.lock().unwrap();
        for (key, outcome) in calls[call].iter().zip(&report.outcomes) {
            if matches!(outcome, broker::Outcome::Nacked | broker::Outcome::Returned) {
                refused.insert((key.branch.clone(), key.lsn.get()));
            }
        }
    }
}

/// What one node failure cost: the worst lag while the node was down, and after it returned.
#[derive(Debug)]
struct Cost {
    during: Duration,
    after: Duration,
    /// Intents the consumer applied while the node was down.
    applied_while_down: u64,
}

async fn failures_under_load(cluster: &PrivateCluster, queue_type: QueueType) -> [Cost; 2] {
    let (pool, url) = fresh_database("cluster").await;
    let mut config: RelayConfig = relay_config(&url, cluster.urls(), &unique("relay-cluster"));
    config.queue_type = queue_type;
    config.replicas = Some(3);
    config.amqp_connect_timeout = Duration::from_secs(1);
    config.amqp_confirm_timeout = Duration::from_secs(2);
    let recorder = Group::parse("recorder").unwrap();
    config.groups = vec![Group::Default, recorder];
    let rabbit = config.rabbit_config().unwrap();
    assert_eq!(rabbit.addresses().len(), 3);
    let first_deliveries = FirstDeliveries::start(&rabbit);
    // The real publishers, each event the broker refused (nacked, returned) recorded.
    let refusals = Arc::new(Refusals::default());
    let factory = {
        let rabbit = rabbit.clone();
        let observer: Arc<dyn Observer> = refusals.clone();
        Arc::new(move |_shard| {
            Double::rabbit(
                rabbit.clone(),
                Script {
                    observer: Some(observer.clone()),
                    ..Script::default()
                },
            )
        })
    };
    let relays = [
        Relay::start_with(config.clone(), factory.clone())
            .await
            .unwrap(),
        Relay::start_with(config.clone(), factory).await.unwrap(),
    ];
    let (fold_pool, _) = fresh_database("clusterfold").await;
    let fold = FoldStore::new(fold_pool);
    let folding = Folding::start(rabbit.clone(), &fold);
    let workload = Workload::new(&unique("cl"), 3, 4, 2);
    let ran = workload.run(&pool).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = keep_writing(pool.clone(), workload, ran, stop.clone());
    wait_until(
        "the first intents ship",
        Duration::from_secs(60),
        || async { folding.totals().applied >= 50 },
    )
    .await;

    let mut costs = Vec::new();
    // Node 1 took every declare first, so it leads every partition: stopped gracefully. Then
    // node 2, killed.
    for (node, kill) in [(1u8, false), (2u8, true)] {
        let (down_at, _) = oldest_pending(&pool).await;
        let applied = folding.totals().applied;
        tokio::task::block_in_place(|| {
            if kill {
                cluster.kill_node(node);
            } else {
                cluster.stop_node(node);
            }
        });
        let during = worst_lag(&pool, down_at, Duration::from_secs(5)).await;
        let applied_while_down = folding.totals().applied - applied;
        tokio::task::block_in_place(|| cluster.start_node(node));
        let (back, _) = oldest_pending(&pool).await;
        let after = worst_lag(&pool, back, Duration::from_secs(4)).await;
        costs.push(Cost {
            during,
            after,
            applied_while_down,
        });
    }
    stop.store(true, Ordering::Release);
    let expected = writer.await.unwrap();
    let outbox = Outbox::new(pool.clone());
    wait_until("the outbox emptied", Duration::from_secs(60), || async {
        pending(&outbox).await == 0
    })
    .await;
    // Shown if the wait below fails: a gap counted (`gaps`) or a partition that stopped
    // receiving tell two different causes apart.
    println!(
        "{queue_type:?}: consumer when the outbox emptied: {:?}",
        folding.totals()
    );
    if !holds_within(Duration::from_secs(60), || async {
        folded_count(&fold, &expected).await == count(&expected)
    })
    .await
    {
        let report = diagnose(cluster, &rabbit, &fold, &expected, &folding).await;
        panic!(
            "{queue_type:?}: the fold lacks live intents 60 s after the outbox emptied\n{report}"
        );
    }
    until_folded_exactly(&fold, &expected, "the fold has every live intent").await;
    // Each step of the teardown is bounded: a step that hangs fails the test, naming itself,
    // instead of holding the suite until CI's limit.
    let teardown = Duration::from_secs(60);
    tokio::time::timeout(teardown, folding.stop())
        .await
        .expect("the consumer stops within 60 s");
    let first = tokio::time::timeout(teardown, first_deliveries.stop())
        .await
        .expect("the recorder stops within 60 s");
    let refused = refusals.events();
    println!(
        "{queue_type:?}: the broker refused {} event(s) once at least",
        refused.len()
    );
    for (branch, lsns) in &first {
        let taken: Vec<u64> = lsns
            .iter()
            .copied()
            .filter(|lsn| !refused.contains(&(branch.clone(), *lsn)))
            .collect();
        assert!(
            taken.windows(2).all(|pair| pair[0] < pair[1]),
            "{queue_type:?}: {branch}'s first copies reached the queue out of order (events the broker refused aside): {lsns:?}"
        );
    }
    assert_eq!(
        first.len(),
        expected.len(),
        "every branch reached the recorder"
    );
    for relay in relays {
        tokio::time::timeout(teardown, relay.shutdown())
            .await
            .expect("a relay shuts down within 60 s");
    }
    costs.try_into().unwrap()
}

/// What a failed wait for the fold shows: per partition, the consumer's totals, the offset it
/// stored and the branches short of their live history; the broker's view of each stream
/// and of its consumers; the nodes' logs are kept in a directory named here.
async fn diagnose(
    cluster: &PrivateCluster,
    rabbit: &RabbitConfig,
    fold: &FoldStore,
    expected: &Expected,
    folding: &Folding,
) -> String {
    use std::fmt::Write;
    let mut report = String::new();
    let progress = folding.progress.lock().unwrap().clone();
    let topology = &rabbit.topology;
    let mut short = std::collections::BTreeMap::<u16, Vec<String>>::new();
    for tenant in tenants_of(expected) {
        let mut got = std::collections::BTreeMap::<_, usize>::new();
        for event in fold.folded(&tenant).await.unwrap() {
            *got.entry(event.key.branch).or_default() += 1;
        }
        for (branch, want) in expected.iter().filter(|(key, _)| key.tenant == tenant) {
            let have = got.get(branch).copied().unwrap_or(0);
            if have != want.len() {
                let partition = topology.partition_of(&branch.tenant, &branch.run).0;
                short
                    .entry(partition)
                    .or_default()
                    .push(format!("{branch}: {have} of {}", want.len()));
            }
        }
    }
    for partition in 0..topology.partitions() {
        let queue = topology.queue(Partition(partition));
        let mut conn = fold.pool().acquire().await.unwrap();
        let stored = distribution::store::stream_offset(&mut conn, queue.as_str())
            .await
            .ok()
            .flatten();
        let _ = writeln!(
            report,
            "{queue}: stored offset {stored:?}; consumer {:?}; short: {:?}",
            progress[usize::from(partition)],
            short.get(&partition)
        );
    }
    // Node 3 was never stopped.
    let _ = writeln!(
        report,
        "queues:\n{}",
        cluster.ctl(
            3,
            &[
                "list_queues",
                "name",
                "type",
                "messages",
                "leader",
                "members",
                "online",
                "consumers"
            ]
        )
    );
    let _ = writeln!(
        report,
        "consumers:\n{}",
        cluster.ctl(
            3,
            &[
                "list_consumers",
                "queue_name",
                "channel_pid",
                "ack_required",
                "prefetch_count",
                "arguments"
            ]
        )
    );
    for partition in 0..topology.partitions() {
        let queue = topology.queue(Partition(partition));
        let _ = writeln!(
            report,
            "{queue}: {}",
            cluster.ctl(
                3,
                &[
                    "eval",
                    &format!("rabbit_stream_queue:status(<<\"/\">>, <<\"{queue}\">>).")
                ]
            )
        );
    }
    let _ = writeln!(
        report,
        "nodes' logs kept in {}",
        cluster.keep_logs().display()
    );
    report
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

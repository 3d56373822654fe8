//! What the broker delivered, counted: a raw consumer on every partition queue (no fold, every
//! delivery kept, in delivery order), and a host that writes on while a test hurts something.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distribution::broker::Partition;
use distribution::rabbit::{self, RabbitConfig};
use distribution::store::{BranchKey, FoldModel, Outbox, OutboxEvent};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use sqlx::PgPool;

use crate::harness::{Expected, Ran, Workload, merge, pending, unique, wait_until};

/// Every message of the topology as the broker delivered it, per queue in delivery order
/// (a raw consumer: no fold, every delivery counted).
pub struct Recorder {
    deliveries: Arc<Mutex<Vec<(Instant, OutboxEvent)>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Recorder {
    pub async fn start(rabbit: &RabbitConfig) -> Self {
        let connection =
            lapin::Connection::connect(&rabbit.uri, lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let connection = Arc::new(connection);
        let declare = connection.create_channel().await.unwrap();
        rabbit.topology.declare(&declare).await.unwrap();
        let deliveries = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for partition in 0..rabbit.topology.partitions() {
            let channel = connection.create_channel().await.unwrap();
            channel
                .basic_qos(100, BasicQosOptions::default())
                .await
                .unwrap();
            let mut consumer = channel
                .basic_consume(
                    rabbit.topology.queue(Partition(partition)),
                    format!("recorder-{partition}").as_str().into(),
                    BasicConsumeOptions::default(),
                    lapin::types::FieldTable::default(),
                )
                .await
                .unwrap();
            let (deliveries, stop, connection) =
                (deliveries.clone(), stop.clone(), connection.clone());
            tasks.push(tokio::spawn(async move {
                let _connection = connection;
                while !stop.load(Ordering::Acquire) {
                    let next =
                        tokio::time::timeout(Duration::from_millis(100), consumer.next()).await;
                    let Ok(Some(Ok(delivery))) = next else {
                        continue;
                    };
                    let event = rabbit::decode(&delivery.properties, &delivery.data).unwrap();
                    deliveries.lock().unwrap().push((Instant::now(), event));
                    delivery.ack(BasicAckOptions::default()).await.unwrap();
                }
            }));
        }
        Self {
            deliveries,
            stop,
            tasks,
        }
    }

    pub fn deliveries(&self) -> Vec<OutboxEvent> {
        let deliveries = self.deliveries.lock().unwrap();
        deliveries.iter().map(|(_, event)| event.clone()).collect()
    }

    /// Every delivery with when the recorder took it.
    pub fn arrivals(&self) -> Vec<(Instant, OutboxEvent)> {
        self.deliveries.lock().unwrap().clone()
    }

    pub async fn stop(self) {
        self.stop.store(true, Ordering::Release);
        for task in self.tasks {
            task.await.unwrap();
        }
    }
}

impl Recorder {
    /// How many deliveries came more than once, and the first few of them.
    pub fn duplicates(deliveries: &[OutboxEvent]) -> (usize, Vec<String>) {
        let mut copies: std::collections::HashMap<String, usize> = Default::default();
        for event in deliveries {
            *copies.entry(event.key.to_string()).or_default() += 1;
        }
        let mut twice: Vec<String> = copies
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(key, n)| format!("{key} x{n}"))
            .collect();
        twice.sort();
        let extra = copies.values().map(|n| n - 1).sum();
        twice.truncate(5);
        (extra, twice)
    }
}

/// A host writing one step on every live branch every 20 ms until stopped; returns what it
/// wrote.
pub fn keep_writing(
    pool: PgPool,
    workload: Workload,
    ran: Ran,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Expected> {
    tokio::spawn(async move {
        let mut expected = ran.expected;
        let mut live = ran.live;
        let mut step = workload.steps + 1;
        while !stop.load(Ordering::Acquire) {
            let more = workload.steps(&pool, live, step..=step).await;
            merge(&mut expected, &more.expected);
            live = more.live;
            step += 1;
            // Pacing of the load (about 300 intents/s), not synchronisation.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        expected
    })
}

/// Waits until the outbox is empty and the broker delivered `events` distinct events;
/// returns every delivery.
pub async fn all_delivered(pool: &PgPool, recorder: &Recorder, events: usize) -> Vec<OutboxEvent> {
    let outbox = Outbox::new(pool.clone());
    wait_until("the outbox is empty", Duration::from_secs(120), || async {
        pending(&outbox).await == 0
    })
    .await;
    let distinct = |deliveries: &[OutboxEvent]| {
        deliveries
            .iter()
            .map(|event| event.key.to_string())
            .collect::<std::collections::HashSet<String>>()
            .len()
    };
    // The recorder is a test's consumer and lags the relays under load (one ack awaited at a
    // time: about 330 deliveries/s seen with the other handover tests beside it, 3,323 of
    // 18,000 delivered when the outbox emptied): the wait ends when every event came, and fails
    // only once deliveries stop coming for 15 s (or after 5 minutes in all).
    let at_empty = distinct(&recorder.deliveries());
    let started = std::time::Instant::now();
    let (mut last, mut moved) = (at_empty, std::time::Instant::now());
    let delivered = loop {
        let now = distinct(&recorder.deliveries());
        if now == events {
            break true;
        }
        if now != last {
            (last, moved) = (now, std::time::Instant::now());
        }
        if moved.elapsed() > Duration::from_secs(15) || started.elapsed() > Duration::from_secs(300)
        {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let deliveries = recorder.deliveries();
    assert!(
        delivered,
        "the outbox is empty (every event acked) but the broker delivered {} distinct of {events} \
         events, the last new one {:?} ago ({at_empty} when the outbox was empty, {:?} before; {} \
         deliveries); Lsns missing between each branch's lowest and highest delivered: {:?}",
        distinct(&deliveries),
        moved.elapsed(),
        started.elapsed(),
        deliveries.len(),
        gaps(&deliveries)
    );
    deliveries
}

/// Lsns missing between each branch's lowest and highest one delivered (at most 10), to tell a
/// lost event from a tail still on its way (a forked branch's Lsns start above its fork).
fn gaps(deliveries: &[OutboxEvent]) -> Vec<String> {
    let mut seen: std::collections::BTreeMap<&BranchKey, std::collections::BTreeSet<u64>> =
        Default::default();
    for event in deliveries {
        seen.entry(&event.key.branch)
            .or_default()
            .insert(event.key.lsn.get());
    }
    seen.iter()
        .flat_map(|(branch, lsns)| {
            let (low, top) = (lsns.first().copied(), lsns.last().copied());
            (low.unwrap_or(0)..top.unwrap_or(0))
                .filter(|lsn| !lsns.contains(lsn))
                .map(move |lsn| format!("{branch}@{lsn}"))
        })
        .take(10)
        .collect()
}

/// The fold (WIRE.md's rules, in memory) of every delivery is the host's history.
pub fn assert_folds_to(deliveries: &[OutboxEvent], expected: &Expected) {
    let mut model = FoldModel::new();
    for event in deliveries {
        model.deliver(event).unwrap();
    }
    let mut got: std::collections::BTreeMap<BranchKey, Vec<(distribution::store::Lsn, Vec<u8>)>> =
        std::collections::BTreeMap::new();
    for (key, payload) in model.projection() {
        got.entry(key.branch.clone())
            .or_default()
            .push((key.lsn, payload.clone()));
    }
    assert_eq!(
        &got, expected,
        "the fold of what was delivered is the host's history"
    );
}

/// A host writing on (8 tenants x 2 runs x 2 branches, `label` their prefix) until `stop`,
/// once more than 200 deliveries reached `recorder`; the writer returns what it wrote.
pub async fn writing_while_both_ship(
    pool: &PgPool,
    recorder: &Recorder,
    label: &str,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<Expected>) {
    let workload = Workload::new(&unique(label), 8, 2, 2);
    let ran = workload.run(pool).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = keep_writing(pool.clone(), workload, ran, stop.clone());
    wait_until(
        "both relays ship",
        std::time::Duration::from_secs(30),
        || async { recorder.deliveries().len() > 200 },
    )
    .await;
    (stop, writer)
}

//! Quorum queues never drop a message a consumer keeps failing on. RabbitMQ 4 drops a message
//! after 20 redeliveries unless told otherwise; the relay declares the limit explicitly
//! (`RELAY_DELIVERY_LIMIT`) with the group's dead-letter queue as an at-least-once target. A
//! consumer that dies on one message over and over (killed mid-fold each time) sends it there
//! after the limit; its branch waits behind it (parked at the fold), every other branch flows,
//! and a replay once the cause is fixed completes the branch in order, exactly once.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use distribution::Relay;
use distribution::consumer::{Consumer, ConsumerConfig};
use distribution::rabbit::{DeadFilter, DeadLetters, QueueType};
use distribution::store::{EventKey, EventTable, FoldStore, OutboxEvent, Projection, RewindNotice};
use futures_util::FutureExt;
use sqlx::{PgConnection, PgPool};

use crate::harness::{
    Expected, amqp_url, append_intent, assert_folded_exactly, declare_topology, direct_rabbit,
    drop_topology, fresh_database, relay_config, unique, wait_until, write_first_intent,
};

/// The fold's event table, except that the poisoned event hangs its fold forever (a consumer
/// stuck or crashing on it), after saying so, while `poisoned` is set.
#[derive(Clone)]
struct CrashOn {
    poison: EventKey,
    poisoned: Arc<AtomicBool>,
    hit: tokio::sync::mpsc::UnboundedSender<()>,
}

impl Projection for CrashOn {
    type Error = distribution::store::Error;

    async fn apply(
        &mut self,
        tx: &mut PgConnection,
        event: &OutboxEvent,
    ) -> Result<(), Self::Error> {
        if event.key == self.poison && self.poisoned.load(Ordering::SeqCst) {
            let _ = self.hit.send(());
            std::future::pending::<()>().await;
        }
        EventTable.apply(tx, event).await
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &RewindNotice,
    ) -> Result<(), Self::Error> {
        EventTable.rewind(tx, rewind).await
    }
}

/// With a delivery limit of 3, the poisoned message is delivered 4 times (each consumer is
/// killed mid-fold), then the broker dead-letters it with reason `delivery_limit`, with what
/// the dying consumers had prefetched behind it (and what their batch held before it); nothing past it is applied, the rest waits,
/// and a replay after the fix folds both branches whole, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_a_consumer_keeps_dying_on_is_dead_lettered_past_the_limit_never_dropped() {
    const LIMIT: u32 = 3;
    let (pool, url) = fresh_database("quorumlimit").await;
    let mut config = relay_config(&url, &amqp_url(), &unique("relay-quorum"));
    config.queue_type = QueueType::Quorum;
    config.delivery_limit = LIMIT;
    let rabbit = direct_rabbit(&config);
    let topology = rabbit.topology.clone();
    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology(&topology).await;
        let bad = write_first_intent(&pool, "qbad", b"bad@1").await;
        let good = write_first_intent(&pool, "qgood", b"good@1").await;
        let mut expected = Expected::new();
        for (branch, name) in [(&bad, "bad"), (&good, "good")] {
            let mut events = vec![(
                distribution::store::Lsn::new(1),
                format!("{name}@1").into_bytes(),
            )];
            for lsn in 2..=5 {
                let payload = format!("{name}@{lsn}").into_bytes();
                append_intent(&pool, branch, lsn, &payload).await;
                events.push((distribution::store::Lsn::new(lsn), payload));
            }
            expected.insert(branch.clone(), events);
        }
        let poison = EventKey {
            branch: bad.clone(),
            lsn: distribution::store::Lsn::new(3),
        };
        let relay = Relay::start(config.clone()).await.unwrap();
        let fold = FoldStore::new(pool.clone());
        let poisoned = Arc::new(AtomicBool::new(true));
        let (hit, mut hits) = tokio::sync::mpsc::unbounded_channel();
        let projection = CrashOn {
            poison: poison.clone(),
            poisoned: poisoned.clone(),
            hit,
        };
        // Each consumer on a pool of its own, closed when it is killed: its connections go as
        // a dead process's would, and PostgreSQL rolls back the fold it hung in at once.
        let start = || {
            let mut consumer_config = ConsumerConfig::new(rabbit.clone());
            consumer_config.retry.min = Duration::from_millis(20);
            consumer_config.retry.max = Duration::from_millis(300);
            let own = PgPool::connect_lazy(&url).unwrap();
            let consumer = Consumer::new(consumer_config, own.clone(), projection.clone());
            (tokio::spawn(consumer.run(std::future::pending())), own)
        };
        let kill = |(consumer, own): (tokio::task::JoinHandle<_>, PgPool)| async move {
            consumer.abort();
            let _ = consumer.await;
            own.close().await;
        };
        // Each delivery of the poison hangs its consumer, which is then killed: its
        // connection goes and the broker redelivers the message (one more delivery counted).
        let mut deliveries = 0;
        let dead = DeadLetters::open(&rabbit).await.unwrap();
        let poison_is_dead = || async {
            dead.depth().await.unwrap() > 0
                && dead.list(100).await.unwrap().iter().any(|letter| {
                    letter.event.as_ref().is_ok_and(|event| event.key == poison)
                })
        };
        loop {
            let consumer = start();
            let crashed = tokio::select! {
                got = hits.recv() => got.is_some(),
                () = wait_until("the poison dead-lettered", Duration::from_secs(60), poison_is_dead) => false,
            };
            kill(consumer).await;
            if !crashed {
                break;
            }
            deliveries += 1;
            assert!(deliveries <= LIMIT + 1, "delivered past the limit");
        }
        assert_eq!(deliveries, LIMIT + 1, "the first delivery and {LIMIT} redeliveries");
        // What the dying consumers held unacked behind the poison (prefetched) came back with
        // it each time, so it went over the limit too: dead-lettered with it, in order, never
        // dropped.
        let letters = dead.list(100).await.unwrap();
        for letter in &letters {
            let reason = letter.reason.as_deref().unwrap_or_default();
            assert!(reason.starts_with("broker: delivery_limit"), "{reason}");
        }
        let dead_keys: Vec<EventKey> = letters
            .iter()
            .map(|letter| letter.event.as_ref().unwrap().key.clone())
            .collect();
        let bad_dead: Vec<u64> = dead_keys
            .iter()
            .filter(|key| key.branch == bad)
            .map(|key| key.lsn.get())
            .collect();
        // The consumer folds in batches: what a batch held before the poison rolls back with
        // it on each crash, so it reaches the limit too and is dead-lettered ahead of it.
        let first = *bad_dead.first().expect("the bad branch dead-lettered");
        assert!(
            first <= 3 && bad_dead.contains(&3),
            "the poison dead-lettered, after at most its batch's earlier events: {dead_keys:?}"
        );
        assert!(bad_dead.windows(2).all(|w| w[0] < w[1]), "{dead_keys:?}");

        // Nothing of the bad branch from its first dead letter on was applied; what was not
        // dead-lettered of it waits at the fold; every good event is folded or dead-lettered (or both: one
        // folded but not yet acked when its consumer died came back, a duplicate to the fold).
        let consumer = start();
        let waiting = (6 - first) - bad_dead.len() as u64;
        wait_until("the rest folded", Duration::from_secs(60), || async {
            let mut good_seen: std::collections::BTreeSet<u64> = fold
                .folded(&good.tenant)
                .await
                .unwrap()
                .iter()
                .map(|event| event.key.lsn.get())
                .collect();
            good_seen.extend(
                dead_keys
                    .iter()
                    .filter(|key| key.branch == good)
                    .map(|key| key.lsn.get()),
            );
            good_seen.len() == 5 && fold.parked(&bad.tenant).await.unwrap() == waiting
        })
        .await;
        assert_eq!(
            fold.folded(&bad.tenant).await.unwrap().len() as u64,
            first - 1
        );

        // Fixed: replayed from the dead-letter queue, the branch completes in order, once.
        poisoned.store(false, Ordering::SeqCst);
        assert_eq!(
            dead.replay(&DeadFilter::All).await.unwrap(),
            letters.len() as u64
        );
        wait_until("the branch completed", Duration::from_secs(60), || async {
            fold.folded(&bad.tenant).await.unwrap().len() == 5
                && fold.folded(&good.tenant).await.unwrap().len() == 5
        })
        .await;
        assert_folded_exactly(&fold, &expected).await;
        assert_eq!(dead.depth().await.unwrap(), 0);
        kill(consumer).await;
        relay.shutdown().await;
    })
    .catch_unwind()
    .await;
    drop_topology(&topology).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

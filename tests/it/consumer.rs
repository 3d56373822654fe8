//! The consumer API on the real PostgreSQL and RabbitMQ: a user's own `orders` table, in a
//! database that holds only the fold's tables, is exactly the host's live history through
//! rewinds with batches in flight, relay crashes, consumer kills and failed commits; poison
//! messages and broken chains are dead-lettered while the partition keeps flowing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use distribution::Relay;
use distribution::broker::{Partition, RetryPolicy};
use distribution::consumer::{Consumer, ConsumerConfig, DEAD_LETTER_REASON, FoldStats};
use distribution::store::{
    BranchId, BranchKey, EventTable, IntentWriter, Lsn, Outbox, OutboxEvent, Projection,
    RewindNotice, RunId, TenantId,
};
use distribution::testing::BrokerProxy;
use futures_util::{FutureExt, StreamExt};
use lapin::options::{BasicConsumeOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use sqlx::{PgConnection, PgPool};

use crate::harness::*;

#[derive(Debug, thiserror::Error)]
enum OrdersError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("injected failure after writing (as a crash before commit)")]
    Injected,
    #[error("refused payload {0:?}")]
    Refused(String),
}

/// The user's projection: `order_events` (one row per applied event) and `orders` (each
/// order's current status), written in the fold's transaction. The first application of
/// every event whose Lsn is a multiple of `fail_every` fails after writing, as a crash
/// between the handler's writes and the commit would.
#[derive(Clone)]
struct Orders {
    calls: Arc<AtomicU64>,
    fail_every: u64,
    failed: Arc<std::sync::Mutex<std::collections::HashSet<distribution::store::EventKey>>>,
}

impl Orders {
    fn new(fail_every: u64) -> Self {
        Self {
            calls: Arc::new(AtomicU64::new(0)),
            fail_every,
            failed: Arc::default(),
        }
    }
}

async fn refresh(
    tx: &mut PgConnection,
    tenant: &str,
    run: &str,
    order: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO orders (tenant, run, order_id, status)
         SELECT $1, $2, $3, (SELECT action FROM order_events
                              WHERE tenant = $1 AND run = $2 AND order_id = $3
                              ORDER BY seq DESC LIMIT 1)
         ON CONFLICT (tenant, run, order_id) DO UPDATE SET status = EXCLUDED.status",
    )
    .bind(tenant)
    .bind(run)
    .bind(order)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "DELETE FROM orders WHERE tenant = $1 AND run = $2 AND order_id = $3 AND status IS NULL",
    )
    .bind(tenant)
    .bind(run)
    .bind(order)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

impl Projection for Orders {
    type Error = OrdersError;

    async fn apply(
        &mut self,
        tx: &mut PgConnection,
        event: &OutboxEvent,
    ) -> Result<(), OrdersError> {
        let text = String::from_utf8_lossy(&event.payload).into_owned();
        let Some((action, order)) = text.split_once(':') else {
            return Err(OrdersError::Refused(text));
        };
        let key = &event.key.branch;
        sqlx::query(
            "INSERT INTO order_events (tenant, run, branch, lsn, order_id, action)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(event.key.lsn.get() as i64)
        .bind(order)
        .bind(action)
        .execute(&mut *tx)
        .await?;
        refresh(tx, key.tenant.as_str(), key.run.as_str(), order).await?;
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.fail_every > 0
            && event.key.lsn.get().is_multiple_of(self.fail_every)
            && self.failed.lock().unwrap().insert(event.key.clone())
        {
            return Err(OrdersError::Injected);
        }
        Ok(())
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &RewindNotice,
    ) -> Result<(), OrdersError> {
        let key = &rewind.branch;
        let undone: Vec<String> = sqlx::query_scalar(
            "DELETE FROM order_events WHERE tenant = $1 AND run = $2 AND branch = $3 AND lsn > $4
             RETURNING order_id",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(rewind.fork.get() as i64)
        .fetch_all(&mut *tx)
        .await?;
        for order in undone {
            refresh(tx, key.tenant.as_str(), key.run.as_str(), &order).await?;
        }
        Ok(())
    }

    fn is_permanent(error: &OrdersError) -> bool {
        matches!(error, OrdersError::Refused(_))
    }
}

/// A consumer's own database: the fold's tables (only) and the user's tables.
async fn consumer_database(label: &str) -> PgPool {
    let (pool, _) = fold_database(label).await;
    sqlx::raw_sql(
        "CREATE TABLE order_events (seq bigserial PRIMARY KEY, tenant text, run text, branch text,
                                    lsn bigint, order_id text, action text,
                                    UNIQUE (tenant, run, branch, lsn));
         CREATE TABLE orders (tenant text, run text, order_id text, status text,
                              PRIMARY KEY (tenant, run, order_id));",
    )
    .execute(&pool)
    .await
    .unwrap();
    let outbox_tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename = 'relay_outbox'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(outbox_tables, 0, "a consumer's database needs no outbox");
    pool
}

fn start_consumer(config: ConsumerConfig, pool: &PgPool, orders: &Orders) -> Running<FoldStats> {
    let consumer = Consumer::new(config, pool.clone(), orders.clone());
    until_stopped(|stopped| async move { consumer.run(stopped).await.unwrap() })
}

/// Host side of one run: the live history as the host sees it.
struct HostRun {
    branch: BranchKey,
    head: u64,
    live: Vec<(String, u64, String)>,
    forks: usize,
}

/// A host writes orders on 3 tenants x 2 runs, rewinding now and then while two relays
/// drain (batches of 7, three in flight), while one relay crashes and restarts, the
/// consumer loses the broker for a while, then its database connections, then is killed and
/// restarted, and the first application of every fifth Lsn fails after writing. The user's tables
/// end up holding exactly the live history: each live event once, no abandoned one, and
/// every order's status as the live history says.
#[test]
fn a_users_tables_hold_exactly_the_live_history_through_rewinds_crashes_and_kills() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("orders").await;
        let consumer_pool = consumer_database("ordersfold").await;
        let mut config = relay_config(&url, &amqp_url(), &unique("relay-orders"));
        config.supervisor.drainer.batch_size = 7;
        config.supervisor.drainer.max_batches_in_flight = 3;
        // The consumer reaches the broker through a proxy the test cuts and restores.
        let proxy = BrokerProxy::start(&amqp_url()).unwrap();
        let mut through_proxy = config.clone();
        through_proxy.amqp_url = proxy.amqp_url();
        let mut consumer_config = ConsumerConfig::new(through_proxy.rabbit_config().unwrap());
        consumer_config.rabbit.connect_timeout = Duration::from_secs(1);
        consumer_config.retry = RetryPolicy { min: Duration::from_millis(10), max: Duration::from_millis(200) };
        let orders = Orders::new(5);
        let mut consumer = start_consumer(consumer_config.clone(), &consumer_pool, &orders);
        // Two relays share the tenants; one of them crashes mid-run.
        let mut relay = Relay::start(config.clone()).await.unwrap();
        let other_relay = Relay::start(config.clone()).await.unwrap();

        let writer = IntentWriter::default();
        let mut runs: Vec<HostRun> = Vec::new();
        for tenant in 0..3 {
            for run in 0..2 {
                let branch = BranchKey::new(
                    TenantId::new(format!("shop{tenant}")).unwrap(),
                    RunId::new(format!("day{run}")).unwrap(),
                    BranchId::new("main").unwrap(),
                );
                writer.open_run(&mut pool.acquire().await.unwrap(), &branch).await.unwrap();
                runs.push(HostRun { branch, head: 0, live: Vec::new(), forks: 0 });
            }
        }
        for step in 1..=60u64 {
            for (index, run) in runs.iter_mut().enumerate() {
                if step % 9 == (index as u64 % 9) && run.head >= 3 {
                    let at = run.head - 2;
                    run.forks += 1;
                    let to = BranchId::new(format!("fork{}", run.forks)).unwrap();
                    let rewound = writer
                        .rewind(&mut pool.acquire().await.unwrap(), &run.branch, Lsn::new(at), to)
                        .await
                        .unwrap();
                    let old = run.branch.branch.to_string();
                    run.live.retain(|(branch, lsn, _)| !(branch == &old && *lsn > at));
                    run.branch = rewound.live;
                    run.head = at;
                }
                run.head += 1;
                let order = format!("o{}", run.head.div_ceil(2));
                let action = if run.head % 2 == 1 { "placed" } else { "paid" };
                let payload = format!("{action}:{order}");
                let mut tx = pool.begin().await.unwrap();
                writer.append(&mut tx, &run.branch, Lsn::new(run.head), payload.as_bytes()).await.unwrap();
                tx.commit().await.unwrap();
                run.live.push((run.branch.branch.to_string(), run.head, payload));
            }
            if step == 20 {
                relay.abort().await; // a relay crash with batches in flight
                relay = Relay::start(config.clone()).await.unwrap();
            }
            if step == 40 {
                proxy.cut(); // the broker goes away from the consumer
            }
            if step == 44 {
                proxy.restore();
                // ... and its database connections are killed.
                sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                      WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .execute(&consumer_pool)
                .await
                .unwrap();
            }
            if step == 25 {
                consumer.kill().await; // a consumer killed mid-stream: its transaction rolls back
                consumer = start_consumer(consumer_config.clone(), &consumer_pool, &orders);
            }
        }
        let outbox = Outbox::new(pool.clone());
        wait_until("relay drained", Duration::from_secs(60), || async { pending(&outbox).await == 0 }).await;
        let expected_events: usize = runs.iter().map(|run| run.live.len()).sum();
        wait_until("every live event in the user's table", Duration::from_secs(60), || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM order_events")
                .fetch_one(&consumer_pool)
                .await
                .unwrap();
            let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM relay_fold_parked")
                .fetch_one(&consumer_pool)
                .await
                .unwrap();
            n as usize == expected_events && parked == 0
        })
        .await;

        // Exactly the live history, per run in order of application.
        for run in &runs {
            let got: Vec<(String, i64, String)> = sqlx::query_as(
                "SELECT branch, lsn, action || ':' || order_id FROM order_events
                  WHERE tenant = $1 AND run = $2 ORDER BY seq",
            )
            .bind(run.branch.tenant.as_str())
            .bind(run.branch.run.as_str())
            .fetch_all(&consumer_pool)
            .await
            .unwrap();
            let got: Vec<(String, u64, String)> = got.into_iter().map(|(b, l, p)| (b, l as u64, p)).collect();
            assert_eq!(got, run.live, "{}: the live history, once, in order", run.branch);
            // Each order's status is what the live history says.
            let mut want: BTreeMap<String, String> = BTreeMap::new();
            for (_, _, payload) in &run.live {
                let (action, order) = payload.split_once(':').unwrap();
                want.insert(order.to_owned(), action.to_owned());
            }
            let got: BTreeMap<String, String> = sqlx::query_as::<_, (String, String)>(
                "SELECT order_id, status FROM orders WHERE tenant = $1 AND run = $2",
            )
            .bind(run.branch.tenant.as_str())
            .bind(run.branch.run.as_str())
            .fetch_all(&consumer_pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
            assert_eq!(got, want, "{}: orders", run.branch);
        }
        let rewinds: usize = runs.iter().map(|run| run.forks).sum();
        println!(
            "{expected_events} live events, {rewinds} rewinds, {} handler calls, {} failed after writing",
            orders.calls.load(Ordering::SeqCst),
            orders.failed.lock().unwrap().len()
        );
        assert!(rewinds >= 6);

        let totals = consumer.stop().await;
        assert_eq!(totals.rejected, 0);
        assert!(totals.reconnects >= 1, "the consumer never lost the broker: {totals:?}");
        relay.shutdown().await;
        other_relay.shutdown().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

fn headers(tenant: &str, run: &str, branch: &str, lsn: i64, prev: i64) -> FieldTable {
    let mut headers = FieldTable::default();
    for (name, value) in [("tenant", tenant), ("run", run), ("branch", branch)] {
        headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
    }
    for (name, value) in [
        ("lsn", lsn),
        ("prev_lsn", prev),
        ("base_lsn", 0),
        ("created_at_us", 0),
    ] {
        headers.insert(name.into(), AMQPValue::LongLongInt(value));
    }
    headers
}

/// A message that breaks the contract, one that breaks its branch's chain, and one the
/// handler refuses for good are dead-lettered with their reasons; the messages after them on
/// the same partition are folded.
#[test]
fn poison_and_broken_chains_are_dead_lettered_and_the_partition_keeps_flowing() {
    host_runtime().block_on(async {
        let consumer_pool = consumer_database("poison").await;
        let config = relay_config(
            "postgres://unused@127.0.0.1/x",
            &amqp_url(),
            &unique("relay-poison"),
        );
        let mut rabbit = direct_rabbit(&config);
        rabbit.topology =
            distribution::rabbit::Topology::new(rabbit.topology.exchange().as_str(), 1).unwrap();
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        rabbit.topology.declare(&channel).await.unwrap();
        let exchange = rabbit.topology.exchange().clone();
        let routing = rabbit.topology.routing_key(Partition(0));
        let publish = |headers: Option<FieldTable>, body: &'static [u8]| {
            let channel = channel.clone();
            let exchange = exchange.clone();
            let routing = routing.clone();
            async move {
                let mut properties = BasicProperties::default();
                if let Some(headers) = headers {
                    properties = properties.with_headers(headers);
                }
                channel
                    .basic_publish(
                        exchange,
                        routing,
                        BasicPublishOptions::default(),
                        body,
                        properties,
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        };
        publish(None, b"no headers at all").await; // contract
        publish(Some(headers("t", "r", "a", 1, 0)), b"placed:o1").await;
        publish(Some(headers("t", "r", "a", 2, 1)), b"placed:o2").await;
        publish(Some(headers("t", "r", "a", 5, 1)), b"paid:o1").await; // broken chain
        publish(Some(headers("t", "r", "b", 1, 0)), b"garbage").await; // handler refuses
        publish(Some(headers("t", "r", "c", 1, 0)), b"placed:o9").await;

        let mut consumer_config = ConsumerConfig::new(rabbit.clone());
        consumer_config.retry = RetryPolicy {
            min: Duration::from_millis(10),
            max: Duration::from_millis(100),
        };
        let orders = Orders::new(0);
        let consumer = start_consumer(consumer_config, &consumer_pool, &orders);
        wait_until("good messages folded", Duration::from_secs(30), || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM order_events")
                .fetch_one(&consumer_pool)
                .await
                .unwrap();
            n == 3
        })
        .await;
        let totals = consumer.stop().await;
        assert_eq!(totals.rejected, 3, "{totals:?}");

        // The dead-letter queue holds the three, each with its reason.
        let dead = connection.create_channel().await.unwrap();
        let mut stream = dead
            .basic_consume(
                rabbit.topology.dead_letter_queue(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut reasons = Vec::new();
        for _ in 0..3 {
            let delivery = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            let reason = match delivery
                .properties
                .headers()
                .as_ref()
                .unwrap()
                .inner()
                .get(DEAD_LETTER_REASON)
            {
                Some(AMQPValue::LongString(reason)) => {
                    String::from_utf8_lossy(reason.as_bytes()).into_owned()
                }
                other => panic!("no reason: {other:?}"),
            };
            reasons.push(reason.split(':').next().unwrap().to_owned());
        }
        reasons.sort();
        assert_eq!(reasons, ["broken_chain", "contract", "handler"]);
        drop_topology(&rabbit.topology).await;
    });
}

/// Consumers (each partition's subscriber on its own connection) killed again and again at
/// points spread over their start (connecting, subscribing, consuming) leave no subscription
/// open: a subscriber that outlived its consumer would take messages up to its prefetch and
/// never ack or give them back. The deterministic case, a `basic.consume` abandoned before
/// its answer, is `rabbit/tests/abandoned.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumers_killed_while_starting_leave_no_subscription_open() {
    let (_pool, url) = fresh_database("killedstart").await;
    let config = relay_config(&url, &amqp_url(), &unique("relay-killedstart"));
    let rabbit = direct_rabbit(&config);
    let topology = rabbit.topology.clone();
    let probe = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let subscribers = || async {
        let channel = probe.create_channel().await.unwrap();
        let mut total = 0;
        for partition in 0..topology.partitions() {
            let queue = channel
                .queue_declare(
                    topology.queue(Partition(partition)),
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .unwrap();
            total += queue.consumer_count();
        }
        let _ = channel.close(200, "counted".into()).await;
        total
    };
    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology(&topology).await;
        // A consumer that ran to the end subscribes every partition (the count is right).
        let own = PgPool::connect_lazy(&url).unwrap();
        let consumer = Consumer::new(ConsumerConfig::new(rabbit.clone()), own.clone(), EventTable);
        let running = until_stopped(|stopped| consumer.run(stopped));
        let all = u32::from(topology.partitions());
        wait_until(
            "every partition subscribed",
            Duration::from_secs(10),
            || async { subscribers().await == all },
        )
        .await;
        running.stop().await.unwrap();
        own.close().await;
        // Killed 40 times, 0 to 58 ms after it started.
        for attempt in 0..40u64 {
            let own = PgPool::connect_lazy(&url).unwrap();
            let consumer =
                Consumer::new(ConsumerConfig::new(rabbit.clone()), own.clone(), EventTable);
            let task = tokio::spawn(consumer.run(std::future::pending()));
            tokio::time::sleep(Duration::from_micros(attempt * 1_500)).await;
            task.abort();
            let _ = task.await;
            own.close().await;
        }
        assert!(
            holds_within(Duration::from_secs(10), || async {
                subscribers().await == 0
            })
            .await,
            "{} subscription(s) outlived their consumers",
            subscribers().await
        );
    })
    .catch_unwind()
    .await;
    drop_topology(&topology).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

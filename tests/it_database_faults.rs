//! The relay's database connections failing the way real networks fail them.
#[path = "support/harness.rs"]
mod harness;

mod database_faults {
    use std::time::Duration;

    use distribution::broker::{Consumer, ConsumerConfig, RetryPolicy};
    use distribution::store::{EventTable, FoldStore, IntentWriter, Lsn};
    use distribution::testing::BrokerProxy;
    use distribution::{APPLICATION_NAME, Relay};

    use crate::harness::*;

    /// Connections lost in the middle of calls, without a reset (a middlebox dropped their
    /// state: packets vanish and nothing tells either side), fail those calls after the batch
    /// timeout; the tenants' drainers start again on fresh connections and ship. The lost
    /// connections are closed, not handed back to the pool: with a pool of 2, both lost, a
    /// third tenant still ships. Before, each drainer, and with it its tenant, waited for the
    /// kernel to give up on the socket (about 15 minutes); and a connection handed back to the
    /// pool is tested there with a ping that waits just as long, holding its slot.
    #[test]
    fn connections_lost_mid_call_fail_the_calls_and_free_their_pool_slots() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("lostconn").await;
            let network = BrokerProxy::start(&url).unwrap();
            let mut config = relay_config(&network.amqp_url(), &amqp_url(), &unique("relay-lost"));
            config.db_connections = 2;
            config.supervisor.drainer.batch_timeout = Duration::from_secs(2);
            // Leases that outlive the whole test: the drainers must be freed by their own
            // timeouts, not by a lost bucket.
            config.supervisor.lease.ttl = Duration::from_secs(600);
            config.supervisor.lease.heartbeat = Duration::from_secs(60);
            let fold = FoldStore::new(pool.clone());
            let folding = Folding::start(direct_rabbit(&config), &fold);

            // Two tenants' first intents, their rows locked by the test: the relay publishes
            // them, and both acks (the DELETEs) wait on the locks, holding both connections.
            let first = write_first_intent(&pool, "lost-a", b"a1").await;
            let second = write_first_intent(&pool, "lost-b", b"b1").await;
            let mut holder = pool.begin().await.unwrap();
            sqlx::query("SELECT 1 FROM relay_outbox WHERE tenant_id IN ($1, $2) FOR UPDATE")
                .bind(first.tenant.as_str())
                .bind(second.tenant.as_str())
                .execute(&mut *holder)
                .await
                .unwrap();
            let relay = Relay::start(config.clone()).await.unwrap();
            wait_until(
                "both of the relay's acks wait on the row locks",
                Duration::from_secs(30),
                || async {
                    sqlx::query_scalar::<_, i64>(
                        "SELECT count(*) FROM pg_stat_activity
                          WHERE datname = current_database() AND application_name = $1
                            AND wait_event_type = 'Lock'",
                    )
                    .bind(APPLICATION_NAME)
                    .fetch_one(&pool)
                    .await
                    .unwrap()
                        == 2
                },
            )
            .await;
            // The network loses every open connection of the relay, the waiting ones among
            // them; then the locks go, and PostgreSQL's answers to the acks go nowhere.
            network.lose_open_connections();
            holder.commit().await.unwrap();

            // The host writes each tenant's next intent, and a third tenant's first.
            let writer = IntentWriter::default();
            for (branch, payload) in [(&first, b"a2"), (&second, b"b2")] {
                let mut tx = pool.begin().await.unwrap();
                writer
                    .append(&mut tx, branch, Lsn::new(2), payload)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
            let third = write_first_intent(&pool, "lost-c", b"c1").await;
            let mut expected = Expected::new();
            expected.insert(
                first.clone(),
                vec![(Lsn::new(1), b"a1".to_vec()), (Lsn::new(2), b"a2".to_vec())],
            );
            expected.insert(
                second.clone(),
                vec![(Lsn::new(1), b"b1".to_vec()), (Lsn::new(2), b"b2".to_vec())],
            );
            expected.insert(third.clone(), vec![(Lsn::new(1), b"c1".to_vec())]);
            wait_until(
                "every tenant folded past the lost connections",
                Duration::from_secs(30),
                || async { folded_count(&fold, &expected).await == 5 },
            )
            .await;
            assert_folded_exactly(&fold, &expected).await;

            relay.shutdown().await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }

    /// The consumer's side: a fold whose connection is lost mid-call (waiting on its branch's
    /// fold cursor when the network loses the connection) is abandoned after `fold_timeout`
    /// and retried on a fresh connection, the lost one closed rather than pooled (the pool has
    /// one); the partition goes on folding, exactly once. Before, the partition waited for the
    /// kernel to give up on the socket.
    #[test]
    fn a_fold_whose_connection_is_lost_mid_call_is_retried_and_its_partition_flows() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("lostfold").await;
            let network = BrokerProxy::start(&url).unwrap();
            let config = relay_config(&url, &amqp_url(), &unique("relay-lostfold"));
            let relay = Relay::start(config.clone()).await.unwrap();
            // The consumer reaches its database through the network that will lose connections,
            // with a pool of one: a lost connection handed back to the pool would hold it.
            let consumer_pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&format!(
                    "{}?application_name=lost-fold",
                    network.amqp_url()
                ))
                .await
                .unwrap();
            let mut consumer_config = ConsumerConfig::new(direct_rabbit(&config));
            consumer_config.fold_timeout = Duration::from_secs(2);
            consumer_config.retry = RetryPolicy {
                min: Duration::from_millis(20),
                max: Duration::from_millis(500),
            };
            let (stop, mut stopped) = tokio::sync::watch::channel(false);
            let consumer = Consumer::new(consumer_config, consumer_pool, EventTable);
            let running = tokio::spawn(consumer.run(async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            }));
            let fold = FoldStore::new(pool.clone());
            let writer = IntentWriter::default();
            let append = |lsn: u64, payload: &'static [u8]| {
                let (pool, writer) = (pool.clone(), writer.clone());
                async move {
                    let branch = distribution::store::BranchKey::new(
                        distribution::store::TenantId::new("lostfold").unwrap(),
                        distribution::store::RunId::new("r").unwrap(),
                        distribution::store::BranchId::new("b").unwrap(),
                    );
                    let mut tx = pool.begin().await.unwrap();
                    writer
                        .append(&mut tx, &branch, Lsn::new(lsn), payload)
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                }
            };
            let branch = write_first_intent(&pool, "lostfold", b"first").await;
            let mut expected = Expected::new();
            expected.insert(branch.clone(), vec![(Lsn::new(1), b"first".to_vec())]);
            wait_until(
                "the first intent folded",
                Duration::from_secs(30),
                || async { folded_count(&fold, &expected).await == 1 },
            )
            .await;

            // The branch's fold cursor is locked by the test: the next fold waits on it.
            let mut holder = pool.begin().await.unwrap();
            sqlx::query("SELECT 1 FROM relay_fold_cursor WHERE tenant_id = $1 FOR UPDATE")
                .bind(branch.tenant.as_str())
                .execute(&mut *holder)
                .await
                .unwrap();
            append(2, b"second").await;
            wait_until(
                "the consumer's fold waits on the cursor's lock",
                Duration::from_secs(30),
                || async {
                    sqlx::query_scalar::<_, i64>(
                        "SELECT count(*) FROM pg_stat_activity
                          WHERE datname = current_database() AND application_name = 'lost-fold'
                            AND wait_event_type = 'Lock'",
                    )
                    .fetch_one(&pool)
                    .await
                    .unwrap()
                        > 0
                },
            )
            .await;
            // The network loses the consumer's open connections, the waiting one among them;
            // then the lock goes, and PostgreSQL's answer goes nowhere.
            network.lose_open_connections();
            holder.commit().await.unwrap();
            append(3, b"third").await;
            expected.insert(
                branch.clone(),
                vec![
                    (Lsn::new(1), b"first".to_vec()),
                    (Lsn::new(2), b"second".to_vec()),
                    (Lsn::new(3), b"third".to_vec()),
                ],
            );
            wait_until(
                "the partition folds on past the lost connection",
                Duration::from_secs(30),
                || async { folded_count(&fold, &expected).await == 3 },
            )
            .await;
            assert_folded_exactly(&fold, &expected).await;

            let _ = stop.send(true);
            running.await.unwrap().unwrap();
            relay.shutdown().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }
}

//! The relay's database connections failing the way real networks fail them.

use std::time::Duration;

use distribution::broker::RetryPolicy;
use distribution::consumer::{Consumer, ConsumerConfig};
use distribution::store::{EventTable, FoldStore, Lsn};
use distribution::testing::BrokerProxy;
use distribution::{APPLICATION_NAME, Relay};

use crate::harness::*;

/// Backends of this database with `application_name` that wait on a lock.
async fn waiting_on_locks(pool: &sqlx::PgPool, application_name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND application_name = $1
            AND wait_event_type = 'Lock'",
    )
    .bind(application_name)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A connection lost in the middle of a call, without a reset (a middlebox dropped its
/// state: packets vanish and nothing tells either side), fails that call after the batch
/// timeout; the tenant's drainer starts again on a fresh connection and the tenant ships.
/// Before, the drainer, and with it its tenant, waited for the kernel to give up on the
/// socket (about 15 minutes).
#[test]
fn a_connection_lost_mid_call_fails_the_call_instead_of_holding_its_tenant() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("lostconn").await;
        let network = BrokerProxy::start(&url).unwrap();
        let mut config = relay_config(&network.amqp_url(), &amqp_url(), &unique("relay-lost"));
        config.supervisor.drainer.batch_timeout = Duration::from_secs(2);
        // Leases that outlive the whole test: the drainer must be freed by its own
        // timeout, not by a lost bucket.
        config.supervisor.lease.ttl = Duration::from_secs(600);
        config.supervisor.lease.heartbeat = Duration::from_secs(60);
        let fold = FoldStore::new(pool.clone());
        let folding = Folding::start(direct_rabbit(&config), &fold);

        // The first intent's row is locked by the test: the relay publishes it, and its
        // ack (the DELETE) waits on the lock.
        let branch = write_first_intent(&pool, "lost", b"first").await;
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM relay_outbox WHERE tenant_id = $1 FOR UPDATE")
            .bind(branch.tenant.as_str())
            .execute(&mut *holder)
            .await
            .unwrap();
        let relay = Relay::start(config.clone()).await.unwrap();
        wait_until(
            "the relay's ack waits on the row lock",
            Duration::from_secs(30),
            || async { waiting_on_locks(&pool, APPLICATION_NAME).await > 0 },
        )
        .await;
        // The network loses every open connection of the relay, the waiting one among
        // them; then the lock goes, and PostgreSQL's answer to the ack goes nowhere.
        network.lose_open_connections();
        holder.commit().await.unwrap();

        // The host writes the tenant's next intent: it ships once the drainer gave up.
        append_intent(&pool, &branch, 2, b"second").await;
        let mut expected = Expected::new();
        expected.insert(
            branch.clone(),
            vec![
                (Lsn::new(1), b"first".to_vec()),
                (Lsn::new(2), b"second".to_vec()),
            ],
        );
        wait_until(
            "the tenant's next intent folded",
            Duration::from_secs(30),
            || async { folded_count(&fold, &expected).await == 2 },
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
/// and retried on a fresh connection; the partition goes on folding, exactly once. Before,
/// the partition waited for the kernel to give up on the socket.
#[test]
fn a_fold_whose_connection_is_lost_mid_call_is_retried_and_its_partition_flows() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("lostfold").await;
        let network = BrokerProxy::start(&url).unwrap();
        let config = relay_config(&url, &amqp_url(), &unique("relay-lostfold"));
        let relay = Relay::start(config.clone()).await.unwrap();
        // The consumer reaches its database through the network that will lose connections.
        let consumer_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
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
        let consumer = Consumer::new(consumer_config, consumer_pool, EventTable);
        let running = until_stopped(|stopped| consumer.run(stopped));
        let fold = FoldStore::new(pool.clone());
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
        append_intent(&pool, &branch, 2, b"second").await;
        wait_until(
            "the consumer's fold waits on the cursor's lock",
            Duration::from_secs(30),
            || async { waiting_on_locks(&pool, "lost-fold").await > 0 },
        )
        .await;
        // The network loses the consumer's open connections, the waiting one among them;
        // then the lock goes, and PostgreSQL's answer goes nowhere.
        network.lose_open_connections();
        holder.commit().await.unwrap();
        append_intent(&pool, &branch, 3, b"third").await;
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

        running.stop().await.unwrap();
        relay.shutdown().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

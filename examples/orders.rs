//! A host writes `order placed` / `order paid` events with its state; the relay ships them; a
//! consumer projects them into its own `orders` table exactly once, rewinds included.
//!
//! ```sh
//! cargo run --example orders      # needs PostgreSQL and RabbitMQ (see README, "Two commands")
//! ```
//! It creates two throwaway databases (the host's and the consumer's) and its own exchange and
//! queues, and removes them at the end. Copy the `Orders` projection: it is the whole consumer.
use std::time::Duration;

use anyhow::{Context, Result};
use distribution::consumer::{Consumer, ConsumerConfig};
use distribution::store::{
    self, BranchId, BranchKey, IntentWriter, Lsn, OutboxEvent, Projection, RewindNotice, RunId,
    TenantId,
};
use distribution::{Relay, RelayConfig};
use sqlx::{Connection, PgConnection, PgPool};

/// The consumer's projection: its own tables, written in the fold's transaction, so they commit
/// atomically with the fold's cursor. `order_events` keeps what was applied (to undo a rewind);
/// `orders` is the state the user reads.
#[derive(Clone)]
struct Orders;

#[derive(Debug, thiserror::Error)]
enum OrdersError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error("not an order event: {0:?}")]
    NotAnOrder(String),
}

impl Orders {
    const SCHEMA: &str = "
        CREATE TABLE IF NOT EXISTS order_events (
            tenant text, run text, branch text, lsn bigint, order_id text, status text,
            PRIMARY KEY (tenant, run, branch, lsn));
        CREATE TABLE IF NOT EXISTS orders (
            tenant text, order_id text, status text, PRIMARY KEY (tenant, order_id));";

    /// Sets an order's status from the last event still applied (none: the order is gone).
    async fn refresh(tx: &mut PgConnection, tenant: &str, order: &str) -> Result<(), sqlx::Error> {
        sqlx::query("DELETE FROM orders WHERE tenant = $1 AND order_id = $2")
            .bind(tenant)
            .bind(order)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO orders (tenant, order_id, status)
             SELECT tenant, order_id, status FROM order_events
              WHERE tenant = $1 AND order_id = $2 ORDER BY lsn DESC LIMIT 1",
        )
        .bind(tenant)
        .bind(order)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

impl Projection for Orders {
    type Error = OrdersError;

    async fn apply(
        &mut self,
        tx: &mut PgConnection,
        event: &OutboxEvent,
    ) -> Result<(), OrdersError> {
        let text = String::from_utf8_lossy(&event.payload).into_owned();
        let (status, order) = text
            .split_once(' ')
            .ok_or_else(|| OrdersError::NotAnOrder(text.clone()))?;
        let key = &event.key.branch;
        sqlx::query("INSERT INTO order_events VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(key.tenant.as_str())
            .bind(key.run.as_str())
            .bind(key.branch.as_str())
            .bind(event.key.lsn.get() as i64)
            .bind(order)
            .bind(status)
            .execute(&mut *tx)
            .await?;
        Self::refresh(tx, key.tenant.as_str(), order).await?;
        Ok(())
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &RewindNotice,
    ) -> Result<(), OrdersError> {
        let key = &rewind.branch;
        let undone: Vec<String> = sqlx::query_scalar(
            "DELETE FROM order_events
              WHERE tenant = $1 AND run = $2 AND branch = $3 AND lsn > $4 RETURNING order_id",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(rewind.fork.get() as i64)
        .fetch_all(&mut *tx)
        .await?;
        for order in undone {
            Self::refresh(tx, key.tenant.as_str(), &order).await?;
        }
        Ok(())
    }

    /// A payload that is not an order never will be: dead-letter it. Database errors retry.
    fn is_permanent(error: &OrdersError) -> bool {
        matches!(error, OrdersError::NotAnOrder(_))
    }
}

async fn create_database(admin: &mut PgConnection, server: &str, name: &str) -> Result<PgPool> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut *admin)
        .await?;
    Ok(PgPool::connect(&format!("{server}/{name}")).await?)
}

/// Removes the example's exchange and queues.
async fn drop_topology(config: &RelayConfig) -> Result<()> {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let topology = config.rabbit_config()?.topology;
    let connection = lapin::Connection::connect(&config.amqp_url, Default::default()).await?;
    let channel = connection.create_channel().await?;
    let queues =
        (0..topology.partitions()).map(|p| topology.queue(distribution::broker::Partition(p)));
    for queue in queues.chain([topology.dead_letter_queue()]) {
        channel
            .queue_delete(queue, QueueDeleteOptions::default())
            .await?;
    }
    channel
        .exchange_delete(
            topology.exchange().clone(),
            ExchangeDeleteOptions::default(),
        )
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let amqp = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let server = url
        .rsplit_once('/')
        .context("DATABASE_URL names no database")?
        .0;
    let mut admin = PgConnection::connect(&url)
        .await
        .context("cannot reach PostgreSQL")?;
    let stamp = std::process::id();
    let (host_db, consumer_db) = (
        format!("orders_host_{stamp}"),
        format!("orders_consumer_{stamp}"),
    );

    // The host's database holds the outbox; the consumer's only the fold's tables and its own.
    let host = create_database(&mut admin, server, &host_db).await?;
    store::migrate(&host).await?;
    let consumer_pool = create_database(&mut admin, server, &consumer_db).await?;
    store::migrate_fold(&consumer_pool).await?;
    sqlx::raw_sql(Orders::SCHEMA)
        .execute(&consumer_pool)
        .await?;

    let mut config = RelayConfig::new(format!("{server}/{host_db}"), amqp);
    config.topology = format!("orders-example-{stamp}");
    let relay = Relay::start(config.clone()).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let consumer = Consumer::new(
        ConsumerConfig::new(config.rabbit_config()?),
        consumer_pool.clone(),
        Orders,
    );
    let consuming = tokio::spawn(consumer.run(async move {
        let mut stopped = stopped;
        let _ = stopped.wait_for(|stop| *stop).await;
    }));

    // The host: each event in the same transaction as its own state (elided here).
    let writer = IntentWriter::default();
    let run = BranchKey::new(
        TenantId::new("shop")?,
        RunId::new("day-1")?,
        BranchId::new("main")?,
    );
    writer.open_run(&mut *host.acquire().await?, &run).await?;
    let events = ["placed o1", "placed o2", "paid o1", "paid o2"];
    for (lsn, event) in (1..).zip(events) {
        let mut tx = host.begin().await?;
        writer
            .append(&mut tx, &run, Lsn::new(lsn), event.as_bytes())
            .await?;
        tx.commit().await?;
    }
    // The agent backtracks: "paid o2" (Lsn 4) never happened; o2 is cancelled instead.
    let mut tx = host.begin().await?;
    let rewound = writer
        .rewind(&mut tx, &run, Lsn::new(3), BranchId::new("retry")?)
        .await?;
    writer
        .append(&mut tx, &rewound.live, Lsn::new(4), b"cancelled o2")
        .await?;
    tx.commit().await?;

    // Wait until the consumer's table shows the live history.
    let want = vec![
        ("o1".to_owned(), "paid".to_owned()),
        ("o2".to_owned(), "cancelled".to_owned()),
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let orders = loop {
        let orders: Vec<(String, String)> =
            sqlx::query_as("SELECT order_id, status FROM orders ORDER BY order_id")
                .fetch_all(&consumer_pool)
                .await?;
        if orders == want || tokio::time::Instant::now() > deadline {
            break orders;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("orders in the consumer's own table:");
    for (order, status) in &orders {
        println!("  {order}: {status}");
    }

    let _ = stop.send(true);
    let totals = consuming.await??;
    println!(
        "folded {} events and {} rewind, exactly once ({} redeliveries ignored)",
        totals.applied, totals.rewinds, totals.duplicates
    );
    relay.shutdown().await;
    drop_topology(&config).await?;
    host.close().await;
    consumer_pool.close().await;
    for name in [host_db, consumer_db] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&mut admin)
        .await?;
    }
    anyhow::ensure!(
        orders == want,
        "the consumer's orders are {orders:?}, expected {want:?}"
    );
    Ok(())
}

//! README.md's Rust snippets, compiled and run on the real services: each ```rust block of the
//! README is, character for character, a region of this file between `// README:begin` and
//! `// README:end`, and the tests below run those regions. Alone in its binary: the metrics
//! snippet installs the process-wide metrics recorder.
#[path = "it/harness.rs"]
mod harness;

use std::time::Duration;

use distribution::RelayConfig;
use distribution::store::{BranchId, BranchKey, Outbox, RunId, TenantId};

use crate::harness::*;

const README: &str = include_str!("../README.md");
const THIS: &str = include_str!("readme.rs");

/// The README's ```rust blocks, in order.
fn readme_blocks() -> Vec<String> {
    let mut blocks = Vec::new();
    let mut block: Option<Vec<&str>> = None;
    for line in README.lines() {
        match (&mut block, line.trim_end()) {
            (None, "```rust") => block = Some(Vec::new()),
            (Some(lines), "```") => {
                blocks.push(lines.join("\n"));
                block = None;
            }
            (Some(lines), _) => lines.push(line.trim_end()),
            (None, _) => {}
        }
    }
    blocks
}

/// This file's regions, each without the indentation of its `// README:begin` line.
fn regions() -> Vec<String> {
    let mut regions = Vec::new();
    let mut region: Option<(usize, Vec<String>)> = None;
    for line in THIS.lines() {
        let marker = line.trim();
        if marker == concat!("// README:", "begin") {
            region = Some((line.len() - marker.len(), Vec::new()));
        } else if marker == concat!("// README:", "end") {
            let (_, lines) = region.take().expect("an end after a begin");
            regions.push(lines.join("\n"));
        } else if let Some((indent, lines)) = &mut region {
            let text = line.get(*indent..).unwrap_or_else(|| line.trim_start());
            lines.push(text.trim_end().to_owned());
        }
    }
    regions
}

#[test]
fn every_rust_snippet_of_the_readme_is_a_region_run_here() {
    let (blocks, regions) = (readme_blocks(), regions());
    assert_eq!(blocks.len(), 4, "the README's rust blocks: {blocks:#?}");
    assert_eq!(blocks, regions, "README.md and tests/readme.rs differ");
}

/// A relay configuration of the suite's services, on a database and topology of its own.
async fn setting_up(label: &str) -> (sqlx::PgPool, RelayConfig, BranchKey) {
    let (pool, url) = fresh_database(label).await;
    let mut config = RelayConfig::new(&url, amqp_url());
    config.topology = unique(&format!("readme-{label}"));
    config.db_connections = 2;
    let branch = BranchKey::new(
        TenantId::new("acme").unwrap(),
        RunId::new("run-1").unwrap(),
        BranchId::new("main").unwrap(),
    );
    (pool, config, branch)
}

/// "Embedding in a host" and its metadata, as the README shows them: both intents ship.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedding_as_the_readme_shows() -> anyhow::Result<()> {
    let (pool, config, branch) = setting_up("embed").await;
    let topology = config.rabbit_config()?.topology;
    let payload = br#"{"step":1}"#.to_vec();
    // README:begin
    use distribution::Relay;
    use distribution::store::{IntentWriter, Lsn};

    let relay = Relay::start(config).await?; // its own threads, "outbox-relay"
    let writer = IntentWriter::default();
    let mut tx = pool.begin().await?;
    writer.open_run(&mut tx, &branch).await?; // once per run: its first branch, at Lsn 0
    // ... the host's own state writes in `tx` ...
    writer
        .append(&mut tx, &branch, Lsn::new(1), &payload)
        .await?; // commits with them
    tx.commit().await?;
    // README:end
    // README:begin
    use distribution::store::{EventType, Intent};

    let intent = Intent::new(br#"{"order":7}"#)
        .event_type(EventType::new("order.created")?) // AMQP `type`; consumers filter on it
        .content_type("application/json") // default: application/octet-stream
        .correlation_id("req-42")
        .header("region", "eu-west-1"); // your own headers, as AMQP headers
    let mut tx = pool.begin().await?;
    writer
        .append_intent(&mut tx, &branch, Lsn::new(2), intent)
        .await?;
    tx.commit().await?;
    // README:end
    let outbox = Outbox::new(pool.clone());
    wait_until("both shipped", Duration::from_secs(60), || async {
        pending(&outbox).await == 0
    })
    .await;
    relay.shutdown().await;
    drop_topology(&topology).await;
    Ok(())
}

/// "Consuming", as the README shows it: what the host wrote reaches the consumer's table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consuming_as_the_readme_shows() -> anyhow::Result<()> {
    let (pool, config, _) = setting_up("consume").await;
    let topology = config.rabbit_config()?.topology;
    let relay = distribution::Relay::start(config.clone()).await?;
    let branch = write_first_intent(&pool, "acme", b"first").await;
    append_intent(&pool, &branch, 2, b"second").await;
    let fold_pool = empty_database("consume_fold").await.0;
    distribution::store::migrate_fold(&fold_pool).await?;
    sqlx::query("CREATE TABLE orders (run text, branch text, lsn bigint, body bytea)")
        .execute(&fold_pool)
        .await?;
    let fold_check = fold_pool.clone();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    // README:begin
    use distribution::consumer::{Consumer, ConsumerConfig};
    use distribution::store::{OutboxEvent, Projection, RewindNotice};
    use sqlx::PgConnection;

    #[derive(Clone)]
    struct Orders;

    impl Projection for Orders {
        type Error = sqlx::Error;

        async fn apply(&mut self, tx: &mut PgConnection, event: &OutboxEvent) -> sqlx::Result<()> {
            let key = &event.key;
            sqlx::query("INSERT INTO orders VALUES ($1, $2, $3, $4)")
                .bind(key.branch.run.as_str())
                .bind(key.branch.branch.as_str())
                .bind(key.lsn.get() as i64)
                .bind(&event.payload)
                .execute(tx)
                .await?;
            Ok(())
        }

        // A branch was rewound at `fork`: undo what was applied of it above.
        async fn rewind(&mut self, tx: &mut PgConnection, r: &RewindNotice) -> sqlx::Result<()> {
            sqlx::query("DELETE FROM orders WHERE run = $1 AND branch = $2 AND lsn > $3")
                .bind(r.branch.run.as_str())
                .bind(r.branch.branch.as_str())
                .bind(r.fork.get() as i64)
                .execute(tx)
                .await?;
            Ok(())
        }
    }

    let rabbit = config.rabbit_config()?; // the relay's broker and topology
    let consumer = Consumer::new(ConsumerConfig::new(rabbit), fold_pool, Orders);
    let consuming = tokio::spawn(consumer.run(shutdown)); // reconnects by itself until `shutdown`
    // README:end
    wait_until(
        "both folded into orders",
        Duration::from_secs(60),
        || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
                .fetch_one(&fold_check)
                .await
                .unwrap_or(0)
                == 2
        },
    )
    .await;
    stop.send(true)?;
    consuming.await??;
    relay.shutdown().await;
    drop_topology(&topology).await;
    Ok(())
}

/// "Metrics", as the README shows it: the relay's metrics are described and its lag recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_as_the_readme_shows() -> anyhow::Result<()> {
    let (pool, config, _) = setting_up("metrics").await;
    let topology = config.rabbit_config()?.topology;
    // README:begin
    let prometheus = distribution::prometheus_builder()?.install_recorder()?; // lag buckets set
    distribution::describe_metrics(config.supervisor.publishers()); // HELP lines, zeros
    let relay = distribution::Relay::start(config).await?;
    // serve prometheus.render() on the host's own /metrics route; call
    // prometheus.run_upkeep() every few seconds
    // README:end
    write_first_intent(&pool, "metrics", b"x").await;
    let outbox = Outbox::new(pool.clone());
    wait_until("shipped", Duration::from_secs(60), || async {
        pending(&outbox).await == 0
    })
    .await;
    let scraped = prometheus.render();
    for line in [
        "# HELP relay_write_to_confirm_seconds",
        "relay_write_to_confirm_seconds_bucket{le=\"0.001\"}",
        "relay_drainer_restarts_total 0",
    ] {
        assert!(scraped.contains(line), "{line} missing from {scraped}");
    }
    relay.shutdown().await;
    drop_topology(&topology).await;
    Ok(())
}

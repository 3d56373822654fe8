//! The bench's harness: scratch databases and topologies, the standalone relay's process, its metrics.
use super::*;

pub(crate) fn unique(label: &str) -> String {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or_default();
    format!("{label}_{}_{micros}", std::process::id())
}

pub(crate) struct Env {
    pub(crate) admin: PgConnection,
    pub(crate) server: String,
    /// One broker address, or a cluster's, comma-separated (section 13).
    pub(crate) amqp: String,
    pub(crate) databases: Vec<String>,
    /// The queue type of every topology made (section 13 changes it).
    pub(crate) queue_type: QueueType,
}

impl Env {
    pub(crate) async fn database(&mut self, label: &str) -> Result<(PgPool, String)> {
        let name = unique(&format!("relay_bench_{label}"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut self.admin)
            .await?;
        self.databases.push(name.clone());
        let url = format!("{}/{name}", self.server);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await?;
        store::migrate(&pool).await?;
        Ok((pool, url))
    }

    pub(crate) fn rabbit(&self, label: &str, partitions: u16) -> Result<RabbitConfig> {
        let topology = Topology::new(&unique(&format!("relay-bench-{label}")), partitions)?
            .with_queue_type(self.queue_type);
        Ok(RabbitConfig::new(self.amqp.clone(), topology)?)
    }

    pub(crate) fn relay_config(&self, url: &str, rabbit: &RabbitConfig) -> RelayConfig {
        let mut config = RelayConfig::new(url, self.amqp.clone());
        config.topology = rabbit.topology.exchange().to_string();
        config.partitions = rabbit.topology.partitions();
        config.queue_type = self.queue_type;
        if let Some(window) = std::env::var("BENCH_WINDOW")
            .ok()
            .and_then(|w| w.parse().ok())
        {
            config.supervisor.drainer.max_batches_in_flight = window;
        }
        config
    }

    /// Writes back every dirty page of earlier work (`CHECKPOINT`), so a checkpoint of an
    /// earlier run's writes (a fill, a drain) never lands in the next timed run, on either side.
    pub(crate) async fn checkpoint(&mut self) -> Result<()> {
        sqlx::raw_sql("CHECKPOINT").execute(&mut self.admin).await?;
        Ok(())
    }

    /// Drops the database at `url` (one of [`Env::database`]'s) now rather than at cleanup, so
    /// that nothing it owes (autovacuum of what a run deleted) lands in a later timed run.
    pub(crate) async fn drop_database(&mut self, url: &str) -> Result<()> {
        let name = url.rsplit('/').next().unwrap_or(url).to_owned();
        let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&mut self.admin)
            .await?;
        self.databases.retain(|kept| *kept != name);
        Ok(())
    }

    pub(crate) async fn cleanup(&mut self) {
        for name in std::mem::take(&mut self.databases) {
            let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
                .execute(&mut self.admin)
                .await;
        }
    }
}

/// The first of `amqp`'s comma-separated addresses (plain lapin takes one).
pub(crate) fn first_address(amqp: &str) -> &str {
    amqp.split(',').next().unwrap_or(amqp).trim()
}

pub(crate) async fn declare(amqp: &str, topology: &Topology) -> Result<()> {
    let connection =
        lapin::Connection::connect(first_address(amqp), lapin::ConnectionProperties::default())
            .await?;
    topology
        .declare(&connection.create_channel().await?)
        .await?;
    Ok(())
}

pub(crate) async fn drop_topology(amqp: &str, topology: &Topology) -> Result<()> {
    let connection =
        lapin::Connection::connect(first_address(amqp), lapin::ConnectionProperties::default())
            .await?;
    let channel = connection.create_channel().await?;
    for group in topology.declared_groups() {
        for index in 0..topology.partitions() {
            channel
                .queue_delete(
                    topology.queue_of(group, Partition(index)),
                    QueueDeleteOptions::default(),
                )
                .await?;
        }
        channel
            .queue_delete(
                topology.dead_letter_queue_of(group),
                QueueDeleteOptions::default(),
            )
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

pub(crate) fn synthetic_events(n: usize) -> Vec<OutboxEvent> {
    (0..n)
        .map(|index| {
            let (tenant, run, lsn) = (index % 50, (index / 50) % 20, index / 1000 + 1);
            let branch = testkit::branch(&format!("t{tenant}"), &format!("r{run}"), "main");
            testkit::intent(&branch, lsn as u64)
                .payload(vec![b'x'; PAYLOAD_BYTES as usize])
                .build()
        })
        .collect()
}

/// Waits until the outbox is empty. Polls with the skip scan (a few index probes), not with
/// `backlog()`: a GROUP BY over a large backlog every few ms would load the very database the
/// relay under measurement needs.
pub(crate) async fn wait_drained(outbox: &Outbox, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    while !outbox.tenants_with_pending().await?.is_empty() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "backlog not drained within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

pub(crate) fn spawn_relay(
    url: &str,
    amqp: &str,
    rabbit: &RabbitConfig,
) -> Result<std::process::Child> {
    spawn_relay_at(url, amqp, rabbit, "127.0.0.1:0", 1000)
}

/// A standalone relay with its metrics on `metrics`, polling every `poll_ms` (backlogs that
/// fixtures write appear without NOTIFY: a short poll keeps discovery out of timed figures).
pub(crate) fn spawn_relay_at(
    url: &str,
    amqp: &str,
    rabbit: &RabbitConfig,
    metrics: &str,
    poll_ms: u32,
) -> Result<std::process::Child> {
    Ok(
        std::process::Command::new(env!("CARGO_BIN_EXE_distribution"))
            .arg("run")
            .env("DATABASE_URL", url)
            .env("AMQP_URL", amqp)
            .env("RELAY_TOPOLOGY", rabbit.topology.exchange().as_str())
            .env("RELAY_PARTITIONS", rabbit.topology.partitions().to_string())
            .env("RELAY_METRICS_ADDR", metrics)
            .env("RELAY_POLL_MS", poll_ms.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
    )
}

/// `/metrics` of a relay, as text (plain hyper).
pub(crate) async fn scrape(addr: &str) -> Option<String> {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .ok()?;
    tokio::spawn(connection);
    let request = hyper::Request::get("/metrics")
        .header("host", addr)
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .ok()?;
    let body = sender.send_request(request).await.ok()?.into_body();
    let bytes = body.collect().await.ok()?.to_bytes();
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// The sum of every sample of metric `name` in a scrape.
pub(crate) fn metric_sum(scraped: &str, name: &str) -> f64 {
    scraped
        .lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Transactions PostgreSQL counted in `database` so far.
pub(crate) async fn transactions(admin: &mut PgConnection, database: &str) -> Result<i64> {
    let (commits, rollbacks): (i64, i64) = sqlx::query_as(
        "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1",
    )
    .bind(database)
    .fetch_one(admin)
    .await?;
    Ok(commits + rollbacks)
}

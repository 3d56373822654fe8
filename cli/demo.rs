//! `distribution demo`: the seed's walk, end to end, on this machine's PostgreSQL and RabbitMQ
//! (or, with `--broker nats`, NATS JetStream).
//!
//! A simulated agent run writes its state and export intents in one transaction per step while
//! the broker is unreachable (a proxy the demo owns is cut; the broker itself keeps running). The
//! run completes; the backlog waits; the broker comes back; everything ships and is folded
//! exactly once, in order. The demo uses a database and broker names of its own and removes them.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use distribution::broker::RetryPolicy;
use distribution::consumer::{Consumer, ConsumerConfig, NatsConsumerConfig};
use distribution::store::{
    self, Backlog, BranchId, BranchKey, FoldStore, IntentWriter, Lsn, Outbox, RunId, TenantId,
};
use distribution::{Relay, RelayConfig};

use crate::proxy::BrokerProxy;
use distribution::BrokerKind;
use sqlx::{Connection, PgConnection, PgPool};

const TENANTS: [&str; 3] = ["acme", "globex", "initech"];
const RUNS: usize = 2;
const STEPS: u64 = 40;
const PARTITIONS: u16 = 4;

/// A backlog as a small table.
pub(crate) fn backlog_table(backlog: &[Backlog]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:>10} {:>14}",
        "tenant", "pending", "oldest (s)"
    );
    for tenant in backlog {
        let _ = writeln!(
            out,
            "{:<24} {:>10} {:>14.1}",
            tenant.tenant,
            tenant.pending,
            tenant.oldest_age.as_secs_f64()
        );
    }
    if backlog.is_empty() {
        let _ = writeln!(out, "(nothing pending)");
    }
    out
}

async fn wait_for<F, Fut>(what: &str, limit: Duration, mut done: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + limit;
    while !done().await? {
        if Instant::now() > deadline {
            bail!("timed out after {} s waiting for {what}", limit.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// One agent run: each step writes the run's state and its export intent in one transaction;
/// halfway, the run rewinds two steps and continues on a new branch.
/// Returns how many intents it appended and how many of them its rewind abandoned.
async fn agent_run(
    pool: &PgPool,
    writer: &IntentWriter,
    tenant: &str,
    run: usize,
) -> Result<(u64, u64)> {
    let mut branch = BranchKey::new(
        TenantId::new(tenant)?,
        RunId::new(format!("run-{run}"))?,
        BranchId::new("main")?,
    );
    writer
        .open_run(&mut *pool.acquire().await?, &branch)
        .await?;
    let mut lsn = 0;
    let (mut appended, mut abandoned) = (0, 0);
    for step in 1..=STEPS {
        if step == STEPS / 2 {
            let rewound = writer
                .rewind(
                    &mut *pool.acquire().await?,
                    &branch,
                    Lsn::new(lsn - 2),
                    BranchId::new("retry")?,
                )
                .await?;
            branch = rewound.live;
            lsn -= 2;
            abandoned += rewound.abandoned;
        }
        lsn += 1;
        let mut tx = pool.begin().await?;
        // The host's own state write (this demo plays the host).
        sqlx::query(
            "INSERT INTO demo_agent_state (tenant, run, step, note) VALUES ($1, $2, $3, $4)",
        )
        .bind(tenant)
        .bind(run as i64)
        .bind(step as i64)
        .bind(format!("thought {step}"))
        .execute(&mut *tx)
        .await?;
        let payload = format!("{{\"step\":{step},\"branch\":\"{}\"}}", branch.branch);
        writer
            .append(&mut tx, &branch, Lsn::new(lsn), payload.as_bytes())
            .await?;
        tx.commit().await?;
        appended += 1;
    }
    Ok((appended, abandoned))
}

/// The broker's URL.
fn broker_url(broker: BrokerKind) -> String {
    match broker {
        BrokerKind::RabbitMq => std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into()),
        BrokerKind::Nats => {
            std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
        }
    }
}

pub(crate) async fn run(broker: BrokerKind) -> Result<()> {
    let base_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let broker_url = broker_url(broker);
    let stamp = format!("{}_{}", std::process::id(), chrono_free_stamp());
    let database = format!("relay_demo_{stamp}");
    let mut admin = PgConnection::connect(&base_url)
        .await
        .context("cannot reach PostgreSQL (DATABASE_URL)")?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&mut admin)
        .await?;
    let server = base_url
        .rsplit_once('/')
        .map(|(server, _)| server.to_owned())
        .context("DATABASE_URL has no database")?;
    let url = format!("{server}/{database}");
    let (outcome, removed) = match broker {
        BrokerKind::RabbitMq => {
            let topology = format!("relay-demo-{stamp}");
            let outcome = walk(&url, broker, &broker_url, &topology).await;
            // Its exchange and queues go too, whatever the walk's outcome.
            (outcome, remove_topology(&broker_url, &topology).await)
        }
        BrokerKind::Nats => {
            let stream = format!("relay_demo_{stamp}");
            let outcome = walk(&url, broker, &broker_url, &stream).await;
            // Its streams go too, whatever the walk's outcome.
            (outcome, remove_stream(&url, &broker_url, &stream).await)
        }
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await?;
    outcome.and(removed)
}

/// Deletes the demo's exchange and queues from the broker.
async fn remove_topology(amqp_url: &str, topology: &str) -> Result<()> {
    let mut config = RelayConfig::new("postgres://unused", amqp_url.to_owned());
    config.topology = topology.to_owned();
    config.partitions = PARTITIONS;
    let rabbit = config.rabbit_config()?;
    let (_connection, channel) = distribution::rabbit::open(&rabbit, "outbox-relay-demo-cleanup")
        .await
        .context("cannot reach RabbitMQ to remove the demo's queues")?;
    rabbit
        .topology
        .delete(&channel)
        .await
        .context("removing the demo's queues")?;
    Ok(())
}

/// Deletes the demo's stream and dead-letter stream from NATS.
async fn remove_stream(database_url: &str, nats_url: &str, stream: &str) -> Result<()> {
    let mut config = RelayConfig::nats(database_url, nats_url);
    config.topology = stream.to_owned();
    config.partitions = PARTITIONS;
    distribution::nats::remove(&config.nats_config()?)
        .await
        .context("removing the demo's NATS streams")
}

fn chrono_free_stamp() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or_default()
}

async fn walk(url: &str, broker: BrokerKind, broker_url: &str, topology: &str) -> Result<()> {
    let broker_name = match broker {
        BrokerKind::RabbitMq => "RabbitMQ",
        BrokerKind::Nats => "NATS JetStream",
    };
    let pool = PgPool::connect(url).await?;
    store::migrate(&pool).await?;
    sqlx::query("CREATE TABLE demo_agent_state (tenant text, run bigint, step bigint, note text)")
        .execute(&pool)
        .await?;

    let proxy = BrokerProxy::start(broker_url).context("cannot start the broker proxy")?;
    proxy.cut();
    println!(
        "1. Broker DOWN: the relay talks to {broker_name} through a proxy at {}, now cut.",
        proxy.addr()
    );
    let mut config = match broker {
        BrokerKind::RabbitMq => RelayConfig::new(url, proxy.url()),
        BrokerKind::Nats => RelayConfig::nats(url, proxy.url()),
    };
    config.topology = topology.to_owned();
    config.partitions = PARTITIONS;
    config.supervisor.poll_interval = Duration::from_millis(200);
    config.supervisor.restart.max = Duration::from_millis(500);
    config.supervisor.drainer.retry.max = Duration::from_millis(500);
    // The consumer reaches the broker directly.
    let mut fold_config = config.clone();
    fold_config.amqp_url = broker_url.to_owned();
    fold_config.nats_url = broker_url.to_owned();
    let relay = Relay::start(config).await?;

    let writer = IntentWriter::default();
    let started = Instant::now();
    let (mut appended, mut abandoned) = (0, 0);
    for run in 0..RUNS {
        for tenant in TENANTS {
            let (run_appended, run_abandoned) = agent_run(&pool, &writer, tenant, run).await?;
            appended += run_appended;
            abandoned += run_abandoned;
        }
    }
    let runs = (RUNS * TENANTS.len()) as u64;
    // What waits to ship: the live intents, and one rewind marker per run.
    let expected = appended - abandoned;
    println!(
        "2. The agent runs COMPLETED with the broker down: {runs} runs appended {appended} intents in {:.2} s; \
         each run rewound once, abandoning {} unshipped intents ({abandoned} in all). \
         {expected} live intents and {runs} rewind markers wait to ship.",
        started.elapsed().as_secs_f64(),
        abandoned / runs.max(1),
    );
    let outbox = Outbox::new(pool.clone());
    let before = outbox.backlog().await?;
    println!(
        "3. Backlog waiting in the outbox (what `distribution status` shows; pending counts intents and markers):\n{}",
        backlog_table(&before)
    );

    proxy.restore();
    println!("4. Broker UP: proxy restored. Shipping and folding...");
    let fold = FoldStore::new(pool.clone());
    let (stop_tx, _) = tokio::sync::watch::channel(false);
    // A consumer folding every partition into the demo's projection (`EventTable`): one task
    // per RabbitMQ queue, or a group reading the NATS stream.
    let consumer = match broker {
        BrokerKind::RabbitMq => {
            // Reconnects quickly: the broker's proxy was down a moment ago.
            let mut rabbit = ConsumerConfig::new(fold_config.rabbit_config()?);
            rabbit.retry = RetryPolicy {
                min: Duration::from_millis(20),
                max: Duration::from_millis(500),
            };
            Consumer::new(rabbit, pool.clone(), store::EventTable)
        }
        BrokerKind::Nats => Consumer::on_nats(
            NatsConsumerConfig::new(fold_config.nats_config()?, "demo")?,
            pool.clone(),
            store::EventTable,
        ),
    };
    let mut stop = stop_tx.subscribe();
    let consuming = tokio::spawn(async move {
        consumer
            .run(async move {
                let _ = stop.wait_for(|stop| *stop).await;
            })
            .await
            .map(drop)
    });
    let shipping = Instant::now();
    let tenants: Vec<TenantId> = TENANTS
        .iter()
        .map(TenantId::new)
        .collect::<Result<_, _>>()?;
    wait_for(
        "every intent to be folded",
        Duration::from_secs(60),
        || async {
            let mut folded = 0;
            for tenant in &tenants {
                folded += fold.folded(tenant).await?.len() as u64;
            }
            Ok(folded == expected)
        },
    )
    .await?;
    let _ = stop_tx.send(true);
    consuming.await??;
    relay.shutdown().await;

    println!(
        "5. Everything shipped and folded in {:.2} s. Before / after:",
        shipping.elapsed().as_secs_f64()
    );
    println!(
        "{:<10} {:>16} {:>15} {:>8} {:>22}",
        "tenant", "pending before", "pending after", "folded", "in Lsn order per branch"
    );
    for tenant in &tenants {
        let pending_before = before
            .iter()
            .find(|b| &b.tenant == tenant)
            .map_or(0, |b| b.pending);
        let pending_after = outbox.tenant_backlog(tenant).await?.pending;
        let folded = fold.folded(tenant).await?;
        let mut last: BTreeMap<BranchKey, Lsn> = BTreeMap::new();
        let ordered = folded.iter().all(|event| {
            let previous = last.insert(event.key.branch.clone(), event.key.lsn);
            previous.is_none_or(|previous| previous < event.key.lsn)
        });
        println!(
            "{:<10} {:>16} {:>15} {:>8} {:>22}",
            tenant.as_str(),
            pending_before,
            pending_after,
            folded.len(),
            if ordered { "yes" } else { "NO" }
        );
    }
    println!(
        "pending before = folded intents + one rewind marker per run ({} per tenant); the {abandoned} abandoned intents were never exported.",
        RUNS
    );
    pool.close().await;
    Ok(())
}

//! `distribution run`: the standalone relay until Ctrl-C or SIGTERM.
use anyhow::{Context, Result};

use distribution::store::{self, Outbox};
use distribution::{Relay, RelayConfig};

use crate::outbox_cli::migrate_in;
use crate::{connect, serve};

pub(crate) async fn run(config: RelayConfig) -> Result<()> {
    // NATS_URL is a common variable (NATS's own tools read it), so a relay beside them is not
    // refused for it; but an operator who meant NATS and forgot RELAY_BROKER is told at once.
    if config.broker == distribution::BrokerKind::RabbitMq && !config.nats_url.is_empty() {
        let note = "NATS_URL is set but RELAY_BROKER is rabbitmq: events go to RabbitMQ \
                    (AMQP_URL); RELAY_BROKER=nats sends them to NATS";
        tracing::warn!("{note}");
        eprintln!("warning: {note}");
    }
    // The schema is applied first (idempotent, safe with several relays starting at once),
    // unless the host applies it with its own tool (`distribution sql`).
    if config.skip_migrate {
        let pool = connect(&config.database_url, config.schema().as_ref()).await?;
        wait_for_schema(&pool, config.schema_wait)
            .await
            .context("RELAY_SKIP_MIGRATE is set")?;
        pool.close().await;
    } else {
        migrate_in(&config.database_url, config.schema().as_ref()).await?;
    }
    // One connection to the broker: a refusal is fatal here (no retry fixes it); a broker that
    // is simply down is normal (everything waits in the outbox until it is back).
    if config.broker == distribution::BrokerKind::Nats {
        nats_preflight(&config).await?;
    } else {
        rabbit_preflight(&config).await?;
    }
    let metrics_addr = config.metrics_addr;
    let listener = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .with_context(|| format!("cannot serve metrics on {metrics_addr} (RELAY_METRICS_ADDR)"))?;
    let metrics = distribution::prometheus_builder()?
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    distribution::describe_metrics(config.supervisor_config().publishers());
    let max_parked = u64::from(config.ready_max_parked);
    // The readiness probe's own connection, so a busy relay pool cannot make it time out.
    let probe_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(std::time::Duration::from_secs(1))
        .connect_lazy_with(distribution::connect_options(
            &config.database_url,
            config.schema().as_ref(),
        )?);
    let relay = Relay::start(config).await?;
    serve::spawn(
        listener,
        serve::Probes {
            metrics,
            readiness: relay.readiness(Outbox::new(probe_pool), max_parked),
        },
    );
    tracing::info!(%metrics_addr, "relay running");
    println!("relay running; http://{metrics_addr}/metrics, /healthz and /readyz; Ctrl-C to stop");
    shutdown_signal().await;
    println!("shutting down: finishing batches in flight");
    relay.shutdown().await;
    Ok(())
}

/// RabbitMQ at start: the topology declared, the server's version logged.
async fn rabbit_preflight(config: &RelayConfig) -> Result<()> {
    match distribution::rabbit::preflight(&config.rabbit_config()?).await {
        Ok(distribution::broker::Preflight::Ready) => {
            log_broker_version(config).await;
        }
        Ok(distribution::broker::Preflight::Unreachable(why)) => {
            tracing::warn!(reason = %why, "broker unreachable at start; intents wait in the outbox");
            eprintln!("warning: broker unreachable at start ({why}); the relay keeps trying");
        }
        Err(err) => {
            return Err(anyhow::anyhow!(
                "{err} (AMQP_URL, RELAY_TOPOLOGY, RELAY_QUEUE_TYPE)"
            ));
        }
    }
    Ok(())
}

/// NATS at start: the server held to `RELAY_NATS_SERVER_VERSION` before anything is declared,
/// then the stream declared and read back, the server's version logged with what it means for
/// durability.
async fn nats_preflight(config: &RelayConfig) -> Result<()> {
    Relay::check_nats_version(config).await?;
    let nats = config.nats_config()?;
    match distribution::nats::preflight(&nats).await {
        Ok((preflight, version)) => {
            if let Some(version) = &version {
                tracing::info!(broker = %format!("NATS {version}"), "broker");
                if let Some(note) = distribution::nats::durability_note(version, nats.replicas) {
                    tracing::warn!("{note}");
                    eprintln!("warning: {note}");
                }
            }
            if let distribution::broker::Preflight::Unreachable(why) = preflight {
                tracing::warn!(reason = %why, "broker unreachable at start; intents wait in the outbox");
                eprintln!("warning: broker unreachable at start ({why}); the relay keeps trying");
            }
            Ok(())
        }
        Err(err) => Err(anyhow::anyhow!("{err} (NATS_URL, RELAY_TOPOLOGY)")),
    }
}

/// Returns at Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut terminate) => tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        },
        // No SIGTERM handler: Ctrl-C alone.
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Logs what the broker says it is, and what an operator should know of that version.
pub(crate) async fn log_broker_version(config: &RelayConfig) {
    let Ok(rabbit) = config.rabbit_config() else {
        return;
    };
    match distribution::rabbit::server_version(&rabbit).await {
        Ok(version) => {
            tracing::info!(broker = %version, "broker");
            let streams = config.queue_type == distribution::rabbit::QueueType::Stream;
            for note in version.notes(streams) {
                tracing::warn!(broker = %version, "{note}");
            }
            // The same on every version: the fixes behind them are not verified here.
            let workarounds = if streams {
                distribution::rabbit::STREAM_WORKAROUNDS
            } else {
                &[]
            };
            for workaround in workarounds {
                tracing::info!(broker = %version, workaround, "workaround on");
            }
        }
        Err(err) => tracing::warn!(error = %err, "the broker's version could not be read"),
    }
}

/// The schema, checked now and then every second until `wait` has passed (the wait said once,
/// in the log): a relay started beside the job that migrates waits for it.
async fn wait_for_schema(
    pool: &sqlx::PgPool,
    wait: std::time::Duration,
) -> Result<(), store::Error> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut said = false;
    loop {
        match store::check_schema(pool).await {
            Err(store::Error::SchemaMissing(missing)) if tokio::time::Instant::now() < deadline => {
                if !said {
                    said = true;
                    tracing::warn!(
                        "waiting up to {} s for the schema ({} not found yet; RELAY_SCHEMA_WAIT_SECS)",
                        wait.as_secs(),
                        missing.join(", ")
                    );
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            other => return other,
        }
    }
}

//! `distribution`: the outbox relay's command line.
//!
//! - `migrate`: create or update the outbox schema.
//! - `run`: the standalone relay, with Prometheus metrics (until Ctrl-C / SIGTERM).
//! - `status`: backlog and lag per tenant.
//! - `demo`: the whole walk on this machine (broker down during a run, then everything ships).
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use distribution::store::{self, Outbox};
use distribution::{Relay, RelayConfig};
use sqlx::postgres::PgPoolOptions;

mod demo;

const USAGE: &str = "usage: distribution <migrate|run|status|release|demo>
  migrate  create or update the outbox schema in DATABASE_URL
  run      run the relay (DATABASE_URL, AMQP_URL, RELAY_* variables; see README)
  status   backlog and lag per tenant, and parked branches
  release  <tenant> [run [branch]]: drain parked branches again now
  demo     the broker-down walk, end to end, on this machine";

fn main() -> ExitCode {
    let command = std::env::args().nth(1).unwrap_or_default();
    // lapin logs every broken socket at ERROR on its own thread; the relay reports broker
    // faults itself (rate-limited), so lapin is silenced unless RUST_LOG asks for it.
    let default_filter = if command == "demo" {
        "error,lapin=off,sqlx=off"
    } else {
        "warn,lapin=off,sqlx=warn"
    };
    let format = match std::env::var("RELAY_LOG_FORMAT") {
        Ok(value) => match value.parse::<distribution::LogFormat>() {
            Ok(format) => format,
            Err(err) => {
                eprintln!("error: {err}");
                return ExitCode::FAILURE;
            }
        },
        Err(_) => distribution::LogFormat::Text,
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        distribution::LogFormat::Text => logs.init(),
        distribution::LogFormat::Json => logs.json().init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match command.as_str() {
            "migrate" => migrate().await,
            "run" => run().await,
            "status" => status().await,
            "release" => release(std::env::args().skip(2).collect()).await,
            "demo" => demo::run().await,
            _ => {
                eprintln!("{USAGE}");
                Err(anyhow::anyhow!("unknown command {command:?}"))
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", one_line(&err));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, without a backtrace, skipping causes whose text the
/// line already contains (sqlx repeats its database error at every level).
fn one_line(err: &anyhow::Error) -> String {
    let mut line = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

async fn connect(url: &str) -> Result<sqlx::PgPool> {
    PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .context("cannot reach the outbox database (DATABASE_URL)")
}

async fn migrate() -> Result<()> {
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let pool = connect(&url).await?;
    store::migrate(&pool).await?;
    println!("outbox schema is up to date");
    Ok(())
}

async fn run() -> Result<()> {
    let config = RelayConfig::from_env()?;
    // The schema is applied first (idempotent, safe with several relays starting at once).
    store::migrate(&connect(&config.database_url).await?).await?;
    // One connection to the broker: a refusal is fatal here (no retry fixes it); a broker that
    // is simply down is normal (everything waits in the outbox until it is back).
    match distribution::broker::preflight(&config.rabbit_config()?).await {
        Ok(distribution::broker::Preflight::Ready) => {}
        Ok(distribution::broker::Preflight::Unreachable(why)) => {
            tracing::warn!(reason = %why, "broker unreachable at start; intents wait in the outbox");
            eprintln!("warning: broker unreachable at start ({why}); the relay keeps trying");
        }
        Err(err) => return Err(anyhow::anyhow!("{err} (AMQP_URL, RELAY_TOPOLOGY)")),
    }
    distribution::prometheus_builder()?
        .with_http_listener(config.metrics_addr)
        .install()
        .with_context(|| format!("cannot serve metrics on {}", config.metrics_addr))?;
    distribution::describe_metrics(config.supervisor.shards);
    let metrics_addr = config.metrics_addr;
    let relay = Relay::start(config).await?;
    tracing::info!(%metrics_addr, "relay running");
    println!("relay running; metrics on http://{metrics_addr}/metrics; Ctrl-C to stop");
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    println!("shutting down: finishing batches in flight");
    relay.shutdown().await;
    Ok(())
}

async fn status() -> Result<()> {
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let outbox = Outbox::new(connect(&url).await?);
    let backlog = outbox
        .backlog()
        .await
        .context("cannot read the backlog (has `distribution migrate` run?)")?;
    print!("{}", demo::backlog_table(&backlog));
    let parked = outbox.parked_branches().await?;
    if parked.is_empty() {
        println!("no parked branches");
    } else {
        println!("parked branches (the broker kept refusing their events):");
        println!(
            "{:<40} {:<22} {:>8} {:>12} {:>10} {:>8}",
            "branch", "reason", "attempts", "failing for", "retry in", "pending"
        );
        for branch in parked {
            println!(
                "{:<40} {:<22} {:>8} {:>11.0}s {:>9.0}s {:>8}",
                branch.branch.to_string(),
                branch.reason,
                branch.attempts,
                branch.failing_for.as_secs_f64(),
                branch.retry_in.as_secs_f64(),
                branch.pending
            );
        }
    }
    Ok(())
}

async fn release(args: Vec<String>) -> Result<()> {
    use distribution::store::{BranchId, RunId, TenantId};
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let (tenant, run, branch) = match args.as_slice() {
        [tenant] => (TenantId::new(tenant)?, None, None),
        [tenant, run] => (TenantId::new(tenant)?, Some(RunId::new(run)?), None),
        [tenant, run, branch] => (
            TenantId::new(tenant)?,
            Some(RunId::new(run)?),
            Some(BranchId::new(branch)?),
        ),
        _ => anyhow::bail!("usage: distribution release <tenant> [run [branch]]"),
    };
    let outbox = Outbox::new(connect(&url).await?);
    let released = outbox
        .release(&tenant, run.as_ref(), branch.as_ref())
        .await?;
    println!("released {released} parked branch(es); relays drain them on their next poll");
    Ok(())
}

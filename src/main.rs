//! `distribution`: the outbox relay's command line (`distribution --help`).
//!
//! - `migrate`: create or update the outbox schema.
//! - `run`: the standalone relay, with `/metrics`, `/healthz` and `/readyz` (until Ctrl-C or
//!   SIGTERM).
//! - `status`: backlog and lag per tenant, and parked branches.
//! - `release`: drain parked branches again now.
//! - `retire`: retire closed runs now (outbox or fold).
//! - `dead`: the dead-letter queue: list, show, replay, purge.
//! - `demo`: the whole walk on this machine (broker down during a run, then everything ships).
//!
//! Exit codes: 0 success (help and version included), 1 a failure while running (database or
//! broker refused, unreachable database), 2 a usage or configuration error.
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use distribution::store::{self, Outbox};
use distribution::{LogFormat, Relay, RelayConfig, Settings};

mod dead_cli;
mod demo;
mod group_cli;
#[cfg(feature = "otlp")]
mod otlp;
// The demo takes "the broker" down with the same proxy the tests use, compiled in privately.
#[allow(dead_code)]
mod proxy;
mod serve;

/// Ships committed export intents from PostgreSQL to RabbitMQ, in order per branch,
/// at least once. Every flag can be set by its environment variable instead.
#[derive(Debug, Parser)]
#[command(name = "distribution", version, propagate_version = true)]
struct Cli {
    /// Log format on standard error (colours only on a terminal).
    #[arg(long, env = "RELAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// The database to talk to.
#[derive(Debug, clap::Args)]
struct Database {
    /// PostgreSQL holding the outbox.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// PostgreSQL schema of the relay's tables (default: the connection's search_path).
    #[arg(long, env = "RELAY_SCHEMA", value_parser = parse_schema)]
    schema: Option<store::Schema>,
}

fn parse_schema(name: &str) -> Result<store::Schema, String> {
    store::Schema::new(name).map_err(|err| err.to_string())
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or update the outbox schema in the database (with --fold: only the fold's tables
    /// and `relay_fold`, for a consumer's own database).
    Migrate {
        #[command(flatten)]
        database: Database,
        /// Only the fold's tables and functions (a consumer's own database).
        #[arg(long)]
        fold: bool,
    },
    /// Run the relay until Ctrl-C or SIGTERM.
    Run(Box<Settings>),
    /// Backlog and lag per tenant, parked branches, and (with AMQP_URL) the dead-letter queue.
    Status {
        #[command(flatten)]
        database: Database,
        /// RabbitMQ, to count the dead letters (`<topology>.dead`); without it they are not shown.
        #[arg(long, env = "AMQP_URL", hide_env_values = true)]
        amqp_url: Option<String>,
        /// Exchange name.
        #[arg(long, env = "RELAY_TOPOLOGY", default_value = "outbox")]
        topology: String,
        /// Consumer groups whose dead letters are counted (as the relay's `RELAY_GROUPS`).
        #[arg(
            long,
            env = "RELAY_GROUPS",
            default_value = "default",
            value_delimiter = ','
        )]
        groups: Vec<String>,
    },
    /// The dead-letter queue (`<topology>.dead`): what consumers could not fold.
    Dead {
        #[command(subcommand)]
        action: dead_cli::DeadAction,
    },
    /// Consumer groups: each reads the whole history from its own queues.
    Group {
        #[command(subcommand)]
        action: group_cli::GroupAction,
    },
    /// Drain parked branches again now (all of a tenant, of a run, or one branch).
    Release {
        #[command(flatten)]
        database: Database,
        /// Tenant whose parked branches are released.
        tenant: String,
        /// Only this run's.
        run: Option<String>,
        /// Only this branch of the run.
        branch: Option<String>,
    },
    /// Discard a parked branch's waiting events for good: it is rewound at its last shipped Lsn
    /// to a new branch, so consumers get a rewind marker (never a silent gap), and the host's
    /// later appends to it are refused as abandoned (it goes on on the new branch).
    Discard {
        #[command(flatten)]
        database: Database,
        /// Tenant of the parked branch.
        tenant: String,
        /// Its run.
        run: String,
        /// The parked branch.
        branch: String,
        /// The new live branch (default `discarded-<branch>`, cut to 64 bytes).
        #[arg(long)]
        to: Option<String>,
    },
    /// Retire closed runs now: in the outbox's database, runs closed longer than --retention-secs
    /// ago whose every row shipped; with --fold, a consumer's fold state of runs whose end
    /// marker it folded longer ago than that (for cron; a relay with RELAY_RETENTION_SECS does
    /// the former itself).
    Retire {
        #[command(flatten)]
        database: Database,
        /// Keep closed runs this many seconds.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_153_600_000))]
        retention_secs: u64,
        /// Most runs retired per transaction.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        batch: u32,
        /// DATABASE_URL is a consumer's database: retire the fold's state.
        #[arg(long)]
        fold: bool,
    },
    /// The broker-down walk, end to end, on this machine's PostgreSQL and RabbitMQ.
    Demo,
    /// Print the schema's SQL (every migration, in order) for hosts with another migration
    /// tool; then run the relay with --skip-migrate.
    Sql {
        /// Print the fold's migrations only: what a consumer's own database needs.
        #[arg(long)]
        fold: bool,
    },
    /// Print least-privilege grants: the host's role may only write intents, the relay's only
    /// drain, ack, park and hold leases, a consumer's only fold. Apply as the objects' owner.
    Roles {
        /// The host's role (the write functions only).
        #[arg(long)]
        host: Option<String>,
        /// The relay's role (run it with RELAY_SKIP_MIGRATE=true).
        #[arg(long)]
        relay: Option<String>,
        /// A consumer's role (relay_fold only).
        #[arg(long)]
        consumer: Option<String>,
        /// Grants for a consumer's own database (migrated with the fold's migrations only).
        #[arg(long)]
        fold_database: bool,
        /// PostgreSQL schema of the relay's objects.
        #[arg(long, env = "RELAY_SCHEMA", value_parser = parse_schema)]
        schema: Option<store::Schema>,
    },
}

/// Exit code of a usage or configuration error (as clap's own).
const USAGE: u8 = 2;

fn main() -> ExitCode {
    // Before parsing: a typo'd variable is often why parsing fails.
    let unknown = distribution::unknown_relay_variables(&["RELAY_LOG_FORMAT", "RELAY_GROUP"]);
    for variable in &unknown {
        eprintln!("warning: {variable} is not a setting of this relay and is ignored (a typo?)");
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            if let Some(variable) = blamed_variable(&err) {
                eprintln!("note: that value comes from the environment variable {variable}");
            }
            // Help and version exit 0 on standard output; usage errors exit 2.
            err.exit()
        }
    };
    // lapin logs every broken socket at ERROR on its own thread; the relay reports broker
    // faults itself (rate-limited), so lapin is silenced unless RUST_LOG asks for it.
    let default_filter = if matches!(cli.command, Command::Demo) {
        "error,lapin=off,sqlx=off"
    } else {
        "warn,lapin=off,sqlx=warn"
    };
    use tracing_subscriber::prelude::*;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let logs = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let logs = match cli.log_format {
        LogFormat::Text => logs.boxed(),
        LogFormat::Json => logs.json().boxed(),
    };
    let registry = tracing_subscriber::registry().with(logs.with_filter(filter));
    #[cfg(feature = "otlp")]
    let (registry, _traces) = {
        let (provider, layer) = match otlp::layer() {
            Ok(traces) => traces.unzip(),
            Err(err) => {
                eprintln!("error: {err:#}");
                return ExitCode::from(2);
            }
        };
        (registry.with(layer), FlushOnDrop(provider))
    };
    registry.init();
    for variable in unknown {
        tracing::warn!(%variable, "unknown RELAY_* variable ignored (a typo?); see `distribution run --help`");
    }
    if let Command::Roles {
        host,
        relay,
        consumer,
        fold_database,
        schema,
    } = &cli.command
    {
        let roles = store::Roles {
            host: host.clone(),
            relay: relay.clone(),
            consumer: consumer.clone(),
        };
        return match print_roles(roles, *fold_database, schema.as_ref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("error: {}", one_line(&err));
                ExitCode::from(USAGE)
            }
        };
    }
    let config = match &cli.command {
        Command::Run(settings) => match settings.as_ref().clone().into_config() {
            Ok(config) => Some(config),
            Err(err) => {
                eprintln!("error: {err}");
                return ExitCode::from(USAGE);
            }
        },
        _ => None,
    };
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
        match cli.command {
            Command::Migrate { database, fold } => migrate(&database, fold).await,
            Command::Run(_) => run(config.expect("parsed above")).await,
            Command::Status {
                database,
                amqp_url,
                topology,
                groups,
            } => status(&database, amqp_url, topology, groups).await,
            Command::Dead { action } => dead_cli::run(action).await,
            Command::Group { action } => group_cli::run(action).await,
            Command::Release {
                database,
                tenant,
                run,
                branch,
            } => release(&database, tenant, run, branch).await,
            Command::Discard {
                database,
                tenant,
                run,
                branch,
                to,
            } => discard(&database, tenant, run, branch, to).await,
            Command::Retire {
                database,
                retention_secs,
                batch,
                fold,
            } => retire(&database, retention_secs, batch, fold).await,
            Command::Demo => demo::run().await,
            Command::Sql { fold } => {
                print_sql(fold);
                Ok(())
            }
            Command::Roles { .. } => unreachable!("printed before the runtime starts"),
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

/// The environment variable behind a flag that clap refused, when the flag was not given on
/// the command line (clap's message names only the flag).
fn blamed_variable(err: &clap::Error) -> Option<String> {
    use clap::CommandFactory;
    use clap::error::{ContextKind, ContextValue};
    let Some(ContextValue::String(flag)) = err.get(ContextKind::InvalidArg) else {
        return None;
    };
    let given: Vec<String> = std::env::args().collect();
    let command = Cli::command();
    let args = command.get_arguments().chain(
        command
            .get_subcommands()
            .flat_map(|sub| sub.get_arguments()),
    );
    for arg in args {
        let (Some(long), Some(env)) = (arg.get_long(), arg.get_env()) else {
            continue;
        };
        let long = format!("--{long}");
        let named = flag.split_whitespace().next() == Some(long.as_str());
        let on_command_line = given.iter().any(|word| word.starts_with(&long));
        if named && !on_command_line && std::env::var_os(env).is_some() {
            return Some(env.to_string_lossy().into_owned());
        }
    }
    None
}

/// Every migration's SQL, in order, each under a comment with its version: what
/// `distribution migrate` applies (and records in `relay_migrations`).
fn print_sql(fold: bool) {
    let migrator = if fold {
        &*store::FOLD_MIGRATOR
    } else {
        &*store::MIGRATOR
    };
    for migration in migrator.iter() {
        println!(
            "-- relay migration {} ({})\n{}\n",
            migration.version,
            migration.description,
            migration.sql.as_str().trim_end()
        );
    }
}

/// The grants of `distribution roles`.
fn print_roles(
    roles: store::Roles,
    fold_database: bool,
    schema: Option<&store::Schema>,
) -> Result<()> {
    if roles.host.is_none() && roles.relay.is_none() && roles.consumer.is_none() {
        anyhow::bail!("name at least one role: --host, --relay or --consumer");
    }
    if fold_database && (roles.host.is_some() || roles.relay.is_some()) {
        anyhow::bail!("a consumer's database (--fold-database) has grants for --consumer only");
    }
    let on = if fold_database {
        store::RolesFor::Fold
    } else {
        store::RolesFor::Outbox
    };
    print!("{}", store::roles_sql(&roles, on, schema)?);
    Ok(())
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

async fn connect(url: &str, schema: Option<&store::Schema>) -> Result<sqlx::PgPool> {
    distribution::connect_database(url, 4, schema)
        .await
        .map_err(|err| anyhow::anyhow!("{err} (DATABASE_URL)"))
}

/// Creates the relay's schema (if one is set) and brings its tables up to date.
async fn migrate_in(url: &str, schema: Option<&store::Schema>) -> Result<()> {
    let pool = connect(url, schema).await?;
    if let Some(schema) = schema {
        // Two relays starting at once can race on CREATE SCHEMA IF NOT EXISTS: once more.
        if store::create_schema(&pool, schema).await.is_err() {
            store::create_schema(&pool, schema)
                .await
                .with_context(|| format!("cannot create schema {schema} (RELAY_SCHEMA)"))?;
        }
    }
    store::migrate(&pool).await?;
    Ok(())
}

async fn migrate(database: &Database, fold: bool) -> Result<()> {
    if fold {
        let pool = connect(&database.database_url, database.schema.as_ref()).await?;
        if let Some(schema) = &database.schema {
            store::create_schema(&pool, schema).await?;
        }
        store::migrate_fold(&pool).await?;
        println!("fold schema is up to date");
        return Ok(());
    }
    migrate_in(&database.database_url, database.schema.as_ref()).await?;
    println!("outbox schema is up to date");
    Ok(())
}

async fn discard(
    database: &Database,
    tenant: String,
    run: String,
    branch: String,
    to: Option<String>,
) -> Result<()> {
    use distribution::store::{BranchId, BranchKey, RunId, TenantId};
    let key = BranchKey::new(
        TenantId::new(tenant)?,
        RunId::new(run)?,
        BranchId::new(branch)?,
    );
    let outbox = Outbox::new(connect(&database.database_url, database.schema.as_ref()).await?);
    let to = match to {
        Some(to) => BranchId::new(to)?,
        None => BranchId::new(
            format!("discarded-{}", key.branch)
                .chars()
                .take(64)
                .collect::<String>(),
        )?,
    };
    let discarded = outbox.discard_branch(&key, &to).await?;
    println!(
        "discarded {} waiting intent(s) of {key}: its live history ends at lsn {}; consumers get a rewind marker; the run goes on on {}",
        discarded.discarded, discarded.fork, discarded.live
    );
    Ok(())
}

async fn retire(database: &Database, retention_secs: u64, batch: u32, fold: bool) -> Result<()> {
    let pool = connect(&database.database_url, database.schema.as_ref()).await?;
    let retention = store::Retention {
        keep: std::time::Duration::from_secs(retention_secs),
        batch,
    };
    if fold {
        let runs = store::retire_folded_runs(&pool, retention).await?;
        println!("retired the fold state of {runs} completed runs");
    } else {
        let runs = store::retire_runs(&pool, retention).await?;
        println!("retired {runs} closed runs");
    }
    Ok(())
}

async fn run(config: RelayConfig) -> Result<()> {
    // The schema is applied first (idempotent, safe with several relays starting at once),
    // unless the host applies it with its own tool (`distribution sql`).
    if config.skip_migrate {
        let pool = connect(&config.database_url, config.schema().as_ref()).await?;
        store::check_schema(&pool)
            .await
            .context("RELAY_SKIP_MIGRATE is set")?;
        pool.close().await;
    } else {
        migrate_in(&config.database_url, config.schema().as_ref()).await?;
    }
    // One connection to the broker: a refusal is fatal here (no retry fixes it); a broker that
    // is simply down is normal (everything waits in the outbox until it is back).
    match distribution::broker::preflight(&config.rabbit_config()?).await {
        Ok(distribution::broker::Preflight::Ready) => {
            log_broker_version(&config).await;
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
            outbox: Outbox::new(probe_pool),
            broker: relay.broker_health(),
            max_parked,
        },
    );
    tracing::info!(%metrics_addr, "relay running");
    println!("relay running; http://{metrics_addr}/metrics, /healthz and /readyz; Ctrl-C to stop");
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    println!("shutting down: finishing batches in flight");
    relay.shutdown().await;
    Ok(())
}

async fn status(
    database: &Database,
    amqp_url: Option<String>,
    topology: String,
    groups: Vec<String>,
) -> Result<()> {
    let outbox = Outbox::new(connect(&database.database_url, database.schema.as_ref()).await?);
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
    let Some(amqp_url) = amqp_url else {
        return Ok(());
    };
    let groups = groups.into_iter().filter(|group| group.trim() != "none");
    for group in groups {
        let broker = dead_cli::Broker {
            amqp_url: amqp_url.clone(),
            topology: topology.clone(),
            partitions: 1,
            group: group.trim().to_owned(),
            queues: distribution::QueueSettings::default(),
        };
        let rabbit = broker.rabbit()?;
        let queue = rabbit.topology.dead_letter_queue();
        let depth = async {
            distribution::broker::DeadLetters::open(&rabbit)
                .await?
                .depth()
                .await
        };
        let list = match rabbit.topology.group() {
            distribution::broker::Group::Default => "`distribution dead list`".to_owned(),
            named => format!("`distribution dead list --group {named}`"),
        };
        match depth.await {
            Ok(0) => println!("no dead letters in {queue}"),
            Ok(depth) => println!("{depth} dead letter(s) in {queue}: {list} shows them"),
            // RabbitMQ's answer to a passive declare of a queue that is not there.
            Err(err) if err.to_string().contains("NOT_FOUND") => {
                println!("{queue} does not exist: no consumer of the group declared its queues")
            }
            Err(err) => println!("dead letters in {queue}: unknown ({err})"),
        }
    }
    Ok(())
}

async fn release(
    database: &Database,
    tenant: String,
    run: Option<String>,
    branch: Option<String>,
) -> Result<()> {
    use distribution::store::{BranchId, RunId, TenantId};
    let tenant = TenantId::new(tenant)?;
    let run = run.map(RunId::new).transpose()?;
    let branch = branch.map(BranchId::new).transpose()?;
    let outbox = Outbox::new(connect(&database.database_url, database.schema.as_ref()).await?);
    let released = outbox
        .release(&tenant, run.as_ref(), branch.as_ref())
        .await?;
    println!("released {released} parked branch(es); relays drain them on their next poll");
    Ok(())
}

/// Flushes the OTLP exporter's last spans when `main` returns.
#[cfg(feature = "otlp")]
struct FlushOnDrop(Option<opentelemetry_sdk::trace::SdkTracerProvider>);

#[cfg(feature = "otlp")]
impl Drop for FlushOnDrop {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take() {
            let _ = provider.shutdown();
        }
    }
}

/// Logs what the broker says it is, and what an operator should know of that version.
async fn log_broker_version(config: &RelayConfig) {
    let Ok(rabbit) = config.rabbit_config() else {
        return;
    };
    match distribution::broker::server_version(&rabbit).await {
        Ok(version) => {
            tracing::info!(broker = %version, "broker");
            let streams = config.queue_type == distribution::broker::QueueType::Stream;
            for note in version.notes(streams) {
                tracing::warn!(broker = %version, "{note}");
            }
            for workaround in version.workarounds(streams) {
                tracing::info!(broker = %version, workaround, "workaround on");
            }
        }
        Err(err) => tracing::warn!(error = %err, "the broker's version could not be read"),
    }
}

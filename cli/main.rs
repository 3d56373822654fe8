//! `distribution`: the outbox relay's command line (`distribution --help`).
//!
//! - `migrate`: create or update the outbox schema.
//! - `run`: the standalone relay, with `/metrics`, `/healthz` and `/readyz` (until Ctrl-C or
//!   SIGTERM).
//! - `status`: backlog and lag per tenant, and parked branches.
//! - `release`: drain parked branches again now.
//! - `retire`: retire closed runs now (outbox or fold).
//! - `dead`: the dead-letter queue: list, show, replay, purge.
//! - `console`: the same in a browser, with an overview.
//! - `demo`: the whole walk on this machine (broker down during a run, then everything ships).
//!
//! Exit codes: 0 success (help and version included), 1 a failure while running (database or
//! broker refused, unreachable database), 2 a usage or configuration error.
use std::process::ExitCode;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};

use distribution::store;
use distribution::{LogFormat, Settings};

/// mimalloc rather than glibc's malloc, which cost the relay 1.1-2x the CPU per event
/// (benches/HISTORY.md, issue 47).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod console;
mod dead_cli;
mod demo;
mod group_cli;
mod letters;
#[cfg(feature = "otlp")]
mod otlp;
mod outbox_cli;
mod run_cli;
mod tail_cli;
// The demo takes "the broker" down with the same proxy the tests use (the library's, behind
// its `test-tools` feature), compiled in privately.
#[allow(dead_code)]
#[path = "../src/proxy.rs"]
mod proxy;
mod serve;

use outbox_cli::{Tables, discard, migrate, print_roles, print_sql, release, retire, status};
use run_cli::run;

/// Ships committed export intents from PostgreSQL to RabbitMQ (or NATS JetStream), in order
/// per branch, at least once. Every flag can be set by its environment variable instead.
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
    /// Backlog and lag per tenant, parked branches, and (with AMQP_URL, or NATS_URL on NATS)
    /// each group's dead letters.
    Status {
        #[command(flatten)]
        database: Database,
        // The broker whose dead letters are counted; without its URL they are not shown.
        #[command(flatten)]
        broker: distribution::BrokerArgs,
        /// Consumer groups whose dead letters are counted (as the relay's).
        #[command(flatten)]
        groups: distribution::GroupsArgs,
    },
    /// A group's dead letters (RabbitMQ: the queue `<topology>.dead`; NATS: the stream
    /// `<topology>_dead`): what consumers could not fold.
    Dead {
        #[command(subcommand)]
        action: dead_cli::DeadAction,
    },
    /// Consumer groups: each reads the whole history from its own queues.
    Group {
        #[command(subcommand)]
        action: group_cli::GroupAction,
    },
    /// Watch events arrive: one line each (key, kind, metadata), the payload only if asked,
    /// through a queue of the watcher's own (it takes nothing from any consumer).
    Tail(Box<tail_cli::TailSettings>),
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
    /// Serve the operators' console: overview, parked branches (release, discard) and dead
    /// letters (show, replay, purge), on loopback unless given a token.
    Console(Box<console::ConsoleSettings>),
    /// The broker-down walk, end to end, on this machine's PostgreSQL and RabbitMQ (or NATS).
    Demo {
        /// The broker the demo ships to: RabbitMQ at AMQP_URL, or NATS JetStream at NATS_URL.
        #[arg(long, value_enum, default_value = "rabbitmq")]
        broker: distribution::BrokerKind,
    },
    /// Print the schema's SQL (every migration, in order) for hosts with another migration
    /// tool; then run the relay with --skip-migrate.
    Sql {
        /// Print the fold's migrations only: what a consumer's own database needs.
        #[arg(long)]
        fold: bool,
    },
    /// Print least-privilege grants: the host's role may only write intents, the relay's only
    /// drain, ack, park and hold leases, a consumer's only fold, an operator's only read the
    /// status and release or discard parked branches. Apply as the objects' owner.
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
        /// An operator's role (`distribution console`, `status`, `release`, `discard`): the
        /// status views, relay_release and relay_discard_branch; never a payload.
        #[arg(long)]
        operator: Option<String>,
        /// Grants for a consumer's own database (migrated with the fold's migrations only).
        #[arg(long)]
        fold_database: bool,
        /// PostgreSQL schema of the relay's objects.
        #[arg(long, env = "RELAY_SCHEMA", value_parser = parse_schema)]
        schema: Option<store::Schema>,
    },
}

/// Every environment variable `command` and its subcommands read: the one list the
/// unknown-variable warning checks (a setting of any command is no typo in another).
fn variables_read(command: &clap::Command) -> Vec<String> {
    let mut names: Vec<String> = command
        .get_arguments()
        .filter_map(|arg| arg.get_env())
        .map(|name| name.to_string_lossy().into_owned())
        .collect();
    for sub in command.get_subcommands() {
        names.extend(variables_read(sub));
    }
    names
}

/// Exit code of a usage or configuration error (as clap's own).
const USAGE: u8 = 2;

fn main() -> ExitCode {
    // Read before parsing: a typo'd variable is often why parsing fails. Said once: here if
    // parsing fails (no log starts), else in the log (in its format) once it runs.
    let unknown = distribution::unknown_relay_variables(&variables_read(&Cli::command()));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            for variable in &unknown {
                eprintln!(
                    "warning: {variable} is not a setting of this relay and is ignored (a typo?)"
                );
            }
            if let Some(variable) = blamed_variable(&err) {
                eprintln!("note: that value comes from the environment variable {variable}");
            }
            // Help and version exit 0 on standard output; usage errors exit 2.
            err.exit()
        }
    };
    // lapin logs every broken socket at ERROR on its own thread, async-nats every failed
    // connect ("expected INFO, got nothing"); the relay reports broker faults itself
    // (rate-limited), so both are silenced unless RUST_LOG asks for them.
    let default_filter = if matches!(cli.command, Command::Demo { .. }) {
        "error,lapin=off,async_nats=off,sqlx=off"
    } else {
        "warn,lapin=off,async_nats=off,sqlx=warn"
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
        tracing::warn!(%variable, "{variable} is not a setting of this relay and is ignored (a typo?); see `distribution <command> --help`");
    }
    if let Command::Roles {
        host,
        relay,
        consumer,
        operator,
        fold_database,
        schema,
    } = &cli.command
    {
        let roles = store::Roles {
            host: host.clone(),
            relay: relay.clone(),
            consumer: consumer.clone(),
            operator: operator.clone(),
        };
        return match print_roles(roles, Tables::of(*fold_database), schema.as_ref()) {
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
        Command::Console(settings) => {
            if let Err(err) = settings.check() {
                eprintln!("error: {}", one_line(&err));
                return ExitCode::from(USAGE);
            }
            None
        }
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
            Command::Migrate { database, fold } => migrate(&database, Tables::of(fold)).await,
            Command::Run(_) => run(config.expect("parsed above")).await,
            Command::Status {
                database,
                broker,
                groups,
            } => status(&database, broker, groups).await,
            Command::Dead { action } => dead_cli::run(action).await,
            Command::Group { action } => group_cli::run(action).await,
            Command::Tail(settings) => tail_cli::run(*settings).await,
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
            } => retire(&database, retention_secs, batch, Tables::of(fold)).await,
            Command::Console(settings) => console::run(*settings).await,
            Command::Demo { broker } => demo::run(broker).await,
            Command::Sql { fold } => {
                print_sql(Tables::of(fold));
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

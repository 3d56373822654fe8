//! Relay configuration: every field documented with its default; bad values fail at load time.
use std::net::SocketAddr;
use std::time::Duration;

use broker::{CallProbe, QueueType, RabbitConfig, StreamRetention, Topology};
use supervisor::SupervisorConfig;

/// A configuration value that cannot be used. One readable line, naming the variable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A flag or variable was refused by the parser (missing, out of bounds, not a number).
    #[error("{0}")]
    Rejected(String),
    /// A variable is set to something unusable.
    #[error("{var}={value:?} is invalid: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value (credentials stripped).
        value: String,
        /// Why it is refused.
        reason: String,
    },
}

/// clap's error text without its `error: ` prefix and usage lines.
fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line).to_owned()
}

/// How to run a relay.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// PostgreSQL holding the outbox. Env `DATABASE_URL` (required).
    pub database_url: String,
    /// RabbitMQ. Env `AMQP_URL` (required). The broker may be down at start: that is normal.
    pub amqp_url: String,
    /// Exchange name; queues are `<topology>.p<N>`. Env `RELAY_TOPOLOGY`, default `outbox`.
    pub topology: String,
    /// Broker partitions (queues), keyed by (TenantId, RunId). Env `RELAY_PARTITIONS`, default 8.
    pub partitions: u16,
    /// Tree shape and timings (`RELAY_SHARDS` default 4, `RELAY_BATCH_SIZE` default 1000,
    /// `RELAY_BATCHES_IN_FLIGHT` default 1, `RELAY_POLL_MS` default 1000,
    /// `RELAY_LEASE_TTL_MS` default 5000, `RELAY_LEASE_HEARTBEAT_MS` default 1000).
    pub supervisor: SupervisorConfig,
    /// Runtime threads of the relay (named `outbox-relay`). Env `RELAY_THREADS`, default 2.
    pub worker_threads: usize,
    /// Pool size for drains and acks. Env `RELAY_DB_CONNECTIONS`, default 8.
    pub db_connections: u32,
    /// Where `distribution run` serves Prometheus metrics. Env `RELAY_METRICS_ADDR`, default `127.0.0.1:9464`.
    pub metrics_addr: SocketAddr,
    /// Longest wait for a broker connection (TCP, handshake, channel, topology). Env
    /// `RELAY_AMQP_CONNECT_TIMEOUT_MS`, default 5000.
    pub amqp_connect_timeout: Duration,
    /// Longest wait for a batch's confirms. Env `RELAY_AMQP_CONFIRM_TIMEOUT_MS`, default 10000.
    pub amqp_confirm_timeout: Duration,
    /// Records which threads call the broker client (instrumentation; default none).
    pub probe: Option<CallProbe>,
    /// Classic, quorum (replicated) or stream (replicated, replayable) queues. Env
    /// `RELAY_QUEUE_TYPE`, default classic.
    pub queue_type: QueueType,
    /// What a stream partition keeps (streams only). Env `RELAY_STREAM_MAX_AGE` (e.g. `7D`),
    /// `RELAY_STREAM_MAX_BYTES`, `RELAY_STREAM_SEGMENT_BYTES`; default: everything.
    pub stream_retention: StreamRetention,
    /// Redeliveries a quorum queue allows one message before dead-lettering it to the group's
    /// dead-letter queue. Env `RELAY_DELIVERY_LIMIT`, default 20.
    pub delivery_limit: u32,
    /// Members each quorum queue or stream starts with. Env `RELAY_QUEUE_REPLICAS`; default
    /// RabbitMQ's (every node of the cluster).
    pub replicas: Option<u16>,
    /// Consumer groups whose queues the relay declares at start and after a returned message
    /// (comma-separated names; `default` is the unnamed group of `<topology>.p<N>`). Empty:
    /// only the exchange; each group's consumer (or `distribution group create`) declares its
    /// own. Env `RELAY_GROUPS`, default `default`.
    pub groups: Vec<broker::Group>,
    /// Also write CloudEvents attributes (`cloudEvents:*` headers, binary content mode). Env
    /// `RELAY_CLOUDEVENTS`, default false.
    pub cloudevents: bool,
    /// `/readyz` fails when more branches than this are parked. Env `RELAY_READY_MAX_PARKED`,
    /// default 100.
    pub ready_max_parked: u32,
    /// Extra TLS trust (a private CA) and a client certificate for `amqps://`. Env
    /// `RELAY_AMQP_CA_FILE`, `RELAY_AMQP_CLIENT_CERT_FILE` and `RELAY_AMQP_CLIENT_KEY_FILE`
    /// (PEM files, read at start); default none.
    pub amqp_tls: broker::AmqpTls,
    /// PostgreSQL schema of the relay's tables (created on migrate); the host's writer names
    /// it with `IntentWriter::with_schema`. Env `RELAY_SCHEMA`; default none (the connection's
    /// `search_path`, normally `public`).
    pub schema: Option<String>,
    /// `distribution run` does not apply the schema (the host applies `distribution sql` with
    /// its own migration tool). Env `RELAY_SKIP_MIGRATE`; default false.
    pub skip_migrate: bool,
    /// Retire closed runs (their branches and parked rows; `store::retire_runs`) once they were
    /// closed this long ago and every row of them shipped, checked every quarter of it (between
    /// 100 ms and 60 s). Env `RELAY_RETENTION_SECS`; default none (closed runs are kept).
    pub retention: Option<Duration>,
}

/// Reads a PEM file that must hold a `-----BEGIN ...{kind}-----` block.
fn pem_file(var: &'static str, path: &std::path::Path, kind: &str) -> Result<Vec<u8>, ConfigError> {
    let invalid = |reason: String| ConfigError::Invalid {
        var,
        value: path.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|err| invalid(format!("cannot read it: {err}")))?;
    let text = String::from_utf8_lossy(&bytes);
    let holds_kind = text
        .lines()
        .any(|line| line.starts_with("-----BEGIN ") && line.contains(kind));
    if !holds_kind {
        return Err(invalid(format!("no PEM {kind} in it")));
    }
    Ok(bytes)
}

fn defaults() -> RelayConfig {
    RelayConfig::new("", "")
}

fn millis(duration: Duration) -> u64 {
    duration.as_millis() as u64
}

/// Every setting of a relay as a command-line flag with its environment variable, default and
/// bounds (`distribution run --help` lists them). [`RelayConfig::from_env`] reads the same
/// variables through this parser.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Relay settings")]
pub struct Settings {
    /// PostgreSQL holding the outbox (`?sslmode=require` for TLS).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// RabbitMQ (`amqps://` for TLS). The broker may be down at start.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub amqp_url: String,
    /// Exchange name; queues are `<topology>.p<N>`.
    #[arg(long, env = "RELAY_TOPOLOGY", default_value_t = defaults().topology)]
    pub topology: String,
    /// Broker partitions (queues), keyed by (tenant, run).
    #[arg(long, env = "RELAY_PARTITIONS", default_value_t = defaults().partitions,
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub partitions: u16,
    /// Queue type, stream retention and the quorum delivery limit.
    #[command(flatten)]
    pub queues: QueueSettings,
    /// Consumer groups whose queues the relay declares (comma-separated; `default`: the
    /// unnamed group's `<topology>.p<N>`; `none`: the exchange only).
    #[arg(
        long,
        env = "RELAY_GROUPS",
        default_value = "default",
        value_delimiter = ','
    )]
    pub groups: Vec<String>,
    /// Also write CloudEvents attributes (`cloudEvents:*` headers, binary content mode).
    #[arg(long, env = "RELAY_CLOUDEVENTS", action = clap::ArgAction::Set, default_value_t = false)]
    pub cloudevents: bool,
    /// Publisher shards (one AMQP connection each). On streams, ignored: one shard per
    /// partition.
    #[arg(long, env = "RELAY_SHARDS", default_value_t = defaults().supervisor.shards,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub shards: u16,
    /// Most events drained and published at once per tenant.
    #[arg(long, env = "RELAY_BATCH_SIZE", default_value_t = defaults().supervisor.drainer.batch_size,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch_size: u32,
    /// Batches of one tenant in flight at once.
    #[arg(long, env = "RELAY_BATCHES_IN_FLIGHT",
          default_value_t = defaults().supervisor.drainer.max_batches_in_flight as u32,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub batches_in_flight: u32,
    /// Batches of at most this many events take each shard's express publisher (quiet tenants
    /// never wait behind a backlog); 0: no express lane.
    #[arg(long, env = "RELAY_EXPRESS_MAX_EVENTS", default_value_t = defaults().supervisor.drainer.express_max_events,
          value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub express_max_events: u32,
    /// Most payload bytes in one batch (the first event always comes).
    #[arg(long, env = "RELAY_BATCH_MAX_BYTES", default_value_t = defaults().supervisor.drainer.batch_max_bytes,
          value_parser = clap::value_parser!(u32).range(1024..=(256 << 20)))]
    pub batch_max_bytes: u32,
    /// Events in flight across the relay (the memory bound, in events).
    #[arg(long, env = "RELAY_MAX_IN_FLIGHT", default_value_t = defaults().supervisor.max_in_flight as u64,
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub max_in_flight: u64,
    /// Payload bytes in flight across the relay (the memory bound, in bytes).
    #[arg(long, env = "RELAY_MAX_IN_FLIGHT_BYTES", default_value_t = defaults().supervisor.max_in_flight_bytes as u64,
          value_parser = clap::value_parser!(u64).range(1024..=(16 << 30)))]
    pub max_in_flight_bytes: u64,
    /// Most drainers alive at once; beyond it tenants wait their turn (bounds memory with any
    /// number of tenants).
    #[arg(long, env = "RELAY_MAX_DRAINERS", default_value_t = defaults().supervisor.max_drainers as u32,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_drainers: u32,
    /// How often pending tenants are polled, in ms (the path behind NOTIFY).
    #[arg(long, env = "RELAY_POLL_MS", default_value_t = millis(defaults().supervisor.poll_interval),
          value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub poll_ms: u64,
    /// Lease lifetime in ms: a dead relay's tenants move after about this long.
    #[arg(long, env = "RELAY_LEASE_TTL_MS", default_value_t = millis(defaults().supervisor.lease.ttl),
          value_parser = clap::value_parser!(u64).range(150..=600_000))]
    pub lease_ttl_ms: u64,
    /// Lease renewal period in ms (at most a third of the TTL).
    #[arg(long, env = "RELAY_LEASE_HEARTBEAT_MS", default_value_t = millis(defaults().supervisor.lease.heartbeat),
          value_parser = clap::value_parser!(u64).range(50..=200_000))]
    pub lease_heartbeat_ms: u64,
    /// Refusals in a row after which a branch is parked.
    #[arg(long, env = "RELAY_PARK_AFTER_ATTEMPTS", default_value_t = defaults().supervisor.drainer.park_after_attempts,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub park_after_attempts: u32,
    /// How long a parked branch waits before it is tried again, in ms.
    #[arg(long, env = "RELAY_PARK_RETRY_MS", default_value_t = millis(defaults().supervisor.drainer.park_retry),
          value_parser = clap::value_parser!(u64).range(100..=86_400_000))]
    pub park_retry_ms: u64,
    /// Runtime threads of the relay.
    #[arg(long, env = "RELAY_THREADS", default_value_t = defaults().worker_threads as u16,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,
    /// Database connections for drains and acks.
    #[arg(long, env = "RELAY_DB_CONNECTIONS", default_value_t = defaults().db_connections,
          value_parser = clap::value_parser!(u32).range(2..=1000))]
    pub db_connections: u32,
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    #[arg(long, env = "RELAY_METRICS_ADDR", default_value_t = defaults().metrics_addr)]
    pub metrics_addr: SocketAddr,
    /// Longest wait for a broker connection, in ms.
    #[arg(long, env = "RELAY_AMQP_CONNECT_TIMEOUT_MS", default_value_t = millis(defaults().amqp_connect_timeout),
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub amqp_connect_timeout_ms: u64,
    /// Longest wait for a batch's confirms, in ms.
    #[arg(long, env = "RELAY_AMQP_CONFIRM_TIMEOUT_MS", default_value_t = millis(defaults().amqp_confirm_timeout),
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub amqp_confirm_timeout_ms: u64,
    /// PEM file of certificates trusted for `amqps://` besides the system's roots.
    #[arg(long, env = "RELAY_AMQP_CA_FILE")]
    pub amqp_ca_file: Option<std::path::PathBuf>,
    /// PEM certificate chain presented to the broker (with --amqp-client-key-file).
    #[arg(
        long,
        env = "RELAY_AMQP_CLIENT_CERT_FILE",
        requires = "amqp_client_key_file"
    )]
    pub amqp_client_cert_file: Option<std::path::PathBuf>,
    /// PEM private key of the client certificate.
    #[arg(
        long,
        env = "RELAY_AMQP_CLIENT_KEY_FILE",
        requires = "amqp_client_cert_file"
    )]
    pub amqp_client_key_file: Option<std::path::PathBuf>,
    /// PostgreSQL schema of the relay's tables (default: the connection's search_path).
    #[arg(long, env = "RELAY_SCHEMA")]
    pub schema: Option<String>,
    /// Do not apply the schema at start (the host applies `distribution sql` itself).
    #[arg(long, env = "RELAY_SKIP_MIGRATE")]
    pub skip_migrate: bool,
    /// `/readyz` fails when more branches than this are parked.
    #[arg(long, env = "RELAY_READY_MAX_PARKED", default_value_t = defaults().ready_max_parked,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub ready_max_parked: u32,
    /// Retire closed and shipped runs this many seconds after they closed (default: never).
    #[arg(long, env = "RELAY_RETENTION_SECS",
          value_parser = clap::value_parser!(u64).range(1..=3_153_600_000))]
    pub retention_secs: Option<u64>,
}

/// `RELAY_GROUPS`: `none`, or group names.
fn groups(names: &[String]) -> Result<Vec<broker::Group>, ConfigError> {
    if let [only] = names
        && only.trim() == "none"
    {
        return Ok(Vec::new());
    }
    names
        .iter()
        .map(|name| {
            broker::Group::parse(name.trim()).map_err(|err| ConfigError::Invalid {
                var: "RELAY_GROUPS",
                value: names.join(","),
                reason: err.to_string(),
            })
        })
        .collect()
}

/// How the topology's queues are declared: the relay's, and the commands' that declare or
/// read them (`group`, `dead`), so that every declare agrees.
#[derive(Clone, Debug, clap::Args)]
pub struct QueueSettings {
    /// Queue type: classic, quorum (replicated) or stream (replicated, replayable by
    /// consumer groups from an offset kept in their fold database).
    #[arg(long, env = "RELAY_QUEUE_TYPE", value_enum, default_value_t = QueueType::Classic)]
    pub queue_type: QueueType,
    /// Streams: the longest a partition keeps a message (a number and one of Y M D h m s).
    #[arg(long, env = "RELAY_STREAM_MAX_AGE")]
    pub stream_max_age: Option<String>,
    /// Streams: the most bytes a partition keeps.
    #[arg(long, env = "RELAY_STREAM_MAX_BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub stream_max_bytes: Option<u64>,
    /// Streams: the segment size retention removes whole (RabbitMQ's default 500 MB).
    #[arg(long, env = "RELAY_STREAM_SEGMENT_BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub stream_segment_bytes: Option<u64>,
    /// Quorum queues: redeliveries of one message before the broker dead-letters it to the
    /// group's dead-letter queue (never dropped).
    #[arg(long, env = "RELAY_DELIVERY_LIMIT", default_value_t = broker::DEFAULT_DELIVERY_LIMIT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub delivery_limit: u32,
    /// Quorum queues and streams: members each starts with (default: every node).
    #[arg(long, env = "RELAY_QUEUE_REPLICAS", value_parser = clap::value_parser!(u16).range(1..=9))]
    pub queue_replicas: Option<u16>,
}

impl Default for QueueSettings {
    /// Classic queues, the defaults above.
    fn default() -> Self {
        Self {
            queue_type: QueueType::Classic,
            stream_max_age: None,
            stream_max_bytes: None,
            stream_segment_bytes: None,
            delivery_limit: broker::DEFAULT_DELIVERY_LIMIT,
            queue_replicas: None,
        }
    }
}

impl QueueSettings {
    /// Writes these settings into `config`, refusing retention a stream would not take (and
    /// retention given for another queue type, which would be silently ignored).
    pub fn apply(&self, config: &mut RelayConfig) -> Result<(), ConfigError> {
        let retention = StreamRetention {
            max_age: self.stream_max_age.clone(),
            max_bytes: self.stream_max_bytes,
            segment_bytes: self.stream_segment_bytes,
        };
        retention.validate().map_err(|err| ConfigError::Invalid {
            var: "RELAY_STREAM_MAX_AGE",
            value: self.stream_max_age.clone().unwrap_or_default(),
            reason: err.to_string(),
        })?;
        if retention != StreamRetention::default() && self.queue_type != QueueType::Stream {
            return Err(ConfigError::Invalid {
                var: "RELAY_QUEUE_TYPE",
                value: format!("{:?}", self.queue_type).to_lowercase(),
                reason: "RELAY_STREAM_* retention applies to streams only: set \
                         RELAY_QUEUE_TYPE=stream or unset them"
                    .into(),
            });
        }
        config.queue_type = self.queue_type;
        config.stream_retention = retention;
        config.delivery_limit = self.delivery_limit;
        config.replicas = self.queue_replicas;
        Ok(())
    }
}

impl Settings {
    /// The configuration these settings describe, validated (cross-field rules included).
    pub fn into_config(self) -> Result<RelayConfig, ConfigError> {
        let mut config = RelayConfig::new(self.database_url, self.amqp_url);
        config.topology = self.topology;
        config.partitions = self.partitions;
        self.queues.apply(&mut config)?;
        config.groups = groups(&self.groups)?;
        config.cloudevents = self.cloudevents;
        let supervisor = &mut config.supervisor;
        supervisor.shards = self.shards;
        supervisor.drainer.batch_size = self.batch_size;
        supervisor.drainer.max_batches_in_flight = self.batches_in_flight as usize;
        supervisor.drainer.batch_max_bytes = self.batch_max_bytes;
        supervisor.drainer.express_max_events = self.express_max_events;
        supervisor.max_in_flight = self.max_in_flight as usize;
        supervisor.max_drainers = self.max_drainers as usize;
        supervisor.max_in_flight_bytes = self.max_in_flight_bytes as usize;
        supervisor.poll_interval = Duration::from_millis(self.poll_ms);
        supervisor.lease.ttl = Duration::from_millis(self.lease_ttl_ms);
        supervisor.lease.heartbeat = Duration::from_millis(self.lease_heartbeat_ms);
        supervisor.drainer.park_after_attempts = self.park_after_attempts;
        supervisor.drainer.park_retry = Duration::from_millis(self.park_retry_ms);
        config.worker_threads = usize::from(self.threads);
        config.db_connections = self.db_connections;
        config.metrics_addr = self.metrics_addr;
        config.amqp_connect_timeout = Duration::from_millis(self.amqp_connect_timeout_ms);
        config.amqp_confirm_timeout = Duration::from_millis(self.amqp_confirm_timeout_ms);
        config.ready_max_parked = self.ready_max_parked;
        config.schema = self.schema;
        config.skip_migrate = self.skip_migrate;
        config.retention = self.retention_secs.map(Duration::from_secs);
        if let Some(path) = &self.amqp_ca_file {
            let pem = pem_file("RELAY_AMQP_CA_FILE", path, "CERTIFICATE")?;
            config.amqp_tls.ca_pem = Some(String::from_utf8_lossy(&pem).into_owned());
        }
        if let (Some(cert), Some(key)) = (&self.amqp_client_cert_file, &self.amqp_client_key_file) {
            config.amqp_tls.client_identity = Some((
                pem_file("RELAY_AMQP_CLIENT_CERT_FILE", cert, "CERTIFICATE")?,
                pem_file("RELAY_AMQP_CLIENT_KEY_FILE", key, "PRIVATE KEY")?,
            ));
        }
        config.validate()?;
        Ok(config)
    }

    /// The environment variables these settings read.
    pub fn variables() -> Vec<String> {
        use clap::Args as _;
        Self::augment_args(clap::Command::new("relay"))
            .get_arguments()
            .filter_map(|arg| arg.get_env())
            .map(|name| name.to_string_lossy().into_owned())
            .collect()
    }
}

/// `RELAY_*` variables set in the environment that no setting reads (a typo such as
/// `RELAY_PARTITONS` would otherwise be ignored silently). `also_known` adds variables read
/// elsewhere (the binary's `RELAY_LOG_FORMAT`).
pub fn unknown_relay_variables(also_known: &[&str]) -> Vec<String> {
    let known = Settings::variables();
    let mut unknown: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| name.starts_with("RELAY_"))
        .filter(|name| !known.contains(name) && !also_known.contains(&name.as_str()))
        .collect();
    unknown.sort();
    unknown
}

/// The URL with its password replaced by `***` (parsed as a URL: `@`, `:` and `%` in a
/// password never leak); an unparseable URL is not shown at all.
pub(crate) fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            parsed.to_string()
        }
        Err(_) => "<not a URL>".into(),
    }
}

impl RelayConfig {
    /// Defaults around the two required URLs.
    pub fn new(database_url: impl Into<String>, amqp_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            amqp_url: amqp_url.into(),
            topology: "outbox".into(),
            partitions: 8,
            supervisor: SupervisorConfig::default(),
            worker_threads: 2,
            db_connections: 8,
            metrics_addr: SocketAddr::from(([127, 0, 0, 1], 9464)),
            amqp_connect_timeout: Duration::from_secs(5),
            amqp_confirm_timeout: Duration::from_secs(10),
            probe: None,
            queue_type: QueueType::Classic,
            stream_retention: StreamRetention::default(),
            delivery_limit: broker::DEFAULT_DELIVERY_LIMIT,
            replicas: None,
            groups: vec![broker::Group::Default],
            cloudevents: false,
            ready_max_parked: 100,
            amqp_tls: broker::AmqpTls::default(),
            schema: None,
            skip_migrate: false,
            retention: None,
        }
    }

    /// Reads the environment (see [`Settings`]: each setting's variable, default and bounds)
    /// and validates it. The same parser as the binary's flags: one source of truth.
    pub fn from_env() -> Result<Self, ConfigError> {
        #[derive(clap::Parser)]
        #[command(no_binary_name = true)]
        struct FromEnv {
            #[command(flatten)]
            settings: Settings,
        }
        use clap::Parser as _;
        let parsed = FromEnv::try_parse_from(std::iter::empty::<String>())
            .map_err(|err| ConfigError::Rejected(first_line(&err.render().to_string())))?;
        parsed.settings.into_config()
    }

    /// Checks every value; the first problem comes back as one readable line.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |var: &'static str, value: String, reason: &str| ConfigError::Invalid {
            var,
            value,
            reason: reason.into(),
        };
        if self
            .database_url
            .parse::<sqlx::postgres::PgConnectOptions>()
            .is_err()
            || !(self.database_url.starts_with("postgres://")
                || self.database_url.starts_with("postgresql://"))
        {
            return Err(invalid(
                "DATABASE_URL",
                redact(&self.database_url),
                "expected postgres://user@host:port/database",
            ));
        }
        self.rabbit_config()?;
        if let Some(schema) = &self.schema
            && let Err(err) = store::Schema::new(schema)
        {
            return Err(invalid("RELAY_SCHEMA", schema.clone(), &err.to_string()));
        }
        if self.supervisor.shards == 0 {
            return Err(invalid("RELAY_SHARDS", "0".into(), "must be at least 1"));
        }
        if self.supervisor.drainer.batch_size == 0 || self.supervisor.drainer.batch_size > 100_000 {
            return Err(invalid(
                "RELAY_BATCH_SIZE",
                self.supervisor.drainer.batch_size.to_string(),
                "must be 1 to 100000",
            ));
        }
        if self.supervisor.poll_interval < Duration::from_millis(10) {
            return Err(invalid(
                "RELAY_POLL_MS",
                self.supervisor.poll_interval.as_millis().to_string(),
                "must be at least 10",
            ));
        }
        let batch_bytes = self.supervisor.drainer.batch_max_bytes;
        if !(1024..=(256 << 20)).contains(&batch_bytes) {
            return Err(invalid(
                "RELAY_BATCH_MAX_BYTES",
                batch_bytes.to_string(),
                "must be 1024 to 268435456",
            ));
        }
        if self.supervisor.max_in_flight_bytes < batch_bytes as usize {
            return Err(invalid(
                "RELAY_MAX_IN_FLIGHT_BYTES",
                self.supervisor.max_in_flight_bytes.to_string(),
                "must be at least RELAY_BATCH_MAX_BYTES",
            ));
        }
        for (var, timeout) in [
            ("RELAY_AMQP_CONNECT_TIMEOUT_MS", self.amqp_connect_timeout),
            ("RELAY_AMQP_CONFIRM_TIMEOUT_MS", self.amqp_confirm_timeout),
        ] {
            if !(Duration::from_millis(100)..=Duration::from_secs(600)).contains(&timeout) {
                return Err(invalid(
                    var,
                    timeout.as_millis().to_string(),
                    "must be 100 to 600000",
                ));
            }
        }
        if self.supervisor.drainer.park_after_attempts == 0 {
            return Err(invalid(
                "RELAY_PARK_AFTER_ATTEMPTS",
                "0".into(),
                "must be at least 1",
            ));
        }
        let lease = self.supervisor.lease;
        if lease.heartbeat < Duration::from_millis(50) {
            return Err(invalid(
                "RELAY_LEASE_HEARTBEAT_MS",
                lease.heartbeat.as_millis().to_string(),
                "must be at least 50",
            ));
        }
        if lease.ttl < lease.heartbeat * 3 {
            return Err(invalid(
                "RELAY_LEASE_TTL_MS",
                lease.ttl.as_millis().to_string(),
                "must be at least three heartbeats (RELAY_LEASE_HEARTBEAT_MS x 3)",
            ));
        }
        if self.supervisor.drainer.max_batches_in_flight == 0 {
            return Err(invalid(
                "RELAY_BATCHES_IN_FLIGHT",
                "0".into(),
                "must be at least 1",
            ));
        }
        if self.worker_threads == 0 {
            return Err(invalid("RELAY_THREADS", "0".into(), "must be at least 1"));
        }
        if self.db_connections < 2 {
            return Err(invalid(
                "RELAY_DB_CONNECTIONS",
                self.db_connections.to_string(),
                "must be at least 2",
            ));
        }
        Ok(())
    }

    /// The relay's schema, if any (validated by [`RelayConfig::validate`]).
    pub fn schema(&self) -> Option<store::Schema> {
        self.schema
            .as_ref()
            .and_then(|name| store::Schema::new(name).ok())
    }

    /// The supervisor's configuration as the relay runs it: on streams one publisher shard per
    /// partition ([`supervisor::Sharding::Partition`], `supervisor.shards` ignored), so each
    /// AMQP channel writes to one stream (see there why); else `supervisor` as set.
    pub fn supervisor_config(&self) -> SupervisorConfig {
        let mut supervisor = self.supervisor;
        if self.queue_type == QueueType::Stream {
            supervisor.sharding = supervisor::Sharding::Partition;
            supervisor.shards = self.partitions;
        }
        supervisor
    }

    /// The broker side of this configuration.
    pub fn rabbit_config(&self) -> Result<RabbitConfig, ConfigError> {
        let topology =
            Topology::new(&self.topology, self.partitions).map_err(|err| ConfigError::Invalid {
                var: "RELAY_TOPOLOGY/RELAY_PARTITIONS",
                value: format!("{}/{}", self.topology, self.partitions),
                reason: err.to_string(),
            })?;
        let mut rabbit = RabbitConfig::new(self.amqp_url.clone(), topology).map_err(|err| {
            ConfigError::Invalid {
                var: "AMQP_URL",
                value: redact(&self.amqp_url),
                reason: err.to_string(),
            }
        })?;
        rabbit.topology = rabbit
            .topology
            .with_queue_type(self.queue_type)
            .with_stream_retention(self.stream_retention.clone())
            .with_delivery_limit(self.delivery_limit)
            .with_replicas(self.replicas)
            .declaring(self.groups.clone());
        if self.cloudevents {
            rabbit.wire_mode = broker::WireMode::CloudEvents;
        }
        rabbit.tls = self.amqp_tls.clone();
        rabbit.connect_timeout = self.amqp_connect_timeout;
        rabbit.confirm_timeout = self.amqp_confirm_timeout;
        Ok(rabbit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bad URL is one readable line naming the variable, with no password in it.
    #[test]
    fn bad_configuration_fails_fast_and_readably() {
        let config = RelayConfig::new("mysql://root:secret@db/x", "amqp://127.0.0.1:5672/%2f");
        let err = config.validate().unwrap_err().to_string();
        assert!(err.starts_with("DATABASE_URL="), "{err}");
        assert!(!err.contains("secret"), "{err}");
        let config = RelayConfig::new("postgres://postgres@127.0.0.1/test", "http://guest:pw@x");
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .starts_with("AMQP_URL=")
        );
        // Issue 16: a URI lapin cannot parse ran as "broker unreachable" for ever.
        let config = RelayConfig::new("postgres://postgres@127.0.0.1/test", "amqp://%%%:@@@");
        let err = config.validate().unwrap_err().to_string();
        assert!(err.starts_with("AMQP_URL="), "{err}");
        assert!(err.contains("not a valid AMQP URI"), "{err}");
        let mut config = RelayConfig::new(
            "postgres://postgres@127.0.0.1/test",
            "amqp://127.0.0.1:5672/%2f",
        );
        config.validate().unwrap();
        config.supervisor.shards = 0;
        assert!(config.validate().is_err());
    }

    /// On streams the relay runs one publisher shard per partition, whatever `RELAY_SHARDS`
    /// says; on other queue types the shards are as set.
    #[test]
    fn streams_run_one_publisher_shard_per_partition() {
        let mut config = RelayConfig::new(
            "postgres://postgres@127.0.0.1/test",
            "amqp://127.0.0.1:5672/%2f",
        );
        config.partitions = 6;
        config.supervisor.shards = 3;
        for queue_type in [QueueType::Classic, QueueType::Quorum] {
            config.queue_type = queue_type;
            let supervisor = config.supervisor_config();
            assert_eq!(
                (supervisor.shards, supervisor.sharding),
                (3, supervisor::Sharding::Branch)
            );
        }
        config.queue_type = QueueType::Stream;
        let supervisor = config.supervisor_config();
        assert_eq!(
            (supervisor.shards, supervisor.sharding),
            (6, supervisor::Sharding::Partition)
        );
        assert_eq!(
            supervisor.publishers(),
            12,
            "a bulk and an express lane per partition"
        );
    }

    #[test]
    fn tls_files_are_read_at_start_and_named_when_wrong() {
        let dir = std::env::temp_dir().join(format!("relay-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let not_pem = dir.join("ca.txt");
        std::fs::write(&not_pem, "hello").unwrap();
        let err = pem_file("RELAY_AMQP_CA_FILE", &not_pem, "CERTIFICATE").unwrap_err();
        assert!(err.to_string().starts_with("RELAY_AMQP_CA_FILE="), "{err}");
        assert!(err.to_string().contains("no PEM CERTIFICATE"), "{err}");
        let missing = dir.join("missing.pem");
        let err = pem_file("RELAY_AMQP_CA_FILE", &missing, "CERTIFICATE").unwrap_err();
        assert!(err.to_string().contains("cannot read it"), "{err}");
        let key = dir.join("key.pem");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        assert!(pem_file("RELAY_AMQP_CLIENT_KEY_FILE", &key, "PRIVATE KEY").is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn passwords_never_leak_from_a_redacted_url() {
        for (url, secret) in [
            ("postgres://relay:S3cret@db.example:5432/outbox", "S3cret"),
            ("postgres://relay:p@ss@db.example/outbox", "p@ss"),
            ("postgres://relay:a:b:c@db.example/outbox", "a:b:c"),
            ("amqp://relay:100%25sure@mq.example/%2f", "100%25sure"),
            ("amqps://relay:x%40y@mq.example:5671/vhost", "x%40y"),
        ] {
            let shown = redact(url);
            assert!(!shown.contains(secret), "{shown}");
            assert!(shown.contains("relay:***@"), "{shown}");
        }
        assert_eq!(redact("no scheme at all"), "<not a URL>");
        assert_eq!(
            redact("postgres://relay@db/outbox"),
            "postgres://relay@db/outbox"
        );
    }
}

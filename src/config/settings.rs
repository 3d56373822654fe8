//! The relay's settings as flags and environment variables (clap), and what they become.
use std::net::SocketAddr;
use std::time::Duration;

use rabbit::{QueueType, StreamRetention};

use super::{BrokerKind, ConfigError, RelayConfig, pem_file};

fn defaults() -> RelayConfig {
    RelayConfig::new("", "")
}

fn millis(duration: Duration) -> u64 {
    duration.as_millis() as u64
}

/// Where the broker is and how its topology is named: the relay's own variables, read the same
/// way by the relay and by every command that talks to its broker (`status`, `dead`, `group`,
/// `tail`, `console`), so an operator sets them once for all.
#[derive(Clone, Debug, clap::Args)]
pub struct BrokerArgs {
    /// The broker: RabbitMQ (`AMQP_URL`) or NATS JetStream (`NATS_URL`).
    #[arg(long, env = "RELAY_BROKER", value_enum, default_value = "rabbitmq")]
    pub broker: BrokerKind,
    /// RabbitMQ (`amqps://` for TLS). `run`, `dead`, `group` and `tail` need it on RabbitMQ (a
    /// relay starts while the broker is down); without it `status` and `console` show the
    /// database's side only.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<String>,
    /// NATS servers, comma-separated (`nats://host:4222`): on NATS, what AMQP_URL is on
    /// RabbitMQ.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    pub nats_url: Option<String>,
    /// The exchange (queues `<topology>.p<N>`, dead letters `<topology>.dead`), or on NATS the
    /// stream (subjects `<topology>.p<N>`, dead letters in `<topology>_dead`).
    #[arg(long, env = "RELAY_TOPOLOGY", default_value_t = defaults().topology)]
    pub topology: String,
    /// Broker partitions, keyed by (tenant, run): a run's events, and a replayed dead letter,
    /// go to its run's partition (`tail --run` watches that one alone).
    #[arg(long, env = "RELAY_PARTITIONS", default_value_t = defaults().partitions,
          value_parser = clap::value_parser!(u16).range(super::bounds::PARTITIONS.range()))]
    pub partitions: u16,
}

impl BrokerArgs {
    /// The chosen broker's address, if given.
    pub fn url(&self) -> Option<&str> {
        match self.broker {
            BrokerKind::RabbitMq => self.amqp_url.as_deref(),
            BrokerKind::Nats => self.nats_url.as_deref(),
        }
    }

    /// A relay's configuration for this broker and topology, on no database (what a command
    /// that reads the broker alone builds its broker's settings from); refused with one line
    /// naming the missing address.
    pub fn broker_config(&self) -> Result<RelayConfig, ConfigError> {
        let mut config = match (self.broker, &self.amqp_url, &self.nats_url) {
            (BrokerKind::RabbitMq, Some(url), _) => RelayConfig::new("", url.clone()),
            (BrokerKind::RabbitMq, None, _) => return Err(amqp_url_missing()),
            (BrokerKind::Nats, _, Some(url)) => RelayConfig::nats("", url.clone()),
            (BrokerKind::Nats, _, None) => {
                return Err(ConfigError::Rejected(
                    "NATS_URL (--nats-url) is required with RELAY_BROKER=nats".into(),
                ));
            }
        };
        config.topology = self.topology.clone();
        config.partitions = self.partitions;
        Ok(config)
    }
}

fn amqp_url_missing() -> ConfigError {
    ConfigError::Rejected(
        "AMQP_URL (--amqp-url) is required: the RabbitMQ broker (or RELAY_BROKER=nats with NATS_URL)"
            .into(),
    )
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
    /// The broker, its address and its topology, as every command that talks to it reads them.
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// NATS: replicas of the stream the relay creates (1 on one server, 3 on a cluster).
    #[arg(long, env = "RELAY_NATS_REPLICAS", default_value_t = defaults().nats_replicas as u8,
          value_parser = clap::value_parser!(u8).range(1..=5))]
    pub nats_replicas: u8,
    /// NATS: how long the stream remembers a message id to drop a resend, in seconds.
    #[arg(long, env = "RELAY_NATS_DUPLICATE_WINDOW_SECS", default_value_t = defaults().nats_duplicate_window.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub nats_duplicate_window_secs: u64,
    /// NATS: longest wait for a connection, the stream's declaration, and a batch's acks, in ms.
    #[arg(long, env = "RELAY_NATS_ACK_TIMEOUT_MS", default_value_t = millis(defaults().nats_ack_timeout),
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub nats_ack_timeout_ms: u64,
    /// NATS: a version the server must meet, or the relay does not start (`>=2.10`: before
    /// 2.10 JetStream syncs to disk every 60 s, fixed, and its clusters lost acked events across
    /// partitions). Checked at start against what the server says; no server answering is a
    /// refusal too. Unset: a server before 2.10 is only warned about.
    #[arg(long, env = "RELAY_NATS_SERVER_VERSION")]
    pub nats_server_version: Option<semver::VersionReq>,
    /// Queue type, stream retention and the quorum delivery limit.
    #[command(flatten)]
    pub queues: QueueSettings,
    /// Consumer groups whose queues the relay declares.
    #[command(flatten)]
    pub groups: GroupsArgs,
    /// Also write CloudEvents attributes (binary content mode): `true` as each binding names
    /// them (`cloudEvents_*` headers on RabbitMQ, `ce-*` on NATS), `colon` as `cloudEvents:*`
    /// (the AMQP binding's first prefix; RabbitMQ only).
    #[arg(long, env = "RELAY_CLOUDEVENTS", value_enum, default_value = "false")]
    pub cloudevents: CloudEventsSetting,
    /// Publisher shards (one AMQP connection each). On streams, ignored: one shard per
    /// partition.
    #[arg(long, env = "RELAY_SHARDS", default_value_t = defaults().supervisor.shards,
          value_parser = clap::value_parser!(u16).range(super::bounds::SHARDS.range()))]
    pub shards: u16,
    /// Most events drained and published at once per tenant.
    #[arg(long, env = "RELAY_BATCH_SIZE", default_value_t = defaults().supervisor.drainer.batch_size,
          value_parser = clap::value_parser!(u32).range(super::bounds::BATCH_SIZE.range()))]
    pub batch_size: u32,
    /// Batches of one tenant in flight at once.
    #[arg(long, env = "RELAY_BATCHES_IN_FLIGHT",
          default_value_t = defaults().supervisor.drainer.max_batches_in_flight as u32,
          value_parser = clap::value_parser!(u32).range(super::bounds::BATCHES_IN_FLIGHT.range()))]
    pub batches_in_flight: u32,
    /// Batches of at most this many events take each shard's express publisher (quiet tenants
    /// never wait behind a backlog); 0: no express lane.
    #[arg(long, env = "RELAY_EXPRESS_MAX_EVENTS", default_value_t = defaults().supervisor.drainer.express_max_events,
          value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub express_max_events: u32,
    /// Most payload bytes in one batch (the first event always comes).
    #[arg(long, env = "RELAY_BATCH_MAX_BYTES", default_value_t = defaults().supervisor.drainer.batch_max_bytes,
          value_parser = clap::value_parser!(u32).range(super::bounds::BATCH_MAX_BYTES.range()))]
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
          value_parser = clap::value_parser!(u64).range(super::bounds::POLL_MS.range_u64()))]
    pub poll_ms: u64,
    /// Lease lifetime in ms: a dead relay's tenants move after about this long.
    #[arg(long, env = "RELAY_LEASE_TTL_MS", default_value_t = millis(defaults().supervisor.lease.ttl),
          value_parser = clap::value_parser!(u64).range(super::bounds::LEASE_TTL_MS.range_u64()))]
    pub lease_ttl_ms: u64,
    /// Lease renewal period in ms (at most a third of the TTL).
    #[arg(long, env = "RELAY_LEASE_HEARTBEAT_MS", default_value_t = millis(defaults().supervisor.lease.heartbeat),
          value_parser = clap::value_parser!(u64).range(super::bounds::LEASE_HEARTBEAT_MS.range_u64()))]
    pub lease_heartbeat_ms: u64,
    /// Refusals in a row after which a branch is parked.
    #[arg(long, env = "RELAY_PARK_AFTER_ATTEMPTS", default_value_t = defaults().supervisor.drainer.park_after_attempts,
          value_parser = clap::value_parser!(u32).range(super::bounds::PARK_AFTER_ATTEMPTS.range()))]
    pub park_after_attempts: u32,
    /// How long a parked branch waits before it is tried again, in ms.
    #[arg(long, env = "RELAY_PARK_RETRY_MS", default_value_t = millis(defaults().supervisor.drainer.park_retry),
          value_parser = clap::value_parser!(u64).range(100..=86_400_000))]
    pub park_retry_ms: u64,
    /// Publish only what is durable where this says, so a failover cannot take back what
    /// consumers folded: off; local (this server's disk); sync (every synchronous standby:
    /// what any failover candidate has); all (every streaming standby).
    #[arg(long, env = "RELAY_PUBLISH_REPLICATED", value_enum, default_value_t = ReplicationSetting::Off)]
    pub publish_replicated: ReplicationSetting,
    /// Longest wait for it after each drain, in ms; then the rows wait and are drained again.
    #[arg(long, env = "RELAY_PUBLISH_REPLICATED_TIMEOUT_MS", default_value_t = millis(defaults().replication_timeout),
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub publish_replicated_timeout_ms: u64,
    /// Runtime threads of the relay.
    #[arg(long, env = "RELAY_THREADS", default_value_t = defaults().worker_threads as u16,
          value_parser = clap::value_parser!(u16).range(super::bounds::THREADS.range()))]
    pub threads: u16,
    /// Database connections for drains and acks.
    #[arg(long, env = "RELAY_DB_CONNECTIONS", default_value_t = defaults().db_connections,
          value_parser = clap::value_parser!(u32).range(super::bounds::DB_CONNECTIONS.range()))]
    pub db_connections: u32,
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    #[arg(long, env = "RELAY_METRICS_ADDR", default_value_t = defaults().metrics_addr)]
    pub metrics_addr: SocketAddr,
    /// Longest wait for a broker connection, in ms.
    #[arg(long, env = "RELAY_AMQP_CONNECT_TIMEOUT_MS", default_value_t = millis(defaults().amqp_connect_timeout),
          value_parser = clap::value_parser!(u64).range(super::bounds::AMQP_CONNECT_TIMEOUT_MS.range_u64()))]
    pub amqp_connect_timeout_ms: u64,
    /// Longest wait for a batch's confirms, in ms.
    #[arg(long, env = "RELAY_AMQP_CONFIRM_TIMEOUT_MS", default_value_t = millis(defaults().amqp_confirm_timeout),
          value_parser = clap::value_parser!(u64).range(super::bounds::AMQP_CONFIRM_TIMEOUT_MS.range_u64()))]
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
    /// With RELAY_SKIP_MIGRATE, seconds to wait for a missing or out-of-date schema (checked
    /// every second) before failing: a relay started beside its migration job waits for it.
    #[arg(long, env = "RELAY_SCHEMA_WAIT_SECS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub schema_wait_secs: u64,
    /// `/readyz` fails when more branches than this are parked.
    #[arg(long, env = "RELAY_READY_MAX_PARKED", default_value_t = defaults().ready_max_parked,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub ready_max_parked: u32,
    /// Retire closed and shipped runs this many seconds after they closed (default: never).
    #[arg(long, env = "RELAY_RETENTION_SECS",
          value_parser = clap::value_parser!(u64).range(1..=3_153_600_000))]
    pub retention_secs: Option<u64>,
}

/// `RELAY_GROUPS`, read one way by the relay (whose queues it declares) and by the commands
/// that show the groups' dead letters (`status`, `console`).
#[derive(Clone, Debug, clap::Args)]
pub struct GroupsArgs {
    /// Consumer groups (comma-separated; `default`: the unnamed group's `<topology>.p<N>`;
    /// `none`: no group, the exchange only).
    #[arg(
        long,
        env = "RELAY_GROUPS",
        default_value = "default",
        value_delimiter = ','
    )]
    pub groups: Vec<String>,
}

impl GroupsArgs {
    /// The relay's groups, whose queues it declares: none for `none`; a name that is not a
    /// group's (an empty one too) is refused, naming `RELAY_GROUPS`.
    pub fn parse(&self) -> Result<Vec<broker::Group>, ConfigError> {
        let names = &self.groups;
        if self.is_none() {
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

    /// The names given, trimmed, for the commands that show each group's dead letters
    /// (`status`, `console`): none for `none`; empty entries (`RELAY_GROUPS=`, a trailing
    /// comma) are left out. Each broker's command checks a name by its own rule (NATS takes
    /// group names that RabbitMQ's queues do not).
    pub fn names(&self) -> Vec<&str> {
        if self.is_none() {
            return Vec::new();
        }
        self.groups
            .iter()
            .map(|name| name.trim())
            .filter(|name| !name.is_empty())
            .collect()
    }

    fn is_none(&self) -> bool {
        matches!(&self.groups[..], [only] if only.trim() == "none")
    }
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
    #[arg(long, env = "RELAY_DELIVERY_LIMIT", default_value_t = rabbit::DEFAULT_DELIVERY_LIMIT,
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
            delivery_limit: rabbit::DEFAULT_DELIVERY_LIMIT,
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
        let BrokerArgs {
            broker,
            amqp_url,
            nats_url,
            topology,
            partitions,
        } = self.broker;
        let amqp_url = match (broker, amqp_url) {
            (_, Some(url)) => url,
            (BrokerKind::Nats, None) => String::new(),
            (BrokerKind::RabbitMq, None) => return Err(amqp_url_missing()),
        };
        let mut config = RelayConfig::new(self.database_url, amqp_url);
        config.broker = broker;
        config.nats_url = nats_url.unwrap_or_default();
        config.nats_replicas = usize::from(self.nats_replicas);
        config.nats_duplicate_window = Duration::from_secs(self.nats_duplicate_window_secs);
        config.nats_ack_timeout = Duration::from_millis(self.nats_ack_timeout_ms);
        if broker == BrokerKind::RabbitMq && self.nats_server_version.is_some() {
            return Err(ConfigError::Rejected(
                "RELAY_NATS_SERVER_VERSION is a NATS setting; with RELAY_BROKER=rabbitmq leave it unset"
                    .into(),
            ));
        }
        config.nats_server_version = self.nats_server_version;
        config.topology = topology;
        config.partitions = partitions;
        self.queues.apply(&mut config)?;
        config.groups = self.groups.parse()?;
        config.wire_mode = match self.cloudevents {
            CloudEventsSetting::False => broker::WireMode::Plain,
            CloudEventsSetting::True => broker::WireMode::CloudEvents,
            CloudEventsSetting::Colon => broker::WireMode::CloudEventsColon,
        };
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
        config.schema_wait = Duration::from_secs(self.schema_wait_secs);
        config.retention = self.retention_secs.map(Duration::from_secs);
        config.replication = match self.publish_replicated {
            ReplicationSetting::Off => store::Replication::Off,
            ReplicationSetting::Local => store::Replication::Local,
            ReplicationSetting::Sync => store::Replication::Sync,
            ReplicationSetting::All => store::Replication::All,
        };
        config.replication_timeout = Duration::from_millis(self.publish_replicated_timeout_ms);
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
}

/// `RELAY_*` variables set in the environment that `known` (every variable the command line
/// reads, over all its commands) does not name: a typo such as `RELAY_PARTITONS` would
/// otherwise be ignored silently. Each is named once, sorted.
pub fn unknown_relay_variables(known: &[String]) -> Vec<String> {
    let mut unknown: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| name.starts_with("RELAY_") && !known.contains(name))
        .collect();
    unknown.sort();
    unknown.dedup();
    unknown
}

/// `RELAY_PUBLISH_REPLICATED`: where a drained row must be durable before it is published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ReplicationSetting {
    /// Wherever its commit put it.
    Off,
    /// On this server's disk.
    Local,
    /// On every synchronous standby.
    Sync,
    /// On every streaming standby.
    All,
}

/// `RELAY_CLOUDEVENTS`: whether, and under which prefix, CloudEvents attributes are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CloudEventsSetting {
    /// The contract alone.
    False,
    /// Headers `cloudEvents_<attribute>` on RabbitMQ (the CloudEvents AMQP binding's prefix),
    /// `ce-<attribute>` on NATS (its NATS binding's).
    True,
    /// Headers `cloudEvents:<attribute>`, the AMQP binding's first prefix (what `true` wrote
    /// before); refused on NATS.
    Colon,
}

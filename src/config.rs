//! Relay configuration: every field documented with its default; bad values fail at load time.
use std::net::SocketAddr;
use std::time::Duration;

use broker::CallProbe;

use rabbit::{QueueType, RabbitConfig, StreamRetention, Topology};
use supervisor::SupervisorConfig;

mod bounds;
mod settings;
pub use settings::{BrokerArgs, GroupsArgs, QueueSettings, Settings, unknown_relay_variables};

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

/// Which broker a relay publishes to (`RELAY_BROKER`: `rabbitmq` or `nats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BrokerKind {
    /// RabbitMQ (AMQP 0-9-1) at `AMQP_URL`.
    #[default]
    #[value(name = "rabbitmq")]
    RabbitMq,
    /// NATS JetStream at `NATS_URL`.
    Nats,
}

/// How to run a relay.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// PostgreSQL holding the outbox. Env `DATABASE_URL` (required).
    pub database_url: String,
    /// Where events go: RabbitMQ (the default) or NATS JetStream. Env `RELAY_BROKER`
    /// (`rabbitmq`, `nats`).
    pub broker: BrokerKind,
    /// RabbitMQ. Env `AMQP_URL` (required for RabbitMQ). The broker may be down at start: that
    /// is normal.
    pub amqp_url: String,
    /// NATS servers, comma-separated. Env `NATS_URL` (required for NATS). On NATS the topology
    /// is a stream named `RELAY_TOPOLOGY` with a subject per partition, `<topology>.p<N>`.
    pub nats_url: String,
    /// NATS: replicas of the stream the relay creates. Env `RELAY_NATS_REPLICAS`, default 1.
    pub nats_replicas: usize,
    /// NATS: how long the stream remembers a message id and drops a resend of it. Env
    /// `RELAY_NATS_DUPLICATE_WINDOW_SECS`, default 120 (the server's default).
    pub nats_duplicate_window: Duration,
    /// NATS: longest wait for a connection, the stream's declaration and a batch's acks. Env
    /// `RELAY_NATS_ACK_TIMEOUT_MS`, default 5000.
    pub nats_ack_timeout: Duration,
    /// NATS: a version the server must meet for the relay to start: [`Relay::start`]
    /// (and `distribution run`) asks the server it connects to, and refuses with
    /// [`RelayError::BrokerVersion`](crate::RelayError::BrokerVersion) if it falls short or
    /// cannot be asked ([`Relay::check_nats_version`]). Env
    /// `RELAY_NATS_SERVER_VERSION` (`>=2.10`), default none.
    ///
    /// [`Relay::start`]: crate::Relay::start
    /// [`Relay::check_nats_version`]: crate::Relay::check_nats_version
    pub nats_server_version: Option<semver::VersionReq>,
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
    /// What is written beside the contract: nothing (the default), or CloudEvents attributes
    /// too (binary content mode), as each binding names them, `cloudEvents_*` headers on
    /// RabbitMQ and `ce-*` on NATS ([`broker::WireMode::CloudEvents`], env
    /// `RELAY_CLOUDEVENTS=true`), or `cloudEvents:*` on RabbitMQ alone
    /// ([`broker::WireMode::CloudEventsColon`], `RELAY_CLOUDEVENTS=colon`).
    pub wire_mode: broker::WireMode,
    /// `/readyz` fails when more branches than this are parked. Env `RELAY_READY_MAX_PARKED`,
    /// default 100.
    pub ready_max_parked: u32,
    /// Extra TLS trust (a private CA) and a client certificate for `amqps://`. Env
    /// `RELAY_AMQP_CA_FILE`, `RELAY_AMQP_CLIENT_CERT_FILE` and `RELAY_AMQP_CLIENT_KEY_FILE`
    /// (PEM files, read at start); default none.
    pub amqp_tls: rabbit::AmqpTls,
    /// PostgreSQL schema of the relay's tables (created on migrate); the host's writer names
    /// it with `IntentWriter::with_schema`. Env `RELAY_SCHEMA`; default none (the connection's
    /// `search_path`, normally `public`).
    pub schema: Option<String>,
    /// `distribution run` does not apply the schema (the host applies `distribution sql` with
    /// its own migration tool). Env `RELAY_SKIP_MIGRATE`; default false.
    pub skip_migrate: bool,
    /// With `skip_migrate`, how long `distribution run` waits for a missing or out-of-date
    /// schema (checked every second) before it fails: a relay started beside its migration
    /// job waits for it instead of crash-looping. Env `RELAY_SCHEMA_WAIT_SECS`; default 0.
    pub schema_wait: Duration,
    /// Retire closed runs (their branches and parked rows; `store::retire_runs`) once they were
    /// closed this long ago and every row of them shipped, checked every quarter of it (between
    /// 100 ms and 60 s). Env `RELAY_RETENTION_SECS`; default none (closed runs are kept).
    pub retention: Option<Duration>,
    /// Publish only what is durable where this says (a failover keeps it): off, `local` (this
    /// server's disk), `sync` (every synchronous standby) or `all` (every streaming standby).
    /// (`sync` on a server naming no synchronous standby: its disk.) Env
    /// `RELAY_PUBLISH_REPLICATED`; default off. docs/operations.md, "Failover of the outbox's
    /// database".
    pub replication: store::Replication,
    /// Longest wait for it after each drain; then the rows wait and are drained again. Env
    /// `RELAY_PUBLISH_REPLICATED_TIMEOUT_MS`; default 1000.
    pub replication_timeout: Duration,
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

/// The URL with its password replaced by `***` (parsed as a URL: `@`, `:` and `%` in a
/// password never leak). Of a text that is no URL, whatever precedes its last `@` (where
/// credentials would be) is shown as `***`, the rest as given: the reader sees what was
/// set, never a password.
pub(crate) fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            parsed.to_string()
        }
        Err(_) => match url.rsplit_once('@') {
            None => url.to_owned(),
            Some((credentials, host)) => {
                let scheme = credentials
                    .split_once("://")
                    .map(|(scheme, _)| format!("{scheme}://"))
                    .unwrap_or_default();
                format!("{scheme}***@{host}")
            }
        },
    }
}

impl RelayConfig {
    /// Defaults around the two required URLs (the database's and RabbitMQ's; for NATS see
    /// [`RelayConfig::nats`]).
    pub fn new(database_url: impl Into<String>, amqp_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            broker: BrokerKind::RabbitMq,
            amqp_url: amqp_url.into(),
            nats_url: String::new(),
            nats_replicas: 1,
            nats_duplicate_window: Duration::from_secs(120),
            nats_ack_timeout: Duration::from_secs(5),
            nats_server_version: None,
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
            delivery_limit: rabbit::DEFAULT_DELIVERY_LIMIT,
            replicas: None,
            groups: vec![broker::Group::Default],
            wire_mode: broker::WireMode::Plain,
            ready_max_parked: 100,
            amqp_tls: rabbit::AmqpTls::default(),
            schema: None,
            skip_migrate: false,
            schema_wait: Duration::ZERO,
            retention: None,
            replication: store::Replication::Off,
            replication_timeout: Duration::from_secs(1),
        }
    }

    /// Defaults around the database's URL and NATS servers (comma-separated): events go to
    /// JetStream.
    pub fn nats(database_url: impl Into<String>, nats_url: impl Into<String>) -> Self {
        Self {
            broker: BrokerKind::Nats,
            nats_url: nats_url.into(),
            ..Self::new(database_url, "")
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
        bounds::PARTITIONS.check(self.partitions)?;
        match self.broker {
            BrokerKind::RabbitMq => drop(self.rabbit_config()?),
            BrokerKind::Nats => drop(self.nats_config()?),
        }
        if let Some(schema) = &self.schema
            && let Err(err) = store::Schema::new(schema)
        {
            return Err(invalid("RELAY_SCHEMA", schema.clone(), &err.to_string()));
        }
        bounds::SHARDS.check(self.supervisor.shards)?;
        bounds::BATCH_SIZE.check(self.supervisor.drainer.batch_size)?;
        bounds::POLL_MS.check_ms(self.supervisor.poll_interval)?;
        let batch_bytes = self.supervisor.drainer.batch_max_bytes;
        bounds::BATCH_MAX_BYTES.check(batch_bytes)?;
        if self.supervisor.max_in_flight_bytes < batch_bytes as usize {
            return Err(invalid(
                "RELAY_MAX_IN_FLIGHT_BYTES",
                self.supervisor.max_in_flight_bytes.to_string(),
                "must be at least RELAY_BATCH_MAX_BYTES",
            ));
        }
        bounds::AMQP_CONNECT_TIMEOUT_MS.check_ms(self.amqp_connect_timeout)?;
        bounds::AMQP_CONFIRM_TIMEOUT_MS.check_ms(self.amqp_confirm_timeout)?;
        bounds::PARK_AFTER_ATTEMPTS.check(self.supervisor.drainer.park_after_attempts)?;
        let lease = self.supervisor.lease;
        bounds::LEASE_HEARTBEAT_MS.check_ms(lease.heartbeat)?;
        bounds::LEASE_TTL_MS.check_ms(lease.ttl)?;
        if lease.ttl < lease.heartbeat * 3 {
            return Err(invalid(
                "RELAY_LEASE_TTL_MS",
                lease.ttl.as_millis().to_string(),
                "must be at least three heartbeats (RELAY_LEASE_HEARTBEAT_MS x 3)",
            ));
        }
        bounds::BATCHES_IN_FLIGHT.check(self.supervisor.drainer.max_batches_in_flight)?;
        bounds::THREADS.check(self.worker_threads)?;
        bounds::DB_CONNECTIONS.check(self.db_connections)?;
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

    /// The NATS side of this configuration; RabbitMQ's own settings are refused with it, so
    /// nothing set is silently ignored.
    pub fn nats_config(&self) -> Result<nats::NatsConfig, ConfigError> {
        let invalid = |var: &'static str, value: String, reason: &str| ConfigError::Invalid {
            var,
            value,
            reason: reason.into(),
        };
        if self.nats_url.trim().is_empty() {
            return Err(invalid(
                "NATS_URL",
                String::new(),
                "required with RELAY_BROKER=nats (nats://host:4222; several, comma-separated)",
            ));
        }
        let amqp_only = [
            ("RELAY_QUEUE_TYPE", self.queue_type != QueueType::Classic),
            ("RELAY_QUEUE_REPLICAS", self.replicas.is_some()),
            (
                "RELAY_STREAM_MAX_AGE",
                self.stream_retention != StreamRetention::default(),
            ),
            (
                "RELAY_AMQP_CA_FILE",
                self.amqp_tls != rabbit::AmqpTls::default(),
            ),
        ];
        if let Some((var, _)) = amqp_only.iter().find(|(_, set)| *set) {
            return Err(invalid(
                var,
                "(set)".into(),
                "a RabbitMQ setting; with RELAY_BROKER=nats leave it unset (the stream keeps \
                 everything; RELAY_NATS_REPLICAS sets its replicas)",
            ));
        }
        if self.wire_mode == broker::WireMode::CloudEventsColon {
            return Err(invalid(
                "RELAY_CLOUDEVENTS",
                "colon".into(),
                "cloudEvents:* is the AMQP binding's first prefix; on NATS `true` writes the NATS \
                 binding's ce-* headers",
            ));
        }
        let mut nats = nats::NatsConfig::new(&self.nats_url, &self.topology, self.partitions)
            .map_err(|err| {
                let text = err.to_string();
                let var = if text.contains("stream") {
                    "RELAY_TOPOLOGY"
                } else {
                    "NATS_URL"
                };
                let value = if var == "NATS_URL" {
                    redact(&self.nats_url)
                } else {
                    self.topology.clone()
                };
                invalid(var, value, &text)
            })?;
        nats.replicas = self.nats_replicas;
        nats.wire_mode = self.wire_mode;
        nats.duplicate_window = self.nats_duplicate_window;
        nats.connect_timeout = self.nats_ack_timeout;
        nats.ack_timeout = self.nats_ack_timeout;
        nats.validate().map_err(|err| {
            invalid(
                "RELAY_NATS_DUPLICATE_WINDOW_SECS",
                self.nats_duplicate_window.as_secs().to_string(),
                &err.to_string(),
            )
        })?;
        Ok(nats)
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
                reason: format!(
                    "{err} (a broker URL looks like amqp://user:password@host:5672/%2f; several, \
                     for a cluster, are separated by commas)"
                ),
            }
        })?;
        rabbit.topology = rabbit
            .topology
            .with_queue_type(self.queue_type)
            .with_stream_retention(self.stream_retention.clone())
            .with_delivery_limit(self.delivery_limit)
            .with_replicas(self.replicas)
            .declaring(self.groups.clone());
        rabbit.wire_mode = self.wire_mode;
        rabbit.tls = self.amqp_tls.clone();
        rabbit.connect_timeout = self.amqp_connect_timeout;
        rabbit.confirm_timeout = self.amqp_confirm_timeout;
        Ok(rabbit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RELAY_GROUPS` read one way: `none` alone is no group; the relay refuses a name that
    /// is not a group's (an empty one too), while the commands that show dead letters take the
    /// names as given, empty entries left out, for each broker to check by its own rule.
    #[test]
    fn relay_groups_mean_the_same_to_the_relay_and_the_commands() {
        let groups = |names: &[&str]| GroupsArgs {
            groups: names.iter().map(|name| name.to_string()).collect(),
        };
        let named = |names: &[&str]| -> Vec<String> {
            groups(names)
                .parse()
                .unwrap()
                .iter()
                .map(|group| group.name().to_owned())
                .collect()
        };
        assert_eq!(named(&["default"]), ["default"]);
        assert_eq!(named(&[" billing ", "default"]), ["billing", "default"]);
        assert!(named(&[" none "]).is_empty());
        assert!(groups(&["none"]).names().is_empty());
        for refused in [
            &[""][..],
            &["billing", ""],
            &["Billing"],
            &["p1"],
            &["dead"],
        ] {
            let err = groups(refused).parse().unwrap_err().to_string();
            assert!(err.starts_with("RELAY_GROUPS="), "{refused:?}: {err}");
        }
        assert_eq!(
            groups(&["billing", "", " Projector "]).names(),
            ["billing", "Projector"]
        );
        assert!(groups(&[""]).names().is_empty());
    }

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
        // Partitions past the command line's range are refused in code too (they were not).
        config.supervisor.shards = 8;
        config.partitions = 1025;
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "RELAY_PARTITIONS=\"1025\" is invalid: must be 1 to 1024"
        );
    }

    /// The broker as every command reads it: the chosen broker's address, its topology and
    /// partitions carried into the configuration, a missing address refused in one line
    /// naming it.
    #[test]
    fn broker_args_name_the_missing_address_and_carry_the_topology() {
        // Built by hand: a parse would read this machine's AMQP_URL and NATS_URL.
        let args = |broker, amqp: Option<&str>, nats: Option<&str>| BrokerArgs {
            broker,
            amqp_url: amqp.map(str::to_owned),
            nats_url: nats.map(str::to_owned),
            topology: "t".into(),
            partitions: 3,
        };
        let rabbit = args(
            BrokerKind::RabbitMq,
            Some("amqp://127.0.0.1"),
            Some("nats://x"),
        );
        assert_eq!(rabbit.url(), Some("amqp://127.0.0.1"));
        let config = rabbit.broker_config().unwrap();
        assert_eq!(
            (config.broker, config.topology.as_str(), config.partitions),
            (BrokerKind::RabbitMq, "t", 3)
        );
        let nats = args(BrokerKind::Nats, Some("amqp://127.0.0.1"), None);
        assert_eq!(nats.url(), None);
        assert_eq!(
            nats.broker_config().unwrap_err().to_string(),
            "NATS_URL (--nats-url) is required with RELAY_BROKER=nats"
        );
        let none = args(BrokerKind::RabbitMq, None, Some("nats://x"));
        assert!(
            none.broker_config()
                .unwrap_err()
                .to_string()
                .starts_with("AMQP_URL (--amqp-url) is required")
        );
        // The command line's range: what the relay's validate refuses (above) is refused at
        // the door too.
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Cli {
            #[command(flatten)]
            broker: BrokerArgs,
        }
        let err = Cli::try_parse_from(["x", "--partitions", "1025"]).unwrap_err();
        assert!(err.to_string().contains("1..=1024"), "{err}");
    }

    /// On NATS: the servers are required, RabbitMQ's own settings are refused rather than
    /// ignored, and the stream's name is NATS's; each in one line naming its variable.
    #[test]
    fn a_nats_relay_refuses_what_it_would_ignore_or_nats_would_refuse() {
        let database = "postgres://postgres@127.0.0.1/test";
        let mut config = RelayConfig::nats(database, "nats://127.0.0.1:4222");
        config.validate().unwrap();
        let nats = config.nats_config().unwrap();
        assert_eq!((nats.stream.as_str(), nats.partitions), ("outbox", 8));
        assert_eq!(nats.subject(broker::Partition(3)), "outbox.p3");
        let refused = |config: &RelayConfig| config.validate().unwrap_err().to_string();
        let mut no_servers = config.clone();
        no_servers.nats_url.clear();
        assert!(refused(&no_servers).starts_with("NATS_URL="));
        let mut quorum = config.clone();
        quorum.queue_type = QueueType::Quorum;
        assert!(refused(&quorum).starts_with("RELAY_QUEUE_TYPE="));
        assert!(!refused(&quorum).contains("  "), "one readable line");
        let mut cloudevents = config.clone();
        cloudevents.wire_mode = broker::WireMode::CloudEvents;
        cloudevents.validate().unwrap();
        assert_eq!(
            cloudevents.nats_config().unwrap().wire_mode,
            broker::WireMode::CloudEvents,
            "the adapter is told"
        );
        cloudevents.wire_mode = broker::WireMode::CloudEventsColon;
        let text = refused(&cloudevents);
        assert!(
            text.starts_with("RELAY_CLOUDEVENTS=") && text.contains("ce-*"),
            "{text}"
        );
        config.topology = "relay.events".into();
        let text = refused(&config);
        assert!(
            text.starts_with("RELAY_TOPOLOGY=") && text.contains("A-Z a-z 0-9"),
            "{text}"
        );
        config.topology = "events".into();
        config.nats_duplicate_window = Duration::from_secs(5);
        assert!(refused(&config).starts_with("RELAY_NATS_DUPLICATE_WINDOW_SECS="));
        for text in [refused(&no_servers), refused(&quorum), refused(&config)] {
            assert!(!text.contains('\n'), "{text}");
        }
    }

    /// On streams the relay runs one publisher shard per partition, whatever `RELAY_SHARDS`
    /// says; on other queue types the shards are as set.
    /// `RELAY_CLOUDEVENTS`: off, the binding's `cloudEvents_` prefix, or its first `cloudEvents:`.
    #[test]
    fn cloudevents_are_written_under_the_prefix_asked_for() {
        #[derive(clap::Parser)]
        #[command(no_binary_name = true)]
        struct Flags {
            #[command(flatten)]
            settings: Settings,
        }
        use clap::Parser as _;
        for (value, mode) in [
            ("false", broker::WireMode::Plain),
            ("true", broker::WireMode::CloudEvents),
            ("colon", broker::WireMode::CloudEventsColon),
        ] {
            let flags = Flags::try_parse_from([
                "--database-url",
                "postgres://postgres@127.0.0.1/test",
                "--amqp-url",
                "amqp://127.0.0.1:5672/%2f",
                "--cloudevents",
                value,
            ])
            .unwrap();
            let config = flags.settings.into_config().unwrap();
            assert_eq!(config.wire_mode, mode, "{value}");
            assert_eq!(config.rabbit_config().unwrap().wire_mode, mode);
        }
        assert!(
            Flags::try_parse_from(["--cloudevents", "yes"]).is_err(),
            "an unknown value is refused"
        );
    }

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
        assert_eq!(redact("no scheme at all"), "no scheme at all");
        assert_eq!(redact("amqp//relay:p@ss@mq:5672"), "***@mq:5672");
        assert_eq!(redact("amqp://relay:p@ss@mq:99999"), "amqp://***@mq:99999");
        assert_eq!(
            redact("postgres://relay@db/outbox"),
            "postgres://relay@db/outbox"
        );
    }
}

//! Relay configuration: every field documented with its default; bad values fail at load time.
use std::net::SocketAddr;
use std::time::Duration;

use broker::{CallProbe, RabbitConfig, Topology};
use supervisor::SupervisorConfig;

/// A configuration value that cannot be used. One readable line, naming the variable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A required variable is not set.
    #[error("{0} is not set")]
    Missing(&'static str),
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

fn parsed<T: std::str::FromStr>(var: &'static str, default: T) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(value) => value
            .trim()
            .parse()
            .map_err(|err: T::Err| ConfigError::Invalid {
                var,
                value,
                reason: err.to_string(),
            }),
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
        }
    }

    /// Reads the environment (see each field) and validates it.
    pub fn from_env() -> Result<Self, ConfigError> {
        let database_url =
            std::env::var("DATABASE_URL").map_err(|_| ConfigError::Missing("DATABASE_URL"))?;
        let amqp_url = std::env::var("AMQP_URL").map_err(|_| ConfigError::Missing("AMQP_URL"))?;
        let mut config = Self::new(database_url, amqp_url);
        config.topology = parsed("RELAY_TOPOLOGY", config.topology)?;
        config.partitions = parsed("RELAY_PARTITIONS", config.partitions)?;
        config.supervisor.shards = parsed("RELAY_SHARDS", config.supervisor.shards)?;
        config.supervisor.drainer.batch_size =
            parsed("RELAY_BATCH_SIZE", config.supervisor.drainer.batch_size)?;
        config.supervisor.drainer.max_batches_in_flight = parsed(
            "RELAY_BATCHES_IN_FLIGHT",
            config.supervisor.drainer.max_batches_in_flight,
        )?;
        let poll_ms: u64 = parsed(
            "RELAY_POLL_MS",
            config.supervisor.poll_interval.as_millis() as u64,
        )?;
        config.supervisor.poll_interval = Duration::from_millis(poll_ms);
        let ttl_ms: u64 = parsed(
            "RELAY_LEASE_TTL_MS",
            config.supervisor.lease.ttl.as_millis() as u64,
        )?;
        config.supervisor.lease.ttl = Duration::from_millis(ttl_ms);
        let heartbeat_ms: u64 = parsed(
            "RELAY_LEASE_HEARTBEAT_MS",
            config.supervisor.lease.heartbeat.as_millis() as u64,
        )?;
        config.supervisor.lease.heartbeat = Duration::from_millis(heartbeat_ms);
        config.supervisor.drainer.batch_max_bytes = parsed(
            "RELAY_BATCH_MAX_BYTES",
            config.supervisor.drainer.batch_max_bytes,
        )?;
        config.supervisor.max_in_flight_bytes = parsed(
            "RELAY_MAX_IN_FLIGHT_BYTES",
            config.supervisor.max_in_flight_bytes,
        )?;
        config.supervisor.drainer.park_after_attempts = parsed(
            "RELAY_PARK_AFTER_ATTEMPTS",
            config.supervisor.drainer.park_after_attempts,
        )?;
        let park_retry_ms: u64 = parsed(
            "RELAY_PARK_RETRY_MS",
            config.supervisor.drainer.park_retry.as_millis() as u64,
        )?;
        config.supervisor.drainer.park_retry = Duration::from_millis(park_retry_ms);
        config.worker_threads = parsed("RELAY_THREADS", config.worker_threads)?;
        config.db_connections = parsed("RELAY_DB_CONNECTIONS", config.db_connections)?;
        config.metrics_addr = parsed("RELAY_METRICS_ADDR", config.metrics_addr)?;
        let connect_ms: u64 = parsed(
            "RELAY_AMQP_CONNECT_TIMEOUT_MS",
            config.amqp_connect_timeout.as_millis() as u64,
        )?;
        config.amqp_connect_timeout = Duration::from_millis(connect_ms);
        let confirm_ms: u64 = parsed(
            "RELAY_AMQP_CONFIRM_TIMEOUT_MS",
            config.amqp_confirm_timeout.as_millis() as u64,
        )?;
        config.amqp_confirm_timeout = Duration::from_millis(confirm_ms);
        config.validate()?;
        Ok(config)
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
        let mut config = RelayConfig::new(
            "postgres://postgres@127.0.0.1/test",
            "amqp://127.0.0.1:5672/%2f",
        );
        config.validate().unwrap();
        config.supervisor.shards = 0;
        assert!(config.validate().is_err());
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

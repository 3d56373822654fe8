//! Where and how the relay publishes to JetStream: servers, the stream, its partitions' subjects,
//! timeouts and the acks held in flight. Validated at once, one readable line per fault.
use std::time::Duration;

use async_nats::ServerAddr;
use broker::{Error, Partition, WireMode};
use store::{RunId, TenantId};

/// The most acks a publisher holds in flight: async-nats allows 5,000 per connection and a
/// publish past them waits for a permit, so the relay stays below it.
pub const MAX_ACKS_IN_FLIGHT: usize = 4_096;

/// A JetStream destination: one stream per topology, one subject per partition
/// (`<stream>.p<N>`, the stream bound to `<stream>.*`).
#[derive(Clone, Debug)]
pub struct NatsConfig {
    /// Server URLs (`nats://host:4222`); the client tries them in turn and reconnects by itself.
    pub servers: Vec<String>,
    /// The stream's name, and the first token of its subjects: 1 to 64 bytes of
    /// `[A-Za-z0-9_-]` (NATS refuses `.`, `*`, `>` and whitespace in stream names).
    pub stream: String,
    /// Partitions: `(TenantId, RunId)` -> `p<N>` ([`broker::partition_of`]).
    pub partitions: u16,
    /// Replicas of a stream the relay creates (1 on a single server, 3 on a cluster).
    pub replicas: usize,
    /// How long the stream remembers a `Nats-Msg-Id` to drop a resend as a duplicate (the
    /// server's default, 2 minutes). A resend after it is stored again; the fold absorbs it.
    pub duplicate_window: Duration,
    /// Longest wait for a connection and for the stream's declaration.
    pub connect_timeout: Duration,
    /// Longest wait for a batch's acks, counted from its write: past it each unanswered event
    /// is unconfirmed (perhaps stored: it is sent again with the same `Nats-Msg-Id`).
    pub ack_timeout: Duration,
    /// Acks a publisher holds in flight, at most [`MAX_ACKS_IN_FLIGHT`].
    pub max_in_flight: usize,
    /// How events are written: the contract alone, or with CloudEvents attributes as the NATS
    /// binding's `ce-*` headers ([`WireMode::CloudEvents`]); `CloudEventsColon` is refused.
    pub wire_mode: WireMode,
}

impl NatsConfig {
    /// A configuration with the defaults, checked.
    pub fn new(servers: &str, stream: &str, partitions: u16) -> Result<Self, Error> {
        let config = Self {
            servers: servers
                .split(',')
                .map(|server| server.trim().to_owned())
                .filter(|server| !server.is_empty())
                .collect(),
            stream: stream.to_owned(),
            partitions,
            replicas: 1,
            duplicate_window: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(5),
            ack_timeout: Duration::from_secs(5),
            max_in_flight: 1_024,
            wire_mode: WireMode::Plain,
        };
        config.validate()?;
        Ok(config)
    }

    /// Refuses what would fail later, or be changed silently by the client or the server.
    pub fn validate(&self) -> Result<(), Error> {
        let invalid = |text: String| Err(Error::InvalidConfig(text));
        if self.servers.is_empty() {
            return invalid("no NATS server (a URL looks like nats://host:4222)".into());
        }
        for server in &self.servers {
            if let Err(err) = server.parse::<ServerAddr>() {
                return invalid(format!("NATS server {server:?}: {err}"));
            }
        }
        let token = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
        if self.stream.is_empty() || self.stream.len() > 64 || !self.stream.bytes().all(token) {
            return invalid(format!(
                "NATS stream {:?} must be 1 to 64 bytes of A-Z a-z 0-9 _ -",
                self.stream
            ));
        }
        if self.partitions == 0 {
            return invalid("partitions must be at least 1".into());
        }
        if !(1..=5).contains(&self.replicas) {
            return invalid(format!("stream replicas {} must be 1 to 5", self.replicas));
        }
        if self.max_in_flight == 0 || self.max_in_flight > MAX_ACKS_IN_FLIGHT {
            return invalid(format!(
                "acks in flight {} must be 1 to {MAX_ACKS_IN_FLIGHT}",
                self.max_in_flight
            ));
        }
        if self.ack_timeout.is_zero() || self.connect_timeout.is_zero() {
            return invalid("NATS timeouts must be above zero".into());
        }
        if self.duplicate_window < self.ack_timeout * 2 {
            return invalid(format!(
                "the duplicate window ({:?}) must be at least twice the ack timeout ({:?}): a \
                 resend of an unanswered event must still be recognised",
                self.duplicate_window, self.ack_timeout
            ));
        }
        if self.wire_mode == WireMode::CloudEventsColon {
            return invalid(
                "cloudEvents:* is the AMQP binding's first prefix; on NATS RELAY_CLOUDEVENTS=true \
                 writes the NATS binding's ce-* headers"
                    .into(),
            );
        }
        Ok(())
    }

    /// The subject of a partition: `<stream>.p<N>`.
    pub fn subject(&self, partition: Partition) -> String {
        format!("{}.p{}", self.stream, partition.0)
    }

    /// The subject a run's events go to.
    pub fn subject_of(&self, tenant: &TenantId, run: &RunId) -> String {
        self.subject(broker::partition_of(tenant, run, self.partitions))
    }

    /// The stream's subjects: every partition's (`<stream>.*`).
    pub fn stream_subjects(&self) -> String {
        format!("{}.*", self.stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_configuration_is_one_readable_line() {
        assert!(NatsConfig::new("nats://127.0.0.1:4222", "relay_events-1", 4).is_ok());
        for (servers, stream, partitions, says) in [
            ("", "s", 1, "no NATS server"),
            ("nats://127.0.0.1:4222", "a.b", 1, "must be 1 to 64 bytes"),
            ("nats://127.0.0.1:4222", "a b", 1, "must be 1 to 64 bytes"),
            ("nats://127.0.0.1:4222", "", 1, "must be 1 to 64 bytes"),
            ("nats://127.0.0.1:4222", "s", 0, "partitions"),
        ] {
            let err = NatsConfig::new(servers, stream, partitions).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(says), "{text}");
            assert!(!text.contains('\n'), "{text}");
        }
        let mut config = NatsConfig::new("nats://a:4222, nats://b:4222", "s", 2).unwrap();
        assert_eq!(config.servers, ["nats://a:4222", "nats://b:4222"]);
        assert_eq!(config.subject(Partition(1)), "s.p1");
        assert_eq!(config.stream_subjects(), "s.*");
        config.max_in_flight = 5_000;
        assert!(config.validate().is_err(), "past async-nats's 5,000 acks");
        config.max_in_flight = 64;
        config.duplicate_window = Duration::from_secs(6);
        assert!(
            config.validate().is_err(),
            "a window shorter than two ack timeouts"
        );
        config.duplicate_window = Duration::from_secs(120);
        config.wire_mode = WireMode::CloudEvents;
        config.validate().unwrap();
        config.wire_mode = WireMode::CloudEventsColon;
        assert!(config.validate().is_err(), "the AMQP binding's prefix");
    }
}

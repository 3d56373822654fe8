//! The broker's product and version, from the `server-properties` of its `connection.start`:
//! what differs between RabbitMQ versions is logged at start and tested against both versions
//! this project runs (3.10 and 4.0). lapin 4.12.3 reads that frame and keeps nothing of it
//! (`Channel::on_connection_start_received`), so [`server_version`] opens a connection of its
//! own (TLS as configured), reads the frame and closes the socket before any login.
use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, connection};
use futures_util::{AsyncReadExt, AsyncWriteExt};
use lapin::tcp::AMQPUriTcpExt;
use lapin::types::{AMQPValue, FieldTable};
use lapin::uri::AMQPUri;

use broker::Error;

use crate::rabbit::RabbitConfig;

/// What a broker says it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BrokerVersion {
    /// `product` (`RabbitMQ`), empty if not said.
    pub product: String,
    /// `version` as said (`3.10.8`, `4.0.5`), empty if not said.
    pub version: String,
    /// `cluster_name` as said: by default the name of the node the connection reached
    /// (`rabbit@host`); empty if not said.
    pub cluster_name: String,
    /// `version`'s leading numbers, if it has them.
    numbers: Option<(u32, u32, u32)>,
}

impl BrokerVersion {
    /// From a product and a version text (`4.0.5`, `4.1.0-rc.1`, `3.13`).
    pub fn new(product: &str, version: &str) -> Self {
        let mut parts = version
            .split(|c: char| !c.is_ascii_digit())
            .take_while(|part| !part.is_empty())
            .map(|part| part.parse::<u32>().ok());
        let numbers = match (parts.next(), parts.next(), parts.next()) {
            (Some(Some(major)), Some(Some(minor)), patch) => {
                Some((major, minor, patch.flatten().unwrap_or(0)))
            }
            _ => None,
        };
        Self {
            product: product.to_owned(),
            version: version.to_owned(),
            cluster_name: String::new(),
            numbers,
        }
    }

    /// From `connection.start`'s `server-properties`.
    pub fn from_server_properties(properties: &FieldTable) -> Self {
        let text = |name: &str| match properties.inner().get(name) {
            Some(AMQPValue::LongString(text)) => String::from_utf8_lossy(text.as_bytes()).into(),
            Some(AMQPValue::ShortString(text)) => text.as_str().to_owned(),
            _ => String::new(),
        };
        Self {
            cluster_name: text("cluster_name"),
            ..Self::new(&text("product"), &text("version"))
        }
    }

    /// Whether it is RabbitMQ `major.minor.patch` or later (unknown: false).
    pub fn is_at_least(&self, major: u32, minor: u32, patch: u32) -> bool {
        self.product == "RabbitMQ"
            && self
                .numbers
                .is_some_and(|ours| ours >= (major, minor, patch))
    }

    /// RabbitMQ's default `max_message_size`: 16 MiB since 4.0, 128 MiB before (tested on
    /// 4.0.5 and 3.10.8 by `broker_faults::a_message_too_large_*`); `None` if unknown.
    pub fn default_max_message_size(&self) -> Option<usize> {
        if self.product != "RabbitMQ" || self.numbers.is_none() {
            return None;
        }
        Some(if self.is_at_least(4, 0, 0) {
            16 << 20
        } else {
            128 << 20
        })
    }

    /// What an operator should know of this broker, for the start-up log: one line each
    /// (`streams`: the topology is on streams).
    pub fn notes(&self, streams: bool) -> Vec<&'static str> {
        let mut notes = Vec::new();
        if self.product != "RabbitMQ" || self.numbers.is_none() {
            notes.push("not a RabbitMQ version this relay knows; it behaves as on 4.0");
            return notes;
        }
        if !self.is_at_least(4, 0, 0) {
            notes.push(
                "RabbitMQ before 4.0 is past its end of life; tested here on 3.10.8 and 4.0.5",
            );
            if streams {
                notes.push(
                    "streams: another publisher writing several streams on one channel can \
                     lose confirmed messages when a leader changes (rabbitmq-server#9457); the \
                     relay writes each partition on a channel of its own",
                );
            }
        }
        notes
    }
}

/// What the relay does on streams because of RabbitMQ stream bugs, whatever the broker's
/// version: the releases said to fix them (rabbitmq-server#12236 for #9457, osiris 1.8.5 for
/// osiris#172, both in the 4.0.x line) are not tested here, and neither workaround costs
/// correctness, only connections and idle channels. Logged at start.
pub const STREAM_WORKAROUNDS: &[&str] = &[
    "one publisher shard per stream partition, so a channel writes one stream \
     (rabbitmq-server#9457)",
    "a stream consumer subscribes again to a silent partition \
     (ConsumerConfig::stream_resubscribe, 5 s by default; osiris#172)",
];

impl std::fmt::Display for BrokerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.product.is_empty(), self.version.is_empty()) {
            (true, true) => f.write_str("an unnamed broker"),
            _ => write!(f, "{} {}", self.product, self.version),
        }
    }
}

/// What the broker at the first address of `config` says it is, within the connect timeout.
pub async fn server_version(config: &RabbitConfig) -> Result<BrokerVersion, Error> {
    let limit = config.connect_timeout;
    broker::within("connection.start", limit, read_start(config)).await
}

async fn read_start(config: &RabbitConfig) -> Result<BrokerVersion, Error> {
    read_start_at(config.addresses()[0], config.tls.owned()).await
}

/// What the broker at `address` (one AMQP URI) says it is, read over `tls` when the URI is
/// `amqps`.
pub(crate) async fn read_start_at(
    address: &str,
    tls: lapin::tcp::OwnedTLSConfig,
) -> Result<BrokerVersion, Error> {
    let uri: AMQPUri = address
        .parse()
        .map_err(|why: String| Error::InvalidConfig(format!("not a valid AMQP URI: {why}")))?;
    let unreachable = |err: std::io::Error| Error::Unreachable(err.to_string());
    let runtime = lapin::runtime::default_runtime().map_err(crate::connect::amqp_error)?;
    let mut stream = uri
        .connect_with_config_async(tls.as_ref(), &runtime)
        .await
        .map_err(unreachable)?;
    // The AMQP 0-9-1 protocol header; the broker answers with `connection.start`.
    stream
        .write_all(b"AMQP\x00\x00\x09\x01")
        .await
        .map_err(unreachable)?;
    stream.flush().await.map_err(unreachable)?;
    let mut received = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        match amq_protocol::frame::parsing::parse_frame(received.as_slice()) {
            Ok((
                _,
                AMQPFrame::Method(_, AMQPClass::Connection(connection::AMQPMethod::Start(start))),
            )) => {
                return Ok(BrokerVersion::from_server_properties(
                    &start.server_properties,
                ));
            }
            Ok((_, other)) => {
                return Err(Error::Refused(format!(
                    "the broker did not start with connection.start: {other:?}"
                )));
            }
            Err(err) if err.is_incomplete() => {}
            Err(err) => {
                return Err(Error::Refused(format!(
                    "the broker's first frame does not parse: {err}"
                )));
            }
        }
        if received.len() > 1 << 20 {
            return Err(Error::Refused("connection.start over 1 MiB".into()));
        }
        let read = stream.read(&mut chunk).await.map_err(unreachable)?;
        if read == 0 {
            return Err(Error::Unreachable(
                "the broker closed the connection before connection.start".into(),
            ));
        }
        received.extend_from_slice(&chunk[..read]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_compare() {
        let v310 = BrokerVersion::new("RabbitMQ", "3.10.8");
        let v40 = BrokerVersion::new("RabbitMQ", "4.0.5");
        let rc = BrokerVersion::new("RabbitMQ", "4.1.0-rc.1");
        let short = BrokerVersion::new("RabbitMQ", "3.13");
        let odd = BrokerVersion::new("RabbitMQ", "unknown");
        let other = BrokerVersion::new("SomethingMQ", "9.9.9");
        assert!(v40.is_at_least(4, 0, 0) && v40.is_at_least(4, 0, 5) && !v40.is_at_least(4, 0, 6));
        assert!(!v310.is_at_least(4, 0, 0) && v310.is_at_least(3, 10, 8));
        assert!(rc.is_at_least(4, 1, 0));
        assert!(short.is_at_least(3, 13, 0) && !short.is_at_least(3, 13, 1));
        assert!(!odd.is_at_least(0, 0, 0) && !other.is_at_least(0, 0, 0));
        assert_eq!(v310.default_max_message_size(), Some(128 << 20));
        assert_eq!(v40.default_max_message_size(), Some(16 << 20));
        assert_eq!(odd.default_max_message_size(), None);
        assert!(v40.notes(true).is_empty());
        assert_eq!(v310.notes(true).len(), 2);
        assert_eq!(v310.notes(false).len(), 1);
        assert_eq!(other.notes(false).len(), 1);
        assert_eq!(v40.to_string(), "RabbitMQ 4.0.5");
    }

    #[test]
    fn server_properties_name_the_product_version_and_node() {
        let mut properties = FieldTable::default();
        for (name, value) in [
            ("product", "RabbitMQ"),
            ("version", "4.0.5"),
            ("cluster_name", "rabbit@host"),
        ] {
            properties.insert(name.into(), AMQPValue::LongString(value.into()));
        }
        let said = BrokerVersion::from_server_properties(&properties);
        assert_eq!(
            (said.to_string().as_str(), said.cluster_name.as_str()),
            ("RabbitMQ 4.0.5", "rabbit@host")
        );
        assert!(said.is_at_least(4, 0, 5));
        let unnamed = BrokerVersion::from_server_properties(&FieldTable::default());
        assert_eq!(unnamed.to_string(), "an unnamed broker");
        assert!(unnamed.cluster_name.is_empty());
    }
}

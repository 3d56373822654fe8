//! How to reach RabbitMQ.
use std::time::Duration;

use lapin::ConnectionProperties;

use crate::connect::ClosingConnection;

use broker::Error;

use crate::connect::AmqpTls;
use crate::topology::Topology;

/// How to reach RabbitMQ.
#[derive(Clone, Debug)]
pub struct RabbitConfig {
    /// AMQP URI, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10`; or the URIs of
    /// several nodes of one cluster, separated by commas: a connection goes to the node that
    /// answered last, and to the next one when it fails or when a publisher's session on it
    /// had a batch unconfirmed for `confirm_timeout` (a node cut off from its cluster's
    /// majority takes connections and publishes but confirms nothing). Percent-encode a comma
    /// in a password.
    pub uri: String,
    /// Exchange and partition queues.
    pub topology: Topology,
    /// Longest wait for a connection (TCP, handshake, channel, topology). Default 5 s.
    pub connect_timeout: Duration,
    /// Longest wait for a batch's confirms after its last publish. Default 10 s.
    pub confirm_timeout: Duration,
    /// After the broker returned a message (no queue bound for it: a queue or binding was
    /// deleted), declare the topology again before the next write, so it heals by itself.
    /// Default true.
    pub redeclare_on_return: bool,
    /// Extra TLS trust and a client certificate for `amqps://`. Default none.
    pub tls: AmqpTls,
    /// What the relay writes beside the contract: nothing more, or CloudEvents attributes too.
    /// Default [`broker::WireMode::Plain`].
    pub wire_mode: broker::WireMode,
    /// Which of the addresses in `uri` to try first (the last that answered); shared by the
    /// clones of this configuration.
    next_address: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The topology a publisher's session of this configuration (or a clone) declared, unless a
    /// fault since may mean part of it is gone ([`RabbitConfig::forget_declared`]).
    declared: std::sync::Arc<std::sync::Mutex<Option<Topology>>>,
}

impl RabbitConfig {
    /// A configuration with the default timeouts.
    pub fn new(uri: impl Into<String>, topology: Topology) -> Result<Self, Error> {
        let uri = uri.into();
        if !(uri.starts_with("amqp://") || uri.starts_with("amqps://")) {
            return Err(Error::InvalidConfig(format!(
                "broker URI must start with amqp:// or amqps://, got {:?}",
                uri.split('@').next_back().unwrap_or_default()
            )));
        }
        // Parsed once here, as lapin will parse it at every connect: a URI it cannot read is
        // a configuration error at start (exit 2), not an unreachable broker retried for ever.
        // lapin's message quotes no part of the URI, so no password can leak through it.
        for (index, address) in uri.split(',').enumerate() {
            let address = address.trim();
            if index > 0 && !(address.starts_with("amqp://") || address.starts_with("amqps://")) {
                return Err(Error::InvalidConfig(format!(
                    "broker URI {} must start with amqp:// or amqps://",
                    index + 1
                )));
            }
            if let Err(why) = address.parse::<lapin::uri::AMQPUri>() {
                return Err(Error::InvalidConfig(format!(
                    "not a valid AMQP URI{}: {why}",
                    if index > 0 {
                        format!(" (address {})", index + 1)
                    } else {
                        String::new()
                    }
                )));
            }
        }
        Ok(Self {
            uri,
            topology,
            connect_timeout: Duration::from_secs(5),
            confirm_timeout: Duration::from_secs(10),
            redeclare_on_return: true,
            tls: AmqpTls::default(),
            wire_mode: broker::WireMode::Plain,
            next_address: std::sync::Arc::default(),
            declared: std::sync::Arc::default(),
        })
    }

    /// The broker addresses of `uri`, in the order given.
    pub fn addresses(&self) -> Vec<&str> {
        self.uri.split(',').map(str::trim).collect()
    }

    /// Connects to one of the addresses, each under `connect_timeout`: first to the one that
    /// answered last, then to each next one in turn; the last failure if none answers.
    /// [`RabbitConfig::connect`] with the connection named `name` (as the broker lists it),
    /// its failure as an [`Error`].
    pub(crate) async fn connect_named(&self, name: &str) -> Result<ClosingConnection, Error> {
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        match self.connect(properties).await {
            Ok((connection, _)) => Ok(connection),
            Err(ConnectFailure::Failed(err)) => Err(crate::connect::amqp_error(err)),
            Err(ConnectFailure::TimedOut) => Err(Error::Unreachable(format!(
                "no connection within {} ms",
                self.connect_timeout.as_millis()
            ))),
        }
    }

    /// A connection, and the index of the address that gave it.
    pub(crate) async fn connect(
        &self,
        properties: ConnectionProperties,
    ) -> Result<(ClosingConnection, usize), ConnectFailure> {
        use std::sync::atomic::Ordering;
        let addresses = self.addresses();
        let first = self.next_address.load(Ordering::Relaxed) % addresses.len();
        let mut failure = ConnectFailure::TimedOut;
        for step in 0..addresses.len() {
            let index = (first + step) % addresses.len();
            let attempt = tokio::time::timeout(
                self.connect_timeout,
                crate::connect::connect(addresses[index], &self.tls, properties.clone()),
            )
            .await;
            match attempt {
                Ok(Ok(connection)) => {
                    self.next_address.store(index, Ordering::Relaxed);
                    if step > 0 {
                        tracing::info!(
                            address = index + 1,
                            of = addresses.len(),
                            "connected to another broker address"
                        );
                    }
                    return Ok((connection, index));
                }
                Ok(Err(err)) => failure = ConnectFailure::Failed(err),
                Err(_) => failure = ConnectFailure::TimedOut,
            }
        }
        self.next_address
            .store((first + 1) % addresses.len(), Ordering::Relaxed);
        Err(failure)
    }

    /// The next connection tries the address after `address` first, unless a connection since
    /// moved on already: a session on `address` had a batch unconfirmed for `confirm_timeout`.
    /// A node cut off from its cluster's majority (not yet paused by `pause_minority`, or never
    /// under `ignore`) still takes connections and publishes, and confirms none: without this
    /// every restart connected to it again (the address that answered last).
    pub(crate) fn pass_over(&self, address: usize) {
        use std::sync::atomic::Ordering;
        let next = (address + 1) % self.addresses().len();
        let _ =
            self.next_address
                .compare_exchange(address, next, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Whether a publisher's session already declared this configuration's topology, so a new
    /// one need not. Declaring binds queues, and a binding is a metadata transaction that
    /// waits for every node: while a node is cut off and not yet seen down (`net_ticktime`),
    /// a `queue.bind` through any node waits (10 s of a 10 s cut, measured), and a publisher
    /// restarting then would stall for the whole cut though the queues take publishes.
    pub(crate) fn declared(&self) -> bool {
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            == Some(&self.topology)
    }

    /// Notes that a session declared the topology.
    pub(crate) fn mark_declared(&self) {
        *self
            .declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(self.topology.clone());
    }

    /// The next session declares the topology again: a session failed in a way that may mean
    /// part of it is gone (anything but a confirm's timeout or a failed connect). A deleted
    /// queue also makes the broker return what is routed to it, and the session then declares
    /// again on its own (`redeclare_on_return`).
    pub(crate) fn forget_declared(&self) {
        *self
            .declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }
}

/// Why no address of a [`RabbitConfig`] gave a connection (the last one's failure).
#[derive(Debug)]
pub(crate) enum ConnectFailure {
    /// It answered with an error.
    Failed(lapin::Error),
    /// It did not answer within the connect timeout.
    TimedOut,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn three_nodes() -> RabbitConfig {
        let uri = "amqp://a:5672/%2f,amqp://b:5672/%2f,amqp://c:5672/%2f";
        RabbitConfig::new(uri, Topology::new("t", 2).unwrap()).unwrap()
    }

    #[test]
    fn an_unconfirmed_session_sends_the_next_connection_to_the_next_address() {
        let config = three_nodes();
        let clone = config.clone();
        config.pass_over(0);
        assert_eq!(clone.next_address.load(Ordering::Relaxed), 1);
        // A second publisher of the same node reporting late moves it no further.
        config.pass_over(0);
        assert_eq!(clone.next_address.load(Ordering::Relaxed), 1);
        // Past the last address, back to the first.
        config.pass_over(1);
        config.pass_over(2);
        assert_eq!(clone.next_address.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_declared_topology_is_declared_again_only_after_a_fault_or_for_another_topology() {
        let config = three_nodes();
        let clone = config.clone();
        assert!(!clone.declared());
        config.mark_declared();
        assert!(clone.declared(), "clones share what was declared");
        let mut other = config.clone();
        other.topology = other
            .topology
            .clone()
            .with_group(broker::Group::parse("g").unwrap());
        assert!(
            !other.declared(),
            "another topology is not declared by this one's session"
        );
        clone.forget_declared();
        assert!(!config.declared());
    }

    #[test]
    fn one_address_stays_the_one() {
        let config =
            RabbitConfig::new("amqp://a:5672/%2f", Topology::new("t", 2).unwrap()).unwrap();
        config.pass_over(0);
        assert_eq!(config.next_address.load(Ordering::Relaxed), 0);
    }
}

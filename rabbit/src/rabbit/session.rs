//! Opening a session (connection, channel, topology), and what a broker's refusal means.
use std::time::Duration;

use lapin::{Channel, ConnectionProperties};

use crate::connect::ClosingConnection;

use super::config::{ConnectFailure, RabbitConfig};
use super::flow::within;
use super::within_topology;
use broker::{Error, Preflight};

/// The broker's limit from a size refusal ("message size S is larger than configured max size
/// M", PRECONDITION_FAILED), if `err` is one.
pub(crate) fn size_limit(err: &lapin::Error) -> Option<usize> {
    let text = err.to_string();
    if !text.contains("PRECONDITION_FAILED") || !text.contains("larger than") {
        return None;
    }
    let after = &text[text.rfind("max size ")? + "max size ".len()..];
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Opens a connection named `name` and a channel, and declares the topology, each step under
/// the config's timeouts (TLS as configured). The consumer's sessions start here.
pub async fn open(
    config: &RabbitConfig,
    name: &str,
) -> Result<(ClosingConnection, Channel), Error> {
    open_at(config, name, true)
        .await
        .map(|(connection, channel, _)| (connection, channel))
}

/// [`open`], declaring the topology only if `declare`; with the index of the address the
/// connection went to.
pub(crate) async fn open_at(
    config: &RabbitConfig,
    name: &str,
    declare: bool,
) -> Result<(ClosingConnection, Channel, usize), Error> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let (connection, address) = match config.connect(properties).await {
        Ok(connection) => connection,
        Err(ConnectFailure::Failed(err)) => return Err(refused_or(err, Error::Unreachable)),
        Err(ConnectFailure::TimedOut) => {
            return Err(Error::Unreachable(format!(
                "no connection within {} ms",
                config.connect_timeout.as_millis()
            )));
        }
    };
    let channel = within(
        "channel.open",
        config.connect_timeout,
        connection.create_channel(),
    )
    .await?;
    if !declare {
        return Ok((connection, channel, address));
    }
    // Under the timeout too: a broker that goes silent mid-declare would otherwise hold this
    // publisher forever (it would never fault, so never restart).
    within_topology(&config.topology, &channel, config.connect_timeout)
        .await
        .map_err(|err| match err {
            Error::Channel(err) => match err.downcast::<lapin::Error>() {
                Ok(err) => refused_or(*err, |text| {
                    Error::Unreachable(format!("declaring the topology: {text}"))
                }),
                Err(other) => Error::Channel(other),
            },
            other => other,
        })?;
    Ok((connection, channel, address))
}

/// A refusal by the broker (an AMQP error it sent: access refused, not allowed, precondition
/// failed...) is permanent; anything else (I/O, a reset) is `otherwise`.
pub(crate) fn refused_or(err: lapin::Error, otherwise: impl FnOnce(String) -> Error) -> Error {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Error::Refused(explain(amqp.to_string())),
        lapin::ErrorKind::AuthProviderError(text) => Error::Refused(text.clone()),
        _ => otherwise(err.to_string()),
    }
}

/// A refusal's text, with the way out where the relay knows it: a dead-letter queue declared
/// by a relay before `x-delivery-limit` was set on it ([`crate::topology::DEAD_LETTER_DELIVERY_LIMIT`])
/// cannot be declared again with it, and on RabbitMQ 4 it drops a letter read 20 times.
pub(crate) fn explain(refusal: String) -> String {
    let old_dead_queue = refusal.contains("inequivalent arg 'x-delivery-limit'")
        && refusal.contains("but current is none")
        && refusal
            .split('\'')
            .any(|part| part.ends_with(".dead") && !part.contains(' '));
    if !old_dead_queue {
        return refusal;
    }
    format!(
        "{refusal} (a dead-letter queue declared by an earlier relay, without a delivery limit: \
         on RabbitMQ 4 it drops a letter read 20 times; protect its letters now with \
         `rabbitmqctl set_policy --apply-to quorum_queues relay-dead '\\.dead$' \
         '{{\"delivery-limit\": {limit}}}'`, replay or purge them (`distribution dead`), then \
         delete the empty queue: the relay declares it again, with the limit)",
        limit = crate::topology::DEAD_LETTER_DELIVERY_LIMIT
    )
}

/// A refusal while running (credentials revoked, vhost or queue changed under the relay): no
/// retry fixes it, so it is counted every time and logged at ERROR at most every 30 s (every
/// publisher retries it with backoff).
pub(crate) fn refused_at_run_time(why: &str) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    metrics::counter!("relay_broker_refusals_total").increment(1);
    let mut last = LAST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
        *last = Some(std::time::Instant::now());
        tracing::error!(
            reason = why,
            "the broker refuses the relay (credentials, vhost or topology); nothing ships until an operator fixes it"
        );
    }
}

/// Connects once and declares the topology: `Err(Error::Refused)` when the broker refuses
/// (credentials, vhost, a reserved or conflicting topology), which no retry will fix.
pub async fn preflight(config: &RabbitConfig) -> Result<Preflight, Error> {
    match open(config, "outbox-relay-preflight").await {
        Ok((connection, _channel)) => {
            let closing = connection.close(200, "preflight done".into());
            let _ = tokio::time::timeout(config.connect_timeout, closing).await;
            Ok(Preflight::Ready)
        }
        Err(Error::Refused(why)) => Err(Error::Refused(why)),
        Err(Error::InvalidConfig(why)) => Err(Error::InvalidConfig(why)),
        Err(other) => Ok(Preflight::Unreachable(other.to_string())),
    }
}

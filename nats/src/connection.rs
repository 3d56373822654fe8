//! Connections to NATS: the first server that answers, a JetStream context sized by the
//! configuration, and the flag that says the connection lost its server.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, Context};
use async_nats::{Client, ConnectOptions, Event, ServerAddr};
use broker::Error;
use tokio::sync::watch;

use crate::config::NatsConfig;

/// Connects to the first server that answers, under the connect timeout, and opens a JetStream
/// context whose acks in flight and timeouts are the configuration's.
pub async fn connect(config: &NatsConfig) -> Result<(Client, Context), Error> {
    let (client, context, _lost) = open(config).await?;
    Ok((client, context))
}

/// [`connect`], and a flag that turns true when the connection loses its server.
///
/// A client that loses its server reconnects by itself and then writes what was queued
/// meanwhile, while what was on the wire when the connection broke is gone: a later event of a
/// branch would be stored before an earlier one the relay sends again. So the relay never
/// writes on a connection that lost its server (the flag), and the client holds its reconnect
/// back for half the stream's duplicate window: by then the relay has sent everything again on
/// a connection of its own, and what the old one still writes is dropped as a duplicate.
pub(crate) async fn open(
    config: &NatsConfig,
) -> Result<(Client, Context, watch::Receiver<bool>), Error> {
    let servers = config
        .servers
        .iter()
        .map(|server| {
            server
                .parse::<ServerAddr>()
                .map_err(|err| Error::InvalidConfig(format!("NATS server {server:?}: {err}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (lost_tx, lost) = watch::channel(false);
    let connected = Arc::new(AtomicBool::new(false));
    let hold = config.duplicate_window / 2;
    let options = ConnectOptions::new()
        .name("outbox-relay")
        .connection_timeout(config.connect_timeout)
        .max_reconnects(servers.len())
        .reconnect_delay_callback({
            let connected = connected.clone();
            move |_attempt| {
                if connected.load(Ordering::Acquire) {
                    hold
                } else {
                    Duration::ZERO
                }
            }
        })
        .event_callback(move |event| {
            if matches!(event, Event::Disconnected) {
                let _ = lost_tx.send(true);
            }
            std::future::ready(())
        });
    let client = broker::within("connecting to NATS", config.connect_timeout, async {
        (options.connect(servers).await).map_err(|err| Error::Unreachable(format!("NATS: {err}")))
    })
    .await?;
    let context = jetstream::ContextBuilder::new()
        .timeout(config.ack_timeout)
        .ack_timeout(config.ack_timeout)
        .max_ack_inflight(config.max_in_flight)
        .backpressure_on_inflight(true)
        .build(client.clone());
    connected.store(true, Ordering::Release);
    Ok((client, context, lost))
}

/// Publishes one message and waits, under `limit`, until the stream says it is stored (not a
/// copy still in flight at the stream's leader, [`crate::attribute::ack_stored`]). `what`
/// names the operation in its errors. For the tools' single writes (dead letters, replays),
/// never the relay's pipelined publishes.
pub(crate) async fn publish_stored(
    context: &Context,
    subject: String,
    headers: async_nats::HeaderMap,
    payload: bytes::Bytes,
    what: &'static str,
    limit: Duration,
) -> Result<(), Error> {
    let unreachable = |err: &dyn std::fmt::Display| Error::Unreachable(format!("{what}: {err}"));
    let work = async {
        let ack = context
            .publish_with_headers(subject, headers, payload)
            .await
            .map_err(|err| unreachable(&err))?;
        ack.await.map_err(|err| unreachable(&err))
    };
    match broker::within(what, limit, work).await? {
        ack if crate::attribute::ack_stored(&ack) => Ok(()),
        _ => Err(unreachable(
            &"a copy is in flight at the stream's leader, not stored yet",
        )),
    }
}

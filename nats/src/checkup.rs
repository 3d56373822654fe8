//! What an operator's console asks of NATS: the server's version, what it means for
//! durability, and what the relay's stream holds. Declares nothing.
use async_nats::jetstream::context::GetStreamErrorKind;
use broker::Error;

use crate::config::NatsConfig;

/// What [`checkup`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsCheckup {
    /// The server's version, as it said when the connection opened.
    pub version: String,
    /// Messages the relay's stream holds; `None` while there is no such stream (no relay or
    /// consumer declared it yet).
    pub stream_messages: Option<u64>,
    /// What the version means for an acked event's durability ([`crate::publisher::durability_note`]),
    /// for the stream's own replicas (the configuration's while there is no stream).
    pub durability: Option<String>,
}

/// Connects to `config`'s servers and reads the version and the stream's state, each step
/// within `config.connect_timeout`.
pub async fn checkup(config: &NatsConfig) -> Result<NatsCheckup, Error> {
    let (client, context) = crate::connection::connect(config).await?;
    let version = client.server_info().version;
    let limit = config.connect_timeout;
    let read = async {
        match context.get_stream(&config.stream).await {
            Ok(mut stream) => stream
                .info()
                .await
                .map(|info| Some((info.state.messages, info.config.num_replicas)))
                .map_err(|err| {
                    Error::Unreachable(format!("reading NATS stream {}: {err}", config.stream))
                }),
            Err(err) => match err.kind() {
                GetStreamErrorKind::JetStream(js)
                    if js.error_code().0 == crate::stream::STREAM_NOT_FOUND =>
                {
                    Ok(None)
                }
                _ => Err(Error::Unreachable(format!(
                    "reading NATS stream {}: {err}",
                    config.stream
                ))),
            },
        }
    };
    let stream = broker::within("reading the NATS stream", limit, read).await?;
    let replicas = stream.map_or(config.replicas, |(_, replicas)| replicas);
    Ok(NatsCheckup {
        durability: crate::publisher::durability_note(&version, replicas),
        version,
        stream_messages: stream.map(|(messages, _)| messages),
    })
}

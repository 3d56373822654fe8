//! The stream: created when missing, and read back either way, since `get_or_create_stream`
//! never compares an existing stream's settings and a server may drop a field it does not know.
use async_nats::jetstream::Context;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::{Config, RetentionPolicy, StorageType};
use broker::Error;

use crate::config::NatsConfig;

/// JetStream's "stream not found" (`JSStreamNotFoundErr`).
pub(crate) const STREAM_NOT_FOUND: u64 = 10059;

/// Makes sure the stream exists as the relay needs it, under the connect timeout: created with
/// `config`'s settings if missing, and refused with a readable line if it exists otherwise.
pub async fn declare(context: &Context, config: &NatsConfig) -> Result<(), Error> {
    let timeout = config.connect_timeout;
    let work = async {
        let found = match context.get_stream(&config.stream).await {
            Ok(stream) => stream.cached_info().config.clone(),
            Err(err) => match err.kind() {
                GetStreamErrorKind::JetStream(js) if js.error_code().0 == STREAM_NOT_FOUND => {
                    let created = context.create_stream(wanted(config)).await.map_err(|err| {
                        Error::Refused(format!("creating NATS stream {}: {err}", config.stream))
                    })?;
                    created.cached_info().config.clone()
                }
                _ => {
                    return Err(Error::Unreachable(format!(
                        "reading NATS stream {}: {err}",
                        config.stream
                    )));
                }
            },
        };
        check(&found, config)
    };
    broker::within("declaring the NATS stream", timeout, work).await
}

/// Deletes the stream and its dead-letter stream (`<stream>_dead`) with what they hold, under
/// the connect timeout; one already gone is skipped. For tools that made a stream of their own
/// (`distribution demo`), never the relay.
pub async fn remove(config: &NatsConfig) -> Result<(), Error> {
    let (_client, context) = crate::connection::connect(config).await?;
    for name in [
        config.stream.clone(),
        crate::stream::dead_letter_stream(&config.stream),
    ] {
        let deleted = tokio::time::timeout(config.connect_timeout, context.delete_stream(&name))
            .await
            .map_err(|_| Error::timed_out("deleting a NATS stream", config.connect_timeout))?;
        if let Err(err) = deleted
            && !matches!(err.kind(), async_nats::jetstream::context::DeleteStreamErrorKind::JetStream(js) if js.error_code().0 == STREAM_NOT_FOUND)
        {
            return Err(Error::Unreachable(format!(
                "deleting NATS stream {name}: {err}"
            )));
        }
    }
    Ok(())
}

/// The stream the relay creates.
fn wanted(config: &NatsConfig) -> Config {
    Config {
        name: config.stream.clone(),
        subjects: vec![config.stream_subjects()],
        duplicate_window: config.duplicate_window,
        num_replicas: config.replicas,
        storage: StorageType::File,
        retention: RetentionPolicy::Limits,
        ..Config::default()
    }
}

/// Whether a stream, as the server reads it back, is one the relay can promise on: it holds
/// every partition's subject, keeps messages until its limits (not until a consumer acks
/// them), on disk, and remembers ids at least as long as asked.
fn check(found: &Config, config: &NatsConfig) -> Result<(), Error> {
    let name = &config.stream;
    let subjects = config.stream_subjects();
    let covers = found
        .subjects
        .iter()
        .any(|subject| *subject == subjects || *subject == format!("{name}.>"));
    let refuse = |what: String| {
        Err(Error::Refused(format!(
            "NATS stream {name} {what}; delete it (or name another stream) and the relay \
             creates it as it needs"
        )))
    };
    if !covers {
        return refuse(format!(
            "has subjects {:?}, not {subjects:?}",
            found.subjects
        ));
    }
    if found.retention != RetentionPolicy::Limits {
        return refuse(format!(
            "has retention {:?}: messages must stay until the stream's limits, not go with \
             an ack",
            found.retention
        ));
    }
    if found.storage != StorageType::File {
        return refuse("keeps messages in memory: a server restart would lose them".into());
    }
    if found.duplicate_window < config.duplicate_window {
        return refuse(format!(
            "remembers message ids for {:?}, less than the {:?} asked (a resend after it \
             is stored twice)",
            found.duplicate_window, config.duplicate_window
        ));
    }
    Ok(())
}

/// The stream a consumer's dead letters are kept in: `<stream>_dead`, subjects
/// `<stream>_dead.<group>`.
pub fn dead_letter_stream(stream: &str) -> String {
    format!("{stream}_dead")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_stream_read_back_otherwise_is_refused_with_what_differs() {
        let config = NatsConfig::new("nats://127.0.0.1:4222", "events", 4).unwrap();
        assert!(check(&wanted(&config), &config).is_ok());
        let wider = Config {
            subjects: vec!["events.>".into()],
            ..wanted(&config)
        };
        assert!(check(&wider, &config).is_ok());
        for (found, says) in [
            (
                Config {
                    subjects: vec!["other.*".into()],
                    ..wanted(&config)
                },
                "has subjects",
            ),
            (
                Config {
                    retention: RetentionPolicy::WorkQueue,
                    ..wanted(&config)
                },
                "retention",
            ),
            (
                Config {
                    storage: StorageType::Memory,
                    ..wanted(&config)
                },
                "in memory",
            ),
            (
                Config {
                    duplicate_window: Duration::from_secs(10),
                    ..wanted(&config)
                },
                "remembers message ids",
            ),
        ] {
            let text = check(&found, &config).unwrap_err().to_string();
            assert!(text.contains(says) && text.contains("events"), "{text}");
        }
    }
}

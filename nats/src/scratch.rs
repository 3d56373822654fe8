//! Test streams (feature `fixtures`, never used by the relay): named by [`unique_stream`] and
//! deleted when the test process exits, passed or failed, with those a dead run left behind.
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::TryStreamExt;

/// A stream name no other test of any run uses (`relay_test_<label>_<pid>_<n>_<micros>`); a
/// stream so named is deleted at this process's exit if its test does not delete it.
pub fn unique_stream(label: &str) -> String {
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if !REGISTERED.swap(true, Ordering::SeqCst) {
        store::scratch::at_exit(delete_at_exit);
    }
    store::scratch::unique(&format!("relay_test_{label}"))
}

extern "C" fn delete_at_exit() {
    let Ok(url) = std::env::var("NATS_URL") else {
        return;
    };
    let _ = store::scratch::finish_on_own_thread(Duration::from_secs(20), move || async move {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_micros());
        let pid = std::process::id();
        let client = async_nats::connect(url).await.ok()?;
        let context = async_nats::jetstream::new(client);
        let names: Vec<String> = context.stream_names().try_collect().await.ok()?;
        for name in names {
            let base = name.strip_suffix("_dead").unwrap_or(&name);
            if base.starts_with("relay_test_") && store::scratch::is_ours(base, pid, now) {
                let _ = context.delete_stream(&name).await;
            }
        }
        Some(())
    });
}

/// Every message of `stream` on the server at `url`, in stream order, with its subject and
/// what it decodes to (none if the stream does not exist): what a test reads back.
pub async fn read_stream(
    url: &str,
    stream: &str,
) -> Vec<(String, Result<store::OutboxEvent, broker::WireError>)> {
    read_raw(url, stream)
        .await
        .into_iter()
        .map(|message| {
            let event = crate::wire::decode(&message.headers, &message.payload);
            (message.subject.to_string(), event)
        })
        .collect()
}

/// Every message of `stream` on the server at `url`, in stream order: what it decodes to and
/// when the server stored it (a copy stored again after the duplicate window is a second
/// message, later by at least the window).
pub async fn read_stream_stored_at(
    url: &str,
    stream: &str,
) -> Vec<(
    Result<store::OutboxEvent, broker::WireError>,
    std::time::SystemTime,
)> {
    read_raw(url, stream)
        .await
        .into_iter()
        .map(|message| {
            let event = crate::wire::decode(&message.headers, &message.payload);
            (event, std::time::SystemTime::from(message.time))
        })
        .collect()
}

/// Every header of every message of `stream`, in stream order, as (name, value) pairs in the
/// order the server keeps them: what a test of the wire reads, in no client's types.
pub async fn read_headers(url: &str, stream: &str) -> Vec<Vec<(String, String)>> {
    read_raw(url, stream)
        .await
        .into_iter()
        .map(|message| {
            message
                .headers
                .iter()
                .flat_map(|(name, values)| {
                    values
                        .iter()
                        .map(move |value| (name.to_string(), value.as_str().to_owned()))
                })
                .collect()
        })
        .collect()
}

async fn read_raw(url: &str, stream: &str) -> Vec<async_nats::jetstream::message::StreamMessage> {
    let client = async_nats::connect(url).await.expect("NATS answers");
    let context = async_nats::jetstream::new(client);
    let Ok(mut stream) = context.get_stream(stream).await else {
        return Vec::new();
    };
    let last = stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let mut messages = Vec::new();
    for sequence in 1..=last {
        // A cluster that just healed answers "temporarily unavailable" (10008) for a moment.
        let mut tries = 0;
        let message = loop {
            match stream.get_raw_message(sequence).await {
                Ok(message) => break message,
                Err(err) if tries < 100 => {
                    tries += 1;
                    tracing::debug!(sequence, %err, "reading a stored message again");
                    // Polling pace, not synchronisation.
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(err) => panic!("stored message {sequence}: {err}"),
            }
        };
        messages.push(message);
    }
    messages
}

/// Deletes `stream` and its dead-letter stream from the server at `url`, if they are there.
pub async fn delete_stream(url: &str, stream: &str) {
    if let Ok(client) = async_nats::connect(url).await {
        let context = async_nats::jetstream::new(client);
        let _ = context.delete_stream(stream).await;
        let _ = context
            .delete_stream(crate::stream::dead_letter_stream(stream))
            .await;
    }
}

//! lapin logs every returned message at WARN with its payload, on its own I/O thread; the
//! relay's connections keep that line from every subscriber, whatever its filter.
use std::io::Write;
use std::sync::{Arc, Mutex};

use broker::{Outcome, Partition, Publisher};

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use rabbit::{RabbitConfig, RabbitPublisher, Topology};
use store::OutboxEvent;

/// Everything every subscriber of the process was given, as text.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_returned_payload_never_reaches_a_log() {
    let captured = Captured::default();
    let writer = captured.clone();
    // The most permissive host: everything, at every level, from every crate.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .init();

    let topology = Topology::new(&rabbit::scratch::unique("relay-test-quiet"), 1).unwrap();
    let url = std::env::var("AMQP_URL").expect("AMQP_URL");
    let mut config = RabbitConfig::new(url.clone(), topology.clone()).unwrap();
    config.redeclare_on_return = false;
    let mut publisher = RabbitPublisher::new(config);
    let branch = testkit::branch("quiet", "r", "b");
    let event = |lsn: u64, payload: &str| -> OutboxEvent {
        testkit::intent(&branch, lsn).payload(payload).build()
    };
    assert_eq!(
        publisher.publish(&[event(1, "warm-up")]).await.accepted(),
        1
    );
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(topology.queue(Partition(0)), QueueDeleteOptions::default())
        .await
        .unwrap();

    let secret = "SECRET-CARD-4111111111111111";
    let report = publisher.publish(&[event(2, secret)]).await;
    assert_eq!(report.outcomes, vec![Outcome::Returned]);
    drop(publisher);
    let _ = channel
        .exchange_delete(
            topology.exchange().clone(),
            ExchangeDeleteOptions::default(),
        )
        .await;
    let _ = channel
        .queue_delete(topology.dead_letter_queue(), QueueDeleteOptions::default())
        .await;

    let text = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
    // The subscriber does hear lapin's I/O thread (so the check below is not vacuous)...
    assert!(
        text.contains("lapin-io-loop") || text.contains("lapin::"),
        "no lapin lines at all"
    );
    // ...but never the returned payload, in any form.
    let as_bytes = format!("{:?}", secret.as_bytes());
    let as_bytes = &as_bytes[1..as_bytes.len() - 1];
    assert!(!text.contains(secret), "the payload was logged");
    if let Some(at) = text.find(as_bytes) {
        let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[at..].find('\n').map_or(text.len(), |i| at + i);
        panic!(
            "the payload was logged as bytes: {}",
            &text[line_start..line_end.min(line_start + 600)]
        );
    }
    assert!(
        !text.contains("Server returned us a message"),
        "lapin's return line was logged"
    );
}

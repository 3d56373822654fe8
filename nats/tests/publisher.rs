//! The NATS adapter against the machine's NATS server (JetStream, `NATS_URL`): what the relay
//! publishes is stored once, in order per subject, and reads back as written; every refusal is
//! named; nothing is written under a closed fence. Each test has a stream of its own, deleted
//! at the end (and at the process's exit if the test fails).
use std::time::{Duration, Instant};

use async_nats::jetstream;
use broker::{Outcome, Publisher, report_future};
use nats::{NatsConfig, NatsPublisher};
use store::{Bucket, Lease, LeaseEpoch, OutboxEvent, RelayId};

fn config(label: &str, partitions: u16) -> NatsConfig {
    let stream = nats::scratch::unique_stream(label);
    NatsConfig::new(&testkit::nats_url(), &stream, partitions).unwrap()
}

/// Events of three branches of two runs, interleaved, ascending per branch.
fn interleaved(n: u64) -> Vec<OutboxEvent> {
    let branches = [
        testkit::branch("acme", "run-1", "main"),
        testkit::branch("acme", "run-1", "retry-1"),
        testkit::branch("globex", "run-9", "main"),
    ];
    (1..=n)
        .flat_map(|lsn| {
            branches.iter().map(move |branch| {
                testkit::intent(branch, lsn)
                    .prev(lsn - 1)
                    .payload(format!("{branch}/{lsn}").into_bytes())
                    .build()
            })
        })
        .map(|mut event| {
            // The wire carries microseconds.
            event.created_at =
                chrono::DateTime::from_timestamp_micros(event.created_at.timestamp_micros())
                    .unwrap();
            event
        })
        .collect()
}

async fn context() -> jetstream::Context {
    jetstream::new(async_nats::connect(testkit::nats_url()).await.unwrap())
}

/// Every message of `stream`, in stream order, decoded, with its subject.
async fn stored(stream: &str) -> Vec<(String, OutboxEvent)> {
    nats::scratch::read_stream(&testkit::nats_url(), stream)
        .await
        .into_iter()
        .map(|(subject, event)| (subject, event.unwrap()))
        .collect()
}

async fn delete(stream: &str) {
    nats::scratch::delete_stream(&testkit::nats_url(), stream).await;
}

#[tokio::test]
async fn a_batch_is_stored_once_in_order_and_reads_back_as_written() {
    let config = config("batch", 4);
    let mut publisher = NatsPublisher::new(config.clone());
    let events = interleaved(40);
    let report = publisher.publish(&events).await;
    assert!(report.fault.is_none(), "{:?}", report.fault);
    assert_eq!(report.accepted(), events.len());

    let messages = stored(&config.stream).await;
    let read: Vec<OutboxEvent> = messages.iter().map(|(_, event)| event.clone()).collect();
    assert_eq!(read, events, "in the order written, each as written");
    for (subject, event) in &messages {
        let branch = &event.key.branch;
        assert_eq!(*subject, config.subject_of(&branch.tenant, &branch.run));
    }

    // Sent again (a resend after an unknown fate): accepted, and not stored again.
    let report = publisher.publish(&events).await;
    assert_eq!(report.accepted(), events.len());
    assert_eq!(stored(&config.stream).await.len(), events.len());
    delete(&config.stream).await;
}

#[tokio::test]
async fn a_closed_fence_writes_nothing_and_is_no_fault() {
    let config = config("fence", 2);
    let mut publisher = NatsPublisher::new(config.clone());
    let lease = Lease::new(
        Bucket(1),
        RelayId::generate(),
        LeaseEpoch(1),
        Instant::now() + Duration::from_secs(60),
    );
    let fence = lease.fence();
    let events = interleaved(3);
    let (done, report) = report_future(events.len());
    publisher.send(&events[..3], &fence, done).await;
    assert_eq!(report.await.accepted(), 3, "open: written");
    lease.revoke();
    let (done, report) = report_future(events.len() - 3);
    publisher.send(&events[3..], &fence, done).await;
    let report = report.await;
    assert!(report.fault.is_none());
    assert!(report.outcomes.iter().all(|o| *o == Outcome::NotSent));
    assert_eq!(stored(&config.stream).await.len(), 3);
    delete(&config.stream).await;
}

/// Refusals name their cause, and the rest of the batch is written.
#[tokio::test]
async fn what_cannot_be_stored_is_refused_by_cause_and_the_rest_is_stored() {
    let config = config("refused", 1);
    let mut publisher = NatsPublisher::new(config.clone());
    let branch = testkit::branch("acme", "run-1", "main");
    let other = testkit::branch("acme", "run-1", "other");
    let mut line_break = testkit::intent(&other, 1).build();
    line_break.meta.headers = [("note".to_owned(), "two\nlines".to_owned())].into();
    let events = vec![
        testkit::intent(&branch, 1).build(),
        // Over the server's max_payload (1 MiB): refused by the client before writing.
        testkit::intent(&branch, 2)
            .prev(1)
            .payload(vec![7; 1_100_000])
            .build(),
        line_break,
        testkit::intent(&branch, 3).prev(2).build(),
    ];
    let report = publisher.publish(&events).await;
    assert!(report.fault.is_none(), "{:?}", report.fault);
    assert_eq!(
        report.outcomes,
        [
            Outcome::Accepted,
            Outcome::TooLarge,
            Outcome::Unwritable,
            Outcome::Accepted
        ]
    );
    let lsns: Vec<u64> = stored(&config.stream)
        .await
        .iter()
        .map(|(_, event)| event.key.lsn.get())
        .collect();
    assert_eq!(lsns, [1, 3]);
    delete(&config.stream).await;
}

/// A stream deleted under a running publisher: the next batch finds no stream (not stored,
/// the session faults), and the session after it creates the stream again.
#[tokio::test]
async fn a_deleted_stream_faults_the_session_and_the_next_one_creates_it() {
    let config = config("deleted", 2);
    let mut publisher = NatsPublisher::new(config.clone());
    let events = interleaved(2);
    assert_eq!(publisher.publish(&events[..2]).await.accepted(), 2);
    context().await.delete_stream(&config.stream).await.unwrap();
    let report = publisher.publish(&events[2..4]).await;
    assert!(report.fault.is_some());
    assert_eq!(report.accepted(), 0);
    assert!(
        report.outcomes.iter().all(|o| *o == Outcome::NotSent),
        "{:?}",
        report.outcomes
    );
    let report = publisher.publish(&events[2..4]).await;
    assert!(report.fault.is_none(), "{:?}", report.fault);
    assert_eq!(report.accepted(), 2);
    assert_eq!(stored(&config.stream).await.len(), 2);
    delete(&config.stream).await;
}

/// A stream that exists with settings the relay cannot promise on is refused by name; a wider
/// subject filter is fine.
#[tokio::test]
async fn an_existing_stream_of_other_settings_is_refused_with_what_differs() {
    let config = config("settings", 2);
    context()
        .await
        .create_stream(jetstream::stream::Config {
            name: config.stream.clone(),
            subjects: vec![config.stream_subjects()],
            storage: jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .unwrap();
    let report = NatsPublisher::new(config.clone())
        .publish(&interleaved(1))
        .await;
    let fault = report.fault.expect("refused").to_string();
    assert!(
        fault.contains("in memory") && fault.contains(&config.stream),
        "{fault}"
    );
    assert!(stored(&config.stream).await.is_empty());
    delete(&config.stream).await;
}

/// No server: every event not sent, a fault, within the connect timeout.
#[tokio::test]
async fn a_server_that_is_not_there_is_a_fault_within_the_connect_timeout() {
    let mut config = config("absent", 1);
    config.servers = vec![format!("nats://{}", testkit::free_addr())];
    config.connect_timeout = Duration::from_secs(2);
    let started = Instant::now();
    let report = NatsPublisher::new(config).publish(&interleaved(1)).await;
    assert!(report.fault.is_some());
    assert!(report.outcomes.iter().all(|o| *o == Outcome::NotSent));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
}

/// The stream's own limits, read from the server's answers: a message over its
/// `max_msg_size` is too large (its branch parks), a stream full with `discard: new` has no
/// room (its branch waits and is retried, never parked), and the session stays up for the rest.
#[tokio::test]
async fn the_streams_limits_refuse_by_cause() {
    let config = config("limits", 1);
    context()
        .await
        .create_stream(jetstream::stream::Config {
            name: config.stream.clone(),
            subjects: vec![config.stream_subjects()],
            max_message_size: 512,
            max_messages: 3,
            discard: jetstream::stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut publisher = NatsPublisher::new(config.clone());
    let branch = testkit::branch("acme", "run-1", "main");
    let events: Vec<OutboxEvent> = (1..=5)
        .map(|lsn| {
            let payload = if lsn == 2 { vec![1; 2_000] } else { vec![0; 8] };
            testkit::intent(&branch, lsn)
                .prev(lsn - 1)
                .payload(payload)
                .build()
        })
        .collect();
    let report = publisher.publish(&events).await;
    assert!(report.fault.is_none(), "{:?}", report.fault);
    assert_eq!(
        report.outcomes,
        [
            Outcome::Accepted,
            Outcome::TooLarge,
            Outcome::Accepted,
            Outcome::Accepted,
            Outcome::NoRoom,
        ]
    );
    delete(&config.stream).await;
}

//! The RabbitMQ publisher on the real broker, each test on its own names.
use std::time::Duration;

use broker::{Outcome, Partition, Publisher};

use futures_util::StreamExt;
use lapin::options::{BasicGetOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};
use rabbit::{QueueType, RabbitConfig, RabbitPublisher, Topology};
use store::{Fence, OutboxEvent, RunId, TenantId};

mod support;
use support::*;

/// Everything in a partition queue right now, decoded.
async fn drain_queue(topology: &Topology, partition: Partition) -> Vec<OutboxEvent> {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut got = Vec::new();
    let options = BasicGetOptions { no_ack: true };
    while let Some(message) = channel
        .basic_get(topology.queue(partition), options)
        .await
        .unwrap()
    {
        got.push(rabbit::decode(&message.delivery.properties, &message.delivery.data).unwrap());
    }
    got
}

/// Accepted events are confirmed, routed to their run's partition, in order, body unchanged.
#[tokio::test]
async fn accepted_events_are_confirmed_and_routed_by_run() {
    let topology = unique_topology("accept", 4);
    let mut publisher =
        RabbitPublisher::new(RabbitConfig::new(amqp_url(), topology.clone()).unwrap());
    let mut batch = events("ta", "r1", "main", &[1, 2, 3]);
    batch.extend(events("ta", "r2", "main", &[5, 9]));
    batch.extend(events("tb", "r1", "alt", &[7]));
    let report = publisher.publish(&batch).await;
    assert!(report.fault.is_none(), "{:?}", report.fault);
    assert_eq!(report.outcomes, vec![Outcome::Accepted; batch.len()]);

    let mut received = Vec::new();
    for index in 0..topology.partitions() {
        let partition = Partition(index);
        for event in drain_queue(&topology, partition).await {
            let branch = &event.key.branch;
            assert_eq!(
                topology.partition_of(&branch.tenant, &branch.run),
                partition
            );
            received.push(event);
        }
    }
    received.sort_by(|a, b| a.key.cmp(&b.key));
    let mut expected = batch.clone();
    expected.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(received.len(), expected.len());
    for (got, want) in received.iter().zip(&expected) {
        assert_eq!(
            (&got.key, got.prev_lsn, &got.payload),
            (&want.key, want.prev_lsn, &want.payload)
        );
    }
    cleanup(&topology).await;
}

/// Each queue gets its events in the batches' order, every one of them (300 events of 3
/// branches interleaved, two partitions, three batches on one channel). It failed when a
/// trial publisher polled a batch's writes in reverse.
#[tokio::test]
async fn a_batch_reaches_each_queue_in_its_order() {
    let topology = unique_topology("order", 2);
    let mut publisher =
        RabbitPublisher::new(RabbitConfig::new(amqp_url(), topology.clone()).unwrap());
    let branches = [("ta", "r1"), ("ta", "r2"), ("tb", "r3")];
    let mut sent = Vec::new();
    for round in 0..3u64 {
        let mut batch = Vec::new();
        for lsn in round * 100 + 1..=round * 100 + 100 {
            let (tenant, run) = branches[(lsn % 3) as usize];
            batch.extend(events(tenant, run, "main", &[lsn]));
        }
        let report = publisher.publish(&batch).await;
        assert!(report.fault.is_none(), "{:?}", report.fault);
        assert_eq!(report.outcomes, vec![Outcome::Accepted; batch.len()]);
        sent.extend(batch);
    }
    let mut received = 0;
    for index in 0..topology.partitions() {
        let partition = Partition(index);
        let got: Vec<String> = drain_queue(&topology, partition)
            .await
            .iter()
            .map(|event| event.key.to_string())
            .collect();
        let want: Vec<String> = sent
            .iter()
            .filter(|event| {
                let branch = &event.key.branch;
                topology.partition_of(&branch.tenant, &branch.run) == partition
            })
            .map(|event| event.key.to_string())
            .collect();
        assert_eq!(got, want, "partition {index} in the order sent");
        received += got.len();
    }
    assert_eq!(received, sent.len());
    cleanup(&topology).await;
}

/// A broker that refuses, or accepts TCP and never speaks, yields an error in bounded time:
/// never a hang, never a panic, nothing reported accepted.
#[tokio::test]
async fn unreachable_broker_is_an_error_not_a_hang() {
    let topology = unique_topology("down", 1);
    // Refused: a port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut config = RabbitConfig::new(
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
        topology.clone(),
    )
    .unwrap();
    config.connect_timeout = Duration::from_millis(500);
    let mut publisher = RabbitPublisher::new(config.clone());
    let batch = events("ta", "r1", "main", &[1, 2]);
    let report = tokio::time::timeout(Duration::from_secs(10), publisher.publish(&batch))
        .await
        .unwrap();
    assert!(report.fault.is_some());
    assert_eq!(report.outcomes, vec![Outcome::NotSent; 2]);

    // Black hole: accepts the TCP connection, never answers the AMQP handshake.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    config.uri = format!("amqp://guest:guest@{}/%2f", silent.local_addr().unwrap());
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let mut publisher = RabbitPublisher::new(config);
    let report = tokio::time::timeout(Duration::from_secs(10), publisher.publish(&batch))
        .await
        .unwrap();
    assert!(
        report
            .fault
            .as_ref()
            .is_some_and(|fault| fault.is_transient())
    );
    assert_eq!(report.accepted(), 0);
    hold.abort();
    assert!(
        RabbitConfig::new("http://nope", topology).is_err(),
        "a bad URI fails fast"
    );
}

/// A mandatory publish that nothing routes comes back as an ack *with* a returned message:
/// it must not be reported accepted.
#[tokio::test]
async fn unroutable_events_are_not_reported_accepted() {
    let topology = unique_topology("unroutable", 2);
    let mut config = RabbitConfig::new(amqp_url(), topology.clone()).unwrap();
    config.redeclare_on_return = false; // keep the queue deleted
    let mut publisher = RabbitPublisher::new(config);
    // First publish declares the topology; then the test removes partition 0's queue.
    let warmup = events("ta", "r1", "main", &[1]);
    assert_eq!(publisher.publish(&warmup).await.accepted(), 1);
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(topology.queue(Partition(0)), QueueDeleteOptions::default())
        .await
        .unwrap();

    let mut batch = Vec::new();
    for run in 0..16 {
        batch.extend(events("ta", &format!("run{run}"), "main", &[1]));
    }
    let expected: Vec<Outcome> = batch
        .iter()
        .map(|event| {
            let partition = topology.partition_of(&event.key.branch.tenant, &event.key.branch.run);
            if partition == Partition(0) {
                Outcome::Returned
            } else {
                Outcome::Accepted
            }
        })
        .collect();
    assert!(
        expected.contains(&Outcome::Returned),
        "the test must route some runs to the deleted queue"
    );

    // One batch, confirms awaited.
    let report = publisher.publish(&batch).await;
    assert!(report.fault.is_none(), "{:?}", report.fault);
    assert_eq!(report.outcomes, expected);

    // Three batches written back to back before any confirm is awaited (the relay's pattern):
    // RabbitMQ acks several tags at once and lapin attaches a return to whichever confirm it
    // resolves first, so outcomes must be decided by message id, not by position.
    let mut confirms = Vec::new();
    for part in [&batch[..5], &batch[5..11], &batch[11..]] {
        let (done, report) = broker::report_future(part.len());
        publisher.send(part, &Fence::open(), done).await;
        confirms.push(report);
    }
    let [first, second, third]: [_; 3] = confirms.try_into().ok().unwrap();
    let mut pipelined = first.await.outcomes;
    pipelined.extend(second.await.outcomes);
    pipelined.extend(third.await.outcomes);
    assert_eq!(pipelined, expected);
    cleanup(&topology).await;
}

/// The loss path of return attribution, aimed at batch boundaries: many small pipelined batches
/// of several tenants, each ending with an unroutable event and starting with routable ones, so
/// that a multiple-ack spanning two batches can hand a batch's return to the next batch's
/// confirm (or to one still being written). Every unroutable event must come back `Returned`
/// and every routable one `Accepted`, whatever confirm lapin attached the return to.
#[tokio::test]
async fn returns_at_batch_boundaries_are_never_lost() {
    let topology = unique_topology("boundary", 2);
    let mut config = RabbitConfig::new(amqp_url(), topology.clone()).unwrap();
    config.redeclare_on_return = false; // keep the queue deleted
    let mut publisher = RabbitPublisher::new(config);
    let warmup = events("ta", "r1", "main", &[1]);
    assert_eq!(publisher.publish(&warmup).await.accepted(), 1);
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(topology.queue(Partition(0)), QueueDeleteOptions::default())
        .await
        .unwrap();
    // Runs that land on the deleted partition 0, and runs that land on partition 1.
    let (mut dead, mut live) = (Vec::new(), Vec::new());
    for run in 0..200 {
        let run = format!("run{run}");
        let tenant = TenantId::new(format!("t{}", live.len() % 3)).unwrap();
        match topology.partition_of(&tenant, &RunId::new(&run).unwrap()) {
            Partition(0) if dead.len() < 40 => dead.push((tenant, run)),
            Partition(1) if live.len() < 40 => live.push((tenant, run)),
            _ => {}
        }
    }
    let mut lsn = 1;
    let mut wrong = 0;
    let mut returned = 0;
    for round in 0..5 {
        // 150 batches of 1-3 routable events then one unroutable one, written back to back.
        let mut batches = Vec::new();
        for index in 0..150usize {
            let mut batch = Vec::new();
            for k in 0..(1 + (index + round) % 3) {
                let (tenant, run) = &live[(index + k) % live.len()];
                batch.extend(events(tenant.as_str(), run, "main", &[lsn]));
                lsn += 1;
            }
            let (tenant, run) = &dead[index % dead.len()];
            batch.extend(events(tenant.as_str(), run, "main", &[lsn]));
            lsn += 1;
            batches.push(batch);
        }
        let fence = Fence::open();
        let mut confirms = Vec::new();
        for batch in &batches {
            let (done, report) = broker::report_future(batch.len());
            publisher.send(batch, &fence, done).await;
            confirms.push(report);
        }
        for (batch, confirm) in batches.iter().zip(confirms) {
            let report = confirm.await;
            assert!(report.fault.is_none(), "{:?}", report.fault);
            let want: Vec<Outcome> = (0..batch.len())
                .map(|i| {
                    if i + 1 == batch.len() {
                        Outcome::Returned
                    } else {
                        Outcome::Accepted
                    }
                })
                .collect();
            returned += report
                .outcomes
                .iter()
                .filter(|o| **o == Outcome::Returned)
                .count();
            if report.outcomes != want {
                wrong += 1;
            }
        }
    }
    assert_eq!(
        wrong, 0,
        "batches whose outcomes were misattributed ({returned} returns seen)"
    );
    assert_eq!(returned, 750);
    cleanup(&topology).await;
}

/// A queue deleted under a running publisher heals by itself: the first events for it come
/// back returned (never reported accepted), the publisher declares the topology again, and
/// the same events are accepted and routed when sent again.
#[tokio::test]
async fn a_deleted_queue_heals_by_itself() {
    let topology = unique_topology("heal", 2);
    let mut publisher =
        RabbitPublisher::new(RabbitConfig::new(amqp_url(), topology.clone()).unwrap());
    let warmup = events("ta", "r1", "main", &[1]);
    assert_eq!(publisher.publish(&warmup).await.accepted(), 1);
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(topology.queue(Partition(0)), QueueDeleteOptions::default())
        .await
        .unwrap();
    let run = (0..100)
        .map(|run| format!("run{run}"))
        .find(|run| {
            topology.partition_of(&TenantId::new("ta").unwrap(), &RunId::new(run).unwrap())
                == Partition(0)
        })
        .unwrap();
    let batch = events("ta", &run, "main", &[1, 2, 3]);
    let first = publisher.publish(&batch).await;
    assert_eq!(first.outcomes, vec![Outcome::Returned; 3]);
    let again = publisher.publish(&batch).await;
    assert_eq!(
        again.outcomes,
        vec![Outcome::Accepted; 3],
        "the topology did not heal"
    );
    let queue = channel
        .queue_declare(
            topology.queue(Partition(0)),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    assert_eq!(
        queue.message_count(),
        3,
        "the healed queue holds the resent events"
    );
    cleanup(&topology).await;
}

/// At start a relay connects once: a broker that refuses (wrong credentials, unknown vhost,
/// queues declared with other arguments) is an error no retry fixes; one that is not there is
/// not an error (the relay waits for it).
#[tokio::test]
async fn preflight_tells_refusals_from_outages() {
    let topology = unique_topology("preflight", 2);
    let url = amqp_url();
    let config = |url: String| RabbitConfig::new(url, topology.clone()).unwrap();
    assert_eq!(
        rabbit::preflight(&config(url.clone())).await.unwrap(),
        broker::Preflight::Ready
    );
    let wrong_password = url.replacen("guest:guest", "guest:wrong", 1);
    let refused = rabbit::preflight(&config(wrong_password)).await;
    assert!(
        matches!(refused, Err(broker::Error::Refused(_))),
        "{refused:?}"
    );
    let no_vhost = format!("{}/no-such-vhost", url.rsplit_once('/').unwrap().0);
    let refused = rabbit::preflight(&config(no_vhost)).await;
    assert!(
        matches!(refused, Err(broker::Error::Refused(_))),
        "{refused:?}"
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = listener.local_addr().unwrap().port();
    drop(listener);
    let down = rabbit::preflight(&config(format!(
        "amqp://guest:guest@127.0.0.1:{closed_port}/%2f"
    )))
    .await
    .unwrap();
    assert!(
        matches!(down, broker::Preflight::Unreachable(_)),
        "{down:?}"
    );
    // Queues someone declared with other arguments: the topology conflicts.
    let conflicting = unique_topology("conflict", 1);
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            conflicting.queue(Partition(0)),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let refused =
        rabbit::preflight(&RabbitConfig::new(url.clone(), conflicting.clone()).unwrap()).await;
    assert!(
        matches!(refused, Err(broker::Error::Refused(_))),
        "{refused:?}"
    );
    cleanup(&conflicting).await;
    cleanup(&topology).await;
}

/// `RELAY_QUEUE_TYPE=quorum` declares replicated queues that publish and deliver like
/// classic ones (single active consumer included); a relay of the other type against
/// existing queues is refused with RabbitMQ's reason, never retried silently.
#[tokio::test]
async fn quorum_queues_work_and_a_type_mismatch_is_refused() {
    let quorum = unique_topology("quorum", 2).with_queue_type(QueueType::Quorum);
    let config = RabbitConfig::new(amqp_url(), quorum.clone()).unwrap();
    assert_eq!(
        rabbit::preflight(&config).await.unwrap(),
        broker::Preflight::Ready
    );
    let mut publisher = RabbitPublisher::new(config);
    let batch = events("tq", "r1", "main", &[1, 2, 3]);
    let report = publisher.publish(&batch).await;
    assert_eq!(
        report.outcomes,
        vec![Outcome::Accepted; 3],
        "{:?}",
        report.fault
    );
    let partition = quorum.partition_of(&TenantId::new("tq").unwrap(), &RunId::new("r1").unwrap());
    // A consumer, as a fold would (quorum queues with a single active consumer refuse
    // basic.get).
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut deliveries = channel
        .basic_consume(
            quorum.queue(partition),
            "quorum-test".into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let mut lsns = Vec::new();
    while lsns.len() < 3 {
        let delivery = tokio::time::timeout(Duration::from_secs(10), deliveries.next())
            .await
            .expect("delivered within 10 s")
            .expect("the consumer is open")
            .unwrap();
        let event = rabbit::decode(&delivery.properties, &delivery.data).unwrap();
        lsns.push(event.key.lsn.get());
    }
    assert_eq!(lsns, vec![1, 2, 3]);
    drop(connection);
    drop(publisher);

    // The same names as classic queues: RabbitMQ cannot convert them.
    let classic = Topology::new(quorum.exchange().as_str(), 2).unwrap();
    let refused = rabbit::preflight(&RabbitConfig::new(amqp_url(), classic.clone()).unwrap()).await;
    match refused {
        // RabbitMQ names the first argument that differs (the dead-letter target, then the type).
        Err(broker::Error::Refused(why)) => assert!(why.contains("inequivalent arg"), "{why}"),
        other => panic!("expected a refusal naming an inequivalent argument, got {other:?}"),
    }
    cleanup(&quorum).await;

    // And the other way round.
    let config = RabbitConfig::new(amqp_url(), classic.clone()).unwrap();
    assert_eq!(
        rabbit::preflight(&config).await.unwrap(),
        broker::Preflight::Ready
    );
    let as_quorum = classic.clone().with_queue_type(QueueType::Quorum);
    let refused = rabbit::preflight(&RabbitConfig::new(amqp_url(), as_quorum).unwrap()).await;
    assert!(
        matches!(refused, Err(broker::Error::Refused(_))),
        "{refused:?}"
    );
    cleanup(&classic).await;
}

/// Several comma-separated addresses (the nodes of one cluster): a node that refuses
/// connections is passed over for the next, and a bad second address is refused at the door.
#[tokio::test]
async fn a_dead_address_is_passed_over_for_the_next() {
    let topology = unique_topology("failover", 1);
    let uri = format!("amqp://guest:guest@127.0.0.1:1/%2f,{}", amqp_url());
    let config = RabbitConfig::new(uri, topology.clone()).unwrap();
    assert_eq!(config.addresses().len(), 2);
    assert_eq!(
        rabbit::preflight(&config).await.unwrap(),
        broker::Preflight::Ready
    );
    let mut publisher = RabbitPublisher::new(config);
    let report = publisher
        .publish(&events("tf", "r1", "main", &[1, 2]))
        .await;
    assert_eq!(
        report.outcomes,
        vec![Outcome::Accepted; 2],
        "{:?}",
        report.fault
    );
    drop(publisher);
    cleanup(&topology).await;
    let bad = RabbitConfig::new(format!("{},localhost:5672", amqp_url()), topology);
    assert!(
        matches!(&bad, Err(broker::Error::InvalidConfig(why)) if why.contains("URI 2")),
        "{bad:?}"
    );
}

//! A test's scratch topology is deleted when its process exits, also when the test failed.
use broker::Partition;
use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::{Connection, ConnectionProperties};
use rabbit::Topology;

use testkit::amqp_url;

/// Run only as the child of the test below: declares a scratch topology with a message in a
/// queue, prints its name and fails.
#[tokio::test]
#[ignore = "the child of a_failed_tests_topology_is_deleted_at_its_exit"]
async fn child_declares_a_topology_and_fails() {
    if std::env::var_os("SCRATCH_CHILD").is_none() {
        return;
    }
    let name = rabbit::scratch::leave_a_topology(&amqp_url(), "relay-test-child")
        .await
        .unwrap();
    println!("SCRATCH={name}");
    panic!("this test fails on purpose");
}

#[tokio::test]
async fn a_failed_tests_topology_is_deleted_at_its_exit() {
    let name = store::scratch::failing_child("child_declares_a_topology_and_fails");
    let topology = Topology::new(&name, 2).unwrap();
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    // A passive declare of a missing name closes its channel: one channel per look.
    let passive_queue = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let mut names = vec![topology.dead_letter_queue()];
    names.extend((0..2).map(|index| topology.queue(Partition(index))));
    for queue in names {
        let channel = connection.create_channel().await.unwrap();
        let found = channel
            .queue_declare(queue.clone(), passive_queue, Default::default())
            .await;
        assert!(found.is_err(), "{queue} was deleted when the child exited");
    }
    let channel = connection.create_channel().await.unwrap();
    let found = channel
        .exchange_declare(
            topology.exchange().clone(),
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await;
    assert!(found.is_err(), "{name} was deleted when the child exited");
}

//! The RabbitMQ adapter's promises that need a broker the test can silence.

use std::time::Duration;

use distribution::broker::{Publisher, report_future};

use distribution::rabbit::{RabbitConfig, RabbitPublisher, Topology};
use distribution::store::{Fence, OutboxEvent};
use distribution::testing::BrokerProxy;

use crate::harness::*;

fn event(lsn: u64) -> OutboxEvent {
    testkit::intent(&testkit::branch("t", "r", "main"), lsn)
        .payload("in flight")
        .build()
}

/// A publisher dropped (its actor died) with a batch written but unconfirmed answers that
/// batch at once, unconfirmed, instead of after its confirm timeout: its confirm pump goes
/// with it. This is what lets a dead publisher's drainers retry at once.
#[test]
fn a_dropped_publisher_answers_its_batch_in_flight_at_once() {
    host_runtime().block_on(async {
        let proxy = BrokerProxy::start(&amqp_url()).unwrap();
        let topology = Topology::new(&unique("dropped"), 1).unwrap();
        let mut config = RabbitConfig::new(proxy.amqp_url(), topology.clone()).unwrap();
        config.confirm_timeout = Duration::from_secs(120);
        let mut publisher = RabbitPublisher::new(config);
        // The session is open and the topology declared.
        assert_eq!(publisher.publish(&[event(1)]).await.accepted(), 1);

        proxy.silence();
        let (done, report) = report_future(1);
        publisher.send(&[event(2)], &Fence::open(), done).await;
        let mut report = std::pin::pin!(report);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut report)
                .await
                .is_err(),
            "no confirm can pass a silent broker"
        );
        drop(publisher);
        let report = tokio::time::timeout(Duration::from_secs(10), report)
            .await
            .expect("answered when dropped, not after the 120 s confirm timeout");
        assert!(
            report.outcomes.iter().all(|outcome| !outcome.is_accepted()),
            "{report:?}"
        );
        proxy.restore();
        drop_topology(&topology).await;
    });
}

//! What Prometheus scrapes from a relay: every metric described, the lag as a real histogram
//! with buckets from 1 ms to 60 s, and failure counters present (at zero) before any failure.
#[path = "support/harness.rs"]
mod harness;

mod metrics_surface {
    use std::time::Duration;

    use distribution::Relay;
    use distribution::store::{BranchId, BranchKey, IntentWriter, Lsn, Outbox, RunId, TenantId};

    use crate::harness::*;

    #[test]
    fn metrics_are_described_bucketed_and_present_from_the_start() {
        let recorder = distribution::prometheus_builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).unwrap();
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("metrics").await;
            let config = relay_config(&url, &amqp_url(), &unique("relay-metrics"));
            distribution::describe_metrics(config.supervisor.shards);
            let before = handle.render();
            assert!(
                before.contains("relay_drainer_restarts_total 0"),
                "{before}"
            );
            assert!(
                before.contains("relay_publisher_restarts_total{shard=\"0\"} 0"),
                "{before}"
            );

            let relay = Relay::start(config.clone()).await.unwrap();
            let branch = BranchKey::new(
                TenantId::new("m").unwrap(),
                RunId::new("r").unwrap(),
                BranchId::new("b").unwrap(),
            );
            let writer = IntentWriter::default();
            writer
                .open_run(&mut pool.acquire().await.unwrap(), &branch)
                .await
                .unwrap();
            writer
                .append(
                    &mut pool.acquire().await.unwrap(),
                    &branch,
                    Lsn::new(1),
                    b"x",
                )
                .await
                .unwrap();
            let outbox = Outbox::new(pool.clone());
            wait_until("shipped", Duration::from_secs(30), || async {
                pending(&outbox).await == 0
            })
            .await;
            let scraped = handle.render();
            for name in [
                "relay_write_to_confirm_seconds",
                "relay_events_shipped_total",
                "relay_publish_failures_total",
                "relay_lease_buckets_held",
            ] {
                assert!(
                    scraped.contains(&format!("# HELP {name} ")),
                    "no HELP for {name}"
                );
            }
            assert!(
                scraped.contains("# TYPE relay_write_to_confirm_seconds histogram"),
                "{scraped}"
            );
            assert!(
                scraped
                    .contains("relay_write_to_confirm_seconds_bucket{tenant=\"m\",le=\"0.001\"}"),
                "{scraped}"
            );
            assert!(
                scraped.contains("relay_write_to_confirm_seconds_bucket{tenant=\"m\",le=\"60\"}"),
                "{scraped}"
            );
            relay.shutdown().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }
}

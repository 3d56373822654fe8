//! What Prometheus scrapes from a relay (alone in its binary: it installs the process-wide
//! metrics recorder, see `tests/it/main.rs`): every metric described, the lag as a real histogram
//! with buckets from 1 ms to 60 s, and failure counters present (at zero) before any failure.
#[path = "it/harness.rs"]
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
            distribution::describe_metrics(config.supervisor.publishers());
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
                scraped.contains("relay_write_to_confirm_seconds_bucket{le=\"0.001\"}"),
                "{scraped}"
            );
            assert!(
                scraped.contains("relay_write_to_confirm_seconds_bucket{le=\"60\"}"),
                "{scraped}"
            );
            // One histogram per relay (not per tenant): the one event shipped, one sample.
            assert!(
                scraped.contains("relay_write_to_confirm_seconds_count 1\n"),
                "{scraped}"
            );
            // Shipped is counted per relay, not per tenant (a series per tenant ever seen).
            assert!(
                scraped.contains("relay_events_shipped_total 1\n"),
                "{scraped}"
            );
            relay.shutdown().await;
            assert!(
                scraped.contains("relay_broker_refusals_total 0"),
                "{scraped}"
            );

            // Credentials that stop working while the relay runs: counted, not silent.
            let bad_url = amqp_url().replacen("guest:guest", "guest:wrong", 1);
            assert_ne!(
                bad_url,
                amqp_url(),
                "the test broker URL carries guest:guest"
            );
            let refused = relay_config(&url, &bad_url, &config.topology);
            let relay = Relay::start(refused).await.unwrap();
            writer
                .append(
                    &mut pool.acquire().await.unwrap(),
                    &branch,
                    Lsn::new(2),
                    b"y",
                )
                .await
                .unwrap();
            wait_until("a refusal counted", Duration::from_secs(30), || async {
                handle
                    .render()
                    .lines()
                    .filter_map(|line| line.strip_prefix("relay_broker_refusals_total "))
                    .any(|value| value.trim() != "0")
            })
            .await;
            assert_eq!(pending(&outbox).await, 1, "nothing acked while refused");
            relay.shutdown().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }
}

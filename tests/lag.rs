//! Step 9 of the T7.4 acceptance suite (relay lag is a metric), alone in its binary: it installs
//! a process-wide metrics recorder, and a process has one (the `metrics` crate's design), so it
//! cannot share a binary with the other tests (see `tests/it/main.rs`).
#[path = "it/harness.rs"]
mod harness;

mod outbox {
    use std::time::Duration;

    use distribution::Relay;
    use distribution::testing::BrokerProxy;

    use crate::harness::*;

    /// Step 9: relay lag is emitted: pending rows and oldest age per tenant while the broker is
    /// down; once it is back, events shipped and the write-to-confirm latency of each.
    #[test]
    fn outbox_relay_lag_is_emitted_as_metrics() {
        let snapshotter = {
            let recorder = metrics_util::debugging::DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            recorder
                .install()
                .expect("only this test installs a recorder");
            snapshotter
        };
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("metrics").await;
            let proxy = BrokerProxy::start(&amqp_url()).unwrap();
            proxy.cut();
            let config = relay_config(&url, &proxy.amqp_url(), &unique("relay-metrics"));
            let relay = Relay::start(config.clone()).await.unwrap();
            let prefix = unique("lag").replace('_', "-");
            let ran = Workload::new(&prefix, 1, 2, 10).run(&pool).await;
            let tenant = tenants_of(&ran.expected)[0].to_string();
            let total = count(&ran.expected) as f64;

            /// What the recorder showed for this test's tenant, accumulated over snapshots
            /// (a `DebuggingRecorder` snapshot resets what it reads).
            #[derive(Default)]
            struct Seen {
                shipped: u64,
                lag_samples: usize,
                pending: bool,
                age: bool,
            }
            let mut seen = Seen::default();
            let read = |seen: &mut Seen| {
                use metrics_util::debugging::DebugValue;
                for (key, _, _, value) in snapshotter.snapshot().into_vec() {
                    let key = key.key();
                    if let DebugValue::Histogram(values) = &value
                        && key.name() == "relay_write_to_confirm_seconds"
                    {
                        seen.lag_samples += values.len();
                        continue;
                    }
                    if let DebugValue::Counter(n) = &value
                        && key.name() == "relay_events_shipped_total"
                    {
                        // Per relay: this test's relay and any other of this binary's tests.
                        seen.shipped += n;
                        continue;
                    }
                    if !key
                        .labels()
                        .any(|label| label.key() == "tenant" && label.value() == tenant)
                    {
                        continue;
                    }
                    match (key.name(), value) {
                        ("relay_backlog_pending", DebugValue::Gauge(v)) if v.0 == total => {
                            seen.pending = true
                        }
                        ("relay_backlog_oldest_age_seconds", DebugValue::Gauge(v)) if v.0 > 0.0 => {
                            seen.age = true
                        }
                        _ => {}
                    }
                }
            };
            wait_until("backlog gauges", Duration::from_secs(30), || {
                read(&mut seen);
                let done = seen.pending && seen.age;
                async move { done }
            })
            .await;
            proxy.restore();
            wait_until(
                "shipped counter and lag histogram",
                Duration::from_secs(60),
                || {
                    read(&mut seen);
                    // The lag histogram is one per relay, shared with the other tests of this
                    // binary that run meanwhile: at least one sample per event shipped here
                    // (tests/metrics.rs counts them exactly).
                    let done = seen.shipped as f64 >= total && seen.lag_samples as f64 >= total;
                    async move { done }
                },
            )
            .await;
            relay.shutdown().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }
}

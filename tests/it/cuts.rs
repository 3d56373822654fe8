//! Repeated short broker cuts under several relays and dozens of tenants: every tenant ships
//! in every stretch the broker is reachable, not only after the last cut. An independent
//! campaign (20 cuts of 1 to 5 s, alternately reset and stalled, 3 relays, 50 tenants, the
//! broker reachable 1 to 2 s between cuts) saw a tenant go 77 s without a delivery.

mod outbox {
    use std::collections::{BTreeMap, HashMap};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use distribution::store::TenantId;
    use distribution::testing::BrokerProxy;
    use distribution::{Relay, RelayConfig};

    use crate::harness::*;
    use crate::recorder::{Recorder, keep_writing};

    /// How a fault takes the broker away.
    #[derive(Clone, Copy, Debug)]
    enum Fault {
        /// Connections reset, new ones refused.
        Cut,
        /// Connections stay open and nothing passes (held, then delivered on restore).
        Stall,
    }

    /// The faults, in order, with how long each lasts: as the campaign's, 1 to 5 s,
    /// alternating.
    const FAULTS: [(Fault, u64); 10] = [
        (Fault::Cut, 2_000),
        (Fault::Stall, 1_000),
        (Fault::Cut, 3_000),
        (Fault::Stall, 2_000),
        (Fault::Cut, 1_000),
        (Fault::Stall, 3_000),
        (Fault::Cut, 2_000),
        (Fault::Stall, 1_000),
        (Fault::Cut, 5_000),
        (Fault::Stall, 2_000),
    ];

    /// How long the broker is reachable between two faults.
    const WINDOW: Duration = Duration::from_millis(1_500);

    /// The most broker availability a tenant with work may go without a delivery: about two
    /// windows (one missed while its publisher reconnects, and margin for a slow machine).
    const MOST_UP_WITHOUT_DELIVERY: Duration = Duration::from_secs(4);

    /// How much of `[from, to]` lies in the `up` intervals.
    fn up_within(up: &[(Instant, Instant)], from: Instant, to: Instant) -> Duration {
        up.iter()
            .map(|&(start, end)| {
                let (start, end) = (start.max(from), end.min(to));
                end.saturating_duration_since(start)
            })
            .sum()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn repeated_broker_cuts_stall_no_tenant_while_the_broker_is_reachable() {
        crate::harness::capture_logs();
        let (pool, url) = fresh_database("cuts").await;
        let proxy = BrokerProxy::start(&amqp_url()).unwrap();
        // The relay's own defaults (timeouts, backoffs, shards): what users run.
        let mut config = RelayConfig::new(&url, proxy.amqp_url());
        config.topology = unique("cuts");
        // Three relays beside the suite's other tests stay well within the server's 100
        // connections.
        config.db_connections = 2;
        let recorder = Recorder::start(&direct_rabbit(&config)).await;
        let mut relays = Vec::new();
        for _ in 0..3 {
            relays.push(Relay::start(config.clone()).await.unwrap());
        }
        let workload = Workload::new(&unique("ct"), 30, 1, 2);
        let ran = workload.run(&pool).await;
        let stop = Arc::new(AtomicBool::new(false));
        let writer = keep_writing(pool.clone(), workload, ran, stop.clone());
        wait_until("every tenant ships", Duration::from_secs(60), || async {
            let tenants: std::collections::BTreeSet<TenantId> = recorder
                .deliveries()
                .into_iter()
                .map(|event| event.key.branch.tenant)
                .collect();
            tenants.len() == 30
        })
        .await;

        let mut up = Vec::new();
        let observed_from = Instant::now();
        let mut up_since = observed_from;
        for (fault, millis) in FAULTS {
            match fault {
                Fault::Cut => proxy.cut(),
                Fault::Stall => proxy.silence(),
            }
            up.push((up_since, Instant::now()));
            tracing::info!(?fault, millis, "test: the broker goes away");
            tokio::time::sleep(Duration::from_millis(millis)).await;
            proxy.restore();
            up_since = Instant::now();
            tracing::info!("test: the broker is back");
            tokio::time::sleep(WINDOW).await;
        }
        // A last stretch as long as two windows, then the host stops writing.
        tokio::time::sleep(2 * WINDOW).await;
        let observed_to = Instant::now();
        up.push((up_since, observed_to));
        stop.store(true, Ordering::Release);
        let expected = writer.await.unwrap();

        let total = count(&expected);
        wait_until(
            "every intent delivered",
            Duration::from_secs(60),
            || async {
                let delivered: std::collections::HashSet<String> = recorder
                    .deliveries()
                    .iter()
                    .map(|event| event.key.to_string())
                    .collect();
                delivered.len() >= total
            },
        )
        .await;
        let arrivals = recorder.arrivals();
        recorder.stop().await;
        for relay in relays {
            relay.shutdown().await;
        }
        drop_topology(&config.rabbit_config().unwrap().topology).await;

        // Nothing lost, and each branch's first copies in ascending order.
        let mut seen: HashMap<String, u64> = HashMap::new();
        let mut first_copies: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let mut by_tenant: BTreeMap<String, Vec<Instant>> = BTreeMap::new();
        for (at, event) in &arrivals {
            let key = event.key.to_string();
            if seen.insert(key, event.key.lsn.get()).is_none() {
                first_copies
                    .entry(event.key.branch.to_string())
                    .or_default()
                    .push(event.key.lsn.get());
            }
            by_tenant
                .entry(event.key.branch.tenant.to_string())
                .or_default()
                .push(*at);
        }
        for (branch, events) in &expected {
            let lsns = first_copies
                .get(&branch.to_string())
                .cloned()
                .unwrap_or_default();
            let want: Vec<u64> = events.iter().map(|(lsn, _)| lsn.get()).collect();
            assert_eq!(
                lsns, want,
                "{branch}: first copies, in order, are every intent"
            );
        }

        // The broker availability each tenant went without a delivery, at its worst.
        let mut worst: Vec<(Duration, String)> = by_tenant
            .iter()
            .map(|(tenant, times)| {
                let mut times: Vec<Instant> = times
                    .iter()
                    .copied()
                    .filter(|at| (observed_from..=observed_to).contains(at))
                    .collect();
                times.sort();
                let mut edges = vec![observed_from];
                edges.extend(times);
                edges.push(observed_to);
                let longest = edges
                    .windows(2)
                    .map(|pair| up_within(&up, pair[0], pair[1]))
                    .max()
                    .unwrap_or_default();
                (longest, tenant.clone())
            })
            .collect();
        worst.sort_by(|a, b| b.cmp(a));
        let total_up = up_within(&up, observed_from, observed_to);
        println!(
            "broker reachable {total_up:?} of {:?}; longest availability without a delivery, worst tenants: {:?}",
            observed_to - observed_from,
            &worst[..5.min(worst.len())]
        );
        assert!(
            worst[0].0 <= MOST_UP_WITHOUT_DELIVERY,
            "tenants went without a delivery through more than {MOST_UP_WITHOUT_DELIVERY:?} of \
             broker availability: {:?}",
            worst
                .iter()
                .filter(|(longest, _)| *longest > MOST_UP_WITHOUT_DELIVERY)
                .collect::<Vec<_>>()
        );
    }
}

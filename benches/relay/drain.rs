//! Sections 3, 5, 6 and the others on one node: drain rates, scale-out, fairness, RSS, idle cost.
use super::*;

/// Rows of sections 10 and 11.
pub(crate) async fn scale(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let mut one = 0.0;
    for relays in 1..=3 {
        let (shares, rate) = relay_shares(env, relays, mode.backlog_per_run).await?;
        if relays == 1 {
            one = rate;
        }
        let even = 1.0 / relays as f64;
        let worst = shares
            .iter()
            .fold(0.0f64, |worst, share| worst.max(share / even));
        let shares: Vec<String> = shares
            .iter()
            .map(|s| format!("{:.0}%", s * 100.0))
            .collect();
        row(
            &format!("10. {relays} relay(s): shares; total"),
            format!(
                "{}; {rate:.0} ev/s ({:.2}x one relay)",
                shares.join(" / "),
                rate / one
            ),
            &format!("largest share {worst:.2}x even (target <= 1.5)"),
        );
    }
    join_rows(env, mode, row).await?;
    let tenants = mode.many_tenants;
    let (rate, peak, appended, refused, qps, cpu, idle_rss) =
        many_tenants(env, tenants, mode.idle_secs).await?;
    row(
        &format!("11. {tenants} tenants x 2 intents: drain, peak RSS"),
        format!("{rate:.0} ev/s, {peak} MB"),
        "standalone relay",
    );
    row(
        &format!("11. {tenants} tenants: host appends beside, refused"),
        format!("{appended}, {refused} refused"),
        "one transaction each, same database; target 0 refused",
    );
    row(
        &format!("11. {tenants} tenants idle: queries, CPU, RSS"),
        format!("{qps:.1} /s, {cpu:.1} %, {idle_rss} MB"),
        "after the drain, drainers retired",
    );
    Ok(())
}

/// Section 12b/c: backlog drain rate of a relay (`per_run x 1000` intents, 50 tenants x 20
/// runs), with full metadata on every intent or none, into `bound` consumer groups.
pub(crate) async fn drain_rate(
    env: &mut Env,
    per_run: u32,
    with_meta: bool,
    bound: u16,
) -> Result<f64> {
    let (pool, url) = env.database("drainmeta").await?;
    let mut rabbit = env.rabbit("drainmeta", 8)?;
    rabbit.topology = rabbit.topology.declaring(groups(bound));
    // Both backlogs written by the same statement, the one with every intent carrying the
    // metadata, so the two differ in nothing else (an UPDATE afterwards would leave the
    // metadata's table twice the pages, half of them dead).
    let meta = with_meta.then(|| full_metadata(1));
    let written = store::fixtures::fill_backlog_with(
        &pool,
        "t",
        50,
        20,
        per_run,
        PAYLOAD_BYTES,
        meta.as_ref(),
    )
    .await?;
    env.checkpoint().await?;
    let outbox = Outbox::new(pool.clone());
    let mut config = env.relay_config(&url, &rabbit);
    config.groups = groups(bound);
    let started = Instant::now();
    let relay = Relay::start(config).await?;
    wait_drained(&outbox, Duration::from_secs(900)).await?;
    let rate = written as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    Ok(rate)
}

/// Section 12b: the drain with full metadata next to the drain without, and the pipelined
/// ceilings with and without the same headers (`BENCH_ONLY=metadrain` runs this alone).
pub(crate) async fn metadata_drain(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    // The drain pair: 5 pairs, the order swapped every other pair (so neither side always
    // runs first), the ratio the median of the pairs' ratios.
    // A drain's rate is noisy on 2 shared cores (single drains of the same backlog ranged
    // 13.8k-16.1k ev/s in one session), so one median of 3 could say 0.75 or 0.95 of the same
    // code.
    let per_run = (mode.backlog_per_run / 2).max(1);
    let (mut plain, mut meta, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..5 {
        let (p, m) = if pair % 2 == 0 {
            let p = drain_rate(env, per_run, false, 0).await?;
            (p, drain_rate(env, per_run, true, 0).await?)
        } else {
            let m = drain_rate(env, per_run, true, 0).await?;
            (drain_rate(env, per_run, false, 0).await?, m)
        };
        plain.push(p);
        meta.push(m);
        ratios.push(m / p);
    }
    let per_run_raw = (mode.backlog_per_run / 4).max(1);
    let (mut raw_plain, mut raw_meta) = (Vec::new(), Vec::new());
    let payload = vec![b'x'; PAYLOAD_BYTES as usize];
    let events = per_run_raw as usize * 1000;
    for _ in 0..3 {
        for (with_meta, into) in [(false, &mut raw_plain), (true, &mut raw_meta)] {
            let rabbit = env.rabbit("rawmeta", 8)?;
            declare(&env.amqp, &rabbit.topology).await?;
            let properties = wire_like_properties(with_meta.then(|| full_metadata(1)).as_ref());
            into.push(
                raw_pipelined_with(&env.amqp, &rabbit.topology, events, &payload, 4, properties)
                    .await?,
            );
            drop_topology(&env.amqp, &rabbit.topology).await?;
        }
    }
    let (raw_plain, raw_meta) = (min_median_max(raw_plain).1, min_median_max(raw_meta).1);
    row(
        "12. pipelined ceiling, contract headers only",
        format!("{raw_plain:.0} ev/s"),
        "plain lapin, the relay's headers for an intent without metadata; median of 3",
    );
    row(
        "12. pipelined ceiling, with the metadata",
        format!("{raw_meta:.0} ev/s"),
        &format!(
            "the same plus every metadata field: ratio {:.2}, what the broker itself pays",
            raw_meta / raw_plain
        ),
    );
    let (plain_min, plain, plain_max) = min_median_max(plain);
    let (meta_min, meta, meta_max) = min_median_max(meta);
    let (ratio_min, ratio, ratio_max) = min_median_max(ratios);
    let events = u64::from(per_run) * 1000;
    row(
        "12. backlog drain, no metadata",
        format!("{plain:.0} ev/s"),
        &format!("{events} events, median of 5 ({plain_min:.0}-{plain_max:.0})"),
    );
    row(
        "12. backlog drain, full metadata",
        format!("{meta:.0} ev/s"),
        &format!("the same backlog with every field set ({meta_min:.0}-{meta_max:.0})"),
    );
    row(
        "12. drain ratio metadata/plain",
        format!("{ratio:.2}"),
        &format!(
            "median of 5 side-by-side pairs' ratios ({ratio_min:.2}-{ratio_max:.2}); target >= 0.9"
        ),
    );
    Ok(())
}

/// Section 12: what metadata and consumer groups cost, each pair side by side in one run,
/// alternated (A B A B ...) and the median of 3 taken.
pub(crate) async fn metadata_and_groups(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let seconds = mode.latency_secs.min(10);
    let (mut plain, mut meta) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        plain.push(append_rate(env, false, Wake::Waker, 8, seconds).await?);
        meta.push(append_rate(env, true, Wake::Waker, 8, seconds).await?);
    }
    let (plain, meta) = (min_median_max(plain).1, min_median_max(meta).1);
    row(
        "12. host append, payload only",
        format!("{plain:.0} commits/s"),
        "8 writers, one intent per transaction, no NOTIFY; median of 3",
    );
    row(
        "12. host append, full metadata",
        format!("{meta:.0} commits/s"),
        "type, content type, correlation and causation ids, 3 headers, traceparent and tracestate",
    );
    row(
        "12. append ratio metadata/plain",
        format!("{:.2}", meta / plain),
        "same run, alternated",
    );
    metadata_drain(env, mode, row).await?;
    let per_run = (mode.backlog_per_run / 4).max(1);
    let (mut one, mut three) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        one.push(drain_rate(env, per_run, false, 1).await?);
        three.push(drain_rate(env, per_run, false, 3).await?);
    }
    let (one, three) = (min_median_max(one).1, min_median_max(three).1);
    row(
        "12. backlog drain, 1 group bound",
        format!("{one:.0} ev/s"),
        "median of 3",
    );
    row(
        "12. backlog drain, 3 groups bound",
        format!("{three:.0} ev/s"),
        &format!(
            "ratio {:.2}: the broker copies each message into 3 queues",
            three / one
        ),
    );
    for bound in [1, 3] {
        let load = Load {
            groups: bound,
            ..Load::busy()
        };
        let (measured, _) = latency(env, mode, Wake::Notify, &load).await?;
        latency_rows(row, &format!("NOTIFY, {bound} group(s) bound"), &measured);
    }
    Ok(())
}

/// Section 8: what one refresh of the lag gauges costs with `per_run x 1000` intents pending
/// (50 tenants): the former full `GROUP BY` against the bounded read, median of 3 each, ms.
pub(crate) async fn gauge_cost(env: &mut Env, per_run: u32) -> Result<(u64, f64, f64)> {
    let (pool, _) = env.database("gauges").await?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    let outbox = Outbox::new(pool.clone());
    let tenants: Vec<TenantId> = (0..50)
        .map(|t| TenantId::new(format!("t{t}")))
        .collect::<Result<_, _>>()?;
    let median = |mut samples: Vec<f64>| {
        samples.sort_by(f64::total_cmp);
        samples[samples.len() / 2]
    };
    let mut full = Vec::new();
    let mut bounded = Vec::new();
    for _ in 0..3 {
        let started = Instant::now();
        outbox.backlog().await?;
        full.push(started.elapsed().as_secs_f64() * 1000.0);
        let started = Instant::now();
        outbox
            .backlog_of(&tenants, distribution::PENDING_GAUGE_CAP)
            .await?;
        bounded.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    pool.close().await;
    Ok((written, median(full), median(bounded)))
}

/// Section 7: quiet tenants alone, beside one tenant draining a backlog (with and without
/// the express lane), each next to its floor.
pub(crate) async fn fairness(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    // Enough backlog for the hot tenant to still be draining when the writers stop.
    let hot = 20_000 * (mode.latency_secs as u32 + 10);
    for (label, load) in [
        ("alone", Load::quiet(0, 32)),
        ("beside a hot backlog, express lane", Load::quiet(hot, 32)),
        ("beside a hot backlog, no express lane", Load::quiet(hot, 0)),
    ] {
        let (m, hot_left) = latency(env, mode, Wake::Notify, &load).await?;
        let (floor_p50, floor_p99) = m.floor;
        let note = if load.hot_backlog > 0 {
            format!(
                "hot tenant: {} intents waiting at start, {hot_left} still waiting at the end; p99/floor p99 = {:.1} (target <= 2)",
                load.hot_backlog,
                m.p99 / floor_p99
            )
        } else {
            format!("20 tenants x 10 events/s, writers achieved {:.0}/s", m.rate)
        };
        row(
            &format!("7. quiet tenants {label}: p50 / p99 (floor p50 / p99)"),
            format!(
                "{:.1} / {:.1} ms ({floor_p50:.1} / {floor_p99:.1} ms)",
                m.p50, m.p99
            ),
            &note,
        );
    }
    Ok(())
}

/// Section 10: `relays` standalone relays share a backlog of 50 tenants x 20 runs; each
/// relay's share of what shipped (from its own `/metrics`), and the total rate.
pub(crate) async fn relay_shares(
    env: &mut Env,
    relays: usize,
    per_run: u32,
) -> Result<(Vec<f64>, f64)> {
    let (pool, url) = env.database("shares").await?;
    let rabbit = env.rabbit("shares", 8)?;
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..relays {
        let addr = testkit::free_addr();
        children.push(spawn_relay_at(&url, &env.amqp, &rabbit, &addr, 50)?);
        addrs.push(addr);
    }
    // Wait until the lease buckets are spread (each relay holds about its share) before the
    // backlog appears, so the measure is the steady state, not the first relay's head start.
    let even = 128.0 / relays as f64;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut held = Vec::new();
        for addr in &addrs {
            held.push(
                scrape(addr)
                    .await
                    .map_or(0.0, |s| metric_sum(&s, "relay_lease_buckets_held")),
            );
        }
        if held.iter().all(|h| (*h - even).abs() <= 1.0) {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "leases never spread: {held:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    let started = Instant::now();
    let drained = wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(900)).await;
    let rate = written as f64 / started.elapsed().as_secs_f64();
    let mut shipped = Vec::new();
    for addr in &addrs {
        shipped.push(
            scrape(addr)
                .await
                .map_or(0.0, |s| metric_sum(&s, "relay_events_shipped_total")),
        );
    }
    for mut child in children {
        child.kill()?;
        child.wait()?;
    }
    drained?;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    let total: f64 = shipped.iter().sum();
    Ok((shipped.iter().map(|s| s / total.max(1.0)).collect(), rate))
}

/// Rows of section 10 on a backlog already waiting: 1, 2 or 3 relays started one after
/// another (each once the previous one ships), deliveries per event at the broker (planned
/// handovers: target 1.000) and the drain rate through the handovers.
pub(crate) async fn join_rows(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    for relays in 1..=3 {
        let (ratio, rate) = join_backlog(env, relays, mode.backlog_per_run).await?;
        row(
            &format!("10. {relays} relay(s) joining a backlog: deliveries / events; drain"),
            format!("{ratio:.3}; {rate:.0} ev/s"),
            "target 1.000 (a join and the rebalance are planned handovers)",
        );
    }
    Ok(())
}

/// `relays` standalone relays started one after another on a backlog of 50 tenants x 20 runs;
/// messages in the queues per event written (nothing consumes them), and the drain rate.
pub(crate) async fn join_backlog(env: &mut Env, relays: usize, per_run: u32) -> Result<(f64, f64)> {
    let (pool, url) = env.database("join").await?;
    let rabbit = env.rabbit("join", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    let outbox = Outbox::new(pool.clone());
    let started = Instant::now();
    let mut children = Vec::new();
    for _ in 0..relays {
        let addr = testkit::free_addr();
        children.push(spawn_relay_at(&url, &env.amqp, &rabbit, &addr, 50)?);
        // The next joins once this one ships, or once nothing is left to ship (a small
        // backlog, `--quick`, can be gone before a later relay holds any bucket).
        let deadline = Instant::now() + Duration::from_secs(60);
        while scrape(&addr)
            .await
            .map_or(0.0, |s| metric_sum(&s, "relay_events_shipped_total"))
            < 1.0
            && outbox.pending_and_parked().await?.0
        {
            anyhow::ensure!(Instant::now() < deadline, "a relay never shipped");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let drained = wait_drained(&outbox, Duration::from_secs(900)).await;
    let rate = written as f64 / started.elapsed().as_secs_f64();
    for mut child in children {
        child.kill()?;
        child.wait()?;
    }
    drained?;
    let connection =
        lapin::Connection::connect(&env.amqp, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let mut queued = 0u64;
    for index in 0..rabbit.topology.partitions() {
        let queue = channel
            .queue_declare(
                rabbit.topology.queue(Partition(index)),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await?;
        queued += u64::from(queue.message_count());
    }
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    Ok((queued as f64 / written.max(1) as f64, rate))
}

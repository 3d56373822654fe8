//! Section 9: payload sizes, the relay against the ceiling writing the same messages.
use super::*;

/// Section 9: at each payload size, the pipelined raw ceiling and the standalone relay
/// draining the same volume, then the bound (`bound.rs`) with and without retiring rows, 3 times
/// in turn (`BENCH_SIZE_RUNS`); returns each side's rates, peak RSS and CPU.
/// The ceiling speaks plain AMQP on loopback; with `database_tls` false the relay reads
/// PostgreSQL in plain text too (`sslmode=disable`), else as configured by default
/// (`sslmode=prefer`: TLS when the server offers it, as this machine's does).
pub(crate) async fn payload_size(
    env: &mut Env,
    payload_bytes: u32,
    events: u32,
    database_tls: bool,
) -> Result<SizeRuns> {
    let payload = store::fixtures::Incompressible::default().bytes(payload_bytes as usize);
    let mut runs = SizeRuns::default();
    // `BENCH_SIZE_RUNS=<n>` runs each side n times instead of 3 (the ratios are noisy here).
    let turns = std::env::var("BENCH_SIZE_RUNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3);
    for _ in 0..turns {
        let rabbit = env.rabbit("size-raw", 8)?;
        let mut declarer = RabbitPublisher::new(rabbit.clone());
        anyhow::ensure!(
            declarer.publish(&synthetic_events(1)).await.fault.is_none(),
            "broker not reachable"
        );
        env.checkpoint().await?;
        runs.quiet += servers_quiet().await;
        let before = (cpu_ticks_named("beam"), cpu_ticks(std::process::id())?);
        runs.ceilings
            .push(raw_pipelined(&env.amqp, &rabbit.topology, events as usize, &payload, 4).await?);
        runs.ceiling_cpu[0] += cpu_ticks_named("beam") - before.0;
        runs.ceiling_cpu[1] += cpu_ticks(std::process::id())? - before.1;
        drop_topology(&env.amqp, &rabbit.topology).await?;
        // The same without the contract's headers, for reference (what earlier runs called
        // the ceiling).
        let rabbit = env.rabbit("size-bare", 8)?;
        declare(&env.amqp, &rabbit.topology).await?;
        runs.quiet += servers_quiet().await;
        runs.bare.push(
            raw_pipelined_with(
                &env.amqp,
                &rabbit.topology,
                events as usize,
                &payload,
                4,
                lapin::BasicProperties::default(),
            )
            .await?,
        );
        drop_topology(&env.amqp, &rabbit.topology).await?;

        let (pool, url) = env.database("size").await?;
        let rabbit = env.rabbit("size", 8)?;
        // The relay first, ready and holding every lease, so its start is not timed; then
        // the backlog in one transaction (50 tenants x 4 runs).
        let addr = testkit::free_addr();
        let relay_url = if database_tls {
            url.clone()
        } else {
            format!("{url}?sslmode=disable")
        };
        let mut child = spawn_relay_at(&relay_url, &env.amqp, &rabbit, &addr, 50)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while scrape(&addr)
            .await
            .is_none_or(|scraped| metric_sum(&scraped, "relay_lease_buckets_held") < 128.0)
        {
            anyhow::ensure!(Instant::now() < deadline, "the relay never took its leases");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let per_run = (events / 200).max(1);
        env.checkpoint().await?;
        // Before the fill: the relay ships the backlog as soon as it commits.
        runs.quiet += servers_quiet().await;
        let written =
            store::fixtures::fill_backlog_random(&pool, "t", 50, 4, per_run, payload_bytes).await?;
        let before = [
            cpu_ticks_named("beam"),
            cpu_ticks_named("postgres"),
            cpu_ticks(child.id())?,
        ];
        let started = Instant::now();
        let drained = wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(900)).await;
        let elapsed = started.elapsed().as_secs_f64();
        let after = [
            cpu_ticks_named("beam"),
            cpu_ticks_named("postgres"),
            cpu_ticks(child.id())?,
        ];
        let rss = proc_status_kb(child.id(), "VmHWM");
        child.kill()?;
        child.wait()?;
        drained?;
        runs.peak = runs.peak.max(rss? / 1024);
        runs.relays.push(written as f64 / elapsed);
        for (sum, (after, before)) in runs.relay_cpu.iter_mut().zip(after.iter().zip(before)) {
            *sum += after - before;
        }
        runs.events += written;
        drop_topology(&env.amqp, &rabbit.topology).await?;
        runs.vacuum[0] += vacuum_ticks(&pool).await?;
        pool.close().await;
        env.drop_database(&url).await?;
        if !database_tls {
            for (index, delete) in [false, true].into_iter().enumerate() {
                let (rate, cpu, quiet, vacuum) =
                    bound_run(env, payload_bytes, events, delete).await?;
                runs.quiet += quiet;
                if delete {
                    runs.vacuum[1] += vacuum;
                }
                runs.bounds[index].push(rate);
                for (sum, ticks) in runs.bound_cpu[index].iter_mut().zip(cpu) {
                    *sum += ticks;
                }
            }
        }
    }
    Ok(runs)
}

/// One run of the bound (`bound::read_and_publish`) on a backlog written as the relay's was:
/// its rate, the CPU ticks of RabbitMQ, PostgreSQL and this process, the wait for quiet, and
/// PostgreSQL's ticks for the VACUUM the run left owing.
async fn bound_run(
    env: &mut Env,
    payload_bytes: u32,
    events: u32,
    delete: bool,
) -> Result<(f64, [u64; 3], Duration, u64)> {
    let (pool, url) = env.database("bound").await?;
    let rabbit = env.rabbit("size-bound", 8)?;
    declare(&env.amqp, &rabbit.topology).await?;
    env.checkpoint().await?;
    // Before the fill, as for the relay (which ships the backlog as soon as it commits).
    let quiet = servers_quiet().await;
    let written = store::fixtures::fill_backlog_random(
        &pool,
        "t",
        50,
        4,
        (events / 200).max(1),
        payload_bytes,
    )
    .await?;
    let ticks = || -> Result<[u64; 3]> {
        Ok([
            cpu_ticks_named("beam"),
            cpu_ticks_named("postgres"),
            cpu_ticks(std::process::id())?,
        ])
    };
    let before = ticks()?;
    let (rate, read) =
        bound::read_and_publish(&url, &env.amqp, &rabbit.topology, payload_bytes, 4, delete)
            .await?;
    let after = ticks()?;
    anyhow::ensure!(
        read as u64 == written,
        "bound: read {read} of {written} rows"
    );
    anyhow::ensure!(
        !delete
            || Outbox::new(pool.clone())
                .tenants_with_pending()
                .await?
                .is_empty(),
        "bound: rows left after deleting every confirmed one ({written} written)"
    );
    drop_topology(&env.amqp, &rabbit.topology).await?;
    let vacuum = vacuum_ticks(&pool).await?;
    pool.close().await;
    env.drop_database(&url).await?;
    Ok((rate, [0, 1, 2].map(|i| after[i] - before[i]), quiet, vacuum))
}

/// The ceiling/relay pairs at one payload size (3 unless `BENCH_SIZE_RUNS` says), and the bounds.
#[derive(Default)]
pub(crate) struct SizeRuns {
    pub(crate) ceilings: Vec<f64>,
    /// Ceilings of bare messages (no properties but the message id and persistence).
    pub(crate) bare: Vec<f64>,
    pub(crate) relays: Vec<f64>,
    /// Peak RSS of the relay, MB.
    pub(crate) peak: u64,
    /// CPU ticks over the ceilings' runs: RabbitMQ, the publishing client (this process).
    pub(crate) ceiling_cpu: [u64; 2],
    /// CPU ticks over the relay's drains: RabbitMQ, PostgreSQL, the relay.
    pub(crate) relay_cpu: [u64; 3],
    /// Events the relay drained in all (the ceilings published as many).
    pub(crate) events: u64,
    /// The bound's rates without and with deleting what was confirmed (`bound.rs`).
    pub(crate) bounds: [Vec<f64>; 2],
    /// CPU ticks over the bound's runs, without and with the delete: RabbitMQ, PostgreSQL,
    /// the bench (reading and publishing).
    pub(crate) bound_cpu: [[u64; 3]; 2],
    /// PostgreSQL's CPU ticks for the VACUUM each drain left owing (measured after it, so it
    /// lands in no timed run): the relay's runs, the bound's runs that delete.
    pub(crate) vacuum: [u64; 2],
    /// Time spent waiting for both servers to go quiet before timed runs (`servers_quiet`).
    pub(crate) quiet: Duration,
}

/// Rows of section 9.
pub(crate) async fn payload_sizes(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    for (bytes, events, label, database_tls) in [
        (256, mode.raw_events as u32, "256 B", false),
        (64 << 10, mode.large_payload_events * 4, "64 KiB", false),
        (256 << 10, mode.large_payload_events, "256 KiB", false),
        (
            256 << 10,
            mode.large_payload_events,
            "256 KiB, PostgreSQL over TLS",
            true,
        ),
    ] {
        // `BENCH_SIZE=<label>` runs one row of the section (for example `256 KiB`).
        if std::env::var("BENCH_SIZE").is_ok_and(|only| only != label) {
            continue;
        }
        let runs = payload_size(env, bytes, events, database_tls).await?;
        let (ceilings, relays, peak) = (runs.ceilings, runs.relays, runs.peak);
        let ratios: Vec<f64> = relays.iter().zip(&ceilings).map(|(r, c)| r / c).collect();
        let bare_ratios: Vec<f64> = relays.iter().zip(&runs.bare).map(|(r, c)| r / c).collect();
        // CPU per 1,000 events, in ms (a tick is 10 ms).
        let per_k = |ticks: u64| ticks as f64 * 10.0 * 1_000.0 / runs.events.max(1) as f64;
        let [c_rabbit, c_client] = runs.ceiling_cpu.map(per_k);
        let [r_rabbit, r_postgres, r_relay] = runs.relay_cpu.map(per_k);
        row(
            &format!("9. {label}: CPU ms per 1,000 events, ceiling -> relay"),
            format!(
                "{:.0} ({c_rabbit:.0} RabbitMQ + {c_client:.0} client) -> {:.0} ({r_rabbit:.0} RabbitMQ + {r_postgres:.0} PostgreSQL + {r_relay:.0} relay), then {:.0} for the VACUUM it owes",
                c_rabbit + c_client,
                r_rabbit + r_postgres + r_relay,
                per_k(runs.vacuum[0])
            ),
            &format!(
                "summed over the {} runs from /proc; the machine has 2 cores for all of it; before each timed run both servers were let go quiet ({:.0} s in all)",
                relays.len(),
                runs.quiet.as_secs_f64()
            ),
        );
        let (c_min, c_med, c_max) = min_median_max(ceilings.clone());
        let (r_min, r_med, r_max) = min_median_max(relays.clone());
        let (q_min, q_med, q_max) = min_median_max(ratios);
        let mb = f64::from(bytes) / 1_048_576.0;
        row(
            &format!("9. {label}: raw ceiling / relay, ev/s (min / median / max)"),
            format!("{c_min:.0} / {c_med:.0} / {c_max:.0} -> {r_min:.0} / {r_med:.0} / {r_max:.0}"),
            &format!(
                "{events} incompressible events per run, {} runs; relay median {:.0} MB/s; {}",
                ceilings.len(),
                r_med * mb,
                if database_tls {
                    "the relay reads PostgreSQL over TLS (sslmode=prefer, the default), the ceiling speaks plain AMQP"
                } else {
                    "plain TCP on loopback for both (sslmode=disable, amqp://)"
                }
            ),
        );
        row(
            &format!("9. {label}: relay / ceiling ratio (min / median / max)"),
            format!("{q_min:.2} / {q_med:.2} / {q_max:.2}"),
            if bytes >= 64 << 10 {
                "target >= 0.7"
            } else {
                "target >= 0.8; the ceiling writes the same properties and headers as the relay"
            },
        );
        let (b_min, b_med, b_max) = min_median_max(bare_ratios);
        let (bare_min, bare_med, bare_max) = min_median_max(runs.bare);
        row(
            &format!("9. {label}: relay / ceiling of bare messages (min / median / max)"),
            format!("{b_min:.2} / {b_med:.2} / {b_max:.2}"),
            &format!(
                "the ceiling without the contract's headers: {bare_min:.0} / {bare_med:.0} / {bare_max:.0} ev/s, for reference"
            ),
        );
        for (index, name) in ["no retirement", "deleting what was confirmed"]
            .into_iter()
            .enumerate()
        {
            if runs.bounds[index].is_empty() {
                continue;
            }
            let ratios: Vec<f64> = runs.bounds[index]
                .iter()
                .zip(&ceilings)
                .map(|(b, c)| b / c)
                .collect();
            let (q_min, q_med, q_max) = min_median_max(ratios);
            let (_, b_med, _) = min_median_max(runs.bounds[index].clone());
            let [b_rabbit, b_postgres, b_client] = runs.bound_cpu[index].map(per_k);
            row(
                &format!(
                    "9. {label}: bound, read and publish by hand, {name} / ceiling (min / median / max)"
                ),
                format!("{q_min:.2} / {q_med:.2} / {q_max:.2}"),
                &format!(
                    "no relay: the same backlog read by one connection in the relay's batches (1,000 events or 4 MiB) and published on 4, 2 batches each in flight (bound.rs); median {b_med:.0} ev/s; CPU ms per 1,000 events {:.0} ({b_rabbit:.0} RabbitMQ + {b_postgres:.0} PostgreSQL + {b_client:.0} client){}; what a relay can hope for here",
                    b_rabbit + b_postgres + b_client,
                    if index == 1 {
                        format!(", then {:.0} for the VACUUM it owes", per_k(runs.vacuum[1]))
                    } else {
                        String::new()
                    }
                ),
            );
        }
        row(
            &format!("9. {label}: relay peak RSS"),
            format!("{peak} MB"),
            &format!(
                "standalone relay, highest of the {} runs; target < 150 MB",
                relays.len()
            ),
        );
    }
    Ok(())
}

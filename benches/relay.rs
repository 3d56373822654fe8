//! The relay benchmark, side by side in one run on this machine's PostgreSQL and RabbitMQ.
//!
//! `cargo bench --bench relay` (full) or `cargo bench --bench relay -- --quick` (under a minute).
//! Prints a table and writes it to `benches/results.md` with the date, commit and machine:
//! 1. raw ceiling: pipelined confirmed publishes, no database (1 channel, and one per shard);
//! 2. seed-style baseline: drain 100, publish-and-await one at a time, ack;
//! 3. this relay draining a pre-filled backlog (50 tenants x 20 runs);
//! 4. commit-to-confirm latency at a steady 2,000 events/s from 8 concurrent host writers,
//!    woken by NOTIFY, the in-process waker, and NOTIFY after the commit (4a: the host's
//!    commits/s with each, unpaced; `BENCH_ONLY=wakecost` runs 4a alone);
//! 5. peak RSS of the standalone relay draining a small and a 10x larger backlog;
//! 6. database queries per second and CPU of the relay while 1,000 tenants sit idle;
//! 13. classic, quorum and stream queues on one node and on a private 3-node cluster, and a
//!     consumer group replaying a stream (`BENCH_ONLY=queues` runs this section alone); 13b:
//!     on RabbitMQ 4.0, streams written with and without a shard per partition
//!     (`BENCH_ONLY=streamshards` runs it alone).
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use distribution::broker::{
    BoxFuture, Group, OnReport, Partition, Publisher, QueueType, RabbitConfig, RabbitPublisher,
    Topology,
};
use distribution::store::{
    self, BranchId, BranchKey, EventKey, EventKind, EventType, Fence, Intent, IntentWriter, Lsn,
    Metadata, Outbox, OutboxEvent, RunId, TenantId,
};
use distribution::{Relay, RelayConfig};
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use sqlx::{Connection, PgConnection, PgPool};

const PAYLOAD_BYTES: u32 = 256;

struct Mode {
    name: &'static str,
    raw_events: usize,
    baseline_events: u32,
    backlog_per_run: u32,
    latency_secs: u64,
    rss_small_per_run: u32,
    rss_large_per_run: u32,
    idle_tenants: u32,
    idle_secs: u64,
    /// Events per run at 256 KiB (four times as many at 64 KiB).
    large_payload_events: u32,
    /// Tenants of section 11.
    many_tenants: u32,
}

const QUICK: Mode = Mode {
    name: "quick",
    // Same volume as the relay's backlog (50 x 20 x 20).
    raw_events: 20_000,
    baseline_events: 3_000,
    backlog_per_run: 20,
    latency_secs: 4,
    rss_small_per_run: 10,
    rss_large_per_run: 100,
    idle_tenants: 1_000,
    idle_secs: 6,
    large_payload_events: 400,
    many_tenants: 10_000,
};

const FULL: Mode = Mode {
    name: "full",
    // Same volume as the relay's backlog (50 x 20 x 200): RabbitMQ slows as queues deepen, so
    // a smaller ceiling run would flatter the ceiling.
    raw_events: 200_000,
    baseline_events: 10_000,
    backlog_per_run: 200,
    latency_secs: 20,
    rss_small_per_run: 100,
    rss_large_per_run: 1_000,
    idle_tenants: 1_000,
    idle_secs: 20,
    large_payload_events: 1_000,
    many_tenants: 100_000,
};

fn unique(label: &str) -> String {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or_default();
    format!("{label}_{}_{micros}", std::process::id())
}

struct Env {
    admin: PgConnection,
    server: String,
    /// One broker address, or a cluster's, comma-separated (section 13).
    amqp: String,
    databases: Vec<String>,
    /// The queue type of every topology made (section 13 changes it).
    queue_type: QueueType,
}

impl Env {
    async fn database(&mut self, label: &str) -> Result<(PgPool, String)> {
        let name = unique(&format!("relay_bench_{label}"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut self.admin)
            .await?;
        self.databases.push(name.clone());
        let url = format!("{}/{name}", self.server);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await?;
        store::migrate(&pool).await?;
        Ok((pool, url))
    }

    fn rabbit(&self, label: &str, partitions: u16) -> Result<RabbitConfig> {
        let topology = Topology::new(&unique(&format!("relay-bench-{label}")), partitions)?
            .with_queue_type(self.queue_type);
        Ok(RabbitConfig::new(self.amqp.clone(), topology)?)
    }

    fn relay_config(&self, url: &str, rabbit: &RabbitConfig) -> RelayConfig {
        let mut config = RelayConfig::new(url, self.amqp.clone());
        config.topology = rabbit.topology.exchange().to_string();
        config.partitions = rabbit.topology.partitions();
        config.queue_type = self.queue_type;
        if let Some(window) = std::env::var("BENCH_WINDOW")
            .ok()
            .and_then(|w| w.parse().ok())
        {
            config.supervisor.drainer.max_batches_in_flight = window;
        }
        config
    }

    /// Writes back every dirty page of earlier work (`CHECKPOINT`), so a checkpoint of an
    /// earlier run's writes (a fill, a drain) never lands in the next timed run, on either side.
    async fn checkpoint(&mut self) -> Result<()> {
        sqlx::raw_sql("CHECKPOINT").execute(&mut self.admin).await?;
        Ok(())
    }

    async fn cleanup(&mut self) {
        for name in std::mem::take(&mut self.databases) {
            let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
                .execute(&mut self.admin)
                .await;
        }
    }
}

/// The first of `amqp`'s comma-separated addresses (plain lapin takes one).
fn first_address(amqp: &str) -> &str {
    amqp.split(',').next().unwrap_or(amqp).trim()
}

async fn declare(amqp: &str, topology: &Topology) -> Result<()> {
    let connection =
        lapin::Connection::connect(first_address(amqp), lapin::ConnectionProperties::default())
            .await?;
    topology
        .declare(&connection.create_channel().await?)
        .await?;
    Ok(())
}

async fn drop_topology(amqp: &str, topology: &Topology) -> Result<()> {
    let connection =
        lapin::Connection::connect(first_address(amqp), lapin::ConnectionProperties::default())
            .await?;
    let channel = connection.create_channel().await?;
    for group in topology.declared_groups() {
        for index in 0..topology.partitions() {
            channel
                .queue_delete(
                    topology.queue_of(group, Partition(index)),
                    QueueDeleteOptions::default(),
                )
                .await?;
        }
        channel
            .queue_delete(
                topology.dead_letter_queue_of(group),
                QueueDeleteOptions::default(),
            )
            .await?;
    }
    channel
        .exchange_delete(
            topology.exchange().clone(),
            ExchangeDeleteOptions::default(),
        )
        .await?;
    Ok(())
}

fn synthetic_events(n: usize) -> Vec<OutboxEvent> {
    (0..n)
        .map(|index| {
            let (tenant, run, lsn) = (index % 50, (index / 50) % 20, index / 1000 + 1);
            OutboxEvent {
                key: EventKey {
                    branch: BranchKey::new(
                        TenantId::new(format!("t{tenant}")).expect("valid id"),
                        RunId::new(format!("r{run}")).expect("valid id"),
                        BranchId::new("main").expect("valid id"),
                    ),
                    lsn: Lsn::new(lsn as u64),
                },
                prev_lsn: Lsn::new(lsn as u64 - 1),
                base_lsn: Lsn::ZERO,
                payload: vec![b'x'; PAYLOAD_BYTES as usize],
                created_at: chrono::Utc::now(),
                kind: EventKind::Intent,
                parent: None,
                meta: Default::default(),
            }
        })
        .collect()
}

/// Section 1: confirmed publishes straight from memory over `channels` connections, through
/// the relay's own adapter, a batch's confirms awaited before the next (section 9 measures the
/// truly pipelined ceiling on plain lapin).
async fn raw_ceiling(
    rabbit: &RabbitConfig,
    events: &[OutboxEvent],
    channels: usize,
) -> Result<f64> {
    let mut warmup = RabbitPublisher::new(rabbit.clone());
    anyhow::ensure!(
        warmup.publish(&events[..1]).await.fault.is_none(),
        "broker not reachable"
    );
    let per_channel = events.len().div_ceil(channels);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for slice in events.chunks(per_channel) {
        let (rabbit, slice) = (rabbit.clone(), slice.to_vec());
        tasks.push(tokio::spawn(async move {
            let mut publisher = RabbitPublisher::new(rabbit);
            let mut accepted = 0;
            for batch in slice.chunks(1000) {
                accepted += publisher.publish(batch).await.accepted();
            }
            accepted
        }));
    }
    let mut accepted = 0;
    for task in tasks {
        accepted += task.await?;
    }
    anyhow::ensure!(
        accepted == events.len(),
        "raw ceiling: only {accepted} of {} accepted",
        events.len()
    );
    Ok(events.len() as f64 / started.elapsed().as_secs_f64())
}

/// The broker's best effort at one payload size, outside the relay's adapter: `connections`
/// connections, each a confirming channel that writes without waiting for confirms (200 writes
/// queued before any is awaited), with up to 2,000 confirms outstanding (awaited oldest
/// first), plain lapin. Each message carries what the
/// relay's carries for an intent without metadata (WIRE.md's properties and headers), so the
/// ceiling is the same work done with nothing else in the way; `raw_pipelined_with` takes other
/// properties (none at all: what the broker does for bare messages).
async fn raw_pipelined(
    amqp: &str,
    topology: &Topology,
    events: usize,
    payload: &[u8],
    connections: usize,
) -> Result<f64> {
    raw_pipelined_with(
        amqp,
        topology,
        events,
        payload,
        connections,
        wire_like_properties(None),
    )
    .await
}

/// [`raw_pipelined`], each message with `base`'s properties (and its own message id).
async fn raw_pipelined_with(
    amqp: &str,
    topology: &Topology,
    events: usize,
    payload: &[u8],
    connections: usize,
    base: lapin::BasicProperties,
) -> Result<f64> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::types::ShortString;
    use std::collections::VecDeque;
    let per_connection = events.div_ceil(connections);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for index in 0..connections {
        let (amqp, topology, payload, base) = (
            amqp.to_owned(),
            topology.clone(),
            payload.to_vec(),
            base.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let connection = lapin::Connection::connect(
                first_address(&amqp),
                lapin::ConnectionProperties::default(),
            )
            .await?;
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            let mut outstanding = VecDeque::new();
            let mut acked = 0usize;
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            // Writes queued 200 at a time before any is awaited (lapin queues a publish's
            // frames on its first poll and resolves it once its I/O thread wrote them), where
            // the relay's adapter awaits each write before queueing the next.
            for first_n in (0..per_connection).step_by(200) {
                let mut writes = Vec::new();
                for n in first_n..(first_n + 200).min(per_connection) {
                    let partition =
                        Partition(((index + n) % usize::from(topology.partitions())) as u16);
                    let properties = base
                        .clone()
                        .with_delivery_mode(2)
                        .with_message_id(ShortString::from(format!("raw-{index}-{n}")));
                    let mut publish = Box::pin(channel.basic_publish(
                        topology.exchange().clone(),
                        topology.routing_key(partition),
                        options,
                        &payload,
                        properties,
                    ));
                    let first = std::future::poll_fn(|cx| {
                        std::task::Poll::Ready(publish.as_mut().poll(cx))
                    })
                    .await;
                    writes.push((first, publish));
                }
                for (first, publish) in writes {
                    let confirm = match first {
                        std::task::Poll::Ready(confirm) => confirm?,
                        std::task::Poll::Pending => publish.await?,
                    };
                    outstanding.push_back(confirm);
                    if outstanding.len() >= 2_000
                        && let Some(oldest) = outstanding.pop_front()
                    {
                        acked += usize::from(oldest.await?.is_ack());
                    }
                }
            }
            for confirm in outstanding {
                acked += usize::from(confirm.await?.is_ack());
            }
            anyhow::Ok(acked)
        }));
    }
    let mut acked = 0;
    for task in tasks {
        acked += task.await??;
    }
    anyhow::ensure!(
        acked == per_connection * connections,
        "raw ceiling: {acked} acked"
    );
    Ok(acked as f64 / started.elapsed().as_secs_f64())
}

/// Section 9: at each payload size, the pipelined raw ceiling and the standalone relay
/// draining the same volume, 3 times in turn; returns (ceilings, relay rates, peak RSS MB).
/// The ceiling speaks plain AMQP on loopback; with `database_tls` false the relay reads
/// PostgreSQL in plain text too (`sslmode=disable`), else as configured by default
/// (`sslmode=prefer`: TLS when the server offers it, as this machine's does).
async fn payload_size(
    env: &mut Env,
    payload_bytes: u32,
    events: u32,
    database_tls: bool,
) -> Result<SizeRuns> {
    let payload = store::fixtures::Incompressible::default().bytes(payload_bytes as usize);
    let mut runs = SizeRuns::default();
    for _ in 0..3 {
        let rabbit = env.rabbit("size-raw", 8)?;
        let mut declarer = RabbitPublisher::new(rabbit.clone());
        anyhow::ensure!(
            declarer.publish(&synthetic_events(1)).await.fault.is_none(),
            "broker not reachable"
        );
        env.checkpoint().await?;
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
        let addr = format!("127.0.0.1:{}", free_port()?);
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
        pool.close().await;
    }
    Ok(runs)
}

/// Three ceiling/relay pairs at one payload size.
#[derive(Default)]
struct SizeRuns {
    ceilings: Vec<f64>,
    /// Ceilings of bare messages (no properties but the message id and persistence).
    bare: Vec<f64>,
    relays: Vec<f64>,
    /// Peak RSS of the relay, MB.
    peak: u64,
    /// CPU ticks over the ceilings' runs: RabbitMQ, the publishing client (this process).
    ceiling_cpu: [u64; 2],
    /// CPU ticks over the relay's drains: RabbitMQ, PostgreSQL, the relay.
    relay_cpu: [u64; 3],
    /// Events the relay drained in all (the ceilings published as many).
    events: u64,
}

/// CPU ticks (user + system, 1/100 s) so far of every process whose name starts with `name`
/// (`beam` for RabbitMQ, `postgres` for the server and its backends): processes that end
/// meanwhile are not counted, so this is a lower bound.
fn cpu_ticks_named(name: &str) -> u64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let (head, tail) = stat.rsplit_once(')')?;
            let comm = head.split_once('(')?.1;
            if !comm.starts_with(name) {
                return None;
            }
            let fields: Vec<&str> = tail.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

fn min_median_max(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    (
        values[0],
        values[values.len() / 2],
        values[values.len() - 1],
    )
}

/// Rows of section 9.
async fn payload_sizes(
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
                "{:.0} ({c_rabbit:.0} RabbitMQ + {c_client:.0} client) -> {:.0} ({r_rabbit:.0} RabbitMQ + {r_postgres:.0} PostgreSQL + {r_relay:.0} relay)",
                c_rabbit + c_client,
                r_rabbit + r_postgres + r_relay
            ),
            "summed over the 3 runs from /proc; the machine has 2 cores for all of it",
        );
        let (c_min, c_med, c_max) = min_median_max(ceilings);
        let (r_min, r_med, r_max) = min_median_max(relays);
        let (q_min, q_med, q_max) = min_median_max(ratios);
        let mb = f64::from(bytes) / 1_048_576.0;
        row(
            &format!("9. {label}: raw ceiling / relay, ev/s (min / median / max)"),
            format!("{c_min:.0} / {c_med:.0} / {c_max:.0} -> {r_min:.0} / {r_med:.0} / {r_max:.0}"),
            &format!(
                "{events} incompressible events per run, 3 runs; relay median {:.0} MB/s; {}",
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
        row(
            &format!("9. {label}: relay peak RSS"),
            format!("{peak} MB"),
            "standalone relay, highest of the 3 runs; target < 150 MB",
        );
    }
    Ok(())
}

/// Rows of sections 10 and 11.
async fn scale(env: &mut Env, mode: &Mode, row: &mut impl FnMut(&str, String, &str)) -> Result<()> {
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

/// Waits until the outbox is empty. Polls with the skip scan (a few index probes), not with
/// `backlog()`: a GROUP BY over a large backlog every few ms would load the very database the
/// relay under measurement needs.
async fn wait_drained(outbox: &Outbox, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    while !outbox.tenants_with_pending().await?.is_empty() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "backlog not drained within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// 2. The seed's loop: drain 100, publish each and await its confirm, ack.
async fn seed_style(outbox: &Outbox, rabbit: &RabbitConfig, tenants: &[TenantId]) -> Result<f64> {
    let mut publisher = RabbitPublisher::new(rabbit.clone());
    let started = Instant::now();
    let mut shipped = 0u64;
    loop {
        let mut drained_any = false;
        for tenant in tenants {
            let batch = outbox.drain_outbox(tenant, 100).await?;
            drained_any |= !batch.is_empty();
            let mut acks = Vec::with_capacity(batch.len());
            for event in batch {
                if !publisher
                    .publish(std::slice::from_ref(&event))
                    .await
                    .outcomes[0]
                    .is_accepted()
                {
                    break;
                }
                acks.push(event.key);
            }
            shipped += outbox.ack_outbox(&acks).await?;
        }
        if !drained_any {
            break;
        }
    }
    Ok(shipped as f64 / started.elapsed().as_secs_f64())
}

/// When each event was first handed to a publisher, and the size of its batch.
type SentAt = Arc<Mutex<HashMap<EventKey, (Instant, usize)>>>;

/// Records when the broker confirmed each event (first confirm wins), for latency. The time is
/// taken when the whole batch's confirms are in, so it never understates a confirm.
struct TimedPublisher {
    inner: RabbitPublisher,
    confirmed: Arc<Mutex<HashMap<EventKey, Instant>>>,
    /// When each event was first handed to the publisher, and its batch's size: recorded for
    /// `BENCH_DUMP` only, so a plain run's publish path carries nothing more.
    sent: Option<SentAt>,
}

impl Publisher for TimedPublisher {
    fn send<'a>(
        &'a mut self,
        events: &'a [OutboxEvent],
        fence: &'a Fence,
        done: OnReport,
    ) -> BoxFuture<'a, ()> {
        let keys: Vec<EventKey> = events.iter().map(|event| event.key.clone()).collect();
        if let Some(sent) = &self.sent {
            let now = Instant::now();
            let mut sent = sent.lock().unwrap_or_else(|poison| poison.into_inner());
            for key in &keys {
                sent.entry(key.clone()).or_insert((now, keys.len()));
            }
        }
        let confirmed = self.confirmed.clone();
        let timed: OnReport = Box::new(move |report| {
            let now = Instant::now();
            {
                let mut confirmed = confirmed
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner());
                for (key, outcome) in keys.into_iter().zip(&report.outcomes) {
                    if outcome.is_accepted() {
                        confirmed.entry(key).or_insert(now);
                    }
                }
            }
            done(report);
        });
        self.inner.send(events, fence, timed)
    }
}

/// Section 4's rows for one wake-up path: the relay's p50 / p99 against the floor measured in
/// the same run, as ratios, and, in the value itself, the rate the writers reached when it fell
/// short of the offered one (a saturated machine's latency is not the relay's).
fn latency_rows(row: &mut impl FnMut(&str, String, &str), label: &str, measured: &Latency) {
    let (floor_p50, floor_p99) = measured.floor;
    let offered = latency_rate();
    let short = if measured.rate < 0.95 * f64::from(offered) {
        format!(
            "; writers reached only {:.0} of {offered} events/s offered",
            measured.rate
        )
    } else {
        String::new()
    };
    row(
        &format!("4. commit-to-confirm p50 / p99 ({label})"),
        format!(
            "{:.1} / {:.1} ms = {:.1}x / {:.1}x the floor ({floor_p50:.1} / {floor_p99:.1} ms){short}",
            measured.p50,
            measured.p99,
            measured.p50 / floor_p50.max(f64::EPSILON),
            measured.p99 / floor_p99.max(f64::EPSILON),
        ),
        &format!(
            "{} events; floor: one outbox read + one confirmed publish under the same load, every 10 ms; as the events met it (the probe running at each commit) {:.1} / {:.1} ms; PostgreSQL {}; {}targets p50 <= 1.5x, p99 <= 2x",
            measured.events,
            measured.floor_at_commits.0,
            measured.floor_at_commits.1,
            if latency_in_plain_text() {
                "in plain text (BENCH_PG_TLS=off)"
            } else {
                "over TLS (sslmode=prefer, the default)"
            },
            measured
                .stolen
                .map(|stolen| format!("hypervisor steal {stolen:.1} % of CPU time; "))
                .unwrap_or_default()
        ),
    );
    row(
        &format!("4. commit-to-confirm max ({label})"),
        format!("{:.1} ms", measured.max),
        "",
    );
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

struct Latency {
    p50: f64,
    p99: f64,
    max: f64,
    events: usize,
    rate: f64,
    /// The floor under the same load: one outbox read plus one confirmed publish (p50, p99),
    /// over the probes (sampled in time: a stall weighs what it lasts).
    floor: (f64, f64),
    /// The same floor as the events met it: per event, the probe running at its commit (or
    /// the next to start); p50, p99. Sampled by load: a stall weighs the events it holds, as
    /// it does in the relay's own percentiles.
    floor_at_commits: (f64, f64),
    /// Percent of the machine's CPU time the hypervisor took (`steal` in `/proc/stat`) while
    /// the writers ran; `None` where there is no `/proc/stat`.
    stolen: Option<f64>,
}

/// The machine's CPU time so far, in ticks: stolen by the hypervisor, and in all.
fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice, counted in user]
    Some((*ticks.get(7)?, ticks.iter().take(8).sum()))
}

/// The floor each event met: the duration of the probe running at its commit, else of the
/// next probe to start (`probes` in start order; `commits` as instants).
fn floor_at(probes: &[(Instant, f64)], commits: impl Iterator<Item = Instant>) -> Vec<f64> {
    let mut met: Vec<f64> = commits
        .filter_map(|committed| {
            let next = probes.partition_point(|(start, _)| *start <= committed);
            let running = next
                .checked_sub(1)
                .map(|i| probes[i])
                .filter(|(start, ms)| *start + Duration::from_secs_f64(ms / 1000.0) >= committed);
            running.or(probes.get(next).copied()).map(|(_, ms)| ms)
        })
        .collect();
    met.sort_by(f64::total_cmp);
    met
}

/// Offered load of the latency measurement, events/s over 8 writers: 2,000 unless
/// `BENCH_RATE` says otherwise (to see the relay's latency on an unloaded machine).
fn latency_rate() -> u32 {
    std::env::var("BENCH_RATE")
        .ok()
        .and_then(|rate| rate.parse().ok())
        .unwrap_or(2_000)
        .max(8)
}

/// Whether the latency rows read PostgreSQL in plain text (`BENCH_PG_TLS=off`) rather than
/// over TLS (`sslmode=prefer`, the default, as the machine's server offers it).
fn latency_in_plain_text() -> bool {
    std::env::var("BENCH_PG_TLS").is_ok_and(|tls| tls == "off")
}

/// How the host wakes the relay after a commit.
#[derive(Clone, Copy, PartialEq)]
enum Wake {
    /// `NOTIFY` inside the host transaction (the default writer).
    Notify,
    /// No NOTIFY; the embedded host calls `RelayWaker::wake` after its commit.
    Waker,
    /// No NOTIFY in the transaction; the host calls `IntentWriter::wake_relays` after its
    /// commit (what a host of a standalone relay can do).
    AfterCommit,
}

impl Wake {
    fn label(self) -> &'static str {
        match self {
            Wake::Notify => "NOTIFY",
            Wake::Waker => "in-process waker",
            Wake::AfterCommit => "NOTIFY after the commit",
        }
    }
}

/// Who writes during a latency measurement, and beside what.
struct Load {
    /// Writers (each its own run), spread over `tenants` tenants named `<prefix><n>`.
    writers: u32,
    tenants: u32,
    prefix: &'static str,
    /// Events per second over all writers.
    rate: u32,
    /// Intents already waiting for one hot tenant (20 runs) when the writers start.
    hot_backlog: u32,
    /// Batches this small take the express lane (0: no lane).
    express_max_events: u32,
    /// Consumer groups bound (each its own queues); 0: the unnamed group alone.
    groups: u16,
}

impl Load {
    /// Section 4: 8 writers over 4 tenants at `latency_rate()`.
    fn busy() -> Self {
        Self {
            writers: 8,
            tenants: 4,
            prefix: "lat",
            rate: latency_rate(),
            hot_backlog: 0,
            express_max_events: 32,
            groups: 0,
        }
    }

    /// Section 7: 20 quiet tenants at 10 events/s each, beside a hot backlog or not.
    fn quiet(hot_backlog: u32, express_max_events: u32) -> Self {
        Self {
            writers: 20,
            tenants: 20,
            prefix: "quiet",
            rate: 200,
            hot_backlog,
            express_max_events,
            groups: 0,
        }
    }
}

/// `n` named consumer groups (`g0`..), or the unnamed group alone for 0.
fn groups(n: u16) -> Vec<Group> {
    if n == 0 {
        return vec![Group::Default];
    }
    (0..n)
        .map(|g| Group::parse(&format!("g{g}")).expect("valid group"))
        .collect()
}

/// Latency from each host commit to its broker confirm, for the writers of `load`, and the
/// floor (one outbox read + one confirmed publish) timed under the same load. Also returns the
/// hot tenant's intents still waiting when the writers finished (it must still be draining).
async fn latency(env: &mut Env, mode: &Mode, wake: Wake, load: &Load) -> Result<(Latency, i64)> {
    let (pool, url) = env.database("latency").await?;
    // PostgreSQL over TLS (`sslmode=prefer`, the default, as the machine's server offers it)
    // unless `BENCH_PG_TLS=off`: the host's writers, the relay and the floor's probe alike.
    let (pool, url) = if latency_in_plain_text() {
        let url = format!("{url}?sslmode=disable");
        let plain = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await?;
        pool.close().await;
        (plain, url)
    } else {
        (pool, url)
    };
    let mut rabbit = env.rabbit("latency", 8)?;
    rabbit.topology = rabbit.topology.declaring(groups(load.groups));
    if load.hot_backlog > 0 {
        store::fixtures::fill_backlog(&pool, "hot", 1, 20, load.hot_backlog / 20, PAYLOAD_BYTES)
            .await?;
    }
    let confirmed: Arc<Mutex<HashMap<EventKey, Instant>>> = Arc::default();
    let sent: Option<SentAt> = std::env::var_os("BENCH_DUMP").map(|_| Arc::default());
    let (factory_rabbit, factory_confirmed, factory_sent) =
        (rabbit.clone(), confirmed.clone(), sent.clone());
    let mut config = env.relay_config(&url, &rabbit);
    config.supervisor.drainer.express_max_events = load.express_max_events;
    config.groups = groups(load.groups);
    let relay = Relay::start_with(
        config,
        Arc::new(move |_| {
            Box::new(TimedPublisher {
                inner: RabbitPublisher::new(factory_rabbit.clone()),
                confirmed: factory_confirmed.clone(),
                sent: factory_sent.clone(),
            }) as Box<dyn Publisher>
        }),
    )
    .await?;
    let outbox = Outbox::new(pool.clone());
    // Measure a relay in its steady state, not one starting up: every writer's branch ships
    // its first intent (Lsn 1) before the clock starts. That waits for the relay to hold each
    // tenant's lease bucket (a relay's first heartbeat claims only half the buckets,
    // `LeasePlan::first_step`; the rest come a quarter heartbeat later), for each tenant's drainer and
    // for the connection of the publisher that ships each branch's small batches (the express
    // lane of its shard; a bulk lane still connects on its first batch).
    let (writer_count, rate) = (load.writers, load.rate.max(load.writers));
    let mut keys = Vec::new();
    for writer_index in 0..writer_count {
        let tenant = format!("{}{}", load.prefix, writer_index % load.tenants.max(1));
        let key = BranchKey::new(
            TenantId::new(tenant)?,
            RunId::new(format!("w{writer_index}"))?,
            BranchId::new("main")?,
        );
        let writer = IntentWriter::default().with_notify(wake == Wake::Notify);
        writer.open_run(&mut *pool.acquire().await?, &key).await?;
        let mut tx = pool.begin().await?;
        writer.append(&mut tx, &key, Lsn::new(1), b"warm").await?;
        tx.commit().await?;
        match wake {
            Wake::Waker => relay.waker().wake(&key.tenant),
            Wake::AfterCommit => {
                writer
                    .wake_relays(&mut *pool.acquire().await?, &key.tenant)
                    .await?
            }
            Wake::Notify => {}
        }
        keys.push(key);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for key in &keys {
        while outbox.tenant_backlog(&key.tenant).await?.pending > 0 {
            anyhow::ensure!(Instant::now() < deadline, "warm-up did not ship in 30 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    let ticks_before = machine_ticks();
    let started = Instant::now();
    let mut writers = Vec::new();
    for key in keys {
        let pool = pool.clone();
        let seconds = mode.latency_secs;
        let waker = relay.waker();
        writers.push(tokio::spawn(async move {
            let writer = IntentWriter::default().with_notify(wake == Wake::Notify);
            let mut ticker = tokio::time::interval(Duration::from_secs(writer_count.into()) / rate);
            // Burst: a writer that fell behind catches up, so the offered load stays as set.
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut commits = Vec::new();
            // Lsn 1 was the warm-up.
            for lsn in 2..=(u64::from(rate) / u64::from(writer_count) * seconds + 1) {
                ticker.tick().await;
                let begun = Instant::now();
                let mut tx = pool.begin().await.expect("begin");
                let payload = [b'x'; PAYLOAD_BYTES as usize];
                writer
                    .append(&mut tx, &key, Lsn::new(lsn), &payload)
                    .await
                    .expect("append");
                tx.commit().await.expect("commit");
                let committed = Instant::now();
                let transaction = committed - begun;
                if wake == Wake::Waker || std::env::var_os("BENCH_WAKE_BOTH").is_some() {
                    waker.wake(&key.tenant);
                }
                if wake == Wake::AfterCommit {
                    let mut conn = pool.acquire().await.expect("connection");
                    writer
                        .wake_relays(&mut conn, &key.tenant)
                        .await
                        .expect("wake");
                }
                let event = EventKey {
                    branch: key.clone(),
                    lsn: Lsn::new(lsn),
                };
                commits.push((event, committed, transaction));
            }
            commits
        }));
    }
    // The floor: whatever the design, an event needs at least one outbox read and one confirmed
    // publish after its commit. Time exactly that pair, every 10 ms, under the same load.
    let probe = {
        let (outbox, rabbit) = (Outbox::new(pool.clone()), rabbit.clone());
        let writers_done = writers
            .iter()
            .map(|writer| writer.abort_handle())
            .collect::<Vec<_>>();
        tokio::spawn(async move {
            let mut publisher = RabbitPublisher::new(rabbit);
            let event = synthetic_events(1);
            let tenant = TenantId::new("floor-probe").expect("valid id");
            // Per probe: when it started, and how long it took (ms).
            let mut millis = Vec::new();
            while writers_done.iter().any(|writer| !writer.is_finished()) {
                let started = Instant::now();
                outbox.drain_outbox(&tenant, 1).await.expect("probe read");
                publisher.publish(&event).await;
                millis.push((started, started.elapsed().as_secs_f64() * 1000.0));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            millis
        })
    };
    let mut commits = Vec::new();
    for writer in writers {
        commits.extend(writer.await?);
    }
    let rate = commits.len() as f64 / started.elapsed().as_secs_f64();
    let stolen =
        machine_ticks()
            .zip(ticks_before)
            .map(|((steal, total), (steal_before, total_before))| {
                100.0 * (steal - steal_before) as f64 / (total - total_before).max(1) as f64
            });
    let hot_left = if load.hot_backlog > 0 {
        outbox
            .tenant_backlog(&TenantId::new("hot0")?)
            .await?
            .pending as i64
    } else {
        0
    };
    let probes = probe.await?;
    let mut floor: Vec<f64> = probes.iter().map(|(_, ms)| *ms).collect();
    floor.sort_by(f64::total_cmp);
    let met = floor_at(&probes, commits.iter().map(|(_, committed, _)| *committed));
    // Every measured event confirmed (the hot backlog may still be draining: not waited for).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = {
            let confirmed = confirmed
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            commits.iter().all(|(key, ..)| confirmed.contains_key(key))
        };
        if done || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.abort().await;
    let mut millis: Vec<f64> = {
        let confirmed = confirmed
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        commits
            .iter()
            .map(|(key, committed, _)| {
                confirmed.get(key).map_or(f64::INFINITY, |at| {
                    at.saturating_duration_since(*committed).as_secs_f64() * 1000.0
                })
            })
            .collect()
    };
    if let (Ok(path), Some(sent)) = (std::env::var("BENCH_DUMP"), &sent) {
        // Per event: seconds from the start at its commit, branch, Lsn, commit-to-confirm ms,
        // commit-to-publisher ms, the size of the batch it went in, and how long its writer's
        // transaction took (ms). Beside it, `.floor`: per probe, its start (seconds from the
        // start) and how long it took (ms).
        let mut out = String::new();
        let sent = sent.lock().unwrap_or_else(|poison| poison.into_inner());
        for ((key, committed, transaction), ms) in commits.iter().zip(&millis) {
            let (to_publisher, batch) = sent.get(key).map_or((f64::INFINITY, 0), |(at, batch)| {
                (
                    at.saturating_duration_since(*committed).as_secs_f64() * 1000.0,
                    *batch,
                )
            });
            let _ = writeln!(
                out,
                "{:.3} {} {} {ms:.2} {to_publisher:.2} {batch} {:.2}",
                committed.duration_since(started).as_secs_f64(),
                key.branch,
                key.lsn,
                transaction.as_secs_f64() * 1000.0
            );
        }
        let name = match wake {
            Wake::Notify => "notify",
            Wake::Waker => "waker",
            Wake::AfterCommit => "after",
        };
        std::fs::write(format!("{path}.{name}"), out)?;
        let mut out = String::new();
        for (at, ms) in &probes {
            let _ = writeln!(
                out,
                "{:.3} {ms:.2}",
                at.saturating_duration_since(started).as_secs_f64()
            );
        }
        std::fs::write(format!("{path}.{name}.floor"), out)?;
    }
    millis.sort_by(f64::total_cmp);
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    Ok((
        Latency {
            p50: percentile(&millis, 0.5),
            p99: percentile(&millis, 0.99),
            max: millis.last().copied().unwrap_or_default(),
            events: commits.len(),
            rate,
            floor: (percentile(&floor, 0.5), percentile(&floor, 0.99)),
            floor_at_commits: (percentile(&met, 0.5), percentile(&met, 0.99)),
            stolen,
        },
        hot_left,
    ))
}

/// Full metadata, as a host that uses every field sets it (about 300 bytes of JSON).
fn full_metadata(step: u64) -> Metadata {
    Intent::new(b"")
        .event_type(EventType::new("order.created").expect("valid type"))
        .content_type("application/json")
        .correlation_id(format!("req-{step}"))
        .causation_id(format!("cmd-{step}"))
        .header("region", "eu-west-1")
        .header("actor", "agent-7")
        .header("schema", "v3")
        .trace(
            format!(
                "00-{:032x}-{:016x}-01",
                0x4bf9_2f35_77b3_4da6_u128 + u128::from(step),
                step + 1
            ),
            Some("vendor=t61rcWkgMzE".into()),
        )
        .metadata()
        .clone()
}

/// The properties the relay writes for an intent (`broker::encode`), with `meta`'s fields or
/// without.
fn wire_like_properties(meta: Option<&Metadata>) -> lapin::BasicProperties {
    let mut event = synthetic_events(1).remove(0);
    event.meta = meta.cloned().unwrap_or_default();
    distribution::broker::encode(&event, distribution::broker::WireMode::Plain)
}

/// Section 4a: the host's commits/s at 8 unpaced writers (one intent per transaction) for each
/// way of waking relays, side by side (3 rounds, the order rotated each round; median of 3).
/// `BENCH_ONLY=wakecost` runs this alone.
async fn wake_costs(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let seconds = mode.latency_secs.min(10);
    let order = [Wake::Notify, Wake::AfterCommit, Wake::Waker];
    let mut rates: [Vec<f64>; 3] = Default::default();
    for round in 0..3 {
        for step in 0..3 {
            let index = (round + step) % 3;
            rates[index].push(append_rate(env, false, order[index], 8, seconds).await?);
        }
    }
    let [inside, after, none] = rates.map(min_median_max);
    let cell = |(low, median, high): (f64, f64, f64)| {
        format!("{median:.0} commits/s ({low:.0}-{high:.0})")
    };
    row(
        "4a. host append, NOTIFY in the transaction (the default)",
        cell(inside),
        "8 writers, one intent per transaction, unpaced; median of 3 rounds (range), order rotated",
    );
    row(
        "4a. host append, NOTIFY after the commit (`wake_relays`)",
        cell(after),
        &format!("{:.2}x the default, same rounds", after.1 / inside.1),
    );
    row(
        "4a. host append, no NOTIFY (in-process waker or polling)",
        cell(none),
        &format!("{:.2}x the default, same rounds", none.1 / inside.1),
    );
    Ok(())
}

/// Sections 4a and 12a: commits/s of `writers` unpaced writers for `seconds`, each appending one
/// intent per transaction (full metadata or payload only), waking relays as `wake` says
/// (`Waker`: no SQL wake-up at all). No relay runs: the host's own cost.
async fn append_rate(
    env: &mut Env,
    with_meta: bool,
    wake: Wake,
    writers: u32,
    seconds: u64,
) -> Result<f64> {
    let (pool, _) = env
        .database(if with_meta {
            "appendmeta"
        } else {
            "appendplain"
        })
        .await?;
    env.checkpoint().await?;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let writer = IntentWriter::default().with_notify(wake == Wake::Notify);
            let key = BranchKey::new(
                TenantId::new(format!("a{w}")).expect("valid id"),
                RunId::new("r").expect("valid id"),
                BranchId::new("main").expect("valid id"),
            );
            let mut conn = pool.acquire().await.expect("connection");
            writer.open_run(&mut conn, &key).await.expect("open");
            let payload = vec![b'x'; PAYLOAD_BYTES as usize];
            let mut lsn = 0u64;
            while Instant::now() < deadline {
                lsn += 1;
                let intent = if with_meta {
                    Intent::new(&payload).with_metadata(full_metadata(lsn))
                } else {
                    Intent::new(&payload)
                };
                let mut tx = pool.begin().await.expect("begin");
                writer
                    .append_intent(&mut tx, &key, Lsn::new(lsn), intent)
                    .await
                    .expect("append");
                tx.commit().await.expect("commit");
                if wake == Wake::AfterCommit {
                    writer
                        .wake_relays(&mut conn, &key.tenant)
                        .await
                        .expect("wake");
                }
            }
            lsn
        }));
    }
    let mut commits = 0;
    for task in tasks {
        commits += task.await?;
    }
    pool.close().await;
    Ok(commits as f64 / seconds as f64)
}

/// Section 12b/c: backlog drain rate of a relay (`per_run x 1000` intents, 50 tenants x 20
/// runs), with full metadata on every intent or none, into `bound` consumer groups.
async fn drain_rate(env: &mut Env, per_run: u32, with_meta: bool, bound: u16) -> Result<f64> {
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
async fn metadata_drain(
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
async fn metadata_and_groups(
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

/// Section 13: for classic, quorum and stream queues, on the machine's node and on a private
/// 3-node cluster (`scripts/rabbitmq-cluster`, replicas on every node): the backlog drain next to
/// the pipelined raw ceiling on the same queue type (median of 3, alternated), and the
/// commit-to-confirm latency next to its floor; then the replay rate of a consumer group
/// reading a stream from its first offset into the fold's event table.
async fn queue_types(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let per_run = (mode.backlog_per_run / 4).max(1);
    let events = per_run as usize * 1000;
    let payload = vec![b'x'; PAYLOAD_BYTES as usize];
    let single = env.amqp.clone();
    let cluster_dir = std::env::temp_dir().join(unique("relay-bench-cluster"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/rabbitmq-cluster");
    let started = std::process::Command::new(script)
        .arg("start")
        .arg(&cluster_dir)
        .output()?;
    anyhow::ensure!(
        started.status.success(),
        "starting the cluster: {}",
        String::from_utf8_lossy(&started.stderr)
    );
    let cluster = String::from_utf8_lossy(&started.stdout).trim().to_owned();
    let measured = async {
        for (place, amqp) in [("1 node", single.clone()), ("3-node cluster", cluster.clone())] {
            env.amqp = amqp;
            for queue_type in [QueueType::Classic, QueueType::Quorum, QueueType::Stream] {
                env.queue_type = queue_type;
                let name = format!("{queue_type:?}").to_lowercase();
                let (mut drains, mut ceilings) = (Vec::new(), Vec::new());
                for _ in 0..3 {
                    drains.push(drain_rate(env, per_run, false, 0).await?);
                    let rabbit = env.rabbit("rawqueues", 8)?;
                    declare(&env.amqp, &rabbit.topology).await?;
                    ceilings.push(
                        raw_pipelined(&env.amqp, &rabbit.topology, events, &payload, 4).await?,
                    );
                    drop_topology(&env.amqp, &rabbit.topology).await?;
                }
                let (drain, ceiling) = (min_median_max(drains).1, min_median_max(ceilings).1);
                row(
                    &format!("13. {place}, {name}: backlog drain"),
                    format!("{drain:.0} ev/s"),
                    &format!(
                        "{events} events, median of 3; {:.2} of the pipelined ceiling on {name} queues ({ceiling:.0} ev/s, same run)",
                        drain / ceiling
                    ),
                );
                let (latency, _) = latency(env, mode, Wake::Notify, &Load::busy()).await?;
                latency_rows(row, &format!("{place}, {name}"), &latency);
            }
        }
        env.amqp = single.clone();
        env.queue_type = QueueType::Stream;
        let (drain, replay) = stream_replay(env, per_run).await?;
        row(
            "13. 1 node, stream: a group replaying from the first offset",
            format!("{replay:.0} ev/s"),
            &format!(
                "{events} events into the fold's event table (one transaction each, 8 partitions); the relay drained them at {drain:.0} ev/s"
            ),
        );
        anyhow::Ok(())
    }
    .await;
    env.amqp = single;
    env.queue_type = QueueType::Classic;
    let _ = std::process::Command::new(script)
        .arg("stop")
        .arg(&cluster_dir)
        .status();
    measured
}

/// Section 13b: what the per-partition shards cost on streams (`Sharding::Partition`, the
/// workaround for rabbitmq-server#9457, applied on every version): on a private RabbitMQ 4.0
/// node (`scripts/rabbitmq-root`), the backlog drain into 8 streams with one publisher shard
/// per partition (the relay as it runs) next to the default 4 shards by branch, median of 3,
/// alternated. The second is started through `Relay::start_with` with a relay configuration of
/// classic queues (so no per-partition override) and publishers on the stream topology.
async fn stream_shards(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let per_run = (mode.backlog_per_run / 4).max(1);
    let scripts = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts");
    let root = std::process::Command::new(format!("{scripts}/rabbitmq-root"))
        .arg("ensure")
        .output()?;
    anyhow::ensure!(
        root.status.success(),
        "building the RabbitMQ 4.0 root: {}",
        String::from_utf8_lossy(&root.stderr)
    );
    let root = String::from_utf8_lossy(&root.stdout).trim().to_owned();
    let dir = format!("{root}/tmp/{}", unique("relay-bench-v4"));
    let cluster = |args: &[&str]| {
        std::process::Command::new(format!("{scripts}/rabbitmq-cluster"))
            .args(args)
            .env("RABBITMQ_ROOT", &root)
            .output()
    };
    let started = cluster(&["start", &dir, "1"])?;
    anyhow::ensure!(
        started.status.success(),
        "starting a RabbitMQ 4.0 node: {}",
        String::from_utf8_lossy(&started.stderr)
    );
    let single = std::mem::replace(
        &mut env.amqp,
        String::from_utf8_lossy(&started.stdout).trim().to_owned(),
    );
    env.queue_type = QueueType::Stream;
    let measured = async {
        let (mut by_partition, mut by_branch) = (Vec::new(), Vec::new());
        let mut publishers = (0, 0);
        for _ in 0..3 {
            let (rate, count) = stream_drain(env, per_run, true).await?;
            by_partition.push(rate);
            publishers.0 = count;
            let (rate, count) = stream_drain(env, per_run, false).await?;
            by_branch.push(rate);
            publishers.1 = count;
        }
        let (partition, branch) = (
            min_median_max(by_partition).1,
            min_median_max(by_branch).1,
        );
        row(
            "13b. RabbitMQ 4.0, 8 streams: drain with a shard per partition vs 4 shards by branch",
            format!("{partition:.0} vs {branch:.0} ev/s"),
            &format!(
                "{} events, median of 3, alternated; {:.2}x; {} vs {} publishers (an AMQP connection and channel each)",
                per_run * 1000,
                partition / branch,
                publishers.0,
                publishers.1
            ),
        );
        anyhow::Ok(())
    }
    .await;
    env.amqp = single;
    env.queue_type = QueueType::Classic;
    let _ = cluster(&["stop", &dir]);
    measured
}

/// One backlog drain into streams (50 tenants x 20 runs x `per_run` intents): with the relay's
/// per-partition shards or with shards by branch; (ev/s, publishers).
async fn stream_drain(env: &mut Env, per_run: u32, per_partition: bool) -> Result<(f64, u16)> {
    let (pool, url) = env.database("streamshards").await?;
    let rabbit = env.rabbit("streamshards", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    env.checkpoint().await?;
    let outbox = Outbox::new(pool.clone());
    let mut config = env.relay_config(&url, &rabbit);
    let started = Instant::now();
    let (relay, publishers) = if per_partition {
        let publishers = config.supervisor_config().publishers();
        (Relay::start(config).await?, publishers)
    } else {
        config.queue_type = QueueType::Classic;
        let publishers = config.supervisor_config().publishers();
        let on_streams = rabbit.clone();
        let factory: distribution::PublisherFactory = Arc::new(move |_| {
            Box::new(RabbitPublisher::new(on_streams.clone())) as Box<dyn Publisher>
        });
        (Relay::start_with(config, factory).await?, publishers)
    };
    wait_drained(&outbox, Duration::from_secs(900)).await?;
    let rate = written as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    Ok((rate, publishers))
}

/// Section 13: the relay drains `per_run x 1000` events into streams, then a consumer group
/// with its own fold database replays them from the first offset; (drain, replay) in ev/s.
async fn stream_replay(env: &mut Env, per_run: u32) -> Result<(f64, f64)> {
    use distribution::consumer::{Consumer, ConsumerConfig};
    let (pool, url) = env.database("replay").await?;
    let rabbit = env.rabbit("replay", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    env.checkpoint().await?;
    let outbox = Outbox::new(pool.clone());
    let started = Instant::now();
    let relay = Relay::start(env.relay_config(&url, &rabbit)).await?;
    wait_drained(&outbox, Duration::from_secs(900)).await?;
    let drain = written as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    let (fold_pool, _) = env.database("replayfold").await?;
    let mut group = rabbit.clone();
    group.topology = group.topology.with_group(Group::parse("replay")?);
    let consumer = Consumer::new(
        ConsumerConfig::new(group.clone()),
        fold_pool,
        store::EventTable,
    );
    let progress = consumer.progress();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    }));
    let deadline = Instant::now() + Duration::from_secs(900);
    while progress.totals().applied < written {
        anyhow::ensure!(Instant::now() < deadline, "the replay did not end in 900 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = written as f64 / started.elapsed().as_secs_f64();
    let _ = stop.send(true);
    running.await??;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    // The streams went with the first; only the group's dead-letter queue is left.
    let _ = drop_topology(&env.amqp, &group.topology).await;
    pool.close().await;
    Ok((drain, replay))
}

/// Section 8: what one refresh of the lag gauges costs with `per_run x 1000` intents pending
/// (50 tenants): the former full `GROUP BY` against the bounded read, median of 3 each, ms.
async fn gauge_cost(env: &mut Env, per_run: u32) -> Result<(u64, f64, f64)> {
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
async fn fairness(
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

fn spawn_relay(url: &str, amqp: &str, rabbit: &RabbitConfig) -> Result<std::process::Child> {
    spawn_relay_at(url, amqp, rabbit, "127.0.0.1:0", 1000)
}

/// A standalone relay with its metrics on `metrics`, polling every `poll_ms` (backlogs that
/// fixtures write appear without NOTIFY: a short poll keeps discovery out of timed figures).
fn spawn_relay_at(
    url: &str,
    amqp: &str,
    rabbit: &RabbitConfig,
    metrics: &str,
    poll_ms: u32,
) -> Result<std::process::Child> {
    Ok(
        std::process::Command::new(env!("CARGO_BIN_EXE_distribution"))
            .arg("run")
            .env("DATABASE_URL", url)
            .env("AMQP_URL", amqp)
            .env("RELAY_TOPOLOGY", rabbit.topology.exchange().as_str())
            .env("RELAY_PARTITIONS", rabbit.topology.partitions().to_string())
            .env("RELAY_METRICS_ADDR", metrics)
            .env("RELAY_POLL_MS", poll_ms.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
    )
}

/// `/metrics` of a relay, as text (plain hyper).
async fn scrape(addr: &str) -> Option<String> {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .ok()?;
    tokio::spawn(connection);
    let request = hyper::Request::get("/metrics")
        .header("host", addr)
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .ok()?;
    let body = sender.send_request(request).await.ok()?.into_body();
    let bytes = body.collect().await.ok()?.to_bytes();
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

/// The sum of every sample of metric `name` in a scrape.
fn metric_sum(scraped: &str, name: &str) -> f64 {
    scraped
        .lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Section 10: `relays` standalone relays share a backlog of 50 tenants x 20 runs; each
/// relay's share of what shipped (from its own `/metrics`), and the total rate.
async fn relay_shares(env: &mut Env, relays: usize, per_run: u32) -> Result<(Vec<f64>, f64)> {
    let (pool, url) = env.database("shares").await?;
    let rabbit = env.rabbit("shares", 8)?;
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..relays {
        let addr = format!("127.0.0.1:{}", free_port()?);
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
async fn join_rows(
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
async fn join_backlog(env: &mut Env, relays: usize, per_run: u32) -> Result<(f64, f64)> {
    let (pool, url) = env.database("join").await?;
    let rabbit = env.rabbit("join", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    let outbox = Outbox::new(pool.clone());
    let started = Instant::now();
    let mut children = Vec::new();
    for _ in 0..relays {
        let addr = format!("127.0.0.1:{}", free_port()?);
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

/// Section 11: `tenants` tenants x 2 intents drained by the standalone relay while a host
/// appends beside it; then the same relay idle with that many tenants seen.
/// Returns (drain ev/s, peak RSS MB, host appends, host appends refused, idle queries/s,
/// idle CPU %, idle RSS MB).
async fn many_tenants(
    env: &mut Env,
    tenants: u32,
    idle_secs: u64,
) -> Result<(f64, u64, u64, u64, f64, f64, u64)> {
    let (pool, url) = env.database("many").await?;
    let rabbit = env.rabbit("many", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "m", tenants, 1, 2, PAYLOAD_BYTES).await?;
    let mut child = spawn_relay(&url, &env.amqp, &rabbit)?;
    let started = Instant::now();
    // The host, beside the relay: one transaction per append, counting what PostgreSQL refuses.
    let host = {
        let pool = pool.clone();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let writer = IntentWriter::default();
            let key = BranchKey::new(
                TenantId::new("host-beside").expect("valid id"),
                RunId::new("r").expect("valid id"),
                BranchId::new("main").expect("valid id"),
            );
            let (mut appended, mut refused) = (0u64, 0u64);
            if writer
                .open_run(&mut pool.acquire().await.expect("conn"), &key)
                .await
                .is_err()
            {
                return (0, 1);
            }
            let mut lsn = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                lsn += 1;
                let result = async {
                    let mut tx = pool.begin().await?;
                    writer.append(&mut tx, &key, Lsn::new(lsn), b"host").await?;
                    tx.commit().await?;
                    anyhow::Ok(())
                }
                .await;
                match result {
                    Ok(()) => appended += 1,
                    Err(_) => {
                        refused += 1;
                        lsn -= 1;
                    }
                }
            }
            (appended, refused)
        });
        (stop, task)
    };
    // Drained: the backlog's tenants, not the host's own, which keeps writing meanwhile.
    let drained = async {
        let deadline = Instant::now() + Duration::from_secs(1800);
        loop {
            let left: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM relay_outbox WHERE tenant_id <> 'host-beside')",
            )
            .fetch_one(&pool)
            .await?;
            if !left {
                return anyhow::Ok(());
            }
            anyhow::ensure!(Instant::now() < deadline, "backlog not drained");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    .await;
    let rate = written as f64 / started.elapsed().as_secs_f64();
    host.0.store(true, std::sync::atomic::Ordering::Relaxed);
    let (appended, refused) = host.1.await?;
    drained?;
    let peak = proc_status_kb(child.id(), "VmHWM")? / 1024;
    // Idle with every tenant seen: as in section 6, after PostgreSQL's statistics settle.
    let database = url.rsplit_once('/').context("url")?.1.to_owned();
    tokio::time::sleep(Duration::from_secs(12)).await;
    let before = transactions(&mut env.admin, &database).await?;
    let cpu_before = cpu_ticks(child.id())?;
    let idle_started = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let after = transactions(&mut env.admin, &database).await?;
    let cpu_after = cpu_ticks(child.id())?;
    let elapsed = idle_started.elapsed().as_secs_f64();
    let idle_rss = proc_status_kb(child.id(), "VmRSS")? / 1024;
    child.kill()?;
    child.wait()?;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    let qps = (after - before) as f64 / elapsed;
    let cpu = (cpu_after - cpu_before) as f64 / 100.0 / elapsed * 100.0;
    Ok((rate, peak, appended, refused, qps, cpu, idle_rss))
}

fn proc_status_kb(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|line| line.starts_with(field))
        .context("no such field")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("no value")?
        .parse()?)
}

fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_name = stat.rsplit_once(')').context("malformed stat")?.1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat; 12 and 13 after the name.
    Ok(fields[11].parse::<u64>()? + fields[12].parse::<u64>()?)
}

/// 5. Peak RSS (VmHWM) of the standalone relay draining a backlog of 50 x 20 x `per_run`.
async fn peak_rss(env: &mut Env, per_run: u32) -> Result<(u64, f64)> {
    let (pool, url) = env.database("rss").await?;
    let rabbit = env.rabbit("rss", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    let mut child = spawn_relay(&url, &env.amqp, &rabbit)?;
    let started = Instant::now();
    let drained = wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(900)).await;
    let elapsed = started.elapsed().as_secs_f64();
    let peak = proc_status_kb(child.id(), "VmHWM");
    child.kill()?;
    child.wait()?;
    drained?;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    Ok((peak? / 1024, written as f64 / elapsed))
}

/// Transactions PostgreSQL counted in `database` so far.
async fn transactions(admin: &mut PgConnection, database: &str) -> Result<i64> {
    let (commits, rollbacks): (i64, i64) = sqlx::query_as(
        "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1",
    )
    .bind(database)
    .fetch_one(admin)
    .await?;
    Ok(commits + rollbacks)
}

/// 6. Queries per second and CPU of the standalone relay holding `tenants` idle tenants.
async fn idle(env: &mut Env, tenants: u32, seconds: u64) -> Result<(f64, f64)> {
    let (pool, url) = env.database("idle").await?;
    let rabbit = env.rabbit("idle", 8)?;
    store::fixtures::fill_backlog(&pool, "idle", tenants, 1, 1, PAYLOAD_BYTES).await?;
    let mut child = spawn_relay(&url, &env.amqp, &rabbit)?;
    wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(120)).await?;
    pool.close().await;
    let database = url.rsplit_once('/').context("url")?.1.to_owned();
    // A measurement window, not synchronisation: PostgreSQL 15 backends flush their statistics
    // up to 10 s after going idle (PGSTAT_IDLE_INTERVAL), so wait that out or the drain that
    // just finished is counted as idle load.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let before = transactions(&mut env.admin, &database).await?;
    let cpu_before = cpu_ticks(child.id())?;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let after = transactions(&mut env.admin, &database).await?;
    let cpu_after = cpu_ticks(child.id())?;
    let elapsed = started.elapsed().as_secs_f64();
    child.kill()?;
    child.wait()?;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    let ticks_per_second = 100.0; // USER_HZ on Linux
    let cpu_percent = (cpu_after - cpu_before) as f64 / ticks_per_second / elapsed * 100.0;
    Ok(((after - before) as f64 / elapsed, cpu_percent))
}

async fn run(mode: &Mode) -> Result<String> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let amqp = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let mut env = Env {
        admin: PgConnection::connect(&url).await.context("DATABASE_URL")?,
        server: url
            .rsplit_once('/')
            .context("DATABASE_URL has no database")?
            .0
            .to_owned(),
        amqp,
        databases: Vec::new(),
        queue_type: QueueType::Classic,
    };
    let mut table = String::new();
    let mut row = |measure: &str, value: String, note: &str| {
        println!("| {measure} | {value} | {note} |");
        let _ = writeln!(table, "| {measure} | {value} | {note} |");
    };
    println!("| measure | value | note |\n|---|---|---|");

    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "join") {
        join_rows(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "scale") {
        scale(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "sizes") {
        payload_sizes(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "gauges") {
        let (pending, full, bounded) = gauge_cost(&mut env, mode.rss_large_per_run).await?;
        row(
            &format!("8. lag gauges' read, {pending} pending"),
            format!("{full:.0} ms -> {bounded:.0} ms"),
            "former GROUP BY -> capped count + index probe per drained tenant; median of 3",
        );
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "fairness") {
        fairness(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if let Ok(only @ ("drainmeta" | "drainplain")) = std::env::var("BENCH_ONLY").as_deref() {
        // One drain with full metadata or none, for a profiler.
        let with_meta = only == "drainmeta";
        let rate = drain_rate(&mut env, (mode.backlog_per_run / 4).max(1), with_meta, 0).await?;
        row(
            &format!(
                "12. backlog drain, {} (one run)",
                if with_meta {
                    "full metadata"
                } else {
                    "no metadata"
                }
            ),
            format!("{rate:.0} ev/s"),
            "",
        );
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "queues") {
        queue_types(&mut env, mode, &mut row).await?;
        stream_shards(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "streamshards") {
        stream_shards(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "metadrain") {
        metadata_drain(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "meta") {
        metadata_and_groups(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "wakecost") {
        wake_costs(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "latency") {
        for wake in [Wake::Notify, Wake::Waker, Wake::AfterCommit] {
            let (measured, _) = latency(&mut env, mode, wake, &Load::busy()).await?;
            latency_rows(&mut row, wake.label(), &measured);
        }
        env.cleanup().await;
        return Ok(table);
    }
    let rabbit = env.rabbit("raw", 8)?;
    let events = synthetic_events(mode.raw_events);
    let raw_one = raw_ceiling(&rabbit, &events, 1).await?;
    let note = format!(
        "{} events, batches of 1000, each batch's confirms awaited before the next (the relay's adapter); section 9 has the truly pipelined ceiling",
        mode.raw_events
    );
    row(
        "1. adapter ceiling, 1 channel",
        format!("{raw_one:.0} ev/s"),
        &note,
    );
    let raw_shards = raw_ceiling(&rabbit, &events, 4).await?;
    row(
        "1. adapter ceiling, 4 channels",
        format!("{raw_shards:.0} ev/s"),
        "a connection per channel, like the relay's 4 shards",
    );
    let payload = vec![b'x'; PAYLOAD_BYTES as usize];
    let pipelined =
        raw_pipelined(&env.amqp, &rabbit.topology, mode.raw_events, &payload, 4).await?;
    row(
        "1. truly pipelined ceiling, 4 connections",
        format!("{pipelined:.0} ev/s"),
        "plain lapin, up to 2,000 confirms outstanding per connection, the relay's properties and headers on each message, no database: what section 3 is held to",
    );
    drop_topology(&env.amqp, &rabbit.topology).await?;

    let (pool, _) = env.database("baseline").await?;
    let rabbit = env.rabbit("baseline", 8)?;
    let per_run = (mode.baseline_events / 1000).max(1);
    store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    let tenants: Vec<TenantId> = (0..50)
        .map(|t| TenantId::new(format!("t{t}")))
        .collect::<Result<_, _>>()?;
    let baseline = seed_style(&Outbox::new(pool.clone()), &rabbit, &tenants).await?;
    let note = format!(
        "{} events, drain 100, one confirm awaited at a time",
        per_run * 1000
    );
    row(
        "2. seed-style baseline",
        format!("{baseline:.0} ev/s"),
        &note,
    );
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;

    let (pool, url) = env.database("drain").await?;
    let rabbit = env.rabbit("drain", 8)?;
    let written =
        store::fixtures::fill_backlog(&pool, "t", 50, 20, mode.backlog_per_run, PAYLOAD_BYTES)
            .await?;
    let outbox = Outbox::new(pool.clone());
    let started = Instant::now();
    let relay = Relay::start(env.relay_config(&url, &rabbit)).await?;
    wait_drained(&outbox, Duration::from_secs(900)).await?;
    let drain = written as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    let note = format!("{written} events, 50 tenants x 20 runs, 4 shards, batch 1000");
    row("3. relay, backlog drain", format!("{drain:.0} ev/s"), &note);
    row(
        "3/1 ratio (vs the truly pipelined ceiling)",
        format!("{:.2}", drain / pipelined),
        "target >= 0.8",
    );
    row(
        "3/1 ratio (vs the adapter ceiling, 4 channels)",
        format!("{:.2}", drain / raw_shards),
        "the adapter awaits each batch's confirms; kept for comparison with earlier runs",
    );
    row(
        "3/1 ratio (vs 1 channel)",
        format!("{:.2}", drain / raw_one),
        "",
    );
    row(
        "3/2 ratio",
        format!("{:.1}", drain / baseline),
        "target >= 10",
    );
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;

    wake_costs(&mut env, mode, &mut row).await?;
    for wake in [Wake::Notify, Wake::Waker, Wake::AfterCommit] {
        let (measured, _) = latency(&mut env, mode, wake, &Load::busy()).await?;
        latency_rows(&mut row, wake.label(), &measured);
    }

    fairness(&mut env, mode, &mut row).await?;

    let (pending, full, bounded) = gauge_cost(&mut env, mode.rss_large_per_run).await?;
    row(
        &format!("8. lag gauges' read, {pending} pending"),
        format!("{full:.0} ms -> {bounded:.0} ms"),
        "former GROUP BY over the outbox -> per drained tenant, capped count + index probe; median of 3",
    );

    let (small_rss, small_rate) = peak_rss(&mut env, mode.rss_small_per_run).await?;
    let (large_rss, large_rate) = peak_rss(&mut env, mode.rss_large_per_run).await?;
    let (small, large) = (mode.rss_small_per_run * 1000, mode.rss_large_per_run * 1000);
    let note = format!("standalone relay, drained at {small_rate:.0} ev/s");
    row(
        &format!("5. peak RSS, {small} backlog"),
        format!("{small_rss} MB"),
        &note,
    );
    let note = format!("drained at {large_rate:.0} ev/s; target < 100 MB");
    row(
        &format!("5. peak RSS, {large} backlog"),
        format!("{large_rss} MB"),
        &note,
    );
    let ratio = large_rss as f64 / small_rss.max(1) as f64;
    row(
        "5. RSS ratio large/small",
        format!("{ratio:.2}"),
        "target <= 1.2",
    );

    payload_sizes(&mut env, mode, &mut row).await?;
    scale(&mut env, mode, &mut row).await?;
    metadata_and_groups(&mut env, mode, &mut row).await?;
    queue_types(&mut env, mode, &mut row).await?;
    stream_shards(&mut env, mode, &mut row).await?;

    let (qps, cpu) = idle(&mut env, mode.idle_tenants, mode.idle_secs).await?;
    let tenants = mode.idle_tenants;
    row(
        &format!("6. idle, {tenants} tenants: DB queries"),
        format!("{qps:.1} /s"),
        "transactions on the relay's database",
    );
    row(
        &format!("6. idle, {tenants} tenants: relay CPU"),
        format!("{cpu:.1} %"),
        "of one core",
    );
    env.cleanup().await;
    Ok(table)
}

fn machine() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|name| name.trim().to_owned())
        })
        .unwrap_or_default();
    format!("{cores} cores ({cpu})")
}

fn command_output(program: &str, args: &[&str]) -> String {
    std::process::Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|arg| arg == "--quick")
        || std::env::var("BENCH_QUICK").is_ok_and(|v| v == "1");
    let mode = if quick { &QUICK } else { &FULL };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let table = runtime.block_on(run(mode))?;
    let report = format!(
        "# Relay benchmark\n\n{}, commit {}, {} mode, {}; PostgreSQL and RabbitMQ on the same machine.\n\
         Command: `cargo bench --bench relay{}`\n\n| measure | value | note |\n|---|---|---|\n{table}",
        command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        command_output("git", &["rev-parse", "--short", "HEAD"]),
        mode.name,
        machine(),
        if quick { " -- --quick" } else { "" }
    );
    std::fs::write(
        concat!(env!("CARGO_MANIFEST_DIR"), "/benches/results.md"),
        report,
    )?;
    println!("written to benches/results.md");
    Ok(())
}

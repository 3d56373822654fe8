//! The relay benchmark, side by side in one run on this machine's PostgreSQL and RabbitMQ.
//!
//! `cargo bench --bench relay` (full) or `cargo bench --bench relay -- --quick` (under a minute).
//! Prints a table and writes it with the date, commit and machine to `benches/results.md` (a
//! full run only; a quick run or one with any `BENCH_*` setting writes `target/bench-partial.md`):
//! 1. raw ceiling: pipelined confirmed publishes, no database (1 channel, and one per shard);
//! 2. seed-style baseline: drain 100, publish-and-await one at a time, ack;
//! 3. this relay draining a pre-filled backlog (50 tenants x 20 runs; `BENCH_ONLY=drain` runs it
//!    alone, beside section 1's truly pipelined ceiling);
//! 4. commit-to-confirm latency at a steady 2,000 events/s from 8 concurrent host writers,
//!    woken by NOTIFY, the in-process waker, and NOTIFY after the commit (4a: the host's
//!    commits/s with each, unpaced; `BENCH_ONLY=wakecost` runs 4a alone);
//! 5. peak RSS of the standalone relay draining a small and a 10x larger backlog;
//! 6. database queries per second and CPU of the relay while 1,000 tenants sit idle;
//! 7. quiet tenants' latency alone and beside a hot backlog, with and without the express lane
//!    (`BENCH_ONLY=fairness`);
//! 8. the lag gauges' read over a million pending intents (`BENCH_ONLY=gauges`);
//! 9. the drain at 256 B, 64 KiB and 256 KiB against the pipelined ceiling and a bound written
//!    by hand, with CPU per process and peak RSS (`BENCH_ONLY=sizes`);
//! 10. one, two and three relays sharing tenants and joining a backlog (`BENCH_ONLY=join`);
//! 11. 100,000 tenants: drain, peak RSS, the host beside it, idle cost (`BENCH_ONLY=scale`);
//! 12. full metadata against the payload alone: appends, the ceiling, the drain
//!     (`BENCH_ONLY=meta`; `metadrain` the drains alone, `drainmeta` or `drainplain` one of them);
//! 13. classic, quorum and stream queues on one node and on a private 3-node cluster, and a
//!     consumer group replaying a stream (`BENCH_ONLY=queues` runs this section alone); 13b:
//!     on RabbitMQ 4.0, streams written with and without a shard per partition
//!     (`BENCH_ONLY=streamshards` runs it alone);
//! 14. the consumer's pace: folding in batches against one transaction per delivery, a group
//!     replaying a stream and a live group on classic and quorum queues (`BENCH_ONLY=fold`);
//! 16. NATS JetStream: the relay's drain against a ceiling written by hand and against one
//!     publish awaited at a time, and section 9's bound on NATS, at 256 B and 64 KiB, and
//!     commit-to-ack latency against its floor (`BENCH_ONLY=nats`); 16b: a consumer group
//!     replaying the stream against the relay's drain (`BENCH_ONLY=natsfold` alone).
//!
//! This file holds the modes, the order of the sections and the report; each section lives
//! in a module of its own (`ceiling`, `sizes` and its hand-written `bound`, `latency` and
//! `host`, `drain`, `footprint`, `queues`, `fold`, `nats`), beside the harness (`env`) and what is read from
//! /proc (`measure`).
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use distribution::broker::{BoxFuture, Group, OnReport, Partition, Publisher};
use distribution::rabbit::{QueueType, RabbitConfig, RabbitPublisher, Topology};
use distribution::store::{
    self, BranchId, BranchKey, EventKey, EventType, Fence, Intent, IntentWriter, Lsn, Metadata,
    Outbox, OutboxEvent, RunId, TenantId,
};
use distribution::{Relay, RelayConfig};
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// The standalone binary's allocator (cli/main.rs), so that the relay run in this process (sections
/// 3 and 16) costs what `distribution run` costs; the ceilings and bounds run under it too.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bound;
mod ceiling;
mod drain;
mod env;
mod fold;
mod footprint;
mod host;
mod latency;
mod measure;
mod nats;
mod queues;
mod sizes;
use ceiling::*;
use drain::*;
use env::*;
use footprint::*;
use host::*;
use latency::*;
use measure::*;
use queues::*;
use sizes::*;

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
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "nats") {
        nats::nats_rows(&mut env, mode, &mut row).await?;
        nats::nats_fold_rows(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "natsfold") {
        nats::nats_fold_rows(&mut env, mode, &mut row).await?;
        env.cleanup().await;
        return Ok(table);
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "fold") {
        fold::fold_pace(&mut env, mode, &mut row).await?;
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
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "drain") {
        let rabbit = env.rabbit("raw", 8)?;
        // One confirmed publish declares the topology, as section 1's first ceiling does.
        let declared = RabbitPublisher::new(rabbit.clone())
            .publish(&synthetic_events(1))
            .await;
        anyhow::ensure!(declared.fault.is_none(), "broker not reachable");
        let payload = vec![b'x'; PAYLOAD_BYTES as usize];
        let pipelined =
            raw_pipelined(&env.amqp, &rabbit.topology, mode.raw_events, &payload, 4).await?;
        drop_topology(&env.amqp, &rabbit.topology).await?;
        backlog_drain(&mut env, mode, pipelined, &mut row).await?;
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

    let drain = backlog_drain(&mut env, mode, pipelined, &mut row).await?;
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
    fold::fold_pace(&mut env, mode, &mut row).await?;
    nats::nats_rows(&mut env, mode, &mut row).await?;
    nats::nats_fold_rows(&mut env, mode, &mut row).await?;

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

/// Section 3: the relay draining a backlog of 50 tenants x 20 runs, against section 1's truly
/// pipelined ceiling (`BENCH_ONLY=drain` runs the two alone). Returns events/s.
async fn backlog_drain(
    env: &mut Env,
    mode: &Mode,
    pipelined: f64,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<f64> {
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
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    let note = format!("{written} events, 50 tenants x 20 runs, 4 shards, batch 1000");
    row("3. relay, backlog drain", format!("{drain:.0} ev/s"), &note);
    row(
        "3/1 ratio (vs the truly pipelined ceiling)",
        format!("{:.2}", drain / pipelined),
        "target >= 0.8",
    );
    Ok(drain)
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
    // Only a full run with no BENCH_* setting replaces benches/results.md (the table the repository
    // keeps); any other run writes target/bench-partial.md, to be copied into HISTORY.md.
    let settings = partial_settings(std::env::vars());
    let path = if quick || !settings.is_empty() {
        concat!(env!("CARGO_MANIFEST_DIR"), "/target/bench-partial.md")
    } else {
        concat!(env!("CARGO_MANIFEST_DIR"), "/benches/results.md")
    };
    let report = if settings.is_empty() {
        report
    } else {
        format!("{report}\nSettings: {}\n", settings.join(", "))
    };
    if let Some(dir) = std::path::Path::new(path).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, report)?;
    println!("written to {path}");
    Ok(())
}

/// The BENCH_* variables that make a run partial or unlike the full one (all but BENCH_QUICK,
/// which the mode already says), as `NAME=value`, sorted.
fn partial_settings(vars: impl Iterator<Item = (String, String)>) -> Vec<String> {
    let mut settings: Vec<String> = vars
        .filter(|(name, _)| name.starts_with("BENCH_") && name != "BENCH_QUICK")
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    settings.sort();
    settings
}

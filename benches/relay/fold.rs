//! Section 14: the consumer's pace. Folding in batches against one transaction per delivery,
//! side by side in one run: a group replaying a stream from its first offset, and a live group
//! folding a backlog while the relay drains it, on classic and quorum queues.
use super::*;

use distribution::consumer::{Consumer, ConsumerConfig, FoldBatch};

/// One transaction per delivery (what the consumer did before batches), then the defaults
/// (`BENCH_FOLD_EVENTS` and `BENCH_FOLD_PREFETCH` try others).
pub(crate) fn batches() -> [(&'static str, FoldBatch); 2] {
    let events = std::env::var("BENCH_FOLD_EVENTS")
        .ok()
        .and_then(|events| events.parse().ok())
        .unwrap_or(FoldBatch::default().events);
    [
        (
            "one transaction per delivery",
            FoldBatch {
                events: 1,
                ..FoldBatch::default()
            },
        ),
        (
            "batches",
            FoldBatch {
                events,
                ..FoldBatch::default()
            },
        ),
    ]
}

/// A consumer of `rabbit`'s group folding into the event table of a fresh database, in
/// batches of `batch`; stopped by the returned sender.
async fn start_consumer(
    env: &mut Env,
    rabbit: &RabbitConfig,
    batch: FoldBatch,
) -> Result<(
    distribution::consumer::ConsumerProgress,
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<distribution::consumer::FoldStats, distribution::broker::Error>>,
)> {
    let (fold_pool, _) = env.database("foldpace").await?;
    let mut config = ConsumerConfig::new(rabbit.clone());
    config.batch = batch;
    if let Some(prefetch) = std::env::var("BENCH_FOLD_PREFETCH")
        .ok()
        .and_then(|prefetch| prefetch.parse().ok())
    {
        config.prefetch = prefetch;
    }
    let consumer = Consumer::new(config, fold_pool, store::EventTable);
    let progress = consumer.progress();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    }));
    Ok((progress, stop, running))
}

/// Waits until `progress` applied `written` events, at most 900 s.
pub(crate) async fn wait_applied(
    progress: &distribution::consumer::ConsumerProgress,
    written: u64,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(900);
    while progress.totals().applied < written {
        anyhow::ensure!(Instant::now() < deadline, "the fold did not end in 900 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

pub(crate) async fn fold_pace(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let per_run = (mode.backlog_per_run / 4).max(1);
    let saved = env.queue_type;
    let measured = async {
        // A stream drained once, replayed by a group of each kind.
        env.queue_type = QueueType::Stream;
        let (pool, url) = env.database("foldstream").await?;
        let rabbit = env.rabbit("foldstream", 8)?;
        let written =
            store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
        env.checkpoint().await?;
        let started = Instant::now();
        let relay = Relay::start(env.relay_config(&url, &rabbit)).await?;
        wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(900)).await?;
        let drain = written as f64 / started.elapsed().as_secs_f64();
        relay.shutdown().await;
        let mut rates = Vec::new();
        let mut cpu = Vec::new();
        let mut groups = Vec::new();
        for (_, batch) in batches() {
            let mut group = rabbit.clone();
            group.topology = group
                .topology
                .with_group(Group::parse(&format!("replay{}", batch.events))?);
            env.checkpoint().await?;
            let (progress, stop, running) = start_consumer(env, &group, batch).await?;
            let started = Instant::now();
            let before = (
                cpu_ticks_named("beam"),
                cpu_ticks_named("postgres"),
                cpu_ticks(std::process::id())?,
            );
            wait_applied(&progress, written).await?;
            rates.push(written as f64 / started.elapsed().as_secs_f64());
            // CPU ms per 1,000 events (ticks are 10 ms): RabbitMQ, PostgreSQL, the consumer.
            let per_thousand = |ticks: u64| ticks as f64 * 10.0 * 1000.0 / written as f64;
            cpu.push((
                per_thousand(cpu_ticks_named("beam") - before.0),
                per_thousand(cpu_ticks_named("postgres") - before.1),
                per_thousand(cpu_ticks(std::process::id())? - before.2),
            ));
            let _ = stop.send(true);
            running.await??;
            groups.push(group);
        }
        row(
            "14. stream: a group replaying from the first offset, one transaction per delivery -> batches",
            format!("{:.0} -> {:.0} ev/s", rates[0], rates[1]),
            &format!(
                "{written} events into the fold's event table, 8 partitions; {:.1}x; the relay drained them at {drain:.0} ev/s: the batched replay is {:.2} of the drain; CPU ms per 1,000 events (RabbitMQ + PostgreSQL + consumer) {:.0} + {:.0} + {:.0} -> {:.0} + {:.0} + {:.0}",
                rates[1] / rates[0],
                rates[1] / drain,
                cpu[0].0, cpu[0].1, cpu[0].2, cpu[1].0, cpu[1].1, cpu[1].2,
            ),
        );
        drop_topology(&env.amqp, &rabbit.topology).await?;
        for group in &groups {
            let _ = drop_topology(&env.amqp, &group.topology).await;
        }
        pool.close().await;

        // A live group while the relay drains a backlog.
        for queue_type in [QueueType::Classic, QueueType::Quorum] {
            env.queue_type = queue_type;
            let name = format!("{queue_type:?}").to_lowercase();
            let mut rows = Vec::new();
            for (label, batch) in batches() {
                let (pool, url) = env.database("foldlive").await?;
                let rabbit = env.rabbit("foldlive", 8)?;
                declare(&env.amqp, &rabbit.topology).await?;
                let written =
                    store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES)
                        .await?;
                env.checkpoint().await?;
                let (progress, stop, running) = start_consumer(env, &rabbit, batch).await?;
                let started = Instant::now();
                let relay = Relay::start(env.relay_config(&url, &rabbit)).await?;
                wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(900)).await?;
                let drain = written as f64 / started.elapsed().as_secs_f64();
                wait_applied(&progress, written).await?;
                let fold = written as f64 / started.elapsed().as_secs_f64();
                relay.shutdown().await;
                let _ = stop.send(true);
                running.await??;
                drop_topology(&env.amqp, &rabbit.topology).await?;
                pool.close().await;
                rows.push((label, written, drain, fold));
            }
            let [(_, written, drain1, fold1), (_, _, drain, fold)] = rows[..] else {
                unreachable!("two runs");
            };
            row(
                &format!("14. {name}: a live group's fold / the relay's drain, one transaction per delivery -> batches"),
                format!("{:.2} -> {:.2}", fold1 / drain1, fold / drain),
                &format!(
                    "{written} events each, 8 partitions, the consumer running before the relay starts; folds {fold1:.0} -> {fold:.0} ev/s, drains {drain1:.0} and {drain:.0} ev/s"
                ),
            );
        }
        anyhow::Ok(())
    }
    .await;
    env.queue_type = saved;
    measured
}

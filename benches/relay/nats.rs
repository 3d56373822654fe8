//! Section 16: NATS JetStream (the machine's server, `NATS_URL`): the relay draining a backlog
//! against the NATS ceiling written by hand (the relay's headers and acks, pipelined, no
//! database), against section 9's bound on NATS (the same backlog read out of PostgreSQL and
//! published by hand), and the chapter's design, one publish awaited at a time, at 256 B and
//! 64 KiB, and commit-to-ack latency against its floor at section 4's load
//! (`BENCH_ONLY=nats` runs it alone).
use std::collections::VecDeque;

use distribution::nats::NatsConfig;

use super::*;

/// Acks a ceiling connection holds in flight: what a relay publisher holds (`NatsConfig`'s
/// default).
const IN_FLIGHT: usize = 1_024;

pub(crate) fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A stream of its own for one measurement, declared as the relay declares it.
pub(crate) async fn stream(label: &str) -> Result<NatsConfig> {
    let name = unique(&format!("relay_bench_{label}")).replace('-', "_");
    let config = NatsConfig::new(&nats_url(), &name, 8)?;
    let (_client, context) = distribution::nats::connect(&config).await?;
    distribution::nats::declare(&context, &config).await?;
    Ok(config)
}

pub(crate) async fn drop_stream(config: &NatsConfig) {
    distribution::nats::scratch::delete_stream(&nats_url(), &config.stream).await;
}

fn sized_events(n: usize, bytes: usize) -> Vec<OutboxEvent> {
    let mut events = synthetic_events(n);
    for event in &mut events {
        event.payload = vec![b'x'; bytes];
    }
    events
}

/// An event's subject and message as the relay writes them (its headers, the payload as is).
fn message_of(
    config: &NatsConfig,
    event: OutboxEvent,
) -> Result<(String, async_nats::jetstream::message::PublishMessage)> {
    let headers = distribution::nats::headers(
        &event,
        distribution::broker::WireMode::Plain,
        &config.stream,
    )
    .map_err(|unwritable| anyhow::anyhow!("{unwritable}"))?;
    let subject = config.subject_of(&event.key.branch.tenant, &event.key.branch.run);
    let message = async_nats::jetstream::message::PublishMessage::build()
        .payload(event.payload.into())
        .headers(headers);
    Ok((subject, message))
}

/// Publishes `events` over `connections` connections with the relay's headers, up to
/// `in_flight` acks outstanding per connection (awaited oldest first; 1: the chapter's one at
/// a time); events per second, every ack a stored message.
async fn publish_by_hand(
    config: &NatsConfig,
    events: &[OutboxEvent],
    connections: usize,
    in_flight: usize,
) -> Result<f64> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for slice in events.chunks(events.len().div_ceil(connections)) {
        let (config, slice) = (config.clone(), slice.to_vec());
        tasks.push(tokio::spawn(async move {
            let (_client, context) = distribution::nats::connect(&config).await?;
            let mut acks = VecDeque::new();
            let sent = slice.len();
            for event in slice {
                let (subject, message) = message_of(&config, event)?;
                acks.push_back(context.send_publish(subject, message).await?);
                while acks.len() >= in_flight {
                    acks.pop_front().expect("an ack").await?;
                }
            }
            for ack in acks {
                ack.await?;
            }
            anyhow::Ok(sent)
        }));
    }
    let mut stored = 0;
    for task in tasks {
        stored += task.await??;
    }
    anyhow::ensure!(
        stored == events.len(),
        "only {stored} of {} stored",
        events.len()
    );
    Ok(events.len() as f64 / started.elapsed().as_secs_f64())
}

/// Section 9's bound on NATS: the same backlog read out of PostgreSQL (`bound::read_and_send`)
/// and published pipelined by hand on 4 connections with the relay's headers and window, each
/// batch's rows deleted once its acks are in; events/s. What a relay on NATS can hope for here.
async fn bound_drain(env: &mut Env, per_run: u32, bytes: u32) -> Result<f64> {
    let (pool, url) = env.database("natsbound").await?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, bytes).await?;
    env.checkpoint().await?;
    let stream = stream("bound").await?;
    let config = stream.clone();
    let (rate, read) = super::bound::read_and_send(&url, bytes, 4, move |pool, batches| {
        tokio::spawn(publish_rows(config.clone(), pool, batches))
    })
    .await?;
    anyhow::ensure!(read as u64 == written, "bound: read {read} of {written}");
    anyhow::ensure!(
        Outbox::new(pool.clone())
            .tenants_with_pending()
            .await?
            .is_empty(),
        "bound: rows left after deleting every acked one"
    );
    drop_stream(&stream).await;
    pool.close().await;
    env.drop_database(&url).await?;
    Ok(rate)
}

/// One publishing connection of [`bound_drain`]: every row published without waiting, at most
/// [`IN_FLIGHT`] acks outstanding (the relay's window, and the client's limit it sets: a
/// publish past it waits for an ack), awaited oldest first; a batch's rows deleted once its
/// last ack is in.
async fn publish_rows(
    config: NatsConfig,
    pool: PgPool,
    mut batches: tokio::sync::mpsc::Receiver<super::bound::Rows>,
) -> Result<usize> {
    let (_client, context) = distribution::nats::connect(&config).await?;
    let mut window = AckWindow::default();
    while let Some(rows) = batches.recv().await {
        window
            .batches
            .push_back((Vec::with_capacity(rows.len()), rows.len()));
        for (_, tenant, run, lsn, payload) in rows {
            let branch = testkit::branch(&tenant, &run, "main");
            let event = testkit::intent(&branch, lsn as u64)
                .payload(payload)
                .build();
            let (subject, message) = message_of(&config, event)?;
            while window.acks.len() >= IN_FLIGHT {
                window.await_oldest(&pool).await?;
            }
            window
                .acks
                .push_back(context.send_publish(subject, message).await?);
            let batch = window.batches.back_mut().expect("this batch");
            batch.0.push((tenant, run, lsn));
        }
    }
    while !window.acks.is_empty() {
        window.await_oldest(&pool).await?;
    }
    Ok(window.acked)
}

/// [`publish_rows`]'s acks outstanding, oldest first, and each batch's rows with how many of its
/// acks are still outstanding.
#[derive(Default)]
struct AckWindow {
    acks: VecDeque<async_nats::jetstream::context::PublishAckFuture>,
    batches: VecDeque<(super::bound::Keys, usize)>,
    acked: usize,
}

impl AckWindow {
    /// Awaits the oldest ack (a stored message); deletes its batch's rows if it was the last.
    async fn await_oldest(&mut self, pool: &PgPool) -> Result<()> {
        self.acks.pop_front().expect("an ack").await?;
        let (_, outstanding) = self.batches.front_mut().expect("a batch");
        *outstanding -= 1;
        if *outstanding == 0 {
            let (keys, _) = self.batches.pop_front().expect("a batch");
            super::bound::delete_rows(pool, &keys).await?;
            self.acked += keys.len();
        }
        Ok(())
    }
}

/// The relay on NATS draining `50 x 20 x per_run` intents of `bytes` each.
async fn relay_drain(env: &mut Env, per_run: u32, bytes: u32) -> Result<f64> {
    let (pool, url) = env.database("nats").await?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, bytes).await?;
    env.checkpoint().await?;
    let stream = stream("drain").await?;
    let mut config = RelayConfig::nats(&url, nats_url());
    config.topology = stream.stream.clone();
    config.partitions = stream.partitions;
    let outbox = Outbox::new(pool.clone());
    let started = Instant::now();
    let relay = Relay::start(config).await?;
    wait_drained(&outbox, Duration::from_secs(900)).await?;
    let rate = written as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    drop_stream(&stream).await;
    pool.close().await;
    env.drop_database(&url).await?;
    Ok(rate)
}

/// Rows of section 16: at each size, the hand-written ceiling on 1 and 4 connections, the
/// relay, and one publish at a time; three turns a side, the median of each.
pub(crate) async fn nats_rows(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    for (bytes, events, label) in [
        (256usize, mode.raw_events, "256 B"),
        (64 << 10, mode.large_payload_events as usize * 4, "64 KiB"),
    ] {
        let per_run = (events / 1000).max(1) as u32;
        let events = sized_events(per_run as usize * 1000, bytes);
        let (mut one, mut four, mut relay, mut serial) = (vec![], vec![], vec![], vec![]);
        let mut bound = vec![];
        for _ in 0..3 {
            let config = stream("ceiling").await?;
            one.push(publish_by_hand(&config, &events, 1, IN_FLIGHT).await?);
            drop_stream(&config).await;
            let config = stream("ceiling").await?;
            four.push(publish_by_hand(&config, &events, 4, IN_FLIGHT).await?);
            drop_stream(&config).await;
            relay.push(relay_drain(env, per_run, bytes as u32).await?);
            bound.push(bound_drain(env, per_run, bytes as u32).await?);
            let config = stream("serial").await?;
            let few = &events[..events.len().min(2_000)];
            serial.push(publish_by_hand(&config, few, 1, 1).await?);
            drop_stream(&config).await;
        }
        let median = |values: &mut Vec<f64>| {
            values.sort_by(f64::total_cmp);
            values[values.len() / 2]
        };
        let (one, four, relay, serial, bound) = (
            median(&mut one),
            median(&mut four),
            median(&mut relay),
            median(&mut serial),
            median(&mut bound),
        );
        let n = events.len();
        row(
            &format!("16. NATS {label}: ceiling by hand, 1 / 4 connections"),
            format!("{one:.0} / {four:.0} ev/s"),
            &format!(
                "{n} events, the relay's headers, up to {IN_FLIGHT} acks in flight per connection, no database; median of 3"
            ),
        );
        row(
            &format!("16. NATS {label}: relay drain"),
            format!(
                "{relay:.0} ev/s ({:.2} of 4 connections, {:.2} of 1)",
                relay / four,
                relay / one
            ),
            "50 tenants x 20 runs backlog, RELAY_BROKER=nats, defaults (4 shards); target >= 0.9",
        );
        row(
            &format!("16. NATS {label}: bound by hand from PostgreSQL (read, publish, delete)"),
            format!(
                "{bound:.0} ev/s ({:.2} of the ceiling on 4 connections; the relay drains {:.2} of it)",
                bound / four,
                relay / bound
            ),
            "the same backlog read in the relay's batches, published pipelined on 4 connections with the relay's headers, each batch deleted once acked (section 9's bound); median of 3",
        );
        row(
            &format!("16. NATS {label}: one publish awaited at a time"),
            format!(
                "{serial:.0} ev/s (the relay drains {:.2}x this)",
                relay / serial
            ),
            "the chapter's design, from memory (no database): what the relay replaces",
        );
    }
    // Commit-to-ack latency at section 4's load, against its floor (one outbox read and one
    // acked publish) on NATS, timed in the same run.
    let load = Load {
        nats: true,
        ..Load::busy()
    };
    let (measured, _) = latency(env, mode, Wake::Notify, &load).await?;
    latency_rows(row, Wake::Notify.label(), &measured);
    Ok(())
}

/// Row 16b: a NATS consumer group replaying the stream the relay drained (the position stored
/// in each batch's transaction), one transaction per delivery and in batches, against that
/// drain; side by side in one run (`BENCH_ONLY=natsfold` runs it alone).
pub(crate) async fn nats_fold_rows(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    use distribution::consumer::{Consumer, NatsConsumerConfig};

    let per_run = (mode.backlog_per_run / 4).max(1);
    let (pool, url) = env.database("natsfold").await?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    env.checkpoint().await?;
    let stream = stream("natsfold").await?;
    let mut config = RelayConfig::nats(&url, nats_url());
    config.topology = stream.stream.clone();
    config.partitions = stream.partitions;
    let started = Instant::now();
    let relay = Relay::start(config).await?;
    wait_drained(&Outbox::new(pool.clone()), Duration::from_secs(900)).await?;
    let drain = written as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    let mut rates = Vec::new();
    for (_, batch) in super::fold::batches() {
        let (fold_pool, fold_url) = env.database("natsfoldpace").await?;
        env.checkpoint().await?;
        let mut group =
            NatsConsumerConfig::new(stream.clone(), &format!("replay{}", batch.events))?;
        group.batch = batch;
        let consumer = Consumer::on_nats(group, fold_pool.clone(), store::EventTable);
        let progress = consumer.progress();
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let started = Instant::now();
        let running = tokio::spawn(consumer.run(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        }));
        super::fold::wait_applied(&progress, written).await?;
        rates.push(written as f64 / started.elapsed().as_secs_f64());
        let _ = stop.send(true);
        running.await??;
        fold_pool.close().await;
        env.drop_database(&fold_url).await?;
    }
    drop_stream(&stream).await;
    pool.close().await;
    env.drop_database(&url).await?;
    row(
        "16b. NATS: a group replaying the stream, one transaction per delivery / batches",
        format!(
            "{:.0} / {:.0} ev/s ({:.2} of the relay's drain of the same backlog, {drain:.0} ev/s)",
            rates[0],
            rates[1],
            rates[1] / drain
        ),
        &format!(
            "{written} events of 256 B, 50 tenants x 20 runs, 8 partitions, Consumer::on_nats into the event table of a fresh database"
        ),
    );
    Ok(())
}

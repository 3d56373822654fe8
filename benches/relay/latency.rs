//! Section 4: commit-to-confirm latency at a steady rate, by wake-up, and 4a the host's commits/s.
use super::*;

/// When each event was first handed to a publisher, and the size of its batch.
pub(crate) type SentAt = Arc<Mutex<HashMap<EventKey, (Instant, usize)>>>;

/// Records when the broker confirmed each event (first confirm wins), for latency. The time is
/// taken when the whole batch's confirms are in, so it never understates a confirm.
pub(crate) struct TimedPublisher {
    pub(crate) inner: Box<dyn Publisher>,
    pub(crate) confirmed: Arc<Mutex<HashMap<EventKey, Instant>>>,
    /// When each event was first handed to the publisher, and its batch's size: recorded for
    /// `BENCH_DUMP` only, so a plain run's publish path carries nothing more.
    pub(crate) sent: Option<SentAt>,
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
pub(crate) fn latency_rows(
    row: &mut impl FnMut(&str, String, &str),
    label: &str,
    measured: &Latency,
) {
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
        &format!("{} p50 / p99 ({label})", measured.measure),
        format!(
            "{:.1} / {:.1} ms = {:.1}x / {:.1}x the floor ({floor_p50:.1} / {floor_p99:.1} ms){short}",
            measured.p50,
            measured.p99,
            measured.p50 / floor_p50.max(f64::EPSILON),
            measured.p99 / floor_p99.max(f64::EPSILON),
        ),
        &format!(
            "{} events; floor: one outbox read + one confirmed publish (on the same broker) under the same load, every 10 ms; as the events met it (the probe running at each commit) {:.1} / {:.1} ms; PostgreSQL {}; {}targets p50 <= 1.5x, p99 <= 2x",
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
        &format!("{} max ({label})", measured.measure),
        format!("{:.1} ms", measured.max),
        "",
    );
}

pub(crate) struct Latency {
    /// What the rows call it: `4. commit-to-confirm` on RabbitMQ, `16. NATS commit-to-ack`.
    pub(crate) measure: &'static str,
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) max: f64,
    pub(crate) events: usize,
    pub(crate) rate: f64,
    /// The floor under the same load: one outbox read plus one confirmed publish (p50, p99),
    /// over the probes (sampled in time: a stall weighs what it lasts).
    pub(crate) floor: (f64, f64),
    /// The same floor as the events met it: per event, the probe running at its commit (or
    /// the next to start); p50, p99. Sampled by load: a stall weighs the events it holds, as
    /// it does in the relay's own percentiles.
    pub(crate) floor_at_commits: (f64, f64),
    /// Percent of the machine's CPU time the hypervisor took (`steal` in `/proc/stat`) while
    /// the writers ran; `None` where there is no `/proc/stat`.
    pub(crate) stolen: Option<f64>,
}

/// The floor each event met: the duration of the probe running at its commit, else of the
/// next probe to start (`probes` in start order; `commits` as instants).
pub(crate) fn floor_at(
    probes: &[(Instant, f64)],
    commits: impl Iterator<Item = Instant>,
) -> Vec<f64> {
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
pub(crate) fn latency_rate() -> u32 {
    std::env::var("BENCH_RATE")
        .ok()
        .and_then(|rate| rate.parse().ok())
        .unwrap_or(2_000)
        .max(8)
}

/// Whether the latency rows read PostgreSQL in plain text (`BENCH_PG_TLS=off`) rather than
/// over TLS (`sslmode=prefer`, the default, as the machine's server offers it).
pub(crate) fn latency_in_plain_text() -> bool {
    std::env::var("BENCH_PG_TLS").is_ok_and(|tls| tls == "off")
}

/// How the host wakes the relay after a commit.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Wake {
    /// `NOTIFY` inside the host transaction (the default writer).
    Notify,
    /// No NOTIFY; the embedded host calls `RelayWaker::wake` after its commit.
    Waker,
    /// No NOTIFY in the transaction; the host calls `IntentWriter::wake_relays` after its
    /// commit (what a host of a standalone relay can do).
    AfterCommit,
}

impl Wake {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Wake::Notify => "NOTIFY",
            Wake::Waker => "in-process waker",
            Wake::AfterCommit => "NOTIFY after the commit",
        }
    }
}

/// Who writes during a latency measurement, and beside what.
pub(crate) struct Load {
    /// Writers (each its own run), spread over `tenants` tenants named `<prefix><n>`.
    pub(crate) writers: u32,
    pub(crate) tenants: u32,
    pub(crate) prefix: &'static str,
    /// Events per second over all writers.
    pub(crate) rate: u32,
    /// Intents already waiting for one hot tenant (20 runs) when the writers start.
    pub(crate) hot_backlog: u32,
    /// Batches this small take the express lane (0: no lane).
    pub(crate) express_max_events: u32,
    /// Consumer groups bound (each its own queues); 0: the unnamed group alone.
    pub(crate) groups: u16,
    /// Shipped to the machine's NATS (a stream of its own) rather than to RabbitMQ.
    pub(crate) nats: bool,
}

impl Load {
    /// Section 4: 8 writers over 4 tenants at `latency_rate()`.
    pub(crate) fn busy() -> Self {
        Self {
            writers: 8,
            tenants: 4,
            prefix: "lat",
            rate: latency_rate(),
            hot_backlog: 0,
            express_max_events: 32,
            groups: 0,
            nats: false,
        }
    }

    /// Section 7: 20 quiet tenants at 10 events/s each, beside a hot backlog or not.
    pub(crate) fn quiet(hot_backlog: u32, express_max_events: u32) -> Self {
        Self {
            writers: 20,
            tenants: 20,
            prefix: "quiet",
            rate: 200,
            hot_backlog,
            express_max_events,
            groups: 0,
            nats: false,
        }
    }
}

/// `n` named consumer groups (`g0`..), or the unnamed group alone for 0.
pub(crate) fn groups(n: u16) -> Vec<Group> {
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
pub(crate) async fn latency(
    env: &mut Env,
    mode: &Mode,
    wake: Wake,
    load: &Load,
) -> Result<(Latency, i64)> {
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
    let target = Target::new(env, load).await?;
    if load.hot_backlog > 0 {
        store::fixtures::fill_backlog(&pool, "hot", 1, 20, load.hot_backlog / 20, PAYLOAD_BYTES)
            .await?;
    }
    let confirmed: Arc<Mutex<HashMap<EventKey, Instant>>> = Arc::default();
    let sent: Option<SentAt> = std::env::var_os("BENCH_DUMP").map(|_| Arc::default());
    let (factory_target, factory_confirmed, factory_sent) =
        (target.clone(), confirmed.clone(), sent.clone());
    let mut config = target.relay_config(env, &url);
    config.supervisor.drainer.express_max_events = load.express_max_events;
    let relay = Relay::start_with(
        config,
        Arc::new(move |_| {
            Box::new(TimedPublisher {
                inner: factory_target.publisher(),
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
        let (outbox, target) = (Outbox::new(pool.clone()), target.clone());
        let writers_done = writers
            .iter()
            .map(|writer| writer.abort_handle())
            .collect::<Vec<_>>();
        tokio::spawn(async move {
            let mut publisher = target.publisher();
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
    target.drop(env).await?;
    pool.close().await;
    Ok((
        Latency {
            measure: match target {
                Target::Rabbit(_) => "4. commit-to-confirm",
                Target::Nats(_) => "16. NATS commit-to-ack",
            },
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

/// Where a latency measurement ships: a RabbitMQ topology or a NATS stream of its own.
#[derive(Clone)]
pub(crate) enum Target {
    Rabbit(RabbitConfig),
    Nats(distribution::nats::NatsConfig),
}

impl Target {
    async fn new(env: &mut Env, load: &Load) -> Result<Self> {
        if load.nats {
            anyhow::ensure!(load.groups == 0, "groups are RabbitMQ's queues here");
            return Ok(Target::Nats(super::nats::stream("latency").await?));
        }
        let mut rabbit = env.rabbit("latency", 8)?;
        rabbit.topology = rabbit.topology.declaring(groups(load.groups));
        Ok(Target::Rabbit(rabbit))
    }

    fn relay_config(&self, env: &Env, url: &str) -> RelayConfig {
        match self {
            Target::Rabbit(rabbit) => {
                let mut config = env.relay_config(url, rabbit);
                config.groups = rabbit.topology.declared_groups().to_vec();
                config
            }
            Target::Nats(stream) => {
                let mut config = RelayConfig::nats(url, super::nats::nats_url());
                config.topology = stream.stream.clone();
                config.partitions = stream.partitions;
                config
            }
        }
    }

    fn publisher(&self) -> Box<dyn Publisher> {
        match self {
            Target::Rabbit(rabbit) => Box::new(RabbitPublisher::new(rabbit.clone())),
            Target::Nats(stream) => {
                Box::new(distribution::nats::NatsPublisher::new(stream.clone()))
            }
        }
    }

    async fn drop(&self, env: &Env) -> Result<()> {
        match self {
            Target::Rabbit(rabbit) => drop_topology(&env.amqp, &rabbit.topology).await,
            Target::Nats(stream) => {
                super::nats::drop_stream(stream).await;
                Ok(())
            }
        }
    }
}

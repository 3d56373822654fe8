//! The bounded soak (alone in its binary: it runs for minutes and measures processes, so
//! nothing else may run beside it). Writers write at a steady rate, each run of 20 events closed
//! as it ends; two relay processes share the outbox with retention on; a consumer folds into its
//! own database with retention on. Meanwhile the second relay is restarted (SIGTERM and SIGKILL
//! in turn, each SIGTERM a clean exit) and the first, which runs from start to end, loses its
//! broker with a reset, then without one (packets held), then its database without one. Each
//! sample reads the first relay's memory, descriptors, sockets, threads and tasks, the test
//! process's memory (the consumer, the writers), the databases' backends, the relay's tables
//! (and the fold's, but for the projection's own rows) and the worst lag since the last sample;
//! the run fails on a series that grows past its warm-up or cannot be read (`soak/judge.rs`),
//! on lag above its bound, on relay A exiting, and on anything lost, doubled, out of order or
//! not retired.
//!
//! The database is a private PostgreSQL 17 (`it/pg_pair.rs`) with autovacuum on: this machine's
//! server runs with it off, and an outbox, every row inserted then deleted, lives on vacuum.
//!
//! - `cargo test --test soak` (CI): a 100 s smoke, a sample every 10 s, one fault of each kind
//!   (at 17, 52 and 87 s), relay B stopped at 30, 60 and 90 s.
//! - `SOAK_SECS=3600 cargo test --test soak -- --nocapture`: the full run, a sample a minute;
//!   it writes its table to `benches/soak.md`. Any run writes it to the target's temporary
//!   directory (`soak/soak.md`), beside every process's log (`soak/*.log`, the server's too).
#[path = "it/harness.rs"]
mod harness;
#[path = "soak/judge.rs"]
mod judge;
#[path = "it/node.rs"]
mod node;
#[path = "it/pg_pair.rs"]
mod pg_pair;

mod soak {
    use std::fmt::Write as _;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use distribution::consumer::{Consumer, ConsumerConfig};
    use distribution::store::{
        BranchId, BranchKey, EventTable, IntentWriter, Lsn, Retention, RunId, TenantId,
    };
    use distribution::testing::BrokerProxy;
    use sqlx::PgPool;

    use crate::harness::*;
    use crate::judge::{Slack, above, growth};
    use crate::pg_pair::{PgPair, Postgres};

    /// Events per run (each run is closed after its last, then retired on both sides).
    const RUN_LENGTH: u64 = 20;
    /// The payload's size: a run's key and Lsn, padded.
    const PAYLOAD: usize = 200;
    const TENANTS: usize = 4;
    /// Writers per tenant, each with a run of its own at a time.
    const WRITERS_PER_TENANT: usize = 2;
    const LEASE_TTL: Duration = Duration::from_secs(5);

    /// The soak's schedule: the smoke's or the full run's.
    #[derive(Clone, Copy, Debug)]
    struct Plan {
        length: Duration,
        sample_every: Duration,
        /// Events per second, all writers together.
        rate: u64,
        restart_every: Duration,
        fault_every: Duration,
        fault_for: Duration,
    }

    impl Plan {
        fn from_env() -> Self {
            let secs = std::env::var("SOAK_SECS")
                .ok()
                .map(|secs| {
                    secs.parse::<u64>()
                        .expect("SOAK_SECS is a number of seconds")
                })
                .unwrap_or(100);
            // Two samples in each third at the least (`judge::JUDGED_FROM`), with room to spare.
            assert!(secs >= 90, "SOAK_SECS={secs}: a soak runs 90 s or more");
            if secs >= 600 {
                Self {
                    length: Duration::from_secs(secs),
                    sample_every: Duration::from_secs(60),
                    rate: 300,
                    restart_every: Duration::from_secs(300),
                    fault_every: Duration::from_secs(180),
                    fault_for: Duration::from_secs(20),
                }
            } else {
                Self {
                    length: Duration::from_secs(secs),
                    sample_every: Duration::from_secs(10),
                    rate: 300,
                    restart_every: Duration::from_secs(30),
                    fault_every: Duration::from_secs(35),
                    fault_for: Duration::from_secs(6),
                }
            }
        }

        fn full(&self) -> bool {
            self.length >= Duration::from_secs(3600)
        }
    }

    /// One sample of every series.
    #[derive(Clone, Debug, Default)]
    struct Sample {
        at: Duration,
        relay_rss_mb: f64,
        relay_fds: f64,
        relay_sockets: f64,
        relay_threads: f64,
        relay_tasks: f64,
        process_rss_mb: f64,
        backends: f64,
        relay_tables_kb: f64,
        fold_tables_kb: f64,
        dead_rows: f64,
        lag_secs: f64,
        unfolded: f64,
    }

    /// A series: its name, how to read it from a sample, and how far it may grow.
    type Series = (&'static str, fn(&Sample) -> f64, Slack);

    /// What each series may do. Descriptors, sockets, threads and backends move by a few as
    /// connections are cut and opened again and blocking threads come and go; memory, tasks and
    /// table sizes by a share plus a floor. A steady leak of L over the run raises the last
    /// third's highest by L/3 over the middle third's, so memory's 5 % + 6 MB catches a leak
    /// of about 30 MB over the run on the relay's 55-65 MB (what one run measured: samples
    /// moved by 6 MB as faults came and went). Lag and the unfolded count are judged by a
    /// bound instead (a fault in the last third raises them).
    const SERIES: [Series; 10] = [
        ("relay RSS (MB)", |s| s.relay_rss_mb, Slack::new(0.05, 6.0)),
        ("relay fds", |s| s.relay_fds, Slack::new(0.0, 8.0)),
        ("relay sockets", |s| s.relay_sockets, Slack::new(0.0, 6.0)),
        ("relay threads", |s| s.relay_threads, Slack::new(0.0, 6.0)),
        ("relay tasks", |s| s.relay_tasks, Slack::new(0.1, 20.0)),
        (
            "consumer RSS (MB)",
            |s| s.process_rss_mb,
            Slack::new(0.1, 16.0),
        ),
        ("backends", |s| s.backends, Slack::new(0.0, 8.0)),
        (
            "relay tables (kB)",
            |s| s.relay_tables_kb,
            Slack::new(0.25, 1024.0),
        ),
        (
            "fold tables (kB)",
            |s| s.fold_tables_kb,
            Slack::new(0.25, 1024.0),
        ),
        ("dead rows", |s| s.dead_rows, Slack::new(0.25, 5000.0)),
    ];

    /// What the writers wrote: events committed, and runs closed.
    #[derive(Default)]
    struct Written {
        events: AtomicU64,
        runs: AtomicU64,
    }

    fn payload(branch: &BranchKey, lsn: u64) -> Vec<u8> {
        let mut text = format!("{}/{}@{lsn}", branch.tenant, branch.run);
        assert!(text.len() <= PAYLOAD);
        text.extend(std::iter::repeat_n('.', PAYLOAD - text.len()));
        text.into_bytes()
    }

    /// One writer: runs of [`RUN_LENGTH`] events, one transaction per event at `per_second`,
    /// the last one closing the run; stops between runs once `stop` is set.
    async fn writer(
        pool: PgPool,
        tenant: usize,
        id: usize,
        per_second: f64,
        stop: Arc<AtomicBool>,
        written: Arc<Written>,
    ) {
        let host = IntentWriter::default();
        let mut pace = tokio::time::interval(Duration::from_secs_f64(1.0 / per_second));
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let tenant_id = TenantId::new(format!("soak{tenant}")).unwrap();
        for run in 0.. {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            let branch = BranchKey::new(
                tenant_id.clone(),
                RunId::new(format!("w{id}r{run}")).unwrap(),
                BranchId::new("main").unwrap(),
            );
            for lsn in 1..=RUN_LENGTH {
                pace.tick().await;
                let mut tx = pool.begin().await.unwrap();
                if lsn == 1 {
                    host.open_run(&mut tx, &branch).await.unwrap();
                }
                host.append(&mut tx, &branch, Lsn::new(lsn), &payload(&branch, lsn))
                    .await
                    .unwrap();
                if lsn == RUN_LENGTH {
                    host.close_run(&mut tx, &branch.tenant, &branch.run)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();
                written.events.fetch_add(1, Ordering::SeqCst);
            }
            written.runs.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A relay process of the soak, its log in `logs`, and its `/metrics` address.
    fn relay(
        name: &str,
        database: &str,
        amqp: &str,
        topology: &str,
        logs: &Path,
    ) -> (Process, String) {
        let log = std::fs::File::create(logs.join(format!("{name}.log"))).unwrap();
        let metrics = free_addr();
        let child = run_command(database, amqp, topology, &metrics)
            .env("RELAY_RETENTION_SECS", "1")
            .env("RELAY_LEASE_TTL_MS", LEASE_TTL.as_millis().to_string())
            .env("RELAY_LEASE_HEARTBEAT_MS", "1000")
            .env("RELAY_POLL_MS", "200")
            .stderr(log.try_clone().unwrap())
            .stdout(log)
            .spawn()
            .expect("spawn the relay binary");
        (Process(child), metrics)
    }

    /// `key:` of `/proc/<pid>/status`, its first number.
    fn status_field(pid: u32, key: &str) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|line| line.strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|number| number.parse().ok())
            .unwrap_or(f64::NAN)
    }

    /// Descriptors open in `pid`, and how many of them are sockets.
    fn descriptors(pid: u32) -> (f64, f64) {
        let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return (f64::NAN, f64::NAN);
        };
        let (mut all, mut sockets) = (0, 0);
        for entry in entries.flatten() {
            all += 1;
            if std::fs::read_link(entry.path())
                .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"))
            {
                sockets += 1;
            }
        }
        (all as f64, sockets as f64)
    }

    /// The value of the unlabelled gauge `name` in a Prometheus scrape.
    fn gauge(scrape: &str, name: &str) -> f64 {
        scrape
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(f64::NAN)
    }

    /// Bytes of the relay's tables (and their indexes and TOAST) in `pool`'s database, but
    /// `except`.
    async fn relay_tables_kb(pool: &PgPool, except: &str) -> f64 {
        let bytes: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE c.relkind = 'r' AND c.relname LIKE 'relay\\_%' AND c.relname <> $1
                AND n.nspname NOT IN ('pg_catalog', 'information_schema')",
        )
        .bind(except)
        .fetch_one(pool)
        .await
        .unwrap();
        bytes as f64 / 1024.0
    }

    struct Probe {
        relay_pid: u32,
        relay_metrics: String,
        host: PgPool,
        fold: PgPool,
        databases: Vec<String>,
        written: Arc<Written>,
        progress: distribution::consumer::ConsumerProgress,
        /// The highest lag seen since the last sample, in ms (the lag watcher's).
        worst_lag_ms: Arc<AtomicU64>,
        started: Instant,
    }

    impl Probe {
        async fn sample(&self) -> Sample {
            let pid = self.relay_pid;
            let (relay_fds, relay_sockets) = descriptors(pid);
            let scrape = tokio::time::timeout(
                Duration::from_secs(5),
                http_get(&self.relay_metrics, "/metrics"),
            )
            .await
            .ok()
            .flatten()
            .map(|(_, body)| body)
            .unwrap_or_default();
            let backends: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = ANY($1)")
                    .bind(&self.databases)
                    .fetch_one(&self.host)
                    .await
                    .unwrap();
            let dead_rows: i64 = sqlx::query_scalar(
                "SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables
                  WHERE relname LIKE 'relay\\_%'",
            )
            .fetch_one(&self.host)
            .await
            .unwrap();
            let lag = self.worst_lag_ms.swap(0, Ordering::SeqCst) as f64 / 1000.0;
            let applied = self.progress.totals().applied;
            Sample {
                at: self.started.elapsed(),
                relay_rss_mb: status_field(pid, "VmRSS:") / 1024.0,
                relay_fds,
                relay_sockets,
                relay_threads: status_field(pid, "Threads:"),
                relay_tasks: gauge(&scrape, "relay_runtime_tasks"),
                process_rss_mb: status_field(std::process::id(), "VmRSS:") / 1024.0,
                backends: backends as f64,
                relay_tables_kb: relay_tables_kb(&self.host, "").await,
                fold_tables_kb: relay_tables_kb(&self.fold, "relay_fold_event").await,
                dead_rows: dead_rows as f64,
                lag_secs: lag,
                unfolded: self.written.events.load(Ordering::SeqCst) as f64 - applied as f64,
            }
        }
    }

    /// The age of the oldest intent in the outbox (0 when empty), in ms.
    async fn lag_ms(host: &PgPool) -> u64 {
        let (now, oldest) = oldest_pending(host).await;
        oldest.map_or(0, |oldest| (now - oldest).num_milliseconds().max(0) as u64)
    }

    fn table(plan: &Plan, rate: f64, samples: &[Sample], verdicts: &[String]) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Soak: {} s, a sample every {} s, {rate:.0} events/s written ({} offered)\n",
            plan.length.as_secs(),
            plan.sample_every.as_secs(),
            plan.rate
        );
        let _ = writeln!(
            out,
            "Relay B restarted every {} s (SIGTERM and SIGKILL in turn); relay A's broker cut, \
             then silenced, then its database silenced, for {} s every {} s. Written by \
             `tests/soak.rs`. The test process holds the consumer, the writers and the \
             proxies; backends count every connection to both databases; dead rows are the \
             relay's tables'.\n",
            plan.restart_every.as_secs(),
            plan.fault_for.as_secs(),
            plan.fault_every.as_secs()
        );
        let _ = writeln!(
            out,
            "| s | relay A RSS MB | fds | sockets | threads | tasks | test process RSS MB | backends | relay tables kB | fold tables kB | relay dead rows | worst lag s | unfolded |"
        );
        let _ = writeln!(out, "|{}", "---|".repeat(13));
        for s in samples {
            let _ = writeln!(
                out,
                "| {} | {:.1} | {} | {} | {} | {} | {:.1} | {} | {:.0} | {:.0} | {} | {:.1} | {} |",
                s.at.as_secs(),
                s.relay_rss_mb,
                s.relay_fds,
                s.relay_sockets,
                s.relay_threads,
                s.relay_tasks,
                s.process_rss_mb,
                s.backends,
                s.relay_tables_kb,
                s.fold_tables_kb,
                s.dead_rows,
                s.lag_secs,
                s.unfolded
            );
        }
        let _ = writeln!(out);
        if verdicts.is_empty() {
            let _ = writeln!(
                out,
                "Verdict: no series grew past its warm-up; lag within bound."
            );
        } else {
            for verdict in verdicts {
                let _ = writeln!(out, "- {verdict}");
            }
        }
        out
    }

    /// The fold holds each closed run's 20 events exactly once, applied in Lsn order, with
    /// their payloads: the number of runs and the rows that break a rule.
    async fn fold_breaches(fold: &PgPool) -> (i64, i64, i64) {
        sqlx::query_as(
            "WITH applied AS (
               SELECT tenant_id, run_id, lsn, payload,
                      row_number() OVER (PARTITION BY tenant_id, run_id, branch_id
                                         ORDER BY applied_seq) AS nth
                 FROM relay_fold_event)
             SELECT (SELECT count(DISTINCT (tenant_id, run_id)) FROM applied),
                    count(*) FILTER (WHERE lsn <> nth OR length(payload) <> 200
                       OR rtrim(convert_from(payload, 'UTF8'), '.') <> tenant_id || '/' || run_id || '@' || lsn),
                    (SELECT count(*) FROM (SELECT 1 FROM applied GROUP BY tenant_id, run_id
                                            HAVING count(*) <> 20 OR max(lsn) <> 20) short)
               FROM applied",
        )
        .fetch_one(fold)
        .await
        .unwrap()
    }

    /// Kills the process it holds when dropped (a panicking test's relay B).
    struct KillOnDrop(Arc<Mutex<Option<Process>>>);

    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            drop(
                self.0
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner())
                    .take(),
            );
        }
    }

    /// A task aborted when dropped (a panicking test's writers, consumer and watchers).
    struct AbortOnDrop<T>(Option<tokio::task::JoinHandle<T>>);

    impl<T: Send + 'static> AbortOnDrop<T> {
        fn spawn(task: impl std::future::Future<Output = T> + Send + 'static) -> Self {
            Self(Some(tokio::spawn(task)))
        }

        /// Its result; a panic inside it is the test's.
        async fn join(mut self) -> T {
            let handle = self.0.take().expect("joined once");
            match handle.await {
                Ok(value) => value,
                Err(err) => std::panic::resume_unwind(err.into_panic()),
            }
        }
    }

    impl<T> Drop for AbortOnDrop<T> {
        fn drop(&mut self) {
            if let Some(handle) = &self.0 {
                handle.abort();
            }
        }
    }

    /// Waits up to `limit` for `process` to exit (then kills it): its exit status.
    async fn wait_exit(process: &mut Process, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = process.0.try_wait().unwrap() {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = process.0.kill();
                return process.0.wait().unwrap();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends `signal` to relay B and waits (30 s at most) for it to exit.
    async fn stop_process(
        relay_b: &Arc<Mutex<Option<Process>>>,
        signal: &str,
    ) -> std::process::ExitStatus {
        let mut process = relay_b.lock().unwrap().take().expect("relay B is running");
        process.signal(signal);
        wait_exit(&mut process, Duration::from_secs(30)).await
    }

    #[test]
    fn the_relay_and_consumer_hold_steady_through_restarts_and_cuts() {
        let plan = Plan::from_env();
        let logs = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("soak");
        let _ = std::fs::remove_dir_all(&logs);
        std::fs::create_dir_all(&logs).unwrap();
        // A private server set as production sets it: the machine's runs with autovacuum
        // off, and an outbox (every row inserted, then deleted) lives on vacuum. The smoke
        // wakes autovacuum every 10 s so that it acts within two minutes; the full run keeps
        // every default.
        let naptime = if plan.length < Duration::from_secs(600) {
            "autovacuum = on\nautovacuum_naptime = 10s"
        } else {
            "autovacuum = on"
        };
        let server = PgPair::alone(Postgres::V17, "soak", naptime);
        server.psql(server.primary_port(), "CREATE DATABASE fold");
        let url = server.url(server.primary_port());
        let fold_url = url.replace("/relay", "/fold");
        host_runtime().block_on(async {
            let host = PgPool::connect(&url).await.unwrap();
            distribution::store::migrate(&host).await.unwrap();
            let fold = PgPool::connect(&fold_url).await.unwrap();
            distribution::store::migrate_fold(&fold).await.unwrap();
            let topology = unique("relay-soak");
            let config = relay_config(&url, &amqp_url(), &topology);
            let rabbit = direct_rabbit(&config);
            declare_topology(&rabbit.topology).await;
            let broker = BrokerProxy::start(&amqp_url()).unwrap();
            let database = BrokerProxy::start(&url).unwrap();
            let databases = vec!["relay".to_owned(), "fold".to_owned()];

            // Relay B, shared with the task that restarts it: killed with the test's body,
            // also when it panics (before the clean-up deletes the topology it would declare
            // again).
            let relay_b = Arc::new(Mutex::new(None::<Process>));
            let _kill_b = KillOnDrop(relay_b.clone());
            let run = async {
                let (mut relay_a, metrics_a) = relay(
                    "relay-a",
                    &database.url(),
                    &broker.amqp_url(),
                    &topology,
                    &logs,
                );
                // The fold keeps a run's state well past the longest redelivery a fault can
                // cause (a lease's TTL to notice, another to take over, the fault itself):
                // retired sooner, a late copy is refused as a retired run's (RL202) and
                // dead-lettered, as docs/sql-api.md warns. A first run with 3 s saw that.
                let fold_retention = (plan.fault_for + LEASE_TTL * 2) * 2;
                let mut consumer_config = ConsumerConfig::new(rabbit.clone());
                consumer_config.retention = Some(Retention::new(fold_retention));
                let consumer = Consumer::new(consumer_config, fold.clone(), EventTable);
                let progress = consumer.progress();
                let consuming = until_stopped(|stopped| consumer.run(stopped));

                let stop = Arc::new(AtomicBool::new(false));
                let written = Arc::new(Written::default());
                let per_writer = plan.rate as f64 / (TENANTS * WRITERS_PER_TENANT) as f64;
                let writers: Vec<_> = (0..TENANTS * WRITERS_PER_TENANT)
                    .map(|id| {
                        AbortOnDrop::spawn(writer(
                            host.clone(),
                            id % TENANTS,
                            id,
                            per_writer,
                            stop.clone(),
                            written.clone(),
                        ))
                    })
                    .collect();

                // The lag, every second: each sample keeps the worst since the one before.
                let worst_lag_ms = Arc::new(AtomicU64::new(0));
                let lag_watch = AbortOnDrop::spawn({
                    let (host, worst, stop) = (host.clone(), worst_lag_ms.clone(), stop.clone());
                    async move {
                        let mut every = tokio::time::interval(Duration::from_secs(1));
                        while !stop.load(Ordering::SeqCst) {
                            every.tick().await;
                            worst.fetch_max(lag_ms(&host).await, Ordering::SeqCst);
                        }
                    }
                });

                // Relay B: restarted on its schedule, SIGTERM and SIGKILL in turn; each
                // SIGTERM must end in a clean exit within its grace.
                let (chaos_stop, mut chaos_stopped) = tokio::sync::watch::channel(false);
                let restarts = AbortOnDrop::spawn({
                    let (relay_b, url, topology, logs) =
                        (relay_b.clone(), url.clone(), topology.clone(), logs.clone());
                    async move {
                        let start = |generation: u32| {
                            let name = format!("relay-b{generation}");
                            *relay_b.lock().unwrap() =
                                Some(relay(&name, &url, &amqp_url(), &topology, &logs).0);
                        };
                        let (mut terms, mut kills) = (0u32, 0u32);
                        start(0);
                        let mut every = tokio::time::interval_at(
                            tokio::time::Instant::now() + plan.restart_every,
                            plan.restart_every,
                        );
                        loop {
                            tokio::select! {
                                _ = every.tick() => {}
                                _ = chaos_stopped.wait_for(|stop| *stop) => break,
                            }
                            let signal = if (terms + kills) % 2 == 0 {
                                "-TERM"
                            } else {
                                "-KILL"
                            };
                            let stopped = stop_process(&relay_b, signal).await;
                            if signal == "-TERM" {
                                assert!(stopped.success(), "relay B's SIGTERM ended in {stopped}");
                                terms += 1;
                            } else {
                                kills += 1;
                            }
                            start(terms + kills);
                        }
                        let stopped = stop_process(&relay_b, "-TERM").await;
                        assert!(
                            stopped.success(),
                            "relay B's last SIGTERM ended in {stopped}"
                        );
                        (terms, kills)
                    }
                });

                let probe = Probe {
                    relay_pid: relay_a.0.id(),
                    relay_metrics: metrics_a,
                    host: host.clone(),
                    fold: fold.clone(),
                    databases,
                    written: written.clone(),
                    progress: progress.clone(),
                    worst_lag_ms,
                    started: Instant::now(),
                };
                let mut samples = Vec::new();
                let mut faults = 0;
                let mut sampling = tokio::time::interval_at(
                    tokio::time::Instant::now() + plan.sample_every,
                    plan.sample_every,
                );
                // Half a period in, so that the smoke's 100 s hold one fault of each
                // kind (at 17, 52 and 87 s).
                let mut faulting = tokio::time::interval_at(
                    tokio::time::Instant::now() + plan.fault_every / 2,
                    plan.fault_every,
                );
                let deadline = tokio::time::Instant::now() + plan.length;
                let mut fault_ends: Option<tokio::time::Instant> = None;
                loop {
                    let heal = fault_ends.unwrap_or(deadline);
                    tokio::select! {
                        _ = tokio::time::sleep_until(deadline) => break,
                        _ = sampling.tick() => {
                            assert!(
                                relay_a.0.try_wait().unwrap().is_none(),
                                "relay A exited mid-run (its log: {})",
                                logs.join("relay-a.log").display()
                            );
                            let sample = probe.sample().await;
                            println!("{sample:?}");
                            samples.push(sample);
                        }
                        _ = faulting.tick(), if fault_ends.is_none() => {
                            match faults % 3 {
                                0 => broker.cut(),
                                1 => broker.silence(),
                                _ => database.silence(),
                            }
                            faults += 1;
                            fault_ends = Some(tokio::time::Instant::now() + plan.fault_for);
                        }
                        _ = tokio::time::sleep_until(heal), if fault_ends.is_some() => {
                            broker.restore();
                            database.restore();
                            fault_ends = None;
                        }
                    }
                }
                broker.restore();
                database.restore();
                let _ = chaos_stop.send(true);
                stop.store(true, Ordering::SeqCst);
                for writer in writers {
                    writer.join().await;
                }
                lag_watch.join().await;
                let (terms, kills) = restarts.join().await;
                let events = written.events.load(Ordering::SeqCst);
                let runs = written.runs.load(Ordering::SeqCst);

                // The run's verdict: growth and lag first (they are what a soak is for).
                let mut verdicts = Vec::new();
                for (name, read, slack) in SERIES {
                    let series: Vec<f64> = samples.iter().map(read).collect();
                    if let Some(at) = series.iter().position(|value| !value.is_finite()) {
                        verdicts.push(format!("{name}: sample {at} could not be read"));
                    } else if let Some(why) = growth(&series, slack) {
                        verdicts.push(format!("{name} grew: {why}"));
                    }
                }
                let lag: Vec<f64> = samples.iter().map(|s| s.lag_secs).collect();
                let lag_bound = (plan.fault_for + LEASE_TTL).as_secs_f64() + 30.0;
                if let Some(why) = above(&lag, lag_bound) {
                    verdicts.push(format!("lag: {why}"));
                }
                let unfolded: Vec<f64> = samples.iter().map(|s| s.unfolded).collect();
                if let Some(why) = above(&unfolded, plan.rate as f64 * lag_bound) {
                    verdicts.push(format!("unfolded events: {why}"));
                }
                let rate = events as f64 / plan.length.as_secs_f64();
                let report = table(&plan, rate, &samples, &verdicts);
                std::fs::write(logs.join("soak.md"), &report).unwrap();
                println!("{report}");
                println!(
                    "{events} events in {runs} runs written; relay B stopped {terms} times by \
                     SIGTERM and {kills} by SIGKILL; {faults} faults on relay A"
                );
                assert!(
                    terms >= 1 && kills >= 1 && faults >= 3,
                    "the soak ran every fault: {terms} SIGTERM, {kills} SIGKILL, {faults} cuts"
                );
                assert!(
                    verdicts.is_empty(),
                    "the soak found growth (logs and table in {}):\n{}",
                    logs.display(),
                    verdicts.join("\n")
                );

                // Then everything written is folded exactly once, in order, and every run is
                // retired on both sides.
                wait_until("every event folded", Duration::from_secs(120), || async {
                    progress.totals().applied >= events
                })
                .await;
                let (folded_runs, broken, short) = fold_breaches(&fold).await;
                assert_eq!(
                    (folded_runs, broken, short),
                    (runs as i64, 0, 0),
                    "runs folded, rows out of order or with another payload, runs not whole"
                );
                let totals = progress.totals();
                assert_eq!(
                    totals.applied, events,
                    "each event applied once: {totals:?}"
                );
                assert_eq!(totals.rejected, 0, "nothing dead-lettered: {totals:?}");
                wait_until(
                    "every closed run retired by the relay and the consumer",
                    fold_retention * 2 + Duration::from_secs(30),
                    || async {
                        let left: (i64, i64) = (
                            sqlx::query_scalar("SELECT count(*) FROM relay_branch")
                                .fetch_one(&host)
                                .await
                                .unwrap(),
                            sqlx::query_scalar("SELECT count(*) FROM relay_fold_cursor")
                                .fetch_one(&fold)
                                .await
                                .unwrap(),
                        );
                        left == (0, 0)
                    },
                )
                .await;
                tokio::time::timeout(Duration::from_secs(60), consuming.stop())
                    .await
                    .expect("the consumer stops within 60 s")
                    .unwrap();
                assert!(
                    relay_a.0.try_wait().unwrap().is_none(),
                    "relay A exited before the end"
                );
                relay_a.signal("-TERM");
                let stopped = wait_exit(&mut relay_a, Duration::from_secs(30)).await;
                assert!(stopped.success(), "relay A's SIGTERM ended in {stopped}");
                // Only a passing full run is the figures benches/soak.md shows.
                if plan.full() {
                    std::fs::write(
                        Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/soak.md"),
                        &report,
                    )
                    .unwrap();
                }
            };
            // The server's log joins the relays' (it is removed with the server).
            let clean_up = async {
                drop_topology(&rabbit.topology).await;
                for log in crate::pg_pair::logs(&server) {
                    let _ = std::fs::copy(&log, logs.join("postgres.log"));
                }
            };
            then_clean_up(run, clean_up).await;
        });
    }
}

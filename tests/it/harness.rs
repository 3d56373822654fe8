//! Shared harness of the relay's integration tests: a fresh database per test, unique broker
//! names, a host runtime with named executor threads, a simulated agent workload, a fold that
//! consumes the real broker, and waiting on conditions with deadlines (never sleeps as sync).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distribution::broker::RetryPolicy;
use distribution::consumer::{Consumer, ConsumerConfig, ConsumerProgress, FoldStats};
use distribution::rabbit::{RabbitConfig, Topology};
use distribution::store::{
    self, BranchId, BranchKey, EventTable, FoldStore, IntentWriter, Lsn, Outbox, RunId, TenantId,
};
use distribution::{RelayConfig, RelayHandle};
use sqlx::PgPool;
#[allow(unused_imports)] // each test binary that includes the harness uses some
pub use testkit::{
    Running, amqp_url, declare_topology_at, delete_topology_at as drop_topology_at, empty_database,
    fold_database, free_addr, holds_within, unique, until_stopped, wait_until,
};

/// Name prefix of the host's executor threads: the broker client must never run on them.
pub const HOST_THREADS: &str = "host-executor";

/// The `distribution` binary with none of the suite's own relay settings (`RELAY_*`,
/// `DATABASE_URL`, `AMQP_URL`, `NATS_URL`) leaking in: each test sets what it means.
pub fn relay_command() -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_distribution"));
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("RELAY_")
            || name == "DATABASE_URL"
            || name == "AMQP_URL"
            || name == "NATS_URL"
        {
            command.env_remove(name.as_ref());
        }
    }
    command.stdin(std::process::Stdio::null());
    command
}

/// `distribution run` on the database `url` and the broker `amqp`, with its own topology (the
/// harness's 4 partitions, so `drop_topology_named` removes every queue) and `/metrics`
/// address, silent; add settings with `.env`.
pub fn run_command(url: &str, amqp: &str, topology: &str, addr: &str) -> std::process::Command {
    let mut command = relay_command();
    command
        .arg("run")
        .env("DATABASE_URL", url)
        .env("AMQP_URL", amqp)
        .env("RELAY_TOPOLOGY", topology)
        .env("RELAY_PARTITIONS", "4")
        .env("RELAY_METRICS_ADDR", addr)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    command
}

/// `GET path` on `addr` (a relay's `/metrics`, `/healthz`, `/readyz`): status and body, or
/// `None` if nothing answers.
pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let (status, _, body) = http_send(addr, "GET", path, &[], Vec::new()).await?;
    Some((status, body))
}

/// `method path` on `addr` with `headers` (a `host` header is added unless given) and `body`:
/// status, headers and body (as text), or `None` if nothing answers.
pub async fn http_send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Option<(u16, hyper::HeaderMap, String)> {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let io = hyper_util::rt::TokioIo::new(stream);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io).await.ok()?;
    tokio::spawn(connection);
    let mut request = hyper::Request::builder().method(method).uri(path);
    if !headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("host"))
    {
        request = request.header("host", addr);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
        .ok()?;
    let response = sender.send_request(request).await.ok()?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.ok()?.to_bytes();
    Some((status, headers, String::from_utf8_lossy(&body).into_owned()))
}

/// Runs `test`, then `clean_up` whether the test passed or panicked, then the test's panic.
pub async fn then_clean_up(
    test: impl std::future::Future<Output = ()>,
    clean_up: impl std::future::Future<Output = ()>,
) {
    use futures_util::FutureExt;
    let outcome = std::panic::AssertUnwindSafe(test).catch_unwind().await;
    clean_up.await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// The relays' and consumers' own account in a test's captured output (cargo shows it with a
/// failure, so a failing run keeps every relay's log): `RUST_LOG` if set, else warnings and the
/// relay's INFO lines (leases lost and handed over, publishers restarting, stalls: a few per
/// test), each with its thread's name (`outbox-relay-<n>`: which relay of the test said it),
/// without lapin's own (a connection a fault cuts is logged by lapin at ERROR each time, which
/// buries the failure's message). Every relay the harness configures calls it.
pub fn capture_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(
            "warn,supervisor=info,actors=info,broker=info,consumer=info,distribution=info,lapin=off",
        )
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_thread_names(true)
        .with_ansi(false)
        .with_test_writer()
        .try_init();
}

/// The host: a multi-thread runtime whose workers are named `host-executor`, torn down within
/// 10 s when dropped.
pub fn host_runtime() -> HostRuntime {
    HostRuntime::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(HOST_THREADS)
            .enable_all()
            .build()
            .unwrap(),
    )
}

/// A test's runtime whose drop gives its tasks 10 s to stop, where a plain runtime's drop waits
/// for ever: lapin 4.12.3 can deadlock a worker thread with its I/O thread when a connection
/// error meets an incoming delivery (`Consumers::error` holds the consumers' lock and waits
/// for the channel's status, which the I/O loop holds while it waits for the consumers' lock).
/// Seen once, after a test had passed every check, as a drop that never returned and hung the
/// suite.
pub struct HostRuntime(Option<tokio::runtime::Runtime>);

impl HostRuntime {
    pub fn new(runtime: tokio::runtime::Runtime) -> Self {
        Self(Some(runtime))
    }
}

impl std::ops::Deref for HostRuntime {
    type Target = tokio::runtime::Runtime;

    fn deref(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("the runtime lives until dropped")
    }
}

impl Drop for HostRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_timeout(std::time::Duration::from_secs(10));
        }
    }
}

/// A fresh database with nothing in it (a consumer's own database, say).
pub async fn bare_database(label: &str) -> PgPool {
    empty_database(label).await.0
}

/// A fresh, migrated database with a host state table; returns its pool and URL.
pub async fn fresh_database(label: &str) -> (PgPool, String) {
    let (pool, url) = testkit::migrated_database(label).await;
    host_state(&pool).await;
    (pool, url)
}

/// The outbox migrated on `url` (a private server's) with the host's state table, and a relay
/// configuration for it with leases on a quick clock (TTL 1.5 s, heartbeat 250 ms), batches of
/// 20 and an in-flight budget of 200, on a topology of its own.
pub async fn quick_leases_on(url: &str, label: &str) -> (PgPool, RelayConfig) {
    let pool = PgPool::connect(url).await.unwrap();
    distribution::store::migrate(&pool).await.unwrap();
    host_state(&pool).await;
    let mut config = relay_config(url, &amqp_url(), &unique(label));
    config.supervisor.lease.ttl = Duration::from_millis(1500);
    config.supervisor.lease.heartbeat = Duration::from_millis(250);
    config.supervisor.drainer.batch_size = 20;
    config.supervisor.max_in_flight = 200;
    (pool, config)
}

/// The host's own state table, which [`Workload`] writes beside its intents.
pub async fn host_state(pool: &PgPool) {
    sqlx::query("CREATE TABLE host_state (tenant text, run text, step bigint, note text)")
        .execute(pool)
        .await
        .unwrap();
}

/// A relay configuration with test-speed timings.
pub fn relay_config(database_url: &str, amqp_url: &str, topology: &str) -> RelayConfig {
    capture_logs();
    let mut config = RelayConfig::new(database_url, amqp_url);
    config.topology = topology.to_owned();
    config.partitions = 4;
    config.supervisor.shards = 3;
    config.supervisor.poll_interval = Duration::from_millis(100);
    config.supervisor.metrics_interval = Duration::from_millis(100);
    config.supervisor.restart.min = Duration::from_millis(20);
    config.supervisor.restart.max = Duration::from_millis(300);
    config.supervisor.drainer.retry.min = Duration::from_millis(20);
    config.supervisor.drainer.retry.max = Duration::from_millis(300);
    config.supervisor.drainer.batch_timeout = Duration::from_secs(10);
    config.supervisor.finish_grace = Duration::from_secs(5);
    config
}

/// The broker side of `config`, but talking to the real broker directly (the fold's side).
pub fn direct_rabbit(config: &RelayConfig) -> RabbitConfig {
    let mut direct = config.clone();
    direct.amqp_url = amqp_url();
    direct.rabbit_config().unwrap()
}

/// What the fold must end with: per branch, the live events in Lsn order with their payloads.
pub type Expected = BTreeMap<BranchKey, Vec<(Lsn, Vec<u8>)>>;

pub fn count(expected: &Expected) -> usize {
    expected.values().map(Vec::len).sum()
}

pub fn tenants_of(expected: &Expected) -> Vec<TenantId> {
    let mut tenants: Vec<TenantId> = expected.keys().map(|key| key.tenant.clone()).collect();
    tenants.dedup();
    tenants
}

/// A simulated agent workload: tenants x runs, `steps` steps each, interleaved round-robin; each
/// step is one host transaction writing the host's state and the export intent. With `rewind`,
/// run 0 of each tenant rewinds 3 steps halfway (only use it while nothing can ship).
pub struct Workload {
    pub prefix: String,
    pub tenants: usize,
    pub runs: usize,
    pub steps: u64,
    pub rewind: bool,
}

pub struct Ran {
    pub expected: Expected,
    pub elapsed: Duration,
    /// Each run's live branch and its head, to continue the runs.
    pub live: Vec<(BranchKey, u64)>,
    /// Rewinds made (each writes one rewind marker to the outbox).
    pub rewinds: usize,
}

impl Workload {
    pub fn new(prefix: &str, tenants: usize, runs: usize, steps: u64) -> Self {
        Self {
            prefix: prefix.to_owned(),
            tenants,
            runs,
            steps,
            rewind: false,
        }
    }

    /// Opens the runs and writes `steps` steps.
    pub async fn run(&self, pool: &PgPool) -> Ran {
        let writer = IntentWriter::default();
        let mut live: Vec<(BranchKey, u64)> = Vec::new();
        for tenant in 0..self.tenants {
            for run in 0..self.runs {
                let key = BranchKey::new(
                    TenantId::new(format!("{}-t{tenant}", self.prefix)).unwrap(),
                    RunId::new(format!("r{run}")).unwrap(),
                    BranchId::new("main").unwrap(),
                );
                writer
                    .open_run(&mut pool.acquire().await.unwrap(), &key)
                    .await
                    .unwrap();
                live.push((key, 0));
            }
        }
        self.steps(pool, live, 1..=self.steps).await
    }

    /// Writes the steps `range` on the live branches `live` (continuing a previous `Ran`).
    pub async fn steps(
        &self,
        pool: &PgPool,
        mut live: Vec<(BranchKey, u64)>,
        range: std::ops::RangeInclusive<u64>,
    ) -> Ran {
        let writer = IntentWriter::default();
        let mut expected = Expected::new();
        let mut rewinds = 0;
        let started = Instant::now();
        for step in range {
            for (index, (branch, lsn)) in live.iter_mut().enumerate() {
                if self.rewind && step == self.steps / 2 && index % self.runs == 0 {
                    let at = *lsn - 3;
                    let rewound = writer
                        .rewind(
                            &mut pool.acquire().await.unwrap(),
                            branch,
                            Lsn::new(at),
                            BranchId::new(format!("fork{step}")).unwrap(),
                        )
                        .await
                        .unwrap();
                    assert_eq!(rewound.abandoned, 3);
                    rewinds += 1;
                    expected
                        .get_mut(branch)
                        .unwrap()
                        .retain(|(event_lsn, _)| event_lsn.get() <= at);
                    *branch = rewound.live;
                    *lsn = at;
                }
                *lsn += 1;
                let payload = format!("{branch}@{lsn}:step{step}").into_bytes();
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("INSERT INTO host_state (tenant, run, step, note) VALUES ($1, $2, $3, 'thought')")
                    .bind(branch.tenant.as_str())
                    .bind(branch.run.as_str())
                    .bind(step as i64)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                writer
                    .append(&mut tx, branch, Lsn::new(*lsn), &payload)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                expected
                    .entry(branch.clone())
                    .or_default()
                    .push((Lsn::new(*lsn), payload));
            }
        }
        Ran {
            expected,
            elapsed: started.elapsed(),
            live,
            rewinds,
        }
    }
}

pub fn merge(into: &mut Expected, more: &Expected) {
    for (branch, events) in more {
        into.entry(branch.clone())
            .or_default()
            .extend(events.iter().cloned());
    }
}

/// Number of expected events already folded.
pub async fn folded_count(fold: &FoldStore, expected: &Expected) -> usize {
    let mut folded = 0;
    for tenant in tenants_of(expected) {
        folded += fold.folded(&tenant).await.unwrap().len();
    }
    folded
}

/// The fold holds exactly `expected`: every live event once, applied in Lsn order per branch,
/// nothing else, nothing parked.
pub async fn assert_folded_exactly(fold: &FoldStore, expected: &Expected) {
    for tenant in tenants_of(expected) {
        let mut got = Expected::new();
        for event in fold.folded(&tenant).await.unwrap() {
            got.entry(event.key.branch)
                .or_default()
                .push((event.key.lsn, event.payload));
        }
        let want: Expected = expected
            .iter()
            .filter(|(key, _)| key.tenant == tenant)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(got.len(), want.len(), "branches of {tenant}");
        for (branch, events) in &want {
            let got_lsns: Vec<u64> = got[branch].iter().map(|(lsn, _)| lsn.get()).collect();
            let want_lsns: Vec<u64> = events.iter().map(|(lsn, _)| lsn.get()).collect();
            assert_eq!(
                got_lsns, want_lsns,
                "fold of {branch}: each live event once, in Lsn order"
            );
            assert_eq!(&got[branch], events, "payloads of {branch}");
        }
        assert_eq!(fold.parked(&tenant).await.unwrap(), 0);
    }
}

/// Waits (up to 60 s) until the fold has as many events as `expected`, then checks it holds
/// exactly `expected` ([`assert_folded_exactly`]).
pub async fn until_folded_exactly(fold: &FoldStore, expected: &Expected, what: &str) {
    wait_until(what, Duration::from_secs(60), || async {
        folded_count(fold, expected).await == count(expected)
    })
    .await;
    assert_folded_exactly(fold, expected).await;
}

/// Opens run `r`, branch `b` of `tenant` and appends its first intent, in one host
/// transaction; returns the branch.
pub async fn write_first_intent(pool: &PgPool, tenant: &str, payload: &[u8]) -> BranchKey {
    let branch = BranchKey::new(
        TenantId::new(tenant).unwrap(),
        RunId::new("r").unwrap(),
        BranchId::new("b").unwrap(),
    );
    let writer = IntentWriter::default();
    let mut tx = pool.begin().await.unwrap();
    writer.open_run(&mut tx, &branch).await.unwrap();
    writer
        .append(&mut tx, &branch, Lsn::new(1), payload)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    branch
}

/// Appends `payload` at `lsn` to `branch`, in one host transaction.
pub async fn append_intent(pool: &PgPool, branch: &BranchKey, lsn: u64, payload: &[u8]) {
    let mut tx = pool.begin().await.unwrap();
    IntentWriter::default()
        .append(&mut tx, branch, Lsn::new(lsn), payload)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

pub async fn pending(outbox: &Outbox) -> u64 {
    outbox
        .backlog()
        .await
        .unwrap()
        .iter()
        .map(|tenant| tenant.pending)
        .sum()
}

/// The oldest intent still in the outbox (none: empty), and the database's clock.
pub async fn oldest_pending(
    pool: &PgPool,
) -> (
    chrono::DateTime<chrono::Utc>,
    Option<chrono::DateTime<chrono::Utc>>,
) {
    sqlx::query_as("SELECT now(), min(created_at) FROM relay_outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Fold consumers on every partition of the real broker, until stopped: the project's own
/// projection ([`FoldStore`]'s `EventTable`), reconnecting quickly (20-500 ms).
pub struct Folding {
    running: Running<FoldStats>,
    pub progress: ConsumerProgress,
}

impl Folding {
    pub fn start(rabbit: RabbitConfig, fold: &FoldStore) -> Self {
        let mut config = ConsumerConfig::new(rabbit);
        config.retry = RetryPolicy {
            min: Duration::from_millis(20),
            max: Duration::from_millis(500),
        };
        let consumer = Consumer::new(config, fold.pool().clone(), EventTable);
        let progress = consumer.progress();
        let running =
            until_stopped(
                |stopped| async move { consumer.run(stopped).await.expect("fold consumer") },
            );
        Self { running, progress }
    }

    pub fn totals(&self) -> FoldStats {
        self.progress.totals()
    }

    pub async fn stop(self) -> FoldStats {
        self.running.stop().await;
        self.progress.totals()
    }
}

/// Removes a test's queues and exchange.
/// Declares `topology` on the real broker (what the relay declares when it connects), so
/// consumers can subscribe before any relay runs.
pub async fn declare_topology(topology: &Topology) {
    declare_topology_at(&amqp_url(), topology).await;
}

pub async fn drop_topology(topology: &Topology) {
    drop_topology_at(&amqp_url(), topology).await;
}

/// Lease buckets `relay` holds now (0 while its tree restarts).
pub async fn buckets(relay: &RelayHandle) -> usize {
    relay
        .snapshot()
        .await
        .map(|tree| tree.buckets_held)
        .unwrap_or(0)
}

/// Why the handler refused an event.
#[derive(Debug)]
pub enum Refused {
    Poison,
    Store(store::Error),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Poison => write!(f, "poison: the handler cannot take this event yet"),
            Refused::Store(err) => write!(f, "{err}"),
        }
    }
}

impl std::error::Error for Refused {}

/// The project's event table, refusing (permanently) events whose body starts with `poison`
/// while `refusing` is set: a handler bug, fixed later.
#[derive(Clone)]
pub struct Picky {
    pub refusing: Arc<std::sync::atomic::AtomicBool>,
}

impl store::Projection for Picky {
    type Error = Refused;

    fn is_permanent(error: &Refused) -> bool {
        matches!(error, Refused::Poison)
    }

    async fn apply(
        &mut self,
        tx: &mut sqlx::PgConnection,
        event: &store::OutboxEvent,
    ) -> Result<(), Refused> {
        if self.refusing.load(std::sync::atomic::Ordering::SeqCst)
            && event.payload.starts_with(b"poison")
        {
            return Err(Refused::Poison);
        }
        store::EventTable
            .apply(tx, event)
            .await
            .map_err(Refused::Store)
    }

    async fn rewind(
        &mut self,
        tx: &mut sqlx::PgConnection,
        rewind: &store::RewindNotice,
    ) -> Result<(), Refused> {
        store::EventTable
            .rewind(tx, rewind)
            .await
            .map_err(Refused::Store)
    }
}

/// A consumer of `rabbit`'s default group folding into `pool` with [`Picky`], refusing poison
/// until told otherwise; stopped by [`PickyConsumer::stop`].
pub struct PickyConsumer {
    /// Cleared, the handler takes poison too (the bug is fixed).
    pub refusing: Arc<std::sync::atomic::AtomicBool>,
    pub progress: distribution::consumer::ConsumerProgress,
    consuming: Running<Result<FoldStats, distribution::broker::Error>>,
}

impl PickyConsumer {
    pub fn start(rabbit: &RabbitConfig, pool: &PgPool) -> Self {
        let refusing = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let consumer = distribution::consumer::Consumer::new(
            distribution::consumer::ConsumerConfig::new(rabbit.clone()),
            pool.clone(),
            Picky {
                refusing: refusing.clone(),
            },
        );
        let progress = consumer.progress();
        let consuming = until_stopped(|stopped| consumer.run(stopped));
        Self {
            refusing,
            progress,
            consuming,
        }
    }

    /// Takes poison from now on.
    pub fn fixed(&self) {
        self.refusing
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops it; panics if it failed.
    pub async fn stop(self) {
        self.consuming.stop().await.unwrap();
    }
}

/// A relay run as the binary; on drop (the test failing too) woken if stopped, then killed.
pub struct Process(pub std::process::Child);

impl Process {
    pub fn signal(&self, signal: &str) {
        let sent = std::process::Command::new("kill")
            .args([signal, &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {signal}");
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // No assertion here: a failed kill while a test already panics would abort.
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.id().to_string()])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

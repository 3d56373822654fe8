//! PostgreSQL failovers on real standbys (`pg_pair.rs`): the host, the relays and nothing
//! else reach the outbox's database through a proxy the test owns, which a failover points at
//! the promoted standby (sqlx takes one host). The consumer's fold database is the machine's
//! PostgreSQL (it does not fail over here); the broker is the machine's RabbitMQ.
//!
//! - asynchronous replication, failovers at random cut points (`FAILOVERS`, default 3): what
//!   the relay shipped and the promoted standby lacks is written again by the host with new
//!   content; the consumer refuses its first reused Lsn as diverged (RL203), folds nothing of
//!   the new history onto the old, and after the operator's runbook (`group adopt`, then
//!   `dead replay`) holds exactly the new primary's history;
//! - synchronous replication, the primary killed under load: nothing diverges, nothing is lost
//!   or applied twice, and shipping resumes within 15 s of the retarget;
//! - a commit whose wait for the synchronous standby was cancelled: visible on the primary,
//!   missing on the promoted standby. Without `RELAY_PUBLISH_REPLICATED` the relay publishes it
//!   and the consumer folds a phantom (caught as diverged once the host writes that Lsn again);
//!   with `sync` the relay holds it back and the fold never sees it.
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use distribution::rabbit::DeadLetters;
use distribution::store::{BranchKey, FoldStore, Lsn, Replication, TenantId};
use distribution::testing::BrokerProxy;
use distribution::{Relay, RelayConfig, RelayHandle};
use sqlx::{Connection, PgPool};

use crate::harness::{
    Expected, Folding, amqp_url, assert_folded_exactly, declare_topology, drop_topology,
    fold_database, relay_command, relay_config, unique, wait_until,
};
use crate::pg_pair::{PgPair, Postgres};

/// One at a time: each test runs two PostgreSQL servers of its own on two cores.
pub(crate) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The host: its own table of what it wrote (its state, in the same transaction as each
/// intent), written through the proxy.
struct Host {
    pool: PgPool,
    branches: Vec<BranchKey>,
}

impl Host {
    async fn open(pool: PgPool, label: &str) -> Self {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS host_history (
                 tenant text, run text, branch text, lsn bigint, payload bytea,
                 PRIMARY KEY (tenant, run, branch, lsn))",
        )
        .execute(&pool)
        .await
        .unwrap();
        let mut branches = Vec::new();
        // Several tenants, runs and branches interleaved.
        for t in 0..3 {
            for r in 0..2 {
                let branch = testkit::branch(&format!("{label}-t{t}"), &format!("r{r}"), "main");
                sqlx::query("SELECT relay_open_run($1, $2, $3)")
                    .bind(branch.tenant.as_str())
                    .bind(branch.run.as_str())
                    .bind(branch.branch.as_str())
                    .execute(&pool)
                    .await
                    .unwrap();
                branches.push(branch);
            }
        }
        Self { pool, branches }
    }

    /// The head of `branch` as the host's database has it now.
    async fn head(&self, branch: &BranchKey) -> u64 {
        retrying(|| async {
            sqlx::query_scalar::<_, i64>(
                "SELECT head_lsn FROM relay_branch WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3",
            )
            .bind(branch.tenant.as_str())
            .bind(branch.run.as_str())
            .bind(branch.branch.as_str())
            .fetch_one(&self.pool)
            .await
        })
        .await as u64
    }

    /// Appends `count` intents to `branch` after its head, each with the host's state, in one
    /// transaction each; the payload names the generation (a failover's count).
    async fn append(&self, branch: &BranchKey, count: u64, generation: u32) {
        for _ in 0..count {
            let lsn = self.head(branch).await + 1;
            let payload = format!("{branch}@{lsn}#g{generation}").into_bytes();
            retrying(|| async {
                let mut tx = self.pool.begin().await?;
                // A commit whose answer the failover cut off may have landed (seen in CI: the
                // retry then hit host_history's key until the deadline): then it is done.
                let landed: Option<Vec<u8>> = sqlx::query_scalar(
                    "SELECT payload FROM host_history
                      WHERE tenant = $1 AND run = $2 AND branch = $3 AND lsn = $4",
                )
                .bind(branch.tenant.as_str())
                .bind(branch.run.as_str())
                .bind(branch.branch.as_str())
                .bind(lsn as i64)
                .fetch_optional(&mut *tx)
                .await?;
                if let Some(landed) = landed {
                    assert_eq!(landed, payload, "{branch}@{lsn}: another write landed");
                    return Ok(());
                }
                sqlx::query("INSERT INTO host_history VALUES ($1, $2, $3, $4, $5)")
                    .bind(branch.tenant.as_str())
                    .bind(branch.run.as_str())
                    .bind(branch.branch.as_str())
                    .bind(lsn as i64)
                    .bind(&payload)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query("SELECT relay_append($1, $2, $3, $4, $5)")
                    .bind(branch.tenant.as_str())
                    .bind(branch.run.as_str())
                    .bind(branch.branch.as_str())
                    .bind(lsn as i64)
                    .bind(&payload)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await
            })
            .await;
        }
    }

    /// What the host's database holds now: the live history.
    async fn history(&self) -> Expected {
        let rows: Vec<(String, String, String, i64, Vec<u8>)> = retrying(|| async {
            sqlx::query_as(
                "SELECT tenant, run, branch, lsn, payload FROM host_history ORDER BY 1, 2, 3, 4",
            )
            .fetch_all(&self.pool)
            .await
        })
        .await;
        let mut expected = Expected::new();
        for (tenant, run, branch, lsn, payload) in rows {
            expected
                .entry(testkit::branch(&tenant, &run, &branch))
                .or_default()
                .push((Lsn::new(lsn as u64), payload));
        }
        expected
    }
}

/// Retries `call` while the database is away (a failover, a retarget), for at most 60 s.
async fn retrying<T, F, Fut>(mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match call().await {
            Ok(value) => return value,
            Err(sqlx::Error::Database(db)) if db.code().is_some_and(|c| c.starts_with("RL")) => {
                panic!("refused: {db}")
            }
            Err(err) => {
                assert!(
                    Instant::now() < deadline,
                    "the database never came back: {err}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn fold_has(fold: &FoldStore, expected: &Expected) -> bool {
    let mut want: BTreeMap<BranchKey, Vec<(Lsn, Vec<u8>)>> = BTreeMap::new();
    for (branch, events) in expected {
        want.insert(branch.clone(), events.clone());
    }
    let tenants: BTreeSet<TenantId> = expected.keys().map(|b| b.tenant.clone()).collect();
    let mut got: BTreeMap<BranchKey, Vec<(Lsn, Vec<u8>)>> = BTreeMap::new();
    for tenant in tenants {
        for event in fold.folded(&tenant).await.unwrap() {
            got.entry(event.key.branch.clone())
                .or_default()
                .push((event.key.lsn, event.payload));
        }
    }
    for events in got.values_mut() {
        events.sort();
    }
    got == want
}

/// The dead letters now, as (branch, lsn, reason).
async fn dead_letters(dead: &DeadLetters) -> Vec<(BranchKey, u64, String)> {
    dead.list(10_000)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|letter| {
            let event = letter.event.ok()?;
            Some((
                event.key.branch,
                event.key.lsn.get(),
                letter.reason.unwrap_or_default(),
            ))
        })
        .collect()
}

struct Rig {
    pair: PgPair,
    proxy: BrokerProxy,
    config: RelayConfig,
    fold: FoldStore,
    fold_url: String,
    folding: Folding,
    relay: Option<RelayHandle>,
}

impl Rig {
    async fn start(version: Postgres, label: &str, replication: Replication) -> (Self, Host) {
        Self::start_with(version, label, replication, true).await
    }

    /// As `start`; without `in_process`, no relay is started (the test runs the binary).
    async fn start_with(
        version: Postgres,
        label: &str,
        replication: Replication,
        in_process: bool,
    ) -> (Self, Host) {
        // The recorder first: what the relays count from now on is read back.
        crate::metrics_now();
        let pair = tokio::task::block_in_place(|| PgPair::start(version, label));
        let proxy = BrokerProxy::start(&pair.url(pair.primary_port())).unwrap();
        let pool = PgPool::connect(&proxy.url()).await.unwrap();
        distribution::store::migrate(&pool).await.unwrap();
        let (fold_pool, fold_url) = fold_database(&format!("{label}_fold")).await;
        let fold = FoldStore::new(fold_pool);
        let mut config = relay_config(&proxy.url(), &amqp_url(), &unique(label));
        config.replication = replication;
        config.replication_timeout = Duration::from_millis(200);
        let rabbit = config.rabbit_config().unwrap();
        declare_topology(&rabbit.topology).await;
        let folding = Folding::start(rabbit, &fold);
        let relay = if in_process {
            Some(Relay::start(config.clone()).await.unwrap())
        } else {
            None
        };
        let host = Host::open(pool, label).await;
        (
            Self {
                pair,
                proxy,
                config,
                fold,
                fold_url,
                folding,
                relay,
            },
            host,
        )
    }

    /// Runs `distribution args...` as an operator would, on the fold's database and the broker,
    /// and requires it to succeed.
    fn distribution(&self, args: &[&str]) {
        let output = relay_command()
            .args(args)
            .env("DATABASE_URL", &self.fold_url)
            .env("AMQP_URL", amqp_url())
            .env("RELAY_TOPOLOGY", &self.config.topology)
            .env("RELAY_PARTITIONS", self.config.partitions.to_string())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "distribution {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    async fn until_folded(&self, host: &Host, what: &str) {
        let expected = host.history().await;
        wait_until(what, Duration::from_secs(60), || async {
            fold_has(&self.fold, &expected).await
        })
        .await;
    }

    async fn stop(mut self) {
        if let Some(relay) = self.relay.take() {
            relay.shutdown().await;
        }
        self.folding.stop().await;
        drop_topology(&self.config.rabbit_config().unwrap().topology).await;
    }
}

fn failovers() -> u32 {
    std::env::var("FAILOVERS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3)
}

/// A small deterministic generator (the failovers' cut points), seeded by `FAILOVER_SEED`.
struct Picks(u64);

impl Picks {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below
    }
}

async fn asynchronous_failovers(version: Postgres) {
    let _serial = SERIAL.lock().await;
    let label = match version {
        Postgres::V15 => "fo15",
        Postgres::V17 => "fo17",
    };
    let (rig, host) = Rig::start(version, label, Replication::Off).await;
    let dead = DeadLetters::open(&crate::harness::direct_rabbit(&rig.config))
        .await
        .unwrap();
    let seed = std::env::var("FAILOVER_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(0x5eed_f00d_u64);
    println!(
        "{version:?}: {} failovers, FAILOVER_SEED={seed}",
        failovers()
    );
    let mut picks = Picks(seed | 1);
    let mut rig = rig;
    let mut detected = 0;
    for generation in 0..failovers() {
        // What the standby keeps.
        for branch in &host.branches {
            host.append(branch, 1 + picks.next(3), generation).await;
        }
        rig.until_folded(&host, "the safe history folded").await;
        tokio::task::block_in_place(|| rig.pair.wait_caught_up());
        let safe: Vec<u64> = {
            let mut heads = Vec::new();
            for branch in &host.branches {
                heads.push(host.head(branch).await);
            }
            heads
        };
        // What only the primary gets, shipped and folded before it dies (a random cut point:
        // 0 to 3 intents per branch, at least one somewhere).
        tokio::task::block_in_place(|| rig.pair.cut_replication());
        let mut lost: Vec<u64> = host.branches.iter().map(|_| picks.next(4)).collect();
        if lost.iter().all(|n| *n == 0) {
            lost[0] = 1;
        }
        for (branch, n) in host.branches.iter().zip(&lost) {
            host.append(branch, *n, generation).await;
        }
        rig.until_folded(&host, "the history the standby lacks, folded")
            .await;
        // The failover: the primary killed, the standby promoted, the proxy retargeted.
        let timeline = rig.pair.timeline();
        tokio::task::block_in_place(|| rig.pair.fail_over(true));
        rig.proxy.retarget(&rig.pair.primary_authority());
        assert!(rig.pair.timeline() > timeline, "a new timeline");
        // The host resumes from what its database kept: the lost Lsns written again.
        for branch in &host.branches {
            host.append(branch, 1 + picks.next(4), generation + 1000)
                .await;
        }
        // Each branch that lost shipped intents is refused at its first reused Lsn; the
        // others fold the new history at once.
        let diverged: Vec<(BranchKey, u64)> = host
            .branches
            .iter()
            .zip(&safe)
            .zip(&lost)
            .filter(|(_, n)| **n > 0)
            .map(|((branch, head), _)| (branch.clone(), head + 1))
            .collect();
        wait_until(
            "the first reused Lsn of every branch that lost shipped intents is dead-lettered",
            Duration::from_secs(60),
            || async {
                let letters = dead_letters(&dead).await;
                diverged.iter().all(|(branch, first)| {
                    letters
                        .iter()
                        .any(|(b, lsn, _)| b == branch && lsn == first)
                })
            },
        )
        .await;
        let letters = dead_letters(&dead).await;
        for (branch, first) in &diverged {
            let mine: Vec<&(BranchKey, u64, String)> =
                letters.iter().filter(|(b, _, _)| b == branch).collect();
            assert_eq!(
                mine.first().map(|(_, lsn, _)| *lsn),
                Some(*first),
                "{branch}: the first dead letter is the first reused Lsn: {mine:?}"
            );
            assert!(
                mine.iter()
                    .all(|(_, _, reason)| reason.starts_with("diverged")),
                "{mine:?}"
            );
            detected += 1;
        }
        // Nothing of the new history was folded onto the old: the diverged branches hold
        // what they held.
        for (branch, _) in &diverged {
            let folded = rig.fold.folded(&branch.tenant).await.unwrap();
            assert!(
                folded
                    .iter()
                    .filter(|event| event.key.branch == *branch)
                    .all(|event| !String::from_utf8_lossy(&event.payload)
                        .ends_with(&format!("#g{}", generation + 1000))),
                "{branch}: new history mixed with the old"
            );
        }
        // The runbook as docs/operations.md writes it ("After a failover", steps 3 and 4):
        // `distribution group adopt` for each diverged branch, `distribution dead replay`.
        for (branch, _) in &diverged {
            rig.distribution(&[
                "group",
                "adopt",
                "--tenant",
                branch.tenant.as_str(),
                "--run",
                branch.run.as_str(),
                "--branch",
                branch.branch.as_str(),
            ]);
            rig.distribution(&[
                "dead",
                "replay",
                "--tenant",
                branch.tenant.as_str(),
                "--run",
                branch.run.as_str(),
            ]);
        }
        rig.until_folded(&host, "the new primary's history, after the runbook")
            .await;
        assert_folded_exactly(&rig.fold, &host.history().await).await;
        assert_eq!(dead.depth().await.unwrap(), 0, "every dead letter folded");
    }
    println!("{version:?}: {detected} divergences detected at their first reused Lsn");
    rig.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_failovers_are_detected_at_the_first_reused_lsn_and_adopted_by_the_runbook() {
    asynchronous_failovers(Postgres::V15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_failovers_are_detected_at_the_first_reused_lsn_and_adopted_by_the_runbook_on_postgres_17()
 {
    asynchronous_failovers(Postgres::V17).await;
}

/// Synchronous replication: the primary killed while the host writes; nothing diverges,
/// every intent of the new primary's history folds once, and shipping resumes within 15 s of
/// the retarget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_failover_loses_nothing_and_ships_again_within_seconds() {
    let _serial = SERIAL.lock().await;
    let (mut rig, host) = Rig::start(Postgres::V15, "fosync", Replication::Off).await;
    tokio::task::block_in_place(|| rig.pair.set_synchronous(true));
    for branch in &host.branches {
        host.append(branch, 3, 0).await;
    }
    rig.until_folded(&host, "the first history folded").await;
    // Killed while the host writes.
    let writer = {
        let pool = host.pool.clone();
        let branches = host.branches.clone();
        tokio::spawn(async move {
            let host = Host { pool, branches };
            for _ in 0..5 {
                for branch in &host.branches {
                    host.append(branch, 1, 1).await;
                }
            }
        })
    };
    tokio::task::block_in_place(|| rig.pair.fail_over(false));
    rig.proxy.retarget(&rig.pair.primary_authority());
    let retargeted = Instant::now();
    writer.await.unwrap();
    for branch in &host.branches {
        host.append(branch, 1, 2).await;
    }
    rig.until_folded(&host, "the new primary's history").await;
    let took = retargeted.elapsed();
    println!("sync failover: everything folded {took:?} after the retarget");
    assert!(
        took < Duration::from_secs(15),
        "shipping resumed in {took:?}"
    );
    assert_folded_exactly(&rig.fold, &host.history().await).await;
    let dead = DeadLetters::open(&crate::harness::direct_rabbit(&rig.config))
        .await
        .unwrap();
    assert_eq!(dead.depth().await.unwrap(), 0, "nothing diverged");
    rig.stop().await;
}

/// The phantom of a cancelled synchronous-replication wait: the host's commit of `x` waits for
/// the stopped standby, is cancelled (pg_cancel_backend: the client sees a WARNING and
/// success), and is visible on the primary; the standby, started again and promoted, never
/// had it. Returns the dead letters and whether the fold ever held the phantom.
async fn cancelled_wait(
    replication: Replication,
    label: &str,
) -> (Vec<(BranchKey, u64, String)>, bool) {
    let _serial = SERIAL.lock().await;
    let (mut rig, host) = Rig::start(Postgres::V15, label, replication).await;
    tokio::task::block_in_place(|| rig.pair.set_synchronous(true));
    for branch in &host.branches {
        host.append(branch, 2, 0).await;
    }
    rig.until_folded(&host, "the first history folded").await;
    tokio::task::block_in_place(|| rig.pair.stop_standby());
    let branch = host.branches[0].clone();
    let phantom_lsn = host.head(&branch).await + 1;
    let waiting = {
        let pool = host.pool.clone();
        let branches = host.branches.clone();
        let branch = branch.clone();
        tokio::spawn(async move {
            Host { pool, branches }.append(&branch, 1, 7).await;
        })
    };
    // Its commit waits for the standby; cancelled, it is visible on the primary. The relay's
    // own writes (leases, membership) wait in SyncRep too while the standby is away: only the
    // host's backend is counted and cancelled (CI once timed out counting them all).
    let primary = rig.pair.primary_port();
    let pair = &rig.pair;
    wait_until(
        "the commit waits in SyncRep",
        Duration::from_secs(30),
        || async {
            tokio::task::block_in_place(|| {
                pair.psql(
                    primary,
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' \
                     AND application_name <> 'outbox-relay'",
                )
            }) == "1"
        },
    )
    .await;
    tokio::task::block_in_place(|| {
        pair.psql(
            primary,
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep' \
             AND application_name <> 'outbox-relay'",
        )
    });
    waiting.await.unwrap();
    let phantom = format!("{branch}@{phantom_lsn}#g7").into_bytes();
    let fold = rig.fold.clone();
    let folded_phantom = || async {
        fold.folded(&branch.tenant)
            .await
            .unwrap()
            .iter()
            .any(|event| event.payload == phantom)
    };
    match replication {
        Replication::Off => {
            wait_until(
                "the relay ships the phantom",
                Duration::from_secs(30),
                &folded_phantom,
            )
            .await;
        }
        _ => {
            // The relay drained it and held it back (the standby cannot confirm it).
            wait_until(
                "the relay holds back what the standby lacks",
                Duration::from_secs(30),
                || async { held_back() > 0 },
            )
            .await;
        }
    }
    let ever_folded = folded_phantom().await;
    // The primary dies; then the standby, started again, is promoted without the phantom
    // (started while the primary lived, it would have streamed it).
    tokio::task::block_in_place(|| {
        rig.pair.kill_primary();
        rig.pair.start_standby();
        rig.pair.promote(false)
    });
    rig.proxy.retarget(&rig.pair.primary_authority());
    host.append(&branch, 2, 8).await;
    let dead = DeadLetters::open(&crate::harness::direct_rabbit(&rig.config))
        .await
        .unwrap();
    if ever_folded {
        wait_until(
            "the rewritten Lsn is refused",
            Duration::from_secs(60),
            || async { !dead_letters(&dead).await.is_empty() },
        )
        .await;
    } else {
        rig.until_folded(&host, "the new primary's history").await;
        assert_folded_exactly(&rig.fold, &host.history().await).await;
    }
    let letters = dead_letters(&dead).await;
    rig.stop().await;
    (letters, ever_folded)
}

/// Drains held back by RELAY_PUBLISH_REPLICATED so far (this process's relays).
fn held_back() -> u64 {
    crate::metrics_now()
        .lines()
        .filter(|line| line.starts_with("relay_drains_held_back_total"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_sync_wait_is_a_phantom_without_the_setting_and_never_published_with_it() {
    // Without the setting: the phantom is folded (and caught as diverged when the host writes
    // its Lsn again: without epochs it was a duplicate, silently).
    let (letters, folded) = cancelled_wait(Replication::Off, "fophantom").await;
    assert!(
        folded,
        "without RELAY_PUBLISH_REPLICATED the phantom reaches the fold"
    );
    assert!(
        letters
            .iter()
            .any(|(_, _, reason)| reason.starts_with("diverged")),
        "{letters:?}"
    );
    // With it: never published; the new history folds as it is.
    let (letters, folded) = cancelled_wait(Replication::Sync, "fosafe").await;
    assert!(
        !folded,
        "RELAY_PUBLISH_REPLICATED=sync never publishes the phantom"
    );
    assert!(letters.is_empty(), "{letters:?}");
}

/// A relay run as the binary, stopped (SIGTERM, then waited for) when dropped.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// `name`'s value in a Prometheus exposition (the first series of it).
fn gauge(exposition: &str, name: &str) -> Option<f64> {
    exposition
        .lines()
        .find(|line| line.starts_with(name) && !line.starts_with('#'))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

/// Synchronous replication, the standby down: the hosts' commits wait for it, and so do the
/// relay's lease renewals, so its fences close within the TTL and `/readyz` says why (here
/// with intents waiting that a session committed with `synchronous_commit = local`); once the
/// standby is back, everything ships within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_standby_down_closes_the_fences_says_why_and_everything_ships_on_its_return() {
    let _serial = SERIAL.lock().await;
    let (mut rig, host) = Rig::start_with(Postgres::V15, "fodown", Replication::Off, false).await;
    tokio::task::block_in_place(|| rig.pair.set_synchronous(true));
    let addr = crate::harness::free_addr();
    let ttl = Duration::from_millis(1500);
    let _relay = Running(
        crate::harness::run_command(&rig.proxy.url(), &amqp_url(), &rig.config.topology, &addr)
            .env("RELAY_LEASE_TTL_MS", ttl.as_millis().to_string())
            .env("RELAY_LEASE_HEARTBEAT_MS", "250")
            .env("RELAY_POLL_MS", "100")
            .spawn()
            .unwrap(),
    );
    for branch in &host.branches {
        host.append(branch, 2, 0).await;
    }
    rig.until_folded(&host, "the first history folded").await;
    let metrics = || async {
        crate::harness::http_get(&addr, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    };
    assert!(gauge(&metrics().await, "relay_lease_buckets_held").unwrap_or(0.0) > 0.0);

    tokio::task::block_in_place(|| rig.pair.stop_standby());
    let stopped = Instant::now();
    // The host's next commit waits for the standby.
    let waiting = {
        let pool = host.pool.clone();
        let branches = host.branches.clone();
        tokio::spawn(async move {
            let host = Host { pool, branches };
            let branch = host.branches[1].clone();
            host.append(&branch, 1, 1).await;
        })
    };
    // The relay's renewals wait too: its fences close, it holds no bucket.
    wait_until(
        "the relay holds no bucket",
        Duration::from_secs(30),
        || async { gauge(&metrics().await, "relay_lease_buckets_held") == Some(0.0) },
    )
    .await;
    let closed = stopped.elapsed();
    println!("standby down: the relay held no bucket {closed:?} after it stopped (TTL {ttl:?})");
    assert!(closed < ttl + Duration::from_secs(1), "{closed:?}");
    // A session that does not wait for the standby commits intents that cannot ship.
    let mut conn = sqlx::PgConnection::connect(&rig.proxy.url()).await.unwrap();
    sqlx::query("SET synchronous_commit = local")
        .execute(&mut conn)
        .await
        .unwrap();
    let branch = &host.branches[0];
    let lsn = host.head(branch).await + 1;
    // The intent and the host's record of it. Without NOTIFY: the commit waiting for the
    // standby holds the notification queue's lock until its WAL is replicated
    // (docs/sql-api.md), and a notifying commit would wait.
    for sql in [
        "SELECT relay_append($1, $2, $3, $4, $5, p_notify => false)",
        "INSERT INTO host_history VALUES ($1, $2, $3, $4, $5)",
    ] {
        sqlx::query(sql)
            .bind(branch.tenant.as_str())
            .bind(branch.run.as_str())
            .bind(branch.branch.as_str())
            .bind(lsn as i64)
            .bind(format!("{branch}@{lsn}#local").into_bytes())
            .execute(&mut conn)
            .await
            .unwrap();
    }
    wait_until("/readyz says why", Duration::from_secs(30), || async {
        crate::harness::http_get(&addr, "/readyz")
            .await
            .is_some_and(|(status, body)| status == 503 && body.contains("holds no lease bucket"))
    })
    .await;
    // Back: the waiting commit completes, everything ships within seconds.
    let back = Instant::now();
    tokio::task::block_in_place(|| rig.pair.start_standby());
    waiting.await.unwrap();
    rig.until_folded(&host, "everything, once the standby is back")
        .await;
    let took = back.elapsed();
    println!("standby back: everything folded {took:?} after it started");
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert_folded_exactly(&rig.fold, &host.history().await).await;
    drop(conn);
    rig.stop().await;
}

/// One publish call: which relay, which tenants, when it began and (once confirmed) ended.
type Write = (usize, BTreeSet<TenantId>, Instant, Option<Instant>);

/// Every publish call of the relays.
#[derive(Default)]
struct Writes(std::sync::Mutex<Vec<Write>>);

struct RelayWrites {
    relay: usize,
    writes: std::sync::Arc<Writes>,
}

impl crate::double::Observer for RelayWrites {
    fn writing(&self, events: &[distribution::store::OutboxEvent]) -> usize {
        let tenants = events.iter().map(|e| e.key.branch.tenant.clone()).collect();
        let mut writes = self.writes.0.lock().unwrap();
        writes.push((self.relay, tenants, Instant::now(), None));
        writes.len() - 1
    }

    fn written(&self, _call: usize) {}

    fn confirmed(&self, call: usize, _report: &distribution::broker::PublishReport) {
        self.writes.0.lock().unwrap()[call].3 = Some(Instant::now());
    }
}

/// The longest time two relays published one tenant at once.
fn longest_overlap(writes: &Writes) -> Duration {
    let writes = writes.0.lock().unwrap();
    let mut longest = Duration::ZERO;
    for (i, (relay_a, tenants_a, start_a, end_a)) in writes.iter().enumerate() {
        let end_a = end_a.unwrap_or_else(Instant::now);
        for (relay_b, tenants_b, start_b, end_b) in &writes[i + 1..] {
            let end_b = end_b.unwrap_or_else(Instant::now);
            if relay_a != relay_b && !tenants_a.is_disjoint(tenants_b) {
                let (start, end) = ((*start_a).max(*start_b), end_a.min(end_b));
                longest = longest.max(end.saturating_duration_since(start));
            }
        }
    }
    longest
}

/// An asynchronous failover loses the lease table's last changes: here a second relay joined
/// and took half the buckets on the primary alone. On the promoted standby those rows are
/// the first relay's again, expired, and claimed anew with epochs already handed out once.
/// Two relays may then publish one tenant at once, but only until the fence of the one that
/// lost it closes by time (within the TTL); the fold holds the host's history exactly (what
/// went twice is absorbed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_epochs_given_twice_after_an_async_failover_overlap_at_most_a_ttl() {
    let _serial = SERIAL.lock().await;
    let (mut rig, host) = Rig::start_with(Postgres::V15, "foepoch", Replication::Off, false).await;
    let ttl = Duration::from_millis(1500);
    let mut config = rig.config.clone();
    config.supervisor.lease.ttl = ttl;
    config.supervisor.lease.heartbeat = Duration::from_millis(250);
    config.supervisor.drainer.batch_size = 10;
    let writes = std::sync::Arc::new(Writes::default());
    let start = |relay: usize| {
        let rabbit = config.rabbit_config().unwrap();
        let observer: std::sync::Arc<dyn crate::double::Observer> =
            std::sync::Arc::new(RelayWrites {
                relay,
                writes: writes.clone(),
            });
        let factory = std::sync::Arc::new(move |_shard| {
            crate::double::Double::rabbit(
                rabbit.clone(),
                crate::double::Script {
                    // A slow path to the broker: the backlog drains across the failover.
                    delay: Duration::from_millis(20),
                    observer: Some(observer.clone()),
                    ..crate::double::Script::default()
                },
            )
        });
        Relay::start_with(config.clone(), factory)
    };
    let first = start(0).await.unwrap();
    wait_until(
        "the first relay holds every bucket",
        Duration::from_secs(30),
        || async { crate::harness::buckets(&first).await == 128 },
    )
    .await;
    // A backlog that is still draining when the primary dies.
    for branch in &host.branches {
        host.append(branch, 150, 0).await;
    }
    tokio::task::block_in_place(|| rig.pair.wait_caught_up());
    tokio::task::block_in_place(|| rig.pair.cut_replication());
    // The second relay joins on the primary alone.
    let second = start(1).await.unwrap();
    wait_until(
        "even shares on the primary",
        Duration::from_secs(30),
        || async { crate::harness::buckets(&second).await == 64 },
    )
    .await;
    let leases = |pair: &PgPair, port: u16| -> BTreeMap<i64, (String, i64)> {
        pair.psql(
            port,
            "SELECT bucket, coalesce(owner, ''), epoch FROM relay_lease",
        )
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split('|').collect();
            (
                fields[0].parse().unwrap(),
                (fields[1].to_owned(), fields[2].parse().unwrap()),
            )
        })
        .collect()
    };
    let (before, kept) = tokio::task::block_in_place(|| {
        (
            leases(&rig.pair, rig.pair.primary_port()),
            leases(&rig.pair, rig.pair.standby_port()),
        )
    });
    tokio::task::block_in_place(|| rig.pair.fail_over(false));
    rig.proxy.retarget(&rig.pair.primary_authority());
    // Epochs the lost primary handed out while the standby did not follow (the standby's
    // epoch differs), seen handed out again by the new primary, sampled until the relays hold
    // even shares there.
    let mut given_twice: BTreeMap<i64, String> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let settled = tokio::task::block_in_place(|| {
            rig.pair.psql(
                rig.pair.primary_port(),
                "SELECT count(*) FILTER (WHERE expires_at > now()) = 128 AND count(DISTINCT owner) = 2
                   FROM relay_lease",
            )
        }) == "t";
        let now = tokio::task::block_in_place(|| leases(&rig.pair, rig.pair.primary_port()));
        for (bucket, (owner, epoch)) in &now {
            if kept.get(bucket).is_some_and(|(_, old)| old != epoch)
                && before.get(bucket).is_some_and(|(_, lost)| lost == epoch)
            {
                given_twice.insert(*bucket, owner.clone());
            }
        }
        if settled {
            break;
        }
        assert!(Instant::now() < deadline, "even shares on the new primary");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rig.until_folded(&host, "the host's history, after the failover")
        .await;
    let reused = given_twice.len();
    let moved = given_twice
        .iter()
        .filter(|(bucket, owner)| before.get(bucket).is_some_and(|(lost, _)| lost != *owner))
        .count();
    println!("lease epochs given twice: {reused} buckets, {moved} of them to the other relay");
    assert!(
        reused > 0,
        "the failover gave no epoch twice: the case was not made"
    );
    assert_folded_exactly(&rig.fold, &host.history().await).await;
    let overlap = longest_overlap(&writes);
    println!("two relays published one tenant at once for at most {overlap:?} (TTL {ttl:?})");
    assert!(overlap <= ttl, "{overlap:?}");
    first.shutdown().await;
    second.shutdown().await;
    rig.stop().await;
}

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

use distribution::broker::{DeadFilter, DeadLetters};
use distribution::store::{
    BranchKey, FoldStore, Lsn, Replication, TenantId, adopt_branch, migrate_fold,
};
use distribution::testing::BrokerProxy;
use distribution::{Relay, RelayConfig, RelayHandle};
use sqlx::PgPool;

use crate::harness::{
    Expected, Folding, amqp_url, assert_folded_exactly, declare_topology, drop_topology,
    empty_database, relay_config, unique, wait_until,
};
use crate::pg_pair::{PgPair, Postgres};

/// One at a time: each test runs two PostgreSQL servers of its own on two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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
            sqlx::query_as("SELECT tenant, run, branch, lsn, payload FROM host_history ORDER BY 1, 2, 3, 4")
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
                assert!(Instant::now() < deadline, "the database never came back: {err}");
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
            Some((event.key.branch, event.key.lsn.get(), letter.reason.unwrap_or_default()))
        })
        .collect()
}

struct Rig {
    pair: PgPair,
    proxy: BrokerProxy,
    config: RelayConfig,
    fold: FoldStore,
    folding: Folding,
    relay: Option<RelayHandle>,
}

impl Rig {
    async fn start(version: Postgres, label: &str, replication: Replication) -> (Self, Host) {
        // The recorder first: what the relays count from now on is read back.
        crate::metrics_now();
        let pair = tokio::task::block_in_place(|| PgPair::start(version, label));
        let proxy = BrokerProxy::start(&pair.url(pair.primary_port())).unwrap();
        let pool = PgPool::connect(&proxy.url()).await.unwrap();
        distribution::store::migrate(&pool).await.unwrap();
        let (fold_pool, _) = empty_database(&format!("{label}_fold")).await;
        migrate_fold(&fold_pool).await.unwrap();
        let fold = FoldStore::new(fold_pool);
        let mut config = relay_config(&proxy.url(), &amqp_url(), &unique(label));
        config.replication = replication;
        config.replication_timeout = Duration::from_millis(200);
        let rabbit = config.rabbit_config().unwrap();
        declare_topology(&rabbit.topology).await;
        let folding = Folding::start(rabbit, &fold);
        let relay = Relay::start(config.clone()).await.unwrap();
        let host = Host::open(pool, label).await;
        (
            Self {
                pair,
                proxy,
                config,
                fold,
                folding,
                relay: Some(relay),
            },
            host,
        )
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
    println!("{version:?}: {} failovers, FAILOVER_SEED={seed}", failovers());
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
        rig.until_folded(&host, "the history the standby lacks, folded").await;
        // The failover: the primary killed, the standby promoted, the proxy retargeted.
        let timeline = rig.pair.timeline();
        tokio::task::block_in_place(|| rig.pair.fail_over(true));
        rig.proxy.retarget(&rig.pair.primary_authority());
        assert!(rig.pair.timeline() > timeline, "a new timeline");
        // The host resumes from what its database kept: the lost Lsns written again.
        for branch in &host.branches {
            host.append(branch, 1 + picks.next(4), generation + 1000).await;
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
                mine.iter().all(|(_, _, reason)| reason.starts_with("diverged")),
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
        // The runbook (docs/operations.md, "After a failover"): adopt each diverged branch,
        // replay the dead letters in order.
        for (branch, _) in &diverged {
            let mut conn = rig.fold.pool().acquire().await.unwrap();
            assert!(adopt_branch(&mut conn, branch).await.unwrap());
        }
        dead.replay(&DeadFilter::All).await.unwrap();
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
    assert!(took < Duration::from_secs(15), "shipping resumed in {took:?}");
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
async fn cancelled_wait(replication: Replication, label: &str) -> (Vec<(BranchKey, u64, String)>, bool) {
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
    // Its commit waits for the standby; cancelled, it is visible on the primary.
    let primary = rig.pair.primary_port();
    let pair = &rig.pair;
    wait_until("the commit waits in SyncRep", Duration::from_secs(30), || async {
        tokio::task::block_in_place(|| {
            pair.psql(primary, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        }) == "1"
    })
    .await;
    tokio::task::block_in_place(|| {
        pair.psql(
            primary,
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
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
            wait_until("the relay ships the phantom", Duration::from_secs(30), || {
                folded_phantom()
            })
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
        wait_until("the rewritten Lsn is refused", Duration::from_secs(60), || async {
            !dead_letters(&dead).await.is_empty()
        })
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
    assert!(folded, "without RELAY_PUBLISH_REPLICATED the phantom reaches the fold");
    assert!(
        letters.iter().any(|(_, _, reason)| reason.starts_with("diverged")),
        "{letters:?}"
    );
    // With it: never published; the new history folds as it is.
    let (letters, folded) = cancelled_wait(Replication::Sync, "fosafe").await;
    assert!(!folded, "RELAY_PUBLISH_REPLICATED=sync never publishes the phantom");
    assert!(letters.is_empty(), "{letters:?}");
}

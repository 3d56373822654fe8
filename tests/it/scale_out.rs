//! Several relays on one outbox, on the real PostgreSQL and RabbitMQ: even shares, handover on
//! a crash and on a join, never two relays publishing one tenant at once, nothing lost or
//! reordered; and more tenants than PostgreSQL's lock table could ever hold, beside a host.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distribution::broker::{Outcome, PublishReport};

use distribution::rabbit::RabbitConfig;
use distribution::store::{
    BranchId, BranchKey, FoldStore, IntentWriter, LEASE_BUCKETS, Lsn, Outbox, OutboxEvent, RunId,
    TenantId,
};
use distribution::{Relay, RelayConfig, RelayHandle};

use crate::double::{Double, Observer, Script};
use crate::harness::*;

/// One publish call of one relay: its tenants, when it wrote (end `None`: still writing, or
/// cut off by a crash), and whether anything reached the broker.
#[derive(Clone, Debug)]
struct Write {
    relay: usize,
    tenants: Vec<TenantId>,
    start: Instant,
    end: Option<Instant>,
    /// `Some(false)` when every event came back `NotSent` (the fence was closed, or no
    /// connection); `None` until its confirms resolve (never, after a crash).
    written: Option<bool>,
}

#[derive(Clone, Default)]
struct PublishLog(Arc<Mutex<Vec<Write>>>);

impl PublishLog {
    fn writes(&self) -> Vec<Write> {
        self.0.lock().unwrap().clone()
    }
}

/// One relay's writes, as a [`Double`]'s observer.
struct RelayWrites {
    relay: usize,
    log: PublishLog,
}

impl Observer for RelayWrites {
    fn writing(&self, events: &[OutboxEvent]) -> usize {
        let mut tenants: Vec<TenantId> = events
            .iter()
            .map(|event| event.key.branch.tenant.clone())
            .collect();
        tenants.dedup();
        let mut log = self.log.0.lock().unwrap();
        log.push(Write {
            relay: self.relay,
            tenants,
            start: Instant::now(),
            end: None,
            written: None,
        });
        log.len() - 1
    }

    fn written(&self, call: usize) {
        self.log.0.lock().unwrap()[call].end = Some(Instant::now());
    }

    fn confirmed(&self, call: usize, report: &PublishReport) {
        let written = report
            .outcomes
            .iter()
            .any(|outcome| *outcome != Outcome::NotSent);
        self.log.0.lock().unwrap()[call].written = Some(written);
    }
}

async fn start_relay(config: &RelayConfig, relay: usize, log: &PublishLog) -> RelayHandle {
    start_slow_relay(config, relay, log, Duration::ZERO).await
}

async fn start_slow_relay(
    config: &RelayConfig,
    relay: usize,
    log: &PublishLog,
    delay: Duration,
) -> RelayHandle {
    let rabbit: RabbitConfig = config.rabbit_config().unwrap();
    let log = log.clone();
    // The real publisher, recording every call; `delay` holds each call back first (a slow
    // path to the broker), so batches queue up in front of it.
    let observer: Arc<dyn Observer> = Arc::new(RelayWrites { relay, log });
    let factory = Arc::new(move |_shard| {
        Double::rabbit(
            rabbit.clone(),
            Script {
                delay,
                observer: Some(observer.clone()),
                ..Script::default()
            },
        )
    });
    Relay::start_with(config.clone(), factory).await.unwrap()
}

/// Asserts that no two relays ever wrote one tenant at the same time (a write that reached
/// the broker, or may have: `unfinished` says until when one that never returned lasted);
/// returns how many times a tenant passed from one relay to another.
fn assert_never_together(writes: &[Write], unfinished: impl Fn(&Write) -> Instant) -> usize {
    let mut by_tenant: BTreeMap<TenantId, Vec<(usize, Instant, Instant)>> = BTreeMap::new();
    for write in writes.iter().filter(|write| write.written != Some(false)) {
        let end = write.end.unwrap_or_else(|| unfinished(write));
        for tenant in &write.tenants {
            by_tenant
                .entry(tenant.clone())
                .or_default()
                .push((write.relay, write.start, end));
        }
    }
    let mut handovers = 0;
    for (tenant, mut spans) in by_tenant {
        spans.sort_by_key(|(_, start, _)| *start);
        for pair in spans.windows(2) {
            let ((relay_a, _, end_a), (relay_b, start_b, _)) = (pair[0], pair[1]);
            if relay_a != relay_b {
                handovers += 1;
                assert!(
                    end_a <= start_b,
                    "{tenant}: relays {relay_a} and {relay_b} published at once"
                );
            }
        }
    }
    handovers
}

/// The lease TTL of [`quick_leases`].
const QUICK_TTL: Duration = Duration::from_millis(1500);

/// `config` with leases that move within seconds: a TTL of 1.5 s, renewed every 250 ms.
fn quick_leases(mut config: RelayConfig) -> RelayConfig {
    config.supervisor.lease.ttl = QUICK_TTL;
    config.supervisor.lease.heartbeat = Duration::from_millis(250);
    config
}

/// Waits until the relays' bucket counts are exactly `want` (in order).
async fn shares(relays: &[&RelayHandle], want: &[usize], what: &str) {
    wait_until(what, Duration::from_secs(30), || async {
        let mut got = Vec::new();
        for relay in relays {
            got.push(buckets(relay).await);
        }
        let mut sorted = got.clone();
        sorted.sort_unstable();
        let mut want = want.to_vec();
        want.sort_unstable();
        sorted == want
    })
    .await;
}

/// Three relays: two share the buckets evenly, a third joins and takes its third, the first
/// crashes and the other two take its share over; meanwhile a host keeps writing. Every
/// event is folded exactly once in order, and no two relays ever published one tenant at
/// the same time (a crashed relay's unfinished write counts as lasting until the crash).
#[test]
fn relays_share_evenly_hand_over_on_crash_and_join_and_never_publish_a_tenant_together() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("scale3").await;
        let config = quick_leases(relay_config(&url, &amqp_url(), &unique("relay-scale3")));
        let fold = FoldStore::new(pool.clone());
        let folding = Folding::start(direct_rabbit(&config), &fold);
        let log = PublishLog::default();

        let first = start_relay(&config, 1, &log).await;
        let second = start_relay(&config, 2, &log).await;
        shares(
            &[&first, &second],
            &[64, 64],
            "two relays split the buckets",
        )
        .await;

        let workload = Workload::new("s3", 40, 2, 30);
        let ran = workload.run(&pool).await;
        let mut all = ran.expected.clone();

        let third = start_relay(&config, 3, &log).await;
        shares(
            &[&first, &second, &third],
            &[42, 43, 43],
            "a joining relay takes its third",
        )
        .await;
        let more = workload.steps(&pool, ran.live.clone(), 31..=45).await;
        merge(&mut all, &more.expected);

        first.abort().await; // a crash: nothing released, its leases expire
        let crashed_at = Instant::now(); // no write of the first relay goes on past this
        let after = workload.steps(&pool, more.live.clone(), 46..=60).await;
        merge(&mut all, &after.expected);
        shares(
            &[&second, &third],
            &[64, 64],
            "the survivors take the crashed relay's share",
        )
        .await;

        wait_until("every event folded", Duration::from_secs(90), || async {
            folded_count(&fold, &all).await == count(&all)
        })
        .await;
        assert_folded_exactly(&fold, &all).await;

        // No interval in which two relays published the same tenant. A write cut off by
        // the crash lasted until the crash at most; the others finished.
        let writes = log.writes();
        let handovers = assert_never_together(&writes, |write| {
            if write.relay == 1 {
                crashed_at
            } else {
                Instant::now()
            }
        });
        assert!(handovers > 0, "the scenario moved no tenant between relays");
        let per_relay: Vec<usize> = (1..=3)
            .map(|relay| writes.iter().filter(|write| write.relay == relay).count())
            .collect();
        println!("publish calls per relay: {per_relay:?}, handovers: {handovers}");

        second.shutdown().await;
        third.shutdown().await;
        folding.stop().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

/// A relay whose database goes silent (a network dropping its packets) while batches wait
/// in front of its publishers: from its fence's deadline (90% of the TTL after the last
/// renewal it sent, so at most a TTL after the silence began) until the partition ends it
/// writes nothing, though its publishers keep being handed batches; the other relay takes
/// every bucket over. When the partition ends (its connections reset, as after a
/// middlebox restart) it rejoins and takes its half back. Every event is folded exactly once
/// in order, and no two relays ever wrote one tenant at once.
#[test]
fn a_relay_cut_off_from_its_database_writes_nothing_past_its_fence_and_rejoins() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("stall").await;
        let network = distribution::testing::BrokerProxy::start(&url).unwrap();
        let direct = quick_leases(relay_config(&url, &amqp_url(), &unique("relay-stall")));
        let mut partitioned = direct.clone();
        partitioned.database_url = network.amqp_url();
        let fold = FoldStore::new(pool.clone());
        let folding = Folding::start(direct_rabbit(&direct), &fold);
        let log = PublishLog::default();

        // The first relay's path to the broker is slow, so its batches queue in front of
        // its publishers: some are still waiting when its fence closes.
        let first = start_slow_relay(&partitioned, 1, &log, Duration::from_millis(700)).await;
        let second = start_relay(&direct, 2, &log).await;
        shares(
            &[&first, &second],
            &[64, 64],
            "two relays split the buckets",
        )
        .await;
        let workload = Workload::new("st", 40, 2, 10);
        let ran = workload.run(&pool).await;
        let mut all = ran.expected.clone();

        network.silence();
        let deadline = Instant::now() + QUICK_TTL;
        let more = workload.steps(&pool, ran.live.clone(), 11..=20).await;
        merge(&mut all, &more.expected);
        wait_until(
            "the second relay holds every bucket",
            Duration::from_secs(30),
            || async { buckets(&second).await == usize::from(LEASE_BUCKETS) },
        )
        .await;
        // The first relay's publishers were handed batches after its deadline (drained
        // before the silence), and got through all of them before the partition ends.
        wait_until(
            "the first relay tries a batch past its deadline, then has none left",
            Duration::from_secs(30),
            || async {
                let writes = log.writes();
                let mine = writes.iter().filter(|write| write.relay == 1);
                mine.clone().any(|write| write.start > deadline)
                    && mine.clone().all(|write| write.end.is_some())
            },
        )
        .await;
        let healed_at = Instant::now();
        network.cut();
        network.restore();
        shares(
            &[&first, &second],
            &[64, 64],
            "the first relay rejoins after the partition",
        )
        .await;
        let after = workload.steps(&pool, more.live.clone(), 21..=25).await;
        merge(&mut all, &after.expected);
        wait_until("every event folded", Duration::from_secs(90), || async {
            folded_count(&fold, &all).await == count(&all)
        })
        .await;
        assert_folded_exactly(&fold, &all).await;

        let writes = log.writes();
        let fenced: Vec<&Write> = writes
            .iter()
            .filter(|write| write.relay == 1 && write.start > deadline && write.start < healed_at)
            .collect();
        assert!(
            !fenced.is_empty(),
            "no batch reached the first relay's publishers past its deadline"
        );
        let leaked: Vec<&&Write> = fenced
            .iter()
            .filter(|write| write.written != Some(false))
            .collect();
        assert!(
            leaked.is_empty(),
            "the first relay wrote {} of {} batches past its fence's deadline: {leaked:?}",
            leaked.len(),
            fenced.len()
        );
        let handovers = assert_never_together(&writes, |_| Instant::now());
        assert!(
            handovers > 0,
            "the partition moved no tenant between relays"
        );
        println!(
            "{} batches held back by the fence, {handovers} handovers",
            fenced.len()
        );

        first.shutdown().await;
        second.shutdown().await;
        folding.stop().await;
        drop_topology(&direct.rabbit_config().unwrap().topology).await;
    });
}

/// Every database connection of two relays (their lease runners' too) is killed again and
/// again (`pg_terminate_backend`, found by the relay's `application_name`) while a host
/// writes: the host never notices, the relays keep their shares or hand them over without
/// ever writing one tenant together, and every event is folded exactly once in order.
#[test]
fn killed_database_connections_lose_duplicate_and_reorder_nothing() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("killed").await;
        let config = quick_leases(relay_config(&url, &amqp_url(), &unique("relay-killed")));
        let fold = FoldStore::new(pool.clone());
        let folding = Folding::start(direct_rabbit(&config), &fold);
        let log = PublishLog::default();
        let first = start_relay(&config, 1, &log).await;
        let second = start_relay(&config, 2, &log).await;
        shares(
            &[&first, &second],
            &[64, 64],
            "two relays split the buckets",
        )
        .await;

        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let killer = {
            let (pool, stop) = (pool.clone(), stop.clone());
            tokio::spawn(async move {
                let mut killed = 0i64;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let round: Vec<bool> = sqlx::query_scalar(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                          WHERE datname = current_database() AND application_name = $1",
                    )
                    .bind(distribution::APPLICATION_NAME)
                    .fetch_all(&pool)
                    .await
                    .unwrap();
                    killed += round.into_iter().filter(|done| *done).count() as i64;
                    // Pacing of the fault, not a synchronisation: a kill every 150 ms.
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                killed
            })
        };
        let workload = Workload::new("k", 30, 2, 25);
        let ran = workload.run(&pool).await;
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let killed = killer.await.unwrap();
        assert!(killed > 0, "no relay connection was ever killed");

        wait_until("every event folded", Duration::from_secs(90), || async {
            folded_count(&fold, &ran.expected).await == count(&ran.expected)
        })
        .await;
        assert_folded_exactly(&fold, &ran.expected).await;
        assert_never_together(&log.writes(), |_| Instant::now());
        shares(
            &[&first, &second],
            &[64, 64],
            "both relays hold their half again",
        )
        .await;
        println!(
            "{killed} relay connections killed while {} events were written in {:.1} s",
            count(&ran.expected),
            ran.elapsed.as_secs_f64()
        );

        first.shutdown().await;
        second.shutdown().await;
        folding.stop().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

/// Far more tenants than PostgreSQL's shared lock table has slots (about 6,400 here) drain
/// while a host appends beside them: no host statement is refused, the relay holds no
/// advisory lock, everything ships, and then every idle drainer retires.
#[test]
fn more_tenants_than_the_lock_table_holds_drain_while_a_host_appends() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("manytenants").await;
        let mut config = relay_config(&url, &amqp_url(), &unique("relay-many"));
        config.supervisor.drainer.idle_retire = Duration::from_millis(500);
        // Far fewer drainer slots than tenants: they take turns, memory stays bounded.
        config.supervisor.max_drainers = 300;
        let slots: i64 = sqlx::query_scalar(
            "SELECT current_setting('max_locks_per_transaction')::bigint
                  * (current_setting('max_connections')::bigint
                     + current_setting('max_prepared_transactions')::bigint)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        let tenants = usize::try_from(slots).unwrap() + 1_000;
        // The backlog: one event for each of `tenants` tenants, written as a host would.
        let writers: Vec<_> = (0..4)
            .map(|part| {
                let pool = pool.clone();
                tokio::spawn(async move {
                    let writer = IntentWriter::default().with_notify(false);
                    for tenant in (part..tenants).step_by(4) {
                        let branch = BranchKey::new(
                            TenantId::new(format!("m{tenant}")).unwrap(),
                            RunId::new("r").unwrap(),
                            BranchId::new("b").unwrap(),
                        );
                        let mut tx = pool.begin().await.unwrap();
                        writer.open_run(&mut tx, &branch).await.unwrap();
                        writer
                            .append(&mut tx, &branch, Lsn::new(1), b"m")
                            .await
                            .unwrap();
                        tx.commit().await.unwrap();
                    }
                })
            })
            .collect();
        for writer in writers {
            writer.await.unwrap();
        }
        let outbox = Outbox::new(pool.clone());
        assert_eq!(pending(&outbox).await as usize, tenants);

        let relay = Relay::start(config.clone()).await.unwrap();
        // A host keeps appending on its own tenant while the relay drains: none refused.
        let host = {
            let pool = pool.clone();
            tokio::spawn(async move {
                let writer = IntentWriter::default();
                let branch = BranchKey::new(
                    TenantId::new("host").unwrap(),
                    RunId::new("r").unwrap(),
                    BranchId::new("b").unwrap(),
                );
                writer
                    .open_run(&mut pool.acquire().await.unwrap(), &branch)
                    .await
                    .unwrap();
                let mut refused = 0;
                for lsn in 1..=2_000u64 {
                    let mut tx = pool.begin().await.unwrap();
                    let appended = writer.append(&mut tx, &branch, Lsn::new(lsn), b"h").await;
                    match appended {
                        Ok(()) => tx.commit().await.unwrap(),
                        Err(_) => refused += 1,
                    }
                }
                refused
            })
        };
        let max_advisory = Arc::new(std::sync::atomic::AtomicI64::new(0));
        let max_drainers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let started = std::time::Instant::now();
        wait_until("every tenant drained", Duration::from_secs(240), || async {
            if let Some(tree) = relay.snapshot().await {
                max_drainers.fetch_max(tree.drainers.len(), std::sync::atomic::Ordering::SeqCst);
            }
            // This database's only: tests beside it migrate their own databases, and
            // sqlx's migrator holds an advisory lock while it does.
            let advisory: i64 =
                sqlx::query_scalar(
                    "SELECT count(*) FROM pg_locks
                      WHERE locktype = 'advisory'
                        AND database = (SELECT oid FROM pg_database
                                         WHERE datname = current_database())",
                )
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            max_advisory.fetch_max(advisory, std::sync::atomic::Ordering::SeqCst);
            pending(&outbox).await == 0
        })
        .await;
        let drained_in = started.elapsed();
        assert_eq!(host.await.unwrap(), 0, "host appends refused");
        assert_eq!(
            max_advisory.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "the relay took advisory locks"
        );
        let most = max_drainers.load(std::sync::atomic::Ordering::SeqCst);
        assert!(most <= 300, "{most} drainers alive at once (cap 300)");
        assert!(most > 0, "the snapshot never saw a drainer");
        let tree = relay.snapshot().await.unwrap();
        assert_eq!(tree.buckets_held, usize::from(LEASE_BUCKETS));
        // Idle costs nothing: every drainer retires; nothing is kept per tenant ever seen.
        wait_until("idle drainers retired", Duration::from_secs(30), || async {
            relay
                .snapshot()
                .await
                .is_some_and(|tree| tree.drainers.is_empty())
        })
        .await;
        // ... and nothing of a retired drainer lingers: its timers (a 30 s batch timeout
        // each, holding the actor's mailboxes) went with it. Before, every tenant drained
        // in the last 30 s left one task alive.
        let tasks = relay.snapshot().await.unwrap().tasks_alive;
        assert!(
            tasks < 500,
            "{tasks} tasks alive on the relay's runtime after {tenants} tenants drained and every drainer retired"
        );
        println!(
            "{tenants} tenants drained beside a host in {:.1} s (lock table: {slots} slots), at most {most} drainers alive, {tasks} tasks alive after",
            drained_in.as_secs_f64()
        );
        relay.shutdown().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

/// An idle drainer woken again and again (a NOTIFY storm, a host calling its waker on
/// every commit) keeps one idle check, not one 30 s timer per empty drain.
#[test]
fn an_idle_drainer_woken_again_and_again_keeps_one_timer() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("wakestorm").await;
        let mut config = relay_config(&url, &amqp_url(), &unique("relay-wakestorm"));
        config.supervisor.drainer.idle_retire = Duration::from_secs(60);
        let relay = Relay::start(config.clone()).await.unwrap();
        let branch = write_first_intent(&pool, "storm", b"s").await;
        let outbox = Outbox::new(pool.clone());
        wait_until("shipped", Duration::from_secs(30), || async {
            pending(&outbox).await == 0
        })
        .await;
        let idle = relay.snapshot().await.unwrap();
        assert!(
            idle.drainers.contains_key(&branch.tenant),
            "its drainer idles"
        );
        let before = idle.tasks_alive;
        // Each wake-up that is not coalesced costs the drainer an empty drain; a snapshot
        // between wake-ups lets many of them through.
        let waker = relay.waker();
        for _ in 0..500 {
            waker.wake(&branch.tenant);
            relay.snapshot().await.unwrap();
        }
        wait_until(
            "the storm's timers gone (formerly one per empty drain, for 60 s)",
            Duration::from_secs(10),
            || async {
                relay
                    .snapshot()
                    .await
                    .is_some_and(|tree| tree.tasks_alive <= before + 5)
            },
        )
        .await;
        relay.shutdown().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

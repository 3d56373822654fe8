//! Several relays on one outbox, on the real PostgreSQL and RabbitMQ: even shares, handover on
//! a crash and on a join, never two relays publishing one tenant at once, nothing lost or
//! reordered; and more tenants than PostgreSQL's lock table could ever hold, beside a host.
#[path = "support/harness.rs"]
mod harness;

mod scale_out {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use distribution::broker::{BoxFuture, Confirms, Publisher, RabbitConfig, RabbitPublisher};
    use distribution::store::{
        BranchId, BranchKey, Fence, FoldStore, IntentWriter, LEASE_BUCKETS, Lsn, Outbox,
        OutboxEvent, RunId, TenantId,
    };
    use distribution::{Relay, RelayConfig, RelayHandle};

    use crate::harness::*;

    /// One publish call of one relay: its tenants and when it wrote (end `None`: still writing,
    /// or cut off by a crash).
    #[derive(Clone, Debug)]
    struct Write {
        relay: usize,
        tenants: Vec<TenantId>,
        start: Instant,
        end: Option<Instant>,
    }

    #[derive(Clone, Default)]
    struct PublishLog(Arc<Mutex<Vec<Write>>>);

    struct Recording {
        relay: usize,
        inner: RabbitPublisher,
        log: PublishLog,
    }

    impl Publisher for Recording {
        #[allow(clippy::async_yields_async)]
        fn send<'a>(
            &'a mut self,
            events: &'a [OutboxEvent],
            fence: &'a Fence,
        ) -> BoxFuture<'a, Confirms> {
            Box::pin(async move {
                let entry = fence.is_open().then(|| {
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
                    });
                    log.len() - 1
                });
                let confirms = self.inner.send(events, fence).await;
                if let Some(entry) = entry {
                    self.log.0.lock().unwrap()[entry].end = Some(Instant::now());
                }
                confirms
            })
        }
    }

    async fn start_relay(config: &RelayConfig, relay: usize, log: &PublishLog) -> RelayHandle {
        let rabbit: RabbitConfig = config.rabbit_config().unwrap();
        let log = log.clone();
        let factory = Arc::new(move |_shard| {
            Box::new(Recording {
                relay,
                inner: RabbitPublisher::new(rabbit.clone()),
                log: log.clone(),
            }) as Box<dyn Publisher>
        });
        Relay::start_with(config.clone(), factory).await.unwrap()
    }

    async fn buckets(relay: &RelayHandle) -> usize {
        relay
            .snapshot()
            .await
            .map(|tree| tree.buckets_held)
            .unwrap_or(0)
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
            let mut config = relay_config(&url, &amqp_url(), &unique("relay-scale3"));
            config.supervisor.lease.ttl = Duration::from_millis(1500);
            config.supervisor.lease.heartbeat = Duration::from_millis(250);
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

            // No interval in which two relays published the same tenant.
            let writes = log.0.lock().unwrap().clone();
            let mut by_tenant: BTreeMap<TenantId, Vec<(usize, Instant, Instant)>> = BTreeMap::new();
            for write in &writes {
                // A write cut off by the crash lasted until the crash at most; the others finished.
                let end = write.end.unwrap_or(if write.relay == 1 {
                    crashed_at
                } else {
                    Instant::now()
                });
                for tenant in &write.tenants {
                    by_tenant.entry(tenant.clone()).or_default().push((
                        write.relay,
                        write.start,
                        end,
                    ));
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
                let advisory: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
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
}

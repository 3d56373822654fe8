//! The T7.4 acceptance suite, on this machine's real PostgreSQL and RabbitMQ.
//!
//! `cargo test -p distribution outbox -- --test-threads=1` runs it; every Verify step is a test
//! in `mod outbox`. Broker outages are a proxy each test owns; the real RabbitMQ keeps running.

mod outbox {
    use std::time::{Duration, Instant};

    use distribution::Relay;
    use distribution::broker::{CallProbe, Partition};
    use distribution::store::{
        BranchId, BranchKey, FoldStore, IntentWriter, LEASE_BUCKETS, Lsn, Outbox, RunId, TenantId,
    };
    use distribution::testing::BrokerProxy;
    use futures_util::StreamExt;
    use lapin::options::{BasicConsumeOptions, BasicQosOptions};
    use lapin::types::FieldTable;

    use crate::harness::*;

    /// The largest down/up latency ratio accepted for a host run (step 2). An executor that
    /// touched the broker inline would pay connect timeouts per step: a ratio in the hundreds.
    const LATENCY_RATIO_BOUND: f64 = 3.0;

    /// Steps 1-4 and 7: the broker is down for a whole run; the run completes at normal speed
    /// (ratio to a broker-up baseline measured here); nothing ships while it is down; when it
    /// returns every event ships and is folded once, in Lsn order per branch, across tenants,
    /// runs and branches interleaved; and the broker client never ran on a host thread.
    #[test]
    fn outbox_broker_down_for_a_whole_run_then_everything_ships_in_order() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("down").await;
            let proxy = BrokerProxy::start(&amqp_url()).unwrap();
            let probe = CallProbe::new();
            let mut config = relay_config(&url, &proxy.amqp_url(), &unique("relay-down"));
            config.probe = Some(probe.clone());
            let fold = FoldStore::new(pool.clone());
            let folding = Folding::start(direct_rabbit(&config), &fold);
            let relay = Relay::start(config.clone()).await.unwrap();
            let outbox = Outbox::new(pool.clone());

            let baseline = Workload::new("up", 3, 2, 40).run(&pool).await;
            proxy.cut();
            let mut down_workload = Workload::new("down", 3, 2, 40);
            down_workload.rewind = true;
            let down = down_workload.run(&pool).await;

            let ratio = down.elapsed.as_secs_f64() / baseline.elapsed.as_secs_f64();
            println!(
                "host run latency: broker up {:.3} s, broker down {:.3} s, ratio {ratio:.2} (bound {LATENCY_RATIO_BOUND})",
                baseline.elapsed.as_secs_f64(),
                down.elapsed.as_secs_f64()
            );
            assert!(ratio <= LATENCY_RATIO_BOUND, "broker-down run was {ratio:.2}x slower than broker-up");

            // While the broker is down nothing of the down run ships; the backlog shows it waiting.
            assert_eq!(folded_count(&fold, &down.expected).await, 0);
            let waiting: u64 = {
                let mut waiting = 0;
                for tenant in tenants_of(&down.expected) {
                    waiting += outbox.tenant_backlog(&tenant).await.unwrap().pending;
                }
                waiting
            };
            // Every intent of the run waits, and one rewind marker per rewind.
            assert_eq!(waiting as usize, count(&down.expected) + down.rewinds);

            proxy.restore();
            let mut all = baseline.expected.clone();
            merge(&mut all, &down.expected);
            wait_until("every event folded", Duration::from_secs(60), || async {
                folded_count(&fold, &all).await == count(&all)
            })
            .await;
            assert_folded_exactly(&fold, &all).await;
            wait_until("backlog empty", Duration::from_secs(10), || async { pending(&outbox).await == 0 }).await;

            // Step 7: the broker client was called, and never from a host executor thread.
            let calls = probe.calls_by_thread();
            assert!(!calls.is_empty(), "the probe saw no broker call at all");
            for (thread, n_calls) in &calls {
                assert!(!thread.starts_with(HOST_THREADS), "{n_calls} broker calls from host thread {thread}");
                assert!(thread.starts_with("outbox-relay"), "broker call from unexpected thread {thread}");
            }

            relay.shutdown().await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }

    /// Step 5: ack loss forces every event to be delivered twice; the folded state is identical
    /// to folding each event once (exactly once at the fold, not in transport).
    #[test]
    fn outbox_forced_redelivery_leaves_the_fold_identical_to_single_delivery() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("redeliver").await;
            let config = relay_config(&url, &amqp_url(), &unique("relay-redeliver"));
            let rabbit = direct_rabbit(&config);
            let outbox = Outbox::new(pool.clone());
            let ran = Workload::new("rd", 2, 2, 25).run(&pool).await;
            let relay = Relay::start(config.clone()).await.unwrap();
            wait_until("all confirmed", Duration::from_secs(60), || async {
                pending(&outbox).await == 0
            })
            .await;
            relay.shutdown().await;

            // A consumer folds every delivery but loses its acks (its channel dies unacked).
            let fold = FoldStore::new(pool.clone());
            let total = count(&ran.expected);
            let connection =
                lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                    .await
                    .unwrap();
            let mut first_pass = 0;
            for index in 0..rabbit.topology.partitions() {
                let channel = connection.create_channel().await.unwrap();
                channel
                    .basic_qos(10_000, BasicQosOptions::default())
                    .await
                    .unwrap();
                let in_partition = ran
                    .expected
                    .iter()
                    .filter(|(key, _)| {
                        rabbit.topology.partition_of(&key.tenant, &key.run) == Partition(index)
                    })
                    .map(|(_, events)| events.len())
                    .sum::<usize>();
                let mut consumer = channel
                    .basic_consume(
                        rabbit.topology.queue(Partition(index)),
                        "".into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                for _ in 0..in_partition {
                    let delivery = consumer.next().await.unwrap().unwrap();
                    let event =
                        distribution::rabbit::decode(&delivery.properties, &delivery.data).unwrap();
                    fold.apply(&event).await.unwrap();
                    first_pass += 1;
                }
                channel.close(200, "ack lost".into()).await.unwrap();
            }
            connection.close(200, "ack lost".into()).await.unwrap();
            assert_eq!(first_pass, total);

            // The real consumer then receives all of it again.
            let folding = Folding::start(rabbit.clone(), &fold);
            wait_until(
                "every event redelivered",
                Duration::from_secs(60),
                || async { folding.totals().duplicates as usize == total },
            )
            .await;
            let stats = folding.stop().await;
            assert_eq!(
                (stats.applied, stats.duplicates),
                (0, total as u64),
                "redeliveries are no-ops"
            );

            // The single-delivery case, folded in another database, is identical.
            let (reference_pool, _) = fresh_database("reference").await;
            let reference = FoldStore::new(reference_pool);
            for (branch, events) in &ran.expected {
                let mut prev = Lsn::ZERO;
                for (lsn, payload) in events {
                    let event = testkit::intent(branch, lsn.get())
                        .prev(prev.get())
                        .payload(payload.clone())
                        .build();
                    reference.apply(&event).await.unwrap();
                    prev = *lsn;
                }
            }
            for tenant in tenants_of(&ran.expected) {
                assert_eq!(
                    fold.folded(&tenant).await.unwrap().len(),
                    reference.folded(&tenant).await.unwrap().len()
                );
            }
            assert_folded_exactly(&fold, &ran.expected).await;
            assert_folded_exactly(&reference, &ran.expected).await;
            drop_topology(&rabbit.topology).await;
        });
    }

    /// Step 6 (actors): drainers and publishers killed mid-batch, again and again, while a
    /// backlog ships; restarted, they lose nothing and duplicate nothing at the fold.
    #[test]
    fn outbox_killing_drainers_and_publishers_mid_batch_loses_and_duplicates_nothing() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("kill").await;
            let mut config = relay_config(&url, &amqp_url(), &unique("relay-kill"));
            config.supervisor.drainer.batch_size = 25;
            let outbox = Outbox::new(pool.clone());
            let fold = FoldStore::new(pool.clone());
            let ran = Workload::new("kill", 3, 2, 150).run(&pool).await;
            let total = count(&ran.expected) as u64;
            let folding = Folding::start(direct_rabbit(&config), &fold);
            let relay = Relay::start(config.clone()).await.unwrap();

            let mut kills = 0;
            let mut last_pending = total;
            while kills < 8 {
                // Wait for progress since the last kill, so each kill lands on a working tree.
                wait_until("progress", Duration::from_secs(30), || async {
                    let now = pending(&outbox).await;
                    now < last_pending || now == 0
                })
                .await;
                last_pending = pending(&outbox).await;
                if last_pending == 0 {
                    break;
                }
                let Some(tree) = relay.snapshot().await else {
                    continue;
                };
                if kills % 2 == 0 {
                    if let Some(drainer) = tree
                        .drainers
                        .values()
                        .nth(kills % tree.drainers.len().max(1))
                    {
                        drainer.kill();
                        kills += 1;
                    }
                } else if let Some(publisher) = tree
                    .publishers
                    .iter()
                    .flatten()
                    .nth(kills % tree.publishers.len().max(1))
                {
                    publisher.kill();
                    kills += 1;
                }
            }
            assert!(
                kills >= 4,
                "only {kills} kills landed before the backlog drained"
            );
            wait_until("every event folded", Duration::from_secs(60), || async {
                folded_count(&fold, &ran.expected).await as u64 == total
            })
            .await;
            assert_folded_exactly(&fold, &ran.expected).await;
            assert_eq!(pending(&outbox).await, 0);
            relay.shutdown().await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }

    /// Step 6 (process): the standalone relay is SIGKILLed mid-batch and started again; nothing
    /// is lost and nothing is duplicated at the fold. Proves ack-after-confirm end to end.
    #[test]
    fn outbox_sigkill_of_the_relay_process_loses_and_duplicates_nothing() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("sigkill").await;
            let config = relay_config(&url, &amqp_url(), &unique("relay-sigkill"));
            let outbox = Outbox::new(pool.clone());
            let fold = FoldStore::new(pool.clone());
            let ran = Workload::new("sk", 3, 2, 300).run(&pool).await;
            let total = count(&ran.expected) as u64;
            let folding = Folding::start(direct_rabbit(&config), &fold);
            let spawn = || {
                std::process::Command::new(env!("CARGO_BIN_EXE_distribution"))
                    .arg("run")
                    .env("DATABASE_URL", &url)
                    .env("AMQP_URL", amqp_url())
                    .env("RELAY_TOPOLOGY", &config.topology)
                    .env("RELAY_PARTITIONS", config.partitions.to_string())
                    .env("RELAY_BATCH_SIZE", "20")
                    .env("RELAY_POLL_MS", "100")
                    .env("RELAY_METRICS_ADDR", "127.0.0.1:0")
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("spawn the relay binary")
            };
            let mut first = spawn();
            wait_until(
                "the first relay to ship something",
                Duration::from_secs(60),
                || async { pending(&outbox).await < total },
            )
            .await;
            first.kill().unwrap(); // SIGKILL
            first.wait().unwrap();
            let left = pending(&outbox).await;
            assert!(
                left > 0,
                "the relay finished before it could be killed mid-run"
            );
            println!("SIGKILL with {left} of {total} events pending");

            let mut second = spawn();
            wait_until("every event folded", Duration::from_secs(90), || async {
                folded_count(&fold, &ran.expected).await as u64 == total
            })
            .await;
            second.kill().unwrap();
            second.wait().unwrap();
            assert_folded_exactly(&fold, &ran.expected).await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }

    /// Step 8: after a rewind only the live branch is exported: the abandoned tail never
    /// reaches the broker; the shared prefix and the new branch do.
    #[test]
    fn outbox_only_the_live_branch_is_exported_after_a_rewind() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("rewind").await;
            let proxy = BrokerProxy::start(&amqp_url()).unwrap();
            proxy.cut();
            let config = relay_config(&url, &proxy.amqp_url(), &unique("relay-rewind"));
            let relay = Relay::start(config.clone()).await.unwrap();
            let writer = IntentWriter::default();
            let tenant = TenantId::new("rw").unwrap();
            let main = BranchKey::new(
                tenant.clone(),
                RunId::new("r1").unwrap(),
                BranchId::new("main").unwrap(),
            );
            let other = BranchKey::new(
                tenant.clone(),
                RunId::new("r2").unwrap(),
                BranchId::new("main").unwrap(),
            );
            writer
                .open_run(&mut pool.acquire().await.unwrap(), &main)
                .await
                .unwrap();
            writer
                .open_run(&mut pool.acquire().await.unwrap(), &other)
                .await
                .unwrap();
            for lsn in 1..=10 {
                writer
                    .append(
                        &mut pool.acquire().await.unwrap(),
                        &main,
                        Lsn::new(lsn),
                        format!("main{lsn}").as_bytes(),
                    )
                    .await
                    .unwrap();
                writer
                    .append(
                        &mut pool.acquire().await.unwrap(),
                        &other,
                        Lsn::new(lsn),
                        format!("other{lsn}").as_bytes(),
                    )
                    .await
                    .unwrap();
            }
            let rewound = writer
                .rewind(
                    &mut pool.acquire().await.unwrap(),
                    &main,
                    Lsn::new(5),
                    BranchId::new("alt").unwrap(),
                )
                .await
                .unwrap();
            assert_eq!(rewound.abandoned, 5);
            for lsn in 6..=9 {
                writer
                    .append(
                        &mut pool.acquire().await.unwrap(),
                        &rewound.live,
                        Lsn::new(lsn),
                        format!("alt{lsn}").as_bytes(),
                    )
                    .await
                    .unwrap();
            }
            let mut expected = Expected::new();
            expected.insert(
                main.clone(),
                (1..=5)
                    .map(|l| (Lsn::new(l), format!("main{l}").into_bytes()))
                    .collect(),
            );
            expected.insert(
                rewound.live.clone(),
                (6..=9)
                    .map(|l| (Lsn::new(l), format!("alt{l}").into_bytes()))
                    .collect(),
            );
            expected.insert(
                other.clone(),
                (1..=10)
                    .map(|l| (Lsn::new(l), format!("other{l}").into_bytes()))
                    .collect(),
            );

            let fold = FoldStore::new(pool.clone());
            let folding = Folding::start(direct_rabbit(&config), &fold);
            proxy.restore();
            wait_until(
                "the live history folded",
                Duration::from_secs(60),
                || async { folded_count(&fold, &expected).await == count(&expected) },
            )
            .await;
            wait_until("backlog empty", Duration::from_secs(10), || async {
                pending(&Outbox::new(pool.clone())).await == 0
            })
            .await;
            // Everything the broker ever carried has been folded (the backlog is empty and the
            // fold consumers are caught up), and it is exactly the live history.
            assert_folded_exactly(&fold, &expected).await;
            assert!(
                fold.folded(&tenant)
                    .await
                    .unwrap()
                    .iter()
                    .all(|e| !(e.key.branch == main && e.key.lsn > Lsn::new(5)))
            );
            relay.shutdown().await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }

    /// Several relays on one database: each tenant is drained by exactly one of them; when one
    /// dies, the survivor takes its tenants over with no operator, and nothing is lost.
    #[test]
    fn outbox_two_relays_split_tenants_and_a_dead_relays_tenants_move_to_the_survivor() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("two").await;
            let config = relay_config(&url, &amqp_url(), &unique("relay-two"));
            let fold = FoldStore::new(pool.clone());
            let folding = Folding::start(direct_rabbit(&config), &fold);
            let first = Relay::start(config.clone()).await.unwrap();
            let second = Relay::start(config.clone()).await.unwrap();
            let workload = Workload::new("two", 8, 1, 30);
            let ran = workload.run(&pool).await;
            let mut all = ran.expected.clone();
            let tenants = tenants_of(&all);
            wait_until("every event folded", Duration::from_secs(60), || async {
                folded_count(&fold, &all).await == count(&all)
            })
            .await;
            let held_first = held(&first).await;
            let held_second = held(&second).await;
            assert!(
                held_first
                    .iter()
                    .all(|tenant| !held_second.contains(tenant)),
                "a tenant held twice"
            );
            assert_eq!(held_first.len() + held_second.len(), tenants.len());

            first.abort().await; // a crash: its leases go with its connections
            let more = workload.steps(&pool, ran.live.clone(), 31..=50).await;
            merge(&mut all, &more.expected);
            wait_until(
                "the survivor ships the dead relay's tenants",
                Duration::from_secs(60),
                || async { folded_count(&fold, &all).await == count(&all) },
            )
            .await;
            let held = held(&second).await;
            assert_eq!(held.len(), tenants.len(), "the survivor holds every tenant");
            assert_folded_exactly(&fold, &all).await;
            second.shutdown().await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }

    /// The tenants a relay holds right now.
    async fn held(relay: &distribution::RelayHandle) -> Vec<TenantId> {
        relay
            .snapshot()
            .await
            .expect("relay running")
            .drainers
            .into_keys()
            .collect()
    }

    /// A stalled host runtime does not stall the relay: with every host executor thread
    /// blocked, committed events still ship.
    #[test]
    fn outbox_relay_keeps_shipping_while_the_host_runtime_is_stalled() {
        let host = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (pool, url, relay, fold, folding, ran, config) = host.block_on(async {
            let (pool, url) = fresh_database("stall").await;
            let config = relay_config(&url, &amqp_url(), &unique("relay-stall"));
            let fold = FoldStore::new(pool.clone());
            let folding = Folding::start(direct_rabbit(&config), &fold);
            let relay = Relay::start(config.clone()).await.unwrap();
            let ran = Workload::new("stall", 2, 2, 20).run(&pool).await;
            (pool, url, relay, fold, folding, ran, config)
        });
        // The host's only executor thread is now blocked (not driving anything) until the relay
        // has shipped everything, as observed from a separate checker thread with its own runtime.
        let checker = std::thread::spawn({
            let url = url.clone();
            move || {
                let checker = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                checker.block_on(async {
                    let pool = sqlx::PgPool::connect(&url).await.unwrap();
                    let outbox = Outbox::new(pool);
                    wait_until(
                        "the relay ships while the host stalls",
                        Duration::from_secs(60),
                        || async { pending(&outbox).await == 0 },
                    )
                    .await;
                })
            }
        });
        checker
            .join()
            .expect("the relay shipped everything while the host was blocked");
        host.block_on(async {
            wait_until("every event folded", Duration::from_secs(60), || async {
                folded_count(&fold, &ran.expected).await == count(&ran.expected)
            })
            .await;
            assert_folded_exactly(&fold, &ran.expected).await;
            relay.shutdown().await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
            drop(pool);
        });
    }

    /// A broker that swallows every byte (a network dropping packets): a publisher notices
    /// within its AMQP timeouts instead of trying every queued batch on the dead session,
    /// nothing is acked that the broker did not confirm, and everything ships, in order and
    /// once at the fold, when it answers again.
    #[test]
    fn outbox_a_silent_broker_is_noticed_within_its_timeouts_and_nothing_is_acked() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("silent").await;
            let proxy = BrokerProxy::start(&amqp_url()).unwrap();
            let mut config = relay_config(&url, &proxy.amqp_url(), &unique("relay-silent"));
            config.amqp_connect_timeout = Duration::from_secs(2);
            config.amqp_confirm_timeout = Duration::from_secs(1);
            let fold = FoldStore::new(pool.clone());
            let folding = Folding::start(direct_rabbit(&config), &fold);
            let relay = Relay::start(config.clone()).await.unwrap();
            let outbox = Outbox::new(pool.clone());
            let workload = Workload::new("silent", 4, 2, 10);
            let ran = workload.run(&pool).await;
            let mut all = ran.expected.clone();
            wait_until("first events folded", Duration::from_secs(30), || async {
                folded_count(&fold, &all).await == count(&all)
            })
            .await;
            let before: Vec<_> = relay
                .snapshot()
                .await
                .unwrap()
                .publishers
                .iter()
                .map(|publisher| publisher.as_ref().map(|p| p.get_id()))
                .collect();

            proxy.silence();
            let silenced = Instant::now();
            let more = workload.steps(&pool, ran.live.clone(), 11..=20).await;
            merge(&mut all, &more.expected);
            wait_until(
                "a publisher noticed the silence",
                Duration::from_secs(20),
                || async {
                    relay.snapshot().await.is_some_and(|tree| {
                        tree.publishers
                            .iter()
                            .zip(&before)
                            .any(|(now, was)| now.as_ref().map(|p| p.get_id()) != *was)
                    })
                },
            )
            .await;
            let noticed = silenced.elapsed();
            println!(
                "silent broker noticed after {:.2} s (confirm timeout 1 s)",
                noticed.as_secs_f64()
            );
            assert!(
                noticed < Duration::from_secs(8),
                "noticed only after {noticed:?}"
            );
            // Nothing written while silent was acked: every new event still waits.
            assert_eq!(pending(&outbox).await as usize, count(&more.expected));

            proxy.restore();
            let deadline = Instant::now() + Duration::from_secs(60);
            while folded_count(&fold, &all).await != count(&all) {
                if Instant::now() > deadline {
                    // Say why before failing: what the relay holds and what still waits.
                    let tree = relay.snapshot().await;
                    let leases: Vec<(Option<String>, i64)> =
                        sqlx::query_as("SELECT owner, count(*) FROM relay_lease GROUP BY owner")
                            .fetch_all(&pool)
                            .await
                            .unwrap();
                    panic!(
                        "not everything folded 60 s after the broker answered: folded {} of {}; \
                         backlog {:?}; parked {:?}; leases {leases:?}; relay {:?}",
                        folded_count(&fold, &all).await,
                        count(&all),
                        outbox.backlog().await.unwrap(),
                        outbox.parked_branches().await.unwrap(),
                        tree.map(|tree| (
                            tree.relay_id,
                            tree.buckets_held,
                            tree.drainers.keys().cloned().collect::<Vec<_>>(),
                            tree.publishers.iter().filter(|p| p.is_some()).count(),
                        )),
                    );
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_folded_exactly(&fold, &all).await;
            relay.shutdown().await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }

    /// A relay that would not poll for 120 s, holding every lease bucket (its first poll has
    /// run, finding nothing), and 5 intents of branch `<tenant>/r/b` committed without NOTIFY:
    /// only a wake-up can make it ship them.
    async fn unpolled_relay_and_unnotified_intents(
        label: &str,
        tenant: &str,
    ) -> (
        sqlx::PgPool,
        distribution::RelayConfig,
        distribution::RelayHandle,
        BranchKey,
    ) {
        let (pool, url) = fresh_database(label).await;
        let mut config = relay_config(&url, &amqp_url(), &unique(&format!("relay-{label}")));
        config.supervisor.poll_interval = Duration::from_secs(120);
        let relay = Relay::start(config.clone()).await.unwrap();
        wait_until("leases held", Duration::from_secs(10), || async {
            relay
                .snapshot()
                .await
                .is_some_and(|tree| tree.buckets_held == usize::from(LEASE_BUCKETS))
        })
        .await;
        let writer = IntentWriter::default().with_notify(false);
        let branch = BranchKey::new(
            TenantId::new(tenant).unwrap(),
            RunId::new("r").unwrap(),
            BranchId::new("b").unwrap(),
        );
        let mut tx = pool.begin().await.unwrap();
        writer.open_run(&mut tx, &branch).await.unwrap();
        for lsn in 1..=5 {
            writer
                .append(&mut tx, &branch, Lsn::new(lsn), b"x")
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        (pool, config, relay, branch)
    }

    /// An embedded host that turns NOTIFY off (to keep its commits fast) wakes the relay
    /// in-process: events ship long before the next poll would have found them.
    #[test]
    fn outbox_an_in_process_waker_replaces_notify() {
        host_runtime().block_on(async {
            let (pool, config, relay, branch) =
                unpolled_relay_and_unnotified_intents("waker", "wk").await;
            let outbox = Outbox::new(pool.clone());
            // Nothing ships before the wake-up (no NOTIFY, no poll for 120 s): a second after
            // the commit, with every lease held, all five still wait.
            let shipped = || async { pending(&outbox).await < 5 };
            assert!(
                !holds_within(Duration::from_secs(1), shipped).await,
                "something shipped before the wake-up"
            );
            relay.waker().wake(&branch.tenant);
            wait_until("woken relay ships", Duration::from_secs(20), || async {
                pending(&outbox).await == 0
            })
            .await;
            relay.shutdown().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }

    /// A host that turns NOTIFY off inside its transactions (to keep its commits from being
    /// serialised) wakes a relay it does not embed with `wake_relays` after the commit: events
    /// ship long before the next poll would have found them.
    #[test]
    fn outbox_a_wake_after_the_commit_replaces_the_in_transaction_notify() {
        host_runtime().block_on(async {
            let (pool, config, relay, branch) =
                unpolled_relay_and_unnotified_intents("wakeafter", "wa").await;
            let outbox = Outbox::new(pool.clone());
            // The relay's listener subscribed (else the NOTIFY reaches nobody).
            wait_until("relay listening", Duration::from_secs(10), || async {
                let listening: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND query LIKE 'LISTEN %relay_outbox%'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                listening > 0
            })
            .await;
            let shipped = || async { pending(&outbox).await < 5 };
            assert!(
                !holds_within(Duration::from_secs(1), shipped).await,
                "something shipped before the wake-up"
            );
            let mut conn = pool.acquire().await.unwrap();
            IntentWriter::default()
                .wake_relays(&mut conn, &branch.tenant)
                .await
                .unwrap();
            wait_until("woken relay ships", Duration::from_secs(20), || async {
                pending(&outbox).await == 0
            })
            .await;
            relay.shutdown().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }
}

//! Broker faults a proxy cannot make, on private RabbitMQ nodes each test starts and stops
//! itself (never the machine's own broker): a node restart under load (classic and quorum
//! queues), a memory alarm (flow control: `connection.blocked`), and a message-size limit
//! below an intent. Each heals in seconds, hurts only what it must, and keeps the ordering
//! promises of `broker/WIRE.md`.

mod outbox {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use distribution::rabbit::QueueType;
    use distribution::store::{
        BranchId, BranchKey, EventKind, FoldModel, FoldStore, IntentWriter, Lsn, Outbox,
        OutboxEvent, RunId,
    };
    use distribution::{Relay, RelayConfig};
    use sqlx::PgPool;

    use crate::harness::*;
    use crate::node::{PrivateNode, Rabbit};
    use crate::recorder::{Recorder, keep_writing};

    /// The harness's test-speed relay on `node`, with 1 s AMQP timeouts (the drainer's batch
    /// timeout stays the harness's 10 s).
    fn relay_on(node: &PrivateNode, url: &str, topology: &str) -> RelayConfig {
        let mut config = relay_config(url, &node.url(), topology);
        config.amqp_connect_timeout = Duration::from_secs(1);
        config.amqp_confirm_timeout = Duration::from_secs(1);
        config
    }

    /// The node's broker application stops for 3 s under load and starts again: every branch
    /// ships again within seconds of the broker accepting connections (a batch of a publisher
    /// that died is settled at once, not at a timeout), and the fold is exact.
    async fn restart_under_load(rabbit: Rabbit, queue_type: QueueType) -> Duration {
        let node = tokio::task::block_in_place(|| PrivateNode::start_on(rabbit, "restart"));
        let (pool, url) = fresh_database("brokerrestart").await;
        let topology = unique("restart");
        let mut config = relay_on(&node, &url, &topology);
        config.queue_type = queue_type;
        let rabbit = config.rabbit_config().unwrap();
        let relay = Relay::start(config).await.unwrap();
        let fold_pool = fresh_database("brokerrestartfold").await.0;
        let fold = FoldStore::new(fold_pool);
        let folding = Folding::start(rabbit.clone(), &fold);

        let workload = Workload::new(&unique("rs"), 3, 3, 2);
        let ran = workload.run(&pool).await;
        let stop = Arc::new(AtomicBool::new(false));
        let writer = keep_writing(pool.clone(), workload, ran, stop.clone());
        let outbox = Outbox::new(pool.clone());
        wait_until(
            "the first intents ship",
            Duration::from_secs(30),
            || async { folding.totals().applied >= 20 },
        )
        .await;

        tokio::task::block_in_place(|| node.stop_app());
        // The outage lasts 3 s while the host writes on (the host never waits for the broker).
        tokio::time::sleep(Duration::from_secs(3)).await;
        tokio::task::block_in_place(|| node.start_app());
        let (back, _) = oldest_pending(&pool).await;

        // Lag after recovery: for each intent, from max(its commit, the broker's return) to its
        // ack; the oldest pending intent bounds it at each sample. Sampled while the host writes
        // on for 4 s, then until the outbox is empty.
        let mut worst = Duration::ZERO;
        let writing_until = tokio::time::Instant::now() + Duration::from_secs(4);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            let (now, oldest) = oldest_pending(&pool).await;
            match oldest {
                Some(oldest) => {
                    let lag = (now - oldest.max(back)).to_std().unwrap_or_default();
                    worst = worst.max(lag);
                }
                None if writer.is_finished() => break,
                None => {}
            }
            if tokio::time::Instant::now() >= writing_until {
                stop.store(true, Ordering::Release);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the outbox did not empty within 90 s of the broker's return"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let expected = writer.await.unwrap();
        assert_eq!(pending(&outbox).await, 0);
        until_folded_exactly(&fold, &expected, "the fold has every live intent").await;
        folding.stop().await;
        relay.shutdown().await;
        // The topology goes with the node's data directory.
        worst
    }

    /// A broker restart (classic queues) heals within seconds: the lag of any intent after the
    /// broker accepts connections again stays under 5 s (a few seconds plus the retry backoff;
    /// before, branches stalled for twice the drainer's batch timeout).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broker_restart_under_load_heals_within_seconds_classic() {
        heals_within_seconds(Rabbit::V3_10, QueueType::Classic).await;
    }

    /// The same on RabbitMQ 4.0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broker_restart_under_load_heals_within_seconds_classic_on_rabbitmq_4_0() {
        heals_within_seconds(Rabbit::V4_0, QueueType::Classic).await;
    }

    /// The same with quorum queues.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broker_restart_under_load_heals_within_seconds_quorum() {
        heals_within_seconds(Rabbit::V3_10, QueueType::Quorum).await;
    }

    /// The same on RabbitMQ 4.0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broker_restart_under_load_heals_within_seconds_quorum_on_rabbitmq_4_0() {
        heals_within_seconds(Rabbit::V4_0, QueueType::Quorum).await;
    }

    async fn heals_within_seconds(rabbit: Rabbit, queue_type: QueueType) {
        let worst = restart_under_load(rabbit, queue_type).await;
        println!("{rabbit:?} {queue_type:?}: worst lag after the broker returned: {worst:?}");
        assert!(
            worst < Duration::from_secs(5),
            "an intent waited {worst:?} after the broker returned"
        );
    }

    /// A broker restart as operators meet it: three relays with their default timings share
    /// 40 tenants (80 runs written on at a few hundred intents a second, so both lanes are
    /// busy once a backlog builds), a consumer folds, and the broker application stops for
    /// 10 s. Every intent committed before the broker's return is confirmed within 5 s of it,
    /// and the fold is exact. An independent campaign measured 11 to 65 s; this test failed
    /// on that code (18 and 20 tenants with nothing shipped 5 s after the return, all shipped
    /// after 8.1 to 8.7 s: publishers and drainers each waited out a delay drawn while the
    /// broker was down). Now the core checks the broker every 500 ms while it is in doubt,
    /// and its answer, or any publisher's recovery, restarts every publisher and resumes every
    /// drainer at once (`supervisor::core`, `Core::broker_back`): 0.02 to 0.66 s here.
    async fn restart_with_several_relays(rabbit: Rabbit, queue_type: QueueType) {
        crate::harness::capture_logs();
        let node = tokio::task::block_in_place(|| PrivateNode::start_on(rabbit, "restartmany"));
        let (pool, url) = fresh_database("brokerrestartmany").await;
        let topology = unique("restartmany");
        let mut config = RelayConfig::new(&url, node.url());
        config.topology = topology.clone();
        config.queue_type = queue_type;
        // Few database connections: three relays beside the suite's other tests stay well
        // within the server's 100 (the broker is what this test is about).
        config.db_connections = 2;
        let rabbit_config = config.rabbit_config().unwrap();
        let mut relays = Vec::new();
        for _ in 0..3 {
            relays.push(Relay::start(config.clone()).await.unwrap());
        }
        let fold = FoldStore::new(fresh_database("brokerrestartmanyfold").await.0);
        let folding = Folding::start(rabbit_config.clone(), &fold);

        let workload = Workload::new(&unique("rm"), 40, 2, 2);
        let ran = workload.run(&pool).await;
        let stop = Arc::new(AtomicBool::new(false));
        let writer = keep_writing(pool.clone(), workload, ran, stop.clone());
        wait_until(
            "the first intents ship",
            Duration::from_secs(60),
            || async { folding.totals().applied >= 400 },
        )
        .await;

        tracing::info!("test: the broker stops");
        tokio::task::block_in_place(|| node.stop_app());
        // The outage lasts 10 s while the host writes on.
        tokio::time::sleep(Duration::from_secs(10)).await;
        tokio::task::block_in_place(|| node.start_app());
        let (back, _) = oldest_pending(&pool).await;
        tracing::info!(%back, "test: the broker is back");
        // What the host had committed by then: each branch's head.
        let heads: Vec<(String, String, String, i64)> =
            sqlx::query_as("SELECT tenant_id, run_id, branch_id, head_lsn FROM relay_branch")
                .fetch_all(&pool)
                .await
                .unwrap();
        let waiting = |pool: PgPool| async move {
            sqlx::query_as::<_, (String, i64)>(
                "SELECT tenant_id, count(*) FROM relay_outbox WHERE created_at < $1
                  GROUP BY tenant_id ORDER BY 2 DESC",
            )
            .bind(back)
            .fetch_all(&pool)
            .await
            .unwrap()
        };
        let healed = holds_within(Duration::from_secs(5), || {
            let pool = pool.clone();
            async move { waiting(pool).await.is_empty() }
        })
        .await;
        let left = waiting(pool.clone()).await;
        let (now, _) = oldest_pending(&pool).await;
        println!(
            "healed: {healed}, {:?} after the broker's return",
            (now - back).to_std().unwrap_or_default()
        );
        stop.store(true, Ordering::Release);
        let expected = writer.await.unwrap();
        assert!(
            healed,
            "{} tenants still had intents committed before the broker's return {:?} after it: {left:?}",
            left.len(),
            (now - back).to_std().unwrap_or_default()
        );
        until_folded_exactly(&fold, &expected, "the fold has every live intent").await;
        // And the consumer had folded all of it within seconds of the return too.
        let mut last_applied = back;
        for (tenant, run, branch, head) in &heads {
            let applied: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
                "SELECT max(applied_at) FROM relay_fold_event
                  WHERE tenant_id = $1 AND run_id = $2 AND branch_id = $3 AND lsn <= $4",
            )
            .bind(tenant)
            .bind(run)
            .bind(branch)
            .bind(head)
            .fetch_one(fold.pool())
            .await
            .unwrap();
            last_applied = last_applied.max(applied.unwrap_or(back));
        }
        let folded_after = (last_applied - back).to_std().unwrap_or_default();
        // Each tenant's first fold after the return: when the consumer served it again (the
        // rest is the fold's own pace through the backlog).
        let first: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
            "SELECT max(first) FROM (SELECT min(applied_at) AS first FROM relay_fold_event
              WHERE applied_at >= $1 GROUP BY tenant_id) AS firsts",
        )
        .bind(back)
        .fetch_one(fold.pool())
        .await
        .unwrap();
        let served_after = first.map_or(Duration::ZERO, |first| {
            (first - back).to_std().unwrap_or_default()
        });
        println!(
            "folded: every tenant served again {served_after:?} and everything committed \
             before folded {folded_after:?} after the broker's return"
        );
        folding.stop().await;
        for relay in relays {
            relay.shutdown().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_broker_restart_with_several_relays_heals_every_tenant_within_seconds_classic() {
        restart_with_several_relays(Rabbit::V3_10, QueueType::Classic).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_broker_restart_with_several_relays_heals_every_tenant_within_seconds_quorum() {
        restart_with_several_relays(Rabbit::V3_10, QueueType::Quorum).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_broker_restart_with_several_relays_heals_every_tenant_within_seconds_classic_on_rabbitmq_4_0()
     {
        restart_with_several_relays(Rabbit::V4_0, QueueType::Classic).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_broker_restart_with_several_relays_heals_every_tenant_within_seconds_quorum_on_rabbitmq_4_0()
     {
        restart_with_several_relays(Rabbit::V4_0, QueueType::Quorum).await;
    }

    async fn append(pool: &PgPool, branch: &BranchKey, lsn: u64) {
        append_intent(pool, branch, lsn, format!("{branch}@{lsn}").as_bytes()).await;
    }

    /// Under a memory alarm the broker blocks the relay's connections (`connection.blocked`)
    /// and stops reading them; what was written stays in their sockets. The relay stops
    /// writing, says so (`BrokerHealth::blocked`), and never sends a batch again elsewhere
    /// while the connection it was written on could still deliver it: once the alarm clears,
    /// every intent and marker arrives exactly once, and each rewound branch's marker after
    /// every intent of it. Before, the relay timed blocked batches out and sent them (and the
    /// marker) again, and the first copies landed after the marker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blocked_broker_gets_each_message_once_and_every_marker_after_its_branch() {
        blocked_broker(Rabbit::V3_10).await;
    }

    /// The same on RabbitMQ 4.0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_blocked_broker_gets_each_message_once_and_every_marker_after_its_branch_on_rabbitmq_4_0()
     {
        blocked_broker(Rabbit::V4_0).await;
    }

    async fn blocked_broker(rabbit: Rabbit) {
        let node = tokio::task::block_in_place(|| PrivateNode::start_on(rabbit, "alarm"));
        let (pool, url) = fresh_database("brokeralarm").await;
        let topology = unique("alarm");
        let mut config = relay_on(&node, &url, &topology);
        // Every timeout of the relay short against the alarm held below.
        config.supervisor.drainer.batch_timeout = Duration::from_secs(2);
        let longest = config
            .amqp_confirm_timeout
            .max(config.supervisor.drainer.batch_timeout);
        let rabbit = config.rabbit_config().unwrap();
        let recorder = Recorder::start(&rabbit).await;
        let relay = Relay::start(config).await.unwrap();
        let health = relay.broker_health();

        let prefix = unique("al");
        let writer = IntentWriter::default();
        let mut branches = Vec::new();
        for index in 0..4 {
            let branch = write_first_intent(&pool, &format!("{prefix}-t{index}"), b"1").await;
            branches.push(branch);
        }
        wait_until(
            "the first intents arrive",
            Duration::from_secs(30),
            || async { recorder.deliveries().len() == branches.len() },
        )
        .await;

        tokio::task::block_in_place(|| node.memory_alarm(true));
        // The host writes on, then rewinds every branch at 3 (4..=6 abandoned, possibly read
        // by the relay already), then writes on the new branch.
        for branch in &branches {
            for lsn in 2..=6 {
                append(&pool, branch, lsn).await;
            }
        }
        wait_until(
            "the relay's connections are blocked",
            Duration::from_secs(30),
            || async { health.blocked() },
        )
        .await;
        let mut live = Vec::new();
        for branch in &branches {
            let rewound = writer
                .rewind(
                    &mut pool.acquire().await.unwrap(),
                    branch,
                    Lsn::new(3),
                    BranchId::new("fork").unwrap(),
                )
                .await
                .unwrap();
            for lsn in 4..=5 {
                append(&pool, &rewound.live, lsn).await;
            }
            live.push(rewound.live);
        }
        // Held past twice the longest of the relay's own timeouts (its confirm timeout and its
        // drainers' batch timeout, as configured above), counted from when the relay was seen
        // blocked: any of them that fired on a blocked connection would have had time to.
        tokio::time::sleep(2 * longest).await;
        assert!(health.blocked(), "still blocked while the alarm holds");
        assert!(
            tokio::task::block_in_place(|| node.alarmed()),
            "the alarm held"
        );
        tokio::task::block_in_place(|| node.memory_alarm(false));

        // Everything of live history arrives: each branch's marker and the new branches' 4, 5.
        let arrived = |deliveries: &[OutboxEvent]| {
            let markers = deliveries.iter().filter(|event| event.is_rewind()).count();
            let forked = deliveries
                .iter()
                .filter(|event| live.contains(&event.key.branch))
                .count();
            markers == branches.len() && forked == 2 * live.len()
        };
        wait_until("live history arrives", Duration::from_secs(60), || async {
            arrived(&recorder.deliveries())
        })
        .await;
        wait_until("the outbox is empty", Duration::from_secs(30), || async {
            pending(&Outbox::new(pool.clone())).await == 0
        })
        .await;
        assert!(!health.blocked(), "unblocked once the alarm cleared");
        let deliveries = recorder.deliveries();
        recorder.stop().await;
        relay.shutdown().await;

        // Exactly once at the broker: no batch was sent again while its first copy could land.
        let (extra, twice) = Recorder::duplicates(&deliveries);
        assert_eq!(extra, 0, "delivered more than once: {twice:?}");
        // Each marker after every intent of its branch (one queue per run, so this is the
        // broker's order).
        for branch in &branches {
            let of_branch: Vec<&OutboxEvent> = deliveries
                .iter()
                .filter(|event| &event.key.branch == branch)
                .collect();
            let marker = of_branch
                .iter()
                .position(|event| matches!(event.kind, EventKind::Rewind { .. }))
                .expect("a marker");
            assert_eq!(
                marker,
                of_branch.len() - 1,
                "{branch}: an intent after its marker"
            );
        }
        // And a consumer following WIRE.md gets exactly the live history from it.
        let mut model = FoldModel::new();
        for event in &deliveries {
            model.deliver(event).unwrap();
        }
        let mut got: BTreeMap<BranchKey, Vec<u64>> = BTreeMap::new();
        for (key, _) in model.projection() {
            got.entry(key.branch.clone())
                .or_default()
                .push(key.lsn.get());
        }
        for (branch, forked) in branches.iter().zip(&live) {
            assert_eq!(got[branch], [1, 2, 3], "{branch}");
            assert_eq!(got[forked], [4, 5], "{forked}");
        }
        assert_eq!(model.held_back(), 0);
    }

    /// The broker refuses a message larger than its `max_message_size` by closing the channel
    /// (PRECONDITION_FAILED). That refusal counts against the message's branch like a nack:
    /// the branch cools, then parks with reason `too_large`; the tenant's other runs and other
    /// tenants flow meanwhile; once the limit allows it, `release` ships it, in order, once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_too_large_for_the_broker_parks_its_branch_and_its_tenant_flows() {
        too_large(Rabbit::V3_10).await;
    }

    /// The same on RabbitMQ 4.0, whose limit is set where 4.0 reads it (`PrivateNode`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_too_large_for_the_broker_parks_its_branch_and_its_tenant_flows_on_rabbitmq_4_0()
     {
        too_large(Rabbit::V4_0).await;
    }

    async fn too_large(rabbit: Rabbit) {
        let node = tokio::task::block_in_place(|| PrivateNode::start_on(rabbit, "size"));
        // What docs/operations.md and `IntentWriter` say of the default.
        let default = tokio::task::block_in_place(|| node.default_max_message_size());
        let documented = match rabbit {
            Rabbit::V3_10 => 128 << 20,
            Rabbit::V4_0 => 16 << 20,
        };
        assert_eq!(default, documented, "{rabbit:?}'s default max_message_size");
        tokio::task::block_in_place(|| node.max_message_size(4096));
        let (pool, url) = fresh_database("brokersize").await;
        let topology = unique("size");
        let mut config = relay_on(&node, &url, &topology);
        config.supervisor.drainer.park_after_attempts = 3;
        config.supervisor.drainer.park_retry = Duration::from_secs(600);
        let rabbit_config = config.rabbit_config().unwrap();
        // The version the broker says, and the default the relay's version rules give it.
        let version = distribution::rabbit::server_version(&rabbit_config)
            .await
            .unwrap();
        assert_eq!(
            version.is_at_least(4, 0, 0),
            rabbit == Rabbit::V4_0,
            "{version}"
        );
        assert_eq!(version.default_max_message_size(), Some(documented));
        let rabbit = rabbit_config;
        let relay = Relay::start(config).await.unwrap();
        let fold = FoldStore::new(fresh_database("brokersizefold").await.0);
        let folding = Folding::start(rabbit.clone(), &fold);

        let prefix = unique("sz");
        let tenant = format!("{prefix}-t");
        let big = write_first_intent(&pool, &tenant, b"small").await;
        append_intent(&pool, &big, 2, &vec![7u8; 8192]).await;
        append_intent(&pool, &big, 3, b"after the big one").await;
        // Its first intent is live history and small: it folds.
        let mut expected = Expected::new();
        expected.insert(big.clone(), vec![(Lsn::new(1), b"small".to_vec())]);
        let mut others = Vec::new();
        let writer = IntentWriter::default();
        for run in ["r2", "r3"] {
            let branch = BranchKey::new(
                big.tenant.clone(),
                RunId::new(run).unwrap(),
                BranchId::new("b").unwrap(),
            );
            let mut tx = pool.begin().await.unwrap();
            writer.open_run(&mut tx, &branch).await.unwrap();
            tx.commit().await.unwrap();
            others.push(branch);
        }
        others.push(write_first_intent(&pool, &format!("{prefix}-other"), b"1").await);
        for branch in &others {
            let first = if branch.tenant == big.tenant { 1 } else { 2 };
            if first == 2 {
                expected.insert(branch.clone(), vec![(Lsn::new(1), b"1".to_vec())]);
            }
            for lsn in first..=20 {
                let payload = format!("{branch}@{lsn}").into_bytes();
                append_intent(&pool, branch, lsn, &payload).await;
                expected
                    .entry(branch.clone())
                    .or_default()
                    .push((Lsn::new(lsn), payload));
            }
        }
        // The other runs of the tenant and the other tenant fold in full while the big one
        // cools and parks.
        wait_until(
            "the other branches fold",
            Duration::from_secs(30),
            || async { folded_count(&fold, &expected).await == count(&expected) },
        )
        .await;
        let outbox = Outbox::new(pool.clone());
        wait_until(
            "the branch parks as too_large",
            Duration::from_secs(60),
            || async {
                outbox
                    .parked_branches()
                    .await
                    .unwrap()
                    .iter()
                    .any(|parked| parked.branch == big && parked.reason == "too_large")
            },
        )
        .await;
        let parked = outbox.parked_branches().await.unwrap();
        assert_eq!(parked.len(), 1, "only the big branch parks: {parked:?}");
        // Its big intent and the one after it wait; so does the one before it when the
        // channel closed before that one's confirm came (it is sent again: at least once).
        assert!(
            (2..=3).contains(&parked[0].pending),
            "{} of its intents wait",
            parked[0].pending
        );

        // The operator raises the limit and releases the branch: it ships, in order, once.
        tokio::task::block_in_place(|| node.max_message_size(1 << 20));
        assert_eq!(
            outbox
                .release(&big.tenant, Some(&big.run), None)
                .await
                .unwrap(),
            1
        );
        expected.get_mut(&big).unwrap().extend([
            (Lsn::new(2), vec![7u8; 8192]),
            (Lsn::new(3), b"after the big one".to_vec()),
        ]);
        until_folded_exactly(&fold, &expected, "the released branch folds").await;
        folding.stop().await;
        relay.shutdown().await;
    }
}

/// A test's scratch topology is deleted at its process's exit from the broker `AMQP_URL` names,
/// also when that is not this machine's node (a bare `rabbitmqctl` lists this machine's).
mod scratch {
    use crate::node::PrivateNode;

    /// Run only as the child of the test below, with `AMQP_URL` naming a private node:
    /// declares a scratch topology with a message in a queue, prints its name and fails.
    #[tokio::test]
    #[ignore = "the child of a_scratch_topology_is_deleted_from_the_broker_amqp_url_names"]
    async fn child_declares_a_topology_on_a_private_node_and_fails() {
        if std::env::var_os("SCRATCH_CHILD").is_none() {
            return;
        }
        let url = std::env::var("AMQP_URL").unwrap();
        let name = distribution::rabbit::scratch::leave_a_topology(&url, "relay-test-away")
            .await
            .unwrap();
        println!("SCRATCH={name}");
        panic!("this test fails on purpose");
    }

    #[test]
    fn a_scratch_topology_is_deleted_from_the_broker_amqp_url_names() {
        let node = PrivateNode::start("scratch");
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "broker_faults::scratch::child_declares_a_topology_on_a_private_node_and_fails",
                "--nocapture",
            ])
            .env("SCRATCH_CHILD", "1")
            .env("AMQP_URL", node.url())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(!output.status.success(), "the child failed: {stdout}");
        let name = stdout
            .lines()
            .find_map(|line| line.strip_prefix("SCRATCH="))
            .unwrap_or_else(|| panic!("the child named its topology: {stdout}"))
            .to_owned();
        // Not vacuous: the node is not the one a bare `rabbitmqctl` reaches.
        assert!(node.url() != std::env::var("AMQP_URL").unwrap());
        let queues = node.ctl(&["list_queues", "name", "--quiet", "--no-table-headers"]);
        let exchanges = node.ctl(&["list_exchanges", "name", "--quiet", "--no-table-headers"]);
        let left: Vec<&str> = queues
            .lines()
            .chain(exchanges.lines())
            .filter(|line| line.trim().starts_with(&name))
            .collect();
        assert!(left.is_empty(), "left on the private node: {left:?}");
    }
}

/// The console's look at the broker (`rabbit::checkup`), on a private node: up with its version
/// while it serves; blocked, with the broker's reason, while a memory alarm holds (a client can
/// only learn that by publishing); up again once the alarm clears; an error when the broker
/// application is stopped.
mod checkup {
    use std::time::Duration;

    use distribution::rabbit::{self, RabbitConfig};

    use crate::harness::*;
    use crate::node::{PrivateNode, Rabbit};

    async fn sees_an_alarm(rabbit: Rabbit, version: &str) {
        let node = tokio::task::block_in_place(|| PrivateNode::start_on(rabbit, "checkup"));
        let mut config: RabbitConfig = relay_config("postgres://unused", &node.url(), "checkup")
            .rabbit_config()
            .unwrap();
        config.connect_timeout = Duration::from_secs(2);
        let look = || rabbit::checkup(&config, Duration::from_secs(5));

        let up = look().await.unwrap();
        assert_eq!(up.blocked, None, "{up:?}");
        assert!(up.version.version.starts_with(version), "{up:?}");

        tokio::task::block_in_place(|| node.memory_alarm(true));
        wait_until(
            "the node raises its alarm",
            Duration::from_secs(30),
            || async { tokio::task::block_in_place(|| node.alarmed()) },
        )
        .await;
        let blocked = look().await.unwrap();
        assert!(
            blocked
                .blocked
                .as_deref()
                .is_some_and(|reason| reason.contains("memory")),
            "{blocked:?}"
        );

        tokio::task::block_in_place(|| node.memory_alarm(false));
        wait_until(
            "the checkup sees the broker up again",
            Duration::from_secs(30),
            || async { look().await.is_ok_and(|checkup| checkup.blocked.is_none()) },
        )
        .await;

        tokio::task::block_in_place(|| node.stop_app());
        assert!(look().await.is_err(), "a stopped broker is no checkup");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_checkup_sees_a_memory_alarm() {
        sees_an_alarm(Rabbit::V3_10, "3.10").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_checkup_sees_a_memory_alarm_on_rabbitmq_4_0() {
        sees_an_alarm(Rabbit::V4_0, "4.0").await;
    }
}

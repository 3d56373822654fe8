//! Failed work, read back and replayed: a consumer whose handler refuses some events for good
//! dead-letters them (their branches wait behind them at the fold); `distribution dead list`
//! shows them with their reasons and removes nothing; once the handler is fixed, a replay of one
//! tenant's dead letters sends them back through the fold's rules, and that tenant's projection
//! becomes exactly its live history, the dead letters applied in the order they were
//! dead-lettered; the other tenant's dead letter stays until it is purged.
use std::time::Duration;

use distribution::Relay;
use distribution::rabbit::{DeadFilter, DeadLetters};
use futures_util::FutureExt;
use store::{BranchId, BranchKey, FoldStore, IntentWriter, Lsn, RunId, TenantId};

use crate::harness::{
    Expected, PickyConsumer, amqp_url, assert_folded_exactly, declare_topology,
    declare_topology_at, drop_topology, drop_topology_at, fresh_database, relay_config, unique,
    wait_until,
};
use crate::node::{PrivateNode, Rabbit};

fn run_of(tenant: &str, run: &str) -> BranchKey {
    BranchKey::new(
        TenantId::new(tenant).unwrap(),
        RunId::new(run).unwrap(),
        BranchId::new("main").unwrap(),
    )
}

/// The order in which the fold applied `keys` (by `relay_fold_event.applied_seq`).
async fn applied_order(pool: &sqlx::PgPool, keys: &[String]) -> Vec<String> {
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT tenant_id, run_id, lsn FROM relay_fold_event
          WHERE tenant_id || '/' || run_id || '/' || branch_id || '/' || lsn = ANY($1)
          ORDER BY applied_seq",
    )
    .bind(keys)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(tenant, run, lsn)| format!("{tenant}/{run}/main/{lsn}"))
        .collect()
}

/// Writes lsn 1..=6 on `branch`, poisoned at `poison`; returns the live history.
async fn write(pool: &sqlx::PgPool, branch: &BranchKey, poison: &[u64]) -> Expected {
    let writer = IntentWriter::default();
    let mut conn = pool.acquire().await.unwrap();
    writer.open_run(&mut conn, branch).await.unwrap();
    let mut expected = Expected::new();
    for lsn in 1..=6 {
        let body = if poison.contains(&lsn) {
            format!("poison {lsn}")
        } else {
            format!("fine {lsn}")
        };
        writer
            .append(&mut conn, branch, Lsn::new(lsn), body.as_bytes())
            .await
            .unwrap();
        expected
            .entry(branch.clone())
            .or_default()
            .push((Lsn::new(lsn), body.into_bytes()));
    }
    expected
}

fn cli() -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_distribution"));
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("RELAY_") || name == "AMQP_URL" {
            command.env_remove(name.as_ref());
        }
    }
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_are_listed_replayed_in_order_through_the_fold_and_purged() {
    let (pool, url) = fresh_database("dead").await;
    let topology = unique("dead");
    let config = relay_config(&url, &amqp_url(), &topology);
    let rabbit = config.rabbit_config().unwrap();

    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology(&rabbit.topology).await;
        let relay = Relay::start(config.clone()).await.unwrap();
        let consumer = PickyConsumer::start(&rabbit, &pool);

        // Tenant a: two runs on one partition (so one consumer sees both, in queue order).
        let a = run_of("dead-a", "r");
        let partition = rabbit.topology.partition_of(&a.tenant, &a.run);
        let a2 = (0..)
            .map(|n| run_of("dead-a", &format!("s{n}")))
            .find(|key| rabbit.topology.partition_of(&key.tenant, &key.run) == partition)
            .unwrap();
        let b = run_of("dead-b", "r");
        let mut expected_a = write(&pool, &a, &[2, 4]).await;
        let more = write(&pool, &a2, &[2]).await;
        expected_a.extend(more);
        write(&pool, &b, &[3]).await;
        let dead = DeadLetters::open(&rabbit).await.unwrap();
        wait_until("three dead letters", Duration::from_secs(30), || async {
            dead.depth().await.unwrap() == 3 && consumer.progress.totals().rejected == 3
        })
        .await;
        // The branches wait behind their dead letters (a@4, poisoned too, is held behind a@2,
        // not refused): a@1, a2@1 and b@1..2 only.
        let fold = FoldStore::new(pool.clone());
        assert_eq!(fold.folded(&a.tenant).await.unwrap().len(), 2);
        assert_eq!(fold.folded(&b.tenant).await.unwrap().len(), 2);

        // `dead list`: in order, with the reason; listing removes nothing.
        let listed = cli()
            .args(["dead", "list", "--topology", &topology, "--partitions", "4"])
            .env("AMQP_URL", amqp_url())
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&listed.stdout).into_owned();
        assert!(
            listed.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&listed.stderr)
        );
        assert!(
            stdout.starts_with(&format!("3 dead letter(s) in {topology}.dead")),
            "{stdout}"
        );
        let ids: Vec<&str> = stdout
            .lines()
            .skip(1)
            .filter_map(|line| line.split_whitespace().nth(1))
            .collect();
        let a2_id = format!("dead-a/{}/main/2", a2.run);
        let mut sorted = ids.clone();
        sorted.sort();
        let mut want = vec!["dead-a/r/main/2", a2_id.as_str(), "dead-b/r/main/3"];
        want.sort();
        assert_eq!(sorted, want, "{stdout}");
        assert!(stdout.contains("handler: poison"), "{stdout}");
        // `dead show`: one letter whole, its body included; nothing is removed either.
        let shown = cli()
            .args(["dead", "show", "dead-b/r/main/3", "--topology", &topology])
            .env("AMQP_URL", amqp_url())
            .output()
            .await
            .unwrap();
        let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
        assert!(
            shown.contains("body (8 bytes, UTF-8):\npoison 3"),
            "{shown}"
        );
        assert!(shown.contains("reason: handler: poison"), "{shown}");
        // When it was written, readable (the header carries microseconds).
        let written = shown
            .lines()
            .find_map(|line| line.strip_prefix("written at: "))
            .unwrap_or_else(|| panic!("no written at: {shown}"));
        assert!(
            chrono::DateTime::parse_from_rfc3339(written).is_ok(),
            "{written}"
        );
        assert_eq!(dead.depth().await.unwrap(), 3);
        // The order tenant a's two were dead-lettered in (the order the consumer met them).
        let dead_order: Vec<String> = ids
            .iter()
            .filter(|id| id.starts_with("dead-a/"))
            .map(|id| id.to_string())
            .collect();

        // The handler is fixed; tenant a's dead letter goes back through the fold, which
        // applies it and releases what waited behind it (a@4 too, now accepted), in order.
        consumer.fixed();
        let tenant_a = DeadFilter::Tenant(a.tenant.clone(), None);
        assert_eq!(dead.replay(&tenant_a).await.unwrap(), 2);
        let fold_ref = &fold;
        wait_until(
            "tenant a's live history",
            Duration::from_secs(30),
            || async { fold_ref.folded(&a.tenant).await.unwrap().len() == 12 },
        )
        .await;
        assert_folded_exactly(&fold, &expected_a).await;
        // Replayed in their original order: the fold applied them in the order they died in.
        assert_eq!(applied_order(&pool, &dead_order).await, dead_order);
        // Tenant b's dead letter stayed; purged by message id, the queue is empty.
        let left = dead.list(10).await.unwrap();
        let left: Vec<String> = left.into_iter().filter_map(|l| l.message_id).collect();
        assert_eq!(left, ["dead-b/r/main/3"]);
        assert_eq!(
            dead.purge(&DeadFilter::MessageId("dead-b/r/main/3".into()))
                .await
                .unwrap(),
            1
        );
        assert_eq!(dead.depth().await.unwrap(), 0);

        consumer.stop().await;
        relay.shutdown().await;
    })
    .catch_unwind()
    .await;
    drop_topology(&rabbit.topology).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// The dead-letter queue is where failed work waits for a person, so no reading of it may lose
/// a letter: on a quorum topology, one letter is listed, shown, and passed over by a replay and
/// a purge whose filter does not take it, 100 times each (every pass takes it and gives it
/// back, which RabbitMQ 4 counts as a delivery), and `distribution dead list` still shows it.
/// On RabbitMQ 4.0 a dead-letter queue declared without `x-delivery-limit` dropped it after its
/// 20th read.
async fn a_dead_letter_survives_every_read(url: &str) {
    let topology = unique("deadreads");
    let mut config = relay_config("postgres://unused", url, &topology);
    config.queue_type = distribution::rabbit::QueueType::Quorum;
    let rabbit = config.rabbit_config().unwrap();
    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology_at(url, &rabbit.topology).await;
        let branch = run_of("deadreads", "r");
        let letter = testkit::intent(&branch, 1)
            .payload("waits for a person")
            .build();
        let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await
            .unwrap();
        let confirm = channel
            .basic_publish(
                "".into(),
                rabbit.topology.dead_letter_queue(),
                lapin::options::BasicPublishOptions::default(),
                &letter.payload,
                distribution::rabbit::encode(&letter, distribution::broker::WireMode::Plain),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "{confirm:?}");
        let id = format!("{branch}/1");

        let dead = DeadLetters::open(&rabbit).await.unwrap();
        let elsewhere = DeadFilter::Tenant(TenantId::new("someone-else").unwrap(), None);
        for round in 1..=100 {
            let listed = dead.list(10).await.unwrap();
            let ids: Vec<_> = listed.iter().filter_map(|l| l.message_id.clone()).collect();
            assert_eq!(ids, std::slice::from_ref(&id), "listed, round {round}");
            assert!(
                dead.find(&id).await.unwrap().is_some(),
                "shown, round {round}"
            );
            assert_eq!(dead.replay(&elsewhere).await.unwrap(), 0, "round {round}");
            assert_eq!(dead.purge(&elsewhere).await.unwrap(), 0, "round {round}");
        }
        assert_eq!(dead.depth().await.unwrap(), 1);
        let listed = cli()
            .args(["dead", "list", "--topology", &topology, "--partitions", "4"])
            .args(["--queue-type", "quorum"])
            .env("AMQP_URL", url)
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&listed.stdout).into_owned();
        assert!(
            listed.status.success() && stdout.contains(&id),
            "{stdout}{}",
            String::from_utf8_lossy(&listed.stderr)
        );
    })
    .catch_unwind()
    .await;
    drop_topology_at(url, &rabbit.topology).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_survives_every_read_on_rabbitmq_4_0() {
    let node = tokio::task::block_in_place(|| PrivateNode::start_on(Rabbit::V4_0, "deadreads"));
    a_dead_letter_survives_every_read(&node.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_survives_every_read_on_rabbitmq_3_10() {
    a_dead_letter_survives_every_read(&amqp_url()).await;
}

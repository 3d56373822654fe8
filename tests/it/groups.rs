//! Consumer groups and metadata on the real PostgreSQL and RabbitMQ: three services read one
//! history, each from its own queues into its own database. Two fold everything; the third
//! subscribes to one event type. Through rewinds, typed and untyped intents, and a relay
//! restart, each ends with exactly its share of the live history, once. A handler gets every
//! metadata field the host set. Deleting one group's queues never stops the others.
use std::collections::BTreeSet;
use std::time::Duration;

use distribution::Relay;
use distribution::broker::{Group, Partition};
use distribution::consumer::{Consumer, ConsumerConfig};
use distribution::rabbit::Topology;
use distribution::store::{
    self, BranchKey, EventType, FoldStore, Intent, IntentWriter, Lsn, Metadata, Outbox,
    OutboxEvent, Projection, RewindNotice,
};
use futures_util::FutureExt;
use sqlx::{PgConnection, PgPool};

use crate::harness::{
    Expected, Folding, Workload, amqp_url, assert_folded_exactly, count, declare_topology,
    drop_topology, fold_database, folded_count, fresh_database, merge, pending, relay_config,
    unique, until_stopped, wait_until,
};

/// Keeps every applied event with its metadata; undoes above a rewind's fork.
#[derive(Clone, Copy, Debug, Default)]
struct WithMetadata;

impl Projection for WithMetadata {
    type Error = sqlx::Error;

    async fn apply(
        &mut self,
        tx: &mut PgConnection,
        event: &OutboxEvent,
    ) -> Result<(), sqlx::Error> {
        let key = &event.key.branch;
        sqlx::query(
            "INSERT INTO seen (tenant, run, branch, lsn, payload, meta) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(event.key.lsn.get() as i64)
        .bind(&event.payload)
        .bind(sqlx::types::Json(&event.meta))
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &RewindNotice,
    ) -> Result<(), sqlx::Error> {
        let key = &rewind.branch;
        sqlx::query("DELETE FROM seen WHERE tenant = $1 AND run = $2 AND branch = $3 AND lsn > $4")
            .bind(key.tenant.as_str())
            .bind(key.run.as_str())
            .bind(key.branch.as_str())
            .bind(rewind.fork.get() as i64)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

type Seen = Vec<(BranchKey, u64, Vec<u8>, Metadata)>;
type SeenRow = (
    String,
    String,
    String,
    i64,
    Vec<u8>,
    sqlx::types::Json<Metadata>,
);

async fn seen(pool: &PgPool) -> Seen {
    let rows: Vec<SeenRow> =
        sqlx::query_as("SELECT tenant, run, branch, lsn, payload, meta FROM seen")
            .fetch_all(pool)
            .await
            .unwrap();
    let mut seen: Seen = rows
        .into_iter()
        .map(|(tenant, run, branch, lsn, payload, meta)| {
            let key = BranchKey::new(
                store::TenantId::new(tenant).unwrap(),
                store::RunId::new(run).unwrap(),
                store::BranchId::new(branch).unwrap(),
            );
            (key, lsn as u64, payload, meta.0)
        })
        .collect();
    seen.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    seen
}

/// The metadata of typed step `step` on `branch`: every field, so the handler's copy shows
/// that each one travelled.
fn metadata_of(branch: &BranchKey, step: u64) -> Metadata {
    let kind = if step.is_multiple_of(2) {
        "order.paid"
    } else {
        "order.placed"
    };
    Intent::new(b"")
        .event_type(EventType::new(kind).unwrap())
        .content_type("application/json")
        .correlation_id(format!("req-{}-{step}", branch.run))
        .causation_id(format!("cmd-{step}"))
        .header("step", step.to_string())
        .header("region", "eu-west-1")
        .trace(
            format!("00-{:032x}-{:016x}-01", 0xabc0_0000 + step, 0xdef0 + step),
            Some("vendor=value".into()),
        )
        .metadata()
        .clone()
}

/// Writes `steps` typed steps on each live branch; returns the expected events.
async fn typed_steps(
    pool: &PgPool,
    live: &mut [(BranchKey, u64)],
    steps: std::ops::RangeInclusive<u64>,
) -> Vec<(BranchKey, u64, Vec<u8>, Metadata)> {
    let writer = IntentWriter::default();
    let mut written = Vec::new();
    for step in steps {
        for (branch, head) in live.iter_mut() {
            *head += 1;
            let payload = format!(r#"{{"branch":"{branch}","step":{step}}}"#).into_bytes();
            let meta = metadata_of(branch, step);
            let mut tx = pool.begin().await.unwrap();
            writer
                .append_intent(
                    &mut tx,
                    branch,
                    Lsn::new(*head),
                    Intent::new(&payload).with_metadata(meta.clone()),
                )
                .await
                .unwrap();
            tx.commit().await.unwrap();
            written.push((branch.clone(), *head, payload, meta));
        }
    }
    written
}

async fn group_database(label: &str) -> PgPool {
    let (pool, _) = fold_database(label).await;
    sqlx::raw_sql(
        "CREATE TABLE seen (tenant text, run text, branch text, lsn bigint, payload bytea, meta jsonb,
                            PRIMARY KEY (tenant, run, branch, lsn))",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool
}

fn as_expected(events: &[(BranchKey, u64, Vec<u8>, Metadata)]) -> Expected {
    let mut expected = Expected::new();
    for (branch, lsn, payload, _) in events {
        expected
            .entry(branch.clone())
            .or_default()
            .push((Lsn::new(*lsn), payload.clone()));
    }
    expected
}

/// Two groups fold the whole history (untyped intents with rewinds, then typed ones across a
/// relay restart) exactly once each, in their own databases; a third group subscribed to
/// `order.paid` holds exactly the live `order.paid` events, each with every metadata field the
/// host set. Then one group's queues are deleted: the relay and the other groups go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn groups_each_fold_their_share_of_one_history_exactly_once() {
    let (pool, url) = fresh_database("groups").await;
    let name = unique("relay-groups");
    let [projection, search, billing] =
        ["projection", "search", "billing"].map(|group| Group::parse(group).unwrap());
    let mut config = relay_config(&url, &amqp_url(), &name);
    config.groups = vec![projection.clone(), search.clone(), billing.clone()];
    let base = config.rabbit_config().unwrap();
    let topology_of = |group: &Group| base.topology.clone().with_group(group.clone());
    let topologies: Vec<Topology> = config.groups.iter().map(topology_of).collect();
    let outcome = std::panic::AssertUnwindSafe(async {
        // The relay declares the groups' queues; so do their consumers. Declared here first,
        // so what the workload writes before either runs has somewhere to go.
        for topology in &topologies {
            declare_topology(topology).await;
        }
        let folds: Vec<FoldStore> = [
            fold_database("groupsproj").await.0,
            fold_database("groupssearch").await.0,
        ]
        .into_iter()
        .map(FoldStore::new)
        .collect();
        let billing_db = group_database("groupsbilling").await;
        let rabbit_of = |group: &Group| {
            let mut rabbit = base.clone();
            rabbit.topology = topology_of(group);
            rabbit
        };
        let mut folding: Vec<Folding> = vec![
            Folding::start(rabbit_of(&projection), &folds[0]),
            Folding::start(rabbit_of(&search), &folds[1]),
        ];
        let mut billing_config = ConsumerConfig::new(rabbit_of(&billing));
        billing_config.event_types = Some(BTreeSet::from([EventType::new("order.paid").unwrap()]));
        let billing_consumer = Consumer::new(billing_config, billing_db.clone(), WithMetadata);
        let billing_consumer = until_stopped(|stopped| billing_consumer.run(stopped));

        // Untyped history with rewinds, written while no relay runs (so the rewinds abandon).
        let mut workload = Workload::new("grp", 3, 2, 12);
        workload.rewind = true;
        let ran = workload.run(&pool).await;
        let mut everything = ran.expected.clone();
        let mut live = ran.live.clone();
        let mut typed = typed_steps(&pool, &mut live, 1..=4).await;
        let relay = Relay::start(config.clone()).await.unwrap();
        // More typed steps while the relay runs, then a relay restart in the middle of them.
        typed.extend(typed_steps(&pool, &mut live, 5..=8).await);
        relay.shutdown().await;
        typed.extend(typed_steps(&pool, &mut live, 9..=12).await);
        let relay = Relay::start(config.clone()).await.unwrap();
        merge(&mut everything, &as_expected(&typed));

        let outbox = Outbox::new(pool.clone());
        wait_until("relay drained", Duration::from_secs(60), || async {
            pending(&outbox).await == 0
        })
        .await;
        for fold in &folds {
            wait_until(
                "a whole-history group folded everything",
                Duration::from_secs(60),
                || async { folded_count(fold, &everything).await == count(&everything) },
            )
            .await;
            assert_folded_exactly(fold, &everything).await;
        }
        let paid: Seen = typed
            .iter()
            .filter(|(_, _, _, meta)| {
                meta.event_type.as_ref().map(EventType::as_str) == Some("order.paid")
            })
            .cloned()
            .collect();
        assert_eq!(paid.len(), 6 * 6, "half of 12 typed steps on 6 runs");
        let mut paid_sorted = paid.clone();
        paid_sorted.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        wait_until(
            "the billing group folded its type",
            Duration::from_secs(60),
            || async { seen(&billing_db).await.len() >= paid_sorted.len() },
        )
        .await;
        // Exactly the live order.paid events, each with every field the host set.
        let got = seen(&billing_db).await;
        let first_difference = got.iter().zip(&paid_sorted).position(|(a, b)| a != b);
        assert!(
            got == paid_sorted,
            "billing holds {} events, want {}; first difference at {first_difference:?}: {:?}",
            got.len(),
            paid_sorted.len(),
            first_difference.map(|i| (&got[i].0, got[i].1, &got[i].3, &paid_sorted[i].3)),
        );
        let parked: i64 = sqlx::query_scalar("SELECT count(*) FROM relay_fold_parked")
            .fetch_one(&billing_db)
            .await
            .unwrap();
        assert_eq!(
            parked, 0,
            "skipped types advance the chain: nothing waits behind them"
        );

        // The search service is retired: its queues go, with what they hold.
        folding.pop().unwrap().stop().await;
        let connection =
            lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                .await
                .unwrap();
        base.topology
            .delete_group(&connection.create_channel().await.unwrap(), &search)
            .await
            .unwrap();
        let more = typed_steps(&pool, &mut live, 13..=16).await;
        merge(&mut everything, &as_expected(&more));
        wait_until(
            "relay drained after a group was deleted",
            Duration::from_secs(30),
            || async { pending(&outbox).await == 0 },
        )
        .await;
        wait_until(
            "the projection group folded the rest",
            Duration::from_secs(60),
            || async { folded_count(&folds[0], &everything).await == count(&everything) },
        )
        .await;
        assert_folded_exactly(&folds[0], &everything).await;
        let parked_branches = outbox.parked_branches().await.unwrap();
        assert!(
            parked_branches.is_empty(),
            "no branch parked: {parked_branches:?}"
        );
        let deleted = connection
            .create_channel()
            .await
            .unwrap()
            .queue_declare(
                search_queue(&base.topology, &search),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await;
        assert!(deleted.is_err(), "the deleted group's queues stay deleted");

        relay.shutdown().await;
        for folding in folding {
            folding.stop().await;
        }
        billing_consumer.stop().await.unwrap();
    })
    .catch_unwind()
    .await;
    for topology in &topologies {
        drop_topology(topology).await;
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

fn search_queue(topology: &Topology, group: &Group) -> lapin::types::ShortString {
    topology.queue_of(group, Partition(0))
}

/// `distribution group create` declares a group's queues bound to the exchange (a message
/// routed to `p2` lands in the group's `p2`), `group delete` removes them with what they
/// hold, and a bad group name is refused with a line that says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_commands_create_and_delete_a_groups_queues() {
    let name = unique("relay-groupcli");
    let topology = Topology::new(&name, 4).unwrap();
    let search = Group::parse("search").unwrap();
    let cli = |args: &[&str]| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_distribution"));
        command
            .args(args)
            .args(["--topology", &name, "--partitions", "4"])
            .env("AMQP_URL", amqp_url())
            .env_remove("RELAY_GROUP")
            .stdin(std::process::Stdio::null());
        command
    };
    let outcome = std::panic::AssertUnwindSafe(async {
        let created = cli(&["group", "create", "search"]).output().await.unwrap();
        assert!(created.status.success(), "{created:?}");
        let connection =
            lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let channel = connection.create_channel().await.unwrap();
        channel
            .basic_publish(
                topology.exchange().clone(),
                topology.routing_key(Partition(2)),
                lapin::options::BasicPublishOptions::default(),
                b"routed",
                lapin::BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let depth = |queue: lapin::types::ShortString| {
            let connection = &connection;
            async move {
                let channel = connection.create_channel().await.unwrap();
                channel
                    .queue_declare(queue, passive, Default::default())
                    .await
                    .map(|queue| queue.message_count())
            }
        };
        wait_until(
            "the message routed into the group's p2",
            Duration::from_secs(10),
            || async { depth(topology.queue_of(&search, Partition(2))).await.ok() == Some(1) },
        )
        .await;
        assert_eq!(
            depth(topology.dead_letter_queue_of(&search)).await.ok(),
            Some(0)
        );

        // A dead letter of the search group: what a relay published, as the consumer dead-lettered it.
        let letter = testkit::intent(&testkit::branch("t", "r", "main"), 1)
            .payload("dead")
            .build();
        let partition = topology.partition_of(&letter.key.branch.tenant, &letter.key.branch.run);
        channel
            .basic_publish(
                "".into(),
                topology.dead_letter_queue_of(&search),
                lapin::options::BasicPublishOptions::default(),
                &letter.payload,
                distribution::rabbit::encode(&letter, distribution::broker::WireMode::Plain),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        // `status` counts each group's dead letters (RELAY_GROUPS, as the relay reads it).
        let (_pool, url) = fresh_database("groupstatus").await;
        let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_distribution"))
            .args(["status", "--topology", &name])
            .env("AMQP_URL", amqp_url())
            .env("DATABASE_URL", &url)
            .env("RELAY_GROUPS", "default,search")
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&status.stdout).into_owned();
        assert!(status.status.success(), "{status:?}");
        assert!(
            stdout.contains(&format!("{name}.dead does not exist")),
            "the unnamed group was never declared: {stdout}"
        );
        assert!(
            stdout.contains(&format!(
                "1 dead letter(s) in {name}.search.dead: `distribution dead list --group search`"
            )),
            "{stdout}"
        );
        // Asked about dead letters and unable to tell (the broker refuses the password):
        // said on stdout, and the exit code is a failure, never "0, unknown".
        let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_distribution"))
            .args(["status", "--topology", &name])
            .env(
                "AMQP_URL",
                amqp_url().replacen("guest:guest@", "guest:wrong@", 1),
            )
            .env("DATABASE_URL", &url)
            .env("RELAY_GROUPS", "search")
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&refused.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
        assert_eq!(refused.status.code(), Some(1), "{stdout}{stderr}");
        assert!(stdout.contains("dead letters in"), "{stdout}");
        assert!(stdout.contains(": unknown ("), "{stdout}");
        assert!(
            stderr.contains(&format!("could not read the depth of {name}.search.dead")),
            "{stderr}"
        );

        // Replaying the search group's dead letters puts them back into its own partition
        // queue only: another group, which folded the message already, gets no second copy.
        let other = Group::parse("other").unwrap();
        let created = cli(&["group", "create", "other"]).output().await.unwrap();
        assert!(created.status.success(), "{created:?}");
        let before = depth(topology.queue_of(&search, partition)).await.unwrap();
        let replayed = cli(&["dead", "replay", "--all", "--group", "search"])
            .output()
            .await
            .unwrap();
        assert!(replayed.status.success(), "{replayed:?}");
        wait_until(
            "the replayed letter in search's queue",
            Duration::from_secs(10),
            || async {
                depth(topology.queue_of(&search, partition)).await.ok() == Some(before + 1)
            },
        )
        .await;
        assert_eq!(
            depth(topology.dead_letter_queue_of(&search)).await.ok(),
            Some(0)
        );
        assert_eq!(
            depth(topology.queue_of(&other, partition)).await.ok(),
            Some(0)
        );

        let deleted = cli(&["group", "delete", "search"]).output().await.unwrap();
        assert!(deleted.status.success(), "{deleted:?}");
        assert!(
            String::from_utf8_lossy(&deleted.stdout).contains("2 messages"),
            "{deleted:?}"
        );
        for index in 0..4 {
            assert!(
                depth(topology.queue_of(&search, Partition(index)))
                    .await
                    .is_err()
            );
        }

        let refused = cli(&["group", "create", "Search!"]).output().await.unwrap();
        assert!(!refused.status.success());
        assert!(
            String::from_utf8_lossy(&refused.stderr).contains("consumer group \"Search!\""),
            "{refused:?}"
        );
    })
    .catch_unwind()
    .await;
    drop_topology(&topology.clone().with_group(search)).await;
    drop_topology(&topology.clone().with_group(Group::parse("other").unwrap())).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

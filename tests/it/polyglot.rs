//! Hosts and consumers in other languages, through the SQL API alone: the TypeScript host of
//! `examples/typescript-host` (node and `pg`) writes its state and its intents in one
//! transaction, with a rewind, by calling `relay_open_run`/`relay_append`/`relay_rewind`; the
//! Python consumers of `examples/python-consumer` (pika or nats-py, and psycopg) project into
//! their own table through `relay_fold_batch`, from RabbitMQ or from NATS JetStream. Under a relay restart (with intents written while no relay ran), a
//! consumer crash between its write and its commit, and the redelivery that follows, its table
//! equals the live history, each run in its order. `.ci/run` installs what the examples need;
//! the test installs it too when it is missing.
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use distribution::Relay;
use futures_util::FutureExt;
use sqlx::PgPool;
use tokio::process::{Child, Command};

use crate::harness::{
    amqp_url, declare_topology, drop_topology, fold_database, fresh_database, relay_config, unique,
    wait_until,
};

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(name)
}

async fn succeeds(command: &mut Command, what: &str) -> String {
    let output = command
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap_or_else(|err| panic!("{what}: cannot run: {err}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// `examples/typescript-host` built (`npm ci` when its packages are missing, then `tsc`).
async fn typescript_host() -> PathBuf {
    let dir = example("typescript-host");
    if !dir.join("node_modules").exists() {
        succeeds(
            Command::new("npm")
                .args(["ci", "--no-audit", "--no-fund"])
                .current_dir(&dir),
            "npm ci in examples/typescript-host",
        )
        .await;
    }
    succeeds(
        Command::new("node")
            .arg("node_modules/typescript/bin/tsc")
            .current_dir(&dir),
        "tsc in examples/typescript-host",
    )
    .await;
    dir.join("dist").join("host.js")
}

/// `examples/python-consumer/consumer.py`, its packages installed when missing.
async fn python_consumer() -> PathBuf {
    let dir = example("python-consumer");
    let present = Command::new("python3")
        .args(["-c", "import pika, psycopg, nats"])
        .stderr(Stdio::null())
        .status()
        .await
        .is_ok_and(|status| status.success());
    if !present {
        succeeds(
            Command::new("python3")
                .args(["-m", "pip", "install", "-q", "-r", "requirements.txt"])
                .current_dir(&dir),
            "pip install in examples/python-consumer",
        )
        .await;
    }
    dir.join("consumer.py")
}

/// Runs the host for `tenant`: 3 runs, steps 1..=30 on `main`, a rewind at 12 to `retry`,
/// steps 13..=22 on it.
async fn run_host(host: &Path, database_url: &str, tenant: &str) {
    let stdout = succeeds(
        Command::new("node")
            .arg(host)
            .env("DATABASE_URL", database_url)
            .env("TENANT", tenant)
            .env("RUNS", "3")
            .env("STEPS", "30")
            .env("FORK", "12")
            .env("RETRY_STEPS", "10"),
        "the TypeScript host",
    )
    .await;
    assert!(
        stdout.contains(r#""refused":"RL105: branch"#),
        "an append to the abandoned branch is refused with RL105:\n{stdout}"
    );
    assert!(
        stdout.contains(r#""closed":"ts-r3","branch":"retry","end":23"#),
        "each run is closed after its last step:\n{stdout}"
    );
}

type Projected = Vec<(String, String, i64, Vec<u8>, serde_json::Value)>;

/// The live history of each tenant as the host wrote it: per run, `main` 1..=12, then `retry`
/// 13..=22, with the host's JSON bodies and the metadata it set (`metadata` in
/// `examples/typescript-host/src/host.ts`), as the Python consumer read it off the wire.
fn live_history() -> Projected {
    let mut live = Vec::new();
    for run in ["ts-r1", "ts-r2", "ts-r3"] {
        for (branch, steps) in [("main", 1..=12), ("retry", 13..=22)] {
            for step in steps {
                let body = format!(r#"{{"run":"{run}","branch":"{branch}","step":{step}}}"#);
                let meta = serde_json::json!({
                    "type": "agent.step",
                    "content_type": "application/json",
                    "correlation_id": format!("{run}-{step}"),
                    "causation_id": format!("{branch}-{}", step - 1),
                    "headers": {"agent-step": step.to_string()},
                    "traceparent": format!("00-{:032x}-{:016x}-01", 0x1000 + step, step + 1),
                    "tracestate": "host=ts",
                });
                live.push((
                    run.to_owned(),
                    branch.to_owned(),
                    step,
                    body.into_bytes(),
                    meta,
                ));
            }
        }
    }
    live
}

/// The Python consumer's table for `tenant`, each run in the order it was built.
async fn projected(pool: &PgPool, tenant: &str) -> Projected {
    sqlx::query_as(
        "SELECT run, branch, lsn, body, coalesce(meta, 'null') FROM py_projection
          WHERE tenant = $1 ORDER BY run, seq",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await
    .unwrap_or_default()
}

fn consumer(script: &Path, database_url: &str, topology: &str, crash_after: u32) -> Child {
    Command::new("python3")
        .arg(script)
        .env("AMQP_URL", amqp_url())
        .env("DATABASE_URL", database_url)
        .env("TOPOLOGY", topology)
        .env("PARTITIONS", "4")
        .env("CRASH_AFTER_WRITES", crash_after.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typescript_host_and_a_python_consumer_get_exactly_the_live_history() {
    let host = typescript_host().await;
    let script = python_consumer().await;
    let (pool, url) = fresh_database("polyglot").await;
    let (fold_pool, fold_url) = fold_database("polyglot_fold").await;
    let topology = unique("polyglot");
    let config = relay_config(&url, &amqp_url(), &topology);
    let rabbit = config.rabbit_config().unwrap();

    let outcome = std::panic::AssertUnwindSafe(async {
        // The topology first, so the consumer's queues exist before any relay runs.
        declare_topology(&rabbit.topology).await;

        // A consumer that crashes after its 10th write, before committing it.
        let mut crashing = consumer(&script, &fold_url, &topology, 10);
        let relay = Relay::start(config.clone()).await.unwrap();
        run_host(&host, &url, "ts-a").await;
        let status = tokio::time::timeout(Duration::from_secs(60), crashing.wait())
            .await
            .expect("the consumer reaches its 10th write")
            .unwrap();
        assert_eq!(status.code(), Some(3), "the consumer crashed as told");

        // The relay restarts; meanwhile a second tenant's history waits in the outbox.
        relay.shutdown().await;
        run_host(&host, &url, "ts-b").await;
        let relay = Relay::start(config.clone()).await.unwrap();

        // The consumer again: the crashed delivery is redelivered, everything else arrives.
        let mut steady = consumer(&script, &fold_url, &topology, 0);
        for tenant in ["ts-a", "ts-b"] {
            let want = live_history();
            wait_until(
                "the Python consumer's table to equal the live history",
                Duration::from_secs(60),
                || async { projected(&fold_pool, tenant).await == want },
            )
            .await;
        }
        // Nothing left held back, and the host's own state is where its history ends.
        let held: i64 = sqlx::query_scalar("SELECT count(*) FROM relay_fold_parked")
            .fetch_one(&fold_pool)
            .await
            .unwrap();
        assert_eq!(held, 0);
        let states: Vec<(String, i64)> =
            sqlx::query_as("SELECT branch, step FROM ts_host_state ORDER BY tenant, run")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(states, vec![("retry".to_owned(), 22); 6]);
        // Every run was closed by the host, and ended at the consumer once, after all of it.
        let want: Vec<(String, String)> = ["ts-a", "ts-b"]
            .iter()
            .flat_map(|t| ["ts-r1", "ts-r2", "ts-r3"].map(|r| (t.to_string(), r.to_owned())))
            .collect();
        wait_until(
            "every run to end at the Python consumer",
            Duration::from_secs(60),
            || async {
                sqlx::query_as::<_, (String, String)>(
                    "SELECT tenant, run FROM py_runs_done ORDER BY tenant, run",
                )
                .fetch_all(&fold_pool)
                .await
                .unwrap_or_default()
                    == want
            },
        )
        .await;
        // Ended after all of it: the projection is still exactly the live history.
        for tenant in ["ts-a", "ts-b"] {
            assert_eq!(projected(&fold_pool, tenant).await, live_history());
        }
        // What the fold refuses is dead-lettered for real, with its reason, and changes
        // nothing: a forged broken chain (RL200), and the run's Lsn 22 written again in a
        // later epoch, as after a failover that lost it (RL203).
        refused_messages_are_dead_lettered(&rabbit, &fold_pool).await;
        steady.kill().await.unwrap();
        relay.shutdown().await;
    })
    .catch_unwind()
    .await;
    drop_topology(&rabbit.topology).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Publishes two messages the fold refuses to the Python consumer's partition of ts-a/ts-r1 and
/// finds each in the dead-letter queue with its SQLSTATE (the example once nacked them into a
/// queue without a dead-letter exchange: the broker dropped them).
async fn refused_messages_are_dead_lettered(
    rabbit: &distribution::rabbit::RabbitConfig,
    fold_pool: &PgPool,
) {
    use distribution::broker::WireMode;
    use distribution::rabbit::{DeadLetters, encode};
    use distribution::store::EventKind;
    let branch = testkit::branch("ts-a", "ts-r1", "retry");
    let epoch: i64 = sqlx::query_scalar(
        "SELECT max(e) FROM relay_fold_cursor, unnest(epochs) e WHERE tenant_id = 'ts-a'",
    )
    .fetch_one(fold_pool)
    .await
    .unwrap();
    let broken = testkit::intent(&branch, 60)
        .prev(14)
        .base(12)
        .parent("main")
        .build();
    let rewritten = testkit::intent(&branch, 22)
        .prev(21)
        .base(12)
        .parent("main")
        .payload("written again")
        .epochs(epoch as u64 + 1, Some(epoch as u64 + 1))
        .build();
    assert_eq!(rewritten.kind, EventKind::Intent);
    let (connection, channel) = distribution::rabbit::open(rabbit, "polyglot-forger")
        .await
        .unwrap();
    channel.confirm_select(Default::default()).await.unwrap();
    let partition = rabbit.topology.partition_of(&branch.tenant, &branch.run);
    for event in [&broken, &rewritten] {
        channel
            .basic_publish(
                rabbit.topology.exchange().clone(),
                rabbit.topology.routing_key(partition),
                Default::default(),
                &event.payload,
                encode(event, WireMode::Plain),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let dead = DeadLetters::open(rabbit).await.unwrap();
    wait_until(
        "both refused messages in the dead-letter queue",
        Duration::from_secs(30),
        || async { dead.depth().await.unwrap_or(0) >= 2 },
    )
    .await;
    let mut reasons: Vec<String> = dead
        .list(10)
        .await
        .unwrap()
        .into_iter()
        .map(|letter| letter.reason.unwrap_or_default())
        .collect();
    reasons.sort();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(reasons[0].starts_with("RL200"), "{reasons:?}");
    assert!(reasons[1].starts_with("RL203"), "{reasons:?}");
    drop(connection);
    assert_eq!(projected(fold_pool, "ts-a").await, live_history());
}

/// `url` connecting as `role` instead of its user.
fn as_role(url: &str, role: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{role}@{host}")
}

/// Drops `roles` and everything they own or were granted in each of `pools`' databases.
async fn drop_roles(pools: &[&PgPool], roles: &[String]) {
    for role in roles {
        for pool in pools {
            let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP OWNED BY {role}")))
                .execute(*pool)
                .await;
        }
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
            .execute(pools[0])
            .await;
    }
}

/// Whether `sql` run as the role behind `url` is refused for lack of privilege (42501).
async fn refused(url: &str, sql: &str) -> bool {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url)
        .await
        .unwrap();
    match sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut conn)
        .await
    {
        Err(sqlx::Error::Database(db)) => db.code().as_deref() == Some("42501"),
        other => panic!("{sql}: expected a refusal, got {other:?}"),
    }
}

/// Least privilege, applied from `distribution roles` (`store::roles_sql`): the relay runs as
/// a role that can only drain, ack, park and hold leases (no owner or superuser rights, no
/// migration), the TypeScript host as one that can only call the write functions, the Python
/// consumer as one that can only call `relay_fold`; the whole history still arrives exactly.
/// The host's role is refused when it reads, drains, acks or deletes outbox rows, the relay's
/// when it writes intents, the consumer's when it touches the fold's tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_and_both_examples_run_under_least_privilege_roles() {
    use distribution::store::{Roles, RolesFor, roles_sql};

    let host = typescript_host().await;
    let script = python_consumer().await;
    let (pool, url) = fresh_database("roles").await;
    let (fold_pool, fold_url) = fold_database("roles_fold").await;
    let (host_role, relay_role, consumer_role) =
        (unique("rhost"), unique("rrelay"), unique("rconsumer"));
    let all_roles = [host_role.clone(), relay_role.clone(), consumer_role.clone()];
    for role in &all_roles {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE ROLE {role} LOGIN")))
            .execute(&pool)
            .await
            .unwrap();
    }
    let outbox_grants = roles_sql(
        &Roles {
            host: Some(host_role.clone()),
            relay: Some(relay_role.clone()),
            consumer: None,
            operator: None,
        },
        RolesFor::Outbox,
        None,
    )
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{outbox_grants}\nGRANT CREATE ON SCHEMA public TO {host_role};"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let fold_grants = roles_sql(
        &Roles {
            consumer: Some(consumer_role.clone()),
            ..Roles::default()
        },
        RolesFor::Fold,
        None,
    )
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{fold_grants}\nGRANT CREATE ON SCHEMA public TO {consumer_role};"
    )))
    .execute(&fold_pool)
    .await
    .unwrap();

    let topology = unique("roles");
    let (host_url, relay_url, consumer_url) = (
        as_role(&url, &host_role),
        as_role(&url, &relay_role),
        as_role(&fold_url, &consumer_role),
    );
    let mut config = relay_config(&relay_url, &amqp_url(), &topology);
    config.skip_migrate = true;
    let rabbit = config.rabbit_config().unwrap();

    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology(&rabbit.topology).await;
        let relay = Relay::start(config.clone()).await.unwrap();
        let mut steady = consumer(&script, &consumer_url, &topology, 0);
        run_host(&host, &host_url, "ts-least").await;
        let want = live_history();
        wait_until(
            "the Python consumer's table to equal the live history",
            Duration::from_secs(60),
            || async { projected(&fold_pool, "ts-least").await == want },
        )
        .await;
        steady.kill().await.unwrap();
        relay.shutdown().await;

        // The host closed its runs; retirement works under the relay's and the consumer's roles
        // (nothing is due yet: the retention is an hour).
        let hour = distribution::store::Retention::new(Duration::from_secs(3600));
        let relay_pool = PgPool::connect(&relay_url).await.unwrap();
        assert_eq!(
            distribution::store::retire_runs(&relay_pool, hour)
                .await
                .unwrap(),
            0
        );
        let consumer_pool = PgPool::connect(&consumer_url).await.unwrap();
        assert_eq!(
            distribution::store::retire_folded_runs(&consumer_pool, hour)
                .await
                .unwrap(),
            0
        );
        relay_pool.close().await;
        consumer_pool.close().await;

        // Each role is refused what is not its part.
        for sql in [
            "SELECT count(*) FROM relay_outbox",
            "DELETE FROM relay_outbox",
            "SELECT * FROM relay_ack_and_drain(0, NULL, 0, 'ts-least', '{}', '{}', '{}', 10, \
             1000000, '{}', '{}', '{}')",
            "UPDATE relay_branch SET head_lsn = 0",
            "UPDATE relay_lease SET owner = 'me'",
            "SELECT relay_retire_runs('1 second', 10)",
            "SELECT * FROM relay_discard_branch('ts-least', 'ts-r1', 'retry', 'x')",
        ] {
            assert!(refused(&host_url, sql).await, "the host role: {sql}");
        }
        for sql in [
            "SELECT relay_append('ts-least', 'ts-r1', 'retry', 99, '\\x00')",
            "SELECT relay_open_run('ts-least', 'x', 'main')",
            "SELECT relay_close_run('ts-least', 'ts-r1')",
            "SELECT * FROM relay_discard_branch('ts-least', 'ts-r1', 'retry', 'x')",
            "UPDATE relay_branch SET head_lsn = 0",
            "INSERT INTO relay_outbox (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, \
             payload) VALUES ('a', 'b', 'c', 1, 0, 0, '')",
        ] {
            assert!(refused(&relay_url, sql).await, "the relay role: {sql}");
        }
        for sql in [
            "SELECT count(*) FROM relay_fold_cursor",
            "DELETE FROM relay_fold_parked",
            "DELETE FROM relay_fold_horizon",
        ] {
            assert!(
                refused(&consumer_url, sql).await,
                "the consumer role: {sql}"
            );
        }
    })
    .catch_unwind()
    .await;
    drop_topology(&rabbit.topology).await;
    drop_roles(&[&pool, &fold_pool], &all_roles).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// `examples/python-consumer/consumer_nats.py` on `stream`, folding into `database_url`.
fn nats_consumer(script: &Path, database_url: &str, stream: &str, crash_after: u32) -> Child {
    Command::new("python3")
        .arg(script.with_file_name("consumer_nats.py"))
        .env("NATS_URL", testkit::nats_url())
        .env("DATABASE_URL", database_url)
        .env("STREAM", stream)
        .env("PARTITIONS", "4")
        .env("GROUP", "python")
        .env("CRASH_AFTER_WRITES", crash_after.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs")
}

/// The same on NATS JetStream: the TypeScript host's history shipped by the relay to a stream,
/// read by the Python consumer written from WIRE.md's NATS section (nats-py), which crashes
/// once between its write and its commit; its table equals the live history, every run ends
/// once, and a message the fold refuses (a forged broken chain) is kept in the dead-letter
/// stream with its SQLSTATE and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typescript_host_and_a_python_consumer_on_nats_get_exactly_the_live_history() {
    let host = typescript_host().await;
    let script = python_consumer().await;
    let (pool, url) = fresh_database("polyglot_nats").await;
    let (fold_pool, fold_url) = fold_database("polyglot_nats_fold").await;
    let stream = distribution::nats::scratch::unique_stream("polyglot");
    let mut config = relay_config(&url, "", &stream);
    config.broker = distribution::BrokerKind::Nats;
    config.nats_url = testkit::nats_url();
    let nats = config.nats_config().unwrap();
    // The streams first, so the consumer can subscribe before any relay runs.
    distribution::nats::Reading::connect(&nats).await.unwrap();

    let mut crashing = nats_consumer(&script, &fold_url, &stream, 10);
    let relay = Relay::start(config.clone()).await.unwrap();
    run_host(&host, &url, "ts-a").await;
    let status = tokio::time::timeout(Duration::from_secs(60), crashing.wait())
        .await
        .expect("the consumer reaches its 10th write")
        .unwrap();
    assert_eq!(status.code(), Some(3), "the consumer crashed as told");
    relay.shutdown().await;
    run_host(&host, &url, "ts-b").await;
    let relay = Relay::start(config.clone()).await.unwrap();

    let mut steady = nats_consumer(&script, &fold_url, &stream, 0);
    for tenant in ["ts-a", "ts-b"] {
        let want = live_history();
        wait_until(
            "the Python consumer's table to equal the live history",
            Duration::from_secs(60),
            || async { projected(&fold_pool, tenant).await == want },
        )
        .await;
    }
    // The host's own state is where its history ends.
    let states: Vec<(String, i64)> =
        sqlx::query_as("SELECT branch, step FROM ts_host_state ORDER BY tenant, run")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(states, vec![("retry".to_owned(), 22); 6]);
    let want: Vec<(String, String)> = ["ts-a", "ts-b"]
        .iter()
        .flat_map(|t| ["ts-r1", "ts-r2", "ts-r3"].map(|r| (t.to_string(), r.to_owned())))
        .collect();
    wait_until(
        "every run to end at the Python consumer",
        Duration::from_secs(60),
        || async {
            sqlx::query_as::<_, (String, String)>(
                "SELECT tenant, run FROM py_runs_done ORDER BY tenant, run",
            )
            .fetch_all(&fold_pool)
            .await
            .unwrap_or_default()
                == want
        },
    )
    .await;

    // A forged broken chain, written as the relay writes: kept as a dead letter, nothing else.
    use distribution::broker::Publisher as _;
    let branch = testkit::branch("ts-a", "ts-r1", "retry");
    let broken = testkit::intent(&branch, 60)
        .prev(14)
        .base(12)
        .parent("main")
        .build();
    let mut forger = distribution::nats::NatsPublisher::new(nats.clone());
    assert_eq!(
        forger
            .publish(std::slice::from_ref(&broken))
            .await
            .accepted(),
        1
    );
    let client = async_nats::connect(testkit::nats_url()).await.unwrap();
    let context = async_nats::jetstream::new(client);
    let dead_stream = distribution::nats::dead_letter_stream(&stream);
    wait_until(
        "the refused message in the dead-letter stream",
        Duration::from_secs(30),
        || async {
            match context.get_stream(&dead_stream).await {
                Ok(mut dead) => dead.info().await.is_ok_and(|info| info.state.messages == 1),
                Err(_) => false,
            }
        },
    )
    .await;
    let kept = context
        .get_stream(&dead_stream)
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    assert_eq!(kept.subject.as_str(), format!("{dead_stream}.python"));
    let reason = kept
        .headers
        .get(distribution::broker::DEAD_LETTER_REASON)
        .map(|value| value.as_str().to_owned())
        .unwrap_or_default();
    assert!(reason.starts_with("RL200"), "{reason}");
    for tenant in ["ts-a", "ts-b"] {
        assert_eq!(projected(&fold_pool, tenant).await, live_history());
    }
    steady.kill().await.unwrap();
    relay.shutdown().await;
    distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
}

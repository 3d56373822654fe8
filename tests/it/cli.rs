//! The binary as an operator meets it: help and version exit 0, usage and configuration errors
//! exit 2 naming the flag or variable, database problems are named within seconds, and a
//! running relay answers `/healthz`, `/readyz` (with the reason when not ready) and `/metrics`.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use distribution::store::Outbox;
use distribution::testing::BrokerProxy;

use crate::harness::*;
use crate::node::PrivateNode;

fn output(command: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = command.output().expect("run the binary");
    (
        status.code().expect("exited"),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

/// Like [`output`], but a process still running after `limit` is killed and fails the test
/// (a relay that should refuse to start must not hang the suite instead).
fn output_within(command: &mut Command, limit: Duration) -> (i32, String, String) {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the binary");
    let pid = child.id().to_string();
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match finished.recv_timeout(limit) {
        Ok(output) => {
            let Output {
                status,
                stdout,
                stderr,
            } = output.expect("wait for the binary");
            (
                status.code().expect("exited"),
                String::from_utf8_lossy(&stdout).into_owned(),
                String::from_utf8_lossy(&stderr).into_owned(),
            )
        }
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            panic!("still running after {limit:?}");
        }
    }
}

#[test]
fn help_and_version_exit_0_usage_errors_exit_2() {
    for args in [
        &["--help"][..],
        &["-h"],
        &["help"],
        &["run", "--help"],
        &["--version"],
    ] {
        let (code, stdout, _) = output(relay_command().args(args));
        assert_eq!(code, 0, "{args:?}");
        assert!(!stdout.is_empty(), "{args:?} printed nothing");
    }
    let (_, help, _) = output(relay_command().args(["run", "--help"]));
    for variable in [
        "DATABASE_URL",
        "RELAY_THREADS",
        "RELAY_QUEUE_TYPE",
        "RELAY_POLL_MS",
    ] {
        assert!(help.contains(variable), "run --help lacks {variable}");
    }
    let (_, version, _) = output(relay_command().arg("--version"));
    assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
    for args in [
        &[][..],
        &["bogus"],
        &["status", "extra", "words"],
        &["release"],
    ] {
        let (code, _, stderr) = output(
            relay_command()
                .args(args)
                .env("DATABASE_URL", "postgres://x@127.0.0.1/x"),
        );
        assert_eq!(code, 2, "{args:?}: {stderr}");
    }
}

#[test]
fn bad_settings_exit_2_naming_the_variable() {
    let base = |command: &mut Command| {
        command
            .arg("run")
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x")
            .env("AMQP_URL", "amqp://127.0.0.1:1/%2f");
    };
    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(command.env("RELAY_THREADS", "100000"));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("RELAY_THREADS") && stderr.contains("1..=256"),
        "{stderr}"
    );

    // A URI lapin cannot parse is a configuration error, not an unreachable broker.
    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(command.env("AMQP_URL", "amqp://%%%:@@@"));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("AMQP_URL=") && stderr.contains("not a valid AMQP URI"),
        "{stderr}"
    );
    // A malformed URL is shown as given, its credentials masked, beside what a URL looks like.
    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(command.env("AMQP_URL", "amqp//relay:S3cret@mq.example:5672"));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("AMQP_URL=\"***@mq.example:5672\" is invalid")
            && stderr.contains("a broker URL looks like amqp://user:password@host:5672/%2f"),
        "{stderr}"
    );
    assert!(!stderr.contains("S3cret"), "{stderr}");

    // No broker URL at all: one readable line saying which and the other choice (it once
    // carried a run of 22 spaces from a broken line continuation).
    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(command.env_remove("AMQP_URL"));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains(
            "AMQP_URL (--amqp-url) is required: the RabbitMQ broker (or RELAY_BROKER=nats \
             with NATS_URL)"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("  "), "{stderr}");

    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(command.args(["--partitions", "abc"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--partitions"), "{stderr}");

    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(
        command
            .env("RELAY_LEASE_TTL_MS", "200")
            .env("RELAY_PARTITONS", "3"),
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("RELAY_LEASE_TTL_MS"), "{stderr}");
    assert_eq!(
        stderr.matches("RELAY_PARTITONS is not a setting").count(),
        1,
        "{stderr}"
    );
    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(command.env("RELAY_QUEUE_TYPE", "lazy"));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("classic, quorum, stream"), "{stderr}");

    // Stream retention a stream would not take, or given to another queue type.
    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(
        command
            .env("RELAY_QUEUE_TYPE", "stream")
            .env("RELAY_STREAM_MAX_AGE", "7days"),
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("RELAY_STREAM_MAX_AGE=\"7days\" is invalid")
            && stderr.contains("Y M D h m s"),
        "{stderr}"
    );
    let mut command = relay_command();
    base(&mut command);
    let (code, _, stderr) = output(command.env("RELAY_STREAM_MAX_BYTES", "1000000"));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("RELAY_QUEUE_TYPE=\"classic\" is invalid")
            && stderr.contains("streams only"),
        "{stderr}"
    );
}

#[test]
fn database_problems_are_named_within_seconds() {
    let database = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let server = database.rsplit_once('/').unwrap().0.to_owned();
    let cases = [
        (
            "postgres://postgres@127.0.0.1:1/test".to_owned(),
            "Connection refused",
        ),
        (format!("{server}/no_such_database_here"), "does not exist"),
        (
            database.replacen("postgres@", "no_such_role@", 1),
            "role \"no_such_role\" does not exist",
        ),
    ];
    for (url, cause) in cases {
        let started = Instant::now();
        let (code, _, stderr) = output(relay_command().arg("status").env("DATABASE_URL", &url));
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains(cause), "{url}: {stderr}");
        assert!(!stderr.contains("pool timed out"), "{stderr}");
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{:?}",
            started.elapsed()
        );
    }
}

/// `distribution sql` is the whole schema for a host's own migration tool: applied as is,
/// the host writes and the relay's drain reads.
#[test]
fn the_printed_sql_builds_a_working_outbox() {
    let (code, sql, stderr) = output(relay_command().arg("sql"));
    assert_eq!(code, 0, "{stderr}");
    assert!(sql.contains("-- relay migration 1 "), "{sql}");
    host_runtime().block_on(async {
        let (pool, url) = empty_database("cli_sql").await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
        let branch = write_first_intent(&pool, "sql", b"x").await;
        let drained = Outbox::new(pool.clone())
            .drain_outbox(&branch.tenant, 10)
            .await
            .unwrap();
        assert_eq!(drained.len(), 1);

        // A relay that does not migrate (RELAY_SKIP_MIGRATE) runs on that schema, ships,
        // and leaves the migrations to the host's tool (no relay_migrations table).
        let topology = unique("relay-skip");
        let addr = free_addr();
        let mut child = run_command(&url, &amqp_url(), &topology, &addr)
            .env("RELAY_POLL_MS", "100")
            .env("RELAY_SKIP_MIGRATE", "true")
            .spawn()
            .unwrap();
        let outbox = Outbox::new(pool.clone());
        wait_until(
            "shipped without migrating",
            Duration::from_secs(30),
            || async { pending(&outbox).await == 0 },
        )
        .await;
        child.kill().unwrap();
        child.wait().unwrap();
        let tracked: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('relay_migrations')::text")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(tracked, None, "the relay migrated although told not to");
        drop_topology(&distribution::rabbit::Topology::new(&topology, 8).unwrap()).await;
    });
}

/// `distribution group reset` empties the named projection tables and forgets the fold's
/// state and stream offsets in one transaction; without `--truncate` or `--fold-only` it is
/// a usage error (the tables would get every event twice), and a bad table name is refused
/// before anything is done.
#[test]
fn group_reset_empties_the_projection_with_the_fold_or_refuses() {
    host_runtime().block_on(async {
        let (pool, url) = fold_database("cli_group_reset").await;
        sqlx::raw_sql(
            "CREATE TABLE orders (id int); INSERT INTO orders VALUES (1), (2);
             SELECT relay_fold_save_offset('relay.p0', 42);",
        )
        .execute(&pool)
        .await
        .unwrap();
        let count = |sql: &'static str| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(sql)
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            }
        };
        let (code, _, stderr) = output(
            relay_command()
                .args(["group", "reset"])
                .env("DATABASE_URL", &url),
        );
        assert_eq!(code, 2, "a usage error: {stderr}");
        assert!(stderr.contains("--truncate <TABLE>"), "{stderr}");
        let (code, _, stderr) = output(
            relay_command()
                .args(["group", "reset", "--truncate", "Orders; DROP"])
                .env("DATABASE_URL", &url),
        );
        assert_ne!(code, 0, "{stderr}");
        assert_eq!(
            count("SELECT count(*) FROM orders").await,
            2,
            "nothing done"
        );
        assert_eq!(count("SELECT count(*) FROM relay_fold_offset").await, 1);
        let (code, stdout, stderr) = output(
            relay_command()
                .args(["group", "reset", "--truncate", "public.orders"])
                .env("DATABASE_URL", &url),
        );
        assert_eq!(code, 0, "{stderr}");
        assert!(stdout.contains("emptied \"public\".\"orders\""), "{stdout}");
        assert_eq!(count("SELECT count(*) FROM orders").await, 0);
        assert_eq!(count("SELECT count(*) FROM relay_fold_offset").await, 0);
    });
}

/// The unknown-variable warning reads every command's settings: the console's token is no
/// typo for `sql` (or `run`, or `status`), a misspelt setting is named, and each once.
#[test]
fn only_a_variable_no_command_reads_is_called_a_typo() {
    let (code, _, stderr) = output(
        relay_command()
            .arg("sql")
            .env("RELAY_CONSOLE_TOKEN", "a-token-of-sixteen-characters")
            .env("RELAY_CONSOLE_LISTEN", "127.0.0.1:9181")
            .env("RELAY_GROUP", "billing")
            .env("RELAY_PARTITONS", "4"),
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("RELAY_PARTITONS is not a setting of this relay and is ignored (a typo?)"),
        "{stderr}"
    );
    // And on a usage error (no log runs then), said on standard error, once.
    let (code, _, stderr) = output(
        relay_command()
            .args(["sql", "--no-such-flag"])
            .env("RELAY_CONSOLE_TOKEN", "a-token-of-sixteen-characters")
            .env("RELAY_PARTITONS", "4"),
    );
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(stderr.matches("RELAY_PARTITONS").count(), 1, "{stderr}");
    assert!(!stderr.contains("RELAY_CONSOLE_TOKEN"), "{stderr}");
}

/// `distribution sql --fold` is what a consumer's own database needs: applied as is,
/// `relay_fold` folds. `distribution roles` prints grants, and refuses a bad call with exit 2.
#[test]
fn the_printed_fold_sql_folds_and_roles_refuse_bad_names() {
    let (code, sql, stderr) = output(relay_command().args(["sql", "--fold"]));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        !sql.contains("relay_outbox ("),
        "only the fold's objects:\n{sql}"
    );
    host_runtime().block_on(async {
        let pool = bare_database("cli_fold_sql").await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
        let actions: Vec<String> = sqlx::query_scalar(
            "SELECT action FROM relay_fold('t', 'r', 'main', 'intent', 1, 0, 0, NULL, NULL, \
             NULL, 'x'::bytea)",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(actions, ["apply"]);
    });
    let (code, grants, stderr) =
        output(relay_command().args(["roles", "--consumer", "app_fold", "--fold-database"]));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        grants.contains("GRANT EXECUTE ON FUNCTION relay_fold, relay_fold_retire, relay_fold_offset, relay_fold_save_offset, relay_fold_reset, relay_fold_adopt, relay_fold_batch TO app_fold;"),
        "{grants}"
    );
    let (code, _, stderr) = output(relay_command().arg("roles"));
    assert_eq!(code, 2);
    assert!(stderr.contains("name at least one role"), "{stderr}");
    let (code, _, stderr) = output(relay_command().args(["roles", "--host", "App-Host"]));
    assert_eq!(code, 2);
    assert!(stderr.contains("invalid host role"), "{stderr}");
}

/// Told not to migrate, a relay on a database without the schema stops at once, naming
/// what is missing and how to apply it, and creates nothing.
#[test]
fn skip_migrate_without_the_schema_fails_at_start_naming_what_is_missing() {
    host_runtime().block_on(async {
        let (pool, url) = empty_database("cli_skip").await;
        let (code, _, stderr) = output_within(
            relay_command()
                .arg("run")
                .env("DATABASE_URL", &url)
                .env("AMQP_URL", amqp_url())
                .env("RELAY_TOPOLOGY", unique("relay-skip-missing"))
                .env("RELAY_METRICS_ADDR", "127.0.0.1:0")
                .env("RELAY_SKIP_MIGRATE", "true"),
            Duration::from_secs(10),
        );
        assert_eq!(code, 1, "{stderr}");
        for named in [
            "RELAY_SKIP_MIGRATE",
            "relay_outbox",
            "relay_ack_and_drain",
            "distribution sql",
        ] {
            assert!(stderr.contains(named), "{named} not named: {stderr}");
        }
        let created: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname LIKE 'relay%'")
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(created, 0, "the relay created tables although told not to");
    });
}

/// RELAY_NATS_SERVER_VERSION holds the server to a version: the machine's server (2.9.10)
/// under a requirement above its version is refused at start in one line naming the version and
/// the setting, before any stream is declared; no server answering is a refusal too; under a
/// requirement it meets the relay starts.
#[test]
fn a_nats_server_below_the_required_version_is_refused_before_anything_is_declared() {
    host_runtime().block_on(async {
        let (_pool, url) = empty_database("cli_nats_version").await;
        let stream = distribution::nats::scratch::unique_stream("relay-version");
        let run = |nats_url: &str, required: &str| {
            let mut command = relay_command();
            command
                .arg("run")
                .env("DATABASE_URL", &url)
                .env("RELAY_BROKER", "nats")
                .env("NATS_URL", nats_url)
                .env("RELAY_TOPOLOGY", &stream)
                .env("RELAY_METRICS_ADDR", "127.0.0.1:0")
                .env("RELAY_NATS_ACK_TIMEOUT_MS", "1000")
                .env("RELAY_NATS_SERVER_VERSION", required);
            command
        };
        let client = async_nats::connect(testkit::nats_url()).await.unwrap();
        let version = client.server_info().version;
        let jetstream = async_nats::jetstream::new(client);
        let (code, _, stderr) = output_within(
            &mut run(&testkit::nats_url(), &format!(">{version}")),
            Duration::from_secs(20),
        );
        assert_eq!(code, 1, "{stderr}");
        let line = stderr.lines().find(|line| line.starts_with("error:"));
        assert_eq!(
            line,
            Some(
                format!("error: NATS {version} does not meet RELAY_NATS_SERVER_VERSION=>{version}")
                    .as_str()
            ),
            "{stderr}"
        );
        assert!(
            jetstream.get_stream(&stream).await.is_err(),
            "a refused relay declared its stream"
        );
        // Nobody answering: nothing can be checked, so nothing starts.
        let (code, _, stderr) = output_within(
            &mut run("nats://127.0.0.1:1", &format!(">={version}")),
            Duration::from_secs(20),
        );
        assert_eq!(code, 1, "{stderr}");
        assert!(
            stderr.contains("version cannot be read") && stderr.lines().count() == 1,
            "{stderr}"
        );
        // Met: the relay runs (it declares its stream) until stopped.
        let mut child = run(&testkit::nats_url(), &format!(">={version}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let declared = async {
            while jetstream.get_stream(&stream).await.is_err() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let started = tokio::time::timeout(Duration::from_secs(20), declared).await;
        let _ = child.kill();
        let _ = child.wait();
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
        assert!(
            started.is_ok(),
            "a relay whose server meets the version did not start"
        );
    });
}

/// With RELAY_SCHEMA_WAIT_SECS, a relay started before its schema (beside the migration job,
/// as deploy/kubernetes/relay.yaml does) says it waits, and runs once the schema is there,
/// instead of crash-looping.
#[test]
fn skip_migrate_waits_for_the_schema_when_told_to() {
    use std::io::{BufRead, BufReader};
    host_runtime().block_on(async {
        let (pool, url) = empty_database("cli_skip_wait").await;
        let topology = unique("relay-skip-wait");
        let addr = free_addr();
        let mut child = run_command(&url, &amqp_url(), &topology, &addr)
            .env("RELAY_SKIP_MIGRATE", "true")
            .env("RELAY_SCHEMA_WAIT_SECS", "120")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        // Its log line (a blocking read: it logs before it waits).
        let mut said = String::new();
        while !said.contains("waiting up to") {
            let mut line = String::new();
            assert!(
                stderr.read_line(&mut line).unwrap() > 0,
                "it exited: {said}"
            );
            said.push_str(&line);
        }
        assert!(
            said.contains("waiting up to 120 s for the schema (relay_outbox"),
            "{said}"
        );
        // Whatever it says next must not block it: drained on a thread.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        assert!(
            child.try_wait().unwrap().is_none(),
            "it waits, it did not exit"
        );
        distribution::store::migrate(&pool).await.unwrap();
        answer_until(&addr, "/readyz", |status| status == 200).await;
        assert_eq!(terminate(&mut child), Some(0), "graceful stop on SIGTERM");
        drop_topology_named(&url, &topology).await;
    });
}

/// Stops a `distribution run` with SIGTERM (its graceful stop): its exit code.
fn terminate(child: &mut std::process::Child) -> Option<i32> {
    let signalled = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success(), "kill -TERM");
    child.wait().unwrap().code()
}

/// Deletes the exchange and queues of the topology named `topology` (the harness's 4
/// partitions).
async fn drop_topology_named(url: &str, topology: &str) {
    let rabbit = relay_config(url, &amqp_url(), topology)
        .rabbit_config()
        .unwrap();
    drop_topology(&rabbit.topology).await;
}

/// Asks `path` until it answers with a status `wanted` accepts (30 s at most).
async fn answer_until(addr: &str, path: &str, wanted: impl Fn(u16) -> bool) -> (u16, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match http_get(addr, path).await {
            Some(answer) if wanted(answer.0) => return answer,
            answer => assert!(Instant::now() < deadline, "{path} answered {answer:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `/healthz` answers while the process lives; `/readyz` fails, saying why, while the
/// broker is down and intents wait, and recovers when they ship.
#[test]
fn a_running_relay_answers_health_and_readiness() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("cli_ready").await;
        let proxy = BrokerProxy::start(&amqp_url()).unwrap();
        let topology = unique("relay-ready");
        let addr = free_addr();
        let mut child = run_command(&url, &proxy.amqp_url(), &topology, &addr)
            .env("RELAY_POLL_MS", "100")
            .env("RELAY_AMQP_CONNECT_TIMEOUT_MS", "1000")
            .spawn()
            .unwrap();
        let (status, _) = answer_until(&addr, "/healthz", |_| true).await;
        assert_eq!(status, 200);
        let (status, body) = http_get(&addr, "/readyz").await.unwrap();
        assert_eq!(status, 200, "{body}");
        let (status, body) = http_get(&addr, "/metrics").await.unwrap();
        assert_eq!(status, 200);
        assert!(
            body.contains("# HELP relay_drainer_restarts_total"),
            "{body}"
        );
        // What `/readyz` says, for alerts (deploy/prometheus/rules.yml: RelayNotReady).
        assert!(body.contains("\nrelay_ready 1\n"), "{body}");
        assert_eq!(http_get(&addr, "/elsewhere").await.unwrap().0, 404);

        proxy.cut();
        write_first_intent(&pool, "ready", b"x").await;
        let (_, body) = answer_until(&addr, "/readyz", |status| status == 503).await;
        assert!(body.contains("broker down while intents wait"), "{body}");
        let (_, body) = http_get(&addr, "/metrics").await.unwrap();
        assert!(body.contains("\nrelay_ready 0\n"), "{body}");
        // Healthy all the same: restarting would not bring the broker back.
        assert_eq!(http_get(&addr, "/healthz").await.unwrap().0, 200);

        proxy.restore();
        let outbox = Outbox::new(pool.clone());
        wait_until(
            "shipped once the broker is back",
            Duration::from_secs(30),
            || async { pending(&outbox).await == 0 },
        )
        .await;
        wait_until("ready again", Duration::from_secs(10), || async {
            http_get(&addr, "/readyz")
                .await
                .is_some_and(|(status, _)| status == 200)
        })
        .await;
        assert_eq!(terminate(&mut child), Some(0), "graceful stop on SIGTERM");
        drop_topology_named(&url, &topology).await;
    });
}

/// `/readyz` names a database that stopped answering (a proxy the test owns cuts the
/// relay's connections and refuses new ones), `/healthz` stays 200, and the relay is
/// ready again once the database is back, shipping what was written meanwhile.
#[test]
fn readiness_names_an_unreachable_database() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("cli_ready_db").await;
        let database = BrokerProxy::start(&url).unwrap();
        let topology = unique("relay-ready-db");
        let addr = free_addr();
        let mut child = run_command(&database.amqp_url(), &amqp_url(), &topology, &addr)
            .env("RELAY_POLL_MS", "100")
            .spawn()
            .unwrap();
        answer_until(&addr, "/readyz", |status| status == 200).await;

        database.cut();
        let (_, body) = answer_until(&addr, "/readyz", |status| status == 503).await;
        assert!(body.contains("database unreachable"), "{body}");
        assert_eq!(http_get(&addr, "/healthz").await.unwrap().0, 200);
        // The host writes on its own connection meanwhile (the proxy is the relay's only).
        write_first_intent(&pool, "ready-db", b"x").await;

        database.restore();
        answer_until(&addr, "/readyz", |status| status == 200).await;
        let outbox = Outbox::new(pool.clone());
        wait_until(
            "shipped once the database is back",
            Duration::from_secs(30),
            || async { pending(&outbox).await == 0 },
        )
        .await;
        child.kill().unwrap();
        child.wait().unwrap();
        drop_topology_named(&url, &topology).await;
    });
}

/// Through a broker memory alarm (on a private node the test owns) `/readyz` answers 503
/// naming the block for as long as intents wait, and 200 again once the alarm clears and
/// they ship. Before, it stayed 200 through most of an alarm: nothing faults on a blocked
/// connection, so the broker looked up.
#[test]
fn readiness_says_the_broker_blocks_the_relay_through_an_alarm() {
    host_runtime().block_on(async {
        let node = PrivateNode::start("ready");
        let timeout = Duration::from_secs(1);
        let timeout_ms = timeout.as_millis().to_string();
        let settings = [
            ("RELAY_POLL_MS", "100"),
            ("RELAY_AMQP_CONNECT_TIMEOUT_MS", timeout_ms.as_str()),
            ("RELAY_AMQP_CONFIRM_TIMEOUT_MS", timeout_ms.as_str()),
        ];
        let shipping = Shipping::start(&node, "ready_alarm", &settings).await;
        let (addr, pool, branch, outbox) = (
            &shipping.addr,
            &shipping.pool,
            &shipping.branch,
            &shipping.outbox,
        );

        tokio::task::block_in_place(|| node.memory_alarm(true));
        for lsn in 2..=10 {
            append_intent(pool, branch, lsn, b"during the alarm").await;
        }
        let (_, body) = answer_until(addr, "/readyz", |status| status == 503).await;
        assert!(body.contains("broker blocks the relay"), "{body}");
        // Every answer while the alarm holds and intents wait says so, for three times the
        // relay's AMQP timeouts set above (any of them firing on the blocked connection would).
        let until = Instant::now() + 3 * timeout;
        while Instant::now() < until {
            let (status, body) = http_get(addr, "/readyz").await.unwrap();
            assert_eq!(status, 503, "ready during the alarm: {body}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(pending(outbox).await > 0, "intents waited throughout");

        tokio::task::block_in_place(|| node.memory_alarm(false));
        answer_until(addr, "/readyz", |status| status == 200).await;
        wait_until(
            "shipped once the alarm clears",
            Duration::from_secs(30),
            || async { pending(outbox).await == 0 },
        )
        .await;
        // The relay stops with `shipping`; the topology goes with the node.
    });
}

/// `distribution demo --broker nats` walks the same story on NATS JetStream (the machine's
/// server): exit 0, every tenant folded in order by a consumer group, and neither its database
/// nor its streams remain.
#[test]
fn the_demo_on_nats_ships_everything_and_leaves_nothing_behind() {
    let child = relay_command()
        .args(["demo", "--broker", "nats"])
        .env("DATABASE_URL", std::env::var("DATABASE_URL").unwrap())
        .env("NATS_URL", testkit::nats_url())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the binary");
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stderr.is_empty(), "the demo is quiet on stderr: {stderr}");
    assert!(stdout.contains("talks to NATS JetStream"), "{stdout}");
    assert!(
        stdout.contains("228 live intents and 6 rewind markers wait to ship"),
        "{stdout}"
    );
    for tenant in ["acme", "globex", "initech"] {
        let row = stdout
            .lines()
            .find(|line| line.starts_with(tenant) && line.ends_with("yes"))
            .unwrap_or_else(|| panic!("{tenant} folded in order: {stdout}"));
        let columns: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(columns[2], "0", "nothing pending after: {row}");
        let number = |at: usize| columns[at].parse::<u64>().unwrap();
        assert_eq!(number(1), number(3) + 2, "{row}");
    }
    host_runtime().block_on(async {
        use futures_util::TryStreamExt;
        let client = async_nats::connect(testkit::nats_url()).await.unwrap();
        let names: Vec<String> = async_nats::jetstream::new(client)
            .stream_names()
            .try_collect()
            .await
            .unwrap();
        let ours = format!("relay_demo_{pid}_");
        let left: Vec<&String> = names
            .iter()
            .filter(|name| name.starts_with(&ours))
            .collect();
        assert!(left.is_empty(), "the demo left {left:?}");
        let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL").unwrap())
            .await
            .unwrap();
        let databases: Vec<String> =
            sqlx::query_scalar("SELECT datname::text FROM pg_database WHERE datname LIKE $1")
                .bind(format!("relay_demo_{pid}_%"))
                .fetch_all(&pool)
                .await
                .unwrap();
        assert!(databases.is_empty(), "the demo left {databases:?}");
    });
}

/// `distribution demo` walks the seed's story and exits 0 with its before/after table, every
/// tenant folded in order; afterwards neither its database nor its exchange and queues remain
/// (README and docs/operations.md promise both; before, its exchange and queues stayed on the broker).
#[test]
fn the_demo_ships_everything_and_leaves_nothing_behind() {
    let child = relay_command()
        .arg("demo")
        .env("DATABASE_URL", std::env::var("DATABASE_URL").unwrap())
        .env("AMQP_URL", amqp_url())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the binary");
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("5. Everything shipped and folded"),
        "{stdout}"
    );
    for tenant in ["acme", "globex", "initech"] {
        let row = stdout
            .lines()
            .find(|line| line.starts_with(tenant) && line.ends_with("yes"))
            .unwrap_or_else(|| panic!("{tenant} folded in order: {stdout}"));
        let columns: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(columns[2], "0", "nothing pending after: {row}");
        // The story adds up: pending before = folded intents + one rewind marker per run.
        let number = |at: usize| columns[at].parse::<u64>().unwrap();
        assert_eq!(number(1), number(3) + 2, "{row}");
    }
    assert!(
        stdout.contains("228 live intents and 6 rewind markers wait to ship"),
        "{stdout}"
    );
    // The broker (this machine's node, which `AMQP_URL` names here) and the database server.
    let ours = format!("relay-demo-{pid}_");
    for what in ["list_queues", "list_exchanges"] {
        let listed = Command::new("rabbitmqctl")
            .args([what, "name", "--quiet", "--no-table-headers"])
            .output()
            .unwrap();
        assert!(listed.status.success(), "rabbitmqctl {what}");
        let left: Vec<String> = String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter(|name| name.starts_with(&ours))
            .map(str::to_owned)
            .collect();
        assert!(left.is_empty(), "the demo left {left:?}");
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let left: Vec<String> = runtime.block_on(async {
        let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL").unwrap())
            .await
            .unwrap();
        sqlx::query_scalar("SELECT datname::text FROM pg_database WHERE datname LIKE $1")
            .bind(format!("relay_demo_{pid}_%"))
            .fetch_all(&pool)
            .await
            .unwrap()
    });
    assert!(left.is_empty(), "the demo left databases {left:?}");
}

/// A quorum dead-letter queue an earlier relay declared (no `x-delivery-limit`) cannot be
/// declared again with the limit: `run` exits 1 within seconds, naming the queue and how to
/// protect its letters and declare it anew (docs/operations.md, "Upgrading a relay onto existing
/// dead-letter queues"); the queue and its letter are left as they were.
#[test]
fn an_old_dead_letter_queue_stops_the_relay_with_the_way_out() {
    host_runtime().block_on(async {
        let (_pool, url) = fresh_database("cli_olddead").await;
        let topology = unique("relay-olddead");
        let dead = format!("{topology}.dead");
        let connection =
            lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let mut arguments = lapin::types::FieldTable::default();
        arguments.insert(
            "x-queue-type".into(),
            lapin::types::AMQPValue::LongString("quorum".into()),
        );
        let durable = lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(dead.as_str().into(), durable, arguments)
            .await
            .unwrap();
        channel
            .basic_publish(
                "".into(),
                dead.as_str().into(),
                Default::default(),
                b"a letter",
                Default::default(),
            )
            .await
            .unwrap();
        let (code, _, stderr) = output_within(
            relay_command()
                .arg("run")
                .env("DATABASE_URL", &url)
                .env("AMQP_URL", amqp_url())
                .env("RELAY_TOPOLOGY", &topology)
                .env("RELAY_QUEUE_TYPE", "quorum")
                .env("RELAY_METRICS_ADDR", "127.0.0.1:0"),
            Duration::from_secs(20),
        );
        assert_eq!(code, 1, "{stderr}");
        for named in [
            "inequivalent arg 'x-delivery-limit'",
            dead.as_str(),
            "set_policy --apply-to quorum_queues relay-dead",
            "delete the empty queue",
        ] {
            assert!(stderr.contains(named), "{named} not named: {stderr}");
        }
        let channel = connection.create_channel().await.unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let queue = channel
            .queue_declare(dead.as_str().into(), passive, Default::default())
            .await
            .unwrap();
        assert_eq!(queue.message_count(), 1, "its letter is still there");
        // The exchange and partition queues the refused declare made before it stopped are
        // this process's scratch names: deleted at its exit.
        let _ = channel
            .queue_delete(dead.as_str().into(), Default::default())
            .await;
    });
}

/// A counter's value in a Prometheus scrape, summed over its labels' series (0 if absent).
fn counter(scrape: &str, name: &str) -> u64 {
    scrape
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?;
            rest.starts_with([' ', '{']).then_some(rest)
        })
        .filter_map(|rest| rest.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A tenant whose drainer fails on every drain (a row whose key it cannot read: inserted past
/// `relay_append`'s checks with an invalid branch id, so not even its branch can be parked)
/// while its host commits hundreds of NOTIFYing intents a second is restarted on its backoff
/// (100 ms doubling to 5 s), not at the host's commit rate. Before, every NOTIFY restarted it.
#[test]
fn a_failing_drainer_restarts_on_its_backoff_under_notify_load() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("cli_backoff").await;
        let topology = unique("relay-backoff");
        let poison = write_first_intent(&pool, "poison", b"x").await;
        sqlx::query(
            "INSERT INTO relay_outbox (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload)
             VALUES ($1, 'r', 'not a branch!', 1, 0, 0, 'x')",
        )
        .bind(poison.tenant.as_str())
        .execute(&pool)
        .await
        .unwrap();
        let addr = free_addr();
        let mut child = run_command(&url, &amqp_url(), &topology, &addr)
            .spawn()
            .unwrap();
        let restarts = || async {
            http_get(&addr, "/metrics").await.map_or(0, |(_, body)| {
                counter(&body, "relay_drainer_restarts_total")
            })
        };
        wait_until("the drainer fails", Duration::from_secs(30), || async {
            restarts().await >= 1
        })
        .await;
        // The host commits on the same tenant, each commit a NOTIFY, for 10 s.
        let before = restarts().await;
        let started = Instant::now();
        let (mut lsn, mut commits) = (1, 0u64);
        let writer = distribution::store::IntentWriter::default();
        while started.elapsed() < Duration::from_secs(10) {
            lsn += 1;
            let mut tx = pool.begin().await.unwrap();
            writer
                .append(&mut tx, &poison, distribution::store::Lsn::new(lsn), b"y")
                .await
                .unwrap();
            tx.commit().await.unwrap();
            commits += 1;
        }
        let elapsed = started.elapsed();
        let during = restarts().await - before;
        println!(
            "{commits} NOTIFYing commits in {elapsed:?}: {during} drainer restarts ({:.1}/s)",
            during as f64 / elapsed.as_secs_f64()
        );
        assert!(commits >= 500, "the host committed {commits} times");
        // 100 ms doubling to 5 s: at most about 7 restarts in 10 s, whatever the commits.
        assert!(
            during <= 12,
            "{during} restarts in {elapsed:?} under {commits} commits"
        );
        terminate(&mut child);
        drop_topology_named(&url, &topology).await;
    });
}

/// `distribution retire`: a closed run, every row of it shipped, closed longer ago than the
/// retention, is removed; one inside the retention is kept.
#[test]
fn retire_removes_closed_shipped_runs_past_the_retention() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("cli_retire").await;
        let outbox = Outbox::new(pool.clone());
        let writer = distribution::store::IntentWriter::default();
        let mut branches = Vec::new();
        for tenant in ["old", "new"] {
            let branch = write_first_intent(&pool, tenant, b"x").await;
            writer
                .close_run(
                    &mut pool.acquire().await.unwrap(),
                    &branch.tenant,
                    &branch.run,
                )
                .await
                .unwrap();
            // Shipped: drained and acked, as a relay would.
            let events = outbox.drain_outbox(&branch.tenant, 10).await.unwrap();
            assert_eq!(events.len(), 2, "the intent and the end marker");
            let keys: Vec<_> = events.iter().map(|event| event.key.clone()).collect();
            outbox.ack_outbox(&keys).await.unwrap();
            branches.push(branch);
        }
        sqlx::query(
            "UPDATE relay_branch SET closed_at = now() - interval '2 hours' WHERE tenant_id = $1",
        )
        .bind(branches[0].tenant.as_str())
        .execute(&pool)
        .await
        .unwrap();
        let (code, stdout, stderr) = output(
            relay_command()
                .args(["retire", "--retention-secs", "3600"])
                .env("DATABASE_URL", &url),
        );
        assert_eq!(code, 0, "{stderr}");
        assert!(stdout.contains("retired 1 closed runs"), "{stdout}");
        let left: Vec<String> = sqlx::query_scalar("SELECT DISTINCT tenant_id FROM relay_branch")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(left, vec!["new".to_owned()]);
    });
}

/// `distribution discard`: a parked branch's waiting intents are deleted, a rewind marker at
/// its last shipped Lsn takes their place, the branch is unparked and the run goes on on the
/// new branch; a branch that is not parked is refused (exit 1, saying so).
#[test]
fn discard_rewinds_a_parked_branch_at_its_last_shipped_lsn() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("cli_discard").await;
        let outbox = Outbox::new(pool.clone());
        let branch = write_first_intent(&pool, "acme", b"1").await;
        for lsn in 2..=3 {
            append_intent(&pool, &branch, lsn, b"later").await;
        }
        let first = outbox.drain_outbox(&branch.tenant, 1).await.unwrap();
        outbox.ack_outbox(&[first[0].key.clone()]).await.unwrap();
        let discard = |url: &str| {
            output(
                relay_command()
                    .args([
                        "discard",
                        "acme",
                        branch.run.as_str(),
                        branch.branch.as_str(),
                        "--to",
                        "after",
                    ])
                    .env("DATABASE_URL", url),
            )
        };
        let (code, _, stderr) = discard(&url);
        assert_eq!(code, 1, "not parked: refused");
        assert!(stderr.contains("not parked"), "{stderr}");
        outbox
            .park_branch(
                &branch,
                "returned",
                5,
                Duration::from_secs(60),
                Duration::from_secs(600),
            )
            .await
            .unwrap();
        let (code, stdout, stderr) = discard(&url);
        assert_eq!(code, 0, "{stderr}");
        assert!(
            stdout.contains("discarded 2 waiting intent(s)") && stdout.contains("ends at lsn 1"),
            "{stdout}"
        );
        let waiting = outbox.drain_outbox(&branch.tenant, 10).await.unwrap();
        assert_eq!(waiting.len(), 1, "only the marker waits: {waiting:?}");
        assert_eq!(
            waiting[0].prev_lsn.get(),
            1,
            "the fork: the last shipped Lsn"
        );
        assert!(outbox.parked_branches().await.unwrap().is_empty());
    });
}

/// `RELAY_LOG_FORMAT=json`: every line the relay writes on standard error is one JSON object
/// with a level and a message; the start names the broker's version and the workarounds on.
#[test]
fn json_logs_are_one_object_per_line() {
    host_runtime().block_on(async {
        let (_pool, url) = fresh_database("cli_json").await;
        let topology = unique("relay-json");
        let addr = free_addr();
        let mut child = run_command(&url, &amqp_url(), &topology, &addr)
            .env("RELAY_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .env("RELAY_QUEUE_TYPE", "stream")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        answer_until(&addr, "/readyz", |status| status == 200).await;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        // Read to its end (the process's exit) before waiting: a full pipe would block it.
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert_eq!(child.wait().unwrap().code(), Some(0));
        let lines: Vec<&str> = stderr.lines().collect();
        assert!(
            lines.len() >= 2,
            "the relay logged at start and stop: {stderr}"
        );
        for line in lines {
            let object: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|err| panic!("{err}: {line}"));
            assert!(object["level"].is_string(), "{line}");
            assert!(object["fields"]["message"].is_string(), "{line}");
        }
        // The start names the broker's version and, on streams, the workarounds in force.
        let said = |message: &str| {
            stderr.lines().any(|line| {
                line.contains(&format!("\"message\":\"{message}\""))
                    && line.contains("\"broker\":\"RabbitMQ ")
            })
        };
        assert!(said("broker"), "{stderr}");
        assert!(said("workaround on"), "{stderr}");
        drop_topology_named(&url, &topology).await;
    });
}

/// `cargo run --example orders` (README): a host and a consumer together. It exits 0 only if
/// the consumer's table equals the live history (the example checks it itself).
#[test]
fn the_orders_example_runs_to_the_end() {
    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_distribution"))
        .parent()
        .unwrap()
        .join("examples/orders");
    if !binary.exists() {
        // `cargo test --workspace` builds the examples; a run of this binary alone does not.
        let built = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["build", "--quiet", "--example", "orders"])
            .status()
            .unwrap();
        assert!(built.success(), "cargo build --example orders");
    }
    let mut command = Command::new(binary);
    command
        .env("DATABASE_URL", std::env::var("DATABASE_URL").unwrap())
        .env("AMQP_URL", amqp_url());
    let (code, stdout, stderr) = output_within(&mut command, Duration::from_secs(120));
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    println!("{stdout}");
}

/// `distribution run` on a private node, ready, its first intent shipped: where the readiness
/// tests start. The relay is killed when this drops; its log (INFO and the supervisor's and
/// actors' DEBUG lines) is printed if the test failed, then removed.
struct Shipping {
    relay: Process,
    log: std::path::PathBuf,
    addr: String,
    pool: sqlx::PgPool,
    branch: distribution::store::BranchKey,
    outbox: Outbox,
}

impl Shipping {
    async fn start(node: &PrivateNode, label: &str, settings: &[(&str, &str)]) -> Self {
        let (pool, url) = fresh_database(&format!("cli_{label}")).await;
        let addr = free_addr();
        let topology = unique(&format!("relay-{label}"));
        let log = std::env::temp_dir().join(unique(&format!("relay-{label}.log")));
        let relay = run_command(&url, &node.url(), &topology, &addr)
            .env(
                "RUST_LOG",
                "info,supervisor=debug,actors=debug,rabbit=debug,broker=debug,lapin=off",
            )
            .envs(settings.iter().copied())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        // Killed on drop from here on, if the relay never gets ready too.
        let relay = Process(relay);
        answer_until(&addr, "/readyz", |status| status == 200).await;
        let shipping = Self {
            relay,
            log,
            addr,
            outbox: Outbox::new(pool.clone()),
            branch: write_first_intent(&pool, label, b"1").await,
            pool,
        };
        wait_until(
            "the first intent ships",
            Duration::from_secs(30),
            || async { pending(&shipping.outbox).await == 0 },
        )
        .await;
        shipping
    }
}

impl Drop for Shipping {
    fn drop(&mut self) {
        // Stopped before its log is read (`Process` would stop it only after this).
        let _ = self.relay.0.kill();
        let _ = self.relay.0.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            println!("---- the relay's log ----\n{log}");
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// `/readyz` through a broker restart (`stop_app`, then `start_app`) with intents waiting:
/// not ready, saying why, while the broker is away; ready again, and everything shipped,
/// within 3 s of its taking connections again (RabbitMQ 3.10 and 4.0), though the drainer's
/// retries had grown to seconds: the relay checks the broker every 500 ms while a publisher
/// has had nothing confirmed since it failed. Before, the checks stopped once publishers had
/// restarted (they connect at their first publish), and one CI run took 5.25 s from
/// `start_app`'s return: the drainer's retry delay.
async fn readiness_through_a_restart(rabbit: crate::node::Rabbit) {
    let node = tokio::task::block_in_place(|| PrivateNode::start_on(rabbit, "readyrestart"));
    let shipping = Shipping::start(&node, "ready_restart", &[]).await;
    let (addr, pool, branch, outbox) = (
        &shipping.addr,
        &shipping.pool,
        &shipping.branch,
        &shipping.outbox,
    );

    tokio::task::block_in_place(|| node.stop_app());
    for lsn in 2..=10 {
        append_intent(pool, branch, lsn, b"during the restart").await;
    }
    let (_, body) = answer_until(addr, "/readyz", |status| status == 503).await;
    assert!(body.contains("broker down while intents wait"), "{body}");
    // Down until the drainer's retries have grown to seconds (its publisher restarted at each):
    // the broker's return must be noticed by the relay's check, not at the next retry.
    wait_until(
        "six publisher restarts",
        Duration::from_secs(60),
        || async {
            let scrape = http_get(addr, "/metrics").await.map(|(_, body)| body);
            counter(
                &scrape.unwrap_or_default(),
                "relay_publisher_restarts_total",
            ) >= 6
        },
    )
    .await;
    // The broker is back from the first moment it takes a connection (`start_app` returns
    // later, after its boot's last steps): the heal is measured from there.
    let url = node.url();
    let answering = tokio::spawn(async move {
        loop {
            let attempt = lapin::Connection::connect(&url, lapin::ConnectionProperties::default());
            if let Ok(Ok(connection)) = tokio::time::timeout(Duration::from_secs(1), attempt).await
            {
                let back = Instant::now();
                let _ = connection.close(200, "checked".into()).await;
                return back;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    tokio::task::block_in_place(|| node.start_app());
    let back = tokio::time::timeout(Duration::from_secs(60), answering)
        .await
        .expect("the broker takes a connection within 60 s of start_app's return")
        .unwrap();
    answer_until(addr, "/readyz", |status| status == 200).await;
    wait_until(
        "shipped once the broker is back",
        Duration::from_secs(30),
        || async { pending(outbox).await == 0 },
    )
    .await;
    let healed = back.elapsed();
    println!("ready and shipped {healed:?} after the broker's return");
    assert!(
        healed < Duration::from_secs(3),
        "ready and shipped only {healed:?} after the broker's return"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_says_the_broker_is_down_through_a_restart() {
    readiness_through_a_restart(crate::node::Rabbit::V3_10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_says_the_broker_is_down_through_a_restart_on_rabbitmq_4_0() {
    readiness_through_a_restart(crate::node::Rabbit::V4_0).await;
}

/// `distribution tail` watches events arrive without taking them from anyone: one line each
/// with the key, kind and metadata, the payload only when asked; `--tenant` and `--run` keep
/// that run's events alone (in Lsn order), `--json` writes one object per line, and every
/// event is still in the group's partition queues afterwards.
#[test]
fn tail_shows_each_event_once_and_takes_nothing_from_the_consumers() {
    use std::io::{BufRead, BufReader};

    host_runtime().block_on(async {
        let (pool, url) = fresh_database("cli_tail").await;
        let config = relay_config(&url, &amqp_url(), &unique("relay-tail"));
        let rabbit = config.rabbit_config().unwrap();
        declare_topology(&rabbit.topology).await;
        let test = async {
            // A tail of everything with payloads, and a JSON tail of one run without them;
            // each says on stderr when it watches.
            let tail = |args: &[&str]| {
                let mut child = relay_command()
                    .arg("tail")
                    .args(args)
                    .env("AMQP_URL", amqp_url())
                    .env("RELAY_TOPOLOGY", rabbit.topology.exchange().as_str())
                    .env("RELAY_PARTITIONS", rabbit.topology.partitions().to_string())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap();
                let mut said = String::new();
                BufReader::new(child.stderr.take().unwrap())
                    .read_line(&mut said)
                    .unwrap();
                assert!(said.starts_with("watching exchange"), "{said}");
                child
            };
            let everything = tail(&["--payload", "--count", "5"]);
            let one_run = tail(&[
                "--json", "--tenant", "tail-a", "--run", "r1", "--count", "3",
            ]);

            let writer = distribution::store::IntentWriter::default();
            let mut conn = pool.acquire().await.unwrap();
            let key = |tenant: &str, run: &str| {
                distribution::store::BranchKey::new(
                    distribution::store::TenantId::new(tenant).unwrap(),
                    distribution::store::RunId::new(run).unwrap(),
                    distribution::store::BranchId::new("main").unwrap(),
                )
            };
            let (watched, other, other_tenant) = (
                key("tail-a", "r1"),
                key("tail-a", "r2"),
                key("tail-b", "r1"),
            );
            for branch in [&watched, &other, &other_tenant] {
                writer.open_run(&mut conn, branch).await.unwrap();
            }
            for lsn in 1..=3u64 {
                let payload = format!("secret {lsn}");
                let intent = distribution::store::Intent::new(payload.as_bytes())
                    .event_type(distribution::store::EventType::new("order.placed").unwrap())
                    .header("region", "eu");
                writer
                    .append_intent(
                        &mut conn,
                        &watched,
                        distribution::store::Lsn::new(lsn),
                        intent,
                    )
                    .await
                    .unwrap();
            }
            for branch in [&other, &other_tenant] {
                writer
                    .append(
                        &mut conn,
                        branch,
                        distribution::store::Lsn::new(1),
                        b"other",
                    )
                    .await
                    .unwrap();
            }
            let relay = distribution::Relay::start(config.clone()).await.unwrap();
            let finished = |child: std::process::Child| {
                let output = child.wait_with_output().unwrap();
                assert!(output.status.success(), "{output:?}");
                String::from_utf8(output.stdout).unwrap()
            };
            let (everything, one_run) =
                tokio::task::spawn_blocking(move || (finished(everything), finished(one_run)))
                    .await
                    .unwrap();
            relay.shutdown().await;

            // One run's events, in Lsn order, with their metadata and no payload.
            let lines: Vec<serde_json::Value> = one_run
                .lines()
                .map(|line| serde_json::from_str(line).unwrap())
                .collect();
            let lsns: Vec<u64> = lines
                .iter()
                .map(|line| line["lsn"].as_u64().unwrap())
                .collect();
            assert_eq!(lsns, [1, 2, 3], "{one_run}");
            for line in &lines {
                assert_eq!(line["tenant"], "tail-a", "{line}");
                assert_eq!(line["run"], "r1", "{line}");
                assert_eq!(line["kind"], "intent", "{line}");
                assert_eq!(line["type"], "order.placed", "{line}");
                assert_eq!(line["headers"]["region"], "eu", "{line}");
                assert!(
                    line["written_at"].as_str().unwrap().ends_with('Z'),
                    "{line}"
                );
            }
            assert!(
                !one_run.contains("secret"),
                "no payload unless asked: {one_run}"
            );
            // Everything, each once, with payloads.
            for id in [
                format!("{watched}/1"),
                format!("{watched}/3"),
                format!("{other}/1"),
                format!("{other_tenant}/1"),
            ] {
                assert_eq!(
                    everything.matches(&format!(" {id} intent ")).count(),
                    1,
                    "{id} once in {everything}"
                );
            }
            assert!(
                everything.contains("payload (text): secret 2"),
                "{everything}"
            );

            // The consumers' copies are all still there.
            let connection =
                lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                    .await
                    .unwrap();
            let channel = connection.create_channel().await.unwrap();
            let mut queued = 0;
            for partition in 0..rabbit.topology.partitions() {
                let queue = channel
                    .queue_declare(
                        rabbit
                            .topology
                            .queue(distribution::broker::Partition(partition)),
                        lapin::options::QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        Default::default(),
                    )
                    .await
                    .unwrap();
                queued += queue.message_count();
            }
            assert_eq!(queued, 5);
        };
        then_clean_up(test, drop_topology(&rabbit.topology)).await;
    });
}

//! The relay on NATS JetStream (the machine's server, `NATS_URL`): the T7.4 acceptance steps
//! that do not need a consumer's fold, read straight from the stream. What the stream holds is
//! checked against what the host wrote: every live intent once, each branch in Lsn order, none
//! while the broker is away, and the outbox empty after.
use std::collections::BTreeMap;
use std::time::Duration;

use distribution::broker::CallProbe;
use distribution::store::{BranchKey, EventKey, EventKind, Lsn, Outbox, OutboxEvent};
use distribution::testing::BrokerProxy;
use distribution::{Relay, RelayConfig};

use crate::harness::*;

/// A relay configuration with test-speed timings, publishing to NATS at `nats_url`.
fn nats_config(database_url: &str, nats_url: &str, stream: &str) -> RelayConfig {
    let mut config = relay_config(database_url, "", stream);
    config.broker = distribution::BrokerKind::Nats;
    config.nats_url = nats_url.to_owned();
    config.nats_ack_timeout = Duration::from_secs(2);
    config
}

/// Every message the stream holds, in stream order (none if there is no stream yet).
async fn stored(stream: &str) -> Vec<OutboxEvent> {
    distribution::nats::scratch::read_stream(&testkit::nats_url(), stream)
        .await
        .into_iter()
        .map(|(_, event)| event.unwrap())
        .collect()
}

/// The intents the stream holds per branch, in stream order, as `Expected` has them; panics on
/// a copy stored twice.
fn intents_by_branch(events: &[OutboxEvent]) -> Expected {
    let mut by_branch = Expected::new();
    let mut seen = std::collections::BTreeSet::new();
    for event in events {
        assert!(
            seen.insert(event.key.clone()),
            "{} {} stored twice",
            event.key.branch,
            event.key.lsn
        );
        if event.kind == EventKind::Intent {
            by_branch
                .entry(event.key.branch.clone())
                .or_default()
                .push((event.key.lsn, event.payload.clone()));
        }
    }
    by_branch
}

/// Each branch's events (markers too) in ascending Lsn, in stream order.
fn assert_in_order(events: &[OutboxEvent]) {
    assert_late_only_if_refused(events, &std::collections::BTreeSet::new());
}

/// Each branch's events in ascending Lsn, in stream order, but for events of `refused`: the
/// server refused a send of each, so its first stored copy is a later send's, and may follow
/// later events of its branch that a pipelined send carried behind it and the server took (room
/// made between the two). WIRE.md allows it ("a resend can follow a later message of the same
/// branch"); the fold holds the later events back until it comes.
fn assert_late_only_if_refused(
    events: &[OutboxEvent],
    refused: &std::collections::BTreeSet<EventKey>,
) {
    let mut highest: BTreeMap<&BranchKey, Lsn> = BTreeMap::new();
    let mut late = Vec::new();
    for event in events {
        match highest.get_mut(&event.key.branch) {
            Some(top) if *top >= event.key.lsn => late.push((&event.key, *top)),
            Some(top) => *top = event.key.lsn,
            None => {
                highest.insert(&event.key.branch, event.key.lsn);
            }
        }
    }
    if !refused.is_empty() {
        let shown: Vec<String> = late
            .iter()
            .map(|(key, after)| format!("{}@{} after {after}", key.branch, key.lsn))
            .collect();
        println!("stored after a later event of its branch: {shown:?}");
    }
    for (key, after) in late {
        assert!(
            refused.contains(key),
            "{}: {} stored after {after}, though no send of it was refused",
            key.branch,
            key.lsn
        );
    }
}

/// Steps 1-4 and 7 of T7.4 on NATS: the broker is away for a whole run, which completes at its
/// normal pace; nothing of it is stored meanwhile; when NATS is back every live intent is
/// stored once, in Lsn order per branch, across tenants, runs and branches (a rewind among
/// them); the outbox empties; the client never ran on a host thread.
#[test]
fn nats_broker_down_for_a_whole_run_then_everything_is_stored_once_in_order() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("nats_down").await;
        let proxy = BrokerProxy::start(&testkit::nats_url()).unwrap();
        let stream = distribution::nats::scratch::unique_stream("down");
        let probe = CallProbe::new();
        let mut config = nats_config(&url, &proxy.url(), &stream);
        config.probe = Some(probe.clone());
        let relay = Relay::start(config).await.unwrap();
        let outbox = Outbox::new(pool.clone());

        let baseline = Workload::new("up", 3, 2, 30).run(&pool).await;
        wait_until("the first run stored", Duration::from_secs(30), || async {
            stored(&stream).await.len() == count(&baseline.expected)
        })
        .await;
        proxy.cut();
        let mut down_workload = Workload::new("down", 3, 2, 30);
        down_workload.rewind = true;
        let down = down_workload.run(&pool).await;
        let ratio = down.elapsed.as_secs_f64() / baseline.elapsed.as_secs_f64();
        println!(
            "host run: NATS up {:.3} s, down {:.3} s, ratio {ratio:.2}",
            baseline.elapsed.as_secs_f64(),
            down.elapsed.as_secs_f64()
        );
        assert!(
            ratio <= 3.0,
            "the run was {ratio:.2}x slower with NATS away"
        );
        assert_eq!(
            stored(&stream).await.len(),
            count(&baseline.expected),
            "nothing stored while NATS is away"
        );

        proxy.restore();
        let mut all = baseline.expected.clone();
        merge(&mut all, &down.expected);
        let markers = down.rewinds;
        wait_until("every event stored", Duration::from_secs(60), || async {
            stored(&stream).await.len() == count(&all) + markers
        })
        .await;
        let events = stored(&stream).await;
        assert_in_order(&events);
        assert_eq!(
            intents_by_branch(&events),
            all,
            "every live intent, once, as written"
        );
        wait_until("backlog empty", Duration::from_secs(10), || async {
            pending(&outbox).await == 0
        })
        .await;

        let calls = probe.calls_by_thread();
        assert!(!calls.is_empty(), "the probe saw no broker call at all");
        for (thread, n_calls) in &calls {
            assert!(
                thread.starts_with("outbox-relay"),
                "{n_calls} broker calls from thread {thread}"
            );
        }
        relay.shutdown().await;
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
    });
}

/// An embedding host's `nats_server_version` is held by `Relay::start` as by the binary: the
/// machine's server under a requirement above its version is refused in one line naming both,
/// before any stream is declared; under one it meets, the relay starts. Before, the library
/// ignored the field and only `distribution run` checked it.
#[test]
fn nats_an_embedded_relay_is_held_to_the_required_server_version() {
    host_runtime().block_on(async {
        let (_pool, url) = fresh_database("nats_embedded_version").await;
        let stream = distribution::nats::scratch::unique_stream("embedded-version");
        let client = async_nats::connect(testkit::nats_url()).await.unwrap();
        let version = client.server_info().version;
        let mut config = nats_config(&url, &testkit::nats_url(), &stream);
        config.nats_server_version = Some(format!(">{version}").parse().unwrap());
        match Relay::start(config.clone()).await {
            Err(distribution::RelayError::BrokerVersion(line)) => assert_eq!(
                line,
                format!("NATS {version} does not meet RELAY_NATS_SERVER_VERSION=>{version}")
            ),
            Err(other) => panic!("refused for another reason: {other}"),
            Ok(_) => panic!("started on NATS {version} under >{version}"),
        }
        let jetstream = async_nats::jetstream::new(client);
        assert!(
            jetstream.get_stream(&stream).await.is_err(),
            "a refused relay declared its stream"
        );
        config.nats_server_version = Some(format!(">={version}").parse().unwrap());
        let relay = Relay::start(config).await.expect("a server that meets it");
        relay.shutdown().await;
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
    });
}

/// `RELAY_CLOUDEVENTS=true` on NATS: each message carries the CloudEvents NATS binding's
/// attributes (binary content mode) as WIRE.md says, read here as a binding reader would (one
/// round of percent-decoding), and still decodes to the event the host wrote.
#[test]
fn nats_cloudevents_attributes_travel_as_the_bindings_ce_headers() {
    use distribution::store::{EventType, Intent, IntentWriter};
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("nats_ce").await;
        let stream = distribution::nats::scratch::unique_stream("ce");
        let mut config = nats_config(&url, &testkit::nats_url(), &stream);
        config.wire_mode = distribution::broker::WireMode::CloudEvents;
        let relay = Relay::start(config).await.unwrap();
        let branch = testkit::branch("acme", "run-ce", "main");
        let intents = [
            Intent::new(b"{\"n\":1}")
                .event_type(EventType::new("order.placed").unwrap())
                .content_type("text/plain; charset=\"utf-8\""),
            Intent::new(b"raw"),
        ];
        let writer = IntentWriter::default();
        let mut tx = pool.begin().await.unwrap();
        writer.open_run(&mut tx, &branch).await.unwrap();
        for (lsn, intent) in (1..).zip(intents) {
            writer
                .append_intent(&mut tx, &branch, Lsn::new(lsn), intent)
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        let nats = testkit::nats_url();
        wait_until("both stored", Duration::from_secs(30), || async {
            stored(&stream).await.len() == 2
        })
        .await;

        let expected = [
            (
                "1",
                "order.placed",
                "text/plain;%20charset=%22utf-8%22",
                "text/plain; charset=\"utf-8\"",
            ),
            (
                "2",
                "outbox.intent",
                "application/octet-stream",
                "application/octet-stream",
            ),
        ];
        let messages = distribution::nats::scratch::read_headers(&nats, &stream).await;
        let events = stored(&stream).await;
        for ((headers, event), (lsn, kind, raw_type, content_type)) in
            messages.iter().zip(&events).zip(expected)
        {
            let get = |name: &str| {
                let found: Vec<&str> = headers
                    .iter()
                    .filter(|(n, _)| n.as_str() == name)
                    .map(|(_, v)| v.as_str())
                    .collect();
                assert_eq!(found.len(), 1, "{name} once in {headers:?}");
                found[0].to_owned()
            };
            let id = format!("acme/run-ce/main/{lsn}");
            assert_eq!(get("Nats-Msg-Id"), id);
            assert_eq!(get("ce-specversion"), "1.0");
            assert_eq!(get("ce-id"), id);
            assert_eq!(get("ce-source"), "/acme/run-ce");
            assert_eq!(get("ce-subject"), "main");
            assert_eq!(get("ce-type"), kind);
            assert_eq!(get("ce-datacontenttype"), raw_type);
            let time = get("ce-time");
            let time = chrono::DateTime::parse_from_rfc3339(&time).unwrap();
            assert_eq!(time, event.created_at, "ce-time is created_at");
            let read = percent_encoding::percent_decode_str(raw_type)
                .decode_utf8()
                .unwrap();
            assert_eq!(read, content_type, "one round of percent-decoding");
            assert!(
                !headers
                    .iter()
                    .any(|(name, _)| name.eq_ignore_ascii_case("content-type")),
                "no Content-Type header: a binding reader takes the message for binary mode"
            );
            assert_eq!(event.key.lsn, Lsn::new(lsn.parse().unwrap()));
        }
        assert_eq!(events[0].payload, b"{\"n\":1}");
        assert_eq!(
            events[0].meta.content_type.as_deref(),
            Some("text/plain; charset=\"utf-8\""),
            "the contract's own header still carries it"
        );
        assert!(
            events.iter().all(|e| e.meta.headers.is_empty()),
            "no ce-* taken for the host's"
        );
        relay.shutdown().await;
        distribution::nats::scratch::delete_stream(&nats, &stream).await;
    });
}

/// Connections reset while the relay ships: acks that were on their way are lost, their
/// events sent again with the same `Nats-Msg-Id`, and the stream drops the copies; each branch
/// stays in order, nothing is lost, and the outbox empties.
#[test]
fn nats_connections_reset_mid_stream_store_each_event_once_in_order() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("nats_reset").await;
        let proxy = BrokerProxy::start(&testkit::nats_url()).unwrap();
        let stream = distribution::nats::scratch::unique_stream("reset");
        let relay = Relay::start(nats_config(&url, &proxy.url(), &stream))
            .await
            .unwrap();
        let outbox = Outbox::new(pool.clone());
        let workload = Workload::new("reset", 4, 2, 25);
        let mut ran = workload.run(&pool).await;
        let mut all = ran.expected.clone();
        for round in 0..4u64 {
            // Reset every connection while the relay has events in flight, then write more.
            proxy.cut();
            proxy.restore();
            let from = 26 + round * 25;
            ran = workload.steps(&pool, ran.live, from..=from + 24).await;
            merge(&mut all, &ran.expected);
        }
        wait_until("every event stored", Duration::from_secs(60), || async {
            stored(&stream).await.len() >= count(&all)
        })
        .await;
        wait_until("backlog empty", Duration::from_secs(20), || async {
            pending(&outbox).await == 0
        })
        .await;
        let events = stored(&stream).await;
        assert_in_order(&events);
        assert_eq!(intents_by_branch(&events), all);
        relay.shutdown().await;
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
    });
}

/// Which NATS server a private node runs.
#[derive(Clone, Copy, Debug)]
enum NatsVersion {
    /// The machine's (Debian 12's 2.9.10).
    Machine,
    /// Debian 13's 2.10, in the root of `scripts/rabbitmq-root`.
    Trixie,
}

/// A NATS server of the test's own (JetStream on a scratch store, a free port), killed with
/// the test: faults the machine's server must never see.
struct PrivateNats {
    version: NatsVersion,
    port: u16,
    /// A configuration file (the server sees it at this path), instead of the flags.
    config: Option<std::path::PathBuf>,
    /// The store as the server sees it (inside the root for 2.10).
    store: std::path::PathBuf,
    /// The store as this process sees it.
    store_here: std::path::PathBuf,
    process: Option<Process>,
}

impl PrivateNats {
    fn start(version: NatsVersion) -> Self {
        let name = testkit::unique("relay-nats-store");
        let (store, store_here) = match version {
            NatsVersion::Machine => {
                let path = std::env::temp_dir().join(&name);
                (path.clone(), path)
            }
            NatsVersion::Trixie => {
                let inside = std::path::Path::new("/tmp").join(&name);
                let root = crate::node::rabbitmq4_root();
                (inside.clone(), root.join(inside.strip_prefix("/").unwrap()))
            }
        };
        let mut server = Self {
            version,
            port: testkit::free_port(),
            config: None,
            store,
            store_here,
            process: None,
        };
        server.run();
        server
    }

    /// The machine's server with its JetStream store limited to `max_file_store` bytes (a
    /// server whose disk fills).
    fn with_store_limit(max_file_store: u64) -> Self {
        let store = std::env::temp_dir().join(testkit::unique("relay-nats-small"));
        std::fs::create_dir_all(&store).unwrap();
        let port = testkit::free_port();
        let conf = store.join("server.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{}\", max_file_store: {max_file_store} }}\n",
                store.join("js").display()
            ),
        )
        .unwrap();
        let mut server = Self {
            version: NatsVersion::Machine,
            port,
            config: Some(conf),
            store: store.clone(),
            store_here: store,
            process: None,
        };
        server.run();
        server
    }

    /// Node `i` of a cluster: `ports[i]` its client port, `routes[i]` its route port, its
    /// configuration and store under `store` (as the server sees it; `store_here` as this
    /// process does); not started.
    fn node(
        version: NatsVersion,
        i: usize,
        ports: &[u16],
        routes: &[u16],
        (store, store_here): (&std::path::Path, &std::path::Path),
    ) -> Self {
        let routes_list: Vec<String> = routes
            .iter()
            .map(|port| format!("\"nats-route://127.0.0.1:{port}\""))
            .collect();
        std::fs::create_dir_all(store_here).unwrap();
        std::fs::write(
            store_here.join(format!("n{i}.conf")),
            format!(
                "server_name: n{i}\nlisten: 127.0.0.1:{}\njetstream {{ store_dir: \"{}\" }}\n\
                 log_file: \"{}\"\n\
                 cluster {{ name: relay, listen: 127.0.0.1:{}, routes: [{}] }}\n",
                ports[i],
                store.join(format!("n{i}")).display(),
                store.join(format!("n{i}.log")).display(),
                routes[i],
                routes_list.join(", ")
            ),
        )
        .unwrap();
        Self {
            version,
            port: ports[i],
            config: Some(store.join(format!("n{i}.conf"))),
            store: store.to_owned(),
            store_here: store_here.to_owned(),
            process: None,
        }
    }

    /// Starts the server (again) on its port and store, and waits until it answers.
    fn run(&mut self) {
        let mut command = match self.version {
            NatsVersion::Machine => std::process::Command::new("nats-server"),
            NatsVersion::Trixie => {
                let mut chroot = std::process::Command::new("chroot");
                chroot
                    .arg(crate::node::rabbitmq4_root())
                    .arg("/usr/sbin/nats-server");
                chroot
            }
        };
        match &self.config {
            Some(config) => command.arg("-c").arg(config),
            None => command
                .args([
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-js",
                    "-sd",
                ])
                .arg(&self.store),
        };
        // A cluster's node writes its log to a file (its configuration says where); what it
        // says before the log opens (a bad configuration, a panic) goes to `n<i>.err` beside it.
        let stderr = match &self.config {
            Some(config) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(
                    self.store_here
                        .join(config.file_name().unwrap())
                        .with_extension("err"),
                )
                .unwrap()
                .into(),
            None => std::process::Stdio::null(),
        };
        let child = command
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("nats-server (Debian's nats-server package)");
        self.process = Some(Process(child));
        let addr = format!("127.0.0.1:{}", self.port);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not answer on {addr}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn signal(&self, signal: &str) {
        self.process.as_ref().expect("running").signal(signal);
    }

    /// SIGKILL: what it had not written to its store is gone with it.
    fn kill(&mut self) {
        self.signal("-KILL");
        if let Some(mut process) = self.process.take() {
            let _ = process.0.wait();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        drop(self.process.take());
        let _ = std::fs::remove_dir_all(&self.store_here);
    }
}

/// Every message of `stream` on `server`, decoded.
async fn stored_on(server: &PrivateNats, stream: &str) -> Vec<OutboxEvent> {
    distribution::nats::scratch::read_stream(&server.url(), stream)
        .await
        .into_iter()
        .map(|(_, event)| event.unwrap())
        .collect()
}

/// What a server's fault may cost: nothing lost, nothing stored twice, each branch in Lsn
/// order. The fault lands while the relay ships a backlog (written while a proxy held the relay
/// away from the server), with hundreds of events in flight, and the host writes on after it.
async fn survives(label: &str, version: NatsVersion, fault: impl AsyncFnOnce(&mut PrivateNats)) {
    let (pool, url) = fresh_database(label).await;
    let mut server = PrivateNats::start(version);
    let proxy = BrokerProxy::start(&server.url()).unwrap();
    let stream = distribution::nats::scratch::unique_stream(label);
    let relay = Relay::start(nats_config(&url, &proxy.url(), &stream))
        .await
        .unwrap();
    let outbox = Outbox::new(pool.clone());
    let workload = Workload::new(label, 4, 2, 20);
    let mut ran = workload.run(&pool).await;
    let mut all = ran.expected.clone();
    proxy.cut();
    ran = workload.steps(&pool, ran.live, 21..=420).await;
    merge(&mut all, &ran.expected);
    let backlog = pending(&outbox).await;
    proxy.restore();
    wait_until("the backlog shipping", Duration::from_secs(30), || async {
        pending(&outbox).await + 300 < backlog
    })
    .await;
    let waiting = pending(&outbox).await;
    fault(&mut server).await;
    println!("{label}: {waiting} of a backlog of {backlog} events pending at the fault");
    ran = workload.steps(&pool, ran.live, 421..=440).await;
    merge(&mut all, &ran.expected);
    wait_until("backlog empty", Duration::from_secs(60), || async {
        pending(&outbox).await == 0
    })
    .await;
    let events = stored_on(&server, &stream).await;
    assert_in_order(&events);
    assert_eq!(intents_by_branch(&events), all);
    relay.shutdown().await;
}

async fn kill_and_restart(server: &mut PrivateNats) {
    server.kill();
    tokio::time::sleep(Duration::from_secs(1)).await; // the outage's length, not a wait for a state
    server.run();
}

async fn freeze(server: &mut PrivateNats) {
    server.signal("-STOP");
    tokio::time::sleep(Duration::from_secs(3)).await; // the freeze's length (ack timeout 2 s)
    server.signal("-CONT");
}

/// The server killed (SIGKILL) while the relay ships, and started again on its store 1 s
/// later: every acked event survives, the unacked ones are sent again, none is stored twice,
/// and each branch stays in order.
#[test]
fn nats_a_server_killed_mid_stream_and_restarted_loses_nothing_and_keeps_order() {
    host_runtime().block_on(survives(
        "nats_killed",
        NatsVersion::Machine,
        kill_and_restart,
    ));
}

/// The same on NATS 2.10.
#[test]
fn nats_a_server_killed_mid_stream_and_restarted_loses_nothing_and_keeps_order_on_2_10() {
    host_runtime().block_on(survives(
        "nats_killed_2_10",
        NatsVersion::Trixie,
        kill_and_restart,
    ));
}

/// The server frozen (SIGSTOP) for longer than the ack timeout while the relay ships: its acks
/// time out, though it stores everything once it resumes; the relay's resends are dropped by
/// their ids, and each branch stays in order.
#[test]
fn nats_a_server_frozen_past_the_ack_timeout_stores_each_event_once_in_order() {
    host_runtime().block_on(survives("nats_frozen", NatsVersion::Machine, freeze));
}

/// The same on NATS 2.10.
#[test]
fn nats_a_server_frozen_past_the_ack_timeout_stores_each_event_once_in_order_on_2_10() {
    host_runtime().block_on(survives("nats_frozen_2_10", NatsVersion::Trixie, freeze));
}

/// How many sends of each branch a NATS double was told there is no room for, and which events.
#[derive(Default)]
struct NoRoomSeen {
    calls: std::sync::Mutex<Vec<Vec<EventKey>>>,
    refused: std::sync::Mutex<BTreeMap<BranchKey, u32>>,
    refused_events: std::sync::Mutex<std::collections::BTreeSet<EventKey>>,
}

impl NoRoomSeen {
    /// The fewest sends refused for want of room of any of `branches`.
    fn fewest(&self, branches: impl Iterator<Item = BranchKey>) -> u32 {
        let refused = self.refused.lock().unwrap();
        branches
            .map(|branch| refused.get(&branch).copied().unwrap_or(0))
            .min()
            .unwrap_or(0)
    }

    /// Every event a send of which was refused for want of room.
    fn refused_events(&self) -> std::collections::BTreeSet<EventKey> {
        self.refused_events.lock().unwrap().clone()
    }
}

impl crate::double::Observer for NoRoomSeen {
    fn writing(&self, events: &[OutboxEvent]) -> usize {
        let mut calls = self.calls.lock().unwrap();
        calls.push(events.iter().map(|event| event.key.clone()).collect());
        calls.len() - 1
    }
    fn written(&self, _call: usize) {}
    fn confirmed(&self, call: usize, report: &distribution::broker::PublishReport) {
        let calls = self.calls.lock().unwrap();
        let events: Vec<&EventKey> = calls[call]
            .iter()
            .zip(&report.outcomes)
            .filter(|(_, outcome)| **outcome == distribution::broker::Outcome::NoRoom)
            .map(|(key, _)| key)
            .collect();
        let branches: std::collections::BTreeSet<&BranchKey> =
            events.iter().map(|key| &key.branch).collect();
        let mut refused = self.refused.lock().unwrap();
        for branch in branches {
            *refused.entry(branch.clone()).or_default() += 1;
        }
        self.refused_events
            .lock()
            .unwrap()
            .extend(events.into_iter().cloned());
    }
}

/// Publishes 1 KiB messages to a stream of their own until the server refuses one for want of
/// room: the store is full.
async fn fill_the_store(url: &str) {
    let client = async_nats::connect(url).await.unwrap();
    let context = async_nats::jetstream::new(client);
    context
        .create_stream(async_nats::jetstream::stream::Config {
            name: "ballast".into(),
            subjects: vec!["ballast".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    for sent in 0.. {
        assert!(sent < 100_000, "the store never filled");
        let published = context.publish("ballast", vec![0u8; 1024].into()).await;
        match published.unwrap().await {
            Ok(_) => {}
            Err(err) => {
                assert!(err.to_string().contains("10023"), "{err}");
                return;
            }
        }
    }
}

/// A server whose store fills while the relay ships (NATS answers "insufficient resources",
/// 10023, to every publish): every branch waits and is retried, none is parked however long it
/// lasts (a nack would park after the grace, here 100 ms and 2 attempts), and once room is made
/// everything ships with no operator releasing anything: each event once, none stored after a
/// later event of its branch unless the server refused a send of it, the fold exact, the outbox
/// empty.
#[test]
fn nats_a_full_store_parks_nothing_and_everything_ships_once_room_is_made() {
    use crate::double::{Double, Script};

    host_runtime().block_on(async {
        let (pool, url) = fresh_database("nats_full").await;
        let server = PrivateNats::with_store_limit(2 << 20);
        let stream = distribution::nats::scratch::unique_stream("full");
        let mut config = nats_config(&url, &server.url(), &stream);
        config.supervisor.drainer.park_after_attempts = 2;
        config.supervisor.drainer.nack_grace = Duration::from_millis(100);
        let seen = std::sync::Arc::new(NoRoomSeen::default());
        let nats = config.nats_config().unwrap();
        let observer: std::sync::Arc<dyn crate::double::Observer> = seen.clone();
        let factory: distribution::PublisherFactory = std::sync::Arc::new(move |_shard| {
            Double::nats(
                nats.clone(),
                Script {
                    observer: Some(observer.clone()),
                    ..Script::default()
                },
            )
        });
        let relay = Relay::start_with(config, factory).await.unwrap();
        let outbox = Outbox::new(pool.clone());
        let workload = Workload::new("nats_full", 4, 2, 60);
        let mut ran = workload.run(&pool).await;
        let mut all = ran.expected.clone();
        wait_until("the first steps shipped", Duration::from_secs(30), || async {
            pending(&outbox).await == 0
        })
        .await;

        fill_the_store(&server.url()).await;
        ran = workload.steps(&pool, ran.live, 61..=100).await;
        merge(&mut all, &ran.expected);
        // Each branch refused in 10 sends, its retries 20 ms to 300 ms apart: long past what
        // parks a nacked one.
        wait_until(
            "every branch refused again and again, or one parked",
            Duration::from_secs(60),
            || async {
                seen.fewest(all.keys().cloned()) >= 10
                    || !outbox.parked_branches().await.unwrap().is_empty()
            },
        )
        .await;
        let parked = outbox.parked_branches().await.unwrap();
        assert!(parked.is_empty(), "parked: {parked:?}");
        let waiting = pending(&outbox).await;
        assert!(waiting > 0, "the full store took nothing");
        println!(
            "every branch refused in at least {} sends for want of room, {waiting} events waiting, none parked",
            seen.fewest(all.keys().cloned())
        );

        // Room is made (the ballast deleted): everything ships, nobody releases anything.
        distribution::nats::scratch::delete_stream(&server.url(), "ballast").await;
        ran = workload.steps(&pool, ran.live, 101..=110).await;
        merge(&mut all, &ran.expected);
        wait_until("backlog empty", Duration::from_secs(60), || async {
            pending(&outbox).await == 0
        })
        .await;
        let parked = outbox.parked_branches().await.unwrap();
        assert!(parked.is_empty(), "parked: {parked:?}");
        let events = stored_on(&server, &stream).await;
        // Room is made while sends are in flight: an event of a branch can be refused and a
        // later one of it, behind it in the same pipelined send, taken.
        assert_late_only_if_refused(&events, &seen.refused_events());
        crate::recorder::assert_folds_to(&events, &all);
        let mut stored = intents_by_branch(&events);
        stored.values_mut().for_each(|intents| intents.sort());
        assert_eq!(stored, all, "the stream holds each live intent once");
        relay.shutdown().await;
    });
}

/// Relays handing tenants over on NATS: a second relay joins while the first drains a backlog
/// (a planned handover of half the tenants), then the first crashes (its leases expire, the
/// second takes everything). Each event is stored once, each branch in order, the outbox
/// empties: the leases and fences are the broker's business no more than before.
#[test]
fn nats_relays_joining_and_crashing_under_a_backlog_store_each_event_once_in_order() {
    host_runtime().block_on(async {
        let (_, url) = testkit::empty_database("nats_handover").await;
        let (pool, mut config) = quick_leases_on(&url, "nats_handover").await;
        let stream = distribution::nats::scratch::unique_stream("handover");
        config.topology = stream.clone();
        config.broker = distribution::BrokerKind::Nats;
        config.nats_url = testkit::nats_url();
        config.nats_ack_timeout = Duration::from_secs(2);
        // Small batches and budgets: the backlog takes seconds, so the join and the crash land
        // while it ships.
        config.supervisor.drainer.batch_size = 5;
        config.supervisor.max_in_flight = 20;
        let outbox = Outbox::new(pool.clone());
        let workload = Workload::new("nats_handover", 12, 2, 200);
        let ran = workload.run(&pool).await;
        let backlog = pending(&outbox).await;
        let first = Relay::start(config.clone()).await.unwrap();
        wait_until(
            "the first relay shipping",
            Duration::from_secs(30),
            || async { pending(&outbox).await < backlog },
        )
        .await;
        let second = Relay::start(config.clone()).await.unwrap();
        wait_until(
            "both relays holding tenants",
            Duration::from_secs(30),
            || async { buckets(&first).await > 0 && buckets(&second).await > 0 },
        )
        .await;
        let waiting = pending(&outbox).await;
        first.abort().await; // a crash, with batches in flight
        println!("{waiting} of {backlog} events pending when the first relay crashed");
        let more = workload.steps(&pool, ran.live.clone(), 201..=210).await;
        let mut all = ran.expected.clone();
        merge(&mut all, &more.expected);
        wait_until("backlog empty", Duration::from_secs(60), || async {
            pending(&outbox).await == 0
        })
        .await;
        let events = stored(&stream).await;
        assert_in_order(&events);
        assert_eq!(intents_by_branch(&events), all);
        second.shutdown().await;
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
    });
}

/// Three NATS servers in one cluster, each on its own ports and store under one scratch
/// directory, stopped and removed with the test.
struct PrivateNatsCluster {
    nodes: Vec<PrivateNats>,
    store: std::path::PathBuf,
}

impl PrivateNatsCluster {
    fn start(version: NatsVersion) -> Self {
        let name = testkit::unique("relay-nats-cluster");
        let (store, store_here) = match version {
            NatsVersion::Machine => {
                let path = std::env::temp_dir().join(&name);
                (path.clone(), path)
            }
            NatsVersion::Trixie => {
                let inside = std::path::Path::new("/tmp").join(&name);
                let root = crate::node::rabbitmq4_root();
                (inside.clone(), root.join(inside.strip_prefix("/").unwrap()))
            }
        };
        let ports: Vec<u16> = (0..3).map(|_| testkit::free_port()).collect();
        let routes: Vec<u16> = (0..3).map(|_| testkit::free_port()).collect();
        let nodes: Vec<PrivateNats> = (0..3)
            .map(|i| PrivateNats::node(version, i, &ports, &routes, (&store, &store_here)))
            .collect();
        // The cluster first, then its servers: one that never answers panics in `run`, and
        // the cluster's drop prints every node's log.
        let mut cluster = Self {
            nodes,
            store: store_here,
        };
        for node in &mut cluster.nodes {
            node.run();
        }
        cluster
    }

    /// Every node's URL, comma-separated (what `NATS_URL` takes).
    fn urls(&self) -> String {
        let urls: Vec<String> = self.nodes.iter().map(PrivateNats::url).collect();
        urls.join(",")
    }

    /// Waits until the cluster places a stream on all three nodes: a fresh 2.10 cluster does so
    /// about 10 s after its servers answer (measured here, idle and loaded alike). Until then a
    /// 3-replica stream is refused with "no suitable peers for placement", which a test of a
    /// fault should not count against its own clock (CI once timed out 30 s into a test that
    /// started before the cluster formed).
    async fn formed(&mut self) {
        let probe = distribution::nats::scratch::unique_stream("probe");
        let started = std::time::Instant::now();
        let first = self.nodes[0].url();
        let placed = async || {
            let Ok(client) = async_nats::connect(&first).await else {
                return false;
            };
            let context = async_nats::jetstream::new(client);
            let created = context
                .create_stream(async_nats::jetstream::stream::Config {
                    name: probe.clone(),
                    subjects: vec![format!("{probe}.>")],
                    num_replicas: 3,
                    ..Default::default()
                })
                .await;
            created.is_ok() && context.delete_stream(&probe).await.is_ok()
        };
        while !placed().await {
            for (i, node) in self.nodes.iter_mut().enumerate() {
                if let Some(process) = node.process.as_mut()
                    && let Ok(Some(status)) = process.0.try_wait()
                {
                    panic!("n{i} exited ({status}) before the cluster formed; its log follows");
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(90),
                "the NATS cluster placed no 3-replica stream in 90 s; the nodes' logs follow"
            );
            // Polling pace, not synchronisation.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        println!(
            "the NATS cluster placed a 3-replica stream {:.1} s after its servers answered",
            started.elapsed().as_secs_f64()
        );
    }

    /// The node leading `stream`, asked of any node that answers.
    async fn leader_of(&self, stream: &str) -> usize {
        for node in &self.nodes {
            let Ok(client) = async_nats::connect(node.url()).await else {
                continue;
            };
            let context = async_nats::jetstream::new(client);
            if let Ok(mut found) = context.get_stream(stream).await
                && let Ok(info) = found.info().await
                && let Some(leader) = info.cluster.as_ref().and_then(|c| c.leader.clone())
            {
                return leader.trim_start_matches('n').parse().unwrap();
            }
        }
        panic!("no node names a leader of {stream}");
    }
}

impl Drop for PrivateNatsCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The servers' own account of a failed run, before the store goes.
            for file in (0..3).flat_map(|i| [format!("n{i}.err"), format!("n{i}.log")]) {
                let log = std::fs::read_to_string(self.store.join(&file)).unwrap_or_default();
                let lines: Vec<&str> = log.lines().collect();
                println!("---- {file}, its last 60 lines ----");
                for line in &lines[lines.len().saturating_sub(60)..] {
                    println!("{line}");
                }
            }
        }
        self.nodes.clear(); // each node removes the store it shares with the others
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// A 3-node JetStream cluster, the stream on 3 replicas: its leader's server killed (SIGKILL)
/// while the relay ships a backlog, and started again 2 s later. The election answers "no
/// responders" for seconds (the relay's sessions fault and retry, never give up), every acked
/// event survives, none is stored twice, each branch stays in order, the outbox empties.
#[test]
fn nats_the_stream_leader_killed_on_a_3_node_cluster_loses_nothing_and_keeps_order() {
    host_runtime().block_on(async {
        let (pool, url) = fresh_database("nats_leader").await;
        let mut cluster = PrivateNatsCluster::start(NatsVersion::Machine);
        let stream = distribution::nats::scratch::unique_stream("leader");
        let mut config = nats_config(&url, &cluster.urls(), &stream);
        config.nats_replicas = 3;
        // Small batches and budgets: the backlog takes seconds, so the kill lands while it
        // ships.
        config.supervisor.drainer.batch_size = 5;
        config.supervisor.max_in_flight = 20;
        let outbox = Outbox::new(pool.clone());
        let workload = Workload::new("nats_leader", 12, 2, 200);
        let mut ran = workload.run(&pool).await;
        let mut all = ran.expected.clone();
        let backlog = pending(&outbox).await;
        // The cluster elects its JetStream leader after it forms: the relay's first sessions
        // may find no JetStream yet, and retry.
        let relay = Relay::start(config).await.unwrap();
        wait_until("the backlog shipping", Duration::from_secs(60), || async {
            pending(&outbox).await + 300 < backlog
        })
        .await;
        let leader = cluster.leader_of(&stream).await;
        let waiting = pending(&outbox).await;
        cluster.nodes[leader].kill();
        let killed_at = std::time::Instant::now();
        println!(
            "killed n{leader}, the stream's leader, with {waiting} of {backlog} events pending"
        );
        tokio::time::sleep(Duration::from_secs(2)).await; // the outage's length
        cluster.nodes[leader].run();
        ran = workload.steps(&pool, ran.live, 201..=210).await;
        merge(&mut all, &ran.expected);
        wait_until("backlog empty", Duration::from_secs(90), || async {
            pending(&outbox).await == 0
        })
        .await;
        println!(
            "the outbox empty {:.1} s after the kill",
            killed_at.elapsed().as_secs_f64()
        );
        let survivor = (leader + 1) % 3;
        let events: Vec<OutboxEvent> =
            distribution::nats::scratch::read_stream(&cluster.nodes[survivor].url(), &stream)
                .await
                .into_iter()
                .map(|(_, event)| event.unwrap())
                .collect();
        assert_in_order(&events);
        assert_eq!(intents_by_branch(&events), all);
        relay.shutdown().await;
    });
}

/// `distribution run` with `RELAY_BROKER=nats`: without `NATS_URL` it exits 2 naming it, and a
/// RabbitMQ setting beside it is refused rather than ignored; with it, the relay declares the
/// stream, says what the server's version means for durability, is ready, ships, and stops
/// gracefully on SIGTERM.
#[test]
fn nats_the_binary_refuses_what_it_lacks_then_ships_and_is_ready() {
    let refused = |extra: &[(&str, &str)]| {
        let mut command = relay_command();
        command
            .arg("run")
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x")
            .env("RELAY_BROKER", "nats");
        for (name, value) in extra {
            command.env(name, value);
        }
        let output = command.output().unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, stderr) = refused(&[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("NATS_URL") && stderr.lines().count() == 1,
        "{stderr}"
    );
    // NATS_URL without RELAY_BROKER=nats: RabbitMQ, and the operator is told.
    let output = relay_command()
        .arg("run")
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x")
        .env("AMQP_URL", "amqp://127.0.0.1:1/%2f")
        .env("NATS_URL", "nats://127.0.0.1:4222")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("NATS_URL is set but RELAY_BROKER is rabbitmq"),
        "{stderr}"
    );
    let (code, stderr) = refused(&[
        ("NATS_URL", "nats://127.0.0.1:4222"),
        ("RELAY_QUEUE_TYPE", "quorum"),
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("RELAY_QUEUE_TYPE") && stderr.contains("RabbitMQ setting"),
        "{stderr}"
    );

    host_runtime().block_on(async {
        let (pool, url) = fresh_database("nats_binary").await;
        let stream = distribution::nats::scratch::unique_stream("binary");
        let addr = free_addr();
        let log = std::env::temp_dir().join(testkit::unique("relay-nats-run.log"));
        let child = relay_command()
            .arg("run")
            .env("DATABASE_URL", &url)
            .env("RELAY_BROKER", "nats")
            .env("NATS_URL", testkit::nats_url())
            .env("RELAY_TOPOLOGY", &stream)
            .env("RELAY_METRICS_ADDR", &addr)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut relay = Process(child);
        wait_until("/readyz 200", Duration::from_secs(30), || async {
            matches!(http_get(&addr, "/readyz").await, Some((200, _)))
        })
        .await;
        let branch = write_first_intent(&pool, "nats-binary", b"hello").await;
        wait_until("the intent stored", Duration::from_secs(30), || async {
            stored(&stream)
                .await
                .iter()
                .any(|event| event.key.branch == branch)
        })
        .await;
        relay.signal("-TERM");
        assert_eq!(
            relay.0.wait().unwrap().code(),
            Some(0),
            "graceful stop on SIGTERM"
        );
        let said = std::fs::read_to_string(&log).unwrap();
        let _ = std::fs::remove_file(&log);
        assert!(
            said.contains("NATS 2.9"),
            "the server's version is said: {said}"
        );
        assert!(
            said.contains("syncs JetStream to disk every 60 s"),
            "{said}"
        );
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
    });
}

/// T7.4's fold steps on NATS, end to end: the relay ships a history with rewinds across
/// tenants, runs and branches to private `servers` (a stream of `replicas`), and a consumer
/// group folds `stream` into a database of its own with the demonstration projection; `fault`
/// strikes the servers while both work. The fold holds exactly the live history: every live
/// intent once, in Lsn order per branch, nothing abandoned, nothing parked, nothing
/// dead-lettered.
async fn the_fold_holds_exactly_the_live_history_through(
    label: &str,
    (servers, replicas): (Vec<String>, usize),
    stream: &str,
    fault: impl AsyncFnOnce(),
) {
    use distribution::consumer::{Consumer, NatsConsumerConfig};
    use distribution::store::{EventTable, FoldStore};

    let (pool, url) = fresh_database(label).await;
    let (fold_pool, _) = fresh_database(&format!("{label}_consumer")).await;
    // The relay reaches each server through a proxy, all cut while the runs rewind (a rewind
    // abandons only what was not shipped); the consumer reaches them directly.
    let proxies: Vec<BrokerProxy> = servers
        .iter()
        .map(|server| BrokerProxy::start(server).unwrap())
        .collect();
    let proxied: Vec<String> = proxies.iter().map(BrokerProxy::url).collect();
    let mut config = nats_config(&url, &proxied.join(","), stream);
    config.nats_replicas = replicas;
    let mut group = NatsConsumerConfig::new(config.nats_config().unwrap(), "projector").unwrap();
    group.nats.servers = servers;
    group.retry.max = Duration::from_millis(500);
    let relay = Relay::start(config).await.unwrap();
    let consumer = Consumer::on_nats(group, fold_pool.clone(), EventTable);
    let folding = until_stopped(|stopped| consumer.run(stopped));
    let fold = FoldStore::new(fold_pool.clone());

    let mut workload = Workload::new(label, 4, 2, 40);
    workload.rewind = true;
    proxies.iter().for_each(BrokerProxy::cut);
    let mut ran = workload.run(&pool).await;
    proxies.iter().for_each(BrokerProxy::restore);
    let mut all = ran.expected.clone();
    let restored = std::time::Instant::now();
    wait_until(
        "the first steps folded",
        Duration::from_secs(30),
        || async { folded_count(&fold, &all).await == count(&all) },
    )
    .await;
    println!(
        "{label}: the first steps folded {:.1} s after the relay's links came back",
        restored.elapsed().as_secs_f64()
    );
    ran = workload.steps(&pool, ran.live, 41..=240).await;
    merge(&mut all, &ran.expected);
    fault().await;
    ran = workload.steps(&pool, ran.live, 241..=260).await;
    merge(&mut all, &ran.expected);
    until_folded_exactly(&fold, &all, "the live history folded").await;
    let stats = folding.stop().await.unwrap();
    println!("{label}: {stats:?}");
    assert_eq!(stats.rejected, 0, "{stats:?}");
    relay.shutdown().await;
}

/// ... the server killed (SIGKILL) and started again on its store 1 s later.
#[test]
fn nats_the_fold_holds_exactly_the_live_history_through_a_server_kill() {
    let mut server = PrivateNats::start(NatsVersion::Machine);
    let stream = distribution::nats::scratch::unique_stream("fold_kill");
    host_runtime().block_on(the_fold_holds_exactly_the_live_history_through(
        "nats_fold_kill",
        (vec![server.url()], 1),
        &stream,
        async || kill_and_restart(&mut server).await,
    ));
}

/// ... the server frozen (SIGSTOP) for 3 s, past the relay's 2 s ack timeout, on NATS 2.10.
#[test]
fn nats_the_fold_holds_exactly_the_live_history_through_a_server_freeze_on_2_10() {
    let mut server = PrivateNats::start(NatsVersion::Trixie);
    let stream = distribution::nats::scratch::unique_stream("fold_freeze");
    host_runtime().block_on(the_fold_holds_exactly_the_live_history_through(
        "nats_fold_freeze",
        (vec![server.url()], 1),
        &stream,
        async || freeze(&mut server).await,
    ));
}

/// ... on a 3-node JetStream cluster of NATS 2.10, the stream on 3 replicas: the stream's
/// leader killed (SIGKILL) while the relay ships and the group folds, and started again 2 s
/// later. The relay's publishes find no stream during the election; the group's reader, whose
/// server-side consumer may die with the leader, goes on from where it was.
#[test]
fn nats_the_fold_holds_exactly_the_live_history_through_a_leader_kill_on_a_2_10_cluster() {
    let mut cluster = PrivateNatsCluster::start(NatsVersion::Trixie);
    let stream = distribution::nats::scratch::unique_stream("fold_leader");
    let servers = cluster.nodes.iter().map(PrivateNats::url).collect();
    host_runtime().block_on(async {
        cluster.formed().await;
        the_fold_holds_exactly_the_live_history_through(
            "nats_fold_leader",
            (servers, 3),
            &stream,
            async || {
                let leader = cluster.leader_of(&stream).await;
                cluster.nodes[leader].kill();
                println!("killed n{leader}, the stream's leader");
                tokio::time::sleep(Duration::from_secs(2)).await; // the outage's length
                cluster.nodes[leader].run();
            },
        )
        .await
    });
}

/// `distribution dead` on NATS (`RELAY_BROKER=nats`): a consumer group kept a message that is
/// not an event and a broken chain as dead letters; `list` shows both with their reasons, `show`
/// one whole, `replay` puts the event back on its partition (the group refuses it again, so it
/// is kept again, under a new sequence), and `purge --all` removes both.
#[test]
fn nats_dead_letters_are_listed_shown_replayed_and_purged_by_the_cli() {
    use distribution::broker::Publisher as _;
    use distribution::consumer::{Consumer, NatsConsumerConfig};
    use distribution::nats::{NatsConfig, NatsDeadLetters, NatsPublisher};
    use distribution::store::EventTable;

    host_runtime().block_on(async {
        let (fold_pool, fold_url) = fresh_database("nats_dead_cli").await;
        let stream = distribution::nats::scratch::unique_stream("dead_cli");
        let nats = NatsConfig::new(&testkit::nats_url(), &stream, 2).unwrap();
        let mut group = NatsConsumerConfig::new(nats.clone(), "projector").unwrap();
        group.retry.max = Duration::from_millis(300);
        let consumer = Consumer::on_nats(group, fold_pool.clone(), EventTable);
        let progress = consumer.progress();
        let folding = until_stopped(|stopped| consumer.run(stopped));

        let branch = testkit::branch("dead-cli", "run-1", "main");
        let mut events = testkit::intents(&branch, &[1, 2, 3, 4, 5]);
        // After 5 was folded, an intent that follows 3: a chain no later delivery can mend.
        events.push(testkit::intent(&branch, 9).prev(3).build());
        let mut publisher = NatsPublisher::new(nats.clone());
        assert_eq!(publisher.publish(&events[..5]).await.accepted(), 5);
        let client = async_nats::connect(testkit::nats_url()).await.unwrap();
        let context = async_nats::jetstream::new(client);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("wire_version", "4");
        let poisoned = nats.subject_of(&branch.tenant, &branch.run);
        context
            .publish_with_headers(poisoned, headers, "garbage".into())
            .await
            .unwrap()
            .await
            .unwrap();
        assert_eq!(publisher.publish(&events[5..]).await.accepted(), 1);
        wait_until("both refused", Duration::from_secs(30), || async {
            progress.totals().rejected == 2
        })
        .await;

        let cli = |args: &[&str]| {
            let mut command = relay_command();
            command
                .arg("dead")
                .args(args)
                .env("RELAY_BROKER", "nats")
                .env("NATS_URL", testkit::nats_url())
                .env("RELAY_TOPOLOGY", &stream)
                .env("RELAY_PARTITIONS", "2")
                .env("RELAY_GROUP", "projector");
            async move {
                let out = tokio::task::spawn_blocking(move || command.output().unwrap())
                    .await
                    .unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
                assert!(
                    out.status.success(),
                    "{stdout}{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                stdout
            }
        };
        let id = "dead-cli/run-1/main/9";
        let listed = cli(&["list"]).await;
        assert!(
            listed.contains(&format!("2 dead letter(s) in {stream}_dead.projector")),
            "{listed}"
        );
        // `status` counts them too.
        let mut status = relay_command();
        status
            .arg("status")
            .env("DATABASE_URL", &fold_url)
            .env("RELAY_BROKER", "nats")
            .env("NATS_URL", testkit::nats_url())
            .env("RELAY_TOPOLOGY", &stream)
            .env("RELAY_GROUPS", "projector,absent");
        let out = tokio::task::spawn_blocking(move || status.output().unwrap())
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(&format!("2 dead letter(s) in {stream}_dead.projector")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!("no dead letters in {stream}_dead.absent")),
            "{stdout}"
        );
        let line = |text: &str, what: &str| {
            text.lines()
                .find(|line| line.contains(what))
                .unwrap_or_else(|| panic!("no {what} in {text}"))
                .to_owned()
        };
        assert!(line(&listed, id).contains("broken_chain"), "{listed}");
        assert!(
            line(&listed, "not an event").contains("contract"),
            "{listed}"
        );
        let shown = cli(&["show", id]).await;
        assert!(shown.contains("kind: intent"), "{shown}");
        assert!(shown.contains("reason: broken_chain"), "{shown}");
        assert!(shown.contains("header lsn: 9"), "{shown}");

        let before = NatsDeadLetters::open(&nats, "projector")
            .await
            .unwrap()
            .list(10)
            .await
            .unwrap();
        let kept_first = before
            .iter()
            .find(|letter| letter.message_id.as_deref() == Some(id))
            .unwrap()
            .sequence;
        let replayed = cli(&["replay", "--tenant", "dead-cli"]).await;
        assert!(replayed.contains("replayed 1 dead letter(s)"), "{replayed}");
        wait_until(
            "the replayed intent refused again",
            Duration::from_secs(30),
            || async { progress.totals().rejected == 3 },
        )
        .await;
        let dead = NatsDeadLetters::open(&nats, "projector").await.unwrap();
        let letters = dead.list(10).await.unwrap();
        assert_eq!(letters.len(), 2, "{letters:?}");
        assert_eq!(
            letters[0].kind(),
            "not an event",
            "the poison stays where it was"
        );
        assert_eq!(letters[1].message_id.as_deref(), Some(id));
        assert!(
            letters[1].sequence > kept_first,
            "kept again, later: {letters:?}"
        );
        // Replayed to its run's partition, as the relay writes it.
        let copies: Vec<String> =
            distribution::nats::scratch::read_stream(&testkit::nats_url(), &stream)
                .await
                .into_iter()
                .filter(|(_, event)| event.as_ref().is_ok_and(|event| event.key.lsn.get() == 9))
                .map(|(subject, _)| subject)
                .collect();
        assert_eq!(
            copies,
            vec![nats.subject_of(&branch.tenant, &branch.run); 2]
        );
        // Another group's letter, which nothing here may touch.
        context
            .publish_with_headers(
                format!("{stream}_dead.other"),
                async_nats::HeaderMap::new(),
                "theirs".into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();

        let purged = cli(&["purge", "--all"]).await;
        assert!(purged.contains("purged 2 dead letter(s)"), "{purged}");
        let listed = cli(&["list"]).await;
        assert!(listed.starts_with("0 dead letter(s)"), "{listed}");
        let theirs = NatsDeadLetters::open(&nats, "other").await.unwrap();
        assert_eq!(
            theirs.list(10).await.unwrap().len(),
            1,
            "another group's letter stays"
        );
        let stats = folding.stop().await.unwrap();
        assert_eq!(stats.applied, 5, "{stats:?}");
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
    });
}

/// `distribution group create|delete` with `RELAY_BROKER=nats`: a group has no queues there
/// (the stream keeps every event for every group), so `create` declares nothing and says
/// whether the stream is there, and `delete` removes the group's dead letters and no other
/// group's (none kept yet: nothing to do, and no error); a name that cannot be a subject token
/// is refused in one line.
#[test]
fn nats_group_create_declares_nothing_and_delete_removes_only_the_groups_dead_letters() {
    use distribution::nats::{NatsConfig, NatsDeadLetters};

    host_runtime().block_on(async {
        let stream = distribution::nats::scratch::unique_stream("group_cli");
        let group = |args: &[&str]| {
            let mut command = relay_command();
            command
                .arg("group")
                .args(args)
                .env("RELAY_BROKER", "nats")
                .env("NATS_URL", testkit::nats_url())
                .env("RELAY_TOPOLOGY", &stream)
                .env("RELAY_PARTITIONS", "2");
            async move {
                let out = tokio::task::spawn_blocking(move || command.output().unwrap())
                    .await
                    .unwrap();
                (
                    out.status.code(),
                    String::from_utf8_lossy(&out.stdout).into_owned(),
                    String::from_utf8_lossy(&out.stderr).into_owned(),
                )
            }
        };
        let (code, created, stderr) = group(&["create", "projector"]).await;
        assert_eq!(code, Some(0), "{created}{stderr}");
        assert!(
            created.contains(&format!("stream {stream} does not exist yet"))
                && created.contains("nothing was declared"),
            "{created}"
        );
        assert!(stored(&stream).await.is_empty());
        let client = async_nats::connect(testkit::nats_url()).await.unwrap();
        let context = async_nats::jetstream::new(client);
        assert!(
            context.get_stream(&stream).await.is_err(),
            "declared nothing"
        );
        // No letter kept yet: nothing to delete, and no error.
        let (code, deleted, stderr) = group(&["delete", "projector"]).await;
        assert_eq!(code, Some(0), "{deleted}{stderr}");
        assert!(deleted.contains("deleted its 0 dead letters"), "{deleted}");
        // The streams, as a consumer declares them.
        distribution::nats::Reading::connect(
            &NatsConfig::new(&testkit::nats_url(), &stream, 2).unwrap(),
        )
        .await
        .unwrap();
        let (_, created, _) = group(&["create", "projector"]).await;
        assert!(
            created.contains(&format!("stream {stream} holds 0 messages")),
            "{created}"
        );
        for subject in ["projector", "projector", "other"] {
            context
                .publish_with_headers(
                    format!("{stream}_dead.{subject}"),
                    async_nats::HeaderMap::new(),
                    "a letter".into(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
        }

        let (code, deleted, stderr) = group(&["delete", "projector"]).await;
        assert_eq!(code, Some(0), "{deleted}{stderr}");
        assert!(deleted.contains("deleted its 2 dead letters"), "{deleted}");
        let nats = NatsConfig::new(&testkit::nats_url(), &stream, 2).unwrap();
        let depth = |group: &'static str| {
            let nats = nats.clone();
            async move {
                NatsDeadLetters::open(&nats, group)
                    .await
                    .unwrap()
                    .depth()
                    .await
                    .unwrap()
            }
        };
        assert_eq!(depth("projector").await, 0);
        assert_eq!(depth("other").await, 1, "another group's letter stays");
        context.get_stream(&stream).await.unwrap();

        let (code, _, stderr) = group(&["create", "Not A Token"]).await;
        assert_eq!(code, Some(1), "{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
    });
}

/// `distribution tail` with `RELAY_BROKER=nats` watches the stream from its next message: one
/// line each with the subject, message id, kind and metadata, the payload only when asked;
/// `--tenant` and `--run` keep that run's events alone, in Lsn order (`--json`: one object per
/// line, the subject under `subject`). A stream that does not exist is refused in one line, and
/// the tail declares nothing.
#[test]
fn nats_tail_shows_each_event_once_from_the_next_message() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    use distribution::store::{EventType, Intent, IntentWriter};

    host_runtime().block_on(async {
        let (pool, url) = fresh_database("nats_tail").await;
        let stream = distribution::nats::scratch::unique_stream("tail");
        let config = nats_config(&url, &testkit::nats_url(), &stream);
        let tail_command = |args: &[&str]| {
            let mut command = relay_command();
            command
                .arg("tail")
                .args(args)
                .env("RELAY_BROKER", "nats")
                .env("NATS_URL", testkit::nats_url())
                .env("RELAY_TOPOLOGY", &stream)
                .env("RELAY_PARTITIONS", config.partitions.to_string());
            command
        };
        // Before any stream: refused, in one line, and nothing declared.
        let refused = tail_command(&[]).output().unwrap();
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("cannot watch stream {stream}"))
                && stderr.trim().lines().count() == 1,
            "{stderr}"
        );
        assert!(stored(&stream).await.is_empty());

        // Something already in the stream, which the tails never show.
        let writer = IntentWriter::default();
        let mut conn = pool.acquire().await.unwrap();
        let (watched, other, other_tenant) = (
            testkit::branch("tail-a", "r1", "main"),
            testkit::branch("tail-a", "r2", "main"),
            testkit::branch("tail-b", "r1", "main"),
        );
        for branch in [&watched, &other, &other_tenant] {
            writer.open_run(&mut conn, branch).await.unwrap();
        }
        writer
            .append(&mut conn, &other, Lsn::new(1), b"before")
            .await
            .unwrap();
        let relay = Relay::start(config.clone()).await.unwrap();
        wait_until(
            "the first event stored",
            Duration::from_secs(30),
            || async { stored(&stream).await.len() == 1 },
        )
        .await;

        let tail = |args: &[&str]| {
            let mut child = tail_command(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let mut said = String::new();
            BufReader::new(child.stderr.take().unwrap())
                .read_line(&mut said)
                .unwrap();
            assert!(said.starts_with("watching stream"), "{said}");
            child
        };
        let everything = tail(&["--payload", "--count", "5"]);
        let one_run = tail(&[
            "--json", "--tenant", "tail-a", "--run", "r1", "--count", "3",
        ]);
        for lsn in 1..=3u64 {
            let payload = format!("secret {lsn}");
            let intent = Intent::new(payload.as_bytes())
                .event_type(EventType::new("order.placed").unwrap())
                .header("region", "eu");
            writer
                .append_intent(&mut conn, &watched, Lsn::new(lsn), intent)
                .await
                .unwrap();
        }
        writer
            .append(&mut conn, &other, Lsn::new(2), b"other")
            .await
            .unwrap();
        writer
            .append(&mut conn, &other_tenant, Lsn::new(1), b"other")
            .await
            .unwrap();
        // Each tail ends once it saw its count; one that misses an event is killed at 60 s
        // and fails the test rather than hang it.
        let finished = |mut child: std::process::Child| {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while child.try_wait().unwrap().is_none() {
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("a tail did not see its events within 60 s");
                }
                // Polling pace, not synchronisation.
                std::thread::sleep(Duration::from_millis(50));
            }
            let output = child.wait_with_output().unwrap();
            assert!(output.status.success(), "{output:?}");
            String::from_utf8(output.stdout).unwrap()
        };
        let (everything, one_run) =
            tokio::task::spawn_blocking(move || (finished(everything), finished(one_run)))
                .await
                .unwrap();
        relay.shutdown().await;

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
            assert_eq!(line["type"], "order.placed", "{line}");
            assert_eq!(line["headers"]["region"], "eu", "{line}");
            assert!(
                line["subject"]
                    .as_str()
                    .unwrap()
                    .starts_with(&format!("{stream}.p")),
                "{line}"
            );
        }
        assert!(!one_run.contains("secret"), "{one_run}");
        for id in [
            format!("{watched}/1"),
            format!("{watched}/3"),
            format!("{other}/2"),
            format!("{other_tenant}/1"),
        ] {
            assert_eq!(
                everything.matches(&format!(" {id} intent ")).count(),
                1,
                "{id} once in {everything}"
            );
        }
        assert!(
            !everything.contains(&format!("{other}/1 ")),
            "from the next message: {everything}"
        );
        assert!(
            everything.contains("payload (text): secret 2"),
            "{everything}"
        );
        distribution::nats::scratch::delete_stream(&testkit::nats_url(), &stream).await;
    });
}

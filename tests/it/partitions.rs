//! Network partitions of a real RabbitMQ cluster: three private nodes, each in a network
//! namespace of its own (`PrivateCluster::start_partitionable`: `net_ticktime` 10,
//! `pause_minority`), with a host writing on, two relays and a consumer in this machine's own
//! namespace reaching every node over the cluster's bridge. Each cut drops packets without a
//! reset (nftables on the bridge), holds for its length, and is lifted; the shapes, after
//! RabbitMQ's own Jepsen tests of quorum queues:
//!
//! - the node leading most queues cut off from the other two (a minority holding the leaders);
//! - the node most clients are connected to cut off from the other two (it still takes their
//!   publishes, and confirms none);
//! - a node leading the fewest cut off from the other two;
//! - a bridge: the leader and one follower cut from each other, the third node seeing both;
//! - the relays and the consumer cut off from the leader's node, the nodes whole.
//!
//! Each at 10 s (below `net_ticktime`'s detection, which still partitions the cluster: the
//! nodes see it 1-2 s after the heal) and 30 s (the minority pauses about 11.5 s in). What must
//! hold, as for the node failures (`under_load::Scene::finish`): nothing lost, no branch's
//! first copies out of order in its queue (events the broker refused aside), the fold exactly
//! the live history, every branch reaching the consumer; and after each heal, every intent
//! written before it acked within 10 s. Each cut's worst lag and heal time are printed.
//!
//! A dropped packet is retransmitted with backoff: after a drop of 6-8 s, TCP resumes 5-7 s
//! after the rule is lifted (../shared/docs/FAULTS.md), which the 10 s bound after a heal has
//! to absorb.
use std::time::{Duration, Instant};

use distribution::rabbit::QueueType;

use crate::harness::{oldest_pending, wait_until};
use crate::node::{End, PrivateCluster, Rabbit};
use crate::under_load::{Scene, worst_lag};

/// Where a cut falls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    /// The node leading most queues, alone.
    LeaderAlone,
    /// The node holding the most client connections (the relays' and the consumer's), alone.
    ClientsNodeAlone,
    /// The node leading the fewest queues, alone.
    FollowerAlone,
    /// The leader and a follower cut from each other; the third node sees both.
    Bridge,
    /// This machine (relays, consumer) cut off from the leader's node.
    ClientsFromLeader,
}

const SHAPES: [Shape; 5] = [
    Shape::LeaderAlone,
    Shape::ClientsNodeAlone,
    Shape::FollowerAlone,
    Shape::Bridge,
    Shape::ClientsFromLeader,
];

/// What one cut cost.
struct Cost {
    shape: Shape,
    length: Duration,
    /// The node the shape was drawn around (the leader, the clients' node, or the lone
    /// follower).
    around: u8,
    /// The node leading the most queues when the cut began.
    leader: u8,
    /// The worst lag while the cut held.
    during: Duration,
    /// Intents the consumer applied while the cut held.
    applied_during: u64,
    /// From the heal until every intent written before it was acked.
    heal: Duration,
    /// From then until the cluster was whole again (every node running, seeing the others,
    /// no partition on record).
    whole: Duration,
    /// The nodes restarted by hand to get there (see [`await_whole`]).
    restarted: Vec<u8>,
    /// What the relays' readiness (`/readyz`) said while the cut held.
    said: Said,
    /// From everything written before the heal acked until both relays answered ready
    /// (`None`: not within 30 s).
    ready_again: Option<Duration>,
}

/// What the relays' readiness probes answered while a cut held, asked every 250 ms.
#[derive(Debug, Default)]
struct Said {
    asked: usize,
    not_ready: usize,
    /// The first "not ready", how long after the cut's rules were in place, and why.
    first: Option<(Duration, String)>,
    /// "Ready" answered by a relay whose oldest unanswered batch had waited [`STUCK`] (known
    /// only where the test sees the relays' sends).
    ready_while_stuck: usize,
}

/// A batch unanswered this long is a relay that cannot ship: its write is bounded by the
/// scene's connect timeout (1 s) and its confirms by the confirm timeout (2 s), after which
/// its publisher reports the broker down. The margin covers the next answer's scheduling on
/// two busy cores.
const STUCK: Duration = Duration::from_secs(4);

impl std::fmt::Display for Said {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "not ready in {} of {} answers, ready with a batch unanswered for {STUCK:?} in {}",
            self.not_ready, self.asked, self.ready_while_stuck
        )?;
        if let Some((after, why)) = &self.first {
            write!(f, ", first {after:.1?} into the cut: {why}")?;
        }
        Ok(())
    }
}

/// Asks each relay's readiness every 250 ms until `stop` says so; `shipping`, where the test
/// sees them, holds each relay's sends (in the order of `readiness`).
fn listen(
    readiness: std::sync::Arc<[distribution::Readiness]>,
    shipping: Option<std::sync::Arc<[std::sync::Arc<crate::under_load::Shipping>]>>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Said> {
    tokio::spawn(async move {
        let began = Instant::now();
        let mut said = Said::default();
        let stuck = |relay: usize| {
            shipping.as_ref().is_some_and(|shipping| {
                shipping[relay]
                    .unanswered_for()
                    .is_some_and(|waited| waited >= STUCK)
            })
        };
        while !*stop.borrow() {
            for (relay, probe) in readiness.iter().enumerate() {
                // Stuck before and after the answer: no batch of the relay was answered while
                // it was asked (an answer between would make "ready" true). The publishers
                // report a batch's fate to the health after its `done`, which the observer
                // hears: an "up" read here was heard first.
                let stuck_before = stuck(relay);
                let answer = probe.check().await;
                said.asked += 1;
                match answer {
                    Err(why) => {
                        said.not_ready += 1;
                        said.first
                            .get_or_insert_with(|| (began.elapsed(), why.to_string()));
                    }
                    Ok(()) if stuck_before && stuck(relay) => said.ready_while_stuck += 1,
                    Ok(()) => {}
                }
            }
            // Asking pace, as a kubelet's probe period; not synchronisation.
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        said
    })
}

/// From `shipped` (everything written before the heal acked), how long until every relay
/// answers ready, asked every 250 ms (`None`: not within 30 s).
async fn until_ready(readiness: &[distribution::Readiness], shipped: Instant) -> Option<Duration> {
    loop {
        let mut all = true;
        for probe in readiness {
            all &= probe.check().await.is_ok();
        }
        if all {
            return Some(shipped.elapsed());
        }
        if shipped.elapsed() > Duration::from_secs(30) {
            return None;
        }
        // Asking pace, as above.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} for {:?} around node {} (leader {}): worst lag {:.1?}, {} applied meanwhile, heal {:.1?}, both relays ready {} after that, whole again {:.1?} later (nodes restarted by hand: {:?}); readiness while cut: {}",
            self.shape,
            self.length,
            self.around,
            self.leader,
            self.during,
            self.applied_during,
            self.heal,
            self.ready_again
                .map_or("not within 30 s".into(), |ready| format!("{ready:.1?}")),
            self.whole,
            self.restarted,
            self.said
        )
    }
}

/// The node leading the most (`most`) or the fewest queues, asked of a node that answers.
/// (`rabbitmqctl list_queues` does not answer within its 60 s on these nodes: an `eval`, which
/// asks each quorum queue's Raft members for their leader, as the metadata's may lag, and
/// takes a stream's writer.)
fn leading_node(cluster: &PrivateCluster, most: bool) -> u8 {
    let leaders = (1..=3)
        .map(|n| {
            cluster.ctl(
                n,
                &[
                    "eval",
                    "[case amqqueue:get_pid(Q) of \
                       {_, _} = Server -> case ra:members(Server) of \
                         {ok, _, {_, Leader}} -> Leader; _ -> none end; \
                       P when is_pid(P) -> node(P); _ -> none end \
                     || Q <- rabbit_amqqueue:list()].",
                ],
            )
        })
        .find(|leaders| leaders.trim_start().starts_with('['))
        .expect("a node lists the queues' leaders");
    let led: Vec<usize> = (1..=3)
        .map(|n| leaders.matches(&format!("'{}'", cluster.node(n))).count())
        .collect();
    let chosen = (0..3).max_by_key(|&n| {
        let count = led[n] as isize;
        if most { count } else { -count }
    });
    chosen.unwrap() as u8 + 1
}

/// Each node's `cluster_status` (JSON), `None` for a node that does not answer.
fn statuses(cluster: &PrivateCluster) -> Vec<Option<serde_json::Value>> {
    (1..=3)
        .map(|n| {
            serde_json::from_str(&cluster.ctl(n, &["cluster_status", "--formatter", "json"])).ok()
        })
        .collect()
}

/// Whether every node runs, sees the other two and records no partition.
fn whole(statuses: &[Option<serde_json::Value>]) -> bool {
    statuses.iter().all(|status| {
        status.as_ref().is_some_and(|status| {
            status["running_nodes"].as_array().map(Vec::len) == Some(3)
                && status["partitions"]
                    .as_object()
                    .is_none_or(serde_json::Map::is_empty)
        })
    })
}

/// What a status says of the cluster: the nodes running, and the partitions on record.
fn view(status: &Option<serde_json::Value>) -> String {
    match status {
        None => "no answer".to_owned(),
        Some(status) => format!(
            "running {}, partitions {}",
            status["running_nodes"], status["partitions"]
        ),
    }
}

/// The nodes an operator restarts to end a partition (RabbitMQ's documentation: restart the
/// nodes of the partition you do not trust): those that do not answer (paused by
/// `pause_minority`, or stuck starting again); else, of those that record a partition, the
/// ones on the smallest side; else those another node does not count as running.
fn untrusted(statuses: &[Option<serde_json::Value>], names: &[String]) -> Vec<u8> {
    let nodes = || (1..=3u8).zip(statuses).zip(names);
    let silent: Vec<u8> = nodes()
        .filter(|((_, status), _)| status.is_none())
        .map(|((n, _), _)| n)
        .collect();
    if !silent.is_empty() {
        return silent;
    }
    // Of the nodes that record a partition, those of the smallest side (the fewest running).
    let running =
        |status: &serde_json::Value| status["running_nodes"].as_array().map_or(0, Vec::len);
    let recording: Vec<(u8, usize)> = nodes()
        .filter_map(|((n, status), _)| {
            let status = status.as_ref()?;
            let parted = status["partitions"]
                .as_object()
                .is_some_and(|partitions| !partitions.is_empty());
            parted.then(|| (n, running(status)))
        })
        .collect();
    if let Some(fewest) = recording.iter().map(|(_, count)| *count).min() {
        return recording
            .iter()
            .filter(|(_, count)| *count == fewest)
            .map(|(n, _)| *n)
            .collect();
    }
    nodes()
        .filter(|(_, name)| {
            statuses.iter().flatten().any(|status| {
                !status["running_nodes"]
                    .as_array()
                    .is_some_and(|running| running.iter().any(|node| node == name.as_str()))
            })
        })
        .map(|((n, _), _)| n)
        .collect()
}

/// Waits until the cluster is whole again; returns the nodes it had to restart. A node paused
/// by `pause_minority` restarts itself once it sees the majority again; but under load a cut
/// shorter than `net_ticktime`'s detection is seen only after the heal, and then RabbitMQ can
/// leave a node paused or a partition on record for minutes (seen here: over 120 s on 3.10;
/// on 4.0 a node that rejoined after the heal hung in its boot, `inconsistent_database,
/// starting_partitioned_network`, and its `stop_app` never returned). After 30 s this does
/// what RabbitMQ's documentation tells an operator to do ([`untrusted`]), restarting the
/// nodes' VMs (SIGKILL, start: `stop_app` can hang), up to three times.
fn await_whole(cluster: &PrivateCluster) -> Vec<u8> {
    let names: Vec<String> = (1..=3).map(|n| cluster.node(n)).collect();
    let mut restarted = Vec::new();
    let mut rounds = 0;
    let mut deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let statuses = statuses(cluster);
        if whole(&statuses) {
            return restarted;
        }
        if Instant::now() >= deadline {
            let untrusted = untrusted(&statuses, &names);
            let views: Vec<String> = statuses.iter().map(view).collect();
            assert!(
                rounds < 3 && !untrusted.is_empty(),
                "the cluster was not whole again (nodes restarted: {restarted:?}): {views:?}"
            );
            println!("restarting nodes {untrusted:?} by hand; the nodes' views: {views:?}");
            for &n in &untrusted {
                cluster.kill_node(n);
                cluster.start_node(n);
            }
            restarted.extend(untrusted);
            rounds += 1;
            deadline = Instant::now() + Duration::from_secs(30);
        }
        // Polling pace of a command-line tool, not synchronisation.
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Cuts the cluster as `shape` says for `length`, heals it, and measures.
async fn partition(
    cluster: &PrivateCluster,
    scene: &Scene,
    shape: Shape,
    length: Duration,
) -> Cost {
    let pool = &scene.pool;
    let leader = tokio::task::block_in_place(|| leading_node(cluster, true));
    let around = match shape {
        Shape::FollowerAlone => tokio::task::block_in_place(|| leading_node(cluster, false)),
        Shape::ClientsNodeAlone => {
            tokio::task::block_in_place(|| (1..=3u8).max_by_key(|&n| cluster.clients(n)).unwrap())
        }
        _ => leader,
    };
    let others: Vec<u8> = (1..=3).filter(|&n| n != around).collect();
    let cuts: Vec<(End, End)> = match shape {
        Shape::LeaderAlone | Shape::ClientsNodeAlone | Shape::FollowerAlone => others
            .iter()
            .map(|&other| (End::Node(around), End::Node(other)))
            .collect(),
        Shape::Bridge => vec![(End::Node(around), End::Node(others[0]))],
        Shape::ClientsFromLeader => vec![(End::Host, End::Node(around))],
    };
    let (cut_at, _) = oldest_pending(pool).await;
    let applied = scene.folding.totals().applied;
    let (stop_listening, stop) = tokio::sync::watch::channel(false);
    tokio::task::block_in_place(|| {
        for (a, b) in &cuts {
            cluster.cut(*a, *b);
        }
    });
    let listening = listen(scene.readiness.clone(), Some(scene.shipping.clone()), stop);
    // The cut's length: the fault's own duration, sampled for the lag meanwhile.
    let during = worst_lag(pool, cut_at, length).await;
    let applied_during = scene.folding.totals().applied - applied;
    stop_listening.send_replace(true);
    tokio::task::block_in_place(|| cluster.heal());
    let healed = Instant::now();
    let said = listening.await.expect("the readiness listener ran");
    let (heal_at, _) = oldest_pending(pool).await;
    wait_until(
        "every intent written before the heal acked",
        Duration::from_secs(120),
        || async {
            oldest_pending(pool)
                .await
                .1
                .is_none_or(|oldest| oldest >= heal_at)
        },
    )
    .await;
    let heal = healed.elapsed();
    let ready_again = until_ready(&scene.readiness, Instant::now()).await;
    let whole = Instant::now();
    let restarted = tokio::task::block_in_place(|| await_whole(cluster));
    let whole = whole.elapsed();
    Cost {
        shape,
        length,
        around,
        leader,
        during,
        applied_during,
        heal,
        whole,
        restarted,
        said,
        ready_again,
    }
}

// `.ci/run` runs one of the eight (10 s cuts on 3.10 quorum queues, about 3 minutes there); the
// rest are opt-in, each 3-5 minutes (two in CI took it past its 30 minutes). docs/operations.md,
// "Tests", says why.

/// One cluster at a time: partitions are timed against `net_ticktime` (RabbitMQ) and election
/// timeouts (NATS), and two clusters booting or healing at once on two cores would blur that.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Every shape at `length` on a partitionable cluster of `rabbit`, under load; prints each
/// cut's cost and checks the run and the heals.
async fn partitions(rabbit: Rabbit, queue_type: QueueType, length: Duration) {
    let _alone = ONE_AT_A_TIME.lock().await;
    crate::harness::capture_logs();
    let cluster =
        tokio::task::block_in_place(|| PrivateCluster::start_partitionable(rabbit, "partitions"));
    let scene = Scene::start(&cluster, queue_type).await;
    let mut costs = Vec::new();
    for shape in SHAPES {
        let cost = partition(&cluster, &scene, shape, length).await;
        println!("{rabbit:?} {queue_type:?}: {cost}");
        costs.push(cost);
    }
    scene.finish(&cluster, 1).await;
    for cost in &costs {
        assert!(
            cost.heal < Duration::from_secs(10),
            "{rabbit:?} {queue_type:?}: intents written before the heal waited {:?} after it ({cost})",
            cost.heal
        );
        // `/readyz` true to what the relay can do: a relay whose batches the broker leaves
        // unanswered says so (when an opened session counted as "up", the two relays answered
        // ready in 77 of their 80 answers through a 10 s cut that shipped nothing)...
        assert_eq!(
            cost.said.ready_while_stuck, 0,
            "{rabbit:?} {queue_type:?}: a relay answered ready with a batch unanswered for {STUCK:?} ({cost})"
        );
        // ...and once everything written before the heal shipped, both say ready within
        // 10 s (a stale "broker down" would keep an operator away from a relay that works).
        assert!(
            cost.ready_again
                .is_some_and(|ready| ready < Duration::from_secs(10)),
            "{rabbit:?} {queue_type:?}: a relay was not ready 10 s after what waited shipped ({cost})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_of_10_s_on_quorum_queues() {
    partitions(Rabbit::V3_10, QueueType::Quorum, Duration::from_secs(10)).await;
}

#[ignore = "opt-in (about 3-5 minutes): cargo test --test partitions -- --include-ignored"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_of_30_s_on_quorum_queues() {
    partitions(Rabbit::V3_10, QueueType::Quorum, Duration::from_secs(30)).await;
}

#[ignore = "opt-in (about 3-5 minutes): cargo test --test partitions -- --include-ignored"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_of_10_s_on_quorum_queues_on_rabbitmq_4_0() {
    partitions(Rabbit::V4_0, QueueType::Quorum, Duration::from_secs(10)).await;
}

#[ignore = "opt-in (about 3-5 minutes): cargo test --test partitions -- --include-ignored"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_of_30_s_on_quorum_queues_on_rabbitmq_4_0() {
    partitions(Rabbit::V4_0, QueueType::Quorum, Duration::from_secs(30)).await;
}

#[ignore = "opt-in (about 3-5 minutes): cargo test --test partitions -- --include-ignored"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_of_10_s_on_streams() {
    partitions(Rabbit::V3_10, QueueType::Stream, Duration::from_secs(10)).await;
}

#[ignore = "opt-in (about 3-5 minutes): cargo test --test partitions -- --include-ignored"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_of_30_s_on_streams() {
    partitions(Rabbit::V3_10, QueueType::Stream, Duration::from_secs(30)).await;
}

#[ignore = "opt-in (about 3-5 minutes): cargo test --test partitions -- --include-ignored"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_of_10_s_on_streams_on_rabbitmq_4_0() {
    partitions(Rabbit::V4_0, QueueType::Stream, Duration::from_secs(10)).await;
}

#[ignore = "opt-in (about 3-5 minutes): cargo test --test partitions -- --include-ignored"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions_of_30_s_on_streams_on_rabbitmq_4_0() {
    partitions(Rabbit::V4_0, QueueType::Stream, Duration::from_secs(30)).await;
}

/// Three NATS servers (the machine's 2.9.10, or 2.10 from the root of `scripts/rabbitmq-root`),
/// each in a network namespace of its own on a bridge of the cluster's own
/// (`scripts/nats-cluster`), one JetStream cluster; stopped with its network when dropped.
struct NatsNet {
    dir: std::path::PathBuf,
    root: Option<&'static std::path::Path>,
    urls: Vec<String>,
}

impl NatsNet {
    fn script() -> std::process::Command {
        std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/nats-cluster"))
    }

    fn run(root: Option<&std::path::Path>, args: &[&std::ffi::OsStr]) -> String {
        let mut script = Self::script();
        if let Some(root) = root {
            script.env("NATS_ROOT", root);
        }
        let output = script
            .args(args)
            .env("NATS_CLUSTER_OWNER", std::process::id().to_string())
            .stdin(std::process::Stdio::null())
            .output()
            .expect("scripts/nats-cluster runs");
        assert!(
            output.status.success(),
            "scripts/nats-cluster {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Starts the cluster, on 2.10 when `on_2_10`.
    fn start(label: &str, on_2_10: bool) -> Self {
        // Clusters of test processes that were killed before their drops ran.
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            Self::run(None, &["sweep".as_ref()]);
        });
        let root = on_2_10.then(crate::node::rabbitmq4_root);
        let dir = match root {
            Some(root) => root.join("tmp").join(testkit::unique(label)),
            None => std::env::temp_dir().join(testkit::unique(label)),
        };
        let urls = Self::run(root, &["start".as_ref(), dir.as_os_str()])
            .trim()
            .split(',')
            .map(str::to_owned)
            .collect();
        Self { dir, root, urls }
    }

    fn cut(&self, a: End, b: End) {
        Self::run(
            self.root,
            &[
                "cut".as_ref(),
                self.dir.as_os_str(),
                a.to_string().as_ref(),
                b.to_string().as_ref(),
            ],
        );
    }

    fn heal(&self) {
        Self::run(self.root, &["heal".as_ref(), self.dir.as_os_str()]);
    }

    /// Waits until the cluster places a stream on three replicas (its JetStream peers all
    /// known to its metadata leader), by creating and deleting one, within 60 s.
    async fn until_ready(&self) {
        let placed = || async {
            let client = async_nats::connect(self.urls.clone()).await.ok()?;
            let context = async_nats::jetstream::new(client);
            let config = async_nats::jetstream::stream::Config {
                name: "ready".into(),
                subjects: vec!["ready".into()],
                num_replicas: 3,
                ..Default::default()
            };
            context.create_stream(config).await.ok()?;
            context.delete_stream("ready").await.ok()
        };
        wait_until(
            "the cluster placing R3 streams",
            Duration::from_secs(60),
            || async {
                tokio::time::timeout(Duration::from_secs(5), placed())
                    .await
                    .ok()
                    .flatten()
                    .is_some()
            },
        )
        .await;
    }

    /// The servers' view of `stream`, from the first that answers within 3 s: its leader
    /// (1-based) and whether every replica is current.
    async fn stream_state(&self, stream: &str) -> Option<(u8, bool)> {
        for url in &self.urls {
            let asked = async {
                let client = async_nats::connect(url).await.ok()?;
                let context = async_nats::jetstream::new(client);
                let mut found = context.get_stream(stream).await.ok()?;
                let info = found.info().await.ok()?;
                let cluster = info.cluster.as_ref()?;
                let leader: u8 = cluster
                    .leader
                    .as_ref()?
                    .trim_start_matches('n')
                    .parse()
                    .ok()?;
                let current = cluster.replicas.len() == 2
                    && cluster.replicas.iter().all(|replica| replica.current);
                Some((leader, current))
            };
            if let Ok(Some(state)) = tokio::time::timeout(Duration::from_secs(3), asked).await {
                return Some(state);
            }
        }
        None
    }
}

impl Drop for NatsNet {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The servers' logs, kept for the failure's report.
            let kept = std::env::temp_dir().join(format!(
                "relay-nats-net-logs-{}",
                self.dir.file_name().unwrap().to_string_lossy()
            ));
            for n in 1..=3 {
                let _ = std::fs::create_dir_all(&kept);
                let _ = std::fs::copy(
                    self.dir.join(format!("n{n}/log")),
                    kept.join(format!("n{n}.log")),
                );
            }
            eprintln!("the NATS servers' logs are kept in {}", kept.display());
        }
        let mut script = Self::script();
        if let Some(root) = self.root {
            script.env("NATS_ROOT", root);
        }
        let _ = script
            .arg("stop")
            .arg(&self.dir)
            .stdin(std::process::Stdio::null())
            .status();
    }
}

/// Network partitions of a NATS JetStream cluster (three servers in namespaces, the stream on
/// three replicas), while a host writes on, a relay ships and a consumer group folds, all in
/// this machine's namespace: the stream's leader cut off from the other two servers (they
/// elect another; the old one can commit nothing), a follower cut off, a bridge (the leader
/// cut off from one follower, the other reaching both), and the relay and the consumer cut off
/// from the leader's server (the servers whole), each for 10 s without a reset, then healed.
/// What must hold: nothing lost; nothing stored twice within the stream's duplicate window (a
/// resend past it is a second copy the fold absorbs, counted); the fold exactly the live
/// history in Lsn order per branch; and after each heal, every intent written before it acked
/// within the duplicate window (20 s here) and 15 s (printed for each cut). On 2.9.10 and
/// 2.10.27 this found acked events missing from the stream (16 to 527 a run): a resend to a
/// leader that still had the first copy in flight was answered `duplicate` with sequence 0,
/// and that copy died with the leader's quorum (`nats::attribute`, `Answer::InFlight`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_partitions_of_10_s_lose_nothing_on_2_10() {
    nats_partitions(true, Duration::from_secs(10)).await;
}

/// The same shapes for 30 s each, longer than the duplicate window (20 s): a message id a
/// cut-off leader staged is forgotten before the heal. Opt-in, like RabbitMQ's 30 s variants.
#[ignore = "opt-in (about 4 minutes): cargo test --test partitions -- --include-ignored nats_partitions_of_30_s"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_partitions_of_30_s_lose_nothing_on_2_10() {
    nats_partitions(true, Duration::from_secs(30)).await;
}

/// The same on the machine's NATS 2.9.10. Opt-in: it fails there in most runs, for the
/// server's own causes (docs/operations.md, "On NATS JetStream"): acked events missing from the
/// stream, one message id stored twice inside the duplicate window, a reader skipping events
/// the stream holds. 2.10 shows none of it.
#[ignore = "opt-in (about 2 minutes; 2.9.10 loses acked events across partitions): cargo test --test partitions -- --include-ignored nats"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_partitions_of_10_s_lose_nothing_on_2_9_10() {
    nats_partitions(false, Duration::from_secs(10)).await;
}

async fn nats_partitions(on_2_10: bool, length: Duration) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use distribution::consumer::{Consumer, NatsConsumerConfig};
    use distribution::store::{EventTable, FoldStore, Lsn, Outbox};

    use crate::harness::*;

    let _alone = ONE_AT_A_TIME.lock().await;
    let cluster = tokio::task::block_in_place(|| NatsNet::start("relay-nats-net", on_2_10));
    cluster.until_ready().await;
    let (pool, url) = fresh_database("nats_partitions").await;
    let (fold_pool, _) = fresh_database("nats_partitions_fold").await;
    let stream = distribution::nats::scratch::unique_stream("partitions");
    let mut config = relay_config(&url, "", &stream);
    config.broker = distribution::BrokerKind::Nats;
    config.nats_url = cluster.urls.join(",");
    config.nats_replicas = 3;
    config.nats_ack_timeout = Duration::from_secs(2);
    // A leader that lost a proposal keeps its message ids staged (sequence 0) until the
    // duplicate window ends, answering every resend "in flight" meanwhile (seen in CI: 110 s
    // with the default 120 s window): a short window bounds the heal.
    let window = Duration::from_secs(20);
    config.nats_duplicate_window = window;
    let relay = distribution::Relay::start(config.clone()).await.unwrap();
    let readiness: Arc<[distribution::Readiness]> = Arc::new([relay.readiness(
        Outbox::new(pool.clone()),
        u64::from(config.ready_max_parked),
    )]);
    let mut group = NatsConsumerConfig::new(config.nats_config().unwrap(), "projector").unwrap();
    group.retry.max = Duration::from_millis(500);
    let consumer = Consumer::on_nats(group, fold_pool.clone(), EventTable);
    let progress = consumer.progress();
    let folding = until_stopped(|stopped| consumer.run(stopped));
    let fold = FoldStore::new(fold_pool.clone());
    let outbox = Outbox::new(pool.clone());

    let workload = Workload::new("nats_part", 4, 2, 10);
    let ran = workload.run(&pool).await;
    let first = ran.expected.clone();
    wait_until(
        "the first steps folded",
        Duration::from_secs(60),
        || async { folded_count(&fold, &first).await == count(&first) },
    )
    .await;
    let writing = Arc::new(AtomicBool::new(false));
    let writer = crate::recorder::keep_writing(pool.clone(), workload, ran, writing.clone());

    let mut heals = Vec::new();
    for shape in [
        "leader alone",
        "follower alone",
        "bridge",
        "clients from leader",
    ] {
        let (leader, _) = cluster.stream_state(&stream).await.expect("a leader");
        let follower = (1..=3u8).find(|&n| n != leader).unwrap();
        let cuts: Vec<(End, End)> = match shape {
            "leader alone" => (1..=3u8)
                .filter(|&n| n != leader)
                .map(|n| (End::Node(leader), End::Node(n)))
                .collect(),
            "follower alone" => (1..=3u8)
                .filter(|&n| n != follower)
                .map(|n| (End::Node(follower), End::Node(n)))
                .collect(),
            // The leader and one follower no longer see each other; the other follower sees
            // both, so the leader keeps a quorum through it while the cut-off follower may
            // campaign.
            "bridge" => vec![(End::Node(leader), End::Node(follower))],
            _ => vec![(End::Host, End::Node(leader))],
        };
        let (stop_listening, stop) = tokio::sync::watch::channel(false);
        tokio::task::block_in_place(|| cuts.iter().for_each(|(a, b)| cluster.cut(*a, *b)));
        let listening = listen(readiness.clone(), None, stop);
        tokio::time::sleep(length).await; // the cut's length, not a wait for a state
        stop_listening.send_replace(true);
        tokio::task::block_in_place(|| cluster.heal());
        let healed = std::time::Instant::now();
        let said = listening.await.expect("the readiness listener ran");
        let (heal_at, _) = oldest_pending(&pool).await;
        wait_until(
            "every intent written before the heal acked",
            Duration::from_secs(120),
            || async {
                oldest_pending(&pool)
                    .await
                    .1
                    .is_none_or(|oldest| oldest >= heal_at)
            },
        )
        .await;
        let heal = healed.elapsed();
        let ready_again = until_ready(&readiness, std::time::Instant::now()).await;
        wait_until(
            "the stream whole again",
            Duration::from_secs(60),
            || async {
                cluster
                    .stream_state(&stream)
                    .await
                    .is_some_and(|(_, current)| current)
            },
        )
        .await;
        println!(
            "NATS {shape} (leader n{leader}) for {length:?}: acked {heal:.1?} after the heal, ready {ready_again:.1?} after that; readiness while cut: {said}"
        );
        heals.push((shape, heal, ready_again));
    }

    writing.store(true, Ordering::Release);
    let all = writer.await.unwrap();
    wait_until("backlog empty", Duration::from_secs(60), || async {
        pending(&outbox).await == 0
    })
    .await;
    // The stream itself: each event once, every live intent. A branch's events may be stored
    // out of Lsn order: a leader change under a pipelined batch loses an earlier event with
    // the old leader while the new one stores a later one, and the earlier is sent again
    // (WIRE.md: a resend can follow a later message; the fold holds back). Counted, not
    // refused.
    let stored =
        distribution::nats::scratch::read_stream_stored_at(&cluster.urls[0], &stream).await;
    let mut last: std::collections::BTreeMap<_, Lsn> = std::collections::BTreeMap::new();
    let mut seen = std::collections::BTreeMap::new();
    let mut behind = 0;
    let mut again = 0;
    for (event, stored_at) in stored {
        let event = event.unwrap();
        // The stream drops a resend with the same id inside its duplicate window only; a resend
        // later than that (an ack lost, the next try past the window) is a second copy, which
        // the fold absorbs (WIRE.md). A second copy inside the window would be a defect.
        if let Some(first) = seen.insert(event.key.clone(), stored_at) {
            let apart = stored_at.duration_since(first).unwrap_or_default();
            assert!(
                apart >= window,
                "{:?} stored twice {apart:?} apart, inside the {window:?} duplicate window",
                event.key
            );
            again += 1;
            continue;
        }
        let before = last
            .entry(event.key.branch.clone())
            .or_insert(event.key.lsn);
        if *before > event.key.lsn {
            behind += 1;
        } else {
            *before = event.key.lsn;
        }
    }
    println!(
        "{behind} events stored after a later one of their branch; {again} stored again after the duplicate window"
    );
    let missing: Vec<String> = all
        .iter()
        .flat_map(|(branch, intents)| {
            intents
                .iter()
                .filter(|(lsn, _)| {
                    !seen.contains_key(&distribution::store::EventKey {
                        branch: branch.clone(),
                        lsn: *lsn,
                    })
                })
                .map(move |(lsn, _)| format!("{branch}/{lsn}"))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "{} live intents acked but not in the stream, the first: {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    // As `until_folded_exactly`, saying on a timeout which branches fell short and where the
    // group stands (a finding, if it happens, needs that much).
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while folded_count(&fold, &all).await != count(&all) {
        if std::time::Instant::now() > deadline {
            let mut short = Vec::new();
            for tenant in tenants_of(&all) {
                let folded = fold.folded(&tenant).await.unwrap();
                for (branch, intents) in all.iter().filter(|(key, _)| key.tenant == tenant) {
                    let got: Vec<u64> = folded
                        .iter()
                        .filter(|event| event.key.branch == *branch)
                        .map(|event| event.key.lsn.get())
                        .collect();
                    if got.len() != intents.len() {
                        short.push(format!(
                            "{branch}: {} of {} folded, the last {:?}, the stream's last {:?}",
                            got.len(),
                            intents.len(),
                            got.last(),
                            last.get(branch)
                        ));
                    }
                }
            }
            panic!(
                "the fold fell short after 90 s: {short:?}; the group: {:?}; held back: {}",
                progress.totals(),
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM relay_fold_parked")
                    .fetch_one(&fold_pool)
                    .await
                    .unwrap_or(-1)
            );
        }
        // Polling pace, not synchronisation.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_folded_exactly(&fold, &all).await;
    let stats = folding.stop().await.unwrap();
    println!("the group: {stats:?}");
    assert_eq!(stats.rejected, 0, "{stats:?}");
    relay.shutdown().await;
    for (shape, heal, ready_again) in heals {
        assert!(
            heal < window + Duration::from_secs(15),
            "NATS {shape}: intents written before the heal waited {heal:?} after it (the \
             duplicate window is {window:?})"
        );
        // As for RabbitMQ: ready within 10 s of shipping again.
        assert!(
            ready_again.is_some_and(|ready| ready < Duration::from_secs(10)),
            "NATS {shape}: the relay was not ready 10 s after what waited shipped ({ready_again:?})"
        );
    }
}

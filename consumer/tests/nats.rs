//! The consumer on NATS JetStream (the machine's server, `NATS_URL`) and PostgreSQL: a group
//! folds each partition once, in order, and resumes exactly where its fold stopped; a second
//! consumer of the group stands by and takes over when the first dies; a message that is not
//! an event is kept as a dead letter and the partition flows on; a new group replays the
//! stream. Each test has a stream and a database of its own, deleted at the end (and at the
//! process's exit if the test fails).
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use broker::Publisher;
use consumer::{Consumer, FoldStats, NatsConsumerConfig, StreamStart};
use nats::{NatsConfig, NatsPublisher};
use sqlx::PgConnection;
use sqlx::PgPool;
use store::{EventTable, OutboxEvent, Projection, RewindNotice};

const WAIT: Duration = Duration::from_secs(30);

fn config(label: &str, partitions: u16) -> NatsConfig {
    let stream = nats::scratch::unique_stream(label);
    NatsConfig::new(&testkit::nats_url(), &stream, partitions).unwrap()
}

/// Events `from..=to` of four branches over two tenants and three runs, interleaved, each
/// after the one before it in its branch.
fn interleaved(from: u64, to: u64) -> Vec<OutboxEvent> {
    let branches = [
        testkit::branch("acme", "run-1", "main"),
        testkit::branch("acme", "run-1", "retry-1"),
        testkit::branch("acme", "run-2", "main"),
        testkit::branch("globex", "run-9", "main"),
    ];
    (from..=to)
        .flat_map(|lsn| {
            branches
                .iter()
                .map(move |branch| testkit::intent(branch, lsn).prev(lsn - 1).build())
        })
        .collect()
}

async fn publish(config: &NatsConfig, events: &[OutboxEvent]) {
    let mut publisher = NatsPublisher::new(config.clone());
    let report = publisher.publish(events).await;
    assert_eq!(report.accepted(), events.len(), "{:?}", report.fault);
}

/// What the fold applied, per branch in the order applied: `tenant/run/branch` -> Lsns.
async fn folded(pool: &PgPool) -> BTreeMap<String, Vec<u64>> {
    let rows: Vec<(String, String, String, i64)> = sqlx::query_as(
        "SELECT tenant_id, run_id, branch_id, lsn FROM relay_fold_event ORDER BY applied_seq",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut branches: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (tenant, run, branch, lsn) in rows {
        branches
            .entry(format!("{tenant}/{run}/{branch}"))
            .or_default()
            .push(lsn as u64);
    }
    branches
}

fn exactly(to: u64) -> BTreeMap<String, Vec<u64>> {
    [
        "acme/run-1/main",
        "acme/run-1/retry-1",
        "acme/run-2/main",
        "globex/run-9/main",
    ]
    .into_iter()
    .map(|branch| (branch.to_owned(), (1..=to).collect()))
    .collect()
}

async fn applied(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM relay_fold_event")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A consumer of `group` running on its own task until stopped (`stop`) or killed (`kill`).
struct Running {
    task: testkit::Running<Result<FoldStats, broker::Error>>,
    progress: consumer::ConsumerProgress,
}

/// [`EventTable`], until it was handed `stall_after` intents: then it never answers again,
/// holding its consumer inside a batch's transaction.
#[derive(Clone)]
struct Stalls {
    handed: Arc<AtomicU64>,
    stall_after: u64,
}

impl Projection for Stalls {
    type Error = store::Error;

    async fn apply(
        &mut self,
        tx: &mut PgConnection,
        event: &OutboxEvent,
    ) -> Result<(), Self::Error> {
        if self.handed.fetch_add(1, Ordering::SeqCst) >= self.stall_after {
            std::future::pending::<()>().await;
        }
        EventTable.apply(tx, event).await
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &RewindNotice,
    ) -> Result<(), Self::Error> {
        EventTable.rewind(tx, rewind).await
    }
}

impl Running {
    fn start(config: NatsConsumerConfig, pool: PgPool) -> Self {
        Self::folding(config, pool, EventTable)
    }

    fn folding<P>(config: NatsConsumerConfig, pool: PgPool, projection: P) -> Self
    where
        P: Projection + Clone + Sync + 'static,
    {
        let consumer = Consumer::on_nats(config, pool, projection);
        let progress = consumer.progress();
        let task = testkit::until_stopped(|stopped| consumer.run(stopped));
        Self { task, progress }
    }

    async fn stop(self) -> FoldStats {
        self.task.stop().await.unwrap()
    }
}

fn group(config: &NatsConfig, name: &str) -> NatsConsumerConfig {
    let mut group = NatsConsumerConfig::new(config.clone(), name).unwrap();
    group.batch.linger = Duration::from_millis(5);
    group.standby_poll = Duration::from_millis(100);
    group
}

/// A group folds every partition once, in order per branch; stopped and started again it
/// resumes at the position its fold stored (nothing read twice); a second group on the same
/// database, started at the first message, reads the whole stream again and the fold applies
/// none of it twice.
#[tokio::test]
async fn a_group_folds_once_in_order_resumes_where_it_stopped_and_a_new_group_replays() {
    let config = config("consume", 3);
    let (pool, _) = testkit::migrated_database("nats_consume").await;
    publish(&config, &interleaved(1, 40)).await;

    let first = Running::start(group(&config, "projector"), pool.clone());
    testkit::wait_until("160 events folded", WAIT, || async {
        applied(&pool).await == 160
    })
    .await;
    let stats = first.stop().await;
    assert_eq!(stats.applied, 160, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(folded(&pool).await, exactly(40));

    publish(&config, &interleaved(41, 60)).await;
    let again = Running::start(group(&config, "projector"), pool.clone());
    testkit::wait_until("240 events folded", WAIT, || async {
        applied(&pool).await == 240
    })
    .await;
    let stats = again.stop().await;
    assert_eq!(stats.applied, 80, "{stats:?}");
    assert_eq!(
        stats.duplicates, 0,
        "resumed exactly after the stored position: {stats:?}"
    );
    assert_eq!(folded(&pool).await, exactly(60));

    let mut replay = group(&config, "replay");
    replay.start = StreamStart::First;
    let replay = Running::start(replay, pool.clone());
    let progress = replay.progress.clone();
    testkit::wait_until("the replay read the whole stream", WAIT, || {
        let progress = progress.clone();
        async move { progress.totals().duplicates == 240 }
    })
    .await;
    let stats = replay.stop().await;
    assert_eq!((stats.applied, stats.duplicates), (0, 240), "{stats:?}");
    assert_eq!(folded(&pool).await, exactly(60));
    nats::scratch::delete_stream(&testkit::nats_url(), &config.stream).await;
}

/// Two consumers of one group, each with its own database pool, as two processes would be:
/// the second stands by while the first reads every partition; the first is killed (its task
/// aborted: its connections close without a word) while it holds a batch's transaction open in
/// the middle of a backlog, and the second takes every partition over from the positions the
/// first's fold stored. Every event is applied once, in order per branch, and nothing is read
/// twice.
#[tokio::test]
async fn a_second_consumer_of_the_group_stands_by_and_takes_over_when_the_first_dies() {
    let config = config("takeover", 2);
    let (pool, url) = testkit::migrated_database("nats_takeover").await;
    let other_pool = PgPool::connect(&url).await.unwrap();
    publish(&config, &interleaved(1, 25)).await;

    let stalls = Stalls {
        handed: Arc::new(AtomicU64::new(0)),
        stall_after: 300,
    };
    let first = Running::folding(group(&config, "projector"), pool.clone(), stalls.clone());
    testkit::wait_until("the first consumer folding", WAIT, || async {
        applied(&pool).await == 100
    })
    .await;
    let second = Running::start(group(&config, "projector"), other_pool.clone());
    let standing = second.progress.clone();
    testkit::wait_until(
        "the second consumer standing by on both partitions",
        WAIT,
        || {
            let standing = standing.clone();
            async move { standing.totals().standbys == 2 }
        },
    )
    .await;
    assert_eq!(second.progress.totals().applied, 0);

    // A backlog; the first stalls inside a batch past its 300th intent and is killed there.
    publish(&config, &interleaved(26, 150)).await;
    testkit::wait_until("the first consumer stalled inside a batch", WAIT, || {
        let handed = stalls.handed.clone();
        async move { handed.load(Ordering::SeqCst) > 300 }
    })
    .await;
    let before_kill = applied(&pool).await;
    assert!(
        before_kill < 300,
        "the stalled batch is not committed: {before_kill}"
    );
    first.task.abort();
    let killed = first.progress.totals();
    testkit::wait_until("all 600 events folded", WAIT, || async {
        applied(&pool).await == 600
    })
    .await;
    let stats = second.stop().await;
    assert_eq!(stats.applied, 600 - before_kill as u64, "{stats:?}");
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(killed.duplicates, 0, "{killed:?}");
    assert_eq!(folded(&pool).await, exactly(150));
    nats::scratch::delete_stream(&testkit::nats_url(), &config.stream).await;
}

/// A message on a partition's subject that is not an event of the contract is kept in the
/// dead-letter stream under the group, with the reason, and the events around it are folded.
#[tokio::test]
async fn a_message_that_is_not_an_event_is_kept_as_a_dead_letter_and_the_partition_flows() {
    let config = config("poison", 1);
    let (pool, _) = testkit::migrated_database("nats_poison").await;
    let events = interleaved(1, 5);
    publish(&config, &events[..8]).await;
    let client = async_nats::connect(testkit::nats_url()).await.unwrap();
    let context = async_nats::jetstream::new(client);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "not-an-event");
    headers.insert("wire_version", "4");
    context
        .publish_with_headers(
            config.subject(broker::Partition(0)),
            headers,
            "garbage".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    publish(&config, &events[8..]).await;

    let running = Running::start(group(&config, "projector"), pool.clone());
    testkit::wait_until("20 events folded", WAIT, || async {
        applied(&pool).await == 20
    })
    .await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.rejected), (20, 1), "{stats:?}");
    assert_eq!(folded(&pool).await, exactly(5));

    let dead = nats::dead_letter_stream(&config.stream);
    let mut stream = context.get_stream(&dead).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
    let kept = stream.get_raw_message(1).await.unwrap();
    assert_eq!(kept.subject.as_str(), format!("{dead}.projector"));
    assert_eq!(&kept.payload[..], b"garbage");
    let reason = kept
        .headers
        .get(broker::DEAD_LETTER_REASON)
        .unwrap()
        .as_str()
        .to_owned();
    assert!(reason.starts_with("contract: "), "{reason}");
    nats::scratch::delete_stream(&testkit::nats_url(), &config.stream).await;
}

/// The fold's database connection killed under a running consumer (every other session of its
/// database terminated by the server): the session ends, a new one takes the lock again on a
/// fresh connection and reads on from the stored position. Every event once, in order.
#[tokio::test]
async fn a_consumer_whose_database_connection_is_killed_reads_on_from_its_position() {
    let config = config("pgkill", 2);
    let (pool, url) = testkit::migrated_database("nats_pgkill").await;
    publish(&config, &interleaved(1, 20)).await;
    let running = Running::start(
        group(&config, "projector"),
        PgPool::connect(&url).await.unwrap(),
    );
    testkit::wait_until("80 events folded", WAIT, || async {
        applied(&pool).await == 80
    })
    .await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND pid <> pg_backend_pid()) killed",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(killed >= 2, "the consumer's held connections: {killed}");
    publish(&config, &interleaved(21, 40)).await;
    testkit::wait_until("160 events folded", WAIT, || async {
        applied(&pool).await == 160
    })
    .await;
    let stats = running.stop().await;
    assert!(stats.reconnects >= 2, "{stats:?}");
    assert_eq!((stats.applied, stats.duplicates), (160, 0), "{stats:?}");
    assert_eq!(folded(&pool).await, exactly(40));
    nats::scratch::delete_stream(&testkit::nats_url(), &config.stream).await;
}

/// A stream deleted and created again under a group's stored position starts its sequences
/// at 1 again: the consumer refuses to read on (it would skip, without a word, everything below
/// the old position), says so on every attempt, and folds nothing of the new stream.
#[tokio::test]
async fn a_stream_created_again_under_a_stored_position_is_refused_not_skipped() {
    let config = config("recreated", 1);
    let (pool, _) = testkit::migrated_database("nats_recreated").await;
    publish(&config, &interleaved(1, 10)).await;
    let first = Running::start(group(&config, "projector"), pool.clone());
    testkit::wait_until("40 events folded", WAIT, || async {
        applied(&pool).await == 40
    })
    .await;
    first.stop().await;
    nats::scratch::delete_stream(&testkit::nats_url(), &config.stream).await;
    let other = testkit::branch("initech", "run-1", "main");
    publish(&config, &testkit::intents(&other, &[1, 2, 3])).await;

    let again = Running::start(group(&config, "projector"), pool.clone());
    let progress = again.progress.clone();
    testkit::wait_until("the consumer refusing twice", WAIT, || {
        let progress = progress.clone();
        async move { progress.totals().reconnects >= 2 }
    })
    .await;
    let stats = again.stop().await;
    assert_eq!(stats.applied, 0, "{stats:?}");
    assert_eq!(applied(&pool).await, 40);
    nats::scratch::delete_stream(&testkit::nats_url(), &config.stream).await;
}

/// A group that starts at the next message has its reader's server-side consumer deleted
/// before anything arrived (as a leader election or missed heartbeats do): async-nats recreates
/// it from the stream's first message, and the consumer still folds only what came after it
/// started.
#[tokio::test]
async fn a_reader_recreated_before_its_first_message_keeps_its_start() {
    let config = config("recreate_reader", 1);
    let (pool, _) = testkit::migrated_database("nats_recreate_reader").await;
    publish(&config, &interleaved(1, 10)).await;
    let mut next = group(&config, "live");
    next.start = StreamStart::Next;
    let running = Running::start(next, pool.clone());
    let client = async_nats::connect(testkit::nats_url()).await.unwrap();
    let context = async_nats::jetstream::new(client);
    let stream = context.get_stream(&config.stream).await.unwrap();
    let consumers = || async {
        use futures_util::TryStreamExt;
        let names: Vec<String> = stream.consumer_names().try_collect().await.unwrap();
        names
    };
    testkit::wait_until("the reader's consumer on the server", WAIT, || async {
        consumers().await.len() == 1
    })
    .await;
    let deleted = consumers().await.remove(0);
    stream.delete_consumer(&deleted).await.unwrap();
    testkit::wait_until("the reader's consumer recreated", WAIT, || async {
        consumers().await.iter().any(|name| *name != deleted)
    })
    .await;
    let later = testkit::branch("initech", "run-1", "main");
    publish(&config, &testkit::intents(&later, &[1, 2, 3, 4])).await;
    testkit::wait_until("the new events folded", WAIT, || async {
        applied(&pool).await >= 4
    })
    .await;
    let stats = running.stop().await;
    assert_eq!((stats.applied, stats.duplicates), (4, 0), "{stats:?}");
    let folded = folded(&pool).await;
    assert_eq!(
        folded.into_iter().collect::<Vec<_>>(),
        [("initech/run-1/main".to_owned(), vec![1, 2, 3, 4])]
    );
    nats::scratch::delete_stream(&testkit::nats_url(), &config.stream).await;
}

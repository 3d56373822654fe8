//! Streams (`RELAY_QUEUE_TYPE=stream`) on the real PostgreSQL and RabbitMQ: every consumer group
//! reads the same partition streams from an offset it keeps in its own fold database, stored
//! in the transaction of each fold. A group created after 10,000 events (with rewinds) replays
//! them into exactly the live group's projection; killed mid-replay it resumes at its stored
//! offset (no delivery folded twice); reset, it rebuilds the same projection. Retention that
//! removes old segments leaves a live consumer alone and stops a group whose offset fell out
//! of it, loudly.
use std::time::Duration;

use distribution::RelayConfig;
use distribution::broker::{Group, Partition};
use distribution::consumer::{Consumer, ConsumerConfig, FoldStats};
use distribution::rabbit::{QueueType, RabbitConfig, StreamRetention, Topology};
use distribution::store::{EventTable, FoldStore, Outbox};
use distribution::{Relay, broker};
use futures_util::FutureExt;
use lapin::options::QueueDeleteOptions;
use sqlx::PgPool;

use crate::harness::{
    Expected, Folding, HostRuntime, Running, Workload, amqp_url, assert_folded_exactly, count,
    declare_topology, drop_topology, fold_database, folded_count, fresh_database, merge, pending,
    relay_config, unique, until_stopped, wait_until,
};

/// A relay configuration on stream partitions.
fn stream_config(url: &str, name: &str, retention: StreamRetention) -> RelayConfig {
    let mut config = relay_config(url, &amqp_url(), name);
    config.queue_type = QueueType::Stream;
    config.stream_retention = retention;
    config
}

/// `base` read as consumer group `group`.
fn as_group(base: &RabbitConfig, group: &str) -> RabbitConfig {
    let mut rabbit = base.clone();
    rabbit.topology = base
        .topology
        .clone()
        .with_group(Group::parse(group).unwrap());
    rabbit
}

/// A group's own fold database: its store and URL.
async fn fold_store(label: &str) -> (FoldStore, String) {
    let (pool, url) = fold_database(label).await;
    (FoldStore::new(pool), url)
}

/// The `application_name` of a [`Replaying`] consumer's database sessions.
const REPLAYING: &str = "stream-replay";

/// A consumer of `rabbit` folding into the event table of the database at `url`, on a pool of
/// its own, until stopped (or killed).
struct Replaying {
    progress: distribution::consumer::ConsumerProgress,
    task: Running<Result<FoldStats, broker::Error>>,
    pool: PgPool,
}

impl Replaying {
    async fn start(rabbit: &RabbitConfig, url: &str) -> Self {
        Self::start_with(
            rabbit,
            url,
            ConsumerConfig::new(rabbit.clone()).stream_resubscribe,
        )
        .await
    }

    /// Started with silent partitions subscribed to again after `resubscribe`.
    async fn start_with(rabbit: &RabbitConfig, url: &str, resubscribe: Duration) -> Self {
        let mut config = ConsumerConfig::new(rabbit.clone());
        config.stream_resubscribe = resubscribe;
        config.retry.min = Duration::from_millis(20);
        config.retry.max = Duration::from_millis(300);
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        let pool = PgPool::connect_with(options.application_name(REPLAYING))
            .await
            .unwrap();
        let consumer = Consumer::new(config, pool.clone(), EventTable);
        let progress = consumer.progress();
        let task = until_stopped(|stopped| consumer.run(stopped));
        Self {
            progress,
            task,
            pool,
        }
    }

    fn totals(&self) -> FoldStats {
        self.progress.totals()
    }

    async fn stop(self) -> FoldStats {
        self.task.stop().await.unwrap()
    }

    /// Kills it: every partition task is dropped wherever it is, mid-fold included. Returns
    /// once its database sessions are gone (a commit it had sent has landed, or never will).
    async fn kill(self) {
        self.task.kill().await;
        self.pool.close().await;
        let admin = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(
                (*self.pool.connect_options())
                    .clone()
                    .application_name("admin"),
            )
            .await
            .unwrap();
        wait_until(
            "the killed consumer's sessions ended",
            Duration::from_secs(30),
            || async {
                let others: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND application_name = $1",
                )
                .bind(REPLAYING)
                .fetch_one(&admin)
                .await
                .unwrap();
                others == 0
            },
        )
        .await;
        admin.close().await;
    }
}

async fn stored_offsets(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT queue, next_offset FROM relay_fold_offset ORDER BY queue")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Deletes the streams, the exchange and each named group's dead-letter queue.
async fn drop_streams(topology: &Topology, groups: &[&str]) {
    drop_topology(topology).await;
    let connection =
        lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let channel = connection.create_channel().await.unwrap();
    for group in groups {
        let _ = channel
            .queue_delete(
                topology.dead_letter_queue_of(&Group::parse(group).unwrap()),
                QueueDeleteOptions::default(),
            )
            .await;
    }
}

/// 10,000 events with rewinds (4 tenants x 5 runs x 500 steps) go through the streams to a
/// group that follows live. A group created afterwards replays them from the first offset,
/// is killed mid-replay and resumes at its stored offset with no delivery folded twice, and
/// ends with exactly the live history, as the live group does; reset (`distribution group
/// reset`), it rebuilds the same projection from the start.
#[test]
fn a_group_created_after_the_history_replays_it_into_the_same_projection() {
    with_bounded_teardown(
        a_group_created_after_the_history_replays_it_into_the_same_projection_body(),
    );
}

async fn a_group_created_after_the_history_replays_it_into_the_same_projection_body() {
    let (pool, url) = fresh_database("streams").await;
    let name = unique("relay-streams");
    let config = stream_config(&url, &name, StreamRetention::default());
    let base = config.rabbit_config().unwrap();
    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology(&base.topology).await;
        let (live_fold, _) = fold_store("streamslive").await;
        let live = Folding::start(as_group(&base, "live"), &live_fold);
        let mut workload = Workload::new("str", 4, 5, 500);
        workload.rewind = true;
        let ran = workload.run(&pool).await;
        let expected: Expected = ran.expected.clone();
        assert!(ran.rewinds > 0);
        let relay = Relay::start(config.clone()).await.unwrap();
        let outbox = Outbox::new(pool.clone());
        wait_until("relay drained", Duration::from_secs(120), || async {
            pending(&outbox).await == 0
        })
        .await;
        wait_until(
            "the live group folded everything",
            Duration::from_secs(120),
            || async { folded_count(&live_fold, &expected).await == count(&expected) },
        )
        .await;
        assert_folded_exactly(&live_fold, &expected).await;

        // A group that did not exist while all of it was published.
        let (replay_fold, replay_url) = fold_store("streamsreplay").await;
        let replay = as_group(&base, "replay");
        let first = Replaying::start(&replay, &replay_url).await;
        let total = count(&expected) as u64;
        wait_until(
            "a third of the replay",
            Duration::from_secs(120),
            || async { first.totals().applied >= total / 3 },
        )
        .await;
        first.kill().await;
        let offsets = stored_offsets(replay_fold.pool()).await;
        assert!(!offsets.is_empty(), "offsets are stored with the fold");
        let folded_before = folded_count(&replay_fold, &expected).await;
        assert!(folded_before < count(&expected), "killed mid-replay");
        let second = Replaying::start(&replay, &replay_url).await;
        wait_until(
            "the replay resumed and ended",
            Duration::from_secs(120),
            || async { folded_count(&replay_fold, &expected).await == count(&expected) },
        )
        .await;
        let resumed = second.stop().await;
        assert_folded_exactly(&replay_fold, &expected).await;
        // Resumed exactly at the stored offsets: the fold saw nothing it had already folded
        // (starting again from the first offset would redeliver `folded_before` events).
        assert_eq!(
            resumed.duplicates, 0,
            "resumed after {folded_before} folded events: {resumed:?}"
        );
        assert_eq!(resumed.gaps, 0);

        // Rebuilt from the start: the projection is emptied with the fold's state.
        let cli = std::process::Command::new(env!("CARGO_BIN_EXE_distribution"))
            .args(["group", "reset", "--fold-only"])
            .env("DATABASE_URL", &replay_url)
            .output()
            .unwrap();
        assert!(cli.status.success(), "{cli:?}");
        assert!(stored_offsets(replay_fold.pool()).await.is_empty());
        assert_eq!(folded_count(&replay_fold, &expected).await, 0);
        let rebuilt = Replaying::start(&replay, &replay_url).await;
        wait_until("the rebuild ended", Duration::from_secs(120), || async {
            folded_count(&replay_fold, &expected).await == count(&expected)
        })
        .await;
        rebuilt.stop().await;
        assert_folded_exactly(&replay_fold, &expected).await;

        relay.shutdown().await;
        live.stop().await;
    })
    .catch_unwind()
    .await;
    drop_streams(&base.topology, &["live", "replay"]).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// A stream partition that stays silent is subscribed to again (after 100 ms here) at the
/// offset the fold expects (the defence against a broker that does not tell a subscription of
/// what it holds, `ConsumerConfig::stream_resubscribe`): through three bursts of events with
/// silences between them, in which every partition subscribes again, the group folds every
/// live event once and none twice.
#[test]
fn a_silent_partition_subscribes_again_where_the_fold_expects() {
    with_bounded_teardown(a_silent_partition_subscribes_again_where_the_fold_expects_body());
}

async fn a_silent_partition_subscribes_again_where_the_fold_expects_body() {
    let (pool, url) = fresh_database("streamsquiet").await;
    let name = unique("relay-quiet");
    let config = stream_config(&url, &name, StreamRetention::default());
    let base = config.rabbit_config().unwrap();
    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology(&base.topology).await;
        let (fold, fold_url) = fold_store("streamsquietfold").await;
        let group = as_group(&base, "quiet");
        let consumer = Replaying::start_with(&group, &fold_url, Duration::from_millis(100)).await;
        let relay = Relay::start(config.clone()).await.unwrap();
        let mut expected = Expected::new();
        for burst in 0..3 {
            let ran = Workload::new(&format!("quiet{burst}"), 2, 3, 30)
                .run(&pool)
                .await;
            expected.extend(ran.expected);
            wait_until("the burst folded", Duration::from_secs(60), || async {
                folded_count(&fold, &expected).await == count(&expected)
            })
            .await;
            let before = consumer.progress.partitions();
            wait_until(
                "every partition subscribed again in the silence",
                Duration::from_secs(30),
                || async {
                    let now = consumer.progress.partitions();
                    now.iter()
                        .zip(&before)
                        .all(|(now, before)| now.resubscribes > before.resubscribes)
                },
            )
            .await;
        }
        let totals = consumer.stop().await;
        assert_folded_exactly(&fold, &expected).await;
        assert_eq!(totals.duplicates, 0, "{totals:?}");
        assert_eq!(totals.gaps, 0, "{totals:?}");
        relay.shutdown().await;
    })
    .catch_unwind()
    .await;
    drop_streams(&base.topology, &["quiet"]).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// With a retention of 150 KB per partition in 16 KB segments, 4,000 more events remove the
/// oldest segments: a group that follows live folds every one of them; a group stopped early
/// comes back to find its stored offsets gone, and stops there (a gap counted, the metric
/// `relay_consumer_offset_lost_total`), folding nothing past it, rather than starting over at
/// the first retained offset.
#[test]
fn retention_leaves_a_live_group_alone_and_stops_a_group_whose_offset_fell_out() {
    with_bounded_teardown(
        retention_leaves_a_live_group_alone_and_stops_a_group_whose_offset_fell_out_body(),
    );
}

async fn retention_leaves_a_live_group_alone_and_stops_a_group_whose_offset_fell_out_body() {
    let (pool, url) = fresh_database("streamsretention").await;
    let name = unique("relay-streamret");
    let retention = StreamRetention {
        max_age: None,
        max_bytes: Some(150_000),
        segment_bytes: Some(16_000),
    };
    let config = stream_config(&url, &name, retention);
    let base = config.rabbit_config().unwrap();
    let outcome = std::panic::AssertUnwindSafe(async {
        declare_topology(&base.topology).await;
        let (live_fold, _) = fold_store("streamsretlive").await;
        let (late_fold, late_url) = fold_store("streamsretlate").await;
        let live = Folding::start(as_group(&base, "live"), &live_fold);
        let late = Replaying::start(&as_group(&base, "late"), &late_url).await;
        let relay = Relay::start(config.clone()).await.unwrap();
        let workload = Workload::new("ret", 2, 8, 10);
        let ran = workload.run(&pool).await;
        let mut expected = ran.expected.clone();
        wait_until(
            "both groups folded the first events",
            Duration::from_secs(60),
            || async {
                folded_count(&live_fold, &expected).await == count(&expected)
                    && folded_count(&late_fold, &expected).await == count(&expected)
            },
        )
        .await;
        late.stop().await;
        let late_offsets = stored_offsets(late_fold.pool()).await;
        assert!(!late_offsets.is_empty(), "offsets are stored with the fold");

        let more = workload.steps(&pool, ran.live.clone(), 11..=260).await;
        merge(&mut expected, &more.expected);
        let outbox = Outbox::new(pool.clone());
        wait_until("relay drained", Duration::from_secs(120), || async {
            pending(&outbox).await == 0
        })
        .await;
        wait_until(
            "the live group folded everything",
            Duration::from_secs(120),
            || async { folded_count(&live_fold, &expected).await == count(&expected) },
        )
        .await;
        assert_folded_exactly(&live_fold, &expected).await;
        assert_eq!(live.totals().gaps, 0, "a live group never meets a gap");

        let folded_late = folded_count(&late_fold, &expected).await;
        let back = Replaying::start(&as_group(&base, "late"), &late_url).await;
        wait_until(
            "the late group stops at the gap",
            Duration::from_secs(60),
            || async { back.totals().gaps >= 1 },
        )
        .await;
        let totals = back.stop().await;
        assert_eq!(totals.applied, 0, "nothing past the gap is folded");
        assert_eq!(folded_count(&late_fold, &expected).await, folded_late);
        assert_eq!(
            stored_offsets(late_fold.pool()).await,
            late_offsets,
            "its offsets stay where they were"
        );

        // Retiring a group on streams deletes its dead-letter queue only: the streams every
        // group reads stay, with what they hold.
        let connection =
            lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let late_group = Group::parse("late").unwrap();
        base.topology
            .delete_group(&connection.create_channel().await.unwrap(), &late_group)
            .await
            .unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        for (queue, exists) in [
            (base.topology.queue(Partition(0)), true),
            (base.topology.dead_letter_queue_of(&late_group), false),
        ] {
            let declared = connection
                .create_channel()
                .await
                .unwrap()
                .queue_declare(queue.clone(), passive, Default::default())
                .await;
            assert_eq!(declared.is_ok(), exists, "{queue}");
        }

        relay.shutdown().await;
        live.stop().await;
    })
    .catch_unwind()
    .await;
    drop_streams(&base.topology, &["live", "late"]).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Runs a stream test on a runtime whose teardown is bounded (`HostRuntime`: a lapin deadlock
/// was seen here once, after this file's retention test had passed every check).
fn with_bounded_teardown(test: impl std::future::Future<Output = ()>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    HostRuntime::new(runtime).block_on(test);
}

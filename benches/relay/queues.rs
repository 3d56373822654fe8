//! Section 13: classic, quorum and stream queues, a group replaying a stream, 13b stream shards on 4.0.
use super::*;

/// Section 13: for classic, quorum and stream queues, on the machine's node and on a private
/// 3-node cluster (`scripts/rabbitmq-cluster`, replicas on every node): the backlog drain next to
/// the pipelined raw ceiling on the same queue type (median of 3, alternated), and the
/// commit-to-confirm latency next to its floor; then the replay rate of a consumer group
/// reading a stream from its first offset into the fold's event table.
pub(crate) async fn queue_types(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let per_run = (mode.backlog_per_run / 4).max(1);
    let events = per_run as usize * 1000;
    let payload = vec![b'x'; PAYLOAD_BYTES as usize];
    let single = env.amqp.clone();
    let cluster_dir = std::env::temp_dir().join(unique("relay-bench-cluster"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/rabbitmq-cluster");
    let started = std::process::Command::new(script)
        .arg("start")
        .arg(&cluster_dir)
        .output()?;
    anyhow::ensure!(
        started.status.success(),
        "starting the cluster: {}",
        String::from_utf8_lossy(&started.stderr)
    );
    let cluster = String::from_utf8_lossy(&started.stdout).trim().to_owned();
    let measured = async {
        for (place, amqp) in [("1 node", single.clone()), ("3-node cluster", cluster.clone())] {
            env.amqp = amqp;
            for queue_type in [QueueType::Classic, QueueType::Quorum, QueueType::Stream] {
                env.queue_type = queue_type;
                let name = format!("{queue_type:?}").to_lowercase();
                let (mut drains, mut ceilings) = (Vec::new(), Vec::new());
                for _ in 0..3 {
                    drains.push(drain_rate(env, per_run, false, 0).await?);
                    let rabbit = env.rabbit("rawqueues", 8)?;
                    declare(&env.amqp, &rabbit.topology).await?;
                    ceilings.push(
                        raw_pipelined(&env.amqp, &rabbit.topology, events, &payload, 4).await?,
                    );
                    drop_topology(&env.amqp, &rabbit.topology).await?;
                }
                let (drain, ceiling) = (min_median_max(drains).1, min_median_max(ceilings).1);
                row(
                    &format!("13. {place}, {name}: backlog drain"),
                    format!("{drain:.0} ev/s"),
                    &format!(
                        "{events} events, median of 3; {:.2} of the pipelined ceiling on {name} queues ({ceiling:.0} ev/s, same run)",
                        drain / ceiling
                    ),
                );
                let (latency, _) = latency(env, mode, Wake::Notify, &Load::busy()).await?;
                latency_rows(row, &format!("{place}, {name}"), &latency);
            }
        }
        env.amqp = single.clone();
        env.queue_type = QueueType::Stream;
        let (drain, replay) = stream_replay(env, per_run).await?;
        row(
            "13. 1 node, stream: a group replaying from the first offset",
            format!("{replay:.0} ev/s"),
            &format!(
                "{events} events into the fold's event table (one transaction each, 8 partitions); the relay drained them at {drain:.0} ev/s"
            ),
        );
        anyhow::Ok(())
    }
    .await;
    env.amqp = single;
    env.queue_type = QueueType::Classic;
    let _ = std::process::Command::new(script)
        .arg("stop")
        .arg(&cluster_dir)
        .status();
    measured
}

/// Section 13b: what the per-partition shards cost on streams (`Sharding::Partition`, the
/// workaround for rabbitmq-server#9457, applied on every version): on a private RabbitMQ 4.0
/// node (`scripts/rabbitmq-root`), the backlog drain into 8 streams with one publisher shard
/// per partition (the relay as it runs) next to the default 4 shards by branch, median of 3,
/// alternated. The second is started through `Relay::start_with` with a relay configuration of
/// classic queues (so no per-partition override) and publishers on the stream topology.
pub(crate) async fn stream_shards(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let per_run = (mode.backlog_per_run / 4).max(1);
    let scripts = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts");
    let root = std::process::Command::new(format!("{scripts}/rabbitmq-root"))
        .arg("ensure")
        .output()?;
    anyhow::ensure!(
        root.status.success(),
        "building the RabbitMQ 4.0 root: {}",
        String::from_utf8_lossy(&root.stderr)
    );
    let root = String::from_utf8_lossy(&root.stdout).trim().to_owned();
    let dir = format!("{root}/tmp/{}", unique("relay-bench-v4"));
    let cluster = |args: &[&str]| {
        std::process::Command::new(format!("{scripts}/rabbitmq-cluster"))
            .args(args)
            .env("RABBITMQ_ROOT", &root)
            .output()
    };
    let started = cluster(&["start", &dir, "1"])?;
    anyhow::ensure!(
        started.status.success(),
        "starting a RabbitMQ 4.0 node: {}",
        String::from_utf8_lossy(&started.stderr)
    );
    let single = std::mem::replace(
        &mut env.amqp,
        String::from_utf8_lossy(&started.stdout).trim().to_owned(),
    );
    env.queue_type = QueueType::Stream;
    let measured = async {
        let (mut by_partition, mut by_branch) = (Vec::new(), Vec::new());
        let mut publishers = (0, 0);
        for _ in 0..3 {
            let (rate, count) = stream_drain(env, per_run, true).await?;
            by_partition.push(rate);
            publishers.0 = count;
            let (rate, count) = stream_drain(env, per_run, false).await?;
            by_branch.push(rate);
            publishers.1 = count;
        }
        let (partition, branch) = (
            min_median_max(by_partition).1,
            min_median_max(by_branch).1,
        );
        row(
            "13b. RabbitMQ 4.0, 8 streams: drain with a shard per partition vs 4 shards by branch",
            format!("{partition:.0} vs {branch:.0} ev/s"),
            &format!(
                "{} events, median of 3, alternated; {:.2}x; {} vs {} publishers (an AMQP connection and channel each)",
                per_run * 1000,
                partition / branch,
                publishers.0,
                publishers.1
            ),
        );
        anyhow::Ok(())
    }
    .await;
    env.amqp = single;
    env.queue_type = QueueType::Classic;
    let _ = cluster(&["stop", &dir]);
    measured
}

/// One backlog drain into streams (50 tenants x 20 runs x `per_run` intents): with the relay's
/// per-partition shards or with shards by branch; (ev/s, publishers).
pub(crate) async fn stream_drain(
    env: &mut Env,
    per_run: u32,
    per_partition: bool,
) -> Result<(f64, u16)> {
    let (pool, url) = env.database("streamshards").await?;
    let rabbit = env.rabbit("streamshards", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    env.checkpoint().await?;
    let outbox = Outbox::new(pool.clone());
    let mut config = env.relay_config(&url, &rabbit);
    let started = Instant::now();
    let (relay, publishers) = if per_partition {
        let publishers = config.supervisor_config().publishers();
        (Relay::start(config).await?, publishers)
    } else {
        config.queue_type = QueueType::Classic;
        let publishers = config.supervisor_config().publishers();
        let on_streams = rabbit.clone();
        let factory: distribution::PublisherFactory = Arc::new(move |_| {
            Box::new(RabbitPublisher::new(on_streams.clone())) as Box<dyn Publisher>
        });
        (Relay::start_with(config, factory).await?, publishers)
    };
    wait_drained(&outbox, Duration::from_secs(900)).await?;
    let rate = written as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    pool.close().await;
    Ok((rate, publishers))
}

/// Section 13: the relay drains `per_run x 1000` events into streams, then a consumer group
/// with its own fold database replays them from the first offset; (drain, replay) in ev/s.
pub(crate) async fn stream_replay(env: &mut Env, per_run: u32) -> Result<(f64, f64)> {
    use distribution::consumer::{Consumer, ConsumerConfig};
    let (pool, url) = env.database("replay").await?;
    let rabbit = env.rabbit("replay", 8)?;
    let written = store::fixtures::fill_backlog(&pool, "t", 50, 20, per_run, PAYLOAD_BYTES).await?;
    env.checkpoint().await?;
    let outbox = Outbox::new(pool.clone());
    let started = Instant::now();
    let relay = Relay::start(env.relay_config(&url, &rabbit)).await?;
    wait_drained(&outbox, Duration::from_secs(900)).await?;
    let drain = written as f64 / started.elapsed().as_secs_f64();
    relay.shutdown().await;
    let (fold_pool, _) = env.database("replayfold").await?;
    let mut group = rabbit.clone();
    group.topology = group.topology.with_group(Group::parse("replay")?);
    let consumer = Consumer::new(
        ConsumerConfig::new(group.clone()),
        fold_pool,
        store::EventTable,
    );
    let progress = consumer.progress();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    }));
    let deadline = Instant::now() + Duration::from_secs(900);
    while progress.totals().applied < written {
        anyhow::ensure!(Instant::now() < deadline, "the replay did not end in 900 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay = written as f64 / started.elapsed().as_secs_f64();
    let _ = stop.send(true);
    running.await??;
    drop_topology(&env.amqp, &rabbit.topology).await?;
    // The streams went with the first; only the group's dead-letter queue is left.
    let _ = drop_topology(&env.amqp, &group.topology).await;
    pool.close().await;
    Ok((drain, replay))
}

//! The host's side: its commits/s by wake-up (4a) and the metadata the metadata sections write.
use super::*;

/// Full metadata, as a host that uses every field sets it (about 300 bytes of JSON).
pub(crate) fn full_metadata(step: u64) -> Metadata {
    Intent::new(b"")
        .event_type(EventType::new("order.created").expect("valid type"))
        .content_type("application/json")
        .correlation_id(format!("req-{step}"))
        .causation_id(format!("cmd-{step}"))
        .header("region", "eu-west-1")
        .header("actor", "agent-7")
        .header("schema", "v3")
        .trace(
            format!(
                "00-{:032x}-{:016x}-01",
                0x4bf9_2f35_77b3_4da6_u128 + u128::from(step),
                step + 1
            ),
            Some("vendor=t61rcWkgMzE".into()),
        )
        .metadata()
        .clone()
}

/// The properties the relay writes for an intent (`rabbit::encode`), with `meta`'s fields or
/// without.
pub(crate) fn wire_like_properties(meta: Option<&Metadata>) -> lapin::BasicProperties {
    let mut event = synthetic_events(1).remove(0);
    event.meta = meta.cloned().unwrap_or_default();
    distribution::rabbit::encode(&event, distribution::broker::WireMode::Plain)
}

/// Section 4a: the host's commits/s at 8 unpaced writers (one intent per transaction) for each
/// way of waking relays, side by side (3 rounds, the order rotated each round; median of 3).
/// `BENCH_ONLY=wakecost` runs this alone.
pub(crate) async fn wake_costs(
    env: &mut Env,
    mode: &Mode,
    row: &mut impl FnMut(&str, String, &str),
) -> Result<()> {
    let seconds = mode.latency_secs.min(10);
    let order = [Wake::Notify, Wake::AfterCommit, Wake::Waker];
    let mut rates: [Vec<f64>; 3] = Default::default();
    for round in 0..3 {
        for step in 0..3 {
            let index = (round + step) % 3;
            rates[index].push(append_rate(env, false, order[index], 8, seconds).await?);
        }
    }
    let [inside, after, none] = rates.map(min_median_max);
    let cell = |(low, median, high): (f64, f64, f64)| {
        format!("{median:.0} commits/s ({low:.0}-{high:.0})")
    };
    row(
        "4a. host append, NOTIFY in the transaction (the default)",
        cell(inside),
        "8 writers, one intent per transaction, unpaced; median of 3 rounds (range), order rotated",
    );
    row(
        "4a. host append, NOTIFY after the commit (`wake_relays`)",
        cell(after),
        &format!("{:.2}x the default, same rounds", after.1 / inside.1),
    );
    row(
        "4a. host append, no NOTIFY (in-process waker or polling)",
        cell(none),
        &format!("{:.2}x the default, same rounds", none.1 / inside.1),
    );
    Ok(())
}

/// Sections 4a and 12a: commits/s of `writers` unpaced writers for `seconds`, each appending one
/// intent per transaction (full metadata or payload only), waking relays as `wake` says
/// (`Waker`: no SQL wake-up at all). No relay runs: the host's own cost.
pub(crate) async fn append_rate(
    env: &mut Env,
    with_meta: bool,
    wake: Wake,
    writers: u32,
    seconds: u64,
) -> Result<f64> {
    let (pool, _) = env
        .database(if with_meta {
            "appendmeta"
        } else {
            "appendplain"
        })
        .await?;
    env.checkpoint().await?;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let writer = IntentWriter::default().with_notify(wake == Wake::Notify);
            let key = BranchKey::new(
                TenantId::new(format!("a{w}")).expect("valid id"),
                RunId::new("r").expect("valid id"),
                BranchId::new("main").expect("valid id"),
            );
            let mut conn = pool.acquire().await.expect("connection");
            writer.open_run(&mut conn, &key).await.expect("open");
            let payload = vec![b'x'; PAYLOAD_BYTES as usize];
            let mut lsn = 0u64;
            while Instant::now() < deadline {
                lsn += 1;
                let intent = if with_meta {
                    Intent::new(&payload).with_metadata(full_metadata(lsn))
                } else {
                    Intent::new(&payload)
                };
                let mut tx = pool.begin().await.expect("begin");
                writer
                    .append_intent(&mut tx, &key, Lsn::new(lsn), intent)
                    .await
                    .expect("append");
                tx.commit().await.expect("commit");
                if wake == Wake::AfterCommit {
                    writer
                        .wake_relays(&mut conn, &key.tenant)
                        .await
                        .expect("wake");
                }
            }
            lsn
        }));
    }
    let mut commits = 0;
    for task in tasks {
        commits += task.await?;
    }
    pool.close().await;
    Ok(commits as f64 / seconds as f64)
}

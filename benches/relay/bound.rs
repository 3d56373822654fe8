//! Section 9's bound: the work every relay must do per event, by hand with no relay in the
//! way: read the backlog out of PostgreSQL and publish it pipelined, then (or not) delete what
//! the broker confirmed. Whatever a relay's design, it reads and publishes the same rows under
//! a memory budget like this one's, so the bound's ratio to the ceiling is what a relay can hope
//! for on the machine; without the delete it is what any retirement scheme can hope for.
use super::*;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;

/// One batch read from the outbox: (seq, tenant, run, lsn, payload) per row.
pub(crate) type Rows = Vec<(i64, String, String, i64, Vec<u8>)>;

/// The keys of a batch's rows: (tenant, run, lsn) on branch `main`.
pub(crate) type Keys = Vec<(String, String, i64)>;

/// Reads every row of `url`'s outbox, tenant by tenant in `seq` order, in the relay's batches
/// (1,000 events or 4 MiB of payload), one reader reading ahead of `connections` publishing
/// connections that each take every `connections`-th batch, publish it without waiting for
/// confirms and settle the batch before last (its confirms awaited, its rows deleted when
/// `delete`, committed without waiting for the WAL flush as the relay's acks are;
/// `BENCH_BOUND_DEPTH` keeps more batches unsettled). Returns events/s and the rows read.
pub(crate) async fn read_and_publish(
    url: &str,
    amqp: &str,
    topology: &Topology,
    payload_bytes: u32,
    connections: usize,
    delete: bool,
) -> Result<(f64, usize)> {
    let (amqp, topology) = (amqp.to_owned(), topology.clone());
    read_and_send(url, payload_bytes, connections, move |pool, receiver| {
        tokio::spawn(publish_batches(
            amqp.clone(),
            topology.clone(),
            pool,
            receiver,
            delete,
        ))
    })
    .await
}

/// A publishing connection's task: takes batches until the reader is done, returns how many
/// events the broker acknowledged.
pub(crate) type Publishing = tokio::task::JoinHandle<Result<usize>>;

/// [`read_and_publish`]'s reader, for any broker: reads the outbox as it says and hands every
/// `connections`-th batch to each of `connections` tasks that `spawn` starts (each given the
/// pool and its batches). Returns events/s and the rows read.
pub(crate) async fn read_and_send(
    url: &str,
    payload_bytes: u32,
    connections: usize,
    spawn: impl Fn(PgPool, tokio::sync::mpsc::Receiver<Rows>) -> Publishing,
) -> Result<(f64, usize)> {
    let options: sqlx::postgres::PgConnectOptions = format!("{url}?sslmode=disable").parse()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections as u32 + 1)
        .connect_with(options.options([("synchronous_commit", "off")]))
        .await?;
    let per_batch = i64::from(((4u32 << 20) / payload_bytes.max(1)).clamp(1, 1000));
    let started = Instant::now();
    let mut senders = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (sender, receiver) = tokio::sync::mpsc::channel::<Rows>(2);
        senders.push(sender);
        tasks.push(spawn(pool.clone(), receiver));
    }
    let tenants: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT tenant_id FROM relay_branch ORDER BY 1")
            .fetch_all(&pool)
            .await?;
    let mut read = 0usize;
    let mut turn = 0usize;
    // Tenant by tenant, each in `seq` order through the drain's index, as the relay reads.
    for tenant in &tenants {
        let mut after = 0i64;
        loop {
            let rows: Rows = sqlx::query_as(
                "SELECT seq, tenant_id, run_id, lsn, payload FROM relay_outbox
                  WHERE tenant_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
            )
            .bind(tenant)
            .bind(after)
            .bind(per_batch)
            .fetch_all(&pool)
            .await?;
            let Some(last) = rows.last() else { break };
            after = last.0;
            read += rows.len();
            senders[turn % connections]
                .send(rows)
                .await
                .map_err(|_| anyhow::anyhow!("a publishing connection ended early"))?;
            turn += 1;
        }
    }
    drop(senders);
    let mut acked = 0;
    for task in tasks {
        acked += task.await??;
    }
    let rate = acked as f64 / started.elapsed().as_secs_f64();
    anyhow::ensure!(acked == read, "bound: {acked} of {read} acked");
    pool.close().await;
    Ok((rate, read))
}

/// `BENCH_BOUND_DEPTH=<n>`: batches each connection keeps unsettled (2: the one just written
/// and the one before; 4 connections x 2 x 4 MiB is the relay's 32 MiB budget).
pub(crate) fn depth() -> usize {
    std::env::var("BENCH_BOUND_DEPTH")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2usize)
        .max(1)
}

/// One publishing connection of [`read_and_publish`]; returns how many publishes were acked.
async fn publish_batches(
    amqp: String,
    topology: Topology,
    pool: PgPool,
    mut batches: tokio::sync::mpsc::Receiver<Rows>,
    delete: bool,
) -> Result<usize> {
    let connection =
        lapin::Connection::connect(first_address(&amqp), lapin::ConnectionProperties::default())
            .await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let base = wire_like_properties(None);
    let depth = depth();
    let mut acked = 0;
    let mut unsettled = std::collections::VecDeque::new();
    while let Some(rows) = batches.recv().await {
        let mut writes = Vec::with_capacity(rows.len());
        for (seq, tenant, run, lsn, payload) in &rows {
            let partition = Partition((*seq % i64::from(topology.partitions())) as u16);
            let properties = base
                .clone()
                .with_delivery_mode(2)
                .with_message_id(ShortString::from(format!("{tenant}/{run}/main/{lsn}")));
            writes.push(
                queue(channel.basic_publish(
                    topology.exchange().clone(),
                    topology.routing_key(partition),
                    options,
                    payload,
                    properties,
                ))
                .await,
            );
        }
        let mut confirms = Vec::with_capacity(writes.len());
        for write in writes {
            confirms.push(written(write).await?);
        }
        let keys: Vec<(String, String, i64)> = rows
            .into_iter()
            .map(|(_, tenant, run, lsn, _)| (tenant, run, lsn))
            .collect();
        unsettled.push_back((keys, confirms));
        while unsettled.len() >= depth
            && let Some(done) = unsettled.pop_front()
        {
            acked += settle(&pool, done, delete).await?;
        }
    }
    for done in unsettled {
        acked += settle(&pool, done, delete).await?;
    }
    connection.close(200, "done".into()).await?;
    Ok(acked)
}

/// Awaits a batch's confirms and, when `delete`, deletes its rows as `ack_outbox` would (by
/// primary key, in one statement).
async fn settle(
    pool: &PgPool,
    (keys, confirms): (Vec<(String, String, i64)>, Vec<lapin::PublisherConfirm>),
    delete: bool,
) -> Result<usize> {
    let mut acked = 0;
    for confirm in confirms {
        acked += usize::from(confirm.await?.is_ack());
    }
    if delete {
        delete_rows(pool, &keys).await?;
    }
    Ok(acked)
}

/// Deletes a settled batch's rows as `ack_outbox` would (by primary key, in one statement).
pub(crate) async fn delete_rows(pool: &PgPool, keys: &Keys) -> Result<()> {
    let tenants: Vec<&str> = keys.iter().map(|(t, _, _)| t.as_str()).collect();
    let runs: Vec<&str> = keys.iter().map(|(_, r, _)| r.as_str()).collect();
    let lsns: Vec<i64> = keys.iter().map(|(_, _, l)| *l).collect();
    let deleted = sqlx::query(
        "DELETE FROM relay_outbox o
          USING unnest($1::text[], $2::text[], $3::bigint[]) AS x(t, r, l)
          WHERE o.tenant_id = x.t AND o.run_id = x.r AND o.branch_id = 'main' AND o.lsn = x.l",
    )
    .bind(&tenants)
    .bind(&runs)
    .bind(&lsns)
    .execute(pool)
    .await?
    .rows_affected();
    anyhow::ensure!(deleted as usize == keys.len(), "bound: deleted {deleted}");
    Ok(())
}

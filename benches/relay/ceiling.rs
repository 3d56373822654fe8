//! Sections 1 and 2: the raw pipelined ceiling (no database) and the seed-style baseline.
use super::*;

/// Section 1: confirmed publishes straight from memory over `channels` connections, through
/// the relay's own adapter, a batch's confirms awaited before the next (section 9 measures the
/// truly pipelined ceiling on plain lapin).
pub(crate) async fn raw_ceiling(
    rabbit: &RabbitConfig,
    events: &[OutboxEvent],
    channels: usize,
) -> Result<f64> {
    let mut warmup = RabbitPublisher::new(rabbit.clone());
    anyhow::ensure!(
        warmup.publish(&events[..1]).await.fault.is_none(),
        "broker not reachable"
    );
    let per_channel = events.len().div_ceil(channels);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for slice in events.chunks(per_channel) {
        let (rabbit, slice) = (rabbit.clone(), slice.to_vec());
        tasks.push(tokio::spawn(async move {
            let mut publisher = RabbitPublisher::new(rabbit);
            let mut accepted = 0;
            for batch in slice.chunks(1000) {
                accepted += publisher.publish(batch).await.accepted();
            }
            accepted
        }));
    }
    let mut accepted = 0;
    for task in tasks {
        accepted += task.await?;
    }
    anyhow::ensure!(
        accepted == events.len(),
        "raw ceiling: only {accepted} of {} accepted",
        events.len()
    );
    Ok(events.len() as f64 / started.elapsed().as_secs_f64())
}

/// The broker's best effort at one payload size, outside the relay's adapter: `connections`
/// connections, each a confirming channel that writes without waiting for confirms (200 writes
/// queued before any is awaited), with up to 2,000 confirms outstanding (awaited oldest
/// first), plain lapin. Each message carries what the
/// relay's carries for an intent without metadata (WIRE.md's properties and headers), so the
/// ceiling is the same work done with nothing else in the way; `raw_pipelined_with` takes other
/// properties (none at all: what the broker does for bare messages).
pub(crate) async fn raw_pipelined(
    amqp: &str,
    topology: &Topology,
    events: usize,
    payload: &[u8],
    connections: usize,
) -> Result<f64> {
    raw_pipelined_with(
        amqp,
        topology,
        events,
        payload,
        connections,
        wire_like_properties(None),
    )
    .await
}

/// [`raw_pipelined`], each message with `base`'s properties (and its own message id).
pub(crate) async fn raw_pipelined_with(
    amqp: &str,
    topology: &Topology,
    events: usize,
    payload: &[u8],
    connections: usize,
    base: lapin::BasicProperties,
) -> Result<f64> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::types::ShortString;
    use std::collections::VecDeque;
    let per_connection = events.div_ceil(connections);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for index in 0..connections {
        let (amqp, topology, payload, base) = (
            amqp.to_owned(),
            topology.clone(),
            payload.to_vec(),
            base.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let connection = lapin::Connection::connect(
                first_address(&amqp),
                lapin::ConnectionProperties::default(),
            )
            .await?;
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            let mut outstanding = VecDeque::new();
            let mut acked = 0usize;
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            // Writes queued 200 at a time before any is awaited (lapin queues a publish's
            // frames on its first poll and resolves it once its I/O thread wrote them), where
            // the relay's adapter awaits each write before queueing the next.
            for first_n in (0..per_connection).step_by(200) {
                let mut writes = Vec::new();
                for n in first_n..(first_n + 200).min(per_connection) {
                    let partition =
                        Partition(((index + n) % usize::from(topology.partitions())) as u16);
                    let properties = base
                        .clone()
                        .with_delivery_mode(2)
                        .with_message_id(ShortString::from(format!("raw-{index}-{n}")));
                    writes.push(
                        queue(channel.basic_publish(
                            topology.exchange().clone(),
                            topology.routing_key(partition),
                            options,
                            &payload,
                            properties,
                        ))
                        .await,
                    );
                }
                for write in writes {
                    outstanding.push_back(written(write).await?);
                    if outstanding.len() >= 2_000
                        && let Some(oldest) = outstanding.pop_front()
                    {
                        acked += usize::from(oldest.await?.is_ack());
                    }
                }
            }
            for confirm in outstanding {
                acked += usize::from(confirm.await?.is_ack());
            }
            anyhow::Ok(acked)
        }));
    }
    let mut acked = 0;
    for task in tasks {
        acked += task.await??;
    }
    anyhow::ensure!(
        acked == per_connection * connections,
        "raw ceiling: {acked} acked"
    );
    Ok(acked as f64 / started.elapsed().as_secs_f64())
}

/// A write queued on its channel, and what is left of it: polled once, lapin takes its delivery
/// tag and queues its frames (the relay's publisher does the same), so a batch's writes are all
/// queued before any is awaited.
pub(crate) type Queued<F> = (
    std::task::Poll<<F as Future>::Output>,
    std::pin::Pin<Box<F>>,
);

/// Polls `write` once (see [`Queued`]).
pub(crate) async fn queue<F: Future>(write: F) -> Queued<F> {
    let mut write = Box::pin(write);
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(write.as_mut().poll(cx))).await;
    (first, write)
}

/// The result of a [`queue`]d write (lapin's: the confirm to await, once the frames are written).
pub(crate) async fn written<F: Future>((first, write): Queued<F>) -> F::Output {
    match first {
        std::task::Poll::Ready(output) => output,
        std::task::Poll::Pending => write.await,
    }
}

/// 2. The seed's loop: drain 100, publish each and await its confirm, ack.
pub(crate) async fn seed_style(
    outbox: &Outbox,
    rabbit: &RabbitConfig,
    tenants: &[TenantId],
) -> Result<f64> {
    let mut publisher = RabbitPublisher::new(rabbit.clone());
    let started = Instant::now();
    let mut shipped = 0u64;
    loop {
        let mut drained_any = false;
        for tenant in tenants {
            let batch = outbox.drain_outbox(tenant, 100).await?;
            drained_any |= !batch.is_empty();
            let mut acks = Vec::with_capacity(batch.len());
            for event in batch {
                if !publisher
                    .publish(std::slice::from_ref(&event))
                    .await
                    .outcomes[0]
                    .is_accepted()
                {
                    break;
                }
                acks.push(event.key);
            }
            shipped += outbox.ack_outbox(&acks).await?;
        }
        if !drained_any {
            break;
        }
    }
    Ok(shipped as f64 / started.elapsed().as_secs_f64())
}

//! An operator's look at the broker (the console's): what it is, whether it blocks
//! publishers now (a resource alarm), found the only way a client can: by publishing; and what
//! a group's partition queues hold and who reads them.
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;

use broker::Error;

use crate::rabbit::{RabbitConfig, within};
use crate::version::BrokerVersion;

/// What [`checkup`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkup {
    /// What the broker says it is (`connection.start`).
    pub version: BrokerVersion,
    /// `Some(reason)` while the broker blocks publishing connections (`connection.blocked`:
    /// a memory or disk alarm), as it said; `None` when it confirmed a publish.
    pub blocked: Option<String>,
}

/// The routing key of the probe: the default exchange routes it to a queue of that name, and
/// no client can declare a queue whose name starts with `amq.`, so it is dropped (and
/// confirmed) without reaching anyone.
const PROBE_ROUTING_KEY: &str = "amq.relay.checkup";

/// Connects to `config`'s broker, reads its version and publishes two empty messages that no
/// queue receives, each with a confirm: a broker under a resource alarm answers with
/// `connection.blocked` instead. Waits at most `config.connect_timeout` for each step and
/// `wait` for the verdict.
pub async fn checkup(config: &RabbitConfig, wait: Duration) -> Result<Checkup, Error> {
    let version = crate::version::server_version(config).await?;
    let connection = config.connect_named("outbox-relay-checkup").await?;
    let mut events = std::pin::pin!(connection.events_listener());
    let limit = config.connect_timeout;
    let channel = within("channel.open", limit, connection.create_channel()).await?;
    within(
        "confirm.select",
        limit,
        channel.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    // Two probes, one after the other's confirm: a broker under an alarm may still take and
    // confirm the publish that blocks the connection (RabbitMQ 4.0.5 did, now and then) and
    // sends `connection.blocked` after it; it reads nothing more from a blocked connection, so
    // the second probe is never confirmed there and the block is what comes.
    let confirmed = async {
        for _ in 0..2 {
            let confirm = channel
                .basic_publish(
                    "".into(),
                    PROBE_ROUTING_KEY.into(),
                    BasicPublishOptions::default(),
                    &[],
                    lapin::BasicProperties::default(),
                )
                .await?;
            confirm.await?;
        }
        Ok::<_, lapin::Error>(())
    };
    let blocked = async {
        while let Some(event) = events.next().await {
            if let lapin::Event::ConnectionBlocked(reason) = event {
                return reason;
            }
        }
        std::future::pending().await
    };
    let verdict = broker::within("basic.publish confirm", wait, async {
        tokio::select! {
            confirmed = confirmed => confirmed.map(|_| None).map_err(crate::connect::amqp_error),
            reason = blocked => Ok(Some(reason)),
        }
    })
    .await;
    // A blocked connection's socket is not read: its close is not awaited (the drop sends it).
    drop(channel);
    Ok(Checkup {
        version,
        blocked: verdict?,
    })
}

/// One partition queue of a group, as the broker counts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueCount {
    /// The queue's name.
    pub queue: String,
    /// `None`: no such queue (no consumer of the group declared it yet).
    pub counted: Option<Counted>,
}

/// What a passive `queue.declare` answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counted {
    /// Messages ready (not counting those a consumer holds unacked; a stream's count is the
    /// broker's own for it).
    pub messages: u32,
    /// Consumers attached.
    pub consumers: u32,
}

/// Each partition queue of `config`'s group, in partition order: a passive `queue.declare`
/// each, on one connection (a missing queue closes its channel, so the next gets a new one),
/// each step within `config.connect_timeout`. Declares nothing.
pub async fn partition_queues(config: &RabbitConfig) -> Result<Vec<QueueCount>, Error> {
    let limit = config.connect_timeout;
    let connection = config.connect_named("outbox-relay-queues").await?;
    let topology = &config.topology;
    let mut counts = Vec::with_capacity(usize::from(topology.partitions()));
    let mut channel = None;
    for partition in 0..topology.partitions() {
        let queue = topology.queue(broker::Partition(partition));
        let open = match channel.take() {
            Some(open) => open,
            None => within("channel.open", limit, connection.create_channel()).await?,
        };
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = within(
            "queue.declare",
            limit,
            open.queue_declare(queue.clone(), passive, FieldTable::default()),
        )
        .await;
        let counted = match declared {
            Ok(declared) => {
                channel = Some(open);
                Some(Counted {
                    messages: declared.message_count(),
                    consumers: declared.consumer_count(),
                })
            }
            Err(err) if err.to_string().contains("NOT_FOUND") => None,
            Err(err) => return Err(err),
        };
        counts.push(QueueCount {
            queue: queue.to_string(),
            counted,
        });
    }
    Ok(counts)
}

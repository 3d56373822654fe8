//! The fold's consumer: reads one partition and folds each delivery, acking only after the
//! fold's transaction committed. A crash before the ack means a redelivery, which the fold
//! turns into a no-op: exactly once at the fold, at least once in transport.
use std::future::Future;

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::FieldTable;
use store::{FoldOutcome, FoldStore};

use crate::rabbit::{open, within};
use crate::{Error, Partition, RabbitConfig, wire};

/// What a consumer did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FoldStats {
    /// Deliveries applied (parked successors they released are counted too).
    pub applied: u64,
    /// Redeliveries of events already applied (no-ops).
    pub duplicates: u64,
    /// Deliveries parked until their predecessor arrives.
    pub parked: u64,
    /// Deliveries that broke the wire contract, rejected without requeue.
    pub rejected: u64,
    /// Rewind markers folded.
    pub rewinds: u64,
}

/// Consumes partitions into a [`FoldStore`].
#[derive(Clone, Debug)]
pub struct FoldConsumer {
    config: RabbitConfig,
    /// Unacked deliveries the broker may push at once. Default 256.
    prefetch: u16,
}

impl FoldConsumer {
    /// A consumer of the topology in `config`.
    pub fn new(config: RabbitConfig) -> Self {
        Self {
            config,
            prefetch: 256,
        }
    }

    /// Consumes `partition` into `fold` until `stop` completes or the broker fails.
    /// `progress` sees the running totals after every delivery (for progress reports and tests).
    pub async fn run(
        &self,
        partition: Partition,
        fold: &FoldStore,
        stop: impl Future<Output = ()>,
        mut progress: impl FnMut(FoldStats),
    ) -> Result<FoldStats, Error> {
        let (_connection, channel) = open(&self.config, "outbox-fold").await?;
        let limit = self.config.connect_timeout;
        within(
            "basic.qos",
            limit,
            channel.basic_qos(self.prefetch, BasicQosOptions::default()),
        )
        .await?;
        let queue = self.config.topology.queue(partition);
        let mut consumer = within(
            "basic.consume",
            limit,
            channel.basic_consume(
                queue,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        let mut stats = FoldStats::default();
        let mut stop = std::pin::pin!(stop);
        loop {
            let delivery = tokio::select! {
                () = &mut stop => return Ok(stats),
                next = consumer.next() => match next {
                    Some(delivery) => delivery?,
                    None => return Err(Error::Unreachable("the broker cancelled the consumer".into())),
                },
            };
            match wire::decode(&delivery.properties, &delivery.data) {
                Ok(event) => {
                    // A store error returns with the delivery unacked: it is redelivered.
                    match fold.apply(&event).await? {
                        FoldOutcome::Applied { released } => {
                            stats.applied += 1 + u64::from(released)
                        }
                        FoldOutcome::Rewound { released } => {
                            stats.rewinds += 1;
                            stats.applied += u64::from(released);
                        }
                        FoldOutcome::Duplicate | FoldOutcome::Abandoned => stats.duplicates += 1,
                        FoldOutcome::Parked => stats.parked += 1,
                    }
                    // Invariant: acked only after the fold's transaction committed.
                    within("basic.ack", limit, delivery.ack(BasicAckOptions::default())).await?;
                }
                Err(err) => {
                    // Logged without the body: a payload never reaches a log line.
                    tracing::warn!(error = %err, bytes = delivery.data.len(), "rejecting a message that breaks the wire contract");
                    stats.rejected += 1;
                    within(
                        "basic.reject",
                        limit,
                        delivery.reject(BasicRejectOptions { requeue: false }),
                    )
                    .await?;
                }
            }
            progress(stats);
        }
    }
}

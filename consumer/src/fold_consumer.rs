//! The demonstration fold: partitions consumed into a [`FoldStore`].
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use store::{EventTable, FoldStore};

use broker::{Error, Partition, RetryPolicy};

use rabbit::RabbitConfig;

use crate::Consumer;
use crate::config::ConsumerConfig;
use crate::stats::FoldStats;

/// Consumes partitions into a [`FoldStore`] (the project's own [`EventTable`] projection):
/// the demonstration fold the tests and the demo use. See [`Consumer`] for your own tables.
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

    /// Consumes `partition` into `fold` until `stop` completes, reconnecting with backoff.
    /// `progress` sees the running totals after every delivery (for progress reports and tests).
    pub async fn run(
        &self,
        partition: Partition,
        fold: &FoldStore,
        stop: impl Future<Output = ()> + Send + 'static,
        progress: impl FnMut(FoldStats) + Send + 'static,
    ) -> Result<FoldStats, Error> {
        let mut config = ConsumerConfig::new(self.config.clone());
        config.partitions = Some(vec![partition]);
        config.prefetch = self.prefetch;
        config.retry = RetryPolicy {
            min: Duration::from_millis(20),
            max: Duration::from_millis(500),
        };
        let progress = Mutex::new(progress);
        let consumer = Consumer::new(config, fold.pool().clone(), EventTable).with_observer(
            move |_, stats| {
                let mut progress = progress.lock().unwrap_or_else(|poison| poison.into_inner());
                progress(stats);
            },
        );
        consumer.run(stop).await
    }
}

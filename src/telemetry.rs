//! What the relay reports: metric descriptions (`# HELP`), histogram buckets, counters that
//! exist from the start, and the binary's log format.
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};

/// Buckets of `relay_write_to_confirm_seconds`, 1 ms to 60 s: a histogram (aggregatable across
/// relays), not a summary.
pub const LAG_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 60.0,
];

/// How long a series nobody updates is kept: per-tenant series of tenants that went quiet are
/// dropped after it, so memory and scrapes grow with the tenants active recently, not with
/// every tenant ever seen. The relay touches its fixed series (counters at zero, gauges) on
/// every metrics tick, so only per-tenant series ever expire.
pub const SERIES_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// A Prometheus recorder set up for the relay: the lag histogram's buckets, and idle series
/// dropped after [`SERIES_IDLE_TIMEOUT`]. An embedding host that already installs its own
/// recorder applies the same with `set_buckets_for_metric` and `idle_timeout`.
pub fn prometheus_builder() -> Result<PrometheusBuilder, BuildError> {
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("relay_write_to_confirm_seconds".into()),
            &LAG_BUCKETS,
        )?
        .idle_timeout(metrics_util::MetricKindMask::ALL, Some(SERIES_IDLE_TIMEOUT)))
}

/// Describes every metric of the relay (Prometheus `# HELP` lines) and registers the failure
/// and restart counters at zero, so dashboards and alerts see them before the first failure.
/// Call once after installing a recorder (the binary does; an embedding host should too).
/// `publishers` is [`supervisor::SupervisorConfig::publishers`] (the `shard` label of the
/// publisher metrics counts every publisher, express lane included).
pub fn describe_metrics(publishers: u16) {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(
        "relay_backlog_pending",
        "Intents waiting in the outbox (counted up to 1,000), for the 100 tenants being drained with the oldest intents."
    );
    describe_gauge!(
        "relay_backlog_oldest_age_seconds",
        Unit::Seconds,
        "Age of the oldest waiting intent, for the 100 tenants being drained with the oldest intents."
    );
    describe_histogram!(
        "relay_write_to_confirm_seconds",
        Unit::Seconds,
        "From the host's write (in its transaction) to the broker's confirm, per shipped intent (all tenants of this relay)."
    );
    describe_counter!(
        "relay_events_shipped_total",
        "Intents confirmed by the broker and retired from the outbox (all tenants of this relay)."
    );
    describe_counter!(
        "relay_publish_failures_total",
        "Intents the broker did not accept, per shard and outcome (nacked, no_room, returned, too_large, unwritable, unconfirmed, not_sent)."
    );
    describe_counter!(
        "relay_publisher_restarts_total",
        "Publisher actors restarted after a broker fault, per shard."
    );
    describe_counter!(
        "relay_drainer_restarts_total",
        "Drainer actors restarted after a failure."
    );
    describe_gauge!(
        "relay_tenants_held",
        "Drainers running now (tenants being drained by this relay)."
    );
    describe_gauge!(
        "relay_runtime_tasks",
        "Tasks alive on the relay's runtime (actors, timers, connections): bounded by the drainers alive, not by the tenants seen."
    );
    describe_gauge!(
        "relay_lease_buckets_held",
        "Lease buckets (of 128) this relay owns."
    );
    describe_gauge!(
        "relay_members",
        "Relays alive, as this relay last saw them."
    );
    describe_counter!(
        "relay_leases_lost_total",
        "Lease buckets lost to expiry or takeover."
    );
    describe_gauge!(
        "relay_parked_branches",
        "Branches parked after repeated broker refusals, per tenant."
    );
    describe_counter!(
        "relay_branches_parked_total",
        "Times a branch was parked, per tenant."
    );
    describe_gauge!(
        "relay_dead_letters",
        "Messages in a dead-letter queue, read every 10 s by each consumer (`distribution dead list` shows them)."
    );
    describe_counter!(
        "relay_runs_retired_total",
        "Closed and shipped runs whose branches this relay removed after RELAY_RETENTION_SECS."
    );
    describe_counter!(
        "relay_fold_runs_retired_total",
        "Completed runs whose fold state a consumer removed after its retention."
    );
    describe_counter!(
        "relay_consumer_dead_letters_total",
        "Messages a consumer dead-lettered, per reason (contract, broken_chain, retired, diverged, handler)."
    );
    describe_counter!(
        "relay_drains_held_back_total",
        "Drains whose rows were not published because they were not yet flushed where RELAY_PUBLISH_REPLICATED requires (a standby down or behind); drained again after a backoff."
    );
    describe_counter!(
        "relay_consumer_superseded_total",
        "Deliveries of history the outbox's database replaced after a failover (an older epoch's copy): nothing applied."
    );
    describe_counter!(
        "relay_consumer_adopted_total",
        "Diverged deliveries adopted after an operator armed their branch (`distribution group adopt`): what the failover lost was undone."
    );
    describe_counter!(
        "relay_consumer_retries_total",
        "Batches of deliveries a consumer retried after a transient failure."
    );
    describe_histogram!(
        "relay_consumer_batch_deliveries",
        "Deliveries per committed batch of a consumer (one transaction, one ack)."
    );
    describe_counter!(
        "relay_broker_refusals_total",
        "Broker sessions refused while running (credentials, vhost, conflicting topology): an operator must act."
    );
    describe_gauge!(
        "relay_broker_blocked_connections",
        "Connections of this process the broker blocks now (connection.blocked: a memory or disk alarm); nothing is written on them until unblocked."
    );
    describe_counter!(
        "relay_consumer_skipped_total",
        "Deliveries a consumer folded without handing them to its projection (an event type outside ConsumerConfig::event_types)."
    );
    describe_counter!(
        "relay_consumer_offset_lost_total",
        "Times a stream consumer stopped at a gap, per queue: messages at its stored offset were removed by the stream's retention before it read them (rebuild the group)."
    );
    describe_counter!(
        "relay_consumer_stream_resubscribes_total",
        "Times a stream consumer subscribed again to a silent partition at the offset its fold expects, per queue."
    );
    describe_gauge!(
        "relay_ready",
        "1 if /readyz would answer ready, else 0, computed at each scrape of the standalone relay's /metrics (deploy/prometheus/rules.yml alerts on it)."
    );
    metrics::counter!("relay_drainer_restarts_total").absolute(0);
    metrics::counter!("relay_broker_refusals_total").absolute(0);
    metrics::gauge!("relay_broker_blocked_connections").set(0.0);
    metrics::counter!("relay_leases_lost_total").absolute(0);
    for shard in 0..publishers {
        let shard = shard.to_string();
        metrics::counter!("relay_publisher_restarts_total", "shard" => shard.clone()).absolute(0);
        for outcome in actors::FAILURE_OUTCOMES {
            metrics::counter!("relay_publish_failures_total", "shard" => shard.clone(), "outcome" => outcome)
                .absolute(0);
        }
    }
}

/// How the binary writes logs: `RELAY_LOG_FORMAT=text` (default) or `json`; colours only on a
/// terminal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Every metric the relay and the consumer register: the names [`describe_metrics`]
/// describes (what alerts and dashboards may name; every one has HELP text).
pub fn metric_names() -> std::collections::BTreeSet<String> {
    let described = Described::default();
    metrics::with_local_recorder(&described, || describe_metrics(1));
    described
        .0
        .into_inner()
        .unwrap_or_else(|poison| poison.into_inner())
}

/// Takes note of every metric described with a HELP text.
#[derive(Default)]
struct Described(std::sync::Mutex<std::collections::BTreeSet<String>>);

impl Described {
    fn note(&self, key: KeyName, description: SharedString) {
        if !description.is_empty() {
            let mut names = self.0.lock().unwrap_or_else(|poison| poison.into_inner());
            names.insert(key.as_str().to_owned());
        }
    }
}

impl Recorder for Described {
    fn describe_counter(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.note(key, description);
    }
    fn describe_gauge(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.note(key, description);
    }
    fn describe_histogram(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.note(key, description);
    }
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// Every metric name the relay's crates record (`counter!("relay_...`, `gauge!`,
    /// `histogram!` in their sources).
    fn recorded_in_sources() -> BTreeSet<String> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut names = BTreeSet::new();
        let mut dirs: Vec<std::path::PathBuf> = [
            "src",
            "cli",
            "actors/src",
            "supervisor/src",
            "broker/src",
            "rabbit/src",
            "nats/src",
            "consumer/src",
            "store/src",
        ]
        .iter()
        .map(|dir| root.join(dir))
        .collect();
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                if path.extension().is_none_or(|ext| ext != "rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                for macro_name in ["counter!(", "gauge!(", "histogram!("] {
                    for (at, _) in text.match_indices(macro_name) {
                        let rest = text[at + macro_name.len()..].trim_start();
                        let Some(rest) = rest.strip_prefix('"') else {
                            continue;
                        };
                        let name: String = rest.chars().take_while(|c| *c != '"').collect();
                        let plain = name.chars().all(|c| c.is_ascii_lowercase() || c == '_');
                        if name.starts_with("relay_") && plain {
                            names.insert(name);
                        }
                    }
                }
            }
        }
        names
    }

    /// README and docs/operations.md: "every metric has a `# HELP` line". Every metric the relay or the consumer
    /// records is described by [`super::describe_metrics`].
    #[test]
    fn every_metric_recorded_anywhere_has_help_text() {
        let recorded = recorded_in_sources();
        assert!(
            recorded.len() >= 20,
            "the scan found the metrics: {recorded:?}"
        );
        let described = super::metric_names();
        let missing: Vec<&String> = recorded.difference(&described).collect();
        assert!(
            missing.is_empty(),
            "recorded without HELP text: {missing:?}"
        );
    }
}

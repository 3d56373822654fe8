//! What the relay reports: metric descriptions (`# HELP`), histogram buckets, counters that
//! exist from the start, and the binary's log format.
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
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
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
        "Intents the broker did not accept, per shard and outcome (nacked, returned, unconfirmed, not_sent)."
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
        "Messages a consumer dead-lettered, per reason (contract, broken_chain, retired, handler)."
    );
    describe_counter!(
        "relay_consumer_retries_total",
        "Deliveries a consumer retried after a transient failure."
    );
    describe_counter!(
        "relay_broker_refusals_total",
        "Broker sessions refused while running (credentials, vhost, conflicting topology): an operator must act."
    );
    metrics::counter!("relay_drainer_restarts_total").absolute(0);
    metrics::counter!("relay_broker_refusals_total").absolute(0);
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

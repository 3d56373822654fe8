//! The core's notes as log lines and metrics: the one place the supervisor's decisions meet
//! `tracing` and `metrics`.
use crate::core::Note;

/// Logs and counts `note`. Repeated failures are logged at WARN on the 1st, 2nd, 4th, 8th...
/// (`broker::warn_worthy`), at DEBUG otherwise.
pub(super) fn record(note: Note) {
    match note {
        Note::BrokerAnswers => {
            tracing::info!("the broker answers again; restarting publishers now");
        }
        Note::BrokerSilent { again } => {
            tracing::debug!(again, "the broker does not answer a check");
        }
        Note::PublisherRecovered { shard, failures } => {
            tracing::info!(shard = shard.0, failures, "publisher recovered");
        }
        Note::PublisherRestarting {
            shard,
            failures,
            retry_in,
            reason,
        } => {
            metrics::counter!("relay_publisher_restarts_total", "shard" => shard.0.to_string())
                .increment(1);
            let retry_in_ms = retry_in.as_millis() as u64;
            if broker::warn_worthy(failures) {
                tracing::warn!(shard = shard.0, failures, retry_in_ms, reason = %reason, "publisher down; restarting");
            } else {
                tracing::debug!(shard = shard.0, failures, retry_in_ms, reason = %reason, "publisher down; restarting");
            }
        }
        Note::DrainerStopped { tenant, reason } => {
            tracing::debug!(tenant = %tenant, reason = %reason, "drainer stopped");
        }
        Note::DrainerRestarting {
            tenant,
            failures,
            retry_in,
            reason,
        } => {
            metrics::counter!("relay_drainer_restarts_total").increment(1);
            let retry_in_ms = retry_in.as_millis() as u64;
            if broker::warn_worthy(failures) {
                tracing::warn!(tenant = %tenant, failures, retry_in_ms, reason = %reason, "drainer down; restarting");
            } else {
                tracing::debug!(tenant = %tenant, failures, retry_in_ms, reason = %reason, "drainer down; restarting");
            }
        }
        Note::LeasesLost { buckets } => {
            tracing::warn!(buckets, "leases lost (expired or taken over)");
            metrics::counter!("relay_leases_lost_total").increment(buckets as u64);
        }
        Note::HandoversForced { buckets, grace } => {
            tracing::warn!(
                buckets,
                grace_ms = grace.as_millis() as u64,
                "buckets handed over without their batches settling in time"
            );
        }
        Note::HandingOver { buckets, members } => {
            tracing::info!(
                buckets,
                members,
                "handing buckets over once their batches settle"
            );
        }
        Note::Leases { held, members } => {
            metrics::gauge!("relay_lease_buckets_held").set(held as f64);
            metrics::gauge!("relay_members").set(f64::from(members));
        }
    }
}

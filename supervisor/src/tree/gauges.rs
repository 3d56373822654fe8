//! The backlog and parked-branches gauges, read on a task of their own, and the relay's fixed
//! series kept alive.
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use store::TenantId;

use super::{RelaySupervisor, SupervisorState};

/// `relay_backlog_pending` counts up to this many intents per tenant, so the gauges' read costs
/// at most `max_drainers` x this many index entries whatever the backlog (at 1M pending in 50
/// tenants, a full count took 400 ms every tick). A tenant this far behind shows it in
/// `relay_backlog_oldest_age_seconds`, which stays exact; `distribution status` counts all.
pub const PENDING_GAUGE_CAP: u32 = 1_000;

/// The backlog gauges (`relay_backlog_pending`, `relay_backlog_oldest_age_seconds`) carry at
/// most this many tenants, those with the oldest intents among the ones being drained: a series
/// per tenant drained made memory and scrapes grow with the tenants seen (3 series per tenant,
/// about 30 MB at 40,000 tenants). A tenant leaving the set is reported at 0 once, then its
/// series expires (`distribution::SERIES_IDLE_TIMEOUT`).
pub const TENANT_GAUGES: usize = 100;

/// The `limit` tenants with the oldest pending intents, oldest first, of those read: the only
/// ones given backlog gauges, so series per tenant never grow with the tenants drained (1,000
/// at a time, 100,000 within minutes at scale).
fn furthest_behind(mut backlog: Vec<store::Backlog>, limit: usize) -> Vec<store::Backlog> {
    backlog.retain(|tenant| tenant.pending > 0);
    backlog.sort_by_key(|tenant| std::cmp::Reverse(tenant.oldest_age));
    backlog.truncate(limit);
    backlog
}

/// Tasks alive on the relay's runtime (the supervisor runs on it).
pub(super) fn tasks_alive() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// What the backlog gauges remember between refreshes, shared with the task that reads them.
#[derive(Debug, Default)]
pub(super) struct Gauges {
    /// A read is running (at most one at a time).
    busy: AtomicBool,
    /// Tenants given backlog gauges by the last read.
    backlog: Mutex<HashSet<TenantId>>,
    /// Tenants given a parked-branches gauge by the last read.
    parked: Mutex<HashSet<TenantId>>,
}

impl RelaySupervisor {
    /// Touches the relay's fixed series (counters registered at zero, gauges without a tenant)
    /// so that a recorder dropping idle series (`distribution::prometheus_builder`) never drops
    /// them; per-tenant series of quiet tenants do expire.
    pub(super) fn keep_series_alive(&self, state: &SupervisorState) {
        metrics::gauge!("relay_tenants_held").set(state.core.drainers_alive() as f64);
        metrics::gauge!("relay_runtime_tasks").set(tasks_alive() as f64);
        metrics::counter!("relay_drainer_restarts_total").increment(0);
        metrics::counter!("relay_leases_lost_total").increment(0);
        metrics::counter!("relay_broker_refusals_total").increment(0);
        for slot in 0..state.directory.slots() {
            let shard = slot.to_string();
            metrics::counter!("relay_publisher_restarts_total", "shard" => shard.clone())
                .increment(0);
            for outcome in actors::FAILURE_OUTCOMES {
                metrics::counter!("relay_publish_failures_total", "shard" => shard.clone(), "outcome" => outcome)
                    .increment(0);
            }
        }
    }

    /// Reads the backlog of the tenants being drained for the lag gauges, on a task of its
    /// own (a slow query never holds the supervisor's mailbox); at most one read at a time,
    /// each under a timeout. Its cost is bounded whatever the backlog: per tenant, one index
    /// probe for the oldest intent and a count that stops at [`PENDING_GAUGE_CAP`].
    pub(super) fn refresh_metrics(&self, state: &mut SupervisorState) {
        if state.gauges.busy.swap(true, Ordering::AcqRel) {
            return;
        }
        let outbox = state.args.outbox.clone();
        let gauges = state.gauges.clone();
        let limit = state
            .args
            .config
            .metrics_interval
            .max(Duration::from_secs(1))
            * 5;
        let draining: Vec<TenantId> = state
            .core
            .drainers()
            .map(|(tenant, _)| tenant.clone())
            .collect();
        tokio::spawn(async move {
            let backlog =
                store::within(limit, outbox.backlog_of(&draining, PENDING_GAUGE_CAP)).await;
            let backlog = match backlog {
                Ok(backlog) => Some(backlog),
                Err(err) => {
                    tracing::warn!(error = %err, "cannot read the backlog for metrics");
                    None
                }
            };
            if let Some(backlog) = backlog {
                let mut seen = HashSet::new();
                for tenant in furthest_behind(backlog, TENANT_GAUGES) {
                    let label = tenant.tenant.to_string();
                    metrics::gauge!("relay_backlog_pending", "tenant" => label.clone())
                        .set(tenant.pending as f64);
                    metrics::gauge!("relay_backlog_oldest_age_seconds", "tenant" => label)
                        .set(tenant.oldest_age.as_secs_f64());
                    seen.insert(tenant.tenant);
                }
                let mut gauged = gauges
                    .backlog
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner());
                for tenant in gauged.difference(&seen) {
                    let label = tenant.to_string();
                    metrics::gauge!("relay_backlog_pending", "tenant" => label.clone()).set(0.0);
                    metrics::gauge!("relay_backlog_oldest_age_seconds", "tenant" => label).set(0.0);
                }
                *gauged = seen;
            }
            // Parked branches per tenant (a small table: only what the broker kept refusing or the relay cannot read).
            if let Ok(parked) = store::within(limit, outbox.parked_branches()).await {
                let mut counts: HashMap<TenantId, usize> = HashMap::new();
                for branch in parked {
                    *counts.entry(branch.branch.tenant).or_default() += 1;
                }
                let mut parked_gauged = gauges
                    .parked
                    .lock()
                    .unwrap_or_else(|poison| poison.into_inner());
                for tenant in parked_gauged.iter() {
                    if !counts.contains_key(tenant) {
                        metrics::gauge!("relay_parked_branches", "tenant" => tenant.to_string())
                            .set(0.0);
                    }
                }
                for (tenant, count) in &counts {
                    metrics::gauge!("relay_parked_branches", "tenant" => tenant.to_string())
                        .set(*count as f64);
                }
                *parked_gauged = counts.into_keys().collect();
            }
            gauges.busy.store(false, Ordering::Release);
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::Duration;

    use store::TenantId;

    use super::*;

    fn backlog(tenant: usize, pending: u64, age_secs: u64) -> store::Backlog {
        store::Backlog {
            tenant: TenantId::new(format!("t{tenant}")).expect("valid id"),
            pending,
            oldest_age: Duration::from_secs(age_secs),
        }
    }

    #[test]
    fn only_the_tenants_furthest_behind_get_gauges() {
        // 1,000 tenants being drained, ages scattered, every tenth already empty.
        let read: Vec<_> = (0..1_000)
            .map(|n| {
                backlog(
                    n,
                    if n % 10 == 0 { 0 } else { 5 },
                    (n * 7919 % 1_000) as u64,
                )
            })
            .collect();
        let gauged = furthest_behind(read.clone(), TENANT_GAUGES);
        assert_eq!(gauged.len(), TENANT_GAUGES);
        assert!(gauged.iter().all(|tenant| tenant.pending > 0));
        assert!(
            gauged
                .windows(2)
                .all(|pair| pair[0].oldest_age >= pair[1].oldest_age)
        );
        // Nobody left out is further behind than the last one kept.
        let cut = gauged.last().expect("some").oldest_age;
        let kept: HashSet<&TenantId> = gauged.iter().map(|tenant| &tenant.tenant).collect();
        assert!(read.iter().all(|tenant| {
            kept.contains(&tenant.tenant) || tenant.pending == 0 || tenant.oldest_age <= cut
        }));
        // Fewer than the limit: every tenant with something pending.
        assert_eq!(
            furthest_behind(read[..30].to_vec(), TENANT_GAUGES).len(),
            27
        );
    }
}

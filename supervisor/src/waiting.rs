//! Tenants waiting for a drainer slot (`max_drainers`): in arrival order, each once.

use std::collections::{HashSet, VecDeque};

use store::TenantId;

/// The queue of tenants with pending intents and no drainer yet.
#[derive(Debug, Default)]
pub(crate) struct Waiting {
    order: VecDeque<TenantId>,
    queued: HashSet<TenantId>,
}

impl Waiting {
    /// Queues `tenant` unless it already waits.
    pub(crate) fn push(&mut self, tenant: TenantId) {
        if self.queued.insert(tenant.clone()) {
            self.order.push_back(tenant);
        }
    }

    /// The tenant that has waited longest.
    pub(crate) fn pop(&mut self) -> Option<TenantId> {
        let tenant = self.order.pop_front()?;
        self.queued.remove(&tenant);
        Some(tenant)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The poller's list is every tenant with pending intents as of its snapshot: a waiting
    /// tenant missing from it has nothing left (a drainer shipped it since it was queued, from
    /// an earlier poll or a wake-up) and leaves the queue, so it never costs a drain that finds
    /// nothing. A tenant written to after that snapshot comes back with the next poll.
    pub(crate) fn keep_only(&mut self, pending: &[TenantId]) {
        if self.order.is_empty() {
            return;
        }
        let pending: HashSet<&TenantId> = pending.iter().collect();
        self.order.retain(|tenant| pending.contains(tenant));
        self.queued.retain(|tenant| pending.contains(tenant));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(names: &[&str]) -> Vec<TenantId> {
        names
            .iter()
            .map(|name| TenantId::new(*name).expect("valid id"))
            .collect()
    }

    fn drain(waiting: &mut Waiting) -> Vec<TenantId> {
        std::iter::from_fn(|| waiting.pop()).collect()
    }

    #[test]
    fn tenants_wait_once_in_arrival_order() {
        let mut waiting = Waiting::default();
        for tenant in tenants(&["b", "a", "b", "c", "a"]) {
            waiting.push(tenant);
        }
        assert_eq!(drain(&mut waiting), tenants(&["b", "a", "c"]));
        assert!(waiting.is_empty());
        // Popped tenants may queue again.
        waiting.push(tenants(&["a"]).remove(0));
        assert_eq!(drain(&mut waiting), tenants(&["a"]));
    }

    #[test]
    fn a_poll_drops_the_tenants_it_no_longer_lists_and_keeps_the_order() {
        let mut waiting = Waiting::default();
        for tenant in tenants(&["a", "b", "c", "d"]) {
            waiting.push(tenant);
        }
        waiting.keep_only(&tenants(&["d", "b", "x"]));
        // "x" is pending but was not waiting: the caller wakes or queues it, not keep_only.
        assert_eq!(drain(&mut waiting), tenants(&["b", "d"]));
        // A dropped tenant can queue again.
        for tenant in tenants(&["c", "a"]) {
            waiting.push(tenant);
        }
        waiting.keep_only(&tenants(&["a", "c"]));
        assert_eq!(drain(&mut waiting), tenants(&["c", "a"]));
        waiting.push(tenants(&["a"]).remove(0));
        waiting.keep_only(&[]);
        assert!(waiting.is_empty());
        assert_eq!(waiting.pop(), None);
    }
}

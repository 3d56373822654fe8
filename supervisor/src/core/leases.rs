//! The core's buckets: gained, lost and handed over.

use store::{Bucket, LeaseChanges, TenantId, bucket_of};

use super::*;

impl<H: Handle> Core<H> {
    /// The keeper gained or lost buckets. Lost fences are already closed (nothing more is
    /// published or acked under them); their drainers are stopped now and not restarted.
    pub(crate) fn leases_changed(&mut self, changes: LeaseChanges) {
        for bucket in &changes.lost {
            self.buckets.remove(bucket);
        }
        for fence in changes.gained {
            if let Some((bucket, _, _)) = fence.lease() {
                self.buckets.insert(bucket, BucketState::Held(fence));
            }
        }
        if changes.lost.is_empty() {
            return;
        }
        let lost: Vec<TenantId> = self
            .tenants
            .keys()
            .filter(|tenant| changes.lost.contains(&bucket_of(tenant)))
            .cloned()
            .collect();
        for tenant in lost {
            if let Some(TenantSlot::Running { drainer, .. }) = self.remove_slot(&tenant) {
                self.children.remove(&drainer.id());
                self.commands.push_back(Command::Kill(drainer));
            }
        }
        // A finish waiting on those drainers is done if they were the last.
        self.finish_if_done();
    }

    /// A planned handover of `buckets`: no drainer starts on them (nor restarts, nor leaves
    /// the waiting queue); their drainers finish their batches in flight under fences still
    /// open. A bucket with no drainer is settled at once.
    pub(crate) fn hand_over(&mut self, buckets: Vec<Bucket>) {
        for bucket in &buckets {
            self.buckets.insert(*bucket, BucketState::Leaving);
        }
        for bucket in buckets {
            let mut busy = false;
            for (tenant, slot) in &self.tenants {
                if bucket_of(tenant) != bucket {
                    continue;
                }
                if let TenantSlot::Running { drainer, .. } = slot {
                    busy = true;
                    self.commands.push_back(Command::Finish(drainer.clone()));
                }
            }
            if !busy {
                self.commands.push_back(Command::Settled(bucket));
            }
        }
    }

    /// Buckets held, not being handed over.
    pub(crate) fn buckets_held(&self) -> usize {
        self.buckets
            .values()
            .filter(|state| matches!(state, BucketState::Held(_)))
            .count()
    }
}

//! The core's graceful shutdown.
use std::time::Instant;

use store::{TenantId, bucket_of};

use super::*;

impl<H: Handle> Core<H> {
    /// Graceful shutdown: drainers finish their batches, then [`Command::Finished`]; after the
    /// grace what is left is killed (sent again by whoever drains next; nothing is lost).
    pub(crate) fn finish(&mut self, now: Instant) {
        if self.phase != Phase::Running {
            return;
        }
        self.phase = Phase::Finishing;
        for slot in self.tenants.values() {
            if let TenantSlot::Running { drainer, .. } = slot {
                self.commands.push_back(Command::Finish(drainer.clone()));
            }
        }
        self.timers
            .set(Timer::FinishDeadline, now + self.config.finish_grace);
        self.finish_if_done();
    }

    pub(super) fn finish_deadline(&mut self) {
        if self.phase != Phase::Finishing {
            return;
        }
        let tenants: Vec<TenantId> = self.tenants.keys().cloned().collect();
        for tenant in tenants {
            if let Some(TenantSlot::Running { drainer, .. }) = self.remove_slot(&tenant) {
                self.children.remove(&drainer.id());
                self.commands.push_back(Command::Kill(drainer));
            }
            // A bucket being handed over is released now (its fence closed first).
            self.settle_if_idle(bucket_of(&tenant));
        }
        self.finish_if_done();
    }

    pub(super) fn finish_if_done(&mut self) {
        if self.phase == Phase::Finishing && self.alive == 0 {
            self.phase = Phase::Finished;
            self.tenants.clear();
            self.timers.clear();
            self.commands.push_back(Command::Finished);
        }
    }
}

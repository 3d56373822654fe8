//! The core's drainers: spawned, admitted when a slot frees, restarted on their backoff, ended.
use std::time::Instant;

use store::TenantId;

use super::*;

impl<H: Handle> Core<H> {
    /// Starts a drainer for `tenant` if its bucket is held with its fence open at `now`, it
    /// has none and a slot is free; queues it when none is.
    pub(super) fn spawn(&mut self, tenant: TenantId, now: Instant) {
        if self.phase != Phase::Running {
            return;
        }
        if !self.staying_open(bucket_of(&tenant), now) {
            // Not ours (any more): nothing to restart.
            if matches!(
                self.tenants.get(&tenant),
                Some(TenantSlot::Restarting { .. })
            ) {
                self.remove_slot(&tenant);
            }
            return;
        }
        let backoff = match self.tenants.get(&tenant) {
            Some(slot) if slot.alive() => return,
            _ if self.alive >= self.config.max_drainers.max(1) => {
                self.waiting.push(tenant);
                return;
            }
            Some(TenantSlot::Restarting { .. }) => match self.remove_slot(&tenant) {
                Some(TenantSlot::Restarting { backoff }) => Some(backoff),
                _ => None,
            },
            _ => None,
        };
        self.alive += 1;
        self.tenants
            .insert(tenant.clone(), TenantSlot::Starting { backoff });
        self.commands.push_back(Command::SpawnDrainer { tenant });
    }

    /// Gives free drainer slots to waiting tenants, in order.
    pub(super) fn admit_waiting(&mut self, now: Instant) {
        while self.alive < self.config.max_drainers.max(1)
            && let Some(tenant) = self.waiting.pop()
        {
            self.spawn(tenant, now);
        }
    }

    /// Whether tenants wait for a drainer slot: drainers with nothing to do retire at once.
    pub(crate) fn crowded(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The drainer commanded for `tenant` runs as `drainer`.
    pub(crate) fn drainer_started(&mut self, tenant: TenantId, drainer: H, now: Instant) {
        let Some(TenantSlot::Starting { backoff }) = self.tenants.remove(&tenant) else {
            // Not commanded: stop it rather than run two.
            self.commands.push_back(Command::Kill(drainer));
            return;
        };
        self.children
            .insert(drainer.id(), Child::Drainer(tenant.clone()));
        // Its bucket may have moved on while it started (the core is told in order, but be
        // safe): finish it where it is leaving, stop it where it is lost.
        let bucket = bucket_of(&tenant);
        if self.phase == Phase::Finishing || self.leaving(bucket) {
            self.commands.push_back(Command::Finish(drainer.clone()));
        } else if self.phase != Phase::Running || !self.staying(bucket) {
            self.commands.push_back(Command::Kill(drainer.clone()));
        }
        self.tenants.insert(
            tenant,
            TenantSlot::Running {
                drainer,
                spawned: now,
                // It drains as it starts.
                wake: Wake::Idle,
                backoff,
            },
        );
    }

    /// The drainer `id` took a `Drain`: the next wake-up sends one, and one that came while it
    /// was queued is sent now.
    pub(crate) fn drainer_took_wake(&mut self, id: H::Id) {
        let Some(Child::Drainer(tenant)) = self.children.get(&id) else {
            return;
        };
        if let Some(TenantSlot::Running { drainer, wake, .. }) = self.tenants.get_mut(tenant)
            && drainer.id() == id
        {
            *wake = match wake {
                Wake::QueuedAgain => {
                    self.commands.push_back(Command::Drain(drainer.clone()));
                    Wake::Queued
                }
                Wake::Idle | Wake::Queued => Wake::Idle,
            };
        }
    }

    /// The drainer `id` found nothing to do at `activity`: while tenants wait for a slot it
    /// retires now (if still idle), else after its own idle delay.
    pub(crate) fn drainer_idle(&mut self, id: H::Id, activity: u64) {
        if !self.crowded() {
            return;
        }
        let Some(Child::Drainer(tenant)) = self.children.get(&id) else {
            return;
        };
        if let Some(TenantSlot::Running { drainer, .. }) = self.tenants.get(tenant)
            && drainer.id() == id
        {
            self.commands
                .push_back(Command::Retire(drainer.clone(), activity));
        }
    }

    /// The drainer commanded for `tenant` could not start: try again after its backoff.
    pub(crate) fn drainer_failed_to_start(&mut self, tenant: TenantId, now: Instant) {
        let backoff = match self.remove_slot(&tenant) {
            Some(TenantSlot::Starting { backoff, .. }) => backoff,
            _ => None,
        };
        self.settle_if_idle(bucket_of(&tenant));
        self.restart_later(tenant, backoff, now);
        self.finish_if_done();
    }

    /// Schedules the tenant's restart after its backoff's next delay: the delay and the
    /// failures in a row, this one included.
    pub(super) fn restart_later(
        &mut self,
        tenant: TenantId,
        backoff: Option<Backoff>,
        now: Instant,
    ) -> (Duration, u64) {
        let mut backoff = backoff.unwrap_or_else(|| Backoff::new(self.config.restart));
        let delay = backoff.next_delay();
        let failures = backoff.failures();
        self.timers
            .set(Timer::RespawnDrainer(tenant.clone()), now + delay);
        self.tenants
            .insert(tenant, TenantSlot::Restarting { backoff });
        (delay, failures)
    }

    /// Removes a tenant's slot, keeping the count of alive ones; a restarting one's timer goes
    /// with it.
    pub(super) fn remove_slot(&mut self, tenant: &TenantId) -> Option<TenantSlot<H>> {
        let slot = self.tenants.remove(tenant)?;
        if slot.alive() {
            self.alive -= 1;
        } else {
            self.timers.stop(&Timer::RespawnDrainer(tenant.clone()));
        }
        Some(slot)
    }

    pub(super) fn drainer_ended(
        &mut self,
        tenant: TenantId,
        why: &str,
        stop: Option<actors::StopReason>,
        now: Instant,
    ) {
        let Some(TenantSlot::Running {
            spawned, backoff, ..
        }) = self.remove_slot(&tenant)
        else {
            return;
        };
        // A drainer that lived longer than the longest delay failed afresh: start its backoff
        // over instead of carrying an old outage's delays forward.
        let backoff = backoff.filter(|_| now.duration_since(spawned) <= self.config.restart.max);
        // The last drainer of a bucket being handed over may be done (finished, or failed:
        // then the next owner sends its batch again); released now, while finishing too.
        let bucket = bucket_of(&tenant);
        self.settle_if_idle(bucket);
        if self.phase != Phase::Running {
            self.finish_if_done();
            return;
        }
        let held = self.staying(bucket);
        if stop.is_some() || !held {
            // Retired (idle), fenced or finished: nothing to restart, nothing to keep.
            self.notes.push_back(Note::DrainerStopped {
                tenant,
                reason: why.to_owned(),
            });
            self.admit_waiting(now);
            return;
        }
        let (delay, failures) = self.restart_later(tenant.clone(), backoff, now);
        self.notes.push_back(Note::DrainerRestarting {
            tenant,
            failures,
            retry_in: delay,
            reason: why.to_owned(),
        });
        self.admit_waiting(now);
    }

    // ----- Views -----

    /// Running drainers.
    pub(crate) fn drainers(&self) -> impl Iterator<Item = (&TenantId, &H)> {
        self.tenants.iter().filter_map(|(tenant, slot)| match slot {
            TenantSlot::Running { drainer, .. } => Some((tenant, drainer)),
            _ => None,
        })
    }

    /// Drainers starting or running.
    pub(crate) fn drainers_alive(&self) -> usize {
        self.alive
    }

    /// Tenants this relay keeps anything for (running, starting, restarting): bounded by the
    /// drainers alive plus those restarting, never by the tenants seen.
    #[cfg(test)]
    pub(super) fn slots(&self) -> usize {
        self.tenants.len()
    }
}

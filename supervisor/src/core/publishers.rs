//! The core's publishers: restarts on their backoff, the broker check during an outage, and
//! the broker's return.
use std::time::{Duration, Instant};

use actors::ShardId;

use super::*;

impl<H: Handle> Core<H> {
    /// The shard's publisher runs as `id`.
    pub(crate) fn publisher_started(&mut self, shard: ShardId, id: H::Id) {
        self.publishers[usize::from(shard.0)].state = PublisherState::Up(id);
        self.children.insert(id, Child::Publisher(shard));
    }

    /// The shard's publisher could not start: try again after its backoff.
    pub(crate) fn publisher_failed_to_start(&mut self, shard: ShardId, now: Instant) {
        let slot = &mut self.publishers[usize::from(shard.0)];
        slot.state = PublisherState::Down;
        let delay = slot.backoff.next_delay();
        self.timers.set(Timer::RespawnPublisher(shard), now + delay);
        self.check_broker_later(delay, now);
    }

    /// A publisher failed and waits `delay` to restart: the broker is in doubt, and if `delay`
    /// is longer than the check's interval it is checked after the interval instead of its
    /// return being learnt only then.
    pub(super) fn check_broker_later(&mut self, delay: Duration, now: Instant) {
        self.doubt = true;
        if self.config.broker_check.is_some_and(|every| delay > every) {
            self.schedule_check(now);
        }
    }

    /// A check after the interval, unless one is scheduled or running.
    fn schedule_check(&mut self, now: Instant) {
        let Some(every) = self.config.broker_check else {
            return;
        };
        if self.check == CheckState::Ready && self.phase == Phase::Running {
            self.check = CheckState::Scheduled;
            self.timers.set(Timer::CheckBroker, now + every);
        }
    }

    /// What [`Command::CheckBroker`] found: the broker took a connection (and the topology's
    /// declaration), or not.
    ///
    /// Answered: the broker is back, unless it had answered already with no publish confirmed
    /// and no check silent since (then publishes fail for another reason, left to the
    /// publishers' own backoff). Silent: checked again after the interval while the broker is
    /// in doubt (a publisher failed, and nothing was confirmed since), whether the publishers
    /// wait to restart or have restarted. A publisher connects at its first publish, so it
    /// restarts at once and fails again only when its drainers retry, each on its own backoff
    /// (up to 5 s). Before, checks stopped once no publisher waited to restart, or for good
    /// once the broker had answered one (even if it then went down again), and the broker's
    /// return was noticed only at the drainers' next retry: 5.25 s after a RabbitMQ 4.0 restart
    /// in one CI run (`cli::readiness_says_the_broker_is_down_through_a_restart_on_rabbitmq_4_0`).
    pub(crate) fn broker_checked(&mut self, answered: bool, now: Instant) {
        self.check = CheckState::Ready;
        if answered {
            self.doubt = false;
            if !std::mem::replace(&mut self.answered, true) {
                self.notes.push_back(Note::BrokerAnswers);
                self.broker_back();
            }
            return;
        }
        self.answered = false;
        if self.doubt {
            self.schedule_check(now);
        }
        self.notes
            .push_back(Note::BrokerSilent { again: self.doubt });
    }

    /// The shard's publisher had a publish confirmed: its next failure starts a fresh backoff.
    /// After failures that is the broker back: see [`Core::broker_back`].
    pub(crate) fn publisher_healthy(&mut self, shard: ShardId) {
        let backoff = &mut self.publishers[usize::from(shard.0)].backoff;
        let failures = backoff.failures();
        backoff.reset();
        // A confirmed publish: the broker takes publishes, so it is no longer in doubt, and
        // its next answer after a failure is news again.
        self.doubt = false;
        self.answered = false;
        if failures > 0 {
            self.notes
                .push_back(Note::PublisherRecovered { shard, failures });
            self.broker_back();
        }
    }

    /// A publisher recovered, so the broker takes publishes again: every publisher waiting out
    /// its restart delay starts now, with its backoff started over, and every drainer is told
    /// to stop backing off. Without this each waited out a delay drawn while the broker was
    /// down (up to the policies' longest, 5 s each, one after the other): after a 10 s broker
    /// restart some tenants shipped nothing for 8 s (`broker_faults::a_broker_restart_with_
    /// several_relays_heals_every_tenant_within_seconds_*`).
    pub(super) fn broker_back(&mut self) {
        if self.phase != Phase::Running {
            return;
        }
        let mut waiting = Vec::new();
        self.timers.retain(|timer| match timer {
            Timer::RespawnPublisher(shard) => {
                waiting.push(*shard);
                false
            }
            Timer::CheckBroker => false,
            _ => true,
        });
        if self.check == CheckState::Scheduled {
            // Its timer is gone; a check already running reports as usual.
            self.check = CheckState::Ready;
        }
        for shard in waiting {
            let slot = &mut self.publishers[usize::from(shard.0)];
            slot.backoff.reset();
            if matches!(slot.state, PublisherState::Down) {
                slot.state = PublisherState::Starting;
                self.commands.push_back(Command::SpawnPublisher(shard));
            }
        }
        for slot in self.tenants.values() {
            if let TenantSlot::Running { drainer, .. } = slot {
                self.commands.push_back(Command::Resume(drainer.clone()));
            }
        }
    }

    /// Consecutive failures of the shard's publisher (for tests and status).
    #[cfg(test)]
    pub(super) fn publisher_failures(&self, shard: ShardId) -> u64 {
        self.publishers[usize::from(shard.0)].backoff.failures()
    }
}

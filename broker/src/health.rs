//! What the publishers last learned about the broker, for readiness probes.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

/// What a first connection says about the broker (an adapter's `preflight`).
#[derive(Debug, PartialEq, Eq)]
pub enum Preflight {
    /// Connected, and the topology (RabbitMQ) or stream (NATS) is declared as the relay needs.
    Ready,
    /// Not reachable now (down, or no answer): not an error, the relay keeps trying.
    Unreachable(String),
}

/// The broker as the relay's publishers last saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerState {
    /// No publisher has talked to the broker yet.
    Unknown,
    /// The last batch the publishers heard of had events confirmed (stored) and no fault. A
    /// session that opens is not enough: during a partition a node accepts connections and
    /// confirms nothing (measured: when an opened session counted as up, two relays that
    /// shipped nothing for a 10 s cut answered ready in 77 of their 80 answers;
    /// tests/it/partitions.rs). A batch the broker refused whole without a fault (nacked,
    /// returned, too large) changes nothing.
    Up,
    /// The last attempt failed: unreachable, refused, or confirms did not come. It stays so
    /// until a batch is confirmed: a broker that is back but gets nothing of this relay's to
    /// confirm still reads down. Readiness ignores it only while no intent at all waits (any
    /// relay's, parked ones included).
    Down,
}

#[derive(Debug, Default)]
struct Inner {
    state: AtomicU8,
    /// Connections the broker has blocked (`connection.blocked`, a resource alarm) and not
    /// unblocked yet.
    blocked: AtomicUsize,
}

/// Shared by every publisher of a relay; cheap to clone and to read.
#[derive(Clone, Debug, Default)]
pub struct BrokerHealth(Arc<Inner>);

impl BrokerHealth {
    /// A fresh health, [`BrokerState::Unknown`].
    pub fn new() -> Self {
        Self::default()
    }

    /// The last state reported.
    pub fn state(&self) -> BrokerState {
        match self.0.state.load(Ordering::Acquire) {
            1 => BrokerState::Up,
            2 => BrokerState::Down,
            _ => BrokerState::Unknown,
        }
    }

    /// Whether the broker holds any of the relay's connections blocked (flow control under a
    /// memory or disk alarm): nothing is written to those until it unblocks them.
    pub fn blocked(&self) -> bool {
        self.0.blocked.load(Ordering::Acquire) > 0
    }

    /// Records what an adapter just learned: down (a connect, a session's setup or a batch
    /// failed), or up (a batch had events taken).
    pub fn report(&self, up: bool) {
        self.0
            .state
            .store(if up { 1 } else { 2 }, Ordering::Release);
    }

    /// A mark for one connection's flow state, counted here while it says blocked.
    pub fn flow_mark(&self) -> BlockedMark {
        BlockedMark {
            health: self.clone(),
            blocked: AtomicBool::new(false),
        }
    }

    fn count_blocked(&self, delta: isize) {
        let now = if delta > 0 {
            self.0.blocked.fetch_add(1, Ordering::AcqRel) + 1
        } else {
            self.0.blocked.fetch_sub(1, Ordering::AcqRel) - 1
        };
        metrics::gauge!("relay_broker_blocked_connections").set(now as f64);
    }
}

/// One connection's share of [`BrokerHealth::blocked`]: counted once while blocked, and
/// uncounted when unblocked or dropped (the connection is gone).
#[derive(Debug)]
pub struct BlockedMark {
    health: BrokerHealth,
    blocked: AtomicBool,
}

impl BlockedMark {
    /// Says whether the connection is blocked now (repeating a state changes nothing).
    pub fn set(&self, blocked: bool) {
        if self.blocked.swap(blocked, Ordering::AcqRel) != blocked {
            self.health.count_blocked(if blocked { 1 } else { -1 });
        }
    }
}

impl Drop for BlockedMark {
    fn drop(&mut self) {
        self.set(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection counts once however often the broker repeats itself, and a connection
    /// dropped while blocked no longer counts.
    #[test]
    fn a_blocked_connection_counts_once_and_not_after_it_is_gone() {
        let health = BrokerHealth::new();
        let (first, second) = (health.flow_mark(), health.flow_mark());
        first.set(true);
        first.set(true);
        second.set(true);
        assert!(health.blocked());
        first.set(false);
        assert!(health.blocked(), "the second is still blocked");
        drop(second);
        assert!(!health.blocked());
        first.set(false);
        assert!(!health.blocked());
    }
}

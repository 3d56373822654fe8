//! The publisher port: what the relay's actors need from a broker.
use std::future::Future;
use std::pin::Pin;

use store::{Fence, OutboxEvent};

use crate::error::Error;

/// A boxed, sendable future (the port is object-safe so tests can inject a fault broker).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the broker did with one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Stored by the broker and routed to its partition (RabbitMQ: `basic.ack`, not returned):
    /// the only outcome that may be acked in the outbox.
    Accepted,
    /// Refused by the broker after it was written (RabbitMQ: `basic.nack`).
    Nacked,
    /// Not stored for want of room, and the broker says so (NATS: the stream at its limits with
    /// discard new, 10077, or the server's JetStream store full, 10023). Nothing is wrong with
    /// the event: its branch waits and is retried on its backoff, never parked, and ships once
    /// room is made. (A RabbitMQ queue at its limit nacks without a reason: `Nacked`.)
    NoRoom,
    /// Taken but routed nowhere (RabbitMQ: returned unroutable, `mandatory`, reply 312): not a
    /// delivery.
    Returned,
    /// Refused for its size: larger than the broker's limit (RabbitMQ: `max_message_size`, the
    /// channel closed with PRECONDITION_FAILED). Not a delivery; sending it again fails the
    /// same way until the limit is raised.
    TooLarge,
    /// Not written: the broker cannot carry the event as it stands (NATS: a header value with a
    /// line break, which its protocol cannot hold). Not a delivery; sending it again fails the
    /// same way until the row is repaired.
    Unwritable,
    /// Written, but no verdict arrived in time or the connection died first: perhaps stored.
    Unconfirmed,
    /// Never written to the broker (unreachable, or an earlier failure in the batch).
    NotSent,
}

impl Outcome {
    /// Whether the broker took responsibility for the event.
    pub fn is_accepted(self) -> bool {
        self == Outcome::Accepted
    }

    /// Its name in metrics (`relay_publish_failures_total{outcome}`) and traces
    /// (`error.type`): `accepted`, `nacked`, `no_room`, `returned`, `too_large`, `unwritable`,
    /// `unconfirmed`, `not_sent`.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::Nacked => "nacked",
            Outcome::NoRoom => "no_room",
            Outcome::Returned => "returned",
            Outcome::TooLarge => "too_large",
            Outcome::Unwritable => "unwritable",
            Outcome::Unconfirmed => "unconfirmed",
            Outcome::NotSent => "not_sent",
        }
    }
}

/// The result of publishing a batch: one outcome per event, in the batch's order.
#[derive(Debug)]
pub struct PublishReport {
    /// `outcomes[i]` is what happened to `events[i]`.
    pub outcomes: Vec<Outcome>,
    /// Set when the connection or channel is unusable; the publisher has dropped it, and the
    /// owner should treat this publisher as failed (the supervisor restarts it).
    pub fault: Option<Error>,
}

impl PublishReport {
    /// Every event `NotSent`, because of `fault`.
    pub fn not_sent(n_events: usize, fault: Error) -> Self {
        Self {
            outcomes: vec![Outcome::NotSent; n_events],
            fault: Some(fault),
        }
    }

    /// How many events were accepted.
    pub fn accepted(&self) -> usize {
        self.outcomes
            .iter()
            .filter(|outcome| outcome.is_accepted())
            .count()
    }

    /// What the batch says of the broker, for [`crate::BrokerHealth::report`]: down on a
    /// fault, up when it took something, nothing when it refused the batch whole without a
    /// fault. (An opened session says nothing: a node cut off from its cluster accepts
    /// connections and confirms nothing.)
    pub fn broker_up(&self) -> Option<bool> {
        match self.fault {
            Some(_) => Some(false),
            None => self
                .outcomes
                .iter()
                .any(|o| o.is_accepted())
                .then_some(true),
        }
    }
}

/// Where a batch's verdict goes: called at most once, by whoever decides it (the adapter's
/// confirm pump, or `send` itself when nothing could be written). Dropped uncalled (the
/// publisher was dropped with the batch in flight) means every event is unconfirmed: the
/// caller must treat that as a verdict too (the actors' `Reply` does).
pub type OnReport = Box<dyn FnOnce(PublishReport) + Send>;

/// A verdict as a future (tools and tests): what [`report_future`] returns.
pub type Confirms = BoxFuture<'static, PublishReport>;

/// The callback to hand to [`Publisher::send`] and the future of the report it receives: every
/// event `Unconfirmed`, with a fault, if the callback is dropped uncalled.
pub fn report_future(n_events: usize) -> (OnReport, Confirms) {
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let done: OnReport = Box::new(move |report| {
        let _ = sender.send(report);
    });
    let confirms = Box::pin(async move {
        receiver.await.unwrap_or_else(|_| PublishReport {
            outcomes: vec![Outcome::Unconfirmed; n_events],
            fault: Some(Error::Unreachable("the publisher was dropped".into())),
        })
    });
    (done, confirms)
}

/// Publishes events to a broker with confirms.
///
/// Contract: events of one branch appear in `events` in ascending Lsn order, and batches are
/// written to the broker in the order of `send` calls on one channel. Nothing here panics or
/// hangs: every await is under a timeout.
pub trait Publisher: Send + 'static {
    /// Writes `events` to the broker, in order, and returns once they are written; their
    /// confirms go to `done` (many batches in flight on one channel, confirms pipelined, no
    /// task per batch).
    ///
    /// Invariant: nothing is written once `fence` is closed (checked before every write); the
    /// events not written are reported `NotSent`, without a fault.
    fn send<'a>(
        &'a mut self,
        events: &'a [OutboxEvent],
        fence: &'a Fence,
        done: OnReport,
    ) -> BoxFuture<'a, ()>;

    /// Writes `events` without a lease fence and awaits their confirms (tools and tests).
    fn publish<'a>(&'a mut self, events: &'a [OutboxEvent]) -> BoxFuture<'a, PublishReport> {
        Box::pin(async move {
            let fence = Fence::open();
            let (done, report) = report_future(events.len());
            self.send(events, &fence, done).await;
            report.await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_says_the_broker_is_up_only_when_it_took_something() {
        let report =
            |outcomes: Vec<Outcome>, fault: Option<Error>| PublishReport { outcomes, fault };
        let fault = || Some(Error::Unreachable("cut".into()));
        assert_eq!(
            report(vec![Outcome::Accepted, Outcome::Nacked], None).broker_up(),
            Some(true)
        );
        assert_eq!(
            report(vec![Outcome::Nacked, Outcome::Returned], None).broker_up(),
            None
        );
        assert_eq!(
            report(vec![Outcome::Accepted], fault()).broker_up(),
            Some(false)
        );
        assert_eq!(
            PublishReport::not_sent(3, Error::Unreachable("cut".into())).broker_up(),
            Some(false)
        );
    }
}

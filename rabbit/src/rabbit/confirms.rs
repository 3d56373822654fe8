//! The confirm pump: which event each confirm, return, nack or size refusal belongs to.
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::watch;

use lapin::Confirmation;
use lapin::types::ShortString;

use super::flow::{Flow, until_unless_blocked};
use super::session::size_limit;
use broker::{BrokerHealth, Error, OnReport, Outcome, PublishReport};

/// A written batch whose confirms the pump awaits.
pub(crate) struct PendingBatch {
    pub(crate) confirms: Vec<lapin::PublisherConfirm>,
    pub(crate) ids: Vec<ShortString>,
    /// Payload bytes of each event written (a size refusal names the limit, not the message).
    pub(crate) sizes: Vec<usize>,
    pub(crate) n_events: usize,
    pub(crate) deadline: tokio::time::Instant,
    pub(crate) write_fault: Option<Error>,
    /// Gets the batch's report from the pump.
    pub(crate) done: OnReport,
}

/// What the pump knows of the writer: batches begun, and batches handed over.
pub(crate) struct Writer {
    pub(crate) started: Arc<AtomicU64>,
    pub(crate) handed: tokio::sync::watch::Receiver<u64>,
}

/// A confirm, before and after the pump saw it resolve (returns already noted).
pub(crate) enum Slot {
    Waiting(lapin::PublisherConfirm),
    Seen(Outcome, Option<lapin::Error>),
}

/// A batch in the pump's hands.
pub(crate) struct Tracked {
    slots: Vec<Slot>,
    batch: PendingBatch,
}

/// Notes a resolved confirm: its return (if any) by message id; what it says.
pub(crate) fn seen(
    confirmation: Result<Confirmation, lapin::Error>,
    returned: &mut HashSet<ShortString>,
) -> Slot {
    let mut note = |message: Option<lapin::message::BasicReturnMessage>| {
        if let Some(id) =
            message.and_then(|message| message.delivery.properties.message_id().clone())
        {
            returned.insert(id);
        }
    };
    match confirmation {
        Ok(Confirmation::Ack(message)) => {
            note(message);
            Slot::Seen(Outcome::Accepted, None)
        }
        Ok(Confirmation::Nack(message)) => {
            note(message);
            Slot::Seen(Outcome::Nacked, None)
        }
        Ok(Confirmation::NotRequested) => Slot::Seen(Outcome::Unconfirmed, None),
        Err(err) => Slot::Seen(Outcome::Unconfirmed, Some(err)),
    }
}

pub(crate) fn track(batch: PendingBatch) -> Tracked {
    let mut batch = batch;
    let slots = std::mem::take(&mut batch.confirms)
        .into_iter()
        .map(Slot::Waiting)
        .collect();
    Tracked { slots, batch }
}

/// Each event's outcome in a batch, from what the broker said of it (`said`: its confirm's
/// outcome, `None` if it was never written), the broker's size limit once a refusal named it,
/// and the channel-wide set of returned message ids, from which this batch's ids are taken.
/// Returns the outcomes and whether any event came back returned (its topology is to be
/// declared again).
///
/// - never written: `NotSent`;
/// - unconfirmed and larger than the size limit: `TooLarge` (the one the broker refused, and
///   any later one it would refuse);
/// - acked but returned (nothing routed it): `Returned`, whatever confirm lapin attached the
///   return to;
/// - otherwise what its confirm said.
///
/// Every id of the batch leaves `returned`; the ids of other batches stay.
pub(crate) fn attribute(
    said: &[Option<Outcome>],
    ids: &[ShortString],
    sizes: &[usize],
    size_limit: Option<usize>,
    returned: &mut HashSet<ShortString>,
) -> (Vec<Outcome>, bool) {
    let mut any_returned = false;
    let outcomes = said
        .iter()
        .enumerate()
        .map(|(index, said)| {
            let size = sizes.get(index).copied().unwrap_or(0);
            let outcome = match said {
                None => Outcome::NotSent,
                Some(Outcome::Unconfirmed) if size_limit.is_some_and(|limit| size > limit) => {
                    Outcome::TooLarge
                }
                Some(outcome) => *outcome,
            };
            // Its return is taken out of the set whatever it says (a return of an event not
            // acked is no delivery either way).
            let was_returned = ids.get(index).is_some_and(|id| returned.remove(id));
            if was_returned && outcome == Outcome::Accepted {
                any_returned = true;
                Outcome::Returned
            } else {
                outcome
            }
        })
        .collect();
    (outcomes, any_returned)
}

/// What a session's faults tell its configuration: a batch unconfirmed for the timeout sends
/// the next connection to the next address ([`RabbitConfig::pass_over`]); any other fault (a
/// refusal, a closed channel, a failed write) makes the next session declare the topology
/// again ([`RabbitConfig::forget_declared`]).
pub(crate) struct SessionFate {
    pub(crate) config: crate::rabbit::RabbitConfig,
    /// The index of the address the session's connection went to.
    pub(crate) address: usize,
}

impl SessionFate {
    fn judge(&self, timed_out: bool, fault: Option<&Error>) {
        if timed_out {
            self.config.pass_over(self.address);
        }
        if fault.is_some() {
            self.config.forget_declared();
        }
    }
}

/// Awaits a channel's confirms strictly in write order and decides each event's outcome from
/// everything the broker said, not from which confirm lapin attached a return to.
///
/// lapin hands a waiting `basic.return` to whichever confirm it resolves next (for a
/// multiple-ack, in hash-map order): possibly a confirm of a later batch, even one still being
/// written. RabbitMQ sends a message's return before its ack, so by the time every confirm of
/// batch N resolved, each return of N is attached to some confirm already resolved. So, before
/// deciding N, the pump waits until every batch whose writing began has been handed over, and
/// notes the returns of every already-resolved confirm of later batches too. Outcomes are then
/// decided by message id against the channel-wide set of returned ids. `fate` hears of every
/// batch's faults.
pub(crate) async fn confirm_pump(
    mut batches: tokio::sync::mpsc::UnboundedReceiver<PendingBatch>,
    mut writer: Writer,
    redeclare: Arc<AtomicBool>,
    confirm_timeout: Duration,
    flow: watch::Receiver<Flow>,
    health: BrokerHealth,
    fate: SessionFate,
) {
    let mut returned: HashSet<ShortString> = HashSet::new();
    let mut ahead: VecDeque<Tracked> = VecDeque::new();
    // The broker's max_message_size, once a refusal named it (the channel is closed then).
    let mut size_limit_seen: Option<usize> = None;
    loop {
        let mut current = match ahead.pop_front() {
            Some(tracked) => tracked,
            None => match batches.recv().await {
                Some(batch) => track(batch),
                None => return,
            },
        };
        let deadline = current.batch.deadline;
        let mut timed_out = false;
        for slot in &mut current.slots {
            if let Slot::Waiting(confirm) = slot {
                // Blocked time does not count: the broker routes what it holds once unblocked.
                *slot = match until_unless_blocked(confirm, deadline, confirm_timeout, &flow).await
                {
                    Some(confirmation) => seen(confirmation, &mut returned),
                    None => {
                        timed_out = true;
                        Slot::Seen(Outcome::Unconfirmed, None)
                    }
                };
            }
        }
        // Every confirm that can carry a return of this batch is resolved now; make sure the
        // pump holds all of them (none is in a batch still being written), then look.
        let begun = writer.started.load(Ordering::Acquire);
        let _ = tokio::time::timeout_at(deadline, writer.handed.wait_for(|h| *h >= begun)).await;
        while let Ok(batch) = batches.try_recv() {
            ahead.push_back(track(batch));
        }
        for later in &mut ahead {
            for slot in &mut later.slots {
                if let Slot::Waiting(confirm) = slot
                    && let Some(confirmation) = confirm.now_or_never()
                {
                    *slot = seen(confirmation, &mut returned);
                }
            }
        }
        let batch = current.batch;
        let mut fault = batch.write_fault;
        let mut said = vec![None; batch.n_events];
        for (index, slot) in current.slots.into_iter().enumerate() {
            if let Slot::Seen(outcome, err) = slot {
                said[index] = Some(outcome);
                if let Some(err) = err {
                    size_limit_seen = size_limit_seen.or(size_limit(&err));
                    fault.get_or_insert(crate::connect::amqp_error(err));
                }
            }
        }
        fate.judge(timed_out, fault.as_ref());
        if timed_out {
            fault.get_or_insert(Error::timed_out("publisher confirm", confirm_timeout));
        }
        let (outcomes, any_returned) = attribute(
            &said,
            &batch.ids,
            &batch.sizes,
            size_limit_seen,
            &mut returned,
        );
        if any_returned {
            redeclare.store(true, Ordering::Release);
        }
        // Reported after `done`: whoever `done` tells has heard of the batch before a probe
        // reads "up".
        let report = PublishReport { outcomes, fault };
        let up = report.broker_up();
        (batch.done)(report);
        if let Some(up) = up {
            health.report(up);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn outcome() -> impl Strategy<Value = Option<Outcome>> {
        prop_oneof![
            Just(None),
            Just(Some(Outcome::Accepted)),
            Just(Some(Outcome::Nacked)),
            Just(Some(Outcome::Unconfirmed)),
        ]
    }

    proptest! {
        /// Whatever the broker said and returned, in any batch: one outcome per event; only an
        /// acked event that was not returned is accepted; a returned acked one is `Returned`;
        /// only an unconfirmed one above a named limit is `TooLarge`; the batch's returns leave
        /// the set and other batches' stay.
        #[test]
        fn each_event_gets_the_outcome_the_broker_gave_it(
            events in proptest::collection::vec((outcome(), 0usize..200, any::<bool>()), 0..40),
            limit in proptest::option::of(0usize..200),
            others in proptest::collection::btree_set(0u32..20, 0..5),
        ) {
            let ids: Vec<ShortString> = (0..events.len()).map(|n| format!("b/{n}").into()).collect();
            let said: Vec<Option<Outcome>> = events.iter().map(|(said, _, _)| *said).collect();
            let sizes: Vec<usize> = events.iter().map(|(_, size, _)| *size).collect();
            let mut returned: HashSet<ShortString> = events
                .iter()
                .zip(&ids)
                .filter(|((_, _, returned), _)| *returned)
                .map(|(_, id)| id.clone())
                .collect();
            let other: HashSet<ShortString> = others.iter().map(|n| format!("other/{n}").into()).collect();
            returned.extend(other.iter().cloned());

            let (outcomes, any_returned) = attribute(&said, &ids, &sizes, limit, &mut returned);

            prop_assert_eq!(outcomes.len(), events.len());
            prop_assert_eq!(&returned, &other);
            let mut expect_returned = false;
            for ((said, size, was_returned), got) in events.iter().zip(&outcomes) {
                let want = match said {
                    None => Outcome::NotSent,
                    Some(Outcome::Unconfirmed) if limit.is_some_and(|l| *size > l) => Outcome::TooLarge,
                    Some(Outcome::Accepted) if *was_returned => {
                        expect_returned = true;
                        Outcome::Returned
                    }
                    Some(outcome) => *outcome,
                };
                prop_assert_eq!(*got, want);
                prop_assert_eq!(got.is_accepted(), *said == Some(Outcome::Accepted) && !was_returned);
            }
            prop_assert_eq!(any_returned, expect_returned);
        }
    }

    #[test]
    fn a_return_lapin_attached_to_another_confirm_still_counts() {
        // The return of event 1 arrived with event 0's confirm: both acked; 1 was not routed.
        let ids: Vec<ShortString> = vec!["e/0".into(), "e/1".into()];
        let mut returned: HashSet<ShortString> = ["e/1".into()].into_iter().collect();
        let (outcomes, any) = attribute(
            &[Some(Outcome::Accepted), Some(Outcome::Accepted)],
            &ids,
            &[10, 10],
            None,
            &mut returned,
        );
        assert_eq!(outcomes, [Outcome::Accepted, Outcome::Returned]);
        assert!(any && returned.is_empty());
    }
}

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
use crate::port::{OnReport, Outcome, PublishReport};
use crate::{BrokerHealth, Error};

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

/// Awaits a channel's confirms strictly in write order and decides each event's outcome from
/// everything the broker said, not from which confirm lapin attached a return to.
///
/// lapin hands a waiting `basic.return` to whichever confirm it resolves next (for a
/// multiple-ack, in hash-map order): possibly a confirm of a later batch, even one still being
/// written. RabbitMQ sends a message's return before its ack, so by the time every confirm of
/// batch N resolved, each return of N is attached to some confirm already resolved. So, before
/// deciding N, the pump waits until every batch whose writing began has been handed over, and
/// notes the returns of every already-resolved confirm of later batches too. Outcomes are then
/// decided by message id against the channel-wide set of returned ids.
pub(crate) async fn confirm_pump(
    mut batches: tokio::sync::mpsc::UnboundedReceiver<PendingBatch>,
    mut writer: Writer,
    redeclare: Arc<AtomicBool>,
    confirm_timeout: Duration,
    flow: watch::Receiver<Flow>,
    health: BrokerHealth,
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
        let mut outcomes = vec![Outcome::NotSent; batch.n_events];
        for (index, slot) in current.slots.into_iter().enumerate() {
            if let Slot::Seen(outcome, err) = slot {
                outcomes[index] = outcome;
                if let Some(err) = err {
                    size_limit_seen = size_limit_seen.or(size_limit(&err));
                    fault.get_or_insert(Error::Channel(err));
                }
            }
        }
        // Refused for its size: every unconfirmed event above the limit the broker named (the
        // one it refused, and any later one it would refuse) counts against its branch.
        if let Some(limit) = size_limit_seen {
            for (outcome, size) in outcomes.iter_mut().zip(&batch.sizes) {
                if *outcome == Outcome::Unconfirmed && *size > limit {
                    *outcome = Outcome::TooLarge;
                }
            }
        }
        if timed_out {
            fault.get_or_insert(Error::Timeout {
                operation: "publisher confirm",
                timeout_ms: confirm_timeout.as_millis() as u64,
            });
        }
        for (outcome, id) in outcomes.iter_mut().zip(&batch.ids) {
            // Acked but returned: nothing routed it, so it was not delivered.
            if returned.remove(id) && *outcome == Outcome::Accepted {
                *outcome = Outcome::Returned;
                redeclare.store(true, Ordering::Release);
            }
        }
        health.report(fault.is_none());
        (batch.done)(PublishReport { outcomes, fault });
    }
}

//! The poller: the task beside the supervisor that finds tenants with pending intents, for
//! relays that are not woken by NOTIFY or the in-process waker alone.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ractor::ActorRef;
use store::{Outbox, within};
use tokio::sync::Notify;

use crate::calls::Failures;
use crate::messages::SupervisorMessage;

/// Polls the tenants with pending intents every `interval` (or at once when `early` fires)
/// and hands them to the supervisor, which drains those in buckets it holds. Ends with the
/// supervisor.
pub(crate) async fn poll_pending(
    outbox: Outbox,
    supervisor: ActorRef<SupervisorMessage>,
    interval: Duration,
    early: Arc<Notify>,
    busy: Arc<AtomicBool>,
) {
    let limit = interval.max(Duration::from_secs(5));
    let mut failures = Failures::new("pending-tenant poll");
    loop {
        // Backpressure: no new batch before the supervisor handled the last one, so a slow
        // supervisor never finds a queue of stale polls in its mailbox.
        if !busy.load(Ordering::Acquire)
            && let Some(tenants) = failures.seen(within(limit, outbox.tenants_with_pending()).await)
        {
            // Sent even when empty: the supervisor prunes its waiting queue with it.
            busy.store(true, Ordering::Release);
            if supervisor
                .cast(SupervisorMessage::Pending(tenants))
                .is_err()
            {
                return;
            }
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = early.notified() => {}
        }
        if supervisor.get_status() > ractor::ActorStatus::Running {
            return;
        }
    }
}

//! A batch's share of the relay-wide budgets (events and payload bytes in flight), taken
//! before its drain and given back when it settles.
use ractor::ActorProcessingErr;
use tokio::sync::{OwnedSemaphorePermit, TryAcquireError};

use super::{Drainer, DrainerState};

/// A batch's share of the relay-wide budgets, given back when the batch settles.
#[derive(Debug)]
pub(super) struct Permits {
    pub(super) events: OwnedSemaphorePermit,
    pub(super) bytes: OwnedSemaphorePermit,
}

/// What a batch holds until it settles: its share of the budgets.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) _permits: Permits,
}

impl Drainer {
    /// Budget for a full batch, in events and bytes. Waits only when nothing of this drainer
    /// is in flight: a drainer blocked here cannot settle its own batches, which hold the
    /// permits it would wait for.
    pub(super) async fn permits(
        state: &DrainerState,
    ) -> Result<Option<Permits>, ActorProcessingErr> {
        let (events, bytes) = state.window.reservation(
            state.args.config.batch_size.max(1),
            state.args.config.batch_max_bytes.max(1),
        );
        let (event_budget, byte_budget) =
            (state.args.budget.clone(), state.args.byte_budget.clone());
        if state.window.is_empty() {
            let events = event_budget.acquire_many_owned(events).await?;
            let bytes = byte_budget.acquire_many_owned(bytes).await?;
            return Ok(Some(Permits { events, bytes }));
        }
        let events = match event_budget.try_acquire_many_owned(events) {
            Ok(permits) => permits,
            Err(TryAcquireError::NoPermits) => return Ok(None),
            Err(closed) => return Err(closed.into()),
        };
        match byte_budget.try_acquire_many_owned(bytes) {
            Ok(bytes) => Ok(Some(Permits { events, bytes })),
            Err(TryAcquireError::NoPermits) => Ok(None),
            Err(closed) => Err(closed.into()),
        }
    }

    /// A drain takes no more than its reservation.
    pub(super) fn limit(permits: &Permits) -> store::DrainLimit {
        store::DrainLimit {
            events: permits.events.num_permits() as u32,
            bytes: permits.bytes.num_permits() as u64,
        }
    }
}

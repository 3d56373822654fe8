//! Flow control: timeouts that count only time the broker did not hold the connection
//! blocked, and writes that wait for it.
use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::time::Instant;

use broker::Error;

/// Awaits a lapin operation under `limit`: its error, or [`Error::Timeout`] naming `operation`.
pub async fn within<T>(
    operation: &'static str,
    limit: Duration,
    future: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, Error> {
    broker::within(operation, limit, async {
        future.await.map_err(crate::connect::amqp_error)
    })
    .await
}

/// A connection's flow control, as the broker last said: blocked or not, and since when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Flow {
    pub(crate) blocked: bool,
    pub(crate) since: Instant,
}

impl Flow {
    pub(crate) fn open() -> Self {
        Self {
            blocked: false,
            since: Instant::now(),
        }
    }
}

/// A wait of `limit` that ran out at `deadline`: whether, and until when, it goes on. A wait
/// counts only time the connection was not blocked: while blocked it goes on for another
/// `limit`; after an unblock it has `limit` from the unblock. Pure, so it is unit-tested.
pub(crate) fn extended(
    deadline: Instant,
    limit: Duration,
    flow: Flow,
    now: Instant,
) -> Option<Instant> {
    if flow.blocked {
        Some(now + limit)
    } else if flow.since + limit > deadline {
        Some(flow.since + limit)
    } else {
        None
    }
}

/// Awaits `future` until `deadline`, extended while (and after) the connection is blocked;
/// `None` once it ran out.
pub(crate) async fn until_unless_blocked<F: Future + Unpin>(
    future: F,
    deadline: Instant,
    limit: Duration,
    flow: &watch::Receiver<Flow>,
) -> Option<F::Output> {
    let mut future = future;
    let mut deadline = deadline;
    loop {
        match tokio::time::timeout_at(deadline, &mut future).await {
            Ok(output) => return Some(output),
            Err(_) => deadline = extended(deadline, limit, *flow.borrow(), Instant::now())?,
        }
    }
}

/// Payload bytes a publisher queues on its channel ahead of the writes it awaits: a batch of
/// small events goes out in one hand-off to lapin's I/O thread, while large ones do not pile
/// up whole in lapin's frame queue (a batch may hold 4 MiB).
pub(crate) const QUEUED_AHEAD_BYTES: usize = 1 << 20;

/// The verdict of a write queued by its first poll (`first`; `publish` still to be awaited
/// when that was pending). A write blocked midway waits for the unblock: lapin keeps its
/// frames and would write them then, so the event stays its session's until its verdict.
pub(crate) async fn written<T, F>(
    first: Poll<lapin::Result<T>>,
    publish: F,
    limit: Duration,
    flow: &watch::Receiver<Flow>,
) -> Result<T, Error>
where
    F: Future<Output = lapin::Result<T>> + Unpin,
{
    let output = match first {
        Poll::Ready(output) => Some(output),
        Poll::Pending => until_unless_blocked(publish, Instant::now() + limit, limit, flow).await,
    };
    match output {
        Some(Ok(confirm)) => Ok(confirm),
        Some(Err(err)) => Err(crate::connect::amqp_error(err)),
        None => Err(Error::timed_out("basic.publish", limit)),
    }
}

/// Follows the broker's `connection.blocked` / `connection.unblocked` for one connection:
/// updates `flow`, the relay's [`BrokerHealth`], and says so in the log. Ends with the
/// connection's events (or when aborted with its session); the mark uncounts itself then.
pub(crate) async fn follow_flow(
    events: impl futures_util::Stream<Item = lapin::Event> + Send + 'static,
    flow: watch::Sender<Flow>,
    mark: broker::BlockedMark,
) {
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let blocked = match event {
            lapin::Event::ConnectionBlocked(reason) => {
                tracing::warn!(
                    reason,
                    "the broker blocked a relay connection (resource alarm): nothing new is written to it; what was written waits for its confirms"
                );
                true
            }
            lapin::Event::ConnectionUnblocked => {
                tracing::info!("the broker unblocked a relay connection");
                false
            }
            _ => continue,
        };
        mark.set(blocked);
        flow.send_replace(Flow {
            blocked,
            since: Instant::now(),
        });
    }
}

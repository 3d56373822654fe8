//! What the relay's tests and benches share, once: the servers they run against, scratch
//! databases and topologies that are deleted when the test process exits (passed or failed),
//! waiting for a condition with a bound, events built in one line, free ports.
//!
//! A dev-dependency only: nothing here is compiled into the relay.
use std::time::{Duration, Instant};

use rabbit::Topology;
use sqlx::PgPool;
use store::{BranchId, BranchKey, EventKey, EventKind, Lsn, OutboxEvent, RunId, TenantId};

/// The broker the tests use (`AMQP_URL`, set in `.cargo/config.toml`).
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").expect("AMQP_URL (set in .cargo/config.toml)")
}

/// The NATS server the tests use (`NATS_URL`, set in `.cargo/config.toml`): the machine's,
/// with JetStream.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").expect("NATS_URL (set in .cargo/config.toml)")
}

/// A name no other test of any run uses; a topology so named is deleted at this process's exit
/// if its test does not delete it.
pub use rabbit::scratch::unique;

/// A topology of `partitions` named by [`unique`] (`relay-test-<label>_...`).
pub fn unique_topology(label: &str, partitions: u16) -> Topology {
    Topology::new(&unique(&format!("relay-test-{label}")), partitions)
        .expect("a unique name is a valid topology name")
}

/// Declares `topology` on the broker at `url` (what the relay declares when it connects), so
/// consumers can subscribe before any relay runs.
pub async fn declare_topology_at(url: &str, topology: &Topology) {
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("connect to the broker");
    let channel = connection.create_channel().await.expect("a channel");
    topology.declare(&channel).await.expect("declare");
    let _ = connection.close(200, "declared".into()).await;
}

/// Deletes `topology`'s exchange and queues (its default group's partitions, streams too, and
/// dead-letter queue) from the broker at `url`, with what they hold; what is gone already is
/// skipped (a refused delete closes its channel: the next one gets a new channel).
pub async fn delete_topology_at(url: &str, topology: &Topology) {
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("connect to the broker");
    let mut channel = connection.create_channel().await.expect("a channel");
    let queues = (0..topology.partitions())
        .map(|index| topology.queue(broker::Partition(index)))
        .chain([topology.dead_letter_queue()]);
    for queue in queues {
        let options = lapin::options::QueueDeleteOptions::default();
        if channel.queue_delete(queue, options).await.is_err() {
            channel = connection.create_channel().await.expect("a channel");
        }
    }
    let options = lapin::options::ExchangeDeleteOptions::default();
    let _ = channel
        .exchange_delete(topology.exchange().clone(), options)
        .await;
    let _ = connection.close(200, "deleted".into()).await;
}

/// What a task started by [`until_stopped`] awaits as its stop signal.
pub type Stopped = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A task that runs until told to stop (a consumer, say): [`Running::stop`] tells it and
/// returns what it returned; dropping it aborts the task.
#[derive(Debug)]
pub struct Running<T> {
    stop: tokio::sync::watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<T>>,
}

/// Spawns `run` with a stop signal it awaits: `until_stopped(|stopped| consumer.run(stopped))`.
pub fn until_stopped<F, Fut>(run: F) -> Running<Fut::Output>
where
    F: FnOnce(Stopped) -> Fut,
    Fut: std::future::Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let signal: Stopped = Box::pin(async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    });
    Running {
        stop,
        task: Some(tokio::spawn(run(signal))),
    }
}

impl<T> Running<T> {
    /// Tells the task to stop and waits for what it returns (a panic in it fails the test).
    pub async fn stop(mut self) -> T {
        let _ = self.stop.send(true);
        let task = self.task.take().expect("stopped once");
        task.await.expect("the task panicked")
    }

    /// Aborts the task (a process killed) without waiting for it to be gone.
    pub fn abort(&self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }

    /// Aborts the task (a process killed) and waits until it is gone.
    pub async fn kill(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl<T> Drop for Running<T> {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// A new, empty database on `DATABASE_URL`'s server, named after `label`: its pool and URL.
/// Dropped when the test process exits, whether its tests passed or failed (`store::scratch`).
pub async fn empty_database(label: &str) -> (PgPool, String) {
    store::scratch::scratch_database(label).await
}

/// [`empty_database`] with the relay's schema.
pub async fn migrated_database(label: &str) -> (PgPool, String) {
    let (pool, url) = empty_database(label).await;
    store::migrate(&pool).await.expect("migrate");
    (pool, url)
}

/// [`empty_database`] with the fold's schema only (`store::migrate_fold`): a consumer's own
/// database.
pub async fn fold_database(label: &str) -> (PgPool, String) {
    let (pool, url) = empty_database(label).await;
    store::migrate_fold(&pool).await.expect("migrate the fold");
    (pool, url)
}

/// Waits until `done` is true, checked every 10 ms; fails the test, naming `what`, after
/// `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, done: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    assert!(
        holds_within(limit, done).await,
        "timed out after {limit:?} waiting for {what}"
    );
}

/// Whether `done` comes true within `limit` (checked every 10 ms): for a test whose answer is
/// the wait's outcome, not a failure.
pub async fn holds_within<F, Fut>(limit: Duration, mut done: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if done().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A port nothing listens on now on 127.0.0.1 (the kernel's pick, released at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port on 127.0.0.1")
        .port()
}

/// `127.0.0.1:<a free port>`, for a listener of the relay's.
pub fn free_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// The branch `tenant` / `run` / `branch` (panics on a name the store refuses).
pub fn branch(tenant: &str, run: &str, branch: &str) -> BranchKey {
    BranchKey::new(
        TenantId::new(tenant).expect("a valid tenant id"),
        RunId::new(run).expect("a valid run id"),
        BranchId::new(branch).expect("a valid branch id"),
    )
}

/// An intent of `branch` at `lsn` as the relay drains it: after `lsn - 1`, base 0, no parent,
/// no metadata, the payload `<branch>@<lsn>`, written now. Change what a test needs with the
/// methods of [`Event`], then [`Event::build`] (or `.into()`).
pub fn intent(branch: &BranchKey, lsn: u64) -> Event {
    Event(OutboxEvent {
        key: EventKey {
            branch: branch.clone(),
            lsn: Lsn::new(lsn),
        },
        prev_lsn: Lsn::new(lsn.saturating_sub(1)),
        base_lsn: Lsn::ZERO,
        payload: format!("{branch}@{lsn}").into_bytes(),
        created_at: chrono::Utc::now(),
        kind: EventKind::Intent,
        parent: None,
        meta: Default::default(),
        epochs: Default::default(),
    })
}

/// Intents of `branch` at `lsns` (ascending), each after the one before it (the first after 0).
pub fn intents(branch: &BranchKey, lsns: &[u64]) -> Vec<OutboxEvent> {
    let mut prev = 0;
    lsns.iter()
        .map(|&lsn| {
            let event = intent(branch, lsn).prev(prev).build();
            prev = lsn;
            event
        })
        .collect()
}

/// An event being built ([`intent`]).
#[derive(Clone, Debug)]
pub struct Event(OutboxEvent);

impl Event {
    /// The Lsn it follows.
    pub fn prev(mut self, lsn: u64) -> Self {
        self.0.prev_lsn = Lsn::new(lsn);
        self
    }

    /// Its branch's base Lsn (where it forked from its parent).
    pub fn base(mut self, lsn: u64) -> Self {
        self.0.base_lsn = Lsn::new(lsn);
        self
    }

    /// Its payload.
    pub fn payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.0.payload = payload.into();
        self
    }

    /// The branch it forked from.
    pub fn parent(mut self, parent: &str) -> Self {
        self.0.parent = Some(BranchId::new(parent).expect("a valid branch id"));
        self
    }

    /// Its kind; a marker (anything but an intent) carries no payload.
    pub fn kind(mut self, kind: EventKind) -> Self {
        if kind != EventKind::Intent {
            self.0.payload = Vec::new();
        }
        self.0.kind = kind;
        self
    }

    /// The epoch it was written in, and its predecessor's (WIRE.md, "Epochs").
    pub fn epochs(mut self, epoch: u64, prev: Option<u64>) -> Self {
        self.0.epochs = store::Epochs {
            epoch: Some(store::Epoch::new(epoch)),
            prev: prev.map(store::Epoch::new),
        };
        self
    }

    /// The event.
    pub fn build(self) -> OutboxEvent {
        self.0
    }
}

impl From<Event> for OutboxEvent {
    fn from(event: Event) -> Self {
        event.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intents_chain_and_a_marker_carries_no_payload() {
        let key = branch("t", "r", "main");
        let chain = intents(&key, &[2, 5, 6]);
        let links: Vec<(u64, u64)> = chain
            .iter()
            .map(|event| (event.prev_lsn.get(), event.key.lsn.get()))
            .collect();
        assert_eq!(links, [(0, 2), (2, 5), (5, 6)]);
        assert_eq!(chain[1].payload, b"t/r/main@5");
        let marker = intent(&key, 7)
            .base(3)
            .parent("root")
            .kind(EventKind::Rewind {
                to: BranchId::new("fork").unwrap(),
            })
            .build();
        assert!(marker.payload.is_empty() && marker.is_rewind());
        assert_eq!((marker.prev_lsn.get(), marker.base_lsn.get()), (6, 3));
        assert_eq!(marker.parent, Some(BranchId::new("root").unwrap()));
    }
}

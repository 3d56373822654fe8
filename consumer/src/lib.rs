//! The consumer: folds deliveries into the user's own tables, exactly once, in order.
//!
//! [`Consumer`] serves every partition of a topology (or a chosen subset, to scale out over
//! several consumer processes), one task per partition. Each delivery is folded with
//! [`store::fold`] into the user's [`Projection`] inside one database transaction, committed
//! before the delivery is acked: a crash anywhere means a redelivery, which the fold turns into
//! a no-op. Exactly once at the fold, at least once in transport.
//!
//! Failures, by kind:
//! - broker or database gone: the partition reconnects with backoff (the delivery in hand is
//!   not acked, so it comes back);
//! - the projection fails with a transient error ([`Projection::is_permanent`] false): the same
//!   delivery is retried with backoff;
//! - a permanent projection error, a message that breaks the wire contract, or a
//!   [`store::Error::BrokenChain`]: the message goes to the dead-letter queue (`<topology>.dead`)
//!   with the reason in header `x-relay-dead-letter-reason`, and the partition keeps flowing.
//!   Later intents of that branch wait (parked) behind it: re-publish it to the exchange once
//!   the cause is fixed and the branch resumes in order.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Confirmation};
use sqlx::{PgConnection, PgPool};
use store::{EventTable, EventType, FoldError, FoldOutcome, FoldStore, OutboxEvent, Projection};
use tokio::sync::watch;
use tracing::Instrument;

use broker::{Backoff, Error, Partition, QueueType, RabbitConfig, RetryPolicy, open, within};

pub use broker::DEAD_LETTER_REASON;

/// What a consumer did (per partition, or summed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FoldStats {
    /// Intents applied (parked successors they released are counted too).
    pub applied: u64,
    /// Redeliveries of messages already folded, and abandoned intents (no-ops).
    pub duplicates: u64,
    /// Deliveries parked until their predecessor (or their parent's rewind) arrives.
    pub parked: u64,
    /// Messages dead-lettered (contract breaks, broken chains, permanent handler errors).
    pub rejected: u64,
    /// Rewind markers folded.
    pub rewinds: u64,
    /// End markers folded (runs complete) when delivered in order; one released from being
    /// held back is not counted here.
    pub ended: u64,
    /// Sessions lost (broker gone, channel failed) and opened again.
    pub reconnects: u64,
    /// Times a stream partition stopped at a gap: messages its stored offset pointed at were
    /// removed by the stream's retention before it read them (metric
    /// `relay_consumer_offset_lost_total`). Nothing past the gap is folded.
    pub gaps: u64,
    /// Times a silent stream partition was subscribed to again
    /// ([`ConsumerConfig::stream_resubscribe`]).
    pub resubscribes: u64,
}

impl FoldStats {
    fn add(&mut self, outcome: FoldOutcome) {
        match outcome {
            FoldOutcome::Applied { released } => self.applied += 1 + u64::from(released),
            FoldOutcome::Rewound { released } => {
                self.rewinds += 1;
                self.applied += u64::from(released);
            }
            FoldOutcome::Duplicate | FoldOutcome::Abandoned => self.duplicates += 1,
            FoldOutcome::Parked => self.parked += 1,
            FoldOutcome::Ended => self.ended += 1,
        }
    }

    /// The sum of two tallies.
    pub fn plus(self, other: FoldStats) -> FoldStats {
        FoldStats {
            applied: self.applied + other.applied,
            duplicates: self.duplicates + other.duplicates,
            parked: self.parked + other.parked,
            rejected: self.rejected + other.rejected,
            rewinds: self.rewinds + other.rewinds,
            ended: self.ended + other.ended,
            reconnects: self.reconnects + other.reconnects,
            gaps: self.gaps + other.gaps,
            resubscribes: self.resubscribes + other.resubscribes,
        }
    }
}

/// How a [`Consumer`] runs.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// The broker and topology.
    pub rabbit: RabbitConfig,
    /// Partitions to serve; `None` serves all of them. Give each consumer process its own
    /// subset to scale out (each queue also has single-active-consumer, so overlaps are safe).
    pub partitions: Option<Vec<Partition>>,
    /// Deliveries the broker may push ahead per partition. Default 256.
    pub prefetch: u16,
    /// Delays between reconnects and between retries of a failing delivery.
    pub retry: RetryPolicy,
    /// Longest one fold (begin, your projection, commit) may take before it is abandoned
    /// (rolled back, or committed unknown to us: the retry is then a no-op) and retried. A
    /// database connection lost mid-call without a reset would otherwise hold its partition
    /// until the kernel gives up on the socket (about 15 minutes). The fold's transaction also
    /// sets `idle_in_transaction_session_timeout` to it, so PostgreSQL ends a transaction whose
    /// client vanished and releases its locks. Default 60 s. Keep your projection's state in
    /// its transaction: a cancelled fold leaves nothing else behind.
    pub fold_timeout: Duration,
    /// Retire the fold's state of runs whose end marker was folded longer than
    /// `retention.keep` ago (`store::retire_folded_runs`), checked every quarter of it
    /// (between 100 ms and 60 s); a later delivery of such a run is dead-lettered as
    /// `retired`, never applied twice. Default `None`: the fold keeps every run's state.
    pub retention: Option<store::Retention>,
    /// Event types this consumer's projection is given; `None` (the default): every intent.
    /// Intents of other types, and untyped ones, are still folded (their branch's chain
    /// advances, so nothing waits behind them) but not handed to [`Projection::apply`];
    /// rewinds and run ends are always handed over. For a consumer group that reads a subset.
    pub event_types: Option<BTreeSet<EventType>>,
    /// Where a stream partition (`QueueType::Stream`) is first read when the fold's database
    /// holds no offset for it (a new group, or one just reset). Default
    /// [`StreamStart::First`]: the whole retained history is replayed. Once an offset is
    /// stored the consumer always resumes there. Ignored for classic and quorum queues.
    pub stream_start: StreamStart,
    /// A stream partition that delivers nothing for this long is subscribed to again, on a
    /// fresh channel, at the offset the consumer expects (metric
    /// `relay_consumer_stream_resubscribes_total{queue}`). RabbitMQ's stream replicas before
    /// osiris 1.8.5 (rabbitmq-server#12785, RabbitMQ 4.0.x) can fail to tell a consumer of
    /// committed messages while another reader of the same replica waits for a later offset
    /// (osiris#172): the consumer then hears of them only when more is written, never if
    /// writing stops. A new subscription reads what is committed at once. Default 5 s; the
    /// cost on an idle partition is one channel opened and one closed per period. Ignored for
    /// classic and quorum queues.
    pub stream_resubscribe: Duration,
}

/// Where a consumer group with no stored offset starts reading a stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamStart {
    /// The first retained message: replay the history the stream keeps.
    #[default]
    First,
    /// The next message published: only what comes after the consumer attaches.
    Next,
    /// The first message published at or after this time (RabbitMQ's resolution: a chunk,
    /// so a few earlier messages may come too; the fold absorbs them).
    At(std::time::SystemTime),
}

impl StreamStart {
    /// `basic.consume`'s `x-stream-offset` argument for this start.
    fn argument(self) -> AMQPValue {
        match self {
            StreamStart::First => AMQPValue::LongString("first".into()),
            StreamStart::Next => AMQPValue::LongString("next".into()),
            StreamStart::At(at) => AMQPValue::Timestamp(
                at.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |since| since.as_secs()),
            ),
        }
    }
}

/// What a stream consumer does with a delivery at `offset` when it expects `expected` next
/// (pure). RabbitMQ's stream offsets are not dense: every segment after the first begins with
/// a tracking chunk that takes one offset and is never delivered (seen on 3.10). So one offset
/// missing is a segment boundary, and two or more are messages the stream's retention removed
/// before this consumer read them: the first retained segment begins with a tracking chunk,
/// so a removed message is always followed by a gap of at least two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StreamStep {
    /// Already folded (the broker started before the stored offset): ack it, nothing else.
    Skip,
    /// The next message: fold it and store `offset + 1` with the fold.
    Fold,
    /// Messages were lost to retention: stop and say so.
    Lost,
}

fn stream_step(expected: Option<u64>, offset: u64) -> StreamStep {
    match expected {
        None => StreamStep::Fold,
        Some(expected) if offset < expected => StreamStep::Skip,
        Some(expected) if offset <= expected + 1 => StreamStep::Fold,
        Some(_) => StreamStep::Lost,
    }
}

/// Where a stream subscription starts (`x-stream-offset`), for a consumer that expects
/// `expected` next (pure): there, once anything is stored or folded; else at `start`. On a
/// subscription made again (`again`) by a consumer that has nothing yet and started at
/// [`StreamStart::Next`], `None`: keep the first subscription, since `next` asked again would
/// skip what the first one was not told of.
fn subscribe_at(expected: Option<u64>, start: StreamStart, again: bool) -> Option<AMQPValue> {
    match expected {
        Some(next) => Some(AMQPValue::LongLongInt(
            i64::try_from(next).unwrap_or(i64::MAX),
        )),
        None if again && start == StreamStart::Next => None,
        None => Some(start.argument()),
    }
}

/// The offset RabbitMQ gives a stream delivery (header `x-stream-offset`).
fn delivery_offset(delivery: &Delivery) -> Option<u64> {
    let headers = delivery.properties.headers().as_ref()?;
    match headers.inner().get("x-stream-offset")? {
        AMQPValue::LongLongInt(offset) => u64::try_from(*offset).ok(),
        AMQPValue::LongUInt(offset) => Some(u64::from(*offset)),
        AMQPValue::LongInt(offset) => u64::try_from(*offset).ok(),
        _ => None,
    }
}

impl ConsumerConfig {
    /// Every partition of `rabbit`'s topology, default prefetch and retry delays.
    pub fn new(rabbit: RabbitConfig) -> Self {
        Self {
            rabbit,
            partitions: None,
            prefetch: 256,
            retry: RetryPolicy::default(),
            fold_timeout: Duration::from_secs(60),
            retention: None,
            event_types: None,
            stream_start: StreamStart::default(),
            stream_resubscribe: Duration::from_secs(5),
        }
    }

    fn partitions(&self) -> Vec<Partition> {
        self.partitions.clone().unwrap_or_else(|| {
            (0..self.rabbit.topology.partitions())
                .map(Partition)
                .collect()
        })
    }
}

/// Folds the relay's messages into a user's [`Projection`], exactly once, in order.
///
/// ```no_run
/// # async fn example(pool: sqlx::PgPool, rabbit: broker::RabbitConfig) -> Result<(), broker::Error> {
/// use consumer::{Consumer, ConsumerConfig};
///
/// // `EventTable` keeps every event; implement `store::Projection` to write your own tables.
/// let consumer = Consumer::new(ConsumerConfig::new(rabbit), pool, store::EventTable);
/// let (stop, stopped) = tokio::sync::watch::channel(false);
/// let running = tokio::spawn(consumer.run(async move {
///     let mut stopped = stopped;
///     let _ = stopped.wait_for(|stop| *stop).await;
/// }));
/// // ... later: stop gracefully (the delivery in hand finishes first).
/// stop.send(true).ok();
/// let totals = running.await.expect("consumer task")?;
/// println!("applied {}", totals.applied);
/// # Ok(()) }
/// ```
pub struct Consumer<P> {
    config: ConsumerConfig,
    pool: PgPool,
    projection: P,
    progress: Arc<Mutex<Vec<FoldStats>>>,
    observer: Option<Observer>,
}

/// Called with a partition's running totals after each of its deliveries.
type Observer = Arc<dyn Fn(Partition, FoldStats) + Send + Sync>;

impl<P> std::fmt::Debug for Consumer<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<P> Consumer<P>
where
    P: Projection + Clone + Sync + 'static,
{
    /// A consumer folding into `projection` on `pool` (migrated with `store::migrate_fold`
    /// or `store::migrate`).
    pub fn new(config: ConsumerConfig, pool: PgPool, projection: P) -> Self {
        let partitions = config.partitions().len();
        Self {
            config,
            pool,
            projection,
            progress: Arc::new(Mutex::new(vec![FoldStats::default(); partitions])),
            observer: None,
        }
    }

    /// Calls `observer` with a partition's running totals after each of its deliveries
    /// (progress reports, tests). It runs on the partition's task: keep it quick.
    pub fn with_observer(
        mut self,
        observer: impl Fn(Partition, FoldStats) + Send + Sync + 'static,
    ) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// The running totals of every partition served, summed.
    pub fn totals(&self) -> FoldStats {
        totals(&self.progress)
    }

    /// A handle on the running totals (readable while `run` runs).
    pub fn progress(&self) -> ConsumerProgress {
        ConsumerProgress(self.progress.clone())
    }

    /// Serves the partitions until `stop` completes; each delivery in hand is finished first.
    /// Never returns early on a broker or database failure: it reconnects with backoff.
    pub async fn run(
        self,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> Result<FoldStats, Error> {
        let (stop_tx, stop_rx) = watch::channel(false);
        // Dropping `run` (a killed consumer) aborts every partition task with it: their
        // connections close and the broker redelivers whatever they had not acked.
        let mut tasks = tokio::task::JoinSet::new();
        for (index, partition) in self.config.partitions().into_iter().enumerate() {
            let serve = Serve {
                config: self.config.clone(),
                pool: self.pool.clone(),
                projection: self.projection.clone(),
                partition,
                progress: self.progress.clone(),
                index,
                observer: self.observer.clone(),
                stream: None,
            };
            tasks.spawn(serve.run(stop_rx.clone()));
        }
        if let Some(retention) = self.config.retention {
            tasks.spawn(retire_loop(self.pool.clone(), retention, stop_rx.clone()));
        }
        tasks.spawn(dead_letter_depth(
            self.config.rabbit.clone(),
            stop_rx.clone(),
        ));
        stop.await;
        let _ = stop_tx.send(true);
        while tasks.join_next().await.is_some() {}
        Ok(totals(&self.progress))
    }
}

/// Retires completed runs' fold state every quarter of the retention until `stop`; a failure
/// is logged and tried again at the next tick.
async fn retire_loop(pool: PgPool, retention: store::Retention, mut stop: watch::Receiver<bool>) {
    let mut ticks = tokio::time::interval(retention.every());
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        match store::retire_folded_runs(&pool, retention).await {
            Ok(runs) => metrics::counter!("relay_fold_runs_retired_total").increment(runs),
            Err(err) => {
                tracing::warn!(error = %err, "retiring completed runs' fold state failed; trying again later")
            }
        }
    }
}

/// How often the dead-letter depth gauge is read.
const DEAD_DEPTH_EVERY: Duration = Duration::from_secs(10);

/// Sets `relay_dead_letters{queue}` to the dead-letter queue's depth every 10 s until `stop`
/// (on a connection of its own, opened again after a failure).
async fn dead_letter_depth(rabbit: broker::RabbitConfig, mut stop: watch::Receiver<bool>) {
    let queue = rabbit.topology.dead_letter_queue().to_string();
    let mut ticks = tokio::time::interval(DEAD_DEPTH_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut session: Option<broker::DeadLetters> = None;
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
        if session.is_none() {
            session = broker::DeadLetters::open(&rabbit).await.ok();
        }
        let Some(dead) = &session else { continue };
        match dead.depth().await {
            Ok(depth) => {
                metrics::gauge!("relay_dead_letters", "queue" => queue.clone())
                    .set(f64::from(depth));
            }
            Err(_) => session = None,
        }
    }
}

/// Running totals of a [`Consumer`], readable from elsewhere. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ConsumerProgress(Arc<Mutex<Vec<FoldStats>>>);

impl ConsumerProgress {
    /// The totals so far.
    pub fn totals(&self) -> FoldStats {
        totals(&self.0)
    }

    /// Each partition's totals, in the order of [`ConsumerConfig::partitions`].
    pub fn partitions(&self) -> Vec<FoldStats> {
        self.0
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }
}

fn totals(progress: &Mutex<Vec<FoldStats>>) -> FoldStats {
    progress
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .iter()
        .fold(FoldStats::default(), |sum, stats| sum.plus(*stats))
}

/// What to do with a delivery after trying to fold it.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Folded(FoldOutcome),
    DeadLetter(String),
    Retry(String),
}

/// One partition's loop.
struct Serve<P> {
    config: ConsumerConfig,
    pool: PgPool,
    projection: P,
    partition: Partition,
    progress: Arc<Mutex<Vec<FoldStats>>>,
    index: usize,
    observer: Option<Observer>,
    /// On a stream: the queue and the offset expected next (`None`: nothing stored yet).
    stream: Option<StreamCursor>,
}

/// Where a stream consumer is: its queue (the key of its stored offset) and the offset it
/// expects next, the same as the one stored in the fold's database.
struct StreamCursor {
    queue: String,
    expected: Option<u64>,
}

struct Session {
    connection: broker::ClosingConnection,
    channel: Channel,
    /// A confirming channel for dead letters: a message is acked only once its dead letter is
    /// confirmed.
    dead: Channel,
}

impl<P> Serve<P>
where
    P: Projection + Clone + Sync + 'static,
{
    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(self.config.retry);
        let partition = self.partition.0;
        while !*stop.borrow() {
            match self.session(&mut stop, &mut backoff).await {
                Ok(()) => return,
                Err(err) => {
                    self.record(|stats| stats.reconnects += 1);
                    let delay = backoff.next_delay();
                    if matches!(err, Error::OffsetLost { .. }) {
                        // Never skipped silently: said on every attempt until an operator acts.
                        tracing::error!(partition, error = %err, retry_in_ms = delay.as_millis() as u64, "stream consumer stopped at a gap");
                    } else if backoff.failures().is_power_of_two() {
                        tracing::warn!(partition, error = %err, retry_in_ms = delay.as_millis() as u64, "consumer session failed; reconnecting");
                    }
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = stop.wait_for(|stop| *stop) => return,
                    }
                }
            }
        }
    }

    async fn open(&self) -> Result<Session, Error> {
        let rabbit = &self.config.rabbit;
        let limit = rabbit.connect_timeout;
        let (connection, channel) = open(rabbit, "outbox-consumer").await?;
        within(
            "basic.qos",
            limit,
            channel.basic_qos(self.config.prefetch, BasicQosOptions::default()),
        )
        .await?;
        let dead = within("channel.open", limit, connection.create_channel()).await?;
        within(
            "confirm.select",
            limit,
            dead.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(Session {
            connection,
            channel,
            dead,
        })
    }

    /// `basic.consume` on `session`'s channel; on a stream, at the offset expected next (or
    /// the group's start). `again` is a subscription made again after a silence: it replaces
    /// the channel with a fresh one (whose prefetch is free; the old one's unacked deliveries
    /// are read again from the expected offset) and returns `None` when it must not be made
    /// (see [`subscribe_at`]).
    async fn subscribe(
        &self,
        session: &mut Session,
        again: bool,
    ) -> Result<Option<lapin::Consumer>, Error> {
        let rabbit = &self.config.rabbit;
        let limit = rabbit.connect_timeout;
        let queue = rabbit.topology.queue(self.partition);
        let mut arguments = FieldTable::default();
        if let Some(cursor) = &self.stream {
            let Some(at) = subscribe_at(cursor.expected, self.config.stream_start, again) else {
                return Ok(None);
            };
            arguments.insert("x-stream-offset".into(), at);
        }
        if again {
            let fresh = within("channel.open", limit, session.connection.create_channel()).await?;
            within(
                "basic.qos",
                limit,
                fresh.basic_qos(self.config.prefetch, BasicQosOptions::default()),
            )
            .await?;
            let old = std::mem::replace(&mut session.channel, fresh);
            within(
                "channel.close",
                limit,
                old.close(200, "subscribing again".into()),
            )
            .await?;
        }
        let deliveries = within(
            "basic.consume",
            limit,
            session.channel.basic_consume(
                queue,
                "".into(),
                BasicConsumeOptions::default(),
                arguments,
            ),
        )
        .await?;
        Ok(Some(deliveries))
    }

    /// One connection's life: consume until stopped (`Ok`) or a failure (`Err`, reconnect).
    async fn session(
        &mut self,
        stop: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
    ) -> Result<(), Error> {
        let mut session = self.open().await?;
        let rabbit = &self.config.rabbit;
        let queue = rabbit.topology.queue(self.partition);
        let on_stream = rabbit.topology.queue_type() == QueueType::Stream;
        if on_stream {
            // Resume exactly after what the fold committed: the offset is stored with it.
            let stored = {
                let mut conn = self.pool.acquire().await.map_err(store::Error::from)?;
                store::stream_offset(&mut conn, queue.as_str()).await?
            };
            self.stream = Some(StreamCursor {
                queue: queue.to_string(),
                expected: stored,
            });
        }
        let mut deliveries = self
            .subscribe(&mut session, false)
            .await?
            .expect("a first subscription is always made");
        let silence = self.config.stream_resubscribe;
        let quiet = tokio::time::sleep(silence);
        tokio::pin!(quiet);
        loop {
            let heard = tokio::select! {
                _ = stop.wait_for(|stop| *stop) => return Ok(()),
                () = &mut quiet, if on_stream => None,
                next = deliveries.next() => Some(next),
            };
            let delivery = match heard {
                None => {
                    // Heard nothing for a while: ask again, in case the broker did not tell
                    // this subscription of what it holds (see `stream_resubscribe`).
                    if let Some(fresh) = self.subscribe(&mut session, true).await? {
                        deliveries = fresh;
                        self.record(|stats| stats.resubscribes += 1);
                        metrics::counter!("relay_consumer_stream_resubscribes_total", "queue" => queue.to_string())
                            .increment(1);
                        tracing::debug!(
                            partition = self.partition.0,
                            "stream partition silent; subscribed again"
                        );
                    }
                    quiet.as_mut().reset(tokio::time::Instant::now() + silence);
                    continue;
                }
                Some(Some(delivery)) => delivery?,
                Some(None) => {
                    return Err(Error::Unreachable(
                        "the broker cancelled the consumer".into(),
                    ));
                }
            };
            if on_stream {
                quiet.as_mut().reset(tokio::time::Instant::now() + silence);
            }
            backoff.reset();
            let offset = match &self.stream {
                None => None,
                Some(cursor) => {
                    let Some(offset) = delivery_offset(&delivery) else {
                        return Err(Error::Refused(format!(
                            "stream {} delivered a message without x-stream-offset",
                            cursor.queue
                        )));
                    };
                    match stream_step(cursor.expected, offset) {
                        StreamStep::Fold => Some(offset),
                        StreamStep::Skip => {
                            let limit = self.config.rabbit.connect_timeout;
                            within("basic.ack", limit, delivery.ack(BasicAckOptions::default()))
                                .await?;
                            continue;
                        }
                        StreamStep::Lost => {
                            let (queue, expected) =
                                (cursor.queue.clone(), cursor.expected.unwrap_or(0));
                            metrics::counter!("relay_consumer_offset_lost_total", "queue" => queue.clone())
                                .increment(1);
                            self.record(|stats| stats.gaps += 1);
                            return Err(Error::OffsetLost {
                                queue,
                                expected,
                                first: offset,
                            });
                        }
                    }
                }
            };
            self.handle(&session, delivery, offset, stop).await?;
        }
    }

    /// Folds one delivery, retrying transient failures with backoff; then acks it, or
    /// dead-letters it and acks it. A broker failure returns (the delivery comes back).
    async fn handle(
        &mut self,
        session: &Session,
        delivery: Delivery,
        offset: Option<u64>,
        stop: &watch::Receiver<bool>,
    ) -> Result<(), Error> {
        let limit = self.config.rabbit.connect_timeout;
        let partition = self.partition.0;
        let mut retry = Backoff::new(self.config.retry);
        let verdict = match broker::decode(&delivery.properties, &delivery.data) {
            Err(err) => Verdict::DeadLetter(format!("contract: {err}")),
            Ok(event) => loop {
                let span = fold_span(&event);
                match self.fold(&event, offset).instrument(span).await {
                    Verdict::Retry(why) => {
                        let delay = retry.next_delay();
                        if retry.failures().is_power_of_two() {
                            tracing::warn!(partition, event = %event.key, failures = retry.failures(), reason = %why, "fold failed; retrying the delivery");
                        }
                        metrics::counter!("relay_consumer_retries_total").increment(1);
                        if *stop.borrow() {
                            // Not acked: redelivered to whoever consumes next.
                            return Ok(());
                        }
                        tokio::time::sleep(delay).await;
                    }
                    verdict => break verdict,
                }
            },
        };
        match verdict {
            Verdict::Folded(outcome) => {
                self.record(|stats| stats.add(outcome));
            }
            Verdict::DeadLetter(reason) => {
                // Logged without the body: a payload never reaches a log line.
                tracing::error!(partition, reason = %reason, bytes = delivery.data.len(), "dead-lettering a message");
                let label = reason.split(':').next().unwrap_or("other").to_owned();
                self.dead_letter(session, &delivery, &reason).await?;
                if let Some(offset) = offset {
                    self.save_offset_alone(offset).await?;
                }
                metrics::counter!("relay_consumer_dead_letters_total", "reason" => label)
                    .increment(1);
                self.record(|stats| stats.rejected += 1);
            }
            Verdict::Retry(_) => unreachable!("retries loop above"),
        }
        // Invariant: acked only after the fold committed (or the dead letter was confirmed).
        within("basic.ack", limit, delivery.ack(BasicAckOptions::default())).await?;
        if let (Some(cursor), Some(offset)) = (&mut self.stream, offset) {
            cursor.expected = Some(offset + 1);
        }
        Ok(())
    }

    /// Stores a stream offset past a dead-lettered message (its dead letter is confirmed), in
    /// a transaction of its own; a failure ends the session, and the message is dead-lettered
    /// again after the reconnect (a duplicate in the dead-letter queue, never a loss).
    async fn save_offset_alone(&self, offset: u64) -> Result<(), Error> {
        let Some(cursor) = &self.stream else {
            return Ok(());
        };
        let mut conn = self.pool.acquire().await.map_err(store::Error::from)?;
        store::save_stream_offset(&mut conn, &cursor.queue, offset + 1).await?;
        Ok(())
    }

    fn record(&self, change: impl FnOnce(&mut FoldStats)) {
        let stats = {
            let mut progress = self
                .progress
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            change(&mut progress[self.index]);
            progress[self.index]
        };
        if let Some(observer) = &self.observer {
            observer(self.partition, stats);
        }
    }

    async fn fold(&mut self, event: &OutboxEvent, offset: Option<u64>) -> Verdict {
        let limit = self.config.fold_timeout;
        tokio::time::timeout(limit, self.fold_once(event, offset))
            .await
            .unwrap_or_else(|_| Verdict::Retry(format!("database: no answer within {limit:?}")))
    }

    async fn fold_once(&mut self, event: &OutboxEvent, offset: Option<u64>) -> Verdict {
        // Should this connection vanish mid-fold (a network losing it without a reset),
        // PostgreSQL ends the orphaned transaction after the same limit and releases the
        // branch's cursor lock; else every retry would wait on that lock until the server
        // noticed the dead client (hours, with default TCP keepalives).
        let idle_ms = self.config.fold_timeout.as_millis().max(1);
        let begin = format!("BEGIN; SET LOCAL idle_in_transaction_session_timeout = {idle_ms}");
        let mut tx = match self.pool.begin_with(sqlx::AssertSqlSafe(begin)).await {
            Ok(tx) => tx,
            Err(err) => return Verdict::Retry(format!("database: {err}")),
        };
        let mut projection = Subscribed {
            inner: &mut self.projection,
            types: self.config.event_types.as_ref(),
        };
        let folded = store::fold(&mut tx, event, &mut projection).await;
        match verdict(folded, P::is_permanent) {
            Verdict::Folded(outcome) => {
                // On a stream, where to resume is part of what this transaction commits.
                if let (Some(cursor), Some(offset)) = (&self.stream, offset)
                    && let Err(err) =
                        store::save_stream_offset(&mut tx, &cursor.queue, offset + 1).await
                {
                    return Verdict::Retry(format!("database: {err}"));
                }
                match tx.commit().await {
                    Ok(()) => Verdict::Folded(outcome),
                    Err(err) => Verdict::Retry(format!("commit: {err}")),
                }
            }
            refused => refused,
        }
    }

    async fn dead_letter(
        &self,
        session: &Session,
        delivery: &Delivery,
        reason: &str,
    ) -> Result<(), Error> {
        let rabbit = &self.config.rabbit;
        // The broker's own delivery headers do not belong to the message.
        let mut headers: FieldTable = delivery
            .properties
            .headers()
            .as_ref()
            .map(|headers| {
                headers
                    .inner()
                    .iter()
                    .filter(|(name, _)| !broker::BROKER_HEADERS.contains(&name.as_str()))
                    .map(|(name, value)| (name.clone(), value.clone()))
                    .collect::<std::collections::BTreeMap<_, _>>()
                    .into()
            })
            .unwrap_or_default();
        headers.insert(
            DEAD_LETTER_REASON.into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        let properties = delivery.properties.clone().with_headers(headers);
        let confirm = within(
            "basic.publish",
            rabbit.connect_timeout,
            session.dead.basic_publish(
                "".into(),
                rabbit.topology.dead_letter_queue(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                properties,
            ),
        )
        .await?;
        match within("dead-letter confirm", rabbit.confirm_timeout, confirm).await? {
            Confirmation::Ack(None) => Ok(()),
            other => Err(Error::Unreachable(format!(
                "the dead-letter queue did not take the message: {other:?}"
            ))),
        }
    }
}

/// What a fold's result means for its delivery (pure): folded (commit it, then ack the
/// delivery); dead-letter it (the chain is broken, the store refuses it for good, or the
/// handler says it will never succeed: the branch waits behind it); or retry it with backoff
/// (anything that may pass later). The reason's first word labels the dead-letter metric.
fn verdict<E: std::fmt::Display>(
    folded: Result<FoldOutcome, FoldError<E>>,
    is_permanent: impl Fn(&E) -> bool,
) -> Verdict {
    match folded {
        Ok(outcome) => Verdict::Folded(outcome),
        Err(FoldError::Store(err @ store::Error::BrokenChain { .. })) => {
            Verdict::DeadLetter(format!("broken_chain: {err}"))
        }
        Err(FoldError::Store(err @ store::Error::RetiredRun { .. })) => {
            Verdict::DeadLetter(format!("retired: {err}"))
        }
        Err(FoldError::Store(err)) if err.is_transient() => {
            Verdict::Retry(format!("database: {err}"))
        }
        Err(FoldError::Store(err)) => Verdict::DeadLetter(format!("contract: {err}")),
        Err(FoldError::Projection(err)) if is_permanent(&err) => {
            Verdict::DeadLetter(format!("handler: {err}"))
        }
        Err(FoldError::Projection(err)) => Verdict::Retry(format!("handler: {err}")),
    }
}

/// The span of one delivery's fold, `relay.fold`: a child (feature `otel`) of the trace the
/// event carries, so one trace shows the host's write, the relay's publish and this fold.
fn fold_span(event: &OutboxEvent) -> tracing::Span {
    let key = &event.key.branch;
    let span = tracing::info_span!(
        "relay.fold",
        tenant = key.tenant.as_str(),
        run = key.run.as_str(),
        branch = key.branch.as_str(),
        lsn = event.key.lsn.get(),
        event_type = event.meta.event_type.as_ref().map(EventType::as_str),
    );
    #[cfg(feature = "otel")]
    if let Some(parent) = store::remote_context(&event.meta) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let _ = span.set_parent(parent);
    }
    span
}

/// The user's projection, given only the subscribed event types' intents
/// ([`ConsumerConfig::event_types`]); the fold's bookkeeping sees every delivery.
struct Subscribed<'a, P> {
    inner: &'a mut P,
    types: Option<&'a BTreeSet<EventType>>,
}

impl<P: Projection> Projection for Subscribed<'_, P> {
    type Error = P::Error;

    async fn apply(&mut self, tx: &mut PgConnection, event: &OutboxEvent) -> Result<(), P::Error> {
        let wanted = match (self.types, &event.meta.event_type) {
            (None, _) => true,
            (Some(types), Some(event_type)) => types.contains(event_type),
            (Some(_), None) => false,
        };
        if !wanted {
            metrics::counter!("relay_consumer_skipped_total").increment(1);
            return Ok(());
        }
        self.inner.apply(tx, event).await
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &store::RewindNotice,
    ) -> Result<(), P::Error> {
        self.inner.rewind(tx, rewind).await
    }

    async fn end(&mut self, tx: &mut PgConnection, end: &OutboxEvent) -> Result<(), P::Error> {
        self.inner.end(tx, end).await
    }

    fn is_permanent(error: &P::Error) -> bool {
        P::is_permanent(error)
    }
}

/// Consumes partitions into a [`FoldStore`] (the project's own [`EventTable`] projection):
/// the demonstration fold the tests and the demo use. See [`Consumer`] for your own tables.
#[derive(Clone, Debug)]
pub struct FoldConsumer {
    config: RabbitConfig,
    /// Unacked deliveries the broker may push at once. Default 256.
    prefetch: u16,
}

impl FoldConsumer {
    /// A consumer of the topology in `config`.
    pub fn new(config: RabbitConfig) -> Self {
        Self {
            config,
            prefetch: 256,
        }
    }

    /// Consumes `partition` into `fold` until `stop` completes, reconnecting with backoff.
    /// `progress` sees the running totals after every delivery (for progress reports and tests).
    pub async fn run(
        &self,
        partition: Partition,
        fold: &FoldStore,
        stop: impl Future<Output = ()> + Send + 'static,
        progress: impl FnMut(FoldStats) + Send + 'static,
    ) -> Result<FoldStats, Error> {
        let mut config = ConsumerConfig::new(self.config.clone());
        config.partitions = Some(vec![partition]);
        config.prefetch = self.prefetch;
        config.retry = RetryPolicy {
            min: Duration::from_millis(20),
            max: Duration::from_millis(500),
        };
        let progress = Mutex::new(progress);
        let consumer = Consumer::new(config, fold.pool().clone(), EventTable).with_observer(
            move |_, stats| {
                let mut progress = progress.lock().unwrap_or_else(|poison| poison.into_inner());
                progress(stats);
            },
        );
        consumer.run(stop).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use store::{BranchId, BranchKey, Lsn, RunId, TenantId};

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("handler says {0}")]
    struct Handler(&'static str);

    fn permanent(err: &Handler) -> bool {
        err.0 == "never"
    }

    fn store_error(err: store::Error) -> Result<FoldOutcome, FoldError<Handler>> {
        Err(FoldError::Store(err))
    }

    fn label(verdict: &Verdict) -> (&'static str, String) {
        match verdict {
            Verdict::Folded(_) => ("folded", String::new()),
            Verdict::DeadLetter(reason) => ("dead_letter", reason.clone()),
            Verdict::Retry(reason) => ("retry", reason.clone()),
        }
    }

    /// Each fold result maps to exactly one fate: what folded is committed and acked; a broken
    /// chain, a refusal by the store and a handler's permanent error are dead-lettered (the
    /// branch waits behind them), with the reason's first word as the metric's label; every
    /// transient error (a database that did not answer, a handler that may pass later) is
    /// retried, never dead-lettered.
    #[test]
    fn every_fold_result_maps_to_one_fate() {
        let outcome = FoldOutcome::Applied { released: 2 };
        assert_eq!(verdict(Ok(outcome), permanent), Verdict::Folded(outcome));
        let broken = store_error(store::Error::BrokenChain {
            branch: BranchKey::new(
                TenantId::new("t").unwrap(),
                RunId::new("r").unwrap(),
                BranchId::new("b").unwrap(),
            ),
            lsn: Lsn::new(5),
            prev: Lsn::new(1),
            applied: Lsn::new(3),
        });
        let (fate, reason) = label(&verdict(broken, permanent));
        assert_eq!(fate, "dead_letter");
        assert!(reason.starts_with("broken_chain: "), "{reason}");
        let silent = store_error(store::Error::NoAnswer {
            after: Duration::from_secs(1),
        });
        let (fate, reason) = label(&verdict(silent, permanent));
        assert_eq!(fate, "retry");
        assert!(reason.starts_with("database: "), "{reason}");
        let refused = store_error(store::Error::LsnOutOfRange { lsn: u64::MAX });
        let (fate, reason) = label(&verdict(refused, permanent));
        assert_eq!(fate, "dead_letter");
        assert!(reason.starts_with("contract: "), "{reason}");
        let never: Result<FoldOutcome, FoldError<Handler>> =
            Err(FoldError::Projection(Handler("never")));
        assert_eq!(
            verdict(never, permanent),
            Verdict::DeadLetter("handler: handler says never".into())
        );
        let later: Result<FoldOutcome, FoldError<Handler>> =
            Err(FoldError::Projection(Handler("later")));
        assert_eq!(
            verdict(later, permanent),
            Verdict::Retry("handler: handler says later".into())
        );
    }

    /// A stream consumer folds the message it expects and the one after it (a segment's
    /// tracking chunk takes one offset), skips what it already folded, and stops at a gap of
    /// two or more (retention removed messages it never read). With nothing stored, whatever
    /// comes first is folded.
    #[test]
    fn a_stream_gap_of_two_or_more_is_a_loss_never_skipped() {
        assert_eq!(stream_step(None, 0), StreamStep::Fold);
        assert_eq!(stream_step(None, 1_850), StreamStep::Fold);
        assert_eq!(stream_step(Some(10), 10), StreamStep::Fold);
        assert_eq!(stream_step(Some(77), 78), StreamStep::Fold);
        assert_eq!(stream_step(Some(10), 9), StreamStep::Skip);
        assert_eq!(stream_step(Some(10), 0), StreamStep::Skip);
        assert_eq!(stream_step(Some(10), 12), StreamStep::Lost);
        assert_eq!(stream_step(Some(0), 1_850), StreamStep::Lost);
        assert_eq!(
            StreamStart::At(std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000)).argument(),
            AMQPValue::Timestamp(1_700_000_000)
        );
        assert_eq!(
            StreamStart::default().argument(),
            AMQPValue::LongString("first".into())
        );
    }

    /// A subscription, first or made again after a silence, starts at the offset expected
    /// next once there is one; before that at the group's start, except that `next` is never
    /// asked twice (it would skip what the first subscription was not told of).
    #[test]
    fn a_subscription_made_again_starts_where_the_fold_expects() {
        let at = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        for start in [StreamStart::First, StreamStart::Next, StreamStart::At(at)] {
            for again in [false, true] {
                assert_eq!(
                    subscribe_at(Some(42), start, again),
                    Some(AMQPValue::LongLongInt(42))
                );
            }
            assert_eq!(subscribe_at(None, start, false), Some(start.argument()));
        }
        assert_eq!(
            subscribe_at(None, StreamStart::First, true),
            Some(AMQPValue::LongString("first".into()))
        );
        assert_eq!(
            subscribe_at(None, StreamStart::At(at), true),
            Some(AMQPValue::Timestamp(1_700_000_000))
        );
        assert_eq!(subscribe_at(None, StreamStart::Next, true), None);
    }
}

//! One NATS partition's loop: take the partition's lock (or stand by), read from the position
//! the fold stored, fold each batch in its transaction with the position past it, dead-letter
//! what is refused, reconnect.
//!
//! One reader per partition and group: the lock is a PostgreSQL session advisory lock, taken on
//! the connection every fold of the session runs on (held out of the pool). Whatever ends the
//! session (the process stopped or killed, the connection broken, the server restarted) ends the
//! lock with it, and a fold can only commit on the connection that holds it: two processes of a
//! group never fold one partition at once. A vanished process's session is ended by the server
//! within about 11 s (the connection's TCP keepalives, 5 s idle then 3 probes 2 s apart, and
//! its `tcp_user_timeout` of 11 s for data left unacknowledged). A batch that fails ends the
//! session too (the connection goes, with the lock): the next one reads again from the stored
//! position, on a fresh connection.
use futures_util::FutureExt;
use sqlx::{Acquire, PgPool};
use store::Projection;
use tokio::sync::watch;

use broker::{Backoff, Error, Partition};
use nats::{Delivery, ReadFrom};

use crate::config::NatsConsumerConfig;
use crate::settle::{Db, Folder, Incoming, Transport};

/// One NATS partition's loop.
pub(crate) struct NatsServe<P> {
    pub(crate) config: NatsConsumerConfig,
    pub(crate) pool: PgPool,
    pub(crate) partition: Partition,
    pub(crate) folder: Folder<P>,
}

impl<P> NatsServe<P>
where
    P: Projection + Clone + Sync + 'static,
{
    pub(crate) async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(self.config.retry);
        while !*stop.borrow() {
            let ended = self.session(&mut stop, &mut backoff).await;
            // The lock goes with the connection.
            self.folder.db = Db::None;
            match ended {
                Ok(()) => return,
                Err(err) => {
                    if !self
                        .folder
                        .after_failure(&err, &mut backoff, &mut stop)
                        .await
                    {
                        return;
                    }
                }
            }
        }
    }

    /// Holds the partition's lock on a connection of its own, or waits for it until `stop`
    /// (`None`).
    async fn lock(
        &mut self,
        key: &str,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Option<sqlx::PgConnection>, Error> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(store::Error::from)?
            .detach();
        // A reader that vanished without a word must not hold its partition for hours.
        sqlx::raw_sql(
            "SET tcp_keepalives_idle = 5; SET tcp_keepalives_interval = 2; \
             SET tcp_keepalives_count = 3; SET tcp_user_timeout = 11000",
        )
        .execute(&mut conn)
        .await
        .map_err(store::Error::from)?;
        let mut told = false;
        loop {
            let held: bool =
                sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
                    .bind(key)
                    .fetch_one(&mut conn)
                    .await
                    .map_err(store::Error::from)?;
            if held {
                if told {
                    tracing::info!(
                        partition = self.partition.0,
                        group = self.config.group,
                        "took the partition over"
                    );
                }
                return Ok(Some(conn));
            }
            if !told {
                told = true;
                self.folder.record(|stats| stats.standbys += 1);
                tracing::info!(
                    partition = self.partition.0,
                    group = self.config.group,
                    "another consumer of the group reads this partition; standing by"
                );
            }
            tokio::select! {
                () = tokio::time::sleep(self.config.standby_poll) => {}
                _ = stop.wait_for(|stop| *stop) => return Ok(None),
            }
        }
    }

    /// One session: the lock, a reader from the stored position, batches folded until stopped
    /// (`Ok`) or a failure (`Err`).
    async fn session(
        &mut self,
        stop: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
    ) -> Result<(), Error> {
        let key = self.config.offset_key(self.partition);
        let Some(mut conn) = self.lock(&key, stop).await? else {
            return Ok(());
        };
        let stored =
            store::stream_offset(conn.acquire().await.map_err(store::Error::from)?, &key).await?;
        let from = stored.map_or(self.config.start.read_from(), ReadFrom::Sequence);
        self.folder.db = Db::Held(conn);
        let reading = nats::Reading::connect(&self.config.nats).await?;
        let mut reader = reading.partition(self.partition, from).await?;
        if let Some(next) = stored
            && next > reader.last_sequence() + 1
        {
            // Sequences restart at 1 in a stream deleted and created again (the relay creates a
            // missing stream): reading on from the stored position would skip, without a word,
            // every message below it.
            return Err(Error::Refused(format!(
                "NATS stream {} ends at sequence {} but group {} stored position {next} for \
                 partition {}: the stream was deleted and created again, and what it held before \
                 is gone; rebuild the group's projection (store::reset_fold) or store another \
                 position under {key} (relay_fold_save_offset)",
                self.config.nats.stream,
                reader.last_sequence(),
                self.config.group,
                self.partition.0,
            )));
        }
        if let Some(next) = stored
            && reader.first_sequence() > next
        {
            // Removed by the stream's limits before this group read them: the stream is shared
            // by every partition, so whether any was this partition's is not known here. The
            // fold's chain refuses an event whose predecessor it never folded (broken_chain):
            // a loss is dead-lettered and its branch waits, never skipped silently.
            metrics::counter!("relay_consumer_offset_lost_total", "queue" => key.clone())
                .increment(1);
            tracing::warn!(
                partition = self.partition.0,
                expected = next,
                first = reader.first_sequence(),
                "the stream no longer holds messages this group had not read"
            );
        }
        let transport = NatsTransport {
            reading: &reading,
            group: &self.config.group,
        };
        let mut expected = stored;
        let bounds = self.config.batch;
        loop {
            let first = tokio::select! {
                _ = stop.wait_for(|stop| *stop) => return Ok(()),
                next = reader.next() => next?,
            };
            backoff.reset();
            // A batch: this message and what else the reader holds (up to the batch's bounds,
            // after waiting at most its linger). Whatever ends the reader on the way ends the
            // session after the batch taken so far is folded.
            let mut bytes = first.bytes();
            let mut batch = vec![admit(first, &mut expected)];
            let mut ended = None;
            let linger_until = tokio::time::Instant::now() + bounds.linger;
            while !bounds.full(batch.len(), bytes) {
                let next = match reader.next().now_or_never() {
                    Some(next) => next,
                    None if bounds.linger.is_zero() => break,
                    None => match tokio::time::timeout_at(linger_until, reader.next()).await {
                        Ok(next) => next,
                        Err(_) => break,
                    },
                };
                match next {
                    Ok(delivery) => {
                        bytes += delivery.bytes();
                        batch.push(admit(delivery, &mut expected));
                    }
                    Err(err) => {
                        ended = Some(err);
                        break;
                    }
                }
            }
            let settled = self
                .folder
                .settle(&transport, batch, Some(&key), stop)
                .await?;
            if settled.is_none() && *stop.borrow() {
                // Stopped while the batch could not commit: read again from the stored position.
                return Ok(());
            }
            if let Some(err) = ended {
                return Err(err);
            }
        }
    }
}

/// A message as a batch takes it: folded past what the fold expects next, acked only before.
fn admit(delivery: Delivery, expected: &mut Option<u64>) -> Incoming<Delivery> {
    let sequence = delivery.sequence();
    if expected.is_some_and(|expected| sequence < expected) {
        return Incoming {
            delivery,
            offset: None,
            event: None,
        };
    }
    *expected = Some(sequence + 1);
    let event = delivery.decode();
    Incoming {
        delivery,
        offset: Some(sequence),
        event: Some(event),
    }
}

/// NATS as the fold's transport: dead letters kept in the dead-letter stream; nothing to ack
/// (the position is stored with the fold).
struct NatsTransport<'a> {
    reading: &'a nats::Reading,
    group: &'a str,
}

impl Transport for NatsTransport<'_> {
    type Delivery = Delivery;

    fn bytes(delivery: &Delivery) -> usize {
        delivery.bytes()
    }

    fn message_id(delivery: &Delivery) -> Option<String> {
        delivery.message_id()
    }

    async fn dead_letter(&self, delivery: &Delivery, reason: &str) -> Result<(), Error> {
        self.reading.dead_letter(self.group, delivery, reason).await
    }

    async fn ack_through(&self, _last: &Delivery) -> Result<(), Error> {
        Ok(())
    }
}

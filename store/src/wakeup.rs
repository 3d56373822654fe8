//! Wake-ups: the tenants whose intents just committed (LISTEN on [`crate::NOTIFY_CHANNEL`]).
//!
//! A latency path only: a lost connection loses notifications, so the relay keeps polling
//! [`crate::Outbox::tenants_with_pending`] as the correctness path.
use sqlx::postgres::PgListener;

use crate::NOTIFY_CHANNEL;
use crate::error::Error;
use crate::key::TenantId;

/// A listening connection.
#[derive(Debug)]
pub struct Wakeups {
    listener: PgListener,
}

impl Wakeups {
    /// Connects and listens.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        let mut listener = PgListener::connect(url).await?;
        listener.listen(NOTIFY_CHANNEL).await?;
        Ok(Self { listener })
    }

    /// The next tenant with newly committed work. `Err` when the connection is lost.
    pub async fn next(&mut self) -> Result<TenantId, Error> {
        loop {
            match self.listener.try_recv().await? {
                Some(notification) => match TenantId::new(notification.payload()) {
                    Ok(tenant) => return Ok(tenant),
                    // Someone else NOTIFYing on our channel: not ours to act on.
                    Err(_) => continue,
                },
                None => return Err(Error::Database(sqlx::Error::PoolClosed)),
            }
        }
    }
}

//! A pooled connection for one call that never hands a lost connection back to the pool.
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

use crate::Error;

/// A connection of the pool for one call (or one transaction), closed rather than returned to
/// the pool if the call is abandoned: its future dropped, by a timeout say. sqlx tests a
/// returned connection with a ping that has no bound, so a connection lost without a reset
/// (a middlebox that dropped its state) would hold its pool slot until the kernel gives up on
/// the socket, about 15 minutes. Call [`CallConnection::finish`] once the call returned, with
/// or without an error: the connection then goes back to the pool as usual.
#[derive(Debug)]
pub struct CallConnection {
    conn: PoolConnection<Postgres>,
    finished: bool,
}

impl CallConnection {
    /// A connection of `pool`.
    pub async fn acquire(pool: &PgPool) -> Result<Self, Error> {
        Ok(Self {
            conn: pool.acquire().await?,
            finished: false,
        })
    }

    /// The call returned: the connection goes back to the pool.
    pub fn finish(mut self) {
        self.finished = true;
    }
}

impl std::ops::Deref for CallConnection {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for CallConnection {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl Drop for CallConnection {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.close_on_drop();
        }
    }
}

//! Tenant leases: each tenant is drained by exactly one relay at a time.
//!
//! A lease is a session-level advisory lock held on one dedicated connection. A relay that dies
//! (crash, SIGKILL, lost network) loses the connection, PostgreSQL drops its locks, and another
//! relay takes the tenants over on its next tick, with no operator and no expiry to wait out.
use sqlx::{Connection, PgConnection};

use crate::{Error, TenantId};

/// Namespace of the relay's advisory locks (first key of the two-key form), "RELY".
const LOCK_NAMESPACE: i32 = 0x5245_4c59;

/// The leases one relay holds. Not `Clone`: the connection is the lease.
#[derive(Debug)]
pub struct TenantLeases {
    connection: PgConnection,
}

impl TenantLeases {
    /// Opens the lease connection.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Ok(Self {
            connection: PgConnection::connect(url).await?,
        })
    }

    /// Tries to take the leases of `tenants`; returns the ones taken (already held ones included).
    pub async fn try_acquire(&mut self, tenants: &[TenantId]) -> Result<Vec<TenantId>, Error> {
        if tenants.is_empty() {
            return Ok(Vec::new());
        }
        let names: Vec<&str> = tenants.iter().map(TenantId::as_str).collect();
        // Locks are re-entrant per session; an already held tenant would stack a second lock, so
        // callers pass only tenants they do not hold.
        let taken: Vec<String> = sqlx::query_scalar(
            "SELECT t FROM unnest($1::text[]) AS t WHERE pg_try_advisory_lock($2, hashtext(t))",
        )
        .bind(&names)
        .bind(LOCK_NAMESPACE)
        .fetch_all(&mut self.connection)
        .await?;
        taken.into_iter().map(TenantId::new).collect()
    }

    /// Gives a tenant's lease back.
    pub async fn release(&mut self, tenant: &TenantId) -> Result<(), Error> {
        sqlx::query("SELECT pg_advisory_unlock($1, hashtext($2))")
            .bind(LOCK_NAMESPACE)
            .bind(tenant.as_str())
            .execute(&mut self.connection)
            .await?;
        Ok(())
    }

    /// Proves the lease connection (and so every lease on it) is still alive.
    pub async fn check(&mut self) -> Result<(), Error> {
        self.connection.ping().await?;
        Ok(())
    }
}

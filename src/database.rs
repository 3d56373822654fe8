//! Connecting to PostgreSQL with an error that names the cause within a couple of seconds.
//!
//! A pool retries a refused connection until its acquire timeout and then reports only
//! "pool timed out"; one direct connection first says what is wrong (refused, no such host,
//! authentication, missing role or database, TLS) and how long it waited.
use std::time::Duration;

use sqlx::Connection;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};

/// How long the first connection may take before the database counts as unreachable.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why PostgreSQL could not be used, in one line (no credentials).
pub(crate) fn describe(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("PostgreSQL refused: {} (SQLSTATE {code})", db.message()),
            None => format!("PostgreSQL refused: {}", db.message()),
        },
        sqlx::Error::Io(io) => format!("cannot connect: {io}"),
        sqlx::Error::Tls(tls) => format!("TLS failed: {tls}"),
        sqlx::Error::Configuration(why) => format!("bad connection settings: {why}"),
        other => other.to_string(),
    }
}

/// Opens one connection (under [`PROBE_TIMEOUT`]) and closes it: `Err` names the cause.
pub(crate) async fn probe(options: &PgConnectOptions) -> Result<(), String> {
    match tokio::time::timeout(PROBE_TIMEOUT, PgConnection::connect_with(options)).await {
        Ok(Ok(connection)) => {
            let _ = connection.close().await;
            Ok(())
        }
        Ok(Err(err)) => Err(describe(&err)),
        Err(_) => Err(format!(
            "no answer within {} s (host down or packets dropped?)",
            PROBE_TIMEOUT.as_secs()
        )),
    }
}

/// A pool of `size` connections to `url`, after one direct connection that names any problem
/// (refused, authentication, missing role or database, TLS) within about two seconds.
///
/// ```no_run
/// # async fn demo() -> Result<(), distribution::RelayError> {
/// let pool = distribution::connect_database("postgres://postgres@127.0.0.1/test", 4).await?;
/// distribution::store::migrate(&pool).await.expect("migrated");
/// # Ok(()) }
/// ```
pub async fn connect_database(url: &str, size: u32) -> Result<PgPool, crate::RelayError> {
    pool(url, size)
        .await
        .map_err(crate::RelayError::DatabaseUnreachable)
}

/// [`connect_database`] with the cause as a line.
pub(crate) async fn pool(url: &str, size: u32) -> Result<PgPool, String> {
    let options: PgConnectOptions = url.parse().map_err(|err| describe(&err))?;
    probe(&options).await?;
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(|err| describe(&err))
}

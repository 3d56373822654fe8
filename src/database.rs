//! Connecting to PostgreSQL with an error that names the cause within a couple of seconds.
//!
//! A pool retries a refused connection until its acquire timeout and then reports only
//! "pool timed out"; one direct connection first says what is wrong (refused, no such host,
//! authentication, missing role or database, TLS) and how long it waited.
use std::time::Duration;

use sqlx::Connection;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use store::Schema;

/// The `application_name` of the relay's connections (what `pg_stat_activity` shows), unless
/// the URL (`?application_name=...`) or `PGAPPNAME` names another.
pub const APPLICATION_NAME: &str = "outbox-relay";

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
/// With `schema`, the pool's connections find the relay's objects in that schema only.
///
/// ```no_run
/// # async fn demo() -> Result<(), distribution::RelayError> {
/// let url = "postgres://postgres@127.0.0.1/test";
/// let pool = distribution::connect_database(url, 4, None).await?;
/// distribution::store::migrate(&pool).await.expect("migrated");
/// # Ok(()) }
/// ```
pub async fn connect_database(
    url: &str,
    size: u32,
    schema: Option<&Schema>,
) -> Result<PgPool, crate::RelayError> {
    pool(url, size, schema)
        .await
        .map_err(crate::RelayError::DatabaseUnreachable)
}

/// Connection options for `url`, in `schema` if given (`search_path`).
pub fn connect_options(
    url: &str,
    schema: Option<&Schema>,
) -> Result<PgConnectOptions, crate::RelayError> {
    options(url, schema).map_err(crate::RelayError::DatabaseUnreachable)
}

/// [`connect_options`] with the cause as a line.
pub(crate) fn options(url: &str, schema: Option<&Schema>) -> Result<PgConnectOptions, String> {
    let mut options: PgConnectOptions = url.parse().map_err(|err| describe(&err))?;
    if options.get_application_name().is_none() {
        options = options.application_name(APPLICATION_NAME);
    }
    Ok(match schema {
        Some(schema) => schema.apply(options),
        None => options,
    })
}

/// A pool that connects on first use (no probe).
pub(crate) fn lazy_pool(
    url: &str,
    size: u32,
    acquire_timeout: Duration,
    schema: Option<&Schema>,
) -> Result<PgPool, String> {
    // Leases commit durably whatever the server's or role's default: a renewal a crash took
    // back would have extended a fence on a beat another relay may already have seen stand
    // still (`supervisor/src/core/leases/sightings.rs`).
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(acquire_timeout)
        .connect_lazy_with(options(url, schema)?.options([("synchronous_commit", "on")])))
}

/// The relay's own commits (acks, parks) do not wait for the WAL flush
/// (`synchronous_commit = off`): a PostgreSQL crash can undo the last few hundred ms of them,
/// which only sends those events again (the fold absorbs the copies). A synchronous commit
/// flushes the WAL up to its own record, so any write committed after an ack (a host's rewind,
/// a lease release) keeps that ack; only a read (`distribution status`, say) can have seen an
/// ack that a crash then undoes.
pub(crate) fn relay_options(
    url: &str,
    schema: Option<&Schema>,
) -> Result<PgConnectOptions, String> {
    Ok(options(url, schema)?.options([("synchronous_commit", "off")]))
}

/// [`connect_database`] with the cause as a line.
pub(crate) async fn pool(url: &str, size: u32, schema: Option<&Schema>) -> Result<PgPool, String> {
    pool_with(options(url, schema)?, size).await
}

/// The relay's drain and ack pool ([`relay_options`]), probed first.
pub(crate) async fn relay_pool(
    url: &str,
    size: u32,
    schema: Option<&Schema>,
) -> Result<PgPool, String> {
    pool_with(relay_options(url, schema)?, size).await
}

async fn pool_with(options: PgConnectOptions, size: u32) -> Result<PgPool, String> {
    probe(&options).await?;
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(|err| describe(&err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_named_unless_the_url_names_them() {
        let named = options("postgres://postgres@127.0.0.1/test", None).unwrap();
        assert_eq!(named.get_application_name(), Some(APPLICATION_NAME));
        let own = options(
            "postgres://postgres@127.0.0.1/test?application_name=billing-relay",
            None,
        )
        .unwrap();
        assert_eq!(own.get_application_name(), Some("billing-relay"));
        let relay = relay_options("postgres://postgres@127.0.0.1/test", None).unwrap();
        assert!(
            relay
                .get_options()
                .is_some_and(|options| options.contains("synchronous_commit=off")),
            "{:?}",
            relay.get_options()
        );
    }
}

//! Shared by the store's integration tests that are not `#[sqlx::test]`s (on `testkit`).
use sqlx::PgPool;

/// A new, empty database on `DATABASE_URL`'s server, named after `label`; dropped when the
/// test process exits (`store::scratch`).
#[allow(dead_code)] // not every test file uses it
pub async fn empty_database(label: &str) -> PgPool {
    testkit::empty_database(label).await.0
}

/// A new database with the relay's schema.
#[allow(dead_code)] // not every test file uses it
pub async fn fresh_database(label: &str) -> PgPool {
    testkit::migrated_database(label).await.0
}

//! Shared by the store's integration tests that are not `#[sqlx::test]`s.
use chrono::Utc;
use sqlx::{Connection, PgConnection, PgPool};

/// A new, empty database on `DATABASE_URL`'s server, named after `label`.
pub async fn empty_database(label: &str) -> PgPool {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL (set in .cargo/config.toml)");
    let name = format!(
        "relay_{label}_{}_{}",
        std::process::id(),
        Utc::now().timestamp_micros()
    );
    let mut admin = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let base = url.rsplit_once('/').map(|(base, _)| base).unwrap();
    PgPool::connect(&format!("{base}/{name}")).await.unwrap()
}

/// A new database with the relay's schema.
#[allow(dead_code)] // not every test file uses it
pub async fn fresh_database(label: &str) -> PgPool {
    let pool = empty_database(label).await;
    store::migrate(&pool).await.unwrap();
    pool
}

//! What the store's benches share: settings from the environment and scratch databases on this
//! machine's PostgreSQL (`DATABASE_URL`, set in .cargo/config.toml).
#![allow(dead_code)]

use sqlx::{Connection, PgConnection, PgPool};

/// The number in environment variable `name`, or `default`.
pub fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// A new database `relay_bench_<label>_<pid>` with the outbox's schema (or, `fold_only`, the
/// fold's alone): a pool of 24 on it, and its name (for [`drop_database`]).
pub async fn database(label: &str, fold_only: bool) -> (PgPool, String) {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL (set in .cargo/config.toml)");
    let name = format!("relay_bench_{label}_{}", std::process::id());
    let mut admin = PgConnection::connect(&url).await.expect("PostgreSQL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create database");
    let base = url.rsplit_once('/').expect("a database in the URL").0;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(24)
        .connect(&format!("{base}/{name}"))
        .await
        .expect("bench database");
    if fold_only {
        store::migrate_fold(&pool).await.expect("migrate fold");
    } else {
        store::migrate(&pool).await.expect("migrate");
    }
    (pool, name)
}

/// Drops database `name`, whoever is still connected.
pub async fn drop_database(name: &str) {
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let mut admin = PgConnection::connect(&url).await.expect("PostgreSQL");
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await;
}

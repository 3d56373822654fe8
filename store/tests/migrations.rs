//! The relay's migrations beside a host's own sqlx migrations, on real PostgreSQL: either
//! order, twice, and a database migrated by an older relay (into `_sqlx_migrations`) adopted.
mod common;

use common::empty_database;
use sqlx::Connection;
use sqlx::migrate::Migrator;

/// A host's own migrations, in sqlx's default table.
async fn host_migrator() -> Migrator {
    let dir = std::env::temp_dir().join(format!("relay-host-migrations-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("20240101000000_host_state.sql"),
        "CREATE TABLE IF NOT EXISTS host_state (id bigint PRIMARY KEY, note text);",
    )
    .unwrap();
    Migrator::new(dir.as_path()).await.unwrap()
}

#[tokio::test]
async fn host_and_relay_migrations_coexist_in_either_order_twice() {
    let host = host_migrator().await;
    let first = empty_database("mig_host_first").await;
    for _ in 0..2 {
        host.run(&first).await.expect("host after relay");
        store::migrate(&first).await.expect("relay after host");
    }
    let second = empty_database("mig_relay_first").await;
    for _ in 0..2 {
        store::migrate(&second).await.expect("relay first");
        host.run(&second).await.expect("host after relay");
    }
    for pool in [&first, &second] {
        let ours: i64 = sqlx::query_scalar("SELECT count(*) FROM relay_migrations")
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(ours as usize, store::MIGRATOR.iter().count());
        let hosts: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations")
            .fetch_all(pool)
            .await
            .unwrap();
        assert_eq!(
            hosts,
            vec![20240101000000],
            "only the host's own rows in its table"
        );
    }
}

/// A database migrated by an earlier relay recorded our versions in `_sqlx_migrations`, where
/// the host's migrator refuses them; the next `migrate` moves them to our table, after which
/// both run cleanly.
#[tokio::test]
async fn a_legacy_database_is_adopted() {
    let pool = empty_database("mig_legacy").await;
    sqlx::migrate!("./migrations").run(&pool).await.unwrap(); // the old relay
    let host = host_migrator().await;
    {
        // On a connection of its own: sqlx keeps its migration lock when a run fails.
        let mut conn = pool.acquire().await.unwrap().detach();
        assert!(
            host.run(&mut conn).await.is_err(),
            "the host's migrator used to trip over the relay's rows"
        );
        conn.close().await.unwrap();
    }
    store::migrate(&pool).await.expect("adopts and carries on");
    host.run(&pool).await.expect("the host runs cleanly now");
    store::migrate(&pool).await.expect("and again");
}

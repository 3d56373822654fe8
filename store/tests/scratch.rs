//! Scratch databases are dropped when the test process exits, also when its test failed.
use sqlx::{Connection, PgConnection};

/// Run only as the child of the test below: makes a scratch database, prints its name and
/// fails.
#[tokio::test]
#[ignore = "the child of a_failed_tests_scratch_database_is_dropped_at_its_exit"]
async fn child_makes_a_database_and_fails() {
    if std::env::var_os("SCRATCH_CHILD").is_none() {
        return;
    }
    let (pool, url) = store::scratch::scratch_database("child").await;
    sqlx::query("CREATE TABLE t (x int)")
        .execute(&pool)
        .await
        .unwrap();
    let name = url.rsplit('/').next().unwrap();
    println!("SCRATCH={name}");
    panic!("this test fails on purpose");
}

#[tokio::test]
async fn a_failed_tests_scratch_database_is_dropped_at_its_exit() {
    let name = store::scratch::failing_child("child_makes_a_database_and_fails");
    assert!(name.starts_with(store::scratch::PREFIX));
    let mut admin = PgConnection::connect(&std::env::var("DATABASE_URL").unwrap())
        .await
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1")
        .bind(&name)
        .fetch_one(&mut admin)
        .await
        .unwrap();
    assert_eq!(left, 0, "{name} was dropped when the child exited");
}

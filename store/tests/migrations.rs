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

/// Upgrading a database whose roles were granted (`distribution roles`) keeps the grants:
/// version 8 and the fold's version 9 drop and create `relay_append`, `relay_ack_and_drain` and
/// `relay_fold` again with new signatures, and PostgreSQL drops a function's grants with it;
/// version 10's stream offset functions get `relay_fold`'s grantees, not PUBLIC.
#[tokio::test]
async fn an_upgrade_keeps_the_roles_grants() {
    let pool = empty_database("mig_grants").await;
    migrate_up_to(&pool, 7).await;
    let suffix = std::process::id();
    let [host, relay, consumer, other, operator] =
        ["host", "relay", "consumer", "other", "operator"]
            .map(|role| format!("mig_{role}_{suffix}"));
    for role in [&host, &relay, &consumer, &other, &operator] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE ROLE {role}")))
            .execute(&pool)
            .await
            .unwrap();
    }
    let roles = store::Roles {
        host: Some(host.clone()),
        relay: Some(relay.clone()),
        consumer: Some(consumer.clone()),
        operator: None,
    };
    // The script as the version 7 relay printed it (no relay_require_meta nor stream offset
    // functions yet).
    let grants = store::roles_sql(&roles, store::RolesFor::Outbox, None)
        .unwrap()
        .replace("relay_require_meta_0018, ", "")
        .replace("relay_require_meta, ", "")
        .replace("relay_current_epoch, ", "")
        .replace(", relay_wait_replicated", "")
        .replace(", relay_fold_adopt", "")
        .replace(", relay_fold_batch", "")
        .replace("relay_release, ", "")
        .replace(
            ", relay_fold_offset, relay_fold_save_offset, relay_fold_reset",
            "",
        );
    assert!(!grants.contains("relay_fold_offset"), "{grants}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(grants))
        .execute(&pool)
        .await
        .unwrap();

    store::migrate(&pool).await.unwrap();
    // The operator's role came with version 9: granted after the upgrade.
    let operator_grants = store::roles_sql(
        &store::Roles {
            operator: Some(operator.clone()),
            ..store::Roles::default()
        },
        store::RolesFor::Outbox,
        None,
    )
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(operator_grants))
        .execute(&pool)
        .await
        .unwrap();
    let may_read = |role: &str, table: &str| {
        let pool = pool.clone();
        let (role, table) = (role.to_owned(), table.to_owned());
        async move {
            sqlx::query_scalar::<_, bool>("SELECT has_table_privilege($1, $2, 'SELECT')")
                .bind(role)
                .bind(table)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let append = "relay_append(text, text, text, bigint, bytea, boolean, bigint, jsonb)";
    let drain = "relay_ack_and_drain(integer, text, bigint, text, text[], text[], bigint[], bigint, bigint, text[], text[], bigint[])";
    let fold = "relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb, bigint, bigint)";
    let fold_batch = "relay_fold_batch(text[], text[], text[], text[], bigint[], bigint[], bigint[], text[], text[], timestamptz[], bytea[], jsonb[], bigint[], bigint[])";
    let outcome = async {
        for (role, function, expected) in [
            (&host, append, true),
            (&relay, append, false),
            (&other, append, false),
            (&relay, drain, true),
            (&host, drain, false),
            (&other, drain, false),
            (&consumer, fold, true),
            (&other, fold, false),
            // Functions that came after the grants follow relay_fold's.
            (&consumer, "relay_fold_reset()", true),
            (&consumer, "relay_fold_save_offset(text, bigint)", true),
            (&host, "relay_fold_reset()", false),
            (&other, "relay_fold_offset(text)", false),
            (&consumer, fold_batch, true),
            (&host, fold_batch, false),
            (&other, fold_batch, false),
            (&operator, "relay_release(text, text, text)", true),
            (
                &operator,
                "relay_discard_branch(text, text, text, text)",
                true,
            ),
            (&operator, append, false),
            (&operator, drain, false),
            // The script revokes both halves of the metadata check (migration 19 split it).
            (&other, "relay_require_meta(jsonb)", false),
            (&other, "relay_require_meta_0018(jsonb)", false),
            // Revoked from PUBLIC by its migration, whatever script ran before.
            (&other, "relay_release(text, text, text)", false),
            (&relay, "relay_release(text, text, text)", false),
        ] {
            assert_eq!(
                may_execute(&pool, role, function).await,
                expected,
                "{role} on {function}"
            );
        }
        // Counts, ages and reasons, never a payload.
        for (role, table, expected) in [
            (&operator, "relay_backlog_status", true),
            (&operator, "relay_oldest_wait", true),
            (&operator, "relay_parked_status", true),
            (&operator, "relay_relays_status", true),
            (&operator, "relay_branch_status", true),
            (&operator, "relay_outbox", false),
            (&operator, "relay_parked_branch", false),
            (&other, "relay_backlog_status", false),
        ] {
            assert_eq!(
                may_read(role, table).await,
                expected,
                "{role} reads {table}"
            );
        }
    };
    let checked = futures_catch(outcome).await;
    for role in [&host, &relay, &consumer, &other, &operator] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP OWNED BY {role}; DROP ROLE {role}"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    if let Err(panic) = checked {
        std::panic::resume_unwind(panic);
    }
}

/// Whether `role` may execute `function` (a signature).
async fn may_execute(pool: &sqlx::PgPool, role: &str, function: &str) -> bool {
    sqlx::query_scalar("SELECT has_function_privilege($1, $2, 'EXECUTE')")
        .bind(role)
        .bind(function)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Applies the relay's migrations up to `version`, as a relay of that version left the schema.
async fn migrate_up_to(pool: &sqlx::PgPool, version: i64) {
    let mut before = Migrator {
        migrations: store::MIGRATOR
            .iter()
            .filter(|migration| migration.version <= version)
            .cloned()
            .collect::<Vec<_>>()
            .into(),
        ..Migrator::DEFAULT
    };
    before.dangerous_set_table_name(store::MIGRATIONS_TABLE);
    before.run(pool).await.unwrap();
}

/// Runs `future`, catching a panic so the caller can clean up first.
async fn futures_catch<F: std::future::Future<Output = ()>>(
    future: F,
) -> Result<(), Box<dyn std::any::Any + Send>> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(std::task::Poll::Ready(())) => std::task::Poll::Ready(Ok(())),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    })
    .await
}

/// A database migrated whole, then for the fold only (a consumer sharing the host's database,
/// as the docs allow): the second is a no-op, not an error (it failed with `function name
/// "relay_fold" is not unique`), both ways round, twice.
#[tokio::test]
async fn migrating_the_fold_after_the_whole_schema_and_back_is_a_no_op() {
    let pool = empty_database("mig_fold_after").await;
    for _ in 0..2 {
        store::migrate(&pool).await.expect("whole");
        store::migrate_fold(&pool).await.expect("fold after whole");
    }
    let fold_only = empty_database("mig_fold_first").await;
    store::migrate_fold(&fold_only).await.expect("fold first");
    store::migrate_fold(&fold_only).await.expect("fold again");
}

/// Migration 19 renames `relay_require_meta` and creates the check anew: a database whose
/// grants were set (`distribution roles` revoking PUBLIC's) before it keeps them on the new
/// function, not PUBLIC's default.
#[tokio::test]
async fn migration_19_keeps_the_metadata_checks_grants() {
    let pool = empty_database("mig_19_grants").await;
    migrate_up_to(&pool, 18).await;
    let other = format!("mig_19_other_{}", std::process::id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {other}; REVOKE EXECUTE ON FUNCTION relay_require_meta(jsonb) FROM PUBLIC"
    )))
    .execute(&pool)
    .await
    .unwrap();
    store::migrate(&pool).await.unwrap();
    let new = may_execute(&pool, &other, "relay_require_meta(jsonb)").await;
    let old = may_execute(&pool, &other, "relay_require_meta_0018(jsonb)").await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP ROLE {other}")))
        .execute(&pool)
        .await
        .unwrap();
    assert!(!old, "the renamed function keeps its grants");
    assert!(
        !new,
        "the new function takes the old one's grants, not PUBLIC's"
    );
}

//! The relay's objects in a schema of their own (`RELAY_SCHEMA`): the host keeps its own
//! `search_path` and may even have tables of the same names; the relay ships all the same.

use std::time::Duration;

use distribution::Relay;
use distribution::store::{self, FoldStore, IntentWriter, Schema};

use crate::harness::*;

#[test]
fn the_relay_lives_in_its_own_schema_beside_a_hosts_tables_of_the_same_names() {
    host_runtime().block_on(async {
        let (pool, url) = empty_database("schema").await;
        // The host's own table that happens to share a name with the relay's.
        sqlx::query("CREATE TABLE relay_outbox (host_note text)")
            .execute(&pool)
            .await
            .unwrap();
        // The consumer's fold tables, in the default schema.
        store::migrate_fold(&pool).await.unwrap();

        let schema = Schema::new("relay_ops").unwrap();
        let relay_pool = distribution::connect_database(&url, 2, Some(&schema))
            .await
            .unwrap();
        store::create_schema(&relay_pool, &schema).await.unwrap();
        store::migrate(&relay_pool).await.unwrap();
        store::migrate(&relay_pool).await.unwrap(); // twice: idempotent
        let placed: Vec<(String, String)> = sqlx::query_as(
            "SELECT table_schema::text, table_name::text FROM information_schema.tables
              WHERE table_name IN ('relay_outbox', 'relay_branch', 'relay_migrations')
              ORDER BY 1, 2",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(
            placed,
            vec![
                ("public".into(), "relay_outbox".into()),
                ("relay_ops".into(), "relay_branch".into()),
                ("relay_ops".into(), "relay_migrations".into()),
                ("relay_ops".into(), "relay_outbox".into()),
            ]
        );

        let mut config = relay_config(&url, &amqp_url(), &unique("relay-schema"));
        config.schema = Some("relay_ops".into());
        let fold = FoldStore::new(pool.clone());
        let folding = Folding::start(direct_rabbit(&config), &fold);
        let relay = Relay::start(config.clone()).await.unwrap();

        // The host writes on its own connections, search_path untouched.
        let writer = IntentWriter::default().with_schema(schema.clone());
        let mut expected = Expected::new();
        for tenant in ["s1", "s2"] {
            let branch = store::BranchKey::new(
                store::TenantId::new(tenant).unwrap(),
                store::RunId::new("r").unwrap(),
                store::BranchId::new("main").unwrap(),
            );
            let mut tx = pool.begin().await.unwrap();
            writer.open_run(&mut tx, &branch).await.unwrap();
            for lsn in 1..=5u64 {
                let payload = format!("{tenant}-{lsn}").into_bytes();
                writer
                    .append(&mut tx, &branch, store::Lsn::new(lsn), &payload)
                    .await
                    .unwrap();
                expected
                    .entry(branch.clone())
                    .or_default()
                    .push((store::Lsn::new(lsn), payload));
            }
            tx.commit().await.unwrap();
        }
        let search_path: String = sqlx::query_scalar("SHOW search_path")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(!search_path.contains("relay_ops"), "{search_path}");
        wait_until("every event folded", Duration::from_secs(30), || async {
            folded_count(&fold, &expected).await == count(&expected)
        })
        .await;
        assert_folded_exactly(&fold, &expected).await;
        let host_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM public.relay_outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(host_rows, 0, "the host's own table was never touched");
        relay.shutdown().await;

        // The operator's commands find the relay's tables through --schema too.
        let cli = |args: &[&str]| {
            let output = std::process::Command::new(env!("CARGO_BIN_EXE_distribution"))
                .args(args)
                .args(["--schema", "relay_ops"])
                .env("DATABASE_URL", &url)
                .env_remove("RELAY_SCHEMA")
                .output()
                .expect("run the binary");
            let text = String::from_utf8_lossy(&output.stdout).into_owned()
                + &String::from_utf8_lossy(&output.stderr);
            assert!(output.status.success(), "{args:?}: {text}");
            text
        };
        assert!(cli(&["status"]).contains("no parked branches"));
        sqlx::query(
            "INSERT INTO relay_ops.relay_parked_branch
                 (tenant_id, run_id, branch_id, reason, attempts, first_failed_at, retry_at)
             VALUES ('parked-t', 'r', 'b', 'nacked', 3, now(), now() + interval '1 hour')",
        )
        .execute(&pool)
        .await
        .unwrap();
        assert!(cli(&["status"]).contains("parked-t"));
        assert!(cli(&["release", "parked-t"]).contains("released 1 parked branch"));
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM relay_ops.relay_parked_branch")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(left, 0, "release --schema released nothing");
        folding.stop().await;
        drop_topology(&config.rabbit_config().unwrap().topology).await;
    });
}

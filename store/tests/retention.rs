//! Runs end, and storage follows: closing a run, its end marker, and retirement in the host's
//! database and in the fold's, on real PostgreSQL. Time passing is made by moving a run's
//! `closed_at` / `ended_at` back (never by sleeping).
use std::time::Duration;

use sqlx::PgPool;
use store::{
    BranchId, BranchKey, Closed, Error, EventKey, EventKind, FoldOutcome, FoldStore, IntentWriter,
    Lsn, Outbox, OutboxEvent, Retention, TenantId, retire_folded_runs, retire_runs,
};
use testkit::branch as key;

fn writer() -> IntentWriter {
    IntentWriter::default().with_notify(false)
}

/// Opens `branch`'s run and appends `1..=n` to it.
async fn written(pool: &PgPool, branch: &BranchKey, n: u64) {
    let mut conn = pool.acquire().await.unwrap();
    writer().open_run(&mut conn, branch).await.unwrap();
    for lsn in 1..=n {
        writer()
            .append(
                &mut conn,
                branch,
                Lsn::new(lsn),
                format!("{lsn}").as_bytes(),
            )
            .await
            .unwrap();
    }
}

async fn close(pool: &PgPool, branch: &BranchKey) -> Result<Closed, Error> {
    let mut conn = pool.acquire().await.unwrap();
    writer()
        .close_run(&mut conn, &branch.tenant, &branch.run)
        .await
}

/// Everything pending of `tenant`, acked as if the broker confirmed it.
async fn shipped(pool: &PgPool, tenant: &TenantId) -> Vec<OutboxEvent> {
    let outbox = Outbox::new(pool.clone());
    let events = outbox.drain_outbox(tenant, 10_000).await.unwrap();
    let keys: Vec<EventKey> = events.iter().map(|event| event.key.clone()).collect();
    outbox.ack_outbox(&keys).await.unwrap();
    events
}

async fn count(pool: &PgPool, table: &str, tenant: &str, run: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {table} WHERE tenant_id = $1 AND run_id = $2"
    )))
    .bind(tenant)
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Moves the close of `run` an hour back: the retention of the tests is ten minutes.
async fn closed_an_hour_ago(pool: &PgPool, tenant: &str, run: &str) {
    sqlx::query(
        "UPDATE relay_branch SET closed_at = closed_at - interval '1 hour'
          WHERE tenant_id = $1 AND run_id = $2 AND closed_at IS NOT NULL",
    )
    .bind(tenant)
    .bind(run)
    .execute(pool)
    .await
    .unwrap();
}

fn ten_minutes() -> Retention {
    Retention {
        keep: Duration::from_secs(600),
        batch: 2,
    }
}

/// Closing refuses every later write of the run with RL110 (`RunClosed`), and puts an end
/// marker after the live branch's last intent: the run's last message on the wire.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn closing_a_run_refuses_later_writes_and_ends_it_on_the_wire(pool: PgPool) {
    let main = key("t", "r", "main");
    written(&pool, &main, 3).await;
    let mut conn = pool.acquire().await.unwrap();
    let retry = writer()
        .rewind(
            &mut conn,
            &main,
            Lsn::new(2),
            BranchId::new("retry").unwrap(),
        )
        .await
        .unwrap()
        .live;
    writer()
        .append(&mut conn, &retry, Lsn::new(3), b"3'")
        .await
        .unwrap();
    let closed = close(&pool, &main).await.unwrap();
    assert_eq!(
        closed,
        Closed {
            live: retry.clone(),
            end: Lsn::new(4),
        }
    );

    let refused = writer().append(&mut conn, &retry, Lsn::new(4), b"4").await;
    assert!(
        matches!(&refused, Err(Error::RunClosed { head, .. }) if *head == Lsn::new(3)),
        "{refused:?}"
    );
    let refused = writer()
        .rewind(
            &mut conn,
            &retry,
            Lsn::new(3),
            BranchId::new("again").unwrap(),
        )
        .await;
    assert!(
        matches!(refused, Err(Error::RunClosed { .. })),
        "{refused:?}"
    );
    assert!(matches!(
        close(&pool, &main).await,
        Err(Error::RunClosed { .. })
    ));
    assert!(matches!(
        close(&pool, &key("t", "never", "main")).await,
        Err(Error::UnknownRun { .. })
    ));

    let events = shipped(&pool, &main.tenant).await;
    let wire: Vec<(String, u64, u64, bool)> = events
        .iter()
        .map(|event| {
            (
                event.key.branch.branch.to_string(),
                event.key.lsn.get(),
                event.prev_lsn.get(),
                event.is_end(),
            )
        })
        .collect();
    assert_eq!(
        wire,
        [
            ("main".into(), 1, 0, false),
            ("main".into(), 2, 1, false),
            ("main".into(), 4, 2, false), // the rewind marker
            ("retry".into(), 3, 2, false),
            ("retry".into(), 4, 3, true), // the end marker, last
        ]
    );
    assert_eq!(events[4].kind, EventKind::End);
    assert_eq!(
        events[4].parent.as_ref().map(BranchId::as_str),
        Some("main")
    );
}

/// Retirement removes exactly the runs closed longer than the retention ago whose every row
/// shipped: all their branches (abandoned ones too) and parked-branch rows. A run closed
/// recently, a closed run with rows still in the outbox and open runs stay. It runs in batches
/// until one comes back short.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn retirement_removes_exactly_the_closed_and_shipped_runs(pool: PgPool) {
    let tenant = TenantId::new("t").unwrap();
    // old1..old3: closed an hour ago and shipped; old1 with an abandoned branch and a parked row.
    for run in ["old1", "old2", "old3"] {
        written(&pool, &key("t", run, "main"), 2).await;
    }
    let mut conn = pool.acquire().await.unwrap();
    writer()
        .rewind(
            &mut conn,
            &key("t", "old1", "main"),
            Lsn::new(1),
            BranchId::new("b").unwrap(),
        )
        .await
        .unwrap();
    written(&pool, &key("t", "unshipped", "main"), 2).await;
    written(&pool, &key("t", "recent", "main"), 2).await;
    written(&pool, &key("t", "open", "main"), 2).await;
    for run in ["old1", "old2", "old3", "recent"] {
        close(&pool, &key("t", run, "main")).await.unwrap();
    }
    shipped(&pool, &tenant).await;
    close(&pool, &key("t", "unshipped", "main")).await.unwrap();
    Outbox::new(pool.clone())
        .park_branch(
            &key("t", "old1", "b"),
            "nacked",
            3,
            Duration::from_secs(1),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    for run in ["old1", "old2", "old3", "unshipped"] {
        closed_an_hour_ago(&pool, "t", run).await;
    }

    // Batches of 2: 2, then 1 (short: done).
    assert_eq!(retire_runs(&pool, ten_minutes()).await.unwrap(), 3);
    for run in ["old1", "old2", "old3"] {
        assert_eq!(count(&pool, "relay_branch", "t", run).await, 0, "{run}");
    }
    assert_eq!(count(&pool, "relay_parked_branch", "t", "old1").await, 0);
    for (run, branches) in [("unshipped", 1), ("recent", 1), ("open", 1)] {
        assert_eq!(
            count(&pool, "relay_branch", "t", run).await,
            branches,
            "{run}"
        );
    }
    assert_eq!(retire_runs(&pool, ten_minutes()).await.unwrap(), 0);

    // Once its end marker ships, the closed run goes too; the open run still takes appends.
    shipped(&pool, &tenant).await;
    assert_eq!(retire_runs(&pool, ten_minutes()).await.unwrap(), 1);
    assert_eq!(count(&pool, "relay_branch", "t", "unshipped").await, 0);
    writer()
        .append(&mut conn, &key("t", "open", "main"), Lsn::new(3), b"3")
        .await
        .unwrap();
    // A retired run's id is free again (ids must not be reused: see docs/sql-api.md, "Runs end").
    let after = writer()
        .append(&mut conn, &key("t", "old2", "main"), Lsn::new(3), b"3")
        .await;
    assert!(
        matches!(after, Err(Error::UnknownBranch { .. })),
        "{after:?}"
    );

    let out_of_range = Retention {
        keep: Duration::from_secs(1),
        batch: 0,
    };
    assert!(matches!(
        retire_runs(&pool, out_of_range).await,
        Err(Error::RetentionOutOfRange)
    ));
}

fn event(branch: &BranchKey, lsn: u64, kind: EventKind) -> OutboxEvent {
    testkit::intent(branch, lsn)
        .payload(format!("{lsn}"))
        .kind(kind)
        .build()
}

/// At the fold: inside the retention a redelivery of a completed run is a duplicate; after it
/// the run's cursors and held-back events are gone and any delivery of it is refused
/// (`RetiredRun`, RL202), never applied again. Runs written after the retired ones, and other
/// tenants' runs, fold as ever.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_fold_retires_completed_runs_and_refuses_their_redeliveries(pool: PgPool) {
    let fold = FoldStore::new(pool.clone());
    let done = key("t", "done", "main");
    let open = key("t", "open", "main");
    // Messages carry the time the host wrote them: a redelivery is as old as the original.
    let early = event(&open, 1, EventKind::Intent);
    let again = event(&done, 2, EventKind::Intent);
    let other_tenant = event(&key("u", "slow", "main"), 1, EventKind::Intent);
    // `done`: 1, 2, an end marker held back behind 3, then 3 releases it.
    fold.apply(&event(&done, 1, EventKind::Intent))
        .await
        .unwrap();
    fold.apply(&again).await.unwrap();
    assert_eq!(
        fold.apply(&event(&done, 4, EventKind::End)).await.unwrap(),
        FoldOutcome::Parked
    );
    assert_eq!(
        fold.apply(&event(&done, 3, EventKind::Intent))
            .await
            .unwrap(),
        FoldOutcome::Applied { released: 0 }
    );
    assert_eq!(
        fold.apply(&event(&done, 4, EventKind::End)).await.unwrap(),
        FoldOutcome::Duplicate
    );
    // An abandoned branch's late event, held for ever: retired with its run.
    let stray = OutboxEvent {
        parent: Some(BranchId::new("main").unwrap()),
        meta: Default::default(),
        ..event(&key("t", "done", "stray"), 9, EventKind::Intent)
    };
    assert_eq!(fold.apply(&stray).await.unwrap(), FoldOutcome::Parked);

    // Inside the retention: kept, and a redelivery is a duplicate.
    assert_eq!(retire_folded_runs(&pool, ten_minutes()).await.unwrap(), 0);
    assert_eq!(fold.apply(&again).await.unwrap(), FoldOutcome::Duplicate);

    sqlx::query("UPDATE relay_fold_cursor SET ended_at = ended_at - interval '1 hour'")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(retire_folded_runs(&pool, ten_minutes()).await.unwrap(), 1);
    assert_eq!(count(&pool, "relay_fold_cursor", "t", "done").await, 0);
    assert_eq!(count(&pool, "relay_fold_parked", "t", "done").await, 0);

    // After it: refused, never applied twice; so is an event held up for longer than the
    // retention (written before the retired end marker, first seen now).
    for late in [&again, &early] {
        let refused = fold.apply(late).await;
        assert!(
            matches!(refused, Err(Error::RetiredRun { .. })),
            "{refused:?}"
        );
        assert!(!refused.unwrap_err().is_transient());
    }
    // The horizon is the tenant's: another tenant's event as old folds as ever.
    assert_eq!(
        fold.apply(&other_tenant).await.unwrap(),
        FoldOutcome::Applied { released: 0 }
    );
    let folded = fold.folded(&done.tenant).await.unwrap();
    assert_eq!(folded.len(), 3, "done@1..=3 once each");
    // What is written now folds as ever.
    assert_eq!(
        fold.apply(&event(&open, 1, EventKind::Intent))
            .await
            .unwrap(),
        FoldOutcome::Applied { released: 0 }
    );
}

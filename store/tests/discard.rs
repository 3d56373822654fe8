//! Discarding a parked branch for good, never as a silent gap: its waiting events go, a rewind
//! marker at its last shipped Lsn tells consumers, the run goes on (closed again if it was) on a
//! new branch, and the fold ends with exactly that live history.
use std::time::Duration;

use sqlx::PgPool;
use store::{
    BranchId, BranchKey, Discarded, Error, EventKey, EventKind, FoldModel, FoldOutcome,
    IntentWriter, Lsn, Outbox,
};

fn key(run: &str, branch: &str) -> BranchKey {
    testkit::branch("t", run, branch)
}

/// `1..=5` on `branch` (a new run), the first two shipped, the branch parked.
async fn parked(pool: &PgPool, branch: &BranchKey, close: bool) -> Outbox {
    let writer = IntentWriter::default().with_notify(false);
    let mut conn = pool.acquire().await.unwrap();
    writer.open_run(&mut conn, branch).await.unwrap();
    for lsn in 1..=5 {
        writer
            .append(&mut conn, branch, Lsn::new(lsn), b"x")
            .await
            .unwrap();
    }
    if close {
        writer
            .close_run(&mut conn, &branch.tenant, &branch.run)
            .await
            .unwrap();
    }
    let outbox = Outbox::new(pool.clone());
    let shipped: Vec<EventKey> = (1..=2)
        .map(|lsn| EventKey {
            branch: branch.clone(),
            lsn: Lsn::new(lsn),
        })
        .collect();
    outbox.ack_outbox(&shipped).await.unwrap();
    outbox
        .park_branch(
            branch,
            "too_large",
            5,
            Duration::from_secs(1),
            Duration::from_secs(600),
        )
        .await
        .unwrap();
    outbox
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_discarded_branch_ends_at_its_last_shipped_lsn_on_the_wire(pool: PgPool) {
    let main = key("r", "main");
    let outbox = parked(&pool, &main, false).await;
    let to = BranchId::new("after").unwrap();
    let discarded = outbox.discard_branch(&main, &to).await.unwrap();
    assert_eq!(
        discarded,
        Discarded {
            live: key("r", "after"),
            fork: Lsn::new(2),
            discarded: 3,
        }
    );
    assert!(
        outbox.parked_branches().await.unwrap().is_empty(),
        "unparked"
    );
    // On the wire: the marker (fork 2, to `after`), nothing of 3..=5.
    let waiting = outbox.drain_outbox(&main.tenant, 100).await.unwrap();
    assert_eq!(waiting.len(), 1);
    assert_eq!(waiting[0].kind, EventKind::Rewind { to: to.clone() });
    assert_eq!(waiting[0].prev_lsn, Lsn::new(2));
    // The host is told on its next append; it goes on on the new branch.
    let writer = IntentWriter::default().with_notify(false);
    let mut conn = pool.acquire().await.unwrap();
    let refused = writer.append(&mut conn, &main, Lsn::new(6), b"6").await;
    assert!(matches!(refused, Err(Error::BranchAbandoned { at, .. }) if at == Lsn::new(2)));
    writer
        .append(&mut conn, &discarded.live, Lsn::new(3), b"3'")
        .await
        .unwrap();

    // A consumer that got 1..=2 (and, say, 3 before the branch parked) ends with main@1..=2,
    // then after@3: the marker undid what it had of the discarded tail.
    let mut model = FoldModel::new();
    for event in outbox.drain_outbox(&main.tenant, 100).await.unwrap() {
        model.deliver(&event).unwrap();
    }
    let mut consumer = FoldModel::new();
    let delivered: Vec<_> = (1..=3)
        .map(|lsn| testkit::intent(&main, lsn).payload("x").build())
        .collect();
    for event in &delivered {
        consumer.deliver(event).unwrap();
    }
    for event in outbox.drain_outbox(&main.tenant, 100).await.unwrap() {
        let outcome = consumer.deliver(&event).unwrap();
        assert_ne!(outcome, FoldOutcome::Parked, "{event:?}");
    }
    let live: Vec<String> = consumer
        .projection()
        .iter()
        .map(|(key, _)| format!("{}@{}", key.branch.branch, key.lsn))
        .collect();
    assert_eq!(live, ["main@1", "main@2", "after@3"]);
    assert_eq!(
        model.held_back(),
        1,
        "without main@1..=2 the new branch waits"
    );
}

#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_closed_run_stays_closed_and_only_a_parked_branch_is_discarded(pool: PgPool) {
    let main = key("closed", "main");
    let outbox = parked(&pool, &main, true).await;
    // Not parked: refused, nothing changed.
    let other = key("other", "main");
    let writer = IntentWriter::default().with_notify(false);
    let mut conn = pool.acquire().await.unwrap();
    writer.open_run(&mut conn, &other).await.unwrap();
    let refused = outbox
        .discard_branch(&other, &BranchId::new("x").unwrap())
        .await;
    assert!(
        matches!(refused, Err(Error::NotParked { .. })),
        "{refused:?}"
    );

    let discarded = outbox
        .discard_branch(&main, &BranchId::new("after").unwrap())
        .await
        .unwrap();
    assert_eq!(discarded.discarded, 3, "3..=5; the end marker moves");
    let waiting: Vec<(String, u64, bool)> = outbox
        .drain_outbox(&main.tenant, 100)
        .await
        .unwrap()
        .into_iter()
        .filter(|event| event.key.branch.run == main.run)
        .map(|event| {
            (
                event.key.branch.branch.to_string(),
                event.key.lsn.get(),
                event.is_end(),
            )
        })
        .collect();
    assert_eq!(
        waiting,
        [("main".to_owned(), 7, false), ("after".to_owned(), 3, true)],
        "the marker, then the run's end on the new branch"
    );
    let refused = writer
        .append(&mut conn, &discarded.live, Lsn::new(3), b"3")
        .await;
    assert!(
        matches!(refused, Err(Error::RunClosed { .. })),
        "{refused:?}"
    );
}

/// A fork onto a branch the run already has (a rewind's or a discard's new branch) is refused
/// naming that branch, and changes nothing: the branch stays parked, its events wait.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_fork_onto_an_existing_branch_is_refused_naming_it(pool: PgPool) {
    let main = key("taken", "main");
    let writer = IntentWriter::default().with_notify(false);
    let mut conn = pool.acquire().await.unwrap();
    let outbox = parked(&pool, &main, false).await;

    let refused = writer
        .rewind(&mut conn, &main, Lsn::new(2), main.branch.clone())
        .await;
    assert!(
        matches!(&refused, Err(Error::BranchExists { branch }) if *branch == main),
        "{refused:?}"
    );
    let refused = outbox.discard_branch(&main, &main.branch).await;
    assert!(
        matches!(&refused, Err(Error::BranchExists { branch }) if *branch == main),
        "{refused:?}"
    );
    assert_eq!(
        outbox.parked_branches().await.unwrap().len(),
        1,
        "still parked"
    );
    let waiting: Vec<u64> = outbox
        .drain_outbox(&main.tenant, 100)
        .await
        .unwrap()
        .iter()
        .map(|event| event.key.lsn.get())
        .collect();
    assert_eq!(waiting, [3, 4, 5]);
}

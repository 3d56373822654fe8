//! The outbox on real PostgreSQL: transactional append, serialised branches, drain, ack, rewind.
use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::Acquire;
use sqlx::PgPool;
use store::{
    BranchId, BranchKey, Error, EventKey, EventKind, Fence, IntentWriter, Lsn, Outbox, OutboxEvent,
    TenantId,
};
use testkit::branch as key;

fn lsns_by_branch(events: &[OutboxEvent]) -> BTreeMap<BranchKey, Vec<u64>> {
    let mut by_branch: BTreeMap<BranchKey, Vec<u64>> = BTreeMap::new();
    for event in events {
        by_branch
            .entry(event.key.branch.clone())
            .or_default()
            .push(event.key.lsn.get());
    }
    by_branch
}

async fn count_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM relay_outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The intent lives and dies with the host's state: that is the whole point of an outbox.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn committed_intents_remain_and_rolled_back_ones_vanish(pool: PgPool) {
    let writer = IntentWriter::default();
    let outbox = Outbox::new(pool.clone());
    let branch = key("t1", "r1", "b1");

    let mut tx = pool.begin().await.unwrap();
    writer.open_run(&mut tx, &branch).await.unwrap();
    writer
        .append(&mut tx, &branch, Lsn::new(1), b"one")
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    writer
        .append(&mut tx, &branch, Lsn::new(2), b"two")
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let drained = outbox.drain_outbox(&branch.tenant, 100).await.unwrap();
    assert_eq!(drained.len(), 1);
    assert_eq!(drained[0].key.lsn, Lsn::new(1));
    assert_eq!(drained[0].payload, b"one");
    assert_eq!(drained[0].prev_lsn, Lsn::ZERO);

    // The rolled-back Lsn 2 was never taken: the branch head is still 1.
    writer
        .append(
            &mut pool.acquire().await.unwrap(),
            &branch,
            Lsn::new(2),
            b"two again",
        )
        .await
        .unwrap();
    assert_eq!(
        outbox
            .drain_outbox(&branch.tenant, 100)
            .await
            .unwrap()
            .len(),
        2
    );
}

/// Bad input is refused with a typed error and nothing written. What the writer can judge
/// alone is refused before any SQL runs (the host's transaction stays usable); what only the
/// database can judge aborts the host's transaction, so its state cannot commit without its
/// intent, and a savepoint lets a host go on.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn bad_appends_are_refused_with_nothing_written(pool: PgPool) {
    let writer = IntentWriter::new(16);
    let branch = key("t1", "r1", "b1");
    writer
        .open_run(&mut pool.acquire().await.unwrap(), &branch)
        .await
        .unwrap();
    writer
        .append(
            &mut pool.acquire().await.unwrap(),
            &branch,
            Lsn::new(5),
            b"five",
        )
        .await
        .unwrap();

    let mut tx = pool.begin().await.unwrap();
    let too_big = writer
        .append(&mut tx, &branch, Lsn::new(6), &[0u8; 17])
        .await;
    assert!(matches!(
        too_big,
        Err(Error::PayloadTooLarge { size: 17, max: 16 })
    ));
    let out_of_range = writer
        .append(&mut tx, &branch, Lsn::new(u64::MAX), b"x")
        .await;
    assert!(matches!(out_of_range, Err(Error::LsnOutOfRange { .. })));
    // Refusals of the database, each inside a savepoint.
    let mut savepoint = (&mut tx).begin().await.unwrap();
    let not_above = writer
        .append(&mut savepoint, &branch, Lsn::new(5), b"again")
        .await;
    assert!(matches!(not_above, Err(Error::LsnNotAboveHead { head, .. }) if head == Lsn::new(5)));
    savepoint.rollback().await.unwrap();
    let mut savepoint = (&mut tx).begin().await.unwrap();
    let unknown = writer
        .append(&mut savepoint, &key("t1", "r1", "nope"), Lsn::new(1), b"x")
        .await;
    assert!(matches!(unknown, Err(Error::UnknownBranch { .. })));
    savepoint.rollback().await.unwrap();
    // The host's transaction survived every refusal and can still commit its own work.
    writer
        .append(&mut tx, &branch, Lsn::new(6), b"six")
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count_rows(&pool).await, 2);

    assert!(matches!(
        TenantId::new(""),
        Err(store::InvalidId {
            kind: "tenant id",
            ..
        })
    ));
    let again = writer
        .open_run(&mut pool.acquire().await.unwrap(), &key("t1", "r1", "b2"))
        .await;
    assert!(matches!(again, Err(Error::RunAlreadyOpen { .. })));

    writer
        .rewind(
            &mut pool.acquire().await.unwrap(),
            &branch,
            Lsn::new(5),
            BranchId::new("b2").unwrap(),
        )
        .await
        .unwrap();
    let abandoned = writer
        .append(
            &mut pool.acquire().await.unwrap(),
            &branch,
            Lsn::new(7),
            b"seven",
        )
        .await;
    assert!(matches!(abandoned, Err(Error::BranchAbandoned { at, .. }) if at == Lsn::new(5)));
    let outside = writer
        .rewind(
            &mut pool.acquire().await.unwrap(),
            &key("t1", "r1", "b2"),
            Lsn::new(9),
            BranchId::new("b3").unwrap(),
        )
        .await;
    assert!(matches!(outside, Err(Error::ForkOutsideBranch { .. })));
    // Without a savepoint, a refusal of the database aborts the host's transaction: the state
    // written beside the refused intent cannot commit.
    sqlx::query("CREATE TABLE host_state (n int)")
        .execute(&pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO host_state VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let refused = writer.append(&mut tx, &branch, Lsn::new(8), b"x").await;
    assert!(matches!(refused, Err(Error::BranchAbandoned { .. })));
    let _ = tx.commit().await;
    let state: i64 = sqlx::query_scalar("SELECT count(*) FROM host_state")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        state, 0,
        "the host's state did not commit without its intent"
    );
    assert_eq!(
        count_rows(&pool).await,
        2,
        "the rewind abandoned lsn 6 and wrote its marker; nothing else was written"
    );
}

/// Lsn n+1 cannot commit while Lsn n is uncommitted, so a polling reader never sees n+1 alone.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_later_lsn_waits_for_the_earlier_commit(pool: PgPool) {
    let writer = IntentWriter::default();
    let outbox = Outbox::new(pool.clone());
    let branch = key("t1", "r1", "b1");
    writer
        .open_run(&mut pool.acquire().await.unwrap(), &branch)
        .await
        .unwrap();

    let mut first = pool.begin().await.unwrap();
    writer
        .append(&mut first, &branch, Lsn::new(1), b"1")
        .await
        .unwrap();

    let second = tokio::spawn({
        let (pool, writer, branch) = (pool.clone(), writer.clone(), branch.clone());
        async move {
            let mut tx = pool.begin().await.unwrap();
            writer
                .append(&mut tx, &branch, Lsn::new(2), b"2")
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
    });
    // Wait (with a deadline) until the second append is blocked on the branch row lock.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if waiting == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "second append never blocked"
        );
        tokio::task::yield_now().await;
    }
    assert!(!second.is_finished());
    assert!(
        outbox
            .drain_outbox(&branch.tenant, 10)
            .await
            .unwrap()
            .is_empty()
    );
    first.commit().await.unwrap();
    second.await.unwrap();
    let drained = outbox.drain_outbox(&branch.tenant, 10).await.unwrap();
    assert_eq!(lsns_by_branch(&drained)[&branch], vec![1, 2]);
    assert_eq!(drained[1].prev_lsn, Lsn::new(1));
}

/// Many concurrent appenders on one branch, a reader polling all along: every drain is a
/// gap-free prefix (each intent names the previous one as its predecessor) and extends the last.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn concurrent_appenders_expose_only_gap_free_prefixes(pool: PgPool) {
    let writer = IntentWriter::default();
    let outbox = Outbox::new(pool.clone());
    let branch = key("t1", "r1", "b1");
    writer
        .open_run(&mut pool.acquire().await.unwrap(), &branch)
        .await
        .unwrap();
    let next_lsn = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(1));

    let mut appenders = Vec::new();
    for _ in 0..6 {
        let (pool, writer, branch, next_lsn) = (
            pool.clone(),
            writer.clone(),
            branch.clone(),
            next_lsn.clone(),
        );
        appenders.push(tokio::spawn(async move {
            let mut committed = 0;
            for _ in 0..40 {
                let lsn = next_lsn.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut tx = pool.begin().await.unwrap();
                match writer
                    .append(&mut tx, &branch, Lsn::new(lsn), &lsn.to_be_bytes())
                    .await
                {
                    Ok(()) => {
                        // Some work inside the host transaction before it commits.
                        sqlx::query("SELECT pg_sleep(0.001)")
                            .execute(&mut *tx)
                            .await
                            .unwrap();
                        tx.commit().await.unwrap();
                        committed += 1;
                    }
                    // A higher Lsn committed first: this host lost the race and rolls back.
                    Err(Error::LsnNotAboveHead { .. }) => tx.rollback().await.unwrap(),
                    Err(other) => panic!("{other}"),
                }
            }
            committed
        }));
    }

    let mut last_seen: Vec<u64> = Vec::new();
    let mut polls = 0;
    while !appenders.iter().all(|task| task.is_finished()) || polls == 0 {
        polls += 1;
        let drained = outbox.drain_outbox(&branch.tenant, 10_000).await.unwrap();
        let mut expected_prev = Lsn::ZERO;
        for event in &drained {
            assert_eq!(event.prev_lsn, expected_prev, "gap before {}", event.key);
            expected_prev = event.key.lsn;
        }
        let lsns: Vec<u64> = drained.iter().map(|event| event.key.lsn.get()).collect();
        assert!(
            lsns.starts_with(&last_seen),
            "a drain lost or reordered what an earlier one saw"
        );
        last_seen = lsns;
    }
    let mut committed = 0;
    for task in appenders {
        committed += task.await.unwrap();
    }
    let drained = outbox.drain_outbox(&branch.tenant, 10_000).await.unwrap();
    assert_eq!(drained.len(), committed);
    assert!(
        committed > 40,
        "the race left too few commits to mean anything: {committed}"
    );
}

/// Per BranchKey ascending Lsn across interleaved tenants, runs and branches; acked rows are
/// never drained again; a rewind's abandoned tail never drains, its live prefix does.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn drain_orders_each_branch_and_skips_acked_and_abandoned(pool: PgPool) {
    let writer = IntentWriter::default();
    let outbox = Outbox::new(pool.clone());
    let tenants = ["ta", "tb", "tc"];
    let mut branches = Vec::new();
    for tenant in tenants {
        for run in ["r1", "r2"] {
            let branch = key(tenant, run, "main");
            writer
                .open_run(&mut pool.acquire().await.unwrap(), &branch)
                .await
                .unwrap();
            branches.push(branch);
        }
    }
    // Interleave: round-robin over branches, Lsns with gaps of varying size per branch.
    for step in 1..=20u64 {
        for (index, branch) in branches.iter().enumerate() {
            let lsn = step * (index as u64 + 1);
            writer
                .append(
                    &mut pool.acquire().await.unwrap(),
                    branch,
                    Lsn::new(lsn),
                    format!("{branch}@{lsn}").as_bytes(),
                )
                .await
                .unwrap();
        }
    }
    // Rewind ta/r1 at Lsn 10: its 11..=20 are abandoned, 1..=10 stay.
    let rewound = writer
        .rewind(
            &mut pool.acquire().await.unwrap(),
            &branches[0],
            Lsn::new(10),
            BranchId::new("alt").unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(rewound.abandoned, 10);
    for lsn in 11..=13 {
        writer
            .append(
                &mut pool.acquire().await.unwrap(),
                &rewound.live,
                Lsn::new(lsn),
                b"alt",
            )
            .await
            .unwrap();
    }

    let tenant_a = TenantId::new("ta").unwrap();
    // Drain in small batches, acking as we go: every branch stays ascending and nothing repeats.
    let mut shipped: BTreeMap<BranchKey, Vec<u64>> = BTreeMap::new();
    let mut markers = Vec::new();
    loop {
        let batch = outbox.drain_outbox(&tenant_a, 7).await.unwrap();
        if batch.is_empty() {
            break;
        }
        for event in &batch {
            if event.is_rewind() {
                // The marker comes after every intent of its branch.
                assert_eq!(shipped[&event.key.branch].last(), Some(&10));
                markers.push(event.clone());
            } else {
                assert!(!markers.iter().any(|m| m.key.branch == event.key.branch));
                shipped
                    .entry(event.key.branch.clone())
                    .or_default()
                    .push(event.key.lsn.get());
            }
            let forked = event.key.branch == rewound.live;
            assert_eq!(
                event.parent.as_ref(),
                forked.then_some(&branches[0].branch),
                "intents of a forked branch name their parent"
            );
        }
        let keys: Vec<EventKey> = batch.iter().map(|event| event.key.clone()).collect();
        assert_eq!(outbox.ack_outbox(&keys).await.unwrap(), keys.len() as u64);
        assert_eq!(
            outbox.ack_outbox(&keys).await.unwrap(),
            0,
            "re-acking is a no-op"
        );
    }
    assert_eq!(
        shipped[&branches[0]],
        (1..=10).collect::<Vec<_>>(),
        "live prefix only"
    );
    assert_eq!(shipped[&rewound.live], vec![11, 12, 13]);
    assert_eq!(markers.len(), 1, "one marker for the one rewind");
    let marker = &markers[0];
    assert_eq!(marker.key.branch, branches[0]);
    assert_eq!(
        marker.prev_lsn,
        Lsn::new(10),
        "the marker names the fork point"
    );
    assert_eq!(marker.key.lsn, Lsn::new(21), "above the old head");
    assert_eq!(
        marker.kind,
        EventKind::Rewind {
            to: rewound.live.branch.clone()
        }
    );
    assert_eq!(
        shipped[&branches[1]],
        (1..=20).map(|s| s * 2).collect::<Vec<_>>()
    );
    // Other tenants were untouched by tenant a's drain and acks.
    for tenant in ["tb", "tc"] {
        let drained = outbox
            .drain_outbox(&TenantId::new(tenant).unwrap(), 1000)
            .await
            .unwrap();
        let by_branch = lsns_by_branch(&drained);
        assert_eq!(by_branch.len(), 2);
        for lsns in by_branch.values() {
            assert_eq!(lsns.len(), 20);
            assert!(lsns.windows(2).all(|pair| pair[0] < pair[1]));
        }
    }
    let unknown = EventKey {
        branch: key("zz", "r", "b"),
        lsn: Lsn::new(1),
    };
    assert_eq!(outbox.ack_outbox(&[unknown]).await.unwrap(), 0);
}

/// Lag is observable: pending rows and oldest age per tenant, and which tenants have work.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn backlog_reports_pending_and_age_per_tenant(pool: PgPool) {
    let writer = IntentWriter::default();
    let outbox = Outbox::new(pool.clone());
    assert_eq!(outbox.oldest_wait().await.unwrap(), Duration::ZERO);
    for (tenant, n) in [("t1", 3u64), ("t2", 5), ("t3", 0)] {
        let branch = key(tenant, "r", "b");
        writer
            .open_run(&mut pool.acquire().await.unwrap(), &branch)
            .await
            .unwrap();
        for lsn in 1..=n {
            writer
                .append(
                    &mut pool.acquire().await.unwrap(),
                    &branch,
                    Lsn::new(lsn),
                    b"x",
                )
                .await
                .unwrap();
        }
    }
    let tenants = outbox.tenants_with_pending().await.unwrap();
    assert_eq!(
        tenants,
        vec![TenantId::new("t1").unwrap(), TenantId::new("t2").unwrap()]
    );
    let backlog = outbox.backlog().await.unwrap();
    assert_eq!(
        backlog.iter().map(|b| b.pending).collect::<Vec<_>>(),
        vec![3, 5]
    );
    assert!(
        backlog
            .iter()
            .all(|b| b.oldest_age < Duration::from_secs(60))
    );
    let idle = outbox
        .tenant_backlog(&TenantId::new("t3").unwrap())
        .await
        .unwrap();
    assert_eq!((idle.pending, idle.oldest_age), (0, Duration::ZERO));
    let busy = outbox
        .tenant_backlog(&TenantId::new("t2").unwrap())
        .await
        .unwrap();
    assert_eq!(busy.pending, 5);
    assert!(busy.oldest_age > Duration::ZERO);
    // A tenant's page: its waiting branches, the oldest waits first, with the Lsns waiting and
    // the count of them all past the limit.
    let second = key("t2", "r0", "b");
    writer
        .open_run(&mut pool.acquire().await.unwrap(), &second)
        .await
        .unwrap();
    writer
        .append(
            &mut pool.acquire().await.unwrap(),
            &second,
            Lsn::new(1),
            b"x",
        )
        .await
        .unwrap();
    let t2 = TenantId::new("t2").unwrap();
    let (branches, total) = outbox.tenant_branches(&t2, 10).await.unwrap();
    let shown: Vec<_> = branches
        .iter()
        .map(|b| {
            (
                b.branch.run.as_str().to_owned(),
                b.pending,
                b.first.get(),
                b.last.get(),
            )
        })
        .collect();
    assert_eq!(shown, [("r".into(), 5, 1, 5), ("r0".into(), 1, 1, 1)]);
    assert_eq!(total, 2);
    assert!(branches[0].oldest_age >= branches[1].oldest_age);
    let (first, total) = outbox.tenant_branches(&t2, 1).await.unwrap();
    assert_eq!((first.len(), total), (1, 2));
    assert_eq!(
        outbox
            .tenant_branches(&TenantId::new("t3").unwrap(), 10)
            .await
            .unwrap(),
        (Vec::new(), 0)
    );
    // Taken out again: what follows counts t2's five.
    sqlx::query("DELETE FROM relay_outbox WHERE tenant_id = 't2' AND run_id = 'r0'")
        .execute(&pool)
        .await
        .unwrap();
    // The gauges' bounded read: the same figures up to its cap, and a tenant without intents
    // reads as zero.
    let asked: Vec<TenantId> = ["t1", "t2", "t3"]
        .iter()
        .map(|t| TenantId::new(t).unwrap())
        .collect();
    let bounded = outbox.backlog_of(&asked, 4).await.unwrap();
    assert_eq!(
        bounded.iter().map(|b| b.pending).collect::<Vec<_>>(),
        vec![3, 4, 0],
        "t2's 5 intents are counted up to the cap of 4"
    );
    assert!(
        bounded[0].oldest_age > Duration::ZERO && bounded[0].oldest_age < Duration::from_secs(60)
    );
    assert_eq!(bounded[2].oldest_age, Duration::ZERO);
    // The console's reads: the longest waits first, paged, with the total; t1 was written first.
    let names = |page: &[store::Backlog]| {
        page.iter()
            .map(|b| b.tenant.as_str().to_owned())
            .collect::<Vec<_>>()
    };
    let (first, total) = outbox.backlog_worst_first(0, 1).await.unwrap();
    assert_eq!((names(&first), total), (vec!["t1".to_owned()], 2));
    let (second, total) = outbox.backlog_worst_first(1, 1).await.unwrap();
    assert_eq!((names(&second), total), (vec!["t2".to_owned()], 2));
    assert_eq!(second[0].pending, 5);
    let (past, total) = outbox.backlog_worst_first(5, 1).await.unwrap();
    assert_eq!(
        (past.len(), total),
        (0, 2),
        "past the last page, the total still counts"
    );
    // The oldest wait of any tenant, without a pass over the rows: t1's, read later.
    let oldest = outbox.oldest_wait().await.unwrap();
    assert!(
        oldest >= first[0].oldest_age && oldest < Duration::from_secs(60),
        "{oldest:?}"
    );
}

/// A release wakes the relays on the tenant's channel, and only when it released something.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_release_wakes_the_relays_only_when_it_released_a_branch(
    options: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let pool = options.connect_with(connect.clone()).await.unwrap();
    let url = store::scratch::database_url(connect.get_database().unwrap());
    let outbox = Outbox::new(pool.clone());
    let writer = IntentWriter::default().with_notify(false);
    let parked = key("parked", "r", "b");
    let mut conn = pool.acquire().await.unwrap();
    writer.open_run(&mut conn, &parked).await.unwrap();
    writer
        .append(&mut conn, &parked, Lsn::new(1), b"x")
        .await
        .unwrap();
    outbox
        .park_branch(
            &parked,
            "nacked",
            5,
            Duration::from_secs(1),
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    let mut wakeups = store::Wakeups::connect(&url).await.unwrap();
    let idle = TenantId::new("idle").unwrap();
    assert_eq!(outbox.release(&idle, None, None).await.unwrap(), 0);
    assert_eq!(
        outbox
            .release(&parked.tenant, Some(&parked.run), None)
            .await
            .unwrap(),
        1
    );
    assert!(outbox.parked_branches().await.unwrap().is_empty());
    // Notifications arrive in commit order: the first must be the second release's.
    let first = tokio::time::timeout(Duration::from_secs(10), wakeups.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first, parked.tenant);
}

/// The relay's one-round-trip step retires exactly what it is given and returns what follows,
/// never what it just retired.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn ack_and_drain_retires_and_returns_the_next_prefix(pool: PgPool) {
    let writer = IntentWriter::default();
    let outbox = Outbox::new(pool.clone());
    let branch = key("t1", "r1", "b1");
    writer
        .open_run(&mut pool.acquire().await.unwrap(), &branch)
        .await
        .unwrap();
    for lsn in 1..=10 {
        writer
            .append(
                &mut pool.acquire().await.unwrap(),
                &branch,
                Lsn::new(lsn),
                b"x",
            )
            .await
            .unwrap();
    }
    let first = outbox.drain_outbox(&branch.tenant, 4).await.unwrap();
    let keys: Vec<EventKey> = first.iter().map(|event| event.key.clone()).collect();
    let next = outbox
        .ack_and_drain(&Fence::open(), &keys, &branch.tenant, 4, &[])
        .await
        .unwrap();
    assert_eq!(lsns_by_branch(&next)[&branch], vec![5, 6, 7, 8]);
    assert_eq!(count_rows(&pool).await, 6);
    let last = outbox
        .ack_and_drain(&Fence::open(), &[], &branch.tenant, 100, &[])
        .await
        .unwrap();
    assert_eq!(lsns_by_branch(&last)[&branch], vec![5, 6, 7, 8, 9, 10]);
    // With 5..=8 in flight, the next drain starts after 8 on that branch only.
    let other = key("t1", "r2", "b1");
    writer
        .open_run(&mut pool.acquire().await.unwrap(), &other)
        .await
        .unwrap();
    writer
        .append(
            &mut pool.acquire().await.unwrap(),
            &other,
            Lsn::new(1),
            b"y",
        )
        .await
        .unwrap();
    let newest_in_flight = EventKey {
        branch: branch.clone(),
        lsn: Lsn::new(8),
    };
    let after = outbox
        .drain_after(&Fence::open(), &branch.tenant, 100, &[newest_in_flight])
        .await
        .unwrap();
    let by_branch = lsns_by_branch(&after);
    assert_eq!(by_branch[&branch], vec![9, 10]);
    assert_eq!(by_branch[&other], vec![1]);
}

/// A writer with NOTIFY off wakes nobody; the default one wakes listeners on commit.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn notify_is_sent_on_commit_only_when_enabled(
    options: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    let pool = options.connect_with(connect.clone()).await.unwrap();
    // The test's database on DATABASE_URL's server (not a fixed address: another server failed).
    let url = store::scratch::database_url(connect.get_database().unwrap());
    let mut wakeups = store::Wakeups::connect(&url).await.unwrap();
    let silent = key("quiet", "r", "b");
    let loud = key("loud", "r", "b");
    for (branch, writer) in [
        (&silent, IntentWriter::default().with_notify(false)),
        (&loud, IntentWriter::default()),
    ] {
        let mut tx = pool.begin().await.unwrap();
        writer.open_run(&mut tx, branch).await.unwrap();
        writer
            .append(&mut tx, branch, Lsn::new(1), b"x")
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    // Notifications arrive in commit order: the first one must be the second commit's.
    let first = tokio::time::timeout(Duration::from_secs(10), wakeups.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first, loud.tenant);
}

/// A drain stops at its byte cap (never splitting an event), but always returns the first
/// event, however large: memory is bounded in bytes and a big payload never stalls a tenant.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_drain_stops_at_its_byte_cap_but_always_takes_the_first_event(pool: PgPool) {
    let writer = IntentWriter::default();
    let outbox = Outbox::new(pool.clone());
    let branch = key("t1", "r1", "b1");
    writer
        .open_run(&mut pool.acquire().await.unwrap(), &branch)
        .await
        .unwrap();
    for (lsn, size) in [(1u64, 3000usize), (2, 1000), (3, 1000), (4, 1000), (5, 10)] {
        writer
            .append(
                &mut pool.acquire().await.unwrap(),
                &branch,
                Lsn::new(lsn),
                &vec![7u8; size],
            )
            .await
            .unwrap();
    }
    let drain = |bytes: u64| {
        let outbox = outbox.clone();
        let tenant = branch.tenant.clone();
        async move {
            let limit = store::DrainLimit { events: 100, bytes };
            let drained = outbox
                .drain_after(&Fence::open(), &tenant, limit, &[])
                .await
                .unwrap();
            drained.iter().map(|e| e.key.lsn.get()).collect::<Vec<_>>()
        }
    };
    assert_eq!(
        drain(100).await,
        vec![1],
        "the first event comes even above the cap"
    );
    assert_eq!(drain(4000).await, vec![1, 2]);
    assert_eq!(drain(4999).await, vec![1, 2]);
    assert_eq!(drain(5000).await, vec![1, 2, 3]);
    assert_eq!(drain(1 << 30).await, vec![1, 2, 3, 4, 5]);
    let after_first = [EventKey {
        branch: branch.clone(),
        lsn: Lsn::new(1),
    }];
    let limit = store::DrainLimit {
        events: 100,
        bytes: 2000,
    };
    let rest = outbox
        .drain_after(&Fence::open(), &branch.tenant, limit, &after_first)
        .await
        .unwrap();
    let lsns: Vec<u64> = rest.iter().map(|e| e.key.lsn.get()).collect();
    assert_eq!(lsns, vec![2, 3]);
}

/// A parked branch waits its delay; one whose parked_at lies in the future (PostgreSQL's clock
/// stepped back past the parking) is drained again at once rather than held for the length of
/// the step.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_parked_branch_is_held_its_delay_and_not_the_length_of_a_step_back(pool: PgPool) {
    let outbox = Outbox::new(pool.clone());
    let writer = IntentWriter::default().with_notify(false);
    let parked = key("parked", "r", "b");
    let mut conn = pool.acquire().await.unwrap();
    writer.open_run(&mut conn, &parked).await.unwrap();
    writer
        .append(&mut conn, &parked, Lsn::new(1), b"x")
        .await
        .unwrap();
    let delay = Duration::from_secs(600);
    outbox
        .park_branch(&parked, "nacked", 5, Duration::from_secs(1), delay)
        .await
        .unwrap();
    async fn drained(outbox: &Outbox, tenant: &TenantId) -> usize {
        outbox
            .ack_and_drain(&Fence::open(), &[], tenant, 10, &[])
            .await
            .unwrap()
            .len()
    }
    assert_eq!(
        drained(&outbox, &parked.tenant).await,
        0,
        "held for its delay"
    );
    // The clock stepped back by an hour since: parked an hour from now, retry in 70 minutes.
    sqlx::query(
        "UPDATE relay_parked_branch
            SET parked_at = now() + interval '1 hour', retry_at = now() + interval '70 minutes'",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        drained(&outbox, &parked.tenant).await,
        1,
        "not held for the step"
    );
}

/// The steady-state call skips a parked branch whole beside the branches in flight, drains
/// every other branch, leaves another tenant's park alone, unparks a branch once one of its
/// events is acked, and drains a parked branch again once its retry is due.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn ack_and_drain_skips_parked_and_in_flight_branches_and_an_ack_unparks(pool: PgPool) {
    let outbox = Outbox::new(pool.clone());
    let writer = IntentWriter::default().with_notify(false);
    let parked = key("t", "r1", "parked");
    let also_parked = key("t", "r4", "also-parked");
    let flying = key("t", "r2", "flying");
    let free = key("t", "r3", "free");
    let elsewhere = key("u", "r1", "parked");
    let mut conn = pool.acquire().await.unwrap();
    for branch in [&parked, &also_parked, &flying, &free, &elsewhere] {
        writer.open_run(&mut conn, branch).await.unwrap();
        for lsn in 1..=3 {
            writer
                .append(&mut conn, branch, Lsn::new(lsn), b"x")
                .await
                .unwrap();
        }
    }
    let hour = Duration::from_secs(3600);
    let zero = Duration::ZERO;
    outbox
        .park_branch(&parked, "nacked", 5, zero, hour)
        .await
        .unwrap();
    outbox
        .park_branch(&also_parked, "nacked", 5, zero, hour)
        .await
        .unwrap();
    outbox
        .park_branch(&elsewhere, "nacked", 5, zero, hour)
        .await
        .unwrap();
    let tenant = &parked.tenant;
    let in_flight = [EventKey {
        branch: flying.clone(),
        lsn: Lsn::new(2),
    }];
    let drained = outbox
        .ack_and_drain(&Fence::open(), &[], tenant, 100, &in_flight)
        .await
        .unwrap();
    let by_branch = lsns_by_branch(&drained);
    assert_eq!(by_branch.get(&parked), None, "parked: skipped whole");
    assert_eq!(by_branch.get(&also_parked), None, "parked: skipped whole");
    assert_eq!(by_branch[&flying], vec![3], "in flight up to 2");
    assert_eq!(by_branch[&free], vec![1, 2, 3]);
    assert_eq!(
        lsns_by_branch(
            &outbox
                .ack_and_drain(&Fence::open(), &[], &elsewhere.tenant, 100, &[])
                .await
                .unwrap()
        )
        .get(&elsewhere),
        None,
        "the other tenant's park holds"
    );
    // An ack of the parked branch's event (a batch confirmed before it parked) unparks it,
    // and only it: the tenant's other parked branch and the other tenant's park stay.
    let confirmed = [EventKey {
        branch: parked.clone(),
        lsn: Lsn::new(1),
    }];
    let drained = outbox
        .ack_and_drain(&Fence::open(), &confirmed, tenant, 100, &[])
        .await
        .unwrap();
    let by_branch = lsns_by_branch(&drained);
    assert_eq!(by_branch[&parked], vec![2, 3]);
    assert_eq!(by_branch.get(&also_parked), None, "still parked");
    let mut still: Vec<BranchKey> = outbox
        .parked_branches()
        .await
        .unwrap()
        .into_iter()
        .map(|parked| parked.branch)
        .collect();
    still.sort();
    let mut expected = vec![also_parked.clone(), elsewhere.clone()];
    expected.sort();
    assert_eq!(still, expected);
    // A park whose retry is due is drained again.
    outbox
        .park_branch(&parked, "nacked", 5, zero, zero)
        .await
        .unwrap();
    let drained = outbox
        .ack_and_drain(&Fence::open(), &[], tenant, 100, &[])
        .await
        .unwrap();
    assert_eq!(lsns_by_branch(&drained)[&parked], vec![2, 3]);
}

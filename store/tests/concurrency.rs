//! SQL-level races, made deterministic: one connection holds a transaction open while another
//! runs the exact statement the relay runs; the test waits until PostgreSQL shows the second
//! one blocked on a lock (no sleeps), then lets the first commit.
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};
use store::{
    BranchId, BranchKey, Bucket, Claimable, Error, EventKey, Fence, IntentWriter, LEASE_BUCKETS,
    Lease, LeaseEpoch, LeaseStore, Lsn, Outbox, RelayId, RunId, TenantId, bucket_of,
};
use testkit::branch as key;

/// What a relay may claim once it has seen the lease rows (read now) unchanged for `seen_for`:
/// free buckets at once, held ones after the longer of `ttl` and the row's TTL. In the relay the
/// supervisor's sightings apply this rule, on the relay's own clock; here it is applied to one
/// read, so what a test claims with it exercises the claim's SQL (the epoch and beat it must
/// still find, the lock an ack holds), not the rule.
async fn claimable_after(leases: &LeaseStore, ttl: Duration, seen_for: Duration) -> Vec<Claimable> {
    leases
        .survey()
        .await
        .unwrap()
        .into_iter()
        .filter(|row| row.owner.is_none() || seen_for >= ttl.max(row.ttl))
        .map(|row| Claimable {
            bucket: row.bucket,
            epoch: row.epoch,
            beat: row.beat,
        })
        .collect()
}

/// Claims for `relay` up to `n` buckets of those [`claimable_after`] `seen_for`.
async fn claim_seen_for(
    leases: &LeaseStore,
    relay: &RelayId,
    ttl: Duration,
    n: u16,
    seen_for: Duration,
) -> Vec<(Bucket, LeaseEpoch)> {
    let claimable = claimable_after(leases, ttl, seen_for).await;
    leases.claim(relay, ttl, n, &claimable).await.unwrap()
}

/// What a relay may claim of `bucket` alone once it has seen the rows unchanged for a TTL.
async fn stale_bucket(leases: &LeaseStore, ttl: Duration, bucket: Bucket) -> Vec<Claimable> {
    claimable_after(leases, ttl, ttl)
        .await
        .into_iter()
        .filter(|claimable| claimable.bucket == bucket)
        .collect()
}

async fn claim_free(
    leases: &LeaseStore,
    relay: &RelayId,
    ttl: Duration,
    n: u16,
) -> Vec<(Bucket, LeaseEpoch)> {
    claim_seen_for(leases, relay, ttl, n, Duration::ZERO).await
}

async fn claim_stale(
    leases: &LeaseStore,
    relay: &RelayId,
    ttl: Duration,
    n: u16,
) -> Vec<(Bucket, LeaseEpoch)> {
    claim_seen_for(leases, relay, ttl, n, ttl).await
}

async fn connect(connect: &sqlx::postgres::PgConnectOptions) -> PgConnection {
    PgConnection::connect_with(connect).await.unwrap()
}

/// Waits until some backend runs a statement containing `fragment` and waits on a lock.
async fn blocked_on_lock(pool: &PgPool, fragment: &str) {
    let started = Instant::now();
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'
                AND pid <> pg_backend_pid()",
        )
        .bind(fragment)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no statement with {fragment:?} ever blocked"
        );
        tokio::task::yield_now().await;
    }
}

/// `close_run` of `branch`'s run on a connection of its own, in the background (it may wait
/// on a lock the test holds).
fn close_on_another_connection(
    pool: &PgPool,
    writer: &IntentWriter,
    branch: &BranchKey,
) -> tokio::task::JoinHandle<Result<store::Closed, store::Error>> {
    let (pool, writer, branch) = (pool.clone(), writer.clone(), branch.clone());
    tokio::spawn(async move {
        let mut conn = pool.acquire().await.unwrap();
        writer
            .close_run(&mut conn, &branch.tenant, &branch.run)
            .await
    })
}

async fn appended(pool: &PgPool, branch: &BranchKey, lsns: std::ops::RangeInclusive<u64>) {
    let writer = IntentWriter::default().with_notify(false);
    let mut conn = pool.acquire().await.unwrap();
    if *lsns.start() == 1 {
        writer.open_run(&mut conn, branch).await.unwrap();
    }
    for lsn in lsns {
        writer
            .append(&mut conn, branch, Lsn::new(lsn), b"x")
            .await
            .unwrap();
    }
}

fn at(branch: &BranchKey, lsn: u64) -> EventKey {
    EventKey {
        branch: branch.clone(),
        lsn: Lsn::new(lsn),
    }
}

/// The race of the issue: lsn 1 and 2 are in flight and confirmed; a rewind at 1 deletes 2 and
/// 3 and commits while the relay's ack of 2 waits on that row. The relay's next drain must not
/// return lsn 3: it was abandoned before the drain read anything. (With the former single
/// statement `WITH acked AS (DELETE ...) SELECT ...` it did: one snapshot for both.)
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_drain_never_returns_what_a_rewind_deleted_while_the_ack_waited(
    pool_options: sqlx::postgres::PgPoolOptions,
    options: sqlx::postgres::PgConnectOptions,
) {
    let pool = pool_options.connect_with(options.clone()).await.unwrap();
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=3).await;
    let outbox = Outbox::new(pool.clone());

    let mut host = connect(&options).await;
    let mut rewind_tx = host.begin().await.unwrap();
    IntentWriter::default()
        .rewind(
            &mut rewind_tx,
            &branch,
            Lsn::new(1),
            BranchId::new("alt").unwrap(),
        )
        .await
        .unwrap();

    let relay = {
        let outbox = outbox.clone();
        let tenant = branch.tenant.clone();
        let shipped = vec![at(&branch, 1), at(&branch, 2)];
        tokio::spawn(async move {
            outbox
                .ack_and_drain(&Fence::open(), &shipped, &tenant, 100, &[])
                .await
        })
    };
    blocked_on_lock(&pool, "relay_ack_and_drain").await;
    rewind_tx.commit().await.unwrap();

    let drained = relay.await.unwrap().unwrap();
    let intents: Vec<u64> = drained
        .iter()
        .filter(|event| !event.is_rewind())
        .map(|event| event.key.lsn.get())
        .collect();
    assert!(
        intents.is_empty(),
        "abandoned intents {intents:?} drained after the rewind committed"
    );
    // What the drain does see, it sees fresh: the rewind's marker.
    assert_eq!(drained.len(), 1);
    assert!(drained[0].is_rewind());
}

/// The same race with another relay's ack in place of the rewind: rows it retired while this
/// ack waited are never drained again (they would be published twice).
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_drain_never_returns_what_another_ack_retired_while_it_waited(
    pool_options: sqlx::postgres::PgPoolOptions,
    options: sqlx::postgres::PgConnectOptions,
) {
    let pool = pool_options.connect_with(options.clone()).await.unwrap();
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=3).await;
    let outbox = Outbox::new(pool.clone());
    let mut other = connect(&options).await;
    let mut other_tx = other.begin().await.unwrap();
    sqlx::query("DELETE FROM relay_outbox WHERE lsn <= 3")
        .execute(&mut *other_tx)
        .await
        .unwrap();
    let relay = {
        let outbox = outbox.clone();
        let tenant = branch.tenant.clone();
        let shipped = vec![at(&branch, 1)];
        tokio::spawn(async move {
            outbox
                .ack_and_drain(&Fence::open(), &shipped, &tenant, 100, &[])
                .await
        })
    };
    blocked_on_lock(&pool, "relay_ack_and_drain").await;
    other_tx.commit().await.unwrap();
    let drained = relay.await.unwrap().unwrap();
    assert!(
        drained.is_empty(),
        "drained {drained:?} after it was retired"
    );
}

/// A takeover bumps the epoch; the former owner's acks and drains are refused by PostgreSQL
/// (its own fence may still look open: clocks are not trusted for this).
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_takeover_fences_the_former_owner_in_postgres(pool: PgPool) {
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=3).await;
    let outbox = Outbox::new(pool.clone());
    let leases = LeaseStore::new(pool.clone());
    let ttl = Duration::from_secs(60);
    let (first, second) = (RelayId::generate(), RelayId::generate());
    let claimed = claim_free(&leases, &first, ttl, LEASE_BUCKETS).await;
    assert_eq!(claimed.len(), usize::from(LEASE_BUCKETS));
    let bucket = bucket_of(&branch.tenant);
    // The fence the first relay's drainers hold.
    let epoch = claimed.iter().find(|(b, _)| *b == bucket).unwrap().1;
    let stale = Lease::new(bucket, first.clone(), epoch, Instant::now() + ttl).fence();

    // Every row names the first relay while it holds its leases: nothing is free.
    let rows = leases.survey().await.unwrap();
    assert!(
        rows.iter()
            .all(|row| row.owner.as_deref() == Some(first.as_str())),
        "{rows:?}"
    );
    // The first relay stalls past its lease (no renewal for a TTL), the second takes a bucket
    // over: the tenant's.
    let tenants_bucket = stale_bucket(&leases, ttl, bucket).await;
    let taken = leases
        .claim(&second, ttl, 1, &tenants_bucket)
        .await
        .unwrap();
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].0, bucket);
    let old_epoch = stale.lease().unwrap().2;
    assert_eq!(
        taken[0].1,
        LeaseEpoch(old_epoch.0 + 1),
        "each takeover is a new epoch"
    );

    assert!(
        stale.is_open(),
        "the stale relay's clock says it still owns the bucket"
    );
    let refused = outbox
        .ack_and_drain(&stale, &[at(&branch, 1)], &branch.tenant, 10, &[])
        .await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    let refused = outbox
        .ack_fenced(&stale, &branch.tenant, &[at(&branch, 1)])
        .await;
    assert!(matches!(refused, Err(Error::Fenced { .. })));
    assert_eq!(
        outbox.drain_outbox(&branch.tenant, 10).await.unwrap().len(),
        3
    );

    // The first relay's renewal shows the loss: every bucket but the one taken comes back.
    let renewed = leases.renew(&first, ttl, &claimed).await.unwrap();
    assert_eq!(renewed.len(), usize::from(LEASE_BUCKETS) - 1);
    assert!(renewed.iter().all(|(b, _)| *b != bucket));

    // The new owner acks and drains normally.
    let fence = Lease::new(bucket, second.clone(), taken[0].1, Instant::now() + ttl).fence();
    let next = outbox
        .ack_and_drain(&fence, &[at(&branch, 1)], &branch.tenant, 10, &[])
        .await
        .unwrap();
    assert_eq!(next.len(), 2);
}

/// A fence that closed in the relay (by time: at 90% of the TTL, counted from the renewal's
/// send; or revoked) while the row is still the relay's: what the broker confirmed is still
/// acked, because PostgreSQL finds the lease current, and nothing more is drained. Once
/// another relay took the bucket over, the same ack is refused and nothing changes.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_fence_closed_in_the_relay_acks_what_postgres_still_fences_and_drains_nothing(
    pool: PgPool,
) {
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=4).await;
    let outbox = Outbox::new(pool.clone());
    let leases = LeaseStore::new(pool.clone());
    let ttl = Duration::from_secs(60);
    let (first, second) = (RelayId::generate(), RelayId::generate());
    let bucket = bucket_of(&branch.tenant);
    let claimed = claim_free(&leases, &first, ttl, LEASE_BUCKETS).await;
    let epoch = claimed.iter().find(|(b, _)| *b == bucket).unwrap().1;
    // Closed in the process (as by time; a fence's clock has millisecond steps, so the test
    // closes it outright).
    let lease = Lease::new(bucket, first.clone(), epoch, Instant::now() + ttl);
    let lapsed = lease.fence();
    lease.revoke();
    assert!(!lapsed.is_open());

    let acked = outbox
        .ack_and_drain(&lapsed, &[at(&branch, 1)], &branch.tenant, 10, &[])
        .await;
    assert!(matches!(acked, Err(Error::Fenced { .. })), "{acked:?}");
    let left: Vec<i64> = sqlx::query_scalar("SELECT lsn FROM relay_outbox ORDER BY lsn")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, vec![2, 3, 4], "the confirmed event is retired");
    let nothing = outbox
        .ack_and_drain(&lapsed, &[], &branch.tenant, 10, &[])
        .await;
    assert!(matches!(nothing, Err(Error::Fenced { .. })), "{nothing:?}");

    // Taken over: the same relay's ack is refused by PostgreSQL.
    assert_eq!(
        claim_stale(&leases, &second, ttl, LEASE_BUCKETS)
            .await
            .len(),
        128
    );
    let refused = outbox
        .ack_fenced(&lapsed, &branch.tenant, &[at(&branch, 2)])
        .await;
    assert!(matches!(refused, Err(Error::Fenced { .. })), "{refused:?}");
    assert_eq!(
        outbox.drain_outbox(&branch.tenant, 10).await.unwrap().len(),
        3
    );
}

/// An ack in progress holds its bucket: a takeover claimed meanwhile skips the bucket instead
/// of overlapping with it, and gets it once the ack is done.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_ack_in_progress_holds_off_a_takeover(
    pool_options: sqlx::postgres::PgPoolOptions,
    options: sqlx::postgres::PgConnectOptions,
) {
    let pool = pool_options.connect_with(options.clone()).await.unwrap();
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=2).await;
    let leases = LeaseStore::new(pool.clone());
    let ttl = Duration::from_secs(60);
    let (first, second) = (RelayId::generate(), RelayId::generate());
    let bucket = bucket_of(&branch.tenant);
    let claimed = claim_free(&leases, &first, ttl, LEASE_BUCKETS).await;
    let epoch = claimed.iter().find(|(b, _)| *b == bucket).unwrap().1;

    // The first relay's ack, inside a transaction held open: the exact function the relay calls.
    let mut acking = connect(&options).await;
    let mut ack_tx = acking.begin().await.unwrap();
    sqlx::query(
        "SELECT count(*) FROM relay_ack_and_drain($1, $2, $3, $4, $5, $6, $7, 0, 0, '{}', '{}', '{}')",
    )
    .bind(i32::from(bucket.0))
    .bind(first.as_str())
    .bind(epoch.0)
    .bind(branch.tenant.as_str())
    .bind(vec![branch.run.as_str()])
    .bind(vec![branch.branch.as_str()])
    .bind(vec![1i64])
    .fetch_one(&mut *ack_tx)
    .await
    .unwrap();
    // Meanwhile another relay, which saw the first's rows unchanged for a TTL, tries to take
    // them all.
    let taken = claim_stale(&leases, &second, ttl, LEASE_BUCKETS).await;
    assert_eq!(taken.len(), 127);
    assert!(
        taken.iter().all(|(taken, _)| *taken != bucket),
        "a takeover overlapped an ack in progress"
    );
    ack_tx.commit().await.unwrap();
    let skipped = stale_bucket(&leases, ttl, bucket).await;
    let taken = leases.claim(&second, ttl, 1, &skipped).await.unwrap();
    assert_eq!(taken, vec![(bucket, LeaseEpoch(epoch.0 + 1))]);
}

/// A claim presents what its relay saw: a renewal committed since (the beat moved), or
/// another claim, makes it take nothing, however long ago the rows were read.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_claim_takes_nothing_whose_row_moved_since_it_was_seen(pool: PgPool) {
    let leases = LeaseStore::new(pool.clone());
    let ttl = Duration::from_secs(60);
    let relays: Vec<RelayId> = (0..3).map(|_| RelayId::generate()).collect();
    let claimed = claim_free(&leases, &relays[0], ttl, LEASE_BUCKETS).await;
    let stale = claimable_after(&leases, ttl, ttl * 10).await;
    assert_eq!(stale.len(), 128);
    leases.renew(&relays[0], ttl, &claimed[..64]).await.unwrap();
    let taken = leases
        .claim(&relays[1], ttl, LEASE_BUCKETS, &stale)
        .await
        .unwrap();
    assert_eq!(
        taken,
        claimed[64..]
            .iter()
            .map(|(b, e)| (*b, LeaseEpoch(e.0 + 1)))
            .collect::<Vec<_>>()
    );
    let again = leases
        .claim(&relays[2], ttl, LEASE_BUCKETS, &stale)
        .await
        .unwrap();
    assert!(again.is_empty(), "{again:?}");
}

/// Every lease row's expires_at moved by `shift` (`"+ interval '1 day'"`), as a step of the
/// database's clock makes it look: written with the beat trigger off, since a step changes no
/// row.
async fn as_if_the_clock_stepped(pool: &PgPool, shift: &str) {
    let mut tx = pool.begin().await.unwrap();
    for statement in [
        "ALTER TABLE relay_lease DISABLE TRIGGER relay_lease_beat".to_owned(),
        format!("UPDATE relay_lease SET expires_at = now() {shift}"),
        "ALTER TABLE relay_lease ENABLE TRIGGER relay_lease_beat".to_owned(),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

/// No lease statement reads the clock to decide: with every row's expires_at in the past (as
/// a step of PostgreSQL's clock forward makes it look) the owner still renews, acks and
/// drains, and nothing is free to claim; with every expires_at far ahead (a step back) a
/// relay that stood still for a TTL is still taken over.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn leases_ignore_a_step_of_the_database_clock(pool: PgPool) {
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=3).await;
    let outbox = Outbox::new(pool.clone());
    let leases = LeaseStore::new(pool.clone());
    let ttl = Duration::from_secs(60);
    let (first, second) = (RelayId::generate(), RelayId::generate());
    let claimed = claim_free(&leases, &first, ttl, LEASE_BUCKETS).await;
    let bucket = bucket_of(&branch.tenant);
    let epoch = claimed.iter().find(|(b, _)| *b == bucket).unwrap().1;
    let fence = Lease::new(bucket, first.clone(), epoch, Instant::now() + ttl).fence();

    as_if_the_clock_stepped(&pool, "- interval '1 day'").await;
    // Every row still names its owner however far the clock stepped: nothing reads as free.
    let rows = leases.survey().await.unwrap();
    assert!(
        rows.iter()
            .all(|row| row.owner.as_deref() == Some(first.as_str())),
        "{rows:?}"
    );
    assert_eq!(
        leases.renew(&first, ttl, &claimed).await.unwrap().len(),
        128
    );
    as_if_the_clock_stepped(&pool, "- interval '1 day'").await;
    let next = outbox
        .ack_and_drain(&fence, &[at(&branch, 1)], &branch.tenant, 10, &[])
        .await
        .unwrap();
    assert_eq!(next.len(), 2);

    as_if_the_clock_stepped(&pool, "+ interval '1 day'").await;
    assert_eq!(
        claim_stale(&leases, &second, ttl, LEASE_BUCKETS)
            .await
            .len(),
        128
    );
}

/// An append holds its branch's lock while a rewind of that branch waits for it: once the append
/// commits, the rewind sees it (PostgreSQL re-reads the locked row), abandons it if it lies above
/// the fork, and puts its marker above it. The marker never sits below an intent of its branch.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_rewind_waiting_on_an_append_sees_it_and_marks_above_it(pool: PgPool) {
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=3).await;
    let writer = IntentWriter::default().with_notify(false);
    let mut append = pool.begin().await.unwrap();
    writer
        .append(&mut append, &branch, Lsn::new(4), b"4")
        .await
        .unwrap();
    let rewind = tokio::spawn({
        let (pool, writer, branch) = (pool.clone(), writer.clone(), branch.clone());
        async move {
            let mut conn = pool.acquire().await.unwrap();
            writer
                .rewind(
                    &mut conn,
                    &branch,
                    Lsn::new(2),
                    BranchId::new("retry").unwrap(),
                )
                .await
        }
    });
    blocked_on_lock(&pool, "relay_rewind").await;
    append.commit().await.unwrap();
    let rewound = rewind.await.unwrap().unwrap();
    assert_eq!(rewound.abandoned, 2, "3 and the concurrent 4 are abandoned");
    let rows: Vec<(i64, i16)> =
        sqlx::query_as("SELECT lsn, kind FROM relay_outbox WHERE branch_id = 'main' ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows, [(1, 0), (2, 0), (5, 1)], "the marker is above lsn 4");
}

/// A rewind holds the branch's lock while an append to it waits: once the rewind commits, the
/// append is refused (the branch is abandoned) and writes nothing.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn an_append_waiting_on_a_rewind_is_refused_once_it_commits(pool: PgPool) {
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=3).await;
    let writer = IntentWriter::default().with_notify(false);
    let mut rewind = pool.begin().await.unwrap();
    writer
        .rewind(
            &mut rewind,
            &branch,
            Lsn::new(3),
            BranchId::new("retry").unwrap(),
        )
        .await
        .unwrap();
    let append = tokio::spawn({
        let (pool, writer, branch) = (pool.clone(), writer.clone(), branch.clone());
        async move {
            let mut conn = pool.acquire().await.unwrap();
            writer.append(&mut conn, &branch, Lsn::new(4), b"4").await
        }
    });
    blocked_on_lock(&pool, "relay_append").await;
    rewind.commit().await.unwrap();
    let refused = append.await.unwrap();
    assert!(
        matches!(refused, Err(Error::BranchAbandoned { at, .. }) if at == Lsn::new(3)),
        "{refused:?}"
    );
    let intents: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM relay_outbox WHERE branch_id = 'main' AND kind = 0",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(intents, 3);
}

/// A close waits for an append in progress on the live branch (the branch's lock), then puts
/// its end marker above it: the end marker never sits below an intent of the run.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_close_waiting_on_an_append_ends_the_run_after_it(pool: PgPool) {
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=3).await;
    let writer = IntentWriter::default().with_notify(false);
    let mut append = pool.begin().await.unwrap();
    writer
        .append(&mut append, &branch, Lsn::new(4), b"4")
        .await
        .unwrap();
    let close = close_on_another_connection(&pool, &writer, &branch);
    blocked_on_lock(&pool, "relay_close_run").await;
    append.commit().await.unwrap();
    let closed = close.await.unwrap().unwrap();
    assert_eq!(closed.end, Lsn::new(5));
    let rows: Vec<(i64, i64, i16)> =
        sqlx::query_as("SELECT lsn, prev_lsn, kind FROM relay_outbox ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        rows.last(),
        Some(&(5, 4, 2)),
        "the end marker follows lsn 4"
    );
}

/// WIRE.md: "A second close is refused (`RL110`): a run has one end marker", also when two
/// closes race: the second waits on the branch's lock while the first is uncommitted, then is
/// refused, and the outbox holds one end marker.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn two_racing_closes_write_one_end_marker(pool: PgPool) {
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=2).await;
    let writer = IntentWriter::default().with_notify(false);
    let mut first = pool.begin().await.unwrap();
    writer
        .close_run(&mut first, &branch.tenant, &branch.run)
        .await
        .unwrap();
    let second = close_on_another_connection(&pool, &writer, &branch);
    blocked_on_lock(&pool, "relay_close_run").await;
    first.commit().await.unwrap();
    let refused = second.await.unwrap();
    assert!(
        matches!(refused, Err(store::Error::RunClosed { .. })),
        "{refused:?}"
    );
    let ends: i64 = sqlx::query_scalar("SELECT count(*) FROM relay_outbox WHERE kind = 2")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ends, 1, "one end marker");
}

/// Retirement never waits for anyone: a host transaction holding an open run's branch, and
/// another holding a closed run's, leave it free to retire every other due run at once; the
/// held run goes in a later pass, once it is free.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn retirement_skips_what_others_hold_and_never_waits_for_a_host(pool: PgPool) {
    let writer = IntentWriter::default().with_notify(false);
    for run in ["a", "b", "c", "open"] {
        appended(&pool, &key("t", run, "main"), 1..=1).await;
    }
    let mut conn = pool.acquire().await.unwrap();
    for run in ["a", "b", "c"] {
        let tenant = TenantId::new("t").unwrap();
        writer
            .close_run(&mut conn, &tenant, &RunId::new(run).unwrap())
            .await
            .unwrap();
    }
    sqlx::query("DELETE FROM relay_outbox")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE relay_branch SET closed_at = closed_at - interval '1 hour'")
        .execute(&pool)
        .await
        .unwrap();
    // The host appends to its open run and holds the branch; someone holds closed run b's row.
    let mut host = pool.begin().await.unwrap();
    writer
        .append(&mut host, &key("t", "open", "main"), Lsn::new(2), b"2")
        .await
        .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM relay_branch WHERE run_id = 'b' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let retention = store::Retention {
        keep: Duration::from_secs(600),
        batch: 100,
    };
    // A retirement that waited on a lock would not return while both transactions are open.
    let retired = tokio::time::timeout(
        Duration::from_secs(30),
        store::retire_runs(&pool, retention),
    )
    .await
    .expect("retirement waited on a lock")
    .unwrap();
    assert_eq!(retired, 2, "a and c; b is held");
    host.commit().await.unwrap();
    holder.commit().await.unwrap();
    assert_eq!(store::retire_runs(&pool, retention).await.unwrap(), 1, "b");
    let runs: Vec<String> = sqlx::query_scalar("SELECT run_id FROM relay_branch ORDER BY run_id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(runs, ["open"]);
}

/// RELAY_PUBLISH_REPLICATED on a server without standbys: `local` returns what was read once
/// it is on this server's disk (at once, here), and so does `sync` (the server names no
/// synchronous standby: it promises its disk alone); `all` has no standby to wait for, so
/// nothing is published ([`Error::NotReplicated`], after the timeout) and the rows stay.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_drain_under_replication_returns_only_what_is_flushed_where_asked(pool: PgPool) {
    use store::Replication;
    let branch = key("t", "r", "main");
    appended(&pool, &branch, 1..=3).await;
    let local = Outbox::new(pool.clone()).replicated(Replication::Local, Duration::from_secs(5));
    let drained = local
        .drain_after(&Fence::open(), &branch.tenant, 10, &[])
        .await
        .unwrap();
    assert_eq!(drained.len(), 3);
    let sync = Outbox::new(pool.clone()).replicated(Replication::Sync, Duration::from_secs(5));
    let drained = sync
        .drain_after(&Fence::open(), &branch.tenant, 10, &[])
        .await
        .unwrap();
    assert_eq!(drained.len(), 3);
    let all = Outbox::new(pool.clone()).replicated(Replication::All, Duration::from_millis(50));
    let waited = all
        .drain_after(&Fence::open(), &branch.tenant, 10, &[])
        .await;
    assert!(
        matches!(waited, Err(Error::NotReplicated { .. })),
        "{waited:?}"
    );
    // An empty drain never waits.
    let nothing = Outbox::new(pool.clone()).replicated(Replication::Sync, Duration::from_secs(60));
    let other = key("other", "r", "main");
    let empty = nothing
        .drain_after(&Fence::open(), &other.tenant, 10, &[])
        .await
        .unwrap();
    assert!(empty.is_empty());
    assert_eq!(
        Outbox::new(pool.clone())
            .drain_outbox(&branch.tenant, 10)
            .await
            .unwrap()
            .len(),
        3,
        "nothing was retired"
    );
}

/// A relay of an earlier version renews with `expires_at` alone: its rows still draw new beats
/// (the trigger) and record the TTL it gave, so newer relays beside it in a rolling upgrade
/// never take its live leases for dead ones.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_renewal_that_sets_no_beat_still_draws_one_and_records_its_ttl(pool: PgPool) {
    let leases = LeaseStore::new(pool.clone());
    let ttl = Duration::from_secs(60);
    let old = RelayId::generate();
    let claimed = claim_free(&leases, &old, ttl, 1).await;
    let bucket = claimed[0].0;
    let row = |rows: Vec<store::LeaseRow>| rows.into_iter().find(|r| r.bucket == bucket).unwrap();
    let before = row(leases.survey().await.unwrap());
    assert_eq!(before.ttl, ttl);
    sqlx::query(
        "UPDATE relay_lease SET expires_at = now() + interval '90 seconds' WHERE bucket = $1",
    )
    .bind(i32::from(bucket.0))
    .execute(&pool)
    .await
    .unwrap();
    let after = row(leases.survey().await.unwrap());
    assert_ne!(after.beat, before.beat, "the beat stood still");
    assert_eq!(after.ttl, Duration::from_secs(90));
    async fn member(pool: &PgPool, relay: &RelayId) -> i64 {
        sqlx::query_scalar("SELECT beat FROM relay_member WHERE relay_id = $1")
            .bind(relay.as_str())
            .fetch_one(pool)
            .await
            .unwrap()
    }
    leases.heartbeat(&RelayId::generate(), ttl).await.unwrap();
    sqlx::query("INSERT INTO relay_member (relay_id, expires_at) VALUES ($1, now())")
        .bind(old.as_str())
        .execute(&pool)
        .await
        .unwrap();
    let first = member(&pool, &old).await;
    sqlx::query(
        "UPDATE relay_member SET expires_at = now() + interval '1 minute' WHERE relay_id = $1",
    )
    .bind(old.as_str())
    .execute(&pool)
    .await
    .unwrap();
    assert_ne!(
        member(&pool, &old).await,
        first,
        "the member's beat stood still"
    );
}

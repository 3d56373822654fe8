//! Rewinds at the fold, on real PostgreSQL: once a branch's marker is folded nothing above its
//! fork point stays applied, and a user's projection sees exactly the host's live history, in
//! its order, whatever the delivery sequence (abandoned events in flight, duplicates, reorders).
mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use sqlx::{PgConnection, PgPool};
use store::{
    BranchId, BranchKey, EventKind, EventTable, FoldModel, FoldOutcome, FoldStore, OutboxEvent,
    Projection, RewindNotice, TenantId,
};

async fn fresh_database(label: &str) -> PgPool {
    let pool = common::fresh_database(label).await;
    journal_table(&pool).await;
    pool
}

/// The user's own table: what their projection did, in the fold's transaction.
async fn journal_table(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS journal (
             seq bigserial PRIMARY KEY, tenant text NOT NULL, run text NOT NULL,
             branch text NOT NULL, lsn bigint NOT NULL, op text NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// A user projection: keeps the project's event table and writes a journal of its own.
struct Journal;

impl Projection for Journal {
    type Error = store::Error;

    async fn apply(
        &mut self,
        tx: &mut PgConnection,
        event: &OutboxEvent,
    ) -> Result<(), store::Error> {
        EventTable.apply(tx, event).await?;
        let key = &event.key.branch;
        sqlx::query(
            "INSERT INTO journal (tenant, run, branch, lsn, op) VALUES ($1, $2, $3, $4, 'apply')",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(event.key.lsn.get() as i64)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &RewindNotice,
    ) -> Result<(), store::Error> {
        EventTable.rewind(tx, rewind).await?;
        let key = &rewind.branch;
        sqlx::query(
            "INSERT INTO journal (tenant, run, branch, lsn, op) VALUES ($1, $2, $3, $4, 'undo')",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(rewind.fork.get() as i64)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    async fn end(&mut self, tx: &mut PgConnection, end: &OutboxEvent) -> Result<(), store::Error> {
        let key = &end.key.branch;
        sqlx::query(
            "INSERT INTO journal (tenant, run, branch, lsn, op) VALUES ($1, $2, $3, $4, 'end')",
        )
        .bind(key.tenant.as_str())
        .bind(key.run.as_str())
        .bind(key.branch.as_str())
        .bind(end.key.lsn.get() as i64)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// The runs whose end the projection was told of, each with whether it came after everything
/// else of its run in the journal (it must), in journal order.
async fn ends(pool: &PgPool, tenant: &TenantId) -> Vec<(String, bool)> {
    sqlx::query_as(
        "SELECT e.run, NOT EXISTS (SELECT 1 FROM journal l WHERE l.tenant = e.tenant
                                     AND l.run = e.run AND l.seq > e.seq)
           FROM journal e WHERE e.tenant = $1 AND e.op = 'end' ORDER BY e.seq",
    )
    .bind(tenant.as_str())
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn fold_one(pool: &PgPool, event: &OutboxEvent) -> FoldOutcome {
    let mut tx = pool.begin().await.unwrap();
    let outcome = store::fold(&mut tx, event, &mut Journal).await.unwrap();
    tx.commit().await.unwrap();
    outcome
}

/// The journal replayed: each apply appends, each undo drops the branch's entries above the
/// fork. What remains is what the user's projection holds, in the order it was built.
async fn effective(pool: &PgPool, tenant: &TenantId) -> Vec<(String, String, u64)> {
    let rows: Vec<(String, String, i64, String)> =
        sqlx::query_as("SELECT run, branch, lsn, op FROM journal WHERE tenant = $1 ORDER BY seq")
            .bind(tenant.as_str())
            .fetch_all(pool)
            .await
            .unwrap();
    let mut live: Vec<(String, String, u64)> = Vec::new();
    for (run, branch, lsn, op) in rows {
        if op == "apply" {
            live.push((run, branch, lsn as u64));
        } else if op == "undo" {
            live.retain(|(r, b, l)| !(r == &run && b == &branch && *l > lsn as u64));
        }
    }
    live
}

fn intent(branch: &BranchKey, lsn: u64, prev: u64, base: u64, parent: Option<&str>) -> OutboxEvent {
    let event = testkit::intent(branch, lsn).prev(prev).base(base);
    match parent {
        Some(parent) => event.parent(parent).build(),
        None => event.build(),
    }
}

fn marker(
    branch: &BranchKey,
    lsn: u64,
    fork: u64,
    base: u64,
    parent: Option<&str>,
    to: &str,
) -> OutboxEvent {
    OutboxEvent {
        kind: EventKind::Rewind {
            to: BranchId::new(to).unwrap(),
        },
        payload: Vec::new(),
        ..intent(branch, lsn, fork, base, parent)
    }
}

fn key(tenant: &TenantId, run: &str, branch: &str) -> BranchKey {
    testkit::branch(tenant.as_str(), run, branch)
}

/// The scenario of the issue, step by step: abandoned events applied before the marker are
/// undone with it, later ones are ignored, the new branch waits for the marker.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_marker_undoes_what_was_applied_above_the_fork_and_gates_the_new_branch(pool: PgPool) {
    journal_table(&pool).await;
    let tenant = TenantId::new("t").unwrap();
    let a = key(&tenant, "r", "a");
    let b = key(&tenant, "r", "b");
    // Host: a@1..=5; rewind at 2 -> b; b@3, b@4. a@3 and a@4 were in flight, a@5 was parked.
    assert_eq!(
        fold_one(&pool, &intent(&a, 1, 0, 0, None)).await,
        FoldOutcome::Applied { released: 0 }
    );
    assert_eq!(
        fold_one(&pool, &intent(&a, 2, 1, 0, None)).await,
        FoldOutcome::Applied { released: 0 }
    );
    assert_eq!(
        fold_one(&pool, &intent(&a, 3, 2, 0, None)).await,
        FoldOutcome::Applied { released: 0 }
    );
    assert_eq!(
        fold_one(&pool, &intent(&a, 5, 4, 0, None)).await,
        FoldOutcome::Parked
    );
    // The new branch's first intent arrives before the marker: it waits.
    assert_eq!(
        fold_one(&pool, &intent(&b, 3, 2, 2, Some("a"))).await,
        FoldOutcome::Parked
    );
    // The marker: undoes a@3, drops the parked a@5, releases b@3.
    assert_eq!(
        fold_one(&pool, &marker(&a, 6, 2, 0, None, "b")).await,
        FoldOutcome::Rewound { released: 1 }
    );
    assert_eq!(
        fold_one(&pool, &marker(&a, 6, 2, 0, None, "b")).await,
        FoldOutcome::Duplicate
    );
    // Late abandoned deliveries never apply.
    assert_eq!(
        fold_one(&pool, &intent(&a, 4, 3, 0, None)).await,
        FoldOutcome::Abandoned
    );
    assert_eq!(
        fold_one(&pool, &intent(&a, 3, 2, 0, None)).await,
        FoldOutcome::Abandoned
    );
    assert_eq!(
        fold_one(&pool, &intent(&a, 2, 1, 0, None)).await,
        FoldOutcome::Duplicate
    );
    assert_eq!(
        fold_one(&pool, &intent(&b, 4, 3, 2, Some("a"))).await,
        FoldOutcome::Applied { released: 0 }
    );

    let folded: Vec<String> = FoldStore::new(pool.clone())
        .folded(&tenant)
        .await
        .unwrap()
        .iter()
        .map(|event| event.key.to_string())
        .collect();
    assert_eq!(folded, ["t/r/a@1", "t/r/a@2", "t/r/b@3", "t/r/b@4"]);
    assert_eq!(
        FoldStore::new(pool.clone()).parked(&tenant).await.unwrap(),
        0
    );
    let journal = effective(&pool, &tenant).await;
    let lsns: Vec<(&str, u64)> = journal.iter().map(|(_, b, l)| (b.as_str(), *l)).collect();
    assert_eq!(lsns, [("a", 1), ("a", 2), ("b", 3), ("b", 4)]);
}

/// The marker may arrive before the old branch's live events: they still apply up to the fork,
/// and the new branch starts only after the last of them.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_new_branch_waits_until_its_parent_reaches_the_fork(pool: PgPool) {
    journal_table(&pool).await;
    let tenant = TenantId::new("t").unwrap();
    let a = key(&tenant, "r", "a");
    let b = key(&tenant, "r", "b");
    assert_eq!(
        fold_one(&pool, &marker(&a, 4, 2, 0, None, "b")).await,
        FoldOutcome::Rewound { released: 0 }
    );
    assert_eq!(
        fold_one(&pool, &intent(&b, 3, 2, 2, Some("a"))).await,
        FoldOutcome::Parked
    );
    assert_eq!(
        fold_one(&pool, &intent(&a, 2, 1, 0, None)).await,
        FoldOutcome::Parked
    );
    assert_eq!(
        fold_one(&pool, &intent(&a, 3, 2, 0, None)).await,
        FoldOutcome::Abandoned
    );
    // a@1 applies, releases a@2 (reaching the fork), which releases b@3.
    assert_eq!(
        fold_one(&pool, &intent(&a, 1, 0, 0, None)).await,
        FoldOutcome::Applied { released: 2 }
    );
    let journal = effective(&pool, &tenant).await;
    let lsns: Vec<(&str, u64)> = journal.iter().map(|(_, b, l)| (b.as_str(), *l)).collect();
    assert_eq!(lsns, [("a", 1), ("a", 2), ("b", 3)]);
}

/// One run's history: branch `a` from 0, then up to three rewinds, each forking the live branch
/// somewhere in its span, often at its very base (so chains of rewinds at one fork point, and
/// branches none of whose intents ship, are common); the abandoned tails may or may not have
/// been in flight.
#[derive(Clone, Debug)]
struct History {
    /// Events per branch (Lsns ascending from its base); `forks[i]` forks branch i into i+1.
    lengths: Vec<u64>,
    forks: Vec<u64>,
    in_flight: Vec<bool>,
    /// Whether the host closed the run at the end (an end marker after the live branch).
    closed: bool,
}

fn histories() -> impl Strategy<Value = History> {
    (1usize..=NAMES.len())
        .prop_flat_map(|branches| {
            (
                prop::collection::vec(0u64..5, branches),
                prop::collection::vec(0u64..100, branches - 1),
                prop::collection::vec(any::<bool>(), 12),
                any::<bool>(),
            )
        })
        .prop_map(|(lengths, fork_picks, in_flight, closed)| {
            let mut forks = Vec::new();
            let mut base = 0;
            for (i, pick) in fork_picks.iter().enumerate() {
                // The fork lies in (base..=head] of branch i, or at its base (a third of them).
                let span = lengths[i];
                let fork = if *pick < 33 {
                    base
                } else {
                    base + pick % (span + 1)
                };
                forks.push(fork);
                base = fork;
            }
            History {
                lengths,
                forks,
                in_flight,
                closed,
            }
        })
}

const NAMES: [&str; 4] = ["a", "b", "c", "d"];

/// All messages that can reach the consumer for `history` on `run`, and the live history.
fn messages(
    tenant: &TenantId,
    run: &str,
    history: &History,
) -> (Vec<OutboxEvent>, Vec<(String, String, u64)>) {
    let mut all = Vec::new();
    let mut live = Vec::new();
    let mut base = 0;
    for (i, &length) in history.lengths.iter().enumerate() {
        let branch = key(tenant, run, NAMES[i]);
        let parent = (i > 0).then(|| NAMES[i - 1]);
        let fork = history.forks.get(i).copied();
        let mut prev = base;
        for lsn in base + 1..=base + length {
            let event = intent(&branch, lsn, prev, base, parent);
            let abandoned = fork.is_some_and(|fork| lsn > fork);
            if !abandoned {
                live.push((run.to_owned(), NAMES[i].to_owned(), lsn));
                all.push(event);
            } else if history.in_flight[(lsn as usize) % history.in_flight.len()] {
                all.push(event); // drained before the rewind committed: still delivered
            }
            prev = lsn;
        }
        if let Some(fork) = fork {
            all.push(marker(
                &branch,
                base + length + 1,
                fork,
                base,
                parent,
                NAMES[i + 1],
            ));
            base = fork;
        } else if history.closed {
            // The live branch, closed after its last intent.
            all.push(OutboxEvent {
                kind: EventKind::End,
                payload: Vec::new(),
                ..intent(&branch, base + length + 1, base + length, base, parent)
            });
        }
    }
    (all, live)
}

/// Two runs' histories and a delivery sequence of their messages: every message at least once
/// (up to three times), in any order.
fn deliveries() -> impl Strategy<Value = (History, History, Vec<usize>)> {
    (histories(), histories()).prop_flat_map(|(h1, h2)| {
        let tenant = TenantId::new("x").unwrap();
        let n = messages(&tenant, "r1", &h1).0.len() + messages(&tenant, "r2", &h2).0.len();
        (Just(h1), Just(h2), prop::collection::vec(1usize..=3, n)).prop_flat_map(
            |(h1, h2, copies)| {
                let order: Vec<usize> = copies
                    .iter()
                    .enumerate()
                    .flat_map(|(message, &n)| std::iter::repeat_n(message, n))
                    .collect();
                (Just(h1), Just(h2), Just(order).prop_shuffle())
            },
        )
    })
}

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

/// The model's projection as (run, branch, lsn), in the order it was built.
fn modelled(model: &FoldModel) -> Vec<(String, String, u64)> {
    model
        .projection()
        .iter()
        .map(|(key, _)| {
            (
                key.branch.run.to_string(),
                key.branch.branch.to_string(),
                key.lsn.get(),
            )
        })
        .collect()
}

fn per_run(history: &[(String, String, u64)], run: &str) -> Vec<(String, String, u64)> {
    history
        .iter()
        .filter(|(r, _, _)| r == run)
        .cloned()
        .collect()
}

/// WIRE.md's rules alone (the in-memory model written from the text) give exactly the live
/// history under any delivery sequence: chains of rewinds at one fork point, rewinds at a
/// branch's base, branches none of whose intents shipped, duplicates, any order. No database:
/// thousands of cases in seconds. A consumer written from an earlier text (a forked branch
/// started only by its own first intent) fails this with runs held back for ever.
#[test]
fn wire_rules_alone_give_the_live_history_under_any_delivery_sequence() {
    proptest!(cases(5_000), |((h1, h2, order) in deliveries())| {
        let tenant = TenantId::new("t").unwrap();
        let (mut all, mut live) = messages(&tenant, "r1", &h1);
        let (more, more_live) = messages(&tenant, "r2", &h2);
        all.extend(more);
        live.extend(more_live);
        let mut model = FoldModel::new();
        for index in &order {
            model.deliver(&all[*index]).unwrap();
        }
        let got = modelled(&model);
        for run in ["r1", "r2"] {
            prop_assert_eq!(per_run(&got, run), per_run(&live, run), "{}: live history, in order", run);
        }
        prop_assert_eq!(model.held_back(), 0);
        let mut ended: Vec<String> = model.ended().iter().map(|key| key.run.to_string()).collect();
        ended.sort();
        let closed: Vec<String> = [("r1", &h1), ("r2", &h2)].iter()
            .filter(|(_, h)| h.closed).map(|(run, _)| run.to_string()).collect();
        prop_assert_eq!(ended, closed, "every closed run ends, once");
    });
}

/// The fold in PostgreSQL (`store::fold`) and WIRE.md's rules (the model) agree on every
/// delivery of any sequence: the same outcome for each (applied and how many released, parked,
/// duplicate, abandoned, rewound), and the same projection, equal to the live history, in its
/// order; the project's event table agrees and nothing is left parked.
#[test]
fn the_fold_and_the_wire_rules_agree_on_every_delivery_of_any_sequence() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let pool = runtime.block_on(fresh_database("rewindfold"));
    let case = AtomicU64::new(0);
    // 1,000 cases by default (about 45 s here); PROPTEST_CASES=N for a longer search. The fold
    // is the SQL function `relay_fold`: `store::fold` only calls it and the projection.
    proptest!(cases(1_000), |((h1, h2, order) in deliveries())| {
        let tenant = TenantId::new(format!("t{}", case.fetch_add(1, Ordering::SeqCst))).unwrap();
        let (mut all, mut live) = messages(&tenant, "r1", &h1);
        let (more, more_live) = messages(&tenant, "r2", &h2);
        all.extend(more);
        live.extend(more_live);
        let mut model = FoldModel::new();
        runtime.block_on(async {
            for index in &order {
                let event = &all[*index];
                let folded = fold_one(&pool, event).await;
                let modelled = model.deliver(event).unwrap();
                assert_eq!(folded, modelled, "outcome of {:?}", event);
            }
            // The user's projection: exactly the live history, each run in its own order.
            let got = effective(&pool, &tenant).await;
            assert_eq!(got, modelled(&model), "the fold's projection is the model's");
            for run in ["r1", "r2"] {
                assert_eq!(per_run(&got, run), per_run(&live, run), "{run}: live history, in order");
            }
            // The project's event table agrees, and nothing is left parked.
            let fold = FoldStore::new(pool.clone());
            let mut table: Vec<(String, String, u64)> = fold.folded(&tenant).await.unwrap().into_iter()
                .map(|e| (e.key.branch.run.to_string(), e.key.branch.branch.to_string(), e.key.lsn.get()))
                .collect();
            table.sort();
            let mut want = live.clone();
            want.sort();
            assert_eq!(table, want);
            assert_eq!(fold.parked(&tenant).await.unwrap(), 0);
            // Each closed run ended once, after everything else of it, as the model says.
            let ends = ends(&pool, &tenant).await;
            let mut ended: Vec<String> = ends.iter().map(|(run, _)| run.clone()).collect();
            ended.sort();
            let mut modelled_ends: Vec<String> = model.ended().iter().map(|key| key.run.to_string()).collect();
            modelled_ends.sort();
            assert_eq!(ended, modelled_ends, "the same runs ended");
            assert!(ends.iter().all(|(_, last)| *last), "an end comes after all of its run: {ends:?}");
            let cursors: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM relay_fold_cursor WHERE tenant_id = $1 AND ended_at IS NOT NULL")
                .bind(tenant.as_str()).fetch_one(&pool).await.unwrap();
            assert_eq!(cursors as usize, ended.len(), "the cursors say which runs ended");
        });
    });
}

/// One row of a fold's answer, as `relay_fold` returns it.
type FoldRow = (
    String,
    String,
    i64,
    i64,
    i64,
    Option<String>,
    Option<String>,
    Option<chrono::DateTime<chrono::Utc>>,
    Option<Vec<u8>>,
    Option<serde_json::Value>,
);

/// `relay_fold`'s arguments for `event`, as a consumer maps a delivery (store::fold's mapping).
struct FoldArgs {
    tenant: String,
    run: String,
    branch: String,
    kind: &'static str,
    lsn: i64,
    prev_lsn: i64,
    base_lsn: i64,
    parent: Option<String>,
    rewound_to: Option<String>,
    created_at: chrono::DateTime<chrono::Utc>,
    payload: Vec<u8>,
    meta: Option<serde_json::Value>,
    epoch: Option<i64>,
    prev_epoch: Option<i64>,
}

fn fold_args(event: &OutboxEvent) -> FoldArgs {
    let key = &event.key.branch;
    let (kind, rewound_to) = match &event.kind {
        EventKind::Intent => ("intent", None),
        EventKind::Rewind { to } => ("rewind", Some(to.to_string())),
        EventKind::End => ("end", None),
    };
    FoldArgs {
        tenant: key.tenant.to_string(),
        run: key.run.to_string(),
        branch: key.branch.to_string(),
        kind,
        lsn: event.key.lsn.get() as i64,
        prev_lsn: event.prev_lsn.get() as i64,
        base_lsn: event.base_lsn.get() as i64,
        parent: event.parent.as_ref().map(ToString::to_string),
        rewound_to,
        created_at: event.created_at,
        payload: event.payload.clone(),
        meta: (!event.meta.is_empty()).then(|| serde_json::to_value(&event.meta).unwrap()),
        epoch: event.epochs.epoch.map(store::Epoch::to_db),
        prev_epoch: event.epochs.prev.map(store::Epoch::to_db),
    }
}

const FOLD_COLUMNS: &str = "action, branch_id, lsn, prev_lsn, base_lsn, parent_branch, \
                            rewound_to, created_at, payload, meta";

/// One `relay_fold` call, in a transaction of its own: its rows in order.
async fn fold_single(pool: &PgPool, event: &OutboxEvent) -> Vec<FoldRow> {
    let a = fold_args(event);
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {FOLD_COLUMNS} FROM relay_fold($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
              WITH ORDINALITY AS f({FOLD_COLUMNS}, n) ORDER BY n"
    )))
    .bind(a.tenant)
    .bind(a.run)
    .bind(a.branch)
    .bind(a.kind)
    .bind(a.lsn)
    .bind(a.prev_lsn)
    .bind(a.base_lsn)
    .bind(a.parent)
    .bind(a.rewound_to)
    .bind(a.created_at)
    .bind(a.payload)
    .bind(a.meta)
    .bind(a.epoch)
    .bind(a.prev_epoch)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// One `relay_fold_batch` call for `events`: each delivery's rows, in order.
async fn fold_batched(
    pool: &PgPool,
    events: &[&OutboxEvent],
) -> Result<Vec<Vec<FoldRow>>, sqlx::Error> {
    fold_batched_args(pool, events.iter().map(|event| fold_args(event)).collect()).await
}

async fn fold_batched_args(
    pool: &PgPool,
    args: Vec<FoldArgs>,
) -> Result<Vec<Vec<FoldRow>>, sqlx::Error> {
    macro_rules! column {
        ($field:ident) => {
            args.iter().map(|a| a.$field.clone()).collect::<Vec<_>>()
        };
    }
    type Numbered = (
        i32,
        String,
        String,
        i64,
        i64,
        i64,
        Option<String>,
        Option<String>,
        Option<chrono::DateTime<chrono::Utc>>,
        Option<Vec<u8>>,
        Option<serde_json::Value>,
    );
    let rows: Vec<Numbered> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT delivery, {FOLD_COLUMNS}
           FROM relay_fold_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
          ORDER BY delivery, step"
    )))
    .bind(column!(tenant))
    .bind(column!(run))
    .bind(column!(branch))
    .bind(column!(kind))
    .bind(column!(lsn))
    .bind(column!(prev_lsn))
    .bind(column!(base_lsn))
    .bind(column!(parent))
    .bind(column!(rewound_to))
    .bind(column!(created_at))
    .bind(column!(payload))
    .bind(column!(meta))
    .bind(column!(epoch))
    .bind(column!(prev_epoch))
    .fetch_all(pool)
    .await?;
    let mut answers = vec![Vec::new(); args.len()];
    for (delivery, action, branch, lsn, prev, base, parent, to, at, payload, meta) in rows {
        answers[delivery as usize - 1].push((
            action, branch, lsn, prev, base, parent, to, at, payload, meta,
        ));
    }
    Ok(answers)
}

/// `relay_fold_batch`, the batched form for consumers in other languages, answers exactly what
/// one `relay_fold` call per delivery answers, delivery by delivery, wherever the batches are
/// cut: any delivery sequence (duplicates, reorders, rewinds, ends) folded both ways, for two
/// tenants, compared row for row (verdicts, released intents with their bodies, undo rows).
#[test]
fn the_batched_fold_answers_what_one_call_per_delivery_answers() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let pool = runtime.block_on(fresh_database("foldbatch"));
    let case = AtomicU64::new(0);
    proptest!(cases(300), |((h1, h2, order) in deliveries(), cuts in prop::collection::vec(1usize..=12, 1..20))| {
        let n = case.fetch_add(1, Ordering::SeqCst);
        let fold_both = |tenant: &TenantId| {
            let (mut all, _) = messages(tenant, "r1", &h1);
            all.extend(messages(tenant, "r2", &h2).0);
            all
        };
        let single_events = fold_both(&TenantId::new(format!("one{n}")).unwrap());
        // The same messages (bodies, times) under another tenant.
        let other = TenantId::new(format!("batch{n}")).unwrap();
        let batched_events: Vec<OutboxEvent> = single_events
            .iter()
            .map(|event| {
                let mut event = event.clone();
                let branch = &event.key.branch;
                event.key.branch = BranchKey::new(other.clone(), branch.run.clone(), branch.branch.clone());
                event
            })
            .collect();
        runtime.block_on(async {
            let mut single = Vec::new();
            for index in &order {
                single.push(fold_single(&pool, &single_events[*index]).await);
            }
            let mut batched = Vec::new();
            let mut sizes = cuts.iter().cycle();
            let mut at = 0;
            while at < order.len() {
                let size = (*sizes.next().unwrap()).min(order.len() - at);
                let events: Vec<&OutboxEvent> =
                    order[at..at + size].iter().map(|index| &batched_events[*index]).collect();
                batched.extend(fold_batched(&pool, &events).await.unwrap());
                at += size;
            }
            assert_eq!(batched, single, "the batched answers are one call's each");
        });
    });
}

/// A refusal inside a batch fails the whole call with the refusal's own SQLSTATE and a hint
/// naming the delivery, and leaves nothing of the batch folded; arrays of unequal lengths are
/// refused with one readable line.
#[tokio::test]
async fn a_refusal_in_a_batch_names_its_delivery_and_folds_nothing() {
    let pool = fresh_database("foldbatchrefusal").await;
    let tenant = TenantId::new("t").unwrap();
    let events = testkit::intents(&key(&tenant, "r", "main"), &[1, 2, 3]);
    let mut args: Vec<FoldArgs> = events.iter().map(fold_args).collect();
    // A malformed message (an id the contract forbids): refused with RL100.
    args[1].branch = "not an id".into();
    let err = fold_batched_args(&pool, args).await.unwrap_err();
    let db = err.as_database_error().expect("a database error");
    assert_eq!(db.code().as_deref(), Some("RL100"), "{db}");
    let hint = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .and_then(|pg| pg.hint().map(str::to_owned));
    assert_eq!(hint.as_deref(), Some("delivery 2 of the batch"), "{db}");
    let cursors: i64 =
        sqlx::query_scalar("SELECT count(*) FROM relay_fold_cursor WHERE tenant_id = 't'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(cursors, 0, "nothing of the batch folded");

    let err = sqlx::query("SELECT * FROM relay_fold_batch(ARRAY['t'], ARRAY[]::text[], ARRAY['b'], ARRAY['intent'], ARRAY[1::bigint], ARRAY[0::bigint], ARRAY[0::bigint], ARRAY[NULL::text], ARRAY[NULL::text], ARRAY[now()], ARRAY['x'::bytea])")
        .execute(&pool)
        .await
        .unwrap_err();
    let db = err.as_database_error().expect("a database error");
    assert_eq!(db.code().as_deref(), Some("22023"));
    assert!(db.message().contains("one element per delivery"), "{db}");
}

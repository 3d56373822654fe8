//! A failover at the fold (WIRE.md, "Epochs"): the outbox's database loses a suffix of what the
//! host wrote (some of it already shipped), the host writes again from what the database kept,
//! in a new epoch (the same Lsns, even the same branch names, with new content). The fold never
//! keeps or drops new history silently: it applies the database's history, or refuses a
//! delivery as diverged (RL203); an operator's adopt and an ordered replay of what it refused
//! then give the database's history (or a refusal that says it cannot be adopted).
//!
//! A small simulator of the host and its database writes the rows as `relay_append`,
//! `relay_rewind` and `relay_close_run` do (epochs and predecessors' epochs included).
mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use sqlx::PgPool;
use store::{
    BranchId, BranchKey, Epoch, Epochs, Error, EventKind, EventTable, FoldModel, FoldOutcome,
    FoldStore, Lsn, OutboxEvent, RunId, TenantId,
};

/// What the host does to its run.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// Appends to the live branch, `gap` above its head (1 or 2: Lsns need not be dense).
    Append { gap: u64 },
    /// Rewinds the live branch at `pick` (mod its span + 1, from its base) to a new branch.
    Rewind { pick: u64 },
    /// Closes the run.
    Close,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u64..=2).prop_map(|gap| Op::Append { gap }),
        2 => (0u64..100).prop_map(|pick| Op::Rewind { pick }),
        1 => Just(Op::Close),
    ]
}

#[derive(Clone, Debug)]
struct Branch {
    name: String,
    base: u64,
    head: u64,
    head_epoch: Option<u64>,
    parent: Option<String>,
    abandoned: bool,
}

/// The database: its branches and the rows it still holds, each with the op that wrote it.
#[derive(Clone, Debug)]
struct Database {
    tenant: TenantId,
    run: String,
    branches: Vec<Branch>,
    /// (row, written by op number, deleted by a rewind before it shipped).
    rows: Vec<(OutboxEvent, usize)>,
    /// Rows a rewind deleted: (row, written by op, deleted by op).
    deleted: Vec<(OutboxEvent, usize, usize)>,
    closed: bool,
    epoch: u64,
    /// Every intent written and not abandoned: (branch, lsn).
    lsns: Vec<(String, u64)>,
}

impl Database {
    fn new(tenant: &TenantId, run: &str) -> Self {
        Self {
            tenant: tenant.clone(),
            run: run.to_owned(),
            branches: vec![Branch {
                name: "main".into(),
                base: 0,
                head: 0,
                head_epoch: None,
                parent: None,
                abandoned: false,
            }],
            rows: Vec::new(),
            deleted: Vec::new(),
            closed: false,
            epoch: 1,
            lsns: Vec::new(),
        }
    }

    fn key(&self, branch: &str) -> BranchKey {
        BranchKey::new(
            self.tenant.clone(),
            RunId::new(&self.run).unwrap(),
            BranchId::new(branch).unwrap(),
        )
    }

    fn live(&mut self) -> &mut Branch {
        self.branches
            .iter_mut()
            .find(|branch| !branch.abandoned)
            .expect("a live branch")
    }

    /// Carries out op number `n` as the write API would (a closed run refuses everything).
    fn write(&mut self, op: Op, n: usize) {
        if self.closed {
            return;
        }
        let epoch = self.epoch;
        let live = self.live().clone();
        let key = self.key(&live.name);
        let row = |lsn: u64, prev: u64| {
            let event = testkit::intent(&key, lsn).prev(prev).base(live.base);
            let event = match &live.parent {
                Some(parent) => event.parent(parent),
                None => event,
            };
            // A payload of the epoch: content written again differs.
            event
                .payload(format!("{}@{lsn}#{epoch}", live.name))
                .epochs(
                    epoch,
                    (prev > live.base).then_some(live.head_epoch).flatten(),
                )
                .build()
        };
        match op {
            Op::Append { gap } => {
                let lsn = live.head + gap;
                self.rows.push((row(lsn, live.head), n));
                self.lsns.push((live.name.clone(), lsn));
                let live = self.live();
                live.head = lsn;
                live.head_epoch = Some(epoch);
            }
            Op::Close => {
                let end = OutboxEvent {
                    kind: EventKind::End,
                    payload: Vec::new(),
                    ..row(live.head + 1, live.head)
                };
                self.rows.push((end, n));
                self.closed = true;
            }
            Op::Rewind { pick } => {
                // At the base or at an intent of the branch. (A fork between two Lsns whose
                // upper one never ships is never reached by the fold: the new branch would
                // wait for ever; the write API does not refuse it, see the closing note.)
                let mut forks = vec![live.base];
                forks.extend(
                    self.lsns
                        .iter()
                        .filter(|(branch, _)| *branch == live.name)
                        .map(|(_, lsn)| *lsn),
                );
                let fork = forks[(pick as usize) % forks.len()];
                self.lsns
                    .retain(|(branch, lsn)| *branch != live.name || *lsn <= fork);
                // The host names its branches from its own state: after a failover it may
                // give a new branch the name a lost one had.
                let to = format!("b{}", self.branches.len());
                let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.rows)
                    .into_iter()
                    .partition(|(row, _)| row.key.branch == key && row.key.lsn > Lsn::new(fork));
                self.rows = kept;
                self.deleted
                    .extend(gone.into_iter().map(|(row, written)| (row, written, n)));
                let marker = OutboxEvent {
                    kind: EventKind::Rewind {
                        to: BranchId::new(&to).unwrap(),
                    },
                    payload: Vec::new(),
                    epochs: Epochs {
                        epoch: Some(Epoch::new(epoch)),
                        prev: None,
                    },
                    ..row(live.head + 1, fork)
                };
                self.rows.push((marker, n));
                self.live().abandoned = true;
                self.branches.push(Branch {
                    name: to,
                    base: fork,
                    head: fork,
                    head_epoch: None,
                    parent: Some(live.name.clone()),
                    abandoned: false,
                });
            }
        }
    }

    /// The live history: each branch of the live lineage up to where it was forked.
    fn live_history(&self) -> Vec<(String, u64, Vec<u8>)> {
        let mut live = Vec::new();
        let mut upto: BTreeMap<String, u64> = BTreeMap::new();
        for (i, branch) in self.branches.iter().enumerate() {
            let fork = self.branches.get(i + 1).map(|next| next.base);
            upto.insert(branch.name.clone(), fork.unwrap_or(u64::MAX));
        }
        for (row, _) in &self.rows {
            if row.kind == EventKind::Intent {
                let branch = row.key.branch.branch.to_string();
                if row.key.lsn.get() <= upto[&branch] {
                    live.push((branch, row.key.lsn.get(), row.payload.clone()));
                }
            }
        }
        live
    }
}

/// One run's failover: what the host did in epoch 1, how much of it the database kept (`kept`
/// ops) and the relay had shipped (`shipped` ops), what it did in epoch 2.
#[derive(Clone, Debug)]
struct Failover {
    before: Vec<Op>,
    kept: usize,
    shipped: usize,
    after: Vec<Op>,
}

fn failovers() -> impl Strategy<Value = Failover> {
    (
        prop::collection::vec(op(), 1..10),
        prop::collection::vec(op(), 0..8),
    )
        .prop_flat_map(|(before, after)| {
            let n = before.len();
            (Just(before), 0..=n, 0..=n, Just(after))
        })
        .prop_map(|(before, kept, shipped, after)| Failover {
            before,
            kept,
            shipped,
            after,
        })
}

/// A history as rows: branch, Lsn, payload.
type History = Vec<(String, u64, Vec<u8>)>;

/// The messages of `failover` on `run`, in the order the relay publishes them, and the history
/// the database ends with. Epoch 1's rows written by the first `shipped` ops were published
/// before the failover (those deleted by a later rewind too: they were in flight); what the
/// database kept and had not shipped goes out after it, then epoch 2's rows.
fn published(tenant: &TenantId, run: &str, failover: &Failover) -> (Vec<OutboxEvent>, History) {
    let mut all = Database::new(tenant, run);
    for (n, op) in failover.before.iter().enumerate() {
        all.write(*op, n);
    }
    let mut messages: Vec<(usize, OutboxEvent)> = all
        .rows
        .iter()
        .map(|(row, written)| (*written, row.clone()))
        .chain(
            all.deleted
                .iter()
                .filter(|(_, written, _)| *written < failover.shipped)
                .map(|(row, written, _)| (*written, row.clone())),
        )
        .filter(|(written, _)| *written < failover.shipped)
        .collect();
    messages.sort_by_key(|(written, _)| *written);
    let mut early: Vec<OutboxEvent> = messages.into_iter().map(|(_, row)| row).collect();
    // What the database kept, then epoch 2 on top of it.
    let mut db = Database::new(tenant, run);
    for (n, op) in failover.before.iter().take(failover.kept).enumerate() {
        db.write(*op, n);
    }
    db.epoch = 2;
    let offset = failover.before.len();
    for (n, op) in failover.after.iter().enumerate() {
        db.write(*op, offset + n);
    }
    // Rows of the kept ops written before `shipped` went out before the failover (above).
    early.extend(
        db.rows
            .iter()
            .filter(|(_, written)| *written >= failover.shipped)
            .map(|(row, _)| row.clone()),
    );
    (early, db.live_history())
}

/// Whether any message of epoch 1 that the database lost was published.
fn lost_history_shipped(failover: &Failover) -> bool {
    failover.shipped > failover.kept
}

/// Folds `messages` into `model` in order; returns the deliveries refused as diverged.
fn fold_all(model: &mut FoldModel, messages: &[OutboxEvent]) -> Vec<OutboxEvent> {
    let mut refused = Vec::new();
    for message in messages {
        match model.deliver(message) {
            Ok(_) => {}
            Err(Error::Diverged { .. }) => refused.push(message.clone()),
            Err(other) => panic!("{message:?}: {other}"),
        }
    }
    refused
}

fn projection(model: &FoldModel) -> Vec<(String, u64, Vec<u8>)> {
    model
        .projection()
        .iter()
        .map(|(key, payload)| {
            (
                key.branch.branch.to_string(),
                key.lsn.get(),
                payload.clone(),
            )
        })
        .collect()
}

fn sorted(mut history: Vec<(String, u64, Vec<u8>)>) -> Vec<(String, u64, Vec<u8>)> {
    history.sort();
    history
}

/// The operator's way out: every branch that diverged is armed, and what was refused is
/// replayed in its order, round after round while that folds something. Returns what is still
/// refused.
fn adopt_and_replay(model: &mut FoldModel, mut refused: Vec<OutboxEvent>) -> Vec<OutboxEvent> {
    loop {
        for message in &refused {
            model.adopt(&message.key.branch);
        }
        let before = refused.len();
        refused = fold_all(model, &refused);
        if refused.is_empty() || refused.len() == before {
            return refused;
        }
    }
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

/// The rules of WIRE.md alone, on failovers at random cut points, each message published once
/// and some of them delivered again later (redeliveries): when nothing the database lost was
/// shipped, nothing diverges and the fold holds the database's history; otherwise it holds it,
/// or a delivery was refused as diverged; and once the operator adopts and replays what was
/// refused, it holds the database's history, unless what was refused says it cannot be adopted
/// (a rewind the database lost undid intents the relay will not send again).
#[test]
fn a_failover_is_never_folded_silently() {
    // How many cases diverged, and how many of those the operator's adopt then mended whole:
    // the property is about them, so both must be common.
    let (tried, diverged, mended) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    proptest!(cases(5_000), |(failover in failovers(), again in prop::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>()), 0..4))| {
        let tenant = TenantId::new("t").unwrap();
        let (mut messages, live) = published(&tenant, "r", &failover);
        // Redeliveries: a message again, later.
        for (which, at) in again {
            if messages.is_empty() {
                break;
            }
            let from = which.index(messages.len());
            let to = from + 1 + at.index(messages.len() - from);
            let copy = messages[from].clone();
            messages.insert(to.min(messages.len()), copy);
        }
        let mut model = FoldModel::new();
        let refused = fold_all(&mut model, &messages);
        tried.fetch_add(1, Ordering::Relaxed);
        if !refused.is_empty() {
            diverged.fetch_add(1, Ordering::Relaxed);
        }
        if !lost_history_shipped(&failover) {
            prop_assert!(refused.is_empty(), "nothing lost was shipped, yet {refused:?}");
            prop_assert_eq!(sorted(projection(&model)), sorted(live.clone()));
        }
        let epoch_two = messages.iter().any(|m| m.epochs.epoch == Some(Epoch::new(2)));
        if refused.is_empty() && epoch_two {
            // Nothing refused: what the fold holds is the database's history, as far as the
            // new epoch's messages could show (a branch the new epoch never wrote on again
            // keeps what it had: nothing reached the fold to tell it otherwise).
            let got = sorted(projection(&model));
            let want = sorted(live.clone());
            let touched: HashSet<String> = messages.iter()
                .filter(|m| m.epochs.epoch == Some(Epoch::new(2)))
                .map(|m| m.key.branch.branch.to_string()).collect();
            let on = |history: &[(String, u64, Vec<u8>)]| history.iter()
                .filter(|(branch, _, _)| touched.contains(branch)).cloned().collect::<Vec<_>>();
            prop_assert_eq!(on(&got), on(&want), "the branches epoch 2 wrote on");
        }
        let had_refused = !refused.is_empty();
        let still = adopt_and_replay(&mut model, refused);
        if had_refused && still.is_empty() {
            mended.fetch_add(1, Ordering::Relaxed);
        }
        if still.is_empty() && epoch_two {
            let touched: HashSet<String> = messages.iter()
                .filter(|m| m.epochs.epoch == Some(Epoch::new(2)))
                .map(|m| m.key.branch.branch.to_string()).collect();
            let on = |history: Vec<(String, u64, Vec<u8>)>| sorted(history.into_iter()
                .filter(|(branch, _, _)| touched.contains(branch)).collect());
            prop_assert_eq!(on(projection(&model)), on(live), "adopted: the database's history");
        }
        for message in &still {
            let verdict = model.deliver(message);
            prop_assert!(matches!(verdict, Err(Error::Diverged { .. })), "{verdict:?}");
        }
    });
    let (tried, diverged, mended) = (
        tried.into_inner(),
        diverged.into_inner(),
        mended.into_inner(),
    );
    println!("{tried} failovers: {diverged} diverged, {mended} of them mended by the adopt");
    assert!(
        diverged * 10 >= tried,
        "divergences are common: {diverged} of {tried}"
    );
    assert!(
        mended * 2 >= diverged,
        "the adopt mends most: {mended} of {diverged}"
    );
}

/// `relay_fold` in PostgreSQL and the rules of WIRE.md (the model) agree on every delivery of
/// failovers delivered in any order with duplicates (superseded, diverged, held, adopted...),
/// and after the operator adopts and replays, on every replayed delivery too; the event
/// table holds what the model holds.
#[test]
fn the_fold_and_the_wire_rules_agree_on_every_delivery_of_a_failover() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let pool = runtime.block_on(common::fresh_database("failoverfold"));
    let case = AtomicU64::new(0);
    proptest!(cases(500), |(failover in failovers(), copies in prop::collection::vec(1usize..=2, 40), seed in any::<u64>())| {
        let tenant = TenantId::new(format!("t{}", case.fetch_add(1, Ordering::SeqCst))).unwrap();
        let (messages, _) = published(&tenant, "r", &failover);
        // Any order, some twice: a deterministic shuffle by the seed.
        let mut order: Vec<usize> = (0..messages.len())
            .flat_map(|i| std::iter::repeat_n(i, copies[i % copies.len()]))
            .collect();
        let mut state = seed | 1;
        for i in (1..order.len()).rev() {
            state ^= state << 13; state ^= state >> 7; state ^= state << 17;
            order.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let mut model = FoldModel::new();
        runtime.block_on(async {
            let fold = FoldStore::new(pool.clone());
            let mut refused = Vec::new();
            for index in &order {
                let event = &messages[*index];
                let folded = fold.apply(event).await;
                let modelled = model.deliver(event);
                agree(&folded, &modelled, event);
                if matches!(modelled, Err(Error::Diverged { .. })) {
                    refused.push(event.clone());
                }
            }
            // The operator's way out, on both.
            for _round in 0..4 {
                if refused.is_empty() {
                    break;
                }
                for message in &refused {
                    let key = &message.key.branch;
                    let armed: bool = sqlx::query_scalar("SELECT relay_fold_adopt($1, $2, $3)")
                        .bind(key.tenant.as_str()).bind(key.run.as_str()).bind(key.branch.as_str())
                        .fetch_one(&pool).await.unwrap();
                    assert_eq!(armed, model.adopt(key));
                }
                let mut again = Vec::new();
                for event in &refused {
                    let folded = fold.apply(event).await;
                    let modelled = model.deliver(event);
                    agree(&folded, &modelled, event);
                    if modelled.is_err() {
                        again.push(event.clone());
                    }
                }
                refused = again;
            }
            let mut table: Vec<(String, u64)> = fold.folded(&tenant).await.unwrap().into_iter()
                .map(|e| (e.key.branch.branch.to_string(), e.key.lsn.get())).collect();
            table.sort();
            let mut modelled: Vec<(String, u64)> = projection(&model).into_iter()
                .map(|(branch, lsn, _)| (branch, lsn)).collect();
            modelled.sort();
            assert_eq!(table, modelled, "the event table holds what the model holds");
        });
    });
}

fn agree(
    folded: &Result<FoldOutcome, Error>,
    modelled: &Result<FoldOutcome, Error>,
    event: &OutboxEvent,
) {
    match (folded, modelled) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "outcome of {event:?} {:?}", event.epochs),
        (Err(Error::Diverged { .. }), Err(Error::Diverged { .. })) => {}
        (Err(Error::BrokenChain { .. }), Err(Error::BrokenChain { .. })) => {}
        (a, b) => panic!(
            "{event:?} {:?}: the fold says {a:?}, the model {b:?}",
            event.epochs
        ),
    }
}

/// The issue's case, on the real fold: `b@5..7` shipped and folded, lost by an asynchronous
/// failover; the host writes 5', 6', 7', 8'. Before epochs the fold answered `duplicate` three
/// times and applied 8' on top of the old 7. Now 5' is refused (RL203), and so is every
/// message after it until the operator adopts; after the adopt and a replay in order, the
/// projection is 1-4, 5', 6', 7', 8'.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_reused_lsn_is_refused_and_adopted_on_the_operators_word(pool: PgPool) {
    let branch = testkit::branch("t", "r", "b");
    let old = |lsn: u64| {
        testkit::intent(&branch, lsn)
            .payload(format!("old {lsn}"))
            .epochs(1, (lsn > 1).then_some(1))
            .build()
    };
    let new = |lsn: u64| {
        testkit::intent(&branch, lsn)
            .payload(format!("new {lsn}"))
            .epochs(2, Some(if lsn == 5 { 1 } else { 2 }))
            .build()
    };
    let fold = FoldStore::new(pool.clone());
    for lsn in 1..=7 {
        assert!(matches!(
            fold.apply(&old(lsn)).await.unwrap(),
            FoldOutcome::Applied { .. }
        ));
    }
    let mut refused = Vec::new();
    for lsn in 5..=8 {
        let outcome = fold.apply(&new(lsn)).await;
        match outcome {
            Err(Error::Diverged { .. }) => refused.push(new(lsn)),
            other => panic!("{lsn}: {other:?}"),
        }
    }
    assert_eq!(
        refused.len(),
        4,
        "5', 6', 7' reuse applied Lsns; 8' names another 7"
    );
    // A copy of the old history delivered late changes nothing.
    assert_eq!(fold.apply(&old(6)).await.unwrap(), FoldOutcome::Duplicate);

    let armed: bool = sqlx::query_scalar("SELECT relay_fold_adopt('t', 'r', 'b')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(armed);
    let mut outcomes = Vec::new();
    for event in &refused {
        outcomes.push(fold.apply(event).await.unwrap());
    }
    assert_eq!(
        outcomes,
        [
            FoldOutcome::Adopted {
                undone: 1,
                released: 0
            },
            FoldOutcome::Applied { released: 0 },
            FoldOutcome::Applied { released: 0 },
            FoldOutcome::Applied { released: 0 },
        ]
    );
    // The old copies are now superseded: the fold holds epoch 2 from 5 on.
    assert_eq!(fold.apply(&old(6)).await.unwrap(), FoldOutcome::Superseded);
    let held: Vec<(u64, Vec<u8>)> = fold
        .folded(&branch.tenant)
        .await
        .unwrap()
        .into_iter()
        .map(|event| (event.key.lsn.get(), event.payload))
        .collect();
    let want: Vec<(u64, Vec<u8>)> = (1..=4)
        .map(|lsn| (lsn, format!("old {lsn}").into_bytes()))
        .chain((5..=8).map(|lsn| (lsn, format!("new {lsn}").into_bytes())))
        .collect();
    let mut held = held;
    held.sort();
    assert_eq!(held, want);
}

/// A rewind the database lost, redone at another fork (a marker of a later epoch on a branch
/// whose marker was folded), and a lost rewind after which the host appends to the old branch
/// again, and an end marker at a reused Lsn: each refused, not taken for a redelivery, an
/// abandoned intent or a duplicate.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn lost_rewinds_and_closes_are_refused_not_taken_for_redeliveries(pool: PgPool) {
    let fold = FoldStore::new(pool.clone());
    let main = testkit::branch("t", "r", "main");
    for lsn in 1..=4 {
        let event = testkit::intent(&main, lsn)
            .epochs(1, (lsn > 1).then_some(1))
            .build();
        fold.apply(&event).await.unwrap();
    }
    // Rewound at 3 to b1 in epoch 1 (folded), lost; redone at 2 to b1 in epoch 2.
    let marker = |fork: u64, epoch: u64| {
        testkit::intent(&main, 5)
            .prev(fork)
            .kind(EventKind::Rewind {
                to: BranchId::new("b1").unwrap(),
            })
            .epochs(epoch, None)
            .build()
    };
    assert!(matches!(
        fold.apply(&marker(3, 1)).await.unwrap(),
        FoldOutcome::Rewound { .. }
    ));
    assert!(matches!(
        fold.apply(&marker(2, 2)).await,
        Err(Error::Diverged { .. })
    ));
    // The host appends to main again (its rewind lost): refused, not abandoned.
    let again = testkit::intent(&main, 5).prev(4).epochs(2, Some(1)).build();
    assert!(matches!(
        fold.apply(&again).await,
        Err(Error::Diverged { .. })
    ));

    // An end marker at an Lsn the fold applied, written again.
    let other = testkit::branch("t", "r2", "main");
    for lsn in 1..=3 {
        let event = testkit::intent(&other, lsn)
            .epochs(1, (lsn > 1).then_some(1))
            .build();
        fold.apply(&event).await.unwrap();
    }
    let end = testkit::intent(&other, 3)
        .prev(2)
        .kind(EventKind::End)
        .epochs(2, Some(1))
        .build();
    assert!(matches!(
        fold.apply(&end).await,
        Err(Error::Diverged { .. })
    ));
    // Before epochs (no headers) the same end marker was a duplicate: it still is.
    let unstamped = OutboxEvent {
        epochs: Epochs::default(),
        ..end
    };
    assert_eq!(
        fold.apply(&unstamped).await.unwrap(),
        FoldOutcome::Duplicate
    );
    let _ = EventTable;
}

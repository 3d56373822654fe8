//! The fold on real PostgreSQL: exactly once per (BranchKey, Lsn), in Lsn order per branch,
//! whatever the delivery sequence (duplicates, reorderings, losses then resends).
mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use common::fresh_database;
use proptest::prelude::*;
use sqlx::PgPool;
use store::{BranchId, BranchKey, FoldOutcome, FoldStore, Lsn, OutboxEvent, RunId, TenantId};

/// One branch's chain: base and ascending Lsns with gaps.
#[derive(Clone, Debug)]
struct Chain {
    run: u8,
    branch: u8,
    base: u64,
    steps: Vec<u64>,
}

fn chains() -> impl Strategy<Value = Vec<Chain>> {
    prop::collection::vec(
        (
            0u8..2,
            0u8..2,
            prop_oneof![Just(0u64), 1u64..50],
            prop::collection::vec(1u64..4, 1..8),
        ),
        1..5,
    )
    .prop_map(|raw| {
        let mut seen = std::collections::BTreeSet::new();
        raw.into_iter()
            .filter(|(run, branch, _, _)| seen.insert((*run, *branch)))
            .map(|(run, branch, base, steps)| Chain {
                run,
                branch,
                base,
                steps,
            })
            .collect()
    })
}

fn events_of(tenant: &TenantId, chain: &Chain) -> Vec<OutboxEvent> {
    let key = BranchKey::new(
        tenant.clone(),
        RunId::new(format!("r{}", chain.run)).unwrap(),
        BranchId::new(format!("b{}", chain.branch)).unwrap(),
    );
    let mut prev = chain.base;
    chain
        .steps
        .iter()
        .map(|step| {
            let lsn = prev + step;
            let event = testkit::intent(&key, lsn)
                .prev(prev)
                .base(chain.base)
                .build();
            prev = lsn;
            event
        })
        .collect()
}

/// The fold converges to "each live event exactly once, in Lsn order per branch" for any
/// delivery sequence in which every event arrives at least once.
#[test]
fn fold_applies_each_event_once_in_lsn_order_under_any_delivery_sequence() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let fold = FoldStore::new(runtime.block_on(fresh_database("fold")));
    let case = AtomicU64::new(0);
    let strategy = chains().prop_flat_map(|chains| {
        let n_events: usize = chains.iter().map(|chain| chain.steps.len()).sum();
        // Each event delivered 1 to 3 times; the whole sequence shuffled (reorderings, and
        // losses followed by later resends are both special cases of this).
        (
            Just(chains),
            prop::collection::vec(1usize..=3, n_events),
            any::<prop::sample::Index>(),
        )
            .prop_flat_map(|(chains, copies, _)| {
                let order: Vec<(usize, usize)> = copies
                    .iter()
                    .enumerate()
                    .flat_map(|(event, &n)| (0..n).map(move |copy| (event, copy)))
                    .collect();
                (Just(chains), Just(order).prop_shuffle())
            })
    });
    let config = ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    };
    proptest!(config, |((chains, deliveries) in strategy)| {
        let tenant = TenantId::new(format!("t{}", case.fetch_add(1, Ordering::SeqCst))).unwrap();
        let events: Vec<OutboxEvent> = chains.iter().flat_map(|chain| events_of(&tenant, chain)).collect();
        runtime.block_on(async {
            let mut applied = 0;
            for (index, _) in &deliveries {
                if let FoldOutcome::Applied { released } = fold.apply(&events[*index]).await.unwrap() {
                    applied += 1 + released as usize;
                }
            }
            assert_eq!(applied, events.len(), "every event applied exactly once");
            let folded = fold.folded(&tenant).await.unwrap();
            let mut by_branch: BTreeMap<BranchKey, Vec<(Lsn, Vec<u8>)>> = BTreeMap::new();
            for event in folded {
                by_branch.entry(event.key.branch.clone()).or_default().push((event.key.lsn, event.payload));
            }
            let mut expected: BTreeMap<BranchKey, Vec<(Lsn, Vec<u8>)>> = BTreeMap::new();
            for event in &events {
                expected.entry(event.key.branch.clone()).or_default().push((event.key.lsn, event.payload.clone()));
            }
            assert_eq!(by_branch, expected, "folded state = each event once, applied in Lsn order");
            assert_eq!(fold.parked(&tenant).await.unwrap(), 0);
        });
    });
}

/// A redelivery of an applied event is a no-op; an event ahead of its predecessor waits.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn fold_parks_early_events_and_ignores_redeliveries(pool: PgPool) {
    let fold = FoldStore::new(pool);
    let tenant = TenantId::new("t").unwrap();
    let chain = Chain {
        run: 0,
        branch: 0,
        base: 4,
        steps: vec![1, 2, 1],
    };
    let events = events_of(&tenant, &chain);
    assert_eq!(fold.apply(&events[1]).await.unwrap(), FoldOutcome::Parked);
    assert_eq!(fold.apply(&events[2]).await.unwrap(), FoldOutcome::Parked);
    assert!(
        fold.folded(&tenant).await.unwrap().is_empty(),
        "nothing applied ahead of its predecessor"
    );
    assert_eq!(
        fold.apply(&events[0]).await.unwrap(),
        FoldOutcome::Applied { released: 2 }
    );
    assert_eq!(
        fold.apply(&events[1]).await.unwrap(),
        FoldOutcome::Duplicate
    );
    let lsns: Vec<u64> = fold
        .folded(&tenant)
        .await
        .unwrap()
        .iter()
        .map(|e| e.key.lsn.get())
        .collect();
    assert_eq!(lsns, vec![5, 7, 8]);
}

//! Property test of the whole relay under injected faults: an in-memory fault-injecting broker
//! (in addition to the real one the acceptance suite uses) behind the same `Publisher` port,
//! with random schedules of channel deaths, nacks, returned messages, lost confirms, consumer
//! ack loss (redeliveries) and actor kills. Whatever the schedule, the fold ends with every
//! live event exactly once, in Lsn order per branch; nothing is lost, duplicated or reordered.

mod outbox {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use distribution::Relay;
    use distribution::store::{BranchKey, FoldStore, Lsn, Outbox};
    use proptest::prelude::*;

    use crate::double::{Double, Fault, MemoryBroker, Script};
    use crate::harness::*;

    fn fault() -> impl Strategy<Value = Fault> {
        prop_oneof![
            Just(Fault::Clean),
            (0usize..8).prop_map(Fault::ChannelDiesAt),
            (0usize..8).prop_map(Fault::NackAt),
            (0usize..8).prop_map(Fault::ReturnAt),
            (0usize..8).prop_map(Fault::ConfirmLostAt),
        ]
    }

    /// Random schedules of broker faults, actor kills and consumer redeliveries never lose,
    /// duplicate (at the fold) or reorder an event.
    #[test]
    fn outbox_random_faults_and_kills_never_lose_duplicate_or_reorder() {
        let runtime = host_runtime();
        let (pool, url) = runtime.block_on(fresh_database("faults"));
        let case = AtomicU64::new(0);
        let strategy = (
            prop::collection::vec(fault(), 0..16),
            prop::collection::vec((1u64..40, any::<bool>(), 0usize..4), 0..4),
            prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        );
        let config = ProptestConfig {
            cases: 12,
            ..ProptestConfig::default()
        };
        proptest!(config, |((faults, kills, redeliveries) in strategy)| {
            let prefix = format!("f{}", case.fetch_add(1, Ordering::SeqCst));
            runtime.block_on(async {
                let ran = Workload::new(&prefix, 2, 2, 8).run(&pool).await;
                let broker = Arc::new(MemoryBroker::default());
                broker.schedule.lock().unwrap().extend(faults.iter().copied());
                let mut relay_config = relay_config(&url, &amqp_url(), &unique("relay-faults"));
                relay_config.supervisor.drainer.batch_size = 5;
                // Several batches per tenant in flight: the window's settling is under test too.
                relay_config.supervisor.drainer.max_batches_in_flight = 3;
                let factory_broker = broker.clone();
                let relay = Relay::start_with(relay_config, Arc::new(move |_| {
                    Double::memory(factory_broker.clone(), Script::default())
                }))
                .await
                .unwrap();
                let outbox = Outbox::new(pool.clone());
                let tenants = tenants_of(&ran.expected);
                let backlog = || async {
                    let mut left = 0;
                    for tenant in &tenants {
                        left += outbox.tenant_backlog(tenant).await.unwrap().pending;
                    }
                    left
                };
                for (after_calls, drainer, index) in &kills {
                    wait_until("publish calls", Duration::from_secs(30), || async {
                        broker.calls.load(Ordering::SeqCst) >= *after_calls || backlog().await == 0
                    })
                    .await;
                    if let Some(tree) = relay.snapshot().await {
                        if *drainer {
                            if let Some(actor) = tree.drainers.values().nth(index % tree.drainers.len().max(1)) {
                                actor.kill();
                            }
                        } else if let Some(actor) = tree.publishers.iter().flatten().nth(index % tree.publishers.len().max(1)) {
                            actor.kill();
                        }
                    }
                }
                wait_until("backlog drained", Duration::from_secs(60), || async { backlog().await == 0 }).await;
                relay.abort().await;

                // The consumer: everything stored, in order, then redeliveries after ack loss.
                let stored = broker.stored.lock().unwrap().clone();
                let mut deliveries = stored.clone();
                for index in &redeliveries {
                    if !stored.is_empty() {
                        deliveries.push(stored[index.index(stored.len())].clone());
                    }
                }
                // Transport order: because the relay never acks past a failure, whatever it sends
                // again arrives after its predecessor, so even a consumer that drops anything
                // early (no parking) converges to every branch's full chain.
                let mut cursors: BTreeMap<BranchKey, Lsn> = BTreeMap::new();
                for event in &stored {
                    let cursor = cursors.entry(event.key.branch.clone()).or_insert(event.base_lsn);
                    if event.prev_lsn == *cursor {
                        *cursor = event.key.lsn;
                    }
                }
                for (branch, events) in &ran.expected {
                    let last = events.last().map(|(lsn, _)| *lsn);
                    assert_eq!(cursors.get(branch).copied(), last, "a dropping consumer stalls on {branch}");
                }

                let fold = FoldStore::new(pool.clone());
                for event in &deliveries {
                    fold.apply(event).await.unwrap();
                }
                assert_folded_exactly(&fold, &ran.expected).await;
            });
        });
    }
}

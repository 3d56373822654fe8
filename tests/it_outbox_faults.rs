//! Property test of the whole relay under injected faults: an in-memory fault-injecting broker
//! (in addition to the real one the acceptance suite uses) behind the same `Publisher` port,
//! with random schedules of channel deaths, nacks, returned messages, lost confirms, consumer
//! ack loss (redeliveries) and actor kills. Whatever the schedule, the fold ends with every
//! live event exactly once, in Lsn order per branch; nothing is lost, duplicated or reordered.
#[path = "support/harness.rs"]
mod harness;

mod outbox {
    use std::collections::{BTreeMap, VecDeque};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use distribution::Relay;
    use distribution::broker::{BoxFuture, Confirms, Error, Outcome, PublishReport, Publisher};
    use distribution::store::{BranchKey, Fence, FoldStore, Lsn, Outbox, OutboxEvent};
    use proptest::prelude::*;

    use crate::harness::*;

    #[derive(Clone, Copy, Debug)]
    enum Fault {
        /// Every event accepted.
        Clean,
        /// The channel dies at event k: before it accepted, k itself stored but unconfirmed,
        /// after it never sent; the publisher actor fails.
        ChannelDiesAt(usize),
        /// Event k nacked (not stored); the rest accepted.
        NackAt(usize),
        /// Event k returned unroutable (not stored); the rest accepted.
        ReturnAt(usize),
        /// Event k stored but its confirm lost (timeout); the publisher actor fails.
        ConfirmLostAt(usize),
    }

    fn fault() -> impl Strategy<Value = Fault> {
        prop_oneof![
            Just(Fault::Clean),
            (0usize..8).prop_map(Fault::ChannelDiesAt),
            (0usize..8).prop_map(Fault::NackAt),
            (0usize..8).prop_map(Fault::ReturnAt),
            (0usize..8).prop_map(Fault::ConfirmLostAt),
        ]
    }

    /// The in-memory broker: a schedule of faults (one per publish call, then clean) and the
    /// queue of what it stored, in order.
    #[derive(Default)]
    struct FaultBroker {
        schedule: Mutex<VecDeque<Fault>>,
        stored: Mutex<Vec<OutboxEvent>>,
        calls: AtomicU64,
    }

    struct FaultPublisher(Arc<FaultBroker>);

    impl Publisher for FaultPublisher {
        // The port's shape: writing yields the future of the confirms.
        #[allow(clippy::async_yields_async)]
        fn send<'a>(
            &'a mut self,
            events: &'a [OutboxEvent],
            fence: &'a Fence,
        ) -> BoxFuture<'a, Confirms> {
            Box::pin(async move {
                let broker = &self.0;
                broker.calls.fetch_add(1, Ordering::SeqCst);
                let fault = broker
                    .schedule
                    .lock()
                    .unwrap()
                    .pop_front()
                    .unwrap_or(Fault::Clean);
                let mut stored = broker.stored.lock().unwrap();
                let mut outcomes = Vec::with_capacity(events.len());
                let mut fault_error = None;
                for (index, event) in events.iter().enumerate() {
                    let at = |k: usize| index == k % events.len();
                    let outcome = match fault {
                        _ if !fence.is_open() => Outcome::NotSent,
                        Fault::ChannelDiesAt(k) if index > k % events.len() => Outcome::NotSent,
                        Fault::ChannelDiesAt(k) | Fault::ConfirmLostAt(k) if at(k) => {
                            stored.push(event.clone());
                            fault_error = Some(Error::Unreachable("injected channel fault".into()));
                            Outcome::Unconfirmed
                        }
                        Fault::NackAt(k) if at(k) => Outcome::Nacked,
                        Fault::ReturnAt(k) if at(k) => Outcome::Returned,
                        _ => {
                            stored.push(event.clone());
                            Outcome::Accepted
                        }
                    };
                    outcomes.push(outcome);
                }
                let report = PublishReport {
                    outcomes,
                    fault: fault_error,
                };
                Box::pin(std::future::ready(report)) as Confirms
            })
        }
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
                let broker = Arc::new(FaultBroker::default());
                broker.schedule.lock().unwrap().extend(faults.iter().copied());
                let mut relay_config = relay_config(&url, &amqp_url(), &unique("relay-faults"));
                relay_config.supervisor.drainer.batch_size = 5;
                // Several batches per tenant in flight: the window's settling is under test too.
                relay_config.supervisor.drainer.max_batches_in_flight = 3;
                let factory_broker = broker.clone();
                let relay = Relay::start_with(relay_config, Arc::new(move |_| {
                    Box::new(FaultPublisher(factory_broker.clone())) as Box<dyn Publisher>
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

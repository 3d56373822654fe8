//! A branch whose events the broker keeps refusing parks alone: the rest of its tenant flows,
//! the branch shows as parked with its reason, and ships in order after a release.
#[path = "support/harness.rs"]
mod harness;

mod poison {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use distribution::Relay;
    use distribution::broker::{
        BoxFuture, Confirms, Outcome, PublishReport, Publisher, RabbitPublisher,
    };
    use distribution::store::{BranchKey, Fence, FoldStore, Outbox, OutboxEvent};

    use crate::harness::*;

    /// The real broker, except that while `poisoned` is set every event of `branch` is nacked
    /// (never written), as a queue at its limit with `reject-publish` would.
    struct Poisoning {
        inner: RabbitPublisher,
        branch: Arc<Mutex<Option<BranchKey>>>,
        poisoned: Arc<AtomicBool>,
    }

    impl Publisher for Poisoning {
        #[allow(clippy::async_yields_async)]
        fn send<'a>(
            &'a mut self,
            events: &'a [OutboxEvent],
            fence: &'a Fence,
        ) -> BoxFuture<'a, Confirms> {
            Box::pin(async move {
                let bad = self.branch.lock().unwrap().clone();
                let poisoned = self.poisoned.load(Ordering::SeqCst);
                let refused: Vec<bool> = events
                    .iter()
                    .map(|event| poisoned && Some(&event.key.branch) == bad.as_ref())
                    .collect();
                let good: Vec<OutboxEvent> = events
                    .iter()
                    .zip(&refused)
                    .filter(|(_, refused)| !**refused)
                    .map(|(event, _)| event.clone())
                    .collect();
                let confirms = self.inner.send(&good, fence).await;
                Box::pin(async move {
                    let report = confirms.await;
                    let mut written = report.outcomes.into_iter();
                    let outcomes = refused
                        .iter()
                        .map(|refused| {
                            if *refused {
                                Outcome::Nacked
                            } else {
                                written.next().unwrap_or(Outcome::NotSent)
                            }
                        })
                        .collect();
                    PublishReport {
                        outcomes,
                        fault: report.fault,
                    }
                }) as Confirms
            })
        }
    }

    #[test]
    fn a_refused_branch_parks_alone_and_ships_in_order_after_release() {
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("poison").await;
            let mut config = relay_config(&url, &amqp_url(), &unique("relay-poison"));
            config.supervisor.drainer.park_after_attempts = 3;
            config.supervisor.drainer.park_retry = Duration::from_secs(600);
            let fold = FoldStore::new(pool.clone());
            let folding = Folding::start(direct_rabbit(&config), &fold);
            let bad_branch = Arc::new(Mutex::new(None));
            let poisoned = Arc::new(AtomicBool::new(true));
            let rabbit = config.rabbit_config().unwrap();
            let factory = {
                let (bad_branch, poisoned) = (bad_branch.clone(), poisoned.clone());
                Arc::new(move |_shard| {
                    Box::new(Poisoning {
                        inner: RabbitPublisher::new(rabbit.clone()),
                        branch: bad_branch.clone(),
                        poisoned: poisoned.clone(),
                    }) as Box<dyn Publisher>
                })
            };
            let relay = Relay::start_with(config.clone(), factory).await.unwrap();
            let outbox = Outbox::new(pool.clone());

            // Tenant "sick" has three runs, one of them poisoned; tenant "calm" has three too.
            let sick = Workload::new("sick", 1, 3, 1).run(&pool).await;
            let calm = Workload::new("calm", 1, 3, 1).run(&pool).await;
            let bad = sick.live[0].0.clone();
            let mut all = sick.expected.clone();
            merge(&mut all, &calm.expected);
            wait_until("the first step folded", Duration::from_secs(30), || async {
                folded_count(&fold, &all).await == count(&all)
            })
            .await;

            // Steps 2..=30 on every branch; the bad branch's are refused from now on.
            *bad_branch.lock().unwrap() = Some(bad.clone());
            let started = Instant::now();
            let sick_more = Workload::new("sick", 1, 3, 30).steps(&pool, sick.live.clone(), 2..=30).await;
            let calm_more = Workload::new("calm", 1, 3, 30).steps(&pool, calm.live.clone(), 2..=30).await;
            let written = started.elapsed();
            merge(&mut all, &sick_more.expected);
            merge(&mut all, &calm_more.expected);
            let mut healthy = all.clone();
            healthy.remove(&bad);
            let bad_pending = sick_more.expected[&bad].len();

            // The healthy branches of the sick tenant ship while the bad one is refused.
            wait_until("healthy branches folded", Duration::from_secs(30), || async {
                let mut folded = 0;
                for tenant in tenants_of(&healthy) {
                    folded += fold
                        .folded(&tenant)
                        .await
                        .unwrap()
                        .iter()
                        .filter(|event| event.key.branch != bad)
                        .count();
                }
                folded == count(&healthy)
            })
            .await;
            let healthy_done = started.elapsed();
            wait_until("the bad branch parked", Duration::from_secs(30), || async {
                !outbox.parked_branches().await.unwrap().is_empty()
            })
            .await;
            let parked = outbox.parked_branches().await.unwrap();
            assert_eq!(parked.len(), 1, "{parked:?}");
            assert_eq!(parked[0].branch, bad);
            assert_eq!(parked[0].reason, "nacked");
            assert!(parked[0].attempts >= 3);
            assert_eq!(parked[0].pending as usize, bad_pending, "its events wait, none acked");
            println!(
                "host wrote for {:.2} s; healthy branches of the refused tenant all folded {:.2} s after the host started; the bad branch parked after {} attempts",
                written.as_secs_f64(),
                healthy_done.as_secs_f64(),
                parked[0].attempts
            );

            // The cause is fixed and an operator releases the branch: it ships, in order.
            poisoned.store(false, Ordering::SeqCst);
            let released = outbox.release(&bad.tenant, Some(&bad.run), None).await.unwrap();
            assert_eq!(released, 1);
            wait_until("everything folded after release", Duration::from_secs(30), || async {
                folded_count(&fold, &all).await == count(&all)
            })
            .await;
            assert_folded_exactly(&fold, &all).await;
            assert!(outbox.parked_branches().await.unwrap().is_empty());
            assert_eq!(pending(&outbox).await, 0);
            relay.shutdown().await;
            folding.stop().await;
            drop_topology(&config.rabbit_config().unwrap().topology).await;
        });
    }
}

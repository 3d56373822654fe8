//! One trace from the host's write to the consumer's fold, alone in its binary: it installs a
//! process-wide `tracing` subscriber with an OpenTelemetry layer exporting to memory (a process
//! has one global subscriber). The host appends inside its own span, and the writer (feature
//! `otel`) puts that span's W3C trace context on the intent; the relay's publish span links to
//! it; the consumer's fold span is its child: same trace id, parent the host's span. Both
//! follow OpenTelemetry's messaging conventions (names, kinds, `messaging.*`, `error.type`).
#[path = "it/harness.rs"]
mod harness;

mod trace {
    use std::time::Duration;

    use distribution::Relay;
    use distribution::consumer::{Consumer, ConsumerConfig};
    use distribution::store::{self, FoldStore, Intent, IntentWriter, Lsn};
    use futures_util::FutureExt;
    use opentelemetry::trace::{SpanKind, Status, TraceContextExt, TracerProvider as _};
    use opentelemetry::{KeyValue, Value};
    use opentelemetry_sdk::trace::SpanData;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::prelude::*;

    use crate::harness::*;

    /// `EventTable`, failing its first apply (of any partition's copy) with a transient error:
    /// the delivery is retried.
    #[derive(Clone)]
    struct FlakyOnce {
        failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl store::Projection for FlakyOnce {
        type Error = store::Error;

        async fn apply(
            &mut self,
            tx: &mut sqlx::PgConnection,
            event: &store::OutboxEvent,
        ) -> Result<(), store::Error> {
            if !self.failed.swap(true, std::sync::atomic::Ordering::SeqCst) {
                return Err(store::Error::NoAnswer {
                    after: Duration::from_millis(1),
                });
            }
            store::EventTable.apply(tx, event).await
        }

        async fn rewind(
            &mut self,
            tx: &mut sqlx::PgConnection,
            rewind: &store::RewindNotice,
        ) -> Result<(), store::Error> {
            store::EventTable.rewind(tx, rewind).await
        }
    }

    fn attribute(span: &SpanData, key: &str) -> Option<Value> {
        span.attributes
            .iter()
            .find(|KeyValue { key: name, .. }| name.as_str() == key)
            .map(|attribute| attribute.value.clone())
    }

    fn text(value: &str) -> Option<Value> {
        Some(Value::from(value.to_owned()))
    }

    #[test]
    fn the_consumers_fold_span_continues_the_hosts_trace() {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("trace-test")))
            .try_init()
            .expect("only this test installs a subscriber");

        host_runtime().block_on(async {
            let (pool, url) = fresh_database("trace").await;
            let (fold_pool, _) = fold_database("tracefold").await;
            let config = relay_config(&url, &amqp_url(), &unique("relay-trace"));
            let rabbit = config.rabbit_config().unwrap();
            let outcome = std::panic::AssertUnwindSafe(async {
                declare_topology(&rabbit.topology).await;
                let relay = Relay::start(config.clone()).await.unwrap();
                let consumer = Consumer::new(
                    ConsumerConfig::new(rabbit.clone()),
                    fold_pool.clone(),
                    FlakyOnce {
                        failed: Default::default(),
                    },
                );
                let consumer = until_stopped(|stopped| consumer.run(stopped));

                // Two requests of the host, traced: each span's context goes onto its intent.
                // Both intents commit together, so the relay ships them in one batch: its
                // publish span is a child of one trace and links to the other.
                let requests = [
                    tracing::info_span!("host.request"),
                    tracing::info_span!("host.request"),
                ];
                let hosts: Vec<_> = requests
                    .iter()
                    .map(|span| {
                        let context = span.context();
                        let span_context = context.span().span_context().clone();
                        (span_context.trace_id(), span_context.span_id())
                    })
                    .collect();
                let branch = write_first_intent(&pool, "trace-t", b"opened").await;
                let mut tx = pool.begin().await.unwrap();
                for (lsn, request) in [2, 3].into_iter().zip(requests) {
                    IntentWriter::default()
                        .append_intent(&mut tx, &branch, Lsn::new(lsn), Intent::new(b"traced"))
                        .instrument(request)
                        .await
                        .unwrap();
                }
                tx.commit().await.unwrap();

                let fold = FoldStore::new(fold_pool.clone());
                wait_until(
                    "the three intents folded",
                    Duration::from_secs(60),
                    || async { fold.folded(&branch.tenant).await.unwrap().len() == 3 },
                )
                .await;
                consumer.stop().await.unwrap();
                relay.shutdown().await;

                provider.force_flush().unwrap();
                let spans = exporter.get_finished_spans().unwrap();
                let exchange = rabbit.topology.exchange().to_string();
                let sends: Vec<_> = spans
                    .iter()
                    .filter(|s| s.name == format!("send {exchange}"))
                    .collect();
                assert!(!sends.is_empty(), "publish spans are named send <exchange>");
                for send in &sends {
                    assert_eq!(send.span_kind, SpanKind::Producer);
                    assert_eq!(attribute(send, "messaging.system"), text("rabbitmq"));
                    assert_eq!(attribute(send, "messaging.operation.name"), text("send"));
                    assert_eq!(attribute(send, "messaging.operation.type"), text("send"));
                    assert_eq!(
                        attribute(send, "messaging.destination.name"),
                        text(&exchange)
                    );
                    assert_eq!(attribute(send, "error.type"), None, "all confirmed");
                    // A batch names its size; a single message its id and routing key.
                    match attribute(send, "messaging.batch.message_count") {
                        Some(Value::I64(count)) => {
                            assert!(count > 1);
                            assert_eq!(attribute(send, "messaging.message.id"), None);
                        }
                        None => {
                            assert!(attribute(send, "messaging.message.id").is_some());
                            assert!(
                                attribute(send, "messaging.rabbitmq.destination.routing_key")
                                    .is_some()
                            );
                        }
                        other => panic!("messaging.batch.message_count {other:?}"),
                    }
                }
                let all_folds: Vec<_> = spans
                    .iter()
                    .filter(|s| s.name.starts_with("process "))
                    .collect();
                for fold in &all_folds {
                    assert_eq!(fold.span_kind, SpanKind::Consumer);
                    let queue = fold.name.strip_prefix("process ").unwrap();
                    assert!(queue.starts_with(&format!("{exchange}.p")), "{queue}");
                    assert_eq!(attribute(fold, "messaging.system"), text("rabbitmq"));
                    assert_eq!(attribute(fold, "messaging.operation.name"), text("process"));
                    assert_eq!(attribute(fold, "messaging.operation.type"), text("process"));
                    assert_eq!(attribute(fold, "messaging.destination.name"), text(queue));
                    assert_eq!(
                        attribute(fold, "messaging.consumer.group.name"),
                        text("default")
                    );
                    assert!(attribute(fold, "messaging.message.id").is_some());
                }
                // The first delivery failed once (transiently) and was retried: its first
                // fold span says so; every other ended well.
                let (failed, folds): (Vec<_>, Vec<_>) = all_folds
                    .into_iter()
                    .partition(|s| attribute(s, "error.type").is_some());
                assert_eq!(failed.len(), 1, "one failed attempt");
                assert_eq!(attribute(failed[0], "error.type"), text("retry"));
                assert!(matches!(failed[0].status, Status::Error { .. }));
                assert_eq!(folds.len(), 3, "one fold span per delivery");
                for (trace, span) in &hosts {
                    let traced: Vec<_> = folds
                        .iter()
                        .filter(|s| s.span_context.trace_id() == *trace)
                        .collect();
                    assert_eq!(
                        traced.len(),
                        1,
                        "each traced intent's fold is in its host's trace"
                    );
                    assert_eq!(
                        traced[0].parent_span_id, *span,
                        "and a child of the host's span"
                    );
                    let shipped = sends.iter().any(|s| {
                        s.span_context.trace_id() == *trace
                            || s.links
                                .iter()
                                .any(|link| link.span_context.trace_id() == *trace)
                    });
                    assert!(
                        shipped,
                        "a relay.publish span is in, or links to, each host trace"
                    );
                }
                let untraced = folds
                    .iter()
                    .filter(|s| {
                        hosts
                            .iter()
                            .all(|(trace, _)| s.span_context.trace_id() != *trace)
                    })
                    .count();
                assert_eq!(
                    untraced, 1,
                    "the untraced intent's fold has a trace of its own"
                );
                // Committed together, the two traced intents were drained into one batch: its
                // span is a child of the first's trace and links to the second's.
                let (first, second) = (hosts[0].0, hosts[1].0);
                let joined = sends.iter().any(|s| {
                    s.span_context.trace_id() == first
                        && s.links
                            .iter()
                            .any(|link| link.span_context.trace_id() == second)
                });
                assert!(
                    joined,
                    "one publish span is in the first trace and links to the second"
                );
            })
            .catch_unwind()
            .await;
            drop_topology(&rabbit.topology).await;
            if let Err(panic) = outcome {
                std::panic::resume_unwind(panic);
            }
        });
    }
}

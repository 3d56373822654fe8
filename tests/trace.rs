//! One trace from the host's write to the consumer's fold, alone in its binary: it installs a
//! process-wide `tracing` subscriber with an OpenTelemetry layer exporting to memory (a process
//! has one global subscriber). The host appends inside its own span, and the writer (feature
//! `otel`) puts that span's W3C trace context on the intent; the relay's `relay.publish` span
//! links to it; the consumer's `relay.fold` span is its child: same trace id, parent the host's
//! span.
#[path = "it/harness.rs"]
mod harness;

mod trace {
    use std::time::Duration;

    use distribution::Relay;
    use distribution::consumer::{Consumer, ConsumerConfig};
    use distribution::store::{self, FoldStore, Intent, IntentWriter, Lsn};
    use futures_util::FutureExt;
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::prelude::*;

    use crate::harness::*;

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
            let fold_pool = bare_database("tracefold").await;
            store::migrate_fold(&fold_pool).await.unwrap();
            let config = relay_config(&url, &amqp_url(), &unique("relay-trace"));
            let rabbit = config.rabbit_config().unwrap();
            let outcome = std::panic::AssertUnwindSafe(async {
                declare_topology(&rabbit.topology).await;
                let relay = Relay::start(config.clone()).await.unwrap();
                let (stop, stopped) = tokio::sync::watch::channel(false);
                let consumer = tokio::spawn(
                    Consumer::new(
                        ConsumerConfig::new(rabbit.clone()),
                        fold_pool.clone(),
                        store::EventTable,
                    )
                    .run(async move {
                        let mut stopped = stopped;
                        let _ = stopped.wait_for(|stop| *stop).await;
                    }),
                );

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
                let _ = stop.send(true);
                consumer.await.unwrap().unwrap();
                relay.shutdown().await;

                provider.force_flush().unwrap();
                let spans = exporter.get_finished_spans().unwrap();
                let folds: Vec<_> = spans.iter().filter(|s| s.name == "relay.fold").collect();
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
                    let shipped = spans.iter().any(|s| {
                        s.name == "relay.publish"
                            && (s.span_context.trace_id() == *trace
                                || s.links
                                    .iter()
                                    .any(|link| link.span_context.trace_id() == *trace))
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
                let joined = spans.iter().any(|s| {
                    s.name == "relay.publish"
                        && s.span_context.trace_id() == first
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

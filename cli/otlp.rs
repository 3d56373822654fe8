//! Traces over OTLP (cargo feature `otlp`): when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, the
//! binary exports its `relay.publish` and `relay.fold` spans (and the rest at INFO) to it over
//! OTLP/HTTP with protobuf, batched. The exporter reads the standard `OTEL_*` variables itself
//! (`OTEL_SERVICE_NAME`, `OTEL_EXPORTER_OTLP_HEADERS`, ...).
use anyhow::{Context, Result};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;

/// A layer exporting spans, boxed for the subscriber.
pub type TraceLayer<S> = Box<dyn Layer<S> + Send + Sync>;

/// The provider to flush at exit, and the layer to add to the subscriber; `None` without an
/// endpoint.
pub fn layer<S>() -> Result<Option<(SdkTracerProvider, TraceLayer<S>)>>
where
    S: tracing::Subscriber
        + for<'span> tracing_subscriber::registry::LookupSpan<'span>
        + Send
        + Sync,
{
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .context("OTEL_EXPORTER_OTLP_ENDPOINT: cannot build the OTLP exporter")?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .build();
    let tracer = provider.tracer("distribution");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
        .boxed();
    Ok(Some((provider, layer)))
}

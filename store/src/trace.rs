//! Trace context from the host's current span (cargo feature `otel`).
//!
//! With the feature, [`crate::IntentWriter::append_intent`] fills an intent's `traceparent`
//! and `tracestate` from the OpenTelemetry context of the current `tracing` span (through
//! `tracing-opentelemetry`), so a host that already traces propagates without code. Without
//! it, or outside a sampled span, nothing is filled.
use crate::Metadata;

#[cfg(feature = "otel")]
pub(crate) fn fill_from_current_span(meta: &mut Metadata) {
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    if meta.traceparent.is_some() {
        return;
    }
    let context = tracing::Span::current().context();
    if !context.span().span_context().is_valid() {
        return;
    }
    let mut carrier = std::collections::HashMap::new();
    opentelemetry_sdk::propagation::TraceContextPropagator::new()
        .inject_context(&context, &mut carrier);
    meta.traceparent = carrier.remove("traceparent");
    meta.tracestate = carrier.remove("tracestate").filter(|s| !s.is_empty());
}

#[cfg(not(feature = "otel"))]
pub(crate) fn fill_from_current_span(_meta: &mut Metadata) {}

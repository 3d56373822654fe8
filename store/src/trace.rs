//! W3C trace context between `tracing` spans and intents (cargo feature `otel`).
//!
//! With the feature, [`crate::IntentWriter::append_intent`] fills an intent's `traceparent`
//! and `tracestate` from the OpenTelemetry context of the current `tracing` span (through
//! `tracing-opentelemetry`), so a host that already traces propagates without code, and
//! [`remote_context`] turns an event's trace context back into a parent or a link for the
//! relay's publish span and the consumer's fold span. Without the feature, or outside a
//! sampled span, nothing is filled.
use crate::meta::Metadata;

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

/// The OpenTelemetry context an event's `traceparent`/`tracestate` name (a remote parent), or
/// `None` when it carries none (or an invalid one). Feature `otel`.
#[cfg(feature = "otel")]
pub fn remote_context(meta: &Metadata) -> Option<opentelemetry::Context> {
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;

    let parent = meta.traceparent.as_ref()?;
    let mut carrier = std::collections::HashMap::new();
    carrier.insert("traceparent".to_owned(), parent.clone());
    if let Some(state) = &meta.tracestate {
        carrier.insert("tracestate".to_owned(), state.clone());
    }
    let context = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
    context.span().span_context().is_valid().then_some(context)
}

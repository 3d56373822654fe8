//! What one delivery's fold is given: the user's projection seen through the subscribed
//! event types, and its span.
use std::collections::BTreeSet;

use sqlx::PgConnection;
use store::{EventType, OutboxEvent, Projection};

/// The span of one delivery's fold, `relay.fold`, named and attributed by OpenTelemetry's
/// messaging conventions (`process <queue>`, kind CONSUMER, `messaging.*` with `system` the
/// broker, `error.type` and an
/// error status when the fold is retried or dead-letters): a child (feature `otel`) of the
/// trace the event carries, so one trace shows the host's write, the relay's publish and this
/// fold.
pub(crate) fn fold_span(
    event: &OutboxEvent,
    system: &'static str,
    queue: &str,
    group: &str,
) -> tracing::Span {
    let key = &event.key.branch;
    let span = tracing::info_span!(
        "relay.fold",
        otel.name = format!("process {queue}"),
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        messaging.system = system,
        messaging.operation.name = "process",
        messaging.operation.type = "process",
        messaging.destination.name = queue,
        messaging.consumer.group.name = group,
        messaging.message.id = broker::message_id(&event.key).to_string(),
        error.type = tracing::field::Empty,
        tenant = key.tenant.as_str(),
        run = key.run.as_str(),
        branch = key.branch.as_str(),
        lsn = event.key.lsn.get(),
        event_type = event.meta.event_type.as_ref().map(EventType::as_str),
    );
    #[cfg(feature = "otel")]
    if let Some(parent) = store::remote_context(&event.meta) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let _ = span.set_parent(parent);
    }
    span
}

/// The user's projection, given only the subscribed event types' intents
/// ([`ConsumerConfig::event_types`]); the fold's bookkeeping sees every delivery.
pub(crate) struct Subscribed<'a, P> {
    pub(super) inner: &'a mut P,
    pub(super) types: Option<&'a BTreeSet<EventType>>,
}

impl<P: Projection> Projection for Subscribed<'_, P> {
    type Error = P::Error;

    async fn apply(&mut self, tx: &mut PgConnection, event: &OutboxEvent) -> Result<(), P::Error> {
        let wanted = match (self.types, &event.meta.event_type) {
            (None, _) => true,
            (Some(types), Some(event_type)) => types.contains(event_type),
            (Some(_), None) => false,
        };
        if !wanted {
            metrics::counter!("relay_consumer_skipped_total").increment(1);
            return Ok(());
        }
        self.inner.apply(tx, event).await
    }

    async fn rewind(
        &mut self,
        tx: &mut PgConnection,
        rewind: &store::RewindNotice,
    ) -> Result<(), P::Error> {
        self.inner.rewind(tx, rewind).await
    }

    async fn end(&mut self, tx: &mut PgConnection, end: &OutboxEvent) -> Result<(), P::Error> {
        self.inner.end(tx, end).await
    }

    fn is_permanent(error: &P::Error) -> bool {
        P::is_permanent(error)
    }
}

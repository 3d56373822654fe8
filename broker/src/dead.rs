//! Dead letters and watched events, whatever the broker: which ones an operation or a watch
//! takes, and how a message reads to a person (pure).
use store::{OutboxEvent, RunId, TenantId};

use crate::error::WireError;
use crate::partition::{Partition, partition_of};

/// What a tail (`distribution tail`) watches: every event, a tenant's, or one run's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TailFilter {
    /// Only this tenant's events.
    pub tenant: Option<TenantId>,
    /// Only this run's (with `tenant`: its partition alone is watched).
    pub run: Option<RunId>,
}

impl TailFilter {
    /// Whether a message is shown: every message without a filter; with one, only events of
    /// that tenant (and run).
    pub fn matches(&self, event: &Result<OutboxEvent, WireError>) -> bool {
        if self.tenant.is_none() && self.run.is_none() {
            return true;
        }
        event.as_ref().is_ok_and(|event| {
            let branch = &event.key.branch;
            self.tenant.as_ref().is_none_or(|t| branch.tenant == *t)
                && self.run.as_ref().is_none_or(|r| branch.run == *r)
        })
    }

    /// The partitions (of `partitions`) a tail watches: one for a tenant's run, else all.
    pub fn partitions(&self, partitions: u16) -> Vec<Partition> {
        match (&self.tenant, &self.run) {
            (Some(tenant), Some(run)) => vec![partition_of(tenant, run, partitions)],
            _ => (0..partitions.max(1)).map(Partition).collect(),
        }
    }
}

/// Which dead letters an operation takes: all of them, or those of a tenant, a run of it, or one
/// message id. Messages that are not events (broken contract) only match `All` and `MessageId`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeadFilter {
    /// Every dead letter.
    All,
    /// The dead letters of a tenant, or of one run of it.
    Tenant(TenantId, Option<RunId>),
    /// The one with this message id.
    MessageId(String),
}

impl DeadFilter {
    /// Whether the dead letter with `message_id` carrying `event` is taken.
    pub fn takes(&self, message_id: Option<&str>, event: &Result<OutboxEvent, WireError>) -> bool {
        match self {
            DeadFilter::All => true,
            DeadFilter::MessageId(id) => message_id == Some(id.as_str()),
            DeadFilter::Tenant(tenant, run) => event.as_ref().is_ok_and(|event| {
                let branch = &event.key.branch;
                branch.tenant == *tenant && run.as_ref().is_none_or(|run| branch.run == *run)
            }),
        }
    }
}

/// A dead letter as an operator reads it, whatever the broker keeps it in (the CLI's `dead`
/// and the console show these).
#[derive(Debug)]
pub struct DeadLetterView {
    /// Where it is among the group's dead letters: its position in the dead-letter queue, from
    /// 1 (RabbitMQ), or its sequence in the dead-letter stream (NATS).
    pub position: u64,
    /// Its message id (`tenant/run/branch/lsn`), if it has one.
    pub message_id: Option<String>,
    /// Why it was dead-lettered, as the consumer (or the broker) said.
    pub reason: Option<String>,
    /// The event it carries, or why it is not one (a message that broke the contract).
    pub event: Result<OutboxEvent, WireError>,
    /// Its headers as a person reads them, in order.
    pub headers: Vec<(String, String)>,
    /// The body, as kept.
    pub body: Vec<u8>,
}

impl DeadLetterView {
    /// What it carries: `intent`, `rewind`, `end`, or `not an event`.
    pub fn kind(&self) -> &'static str {
        event_kind(&self.event)
    }

    /// What a person looks for first ([`event_properties`]).
    pub fn properties(&self) -> Vec<(&'static str, String)> {
        event_properties(&self.event)
    }
}

/// What a person looks for first in a message, from the event it carries (none for a message
/// that is not one): when it was written (RFC 3339, not the header's microseconds), then the
/// metadata it travelled with, those it has.
pub fn event_properties(event: &Result<OutboxEvent, WireError>) -> Vec<(&'static str, String)> {
    let Ok(event) = event else {
        return Vec::new();
    };
    let meta = &event.meta;
    let mut shown = vec![(
        "written at",
        event
            .created_at
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
    )];
    let named = [
        (
            "type",
            meta.event_type.as_ref().map(|t| t.as_str().to_owned()),
        ),
        ("content type", meta.content_type.clone()),
        ("correlation id", meta.correlation_id.clone()),
        ("causation id", meta.causation_id.clone()),
        ("traceparent", meta.traceparent.clone()),
    ];
    shown.extend(
        named
            .into_iter()
            .filter_map(|(name, value)| Some((name, value?))),
    );
    shown
}

/// What a message carries: `intent`, `rewind`, `end`, or `not an event`.
pub fn event_kind(event: &Result<OutboxEvent, WireError>) -> &'static str {
    match event {
        Ok(event) => match event.kind {
            store::EventKind::Intent => "intent",
            store::EventKind::Rewind { .. } => "rewind",
            store::EventKind::End => "end",
        },
        Err(_) => "not an event",
    }
}

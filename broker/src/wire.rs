//! The wire contract (documented in `broker/WIRE.md`), the same on every broker: an event as an
//! [`Envelope`] (a message id, a type, a content type, a correlation id and named headers,
//! [`envelope`]) and back ([`decode`]); the body is the payload, unchanged. Each adapter maps
//! an envelope onto its broker's message and no more (RabbitMQ: `rabbit::encode`, AMQP
//! properties and headers).
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use store::{
    BranchId, BranchKey, Epoch, Epochs, EventKey, EventKind, EventType, Lsn, Metadata, OutboxEvent,
    RunId, TenantId,
};

/// The contract version this relay writes (header `wire_version`).
pub const WIRE_VERSION: i64 = 4;

/// Header naming why a consumer dead-lettered a message, on either broker.
pub const DEAD_LETTER_REASON: &str = "x-relay-dead-letter-reason";

/// The default content type: the payload's bytes, unchanged, of a type the host did not say.
pub const OCTET_STREAM: &str = "application/octet-stream";

/// Prefix of the CloudEvents attributes in opt-in CloudEvents mode (binary content mode of the
/// CloudEvents AMQP protocol binding: attributes as application properties named
/// `cloudEvents_<attribute>`, the binding's prefix since 1.0.2; AMQP 0-9-1 carries them as
/// headers).
pub const CLOUDEVENTS_PREFIX: &str = "cloudEvents_";

/// The binding's first prefix, `cloudEvents:` (1.0), which this relay wrote before it wrote
/// [`CLOUDEVENTS_PREFIX`]: [`WireMode::CloudEventsColon`].
pub const CLOUDEVENTS_COLON_PREFIX: &str = "cloudEvents:";

/// How events are written beside the contract's own properties and headers. The prefixes below
/// are the AMQP binding's, written on RabbitMQ; on NATS, `CloudEvents` writes the NATS binding's
/// `ce-*` headers instead (the `nats` adapter) and `CloudEventsColon` is refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WireMode {
    /// The contract alone (WIRE.md).
    #[default]
    Plain,
    /// The contract plus CloudEvents attributes (`cloudEvents_specversion`, `id`, `source`,
    /// `type`, `time`, `subject`), so CloudEvents SDKs read the message as an event in binary
    /// content mode. Opt-in (`RELAY_CLOUDEVENTS=true`).
    CloudEvents,
    /// The same attributes under the binding's first prefix (`cloudEvents:specversion`, ...),
    /// for readers written for it (`RELAY_CLOUDEVENTS=colon`).
    CloudEventsColon,
}

impl WireMode {
    /// The prefix of the CloudEvents attributes it writes, if any.
    pub fn cloudevents_prefix(self) -> Option<&'static str> {
        match self {
            WireMode::Plain => None,
            WireMode::CloudEvents => Some(CLOUDEVENTS_PREFIX),
            WireMode::CloudEventsColon => Some(CLOUDEVENTS_COLON_PREFIX),
        }
    }
}

/// The `type` of an export intent.
pub const TYPE_INTENT: &str = "outbox.intent";
/// The `type` of a rewind marker.
pub const TYPE_REWIND: &str = "outbox.rewind";
/// The `type` of an end marker (a closed run's last message).
pub const TYPE_END: &str = "outbox.end";

use crate::error::WireError;

/// An event's `message_id` (WIRE.md): `tenant/run/branch/lsn`. Ids are at most 64 bytes each, so
/// this stays far below the 255-byte AMQP short-string limit.
pub fn message_id(key: &EventKey) -> String {
    format!("{}/{}", key.branch, key.lsn)
}

/// The contract's headers whose values are numbers: a broker that carries every header as text
/// (NATS) reads these back as [`Value::Number`], every other as [`Value::Text`].
pub const NUMBER_HEADERS: [&str; 7] = [
    "lsn",
    "prev_lsn",
    "base_lsn",
    "created_at_us",
    "wire_version",
    "epoch",
    "prev_epoch",
];

/// A header's value: the contract's headers are texts (AMQP long strings) and signed 64-bit
/// numbers (AMQP long long ints).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// Bytes, UTF-8 when the relay wrote them.
    Text(Vec<u8>),
    /// A signed 64-bit number.
    Number(i64),
    /// A value of another type, written by someone else: kept so that a header of the
    /// contract's name but not of its type reads as malformed, not as absent.
    Other,
}

impl Value {
    fn text(value: &str) -> Self {
        Value::Text(value.as_bytes().to_vec())
    }
}

/// An event's message without its body, in no broker's terms: what [`envelope`] writes and
/// [`decode`] reads. Each field is optional because a message read back may lack it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Envelope {
    /// `message_id`: [`message_id`].
    pub message_id: Option<String>,
    /// `type`: `outbox.intent`, `outbox.rewind`, `outbox.end`, or the host's event type.
    pub kind: Option<String>,
    /// `content_type`: the host's, or [`OCTET_STREAM`].
    pub content_type: Option<String>,
    /// `correlation_id`, when the host gave one.
    pub correlation_id: Option<String>,
    /// The headers, the host's and the contract's, by name.
    pub headers: BTreeMap<String, Value>,
}

/// An event's envelope (WIRE.md); the body is the payload, unchanged. What every adapter
/// publishes, and [`decode`]'s inverse.
pub fn envelope(event: &OutboxEvent, mode: WireMode) -> Envelope {
    let branch = &event.key.branch;
    let meta = &event.meta;
    let mut headers = BTreeMap::new();
    // The host's headers first: their names never clash with the contract's (the writer and
    // `relay_append` refuse reserved names), so the contract's below cannot be overwritten.
    for (name, value) in &meta.headers {
        headers.insert(name.clone(), Value::text(value));
    }
    for (name, value) in [
        ("causation_id", &meta.causation_id),
        ("traceparent", &meta.traceparent),
        ("tracestate", &meta.tracestate),
    ] {
        if let Some(value) = value {
            headers.insert(name.to_owned(), Value::text(value));
        }
    }
    let mut text = |name: &str, value: &str| headers.insert(name.to_owned(), Value::text(value));
    text("tenant", branch.tenant.as_str());
    text("run", branch.run.as_str());
    text("branch", branch.branch.as_str());
    text(
        "kind",
        match &event.kind {
            EventKind::Intent => "intent",
            EventKind::Rewind { .. } => "rewind",
            EventKind::End => "end",
        },
    );
    if let EventKind::Rewind { to } = &event.kind {
        text("rewound_to", to.as_str());
    }
    if let Some(parent) = &event.parent {
        text("parent_branch", parent.as_str());
    }
    let mut number = |name: &str, value: i64| headers.insert(name.to_owned(), Value::Number(value));
    number("lsn", event.key.lsn.get() as i64);
    number("prev_lsn", event.prev_lsn.get() as i64);
    number("base_lsn", event.base_lsn.get() as i64);
    number("created_at_us", event.created_at.timestamp_micros());
    number("wire_version", WIRE_VERSION);
    if let Some(epoch) = event.epochs.epoch {
        number("epoch", epoch.to_db());
    }
    if let Some(prev) = event.epochs.prev {
        number("prev_epoch", prev.to_db());
    }
    let kind = message_type(event);
    let id = message_id(&event.key);
    if let Some(prefix) = mode.cloudevents_prefix() {
        for (attribute, value) in cloudevents_attributes(event) {
            headers.insert(
                format!("{prefix}{attribute}"),
                Value::Text(value.into_bytes()),
            );
        }
    }
    Envelope {
        message_id: Some(id),
        kind: Some(kind.to_owned()),
        content_type: Some(meta.content_type_or_default().to_owned()),
        correlation_id: meta.correlation_id.clone(),
        headers,
    }
}

/// An event's `type`: the host's event type, or the relay's own for an untyped intent and for
/// markers.
fn message_type(event: &OutboxEvent) -> &str {
    match (&event.kind, &event.meta.event_type) {
        (EventKind::Intent, Some(event_type)) => event_type.as_str(),
        (EventKind::Intent, None) => TYPE_INTENT,
        (EventKind::Rewind { .. }, _) => TYPE_REWIND,
        (EventKind::End, _) => TYPE_END,
    }
}

/// An event's CloudEvents context attributes (WIRE.md, "CloudEvents"), each with its canonical
/// string: `specversion`, `id` (the message id), `source` (`/<tenant>/<run>`), `type` (the
/// message's type), `time` (`created_at` in RFC 3339, microseconds, `Z`) and `subject` (the
/// branch). `datacontenttype` is not among them: each binding carries the content type its own
/// way (AMQP's `content_type` property, a `ce-datacontenttype` header on NATS).
pub fn cloudevents_attributes(event: &OutboxEvent) -> [(&'static str, String); 6] {
    let branch = &event.key.branch;
    [
        ("specversion", "1.0".to_owned()),
        ("id", message_id(&event.key)),
        ("source", format!("/{}/{}", branch.tenant, branch.run)),
        ("type", message_type(event).to_owned()),
        (
            "time",
            event
                .created_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        ),
        ("subject", branch.branch.as_str().to_owned()),
    ]
}

/// The metadata a message carries (empty for a version 1 or 2 message).
fn metadata(envelope: &Envelope, kind: &EventKind) -> Metadata {
    let headers = &envelope.headers;
    let long = |name: &str| match headers.get(name) {
        Some(Value::Text(value)) => Some(String::from_utf8_lossy(value).into_owned()),
        _ => None,
    };
    let event_type = match kind {
        EventKind::Intent => envelope
            .kind
            .as_deref()
            .and_then(|t| EventType::new(t).ok()),
        _ => None,
    };
    Metadata {
        event_type,
        content_type: envelope.content_type.clone().filter(|c| c != OCTET_STREAM),
        correlation_id: envelope.correlation_id.clone(),
        causation_id: long("causation_id"),
        headers: headers
            .iter()
            .filter(|(name, _)| !store::is_reserved_header(name))
            .filter_map(|(name, value)| match value {
                Value::Text(value) => {
                    Some((name.clone(), String::from_utf8_lossy(value).into_owned()))
                }
                _ => None,
            })
            .collect(),
        traceparent: long("traceparent"),
        tracestate: long("tracestate"),
    }
}

type Headers = BTreeMap<String, Value>;

fn text<'a>(headers: &'a Headers, name: &'static str) -> Result<&'a [u8], WireError> {
    match headers.get(name) {
        Some(Value::Text(value)) => Ok(value),
        _ => Err(WireError::Header(name)),
    }
}

fn number(headers: &Headers, name: &'static str) -> Result<i64, WireError> {
    match headers.get(name) {
        Some(Value::Number(value)) if *value >= 0 || name == "created_at_us" => Ok(*value),
        _ => Err(WireError::Header(name)),
    }
}

fn id<T>(
    headers: &Headers,
    name: &'static str,
    parse: fn(&str) -> Result<T, store::InvalidId>,
) -> Result<T, WireError> {
    let raw = std::str::from_utf8(text(headers, name)?).map_err(|_| WireError::Header(name))?;
    parse(raw).map_err(|err| WireError::Id {
        header: name,
        reason: err.to_string(),
    })
}

/// Reads a delivered message back into the event the relay published.
pub fn decode(envelope: &Envelope, body: &[u8]) -> Result<OutboxEvent, WireError> {
    let headers = &envelope.headers;
    let branch = BranchKey::new(
        id(headers, "tenant", |s| TenantId::new(s))?,
        id(headers, "run", |s| RunId::new(s))?,
        id(headers, "branch", |s| BranchId::new(s))?,
    );
    let created_at = DateTime::<Utc>::from_timestamp_micros(number(headers, "created_at_us")?)
        .ok_or(WireError::Header("created_at_us"))?;
    // Version 1 messages carry neither `kind` nor `parent_branch`: they are intents.
    let kind = match headers.get("kind") {
        None => EventKind::Intent,
        Some(Value::Text(kind)) if kind == b"intent" => EventKind::Intent,
        Some(Value::Text(kind)) if kind == b"rewind" => EventKind::Rewind {
            to: id(headers, "rewound_to", |s| BranchId::new(s))?,
        },
        Some(Value::Text(kind)) if kind == b"end" => EventKind::End,
        Some(_) => return Err(WireError::Header("kind")),
    };
    let meta = metadata(envelope, &kind);
    let parent = match headers.get("parent_branch") {
        None => None,
        Some(_) => Some(id(headers, "parent_branch", |s| BranchId::new(s))?),
    };
    // Version 4: absent on rows written before epochs (and on older relays' messages).
    let epoch = |name| match headers.get(name) {
        None => Ok(None),
        Some(_) => number(headers, name).map(|n| Some(Epoch::new(n as u64))),
    };
    let epochs = Epochs {
        epoch: epoch("epoch")?,
        prev: epoch("prev_epoch")?,
    };
    Ok(OutboxEvent {
        key: EventKey {
            branch,
            lsn: Lsn::new(number(headers, "lsn")? as u64),
        },
        prev_lsn: Lsn::new(number(headers, "prev_lsn")? as u64),
        base_lsn: Lsn::new(number(headers, "base_lsn")? as u64),
        payload: body.to_vec(),
        created_at,
        kind,
        parent,
        meta,
        epochs,
    })
}
#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn key(tenant: &str, run: &str, branch: &str, lsn: u64) -> EventKey {
        EventKey {
            branch: BranchKey::new(
                TenantId::new(tenant).unwrap(),
                RunId::new(run).unwrap(),
                BranchId::new(branch).unwrap(),
            ),
            lsn: Lsn::new(lsn),
        }
    }

    fn events() -> impl Strategy<Value = OutboxEvent> {
        let ids = "[a-z0-9][a-z0-9-]{0,11}";
        let kind = prop_oneof![
            Just(EventKind::Intent),
            Just(EventKind::End),
            ids.prop_map(|to| EventKind::Rewind {
                to: BranchId::new(to).unwrap()
            }),
        ];
        let meta = (
            proptest::option::of("[a-z]{1,8}\\.[a-z]{1,8}"),
            proptest::option::of("application/[a-z]{1,8}"),
            proptest::option::of("[ -~]{0,16}"),
            proptest::option::of("[ -~]{0,16}"),
            proptest::collection::btree_map("h-[a-z0-9_]{1,8}", "[ -~]{0,12}", 0..4),
            proptest::option::of("00-[0-9a-f]{32}-[0-9a-f]{16}-01"),
        );
        (
            (ids, ids, ids, 1u64..u64::from(u32::MAX), 0u64..4),
            kind,
            proptest::option::of(ids),
            meta,
            (proptest::option::of(1u64..9), proptest::option::of(1u64..9)),
            proptest::collection::vec(any::<u8>(), 0..32),
            0i64..4_000_000_000_000_000,
        )
            .prop_map(
                |(
                    (tenant, run, branch, lsn, back),
                    kind,
                    parent,
                    meta,
                    epochs,
                    payload,
                    micros,
                )| {
                    let (event_type, content_type, correlation_id, causation_id, headers, trace) =
                        meta;
                    OutboxEvent {
                        key: key(&tenant, &run, &branch, lsn),
                        prev_lsn: Lsn::new(lsn.saturating_sub(1 + back)),
                        base_lsn: Lsn::new(lsn.saturating_sub(1 + 2 * back)),
                        payload,
                        created_at: DateTime::from_timestamp_micros(micros).unwrap(),
                        meta: Metadata {
                            // The host's type names an intent only: a marker's `type` is its own.
                            event_type: event_type
                                .filter(|_| kind == EventKind::Intent)
                                .map(|t| EventType::new(t).unwrap()),
                            content_type,
                            correlation_id,
                            causation_id,
                            headers: headers.into_iter().collect(),
                            traceparent: trace,
                            tracestate: None,
                        },
                        kind,
                        parent: parent.map(|p| BranchId::new(p).unwrap()),
                        epochs: Epochs {
                            epoch: epochs.0.map(Epoch::new),
                            prev: epochs.1.map(Epoch::new),
                        },
                    }
                },
            )
    }

    proptest! {
        /// Every adapter writes an event's envelope and reads it back with [`decode`]: what the
        /// relay writes, a consumer reads unchanged, whatever the mode and the metadata.
        #[test]
        fn decode_inverts_envelope(
            event in events(),
            mode in prop_oneof![
                Just(WireMode::Plain),
                Just(WireMode::CloudEvents),
                Just(WireMode::CloudEventsColon),
            ],
        ) {
            let written = envelope(&event, mode);
            prop_assert_eq!(written.message_id.clone(), Some(message_id(&event.key)));
            prop_assert_eq!(written.headers.get("wire_version"), Some(&Value::Number(WIRE_VERSION)));
            for (name, value) in &written.headers {
                prop_assert_eq!(
                    matches!(value, Value::Number(_)),
                    NUMBER_HEADERS.contains(&name.as_str()),
                    "{} is a number exactly when NUMBER_HEADERS says so", name
                );
            }
            prop_assert_eq!(decode(&written, &event.payload).unwrap(), event);
        }
    }

    /// A header of the contract's name but of another type is malformed, not absent: a `kind`
    /// that is not text is refused, where a message without one is a version 1 intent.
    #[test]
    fn a_header_of_another_type_is_refused_not_ignored() {
        let event = OutboxEvent {
            key: key("acme", "run-7", "main", 3),
            prev_lsn: Lsn::new(2),
            base_lsn: Lsn::ZERO,
            payload: Vec::new(),
            created_at: Utc::now(),
            kind: EventKind::Intent,
            parent: None,
            meta: Metadata::default(),
            epochs: Epochs::default(),
        };
        let mut written = envelope(&event, WireMode::Plain);
        written.headers.remove("kind");
        assert_eq!(decode(&written, b"").unwrap().kind, EventKind::Intent);
        written.headers.insert("kind".into(), Value::Other);
        assert_eq!(decode(&written, b""), Err(WireError::Header("kind")));
        written.headers.insert("kind".into(), Value::text("intent"));
        written
            .headers
            .insert("lsn".into(), Value::Text(b"3".to_vec()));
        assert_eq!(decode(&written, b""), Err(WireError::Header("lsn")));
        assert_eq!(
            decode(&Envelope::default(), b""),
            Err(WireError::Header("tenant"))
        );
    }
}

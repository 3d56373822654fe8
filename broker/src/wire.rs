//! The wire contract (documented in `broker/WIRE.md`): how an outbox event becomes a message.
use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use store::{
    BranchId, BranchKey, Epoch, Epochs, EventKey, EventKind, EventType, Lsn, Metadata, OutboxEvent,
    RunId, TenantId,
};

/// The contract version this relay writes (header `wire_version`).
pub const WIRE_VERSION: i64 = 4;

/// The default content type: the payload's bytes, unchanged, of a type the host did not say.
pub(crate) const OCTET_STREAM: &str = "application/octet-stream";

/// Prefix of the CloudEvents attributes in opt-in CloudEvents mode (binary content mode of the
/// CloudEvents AMQP protocol binding: attributes as application properties named
/// `cloudEvents_<attribute>`, the binding's prefix since 1.0.2; AMQP 0-9-1 carries them as
/// headers).
pub const CLOUDEVENTS_PREFIX: &str = "cloudEvents_";

/// The binding's first prefix, `cloudEvents:` (1.0), which this relay wrote before it wrote
/// [`CLOUDEVENTS_PREFIX`]: [`WireMode::CloudEventsColon`].
pub const CLOUDEVENTS_COLON_PREFIX: &str = "cloudEvents:";

/// How events are written beside the contract's own properties and headers.
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

/// AMQP `type` of an export intent.
pub(crate) const TYPE_INTENT: &str = "outbox.intent";
/// AMQP `type` of a rewind marker.
pub(crate) const TYPE_REWIND: &str = "outbox.rewind";
/// AMQP `type` of an end marker (a closed run's last message).
pub(crate) const TYPE_END: &str = "outbox.end";

use crate::WireError;

/// An event's `message_id` (WIRE.md): `tenant/run/branch/lsn`. Ids are at most 64 bytes each, so this stays far
/// below the 255-byte AMQP short-string limit.
pub fn message_id(key: &EventKey) -> ShortString {
    ShortString::from(format!("{}/{}", key.branch, key.lsn))
}

/// The properties of an event's message (WIRE.md); the body is the payload, unchanged. What
/// the relay publishes, and [`decode`]'s inverse.
pub fn properties(event: &OutboxEvent, mode: WireMode) -> BasicProperties {
    let branch = &event.key.branch;
    let meta = &event.meta;
    let mut headers = FieldTable::default();
    let text_header = |headers: &mut FieldTable, name: &str, value: &str| {
        headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
    };
    // The host's headers first: their names never clash with the contract's (the writer and
    // `relay_append` refuse reserved names), so the contract's below cannot be overwritten.
    for (name, value) in &meta.headers {
        text_header(&mut headers, name, value);
    }
    for (name, value) in [
        ("causation_id", &meta.causation_id),
        ("traceparent", &meta.traceparent),
        ("tracestate", &meta.tracestate),
    ] {
        if let Some(value) = value {
            text_header(&mut headers, name, value);
        }
    }
    headers.insert(
        "tenant".into(),
        AMQPValue::LongString(LongString::from(branch.tenant.as_str())),
    );
    headers.insert(
        "run".into(),
        AMQPValue::LongString(LongString::from(branch.run.as_str())),
    );
    headers.insert(
        "branch".into(),
        AMQPValue::LongString(LongString::from(branch.branch.as_str())),
    );
    headers.insert(
        "lsn".into(),
        AMQPValue::LongLongInt(event.key.lsn.get() as i64),
    );
    headers.insert(
        "prev_lsn".into(),
        AMQPValue::LongLongInt(event.prev_lsn.get() as i64),
    );
    headers.insert(
        "base_lsn".into(),
        AMQPValue::LongLongInt(event.base_lsn.get() as i64),
    );
    headers.insert(
        "created_at_us".into(),
        AMQPValue::LongLongInt(event.created_at.timestamp_micros()),
    );
    headers.insert("wire_version".into(), AMQPValue::LongLongInt(WIRE_VERSION));
    if let Some(epoch) = event.epochs.epoch {
        headers.insert("epoch".into(), AMQPValue::LongLongInt(epoch.to_db()));
    }
    if let Some(prev) = event.epochs.prev {
        headers.insert("prev_epoch".into(), AMQPValue::LongLongInt(prev.to_db()));
    }
    let kind = match &event.kind {
        EventKind::Intent => TYPE_INTENT,
        EventKind::Rewind { to } => {
            headers.insert(
                "rewound_to".into(),
                AMQPValue::LongString(LongString::from(to.as_str())),
            );
            TYPE_REWIND
        }
        EventKind::End => TYPE_END,
    };
    headers.insert(
        "kind".into(),
        AMQPValue::LongString(LongString::from(match &event.kind {
            EventKind::Intent => "intent",
            EventKind::Rewind { .. } => "rewind",
            EventKind::End => "end",
        })),
    );
    if let Some(parent) = &event.parent {
        headers.insert(
            "parent_branch".into(),
            AMQPValue::LongString(LongString::from(parent.as_str())),
        );
    }
    let kind = match (&event.kind, &meta.event_type) {
        (EventKind::Intent, Some(event_type)) => event_type.as_str(),
        _ => kind,
    };
    let id = message_id(&event.key);
    if let Some(prefix) = mode.cloudevents_prefix() {
        let time = event
            .created_at
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        for (attribute, value) in [
            ("specversion", "1.0"),
            ("id", id.as_str()),
            ("source", &format!("/{}/{}", branch.tenant, branch.run)),
            ("type", kind),
            ("time", &time),
            ("subject", branch.branch.as_str()),
        ] {
            text_header(&mut headers, &format!("{prefix}{attribute}"), value);
        }
    }
    let mut properties = BasicProperties::default()
        .with_message_id(id)
        .with_type(kind.into())
        .with_content_type(meta.content_type_or_default().into())
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(correlation) = &meta.correlation_id {
        properties = properties.with_correlation_id(correlation.as_str().into());
    }
    properties
}

/// The metadata a message carries (empty for a version 1 or 2 message).
fn metadata(properties: &BasicProperties, headers: &FieldTable, kind: &EventKind) -> Metadata {
    let short = |value: &Option<ShortString>| value.as_ref().map(|v| v.as_str().to_owned());
    let long = |name: &str| match headers.inner().get(name) {
        Some(AMQPValue::LongString(value)) => {
            Some(String::from_utf8_lossy(value.as_bytes()).into_owned())
        }
        _ => None,
    };
    let event_type = match kind {
        EventKind::Intent => properties
            .kind()
            .as_ref()
            .and_then(|t| EventType::new(t.as_str()).ok()),
        _ => None,
    };
    Metadata {
        event_type,
        content_type: short(properties.content_type()).filter(|c| c != OCTET_STREAM),
        correlation_id: short(properties.correlation_id()),
        causation_id: long("causation_id"),
        headers: headers
            .inner()
            .iter()
            .filter(|(name, _)| !store::is_reserved_header(name.as_str()))
            .filter_map(|(name, value)| match value {
                AMQPValue::LongString(value) => Some((
                    name.to_string(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )),
                _ => None,
            })
            .collect(),
        traceparent: long("traceparent"),
        tracestate: long("tracestate"),
    }
}

fn text<'a>(headers: &'a FieldTable, name: &'static str) -> Result<&'a [u8], WireError> {
    match headers.inner().get(name) {
        Some(AMQPValue::LongString(value)) => Ok(value.as_bytes()),
        _ => Err(WireError::Header(name)),
    }
}

fn number(headers: &FieldTable, name: &'static str) -> Result<i64, WireError> {
    match headers.inner().get(name) {
        Some(AMQPValue::LongLongInt(value)) if *value >= 0 || name == "created_at_us" => Ok(*value),
        _ => Err(WireError::Header(name)),
    }
}

fn id<T>(
    headers: &FieldTable,
    name: &'static str,
    parse: fn(&str) -> Result<T, store::Error>,
) -> Result<T, WireError> {
    let raw = std::str::from_utf8(text(headers, name)?).map_err(|_| WireError::Header(name))?;
    parse(raw).map_err(|err| WireError::Id {
        header: name,
        reason: err.to_string(),
    })
}

/// Reads a delivered message back into the event the relay published.
pub fn decode(properties: &BasicProperties, body: &[u8]) -> Result<OutboxEvent, WireError> {
    let headers = properties
        .headers()
        .as_ref()
        .ok_or(WireError::Header("tenant"))?;
    let branch = BranchKey::new(
        id(headers, "tenant", |s| TenantId::new(s))?,
        id(headers, "run", |s| RunId::new(s))?,
        id(headers, "branch", |s| BranchId::new(s))?,
    );
    let created_at = DateTime::<Utc>::from_timestamp_micros(number(headers, "created_at_us")?)
        .ok_or(WireError::Header("created_at_us"))?;
    // Version 1 messages carry neither `kind` nor `parent_branch`: they are intents.
    let kind = match headers.inner().get("kind") {
        None => EventKind::Intent,
        Some(AMQPValue::LongString(kind)) if kind.as_bytes() == b"intent" => EventKind::Intent,
        Some(AMQPValue::LongString(kind)) if kind.as_bytes() == b"rewind" => EventKind::Rewind {
            to: id(headers, "rewound_to", |s| BranchId::new(s))?,
        },
        Some(AMQPValue::LongString(kind)) if kind.as_bytes() == b"end" => EventKind::End,
        Some(_) => return Err(WireError::Header("kind")),
    };
    let meta = metadata(properties, headers, &kind);
    let parent = match headers.inner().get("parent_branch") {
        None => None,
        Some(_) => Some(id(headers, "parent_branch", |s| BranchId::new(s))?),
    };
    // Version 4: absent on rows written before epochs (and on older relays' messages).
    let epoch = |name| match headers.inner().get(name) {
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
    use super::*;

    /// What the relay writes, the fold reads back unchanged: the body byte for byte.
    #[test]
    fn decode_inverts_encode() {
        let event = OutboxEvent {
            key: EventKey {
                branch: BranchKey::new(
                    TenantId::new("acme").unwrap(),
                    RunId::new("run-7").unwrap(),
                    BranchId::new("main").unwrap(),
                ),
                lsn: Lsn::new(42),
            },
            prev_lsn: Lsn::new(40),
            base_lsn: Lsn::new(3),
            payload: vec![0, 255, 1, 2],
            created_at: DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap(),
            kind: EventKind::Intent,
            parent: Some(BranchId::new("root").unwrap()),
            meta: Default::default(),
            epochs: Default::default(),
        };
        let props = properties(&event, WireMode::Plain);
        assert_eq!(
            props.message_id().as_ref().unwrap().as_str(),
            "acme/run-7/main/42"
        );
        assert_eq!(props.delivery_mode(), &Some(2));
        assert_eq!(decode(&props, &event.payload).unwrap(), event);
        assert_eq!(
            decode(&BasicProperties::default(), b""),
            Err(WireError::Header("tenant"))
        );
        assert_eq!(props.kind().as_ref().unwrap().as_str(), TYPE_INTENT);

        // A rewind marker round-trips with its new branch.
        let marker = OutboxEvent {
            kind: EventKind::Rewind {
                to: BranchId::new("retry-1").unwrap(),
            },
            parent: None,
            meta: Default::default(),
            payload: Vec::new(),
            ..event.clone()
        };
        let props = properties(&marker, WireMode::Plain);
        assert_eq!(props.kind().as_ref().unwrap().as_str(), TYPE_REWIND);
        assert_eq!(decode(&props, b"").unwrap(), marker);

        // So does an end marker.
        let end = OutboxEvent {
            kind: EventKind::End,
            ..marker.clone()
        };
        let props = properties(&end, WireMode::Plain);
        assert_eq!(props.kind().as_ref().unwrap().as_str(), TYPE_END);
        assert_eq!(decode(&props, b"").unwrap(), end);

        // A version 1 message (no kind, no parent) is an intent.
        let v2 = properties(&event, WireMode::Plain);
        let mut headers = FieldTable::default();
        for (name, value) in v2.headers().as_ref().unwrap().inner() {
            if !["kind", "parent_branch", "wire_version"].contains(&name.as_str()) {
                headers.insert(name.clone(), value.clone());
            }
        }
        let v1 = v2.with_headers(headers);
        let decoded = decode(&v1, &event.payload).unwrap();
        assert_eq!(decoded.kind, EventKind::Intent);
        assert_eq!(decoded.parent, None);
    }

    /// WIRE.md, "CloudEvents": markers carry the attributes too (`type` `outbox.end`,
    /// `datacontenttype` the octet-stream default), and a host header's empty value travels as
    /// an empty long string.
    #[test]
    fn markers_carry_cloudevents_and_an_empty_header_value_travels() {
        let end = OutboxEvent {
            key: EventKey {
                branch: BranchKey::new(
                    TenantId::new("acme").unwrap(),
                    RunId::new("run-7").unwrap(),
                    BranchId::new("retry-1").unwrap(),
                ),
                lsn: Lsn::new(9),
            },
            prev_lsn: Lsn::new(8),
            base_lsn: Lsn::new(8),
            payload: Vec::new(),
            created_at: DateTime::from_timestamp_micros(1_700_000_000_000_000).unwrap(),
            kind: EventKind::End,
            parent: Some(BranchId::new("main").unwrap()),
            meta: Metadata::default(),
            epochs: Default::default(),
        };
        let props = properties(&end, WireMode::CloudEvents);
        let headers = props.headers().as_ref().unwrap().inner();
        let text = |name: &str| match headers.get(name) {
            Some(AMQPValue::LongString(v)) => String::from_utf8(v.as_bytes().to_vec()).unwrap(),
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(text("cloudEvents_type"), "outbox.end");
        assert_eq!(text("cloudEvents_time"), "2023-11-14T22:13:20.000000Z");
        assert_eq!(text("cloudEvents_subject"), "retry-1");
        assert_eq!(text("kind"), "end");
        assert_eq!(
            props.content_type().as_ref().unwrap().as_str(),
            OCTET_STREAM
        );
        assert_eq!(
            headers.get("wire_version"),
            Some(&AMQPValue::LongLongInt(4))
        );

        let intent = OutboxEvent {
            kind: EventKind::Intent,
            meta: Metadata {
                headers: [("note".to_owned(), String::new())].into(),
                ..Metadata::default()
            },
            ..end
        };
        let props = properties(&intent, WireMode::Plain);
        let headers = props.headers().as_ref().unwrap().inner();
        assert_eq!(headers.get("note"), Some(&AMQPValue::LongString("".into())));
        assert_eq!(decode(&props, b"").unwrap(), intent);
    }

    /// Version 3: every metadata field travels where WIRE.md says and reads back unchanged;
    /// CloudEvents mode adds its attributes, which are not taken for host headers.
    #[test]
    fn metadata_travels_as_properties_and_headers() {
        let meta = Metadata {
            event_type: Some(EventType::new("order.created").unwrap()),
            content_type: Some("application/json".into()),
            correlation_id: Some("req-42".into()),
            causation_id: Some("cmd-7".into()),
            headers: [("region".to_owned(), "eu".to_owned())].into(),
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            tracestate: Some("congo=t61rcWkgMzE".into()),
        };
        let event = OutboxEvent {
            key: EventKey {
                branch: BranchKey::new(
                    TenantId::new("acme").unwrap(),
                    RunId::new("run-7").unwrap(),
                    BranchId::new("main").unwrap(),
                ),
                lsn: Lsn::new(1),
            },
            prev_lsn: Lsn::new(0),
            base_lsn: Lsn::new(0),
            payload: b"{}".to_vec(),
            created_at: DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap(),
            kind: EventKind::Intent,
            parent: None,
            meta: meta.clone(),
            epochs: Default::default(),
        };
        for mode in [
            WireMode::Plain,
            WireMode::CloudEvents,
            WireMode::CloudEventsColon,
        ] {
            let props = properties(&event, mode);
            assert_eq!(props.kind().as_ref().unwrap().as_str(), "order.created");
            assert_eq!(
                props.content_type().as_ref().unwrap().as_str(),
                "application/json"
            );
            assert_eq!(props.correlation_id().as_ref().unwrap().as_str(), "req-42");
            let headers = props.headers().as_ref().unwrap().inner();
            for name in ["region", "causation_id", "traceparent", "tracestate"] {
                assert!(headers.contains_key(name), "{name}");
            }
            assert_eq!(
                headers.get("wire_version"),
                Some(&AMQPValue::LongLongInt(4))
            );
            assert_eq!(
                headers.contains_key("cloudEvents_type"),
                mode == WireMode::CloudEvents
            );
            assert_eq!(
                headers.contains_key("cloudEvents:type"),
                mode == WireMode::CloudEventsColon
            );
            assert_eq!(decode(&props, b"{}").unwrap(), event, "{mode:?}");
        }
        for (mode, prefix) in [
            (WireMode::CloudEvents, "cloudEvents_"),
            (WireMode::CloudEventsColon, "cloudEvents:"),
        ] {
            let ce = properties(&event, mode);
            let ce = ce.headers().as_ref().unwrap().inner();
            let text = |name: &str| match ce.get(format!("{prefix}{name}").as_str()) {
                Some(AMQPValue::LongString(v)) => String::from_utf8(v.as_bytes().to_vec()).unwrap(),
                other => panic!("{prefix}{name}: {other:?}"),
            };
            assert_eq!(text("specversion"), "1.0");
            assert_eq!(text("id"), "acme/run-7/main/1");
            assert_eq!(text("source"), "/acme/run-7");
            assert_eq!(text("type"), "order.created");
            assert_eq!(text("time"), "2023-11-14T22:13:20.123456Z");
            assert_eq!(text("subject"), "main");
        }
        // An intent without metadata is exactly a version 2 intent but for `wire_version`.
        let plain = OutboxEvent {
            meta: Metadata::default(),
            ..event
        };
        let props = properties(&plain, WireMode::Plain);
        assert_eq!(props.kind().as_ref().unwrap().as_str(), TYPE_INTENT);
        assert_eq!(
            props.content_type().as_ref().unwrap().as_str(),
            OCTET_STREAM
        );
        assert_eq!(props.correlation_id(), &None);
        assert_eq!(decode(&props, b"{}").unwrap(), plain);
    }
}

#[cfg(test)]
mod epoch_tests {
    use super::*;

    /// Version 4: a row's epoch and its predecessor's travel as `epoch` and `prev_epoch` (long
    /// long ints) and read back; a row without them (written before epochs) has neither header,
    /// and reads back without them.
    #[test]
    fn epochs_travel_as_headers_and_only_when_known() {
        let branch = BranchKey::new(
            TenantId::new("acme").unwrap(),
            RunId::new("run-7").unwrap(),
            BranchId::new("main").unwrap(),
        );
        let mut event = OutboxEvent {
            key: EventKey {
                branch,
                lsn: Lsn::new(5),
            },
            prev_lsn: Lsn::new(4),
            base_lsn: Lsn::ZERO,
            payload: b"x".to_vec(),
            created_at: Utc::now(),
            kind: EventKind::Intent,
            parent: None,
            meta: Metadata::default(),
            epochs: Epochs {
                epoch: Some(Epoch::new(3)),
                prev: Some(Epoch::new(2)),
            },
        };
        let props = properties(&event, WireMode::Plain);
        let headers = props.headers().as_ref().unwrap().inner();
        assert_eq!(headers.get("epoch"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(headers.get("prev_epoch"), Some(&AMQPValue::LongLongInt(2)));
        assert_eq!(
            headers.get("wire_version"),
            Some(&AMQPValue::LongLongInt(4))
        );
        let decoded = decode(&props, b"x").unwrap();
        assert_eq!(decoded.epochs, event.epochs);
        assert!(
            decoded.meta.headers.is_empty(),
            "not taken for a host's headers"
        );

        event.epochs = Epochs::default();
        let props = properties(&event, WireMode::Plain);
        let headers = props.headers().as_ref().unwrap().inner();
        assert!(!headers.contains_key("epoch") && !headers.contains_key("prev_epoch"));
        assert_eq!(decode(&props, b"x").unwrap().epochs, Epochs::default());
    }
}

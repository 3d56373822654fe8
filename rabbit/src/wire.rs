//! The wire contract on RabbitMQ (`broker/WIRE.md`): an event's [`broker::Envelope`] as AMQP
//! properties (`message_id`, `type`, `content_type`, `correlation_id`, `delivery_mode` 2) and
//! headers (texts as long strings, numbers as long long ints), and back. What a header means
//! is the core's (`broker::wire`); this is only the mapping.
use broker::{Envelope, Value, WireError, WireMode};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use store::OutboxEvent;

/// The properties of an event's message (WIRE.md); the body is the payload, unchanged. What
/// the relay publishes, and [`decode`]'s inverse.
pub fn properties(event: &OutboxEvent, mode: WireMode) -> BasicProperties {
    let envelope = broker::envelope(event, mode);
    let mut headers = FieldTable::default();
    for (name, value) in envelope.headers {
        let value = match value {
            Value::Text(bytes) => AMQPValue::LongString(LongString::from(bytes)),
            Value::Number(number) => AMQPValue::LongLongInt(number),
            Value::Other => continue,
        };
        headers.insert(ShortString::from(name), value);
    }
    let short = |value: Option<String>| value.map(ShortString::from);
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    if let Some(id) = short(envelope.message_id) {
        properties = properties.with_message_id(id);
    }
    if let Some(kind) = short(envelope.kind) {
        properties = properties.with_type(kind);
    }
    if let Some(content_type) = short(envelope.content_type) {
        properties = properties.with_content_type(content_type);
    }
    if let Some(correlation) = short(envelope.correlation_id) {
        properties = properties.with_correlation_id(correlation);
    }
    properties
}

/// A delivered message's envelope: its properties and headers in the core's terms.
pub fn envelope(properties: &BasicProperties) -> Envelope {
    let short = |value: &Option<ShortString>| value.as_ref().map(|v| v.as_str().to_owned());
    let headers = properties
        .headers()
        .as_ref()
        .map(|headers| {
            headers
                .inner()
                .iter()
                .map(|(name, value)| {
                    let value = match value {
                        AMQPValue::LongString(text) => Value::Text(text.as_bytes().to_vec()),
                        AMQPValue::LongLongInt(number) => Value::Number(*number),
                        _ => Value::Other,
                    };
                    (name.as_str().to_owned(), value)
                })
                .collect()
        })
        .unwrap_or_default();
    Envelope {
        message_id: short(properties.message_id()),
        kind: short(properties.kind()),
        content_type: short(properties.content_type()),
        correlation_id: short(properties.correlation_id()),
        headers,
    }
}

/// Reads a delivered message back into the event the relay published.
pub fn decode(properties: &BasicProperties, body: &[u8]) -> Result<OutboxEvent, WireError> {
    broker::decode(&envelope(properties), body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use broker::{OCTET_STREAM, TYPE_END, TYPE_INTENT, TYPE_REWIND};
    use chrono::DateTime;
    use store::{
        BranchId, BranchKey, EventKey, EventKind, EventType, Lsn, Metadata, RunId, TenantId,
    };

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
    use chrono::Utc;
    use store::{
        BranchId, BranchKey, Epoch, Epochs, EventKey, EventKind, Lsn, Metadata, RunId, TenantId,
    };

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

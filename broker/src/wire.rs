//! The wire contract (documented in `broker/WIRE.md`): how an outbox event becomes a message.
use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use store::{BranchId, BranchKey, EventKey, EventKind, Lsn, OutboxEvent, RunId, TenantId};

/// The contract version this relay writes (header `wire_version`).
pub const WIRE_VERSION: i64 = 2;

/// AMQP `type` of an export intent.
pub(crate) const TYPE_INTENT: &str = "outbox.intent";
/// AMQP `type` of a rewind marker.
pub(crate) const TYPE_REWIND: &str = "outbox.rewind";
/// AMQP `type` of an end marker (a closed run's last message).
pub(crate) const TYPE_END: &str = "outbox.end";

use crate::WireError;

/// Message id: `tenant/run/branch/lsn`. Ids are at most 64 bytes each, so this stays far
/// below the 255-byte AMQP short-string limit.
pub(crate) fn message_id(key: &EventKey) -> ShortString {
    ShortString::from(format!("{}/{}", key.branch, key.lsn))
}

/// The properties of an event's message. The body is the payload, unchanged.
pub(crate) fn properties(event: &OutboxEvent) -> BasicProperties {
    let branch = &event.key.branch;
    let mut headers = FieldTable::default();
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
    BasicProperties::default()
        .with_message_id(message_id(&event.key))
        .with_type(kind.into())
        .with_content_type("application/octet-stream".into())
        .with_delivery_mode(2)
        .with_headers(headers)
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
    let parent = match headers.inner().get("parent_branch") {
        None => None,
        Some(_) => Some(id(headers, "parent_branch", |s| BranchId::new(s))?),
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
        };
        let props = properties(&event);
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
            payload: Vec::new(),
            ..event.clone()
        };
        let props = properties(&marker);
        assert_eq!(props.kind().as_ref().unwrap().as_str(), TYPE_REWIND);
        assert_eq!(decode(&props, b"").unwrap(), marker);

        // So does an end marker.
        let end = OutboxEvent {
            kind: EventKind::End,
            ..marker.clone()
        };
        let props = properties(&end);
        assert_eq!(props.kind().as_ref().unwrap().as_str(), TYPE_END);
        assert_eq!(decode(&props, b"").unwrap(), end);

        // A version 1 message (no kind, no parent) is an intent.
        let v2 = properties(&event);
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
}

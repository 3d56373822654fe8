//! What an intent says about itself besides its payload: an event type, a content type,
//! correlation and causation ids, the host's own headers and W3C trace context.
//!
//! Every field is optional; an intent with none is exactly what `append(payload)` writes. The
//! rules below are checked twice with one table of cases (`store/tests/metadata.rs`): here,
//! before any SQL runs (so a refusal leaves the host's transaction usable), and by
//! `relay_append` itself (`store/migrations/0008_metadata.sql`, SQLSTATE `RL112`) for hosts in
//! other languages. On the wire (version 3, `broker/WIRE.md`) the event type is the AMQP
//! `type`, the content type `content_type`, the correlation id `correlation_id`, and the rest
//! are headers.
use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Most host headers on one intent.
pub const MAX_HEADERS: usize = 32;
/// Most bytes of host headers on one intent, names and values together.
pub const MAX_HEADER_BYTES: usize = 8 * 1024;
/// Longest event type, content type, correlation id or causation id (AMQP short strings hold
/// 255 bytes; the event type leaves room for a prefix).
pub(crate) const MAX_FIELD_BYTES: usize = 255;
/// Longest event type.
pub(crate) const MAX_EVENT_TYPE_BYTES: usize = 128;
/// Longest `tracestate` (W3C Trace Context: 32 members of at most 512 bytes in all).
pub(crate) const MAX_TRACESTATE_BYTES: usize = 512;

/// Header names of the wire contract itself: a host header may not use them (compared without
/// case), nor start with `x-` (RabbitMQ's and the relay's own), `nats-` (the NATS server's: it
/// acts on them), `cloudevents` (the CloudEvents AMQP binding's) or `ce-` (its NATS binding's).
pub const RESERVED_HEADERS: &[&str] = &[
    "wire_version",
    "kind",
    "tenant",
    "run",
    "branch",
    "lsn",
    "prev_lsn",
    "base_lsn",
    "parent_branch",
    "rewound_to",
    "created_at_us",
    "epoch",
    "prev_epoch",
    "causation_id",
    "traceparent",
    "tracestate",
];

/// Whether `name` is the wire contract's or a broker's, not a host's: one of
/// [`RESERVED_HEADERS`] (without case), or starting with `x-`, `nats-`, `cloudevents` or `ce-`. The
/// writer refuses such host headers, and a decoder takes every other long-string header for one
/// of the host's.
pub fn is_reserved_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    RESERVED_HEADERS.contains(&lower.as_str())
        || lower.starts_with("x-")
        || is_nats_header(&lower)
        || lower.starts_with("cloudevents")
        || lower.starts_with("ce-")
}

/// Whether `name` is one the NATS server acts on (`Nats-*`, any case): a host's `Nats-Msg-Id`
/// would have its event dropped as a duplicate.
fn is_nats_header(name: &str) -> bool {
    name.get(..5)
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case("nats-"))
}

/// Whether a header value reads back from every broker as written: no line break, and no
/// whitespace (Unicode's, as [`str::trim`] sees it) at either end. NATS headers are lines of
/// text that its clients read back trimmed; the writer refuses any other host header value.
pub fn is_portable_header_value(value: &str) -> bool {
    !value.contains(['\r', '\n']) && value.trim() == value
}

/// What an event is, in the host's words (`order.created`): 1 to 128 bytes of
/// `[A-Za-z0-9._:/-]`, and not starting with `outbox.` (the relay's own types for markers and
/// untyped intents). The AMQP `type` of its message; consumer groups filter on it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EventType(String);

impl EventType {
    /// Validates `value` as an event type.
    pub fn new(value: impl AsRef<str>) -> Result<Self, Error> {
        let value = value.as_ref();
        let fine = |b: u8| b.is_ascii_alphanumeric() || b"._:/-".contains(&b);
        let reason = if value.is_empty() || value.len() > MAX_EVENT_TYPE_BYTES {
            Some("must be 1 to 128 bytes")
        } else if !value.bytes().all(fine) {
            Some("may only contain A-Z a-z 0-9 . _ : / -")
        } else if value.starts_with("outbox.") {
            Some("outbox.* is reserved for the relay's own types")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(invalid("type", reason)),
            None => Ok(Self(value.to_owned())),
        }
    }

    /// The type as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for EventType {
    type Error = Error;
    fn try_from(value: String) -> Result<Self, Error> {
        Self::new(value)
    }
}

impl From<EventType> for String {
    fn from(value: EventType) -> Self {
        value.0
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An intent's metadata. Stored as one `jsonb` value (`relay_outbox.meta`, these field names),
/// the same shape `relay_fold` takes and returns. Absent fields are `None` / empty.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    /// What the event is (AMQP `type`).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub event_type: Option<EventType>,
    /// The payload's media type (AMQP `content_type`); `None`: `application/octet-stream`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// Ties the event to a request or conversation (AMQP `correlation_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// The id of what caused this event (header `causation_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<String>,
    /// The host's own headers, string to string (AMQP headers of the same names).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// W3C `traceparent` of the span that wrote the intent (header `traceparent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// W3C `tracestate` (header `tracestate`); only with a `traceparent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

impl Metadata {
    /// Whether no field is set (stored as SQL `NULL`, the cheapest append).
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// The content type the consumer sees: the one set, or `application/octet-stream`.
    pub fn content_type_or_default(&self) -> &str {
        self.content_type
            .as_deref()
            .unwrap_or("application/octet-stream")
    }

    /// The trace id of `traceparent` (32 lowercase hex digits), if any.
    pub fn trace_id(&self) -> Option<&str> {
        self.traceparent.as_deref().and_then(|t| t.get(3..35))
    }

    /// Checks every rule of this module; the first broken one is the error
    /// ([`Error::InvalidMetadata`], naming the field).
    pub fn validate(&self) -> Result<(), Error> {
        if let Some(content_type) = &self.content_type {
            check_content_type(content_type)?;
        }
        for (field, value) in [
            ("correlation_id", &self.correlation_id),
            ("causation_id", &self.causation_id),
        ] {
            if let Some(value) = value {
                check_token(field, value)?;
            }
        }
        check_headers(&self.headers)?;
        match (&self.traceparent, &self.tracestate) {
            (Some(parent), state) => {
                check_traceparent(parent)?;
                if let Some(state) = state {
                    check_tracestate(state)?;
                }
            }
            (None, Some(_)) => {
                return Err(invalid("tracestate", "needs a traceparent"));
            }
            (None, None) => {}
        }
        Ok(())
    }
}

fn invalid(field: impl Into<String>, reason: &str) -> Error {
    Error::InvalidMetadata {
        field: field.into(),
        reason: reason.to_owned(),
    }
}

/// Visible ASCII (`!` to `~`).
fn visible(value: &str) -> bool {
    value.bytes().all(|b| b.is_ascii_graphic())
}

fn check_token(field: &'static str, value: &str) -> Result<(), Error> {
    if value.is_empty() || value.len() > MAX_FIELD_BYTES || !visible(value) {
        return Err(invalid(field, "must be 1 to 255 visible ASCII characters"));
    }
    Ok(())
}

/// `type/subtype`, optionally `; parameters`: printable ASCII, at most 255 bytes.
fn check_content_type(value: &str) -> Result<(), Error> {
    let token = |t: &str| !t.is_empty() && visible(t) && !t.contains('/') && !t.contains(';');
    let essence = value.split(';').next().unwrap_or_default();
    let shaped = matches!(essence.trim_end().split_once('/'), Some((kind, sub)) if token(kind) && token(sub));
    if value.len() > MAX_FIELD_BYTES
        || !value.bytes().all(|b| (0x20..0x7f).contains(&b))
        || !shaped
        || value.ends_with(' ')
    {
        return Err(invalid(
            "content_type",
            "must be a media type (type/subtype[; parameters]) of at most 255 printable ASCII bytes, not ending in a space",
        ));
    }
    Ok(())
}

fn check_headers(headers: &BTreeMap<String, String>) -> Result<(), Error> {
    if headers.len() > MAX_HEADERS {
        return Err(invalid("headers", "at most 32 headers"));
    }
    let mut bytes = 0;
    for (name, value) in headers {
        let fine = |b: u8| b.is_ascii_alphanumeric() || b"._-".contains(&b);
        if name.is_empty() || name.len() > 64 || !name.bytes().all(fine) {
            return Err(invalid(
                format!("header {name}"),
                "names are 1 to 64 bytes of A-Z a-z 0-9 . _ -",
            ));
        }
        if is_nats_header(name) {
            return Err(invalid(
                format!("header {name}"),
                "is the NATS server's (Nats-*): a host header may not use the name",
            ));
        }
        if is_reserved_header(name) {
            return Err(invalid(
                format!("header {name}"),
                "is reserved by the wire contract",
            ));
        }
        if !is_portable_header_value(value) {
            return Err(invalid(
                format!("header {name}"),
                "has a line break or whitespace at either end, which NATS headers do not keep",
            ));
        }
        bytes += name.len() + value.len();
    }
    if bytes > MAX_HEADER_BYTES {
        return Err(invalid("headers", "at most 8192 bytes of names and values"));
    }
    Ok(())
}

/// W3C Trace Context `traceparent`: `vv-<32 hex>-<16 hex>-<2 hex>`, lowercase; version `ff`,
/// an all-zero trace id and an all-zero parent id are invalid. Version `00` has exactly these
/// four fields; a later version may append more (`-...`, visible ASCII: a header NATS keeps
/// unchanged), as the specification allows.
fn check_traceparent(value: &str) -> Result<(), Error> {
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    let mut parts = value.splitn(5, '-');
    let (version, trace, parent, flags, rest) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next(),
    );
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && trace.bytes().any(|b| b != b'0')
        && hex(parent, 16)
        && parent.bytes().any(|b| b != b'0')
        && hex(flags, 2)
        && rest.is_none_or(|rest| version != "00" && rest.bytes().all(|b| b.is_ascii_graphic()));
    if !valid {
        return Err(invalid(
            "traceparent",
            "must be a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>, lowercase, ids not all zero)",
        ));
    }
    Ok(())
}

/// W3C `tracestate`: at most 512 bytes, at most 32 comma-separated `key=value` members.
fn check_tracestate(value: &str) -> Result<(), Error> {
    let members: Vec<&str> = value
        .split(',')
        .map(|m| m.trim_matches([' ', '\t']))
        .filter(|m| !m.is_empty())
        .collect();
    let member =
        |m: &str| match m.split_once('=') {
            Some((key, value)) => !key.is_empty()
                && key.len() <= 256
                && key.bytes().all(
                    |b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'*' | b'/' | b'@'),
                )
                && !value.is_empty()
                && value.len() <= 256
                && value
                    .bytes()
                    .all(|b| (0x20..0x7f).contains(&b) && b != b',' && b != b'='),
            None => false,
        };
    if value.len() > MAX_TRACESTATE_BYTES
        || members.is_empty()
        || members.len() > 32
        || !members.iter().all(|m| member(m))
    {
        return Err(invalid(
            "tracestate",
            "must be a W3C tracestate (1 to 32 key=value members, at most 512 bytes)",
        ));
    }
    if value.trim_matches([' ', '\t']) != value {
        return Err(invalid(
            "tracestate",
            "has whitespace at either end, which NATS headers do not keep",
        ));
    }
    Ok(())
}

/// One export intent to append: its payload and, optionally, its metadata.
///
/// ```
/// use store::{EventType, Intent};
/// let intent = Intent::new(br#"{"order":7}"#)
///     .event_type(EventType::new("order.created")?)
///     .content_type("application/json")
///     .correlation_id("req-42")
///     .header("region", "eu-west-1");
/// assert_eq!(intent.metadata().headers["region"], "eu-west-1");
/// # Ok::<(), store::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Intent<'a> {
    payload: &'a [u8],
    meta: Metadata,
}

impl<'a> Intent<'a> {
    /// An intent of `payload` with no metadata (what `append(payload)` writes).
    pub fn new(payload: &'a [u8]) -> Self {
        Self {
            payload,
            meta: Metadata::default(),
        }
    }

    /// With all of `meta` (replacing anything set before).
    pub fn with_metadata(mut self, meta: Metadata) -> Self {
        self.meta = meta;
        self
    }

    /// What the event is.
    pub fn event_type(mut self, event_type: EventType) -> Self {
        self.meta.event_type = Some(event_type);
        self
    }

    /// The payload's media type (`application/json`).
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.meta.content_type = Some(content_type.into());
        self
    }

    /// The request or conversation the event belongs to.
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.meta.correlation_id = Some(id.into());
        self
    }

    /// The id of what caused the event (a command, another event).
    pub fn causation_id(mut self, id: impl Into<String>) -> Self {
        self.meta.causation_id = Some(id.into());
        self
    }

    /// One of the host's own headers (the last value of a name wins).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.meta.headers.insert(name.into(), value.into());
        self
    }

    /// W3C trace context of the span that writes the intent.
    pub fn trace(mut self, traceparent: impl Into<String>, tracestate: Option<String>) -> Self {
        self.meta.traceparent = Some(traceparent.into());
        self.meta.tracestate = tracestate;
        self
    }

    /// The payload.
    pub fn payload(&self) -> &'a [u8] {
        self.payload
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.meta
    }

    pub(crate) fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.meta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_the_documented_shape() {
        let meta = Metadata {
            event_type: Some(EventType::new("order.created").unwrap()),
            content_type: Some("application/json".into()),
            headers: [("region".to_owned(), "eu".to_owned())].into(),
            ..Metadata::default()
        };
        let json = serde_json::to_string(&meta).unwrap();
        assert_eq!(
            json,
            r#"{"type":"order.created","content_type":"application/json","headers":{"region":"eu"}}"#
        );
        assert_eq!(serde_json::from_str::<Metadata>(&json).unwrap(), meta);
        assert!(serde_json::from_str::<Metadata>(r#"{"type":"outbox.x"}"#).is_err());
        assert!(serde_json::from_str::<Metadata>(r#"{"colour":"red"}"#).is_err());
        assert_eq!(serde_json::to_string(&Metadata::default()).unwrap(), "{}");
    }

    #[test]
    fn trace_id_is_read_from_traceparent() {
        let meta = Metadata {
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            ..Metadata::default()
        };
        assert_eq!(meta.trace_id(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        assert!(meta.validate().is_ok());
    }
}

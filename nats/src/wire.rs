//! The wire contract on NATS (`broker/WIRE.md`, "On NATS"): an event's [`broker::Envelope`] as
//! NATS headers and back. Every header of the envelope keeps its name, texts as they are and
//! numbers in decimal ([`broker::NUMBER_HEADERS`] says which read back as numbers); the message
//! id goes in `Nats-Msg-Id` (the stream drops a resend within its duplicate window), the type,
//! content type and correlation id in `x-type`, `x-content-type` and `x-correlation-id` (names
//! no host header can take: `x-` is the contract's).
//!
//! With [`WireMode::CloudEvents`] every event also carries its CloudEvents attributes in the
//! binary content mode of the CloudEvents NATS protocol binding: one header per attribute,
//! named `ce-<attribute>` ([`CLOUDEVENTS_PREFIX`]), its value percent-encoded
//! ([`cloudevents_value`]); the content type as `ce-datacontenttype`.
//!
//! NATS headers are lines of text read back trimmed, so a value with a line break, or with
//! whitespace at either end, cannot travel unchanged; nor can a host header named `Nats-*`,
//! which the server would act on, or `ce-*`, which a CloudEvents reader takes for an
//! attribute. The store refuses them at append time (migrations 18 and 19,
//! `store::is_portable_header_value`, `store::is_reserved_header`); a row written before that is
//! [`Unwritable`] here: refused, never altered. So is, with CloudEvents, a host's
//! `Content-Type: application/cloudevents...`, which a binding reader takes for structured mode.
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use broker::{Envelope, NUMBER_HEADERS, Value, WireError, WireMode};
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use store::OutboxEvent;

/// The header of the message id (the server's deduplication key).
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The header that makes the server refuse a message its subject would store in another
/// stream (error 10060).
pub const EXPECTED_STREAM: &str = "Nats-Expected-Stream";
/// The event's type (AMQP's `type` property).
pub const TYPE: &str = "x-type";
/// The event's content type (AMQP's `content_type` property).
pub const CONTENT_TYPE: &str = "x-content-type";
/// The event's correlation id (AMQP's `correlation_id` property).
pub const CORRELATION_ID: &str = "x-correlation-id";

/// The prefix of the CloudEvents attributes' headers (the NATS binding, binary content mode).
pub(crate) const CLOUDEVENTS_PREFIX: &str = "ce-";

/// What the CloudEvents NATS binding percent-encodes besides every byte of a character outside
/// ASCII: controls, space, double quote and percent (3.1.3.2).
const CLOUDEVENTS_ESCAPED: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// An attribute's header value in the CloudEvents NATS binding: its canonical string with
/// space, `"`, `%`, controls and every character outside printable ASCII percent-encoded as
/// UTF-8 bytes, in upper case (`Euro €` is `Euro%20%E2%82%AC`).
pub(crate) fn cloudevents_value(value: &str) -> String {
    utf8_percent_encode(value, CLOUDEVENTS_ESCAPED).to_string()
}

/// Whether a host header would make a reader of the CloudEvents NATS binding take the message
/// for structured mode: `Content-Type` (any case) starting with `application/cloudevents`
/// (any case), the binding's test (section 3).
fn takes_for_structured(name: &str, value: &str) -> bool {
    name.eq_ignore_ascii_case("content-type") && has_prefix(value, "application/cloudevents")
}

/// Whether a header is the NATS server's or client's (`Nats-*`, any case): never the event's.
pub(crate) fn is_server_header(name: &str) -> bool {
    has_prefix(name, "nats-")
}

/// Whether `text` starts with `prefix`, compared without ASCII case (never panics on a
/// character boundary).
fn has_prefix(text: &str, prefix: &str) -> bool {
    text.get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// An event NATS cannot carry unchanged, and the header that says why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unwritable {
    /// The header's name.
    pub header: String,
    /// Why.
    pub reason: &'static str,
}

impl std::fmt::Display for Unwritable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "header {:?}: {}", self.header, self.reason)
    }
}

fn header_value(name: &str, value: &str) -> Result<HeaderValue, Unwritable> {
    owned_header_value(name, value.to_owned())
}

/// [`header_value`] for a value already owned: it becomes the header value without a copy.
fn owned_header_value(name: &str, value: String) -> Result<HeaderValue, Unwritable> {
    if !store::is_portable_header_value(&value) {
        return Err(Unwritable {
            header: name.to_owned(),
            reason: "a line break or whitespace at either end, which NATS headers do not keep",
        });
    }
    HeaderValue::try_from(value).map_err(|_| Unwritable {
        header: name.to_owned(),
        reason: "not a NATS header value",
    })
}

fn header_name(name: &str) -> Result<HeaderName, Unwritable> {
    if is_server_header(name) {
        return Err(Unwritable {
            header: name.to_owned(),
            reason: "a Nats-* name, which the NATS server acts on",
        });
    }
    if has_prefix(name, CLOUDEVENTS_PREFIX) {
        return Err(Unwritable {
            header: name.to_owned(),
            reason: "a ce-* name, which the CloudEvents NATS binding reads as an attribute",
        });
    }
    name.parse().map_err(|_| Unwritable {
        header: name.to_owned(),
        reason: "not a NATS header name",
    })
}

/// The headers of an event's message (the body is the payload, unchanged); [`decode`]'s
/// inverse. `stream` is the one stream that may store it (`Nats-Expected-Stream`). The
/// configuration refuses [`WireMode::CloudEventsColon`] (the AMQP binding's old prefix); here it
/// writes what `CloudEvents` does.
pub fn headers(event: &OutboxEvent, mode: WireMode, stream: &str) -> Result<HeaderMap, Unwritable> {
    let mut envelope = broker::envelope(event, WireMode::Plain);
    let mut headers = HeaderMap::new();
    // Taken by value: each value's bytes become its header value without another copy (the
    // relay builds these for every event it ships).
    for (name, value) in std::mem::take(&mut envelope.headers) {
        let text = match value {
            Value::Text(bytes) => String::from_utf8(bytes)
                .unwrap_or_else(|err| String::from_utf8_lossy(err.as_bytes()).into_owned()),
            Value::Number(number) => number.to_string(),
            Value::Other => continue,
        };
        if mode != WireMode::Plain && takes_for_structured(&name, &text) {
            return Err(Unwritable {
                header: name,
                reason: "a Content-Type of application/cloudevents, which makes a CloudEvents \
                         NATS reader take the message for structured mode",
            });
        }
        headers.insert(header_name(&name)?, owned_header_value(&name, text)?);
    }
    for (name, value) in [
        (TYPE, &envelope.kind),
        (CONTENT_TYPE, &envelope.content_type),
        (CORRELATION_ID, &envelope.correlation_id),
    ] {
        if let Some(value) = value {
            headers.insert(name, header_value(name, value)?);
        }
    }
    if mode != WireMode::Plain {
        let content_type = envelope
            .content_type
            .as_deref()
            .unwrap_or(broker::OCTET_STREAM);
        for (attribute, value) in broker::cloudevents_attributes(event)
            .into_iter()
            .chain([("datacontenttype", content_type.to_owned())])
        {
            // Printable ASCII without spaces once encoded: a valid header value.
            headers.insert(
                format!("{CLOUDEVENTS_PREFIX}{attribute}"),
                cloudevents_value(&value),
            );
        }
    }
    if let Some(id) = &envelope.message_id {
        headers.insert(MSG_ID, header_value(MSG_ID, id)?);
    }
    headers.insert(EXPECTED_STREAM, header_value(EXPECTED_STREAM, stream)?);
    Ok(headers)
}

/// A delivered message's envelope: the contract's headers in the core's terms (the server's
/// and the client's `Nats-*` headers aside).
pub fn envelope(headers: &HeaderMap) -> Envelope {
    let mut envelope = Envelope::default();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        let first = values.first().map(HeaderValue::as_str);
        match name {
            MSG_ID => envelope.message_id = first.map(str::to_owned),
            TYPE => envelope.kind = first.map(str::to_owned),
            CONTENT_TYPE => envelope.content_type = first.map(str::to_owned),
            CORRELATION_ID => envelope.correlation_id = first.map(str::to_owned),
            _ if is_server_header(name) || has_prefix(name, CLOUDEVENTS_PREFIX) => {}
            _ => {
                let value = match (values.as_slice(), NUMBER_HEADERS.contains(&name)) {
                    ([one], true) => one
                        .as_str()
                        .parse()
                        .map(Value::Number)
                        .unwrap_or(Value::Other),
                    ([one], false) => Value::Text(one.as_str().as_bytes().to_vec()),
                    _ => Value::Other,
                };
                envelope.headers.insert(name.to_owned(), value);
            }
        }
    }
    envelope
}

/// Reads a delivered message back into the event the relay published.
pub fn decode(headers: &HeaderMap, body: &[u8]) -> Result<OutboxEvent, WireError> {
    broker::decode(&envelope(headers), body)
}

#[cfg(test)]
mod tests {
    use chrono::DateTime;
    use proptest::prelude::*;
    use store::{BranchId, EventKind, EventType, Metadata};

    use super::*;

    fn event() -> OutboxEvent {
        let branch = testkit::branch("acme", "run-7", "main");
        let mut event = testkit::intent(&branch, 42)
            .prev(40)
            .base(3)
            .payload(b"{}".to_vec())
            .build();
        // The wire carries microseconds.
        event.created_at = DateTime::from_timestamp_micros(1_700_000_000_123_456).unwrap();
        event
    }

    proptest! {
        /// What the relay writes on NATS, a consumer reads back unchanged: every header a host
        /// may write (names and values NATS keeps) and every kind of event.
        #[test]
        fn decode_inverts_headers(
            host in proptest::collection::btree_map("h[a-z0-9_.-]{0,10}", "([!-~]([ -~]{0,10}[!-~])?)?", 0..5),
            typed in any::<bool>(),
            correlation in proptest::option::of("[!-~]{1,12}"),
            kind in 0..3u8,
            epoch in proptest::option::of(1u64..100),
            micros in 0i64..4_000_000_000_000_000,
        ) {
            let mut event = event();
            event.created_at = DateTime::from_timestamp_micros(micros).unwrap();
            event.kind = match kind {
                0 => EventKind::Intent,
                1 => EventKind::End,
                _ => EventKind::Rewind { to: BranchId::new("retry-1").unwrap() },
            };
            event.epochs.epoch = epoch.map(store::Epoch::new);
            event.meta = Metadata {
                event_type: (typed && kind == 0).then(|| EventType::new("order.created").unwrap()),
                correlation_id: correlation,
                headers: host.into_iter().collect(),
                ..Metadata::default()
            };
            for mode in [WireMode::Plain, WireMode::CloudEvents] {
                let written = headers(&event, mode, "events").unwrap();
                let id = broker::message_id(&event.key);
                prop_assert_eq!(written.get(MSG_ID).map(HeaderValue::as_str), Some(id.as_str()));
                prop_assert_eq!(decode(&written, &event.payload).unwrap(), event.clone());
            }
        }

        /// With CloudEvents, each attribute is a `ce-` header that a reader of the NATS binding
        /// decodes (one round of percent-decoding, UTF-8 checked) back to its canonical string;
        /// the content type among them, spaces and quotes included.
        #[test]
        fn cloudevents_attributes_are_ce_headers_a_binding_reader_decodes(
            content_type in proptest::option::of("[a-z]{1,8}/[a-z+.-]{1,8}(; ?[a-z]{1,6}=(\"[ -!#-~]{0,8}\"|[a-z0-9-]{1,8}))?"),
            typed in any::<bool>(),
        ) {
            let mut event = event();
            event.meta.content_type = content_type.clone();
            event.meta.event_type = typed.then(|| EventType::new("order.created").unwrap());
            let written = headers(&event, WireMode::CloudEvents, "events").unwrap();
            let expected = broker::cloudevents_attributes(&event).into_iter().chain([(
                "datacontenttype",
                content_type.unwrap_or_else(|| broker::OCTET_STREAM.to_owned()),
            )]);
            let mut count = 0;
            for (attribute, value) in expected {
                let name = format!("ce-{attribute}");
                let raw = written.get(name.as_str()).map(HeaderValue::as_str);
                let raw = raw.unwrap_or_else(|| panic!("no {name}"));
                prop_assert!(raw.bytes().all(|b| (b'!'..=b'~').contains(&b) && b != b'"'), "{raw}");
                let read = percent_encoding::percent_decode_str(raw).decode_utf8().unwrap();
                prop_assert_eq!(read.as_ref(), value.as_str());
                count += 1;
            }
            let written_ce = written.iter().filter(|(name, _)| {
                let name: &str = name.as_ref();
                name.starts_with("ce-")
            });
            prop_assert_eq!(written_ce.count(), count, "the binding's attributes and no more");
        }
    }

    /// The binding's own example (3.1.3.2) and what a content type holds: space, `"` and `%`
    /// are encoded, every other printable ASCII character is not.
    #[test]
    fn cloudevents_values_are_percent_encoded_as_the_binding_says() {
        assert_eq!(
            cloudevents_value("Euro \u{20ac} \u{1f600}"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
        assert_eq!(
            cloudevents_value("text/plain; charset=\"utf-8\"; q=100%"),
            "text/plain;%20charset=%22utf-8%22;%20q=100%25"
        );
        let printable: String = ('!'..='~').filter(|c| !matches!(c, '"' | '%')).collect();
        assert_eq!(cloudevents_value(&printable), printable);
    }

    /// What NATS would change or act on is refused, named, never altered.
    #[test]
    fn what_nats_cannot_carry_unchanged_is_refused_by_name() {
        for (name, value, reason) in [
            ("note", "two\nlines", "line break"),
            ("note", "a\rb", "line break"),
            ("note", " padded", "either end"),
            ("note", "padded\t", "either end"),
            ("Nats-Msg-Id", "x", "Nats-*"),
            ("nats-rollup", "all", "Nats-*"),
            ("ce-id", "x", "ce-*"),
            ("CE-Source", "x", "ce-*"),
        ] {
            let mut event = event();
            event.meta.headers = [(name.to_owned(), value.to_owned())].into();
            let refused = headers(&event, WireMode::Plain, "events").unwrap_err();
            assert_eq!(refused.header, name);
            assert!(refused.reason.contains(reason), "{refused}");
        }
        // With CloudEvents, a host's Content-Type that says structured mode; plain, it travels.
        let mut structured = event();
        structured.meta.headers = [(
            "Content-Type".to_owned(),
            "Application/CloudEvents+json".to_owned(),
        )]
        .into();
        let refused = headers(&structured, WireMode::CloudEvents, "events").unwrap_err();
        assert!(refused.reason.contains("structured mode"), "{refused}");
        let written = headers(&structured, WireMode::Plain, "events").unwrap();
        assert_eq!(decode(&written, b"{}").unwrap(), structured);
        structured.meta.headers = [("content-type".to_owned(), "text/plain".to_owned())].into();
        headers(&structured, WireMode::CloudEvents, "events").unwrap();
        let mut event = event();
        event.meta.headers = [("note".to_owned(), String::new())].into();
        let written = headers(&event, WireMode::Plain, "events").unwrap();
        assert_eq!(
            decode(&written, b"{}").unwrap(),
            event,
            "an empty value travels"
        );
        assert_eq!(
            written.get(EXPECTED_STREAM).map(HeaderValue::as_str),
            Some("events")
        );
    }

    /// broker/WIRE.md's NATS table names the headers this module writes: a reader written from
    /// WIRE.md alone finds them where it says.
    #[test]
    fn wire_md_names_the_headers_written_here() {
        let wire = include_str!("../../broker/WIRE.md");
        let section = &wire[wire.find("## On NATS JetStream").expect("a NATS section")..];
        for (property, header) in [
            ("message_id", MSG_ID),
            ("type", TYPE),
            ("content_type", CONTENT_TYPE),
            ("correlation_id", CORRELATION_ID),
        ] {
            let row = format!("| `{property}` | header `{header}`");
            assert!(section.contains(&row), "WIRE.md lacks {row}");
        }
        assert!(section.contains(&format!("header `{EXPECTED_STREAM}: <topology>`")));
        for attribute in broker::cloudevents_attributes(&event())
            .map(|(attribute, _)| attribute)
            .into_iter()
            .chain(["datacontenttype"])
        {
            let name = format!("`{CLOUDEVENTS_PREFIX}{attribute}`");
            assert!(
                section.contains(&name),
                "WIRE.md's NATS section lacks {name}"
            );
        }
        let numbers: Vec<String> = broker::NUMBER_HEADERS
            .iter()
            .map(|name| format!("`{name}`"))
            .collect();
        let row = section
            .lines()
            .find(|line| line.starts_with("| headers, long long ints |"))
            .expect("the numbers' row");
        for name in &numbers {
            assert!(row.contains(name.as_str()), "{row} lacks {name}");
        }
    }

    /// A number header that is not a number is malformed, not absent or zero.
    #[test]
    fn a_number_header_that_is_not_a_number_is_refused() {
        let mut written = headers(&event(), WireMode::Plain, "events").unwrap();
        written.insert("lsn", "forty-two");
        assert_eq!(decode(&written, b""), Err(WireError::Header("lsn")));
    }
}

//! Metadata on intents, on real PostgreSQL: what the host sets is what the relay drains and
//! what the fold hands over (held back or not); bad metadata is refused, by the writer and by
//! `relay_append` itself, from one table of cases, with nothing written.
use std::collections::BTreeMap;

use sqlx::{Acquire, PgPool};
use store::{
    BranchKey, Error, EventType, FoldOutcome, Intent, IntentWriter, Lsn, MAX_HEADER_BYTES,
    MAX_HEADERS, Metadata, Outbox, OutboxEvent, Projection, RewindNotice,
};

fn key(run: &str) -> BranchKey {
    testkit::branch("t", run, "main")
}

fn writer() -> IntentWriter {
    IntentWriter::default().with_notify(false)
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Every field set.
fn full() -> Metadata {
    Metadata {
        event_type: Some(EventType::new("order.created").unwrap()),
        content_type: Some("application/json; charset=utf-8".into()),
        correlation_id: Some("req-42".into()),
        causation_id: Some("cmd-7".into()),
        headers: BTreeMap::from([
            ("region".to_owned(), "eu-west-1".to_owned()),
            ("Actor.Id".to_owned(), "ünïcode välue".to_owned()),
        ]),
        traceparent: Some(TRACEPARENT.into()),
        tracestate: Some("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7".into()),
    }
}

fn with(change: impl FnOnce(&mut Metadata)) -> Metadata {
    let mut meta = Metadata::default();
    change(&mut meta);
    meta
}

fn headers(n: usize, value_bytes: usize) -> BTreeMap<String, String> {
    (0..n)
        .map(|i| (format!("h{i}"), "v".repeat(value_bytes)))
        .collect()
}

/// Metadata that breaks one rule each, with the field the refusal names.
fn bad_cases() -> Vec<(&'static str, Metadata, &'static str)> {
    vec![
        (
            "content type without subtype",
            with(|m| m.content_type = Some("json".into())),
            "content_type",
        ),
        (
            "content type with a control character",
            with(|m| m.content_type = Some("text/plain\n".into())),
            "content_type",
        ),
        (
            "empty correlation id",
            with(|m| m.correlation_id = Some(String::new())),
            "correlation_id",
        ),
        (
            "causation id with a space",
            with(|m| m.causation_id = Some("a b".into())),
            "causation_id",
        ),
        (
            "correlation id of 256 bytes",
            with(|m| m.correlation_id = Some("c".repeat(256))),
            "correlation_id",
        ),
        (
            "too many headers",
            with(|m| m.headers = headers(MAX_HEADERS + 1, 1)),
            "headers",
        ),
        (
            "oversized headers",
            with(|m| m.headers = headers(4, MAX_HEADER_BYTES / 4)),
            "headers",
        ),
        (
            "reserved header",
            with(|m| {
                m.headers.insert("Tenant".into(), "x".into());
            }),
            "header Tenant",
        ),
        (
            "RabbitMQ's header space",
            with(|m| {
                m.headers.insert("x-death".into(), "x".into());
            }),
            "header x-death",
        ),
        (
            "CloudEvents' header space",
            with(|m| {
                m.headers.insert("cloudEvents_type".into(), "x".into());
            }),
            "header cloudEvents_type",
        ),
        (
            "the CloudEvents NATS binding's header space",
            with(|m| {
                m.headers.insert("ce-id".into(), "x".into());
            }),
            "header ce-id",
        ),
        (
            "the CloudEvents NATS binding's header space in upper case",
            with(|m| {
                m.headers.insert("CE-Type".into(), "x".into());
            }),
            "header CE-Type",
        ),
        (
            "a header the NATS server acts on",
            with(|m| {
                m.headers.insert("Nats-Msg-Id".into(), "x".into());
            }),
            "header Nats-Msg-Id",
        ),
        (
            "a NATS header in lower case",
            with(|m| {
                m.headers.insert("nats-rollup".into(), "all".into());
            }),
            "header nats-rollup",
        ),
        (
            "header value with a line break",
            with(|m| {
                m.headers.insert("note".into(), "a\nb".into());
            }),
            "header note",
        ),
        (
            "header value with a carriage return",
            with(|m| {
                m.headers.insert("note".into(), "a\rb".into());
            }),
            "header note",
        ),
        (
            "header value with a leading space",
            with(|m| {
                m.headers.insert("note".into(), " eu".into());
            }),
            "header note",
        ),
        (
            "header value with a trailing tab",
            with(|m| {
                m.headers.insert("note".into(), "eu\t".into());
            }),
            "header note",
        ),
        (
            "header value ending in a no-break space",
            with(|m| {
                m.headers.insert("note".into(), "eu\u{a0}".into());
            }),
            "header note",
        ),
        (
            "header value starting with an ideographic space",
            with(|m| {
                m.headers.insert("note".into(), "\u{3000}eu".into());
            }),
            "header note",
        ),
        (
            "header value of spaces only",
            with(|m| {
                m.headers.insert("note".into(), "  ".into());
            }),
            "header note",
        ),
        (
            "content type ending in a space",
            with(|m| m.content_type = Some("text/plain ".into())),
            "content_type",
        ),
        (
            "content type whose parameters end in a space",
            with(|m| m.content_type = Some("text/plain; charset=utf-8 ".into())),
            "content_type",
        ),
        (
            "tracestate starting with a space",
            with(|m| {
                m.traceparent = Some(TRACEPARENT.into());
                m.tracestate = Some(" a=b".into());
            }),
            "tracestate",
        ),
        (
            "tracestate ending in a tab",
            with(|m| {
                m.traceparent = Some(TRACEPARENT.into());
                m.tracestate = Some("a=b,c=d\t".into());
            }),
            "tracestate",
        ),
        (
            "header name with a colon",
            with(|m| {
                m.headers.insert("a:b".into(), "x".into());
            }),
            "header a:b",
        ),
        (
            "traceparent in upper case",
            with(|m| m.traceparent = Some(TRACEPARENT.to_uppercase())),
            "traceparent",
        ),
        (
            "traceparent with a zero trace id",
            with(|m| {
                m.traceparent =
                    Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01".into())
            }),
            "traceparent",
        ),
        (
            "traceparent of version ff",
            with(|m| m.traceparent = Some(format!("ff{}", &TRACEPARENT[2..]))),
            "traceparent",
        ),
        (
            "version 00 traceparent with more fields",
            with(|m| m.traceparent = Some(format!("{TRACEPARENT}-00"))),
            "traceparent",
        ),
        (
            "tracestate without traceparent",
            with(|m| m.tracestate = Some("a=b".into())),
            "tracestate",
        ),
        (
            "tracestate member without value",
            with(|m| {
                m.traceparent = Some(TRACEPARENT.into());
                m.tracestate = Some("a=b,c".into());
            }),
            "tracestate",
        ),
        (
            "tracestate of 33 members",
            with(|m| {
                m.traceparent = Some(TRACEPARENT.into());
                m.tracestate = Some(
                    (0..33)
                        .map(|i| format!("k{i}=v"))
                        .collect::<Vec<_>>()
                        .join(","),
                );
            }),
            "tracestate",
        ),
    ]
}

/// `relay_append` called directly with `json` refuses it with RL112 naming `field`.
async fn refused_by_sql(
    conn: &mut sqlx::PgConnection,
    json: &serde_json::Value,
    case: &str,
    field: &str,
) {
    let err = sqlx::query("SELECT relay_append('t', 'r', 'main', 2, 'x', false, 262144, $1)")
        .bind(json)
        .execute(conn)
        .await
        .expect_err(case);
    let db = err.as_database_error().expect(case);
    assert_eq!(db.code().as_deref(), Some("RL112"), "{case}: {db}");
    let detail = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .and_then(|pg| pg.detail())
        .map(str::to_owned);
    assert_eq!(detail, Some(format!("field={field}")), "{case}");
}

async fn outbox_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM relay_outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// What the host sets is what the relay drains, field for field; an intent without metadata
/// stores none (NULL) and drains with none.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn metadata_round_trips_through_the_outbox(pool: PgPool) {
    let branch = key("r");
    let mut tx = pool.begin().await.unwrap();
    writer().open_run(&mut tx, &branch).await.unwrap();
    writer()
        .append_intent(
            &mut tx,
            &branch,
            Lsn::new(1),
            Intent::new(b"{}").with_metadata(full()),
        )
        .await
        .unwrap();
    writer()
        .append(&mut tx, &branch, Lsn::new(2), b"plain")
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let events = Outbox::new(pool.clone())
        .drain_outbox(&branch.tenant, 10)
        .await
        .unwrap();
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].meta, full());
    assert_eq!(events[1].meta, Metadata::default());
    let nulls: i64 = sqlx::query_scalar("SELECT count(*) FROM relay_outbox WHERE meta IS NULL")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(nulls, 1, "an intent without metadata stores none");
}

/// docs/sql-api.md, "Writing" (its Metadata table): through `relay_append`, `{}` and `{"headers": {}}` are no metadata
/// (drained as none), and a header's empty value is accepted and kept.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn empty_metadata_is_none_and_an_empty_header_value_is_kept(pool: PgPool) {
    let branch = key("empty");
    sqlx::query("SELECT relay_open_run('t', 'empty', 'main')")
        .execute(&pool)
        .await
        .unwrap();
    for (lsn, meta) in [
        (1, "{}"),
        (2, r#"{"headers": {}}"#),
        (3, r#"{"headers": {"note": ""}}"#),
    ] {
        sqlx::query(
            "SELECT relay_append('t', 'empty', 'main', $1, '\\x00'::bytea, p_meta => $2::jsonb)",
        )
        .bind(lsn)
        .bind(meta)
        .execute(&pool)
        .await
        .unwrap_or_else(|err| panic!("{meta}: {err}"));
    }
    let events = Outbox::new(pool.clone())
        .drain_outbox(&branch.tenant, 10)
        .await
        .unwrap();
    let metas: Vec<Metadata> = events.into_iter().map(|event| event.meta).collect();
    assert_eq!(
        metas,
        vec![
            Metadata::default(),
            Metadata::default(),
            with(|m| m.headers = [("note".to_owned(), String::new())].into()),
        ]
    );
}

/// Each bad case is refused by the writer before any SQL (the host's transaction stays
/// usable), and by `relay_append` called directly, as a host in another language would, with
/// RL112 naming the same field. Nothing is written either way.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn bad_metadata_is_refused_by_the_writer_and_by_the_sql_alike(pool: PgPool) {
    let branch = key("r");
    let mut conn = pool.acquire().await.unwrap();
    writer().open_run(&mut conn, &branch).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    for (case, meta, field) in bad_cases() {
        let refused = writer()
            .append_intent(
                &mut tx,
                &branch,
                Lsn::new(1),
                Intent::new(b"x").with_metadata(meta.clone()),
            )
            .await;
        match refused {
            Err(Error::InvalidMetadata { field: got, .. }) => {
                assert_eq!(got, field, "{case}: the writer names the field")
            }
            other => panic!("{case}: the writer accepted or failed otherwise: {other:?}"),
        }

        // The same metadata straight into the SQL function.
        let json = serde_json::to_value(&meta).unwrap();
        let mut savepoint = (&mut *tx).begin().await.unwrap();
        refused_by_sql(&mut savepoint, &json, case, field).await;
        savepoint.rollback().await.unwrap();
    }
    // The writer's refusals left the transaction usable: a good append still commits.
    writer()
        .append_intent(
            &mut tx,
            &branch,
            Lsn::new(1),
            Intent::new(b"x").with_metadata(full()),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(outbox_rows(&pool).await, 1);

    // Only SQL sees shapes Rust cannot build: unknown fields, non-strings, a bad event type.
    for (case, json, field) in [
        (
            "unknown field",
            serde_json::json!({"colour": "red"}),
            "colour",
        ),
        ("type not a string", serde_json::json!({"type": 7}), "type"),
        (
            "reserved type",
            serde_json::json!({"type": "outbox.intent"}),
            "type",
        ),
        (
            "type with a space",
            serde_json::json!({"type": "a b"}),
            "type",
        ),
        (
            "header not a string",
            serde_json::json!({"headers": {"a": 1}}),
            "header a",
        ),
        ("not an object", serde_json::json!(["type"]), "meta"),
    ] {
        refused_by_sql(&mut pool.acquire().await.unwrap(), &json, case, field).await;
    }
    assert_eq!(outbox_rows(&pool).await, 1, "no refusal wrote anything");

    // EventType::new refuses what the SQL refuses.
    for bad in ["", "a b", "outbox.intent", &"t".repeat(129), "é"] {
        assert!(
            matches!(EventType::new(bad), Err(Error::InvalidMetadata { ref field, .. }) if field == "type"),
            "{bad:?}"
        );
    }
    // Unusual but valid metadata, outside the SQL's fast path, is accepted by both.
    let unusual = [
        with(|m| m.traceparent = Some(format!("01{}-more", &TRACEPARENT[2..]))),
        with(|m| {
            m.traceparent = Some(TRACEPARENT.into());
            m.tracestate = Some("a=b ,, c=d".into());
        }),
        with(|m| {
            m.headers.insert("h".repeat(64), "é".repeat(100));
        }),
        // Whitespace inside a value, ASCII or not, and an empty value travel on every broker.
        with(|m| {
            m.headers
                .insert("inner".into(), "a \tb\u{a0}c\u{3000}d".into());
            m.headers.insert("empty".into(), String::new());
        }),
        with(|m| m.content_type = Some("text/plain ;".into())),
        with(|m| m.content_type = Some("text/plain ; charset=utf-8".into())),
    ];
    for (lsn, meta) in (3..).zip(unusual) {
        assert!(meta.validate().is_ok(), "{meta:?}");
        let json = serde_json::to_value(&meta).unwrap();
        sqlx::query("SELECT relay_append('t', 'r', 'main', $1, 'x', false, 262144, $2)")
            .bind(lsn)
            .bind(&json)
            .execute(&pool)
            .await
            .unwrap_or_else(|err| panic!("{meta:?}: {err}"));
    }
    // And the limits are inclusive: exactly MAX_HEADERS headers of MAX_HEADER_BYTES in all pass.
    let at_limit = with(|m| m.headers = headers(MAX_HEADERS, MAX_HEADER_BYTES / MAX_HEADERS - 3));
    assert!(at_limit.validate().is_ok());
    let json = serde_json::to_value(&at_limit).unwrap();
    sqlx::query("SELECT relay_append('t', 'r', 'main', 10, 'x', false, 262144, $1)")
        .bind(&json)
        .execute(&pool)
        .await
        .unwrap();
}

/// Every character from U+0001 to U+30FF (all of Unicode's White_Space lies there) and a few
/// past it, at the start, inside and at the end of a header value and of a tracestate: the writer
/// and `relay_require_meta` accept exactly the same ones, so a host in any language is told the
/// same thing, and whatever either accepts reads back from NATS unchanged.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn the_writer_and_the_sql_agree_on_every_character_of_a_value(pool: PgPool) {
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query(
        "CREATE FUNCTION pg_temp.meta_ok(p jsonb) RETURNS boolean LANGUAGE plpgsql AS $$
         BEGIN PERFORM relay_require_meta(p); RETURN true;
         EXCEPTION WHEN sqlstate 'RL112' THEN RETURN false; END $$",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let chars = (1..0x3100)
        .chain([0xfeff, 0xfffd, 0x1f600])
        .filter_map(char::from_u32);
    let mut metas = Vec::new();
    for c in chars {
        for value in [format!("{c}eu"), format!("e{c}u"), format!("eu{c}")] {
            metas.push(with(|m| {
                m.headers.insert("note".into(), value.clone());
            }));
            if c.is_ascii() {
                metas.push(with(|m| {
                    m.traceparent = Some(TRACEPARENT.into());
                    m.tracestate = Some(value.replace("eu", "a=b"));
                }));
                // A later version's further fields.
                metas.push(with(|m| {
                    m.traceparent = Some(format!("01{}-{}", &TRACEPARENT[2..], value));
                }));
            }
        }
    }
    let json: Vec<serde_json::Value> = metas
        .iter()
        .map(|m| serde_json::to_value(m).unwrap())
        .collect();
    let sql: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_temp.meta_ok(m) FROM unnest($1::jsonb[]) WITH ORDINALITY AS t(m, i) ORDER BY i",
    )
    .bind(&json)
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert_eq!(sql.len(), metas.len());
    let mut refused = 0;
    for (meta, sql_ok) in metas.iter().zip(sql) {
        let rust_ok = meta.validate().is_ok();
        assert_eq!(
            rust_ok, sql_ok,
            "the writer and the SQL disagree on {meta:?}"
        );
        refused += usize::from(!rust_ok);
    }
    // 25 White_Space characters at 2 ends, line breaks inside too, and ASCII refusals in
    // tracestates and traceparents: the comparison is not of two functions accepting everything.
    assert!(refused > 50, "only {refused} refused");
}

/// Records what the fold hands over./// Records what the fold hands over.
#[derive(Default)]
struct Seen(Vec<(u64, Metadata)>);

impl Projection for Seen {
    type Error = Error;

    async fn apply(
        &mut self,
        _: &mut sqlx::PgConnection,
        event: &OutboxEvent,
    ) -> Result<(), Error> {
        self.0.push((event.key.lsn.get(), event.meta.clone()));
        Ok(())
    }

    async fn rewind(&mut self, _: &mut sqlx::PgConnection, _: &RewindNotice) -> Result<(), Error> {
        Ok(())
    }
}

/// An intent that arrives ahead of its predecessor is held back by `relay_fold` and released
/// later by another delivery: it still reaches the projection with its own metadata.
#[sqlx::test(migrator = "store::MIGRATOR")]
async fn a_held_back_intent_keeps_its_metadata(pool: PgPool) {
    let branch = key("r");
    let mut conn = pool.acquire().await.unwrap();
    writer().open_run(&mut conn, &branch).await.unwrap();
    let second = with(|m| {
        m.event_type = Some(EventType::new("order.paid").unwrap());
        m.headers.insert("amount".into(), "12".into());
    });
    writer()
        .append(&mut conn, &branch, Lsn::new(1), b"1")
        .await
        .unwrap();
    writer()
        .append_intent(
            &mut conn,
            &branch,
            Lsn::new(2),
            Intent::new(b"2").with_metadata(second.clone()),
        )
        .await
        .unwrap();
    let events = Outbox::new(pool.clone())
        .drain_outbox(&branch.tenant, 10)
        .await
        .unwrap();

    let mut seen = Seen::default();
    let fold = async |event: &OutboxEvent, seen: &mut Seen| {
        let mut tx = pool.begin().await.unwrap();
        let outcome = store::fold(&mut tx, event, seen).await.unwrap();
        tx.commit().await.unwrap();
        outcome
    };
    assert_eq!(fold(&events[1], &mut seen).await, FoldOutcome::Parked);
    assert_eq!(
        fold(&events[0], &mut seen).await,
        FoldOutcome::Applied { released: 1 }
    );
    assert_eq!(seen.0, vec![(1, Metadata::default()), (2, second)]);
}

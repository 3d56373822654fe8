-- What a host may no longer send because NATS would change or act on it (broker/WIRE.md,
-- "On NATS JetStream"): a header named `Nats-*` (any case: the server acts on it; a host's
-- Nats-Msg-Id would drop its event as a duplicate), a header value with a line break or with
-- whitespace at either end (NATS headers are lines of text, read back trimmed), and a
-- content_type or tracestate with whitespace at either end, and a traceparent of a later
-- version whose further fields are not visible ASCII (they travel as headers on NATS).
-- Refused on either broker (RL112), as store::meta refuses them before any SQL: a host need
-- not know which broker ships its events. Whitespace is Unicode's White_Space, listed by code
-- point (the rule of Rust's str::trim and of the NATS clients that trim), not the locale's.
-- The check of 0012 otherwise unchanged.
CREATE OR REPLACE FUNCTION relay_require_meta(p_meta jsonb) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_key text;
    v_value jsonb;
    v_bytes integer := 0;
    v_count integer := 0;
    v_lower text;
    v_member text;
    v_members integer := 0;
    v_field text;
BEGIN
    -- The fast path: one expression that holds only for valid metadata (it is stricter than the
    -- rules in places: a tracestate with empty members, a traceparent of a later version);
    -- anything it does not accept goes through the checks below, which name the field.
    IF jsonb_typeof(p_meta) = 'object'
       AND p_meta - ARRAY['type', 'content_type', 'correlation_id', 'causation_id', 'headers',
                          'traceparent', 'tracestate'] = '{}'::jsonb
       AND coalesce(jsonb_typeof(p_meta->'type') = 'string', true)
       AND coalesce(jsonb_typeof(p_meta->'content_type') = 'string', true)
       AND coalesce(jsonb_typeof(p_meta->'correlation_id') = 'string', true)
       AND coalesce(jsonb_typeof(p_meta->'causation_id') = 'string', true)
       AND coalesce(jsonb_typeof(p_meta->'traceparent') = 'string', true)
       AND coalesce(jsonb_typeof(p_meta->'tracestate') = 'string', true)
       AND coalesce((p_meta->>'type') ~ '^[A-Za-z0-9._:/-]+$' AND octet_length(p_meta->>'type') <= 128
                    AND NOT starts_with(p_meta->>'type', 'outbox.'), true)
       AND coalesce(octet_length(p_meta->>'content_type') <= 255
                    AND (p_meta->>'content_type') ~ '^[!-.0-:<-~]+/[!-.0-:<-~]+( *;([ -~]*[!-~])?)?$', true)
       AND coalesce((p_meta->>'correlation_id') ~ '^[!-~]+$'
                    AND octet_length(p_meta->>'correlation_id') <= 255, true)
       AND coalesce((p_meta->>'causation_id') ~ '^[!-~]+$'
                    AND octet_length(p_meta->>'causation_id') <= 255, true)
       AND (NOT p_meta ? 'headers' OR (
            jsonb_typeof(p_meta->'headers') = 'object'
            AND octet_length((p_meta->'headers')::text) <= 8192
            AND jsonb_array_length(jsonb_path_query_array(p_meta->'headers', '$.keyvalue()')) <= 32
            AND NOT jsonb_path_exists(p_meta->'headers',
                '$.keyvalue() ? (@.value.type() != "string" || !(@.key like_regex "^[A-Za-z0-9._-]+$") || @.key like_regex "................................................................." || !(@.value like_regex "^([!-~]([ -~]*[!-~])?)?$") || @.key like_regex "^(x-|nats-|cloudevents|(wire_version|kind|tenant|run|branch|lsn|prev_lsn|base_lsn|parent_branch|rewound_to|created_at_us|epoch|prev_epoch|causation_id|traceparent|tracestate)$)" flag "i")')))
       AND coalesce((p_meta->>'traceparent') ~ '^00-[0-9a-f]+-[0-9a-f]+-[0-9a-f]+$'
                    AND length(p_meta->>'traceparent') = 55
                    AND substr(p_meta->>'traceparent', 36, 1) = '-'
                    AND substr(p_meta->>'traceparent', 53, 1) = '-'
                    AND substr(p_meta->>'traceparent', 4, 32) <> repeat('0', 32)
                    AND substr(p_meta->>'traceparent', 37, 16) <> repeat('0', 16), true)
       AND coalesce(p_meta ? 'traceparent'
                    AND octet_length(p_meta->>'tracestate') <= 256
                    AND length(p_meta->>'tracestate') - length(replace(p_meta->>'tracestate', ',', '')) <= 31
                    AND (p_meta->>'tracestate') ~ '^[a-z0-9_*/@-]+=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e]([ \t]*,[ \t]*[a-z0-9_*/@-]+=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e])*$', true)
    THEN
        RETURN;
    END IF;
    IF jsonb_typeof(p_meta) <> 'object' THEN
        RAISE EXCEPTION 'invalid metadata: must be a JSON object' USING ERRCODE = 'RL112', DETAIL = 'field=meta';
    END IF;
    FOR v_key, v_value IN SELECT * FROM jsonb_each(p_meta) LOOP
        IF v_key NOT IN ('type', 'content_type', 'correlation_id', 'causation_id', 'headers',
                         'traceparent', 'tracestate') THEN
            RAISE EXCEPTION 'invalid metadata: unknown field %', quote_literal(left(v_key, 80))
                USING ERRCODE = 'RL112', DETAIL = format('field=%s', left(v_key, 80));
        END IF;
        IF v_key <> 'headers' AND jsonb_typeof(v_value) <> 'string' THEN
            RAISE EXCEPTION 'invalid metadata %: must be a string', v_key
                USING ERRCODE = 'RL112', DETAIL = format('field=%s', v_key);
        END IF;
    END LOOP;
    IF p_meta ? 'type' AND ((p_meta->>'type') !~ '^[A-Za-z0-9._:/-]{1,128}$'
                            OR starts_with(p_meta->>'type', 'outbox.')) THEN
        RAISE EXCEPTION 'invalid metadata type %: 1 to 128 bytes of A-Z a-z 0-9 . _ : / -, not outbox.*',
            quote_literal(left(p_meta->>'type', 80)) USING ERRCODE = 'RL112', DETAIL = 'field=type';
    END IF;
    IF p_meta ? 'content_type' AND (octet_length(p_meta->>'content_type') > 255
            OR (p_meta->>'content_type') !~ '^[!-.0-:<-~]+/[!-.0-:<-~]+( *;([ -~]*[!-~])?)?$') THEN
        RAISE EXCEPTION 'invalid metadata content_type: a media type (type/subtype[; parameters]) of at most 255 printable ASCII bytes, not ending in a space'
            USING ERRCODE = 'RL112', DETAIL = 'field=content_type';
    END IF;
    FOREACH v_field IN ARRAY ARRAY['correlation_id', 'causation_id'] LOOP
        IF p_meta ? v_field AND (p_meta->>v_field) !~ '^[!-~]{1,255}$' THEN
            RAISE EXCEPTION 'invalid metadata %: 1 to 255 visible ASCII characters', v_field
                USING ERRCODE = 'RL112', DETAIL = format('field=%s', v_field);
        END IF;
    END LOOP;
    IF p_meta ? 'headers' THEN
        IF jsonb_typeof(p_meta->'headers') <> 'object' THEN
            RAISE EXCEPTION 'invalid metadata headers: must be an object of strings'
                USING ERRCODE = 'RL112', DETAIL = 'field=headers';
        END IF;
        FOR v_key, v_value IN SELECT * FROM jsonb_each(p_meta->'headers') LOOP
            v_count := v_count + 1;
            v_lower := lower(v_key);
            IF v_key !~ '^[A-Za-z0-9._-]{1,64}$' THEN
                RAISE EXCEPTION 'invalid header name %: 1 to 64 bytes of A-Z a-z 0-9 . _ -', quote_literal(left(v_key, 80))
                    USING ERRCODE = 'RL112', DETAIL = format('field=header %s', left(v_key, 80));
            END IF;
            IF v_lower IN ('wire_version', 'kind', 'tenant', 'run', 'branch', 'lsn', 'prev_lsn',
                           'base_lsn', 'parent_branch', 'rewound_to', 'created_at_us', 'epoch', 'prev_epoch',
                           'causation_id', 'traceparent', 'tracestate')
               OR starts_with(v_lower, 'x-') OR starts_with(v_lower, 'cloudevents') THEN
                RAISE EXCEPTION 'header % is reserved by the wire contract', v_key
                    USING ERRCODE = 'RL112', DETAIL = format('field=header %s', v_key);
            END IF;
            IF starts_with(v_lower, 'nats-') THEN
                RAISE EXCEPTION 'header % is the NATS server''s (Nats-*): a host header may not use the name', v_key
                    USING ERRCODE = 'RL112', DETAIL = format('field=header %s', v_key);
            END IF;
            IF jsonb_typeof(v_value) <> 'string' THEN
                RAISE EXCEPTION 'header %: values are strings', v_key
                    USING ERRCODE = 'RL112', DETAIL = format('field=header %s', v_key);
            END IF;
            IF (v_value #>> '{}') ~ '[\r\n]|^[\u0009-\u000d\u0020\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]|[\u0009-\u000d\u0020\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]$' THEN
                RAISE EXCEPTION 'header %: a line break or whitespace at either end, which NATS headers do not keep', v_key
                    USING ERRCODE = 'RL112', DETAIL = format('field=header %s', v_key);
            END IF;
            v_bytes := v_bytes + octet_length(v_key) + octet_length(v_value #>> '{}');
        END LOOP;
        IF v_count > 32 THEN
            RAISE EXCEPTION 'invalid metadata headers: % headers, at most 32', v_count
                USING ERRCODE = 'RL112', DETAIL = 'field=headers';
        END IF;
        IF v_bytes > 8192 THEN
            RAISE EXCEPTION 'invalid metadata headers: % bytes of names and values, at most 8192', v_bytes
                USING ERRCODE = 'RL112', DETAIL = 'field=headers';
        END IF;
    END IF;
    IF p_meta ? 'traceparent' THEN
        IF (p_meta->>'traceparent') !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[!-~]*)?$'
           OR starts_with(p_meta->>'traceparent', 'ff-')
           OR (starts_with(p_meta->>'traceparent', '00-') AND length(p_meta->>'traceparent') <> 55)
           OR substr(p_meta->>'traceparent', 4, 32) = repeat('0', 32)
           OR substr(p_meta->>'traceparent', 37, 16) = repeat('0', 16) THEN
            RAISE EXCEPTION 'invalid metadata traceparent: a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>, lowercase, ids not all zero)'
                USING ERRCODE = 'RL112', DETAIL = 'field=traceparent';
        END IF;
    END IF;
    IF p_meta ? 'tracestate' THEN
        IF NOT p_meta ? 'traceparent' THEN
            RAISE EXCEPTION 'invalid metadata tracestate: needs a traceparent'
                USING ERRCODE = 'RL112', DETAIL = 'field=tracestate';
        END IF;
        IF octet_length(p_meta->>'tracestate') > 512 THEN
            v_members := 33;
        ELSE
            FOREACH v_member IN ARRAY string_to_array(p_meta->>'tracestate', ',') LOOP
                v_member := trim(E' \t' FROM v_member);
                CONTINUE WHEN v_member = '';
                v_members := v_members + 1;
                IF v_member !~ '^[a-z0-9_*/@-]+=[\x20-\x2b\x2d-\x3c\x3e-\x7e]+$'
                   OR length(split_part(v_member, '=', 1)) > 256
                   OR length(split_part(v_member, '=', 2)) > 256 THEN
                    v_members := 33;
                    EXIT;
                END IF;
            END LOOP;
        END IF;
        IF v_members = 0 OR v_members > 32 THEN
            RAISE EXCEPTION 'invalid metadata tracestate: a W3C tracestate (1 to 32 key=value members, at most 512 bytes)'
                USING ERRCODE = 'RL112', DETAIL = 'field=tracestate';
        END IF;
        IF (p_meta->>'tracestate') ~ '^[ \t]|[ \t]$' THEN
            RAISE EXCEPTION 'invalid metadata tracestate: whitespace at either end, which NATS headers do not keep'
                USING ERRCODE = 'RL112', DETAIL = 'field=tracestate';
        END IF;
    END IF;
END
$$;

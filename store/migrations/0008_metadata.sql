-- Metadata on intents (wire version 3): an optional event type, content type, correlation and
-- causation ids, the host's own headers and W3C trace context, stored as one jsonb value
-- (`relay_outbox.meta`, the shape of `store::Metadata`). `relay_append` takes it as a new last
-- argument (`p_meta`, default NULL: what earlier versions wrote) and refuses bad metadata with
-- the new SQLSTATE RL112 (DETAIL `field=<name>`); `relay_ack_and_drain` returns it.
-- The same rules are in `store/src/meta.rs` (checked before any SQL, so the host's transaction
-- stays usable); `store/tests/metadata.rs` runs one table of bad cases against both.

ALTER TABLE relay_outbox ADD COLUMN meta jsonb NULL;
COMMENT ON COLUMN relay_outbox.meta IS 'The intent''s metadata (type, content_type, correlation_id, causation_id, headers, traceparent, tracestate); NULL: none. Shipped as AMQP properties and headers (WIRE.md, version 3).';

CREATE FUNCTION relay_require_meta(p_meta jsonb) RETURNS void
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
                    AND (p_meta->>'content_type') ~ '^[!-.0-:<-~]+/[!-.0-:<-~]+ *(;[ -~]*)?$', true)
       AND coalesce((p_meta->>'correlation_id') ~ '^[!-~]+$'
                    AND octet_length(p_meta->>'correlation_id') <= 255, true)
       AND coalesce((p_meta->>'causation_id') ~ '^[!-~]+$'
                    AND octet_length(p_meta->>'causation_id') <= 255, true)
       AND (NOT p_meta ? 'headers' OR (
            jsonb_typeof(p_meta->'headers') = 'object'
            AND octet_length((p_meta->'headers')::text) <= 8192
            AND jsonb_array_length(jsonb_path_query_array(p_meta->'headers', '$.keyvalue()')) <= 32
            AND NOT jsonb_path_exists(p_meta->'headers',
                '$.keyvalue() ? (@.value.type() != "string" || !(@.key like_regex "^[A-Za-z0-9._-]+$") || @.key like_regex "................................................................." || @.key like_regex "^(x-|cloudevents|(wire_version|kind|tenant|run|branch|lsn|prev_lsn|base_lsn|parent_branch|rewound_to|created_at_us|causation_id|traceparent|tracestate)$)" flag "i")')))
       AND coalesce((p_meta->>'traceparent') ~ '^00-[0-9a-f]+-[0-9a-f]+-[0-9a-f]+$'
                    AND length(p_meta->>'traceparent') = 55
                    AND substr(p_meta->>'traceparent', 36, 1) = '-'
                    AND substr(p_meta->>'traceparent', 53, 1) = '-'
                    AND substr(p_meta->>'traceparent', 4, 32) <> repeat('0', 32)
                    AND substr(p_meta->>'traceparent', 37, 16) <> repeat('0', 16), true)
       AND coalesce(p_meta ? 'traceparent'
                    AND octet_length(p_meta->>'tracestate') <= 256
                    AND length(p_meta->>'tracestate') - length(replace(p_meta->>'tracestate', ',', '')) <= 31
                    AND (p_meta->>'tracestate') ~ '^[ \t]*[a-z0-9_*/@-]+=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*(,[ \t]*[a-z0-9_*/@-]+=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e][ \t]*)*$', true)
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
            OR (p_meta->>'content_type') !~ '^[!-.0-:<-~]+/[!-.0-:<-~]+ *(;[ -~]*)?$') THEN
        RAISE EXCEPTION 'invalid metadata content_type: a media type (type/subtype[; parameters]) of at most 255 printable ASCII bytes'
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
                           'base_lsn', 'parent_branch', 'rewound_to', 'created_at_us',
                           'causation_id', 'traceparent', 'tracestate')
               OR starts_with(v_lower, 'x-') OR starts_with(v_lower, 'cloudevents') THEN
                RAISE EXCEPTION 'header % is reserved by the wire contract', v_key
                    USING ERRCODE = 'RL112', DETAIL = format('field=header %s', v_key);
            END IF;
            IF jsonb_typeof(v_value) <> 'string' THEN
                RAISE EXCEPTION 'header %: values are strings', v_key
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
        IF (p_meta->>'traceparent') !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$'
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
    END IF;
END
$$;
COMMENT ON FUNCTION relay_require_meta IS 'Raises RL112 (DETAIL field=<name>) unless p_meta is valid intent metadata (see store/src/meta.rs).';

-- Keeps the grants of a function that this migration drops and creates again with a new
-- signature (PostgreSQL drops a function's grants with it): what `distribution roles` granted
-- before the upgrade still holds after it.
CREATE OR REPLACE FUNCTION pg_temp.relay_regrant(p_old aclitem[], p_function text) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_grantee oid;
BEGIN
    IF p_old IS NULL THEN
        RETURN; -- never granted nor revoked: the default (EXECUTE to PUBLIC) holds for both
    END IF;
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', p_function);
    FOR v_grantee IN SELECT a.grantee FROM aclexplode(p_old) a WHERE a.privilege_type = 'EXECUTE' LOOP
        IF v_grantee = 0 THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', p_function);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', p_function, pg_get_userbyid(v_grantee));
        END IF;
    END LOOP;
END
$$;

CREATE TEMP TABLE relay_old_acl ON COMMIT DROP AS
SELECT 'relay_append' AS name, proacl FROM pg_proc
 WHERE oid = to_regprocedure('relay_append(text, text, text, bigint, bytea, boolean, bigint)')
UNION ALL
SELECT 'relay_ack_and_drain', proacl FROM pg_proc
 WHERE oid = to_regprocedure('relay_ack_and_drain(integer, text, bigint, text, text[], text[], bigint[], bigint, bigint, text[], text[], bigint[])');

-- The append of 0005 with metadata. Unchanged otherwise; without p_meta it writes what it did.
DROP FUNCTION relay_append(text, text, text, bigint, bytea, boolean, bigint);
CREATE FUNCTION relay_append(
    p_tenant text, p_run text, p_branch text, p_lsn bigint, p_payload bytea,
    p_notify boolean DEFAULT true, p_max_payload_bytes bigint DEFAULT 262144,
    p_meta jsonb DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_done integer;
    v_head bigint;
    v_abandoned bigint;
    v_closed timestamptz;
BEGIN
    -- The hot path checks everything in one expression; a refusal then says exactly why.
    -- (No bounded repetition in the patterns: `{1,64}` costs about 5 us per check in
    -- PostgreSQL's regex engine, `+` and a length test about 0.1 us; same rule.)
    IF (p_tenant ~ '^[A-Za-z0-9._:-]+$' AND octet_length(p_tenant) <= 64
        AND p_run ~ '^[A-Za-z0-9._:-]+$' AND octet_length(p_run) <= 64
        AND p_branch ~ '^[A-Za-z0-9._:-]+$' AND octet_length(p_branch) <= 64) IS NOT TRUE THEN
        PERFORM relay_require_id('tenant id', p_tenant);
        PERFORM relay_require_id('run id', p_run);
        PERFORM relay_require_id('branch id', p_branch);
    END IF;
    IF p_lsn IS NULL OR p_lsn < 0 THEN
        RAISE EXCEPTION 'lsn % is out of range (0 to 9223372036854775807)', coalesce(p_lsn::text, 'NULL')
            USING ERRCODE = 'RL102';
    END IF;
    IF p_payload IS NULL OR octet_length(p_payload) > p_max_payload_bytes THEN
        RAISE EXCEPTION 'payload of % bytes exceeds the maximum of % bytes',
            coalesce(octet_length(p_payload)::text, 'NULL'), p_max_payload_bytes
            USING ERRCODE = 'RL101',
                  DETAIL = format('size=%s max=%s', octet_length(p_payload), p_max_payload_bytes);
    END IF;
    IF p_meta IS NOT NULL THEN
        PERFORM relay_require_meta(p_meta);
    END IF;
    -- One statement: lock the live branch row (held until the host commits: a branch's intents
    -- commit in Lsn order, so a reader only ever sees a gap-free prefix of each branch), move
    -- its head, insert the intent.
    WITH old AS (
        SELECT o.head_lsn, o.base_lsn, o.parent_branch_id FROM relay_branch o
         WHERE o.tenant_id = p_tenant AND o.run_id = p_run AND o.branch_id = p_branch
           AND o.abandoned_at_lsn IS NULL AND o.closed_at IS NULL
           FOR UPDATE
    ), moved AS (
        UPDATE relay_branch b SET head_lsn = p_lsn
          FROM old
         WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_branch
           AND old.head_lsn < p_lsn
        RETURNING old.head_lsn AS prev_lsn, old.base_lsn, old.parent_branch_id
    )
    INSERT INTO relay_outbox
        (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, parent_branch_id, meta)
    SELECT p_tenant, p_run, p_branch, p_lsn, m.prev_lsn, m.base_lsn, p_payload, m.parent_branch_id,
           nullif(p_meta, '{}'::jsonb)
      FROM moved m;
    GET DIAGNOSTICS v_done = ROW_COUNT;
    IF v_done = 0 THEN
        SELECT b.head_lsn, b.abandoned_at_lsn, b.closed_at INTO v_head, v_abandoned, v_closed
          FROM relay_branch b
         WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_branch;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'branch %/%/% does not exist (open the run or rewind first)',
                p_tenant, p_run, p_branch USING ERRCODE = 'RL104';
        ELSIF v_abandoned IS NOT NULL THEN
            RAISE EXCEPTION 'branch %/%/% was abandoned by a rewind at lsn %',
                p_tenant, p_run, p_branch, v_abandoned
                USING ERRCODE = 'RL105', DETAIL = format('abandoned_at_lsn=%s', v_abandoned);
        ELSIF v_closed IS NOT NULL THEN
            RAISE EXCEPTION 'run %/% was closed at lsn %', p_tenant, p_run, v_head
                USING ERRCODE = 'RL110', DETAIL = format('head_lsn=%s', v_head);
        ELSE
            RAISE EXCEPTION 'lsn % on %/%/% is not above the branch head %',
                p_lsn, p_tenant, p_run, p_branch, v_head
                USING ERRCODE = 'RL103', DETAIL = format('head_lsn=%s', v_head);
        END IF;
    END IF;
    IF p_notify THEN
        -- Delivered on commit, deduplicated per transaction.
        PERFORM pg_notify('relay_outbox', p_tenant);
    END IF;
END
$$;
COMMENT ON FUNCTION relay_append IS 'Appends the export intent (tenant, run, branch, lsn) with optional metadata (p_meta) in the caller''s transaction; NOTIFYs relays on commit unless p_notify is false.';

-- The drain of 0002, returning each row's metadata too.
DROP FUNCTION relay_ack_and_drain(integer, text, bigint, text, text[], text[], bigint[], bigint, bigint, text[], text[], bigint[]);
CREATE FUNCTION relay_ack_and_drain(
    p_bucket integer, p_owner text, p_epoch bigint,
    p_tenant text,
    p_ack_runs text[], p_ack_branches text[], p_ack_lsns bigint[],
    p_limit bigint, p_max_bytes bigint,
    p_fly_runs text[], p_fly_branches text[], p_fly_lsns bigint[])
RETURNS TABLE (run_id text, branch_id text, lsn bigint, prev_lsn bigint, base_lsn bigint,
               payload bytea, created_at timestamptz, kind smallint, parent_branch_id text,
               rewound_to text, meta jsonb)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
BEGIN
    IF p_owner IS NOT NULL THEN
        PERFORM 1 FROM relay_lease l
          WHERE l.bucket = p_bucket AND l.owner = p_owner AND l.epoch = p_epoch
            AND l.expires_at > clock_timestamp()
            FOR KEY SHARE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'lease of bucket % epoch % is no longer held by %', p_bucket, p_epoch, p_owner
                USING ERRCODE = 'RL001';
        END IF;
    END IF;
    IF cardinality(p_ack_lsns) > 0 THEN
        DELETE FROM relay_outbox o
         USING unnest(p_ack_runs, p_ack_branches, p_ack_lsns) AS k(run_id, branch_id, lsn)
         WHERE o.tenant_id = p_tenant AND o.run_id = k.run_id
           AND o.branch_id = k.branch_id AND o.lsn = k.lsn;
        -- A confirmed event unparks its branch.
        DELETE FROM relay_parked_branch p
         USING unnest(p_ack_runs, p_ack_branches) AS k(run_id, branch_id)
         WHERE p.tenant_id = p_tenant AND p.run_id = k.run_id AND p.branch_id = k.branch_id;
    END IF;
    IF p_limit > 0 THEN
        -- At most p_limit rows holding at most p_max_bytes of payload in all; the first row
        -- always comes, however large.
        RETURN QUERY
        SELECT d.run_id, d.branch_id, d.lsn, d.prev_lsn, d.base_lsn, d.payload, d.created_at,
               d.kind, d.parent_branch_id, d.rewound_to, d.meta
          FROM (SELECT o.*, sum(octet_length(o.payload)) OVER (ORDER BY o.seq) AS upto
                  FROM relay_outbox o
                 WHERE o.tenant_id = p_tenant
                   AND NOT EXISTS (
                       SELECT 1 FROM unnest(p_fly_runs, p_fly_branches, p_fly_lsns)
                                  AS f(run_id, branch_id, lsn)
                        WHERE f.run_id = o.run_id AND f.branch_id = o.branch_id AND o.lsn <= f.lsn)
                   AND NOT EXISTS (
                       SELECT 1 FROM relay_parked_branch p
                        WHERE p.tenant_id = o.tenant_id AND p.run_id = o.run_id
                          AND p.branch_id = o.branch_id AND p.retry_at > clock_timestamp())
                 ORDER BY o.seq
                 LIMIT p_limit) d
         WHERE d.upto <= p_max_bytes OR d.upto = octet_length(d.payload)
         ORDER BY d.seq;
    END IF;
END
$$;
COMMENT ON FUNCTION relay_ack_and_drain IS 'Retire confirmed intents of one tenant and drain its next ones (with their metadata), each step on a fresh snapshot; fenced by the caller''s lease when p_owner is set.';

SELECT pg_temp.relay_regrant(proacl, 'relay_append(text, text, text, bigint, bytea, boolean, bigint, jsonb)')
  FROM relay_old_acl WHERE name = 'relay_append';
SELECT pg_temp.relay_regrant(proacl, 'relay_ack_and_drain(integer, text, bigint, text, text[], text[], bigint[], bigint, bigint, text[], text[], bigint[])')
  FROM relay_old_acl WHERE name = 'relay_ack_and_drain';

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_append(text, text, text, bigint, bytea, boolean, bigint, jsonb) SET search_path = %I, pg_temp', current_schema());
END
$$;

-- Epochs (wire version 4): every row is stamped with the epoch its database was in when it was
-- written, and every intent and end marker with its predecessor's, so a consumer can tell a
-- (BranchKey, Lsn) written again after a failover from a redelivery (WIRE.md, "Epochs").
--
-- An epoch is a number the database raises whenever it may have lost commits a relay read: a
-- promoted standby (a new WAL timeline) or a cluster moved by dump and restore or pg_upgrade (a
-- new system identifier). It is the cluster's base plus its timeline: a promotion adds one at
-- least, and a new cluster's base lies above every epoch the old one used (kept in
-- relay_epoch and relay_branch.head_epoch, both in any dump). Within one epoch a
-- (BranchKey, Lsn) is written at most once. Rows written before this migration have no epoch.

CREATE TABLE relay_epoch (
    system_identifier bigint      NOT NULL,
    timeline          bigint      NOT NULL,
    epoch             bigint      NOT NULL,
    first_seen        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (system_identifier, timeline)
);
COMMENT ON TABLE relay_epoch IS 'Each (cluster, WAL timeline) this outbox was written on, and its epoch: base of the cluster + timeline (relay_current_epoch).';

-- The epoch rows are written in now (the session's first write keeps it for the session: a
-- server never changes timeline or cluster under an open session that can write). NULL on a
-- standby (nothing can be written there).
CREATE FUNCTION relay_current_epoch() RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_cached text := current_setting('relay.epoch', true);
    v_system bigint := 0;
    v_timeline bigint;
    v_epoch bigint;
BEGIN
    IF v_cached IS NOT NULL AND v_cached <> '' THEN
        RETURN v_cached::bigint;
    END IF;
    IF pg_is_in_recovery() THEN
        RETURN NULL;
    END IF;
    BEGIN
        SELECT c.system_identifier INTO v_system FROM pg_control_system() c;
    EXCEPTION WHEN insufficient_privilege THEN
        -- A role that may not read the control file: every cluster is cluster 0 (a promotion
        -- still raises the epoch; a move to a new cluster is not seen). docs/operations.md.
        v_system := 0;
    END;
    v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint;
    SELECT e.epoch INTO v_epoch FROM relay_epoch e
     WHERE e.system_identifier = v_system AND e.timeline = v_timeline;
    IF NOT FOUND THEN
        -- The cluster's base: that of any timeline of it seen before; for a cluster never seen,
        -- above every epoch any other cluster used (the epochs of its rows' heads included).
        SELECT coalesce(
                   (SELECT e.epoch - e.timeline FROM relay_epoch e
                     WHERE e.system_identifier = v_system LIMIT 1),
                   greatest((SELECT max(e.epoch) FROM relay_epoch e),
                            (SELECT max(b.head_epoch) FROM relay_branch b),
                            0))
               + v_timeline
          INTO v_epoch;
        INSERT INTO relay_epoch (system_identifier, timeline, epoch)
        VALUES (v_system, v_timeline, v_epoch)
        ON CONFLICT DO NOTHING;
    END IF;
    PERFORM set_config('relay.epoch', v_epoch::text, false);
    RETURN v_epoch;
END
$$;
COMMENT ON FUNCTION relay_current_epoch IS 'The epoch rows written now are stamped with (WIRE.md, "Epochs"); NULL on a standby.';

ALTER TABLE relay_branch ADD COLUMN head_epoch bigint NULL;
COMMENT ON COLUMN relay_branch.head_epoch IS 'The epoch the intent at head_lsn was written in (NULL: no intent yet, or written before epochs).';
ALTER TABLE relay_outbox
    ADD COLUMN epoch bigint NULL,
    ADD COLUMN prev_epoch bigint NULL;
ALTER TABLE relay_outbox ALTER COLUMN epoch SET DEFAULT relay_current_epoch();
COMMENT ON COLUMN relay_outbox.epoch IS 'The epoch the row was written in (NULL: written before epochs).';
COMMENT ON COLUMN relay_outbox.prev_epoch IS 'Intents and end markers: the epoch the intent at prev_lsn was written in (NULL: prev_lsn is the branch''s base, or unknown).';

-- The two new headers are the contract's: a host header may not use their names (RL112), as
-- store::meta refuses them before any SQL. The check of 0008 otherwise unchanged.
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
                '$.keyvalue() ? (@.value.type() != "string" || !(@.key like_regex "^[A-Za-z0-9._-]+$") || @.key like_regex "................................................................." || @.key like_regex "^(x-|cloudevents|(wire_version|kind|tenant|run|branch|lsn|prev_lsn|base_lsn|parent_branch|rewound_to|created_at_us|epoch|prev_epoch|causation_id|traceparent|tracestate)$)" flag "i")')))
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
                           'base_lsn', 'parent_branch', 'rewound_to', 'created_at_us', 'epoch', 'prev_epoch',
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

-- The append of 0008, stamping the epoch and the predecessor's. Unchanged otherwise.
CREATE OR REPLACE FUNCTION relay_append(
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
    v_epoch bigint;
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
    -- The session's epoch from its cache, without a call: relay_current_epoch, like every
    -- function with a pinned search_path, costs a switch of settings per call (benches/HISTORY.md,
    -- "Issue 50"); the session's first append fills the cache through it.
    v_epoch := nullif(current_setting('relay.epoch', true), '')::bigint;
    IF v_epoch IS NULL THEN
        v_epoch := relay_current_epoch();
    END IF;
    -- One statement: lock the live branch row (held until the host commits: a branch's intents
    -- commit in Lsn order, so a reader only ever sees a gap-free prefix of each branch), move
    -- its head, insert the intent.
    WITH old AS (
        SELECT o.head_lsn, o.head_epoch, o.base_lsn, o.parent_branch_id FROM relay_branch o
         WHERE o.tenant_id = p_tenant AND o.run_id = p_run AND o.branch_id = p_branch
           AND o.abandoned_at_lsn IS NULL AND o.closed_at IS NULL
           FOR UPDATE
    ), moved AS (
        UPDATE relay_branch b SET head_lsn = p_lsn, head_epoch = v_epoch
          FROM old
         WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_branch
           AND old.head_lsn < p_lsn
        RETURNING old.head_lsn AS prev_lsn, old.head_epoch AS prev_epoch, old.base_lsn,
                  old.parent_branch_id
    )
    INSERT INTO relay_outbox
        (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, parent_branch_id, meta,
         epoch, prev_epoch)
    SELECT p_tenant, p_run, p_branch, p_lsn, m.prev_lsn, m.base_lsn, p_payload, m.parent_branch_id,
           nullif(p_meta, '{}'::jsonb), v_epoch,
           CASE WHEN m.prev_lsn > m.base_lsn THEN m.prev_epoch END
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

-- The close of 0005, with the end marker's predecessor's epoch. Unchanged otherwise.
CREATE OR REPLACE FUNCTION relay_close_run(p_tenant text, p_run text, p_notify boolean DEFAULT true)
RETURNS TABLE (branch_id text, end_lsn bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
#variable_conflict use_column
DECLARE
    v_row relay_branch%ROWTYPE;
BEGIN
    PERFORM relay_require_id('tenant id', p_tenant);
    PERFORM relay_require_id('run id', p_run);
    -- The live branch's lock, as an append takes it: the end marker commits after every intent.
    SELECT * INTO v_row FROM relay_branch b
     WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.abandoned_at_lsn IS NULL
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'run %/% does not exist (open it first)', p_tenant, p_run
            USING ERRCODE = 'RL104';
    END IF;
    IF v_row.closed_at IS NOT NULL THEN
        RAISE EXCEPTION 'run %/% was closed at lsn %', p_tenant, p_run, v_row.head_lsn
            USING ERRCODE = 'RL110', DETAIL = format('head_lsn=%s', v_row.head_lsn);
    END IF;
    IF v_row.head_lsn = 9223372036854775807 THEN
        RAISE EXCEPTION 'cannot close %/%: its head is the largest Lsn, no room for the end marker',
            p_tenant, p_run USING ERRCODE = 'RL109';
    END IF;
    UPDATE relay_branch b SET closed_at = now()
     WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = v_row.branch_id;
    -- The end marker: after every intent of the live branch, on its shard and partition.
    INSERT INTO relay_outbox
        (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, kind, parent_branch_id,
         prev_epoch)
    VALUES (p_tenant, p_run, v_row.branch_id, v_row.head_lsn + 1, v_row.head_lsn,
            v_row.base_lsn, '', 2, v_row.parent_branch_id,
            CASE WHEN v_row.head_lsn > v_row.base_lsn THEN v_row.head_epoch END);
    IF p_notify THEN
        PERFORM pg_notify('relay_outbox', p_tenant);
    END IF;
    RETURN QUERY SELECT v_row.branch_id, v_row.head_lsn + 1;
END
$$;

-- The drain of 0008, returning each row's epochs too (a new result type: the function is
-- dropped, and PostgreSQL drops its grants with it: keep what `distribution roles` granted).
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
CREATE TEMP TABLE relay_old_drain_acl ON COMMIT DROP AS
SELECT proacl FROM pg_proc
 WHERE oid = to_regprocedure('relay_ack_and_drain(integer, text, bigint, text, text[], text[], bigint[], bigint, bigint, text[], text[], bigint[])');
DROP FUNCTION relay_ack_and_drain(integer, text, bigint, text, text[], text[], bigint[], bigint, bigint, text[], text[], bigint[]);
CREATE FUNCTION relay_ack_and_drain(
    p_bucket integer, p_owner text, p_epoch bigint,
    p_tenant text,
    p_ack_runs text[], p_ack_branches text[], p_ack_lsns bigint[],
    p_limit bigint, p_max_bytes bigint,
    p_fly_runs text[], p_fly_branches text[], p_fly_lsns bigint[])
RETURNS TABLE (run_id text, branch_id text, lsn bigint, prev_lsn bigint, base_lsn bigint,
               payload bytea, created_at timestamptz, kind smallint, parent_branch_id text,
               rewound_to text, meta jsonb, epoch bigint, prev_epoch bigint)
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
               d.kind, d.parent_branch_id, d.rewound_to, d.meta, d.epoch, d.prev_epoch
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
COMMENT ON FUNCTION relay_ack_and_drain IS 'Retire confirmed intents of one tenant and drain its next ones (with their metadata and epochs), each step on a fresh snapshot; fenced by the caller''s lease when p_owner is set.';

SELECT pg_temp.relay_regrant(proacl, 'relay_ack_and_drain(integer, text, bigint, text, text[], text[], bigint[], bigint, bigint, text[], text[], bigint[])')
  FROM relay_old_drain_acl;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_current_epoch() SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_append(text, text, text, bigint, bytea, boolean, bigint, jsonb) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_close_run(text, text, boolean) SET search_path = %I, pg_temp', current_schema());
END
$$;

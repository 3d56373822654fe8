-- Metadata on intents (wire version 3): `relay_fold` takes a delivery's metadata as a new last
-- argument (`p_meta`, jsonb in the shape of `store::Metadata`: type, content_type,
-- correlation_id, causation_id, headers, traceparent, tracestate; default NULL), keeps it with an
-- intent it holds back, and returns it (new last column `meta`) on every `apply` row, so a
-- released intent reaches the projection with its metadata. Calls with eleven arguments, and
-- readers that name their columns, work unchanged. The fold does not judge metadata: the host's
-- `relay_append` validated it.

ALTER TABLE relay_fold_parked ADD COLUMN IF NOT EXISTS meta jsonb NULL;
COMMENT ON COLUMN relay_fold_parked.meta IS 'The held-back intent''s metadata as delivered (NULL: none).';

-- PostgreSQL drops a function's grants with it: keep what `distribution roles` granted.
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

CREATE TEMP TABLE relay_old_fold_acl ON COMMIT DROP AS
SELECT proacl FROM pg_proc
 WHERE oid = to_regprocedure('relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea)');

DROP FUNCTION relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea);

CREATE FUNCTION relay_fold(
    p_tenant text, p_run text, p_branch text, p_kind text, p_lsn bigint, p_prev_lsn bigint,
    p_base_lsn bigint, p_parent_branch text, p_rewound_to text, p_created_at timestamptz,
    p_payload bytea, p_meta jsonb DEFAULT NULL)
RETURNS TABLE (action text, branch_id text, lsn bigint, prev_lsn bigint, base_lsn bigint,
               parent_branch text, rewound_to text, created_at timestamptz, payload bytea,
               meta jsonb)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
#variable_conflict use_column
DECLARE
    c record;
    r record;
    v_branch text := p_branch;
    v_applied bigint;
    v_at bigint;
    v_to text;
    v_id text;
    v_new integer;
    v_ended boolean := false;
    v_end_created timestamptz;
    v_horizon timestamptz;
BEGIN
    -- The ids' rule of the write API (a consumer's own database has no relay_require_id).
    FOREACH v_id IN ARRAY ARRAY[p_tenant, p_run, p_branch] LOOP
        -- `+` and a length test: `{1,64}` costs about 5 us per check (PostgreSQL's regex engine).
        IF v_id IS NULL OR v_id !~ '^[A-Za-z0-9._:-]+$' OR octet_length(v_id) > 64 THEN
            RAISE EXCEPTION 'invalid id %: 1 to 64 bytes of ASCII letters, digits and - _ . :',
                coalesce(quote_literal(left(v_id, 80)), 'NULL') USING ERRCODE = 'RL100';
        END IF;
    END LOOP;
    IF p_kind IS NULL OR p_kind NOT IN ('intent', 'rewind', 'end') THEN
        RAISE EXCEPTION 'unknown kind %: intent, rewind or end', coalesce(quote_literal(p_kind), 'NULL')
            USING ERRCODE = 'RL201';
    END IF;
    IF p_lsn IS NULL OR p_prev_lsn IS NULL OR p_base_lsn IS NULL
       OR p_lsn <= p_prev_lsn OR p_prev_lsn < p_base_lsn OR p_base_lsn < 0 THEN
        RAISE EXCEPTION 'delivery %/%/% has lsn %, prev_lsn %, base_lsn %: needs 0 <= base_lsn <= prev_lsn < lsn',
            p_tenant, p_run, p_branch, p_lsn, p_prev_lsn, p_base_lsn USING ERRCODE = 'RL201';
    END IF;
    IF p_kind = 'intent' AND p_payload IS NULL THEN
        RAISE EXCEPTION 'intent %/%/%@% without a body (NULL payload)', p_tenant, p_run, p_branch, p_lsn
            USING ERRCODE = 'RL201';
    END IF;
    IF p_kind = 'rewind' AND (p_rewound_to IS NULL OR p_rewound_to !~ '^[A-Za-z0-9._:-]{1,64}$') THEN
        RAISE EXCEPTION 'rewind marker %/%/% without a valid rewound_to', p_tenant, p_run, p_branch
            USING ERRCODE = 'RL201';
    END IF;
    -- The branch's state, created on its first message (intent or marker); its row lock
    -- serialises the folding of a branch.
    INSERT INTO relay_fold_cursor AS f (tenant_id, run_id, branch_id, applied_lsn, started)
    VALUES (p_tenant, p_run, p_branch, p_base_lsn, p_parent_branch IS NULL)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS v_new = ROW_COUNT;
    IF v_new = 1 AND p_created_at IS NOT NULL THEN
        -- No state for this branch: a first delivery, or a run retired by relay_fold_retire.
        -- Every message of a retired run was written no later than its end marker, and the
        -- horizon is the tenant's latest end marker retired: at or before it, this is a
        -- redelivery (or an event of the tenant held up for longer than the retention).
        -- Refused, never applied twice.
        SELECT h.retired_through INTO v_horizon FROM relay_fold_horizon h
         WHERE h.tenant_id = p_tenant;
        IF v_horizon IS NOT NULL AND p_created_at <= v_horizon THEN
            RAISE EXCEPTION 'delivery %/%/%@% was written at % and its branch has no fold state: its run was retired (the tenant''s end markers up to % are), so this is a redelivery after the retention, or an event delayed past it',
                p_tenant, p_run, p_branch, p_lsn, p_created_at, v_horizon
                USING ERRCODE = 'RL202',
                      DETAIL = format('created_at_us=%s retired_through_us=%s',
                                      (extract(epoch FROM p_created_at) * 1000000)::bigint,
                                      (extract(epoch FROM v_horizon) * 1000000)::bigint);
        END IF;
    END IF;
    SELECT f.applied_lsn, f.abandoned_at_lsn, f.rewound_to, f.started INTO c
      FROM relay_fold_cursor f
     WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = p_branch
       FOR UPDATE;

    IF p_kind = 'rewind' THEN
        -- Rule 1: a marker.
        IF c.abandoned_at_lsn IS NOT NULL THEN
            RETURN QUERY SELECT 'duplicate', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, p_rewound_to, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        RETURN QUERY SELECT 'undo', p_branch, p_prev_lsn, c.applied_lsn, p_base_lsn,
                            p_parent_branch, p_rewound_to, p_created_at, NULL::bytea, NULL::jsonb;
        DELETE FROM relay_fold_parked h
         WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = p_branch
           AND h.lsn > p_prev_lsn;
        v_applied := least(c.applied_lsn, p_prev_lsn);
        UPDATE relay_fold_cursor f
           SET applied_lsn = v_applied, abandoned_at_lsn = p_prev_lsn, rewound_to = p_rewound_to
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = p_branch;
        IF NOT c.started THEN
            -- Started (and caught up) by its own parent's hand-over.
            RETURN;
        END IF;
        v_at := p_prev_lsn;
        v_to := p_rewound_to;
    ELSE
        IF c.abandoned_at_lsn IS NOT NULL AND p_lsn > c.abandoned_at_lsn THEN
            -- Rule 2: abandoned.
            RETURN QUERY SELECT 'abandoned', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        IF p_lsn <= c.applied_lsn THEN
            -- Rule 3: a redelivery.
            RETURN QUERY SELECT 'duplicate', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        IF p_prev_lsn < c.applied_lsn THEN
            -- Rule 4: a broken chain.
            RAISE EXCEPTION 'event % on %/%/% claims predecessor % but the fold has applied up to %',
                p_lsn, p_tenant, p_run, p_branch, p_prev_lsn, c.applied_lsn
                USING ERRCODE = 'RL200', DETAIL = format('applied_lsn=%s', c.applied_lsn);
        END IF;
        IF NOT c.started OR p_prev_lsn > c.applied_lsn THEN
            -- Rule 5: hold back.
            INSERT INTO relay_fold_parked AS h
                (tenant_id, run_id, branch_id, lsn, prev_lsn, payload, base_lsn, created_at,
                 parent_branch_id, kind, meta)
            VALUES (p_tenant, p_run, p_branch, p_lsn, p_prev_lsn, coalesce(p_payload, ''),
                    p_base_lsn, coalesce(p_created_at, now()), p_parent_branch, p_kind,
                    nullif(p_meta, '{}'::jsonb))
            ON CONFLICT DO NOTHING;
            RETURN QUERY SELECT 'hold', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        -- Rule 6: apply (an end marker: the run is complete), then catch up.
        IF p_kind = 'end' THEN
            RETURN QUERY SELECT 'end', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
            v_ended := true;
            v_end_created := coalesce(p_created_at, now());
        ELSE
            RETURN QUERY SELECT 'apply', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, p_payload, p_meta;
        END IF;
        v_applied := p_lsn;
        v_at := c.abandoned_at_lsn;
        v_to := c.rewound_to;
    END IF;

    -- Catch up v_branch (started), then hand over along the chain of rewinds.
    LOOP
        LOOP
            DELETE FROM relay_fold_parked h
             WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = v_branch
               AND h.prev_lsn = v_applied
            RETURNING h.lsn, h.prev_lsn, h.base_lsn, h.parent_branch_id, h.created_at, h.payload,
                      h.kind, h.meta
                 INTO r;
            EXIT WHEN NOT FOUND;
            IF r.kind = 'end' THEN
                RETURN QUERY SELECT 'end', v_branch, r.lsn, r.prev_lsn, r.base_lsn,
                                    r.parent_branch_id, NULL::text, r.created_at, NULL::bytea, NULL::jsonb;
                v_ended := true;
                v_end_created := r.created_at;
            ELSE
                RETURN QUERY SELECT 'apply', v_branch, r.lsn, r.prev_lsn, r.base_lsn,
                                    r.parent_branch_id, NULL::text, r.created_at, r.payload, r.meta;
            END IF;
            v_applied := r.lsn;
        END LOOP;
        UPDATE relay_fold_cursor f
           SET applied_lsn = v_applied, started = true,
               ended_at = CASE WHEN v_ended THEN now() ELSE f.ended_at END,
               end_created_at = CASE WHEN v_ended THEN v_end_created ELSE f.end_created_at END
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = v_branch;
        v_ended := false;
        EXIT WHEN v_at IS NULL OR v_to IS NULL OR v_applied <> v_at;
        -- The hand-over: the branch rewound to starts, with or without intents of its own yet.
        INSERT INTO relay_fold_cursor AS f (tenant_id, run_id, branch_id, applied_lsn, started)
        VALUES (p_tenant, p_run, v_to, v_at, false)
        ON CONFLICT DO NOTHING;
        SELECT f.applied_lsn, f.abandoned_at_lsn, f.rewound_to, f.started INTO c
          FROM relay_fold_cursor f
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = v_to
           FOR UPDATE;
        EXIT WHEN c.started;
        v_branch := v_to;
        v_applied := c.applied_lsn;
        v_at := c.abandoned_at_lsn;
        v_to := c.rewound_to;
    END LOOP;
END
$$;
COMMENT ON FUNCTION relay_fold IS 'Folds one delivery (WIRE.md''s consumer rules): returns the verdict on it, then the held-back intents (and end marker) it released, in the order to apply them.';

SELECT pg_temp.relay_regrant(proacl, 'relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb)')
  FROM relay_old_fold_acl;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb) SET search_path = %I, pg_temp', current_schema());
END
$$;

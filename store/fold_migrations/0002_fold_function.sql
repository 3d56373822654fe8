-- The fold's rules (broker/WIRE.md, "What a consumer must do") as one SQL function, so a
-- consumer in any language gets exactly-once, in-order live history by calling it, instead of
-- re-implementing the rules. `store::fold` calls it too: the rules exist once in the product.
--
-- Call it inside the transaction in which you apply what it returns, once per delivery, with the
-- delivery's headers and body; commit, then ack the delivery. It returns, in order:
--   row 1, the verdict on this delivery:
--     'apply'     apply this intent (its columns are the delivery's);
--     'undo'      a rewind marker: undo what you applied of branch_id above lsn (the fork);
--                 prev_lsn is the highest Lsn of it you had applied (nothing to undo when it is
--                 not above lsn); rewound_to is where live history continues;
--     'hold'      kept until its predecessor (or its parent's hand-over) is folded: apply nothing;
--     'duplicate' a redelivery: apply nothing;
--     'abandoned' an intent above a folded marker's fork: apply nothing;
--   then any number of 'apply' rows: intents held back earlier that this delivery released, in
--   the order to apply them (possibly of branches forked from this one).
-- A delivery that breaks its branch's chain (a broken producer) raises RL200: dead-letter it.
-- A malformed delivery (unknown kind, NULL or negative Lsns, a bad id) raises RL201 or RL100.

CREATE OR REPLACE FUNCTION relay_fold(
    p_tenant text, p_run text, p_branch text, p_kind text, p_lsn bigint, p_prev_lsn bigint,
    p_base_lsn bigint, p_parent_branch text, p_rewound_to text, p_created_at timestamptz,
    p_payload bytea)
RETURNS TABLE (action text, branch_id text, lsn bigint, prev_lsn bigint, base_lsn bigint,
               parent_branch text, rewound_to text, created_at timestamptz, payload bytea)
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
BEGIN
    -- The ids' rule of the write API (a consumer's own database has no relay_require_id).
    FOREACH v_id IN ARRAY ARRAY[p_tenant, p_run, p_branch] LOOP
        IF v_id IS NULL OR v_id !~ '^[A-Za-z0-9._:-]{1,64}$' THEN
            RAISE EXCEPTION 'invalid id %: 1 to 64 bytes of ASCII letters, digits and - _ . :',
                coalesce(quote_literal(left(v_id, 80)), 'NULL') USING ERRCODE = 'RL100';
        END IF;
    END LOOP;
    IF p_kind IS NULL OR p_kind NOT IN ('intent', 'rewind') THEN
        RAISE EXCEPTION 'unknown kind %: intent or rewind', coalesce(quote_literal(p_kind), 'NULL')
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
    SELECT f.applied_lsn, f.abandoned_at_lsn, f.rewound_to, f.started INTO c
      FROM relay_fold_cursor f
     WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = p_branch
       FOR UPDATE;

    IF p_kind = 'rewind' THEN
        -- Rule 1: a marker.
        IF c.abandoned_at_lsn IS NOT NULL THEN
            RETURN QUERY SELECT 'duplicate', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, p_rewound_to, p_created_at, NULL::bytea;
            RETURN;
        END IF;
        RETURN QUERY SELECT 'undo', p_branch, p_prev_lsn, c.applied_lsn, p_base_lsn,
                            p_parent_branch, p_rewound_to, p_created_at, NULL::bytea;
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
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea;
            RETURN;
        END IF;
        IF p_lsn <= c.applied_lsn THEN
            -- Rule 3: a redelivery.
            RETURN QUERY SELECT 'duplicate', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea;
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
                 parent_branch_id)
            VALUES (p_tenant, p_run, p_branch, p_lsn, p_prev_lsn, p_payload, p_base_lsn,
                    coalesce(p_created_at, now()), p_parent_branch)
            ON CONFLICT DO NOTHING;
            RETURN QUERY SELECT 'hold', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea;
            RETURN;
        END IF;
        -- Rule 6: apply, then catch up.
        RETURN QUERY SELECT 'apply', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                            p_parent_branch, NULL::text, p_created_at, p_payload;
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
            RETURNING h.lsn, h.prev_lsn, h.base_lsn, h.parent_branch_id, h.created_at, h.payload
                 INTO r;
            EXIT WHEN NOT FOUND;
            RETURN QUERY SELECT 'apply', v_branch, r.lsn, r.prev_lsn, r.base_lsn,
                                r.parent_branch_id, NULL::text, r.created_at, r.payload;
            v_applied := r.lsn;
        END LOOP;
        UPDATE relay_fold_cursor f SET applied_lsn = v_applied, started = true
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = v_branch;
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
COMMENT ON FUNCTION relay_fold IS 'Folds one delivery (WIRE.md''s consumer rules): returns the verdict on it, then the held-back intents it released, in the order to apply them.';

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea) SET search_path = %I, pg_temp', current_schema());
END
$$;

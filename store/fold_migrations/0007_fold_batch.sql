-- The batched form of `relay_fold`, for consumers in any language that fold many deliveries in
-- one transaction (WIRE.md, "Batching"): one call, one round trip, for a whole batch. It calls
-- `relay_fold` for each delivery in array order, so its answer is by construction that of one
-- call per delivery, in the same order (store/tests/rewind_fold.rs checks it differentially).
--
-- Arguments: one array per argument of `relay_fold`, all of one length (the last three may be
-- NULL: no metadata, no epochs). Rows: `delivery` (1-based index into the arrays) and `step`
-- (the row's place in that delivery's answer), then `relay_fold`'s columns, ordered by
-- (delivery, step). Apply them in that order.
--
-- A refusal (RL100, RL200, RL201, RL202, RL203) fails the whole call with the refusal's own
-- SQLSTATE, message and detail, and a hint naming the delivery: `delivery N of the batch`.
-- Roll back, dead-letter that delivery alone, and fold the others again.
CREATE OR REPLACE FUNCTION relay_fold_batch(
    p_tenant text[], p_run text[], p_branch text[], p_kind text[], p_lsn bigint[],
    p_prev_lsn bigint[], p_base_lsn bigint[], p_parent_branch text[], p_rewound_to text[],
    p_created_at timestamptz[], p_payload bytea[], p_meta jsonb[] DEFAULT NULL,
    p_epoch bigint[] DEFAULT NULL, p_prev_epoch bigint[] DEFAULT NULL)
RETURNS TABLE (delivery integer, step integer, action text, branch_id text, lsn bigint,
               prev_lsn bigint, base_lsn bigint, parent_branch text, rewound_to text,
               created_at timestamptz, payload bytea, meta jsonb)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_n integer := coalesce(cardinality(p_tenant), 0);
    v_i integer := 0;
    v_state text;
    v_message text;
    v_detail text;
BEGIN
    IF coalesce(cardinality(p_run), 0) <> v_n OR coalesce(cardinality(p_branch), 0) <> v_n
       OR coalesce(cardinality(p_kind), 0) <> v_n OR coalesce(cardinality(p_lsn), 0) <> v_n
       OR coalesce(cardinality(p_prev_lsn), 0) <> v_n OR coalesce(cardinality(p_base_lsn), 0) <> v_n
       OR coalesce(cardinality(p_parent_branch), 0) <> v_n
       OR coalesce(cardinality(p_rewound_to), 0) <> v_n
       OR coalesce(cardinality(p_created_at), 0) <> v_n
       OR coalesce(cardinality(p_payload), 0) <> v_n
       OR (p_meta IS NOT NULL AND cardinality(p_meta) <> v_n)
       OR (p_epoch IS NOT NULL AND cardinality(p_epoch) <> v_n)
       OR (p_prev_epoch IS NOT NULL AND cardinality(p_prev_epoch) <> v_n) THEN
        RAISE EXCEPTION 'relay_fold_batch: every array must have one element per delivery (% deliveries)', v_n
            USING ERRCODE = '22023';
    END IF;
    -- One exception block around the whole loop (one subtransaction per call, not per
    -- delivery): it only adds the failing delivery's index to the refusal.
    BEGIN
        -- WHILE, not FOR: a FOR loop's variable would hide v_i from the handler below.
        WHILE v_i < v_n LOOP
            v_i := v_i + 1;
            RETURN QUERY
                SELECT v_i, f.n::integer, f.action, f.branch_id, f.lsn, f.prev_lsn, f.base_lsn,
                       f.parent_branch, f.rewound_to, f.created_at, f.payload, f.meta
                  FROM relay_fold(p_tenant[v_i], p_run[v_i], p_branch[v_i], p_kind[v_i],
                                  p_lsn[v_i], p_prev_lsn[v_i], p_base_lsn[v_i],
                                  p_parent_branch[v_i], p_rewound_to[v_i], p_created_at[v_i],
                                  p_payload[v_i], p_meta[v_i], p_epoch[v_i], p_prev_epoch[v_i])
                       WITH ORDINALITY AS f(action, branch_id, lsn, prev_lsn, base_lsn,
                                            parent_branch, rewound_to, created_at, payload,
                                            meta, n);
        END LOOP;
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT,
                                v_detail = PG_EXCEPTION_DETAIL;
        IF v_detail = '' THEN
            RAISE EXCEPTION USING ERRCODE = v_state, MESSAGE = v_message,
                HINT = format('delivery %s of the batch', v_i);
        END IF;
        RAISE EXCEPTION USING ERRCODE = v_state, MESSAGE = v_message, DETAIL = v_detail,
            HINT = format('delivery %s of the batch', v_i);
    END;
END
$$;
COMMENT ON FUNCTION relay_fold_batch IS 'Folds a batch of deliveries: relay_fold for each, in array order; rows (delivery, step, relay_fold''s columns) in that order. A refusal fails the call with its own SQLSTATE and the hint "delivery N of the batch".';

-- Whoever may call relay_fold may call its batched form.
DO $$
DECLARE
    v_acl aclitem[];
    v_grantee oid;
    v_function text := 'relay_fold_batch(text[], text[], text[], text[], bigint[], bigint[], bigint[], text[], text[], timestamptz[], bytea[], jsonb[], bigint[], bigint[])';
BEGIN
    EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', v_function, current_schema());
    SELECT proacl INTO v_acl FROM pg_proc
     WHERE oid = to_regprocedure('relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb, bigint, bigint)');
    IF v_acl IS NULL THEN
        RETURN; -- never granted nor revoked: the default (EXECUTE to PUBLIC) holds for both
    END IF;
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', v_function);
    FOR v_grantee IN SELECT a.grantee FROM aclexplode(v_acl) a WHERE a.privilege_type = 'EXECUTE' LOOP
        IF v_grantee = 0 THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', v_function);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', v_function, pg_get_userbyid(v_grantee));
        END IF;
    END LOOP;
END
$$;

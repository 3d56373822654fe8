-- Discarding a parked branch for good, on the wire: the operator's way out when the broker will
-- never take a branch's events (too large, refused by policy). New SQLSTATE: RL111, the branch
-- is not parked with events waiting.

CREATE FUNCTION relay_discard_branch(p_tenant text, p_run text, p_branch text, p_to text)
RETURNS TABLE (fork_lsn bigint, discarded bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
#variable_conflict use_column
DECLARE
    v_row relay_branch%ROWTYPE;
    v_fork bigint;
    v_discarded bigint;
BEGIN
    PERFORM relay_require_id('tenant id', p_tenant);
    PERFORM relay_require_id('run id', p_run);
    PERFORM relay_require_id('branch id', p_branch);
    PERFORM relay_require_id('branch id', p_to);
    SELECT * INTO v_row FROM relay_branch b
     WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_branch
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'branch %/%/% does not exist', p_tenant, p_run, p_branch
            USING ERRCODE = 'RL104';
    END IF;
    IF v_row.abandoned_at_lsn IS NOT NULL THEN
        RAISE EXCEPTION 'branch %/%/% was abandoned by a rewind at lsn %',
            p_tenant, p_run, p_branch, v_row.abandoned_at_lsn
            USING ERRCODE = 'RL105', DETAIL = format('abandoned_at_lsn=%s', v_row.abandoned_at_lsn);
    END IF;
    -- Everything below the first waiting row has shipped: that is where live history ends.
    SELECT min(o.prev_lsn) INTO v_fork FROM relay_outbox o
     WHERE o.tenant_id = p_tenant AND o.run_id = p_run AND o.branch_id = p_branch;
    IF v_fork IS NULL OR NOT EXISTS (
        SELECT 1 FROM relay_parked_branch p
         WHERE p.tenant_id = p_tenant AND p.run_id = p_run AND p.branch_id = p_branch) THEN
        RAISE EXCEPTION 'branch %/%/% is not parked with events waiting: nothing to discard',
            p_tenant, p_run, p_branch USING ERRCODE = 'RL111';
    END IF;
    IF v_row.head_lsn >= 9223372036854775806 THEN
        RAISE EXCEPTION 'cannot discard %/%/%: its head is too close to the largest Lsn for the marker',
            p_tenant, p_run, p_branch USING ERRCODE = 'RL109';
    END IF;
    IF EXISTS (SELECT 1 FROM relay_branch b
                WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_to) THEN
        RAISE EXCEPTION 'branch %/%/% already exists', p_tenant, p_run, p_to USING ERRCODE = 'RL107';
    END IF;
    -- A rewind at the last shipped Lsn: the waiting rows go, a marker tells consumers.
    UPDATE relay_branch b SET abandoned_at_lsn = v_fork
     WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_branch;
    DELETE FROM relay_outbox o
     WHERE o.tenant_id = p_tenant AND o.run_id = p_run AND o.branch_id = p_branch;
    GET DIAGNOSTICS v_discarded = ROW_COUNT;
    INSERT INTO relay_outbox
        (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, kind, rewound_to,
         parent_branch_id)
    VALUES (p_tenant, p_run, p_branch, v_row.head_lsn + 2, v_fork, v_row.base_lsn, '', 1, p_to,
            v_row.parent_branch_id);
    INSERT INTO relay_branch
        (tenant_id, run_id, branch_id, base_lsn, head_lsn, parent_branch_id, closed_at)
    VALUES (p_tenant, p_run, p_to, v_fork, v_fork, p_branch, v_row.closed_at);
    IF v_row.closed_at IS NOT NULL THEN
        -- The run stays closed: its end marker (discarded above) moves to the new branch.
        INSERT INTO relay_outbox
            (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, kind,
             parent_branch_id)
        VALUES (p_tenant, p_run, p_to, v_fork + 1, v_fork, v_fork, '', 2, p_branch);
        v_discarded := v_discarded - 1;
    END IF;
    -- The marker must drain now, not after the park's retry.
    DELETE FROM relay_parked_branch p
     WHERE p.tenant_id = p_tenant AND p.run_id = p_run AND p.branch_id = p_branch;
    PERFORM pg_notify('relay_outbox', p_tenant);
    RETURN QUERY SELECT v_fork, v_discarded;
END
$$;
COMMENT ON FUNCTION relay_discard_branch IS 'Discards the waiting events of a parked live branch for good: a rewind at its last shipped Lsn to p_to (consumers get the marker), unparked; returns the fork and how many intents were discarded. Operator only (no role is granted it).';

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_discard_branch(text, text, text, text) SET search_path = %I, pg_temp', current_schema());
END
$$;

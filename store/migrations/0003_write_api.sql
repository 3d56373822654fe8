-- The host's write API as SQL functions: one implementation of every rule (validation, the
-- branch lock, Lsn above head, abandoned branches, the payload limit, NOTIFY), callable from any
-- language inside the host's own transaction. `store::IntentWriter` calls these too.
--
-- Refusals raise these SQLSTATEs (class RL, the relay's own), each with a readable message and,
-- where a value explains it, a DETAIL of `name=value` pairs:
--   RL100 invalid id            RL104 unknown branch        RL108 fork outside the branch
--   RL101 payload too large     RL105 branch abandoned      RL109 no room for the marker
--   RL102 lsn out of range      RL106 run already open
--   RL103 lsn not above head    RL107 branch exists
-- A refusal aborts the host's transaction like any failed statement, so state written beside a
-- refused intent cannot commit without it (a host that wants to go on uses a savepoint).
--
-- SECURITY DEFINER with a fixed search_path (set below to the schema they are created in): a
-- host role needs only EXECUTE on them, no privilege on the tables (see `distribution roles`).

CREATE FUNCTION relay_require_id(p_kind text, p_value text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL OR p_value !~ '^[A-Za-z0-9._:-]{1,64}$' THEN
        RAISE EXCEPTION 'invalid % %: 1 to 64 bytes of ASCII letters, digits and - _ . :',
            p_kind, coalesce(quote_literal(left(p_value, 80)), 'NULL')
            USING ERRCODE = 'RL100';
    END IF;
END
$$;
COMMENT ON FUNCTION relay_require_id IS 'Raises RL100 unless p_value is a valid tenant, run or branch id.';

CREATE FUNCTION relay_open_run(p_tenant text, p_run text, p_branch text) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_opened integer := 0;
BEGIN
    PERFORM relay_require_id('tenant id', p_tenant);
    PERFORM relay_require_id('run id', p_run);
    PERFORM relay_require_id('branch id', p_branch);
    BEGIN
        INSERT INTO relay_branch (tenant_id, run_id, branch_id, base_lsn, head_lsn)
        SELECT p_tenant, p_run, p_branch, 0, 0
         WHERE NOT EXISTS (SELECT 1 FROM relay_branch b
                            WHERE b.tenant_id = p_tenant AND b.run_id = p_run);
        GET DIAGNOSTICS v_opened = ROW_COUNT;
    EXCEPTION WHEN unique_violation THEN
        -- A concurrent open of the same run committed first.
        v_opened := 0;
    END;
    IF v_opened = 0 THEN
        RAISE EXCEPTION 'run %/% is already open', p_tenant, p_run USING ERRCODE = 'RL106';
    END IF;
END
$$;
COMMENT ON FUNCTION relay_open_run IS 'Opens a run with its first (live) branch at Lsn 0. RL106 if the run has any branch.';

CREATE FUNCTION relay_append(
    p_tenant text, p_run text, p_branch text, p_lsn bigint, p_payload bytea,
    p_notify boolean DEFAULT true, p_max_payload_bytes bigint DEFAULT 262144)
RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_done integer;
    v_head bigint;
    v_abandoned bigint;
BEGIN
    -- The hot path checks everything in one expression; a refusal then says exactly why.
    IF (p_tenant ~ '^[A-Za-z0-9._:-]{1,64}$' AND p_run ~ '^[A-Za-z0-9._:-]{1,64}$'
        AND p_branch ~ '^[A-Za-z0-9._:-]{1,64}$') IS NOT TRUE THEN
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
    -- One statement: lock the live branch row (held until the host commits: a branch's intents
    -- commit in Lsn order, so a reader only ever sees a gap-free prefix of each branch), move
    -- its head, insert the intent.
    WITH old AS (
        SELECT o.head_lsn, o.base_lsn, o.parent_branch_id FROM relay_branch o
         WHERE o.tenant_id = p_tenant AND o.run_id = p_run AND o.branch_id = p_branch
           AND o.abandoned_at_lsn IS NULL
           FOR UPDATE
    ), moved AS (
        UPDATE relay_branch b SET head_lsn = p_lsn
          FROM old
         WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_branch
           AND old.head_lsn < p_lsn
        RETURNING old.head_lsn AS prev_lsn, old.base_lsn, old.parent_branch_id
    )
    INSERT INTO relay_outbox
        (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, parent_branch_id)
    SELECT p_tenant, p_run, p_branch, p_lsn, m.prev_lsn, m.base_lsn, p_payload, m.parent_branch_id
      FROM moved m;
    GET DIAGNOSTICS v_done = ROW_COUNT;
    IF v_done = 0 THEN
        SELECT b.head_lsn, b.abandoned_at_lsn INTO v_head, v_abandoned FROM relay_branch b
         WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_branch;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'branch %/%/% does not exist (open the run or rewind first)',
                p_tenant, p_run, p_branch USING ERRCODE = 'RL104';
        ELSIF v_abandoned IS NOT NULL THEN
            RAISE EXCEPTION 'branch %/%/% was abandoned by a rewind at lsn %',
                p_tenant, p_run, p_branch, v_abandoned
                USING ERRCODE = 'RL105', DETAIL = format('abandoned_at_lsn=%s', v_abandoned);
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
COMMENT ON FUNCTION relay_append IS 'Appends the export intent (tenant, run, branch, lsn) in the caller''s transaction; NOTIFYs relays on commit unless p_notify is false.';

CREATE FUNCTION relay_rewind(p_tenant text, p_run text, p_from text, p_at bigint, p_to text)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_row relay_branch%ROWTYPE;
    v_abandoned bigint;
BEGIN
    PERFORM relay_require_id('tenant id', p_tenant);
    PERFORM relay_require_id('run id', p_run);
    PERFORM relay_require_id('branch id', p_from);
    PERFORM relay_require_id('branch id', p_to);
    IF p_at IS NULL OR p_at < 0 THEN
        RAISE EXCEPTION 'lsn % is out of range (0 to 9223372036854775807)', coalesce(p_at::text, 'NULL')
            USING ERRCODE = 'RL102';
    END IF;
    SELECT * INTO v_row FROM relay_branch b
     WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_from
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'branch %/%/% does not exist (open the run or rewind first)',
            p_tenant, p_run, p_from USING ERRCODE = 'RL104';
    END IF;
    IF v_row.abandoned_at_lsn IS NOT NULL THEN
        RAISE EXCEPTION 'branch %/%/% was abandoned by a rewind at lsn %',
            p_tenant, p_run, p_from, v_row.abandoned_at_lsn
            USING ERRCODE = 'RL105', DETAIL = format('abandoned_at_lsn=%s', v_row.abandoned_at_lsn);
    END IF;
    IF p_at < v_row.base_lsn OR p_at > v_row.head_lsn THEN
        RAISE EXCEPTION 'cannot fork %/%/% at lsn %: the branch spans (%, %]',
            p_tenant, p_run, p_from, p_at, v_row.base_lsn, v_row.head_lsn
            USING ERRCODE = 'RL108',
                  DETAIL = format('base_lsn=%s head_lsn=%s', v_row.base_lsn, v_row.head_lsn);
    END IF;
    IF EXISTS (SELECT 1 FROM relay_branch b
                WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_to) THEN
        RAISE EXCEPTION 'branch %/%/% already exists', p_tenant, p_run, p_to USING ERRCODE = 'RL107';
    END IF;
    IF v_row.head_lsn = 9223372036854775807 THEN
        RAISE EXCEPTION 'cannot rewind %/%/%: its head is the largest Lsn, no room for the rewind marker',
            p_tenant, p_run, p_from USING ERRCODE = 'RL109';
    END IF;
    UPDATE relay_branch b SET abandoned_at_lsn = p_at
     WHERE b.tenant_id = p_tenant AND b.run_id = p_run AND b.branch_id = p_from;
    -- The unshipped tail above the fork is never exported.
    DELETE FROM relay_outbox o
     WHERE o.tenant_id = p_tenant AND o.run_id = p_run AND o.branch_id = p_from AND o.lsn > p_at;
    GET DIAGNOSTICS v_abandoned = ROW_COUNT;
    -- The marker: after every intent of the old branch (highest Lsn and seq), so it reaches the
    -- broker after each of them that still can, on the same shard and partition.
    INSERT INTO relay_outbox
        (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, kind, rewound_to,
         parent_branch_id)
    VALUES (p_tenant, p_run, p_from, v_row.head_lsn + 1, p_at, v_row.base_lsn, '', 1, p_to,
            v_row.parent_branch_id);
    INSERT INTO relay_branch (tenant_id, run_id, branch_id, base_lsn, head_lsn, parent_branch_id)
    VALUES (p_tenant, p_run, p_to, p_at, p_at, p_from);
    RETURN v_abandoned;
END
$$;
COMMENT ON FUNCTION relay_rewind IS 'Forks the live branch p_from at Lsn p_at into the new live branch p_to; returns how many unshipped intents above p_at were abandoned.';

-- Pin every function's search_path to the schema it was created in (`RELAY_SCHEMA`, or the
-- first schema on the migrating connection's search_path), so a caller's own search_path can
-- neither break nor redirect them.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_open_run(text, text, text) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_append(text, text, text, bigint, bytea, boolean, bigint) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_rewind(text, text, text, bigint, text) SET search_path = %I, pg_temp', current_schema());
END
$$;

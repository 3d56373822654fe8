-- Runs end, and storage follows: `relay_close_run` refuses later appends and rewinds and writes
-- an end marker on the wire; `relay_retire_runs` removes what the relay keeps for a run closed
-- longer than a retention, once every row of it has shipped. Every object is prefixed `relay_`.
-- New SQLSTATE: RL110 run closed (see 0003_write_api.sql for the others).

ALTER TABLE relay_branch ADD COLUMN closed_at timestamptz NULL;
COMMENT ON COLUMN relay_branch.closed_at IS 'Set on the live branch when the run was closed (relay_close_run): nothing more is appended or rewound; the run is retired after the retention.';
CREATE INDEX relay_branch_closed ON relay_branch (closed_at) WHERE closed_at IS NOT NULL;

-- Kind 2: the end marker of a closed run, after every intent of its live branch.
ALTER TABLE relay_outbox DROP CONSTRAINT relay_outbox_kind_check;
ALTER TABLE relay_outbox ADD CONSTRAINT relay_outbox_kind_check CHECK (kind IN (0, 1, 2));
COMMENT ON COLUMN relay_outbox.kind IS '0: an export intent; 1: a rewind marker (the branch is abandoned above prev_lsn, live history continues on rewound_to); 2: an end marker (the run was closed after prev_lsn).';

-- The append of 0003, refusing a closed run (RL110). Unchanged otherwise.
CREATE OR REPLACE FUNCTION relay_append(
    p_tenant text, p_run text, p_branch text, p_lsn bigint, p_payload bytea,
    p_notify boolean DEFAULT true, p_max_payload_bytes bigint DEFAULT 262144)
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
        (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, parent_branch_id)
    SELECT p_tenant, p_run, p_branch, p_lsn, m.prev_lsn, m.base_lsn, p_payload, m.parent_branch_id
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
COMMENT ON FUNCTION relay_append IS 'Appends the export intent (tenant, run, branch, lsn) in the caller''s transaction; NOTIFYs relays on commit unless p_notify is false.';

-- The rewind of 0003, refusing a closed run (RL110). Unchanged otherwise.
CREATE OR REPLACE FUNCTION relay_rewind(p_tenant text, p_run text, p_from text, p_at bigint, p_to text)
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
    IF v_row.closed_at IS NOT NULL THEN
        RAISE EXCEPTION 'run %/% was closed at lsn %', p_tenant, p_run, v_row.head_lsn
            USING ERRCODE = 'RL110', DETAIL = format('head_lsn=%s', v_row.head_lsn);
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

CREATE FUNCTION relay_close_run(p_tenant text, p_run text, p_notify boolean DEFAULT true)
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
        (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, kind, parent_branch_id)
    VALUES (p_tenant, p_run, v_row.branch_id, v_row.head_lsn + 1, v_row.head_lsn,
            v_row.base_lsn, '', 2, v_row.parent_branch_id);
    IF p_notify THEN
        PERFORM pg_notify('relay_outbox', p_tenant);
    END IF;
    RETURN QUERY SELECT v_row.branch_id, v_row.head_lsn + 1;
END
$$;
COMMENT ON FUNCTION relay_close_run IS 'Closes a run in the caller''s transaction: later appends and rewinds are refused (RL110) and an end marker follows the live branch''s last intent; returns the live branch and the end marker''s Lsn.';

-- Retirement, run by the relay (RELAY_RETENTION) or `distribution retire`: in one short
-- transaction, at most p_limit runs closed before now() - p_retention and none of whose rows
-- is still in the outbox (all shipped) lose their branches and parked-branch rows. Rows locked
-- by anyone else are skipped (SKIP LOCKED), so it never waits for a host, and a host waits for
-- it only on rows of runs that are closed (an append to them is refused anyway).
CREATE FUNCTION relay_retire_runs(p_retention interval, p_limit integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_runs integer;
BEGIN
    IF p_retention IS NULL OR p_retention < interval '0' OR p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'retention % and batch % : need a retention >= 0 and a batch >= 1',
            p_retention, p_limit USING ERRCODE = '22023';
    END IF;
    WITH due AS (
        SELECT b.tenant_id, b.run_id FROM relay_branch b
         WHERE b.closed_at < now() - p_retention
           AND NOT EXISTS (SELECT 1 FROM relay_outbox o
                            WHERE o.tenant_id = b.tenant_id AND o.run_id = b.run_id)
         ORDER BY b.closed_at
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    ), branches AS (
        DELETE FROM relay_branch x USING due
         WHERE x.tenant_id = due.tenant_id AND x.run_id = due.run_id
    ), parked AS (
        DELETE FROM relay_parked_branch p USING due
         WHERE p.tenant_id = due.tenant_id AND p.run_id = due.run_id
    )
    SELECT count(*) INTO v_runs FROM due;
    RETURN v_runs;
END
$$;
COMMENT ON FUNCTION relay_retire_runs IS 'Removes the branches (and parked-branch rows) of at most p_limit runs closed more than p_retention ago whose every row has shipped; returns how many runs.';

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_append(text, text, text, bigint, bytea, boolean, bigint) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_rewind(text, text, text, bigint, text) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_close_run(text, text, boolean) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_retire_runs(interval, integer) SET search_path = %I, pg_temp', current_schema());
END
$$;

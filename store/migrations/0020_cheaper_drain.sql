-- The relay's steady-state call costs PostgreSQL less (issue 47; benches/HISTORY.md): the
-- parked branches of the tenant are read once per call and skipped whole, like the caller's
-- cooling branches, instead of probed for every row drained; an ack probes the parked table
-- only when the tenant has a parked branch, once per branch rather than once per event.
-- Same signature, same results: a parked branch whose retry is not due is still never drained
-- (its rows are skipped from its first Lsn, as before), a confirmed event still unparks its
-- branch. The clock is read once per call rather than per row. A relay of an earlier version
-- runs unchanged against this body, and this relay against the earlier one (only slower), so
-- `--skip-migrate` needs no new object.
CREATE OR REPLACE FUNCTION relay_ack_and_drain(
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
DECLARE
    v_skip_runs text[] := p_fly_runs;
    v_skip_branches text[] := p_fly_branches;
    v_skip_lsns bigint[] := p_fly_lsns;
BEGIN
    IF p_owner IS NOT NULL THEN
        PERFORM 1 FROM relay_lease l
          WHERE l.bucket = p_bucket AND l.owner = p_owner AND l.epoch = p_epoch
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
        -- A confirmed event unparks its branch (one probe per branch, none without a park).
        IF EXISTS (SELECT 1 FROM relay_parked_branch p WHERE p.tenant_id = p_tenant) THEN
            DELETE FROM relay_parked_branch p
             USING (SELECT DISTINCT k.run_id, k.branch_id
                      FROM unnest(p_ack_runs, p_ack_branches) AS k(run_id, branch_id)) k
             WHERE p.tenant_id = p_tenant AND p.run_id = k.run_id AND p.branch_id = k.branch_id;
        END IF;
    END IF;
    IF p_limit > 0 THEN
        -- Parked branches whose retry is not due are skipped whole, like the caller's cooling
        -- ones: read once here rather than probed for every row.
        SELECT v_skip_runs || coalesce(array_agg(p.run_id), '{}'),
               v_skip_branches || coalesce(array_agg(p.branch_id), '{}'),
               v_skip_lsns || coalesce(array_agg(9223372036854775807::bigint), '{}')
          INTO v_skip_runs, v_skip_branches, v_skip_lsns
          FROM relay_parked_branch p
         WHERE p.tenant_id = p_tenant AND p.retry_at > clock_timestamp()
           AND p.parked_at <= clock_timestamp();
        -- At most p_limit rows holding at most p_max_bytes of payload in all; the first row
        -- always comes, however large.
        RETURN QUERY
        SELECT d.run_id, d.branch_id, d.lsn, d.prev_lsn, d.base_lsn, d.payload, d.created_at,
               d.kind, d.parent_branch_id, d.rewound_to, d.meta, d.epoch, d.prev_epoch
          FROM (SELECT o.*, sum(octet_length(o.payload)) OVER (ORDER BY o.seq) AS upto
                  FROM relay_outbox o
                 WHERE o.tenant_id = p_tenant
                   AND NOT EXISTS (
                       SELECT 1 FROM unnest(v_skip_runs, v_skip_branches, v_skip_lsns)
                                  AS f(run_id, branch_id, lsn)
                        WHERE f.run_id = o.run_id AND f.branch_id = o.branch_id AND o.lsn <= f.lsn)
                 ORDER BY o.seq
                 LIMIT p_limit) d
         WHERE d.upto <= p_max_bytes OR d.upto = octet_length(d.payload)
         ORDER BY d.seq;
    END IF;
END
$$;
COMMENT ON FUNCTION relay_ack_and_drain IS 'Retire confirmed intents of one tenant and drain its next ones (with their metadata and epochs), each step on a fresh snapshot, skipping the branches in flight, cooling or parked; fenced by the caller''s lease (its owner and epoch, never the clock) when p_owner is set.';

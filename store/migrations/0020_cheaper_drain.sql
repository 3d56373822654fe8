-- The relay's steady-state call costs PostgreSQL less (issue 47; benches/HISTORY.md): it
-- looks at parked branches only when the tenant has one. Before, the drain probed
-- `relay_parked_branch` for every row it read and the ack for every event it retired (two
-- thousand index probes per batch of 1,000, on a table that is almost always empty). With a
-- parked branch the drain probes per row as 0017's did (its cost grows with the rows read, not
-- with how many branches are parked), and the ack probes once per branch acked. The drain
-- stays one query: PostgreSQL evaluates `NOT v_parked OR NOT EXISTS (...)` left to right and
-- never runs the probe while v_parked is false (EXPLAIN ANALYZE under a generic plan: the
-- subplan "never executed"; with a park, one loop per row).
-- Same signature, same results. Whether the tenant has a parked branch is read in its own
-- statement, so a park or release that commits between it and the drain counts from the next
-- call (the relay parks a branch and only then drains again; an operator's release wakes the
-- relays anyway). A relay of an earlier version runs unchanged against this body, and this
-- relay against the earlier one (only slower), so `--skip-migrate` needs no new object.
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
    v_parked boolean;
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
    -- Almost always false: then neither the ack nor the drain looks at parked branches.
    v_parked := EXISTS (SELECT 1 FROM relay_parked_branch p WHERE p.tenant_id = p_tenant);
    IF cardinality(p_ack_lsns) > 0 THEN
        DELETE FROM relay_outbox o
         USING unnest(p_ack_runs, p_ack_branches, p_ack_lsns) AS k(run_id, branch_id, lsn)
         WHERE o.tenant_id = p_tenant AND o.run_id = k.run_id
           AND o.branch_id = k.branch_id AND o.lsn = k.lsn;
        -- A confirmed event unparks its branch (one probe per branch).
        IF v_parked THEN
            DELETE FROM relay_parked_branch p
             USING (SELECT DISTINCT k.run_id, k.branch_id
                      FROM unnest(p_ack_runs, p_ack_branches) AS k(run_id, branch_id)) k
             WHERE p.tenant_id = p_tenant AND p.run_id = k.run_id AND p.branch_id = k.branch_id;
        END IF;
    END IF;
    -- At most p_limit rows holding at most p_max_bytes of payload in all; the first row always
    -- comes, however large. Without a parked branch the OR stops at `NOT v_parked` and no row
    -- probes the table; with one, each row is probed as in 0017.
    IF p_limit > 0 THEN
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
                   AND (NOT v_parked OR NOT EXISTS (
                       SELECT 1 FROM relay_parked_branch p
                        WHERE p.tenant_id = o.tenant_id AND p.run_id = o.run_id
                          AND p.branch_id = o.branch_id AND p.retry_at > clock_timestamp()
                          AND p.parked_at <= clock_timestamp()))
                 ORDER BY o.seq
                 LIMIT p_limit) d
         WHERE d.upto <= p_max_bytes OR d.upto = octet_length(d.payload)
         ORDER BY d.seq;
    END IF;
END
$$;
COMMENT ON FUNCTION relay_ack_and_drain IS 'Retire confirmed intents of one tenant and drain its next ones (with their metadata and epochs), each step on a fresh snapshot, skipping the branches in flight, cooling or parked; fenced by the caller''s lease (its owner and epoch, never the clock) when p_owner is set.';

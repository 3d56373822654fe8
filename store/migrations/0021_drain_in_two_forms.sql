-- The steady-state drain as two queries again, one without the parked branches' filter and one
-- with it, chosen by whether the tenant has a parked branch (as 0020 first had it). 0020's
-- final form wrote them as one query (`NOT v_parked OR NOT EXISTS (...)`): the same results,
-- and as cheap alone (10,000 tenants of 2 intents drained in a loop, or 8 clients calling it
-- under pgbench: within 5-10 %), but the relay drained bench section 11 (10,000 tenants x 2
-- intents, a host appending beside) at 2,153-2,423 events/s with it against 3,144-3,513
-- with this form, interleaved on one machine (benches/HISTORY.md, "Section 11"). Same
-- signature, same results; a relay of an earlier version runs unchanged against this body.
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
    -- comes, however large. The two forms differ only in the parked branches' filter, the
    -- second being 0017's drain unchanged.
    IF p_limit > 0 AND NOT v_parked THEN
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
                 ORDER BY o.seq
                 LIMIT p_limit) d
         WHERE d.upto <= p_max_bytes OR d.upto = octet_length(d.payload)
         ORDER BY d.seq;
    ELSIF p_limit > 0 THEN
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
                          AND p.branch_id = o.branch_id AND p.retry_at > clock_timestamp()
                          AND p.parked_at <= clock_timestamp())
                 ORDER BY o.seq
                 LIMIT p_limit) d
         WHERE d.upto <= p_max_bytes OR d.upto = octet_length(d.payload)
         ORDER BY d.seq;
    END IF;
END
$$;
COMMENT ON FUNCTION relay_ack_and_drain IS 'Retire confirmed intents of one tenant and drain its next ones (with their metadata and epochs), each step on a fresh snapshot, skipping the branches in flight, cooling or parked; fenced by the caller''s lease (its owner and epoch, never the clock) when p_owner is set.';

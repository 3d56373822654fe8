-- What an operator reads and does, without reading a payload: four status views and the
-- release function, for the operator's role of `distribution roles --operator` (which also
-- gets `relay_discard_branch`). The views read the relay's tables with their owner's rights,
-- so the operator is granted the views alone, never `relay_outbox` itself.

CREATE VIEW relay_backlog_status AS
SELECT tenant_id,
       count(*) AS pending,
       extract(epoch FROM clock_timestamp() - min(created_at))::float8 AS oldest_age_secs
  FROM relay_outbox
 GROUP BY tenant_id;
COMMENT ON VIEW relay_backlog_status IS 'Per tenant with intents waiting: how many, and the age in seconds of the oldest (what `distribution status` and the console show).';

-- The oldest waiting intent's age, of any tenant: a skip scan over the drain index and one probe
-- per tenant with intents waiting (what the relay's lag gauges read), never a pass over every row,
-- so a console can sample it every few seconds whatever the backlog. NULL when nothing waits.
CREATE VIEW relay_oldest_wait AS
WITH RECURSIVE t(tenant_id) AS (
    (SELECT tenant_id FROM relay_outbox ORDER BY tenant_id LIMIT 1)
    UNION ALL
    SELECT (SELECT o.tenant_id FROM relay_outbox o
             WHERE o.tenant_id > t.tenant_id ORDER BY o.tenant_id LIMIT 1)
      FROM t WHERE t.tenant_id IS NOT NULL
)
SELECT max(extract(epoch FROM clock_timestamp() -
           (SELECT o.created_at FROM relay_outbox o
             WHERE o.tenant_id = t.tenant_id ORDER BY o.seq LIMIT 1)))::float8 AS oldest_age_secs
  FROM t WHERE t.tenant_id IS NOT NULL;
COMMENT ON VIEW relay_oldest_wait IS 'The age in seconds of the oldest intent waiting, of any tenant (NULL: none); cheap whatever the backlog.';

CREATE VIEW relay_parked_status AS
SELECT p.tenant_id, p.run_id, p.branch_id, p.reason, p.attempts,
       extract(epoch FROM now() - p.first_failed_at)::float8 AS failing_for_secs,
       greatest(extract(epoch FROM p.retry_at - now())::float8, 0) AS retry_in_secs,
       (SELECT count(*) FROM relay_outbox o
         WHERE o.tenant_id = p.tenant_id AND o.run_id = p.run_id
           AND o.branch_id = p.branch_id) AS pending
  FROM relay_parked_branch p;
COMMENT ON VIEW relay_parked_status IS 'Parked branches: the broker''s last refusal, attempts, seconds failing, seconds to the next try, intents waiting.';

CREATE VIEW relay_relays_status AS
SELECT m.relay_id,
       extract(epoch FROM now() - m.joined_at)::float8 AS member_for_secs,
       (SELECT count(*) FROM relay_lease l
         WHERE l.owner = m.relay_id AND l.expires_at > now()) AS buckets
  FROM relay_member m
 WHERE m.expires_at > now();
COMMENT ON VIEW relay_relays_status IS 'Relays alive (their heartbeat not expired), how long they have been members, and how many of the lease buckets each holds.';

CREATE FUNCTION relay_release(p_tenant text, p_run text DEFAULT NULL, p_branch text DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_released bigint;
BEGIN
    DELETE FROM relay_parked_branch p
     WHERE p.tenant_id = p_tenant
       AND (p_run IS NULL OR p.run_id = p_run)
       AND (p_branch IS NULL OR p.branch_id = p_branch);
    GET DIAGNOSTICS v_released = ROW_COUNT;
    IF v_released > 0 THEN
        -- The relays drain the tenant now, not on their next poll.
        PERFORM pg_notify('relay_outbox', p_tenant);
    END IF;
    RETURN v_released;
END
$$;
COMMENT ON FUNCTION relay_release IS 'Releases the parked branches of a tenant (all, one run''s, or one branch): they are drained again at once. Returns how many were released. Operator only.';

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_release(text, text, text) SET search_path = %I, pg_temp', current_schema());
END
$$;

-- Like every function that changes the relay's state, nobody may call it but its owner until
-- `distribution roles --operator` grants it (PostgreSQL would grant EXECUTE to PUBLIC).
REVOKE EXECUTE ON FUNCTION relay_release(text, text, text) FROM PUBLIC;

-- The console's tenant page: per branch with intents waiting, how many, the Lsns of the first
-- and last waiting, and the age of the oldest, for the operator's role (a view, read with its
-- owner's rights, so the operator is still never granted `relay_outbox`; no payload). Filtered
-- by tenant, it reads that tenant's rows through the primary key.

CREATE VIEW relay_branch_status AS
SELECT tenant_id, run_id, branch_id,
       count(*) AS pending,
       min(lsn) AS first_lsn,
       max(lsn) AS last_lsn,
       extract(epoch FROM clock_timestamp() - min(created_at))::float8 AS oldest_age_secs
  FROM relay_outbox
 GROUP BY tenant_id, run_id, branch_id;
COMMENT ON VIEW relay_branch_status IS 'Per branch with intents waiting: how many, the first and last waiting Lsn, and the age in seconds of the oldest (the console''s tenant page).';

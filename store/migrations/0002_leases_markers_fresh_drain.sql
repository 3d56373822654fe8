-- Relay ownership without advisory locks, rewind markers on the wire, and a drain that never
-- returns rows a concurrent transaction deleted. Every object is prefixed `relay_`.

-- Ownership: tenants hash into a fixed set of lease buckets (see store/src/lease.rs). Nothing
-- here lives in PostgreSQL's shared lock table, so no number of tenants can exhaust it.
CREATE TABLE relay_lease (
    bucket     integer     PRIMARY KEY CHECK (bucket >= 0),
    owner      text        NULL,
    epoch      bigint      NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT '-infinity'
);
COMMENT ON TABLE relay_lease IS 'One row per lease bucket; the relay named in owner drains the tenants hashed to it until expires_at.';
COMMENT ON COLUMN relay_lease.bucket IS 'Bucket number: FNV-1a 64 of the tenant id, modulo the number of rows (fixed at 128).';
COMMENT ON COLUMN relay_lease.owner IS 'Relay id holding the bucket; NULL when released.';
COMMENT ON COLUMN relay_lease.epoch IS 'Incremented on every change of owner: the fence that a relay presents with each ack and drain.';
COMMENT ON COLUMN relay_lease.expires_at IS 'The owner must renew before this time; after it any relay may claim the bucket.';
INSERT INTO relay_lease (bucket) SELECT generate_series(0, 127);

CREATE TABLE relay_member (
    relay_id   text        PRIMARY KEY,
    expires_at timestamptz NOT NULL,
    joined_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE relay_member IS 'Live relays (heartbeat); each claims about buckets / members of the buckets.';
COMMENT ON COLUMN relay_member.relay_id IS 'Relay id (host, process and start time).';
COMMENT ON COLUMN relay_member.expires_at IS 'The relay counts as a member until this time unless it renews.';
COMMENT ON COLUMN relay_member.joined_at IS 'When the relay first registered.';

-- Rewind markers and branch ancestry on the wire (contract version 2).
ALTER TABLE relay_outbox
    ADD COLUMN kind smallint NOT NULL DEFAULT 0 CHECK (kind IN (0, 1)),
    ADD COLUMN parent_branch_id text NULL,
    ADD COLUMN rewound_to text NULL;
COMMENT ON COLUMN relay_outbox.kind IS '0: an export intent; 1: a rewind marker (the branch is abandoned above prev_lsn, live history continues on rewound_to).';
COMMENT ON COLUMN relay_outbox.parent_branch_id IS 'For an intent of a branch forked by a rewind: the branch it was forked from (its fork point is base_lsn).';
COMMENT ON COLUMN relay_outbox.rewound_to IS 'For a rewind marker: the new live branch.';

ALTER TABLE relay_fold_cursor
    ADD COLUMN abandoned_at_lsn bigint NULL,
    ADD COLUMN rewound_to text NULL,
    ADD COLUMN started boolean NOT NULL DEFAULT true;
COMMENT ON COLUMN relay_fold_cursor.abandoned_at_lsn IS 'Set when the branch''s rewind marker was folded: nothing above this Lsn is ever applied.';
COMMENT ON COLUMN relay_fold_cursor.rewound_to IS 'The branch that live history continues on, from the rewind marker.';
COMMENT ON COLUMN relay_fold_cursor.started IS 'False while a forked branch waits for its parent to be folded up to the fork point and rewound; nothing of it is applied until then.';

ALTER TABLE relay_fold_parked
    ADD COLUMN base_lsn bigint NOT NULL DEFAULT 0,
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN parent_branch_id text NULL;
COMMENT ON COLUMN relay_fold_parked.base_lsn IS 'base_lsn of the event''s branch, as delivered.';
COMMENT ON COLUMN relay_fold_parked.created_at IS 'When the host wrote the event, as delivered.';
COMMENT ON COLUMN relay_fold_parked.parent_branch_id IS 'The branch the event''s branch was forked from, as delivered.';

-- Rewinds made before this version have no marker: write one for each abandoned branch, so
-- consumers learn about them too (a marker is idempotent at the fold).
INSERT INTO relay_outbox
    (tenant_id, run_id, branch_id, lsn, prev_lsn, base_lsn, payload, kind, rewound_to,
     parent_branch_id)
SELECT parent.tenant_id, parent.run_id, parent.branch_id, parent.head_lsn + 1,
       parent.abandoned_at_lsn, parent.base_lsn, '', 1, child.branch_id, parent.parent_branch_id
  FROM relay_branch parent
  JOIN relay_branch child
    ON child.tenant_id = parent.tenant_id AND child.run_id = parent.run_id
   AND child.parent_branch_id = parent.branch_id
 WHERE parent.abandoned_at_lsn IS NOT NULL AND parent.head_lsn < 9223372036854775807;

-- Branches whose events the broker keeps refusing (returned, nacked): parked alone, so the rest
-- of their tenant flows; their later events wait behind them, in order.
CREATE TABLE relay_parked_branch (
    tenant_id       text        NOT NULL,
    run_id          text        NOT NULL,
    branch_id       text        NOT NULL,
    reason          text        NOT NULL,
    attempts        integer     NOT NULL,
    first_failed_at timestamptz NOT NULL,
    parked_at       timestamptz NOT NULL DEFAULT now(),
    retry_at        timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, run_id, branch_id)
);
COMMENT ON TABLE relay_parked_branch IS 'Branches the relay stopped sending after repeated broker refusals; drained again from retry_at, removed when one of their events is confirmed or an operator releases them.';
COMMENT ON COLUMN relay_parked_branch.reason IS 'What the broker said last (returned NO_ROUTE, nacked, ...).';
COMMENT ON COLUMN relay_parked_branch.attempts IS 'Failed attempts so far.';
COMMENT ON COLUMN relay_parked_branch.first_failed_at IS 'When the first failure of this streak happened.';
COMMENT ON COLUMN relay_parked_branch.parked_at IS 'When it was (last) parked.';
COMMENT ON COLUMN relay_parked_branch.retry_at IS 'The drain skips the branch until then.';

-- The relay's steady-state step: retire confirmed intents and drain the next ones of a tenant.
-- Each statement of a PL/pgSQL function takes its own snapshot (READ COMMITTED), so the drain
-- never returns a row that a transaction deleted and committed while the ack waited on its lock
-- (another relay's ack, a rewind). With an owner, the caller's lease must still be current:
-- FOR KEY SHARE makes a concurrent takeover (SELECT ... FOR UPDATE) wait for this call, and a
-- takeover that committed first fails the check (the row is re-checked after the lock wait).
CREATE FUNCTION relay_ack_and_drain(
    p_bucket integer, p_owner text, p_epoch bigint,
    p_tenant text,
    p_ack_runs text[], p_ack_branches text[], p_ack_lsns bigint[],
    p_limit bigint, p_max_bytes bigint,
    p_fly_runs text[], p_fly_branches text[], p_fly_lsns bigint[])
RETURNS TABLE (run_id text, branch_id text, lsn bigint, prev_lsn bigint, base_lsn bigint,
               payload bytea, created_at timestamptz, kind smallint, parent_branch_id text,
               rewound_to text)
LANGUAGE plpgsql VOLATILE
AS $$
#variable_conflict use_column
BEGIN
    IF p_owner IS NOT NULL THEN
        PERFORM 1 FROM relay_lease l
          WHERE l.bucket = p_bucket AND l.owner = p_owner AND l.epoch = p_epoch
            AND l.expires_at > clock_timestamp()
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
        -- A confirmed event unparks its branch.
        DELETE FROM relay_parked_branch p
         USING unnest(p_ack_runs, p_ack_branches) AS k(run_id, branch_id)
         WHERE p.tenant_id = p_tenant AND p.run_id = k.run_id AND p.branch_id = k.branch_id;
    END IF;
    IF p_limit > 0 THEN
        -- At most p_limit rows holding at most p_max_bytes of payload in all; the first row
        -- always comes, however large.
        RETURN QUERY
        SELECT d.run_id, d.branch_id, d.lsn, d.prev_lsn, d.base_lsn, d.payload, d.created_at,
               d.kind, d.parent_branch_id, d.rewound_to
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
                          AND p.branch_id = o.branch_id AND p.retry_at > clock_timestamp())
                 ORDER BY o.seq
                 LIMIT p_limit) d
         WHERE d.upto <= p_max_bytes OR d.upto = octet_length(d.payload)
         ORDER BY d.seq;
    END IF;
END
$$;
COMMENT ON FUNCTION relay_ack_and_drain IS 'Retire confirmed intents of one tenant and drain its next ones, each step on a fresh snapshot; fenced by the caller''s lease when p_owner is set.';

-- Leases and parked branches that a step of PostgreSQL's clock cannot break
-- (docs/operations.md, "Clocks").
--
-- A lease no longer expires by PostgreSQL's clock. Every change of a lease row draws it a new
-- beat (a random number, so a history a failover or crash took back never brings an old beat
-- round again) and records the TTL its writer gave it (ttl_ms, from expires_at). Another relay
-- may claim a bucket only after it saw the row's (owner, epoch, beat) unchanged for the longer
-- of its own TTL and the row's on its own monotonic clock, and only if epoch and beat are still
-- the same when it claims (the relay's `Sightings`). The holder's fence closes 0.9 of its TTL
-- after it sent the renewal that wrote that beat, which committed before the row was read: the
-- fence is closed before any claim, whatever the database's wall clock did. So a fenced ack
-- checks the owner and the epoch alone, and a renewal renews whatever the caller still owns at
-- its epoch. expires_at stays, written on PostgreSQL's clock, for the status views and for
-- relays of earlier versions, whose writes draw beats too (the trigger), so they can run beside
-- newer ones during a rolling upgrade (they alone still claim by expires_at, and a step of the
-- clock reaches what they decide).
-- Membership likewise: every heartbeat draws the member row a new beat, and a relay counts
-- another live while its beat moved within a TTL of its own clock.
--
-- A parked branch whose parked_at lies in the future (PostgreSQL's clock stepped back past it)
-- is drained again rather than held for the step: a step back holds a parked branch at most
-- twice its delay.

ALTER TABLE relay_lease ADD COLUMN beat bigint NOT NULL DEFAULT 0;
ALTER TABLE relay_lease ADD COLUMN ttl_ms bigint NOT NULL DEFAULT 0;
COMMENT ON COLUMN relay_lease.beat IS 'Drawn anew by every change of the row: a claim presents the (epoch, beat) it saw unchanged for a TTL on its own clock.';
COMMENT ON COLUMN relay_lease.ttl_ms IS 'The TTL its last writer gave the lease: a claimant waits at least this long too.';
COMMENT ON COLUMN relay_lease.expires_at IS 'When the lease lapses on PostgreSQL''s clock, for the status views (and relays before this migration); claims go by the beat, never by this.';
COMMENT ON TABLE relay_lease IS 'One row per lease bucket; the relay named in owner drains the tenants hashed to it while its renewals keep drawing the row new beats.';
ALTER TABLE relay_member ADD COLUMN beat bigint NOT NULL DEFAULT 0;
COMMENT ON COLUMN relay_member.beat IS 'Drawn anew by every heartbeat: a relay counts another live while its beat moved within a TTL of its own clock.';

CREATE FUNCTION relay_lease_beat() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    NEW.beat := (random() * 9007199254740991)::bigint;
    IF NEW.expires_at IS DISTINCT FROM OLD.expires_at AND isfinite(NEW.expires_at)
       AND NEW.expires_at > now() THEN
        NEW.ttl_ms := ceil(extract(epoch FROM NEW.expires_at - now()) * 1000)::bigint;
    END IF;
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION relay_lease_beat IS 'Draws a lease row a new beat at every change, and records its TTL from expires_at (now() is the writer''s transaction start, as in its expires_at).';
CREATE TRIGGER relay_lease_beat BEFORE UPDATE ON relay_lease
    FOR EACH ROW EXECUTE FUNCTION relay_lease_beat();

CREATE FUNCTION relay_member_beat() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    NEW.beat := (random() * 9007199254740991)::bigint;
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION relay_member_beat IS 'Draws a member row a new beat at every heartbeat.';
CREATE TRIGGER relay_member_beat BEFORE UPDATE ON relay_member
    FOR EACH ROW EXECUTE FUNCTION relay_member_beat();

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
COMMENT ON FUNCTION relay_ack_and_drain IS 'Retire confirmed intents of one tenant and drain its next ones (with their metadata and epochs), each step on a fresh snapshot; fenced by the caller''s lease (its owner and epoch, never the clock) when p_owner is set.';

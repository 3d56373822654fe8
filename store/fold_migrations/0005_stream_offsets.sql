-- Stream offsets (RabbitMQ streams, `RELAY_QUEUE_TYPE=stream`): a consumer of a stream stores,
-- per queue, the offset of the next message it will read, in the same transaction as its fold
-- of the message before it; a restarted consumer resumes exactly there. `relay_fold_reset`
-- forgets everything the fold knows (cursors, held-back events, retired horizons, the
-- demonstration projection's events, the offsets), for a projection rebuilt from the start: call
-- it in the transaction that also empties the projection's own tables. Tracked as fold version 5
-- (and outbox version 10: the same file).

CREATE TABLE IF NOT EXISTS relay_fold_offset (
    queue       text        PRIMARY KEY,
    next_offset bigint      NOT NULL CHECK (next_offset >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE relay_fold_offset IS 'Per stream queue, the offset of the next message the fold reads (its x-stream-offset + 1), written in the fold''s transaction.';

CREATE OR REPLACE FUNCTION relay_fold_offset(p_queue text) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER
AS $$
    SELECT o.next_offset FROM relay_fold_offset o WHERE o.queue = p_queue
$$;
COMMENT ON FUNCTION relay_fold_offset(text) IS 'The offset a consumer of stream p_queue resumes at (NULL: none stored yet; start where the consumer is configured to).';

CREATE OR REPLACE FUNCTION relay_fold_save_offset(p_queue text, p_next_offset bigint) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    IF p_next_offset IS NULL OR p_next_offset < 0 THEN
        RAISE EXCEPTION 'relay_fold_save_offset: offset must be a non-negative number, got %', p_next_offset
            USING ERRCODE = '22023';
    END IF;
    -- Never backwards: a late transaction of an overlapping consumer cannot undo progress.
    INSERT INTO relay_fold_offset AS o (queue, next_offset)
    VALUES (p_queue, p_next_offset)
    ON CONFLICT (queue) DO UPDATE
       SET next_offset = greatest(o.next_offset, excluded.next_offset),
           updated_at = now();
END
$$;
COMMENT ON FUNCTION relay_fold_save_offset(text, bigint) IS 'Stores the offset after the message just folded (its x-stream-offset + 1); call it in the fold''s transaction. Never moves an offset back.';

CREATE OR REPLACE FUNCTION relay_fold_reset() RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_branches bigint;
BEGIN
    SELECT count(*) INTO v_branches FROM relay_fold_cursor;
    DELETE FROM relay_fold_cursor;
    DELETE FROM relay_fold_parked;
    DELETE FROM relay_fold_horizon;
    DELETE FROM relay_fold_event;
    DELETE FROM relay_fold_offset;
    RETURN v_branches;
END
$$;
COMMENT ON FUNCTION relay_fold_reset() IS 'Forgets the fold''s state and stream offsets (returns how many branches it knew), for a projection rebuilt from the first retained offset; run it in the transaction that empties the projection''s tables.';

-- Roles granted on an earlier version (`distribution roles`: relay_fold revoked from PUBLIC)
-- get the same for the new functions: only who may fold may read, store and reset offsets.
DO $$
DECLARE
    v_acl aclitem[];
    v_grantee oid;
    v_function text;
BEGIN
    SELECT proacl INTO v_acl FROM pg_proc
     WHERE oid = to_regprocedure('relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb)');
    IF v_acl IS NULL THEN
        RETURN; -- never granted nor revoked: the default (EXECUTE to PUBLIC) holds for all
    END IF;
    FOREACH v_function IN ARRAY ARRAY['relay_fold_offset(text)', 'relay_fold_save_offset(text, bigint)', 'relay_fold_reset()'] LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', v_function);
        FOR v_grantee IN SELECT a.grantee FROM aclexplode(v_acl) a WHERE a.privilege_type = 'EXECUTE' LOOP
            IF v_grantee = 0 THEN
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', v_function);
            ELSE
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', v_function, pg_get_userbyid(v_grantee));
            END IF;
        END LOOP;
    END LOOP;
END
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_fold_offset(text) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_fold_save_offset(text, bigint) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_fold_reset() SET search_path = %I, pg_temp', current_schema());
END
$$;

-- Publishing only what a failover keeps (RELAY_PUBLISH_REPLICATED): after each drain that read
-- rows, the relay calls relay_wait_replicated, which waits until the WAL up to now (past every
-- commit the drain saw) is flushed where the mode says: 'local' (this server's disk: a host
-- committing with synchronous_commit = off can lose what the relay read, in a crash), 'sync'
-- (every synchronous standby: the candidates of a failover; what the database's own
-- synchronous replication promises, and no less: on a server whose synchronous_standby_names
-- names none, its disk, as 'local') or 'all' (every streaming standby).
-- It reads pg_stat_replication itself: a commit whose own wait for a synchronous standby was
-- cancelled (pg_cancel_backend, pg_terminate_backend, or any session's
-- SET synchronous_commit = local) is visible here but not on the standby, and is not taken for
-- replicated. No SQL function gives a row's own commit LSN; pg_current_wal_insert_lsn() after
-- the read is above every commit it saw. New SQLSTATE: RL120, the standbys' positions cannot be
-- read (the function's owner needs pg_read_all_stats, or to be a superuser).

CREATE FUNCTION relay_wait_replicated(p_mode text, p_timeout_ms integer)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_target pg_lsn;
    v_offset numeric;
    v_deadline timestamptz := clock_timestamp() + p_timeout_ms * interval '1 millisecond';
    v_done boolean;
    v_hidden boolean;
BEGIN
    IF p_mode IS NULL OR p_mode NOT IN ('local', 'sync', 'all') THEN
        RAISE EXCEPTION 'unknown replication mode %: local, sync or all',
            coalesce(quote_literal(p_mode), 'NULL') USING ERRCODE = 'RL120';
    END IF;
    v_target := pg_current_wal_insert_lsn();
    -- At a page's start the insert position lies past the page header, where nothing will be
    -- flushed until the next record: wait for the header's start instead.
    v_offset := (v_target - '0/0'::pg_lsn) % current_setting('wal_block_size')::numeric;
    IF v_offset IN (24, 40) THEN
        v_target := v_target - v_offset;
    END IF;
    LOOP
        IF p_mode = 'local' OR (p_mode = 'sync' AND current_setting('synchronous_standby_names') = '') THEN
            v_done := pg_current_wal_flush_lsn() >= v_target;
        ELSE
            SELECT bool_and(r.flush_lsn >= v_target), bool_or(r.flush_lsn IS NULL)
              INTO v_done, v_hidden
              FROM pg_stat_replication r
             WHERE r.state = 'streaming'
               AND (p_mode = 'all' OR r.sync_state IN ('sync', 'quorum'));
            IF v_hidden THEN
                RAISE EXCEPTION 'cannot read the standbys'' flush positions: grant pg_read_all_stats to the owner of relay_wait_replicated (%), or run the migration as a superuser',
                    current_user USING ERRCODE = 'RL120';
            END IF;
        END IF;
        IF v_done THEN
            RETURN true;
        END IF;
        IF clock_timestamp() >= v_deadline THEN
            RETURN false;
        END IF;
        PERFORM pg_sleep(0.001);
    END LOOP;
END
$$;
COMMENT ON FUNCTION relay_wait_replicated IS 'Waits (at most p_timeout_ms) until the WAL up to now is flushed locally (local), on every synchronous standby (sync) or on every streaming standby (all); false on timeout. RL120 if the standbys cannot be read.';


DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_wait_replicated(text, integer) SET search_path = %I, pg_temp', current_schema());
END
$$;

-- Epochs at the fold (wire version 4, WIRE.md "Epochs"): `relay_fold` takes a delivery's
-- `epoch` and `prev_epoch` (new last arguments, default NULL: a message without them folds as
-- before) and keeps per branch the epochs of what it applied. A message written again after a
-- failover, or one that shows the fold applied history the database lost, diverges: it is
-- refused with the new SQLSTATE RL203 (dead-letter it), never applied or dropped. A copy of
-- history the database replaced is 'superseded' (a new verdict: apply nothing). An operator
-- adopts the database's history with `relay_fold_adopt` and a replay of the branch's dead
-- letters: the fold then undoes what the failover lost ('adopt', then 'undo' rows). Calls with
-- twelve arguments, and readers that name their columns, work unchanged.

ALTER TABLE relay_fold_cursor
    ADD COLUMN IF NOT EXISTS epochs bigint[] NULL,
    ADD COLUMN IF NOT EXISTS epoch_from bigint[] NULL,
    ADD COLUMN IF NOT EXISTS marker_epoch bigint NULL,
    ADD COLUMN IF NOT EXISTS adopt boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS base_lsn bigint NULL;
COMMENT ON COLUMN relay_fold_cursor.epochs IS 'The epochs of what was applied, ascending: epochs[i] from Lsn epoch_from[i] on (NULL: none known).';
COMMENT ON COLUMN relay_fold_cursor.epoch_from IS 'Where each of epochs begins (ascending).';
COMMENT ON COLUMN relay_fold_cursor.marker_epoch IS 'The epoch of the rewind marker folded on this branch.';
COMMENT ON COLUMN relay_fold_cursor.base_lsn IS 'Where the branch starts, as its first message said (NULL: created before epochs).';
COMMENT ON COLUMN relay_fold_cursor.adopt IS 'Armed by relay_fold_adopt: the next diverged message that begins its epoch here is adopted.';
ALTER TABLE relay_fold_parked
    ADD COLUMN IF NOT EXISTS epoch bigint NULL,
    ADD COLUMN IF NOT EXISTS prev_epoch bigint NULL;

-- The epoch of what was applied at `p_lsn`: that of the last pair beginning at or below it;
-- below every pair, the first pair's (what was applied there carried no epoch, or nothing was:
-- a message with an epoch there was written again). NULL without pairs.
CREATE OR REPLACE FUNCTION relay_fold_epoch_at(p_epochs bigint[], p_from bigint[], p_lsn bigint)
RETURNS bigint
LANGUAGE sql IMMUTABLE
AS $$
    SELECT coalesce((SELECT h.e FROM unnest(p_epochs, p_from) AS h(e, f)
                      WHERE h.f <= p_lsn ORDER BY h.f DESC LIMIT 1),
                    p_epochs[1])
$$;

-- PostgreSQL drops a function's grants with it: keep what `distribution roles` granted.
CREATE OR REPLACE FUNCTION pg_temp.relay_regrant(p_old aclitem[], p_function text) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_grantee oid;
BEGIN
    IF p_old IS NULL THEN
        RETURN; -- never granted nor revoked: the default (EXECUTE to PUBLIC) holds for both
    END IF;
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', p_function);
    FOR v_grantee IN SELECT a.grantee FROM aclexplode(p_old) a WHERE a.privilege_type = 'EXECUTE' LOOP
        IF v_grantee = 0 THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', p_function);
        ELSE
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', p_function, pg_get_userbyid(v_grantee));
        END IF;
    END LOOP;
END
$$;

CREATE TEMP TABLE relay_old_fold_acl_v6 ON COMMIT DROP AS
SELECT proacl FROM pg_proc
 WHERE oid = to_regprocedure('relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb)');

DROP FUNCTION relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb);

-- What it returns, in order:
--   row 1, the verdict on this delivery: 'apply', 'undo', 'hold', 'duplicate', 'abandoned',
--     'end' (as before), 'superseded' (a copy of history the database replaced: apply
--     nothing), or 'adopt' (an armed branch adopts the database's history: apply the rows that
--     follow in order; first 'undo' rows whose rewound_to is this delivery's branch (undo what
--     you applied of branch_id above lsn: history a failover lost), then this delivery's own
--     verdict row, then what it released);
--   then any number of 'apply' rows (and at most one 'end' row, last): what it released.
-- A delivery that diverges (WIRE.md "Epochs") raises RL203 (DETAIL lsn, epoch, known_epoch):
-- dead-letter it. RL200, RL201, RL202 and RL100 as before.
CREATE FUNCTION relay_fold(
    p_tenant text, p_run text, p_branch text, p_kind text, p_lsn bigint, p_prev_lsn bigint,
    p_base_lsn bigint, p_parent_branch text, p_rewound_to text, p_created_at timestamptz,
    p_payload bytea, p_meta jsonb DEFAULT NULL, p_epoch bigint DEFAULT NULL,
    p_prev_epoch bigint DEFAULT NULL)
RETURNS TABLE (action text, branch_id text, lsn bigint, prev_lsn bigint, base_lsn bigint,
               parent_branch text, rewound_to text, created_at timestamptz, payload bytea,
               meta jsonb)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
#variable_conflict use_column
DECLARE
    c record;
    d record;
    r record;
    v_branch text := p_branch;
    v_applied bigint;
    v_at bigint;
    v_to text;
    v_id text;
    v_new integer;
    v_ended boolean := false;
    v_end_created timestamptz;
    v_horizon timestamptz;
    v_known bigint;
    v_diverged text;
    v_child text;
    v_child_base bigint;
    v_epochs bigint[];
    v_from bigint[];
BEGIN
    -- The ids' rule of the write API (a consumer's own database has no relay_require_id).
    FOREACH v_id IN ARRAY ARRAY[p_tenant, p_run, p_branch] LOOP
        -- `+` and a length test: `{1,64}` costs about 5 us per check (PostgreSQL's regex engine).
        IF v_id IS NULL OR v_id !~ '^[A-Za-z0-9._:-]+$' OR octet_length(v_id) > 64 THEN
            RAISE EXCEPTION 'invalid id %: 1 to 64 bytes of ASCII letters, digits and - _ . :',
                coalesce(quote_literal(left(v_id, 80)), 'NULL') USING ERRCODE = 'RL100';
        END IF;
    END LOOP;
    IF p_kind IS NULL OR p_kind NOT IN ('intent', 'rewind', 'end') THEN
        RAISE EXCEPTION 'unknown kind %: intent, rewind or end', coalesce(quote_literal(p_kind), 'NULL')
            USING ERRCODE = 'RL201';
    END IF;
    IF p_lsn IS NULL OR p_prev_lsn IS NULL OR p_base_lsn IS NULL
       OR p_lsn <= p_prev_lsn OR p_prev_lsn < p_base_lsn OR p_base_lsn < 0 THEN
        RAISE EXCEPTION 'delivery %/%/% has lsn %, prev_lsn %, base_lsn %: needs 0 <= base_lsn <= prev_lsn < lsn',
            p_tenant, p_run, p_branch, p_lsn, p_prev_lsn, p_base_lsn USING ERRCODE = 'RL201';
    END IF;
    IF p_kind = 'intent' AND p_payload IS NULL THEN
        RAISE EXCEPTION 'intent %/%/%@% without a body (NULL payload)', p_tenant, p_run, p_branch, p_lsn
            USING ERRCODE = 'RL201';
    END IF;
    IF p_kind = 'rewind' AND (p_rewound_to IS NULL OR p_rewound_to !~ '^[A-Za-z0-9._:-]{1,64}$') THEN
        RAISE EXCEPTION 'rewind marker %/%/% without a valid rewound_to', p_tenant, p_run, p_branch
            USING ERRCODE = 'RL201';
    END IF;
    -- The branch's state, created on its first message (intent or marker); its row lock
    -- serialises the folding of a branch.
    INSERT INTO relay_fold_cursor AS f (tenant_id, run_id, branch_id, applied_lsn, started, base_lsn)
    VALUES (p_tenant, p_run, p_branch, p_base_lsn, p_parent_branch IS NULL, p_base_lsn)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS v_new = ROW_COUNT;
    IF v_new = 1 AND p_created_at IS NOT NULL THEN
        -- No state for this branch: a first delivery, or a run retired by relay_fold_retire.
        -- Every message of a retired run was written no later than its end marker, and the
        -- horizon is the tenant's latest end marker retired: at or before it, this is a
        -- redelivery (or an event of the tenant held up for longer than the retention).
        -- Refused, never applied twice.
        SELECT h.retired_through INTO v_horizon FROM relay_fold_horizon h
         WHERE h.tenant_id = p_tenant;
        IF v_horizon IS NOT NULL AND p_created_at <= v_horizon THEN
            RAISE EXCEPTION 'delivery %/%/%@% was written at % and its branch has no fold state: its run was retired (the tenant''s end markers up to % are), so this is a redelivery after the retention, or an event delayed past it',
                p_tenant, p_run, p_branch, p_lsn, p_created_at, v_horizon
                USING ERRCODE = 'RL202',
                      DETAIL = format('created_at_us=%s retired_through_us=%s',
                                      (extract(epoch FROM p_created_at) * 1000000)::bigint,
                                      (extract(epoch FROM v_horizon) * 1000000)::bigint);
        END IF;
    END IF;
    SELECT f.applied_lsn, f.abandoned_at_lsn, f.rewound_to, f.started, f.epochs, f.epoch_from,
           f.marker_epoch, f.adopt, f.base_lsn INTO c
      FROM relay_fold_cursor f
     WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = p_branch
       FOR UPDATE;

    -- Rule 0: a copy of history the database replaced (a higher epoch was applied at or below
    -- its Lsn, or a later rewind marker was folded; or, for a branch forked again elsewhere
    -- under its name, anything newer was folded on it).
    v_known := relay_fold_epoch_at(c.epochs, c.epoch_from, p_lsn);
    IF p_epoch IS NOT NULL AND c.base_lsn <> p_base_lsn THEN
        v_known := greatest(c.epochs[cardinality(c.epochs)], c.marker_epoch);
        IF v_known > p_epoch THEN
            RETURN QUERY SELECT 'superseded', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, p_rewound_to, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        v_diverged := format('its branch starts at %s, the fold''s at %s: the database lost the rewind that made the branch the fold knows, and forked one of that name again',
                             p_base_lsn, c.base_lsn);
    ELSIF v_known > p_epoch OR (p_kind = 'rewind' AND c.marker_epoch > p_epoch) THEN
        RETURN QUERY SELECT 'superseded', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                            p_parent_branch, p_rewound_to, p_created_at, NULL::bytea, NULL::jsonb;
        RETURN;
    END IF;
    -- Divergence (rules 1, 2, 3, 4 and 6 with epochs): what the fold applied is not the database's.
    IF v_diverged IS NOT NULL THEN
        NULL; -- forked again elsewhere (above)
    ELSIF p_kind = 'rewind' THEN
        IF c.abandoned_at_lsn IS NOT NULL AND p_epoch > c.marker_epoch THEN
            v_known := c.marker_epoch;
            v_diverged := format('a rewind marker of epoch %s on a branch whose rewind at %s (epoch %s) was folded: the database lost that rewind and rewound again',
                                 p_epoch, c.abandoned_at_lsn, c.marker_epoch);
        END IF;
    ELSIF c.abandoned_at_lsn IS NOT NULL AND p_lsn > c.abandoned_at_lsn THEN
        IF p_epoch > c.marker_epoch THEN
            v_known := c.marker_epoch;
            v_diverged := format('written in epoch %s above the fork %s of a rewind folded in epoch %s: the database lost that rewind and wrote on the branch again',
                                 p_epoch, c.abandoned_at_lsn, c.marker_epoch);
        END IF;
    ELSIF p_lsn <= c.applied_lsn THEN
        IF p_epoch > v_known THEN
            v_diverged := format('written again in epoch %s where the fold applied epoch %s: the database lost the intent it applied',
                                 p_epoch, v_known);
        END IF;
    ELSIF p_prev_lsn < c.applied_lsn THEN
        v_known := relay_fold_epoch_at(c.epochs, c.epoch_from, c.applied_lsn);
        IF p_epoch > v_known THEN
            v_diverged := format('written in epoch %s after %s, below the %s the fold applied in epoch %s: the database lost what the fold applied above %s',
                                 p_epoch, p_prev_lsn, c.applied_lsn, v_known, p_prev_lsn);
        END IF;
    ELSIF p_prev_lsn = c.applied_lsn AND c.started THEN
        v_known := relay_fold_epoch_at(c.epochs, c.epoch_from, c.applied_lsn);
        IF p_prev_epoch <> v_known THEN
            v_diverged := format('its predecessor %s was written in epoch %s, the fold applied one of epoch %s',
                                 p_prev_lsn, p_prev_epoch, v_known);
        END IF;
    END IF;
    IF v_diverged IS NOT NULL THEN
        IF NOT c.adopt OR NOT (p_kind = 'rewind' OR p_prev_epoch IS NULL OR p_prev_epoch < p_epoch) THEN
            RAISE EXCEPTION 'delivery %/%/%@% diverges: %', p_tenant, p_run, p_branch, p_lsn, v_diverged
                USING ERRCODE = 'RL203',
                      DETAIL = format('lsn=%s epoch=%s known_epoch=%s', p_lsn, p_epoch, v_known);
        END IF;
        IF c.base_lsn <> p_base_lsn THEN
            -- Adopted, a branch forked again elsewhere: the fold forgets the one it knew (as a
            -- branch a lost rewind led to) and folds this as the first message of its branch.
            RETURN QUERY SELECT 'adopt', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, p_rewound_to, p_created_at, NULL::bytea, NULL::jsonb;
            v_child := p_branch;
            v_child_base := c.base_lsn;
            v_to := NULL;
        ELSE
        -- Adopted (relay_fold_adopt armed the branch): the point to keep is its prev_lsn.
        IF p_prev_lsn > c.applied_lsn THEN
            RAISE EXCEPTION 'delivery %/%/%@% cannot be adopted: the fold keeps the branch up to % only (a rewind the database lost undid the intents up to %, and they will not be sent again); rebuild the run''s projection from a stream, or accept the gap',
                p_tenant, p_run, p_branch, p_lsn, c.applied_lsn, p_prev_lsn
                USING ERRCODE = 'RL203',
                      DETAIL = format('lsn=%s epoch=%s applied_lsn=%s', p_lsn, p_epoch, c.applied_lsn);
        END IF;
        v_known := relay_fold_epoch_at(c.epochs, c.epoch_from, p_prev_lsn);
        IF p_kind <> 'rewind' AND p_prev_epoch <> v_known THEN
            RAISE EXCEPTION 'delivery %/%/%@% cannot be adopted: the fold''s history differs below % too (epoch % there, the database''s %); fold an earlier message of the branch first (replay in order)',
                p_tenant, p_run, p_branch, p_lsn, p_prev_lsn, v_known, p_prev_epoch
                USING ERRCODE = 'RL203',
                      DETAIL = format('lsn=%s epoch=%s known_epoch=%s', p_lsn, p_epoch, v_known);
        END IF;
        RETURN QUERY SELECT 'adopt', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                            p_parent_branch, p_rewound_to, p_created_at, NULL::bytea, NULL::jsonb;
        -- a. A rewind the database lost (its marker of an earlier epoch): every branch it led
        -- to is forgotten.
        IF p_epoch > c.marker_epoch THEN
            v_child := c.rewound_to;
            v_child_base := c.abandoned_at_lsn;
        END IF;
        v_to := p_branch;
        END IF;
        WHILE v_child IS NOT NULL LOOP
            -- A branch that applied only history of this epoch or later is the database's
            -- (its name given again): it stays, and so do the branches after it.
            DELETE FROM relay_fold_cursor f
             WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = v_child
               AND (v_child = p_branch OR NOT coalesce(f.epochs[1] >= p_epoch, false))
            RETURNING f.applied_lsn, f.abandoned_at_lsn, f.rewound_to, f.marker_epoch INTO d;
            EXIT WHEN NOT FOUND;
            -- What it holds of the database's history waits for the branch of its name.
            DELETE FROM relay_fold_parked h
             WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = v_child
               AND h.epoch < p_epoch;
            IF d.applied_lsn > v_child_base THEN
                RETURN QUERY SELECT 'undo', v_child, v_child_base, d.applied_lsn, v_child_base,
                                    p_branch, p_branch, p_created_at, NULL::bytea, NULL::jsonb;
            END IF;
            IF d.marker_epoch >= p_epoch THEN
                -- Rewound in the database's history: the branch of that name begins anew from
                -- its base, rewound as it was.
                INSERT INTO relay_fold_cursor AS f
                    (tenant_id, run_id, branch_id, applied_lsn, started, base_lsn,
                     abandoned_at_lsn, rewound_to, marker_epoch)
                VALUES (p_tenant, p_run, v_child, v_child_base, false, v_child_base,
                        d.abandoned_at_lsn, d.rewound_to, d.marker_epoch);
                EXIT;
            END IF;
            v_child := d.rewound_to;
            v_child_base := d.abandoned_at_lsn;
        END LOOP;
        IF v_to IS NULL THEN
            -- The branch forked again: its state begins anew with this message.
            INSERT INTO relay_fold_cursor AS f
                (tenant_id, run_id, branch_id, applied_lsn, started, base_lsn)
            VALUES (p_tenant, p_run, p_branch, p_base_lsn, p_parent_branch IS NULL, p_base_lsn)
            ON CONFLICT DO NOTHING;
        ELSE
        -- c. Undo above the point kept.
        IF c.applied_lsn > p_prev_lsn THEN
            RETURN QUERY SELECT 'undo', p_branch, p_prev_lsn, c.applied_lsn, p_base_lsn,
                                p_parent_branch, p_branch, p_created_at, NULL::bytea, NULL::jsonb;
        END IF;
        DELETE FROM relay_fold_parked h
         WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = p_branch
           AND h.lsn > p_prev_lsn AND h.epoch < p_epoch;
        UPDATE relay_fold_cursor f
           SET applied_lsn = least(f.applied_lsn, p_prev_lsn),
               abandoned_at_lsn = CASE WHEN p_epoch > f.marker_epoch THEN NULL ELSE f.abandoned_at_lsn END,
               rewound_to = CASE WHEN p_epoch > f.marker_epoch THEN NULL ELSE f.rewound_to END,
               marker_epoch = CASE WHEN p_epoch > f.marker_epoch THEN NULL ELSE f.marker_epoch END,
               adopt = false,
               epochs = (SELECT array_agg(h.e ORDER BY h.f) FROM unnest(f.epochs, f.epoch_from) AS h(e, f)
                          WHERE h.f <= p_prev_lsn),
               epoch_from = (SELECT array_agg(h.f ORDER BY h.f) FROM unnest(f.epochs, f.epoch_from) AS h(e, f)
                              WHERE h.f <= p_prev_lsn)
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = p_branch;
        END IF;
        SELECT f.applied_lsn, f.abandoned_at_lsn, f.rewound_to, f.started, f.epochs, f.epoch_from,
               f.marker_epoch, f.adopt, f.base_lsn INTO c
          FROM relay_fold_cursor f
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = p_branch;
    END IF;

    IF p_kind = 'rewind' THEN
        -- Rule 1: a marker.
        IF c.abandoned_at_lsn IS NOT NULL THEN
            RETURN QUERY SELECT 'duplicate', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, p_rewound_to, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        RETURN QUERY SELECT 'undo', p_branch, p_prev_lsn, c.applied_lsn, p_base_lsn,
                            p_parent_branch, p_rewound_to, p_created_at, NULL::bytea, NULL::jsonb;
        DELETE FROM relay_fold_parked h
         WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = p_branch
           AND h.lsn > p_prev_lsn;
        v_applied := least(c.applied_lsn, p_prev_lsn);
        UPDATE relay_fold_cursor f
           SET applied_lsn = v_applied, abandoned_at_lsn = p_prev_lsn, rewound_to = p_rewound_to,
               marker_epoch = p_epoch
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = p_branch;
        IF NOT c.started THEN
            -- Started (and caught up) by its own parent's hand-over.
            RETURN;
        END IF;
        v_at := p_prev_lsn;
        v_to := p_rewound_to;
        v_epochs := c.epochs;
        v_from := c.epoch_from;
    ELSE
        IF c.abandoned_at_lsn IS NOT NULL AND p_lsn > c.abandoned_at_lsn THEN
            -- Rule 2: abandoned.
            RETURN QUERY SELECT 'abandoned', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        IF p_lsn <= c.applied_lsn THEN
            -- Rule 3: a redelivery.
            RETURN QUERY SELECT 'duplicate', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        IF p_prev_lsn < c.applied_lsn THEN
            -- Rule 4: a broken chain.
            RAISE EXCEPTION 'event % on %/%/% claims predecessor % but the fold has applied up to %',
                p_lsn, p_tenant, p_run, p_branch, p_prev_lsn, c.applied_lsn
                USING ERRCODE = 'RL200', DETAIL = format('applied_lsn=%s', c.applied_lsn);
        END IF;
        IF NOT c.started OR p_prev_lsn > c.applied_lsn THEN
            -- Rule 5: hold back. Of two held at one place, the lower epoch's is superseded.
            IF EXISTS (SELECT 1 FROM relay_fold_parked h
                        WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = p_branch
                          AND (h.lsn = p_lsn OR h.prev_lsn = p_prev_lsn) AND h.epoch > p_epoch) THEN
                RETURN QUERY SELECT 'superseded', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                    p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
                RETURN;
            END IF;
            DELETE FROM relay_fold_parked h
             WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = p_branch
               AND (h.lsn = p_lsn OR h.prev_lsn = p_prev_lsn) AND h.epoch < p_epoch;
            INSERT INTO relay_fold_parked AS h
                (tenant_id, run_id, branch_id, lsn, prev_lsn, payload, base_lsn, created_at,
                 parent_branch_id, kind, meta, epoch, prev_epoch)
            VALUES (p_tenant, p_run, p_branch, p_lsn, p_prev_lsn, coalesce(p_payload, ''),
                    p_base_lsn, coalesce(p_created_at, now()), p_parent_branch, p_kind,
                    nullif(p_meta, '{}'::jsonb), p_epoch, p_prev_epoch)
            ON CONFLICT DO NOTHING;
            RETURN QUERY SELECT 'hold', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
            RETURN;
        END IF;
        -- Rule 6: apply (an end marker: the run is complete), then catch up.
        IF p_kind = 'end' THEN
            RETURN QUERY SELECT 'end', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, NULL::bytea, NULL::jsonb;
            v_ended := true;
            v_end_created := coalesce(p_created_at, now());
        ELSE
            RETURN QUERY SELECT 'apply', p_branch, p_lsn, p_prev_lsn, p_base_lsn,
                                p_parent_branch, NULL::text, p_created_at, p_payload, p_meta;
        END IF;
        v_applied := p_lsn;
        v_at := c.abandoned_at_lsn;
        v_to := c.rewound_to;
        v_epochs := c.epochs;
        v_from := c.epoch_from;
        IF p_epoch IS NOT NULL AND (v_epochs IS NULL OR p_epoch > v_epochs[cardinality(v_epochs)]) THEN
            v_epochs := array_append(v_epochs, p_epoch);
            v_from := array_append(v_from, p_lsn);
        END IF;
    END IF;

    -- Catch up v_branch (started), then hand over along the chain of rewinds.
    LOOP
        LOOP
            SELECT h.lsn, h.prev_lsn, h.base_lsn, h.parent_branch_id, h.created_at, h.payload,
                   h.kind, h.meta, h.epoch, h.prev_epoch INTO r
              FROM relay_fold_parked h
             WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = v_branch
               AND h.prev_lsn = v_applied;
            EXIT WHEN NOT FOUND;
            v_known := relay_fold_epoch_at(v_epochs, v_from, v_applied);
            IF r.prev_epoch <> v_known THEN
                RAISE EXCEPTION 'delivery %/%/%@% diverges: it releases %@%, whose predecessor % was written in epoch %, and the fold applied one of epoch %',
                    p_tenant, p_run, p_branch, p_lsn, v_branch, r.lsn, v_applied, r.prev_epoch, v_known
                    USING ERRCODE = 'RL203',
                          DETAIL = format('lsn=%s epoch=%s known_epoch=%s', p_lsn, p_epoch, v_known);
            END IF;
            DELETE FROM relay_fold_parked h
             WHERE h.tenant_id = p_tenant AND h.run_id = p_run AND h.branch_id = v_branch
               AND h.lsn = r.lsn;
            IF r.kind = 'end' THEN
                RETURN QUERY SELECT 'end', v_branch, r.lsn, r.prev_lsn, r.base_lsn,
                                    r.parent_branch_id, NULL::text, r.created_at, NULL::bytea, NULL::jsonb;
                v_ended := true;
                v_end_created := r.created_at;
            ELSE
                RETURN QUERY SELECT 'apply', v_branch, r.lsn, r.prev_lsn, r.base_lsn,
                                    r.parent_branch_id, NULL::text, r.created_at, r.payload, r.meta;
            END IF;
            v_applied := r.lsn;
            IF r.epoch IS NOT NULL AND (v_epochs IS NULL OR r.epoch > v_epochs[cardinality(v_epochs)]) THEN
                v_epochs := array_append(v_epochs, r.epoch);
                v_from := array_append(v_from, r.lsn);
            END IF;
        END LOOP;
        UPDATE relay_fold_cursor f
           SET applied_lsn = v_applied, started = true, epochs = v_epochs, epoch_from = v_from,
               ended_at = CASE WHEN v_ended THEN now() ELSE f.ended_at END,
               end_created_at = CASE WHEN v_ended THEN v_end_created ELSE f.end_created_at END
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = v_branch;
        v_ended := false;
        EXIT WHEN v_at IS NULL OR v_to IS NULL OR v_applied <> v_at;
        -- The hand-over: the branch rewound to starts, with or without intents of its own yet.
        INSERT INTO relay_fold_cursor AS f (tenant_id, run_id, branch_id, applied_lsn, started, base_lsn)
        VALUES (p_tenant, p_run, v_to, v_at, false, v_at)
        ON CONFLICT DO NOTHING;
        SELECT f.applied_lsn, f.abandoned_at_lsn, f.rewound_to, f.started, f.epochs, f.epoch_from
          INTO c
          FROM relay_fold_cursor f
         WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = v_to
           FOR UPDATE;
        EXIT WHEN c.started;
        v_branch := v_to;
        v_applied := c.applied_lsn;
        v_at := c.abandoned_at_lsn;
        v_to := c.rewound_to;
        v_epochs := c.epochs;
        v_from := c.epoch_from;
    END LOOP;
END
$$;
COMMENT ON FUNCTION relay_fold IS 'Folds one delivery (WIRE.md''s consumer rules, epochs included): returns the verdict on it, then the held-back intents (and end marker) it released, in the order to apply them; RL203 when it diverges.';

-- The operator's way out of a divergence (WIRE.md "Epochs"): arms the branch, so the next
-- diverged message that begins its epoch on it is adopted (replay the branch's dead letters in
-- order). Returns false when the fold has no state for the branch.
CREATE OR REPLACE FUNCTION relay_fold_adopt(p_tenant text, p_run text, p_branch text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    v_armed integer;
BEGIN
    UPDATE relay_fold_cursor f SET adopt = true
     WHERE f.tenant_id = p_tenant AND f.run_id = p_run AND f.branch_id = p_branch;
    GET DIAGNOSTICS v_armed = ROW_COUNT;
    RETURN v_armed > 0;
END
$$;
COMMENT ON FUNCTION relay_fold_adopt IS 'Arms a diverged branch: its next diverged message that begins an epoch is adopted (the fold undoes the history the database lost). Replay its dead letters in order after.';

SELECT pg_temp.relay_regrant(proacl, 'relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb, bigint, bigint)')
  FROM relay_old_fold_acl_v6;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION relay_fold(text, text, text, text, bigint, bigint, bigint, text, text, timestamptz, bytea, jsonb, bigint, bigint) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION relay_fold_adopt(text, text, text) SET search_path = %I, pg_temp', current_schema());
END
$$;

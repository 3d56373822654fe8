-- The outbox: branches of a run, export intents, and the consumer's fold.
-- Every object is prefixed `relay_`. Once landed this file is never edited: fixes are new files.

CREATE TABLE relay_branch (
    tenant_id        text        NOT NULL,
    run_id           text        NOT NULL,
    branch_id        text        NOT NULL,
    base_lsn         bigint      NOT NULL,
    head_lsn         bigint      NOT NULL,
    parent_branch_id text        NULL,
    abandoned_at_lsn bigint      NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, run_id, branch_id),
    CHECK (head_lsn >= base_lsn)
);
COMMENT ON TABLE relay_branch IS 'One row per branch of a run; its row lock serialises appends so commit order equals Lsn order.';
COMMENT ON COLUMN relay_branch.tenant_id IS 'Tenant that owns the run.';
COMMENT ON COLUMN relay_branch.run_id IS 'Agent run the branch belongs to.';
COMMENT ON COLUMN relay_branch.branch_id IS 'Branch of the run; unique within the run.';
COMMENT ON COLUMN relay_branch.base_lsn IS 'Lsn this branch starts after: 0 for a run''s first branch, the fork point for a rewind.';
COMMENT ON COLUMN relay_branch.head_lsn IS 'Highest Lsn appended to this branch (base_lsn while empty); the next append must be above it.';
COMMENT ON COLUMN relay_branch.parent_branch_id IS 'Branch this one was forked from by a rewind; NULL for a run''s first branch.';
COMMENT ON COLUMN relay_branch.abandoned_at_lsn IS 'NULL while the branch is live; the fork point once a rewind abandoned everything after it.';
COMMENT ON COLUMN relay_branch.created_at IS 'When the branch was opened (host transaction start).';

-- At most one live branch per run: a rewind abandons the old one in the same transaction.
CREATE UNIQUE INDEX relay_branch_one_live_per_run
    ON relay_branch (tenant_id, run_id) WHERE abandoned_at_lsn IS NULL;

CREATE TABLE relay_outbox (
    seq        bigint GENERATED ALWAYS AS IDENTITY,
    tenant_id  text        NOT NULL,
    run_id     text        NOT NULL,
    branch_id  text        NOT NULL,
    lsn        bigint      NOT NULL,
    prev_lsn   bigint      NOT NULL,
    base_lsn   bigint      NOT NULL,
    payload    bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant_id, run_id, branch_id, lsn),
    CHECK (lsn > prev_lsn AND prev_lsn >= base_lsn)
);
COMMENT ON TABLE relay_outbox IS 'Pending export intents on live history. A row is deleted when the broker confirmed it (ack_outbox) or when a rewind abandoned it.';
COMMENT ON COLUMN relay_outbox.seq IS 'Insertion order; within a branch it equals Lsn order because appends to a branch are serialised.';
COMMENT ON COLUMN relay_outbox.tenant_id IS 'Tenant of the intent; the drain unit.';
COMMENT ON COLUMN relay_outbox.run_id IS 'Run of the intent; with tenant_id, the broker partition key.';
COMMENT ON COLUMN relay_outbox.branch_id IS 'Branch of the intent.';
COMMENT ON COLUMN relay_outbox.lsn IS 'Position of the intent in its branch; ascending within a branch.';
COMMENT ON COLUMN relay_outbox.prev_lsn IS 'Lsn of the previous intent on this branch (base_lsn for the first): lets the fold prove order.';
COMMENT ON COLUMN relay_outbox.base_lsn IS 'base_lsn of the branch, copied so a consumer knows where the branch starts.';
COMMENT ON COLUMN relay_outbox.payload IS 'The host''s bytes, shipped unchanged as the message body. Never logged.';
COMMENT ON COLUMN relay_outbox.created_at IS 'When the intent was written (clock time inside the host transaction); ages the backlog.';

CREATE INDEX relay_outbox_drain ON relay_outbox (tenant_id, seq);

-- The consumer's fold: what a consumer applied, exactly once per (BranchKey, Lsn), in Lsn order.
CREATE TABLE relay_fold_cursor (
    tenant_id   text   NOT NULL,
    run_id      text   NOT NULL,
    branch_id   text   NOT NULL,
    applied_lsn bigint NOT NULL,
    PRIMARY KEY (tenant_id, run_id, branch_id)
);
COMMENT ON TABLE relay_fold_cursor IS 'Per branch, the Lsn the fold has applied up to; its row lock serialises folding of a branch.';
COMMENT ON COLUMN relay_fold_cursor.tenant_id IS 'Tenant of the branch.';
COMMENT ON COLUMN relay_fold_cursor.run_id IS 'Run of the branch.';
COMMENT ON COLUMN relay_fold_cursor.branch_id IS 'Branch folded.';
COMMENT ON COLUMN relay_fold_cursor.applied_lsn IS 'Highest Lsn applied; starts at the branch''s base_lsn. Only an event whose prev_lsn equals it may be applied next.';

CREATE TABLE relay_fold_event (
    tenant_id   text        NOT NULL,
    run_id      text        NOT NULL,
    branch_id   text        NOT NULL,
    lsn         bigint      NOT NULL,
    payload     bytea       NOT NULL,
    applied_seq bigint GENERATED ALWAYS AS IDENTITY,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant_id, run_id, branch_id, lsn)
);
COMMENT ON TABLE relay_fold_event IS 'The folded state: each exported event applied exactly once; a redelivery is a no-op insert.';
COMMENT ON COLUMN relay_fold_event.tenant_id IS 'Tenant of the event.';
COMMENT ON COLUMN relay_fold_event.run_id IS 'Run of the event.';
COMMENT ON COLUMN relay_fold_event.branch_id IS 'Branch of the event.';
COMMENT ON COLUMN relay_fold_event.lsn IS 'Lsn of the event.';
COMMENT ON COLUMN relay_fold_event.payload IS 'The event body as published.';
COMMENT ON COLUMN relay_fold_event.applied_seq IS 'Order in which the fold applied events; ascends with Lsn within a branch.';
COMMENT ON COLUMN relay_fold_event.applied_at IS 'When the fold applied the event.';

CREATE TABLE relay_fold_parked (
    tenant_id text   NOT NULL,
    run_id    text   NOT NULL,
    branch_id text   NOT NULL,
    lsn       bigint NOT NULL,
    prev_lsn  bigint NOT NULL,
    payload   bytea  NOT NULL,
    PRIMARY KEY (tenant_id, run_id, branch_id, lsn)
);
COMMENT ON TABLE relay_fold_parked IS 'Events delivered ahead of their predecessor; applied as soon as the gap before them closes.';
COMMENT ON COLUMN relay_fold_parked.tenant_id IS 'Tenant of the event.';
COMMENT ON COLUMN relay_fold_parked.run_id IS 'Run of the event.';
COMMENT ON COLUMN relay_fold_parked.branch_id IS 'Branch of the event.';
COMMENT ON COLUMN relay_fold_parked.lsn IS 'Lsn of the event.';
COMMENT ON COLUMN relay_fold_parked.prev_lsn IS 'Lsn that must be applied before this event.';
COMMENT ON COLUMN relay_fold_parked.payload IS 'The event body as published.';

CREATE UNIQUE INDEX relay_fold_parked_next ON relay_fold_parked (tenant_id, run_id, branch_id, prev_lsn);

-- The fold's tables alone, for a consumer's own database (`store::migrate_fold`). Tracked in
-- `relay_fold_migrations`. On a database that also holds the outbox (`store::migrate`), these
-- tables already exist and every statement here is a no-op.
CREATE TABLE IF NOT EXISTS relay_fold_cursor (
    tenant_id   text   NOT NULL,
    run_id      text   NOT NULL,
    branch_id   text   NOT NULL,
    applied_lsn bigint NOT NULL,
    PRIMARY KEY (tenant_id, run_id, branch_id)
);
ALTER TABLE relay_fold_cursor
    ADD COLUMN IF NOT EXISTS abandoned_at_lsn bigint NULL,
    ADD COLUMN IF NOT EXISTS rewound_to text NULL,
    ADD COLUMN IF NOT EXISTS started boolean NOT NULL DEFAULT true;
COMMENT ON TABLE relay_fold_cursor IS 'Per branch, the Lsn the fold has applied up to; its row lock serialises folding of a branch.';

CREATE TABLE IF NOT EXISTS relay_fold_parked (
    tenant_id text   NOT NULL,
    run_id    text   NOT NULL,
    branch_id text   NOT NULL,
    lsn       bigint NOT NULL,
    prev_lsn  bigint NOT NULL,
    payload   bytea  NOT NULL,
    PRIMARY KEY (tenant_id, run_id, branch_id, lsn)
);
ALTER TABLE relay_fold_parked
    ADD COLUMN IF NOT EXISTS base_lsn bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS parent_branch_id text NULL;
CREATE UNIQUE INDEX IF NOT EXISTS relay_fold_parked_next
    ON relay_fold_parked (tenant_id, run_id, branch_id, prev_lsn);
COMMENT ON TABLE relay_fold_parked IS 'Events delivered ahead of their predecessor (or of their parent''s rewind); applied as soon as that arrives.';

-- Only the project's demonstration projection (`store::EventTable`) writes here.
CREATE TABLE IF NOT EXISTS relay_fold_event (
    tenant_id   text        NOT NULL,
    run_id      text        NOT NULL,
    branch_id   text        NOT NULL,
    lsn         bigint      NOT NULL,
    payload     bytea       NOT NULL,
    applied_seq bigint GENERATED ALWAYS AS IDENTITY,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tenant_id, run_id, branch_id, lsn)
);
COMMENT ON TABLE relay_fold_event IS 'The demonstration fold''s state (store::EventTable): each exported event applied exactly once.';

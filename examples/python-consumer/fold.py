"""What both Python consumers share, whatever the broker: the fold's SQL function
`relay_fold_batch` called once per batch (broker/WIRE.md, "What a consumer must do"), the
projection it writes (`py_projection`, `py_runs_done`), and the contract's header names.

A message is handed over as a dict of the contract's fields, read off the wire by the
consumer of each broker: tenant, run, branch, kind, lsn, prev_lsn, base_lsn, parent_branch,
rewound_to, created_at_us, epoch, prev_epoch (numbers as int), body (bytes) and meta (the
intent's metadata, or None).
"""

import datetime
import os
import sys

from psycopg.types.json import Jsonb

FOLD_BATCH = """SELECT delivery, action, branch_id, lsn, prev_lsn, rewound_to, payload, meta
                  FROM relay_fold_batch(%s::text[], %s::text[], %s::text[], %s::text[],
                                        %s::bigint[], %s::bigint[], %s::bigint[], %s::text[],
                                        %s::text[], %s::timestamptz[], %s::bytea[], %s::jsonb[],
                                        %s::bigint[], %s::bigint[])
                 ORDER BY delivery, step"""

# The fold's refusals (docs/sql-api.md, "Refusals"): they fail again however often the
# delivery comes, so the delivery is dead-lettered.
REFUSED = {"RL100", "RL200", "RL201", "RL202", "RL203"}

# WIRE.md, "Metadata": the contract's own headers (a host header never takes these names).
CONTRACT_HEADERS = {
    "wire_version", "kind", "tenant", "run", "branch", "lsn", "prev_lsn", "base_lsn",
    "parent_branch", "rewound_to", "created_at_us", "epoch", "prev_epoch", "causation_id",
    "traceparent", "tracestate",
}
# Prefixes that are never the host's: RabbitMQ's and the relay's, NATS's, CloudEvents'.
NOT_HOST_PREFIXES = ("x-", "nats-", "cloudevents", "ce-")
# The contract's numbers (WIRE.md): long long ints on AMQP, decimal text on NATS.
NUMBER_HEADERS = {"wire_version", "lsn", "prev_lsn", "base_lsn", "created_at_us", "epoch",
                  "prev_epoch"}


def setting(name, default=None):
    value = os.environ.get(name, default)
    if value is None:
        sys.exit(f"{name} is not set")
    return value


def metadata(kind, event_type, content_type, correlation_id, headers):
    """An intent's metadata as WIRE.md (version 3 and later) says it travels; None when it has
    none. `headers` holds text values."""
    meta = {}
    if kind == "intent" and event_type and not event_type.startswith("outbox."):
        meta["type"] = event_type
    if content_type and content_type != "application/octet-stream":
        meta["content_type"] = content_type
    if correlation_id:
        meta["correlation_id"] = correlation_id
    for name in ("causation_id", "traceparent", "tracestate"):
        if headers.get(name) is not None:
            meta[name] = headers[name]
    own = {
        name: value
        for name, value in headers.items()
        if name.lower() not in CONTRACT_HEADERS
        and not name.lower().startswith(NOT_HOST_PREFIXES)
        and isinstance(value, str)
    }
    if own:
        meta["headers"] = own
    return meta or None


def prepare(db):
    """The projection's tables, and a session that cannot leave a branch locked."""
    # A connection lost mid-transaction must not leave its branch locked (WIRE.md).
    db.execute("SET idle_in_transaction_session_timeout = '60s'")
    db.execute(
        """CREATE TABLE IF NOT EXISTS py_projection (
               seq bigserial, tenant text, run text, branch text, lsn bigint, body bytea,
               meta jsonb, PRIMARY KEY (tenant, run, branch, lsn))"""
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS py_runs_done (tenant text, run text, PRIMARY KEY (tenant, run))"
    )


def arguments(messages):
    """relay_fold_batch's arrays: one element per message, in delivery order."""
    columns = [[] for _ in range(14)]
    for m in messages:
        created = m.get("created_at_us")
        created_at = (
            datetime.datetime.fromtimestamp(created / 1e6, tz=datetime.timezone.utc)
            if created is not None
            else None
        )
        meta = m.get("meta")
        row = (
            m.get("tenant"), m.get("run"), m.get("branch"), m.get("kind"), m.get("lsn"),
            m.get("prev_lsn"), m.get("base_lsn"), m.get("parent_branch"), m.get("rewound_to"),
            created_at, m["body"], meta and Jsonb(meta), m.get("epoch"), m.get("prev_epoch"),
        )
        for column, value in zip(columns, row):
            column.append(value)
    return columns


def fold(db, messages):
    """Folds `messages` into the projection inside the caller's transaction; a refusal raises
    (psycopg.Error with the SQLSTATE; its hint names the delivery: see `refused_at`)."""
    rows = db.execute(FOLD_BATCH, arguments(messages)).fetchall()
    # Also 'hold', 'duplicate', 'abandoned' and 'superseded' (a copy of history the database
    # replaced after a failover): nothing to apply. 'adopt' comes first when an operator
    # adopted a failover's history: the 'undo' rows after it remove what the failover lost.
    for delivery, action, branch, lsn, _prev, _to, payload, row_meta in rows:
        m = messages[delivery - 1]
        tenant, run = m.get("tenant"), m.get("run")
        if action == "apply":
            # Each row brings its body and metadata (those of a held-back intent as relay_fold
            # kept them). A plain INSERT: a second apply of one (branch, lsn) would fail here.
            db.execute(
                "INSERT INTO py_projection (tenant, run, branch, lsn, body, meta)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (tenant, run, branch, lsn, payload, row_meta and Jsonb(row_meta)),
            )
        elif action == "undo":
            db.execute(
                "DELETE FROM py_projection"
                " WHERE tenant = %s AND run = %s AND branch = %s AND lsn > %s",
                (tenant, run, branch, lsn),
            )
        elif action == "end":
            # The run is complete: everything of it is applied. Once per run.
            db.execute(
                "INSERT INTO py_runs_done (tenant, run) VALUES (%s, %s)", (tenant, run)
            )


def refused_at(error):
    """The index in its batch of the delivery a refusal names (hint "delivery N of the
    batch"), or None when the error is not one of the fold's refusals."""
    if error.sqlstate not in REFUSED:
        return None
    return int(error.diag.message_hint.split()[1]) - 1

"""A consumer in Python: projects the relay's events into its own table, exactly once and in
live-history order, through the fold's SQL function `relay_fold_batch` (see broker/WIRE.md). It
re-implements none of the fold's rules: it takes what the broker has pushed (up to BATCH_EVENTS
deliveries, 128 by default), and in one transaction calls `relay_fold_batch` once with each
message's headers, body and metadata (WIRE.md, version 4), applies what it returns in order
("apply" rows, "undo" for a rewind or for history a failover lost, "end" once a closed run is
complete), commits, and only then acks the whole batch with one `multiple` ack. A delivery the
fold refuses (a broken chain, a malformed message, a retired run, a history that diverged after
a failover) fails the call with a hint naming it: the transaction is rolled back, that delivery
alone is published to the group's dead-letter queue with the reason, confirmed by the broker,
and acked, and the rest of the batch is folded again. It is never dropped.

    AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f DATABASE_URL=postgres://... \
      TOPOLOGY=outbox PARTITIONS=4 python3 consumer.py

Its database needs the fold's tables and functions (`distribution migrate --fold`, or
`store::migrate_fold`). It reads the default group's queues (`<TOPOLOGY>.p<N>`) and dead-letters
to `<TOPOLOGY>.dead`. CRASH_AFTER_WRITES=N makes it exit hard once a batch brings its writes to
N or more, before committing it: the batch is rolled back and redelivered.
"""

import datetime
import os
import sys

import pika
import psycopg
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
# What the broker adds to a message it delivers: not the message's own (WIRE.md).
BROKER_HEADERS = {
    "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
    "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", "x-delivery-count",
}

# WIRE.md, "Metadata": the contract's own headers, and the prefixes that are not the host's.
CONTRACT_HEADERS = {
    "wire_version", "kind", "tenant", "run", "branch", "lsn", "prev_lsn", "base_lsn",
    "parent_branch", "rewound_to", "created_at_us", "epoch", "prev_epoch", "causation_id",
    "traceparent", "tracestate",
}


def metadata(properties, headers):
    """An intent's metadata as WIRE.md (version 3 and later) says it travels; None when it has none."""
    meta = {}
    if headers.get("kind", "intent") == "intent" and properties.type \
            and not properties.type.startswith("outbox."):
        meta["type"] = properties.type
    if properties.content_type and properties.content_type != "application/octet-stream":
        meta["content_type"] = properties.content_type
    if properties.correlation_id:
        meta["correlation_id"] = properties.correlation_id
    for name in ("causation_id", "traceparent", "tracestate"):
        if headers.get(name) is not None:
            meta[name] = text(headers[name])
    own = {
        name: text(value)
        for name, value in headers.items()
        if name.lower() not in CONTRACT_HEADERS
        and not name.lower().startswith(("x-", "cloudevents"))
        and isinstance(value, (str, bytes))
    }
    if own:
        meta["headers"] = own
    return meta or None


def setting(name, default=None):
    value = os.environ.get(name, default)
    if value is None:
        sys.exit(f"{name} is not set")
    return value


def text(value):
    """A header's long string: pika gives str, or bytes when it is not UTF-8."""
    if value is None or isinstance(value, str):
        return value
    return value.decode("utf-8")


def main():
    topology = setting("TOPOLOGY")
    partitions = int(setting("PARTITIONS", "4"))
    crash_after = int(setting("CRASH_AFTER_WRITES", "0"))
    db = psycopg.connect(setting("DATABASE_URL"), autocommit=True)
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
    batch_events = int(setting("BATCH_EVENTS", "128"))
    writes = 0
    pending = []  # (method, properties, body) pushed by the broker, not folded yet

    def on_message(_channel, method, properties, body):
        pending.append((method, properties, body))

    def arguments(batch):
        """relay_fold_batch's arrays: one element per delivery, in delivery order."""
        columns = [[] for _ in range(14)]
        for _method, properties, body in batch:
            h = properties.headers or {}
            created = h.get("created_at_us")
            created_at = (
                datetime.datetime.fromtimestamp(created / 1e6, tz=datetime.timezone.utc)
                if created is not None
                else None
            )
            meta = metadata(properties, h)
            row = (
                text(h.get("tenant")), text(h.get("run")), text(h.get("branch")),
                text(h.get("kind")), h.get("lsn"), h.get("prev_lsn"), h.get("base_lsn"),
                text(h.get("parent_branch")), text(h.get("rewound_to")), created_at, body,
                meta and Jsonb(meta), h.get("epoch"), h.get("prev_epoch"),
            )
            for column, value in zip(columns, row):
                column.append(value)
        return columns

    def fold(batch):
        """Folds `batch` in one transaction; a refusal raises (rolled back)."""
        nonlocal writes
        with db.transaction():
            rows = db.execute(FOLD_BATCH, arguments(batch)).fetchall()
            # Also 'hold', 'duplicate', 'abandoned' and 'superseded' (a copy of history the
            # database replaced after a failover): nothing to apply. 'adopt' comes first when
            # an operator adopted a failover's history: the 'undo' rows after it remove what
            # the failover lost.
            for delivery, action, branch, lsn, _prev, _to, payload, row_meta in rows:
                h = batch[delivery - 1][1].headers or {}
                tenant, run = text(h.get("tenant")), text(h.get("run"))
                if action == "apply":
                    # Each row brings its body and metadata (those of a held-back intent as
                    # relay_fold kept them). A plain INSERT: a second apply of one (branch,
                    # lsn) would fail here.
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
                        "INSERT INTO py_runs_done (tenant, run) VALUES (%s, %s)",
                        (tenant, run),
                    )
            writes += len(batch)
            if crash_after and writes >= crash_after:
                print(f"crashing before commit, after {writes} writes", flush=True)
                os._exit(3)

    def handle(batch):
        """Folds `batch`, dead-letters what the fold refuses, then acks all of it."""
        while batch:
            try:
                fold(batch)
                break
            except psycopg.Error as error:
                if error.sqlstate not in REFUSED:
                    raise
                # A broken producer, a malformed message, a run retired after its retention,
                # a history that diverged after a failover: it will fail again. Into the
                # dead-letter queue with its reason, confirmed, and only then acked; the
                # others are folded again without it. The hint is "delivery N of the batch".
                index = int(error.diag.message_hint.split()[1]) - 1
                method, properties, body = batch.pop(index)
                reason = f"{error.sqlstate}: {error.diag.message_primary}"
                print(f"dead-lettering {properties.message_id}: {reason}", flush=True)
                dead_letter(body, properties, reason)
                channel.basic_ack(method.delivery_tag)
        # One ack for what was folded: every delivery up to its last (those before were acked
        # with earlier batches, a dead-lettered one on its own).
        if batch:
            channel.basic_ack(batch[-1][0].delivery_tag, multiple=True)

    connection = pika.BlockingConnection(pika.URLParameters(setting("AMQP_URL")))
    # Dead letters go out on a channel of their own, with publisher confirms: basic_publish
    # returns once the broker has the message (it raises if the broker refuses or cannot
    # route it, and the delivery is then neither acked nor lost).
    dead = connection.channel()
    dead.confirm_delivery()

    def dead_letter(body, properties, reason):
        headers = {
            name: value for name, value in (properties.headers or {}).items()
            if name not in BROKER_HEADERS
        }
        headers["x-relay-dead-letter-reason"] = reason
        dead.basic_publish(
            exchange="",
            routing_key=f"{topology}.dead",
            body=body,
            properties=pika.BasicProperties(
                headers=headers,
                message_id=properties.message_id,
                type=properties.type,
                content_type=properties.content_type,
                correlation_id=properties.correlation_id,
                delivery_mode=2,
            ),
            mandatory=True,
        )

    channel = connection.channel()
    # Room for a full batch while the previous one is folded.
    channel.basic_qos(prefetch_count=2 * batch_events)
    for partition in range(partitions):
        channel.basic_consume(f"{topology}.p{partition}", on_message)
    print("consuming", flush=True)
    try:
        while True:
            # Wait for a delivery, then fold what the broker has pushed, a batch at a time.
            connection.process_data_events(time_limit=None if not pending else 0)
            while pending:
                batch = pending[:batch_events]
                del pending[:batch_events]
                handle(batch)
    except KeyboardInterrupt:
        pass

if __name__ == "__main__":
    main()

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
`store::migrate_fold`). The fold itself is `fold.py`'s, shared with `consumer_nats.py` (the same
on NATS JetStream). It reads the default group's queues (`<TOPOLOGY>.p<N>`) and dead-letters
to `<TOPOLOGY>.dead`. CRASH_AFTER_WRITES=N makes it exit hard once a batch brings its writes to
N or more, before committing it: the batch is rolled back and redelivered.
"""

import os

import pika
import psycopg

from fold import fold, metadata, prepare, refused_at, setting

# What the broker adds to a message it delivers: not the message's own (WIRE.md).
BROKER_HEADERS = {
    "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
    "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", "x-delivery-count",
}


def text(value):
    """A header's long string: pika gives str, or bytes when it is not UTF-8."""
    if value is None or isinstance(value, str):
        return value
    return value.decode("utf-8")


def message(properties, body):
    """A delivery as fold.py takes it: the contract's fields off its AMQP headers."""
    h = properties.headers or {}
    texts = {name: text(value) for name, value in h.items() if isinstance(value, (str, bytes))}
    kind = texts.get("kind", "intent")
    fields = {
        name: texts.get(name)
        for name in ("tenant", "run", "branch", "kind", "parent_branch", "rewound_to")
    }
    fields.update({
        name: h.get(name)
        for name in ("lsn", "prev_lsn", "base_lsn", "created_at_us", "epoch", "prev_epoch")
    })
    fields["body"] = body
    fields["meta"] = metadata(
        kind, properties.type, properties.content_type, properties.correlation_id, texts
    )
    return fields


def main():
    topology = setting("TOPOLOGY")
    partitions = int(setting("PARTITIONS", "4"))
    crash_after = int(setting("CRASH_AFTER_WRITES", "0"))
    db = psycopg.connect(setting("DATABASE_URL"), autocommit=True)
    prepare(db)
    batch_events = int(setting("BATCH_EVENTS", "128"))
    writes = 0
    pending = []  # (method, properties, body) pushed by the broker, not folded yet

    def on_message(_channel, method, properties, body):
        pending.append((method, properties, body))

    def fold_batch(batch):
        """Folds `batch` in one transaction; a refusal raises (rolled back)."""
        nonlocal writes
        with db.transaction():
            fold(db, [message(properties, body) for _method, properties, body in batch])
            writes += len(batch)
            if crash_after and writes >= crash_after:
                print(f"crashing before commit, after {writes} writes", flush=True)
                os._exit(3)

    def handle(batch):
        """Folds `batch`, dead-letters what the fold refuses, then acks all of it."""
        while batch:
            try:
                fold_batch(batch)
                break
            except psycopg.Error as error:
                index = refused_at(error)
                if index is None:
                    raise
                # A broken producer, a malformed message, a run retired after its retention,
                # a history that diverged after a failover: it will fail again. Into the
                # dead-letter queue with its reason, confirmed, and only then acked; the
                # others are folded again without it. The hint is "delivery N of the batch".
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

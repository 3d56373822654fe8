"""A consumer in Python reading NATS JetStream, written from broker/WIRE.md ("On NATS
JetStream" and "What a consumer must do"): it projects the relay's events into its own table,
exactly once and in live-history order, through the fold's SQL function `relay_fold_batch`
(`fold.py`, shared with the RabbitMQ consumer `consumer.py`).

Each partition is the subject `<STREAM>.p<N>` of the relay's stream, read in stream order by an
ordered consumer (nothing is acked to the server): where the group is, per partition, is the
stream sequence after the last message it folded, stored with `relay_fold_save_offset` in the
transaction that folds the batch, and read back with `relay_fold_offset` at start. So a crash
anywhere leaves the batch unfolded and unstored, and the next start reads it again. One process
of a group reads a partition at a time: the one whose database session holds the partition's
advisory lock (`pg_try_advisory_lock(hashtextextended('nats:<STREAM>/<GROUP>/p<N>', 0))`, the
key the Rust consumer uses too); another waits. A message the fold refuses is kept in the stream
`<STREAM>_dead` under `<STREAM>_dead.<GROUP>` with its reason, stored by the server, before the
batch without it commits.

    NATS_URL=nats://127.0.0.1:4222 DATABASE_URL=postgres://... STREAM=outbox PARTITIONS=4 \
      GROUP=python python3 consumer_nats.py

CRASH_AFTER_WRITES=N makes it exit hard once a batch brings its writes to N or more, before
committing it.
"""

import asyncio
import os

import nats
import psycopg
from nats.js import api
from nats.js.errors import NotFoundError

from fold import NUMBER_HEADERS, fold, metadata, prepare, refused_at, setting


def message(msg):
    """A message as fold.py takes it: the contract's fields off its NATS headers (numbers in
    decimal; type, content type and correlation id in x-type, x-content-type,
    x-correlation-id)."""
    h = msg.headers or {}
    fields = {
        name: h.get(name)
        for name in ("tenant", "run", "branch", "kind", "parent_branch", "rewound_to")
    }
    for name in NUMBER_HEADERS - {"wire_version"}:
        fields[name] = int(h[name]) if h.get(name) is not None else None
    fields["body"] = msg.data
    fields["meta"] = metadata(
        h.get("kind", "intent"), h.get("x-type"), h.get("x-content-type"),
        h.get("x-correlation-id"), h,
    )
    return fields


async def main():
    stream = setting("STREAM")
    partitions = int(setting("PARTITIONS", "4"))
    group = setting("GROUP", "python")
    crash_after = int(setting("CRASH_AFTER_WRITES", "0"))
    batch_events = int(setting("BATCH_EVENTS", "128"))
    db = psycopg.connect(setting("DATABASE_URL"), autocommit=True)
    prepare(db)

    # One reader per partition and group: this session's advisory locks, held until it ends.
    keys = {p: f"nats:{stream}/{group}/p{p}" for p in range(partitions)}
    for p, key in keys.items():
        told = False
        while not db.execute(
            "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (key,)
        ).fetchone()[0]:
            if not told:
                print(f"partition {p} is read by another consumer of {group}; standing by",
                      flush=True)
                told = True
            await asyncio.sleep(1)

    nc = await nats.connect(setting("NATS_URL"))
    js = nc.jetstream()
    dead_stream = f"{stream}_dead"
    try:
        await js.stream_info(dead_stream)
    except NotFoundError:
        await js.add_stream(name=dead_stream, subjects=[f"{dead_stream}.*"],
                            storage=api.StorageType.FILE)

    queue = asyncio.Queue()
    # Below these nothing is folded: what was folded already, or before where a partition was
    # told to start (an ordered consumer that lost its server-side consumer before its first
    # message starts again from the stream's first).
    floors = {}
    for p, key in keys.items():
        stored = db.execute("SELECT relay_fold_offset(%s)", (key,)).fetchone()[0]
        floors[p] = stored or 0
        config = api.ConsumerConfig(opt_start_seq=stored) if stored else None
        policy = api.DeliverPolicy.BY_START_SEQUENCE if stored else api.DeliverPolicy.ALL

        async def take(msg, p=p):
            await queue.put((p, msg))

        await js.subscribe(f"{stream}.p{p}", stream=stream, cb=take, ordered_consumer=True,
                           deliver_policy=policy, config=config)
    print("consuming", flush=True)

    writes = 0

    async def dead_letter(msg, reason):
        headers = {
            name: value for name, value in (msg.headers or {}).items()
            if not name.lower().startswith("nats-")
        }
        headers["x-relay-dead-letter-reason"] = reason
        headers["Nats-Msg-Id"] = f"{group}.{msg.metadata.sequence.stream}"
        # Returns once the stream stored it (raises otherwise: nothing is then committed). A
        # duplicate answered with sequence 0 is a copy still in flight at the stream's leader,
        # not stored (NATS before 2.12): not an ack.
        ack = await js.publish(f"{dead_stream}.{group}", msg.data, stream=dead_stream,
                               headers=headers)
        if ack.duplicate and ack.seq == 0:
            raise RuntimeError("dead letter in flight at the stream's leader, not stored yet")

    async def handle(batch):
        """Folds `batch` with the positions past it, dead-letters what the fold refuses."""
        nonlocal writes
        positions = {}
        for p, msg in batch:
            positions[p] = msg.metadata.sequence.stream + 1
        while True:
            try:
                with db.transaction():
                    if batch:
                        fold(db, [message(msg) for _p, msg in batch])
                    for p, position in positions.items():
                        db.execute("SELECT relay_fold_save_offset(%s, %s)", (keys[p], position))
                    writes += len(batch)
                    if crash_after and writes >= crash_after:
                        print(f"crashing before commit, after {writes} writes", flush=True)
                        os._exit(3)
                return
            except psycopg.Error as error:
                index = refused_at(error)
                if index is None:
                    raise
                # It will fail again: kept as a dead letter, the rest folded without it (its
                # position is stored with them).
                _p, msg = batch.pop(index)
                reason = f"{error.sqlstate}: {error.diag.message_primary}"
                print(f"dead-lettering {(msg.headers or {}).get('Nats-Msg-Id')}: {reason}",
                      flush=True)
                await dead_letter(msg, reason)

    while True:
        taken = [await queue.get()]
        while len(taken) < batch_events and not queue.empty():
            taken.append(queue.get_nowait())
        batch = []
        for p, msg in taken:
            sequence = msg.metadata.sequence.stream
            if sequence >= floors[p]:
                floors[p] = sequence + 1
                batch.append((p, msg))
        if batch:
            await handle(batch)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass

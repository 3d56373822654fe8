//! Reading a stream partition: where to subscribe, and what each delivery's offset means
//! (pure).

use rabbit::StreamOffset;

use crate::config::StreamStart;

/// What a stream consumer does with a delivery at `offset` when it expects `expected` next
/// (pure). RabbitMQ's stream offsets are not dense: every segment after the first begins with
/// a tracking chunk that takes one offset and is never delivered (seen on 3.10). So one offset
/// missing is a segment boundary, and two or more are messages the stream's retention removed
/// before this consumer read them: the first retained segment begins with a tracking chunk,
/// so a removed message is always followed by a gap of at least two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamStep {
    /// Already folded (the broker started before the stored offset): ack it, nothing else.
    Skip,
    /// The next message: fold it and store `offset + 1` with the fold.
    Fold,
    /// Messages were lost to retention: stop and say so.
    Lost,
}

pub(crate) fn stream_step(expected: Option<u64>, offset: u64) -> StreamStep {
    match expected {
        None => StreamStep::Fold,
        Some(expected) if offset < expected => StreamStep::Skip,
        Some(expected) if offset <= expected + 1 => StreamStep::Fold,
        Some(_) => StreamStep::Lost,
    }
}

/// Where a stream subscription starts (`x-stream-offset`), for a consumer that expects
/// `expected` next (pure): there, once anything is stored or folded; else at `start`. On a
/// subscription made again (`again`) by a consumer that has nothing yet and started at
/// [`StreamStart::Next`], `None`: keep the first subscription, since `next` asked again would
/// skip what the first one was not told of.
pub(crate) fn subscribe_at(
    expected: Option<u64>,
    start: StreamStart,
    again: bool,
) -> Option<StreamOffset> {
    match expected {
        Some(next) => Some(StreamOffset::Offset(next)),
        None if again && start == StreamStart::Next => None,
        None => Some(start.offset()),
    }
}

//! What JetStream's answer to one publish means for its event: a pure function, property-tested,
//! the one place that reads the server's error codes.
use broker::Outcome;

/// The server's (or the client's) answer to one publish, in the terms that decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Stored (or recognised as a duplicate of a stored message: `duplicate: true` with its
    /// sequence) by the stream named `ours` or not.
    Stored {
        /// The ack named the stream the relay declared.
        ours: bool,
    },
    /// A copy with the same `Nats-Msg-Id` is in flight at the stream's leader, proposed to its
    /// replicas but not yet stored: servers before 2.12 answer `duplicate: true` with sequence
    /// 0, later ones refuse with 10158. Not known to be stored: a leader that loses its quorum
    /// drops it (seen on 2.9 and 2.10 in a partition: hundreds of events acked so and never
    /// stored, before this answer was told apart).
    InFlight,
    /// No stream listens on the subject ("no responders"): deleted, or electing a leader.
    NoStream,
    /// No answer within the ack timeout: perhaps stored.
    TimedOut,
    /// The connection dropped the request before an answer: perhaps stored.
    Lost,
    /// Larger than the server's `max_payload`: refused by the client before writing.
    PayloadTooLarge,
    /// The stream refused it with this JetStream error code.
    Refused(u64),
    /// The client refused it before writing, for another reason.
    Client,
}

/// What the publisher does with one answer: the event's outcome, and whether the session is
/// unusable (the publisher faults; its supervisor restarts it with backoff).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The event's outcome.
    pub outcome: Outcome,
    /// The session should be dropped.
    pub fault: bool,
}

/// JetStream error codes the relay reads (nats-server `server/errors.json`).
mod code {
    /// `JSStreamMessageExceedsMaximumErr`: larger than the stream's `max_msg_size`.
    pub(super) const MESSAGE_TOO_LARGE: u64 = 10054;
    /// `JSStreamNotMatchErr`: `Nats-Expected-Stream` is not the stream the subject maps to.
    pub(super) const WRONG_STREAM: u64 = 10060;
    /// `JSStreamStoreFailedF`: the stream's store refused the write (its `max_msgs`/`max_bytes`
    /// with discard new, or the disk).
    pub(super) const LIMITS_REACHED: u64 = 10077;
    /// `JSInsufficientResourcesErr`: the server's JetStream store is full (`max_file_store`).
    pub(super) const INSUFFICIENT_RESOURCES: u64 = 10023;
    /// `JSStorageResourcesExceededErr`: the account's storage is used up.
    pub(super) const STORAGE_EXCEEDED: u64 = 10047;
    /// `JSStreamDuplicateMessageConflict` (2.12 and later): a copy with this message id is in
    /// flight, not yet stored ([`super::Answer::InFlight`]).
    pub(super) const DUPLICATE_IN_FLIGHT: u64 = 10158;
}

/// Whether a stream's ack says the message is stored: not a `duplicate` answered with sequence
/// 0, which servers before 2.12 give for a copy still in flight at the leader (proposed, not
/// stored, and lost if the leader loses its quorum; [`Answer::InFlight`]).
pub(crate) fn ack_stored(ack: &async_nats::jetstream::publish::PublishAck) -> bool {
    !(ack.duplicate && ack.sequence == 0)
}

/// The verdict on one publish.
///
/// Only a stored message of the relay's own stream is accepted. An answer that leaves the
/// message's fate unknown (no answer, a lost connection) or says nothing was stored because
/// the stream is missing faults the session; a refusal that names the event (too large, the
/// wrong stream, storage refused) cools its branch and leaves the session alone.
pub fn attribute(answer: Answer) -> Verdict {
    let (outcome, fault) = match answer {
        Answer::Stored { ours: true } => (Outcome::Accepted, false),
        // Stored, but where no consumer of the relay's stream reads: routed nowhere of ours.
        Answer::Stored { ours: false } => (Outcome::Returned, false),
        Answer::NoStream => (Outcome::NotSent, true),
        Answer::TimedOut | Answer::Lost | Answer::InFlight => (Outcome::Unconfirmed, true),
        Answer::Refused(code::DUPLICATE_IN_FLIGHT) => (Outcome::Unconfirmed, true),
        Answer::PayloadTooLarge | Answer::Refused(code::MESSAGE_TOO_LARGE) => {
            (Outcome::TooLarge, false)
        }
        Answer::Refused(code::WRONG_STREAM) => (Outcome::Returned, false),
        // No room: the stream at its limits with discard new, or the server's store full. The
        // branch waits and is retried, never parked: the event is not at fault.
        Answer::Refused(
            code::LIMITS_REACHED | code::INSUFFICIENT_RESOURCES | code::STORAGE_EXCEEDED,
        ) => (Outcome::NoRoom, false),
        // Any other refusal of this message: the branch cools and is retried; parked only past
        // the nack grace, like a nack on RabbitMQ.
        Answer::Refused(_) => (Outcome::Nacked, false),
        Answer::Client => (Outcome::NotSent, true),
    };
    Verdict { outcome, fault }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn answers() -> impl Strategy<Value = Answer> {
        prop_oneof![
            any::<bool>().prop_map(|ours| Answer::Stored { ours }),
            Just(Answer::NoStream),
            Just(Answer::TimedOut),
            Just(Answer::Lost),
            Just(Answer::InFlight),
            Just(Answer::PayloadTooLarge),
            prop_oneof![
                Just(10054u64),
                Just(10060),
                Just(10077),
                Just(10023),
                Just(10047),
                Just(10158),
                10000u64..10200
            ]
            .prop_map(Answer::Refused),
            Just(Answer::Client),
        ]
    }

    proptest! {
        /// Accepted exactly when the relay's stream stored it; an unknown fate is never a
        /// refusal of the branch (it is resent, and the stream drops the copy by its id); every
        /// answer that is not a verdict on the event faults the session, so nothing waits on
        /// a session that cannot answer.
        #[test]
        fn only_a_stored_message_is_accepted_and_every_other_answer_is_acted_on(answer in answers()) {
            let verdict = attribute(answer);
            prop_assert_eq!(
                verdict.outcome == Outcome::Accepted,
                answer == Answer::Stored { ours: true }
            );
            if matches!(answer, Answer::TimedOut | Answer::Lost | Answer::InFlight | Answer::Refused(10158)) {
                prop_assert_eq!(verdict.outcome, Outcome::Unconfirmed);
            }
            let refuses_branch = matches!(
                verdict.outcome,
                Outcome::Nacked
                    | Outcome::NoRoom
                    | Outcome::Returned
                    | Outcome::TooLarge
                    | Outcome::Unwritable
            );
            prop_assert!(
                verdict.outcome == Outcome::Accepted || refuses_branch || verdict.fault,
                "{answer:?} -> {verdict:?} would leave its event waiting on nothing"
            );
            prop_assert!(!(refuses_branch && verdict.fault), "{answer:?}: one cause, not two");
        }
    }

    #[test]
    fn a_duplicate_with_sequence_0_is_no_ack() {
        let ack = |duplicate, sequence| async_nats::jetstream::publish::PublishAck {
            stream: "s".into(),
            sequence,
            domain: String::new(),
            duplicate,
            value: None,
        };
        assert!(ack_stored(&ack(false, 7)));
        assert!(ack_stored(&ack(true, 7)));
        assert!(!ack_stored(&ack(true, 0)));
    }

    #[test]
    fn the_server_codes_read() {
        assert_eq!(attribute(Answer::Refused(10054)).outcome, Outcome::TooLarge);
        assert_eq!(
            attribute(Answer::PayloadTooLarge).outcome,
            Outcome::TooLarge
        );
        assert_eq!(attribute(Answer::Refused(10060)).outcome, Outcome::Returned);
        assert_eq!(attribute(Answer::Refused(10077)).outcome, Outcome::NoRoom);
        assert_eq!(attribute(Answer::Refused(10023)).outcome, Outcome::NoRoom);
        assert_eq!(attribute(Answer::Refused(10071)).outcome, Outcome::Nacked);
        assert!(attribute(Answer::NoStream).fault);
        // A duplicate of a copy not yet stored is no ack.
        assert_eq!(attribute(Answer::InFlight).outcome, Outcome::Unconfirmed);
        assert_eq!(
            attribute(Answer::Refused(10158)).outcome,
            Outcome::Unconfirmed
        );
    }
}

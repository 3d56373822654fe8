//! What a fold's result means for its delivery (pure): fold it, dead-letter it, or retry it.
use store::{FoldError, FoldOutcome};

/// What to do with a delivery after trying to fold it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Folded(FoldOutcome),
    /// Dead-lettered, for `why` (its reason text starts with `why`'s label).
    DeadLetter(DeadReason, String),
    Retry(String),
}

/// Why a delivery is dead-lettered: the `reason` label of `relay_consumer_dead_letters_total`
/// and the fold span's `error.type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeadReason {
    /// Not an event of the contract, or refused by the store.
    Contract,
    /// Its `prev_lsn` is past what the branch applied.
    BrokenChain,
    /// Its run was retired.
    Retired,
    /// It shows the fold's history is not the database's (a failover lost commits the fold
    /// applied: WIRE.md, "Epochs").
    Diverged,
    /// The projection's permanent error.
    Handler,
}

impl DeadReason {
    pub(crate) fn label(self) -> &'static str {
        match self {
            DeadReason::Contract => "contract",
            DeadReason::BrokenChain => "broken_chain",
            DeadReason::Retired => "retired",
            DeadReason::Diverged => "diverged",
            DeadReason::Handler => "handler",
        }
    }

    /// The dead letter's reason text: `<label>: <why>`.
    pub(crate) fn reason(self, why: impl std::fmt::Display) -> String {
        format!("{}: {why}", self.label())
    }

    /// The dead letter's verdict, with its [`DeadReason::reason`].
    pub(crate) fn because(self, why: impl std::fmt::Display) -> Verdict {
        Verdict::DeadLetter(self, self.reason(why))
    }
}

impl Verdict {
    /// What failed, for the fold span's `error.type`: the dead letter's reason, `retry`, or
    /// `None` when it folded.
    pub(crate) fn error_type(&self) -> Option<&'static str> {
        match self {
            Verdict::Folded(_) => None,
            Verdict::DeadLetter(why, _) => Some(why.label()),
            Verdict::Retry(_) => Some("retry"),
        }
    }
}

/// What a fold's result means for its delivery (pure): folded (commit it, then ack the
/// delivery); dead-letter it (the chain is broken, the store refuses it for good, or the
/// handler says it will never succeed: the branch waits behind it); or retry it with backoff
/// (anything that may pass later). A dead letter's [`DeadReason`] labels the dead-letter metric.
pub(crate) fn verdict<E: std::fmt::Display>(
    folded: Result<FoldOutcome, FoldError<E>>,
    is_permanent: impl Fn(&E) -> bool,
) -> Verdict {
    match folded {
        Ok(outcome) => Verdict::Folded(outcome),
        Err(FoldError::Store(err @ store::Error::BrokenChain { .. })) => {
            DeadReason::BrokenChain.because(err)
        }
        Err(FoldError::Store(err @ store::Error::RetiredRun { .. })) => {
            DeadReason::Retired.because(err)
        }
        Err(FoldError::Store(err @ store::Error::Diverged { .. })) => {
            DeadReason::Diverged.because(err)
        }
        Err(FoldError::Store(err)) if err.is_transient() => {
            Verdict::Retry(format!("database: {err}"))
        }
        Err(FoldError::Store(err)) => DeadReason::Contract.because(err),
        Err(FoldError::Projection(err)) if is_permanent(&err) => DeadReason::Handler.because(err),
        Err(FoldError::Projection(err)) => Verdict::Retry(format!("handler: {err}")),
    }
}

//! Domain keys: who an intent belongs to and where it sits in its branch.
use std::fmt;
use std::sync::Arc;

/// Longest id accepted for a tenant, run or branch, in bytes. Keeps every AMQP short string the
/// relay builds from ids (message id, routing key) below the protocol's 255-byte limit.
pub const MAX_ID_BYTES: usize = 64;

/// An id refused at the door (empty, too long, or outside `[A-Za-z0-9_.:-]`). Nothing was
/// written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} {value:?}: {reason}")]
pub struct InvalidId {
    /// Which id (`tenant id`, `run id`, `branch id`, `schema`, ...).
    pub kind: &'static str,
    /// Why it was refused.
    pub reason: &'static str,
    /// The offending value (truncated).
    pub value: String,
}

/// An Lsn above PostgreSQL's bigint (`i64::MAX`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LsnOutOfRange(pub(crate) u64);

fn validate_id(kind: &'static str, value: &str) -> Result<(), InvalidId> {
    let reason = if value.is_empty() {
        "must not be empty"
    } else if value.len() > MAX_ID_BYTES {
        "must be at most 64 bytes"
    } else if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
    {
        "may contain only ASCII letters, digits and - _ . :"
    } else {
        return Ok(());
    };
    Err(InvalidId {
        kind,
        reason,
        value: value.chars().take(80).collect(),
    })
}

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Validates and wraps an id: 1 to 64 bytes of `[A-Za-z0-9_.:-]`.
            pub fn new(value: impl AsRef<str>) -> Result<Self, InvalidId> {
                let value = value.as_ref();
                validate_id($kind, value)?;
                Ok(Self(Arc::from(value)))
            }

            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.pad(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), &*self.0)
            }
        }
    };
}

id_newtype!(
    /// A tenant: the unit the relay drains and the first half of the broker partition key.
    TenantId,
    "tenant id"
);
id_newtype!(
    /// An agent run of a tenant: the second half of the broker partition key.
    RunId,
    "run id"
);
id_newtype!(
    /// A branch of a run. A rewind forks a new live branch; the old one's tail is abandoned.
    BranchId,
    "branch id"
);

/// Position of an intent in its branch. Ascends within a branch; 0 means "before the first".
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Lsn(u64);

impl Lsn {
    /// The position before any intent of a run's first branch.
    pub const ZERO: Lsn = Lsn(0);

    /// Wraps a position. Values above `i64::MAX` are refused when written (PostgreSQL bigint).
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The position as a number.
    pub const fn get(self) -> u64 {
        self.0
    }

    pub(crate) fn to_db(self) -> Result<i64, LsnOutOfRange> {
        i64::try_from(self.0).map_err(|_| LsnOutOfRange(self.0))
    }

    pub(crate) fn from_db(value: i64) -> Self {
        // Invariant: every stored Lsn went through `to_db`, so it is never negative.
        Self(value.max(0) as u64)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Tenant, run and branch: the unit of ordering. Order is promised per `BranchKey`, by `Lsn`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct BranchKey {
    /// Tenant that owns the run.
    pub tenant: TenantId,
    /// Run of the tenant.
    pub run: RunId,
    /// Branch of the run.
    pub branch: BranchId,
}

impl BranchKey {
    /// Groups the three ids.
    pub fn new(tenant: TenantId, run: RunId, branch: BranchId) -> Self {
        Self {
            tenant,
            run,
            branch,
        }
    }
}

impl fmt::Display for BranchKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.tenant, self.run, self.branch)
    }
}

/// `(BranchKey, Lsn)`: the identity of one intent, and the fold's idempotency key.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct EventKey {
    /// Branch of the intent.
    pub branch: BranchKey,
    /// Position of the intent in its branch.
    pub lsn: Lsn,
}

impl EventKey {
    /// A key read back from the database (ids re-validated).
    pub(crate) fn from_db(
        tenant: &TenantId,
        run: String,
        branch: String,
        lsn: i64,
    ) -> Result<Self, InvalidId> {
        Ok(Self {
            branch: BranchKey::new(tenant.clone(), RunId::new(run)?, BranchId::new(branch)?),
            lsn: Lsn::from_db(lsn),
        })
    }
}

impl fmt::Display for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.branch, self.lsn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bad ids are refused at the door, so they can never poison a message id or routing key.
    #[test]
    fn ids_are_validated_at_the_door() {
        assert!(TenantId::new("acme-01").is_ok());
        assert!(TenantId::new("").is_err());
        assert!(RunId::new("a/b").is_err());
        assert!(BranchId::new("x".repeat(65)).is_err());
        assert!(BranchId::new("x".repeat(64)).is_ok());
        let err = TenantId::new("").unwrap_err().to_string();
        assert!(err.contains("tenant id"), "{err}");
    }
}

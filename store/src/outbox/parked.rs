//! Parked branches (the broker kept refusing their events, or a row of theirs cannot be
//! read): parked, released, discarded, and why.
use std::time::Duration;

use crate::error::Error;
use crate::key::{BranchId, TenantId};

use super::*;

impl Outbox {
    /// Parks `branch`: the drain skips it for `retry_after`, its events wait in order. Called
    /// after repeated refusals; a confirmed event of the branch (or [`Outbox::release`])
    /// unparks it.
    pub async fn park_branch(
        &self,
        branch: &crate::key::BranchKey,
        reason: &str,
        attempts: u32,
        failing_for: Duration,
        retry_after: Duration,
    ) -> Result<(), Error> {
        sqlx::query(
            "INSERT INTO relay_parked_branch
                 (tenant_id, run_id, branch_id, reason, attempts, first_failed_at, retry_at)
             VALUES ($1, $2, $3, $4, $5, now() - $6 * interval '1 millisecond',
                     now() + $7 * interval '1 millisecond')
             ON CONFLICT (tenant_id, run_id, branch_id) DO UPDATE
                SET reason = EXCLUDED.reason,
                    attempts = relay_parked_branch.attempts + EXCLUDED.attempts,
                    parked_at = now(), retry_at = EXCLUDED.retry_at",
        )
        .bind(branch.tenant.as_str())
        .bind(branch.run.as_str())
        .bind(branch.branch.as_str())
        .bind(reason)
        .bind(i32::try_from(attempts).unwrap_or(i32::MAX))
        .bind(failing_for.as_millis().min(i64::MAX as u128) as i64)
        .bind(retry_after.as_millis().min(i64::MAX as u128) as i64)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Releases parked branches of `tenant` (all, one run's, or one branch): they are drained
    /// again at once (the relays are woken). Returns how many were released.
    pub async fn release(
        &self,
        tenant: &TenantId,
        run: Option<&crate::key::RunId>,
        branch: Option<&BranchId>,
    ) -> Result<u64, Error> {
        // `relay_release` (an operator's role may call it) also wakes the relays at once.
        let released: i64 = sqlx::query_scalar("SELECT relay_release($1, $2, $3)")
            .bind(tenant.as_str())
            .bind(run.map(crate::RunId::as_str))
            .bind(branch.map(BranchId::as_str))
            .fetch_one(&self.pool)
            .await?;
        let released = released.max(0) as u64;
        Ok(released)
    }

    /// Discards the waiting events of the parked live branch `branch` for good
    /// (`relay_discard_branch`), never as a silent gap: it is rewound at its last shipped Lsn to
    /// the new live branch `to`, so consumers get a rewind marker (undoing nothing they applied)
    /// and the run goes on on `to` (closed again if it was closed). The host's later appends
    /// to `branch` are refused as abandoned. Refused with [`Error::NotParked`] unless the
    /// branch is parked with events waiting.
    pub async fn discard_branch(
        &self,
        branch: &crate::key::BranchKey,
        to: &BranchId,
    ) -> Result<Discarded, Error> {
        let live = crate::BranchKey::new(branch.tenant.clone(), branch.run.clone(), to.clone());
        let (fork, discarded): (i64, i64) =
            sqlx::query_as("SELECT fork_lsn, discarded FROM relay_discard_branch($1, $2, $3, $4)")
                .bind(branch.tenant.as_str())
                .bind(branch.run.as_str())
                .bind(branch.branch.as_str())
                .bind(to.as_str())
                .fetch_one(&self.pool)
                .await
                .map_err(|err| crate::error::fork_refusal(err, branch, &live, None))?;
        Ok(Discarded {
            live,
            fork: Lsn::from_db(fork),
            discarded: discarded.max(0) as u64,
        })
    }

    /// Every parked branch, with its reason, age and pending events (`relay_parked_status`,
    /// which an operator's role may read).
    pub async fn parked_branches(&self) -> Result<Vec<ParkedBranch>, Error> {
        type Row = (String, String, String, String, i32, f64, f64, i64);
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT tenant_id, run_id, branch_id, reason, attempts, failing_for_secs,
                    retry_in_secs, pending
               FROM relay_parked_status
              ORDER BY tenant_id, run_id, branch_id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(
                |(tenant, run, branch, reason, attempts, failing, retry, pending)| {
                    Ok(ParkedBranch {
                        branch: crate::BranchKey::new(
                            TenantId::new(tenant)?,
                            crate::RunId::new(run)?,
                            BranchId::new(branch)?,
                        ),
                        cause: ParkCause::of_reason(&reason),
                        reason,
                        attempts: attempts.max(0) as u32,
                        failing_for: Duration::from_secs_f64(failing.max(0.0)),
                        retry_in: Duration::from_secs_f64(retry.max(0.0)),
                        pending: pending.max(0) as u64,
                    })
                },
            )
            .collect()
    }
}

/// Why a branch is parked, by cause: what the operator is told, and the way out. The one
/// place that reads a park's stored reason (the label of the broker's refusal,
/// `broker::Outcome::label`: `nacked`, `returned`, `too_large` or `unwritable`; or the drainer's
/// `unreadable: lsn N: ...`); the console, `status`, the
/// `RelayBranchParked` alert and docs/operations.md ("Parked branches") say the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ParkCause {
    /// The broker nacked its events for longer than the nack grace.
    Nacked,
    /// The broker returned its events as unroutable: no queue is bound for their key.
    Unroutable,
    /// An event is larger than the broker accepts.
    TooLarge,
    /// An event has a header the broker cannot carry (NATS: a value with a line break).
    Unwritable,
    /// A row of it cannot be read (its metadata does not decode).
    Unreadable,
    /// A reason this version does not know (written by another version of the relay).
    Other,
}

impl ParkCause {
    /// Every cause, in the order the docs list them.
    pub const ALL: [ParkCause; 6] = [
        ParkCause::Nacked,
        ParkCause::Unroutable,
        ParkCause::TooLarge,
        ParkCause::Unwritable,
        ParkCause::Unreadable,
        ParkCause::Other,
    ];

    /// The cause of a stored reason.
    pub fn of_reason(reason: &str) -> Self {
        let word = reason.split(':').next().unwrap_or_default().trim();
        match word {
            "nacked" => Self::Nacked,
            "returned" => Self::Unroutable,
            "too_large" => Self::TooLarge,
            "unwritable" => Self::Unwritable,
            "unreadable" => Self::Unreadable,
            _ => Self::Other,
        }
    }

    /// A short name for tables.
    pub fn label(self) -> &'static str {
        match self {
            Self::Nacked => "broker nacked",
            Self::Unroutable => "unroutable",
            Self::TooLarge => "too large",
            Self::Unwritable => "unwritable",
            Self::Unreadable => "unreadable row",
            Self::Other => "other",
        }
    }

    /// What happened, in one sentence.
    pub fn what(self) -> &'static str {
        match self {
            Self::Nacked => {
                "the broker refused (nacked) its events for longer than the nack grace: a queue at its length limit with reject-publish, a quorum queue without a majority, or a broker fault"
            }
            Self::Unroutable => {
                "the broker returned its events: no queue is bound for their partition (a group's queue deleted or never declared)"
            }
            Self::TooLarge => "an event is larger than the broker's max_message_size",
            Self::Unwritable => {
                "an event has a header NATS cannot carry unchanged (a value with a line break or whitespace at either end, a `Nats-*` or `ce-*` name); only rows written before the store's migrations 18 and 19, which refuse them at append (or, with CloudEvents, a host `Content-Type` of `application/cloudevents...`)"
            }
            Self::Unreadable => {
                "a row of it cannot be read by this relay (its metadata does not decode: written past relay_append, or by a newer schema); the intents before it shipped"
            }
            Self::Other => "a reason this version of the relay does not know",
        }
    }

    /// What to do about it.
    pub fn way_out(self) -> &'static str {
        match self {
            Self::Nacked => {
                "fix the queue or the broker (its log names why), then Release; it is retried on its own after `RELAY_PARK_RETRY_MS` too"
            }
            Self::Unroutable => {
                "declare the group's queues again (start its consumer, or `distribution group create`), then Release"
            }
            Self::TooLarge => {
                "raise max_message_size on the broker, then Release; or Discard the branch (its waiting events are dropped for good)"
            }
            Self::Unwritable => {
                "correct the row's `meta` (or Discard the branch: its waiting events are dropped for good), then Release"
            }
            Self::Unreadable => {
                "repair the row named in the reason (or upgrade the relay), then Release: a release before the repair parks it again at once"
            }
            Self::Other => "read the reason; Release once its cause is gone",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ParkCause;

    #[test]
    fn each_stored_reason_has_its_cause() {
        for (reason, cause) in [
            ("nacked", ParkCause::Nacked),
            ("returned", ParkCause::Unroutable),
            ("too_large", ParkCause::TooLarge),
            ("unwritable", ParkCause::Unwritable),
            (
                "unreadable: lsn 2: metadata: unknown field `priority`",
                ParkCause::Unreadable,
            ),
            ("something new", ParkCause::Other),
            ("", ParkCause::Other),
        ] {
            assert_eq!(ParkCause::of_reason(reason), cause, "{reason}");
        }
        let labels: std::collections::BTreeSet<_> =
            ParkCause::ALL.iter().map(|cause| cause.label()).collect();
        assert_eq!(
            labels.len(),
            ParkCause::ALL.len(),
            "labels tell causes apart"
        );
    }

    /// docs/operations.md's table of park causes says what the code says.
    #[test]
    fn the_operations_guide_lists_each_cause_with_its_way_out() {
        let guide = include_str!("../../../docs/operations.md").replace('`', "");
        for cause in ParkCause::ALL {
            let row = guide
                .lines()
                .find(|line| line.starts_with(&format!("| {} ", cause.label())))
                .unwrap_or_else(|| panic!("no row for {}", cause.label()));
            assert!(
                row.contains(&cause.way_out().replace('`', "")),
                "{row}\n{}",
                cause.way_out()
            );
        }
    }
}

//! Branches the broker keeps refusing: parked, released, discarded.
use std::time::Duration;

use crate::{BranchId, Error, TenantId};

use super::*;

impl Outbox {
    /// Parks `branch`: the drain skips it for `retry_after`, its events wait in order. Called
    /// after repeated refusals; a confirmed event of the branch (or [`Outbox::release`])
    /// unparks it.
    pub async fn park_branch(
        &self,
        branch: &crate::BranchKey,
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
        run: Option<&crate::RunId>,
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
        branch: &crate::BranchKey,
        to: &BranchId,
    ) -> Result<Discarded, Error> {
        let (fork, discarded): (i64, i64) =
            sqlx::query_as("SELECT fork_lsn, discarded FROM relay_discard_branch($1, $2, $3, $4)")
                .bind(branch.tenant.as_str())
                .bind(branch.run.as_str())
                .bind(branch.branch.as_str())
                .bind(to.as_str())
                .fetch_one(&self.pool)
                .await
                .map_err(|err| match crate::error::sql_state(&err).as_deref() {
                    Some("RL111") => Error::NotParked {
                        branch: branch.clone(),
                    },
                    Some("RL104") => Error::UnknownBranch {
                        branch: branch.clone(),
                    },
                    Some("RL105") => Error::BranchAbandoned {
                        branch: branch.clone(),
                        at: Lsn::from_db(
                            crate::error::detail_value(&err, "abandoned_at_lsn").unwrap_or(0),
                        ),
                    },
                    Some("RL107") | Some("23505") => Error::BranchExists {
                        branch: crate::BranchKey::new(
                            branch.tenant.clone(),
                            branch.run.clone(),
                            to.clone(),
                        ),
                    },
                    _ => Error::Database(err),
                })?;
        Ok(Discarded {
            live: crate::BranchKey::new(branch.tenant.clone(), branch.run.clone(), to.clone()),
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

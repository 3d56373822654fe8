//! What waits: pending tenants, backlog and oldest age, readiness facts.
use std::time::Duration;

use crate::error::Error;
use crate::key::TenantId;

use super::*;

impl Outbox {
    /// Whether any intent waits, and how many branches are parked: two index probes, for a
    /// readiness check that must stay cheap however large the backlog.
    pub async fn pending_and_parked(&self) -> Result<(bool, u64), Error> {
        let (pending, parked): (bool, i64) = sqlx::query_as(
            "SELECT EXISTS (SELECT 1 FROM relay_outbox), (SELECT count(*) FROM relay_parked_branch)",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok((pending, parked.max(0) as u64))
    }

    /// The tenants that have pending intents (a skip scan over the drain index: one index probe
    /// per tenant, however large the backlog).
    pub async fn tenants_with_pending(&self) -> Result<Vec<TenantId>, Error> {
        let tenants: Vec<String> = sqlx::query_scalar(
            "WITH RECURSIVE t(tenant_id) AS (
                 (SELECT tenant_id FROM relay_outbox ORDER BY tenant_id LIMIT 1)
                 UNION ALL
                 SELECT (SELECT o.tenant_id FROM relay_outbox o
                          WHERE o.tenant_id > t.tenant_id ORDER BY o.tenant_id LIMIT 1)
                   FROM t WHERE t.tenant_id IS NOT NULL
             )
             SELECT tenant_id FROM t WHERE tenant_id IS NOT NULL",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(tenants
            .into_iter()
            .map(TenantId::new)
            .collect::<Result<_, _>>()?)
    }

    /// Pending intents (counted up to `cap`) and the age of the oldest, for `tenants` (in
    /// their order; a tenant without intents reads as zero): the
    /// lag gauges' read. Its cost is at most `cap` index entries and one index probe per
    /// tenant, whatever the backlog (the full [`Outbox::backlog`] counts every row).
    pub async fn backlog_of(&self, tenants: &[TenantId], cap: u32) -> Result<Vec<Backlog>, Error> {
        let names: Vec<&str> = tenants.iter().map(TenantId::as_str).collect();
        let rows: Vec<(String, i64, Option<f64>)> = sqlx::query_as(
            "SELECT t.tenant_id,
                    (SELECT count(*) FROM (SELECT 1 FROM relay_outbox o
                                            WHERE o.tenant_id = t.tenant_id LIMIT $2) AS capped),
                    (SELECT extract(epoch FROM clock_timestamp() - o.created_at)::float8
                       FROM relay_outbox o WHERE o.tenant_id = t.tenant_id
                      ORDER BY o.seq LIMIT 1)
               FROM unnest($1::text[]) WITH ORDINALITY AS t(tenant_id, ord)
              ORDER BY t.ord",
        )
        .bind(&names)
        .bind(i64::from(cap))
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(tenant, pending, age_secs)| {
                Backlog::from_row(tenant, pending, age_secs.unwrap_or(0.0))
            })
            .collect()
    }

    /// Pending intents and the age of the oldest, per tenant with pending work, by tenant
    /// (`relay_backlog_status`, which an operator's role may read).
    pub async fn backlog(&self) -> Result<Vec<Backlog>, Error> {
        let rows: Vec<(String, i64, f64)> = sqlx::query_as(
            "SELECT tenant_id, pending, oldest_age_secs FROM relay_backlog_status
              ORDER BY tenant_id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|(tenant, pending, age_secs)| Backlog::from_row(tenant, pending, age_secs))
            .collect()
    }

    /// One page of [`Outbox::backlog`], the oldest waits first (then by tenant), and how many
    /// tenants have intents waiting in all.
    pub async fn backlog_worst_first(
        &self,
        offset: u64,
        limit: u32,
    ) -> Result<(Vec<Backlog>, u64), Error> {
        let rows: Vec<(String, i64, f64, i64)> = sqlx::query_as(
            "SELECT tenant_id, pending, oldest_age_secs, count(*) OVER ()
               FROM relay_backlog_status
              ORDER BY oldest_age_secs DESC, tenant_id
             OFFSET $1 LIMIT $2",
        )
        .bind(i64::try_from(offset).unwrap_or(i64::MAX))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let total = match rows.first() {
            Some(row) => row.3.max(0) as u64,
            // Past the last page: count them alone.
            None if offset > 0 => {
                let total: i64 = sqlx::query_scalar("SELECT count(*) FROM relay_backlog_status")
                    .fetch_one(&self.pool)
                    .await?;
                total.max(0) as u64
            }
            None => 0,
        };
        let page = rows
            .into_iter()
            .map(|(tenant, pending, age_secs, _)| Backlog::from_row(tenant, pending, age_secs))
            .collect::<Result<_, _>>()?;
        Ok((page, total))
    }

    /// The age of the oldest intent waiting, of any tenant (zero when none waits): one index
    /// probe per tenant with intents waiting (`relay_oldest_wait`, which an operator's role may
    /// read), never a pass over every row.
    pub async fn oldest_wait(&self) -> Result<Duration, Error> {
        let age: Option<f64> = sqlx::query_scalar("SELECT oldest_age_secs FROM relay_oldest_wait")
            .fetch_one(&self.pool)
            .await?;
        Ok(Duration::from_secs_f64(age.unwrap_or(0.0).max(0.0)))
    }

    /// The relays alive, by id: how long each has been a member and how many lease buckets
    /// it holds (`relay_relays_status`).
    pub async fn relays(&self) -> Result<Vec<RelayShare>, Error> {
        let rows: Vec<(String, f64, i64)> = sqlx::query_as(
            "SELECT relay_id, member_for_secs, buckets FROM relay_relays_status ORDER BY relay_id",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(relay, member_for, buckets)| RelayShare {
                relay,
                member_for: Duration::from_secs_f64(member_for.max(0.0)),
                buckets: buckets.max(0) as u64,
            })
            .collect())
    }

    /// Backlog of one tenant (zero pending if it has none), through `relay_backlog_status`
    /// (which an operator's role may read).
    pub async fn tenant_backlog(&self, tenant: &TenantId) -> Result<Backlog, Error> {
        let row: Option<(i64, f64)> = sqlx::query_as(
            "SELECT pending, oldest_age_secs FROM relay_backlog_status WHERE tenant_id = $1",
        )
        .bind(tenant.as_str())
        .fetch_optional(&self.pool)
        .await?;
        let (pending, age_secs) = row.unwrap_or((0, 0.0));
        Ok(Backlog {
            tenant: tenant.clone(),
            pending: pending.max(0) as u64,
            oldest_age: Duration::from_secs_f64(age_secs.max(0.0)),
        })
    }

    /// The branches of `tenant` with intents waiting, the oldest waits first, at most `limit`
    /// of them, and how many there are in all (`relay_branch_status`, which an operator's role
    /// may read).
    pub async fn tenant_branches(
        &self,
        tenant: &TenantId,
        limit: u32,
    ) -> Result<(Vec<BranchBacklog>, u64), Error> {
        type Row = (String, String, i64, i64, i64, f64, i64);
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT run_id, branch_id, pending, first_lsn, last_lsn, oldest_age_secs,
                    count(*) OVER ()
               FROM relay_branch_status
              WHERE tenant_id = $1
              ORDER BY oldest_age_secs DESC, run_id, branch_id
              LIMIT $2",
        )
        .bind(tenant.as_str())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let total = rows.first().map_or(0, |row| row.6.max(0) as u64);
        let branches = rows
            .into_iter()
            .map(|(run, branch, pending, first, last, age_secs, _)| {
                Ok(BranchBacklog {
                    branch: crate::BranchKey::new(
                        tenant.clone(),
                        crate::RunId::new(run)?,
                        crate::BranchId::new(branch)?,
                    ),
                    pending: pending.max(0) as u64,
                    first: crate::Lsn::from_db(first),
                    last: crate::Lsn::from_db(last),
                    oldest_age: Duration::from_secs_f64(age_secs.max(0.0)),
                })
            })
            .collect::<Result<_, Error>>()?;
        Ok((branches, total))
    }
}

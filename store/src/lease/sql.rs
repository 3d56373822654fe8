//! The lease tables' SQL: membership, heartbeats, claims, releases.
use std::time::Duration;

use sqlx::PgPool;

use super::*;
use crate::error::Error;

/// The lease tables' SQL. Cheap to clone (a pool handle). Give it its own small pool, so
/// heartbeats never queue behind drains.
#[derive(Clone, Debug)]
pub struct LeaseStore {
    pool: PgPool,
}

/// One row of `relay_lease` as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRow {
    /// The bucket.
    pub bucket: Bucket,
    /// Its owner (`None` once released, or never claimed).
    pub owner: Option<String>,
    /// Its epoch.
    pub epoch: LeaseEpoch,
    /// Its beat: drawn anew by every change of the row.
    pub beat: i64,
    /// The TTL its last writer gave it.
    pub ttl: Duration,
}

/// One row of `relay_member` as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberRow {
    /// The member.
    pub relay: String,
    /// Its beat: drawn anew by every heartbeat.
    pub beat: i64,
}

/// A bucket that may be claimed, with the epoch and beat PostgreSQL must still find.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claimable {
    /// The bucket.
    pub bucket: Bucket,
    /// The epoch seen.
    pub epoch: LeaseEpoch,
    /// The beat seen.
    pub beat: i64,
}

fn ms(duration: Duration) -> i64 {
    duration.as_millis().min(i64::MAX as u128) as i64
}

fn buckets(rows: Vec<(i32, i64)>) -> Vec<(Bucket, LeaseEpoch)> {
    rows.into_iter()
        .map(|(bucket, epoch)| {
            (
                Bucket(bucket.clamp(0, i32::from(u16::MAX)) as u16),
                LeaseEpoch(epoch),
            )
        })
        .collect()
}

impl LeaseStore {
    /// The lease tables on `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Registers (or renews) relay `me` as a member (a renewal draws its row a new beat) (`ttl` sets the row's
    /// `expires_at`, which only the status views read); returns every member row, its own
    /// included. Rows an hour past their expiry (by PostgreSQL's clock) are deleted; one
    /// deleted while its relay lives is written again at its next heartbeat.
    pub async fn heartbeat(&self, me: &RelayId, ttl: Duration) -> Result<Vec<MemberRow>, Error> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "WITH up AS (
                 INSERT INTO relay_member (relay_id, expires_at)
                 VALUES ($1, now() + $2 * interval '1 millisecond')
                 ON CONFLICT (relay_id) DO UPDATE SET expires_at = EXCLUDED.expires_at
                 RETURNING relay_id, beat
             ), gone AS (
                 DELETE FROM relay_member
                  WHERE expires_at < now() - interval '1 hour' AND relay_id <> $1
             )
             SELECT relay_id, beat FROM relay_member WHERE relay_id <> $1
             UNION ALL SELECT relay_id, beat FROM up",
        )
        .bind(me.as_str())
        .bind(ms(ttl))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(relay, beat)| MemberRow { relay, beat })
            .collect())
    }

    /// Every lease row, for the supervisor's sightings (which buckets a claim may take).
    pub async fn survey(&self) -> Result<Vec<LeaseRow>, Error> {
        let rows: Vec<(i32, Option<String>, i64, i64, i64)> = sqlx::query_as(
            "SELECT bucket, owner, epoch, beat, ttl_ms FROM relay_lease ORDER BY bucket",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(bucket, owner, epoch, beat, ttl_ms)| LeaseRow {
                bucket: Bucket(bucket.clamp(0, i32::from(u16::MAX)) as u16),
                owner,
                epoch: LeaseEpoch(epoch),
                beat,
                ttl: Duration::from_millis(ttl_ms.max(0) as u64),
            })
            .collect())
    }

    /// Renews exactly the leases `held` (bucket, epoch) that `me` still owns at those epochs
    /// (each draws a new beat and records `ttl`); returns those. Only what the caller still holds is renewed: a
    /// lease it dropped (its fence lapsed) must go stale, or nobody could ever claim that
    /// bucket again. No clock is read: a lease nobody claimed is still the caller's.
    pub async fn renew(
        &self,
        me: &RelayId,
        ttl: Duration,
        held: &[(Bucket, LeaseEpoch)],
    ) -> Result<Vec<(Bucket, LeaseEpoch)>, Error> {
        let buckets_held: Vec<i32> = held.iter().map(|(b, _)| i32::from(b.0)).collect();
        let epochs: Vec<i64> = held.iter().map(|(_, e)| e.0).collect();
        let rows: Vec<(i32, i64)> = sqlx::query_as(
            "UPDATE relay_lease l SET expires_at = now() + $2 * interval '1 millisecond'
               FROM unnest($3::int[], $4::bigint[]) AS h(bucket, epoch)
              WHERE l.bucket = h.bucket AND l.epoch = h.epoch AND l.owner = $1
             RETURNING l.bucket, l.epoch",
        )
        .bind(me.as_str())
        .bind(ms(ttl))
        .bind(&buckets_held)
        .bind(&epochs)
        .fetch_all(&self.pool)
        .await?;
        Ok(buckets(rows))
    }

    /// Claims for `me`, each with a new epoch, up to `n` of the `candidates` (what the
    /// supervisor's sightings found claimable) whose rows still have the epoch and beat seen. Buckets that
    /// another relay is claiming, or whose old owner is acking right now, are skipped (taken
    /// on a later heartbeat). FOR UPDATE waits for no one and conflicts with the FOR KEY SHARE
    /// of a fenced ack, so an ack and a takeover never overlap.
    pub async fn claim(
        &self,
        me: &RelayId,
        ttl: Duration,
        n: u16,
        candidates: &[Claimable],
    ) -> Result<Vec<(Bucket, LeaseEpoch)>, Error> {
        if n == 0 || candidates.is_empty() {
            return Ok(Vec::new());
        }
        let wanted: Vec<i32> = candidates.iter().map(|c| i32::from(c.bucket.0)).collect();
        let epochs: Vec<i64> = candidates.iter().map(|c| c.epoch.0).collect();
        let beats: Vec<i64> = candidates.iter().map(|c| c.beat).collect();
        let rows: Vec<(i32, i64)> = sqlx::query_as(
            "UPDATE relay_lease l
                SET owner = $1, epoch = l.epoch + 1,
                    expires_at = now() + $2 * interval '1 millisecond'
               FROM (SELECT r.bucket FROM relay_lease r
                      WHERE (r.bucket, r.epoch, r.beat) IN (
                                SELECT * FROM unnest($4::int[], $5::bigint[], $6::bigint[]))
                      ORDER BY r.bucket
                      LIMIT $3
                      FOR UPDATE SKIP LOCKED) free
              WHERE l.bucket = free.bucket
             RETURNING l.bucket, l.epoch",
        )
        .bind(me.as_str())
        .bind(ms(ttl))
        .bind(i64::from(n))
        .bind(&wanted)
        .bind(&epochs)
        .bind(&beats)
        .fetch_all(&self.pool)
        .await?;
        Ok(buckets(rows))
    }

    /// Releases `leases` of `me` (already revoked locally) so others may claim them at once
    /// (a free row is claimable without waiting for it to go stale).
    pub async fn release(
        &self,
        me: &RelayId,
        leases: &[(Bucket, LeaseEpoch)],
    ) -> Result<(), Error> {
        if leases.is_empty() {
            return Ok(());
        }
        let buckets: Vec<i32> = leases.iter().map(|(b, _)| i32::from(b.0)).collect();
        let epochs: Vec<i64> = leases.iter().map(|(_, e)| e.0).collect();
        sqlx::query(
            "UPDATE relay_lease l SET owner = NULL, expires_at = '-infinity'
               FROM unnest($2::int[], $3::bigint[]) AS r(bucket, epoch)
              WHERE l.bucket = r.bucket AND l.epoch = r.epoch AND l.owner = $1",
        )
        .bind(me.as_str())
        .bind(&buckets)
        .bind(&epochs)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Leaves the membership (graceful shutdown), so the others' shares grow at once.
    pub async fn leave(&self, me: &RelayId) -> Result<(), Error> {
        sqlx::query("DELETE FROM relay_member WHERE relay_id = $1")
            .bind(me.as_str())
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

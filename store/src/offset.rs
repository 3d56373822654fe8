//! Stream offsets kept in the fold's own database (`relay_fold_offset`), so that a consumer of a
//! RabbitMQ stream stores where it is in the very transaction that folds a message: a restart
//! resumes exactly after the last folded message, with no redelivery window.
use sqlx::PgConnection;

use crate::error::Error;

/// The offset a consumer of stream `queue` resumes at: the `x-stream-offset` of the message
/// after the last one it folded. `None`: nothing stored yet (a new group, or one reset).
pub async fn stream_offset(conn: &mut PgConnection, queue: &str) -> Result<Option<u64>, Error> {
    let next: Option<i64> = sqlx::query_scalar("SELECT relay_fold_offset($1)")
        .bind(queue)
        .fetch_one(conn)
        .await?;
    Ok(next.map(|next| next.max(0) as u64))
}

/// Stores `next` (the folded message's `x-stream-offset` + 1) as `queue`'s resume point, in the
/// caller's transaction. An offset never moves back: a smaller `next` leaves the stored one.
pub async fn save_stream_offset(
    conn: &mut PgConnection,
    queue: &str,
    next: u64,
) -> Result<(), Error> {
    // RabbitMQ's offsets stay far below 2^63.
    let next = i64::try_from(next).unwrap_or(i64::MAX);
    sqlx::query("SELECT relay_fold_save_offset($1, $2)")
        .bind(queue)
        .bind(next)
        .execute(conn)
        .await?;
    Ok(())
}

/// Forgets everything the fold knows (branch cursors, held-back events, retired horizons, the
/// [`crate::fold::EventTable`] events, stream offsets) and returns how many branches it knew: the
/// first step of rebuilding a projection from a stream's first retained offset. Call it in the
/// transaction that empties your projection's own tables, with the group's consumers stopped.
pub async fn reset_fold(conn: &mut PgConnection) -> Result<u64, Error> {
    let branches: i64 = sqlx::query_scalar("SELECT relay_fold_reset()")
        .fetch_one(conn)
        .await?;
    Ok(branches.max(0) as u64)
}

/// Arms `branch` after a divergence (WIRE.md, "Epochs"; docs/operations.md, "After a
/// failover"): its next diverged message that begins an epoch is adopted (the fold undoes what
/// the failover lost, through the projection's `rewind`, then folds it). Replay the branch's
/// dead letters in order after. False when the fold has no state for the branch.
pub async fn adopt_branch(
    conn: &mut PgConnection,
    branch: &crate::key::BranchKey,
) -> Result<bool, Error> {
    let armed: bool = sqlx::query_scalar("SELECT relay_fold_adopt($1, $2, $3)")
        .bind(branch.tenant.as_str())
        .bind(branch.run.as_str())
        .bind(branch.branch.as_str())
        .fetch_one(conn)
        .await?;
    Ok(armed)
}

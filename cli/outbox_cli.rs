//! The commands on the outbox's database: `migrate`, `sql`, `roles`, `discard`, `retire`,
//! `status` and `release`.
use anyhow::{Context, Result};

use distribution::store::{self, Outbox};

use crate::letters::{GroupBroker, GroupLetters};
use crate::{Database, connect, dead_cli, demo};

/// Which of the relay's databases a command works on (its `--fold` or `--fold-database`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tables {
    /// The host's database: the outbox, with the fold beside it.
    Outbox,
    /// A consumer's own database: the fold's tables alone.
    FoldOnly,
}

impl Tables {
    /// The tables a command's `--fold` flag names.
    pub(crate) fn of(fold: bool) -> Self {
        if fold { Self::FoldOnly } else { Self::Outbox }
    }
}

/// Every migration's SQL, in order, each under a comment with its version: what
/// `distribution migrate` applies (and records in `relay_migrations`).
pub(crate) fn print_sql(tables: Tables) {
    let migrator = match tables {
        Tables::FoldOnly => &*store::FOLD_MIGRATOR,
        Tables::Outbox => &*store::MIGRATOR,
    };
    for migration in migrator.iter() {
        println!(
            "-- relay migration {} ({})\n{}\n",
            migration.version,
            migration.description,
            migration.sql.as_str().trim_end()
        );
    }
}

/// The grants of `distribution roles`.
pub(crate) fn print_roles(
    roles: store::Roles,
    tables: Tables,
    schema: Option<&store::Schema>,
) -> Result<()> {
    if roles.host.is_none()
        && roles.relay.is_none()
        && roles.consumer.is_none()
        && roles.operator.is_none()
    {
        anyhow::bail!("name at least one role: --host, --relay, --consumer or --operator");
    }
    if tables == Tables::FoldOnly
        && (roles.host.is_some() || roles.relay.is_some() || roles.operator.is_some())
    {
        anyhow::bail!("a consumer's database (--fold-database) has grants for --consumer only");
    }
    let on = match tables {
        Tables::FoldOnly => store::RolesFor::Fold,
        Tables::Outbox => store::RolesFor::Outbox,
    };
    print!("{}", store::roles_sql(&roles, on, schema)?);
    Ok(())
}

pub(crate) async fn migrate_in(url: &str, schema: Option<&store::Schema>) -> Result<()> {
    let pool = connect(url, schema).await?;
    if let Some(schema) = schema {
        // Two relays starting at once can race on CREATE SCHEMA IF NOT EXISTS: once more.
        if store::create_schema(&pool, schema).await.is_err() {
            store::create_schema(&pool, schema)
                .await
                .with_context(|| format!("cannot create schema {schema} (RELAY_SCHEMA)"))?;
        }
    }
    store::migrate(&pool).await?;
    Ok(())
}

pub(crate) async fn migrate(database: &Database, tables: Tables) -> Result<()> {
    if tables == Tables::FoldOnly {
        let pool = connect(&database.database_url, database.schema.as_ref()).await?;
        if let Some(schema) = &database.schema {
            store::create_schema(&pool, schema).await?;
        }
        store::migrate_fold(&pool).await?;
        println!("fold schema is up to date");
        return Ok(());
    }
    migrate_in(&database.database_url, database.schema.as_ref()).await?;
    println!("outbox schema is up to date");
    Ok(())
}

pub(crate) async fn discard(
    database: &Database,
    tenant: String,
    run: String,
    branch: String,
    to: Option<String>,
) -> Result<()> {
    use distribution::store::{BranchId, BranchKey, RunId, TenantId};
    let key = BranchKey::new(
        TenantId::new(tenant)?,
        RunId::new(run)?,
        BranchId::new(branch)?,
    );
    let outbox = Outbox::new(connect(&database.database_url, database.schema.as_ref()).await?);
    let to = match to {
        Some(to) => BranchId::new(to)?,
        None => BranchId::new(
            format!("discarded-{}", key.branch)
                .chars()
                .take(64)
                .collect::<String>(),
        )?,
    };
    let discarded = outbox.discard_branch(&key, &to).await?;
    println!(
        "discarded {} waiting intent(s) of {key}: its live history ends at lsn {}; consumers get a rewind marker; the run goes on on {}",
        discarded.discarded, discarded.fork, discarded.live
    );
    Ok(())
}

pub(crate) async fn retire(
    database: &Database,
    retention_secs: u64,
    batch: u32,
    tables: Tables,
) -> Result<()> {
    let pool = connect(&database.database_url, database.schema.as_ref()).await?;
    let retention = store::Retention {
        keep: std::time::Duration::from_secs(retention_secs),
        batch,
    };
    match tables {
        Tables::FoldOnly => {
            let runs = store::retire_folded_runs(&pool, retention).await?;
            println!("retired the fold state of {runs} completed runs");
        }
        Tables::Outbox => {
            let runs = store::retire_runs(&pool, retention).await?;
            println!("retired {runs} closed runs");
        }
    }
    Ok(())
}

pub(crate) async fn status(
    database: &Database,
    broker: distribution::BrokerArgs,
    groups: distribution::GroupsArgs,
) -> Result<()> {
    let outbox = Outbox::new(connect(&database.database_url, database.schema.as_ref()).await?);
    let backlog = outbox
        .backlog()
        .await
        .context("cannot read the backlog (has `distribution migrate` run?)")?;
    print!("{}", demo::backlog_table(&backlog));
    let parked = outbox.parked_branches().await?;
    if parked.is_empty() {
        println!("no parked branches");
    } else {
        println!("parked branches (their events wait, in order):");
        println!(
            "{:<40} {:<15} {:>8} {:>12} {:>10} {:>8}  reason",
            "branch", "cause", "attempts", "failing for", "retry in", "pending"
        );
        for branch in &parked {
            println!(
                "{:<40} {:<15} {:>8} {:>11.0}s {:>9.0}s {:>8}  {}",
                branch.branch.to_string(),
                branch.cause.label(),
                branch.attempts,
                branch.failing_for.as_secs_f64(),
                branch.retry_in.as_secs_f64(),
                branch.pending,
                branch.reason
            );
        }
        let causes: std::collections::BTreeSet<_> =
            parked.iter().map(|branch| branch.cause).collect();
        for cause in causes {
            println!(
                "{}: {}. Way out: {}.",
                cause.label(),
                cause.what(),
                cause.way_out()
            );
        }
    }
    if broker.url().is_none() {
        return Ok(());
    }
    let mut unanswered = Vec::new();
    for group in groups.names() {
        let kept = dead_cli::Broker {
            place: broker.clone(),
            group: group.to_owned(),
            queues: distribution::QueueSettings::default(),
        }
        .group_broker()?;
        let place = kept.place();
        let list = match (&kept, group) {
            (GroupBroker::Rabbit(_), "default") => "`distribution dead list`".to_owned(),
            (GroupBroker::Rabbit(_), named) => format!("`distribution dead list --group {named}`"),
            (GroupBroker::Nats { .. }, group) => {
                format!("`RELAY_BROKER=nats distribution dead list --group {group}`")
            }
        };
        let depth = async { GroupLetters::open(&kept).await?.depth().await };
        match depth.await {
            Ok(0) => println!("no dead letters in {place}"),
            Ok(depth) => println!("{depth} dead letter(s) in {place}: {list} shows them"),
            // RabbitMQ's answer to a passive declare of a queue that is not there.
            Err(err) if err.to_string().contains("NOT_FOUND") => {
                println!("{place} does not exist: no consumer of the group declared its queues")
            }
            // NATS: no dead-letter stream yet, said as such.
            Err(distribution::broker::Error::Refused(why))
                if matches!(kept, GroupBroker::Nats { .. }) =>
            {
                println!("{why}")
            }
            Err(err) => {
                println!("dead letters in {place}: unknown ({err})");
                unanswered.push(place);
            }
        }
    }
    // Asked about dead letters and could not tell: not a success a script may read as "none".
    match unanswered.as_slice() {
        [] => Ok(()),
        places => anyhow::bail!(
            "could not read the depth of {} (the broker refused or did not answer)",
            places.join(", ")
        ),
    }
}

pub(crate) async fn release(
    database: &Database,
    tenant: String,
    run: Option<String>,
    branch: Option<String>,
) -> Result<()> {
    use distribution::store::{BranchId, RunId, TenantId};
    let tenant = TenantId::new(tenant)?;
    let run = run.map(RunId::new).transpose()?;
    let branch = branch.map(BranchId::new).transpose()?;
    let outbox = Outbox::new(connect(&database.database_url, database.schema.as_ref()).await?);
    let released = outbox
        .release(&tenant, run.as_ref(), branch.as_ref())
        .await?;
    println!("released {released} parked branch(es); relays drain them on their next poll");
    Ok(())
}

//! `distribution group`: create a consumer group's queues before its service first runs,
//! delete them when the service is retired, reset its fold to rebuild its projection, or adopt
//! the outbox database's history on a branch after a failover. On NATS a group has no queues:
//! the stream keeps every event for every group, `create` declares the stream and its
//! dead-letter stream, and `delete` removes the group's dead letters.
use anyhow::{Context, Result};
use clap::Subcommand;
use distribution::broker::{self, Group};

use crate::dead_cli::Broker;
use distribution::BrokerKind;

#[derive(Debug, Subcommand)]
pub enum GroupAction {
    /// Declare the group's partition queues (bound to the topology's exchange with the same
    /// routing keys) and its dead-letter queue. The group receives every event published from
    /// then on; earlier ones are not replayed into it. On NATS a group has nothing to declare
    /// (it reads the one stream from its stored position): says whether the stream is there.
    Create {
        #[command(flatten)]
        broker: Broker,
        /// The group (`[a-z0-9_-]`, 1 to 64 bytes; `default` is the unnamed group).
        name: String,
    },
    /// Delete the group's queues and dead-letter queue with what they hold. Other groups keep
    /// receiving; a relay goes on. A relay with the group in `RELAY_GROUPS` declares it again.
    /// On NATS: delete the group's dead letters (its read positions live in its fold
    /// database: `group reset` forgets them).
    Delete {
        #[command(flatten)]
        broker: Broker,
        /// The group.
        name: String,
    },
    /// Rebuild a group's projection from the start (streams): forget what its fold database
    /// knows (branch cursors, held-back events, stream offsets) and empty the projection
    /// tables named by --truncate, in one transaction. Stop the group's consumers first;
    /// started again, they replay the streams from the first retained offset.
    Reset {
        /// The group's fold database (DATABASE_URL).
        #[command(flatten)]
        database: crate::Database,
        /// A projection table to empty in the same transaction (`table` or `schema.table`;
        /// repeat for each). Required unless --fold-only: a fold reset that leaves the
        /// projection's rows would apply every event to them a second time.
        #[arg(
            long = "truncate",
            value_name = "TABLE",
            required_unless_present = "fold_only"
        )]
        tables: Vec<String>,
        /// Reset the fold's state alone: the projection is the fold's own event table, or is
        /// emptied another way.
        #[arg(long, conflicts_with = "tables")]
        fold_only: bool,
    },
    /// After a failover that lost commits the relay had shipped, the group's fold refuses the
    /// branch's new history as diverged (dead letters with reason `diverged`, RL203). Arm the
    /// branch to adopt the database's history: then replay its dead letters in order
    /// (`distribution dead replay --tenant T --run R`); the first of them undoes what the
    /// failover lost (the projection's rewind) and the rest fold as usual. docs/operations.md,
    /// "After a failover".
    Adopt {
        /// The group's fold database (DATABASE_URL).
        #[command(flatten)]
        database: crate::Database,
        /// The branch's tenant.
        #[arg(long)]
        tenant: String,
        /// The branch's run.
        #[arg(long)]
        run: String,
        /// The branch (as in the dead letters' `branch` header).
        #[arg(long)]
        branch: String,
    },
}

pub async fn run(action: GroupAction) -> Result<()> {
    match action {
        GroupAction::Create { broker, name } if broker.place.broker == BrokerKind::Nats => {
            create_on_nats(&broker, &name).await?;
        }
        GroupAction::Delete { broker, name } if broker.place.broker == BrokerKind::Nats => {
            delete_on_nats(&broker, &name).await?;
        }
        GroupAction::Create { broker, name } => {
            let group = Group::parse(&name).context("group name")?;
            let mut rabbit = broker.rabbit()?;
            rabbit.topology = rabbit.topology.with_group(group.clone());
            // Opening declares the exchange and exactly this group's queues.
            let (connection, _channel) = rabbit::open(&rabbit, "outbox-group")
                .await
                .context("declaring the group's queues")?;
            let _ = connection.close(200, "done".into()).await;
            println!(
                "group {group}: queues {} .. {} and {} are ready",
                rabbit.topology.queue(broker::Partition(0)),
                rabbit
                    .topology
                    .queue(broker::Partition(rabbit.topology.partitions() - 1)),
                rabbit.topology.dead_letter_queue()
            );
        }
        GroupAction::Delete { broker, name } => {
            let group = Group::parse(&name).context("group name")?;
            let mut rabbit = broker.rabbit()?;
            rabbit.topology = rabbit.topology.declaring(Vec::new());
            let (connection, channel) = rabbit::open(&rabbit, "outbox-group")
                .await
                .context("connecting to the broker")?;
            let messages = rabbit
                .topology
                .delete_group(&channel, &group)
                .await
                .context("deleting the group's queues")?;
            let _ = connection.close(200, "done".into()).await;
            println!("group {group}: deleted its queues and {messages} messages in them");
        }
        GroupAction::Reset {
            database,
            tables,
            fold_only: _,
        } => {
            let names = tables
                .iter()
                .map(|table| quoted_table(table))
                .collect::<Result<Vec<_>>>()?;
            let pool = crate::connect(&database.database_url, database.schema.as_ref()).await?;
            let mut tx = pool.begin().await?;
            let branches = distribution::store::reset_fold(&mut tx)
                .await
                .context("resetting the fold (has `distribution migrate --fold` run?)")?;
            for name in &names {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("TRUNCATE {name}")))
                    .execute(&mut *tx)
                    .await
                    .with_context(|| format!("emptying {name}"))?;
            }
            tx.commit().await?;
            println!(
                "reset: forgot {branches} branches and every stream offset{}; start the group's \
                 consumers to replay from the first retained offset",
                if names.is_empty() {
                    String::new()
                } else {
                    format!(", emptied {}", names.join(", "))
                }
            );
        }
        GroupAction::Adopt {
            database,
            tenant,
            run,
            branch,
        } => {
            use distribution::store::{BranchId, BranchKey, RunId, TenantId};
            let key = BranchKey::new(
                TenantId::new(&tenant).context("--tenant")?,
                RunId::new(&run).context("--run")?,
                BranchId::new(&branch).context("--branch")?,
            );
            let pool = crate::connect(&database.database_url, database.schema.as_ref()).await?;
            let mut conn = pool.acquire().await?;
            let armed = distribution::store::adopt_branch(&mut conn, &key)
                .await
                .context("arming the branch (has `distribution migrate --fold` run?)")?;
            if !armed {
                anyhow::bail!(
                    "the fold knows no branch {key}: nothing to adopt (check the dead letters' tenant, run and branch headers)"
                );
            }
            println!(
                "armed {key}: replay its dead letters in order (distribution dead replay --tenant {tenant} --run {run}); the first that begins the new epoch undoes what the failover lost"
            );
        }
    }
    Ok(())
}

/// The group's name as its consumers give it on NATS (a subject token).
fn nats_group(broker: &Broker, name: &str) -> Result<distribution::nats::NatsConfig> {
    let nats = broker.nats()?;
    distribution::consumer::NatsConsumerConfig::new(nats.clone(), name).context("group name")?;
    Ok(nats)
}

/// `group create` on NATS: the stream keeps every event for every group, so nothing is the
/// group's own to declare. It says whether the stream is there (the first relay or consumer
/// declares it, with the settings they are given: declaring it here could give it others).
async fn create_on_nats(broker: &Broker, name: &str) -> Result<()> {
    let nats = nats_group(broker, name)?;
    let checkup = distribution::nats::checkup(&nats)
        .await
        .context("cannot reach NATS (NATS_URL)")?;
    let stream = match checkup.stream_messages {
        Some(messages) => format!("stream {} holds {messages} messages", nats.stream),
        None => format!(
            "stream {} does not exist yet: the first relay or consumer declares it",
            nats.stream
        ),
    };
    println!(
        "group {name}: on NATS a group has no queues of its own, and nothing was declared; \
         {stream}; the group's consumers read it from the position their fold database stored \
         (the first time, from their start setting), so it can replay what came before"
    );
    Ok(())
}

/// `group delete` on NATS: the group's dead letters, for good (none kept yet: nothing to do).
/// The stream stays (other groups read it); the group's positions stay in its fold database.
async fn delete_on_nats(broker: &Broker, name: &str) -> Result<()> {
    let nats = nats_group(broker, name)?;
    let place = format!(
        "{}.{name}",
        distribution::nats::dead_letter_stream(&nats.stream)
    );
    let dead = distribution::nats::NatsDeadLetters::open(&nats, name)
        .await
        .context("cannot reach NATS (NATS_URL)")?;
    let purged = match dead.purge(&distribution::broker::DeadFilter::All).await {
        Ok(purged) => purged,
        // No dead-letter stream: no consumer kept a letter yet.
        Err(distribution::broker::Error::Refused(_)) => 0,
        Err(err) => return Err(err).context("deleting the group's dead letters"),
    };
    println!(
        "group {name}: deleted its {purged} dead letters ({place}); the stream stays for the \
         other groups, and the group's read positions stay in its fold database \
         (`distribution group reset` forgets them)"
    );
    Ok(())
}

/// `table` or `schema.table`, each part a lowercase identifier, quoted for SQL.
fn quoted_table(name: &str) -> Result<String> {
    name.split('.')
        .map(|part| {
            distribution::store::Schema::new(part)
                .map(|_| format!("\"{part}\""))
                .map_err(|err| anyhow::anyhow!("--truncate {name}: {err}"))
        })
        .collect::<Result<Vec<_>>>()
        .and_then(|parts| match parts.len() {
            1 | 2 => Ok(parts.join(".")),
            _ => anyhow::bail!("--truncate {name}: give `table` or `schema.table`"),
        })
}

//! `distribution group`: create a consumer group's queues before its service first runs, or
//! delete them when the service is retired.
use anyhow::{Context, Result};
use clap::Subcommand;
use distribution::broker::{self, Group};

use crate::dead_cli::Broker;

#[derive(Debug, Subcommand)]
pub enum GroupAction {
    /// Declare the group's partition queues (bound to the topology's exchange with the same
    /// routing keys) and its dead-letter queue. The group receives every event published from
    /// then on; earlier ones are not replayed into it.
    Create {
        #[command(flatten)]
        broker: Broker,
        /// The group (`[a-z0-9_-]`, 1 to 64 bytes; `default` is the unnamed group).
        name: String,
    },
    /// Delete the group's queues and dead-letter queue with what they hold. Other groups keep
    /// receiving; a relay goes on. A relay with the group in `RELAY_GROUPS` declares it again.
    Delete {
        #[command(flatten)]
        broker: Broker,
        /// The group.
        name: String,
    },
}

pub async fn run(action: GroupAction) -> Result<()> {
    match action {
        GroupAction::Create { broker, name } => {
            let group = Group::parse(&name).context("group name")?;
            let mut rabbit = broker.rabbit()?;
            rabbit.topology = rabbit.topology.with_group(group.clone());
            // Opening declares the exchange and exactly this group's queues.
            let (connection, _channel) = broker::open(&rabbit, "outbox-group")
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
            let (connection, channel) = broker::open(&rabbit, "outbox-group")
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
    }
    Ok(())
}

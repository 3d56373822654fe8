//! `distribution dead`: a group's dead letters read back (list, show, replay, purge), over
//! `rabbit::DeadLetters` (the dead-letter queue) or `nats::NatsDeadLetters` (the dead-letter
//! stream).
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use distribution::broker::{DeadFilter, DeadLetterView, Group};
use distribution::nats::NatsConfig;
use distribution::rabbit::RabbitConfig;
use distribution::store::{RunId, TenantId};
use distribution::{BrokerArgs, BrokerKind};

use crate::letters::{GroupBroker, GroupLetters};

/// The broker and topology whose dead letters are read.
#[derive(Clone, Debug, Args)]
pub struct Broker {
    #[command(flatten)]
    pub place: BrokerArgs,
    /// The consumer group (`default`: the unnamed group's `<topology>.p<N>` and
    /// `<topology>.dead`; a name: `<topology>.<group>.p<N>` and `<topology>.<group>.dead`; on
    /// NATS the group's subject `<topology>_dead.<group>`).
    #[arg(long, env = "RELAY_GROUP", default_value = "default")]
    pub group: String,
    /// How the topology's queues are declared (as the relay's settings).
    #[command(flatten)]
    pub queues: distribution::QueueSettings,
}

impl Broker {
    pub fn rabbit(&self) -> Result<RabbitConfig> {
        if self.place.broker == BrokerKind::Nats {
            bail!(
                "RELAY_BROKER=nats: this command reads RabbitMQ's queues only (docs/operations.md, \
                 \"On NATS JetStream\", says what runs on NATS)"
            );
        }
        let mut config = self.place.broker_config()?;
        self.queues.apply(&mut config)?;
        let group = Group::parse(&self.group).context("--group / RELAY_GROUP")?;
        let mut rabbit = config.rabbit_config()?;
        rabbit.topology = rabbit.topology.with_group(group);
        Ok(rabbit)
    }
}

impl Broker {
    /// Where the group's dead letters live, on the broker `--broker` names.
    pub fn group_broker(&self) -> Result<GroupBroker> {
        match self.place.broker {
            BrokerKind::RabbitMq => Ok(GroupBroker::Rabbit(self.rabbit()?)),
            BrokerKind::Nats => {
                let nats = self.nats()?;
                // The group's name as its consumers give it (a subject token).
                distribution::consumer::NatsConsumerConfig::new(nats.clone(), &self.group)
                    .context("--group / RELAY_GROUP")?;
                Ok(GroupBroker::Nats {
                    nats,
                    group: self.group.clone(),
                })
            }
        }
    }

    /// The NATS side: the stream's configuration.
    pub fn nats(&self) -> Result<NatsConfig> {
        Ok(self.place.broker_config()?.nats_config()?)
    }
}

#[derive(Debug, Subcommand)]
pub enum DeadAction {
    /// List the dead letters in queue order (nothing is removed).
    List {
        #[command(flatten)]
        broker: Broker,
        /// Show at most this many.
        #[arg(long, default_value_t = 100)]
        limit: u64,
    },
    /// One dead letter, whole: its headers, why it was dead-lettered, its body.
    Show {
        #[command(flatten)]
        broker: Broker,
        /// Its message id (`tenant/run/branch/lsn`, as `list` prints it).
        message_id: String,
    },
    /// Publish dead letters back to their partitions, in their order, for the consumers to
    /// fold again (duplicates are ignored, held-back successors released); each leaves the
    /// dead-letter queue once its partition confirmed it.
    Replay {
        #[command(flatten)]
        broker: Broker,
        #[command(flatten)]
        selection: Selection,
    },
    /// Remove dead letters for good.
    Purge {
        #[command(flatten)]
        broker: Broker,
        #[command(flatten)]
        selection: Selection,
    },
}

/// Which dead letters: name them (at least one of these).
#[derive(Clone, Debug, Args)]
#[group(required = true, multiple = true)]
pub struct Selection {
    /// Every dead letter.
    #[arg(long, conflicts_with_all = ["tenant", "message_id"])]
    pub all: bool,
    /// Those of this tenant.
    #[arg(long, conflicts_with = "message_id")]
    pub tenant: Option<String>,
    /// Only this run of the tenant.
    #[arg(long, requires = "tenant")]
    pub run: Option<String>,
    /// The one with this message id.
    #[arg(long)]
    pub message_id: Option<String>,
}

impl Selection {
    fn filter(&self) -> Result<DeadFilter> {
        if self.all {
            return Ok(DeadFilter::All);
        }
        if let Some(id) = &self.message_id {
            return Ok(DeadFilter::MessageId(id.clone()));
        }
        let tenant = TenantId::new(self.tenant.clone().unwrap_or_default())?;
        let run = self.run.clone().map(RunId::new).transpose()?;
        Ok(DeadFilter::Tenant(tenant, run))
    }
}

/// A dead letter on one line: position, message id, kind, reason.
fn line(letter: &DeadLetterView) -> String {
    format!(
        "{:>5}  {:<48} {:<12} {}",
        letter.position,
        letter.message_id.as_deref().unwrap_or("(no message id)"),
        letter.kind(),
        letter.reason.as_deref().unwrap_or("(no reason)")
    )
}

/// A dead letter whole: what it is, its headers, its body (text, or hex).
fn print(letter: &DeadLetterView, message_id: &str) {
    println!("position: {}", letter.position);
    println!("message_id: {message_id}");
    println!("kind: {}", letter.kind());
    println!("reason: {}", letter.reason.as_deref().unwrap_or("(none)"));
    if let Err(err) = &letter.event {
        println!("not an event: {err}");
    }
    for (name, value) in letter.properties() {
        println!("{name}: {value}");
    }
    for (name, value) in &letter.headers {
        println!("header {name}: {value}");
    }
    match std::str::from_utf8(&letter.body) {
        Ok(text) => println!("body ({} bytes, UTF-8):\n{text}", letter.body.len()),
        Err(_) => {
            let hex: String = letter.body.iter().map(|b| format!("{b:02x}")).collect();
            println!("body ({} bytes, hex):\n{hex}", letter.body.len());
        }
    }
}

/// How many letters a list shows out of how many there are.
fn heading(depth: u64, limit: u64, place: &str) -> String {
    format!(
        "{depth} dead letter(s) in {place}{}",
        if depth > limit {
            format!(" (the first {limit})")
        } else {
            String::new()
        }
    )
}

pub async fn run(action: DeadAction) -> Result<()> {
    let broker = match &action {
        DeadAction::List { broker, .. }
        | DeadAction::Show { broker, .. }
        | DeadAction::Replay { broker, .. }
        | DeadAction::Purge { broker, .. } => broker,
    };
    let group = broker.group_broker()?;
    let place = group.place();
    let dead = GroupLetters::open(&group).await.context(match group {
        GroupBroker::Rabbit(_) => "cannot reach the broker (AMQP_URL)",
        GroupBroker::Nats { .. } => "cannot reach NATS (NATS_URL)",
    })?;
    match action {
        DeadAction::List { limit, .. } => {
            let depth = dead.depth().await.with_context(|| match group {
                GroupBroker::Rabbit(_) => {
                    format!("cannot read {place} (has a consumer declared it?)")
                }
                GroupBroker::Nats { .. } => format!("cannot read {place}"),
            })?;
            let letters = dead.list(limit).await?;
            println!("{}", heading(depth, limit, &place));
            for letter in &letters {
                println!("{}", line(letter));
            }
        }
        DeadAction::Show { message_id, .. } => {
            let letter = dead.find(&message_id).await?.with_context(|| {
                format!("no dead letter with message id {message_id} in {place}")
            })?;
            print(&letter, &message_id);
        }
        DeadAction::Replay { selection, .. } => {
            let replayed = dead.replay(&selection.filter()?).await?;
            println!(
                "replayed {replayed} dead letter(s) to their partitions; the consumers fold them again"
            );
        }
        DeadAction::Purge { selection, .. } => {
            let purged = dead.purge(&selection.filter()?).await?;
            println!("purged {purged} dead letter(s) from {place}");
        }
    }
    Ok(())
}

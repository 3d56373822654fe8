//! `distribution tail`: watch events arrive, one line each (key, kind, metadata), over
//! `rabbit::Tail` or `nats::NatsTail`; the payload only when asked.
use std::io::Write;

use anyhow::{Context, Result};
use clap::Args;
use distribution::BrokerKind;
use distribution::broker::{TailFilter, WireError};
use distribution::nats::{NatsTail, NatsTailed};
use distribution::rabbit::{Tail, Tailed};
use distribution::store::{OutboxEvent, RunId, TenantId};

/// `distribution tail`'s settings.
#[derive(Debug, Args)]
pub struct TailSettings {
    // The broker watched (with --run, only the run's partition).
    #[command(flatten)]
    broker: distribution::BrokerArgs,
    /// Only this tenant's events.
    #[arg(long)]
    tenant: Option<String>,
    /// Only this run of the tenant.
    #[arg(long, requires = "tenant")]
    run: Option<String>,
    /// Print each payload too (as text, or as hex when it is not UTF-8).
    #[arg(long)]
    payload: bool,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
    /// Stop after this many events (default: until Ctrl-C).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    count: Option<u64>,
    /// Most messages the watcher's queue keeps while this terminal is behind; beyond, the
    /// oldest are dropped (never the relay's or a consumer's). RabbitMQ only: on NATS the
    /// watch reads the stream, where a slow terminal only falls behind.
    #[arg(long, default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    keep: u32,
}

/// One message as the tail shows it, whatever the broker.
struct Seen {
    /// Where it was published: the routing key (`p<N>`), or the NATS subject.
    place: String,
    /// What `place` is called in JSON: `routing_key` or `subject`.
    place_name: &'static str,
    message_id: Option<String>,
    event: Result<OutboxEvent, WireError>,
    body: Vec<u8>,
}

impl Seen {
    fn kind(&self) -> &'static str {
        distribution::broker::event_kind(&self.event)
    }

    fn properties(&self) -> Vec<(&'static str, String)> {
        distribution::broker::event_properties(&self.event)
    }
}

impl From<Tailed> for Seen {
    fn from(tailed: Tailed) -> Self {
        Self {
            place: tailed.routing_key,
            place_name: "routing_key",
            message_id: tailed.message_id,
            event: tailed.event,
            body: tailed.body,
        }
    }
}

impl From<NatsTailed> for Seen {
    fn from(tailed: NatsTailed) -> Self {
        Self {
            place: tailed.subject,
            place_name: "subject",
            message_id: tailed.message_id,
            event: tailed.event,
            body: tailed.body,
        }
    }
}

/// The watch on either broker.
enum Watch {
    Rabbit(Box<Tail>),
    Nats(Box<NatsTail>),
}

impl Watch {
    async fn next(&mut self) -> Result<Option<Seen>> {
        Ok(match self {
            Watch::Rabbit(tail) => tail.next().await?.map(Seen::from),
            Watch::Nats(tail) => Some(tail.next().await?.into()),
        })
    }
}

/// Opens the watch the settings name, and says on stderr what it watches.
async fn open(settings: &TailSettings, filter: TailFilter) -> Result<Watch> {
    let config = settings.broker.broker_config()?;
    let topology = &settings.broker.topology;
    match settings.broker.broker {
        BrokerKind::Nats => {
            let nats = config.nats_config()?;
            let tail = NatsTail::open(&nats, filter).await.with_context(|| {
                format!(
                    "cannot watch stream {} (is NATS_URL right, and has a relay or consumer declared the stream?)",
                    topology
                )
            })?;
            eprintln!(
                "watching stream {} from its next message (Ctrl-C to stop)",
                topology
            );
            Ok(Watch::Nats(Box::new(tail)))
        }
        BrokerKind::RabbitMq => {
            let rabbit = config.rabbit_config()?;
            let tail = Tail::open(&rabbit, filter, settings.keep)
                .await
                .with_context(|| {
                    format!(
                        "cannot watch exchange {} (is AMQP_URL right, and has a relay or consumer declared the topology?)",
                        topology
                    )
                })?;
            // Said on stderr: what follows on stdout is the events alone.
            eprintln!(
                "watching exchange {} through {} (Ctrl-C to stop)",
                topology,
                tail.queue()
            );
            Ok(Watch::Rabbit(Box::new(tail)))
        }
    }
}

pub async fn run(settings: TailSettings) -> Result<()> {
    let filter = TailFilter {
        tenant: settings
            .tenant
            .clone()
            .map(TenantId::new)
            .transpose()
            .context("--tenant")?,
        run: settings
            .run
            .clone()
            .map(RunId::new)
            .transpose()
            .context("--run")?,
    };
    let mut tail = open(&settings, filter).await?;
    let mut stdout = std::io::stdout().lock();
    let mut seen = 0u64;
    while settings.count.is_none_or(|count| seen < count) {
        let next = tokio::select! {
            next = tail.next() => next?,
            _ = crate::run_cli::shutdown_signal() => break,
        };
        let Some(tailed) = next else {
            anyhow::bail!("the broker ended the watch (the connection closed)");
        };
        let line = if settings.json {
            json_line(&tailed, settings.payload).to_string()
        } else {
            text_line(&tailed, settings.payload)
        };
        match writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
            Ok(()) => {}
            // `distribution tail | head`: the reader is gone, so is the watch.
            Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => break,
            Err(err) => return Err(err).context("writing to stdout"),
        }
        seen += 1;
    }
    Ok(())
}

/// The payload as shown: UTF-8 text, else hex.
fn payload_text(body: &[u8]) -> (&'static str, String) {
    match std::str::from_utf8(body) {
        Ok(text) => ("text", text.to_owned()),
        Err(_) => ("hex", body.iter().map(|b| format!("{b:02x}")).collect()),
    }
}

/// `p3 acme/run-1/main/7 intent written at=... type=... 42 B`, and the payload on the next line
/// if asked.
fn text_line(tailed: &Seen, payload: bool) -> String {
    let mut line = format!(
        "{} {} {}",
        tailed.place,
        tailed.message_id.as_deref().unwrap_or("(no message id)"),
        tailed.kind()
    );
    match &tailed.event {
        Ok(event) => {
            for (name, value) in tailed.properties() {
                line.push_str(&format!(" {}={value}", name.replace(' ', "_")));
            }
            for (name, value) in &event.meta.headers {
                line.push_str(&format!(" header.{name}={value}"));
            }
        }
        Err(err) => line.push_str(&format!(" ({err})")),
    }
    line.push_str(&format!(" {} B", tailed.body.len()));
    if payload {
        let (kind, shown) = payload_text(&tailed.body);
        line.push_str(&format!("\n  payload ({kind}): {shown}"));
    }
    line
}

/// One JSON object: the key, kind, properties and the host's headers; the payload if asked.
fn json_line(tailed: &Seen, payload: bool) -> serde_json::Value {
    let mut object = serde_json::Map::new();
    object.insert(tailed.place_name.into(), tailed.place.clone().into());
    object.insert("message_id".into(), tailed.message_id.clone().into());
    object.insert("kind".into(), tailed.kind().into());
    match &tailed.event {
        Ok(event) => {
            let branch = &event.key.branch;
            object.insert("tenant".into(), branch.tenant.as_str().into());
            object.insert("run".into(), branch.run.as_str().into());
            object.insert("branch".into(), branch.branch.as_str().into());
            object.insert("lsn".into(), event.key.lsn.get().into());
            for (name, value) in tailed.properties() {
                object.insert(name.replace(' ', "_"), value.into());
            }
            if !event.meta.headers.is_empty() {
                object.insert(
                    "headers".into(),
                    serde_json::to_value(&event.meta.headers).unwrap_or_default(),
                );
            }
        }
        Err(err) => {
            object.insert("not_an_event".into(), err.to_string().into());
        }
    }
    object.insert("bytes".into(), tailed.body.len().into());
    if payload {
        let (kind, shown) = payload_text(&tailed.body);
        object.insert(format!("payload_{kind}"), shown.into());
    }
    object.into()
}

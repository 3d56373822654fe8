//! The pages and their actions: each reads through the store or the broker and renders with
//! `page`; every action checks the CSRF token first.
use std::time::{Duration, SystemTime};

use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{Form, Path, Query, State};
use axum::http::StatusCode;
use distribution::broker::{self, DeadFilter};
use distribution::rabbit;
use distribution::store::{BranchId, BranchKey, RunId, TenantId};
use maud::Markup;
use serde::Deserialize;

use super::guard::{Failure, Page};
use super::page::{self, DeadAction, Section};
use super::{Console, Shared};
use crate::letters::{GroupBroker, GroupLetters};

impl Console {
    pub(super) fn groups(&self) -> Vec<String> {
        self.brokers
            .iter()
            .map(|(group, _)| group.clone())
            .collect()
    }

    pub(super) fn page(&self, title: &str, section: Section, body: Markup) -> Markup {
        page::layout(title, section, &self.groups(), body)
    }

    /// Where the group's dead letters live, or a 404 page.
    pub(super) fn group(&self, group: &str) -> Result<&GroupBroker, Failure> {
        self.brokers
            .iter()
            .find(|(name, _)| name == group)
            .map(|(_, broker)| broker)
            .ok_or_else(|| {
                Failure::new(
                    StatusCode::NOT_FOUND,
                    if self.brokers.is_empty() {
                        "no broker configured (AMQP_URL, or NATS_URL with RELAY_BROKER=nats): \
                         there are no dead letters to show"
                            .to_owned()
                    } else {
                        format!("{group} is not a consumer group of this console (RELAY_GROUPS)")
                    },
                )
            })
    }
}

#[derive(Deserialize)]
pub(super) struct PageQuery {
    #[serde(default)]
    page: u64,
}

pub(super) async fn overview(
    State(console): Shared,
    query: Result<Query<PageQuery>, QueryRejection>,
) -> Page {
    let Query(PageQuery { page }) = query?;
    let offset = page
        .checked_mul(u64::from(page::TENANTS_PER_PAGE))
        .ok_or_else(|| Failure::bad("no such page"))?;
    let broker = async {
        let (_, broker) = console.brokers.first()?;
        let status = broker_status(broker).await.map_err(|err| err.to_string());
        Some((console.broker_shown.clone(), status))
    };
    let groups =
        futures_util::future::join_all(console.brokers.iter().map(|(group, broker)| async move {
            let queue_missing = |err: broker::Error| match err.to_string() {
                text if text.contains("NOT_FOUND") => {
                    "no such queue: no consumer of the group declared it".to_owned()
                }
                text => text,
            };
            let partitions = async {
                match broker {
                    GroupBroker::Rabbit(rabbit) => page::Partitions::Queues(
                        rabbit::partition_queues(rabbit)
                            .await
                            .map_err(|err| err.to_string()),
                    ),
                    GroupBroker::Nats { .. } => page::Partitions::Stream,
                }
            };
            let (dead, partitions) = tokio::join!(
                async { GroupLetters::open(broker).await?.depth().await },
                partitions,
            );
            page::GroupQueues {
                group: group.clone(),
                dead_queue: broker.place(),
                dead: dead.map_err(queue_missing),
                partitions,
            }
        }));
    let (relays, backlog, parked, broker, groups) = tokio::join!(
        console.outbox.relays(),
        console
            .outbox
            .backlog_worst_first(offset, page::TENANTS_PER_PAGE),
        console.outbox.parked_branches(),
        broker,
        groups,
    );
    let (backlog, tenants) = backlog?;
    let data = page::Overview {
        relays: relays?,
        backlog,
        tenants,
        page,
        parked: parked?.len(),
        broker,
        groups,
    };
    let lag = console.lag.lock().expect("lag history");
    Ok(console.page(
        "Overview",
        Section::Overview,
        page::overview(&data, &lag, SystemTime::now()),
    ))
}

/// What the overview says of the broker: RabbitMQ's checkup (a publish that a resource alarm
/// would block), or NATS's version, durability and stream.
async fn broker_status(broker: &GroupBroker) -> Result<page::BrokerStatus, broker::Error> {
    Ok(match broker {
        GroupBroker::Rabbit(rabbit) => {
            let checkup = rabbit::checkup(rabbit, Duration::from_secs(2)).await?;
            let mut what = checkup.version.to_string();
            if !checkup.version.cluster_name.is_empty() {
                what.push_str(&format!(" (cluster {})", checkup.version.cluster_name));
            }
            page::BrokerStatus {
                blocked: checkup.blocked,
                what,
                note: None,
            }
        }
        GroupBroker::Nats { nats, .. } => {
            let checkup = distribution::nats::checkup(nats).await?;
            let stream = match checkup.stream_messages {
                Some(messages) => format!("stream {} holds {messages} messages", nats.stream),
                None => format!(
                    "no stream {} yet (no relay or consumer declared it)",
                    nats.stream
                ),
            };
            page::BrokerStatus {
                blocked: None,
                what: format!("NATS {}, {stream}", checkup.version),
                note: checkup.durability,
            }
        }
    })
}

pub(super) async fn parked(State(console): Shared) -> Page {
    let branches = console.outbox.parked_branches().await?;
    Ok(console.page(
        "Parked branches",
        Section::Parked,
        page::parked(&branches, &console.csrf, SystemTime::now()),
    ))
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum ParkedAction {
    Release,
    Discard,
}

#[derive(Deserialize)]
pub(super) struct ParkedForm {
    csrf: String,
    action: ParkedAction,
    tenant: String,
    run: String,
    branch: String,
    to: Option<String>,
    confirmed: Option<String>,
}

pub(super) async fn parked_act(
    State(console): Shared,
    form: Result<Form<ParkedForm>, FormRejection>,
) -> Page {
    let Form(form) = form?;
    console.check_csrf(&form.csrf)?;
    let key = BranchKey::new(
        TenantId::new(form.tenant).map_err(Failure::bad)?,
        RunId::new(form.run).map_err(Failure::bad)?,
        BranchId::new(form.branch).map_err(Failure::bad)?,
    );
    let page = |title: &str, body| Ok(console.page(title, Section::Parked, body));
    match (form.action, form.confirmed.as_deref()) {
        (ParkedAction::Release, _) => {
            let released = console
                .outbox
                .release(&key.tenant, Some(&key.run), Some(&key.branch))
                .await?;
            let message = match released {
                0 => format!(
                    "{key} was not parked (a relay shipped it, or someone released it first)."
                ),
                _ => format!("Released {key}: the relays drain it now."),
            };
            page("Released", page::done(&message, "/parked"))
        }
        (ParkedAction::Discard, Some("yes")) => {
            let to = BranchId::new(form.to.unwrap_or_default().trim())
                .map_err(|err| Failure::bad(format!("the new live branch: {err}")))?;
            let discarded = console.outbox.discard_branch(&key, &to).await?;
            let message = format!(
                "Discarded {} waiting intent(s) of {key}: its live history ends at lsn {}; consumers get a rewind marker; the run goes on on {}.",
                discarded.discarded, discarded.fork, discarded.live
            );
            page("Discarded", page::done(&message, "/parked"))
        }
        (ParkedAction::Discard, _) => {
            let to: String = format!("discarded-{}", key.branch)
                .chars()
                .take(64)
                .collect();
            // What the discard would drop, read now (the branch may ship or grow meanwhile:
            // the answer says what was dropped).
            let parked = console.outbox.parked_branches().await?;
            let waiting = parked
                .iter()
                .find(|parked| parked.branch == key)
                .map(|parked| parked.pending);
            page(
                "Discard a parked branch?",
                page::confirm_discard(&key, waiting, &to, &console.csrf),
            )
        }
    }
}

#[derive(Deserialize)]
pub(super) struct ShowQuery {
    id: String,
}

pub(super) async fn dead_list(State(console): Shared, Path(group): Path<String>) -> Page {
    let broker = console.group(&group)?;
    let dead = GroupLetters::open(broker).await?;
    let depth = dead.depth().await?;
    let letters = dead.list(page::LETTERS_LISTED).await?;
    Ok(console.page(
        &format!("Dead letters: {group}"),
        Section::Dead,
        page::dead_list(
            &group,
            &broker.place(),
            depth,
            &letters,
            &console.csrf,
            SystemTime::now(),
        ),
    ))
}

/// A tenant's page: its waiting branches, parked branches and dead letters, from the
/// database and every group's dead-letter queue at once.
pub(super) async fn tenant(State(console): Shared, Path(tenant): Path<String>) -> Page {
    let tenant = TenantId::new(tenant).map_err(Failure::bad)?;
    let dead = futures_util::future::join_all(console.brokers.iter().map(|(group, broker)| {
        let tenant = tenant.clone();
        async move {
            let read = async {
                let dead = GroupLetters::open(broker).await?;
                let depth = dead.depth().await?;
                let filter = DeadFilter::Tenant(tenant, None);
                let letters = dead.list(page::TENANT_LETTERS_READ).await?;
                let theirs = letters
                    .into_iter()
                    .filter(|letter| filter.takes(letter.message_id.as_deref(), &letter.event))
                    .collect();
                Ok::<_, broker::Error>(page::TenantLetters {
                    letters: theirs,
                    depth,
                })
            };
            (group.clone(), read.await.map_err(|err| err.to_string()))
        }
    }));
    let (backlog, branches, parked, dead) = tokio::join!(
        console.outbox.tenant_backlog(&tenant),
        console
            .outbox
            .tenant_branches(&tenant, page::BRANCHES_LISTED),
        console.outbox.parked_branches(),
        dead,
    );
    let data = page::TenantPage {
        backlog: backlog?,
        branches: branches?,
        parked: parked?
            .into_iter()
            .filter(|parked| parked.branch.tenant == tenant)
            .collect(),
        dead,
    };
    Ok(console.page(
        &format!("Tenant {tenant}"),
        Section::None,
        page::tenant(&data, &console.csrf, SystemTime::now()),
    ))
}

pub(super) async fn dead_show(
    State(console): Shared,
    Path(group): Path<String>,
    query: Result<Query<ShowQuery>, QueryRejection>,
) -> Page {
    let Query(ShowQuery { id }) = query?;
    let broker = console.group(&group)?;
    let letter = GroupLetters::open(broker)
        .await?
        .find(&id)
        .await?
        .ok_or_else(|| {
            Failure::new(
                StatusCode::NOT_FOUND,
                format!("no dead letter with message id {id} in {}", broker.place()),
            )
        })?;
    Ok(console.page(
        &format!("Dead letter {id}"),
        Section::Dead,
        page::dead_show(&group, &letter, &console.csrf),
    ))
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Select {
    All,
    Tenant,
    Message,
}

#[derive(Deserialize)]
pub(super) struct DeadForm {
    csrf: String,
    action: DeadAction,
    select: Select,
    tenant: Option<String>,
    run: Option<String>,
    message_id: Option<String>,
    confirmed: Option<String>,
}

/// A selection of dead letters: the filter, the form fields that carry it, and what it is in
/// words.
type Selection = (DeadFilter, Vec<(&'static str, String)>, String);

/// The form's selection: the filter, the fields that carry it to the confirmation, and what
/// it is in words.
fn selection(form: &DeadForm) -> Result<Selection, Failure> {
    let given = |value: &Option<String>| {
        value
            .as_deref()
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    };
    Ok(match form.select {
        Select::All => (
            DeadFilter::All,
            vec![("select", "all".into())],
            "every dead letter".into(),
        ),
        Select::Tenant => {
            let tenant =
                TenantId::new(given(&form.tenant).unwrap_or_default()).map_err(Failure::bad)?;
            let run = given(&form.run)
                .map(RunId::new)
                .transpose()
                .map_err(Failure::bad)?;
            let mut fields = vec![("select", "tenant".into()), ("tenant", tenant.to_string())];
            let what = match &run {
                Some(run) => {
                    fields.push(("run", run.to_string()));
                    format!("the dead letters of tenant {tenant}, run {run}")
                }
                None => format!("the dead letters of tenant {tenant}"),
            };
            (DeadFilter::Tenant(tenant, run), fields, what)
        }
        Select::Message => {
            let id = given(&form.message_id)
                .ok_or_else(|| Failure::bad("name the dead letter's message id"))?;
            let what = format!("the dead letter {id}");
            (
                DeadFilter::MessageId(id.clone()),
                vec![("select", "message".into()), ("message_id", id)],
                what,
            )
        }
    })
}

pub(super) async fn dead_act(
    State(console): Shared,
    Path(group): Path<String>,
    form: Result<Form<DeadForm>, FormRejection>,
) -> Page {
    let broker = console.group(&group)?;
    let Form(form) = form?;
    console.check_csrf(&form.csrf)?;
    let (filter, fields, what) = selection(&form)?;
    let dead = GroupLetters::open(broker).await?;
    let queue = broker.place();
    if form.confirmed.as_deref() != Some("yes") {
        let letters = dead.list(page::LETTERS_COUNTED).await?;
        let matching = letters
            .iter()
            .filter(|letter| filter.takes(letter.message_id.as_deref(), &letter.event))
            .count();
        return Ok(console.page(
            &format!("{} dead letters?", form.action.verb()),
            Section::Dead,
            page::confirm_dead(
                &group,
                form.action,
                &fields,
                &what,
                matching,
                letters.len(),
                &console.csrf,
            ),
        ));
    }
    let message = match form.action {
        DeadAction::Replay => {
            let replayed = dead.replay(&filter).await?;
            format!(
                "Replayed {replayed} dead letter(s) ({what}) to their partitions; the consumers fold them again."
            )
        }
        DeadAction::Purge => {
            let purged = dead.purge(&filter).await?;
            format!("Purged {purged} dead letter(s) ({what}) from {queue}.")
        }
    };
    let left = dead.depth().await?;
    Ok(console.page(
        "Done",
        Section::Dead,
        page::done(
            &format!("{message} {queue} now holds {left}."),
            &format!("/dead/{group}"),
        ),
    ))
}

//! `distribution console`: a few server-rendered pages for operators (overview, parked
//! branches, dead letters) with the actions of the CLI (release, discard, replay, purge).
//!
//! Off unless started; binds to loopback by default and refuses any other address without a
//! token (HTTP basic auth, any user name, or a bearer token). Actions are POSTs that carry a
//! CSRF token and come from the console's own pages (`Origin`, `Sec-Fetch-Site`); pages carry
//! no script, a strict content security policy, and never a secret (URLs are shown without
//! credentials). Its database role needs only `distribution roles --operator`.
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Form, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use distribution::broker::{self, DeadFilter, DeadLetters, RabbitConfig};
use distribution::store::{BranchId, BranchKey, Outbox, RunId, TenantId};
use maud::Markup;
use serde::Deserialize;

use crate::dead_cli::Broker;

mod lag;
mod page;

use page::Section;

/// `distribution console`'s settings.
#[derive(Debug, clap::Args)]
pub struct ConsoleSettings {
    #[command(flatten)]
    database: crate::Database,
    /// Address to serve the console on. Anything but loopback needs RELAY_CONSOLE_TOKEN.
    #[arg(long, env = "RELAY_CONSOLE_LISTEN", default_value = "127.0.0.1:9181")]
    listen: SocketAddr,
    /// The console's password (HTTP basic auth with any user name, or `Authorization: Bearer`),
    /// at least 16 characters. Required unless it listens on loopback.
    #[arg(long, env = "RELAY_CONSOLE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// RabbitMQ (`amqps://` for TLS): broker health and the dead letters. Without it the
    /// console shows the database's side only.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    amqp_url: Option<String>,
    /// Exchange name (as the relay's).
    #[arg(long, env = "RELAY_TOPOLOGY", default_value = "outbox")]
    topology: String,
    /// Broker partitions (as the relay's: a replayed letter goes to its run's partition).
    #[arg(long, env = "RELAY_PARTITIONS", default_value_t = 8,
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    partitions: u16,
    /// Consumer groups whose dead letters are shown (as the relay's RELAY_GROUPS).
    #[arg(
        long,
        env = "RELAY_GROUPS",
        default_value = "default",
        value_delimiter = ','
    )]
    groups: Vec<String>,
    /// How the topology's queues are declared (as the relay's settings).
    #[command(flatten)]
    queues: distribution::QueueSettings,
}

impl ConsoleSettings {
    /// Checks what can be checked before connecting to anything: one readable line each.
    pub fn check(&self) -> Result<()> {
        match &self.token {
            Some(token) if token.chars().count() < 16 => {
                anyhow::bail!("RELAY_CONSOLE_TOKEN is shorter than 16 characters")
            }
            None if !self.listen.ip().is_loopback() => anyhow::bail!(
                "the console listens on {} (not loopback) without RELAY_CONSOLE_TOKEN: set a token, or listen on 127.0.0.1",
                self.listen
            ),
            _ => {}
        }
        self.brokers()?;
        Ok(())
    }

    /// Each group's broker settings (none without AMQP_URL).
    fn brokers(&self) -> Result<Vec<(String, RabbitConfig)>> {
        let Some(amqp_url) = &self.amqp_url else {
            return Ok(Vec::new());
        };
        self.groups
            .iter()
            .map(|group| group.trim())
            .filter(|group| !group.is_empty() && *group != "none")
            .map(|group| {
                let rabbit = Broker {
                    amqp_url: amqp_url.clone(),
                    topology: self.topology.clone(),
                    partitions: self.partitions,
                    group: group.to_owned(),
                    queues: self.queues.clone(),
                }
                .rabbit()
                .with_context(|| format!("RELAY_GROUPS: {group}"))?;
                Ok((group.to_owned(), rabbit))
            })
            .collect()
    }
}

/// What every request shares.
struct Console {
    outbox: Outbox,
    /// Per group (in RELAY_GROUPS order): its broker settings.
    brokers: Vec<(String, RabbitConfig)>,
    /// The broker's addresses as shown: without credentials.
    broker_shown: String,
    token: Option<String>,
    csrf: String,
    lag: Mutex<lag::LagHistory>,
}

type Shared = State<Arc<Console>>;

/// Serves the console until Ctrl-C or SIGTERM.
pub async fn run(settings: ConsoleSettings) -> Result<()> {
    let pool = crate::connect(
        &settings.database.database_url,
        settings.database.schema.as_ref(),
    )
    .await?;
    let outbox = Outbox::new(pool);
    outbox
        .backlog_worst_first(0, 1)
        .await
        .context("cannot read the relay's status views (has `distribution migrate` run, and has the console's role `distribution roles --operator`?)")?;
    let mut csrf = [0u8; 32];
    getrandom::fill(&mut csrf).map_err(|err| anyhow::anyhow!("no randomness: {err}"))?;
    let console = Arc::new(Console {
        outbox,
        brokers: settings.brokers()?,
        broker_shown: settings
            .amqp_url
            .as_deref()
            .map(without_credentials)
            .unwrap_or_default(),
        token: settings.token.clone(),
        csrf: csrf.iter().map(|byte| format!("{byte:02x}")).collect(),
        lag: Mutex::new(lag::LagHistory::new(Duration::from_secs(5), 61)),
    });
    let sampler = tokio::spawn(sample_lag(console.clone()));
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (RELAY_CONSOLE_LISTEN)",
                settings.listen
            )
        })?;
    // Tests and scripts read the address from here (port 0 picks one).
    eprintln!(
        "console listening on http://{}/",
        listener.local_addr().unwrap_or(settings.listen)
    );
    let served = axum::serve(listener, router(console))
        .with_graceful_shutdown(crate::run_cli::shutdown_signal())
        .await;
    sampler.abort();
    served.context("serving the console")
}

fn router(console: Arc<Console>) -> axum::Router {
    axum::Router::new()
        .route("/", get(overview))
        .route("/console.css", get(style))
        .route("/parked", get(parked))
        .route("/parked/act", post(parked_act))
        .route("/dead/{group}", get(dead_list))
        .route("/dead/{group}/show", get(dead_show))
        .route("/dead/{group}/act", post(dead_act))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Forms are a few hundred bytes; anything near this is not one of ours.
        .layer(DefaultBodyLimit::max(16 * 1024))
        .layer(middleware::from_fn_with_state(console.clone(), guard))
        .with_state(console)
}

/// Every few seconds: the oldest waiting intent's age, for the overview's plot.
async fn sample_lag(console: Arc<Console>) {
    let every = console.lag.lock().expect("lag history").every();
    let mut ticks = tokio::time::interval(every);
    loop {
        ticks.tick().await;
        if let Ok((worst, _)) = console.outbox.backlog_worst_first(0, 1).await {
            let oldest = worst.first().map(|b| b.oldest_age).unwrap_or_default();
            console
                .lag
                .lock()
                .expect("lag history")
                .push(SystemTime::now(), oldest);
        }
    }
}

/// An AMQP URL list as shown: each address's scheme, host, port and vhost, no user or password.
fn without_credentials(urls: &str) -> String {
    urls.split(',')
        .map(|address| match url::Url::parse(address.trim()) {
            Ok(mut url) => {
                let _ = url.set_username("");
                let _ = url.set_password(None);
                url.set_query(None);
                url.to_string()
            }
            Err(_) => "(an address that is not a URL)".to_owned(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A page that says what went wrong (and never more than the message).
struct Failure {
    status: StatusCode,
    message: String,
}

impl Failure {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn bad(message: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message.to_string())
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let title = self
            .status
            .canonical_reason()
            .unwrap_or("Something went wrong");
        let body = page::layout(
            title,
            Section::None,
            &[],
            page::error(self.status.as_u16(), &self.message),
        );
        (self.status, body).into_response()
    }
}

impl From<distribution::store::Error> for Failure {
    fn from(err: distribution::store::Error) -> Self {
        use distribution::store::Error;
        match err {
            Error::Database(_) | Error::Migrate(_) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the database: {err}"),
            ),
            refused => Self::bad(refused),
        }
    }
}

impl From<broker::Error> for Failure {
    fn from(err: broker::Error) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, format!("the broker: {err}"))
    }
}

impl From<FormRejection> for Failure {
    fn from(rejection: FormRejection) -> Self {
        Self::new(rejection.status(), rejection.body_text())
    }
}

impl From<QueryRejection> for Failure {
    fn from(rejection: QueryRejection) -> Self {
        Self::new(rejection.status(), rejection.body_text())
    }
}

type Page = Result<Markup, Failure>;

impl Console {
    fn groups(&self) -> Vec<String> {
        self.brokers
            .iter()
            .map(|(group, _)| group.clone())
            .collect()
    }

    fn page(&self, title: &str, section: Section, body: Markup) -> Markup {
        page::layout(title, section, &self.groups(), body)
    }

    /// The group's broker settings, or a 404 page.
    fn group(&self, group: &str) -> Result<&RabbitConfig, Failure> {
        self.brokers
            .iter()
            .find(|(name, _)| name == group)
            .map(|(_, rabbit)| rabbit)
            .ok_or_else(|| {
                Failure::new(
                    StatusCode::NOT_FOUND,
                    if self.brokers.is_empty() {
                        "no broker configured (AMQP_URL): there are no dead letters to show"
                            .to_owned()
                    } else {
                        format!("{group} is not a consumer group of this console (RELAY_GROUPS)")
                    },
                )
            })
    }

    /// Whether `given` is this console's CSRF token (in constant time).
    fn csrf_ok(&self, given: &str) -> bool {
        use subtle::ConstantTimeEq;
        given.len() == self.csrf.len() && bool::from(given.as_bytes().ct_eq(self.csrf.as_bytes()))
    }

    fn check_csrf(&self, given: &str) -> Result<(), Failure> {
        if self.csrf_ok(given) {
            Ok(())
        } else {
            Err(Failure::new(
                StatusCode::FORBIDDEN,
                "this form is not one of the console's (or the console restarted since it was shown): load the page again",
            ))
        }
    }

    /// Whether the request carries the console's token (always, without one).
    fn authorized(&self, headers: &HeaderMap) -> bool {
        use headers::authorization::{Basic, Bearer};
        use headers::{Authorization, HeaderMapExt};
        use subtle::ConstantTimeEq;
        let Some(token) = &self.token else {
            return true;
        };
        let given = if let Some(basic) = headers.typed_get::<Authorization<Basic>>() {
            basic.password().to_owned()
        } else if let Some(bearer) = headers.typed_get::<Authorization<Bearer>>() {
            bearer.token().to_owned()
        } else {
            return false;
        };
        given.len() == token.len() && bool::from(given.as_bytes().ct_eq(token.as_bytes()))
    }
}

/// Every request: the token (if any), same-origin actions, and the pages' security headers.
async fn guard(State(console): Shared, request: Request, next: Next) -> Response {
    let mut response = if !console.authorized(request.headers()) {
        let mut response = Failure::new(
            StatusCode::UNAUTHORIZED,
            "the console needs its token (RELAY_CONSOLE_TOKEN) as the password",
        )
        .into_response();
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"outbox relay console\", charset=\"UTF-8\""),
        );
        response
    } else if request.method() == Method::POST && !same_origin(request.headers()) {
        Failure::new(
            StatusCode::FORBIDDEN,
            "an action must come from the console's own pages",
        )
        .into_response()
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        // `no-referrer` would make the browser send `Origin: null` with the pages' own forms.
        (header::REFERRER_POLICY, "same-origin"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_FRAME_OPTIONS, "DENY"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// A POST from a page of this console: a browser's `Sec-Fetch-Site` says so, and an `Origin`
/// names the host the request was sent to. (Non-browser clients send neither: the CSRF token
/// still has to match.)
fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site")
        && !matches!(site.to_str(), Ok("same-origin" | "none"))
    {
        return false;
    }
    match (headers.get(header::ORIGIN), headers.get(header::HOST)) {
        (None, _) => true,
        (Some(origin), Some(host)) => {
            let (Ok(origin), Ok(host)) = (origin.to_str(), host.to_str()) else {
                return false;
            };
            url::Url::parse(origin).is_ok_and(|origin| {
                let port = origin
                    .port()
                    .map(|port| format!(":{port}"))
                    .unwrap_or_default();
                origin
                    .host_str()
                    .is_some_and(|name| format!("{name}{port}") == host)
            })
        }
        (Some(_), None) => false,
    }
}

async fn style() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        page::STYLE,
    )
}

async fn not_found() -> Failure {
    Failure::new(StatusCode::NOT_FOUND, "no such page")
}

async fn method_not_allowed() -> Failure {
    Failure::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "this page does not take that method",
    )
}

#[derive(Deserialize)]
struct PageQuery {
    #[serde(default)]
    page: u64,
}

async fn overview(State(console): Shared, query: Result<Query<PageQuery>, QueryRejection>) -> Page {
    let Query(PageQuery { page }) = query?;
    let offset = page
        .checked_mul(u64::from(page::TENANTS_PER_PAGE))
        .ok_or_else(|| Failure::bad("no such page"))?;
    let broker = async {
        let (_, rabbit) = console.brokers.first()?;
        let checkup = broker::checkup(rabbit, Duration::from_secs(2))
            .await
            .map_err(|err| err.to_string());
        Some((console.broker_shown.clone(), checkup))
    };
    let dead =
        futures_util::future::join_all(console.brokers.iter().map(|(group, rabbit)| async move {
            let depth = async { DeadLetters::open(rabbit).await?.depth().await }
                .await
                .map_err(|err| match err.to_string() {
                    text if text.contains("NOT_FOUND") => {
                        "no such queue: no consumer of the group declared it".to_owned()
                    }
                    text => text,
                });
            (
                group.clone(),
                rabbit.topology.dead_letter_queue().to_string(),
                depth,
            )
        }));
    let (relays, backlog, parked, broker, dead) = tokio::join!(
        console.outbox.relays(),
        console
            .outbox
            .backlog_worst_first(offset, page::TENANTS_PER_PAGE),
        console.outbox.parked_branches(),
        broker,
        dead,
    );
    let (backlog, tenants) = backlog?;
    let data = page::Overview {
        relays: relays?,
        backlog,
        tenants,
        page,
        parked: parked?.len(),
        broker,
        dead,
    };
    let lag = console.lag.lock().expect("lag history");
    Ok(console.page(
        "Overview",
        Section::Overview,
        page::overview(&data, &lag, SystemTime::now()),
    ))
}

async fn parked(State(console): Shared) -> Page {
    let branches = console.outbox.parked_branches().await?;
    Ok(console.page(
        "Parked branches",
        Section::Parked,
        page::parked(&branches, &console.csrf),
    ))
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum ParkedAction {
    Release,
    Discard,
}

#[derive(Deserialize)]
struct ParkedForm {
    csrf: String,
    action: ParkedAction,
    tenant: String,
    run: String,
    branch: String,
    to: Option<String>,
    confirmed: Option<String>,
}

async fn parked_act(State(console): Shared, form: Result<Form<ParkedForm>, FormRejection>) -> Page {
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
            page(
                "Discard a parked branch?",
                page::confirm_discard(&key, &to, &console.csrf),
            )
        }
    }
}

#[derive(Deserialize)]
struct ShowQuery {
    id: String,
}

async fn dead_list(State(console): Shared, Path(group): Path<String>) -> Page {
    let rabbit = console.group(&group)?;
    let dead = DeadLetters::open(rabbit).await?;
    let depth = dead.depth().await?;
    let letters = dead.list(page::LETTERS_LISTED).await?;
    Ok(console.page(
        &format!("Dead letters: {group}"),
        Section::Dead,
        page::dead_list(
            &group,
            rabbit.topology.dead_letter_queue().as_str(),
            depth,
            &letters,
            &console.csrf,
        ),
    ))
}

async fn dead_show(
    State(console): Shared,
    Path(group): Path<String>,
    query: Result<Query<ShowQuery>, QueryRejection>,
) -> Page {
    let Query(ShowQuery { id }) = query?;
    let rabbit = console.group(&group)?;
    let letter = DeadLetters::open(rabbit)
        .await?
        .find(&id)
        .await?
        .ok_or_else(|| {
            Failure::new(
                StatusCode::NOT_FOUND,
                format!(
                    "no dead letter with message id {id} in {}",
                    rabbit.topology.dead_letter_queue()
                ),
            )
        })?;
    Ok(console.page(
        &format!("Dead letter {id}"),
        Section::Dead,
        page::dead_show(&group, &letter),
    ))
}

#[derive(Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
enum DeadAction {
    Replay,
    Purge,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum Select {
    All,
    Tenant,
    Message,
}

#[derive(Deserialize)]
struct DeadForm {
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

async fn dead_act(
    State(console): Shared,
    Path(group): Path<String>,
    form: Result<Form<DeadForm>, FormRejection>,
) -> Page {
    let rabbit = console.group(&group)?;
    let Form(form) = form?;
    console.check_csrf(&form.csrf)?;
    let (filter, fields, what) = selection(&form)?;
    let dead = DeadLetters::open(rabbit).await?;
    let queue = rabbit.topology.dead_letter_queue();
    let action = if form.action == DeadAction::Purge {
        "purge"
    } else {
        "replay"
    };
    if form.confirmed.as_deref() != Some("yes") {
        let letters = dead.list(10_000).await?;
        let matching = letters
            .iter()
            .filter(|letter| filter.matches(letter))
            .count();
        return Ok(console.page(
            &format!(
                "{}?",
                if action == "purge" {
                    "Purge dead letters"
                } else {
                    "Replay dead letters"
                }
            ),
            Section::Dead,
            page::confirm_dead(
                &group,
                action,
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

//! `distribution console`: a few server-rendered pages for operators (overview, a tenant's page,
//! parked branches, dead letters) with the actions of the CLI (release, discard, replay, purge).
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
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header;
use axum::middleware;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use distribution::store::Outbox;

use crate::dead_cli::Broker;
use crate::letters::GroupBroker;

mod guard;
mod lag;
mod page;
mod readable;
mod routes;

use guard::{guard, method_not_allowed, not_found};
use routes::{dead_act, dead_list, dead_show, overview, parked, parked_act, tenant};

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
    // The broker: its health and the dead letters. Without its URL the console shows the
    // database's side only.
    #[command(flatten)]
    broker: distribution::BrokerArgs,
    /// Consumer groups whose dead letters are shown (as the relay's).
    #[command(flatten)]
    groups: distribution::GroupsArgs,
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

    /// Each group's broker settings (none without the broker's URL).
    fn brokers(&self) -> Result<Vec<(String, GroupBroker)>> {
        if self.broker.url().is_none() {
            return Ok(Vec::new());
        }
        self.groups
            .names()
            .into_iter()
            .map(|group| {
                let broker = Broker {
                    place: self.broker.clone(),
                    group: group.to_owned(),
                    queues: self.queues.clone(),
                }
                .group_broker()
                .with_context(|| format!("RELAY_GROUPS: {group}"))?;
                Ok((group.to_owned(), broker))
            })
            .collect()
    }
}

/// What every request shares.
struct Console {
    outbox: Outbox,
    /// Per group (in RELAY_GROUPS order): where its dead letters live.
    brokers: Vec<(String, GroupBroker)>,
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
        .oldest_wait()
        .await
        .context("cannot read the relay's status views (has `distribution migrate` run, and has the console's role `distribution roles --operator`?)")?;
    let mut csrf = [0u8; 32];
    getrandom::fill(&mut csrf).map_err(|err| anyhow::anyhow!("no randomness: {err}"))?;
    let console = Arc::new(Console {
        outbox,
        brokers: settings.brokers()?,
        broker_shown: settings
            .broker
            .url()
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
    // Where it listens (with port 0, the port the kernel picked).
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
        .route("/tenant/{tenant}", get(tenant))
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
        if let Ok(oldest) = console.outbox.oldest_wait().await {
            console
                .lag
                .lock()
                .expect("lag history")
                .push(SystemTime::now(), oldest);
        }
    }
}

/// A broker's URL list as shown: each address's scheme, host, port and vhost (AMQP), no user or
/// password.
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

async fn style() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        page::STYLE,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_addresses_are_shown_without_credentials() {
        assert_eq!(
            without_credentials(
                "amqps://relay:s3cret@rabbit-1:5671/prod?heartbeat=5, amqp://guest:guest@rabbit-2/%2f"
            ),
            "amqps://rabbit-1:5671/prod, amqp://rabbit-2/%2f"
        );
        assert_eq!(
            without_credentials("not a url"),
            "(an address that is not a URL)"
        );
    }
}

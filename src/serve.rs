//! The binary's HTTP surface on `RELAY_METRICS_ADDR`: `/metrics` (Prometheus), `/healthz`
//! (the process answers) and `/readyz` (it can do its job). Anything else is 404.
//!
//! For Kubernetes: point the liveness probe at `/healthz` (a failure means restart the pod)
//! and the readiness probe at `/readyz` (a failure means look at it: the database is
//! unreachable, the broker is down while intents wait, or too many branches are parked;
//! restarting does not fix those, so do not use `/readyz` for liveness).
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use distribution::broker::{BrokerHealth, BrokerState};
use distribution::store::Outbox;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;

/// Longest a readiness check waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(1);

/// What the endpoints read.
pub(crate) struct Probes {
    pub(crate) metrics: PrometheusHandle,
    /// On its own small pool, so a busy relay pool does not make the probe time out.
    pub(crate) outbox: Outbox,
    pub(crate) broker: BrokerHealth,
    pub(crate) relay: distribution::RelayProbe,
    pub(crate) without_buckets: WithoutBuckets,
    pub(crate) max_parked: u64,
}

/// What the relay itself says for a readiness check: how long it has held no lease bucket,
/// as the probes saw it (`None`: it holds some, or does not answer), and how long its drains
/// have been held back for replication.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RelayFacts {
    pub(crate) without_buckets_for: Option<Duration>,
    pub(crate) held_back_for: Option<Duration>,
}

/// Drains held back this long make the relay not ready.
const HELD_BACK_NOT_READY: Duration = Duration::from_secs(5);

/// No lease bucket held this long makes the relay not ready: a relay that has just started (or
/// just handed its buckets over) claims them within a heartbeat or two, and is not to be called
/// stuck before then (cli::a_running_relay_answers_health_and_readiness failed once in CI
/// with the probe racing the first claims under load, as far as its truncated log shows).
const NO_BUCKETS_NOT_READY: Duration = Duration::from_secs(5);

/// Since when the probes have seen the relay hold no lease bucket.
#[derive(Debug, Default)]
pub(crate) struct WithoutBuckets(std::sync::Mutex<Option<std::time::Instant>>);

impl WithoutBuckets {
    /// How long the relay has held none, given what it answers now (`None`: some, or no answer).
    fn observe(&self, buckets_held: Option<usize>, now: std::time::Instant) -> Option<Duration> {
        let mut since = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match buckets_held {
            Some(0) => Some(now.duration_since(*since.get_or_insert(now))),
            Some(_) => {
                *since = None;
                None
            }
            None => None,
        }
    }
}

/// What the database said for a readiness check: whether intents wait, and parked branches.
pub(crate) type DatabaseFacts = Result<(bool, u64), String>;

/// Ready, or not with the reasons (pure: the rules of `/readyz`).
pub(crate) fn readiness(
    database: DatabaseFacts,
    broker: BrokerState,
    blocked: bool,
    relay: RelayFacts,
    max_parked: u64,
) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    match database {
        Err(why) => problems.push(format!("database unreachable: {why}")),
        Ok((pending, parked)) => {
            if let Some(without) = relay
                .without_buckets_for
                .filter(|without| pending && *without >= NO_BUCKETS_NOT_READY)
            {
                problems.push(format!(
                    "holds no lease bucket while intents wait, for {} s (its lease renewals do not commit: the database is slow, or waits for a synchronous standby that is down)",
                    without.as_secs()
                ));
            }
            if let Some(held) = relay
                .held_back_for
                .filter(|held| *held >= HELD_BACK_NOT_READY)
            {
                problems.push(format!(
                    "drains held back for {} s: what they read is not yet flushed where RELAY_PUBLISH_REPLICATED requires (a standby down or behind)",
                    held.as_secs()
                ));
            }
            if pending && broker == BrokerState::Down {
                problems.push("broker down while intents wait".into());
            }
            if pending && blocked {
                problems.push(
                    "broker blocks the relay (connection.blocked: a memory or disk alarm) while intents wait"
                        .into(),
                );
            }
            if parked > max_parked {
                problems.push(format!(
                    "{parked} branches parked (more than RELAY_READY_MAX_PARKED={max_parked})"
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The rules of `/readyz` applied to what the probes read now.
async fn ready(probes: &Probes) -> Result<(), Vec<String>> {
    let facts = match tokio::time::timeout(READY_TIMEOUT, probes.outbox.pending_and_parked()).await
    {
        Ok(Ok(facts)) => Ok(facts),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {} ms", READY_TIMEOUT.as_millis())),
    };
    let (state, blocked) = (probes.broker.state(), probes.broker.blocked());
    let buckets_held = probes.relay.buckets_held().await;
    let relay = RelayFacts {
        without_buckets_for: probes
            .without_buckets
            .observe(buckets_held, std::time::Instant::now()),
        held_back_for: probes.relay.held_back_for(),
    };
    readiness(facts, state, blocked, relay, probes.max_parked)
}

async fn answer(probes: &Probes, request: Request<Incoming>) -> Response<Full<Bytes>> {
    match request.uri().path() {
        "/metrics" => {
            // What `/readyz` would answer, for alerts (Prometheus scrapes only this).
            let ready = ready(probes).await.is_ok();
            metrics::gauge!("relay_ready").set(if ready { 1.0 } else { 0.0 });
            text(StatusCode::OK, probes.metrics.render())
        }
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => match ready(probes).await {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
            Err(problems) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {}\n", problems.join("; ")),
            ),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /metrics, /healthz or /readyz\n".into(),
        ),
    }
}

/// Serves the endpoints on `listener` until the process ends; keeps the histograms' upkeep.
pub(crate) fn spawn(listener: tokio::net::TcpListener, probes: Probes) {
    let probes = Arc::new(probes);
    let upkeep = probes.metrics.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %err, "metrics listener cannot accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let probes = probes.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let probes = probes.clone();
                    async move { Ok::<_, Infallible>(answer(&probes, request).await) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await;
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_names_what_the_relay_says() {
        let none = RelayFacts {
            without_buckets_for: Some(Duration::from_secs(6)),
            held_back_for: None,
        };
        let problems = readiness(Ok((true, 0)), BrokerState::Up, false, none, 0).unwrap_err();
        assert!(
            problems[0].starts_with("holds no lease bucket while intents wait, for 6 s"),
            "{problems:?}"
        );
        assert!(
            readiness(Ok((false, 0)), BrokerState::Up, false, none, 0).is_ok(),
            "nothing waits"
        );
        let starting = RelayFacts {
            without_buckets_for: Some(Duration::from_secs(1)),
            held_back_for: None,
        };
        assert!(
            readiness(Ok((true, 0)), BrokerState::Up, false, starting, 0).is_ok(),
            "a relay still claiming its first buckets is not stuck"
        );
        let held = RelayFacts {
            without_buckets_for: None,
            held_back_for: Some(Duration::from_secs(6)),
        };
        let problems = readiness(Ok((true, 0)), BrokerState::Up, false, held, 0).unwrap_err();
        assert!(
            problems[0].starts_with("drains held back for 6 s"),
            "{problems:?}"
        );
        let briefly = RelayFacts {
            without_buckets_for: None,
            held_back_for: Some(Duration::from_secs(1)),
        };
        assert!(readiness(Ok((true, 0)), BrokerState::Up, false, briefly, 0).is_ok());
    }

    #[test]
    fn the_time_without_buckets_counts_from_the_first_probe_that_saw_none() {
        let without = WithoutBuckets::default();
        let start = std::time::Instant::now();
        let later = |secs| start + Duration::from_secs(secs);
        assert_eq!(without.observe(Some(0), start), Some(Duration::ZERO));
        assert_eq!(
            without.observe(None, later(1)),
            None,
            "no answer says nothing"
        );
        assert_eq!(
            without.observe(Some(0), later(6)),
            Some(Duration::from_secs(6))
        );
        assert_eq!(without.observe(Some(4), later(7)), None);
        assert_eq!(
            without.observe(Some(0), later(9)),
            Some(Duration::ZERO),
            "counted anew"
        );
    }

    /// The rules with nothing said by the relay itself.
    fn plain(
        database: DatabaseFacts,
        broker: BrokerState,
        blocked: bool,
        max_parked: u64,
    ) -> Result<(), Vec<String>> {
        readiness(database, broker, blocked, RelayFacts::default(), max_parked)
    }

    #[test]
    fn readiness_names_each_problem() {
        assert!(
            plain(Ok((false, 0)), BrokerState::Down, false, 0).is_ok(),
            "nothing waits"
        );
        assert!(plain(Ok((true, 0)), BrokerState::Unknown, false, 0).is_ok());
        assert!(plain(Ok((true, 0)), BrokerState::Up, false, 0).is_ok());
        let down = plain(Ok((true, 0)), BrokerState::Down, false, 0).unwrap_err();
        assert_eq!(down, vec!["broker down while intents wait".to_owned()]);
        let parked = plain(Ok((false, 3)), BrokerState::Up, false, 2).unwrap_err();
        assert!(parked[0].starts_with("3 branches parked"), "{parked:?}");
        assert!(plain(Ok((false, 2)), BrokerState::Up, false, 2).is_ok());
        let database = plain(Err("refused".into()), BrokerState::Up, false, 0).unwrap_err();
        assert_eq!(database, vec!["database unreachable: refused".to_owned()]);
        // Issue 16: a broker alarm blocks every publishing connection while the last state
        // reported stays Up (nothing faults): blocked with intents waiting is not ready.
        let blocked = plain(Ok((true, 0)), BrokerState::Up, true, 0).unwrap_err();
        assert!(
            blocked[0].starts_with("broker blocks the relay"),
            "{blocked:?}"
        );
        assert!(
            plain(Ok((false, 0)), BrokerState::Up, true, 0).is_ok(),
            "blocked with nothing waiting"
        );
    }
}

//! The binary's HTTP surface on `RELAY_METRICS_ADDR`: `/metrics` (Prometheus), `/healthz`
//! (the process answers) and `/readyz` (it can do its job). Anything else is 404.
//!
//! For Kubernetes: point the liveness probe at `/healthz` (a failure means restart the pod)
//! and the readiness probe at `/readyz` (a failure means look at it: the database is
//! unreachable, the broker is down while intents wait, or too many branches are parked;
//! restarting does not fix those, so do not use `/readyz` for liveness). Its rules are the
//! library's [`Readiness`], which a host embedding the relay can serve itself.
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use distribution::Readiness;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use metrics_exporter_prometheus::PrometheusHandle;

/// What the endpoints read.
pub(crate) struct Probes {
    pub(crate) metrics: PrometheusHandle,
    pub(crate) readiness: Readiness,
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

async fn answer(probes: &Probes, request: Request<Incoming>) -> Response<Full<Bytes>> {
    match request.uri().path() {
        "/metrics" => {
            // What `/readyz` would answer, for alerts (Prometheus scrapes only this).
            let ready = probes.readiness.check().await.is_ok();
            metrics::gauge!("relay_ready").set(if ready { 1.0 } else { 0.0 });
            text(StatusCode::OK, probes.metrics.render())
        }
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => match probes.readiness.check().await {
            Ok(()) => text(StatusCode::OK, "ready\n".into()),
            Err(problems) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {problems}\n"),
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

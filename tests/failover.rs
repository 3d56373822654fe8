//! The failover tests (`it/failover.rs`), the clock steps (`it/clocks.rs`) and the database's
//! pauses (`it/db_pause.rs`), alone in their binary: each runs two private PostgreSQL servers
//! (`it/pg_pair.rs`), which would starve the timing-sensitive tests of `tests/it` running
//! beside them.
#[path = "it/clocks.rs"]
mod clocks;
#[path = "it/db_pause.rs"]
mod db_pause;
#[path = "it/double.rs"]
mod double;
#[path = "it/failover.rs"]
mod failover;
#[path = "it/harness.rs"]
mod harness;
#[path = "it/node.rs"]
mod node;
#[path = "it/pg_pair.rs"]
mod pg_pair;
#[path = "it/recorder.rs"]
mod recorder;

/// This process's metrics (a Prometheus recorder, installed on the first call), rendered.
pub fn metrics_now() -> String {
    static HANDLE: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = distribution::prometheus_builder().unwrap().build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).unwrap();
            handle
        })
        .render()
}

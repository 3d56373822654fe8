//! The alerts and the dashboard that ship with the relay (`deploy/prometheus/rules.yml`,
//! `deploy/grafana/relay.json`) name only metrics the relay and the consumer register, with the
//! labels they really carry: a standalone relay (`distribution run`) with a parked branch and a
//! consumer in this process (alone in its binary: it installs the process-wide metrics
//! recorder, see `tests/it/main.rs`) are scraped, every series of the rules' unit tests must
//! have the shape of a scraped one, and `promtool test rules` passes.
#[path = "it/harness.rs"]
mod harness;

mod alerts {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::time::Duration;

    use distribution::consumer::{Consumer, ConsumerConfig};
    use distribution::store::{Outbox, TenantId};

    use crate::harness::*;

    /// Metric name to the label names its series carry (`instance` and `job` are Prometheus's).
    type Shapes = BTreeMap<String, BTreeSet<BTreeSet<String>>>;

    fn deploy(file: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy")
            .join(file)
    }

    /// `promtool`: `PROMTOOL`, else `scripts/promtool ensure` (on `PATH`, or Debian's package
    /// unpacked once per machine).
    fn promtool() -> PathBuf {
        if let Some(tool) = std::env::var_os("PROMTOOL") {
            return PathBuf::from(tool);
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/promtool");
        let ensured = Command::new(&script).arg("ensure").output().unwrap();
        assert!(
            ensured.status.success(),
            "{script:?} ensure: {}",
            String::from_utf8_lossy(&ensured.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&ensured.stdout).trim())
    }

    /// `name{a="x",b="y"}` or `name`: the name and its label names.
    fn shape_of(series: &str) -> (String, BTreeSet<String>) {
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        let labels = labels
            .trim_end_matches('}')
            .split(',')
            .filter_map(|pair| {
                pair.split_once('=')
                    .map(|(label, _)| label.trim().to_owned())
            })
            .filter(|label| !["instance", "job", "namespace"].contains(&label.as_str()))
            .collect();
        (name.trim().to_owned(), labels)
    }

    /// Every sample line of a Prometheus text exposition, as shapes.
    fn shapes(exposition: &str, into: &mut Shapes) {
        for line in exposition.lines() {
            if !line.starts_with('#') && !line.trim().is_empty() {
                let series = line.rsplit_once(' ').map_or(line, |(series, _)| series);
                let (name, labels) = shape_of(series);
                into.entry(name).or_default().insert(labels);
            }
        }
    }

    /// Every `relay_...` identifier in `text`.
    fn metric_names(text: &str) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for (at, _) in text.match_indices("relay_") {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                continue;
            }
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            names.insert(name);
        }
        names
    }

    /// A histogram's series names its family: `_bucket`, `_sum`, `_count` dropped.
    fn family(name: &str, described: &BTreeSet<String>) -> String {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix)
                && described.contains(base)
            {
                return base.to_owned();
            }
        }
        name.to_owned()
    }

    /// Stops the relay on drop, also when the test fails.
    struct Running(std::process::Child);

    impl Drop for Running {
        fn drop(&mut self) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn alerts_and_dashboard_name_what_the_relay_and_consumer_export() {
        let recorder = distribution::prometheus_builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).unwrap();
        host_runtime().block_on(async {
            let (pool, url) = fresh_database("alerts").await;
            let topology = unique("relay-alerts");
            // One tenant ships; another waits behind a parked branch.
            write_first_intent(&pool, "shipping", b"x").await;
            let parked = write_first_intent(&pool, "waiting", b"y").await;
            let outbox = Outbox::new(pool.clone());
            outbox
                .park_branch(
                    &parked,
                    "nacked",
                    3,
                    Duration::from_secs(1),
                    Duration::from_secs(3600),
                )
                .await
                .unwrap();
            let addr = free_addr();
            let relay = Running(
                run_command(&url, &amqp_url(), &topology, &addr)
                    .spawn()
                    .unwrap(),
            );
            let config = relay_config(&url, &amqp_url(), &topology);
            let rabbit = direct_rabbit(&config);
            distribution::describe_metrics(config.supervisor.publishers());
            let consumer = Consumer::new(
                ConsumerConfig::new(rabbit.clone()),
                pool.clone(),
                distribution::store::EventTable,
            );
            let consuming = until_stopped(|stopped| consumer.run(stopped));

            let waiting = TenantId::new("waiting").unwrap();
            let parked_line = format!("relay_parked_branches{{tenant=\"{waiting}\"}} 1");
            // The backlog gauges cover the tenants drained when a refresh starts: the first
            // refresh may come before the waiting tenant's drainer (a CI run scraped then).
            let backlog_line = format!("relay_backlog_oldest_age_seconds{{tenant=\"{waiting}\"}}");
            wait_until(
                "the relay reports the parked branch, the waiting tenant's backlog and a confirm",
                Duration::from_secs(30),
                || async {
                    http_get(&addr, "/metrics")
                        .await
                        .is_some_and(|(_, scraped)| {
                            scraped.contains(&parked_line)
                                && scraped.contains(&backlog_line)
                                && scraped.contains("relay_write_to_confirm_seconds_count 1")
                        })
                },
            )
            .await;
            // A message the consumer cannot fold (no headers): dead-lettered, counted by reason.
            let (connection, channel) = distribution::rabbit::open(&rabbit, "alerts-forger")
                .await
                .unwrap();
            channel
                .basic_publish(
                    "".into(),
                    rabbit.topology.queue(distribution::broker::Partition(0)),
                    Default::default(),
                    b"not an event",
                    Default::default(),
                )
                .await
                .unwrap();
            wait_until(
                "the consumer reports its dead-letter depth and a dead letter",
                Duration::from_secs(30),
                || async {
                    let rendered = handle.render();
                    rendered.contains("relay_dead_letters{")
                        && rendered.contains("relay_consumer_dead_letters_total{")
                },
            )
            .await;
            drop(connection);
            let mut scraped = Shapes::new();
            shapes(&http_get(&addr, "/metrics").await.unwrap().1, &mut scraped);
            shapes(&handle.render(), &mut scraped);
            let described = distribution::metric_names();
            consuming.stop().await.unwrap();
            drop(relay);
            drop_topology(&rabbit.topology).await;

            // Every metric the files name is one the relay or the consumer describes.
            for file in [
                "prometheus/rules.yml",
                "prometheus/rules.test.yml",
                "grafana/relay.json",
            ] {
                let text = std::fs::read_to_string(deploy(file)).unwrap();
                let names = metric_names(&text);
                assert!(names.len() >= 5, "{file} names metrics: {names:?}");
                for name in names {
                    assert!(
                        described.contains(&family(&name, &described)),
                        "{file} names {name}, which neither the relay nor the consumer registers"
                    );
                }
            }
            // The dashboard is JSON with a query on every panel.
            let dashboard: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(deploy("grafana/relay.json")).unwrap(),
            )
            .unwrap();
            for panel in dashboard["panels"].as_array().unwrap() {
                let targets = panel["targets"].as_array().unwrap();
                assert!(
                    targets.iter().all(|target| target["expr"].is_string()),
                    "{panel}"
                );
                // One deployment at a time: every selector reads the dashboard's namespace
                // (and, for the relay's own metrics, its job) variable.
                for target in targets {
                    let expr = target["expr"].as_str().unwrap();
                    let selectors = expr.matches("relay_").count();
                    assert_eq!(
                        expr.matches("namespace=~\"$namespace\"").count(),
                        selectors,
                        "{expr}"
                    );
                }
            }
            let variables: Vec<&str> = dashboard["templating"]["list"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|variable| variable["name"].as_str())
                .collect();
            assert_eq!(variables, ["datasource", "job", "namespace"]);
            // Every rule that aggregates keeps the deployment's labels (two deployments
            // sharing a Prometheus alert each on its own).
            let rules = std::fs::read_to_string(deploy("prometheus/rules.yml")).unwrap();
            for line in rules.lines().filter(|line| line.contains(" by (")) {
                assert!(
                    line.matches(" by (").count() == line.matches(" by (job, namespace").count(),
                    "a rule aggregates away the deployment: {line}"
                );
            }

            // Every series of the rules' unit tests has the shape of a scraped series.
            let tests = std::fs::read_to_string(deploy("prometheus/rules.test.yml")).unwrap();
            let mut checked = 0;
            for line in tests.lines() {
                let Some(series) = line.trim().strip_prefix("- series: ") else {
                    continue;
                };
                let (name, labels) = shape_of(series.trim_matches('\''));
                let seen = scraped.get(&name).cloned().unwrap_or_default();
                assert!(
                    seen.contains(&labels),
                    "rules.test.yml's {name} with labels {labels:?}; the relay exports {seen:?}"
                );
                checked += 1;
            }
            assert!(checked >= 10, "the unit tests' series were read");

            let promtool = promtool();
            let ran = Command::new(&promtool)
                .args(["test", "rules", "rules.test.yml"])
                .current_dir(deploy("prometheus"))
                .output()
                .unwrap_or_else(|err| panic!("{promtool:?}: {err}"));
            assert!(
                ran.status.success(),
                "promtool test rules:\n{}{}",
                String::from_utf8_lossy(&ran.stdout),
                String::from_utf8_lossy(&ran.stderr)
            );
        });
    }
}

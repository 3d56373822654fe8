//! The deployment files (`deploy/Dockerfile`, `deploy/kubernetes/relay.yaml`) against the binary,
//! without a container engine (none runs here): every variable they set is one
//! `distribution run` or `migrate` reads, the manifest's settings are accepted by the binary,
//! the probes name the routes and the port it serves, and the image builds the binary the way
//! a clone builds (`--locked`) and runs it as a non-root user. Not checked: that the image
//! builds and starts, and that the manifest applies to a cluster.
#[path = "it/harness.rs"]
mod harness;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};

use harness::relay_command as distribution;

fn deploy(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{path:?}: {err}"))
}

/// The variables `distribution <command>` reads (`[env: NAME` in its help).
fn variables_of(command: &str) -> BTreeSet<String> {
    let help = distribution().args([command, "--help"]).output().unwrap();
    assert!(help.status.success());
    String::from_utf8_lossy(&help.stdout)
        .split("[env: ")
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect()
        })
        .collect()
}

/// Every `RELAY_*`, `DATABASE_URL` and `AMQP_URL` named in `text`.
fn variables_in(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
        .filter(|word| word.starts_with("RELAY_") || *word == "DATABASE_URL" || *word == "AMQP_URL")
        .map(str::to_owned)
        .collect()
}

/// The `KEY: value` lines of the manifest's ConfigMap.
fn config_map(manifest: &str) -> Vec<(String, String)> {
    let data = manifest
        .split("\ndata:\n")
        .nth(1)
        .expect("a ConfigMap with data");
    data.lines()
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.trim().split_once(": "))
        .map(|(key, value)| (key.to_owned(), value.trim_matches('"').to_owned()))
        .collect()
}

#[test]
fn every_variable_the_files_set_is_one_the_binary_reads() {
    let known: BTreeSet<String> = ["run", "migrate", "console"]
        .into_iter()
        .flat_map(variables_of)
        .collect();
    assert!(known.len() > 30, "{known:?}");
    for file in ["kubernetes/relay.yaml", "Dockerfile"] {
        let named = variables_in(&deploy(file));
        assert!(named.len() >= 2, "{file}: {named:?}");
        let unknown: Vec<_> = named.difference(&known).collect();
        assert!(
            unknown.is_empty(),
            "{file} sets {unknown:?}, which no command reads"
        );
    }
}

/// The ConfigMap's values pass the binary's validation: with them, `run` gets past its
/// configuration (exit 2 is a configuration error) and fails on the database it cannot reach.
#[test]
fn the_manifests_settings_are_accepted_by_the_binary() {
    let manifest = deploy("kubernetes/relay.yaml");
    let settings = config_map(&manifest);
    assert!(settings.len() >= 5, "{settings:?}");
    let unreachable = format!("postgres://postgres@{}/none", harness::free_addr());
    let mut command = distribution();
    command
        .arg("run")
        .envs(
            settings
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_str())),
        )
        // The manifest's listener is the pod's; this test's must not collide with anything.
        .env("RELAY_METRICS_ADDR", "127.0.0.1:0")
        .env("DATABASE_URL", unreachable)
        .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f");
    let ran = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert_eq!(ran.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("RELAY_"), "no setting refused: {stderr}");
}

#[test]
fn the_probes_name_the_routes_and_port_the_binary_serves() {
    let manifest = deploy("kubernetes/relay.yaml");
    let after = |marker: &str| {
        manifest
            .split(marker)
            .nth(1)
            .and_then(|rest| rest.lines().nth(1))
            .unwrap_or_else(|| panic!("{marker} in the manifest"))
            .trim()
            .to_owned()
    };
    // The routes are the binary's (`cli::a_running_relay_answers_health_and_readiness`).
    assert_eq!(
        after("livenessProbe:"),
        "httpGet: {path: /healthz, port: metrics}"
    );
    assert_eq!(
        after("readinessProbe:"),
        "httpGet: {path: /readyz, port: metrics}"
    );
    assert!(manifest.contains("- {name: metrics, containerPort: 9464}"));
    let settings = config_map(&manifest);
    assert!(
        settings.contains(&("RELAY_METRICS_ADDR".into(), "0.0.0.0:9464".into())),
        "the port the probes use is the one the relay listens on: {settings:?}"
    );
    assert!(manifest.contains("prometheus.io/port: \"9464\""));
    assert!(deploy("Dockerfile").contains("RELAY_METRICS_ADDR=0.0.0.0:9464"));
    // Least privilege: the relay never runs migrations with its own role.
    assert!(settings.contains(&("RELAY_SKIP_MIGRATE".into(), "true".into())));
    for needed in [
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
        "allowPrivilegeEscalation: false",
    ] {
        assert!(manifest.contains(needed), "{needed}");
    }
}

/// The image builds the binary as a clone does (`Cargo.lock` as committed), copies that one
/// file into a base without a shell, and runs it as a non-root user.
#[test]
fn the_image_ships_the_binary_alone_as_a_non_root_user() {
    let dockerfile = deploy("Dockerfile");
    let stages: Vec<&str> = dockerfile
        .lines()
        .filter(|line| line.starts_with("FROM "))
        .collect();
    assert_eq!(stages.len(), 2, "multi-stage: {stages:?}");
    assert!(stages[0].ends_with(" AS build"));
    assert!(dockerfile.contains("RUN cargo build --release --locked --bin distribution\n"));
    let last = dockerfile.rsplit("\nFROM ").next().unwrap();
    let copies: Vec<&str> = last
        .lines()
        .filter(|line| line.starts_with("COPY "))
        .collect();
    assert_eq!(
        copies,
        ["COPY --from=build /src/target/release/distribution /usr/local/bin/distribution"]
    );
    assert!(last.contains("\nUSER nonroot:nonroot\n"));
    assert!(last.contains("ENTRYPOINT [\"/usr/local/bin/distribution\"]"));
    // `--locked` builds: Cargo.lock is what the manifests need.
    let locked = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--locked",
            "--offline",
            "--prefix",
            "none",
            "-e",
            "normal",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(
        locked.status.success(),
        "{}",
        String::from_utf8_lossy(&locked.stderr)
    );
}

/// Applied again, or the next version applied, the manifest neither meets an immutable Job nor
/// runs an image other than this version; relays wait for the schema rather than crash-loop
/// (`cli::skip_migrate_waits_for_the_schema_when_told_to`); a drain keeps a relay; the
/// operators' console runs behind its token.
#[test]
fn the_manifest_pins_its_image_waits_for_its_schema_and_ships_the_console() {
    let manifest = deploy("kubernetes/relay.yaml");
    let version = env!("CARGO_PKG_VERSION");
    let images: Vec<&str> = manifest
        .lines()
        .filter_map(|line| line.trim().strip_prefix("image: "))
        .collect();
    assert_eq!(images.len(), 3, "migrate, relay, console: {images:?}");
    for image in images {
        assert_eq!(image, format!("outbox-relay:{version}"));
    }
    let job = format!("name: outbox-relay-migrate-{}", version.replace('.', "-"));
    assert!(
        manifest.contains(&job),
        "the Job is named for its version: {job}"
    );
    assert!(manifest.contains("ttlSecondsAfterFinished: "));
    let settings = config_map(&manifest);
    let wait = settings
        .iter()
        .find(|(key, _)| key == "RELAY_SCHEMA_WAIT_SECS")
        .map(|(_, value)| value.parse::<u64>().unwrap());
    assert!(wait.is_some_and(|secs| secs >= 60), "{settings:?}");
    let budget = manifest
        .split("kind: PodDisruptionBudget")
        .nth(1)
        .expect("a PodDisruptionBudget");
    assert!(budget.contains("minAvailable: 1"));
    assert!(budget.contains("matchLabels: {app.kubernetes.io/name: outbox-relay}"));
    let console = manifest
        .split("name: outbox-relay-console\n")
        .nth(1)
        .expect("the console's Deployment");
    assert!(console.contains("args: [\"console\"]"));
    assert!(console.contains("- name: RELAY_CONSOLE_TOKEN\n              valueFrom:"));
    assert!(console.contains("secretKeyRef: {name: outbox-relay, key: console-token}"));
}

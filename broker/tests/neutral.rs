//! The split, checked on the manifests (`cargo metadata`): each broker's client crate is a
//! dependency of its adapter alone, and the crates that decide (`store`, `actors`,
//! `supervisor`) and the core itself know no broker.
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// The crates that speak a broker's protocol, and the one workspace crate each may be a
/// dependency of (besides the test helpers', see below).
const CLIENTS: &[(&str, &str)] = &[
    ("lapin", "rabbit"),
    ("amq-protocol", "rabbit"),
    ("amq-protocol-types", "rabbit"),
    ("async-nats", "nats"),
];

/// Workspace crates that still use a broker's client directly: the tests' shared helpers
/// (`testkit`, a dev-dependency only) declare and delete RabbitMQ topologies with lapin. Named
/// here so that no other crate can join them unnoticed; the consumer reads RabbitMQ through
/// `rabbit::RabbitReading` and NATS through `nats::Reading`.
const NOT_YET_SPLIT: &[(&str, &str)] = &[("testkit", "lapin")];

/// Each workspace package's normal (not dev, not build) dependencies, by name.
fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|package| {
            let names = package["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|dep| dep["kind"].is_null())
                .map(|dep| dep["name"].as_str().unwrap().to_owned())
                .collect();
            (package["name"].as_str().unwrap().to_owned(), names)
        })
        .collect()
}

#[test]
fn each_broker_client_is_known_to_its_adapter_alone() {
    let packages = dependencies();
    for name in [
        "broker",
        "rabbit",
        "store",
        "actors",
        "supervisor",
        "consumer",
    ] {
        assert!(packages.contains_key(name), "the workspace has {name}");
    }
    for (package, deps) in &packages {
        for (client, adapter) in CLIENTS {
            let allowed =
                package == adapter || NOT_YET_SPLIT.contains(&(package.as_str(), *client));
            assert!(
                !deps.contains(*client) || allowed,
                "{package} depends on {client}: only {adapter} may"
            );
        }
    }
}

#[test]
fn the_deciding_crates_know_the_core_and_no_adapter() {
    let packages = dependencies();
    for package in ["store", "actors", "supervisor", "broker"] {
        let deps = &packages[package];
        assert!(
            !deps.contains("rabbit") && !deps.contains("nats"),
            "{package} depends on an adapter: {deps:?}"
        );
    }
    for package in ["actors", "supervisor"] {
        assert!(
            packages[package].contains("broker"),
            "{package} drives the core's port"
        );
    }
    assert!(packages["rabbit"].contains("broker"));
}

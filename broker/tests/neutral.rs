//! The split, checked on the manifests (`cargo metadata`): each broker's client crate is a
//! dependency of its adapter alone, and the crates that decide (`store`, `actors`,
//! `supervisor`) and the core itself know no broker. And no production build carries what
//! only tests use: no crate turns on a test-only feature of another but as a dev-dependency.
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

/// `cargo metadata` of the workspace's own packages.
fn metadata() -> serde_json::Value {
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
    serde_json::from_slice(&output.stdout).unwrap()
}

/// Each workspace package's normal (not dev, not build) dependencies: name, and the features
/// it turns on.
fn normal_dependencies() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    metadata()["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|package| {
            let deps = package["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|dep| dep["kind"].is_null())
                .map(|dep| {
                    let features = dep["features"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|feature| feature.as_str().unwrap().to_owned())
                        .collect();
                    (dep["name"].as_str().unwrap().to_owned(), features)
                })
                .collect();
            (package["name"].as_str().unwrap().to_owned(), deps)
        })
        .collect()
}

/// Each workspace package's normal dependencies, by name.
fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    normal_dependencies()
        .into_iter()
        .map(|(package, deps)| (package, deps.into_keys().collect()))
        .collect()
}

/// Features that exist for tests alone (scratch databases, topologies and streams; the broker
/// proxy).
const TEST_ONLY_FEATURES: &[&str] = &["fixtures", "test-tools"];

/// Each workspace package's default features, followed through: every entry `default` reaches
/// in the package's own `[features]` table (`"dep/feature"`, `"dep?/feature"`, `"dep:name"`,
/// or another feature of its own).
fn default_feature_entries() -> BTreeMap<String, BTreeSet<String>> {
    metadata()["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|package| {
            let table = package["features"].as_object().unwrap();
            let mut reached = BTreeSet::new();
            let mut next = vec!["default".to_owned()];
            while let Some(feature) = next.pop() {
                for entry in table
                    .get(&feature)
                    .and_then(|e| e.as_array())
                    .into_iter()
                    .flatten()
                {
                    let entry = entry.as_str().unwrap().to_owned();
                    if reached.insert(entry.clone()) && table.contains_key(&entry) {
                        next.push(entry);
                    }
                }
            }
            (package["name"].as_str().unwrap().to_owned(), reached)
        })
        .collect()
}

#[test]
fn no_production_crate_turns_on_a_test_only_feature() {
    let packages = normal_dependencies();
    assert!(packages["rabbit"].contains_key("store"), "metadata read");
    for (package, deps) in &packages {
        // testkit is the tests' own helper crate, a dev-dependency wherever it is used.
        if package == "testkit" {
            continue;
        }
        assert!(
            !deps.contains_key("testkit"),
            "{package} depends on testkit in a production build"
        );
        for (dep, features) in deps {
            for feature in TEST_ONLY_FEATURES {
                assert!(
                    !features.contains(*feature),
                    "{package} turns on {dep}'s test-only feature {feature} in a production build"
                );
            }
        }
    }
    let defaults = default_feature_entries();
    assert!(
        defaults["distribution"].contains("mimalloc"),
        "features read"
    );
    for (package, entries) in &defaults {
        for entry in entries {
            let named = entry.rsplit('/').next().unwrap_or(entry);
            assert!(
                !TEST_ONLY_FEATURES.contains(&named),
                "{package}'s default features turn on {entry}, a test-only feature"
            );
        }
    }
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

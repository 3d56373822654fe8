//! The relay's integration suite, on this machine's real PostgreSQL and RabbitMQ: one binary,
//! so the harness compiles once and every test shares it.
//!
//! - `outbox_relay`: the T7.4 acceptance suite (`cargo test -p distribution outbox --
//!   --test-threads=1` runs it, with step 9 from `tests/lag.rs`);
//! - `outbox_faults`: the whole relay under an in-memory fault-injecting broker (proptest);
//! - `broker_faults`: node restarts, alarms and size limits on private RabbitMQ nodes;
//! - `handover`, `scale_out`: several relays on one outbox, every delivery counted;
//! - `polyglot`: a TypeScript host and a Python consumer through the SQL API (and its roles);
//! - `retention`: closed runs retired by the relay and the consumer while open runs go on;
//! - `dead_letters`: the dead-letter queue listed, replayed through the fold, purged;
//! - `nats`: the relay on NATS JetStream (the machine's server), read from the stream;
//! - `streams`: replay by a group created later, resume at a stored offset, reset, retention;
//! - `batches`: the consumer's batches, a poison inside one, kills inside and between them;
//! - `consumer`, `poison`, `fairness`, `database_faults`, `schema`, `tls`, `cli`, `publisher`:
//!   one surface each.
//!
//! Two tests live in binaries of their own, `tests/metrics.rs` and `tests/lag.rs`: each installs
//! the process-wide metrics recorder, and a process has only one. The cluster test
//! (`tests/cluster.rs`, from `cluster.rs` here) has its own too: three RabbitMQ VMs on a 2-core
//! machine starve the timing-sensitive tests that would run beside it (a planned handover sent
//! events twice under that load), and cargo runs test binaries one after another. So do the
//! partitions (`tests/partitions.rs`, from `partitions.rs` here: nodes in network namespaces).
//! `under_load` is what the two share: a cluster under load and its checks.
//!
//! Shared tools: `harness` (fresh databases, unique names, workloads, the fold, `wait_until`),
//! `double` (the fault-injecting publisher), `node` (private RabbitMQ nodes), `recorder` (a raw
//! consumer counting every delivery).

mod double;
mod harness;
mod node;
mod recorder;

mod batches;
mod broker_faults;
mod cli;
mod consumer;
mod cuts;
mod database_faults;
mod dead_letters;
mod fairness;
mod groups;
mod handover;
mod nats;
mod outbox_faults;
mod outbox_relay;
mod poison;
mod polyglot;
mod publisher;
mod quorum;
mod retention;
mod scale_out;
mod schema;
mod streams;
mod tls;

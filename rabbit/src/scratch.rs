//! Scratch broker names for tests (feature `fixtures`): a test that names its topology with
//! [`unique`] has its exchange and queues deleted when its process exits, whether its tests
//! passed or failed. The broker is listed with `rabbitmqctl` (AMQP cannot list queues, and the
//! machine's broker has no management plugin), aimed at the node `AMQP_URL` reaches (`-n`,
//! from the `cluster_name` its `connection.start` says, see [`listing`]; a bare `rabbitmqctl`
//! would list this machine's node, whatever `AMQP_URL` names),
//! and every exchange and queue whose name starts with one of this process's names is deleted
//! over AMQP (`AMQP_URL`). Names of a process that
//! never reached its exit are deleted by a later one once over an hour old, as
//! `store::scratch` does with databases.
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Connection, ConnectionProperties};

/// A name no other test of any run uses (`store::scratch::unique`), for a topology: its
/// exchange and queues are deleted when this process exits.
pub fn unique(label: &str) -> String {
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if !REGISTERED.swap(true, Ordering::SeqCst) {
        store::scratch::at_exit(delete_at_exit);
    }
    store::scratch::unique(label)
}

/// For a test of this clean-up: declares a topology named [`unique`]`(label)` (2 partitions)
/// on the broker at `url` and leaves a message in its partition 1; returns its name.
pub async fn leave_a_topology(url: &str, label: &str) -> Result<String, broker::Error> {
    let topology = crate::topology::Topology::new(&unique(label), 2)?;
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(crate::connect::amqp_error)?;
    let channel = connection
        .create_channel()
        .await
        .map_err(crate::connect::amqp_error)?;
    topology.declare(&channel).await?;
    channel
        .basic_publish(
            "".into(),
            topology.queue(broker::Partition(1)),
            Default::default(),
            b"left behind",
            Default::default(),
        )
        .await
        .map_err(crate::connect::amqp_error)?
        .await
        .map_err(crate::connect::amqp_error)?;
    let _ = connection.close(200, "left behind".into()).await;
    Ok(topology.exchange().to_string())
}

/// Whether the broker object `name` (an exchange, or a queue `<exchange>.<...>`) was named by
/// [`unique`] in process `pid`, or over an hour before `now_micros`.
fn ours(name: &str, pid: u32, now_micros: u128) -> bool {
    store::scratch::is_ours(name.split('.').next().unwrap_or(name), pid, now_micros)
}

/// `rabbitmqctl [-n node] list_<what> name`: one name per line; `None` if the tool is missing,
/// fails, or gets no answer within 10 s.
fn listed(what: &str, node: Option<&str>) -> Option<Vec<String>> {
    let mut command = Command::new("rabbitmqctl");
    if let Some(node) = node {
        command.args(["-n", node]);
    }
    let output = command
        .args([
            what,
            "name",
            "--quiet",
            "--no-table-headers",
            "--timeout",
            "10",
        ])
        .output()
        .ok()?;
    output.status.success().then(|| {
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect()
    })
}

/// The queues and exchanges of the node `AMQP_URL` reached, else of the node a bare
/// `rabbitmqctl` reaches: names listed from another broker than `AMQP_URL`'s only make
/// deletes over AMQP that find nothing. `cluster_name` defaults to the node's name with the
/// host's full name (`rabbit@vm`), which is the node's own name unless the node was named
/// `@localhost`, as private test nodes are: both are tried.
fn listing(cluster_name: Option<&str>) -> (Vec<String>, Vec<String>) {
    let mut nodes: Vec<String> = Vec::new();
    if let Some(name) = cluster_name {
        nodes.push(name.to_owned());
        if let Some((id, _host)) = name.split_once('@') {
            nodes.push(format!("{id}@localhost"));
        }
    }
    let list = |what: &str| {
        nodes
            .iter()
            .find_map(|node| listed(what, Some(node)))
            .or_else(|| listed(what, None))
            .unwrap_or_default()
    };
    std::thread::scope(|scope| {
        let queues = scope.spawn(|| list("list_queues"));
        let exchanges = list("list_exchanges");
        (queues.join().unwrap_or_default(), exchanges)
    })
}

/// At the process's exit: deletes this process's (and stale) queues and exchanges, bounded to
/// 30 s.
extern "C" fn delete_at_exit() {
    let Ok(url) = std::env::var("AMQP_URL") else {
        return;
    };
    let deleted = store::scratch::finish_on_own_thread(Duration::from_secs(30), move || {
        async move {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| since.as_micros());
            let pid = std::process::id();
            let cluster_name = crate::version::read_start_at(&url, Default::default())
                .await
                .ok()
                .map(|broker| broker.cluster_name)
                .filter(|name| !name.is_empty());
            let (queues, exchanges) = listing(cluster_name.as_deref());
            let doomed: Vec<(bool, String)> = (queues.into_iter().map(|name| (true, name)))
                .chain(exchanges.into_iter().map(|name| (false, name)))
                .filter(|(_, name)| ours(name, pid, now))
                .collect();
            if doomed.is_empty() {
                return Ok(0);
            }
            let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
            let mut channel = connection.create_channel().await?;
            for (queue, name) in &doomed {
                let name = name.as_str().into();
                let deleted = if *queue {
                    let options = QueueDeleteOptions::default();
                    channel.queue_delete(name, options).await.map(drop)
                } else {
                    let options = ExchangeDeleteOptions::default();
                    channel.exchange_delete(name, options).await
                };
                // A name gone meanwhile (or refused) closes the channel: open another.
                if deleted.is_err() {
                    channel = connection.create_channel().await?;
                }
            }
            let _ = connection.close(200, "scratch deleted".into()).await;
            Ok::<_, lapin::Error>(doomed.len())
        }
    });
    if !matches!(deleted, Some(Ok(_))) {
        eprintln!("scratch topologies not all deleted within 30 s: {deleted:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_processs_names_and_stale_ones_are_ours() {
        let pid = std::process::id();
        let name = store::scratch::unique("relay-x_y");
        let now = name.rsplit('_').next().unwrap().parse::<u128>().unwrap();
        assert!(ours(&name, pid, now), "its exchange");
        assert!(ours(&format!("{name}.p3"), pid, now), "a partition queue");
        assert!(
            ours(&format!("{name}.recorder.dead"), pid, now),
            "a group's queue"
        );
        assert!(!ours(&name, pid + 1, now), "another process's, fresh");
        assert!(
            ours(&name, pid + 1, now + 3_600_000_001),
            "another's, over an hour old"
        );
        assert!(!ours("amq.direct", pid, now));
        assert!(
            !ours("relay-orders.p0", pid, now),
            "a name unique() did not make"
        );
        assert!(!ours("a_b_c", pid, now));
    }
}

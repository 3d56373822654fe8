//! Scratch broker names for tests (feature `fixtures`): a test that names its topology with
//! [`unique`] has its exchange and queues deleted when its process exits, whether its tests
//! passed or failed. The broker is listed with `rabbitmqctl` (AMQP cannot list queues, and the
//! machine's broker has no management plugin), and every exchange and queue whose name starts
//! with one of this process's names is deleted over AMQP (`AMQP_URL`). Names of a process that
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
        unsafe extern "C" {
            fn atexit(callback: extern "C" fn()) -> std::os::raw::c_int;
        }
        // SAFETY: `atexit` is the C library's. The callback cannot unwind across it: its steps
        // that may panic run on a thread of its own, whose panic `join` returns as a value.
        unsafe {
            atexit(delete_at_exit);
        }
    }
    store::scratch::unique(label)
}

/// Whether the broker object `name` (an exchange, or a queue `<exchange>.<...>`) was named by
/// [`unique`] in process `pid`, or over an hour before `now_micros`.
fn ours(name: &str, pid: u32, now_micros: u128) -> bool {
    let base = name.split('.').next().unwrap_or(name);
    let mut parts = base.rsplitn(4, '_');
    let (Some(micros), Some(n), Some(owner), Some(_label)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let (Ok(micros), Ok(_), Ok(owner)) = (
        micros.parse::<u128>(),
        n.parse::<u64>(),
        owner.parse::<u32>(),
    ) else {
        return false;
    };
    // A time in the name that is not a plausible one (before 2020) is not unique()'s.
    let plausible = micros > 1_577_836_800_000_000;
    plausible && (owner == pid || now_micros.saturating_sub(micros) > 3_600_000_000)
}

/// `rabbitmqctl list_<what> name`: one name per line; none if the tool is missing or fails.
fn listed(what: &str) -> Vec<String> {
    let output = Command::new("rabbitmqctl")
        .args([what, "name", "--quiet", "--no-table-headers"])
        .output();
    match output {
        Ok(output) if output.status.success() => String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    }
}

/// At the process's exit: deletes this process's (and stale) queues and exchanges, on a thread
/// of its own (the exiting thread's runtime may be gone by now), bounded to 30 s.
extern "C" fn delete_at_exit() {
    let deleting = std::thread::spawn(|| {
        let Ok(url) = std::env::var("AMQP_URL") else {
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_micros());
        let pid = std::process::id();
        let (queues, exchanges) = std::thread::scope(|scope| {
            let queues = scope.spawn(|| listed("list_queues"));
            let exchanges = listed("list_exchanges");
            (queues.join().unwrap_or_default(), exchanges)
        });
        let queues: Vec<_> = queues.into_iter().filter(|q| ours(q, pid, now)).collect();
        let exchanges: Vec<_> = exchanges
            .into_iter()
            .filter(|e| ours(e, pid, now))
            .collect();
        if queues.is_empty() && exchanges.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        let delete_all = async {
            let connection = Connection::connect(&url, ConnectionProperties::default()).await?;
            let mut channel = connection.create_channel().await?;
            for queue in &queues {
                // A queue gone meanwhile (or refused) closes the channel: open another.
                if channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await
                    .is_err()
                {
                    channel = connection.create_channel().await?;
                }
            }
            for exchange in &exchanges {
                if channel
                    .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                    .await
                    .is_err()
                {
                    channel = connection.create_channel().await?;
                }
            }
            let _ = connection.close(200, "scratch deleted".into()).await;
            Ok::<_, lapin::Error>(())
        };
        let bounded = runtime
            .block_on(async { tokio::time::timeout(Duration::from_secs(30), delete_all).await });
        if !matches!(bounded, Ok(Ok(()))) {
            eprintln!(
                "scratch topologies not all deleted: {} queues, {} exchanges",
                queues.len(),
                exchanges.len()
            );
        }
    });
    let _ = deleting.join();
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

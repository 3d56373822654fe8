//! Scratch databases for tests (feature `fixtures`): each made on `DATABASE_URL`'s server under
//! a name no other run uses, and dropped when the test process exits, whether its tests passed
//! or failed. A process that never reaches its exit (killed, or aborted) leaves its databases
//! to the sweep of a later process that makes one: it drops every scratch database older than
//! an hour. (Not by whether the creating process is gone: another container's tests on the
//! same server have pids this machine cannot see.)
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{Connection, PgConnection, PgPool};

/// Every scratch database's name starts with this.
pub const PREFIX: &str = "relay_it_";

/// This process's scratch databases, dropped at its exit.
static CREATED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A name no other test of any run uses: `<label>_<pid>_<n>_<micros>` (a per-process counter
/// because two tests of one binary can start in the same microsecond; the time last, for the
/// sweep). Also good for a test's broker names.
pub fn unique(label: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{label}_{}_{n}_{}", std::process::id(), now_micros())
}

fn now_micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros())
}

fn server_url() -> String {
    std::env::var("DATABASE_URL").expect("DATABASE_URL (set in .cargo/config.toml)")
}

/// A new, empty database named after `label`: its pool and URL. Panics if the server refuses
/// (a test tool).
pub async fn scratch_database(label: &str) -> (PgPool, String) {
    let url = server_url();
    let name = unique(&format!("{PREFIX}{label}"));
    let mut admin = PgConnection::connect(&url)
        .await
        .expect("connect to DATABASE_URL");
    sweep_once(&mut admin).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create a scratch database");
    CREATED
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .push(name.clone());
    let server = url
        .rsplit_once('/')
        .map_or(url.as_str(), |(server, _)| server);
    let url = format!("{server}/{name}");
    let pool = PgPool::connect(&url)
        .await
        .expect("connect to the scratch database");
    (pool, url)
}

/// Once per process: registers the drop at exit, and drops the scratch databases older than an
/// hour.
async fn sweep_once(admin: &mut PgConnection) {
    static SWEPT: AtomicBool = AtomicBool::new(false);
    if SWEPT.swap(true, Ordering::SeqCst) {
        return;
    }
    unsafe extern "C" {
        fn atexit(callback: extern "C" fn()) -> std::os::raw::c_int;
    }
    // SAFETY: `atexit` is the C library's. The callback cannot unwind across it: its one step
    // that may panic runs on a thread of its own, whose panic `join` returns as a value.
    unsafe {
        atexit(drop_at_exit);
    }
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'relay\\_it\\_%'")
            .fetch_all(&mut *admin)
            .await
            .unwrap_or_default();
    let now = now_micros();
    for name in names.iter().filter(|name| stale(name, now)) {
        drop_database(admin, name).await;
    }
}

/// Whether the scratch database `name` is over an hour old (by the time in its name). Names it
/// cannot read are left alone.
fn stale(name: &str, now: u128) -> bool {
    name.rsplit('_')
        .next()
        .and_then(|micros| micros.parse::<u128>().ok())
        .is_some_and(|created| now.saturating_sub(created) > 3_600_000_000)
}

async fn drop_database(admin: &mut PgConnection, name: &str) {
    let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
    if let Err(err) = sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
        .execute(&mut *admin)
        .await
    {
        eprintln!("scratch database {name} not dropped: {err}");
    }
}

/// At the process's exit: drops this process's scratch databases, on a thread of its own (the
/// exiting thread's runtime and thread-locals may be gone by now).
extern "C" fn drop_at_exit() {
    let names = std::mem::take(&mut *CREATED.lock().unwrap_or_else(|poison| poison.into_inner()));
    if names.is_empty() {
        return;
    }
    let dropping = std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        // Bounded: a server gone by now must not hold the test process at its exit.
        let drop_all = async {
            let Ok(mut admin) = PgConnection::connect(&server_url()).await else {
                return;
            };
            for name in &names {
                drop_database(&mut admin, name).await;
            }
        };
        let bounded = runtime
            .block_on(async { tokio::time::timeout(Duration::from_secs(30), drop_all).await });
        if bounded.is_err() {
            eprintln!("scratch databases not dropped within 30 s: {names:?}");
        }
    });
    let _ = dropping.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_databases_older_than_an_hour_are_stale() {
        let name = unique(&format!("{PREFIX}x_y"));
        let now = now_micros();
        assert!(!stale(&name, now));
        assert!(stale(&name, now + 3_600_000_001), "over an hour old");
        assert!(!stale(&format!("{PREFIX}unreadable"), now));
    }
}

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

/// Whether `name` was made by [`unique`] in process `pid`, or over an hour before
/// `now_micros` (a run that died before its exit hook): what an exit hook may delete.
pub fn is_ours(name: &str, pid: u32, now_micros: u128) -> bool {
    let mut parts = name.rsplitn(4, '_');
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

fn now_micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros())
}

fn server_url() -> String {
    std::env::var("DATABASE_URL").expect("DATABASE_URL (set in .cargo/config.toml)")
}

/// The URL of database `name` on `DATABASE_URL`'s server (its host, port, user and options).
pub fn database_url(name: &str) -> String {
    let url = server_url();
    let (server, options) = match url.split_once('?') {
        Some((server, options)) => (server, format!("?{options}")),
        None => (url.as_str(), String::new()),
    };
    let server = server.rsplit_once('/').map_or(server, |(server, _)| server);
    format!("{server}/{name}{options}")
}

/// A new, empty database named after `label`: its pool and URL. Panics if the server refuses
/// (a test tool).
pub async fn scratch_database(label: &str) -> (PgPool, String) {
    assert!(
        label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_'),
        "a scratch database's label is [A-Za-z0-9_] (it names the database): {label:?}"
    );
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
    let url = database_url(&name);
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
    at_exit(drop_at_exit);
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

/// Has `callback` run when the process exits (C's `atexit`): the test harness exits that way
/// whether its tests passed or failed. `callback` must not unwind: run what may panic through
/// [`finish_on_own_thread`].
pub fn at_exit(callback: extern "C" fn()) {
    unsafe extern "C" {
        fn atexit(callback: extern "C" fn()) -> std::os::raw::c_int;
    }
    // SAFETY: `atexit` is the C library's; the callbacks given here do not unwind (above).
    unsafe {
        atexit(callback);
    }
}

/// Runs `work` on a thread and a runtime of its own, for at most `limit`: for an exit hook,
/// where the exiting thread's runtime and thread-locals may be gone. `None` if it did not
/// finish in time, panicked, or had no runtime (a panic is `join`'s value, never an unwind).
pub fn finish_on_own_thread<F, Fut>(limit: Duration, work: F) -> Option<Fut::Output>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future,
    Fut::Output: Send + 'static,
{
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        runtime.block_on(async { tokio::time::timeout(limit, work()).await.ok() })
    })
    .join()
    .ok()
    .flatten()
}

/// For a test of an exit hook: runs `child`, an ignored test of this same test binary, with
/// `SCRATCH_CHILD=1` (the child does its work only then), checks that it failed, and returns
/// what it printed after `SCRATCH=`.
pub fn failing_child(child: &str) -> String {
    let output = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args(["--ignored", "--exact", child, "--nocapture"])
        .env("SCRATCH_CHILD", "1")
        .output()
        .expect("run the child test");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        !output.status.success(),
        "the child's test failed: {stdout}"
    );
    stdout
        .lines()
        .find_map(|line| line.strip_prefix("SCRATCH="))
        .unwrap_or_else(|| panic!("the child printed its name: {stdout}"))
        .to_owned()
}

/// At the process's exit: drops this process's scratch databases, bounded to 30 s.
extern "C" fn drop_at_exit() {
    let names = std::mem::take(&mut *CREATED.lock().unwrap_or_else(|poison| poison.into_inner()));
    if names.is_empty() {
        return;
    }
    let left = names.clone();
    // Bounded: a server gone by now must not hold the test process at its exit.
    let dropped = finish_on_own_thread(Duration::from_secs(30), move || async move {
        let Ok(mut admin) = PgConnection::connect(&server_url()).await else {
            return;
        };
        for name in &names {
            drop_database(&mut admin, name).await;
        }
    });
    if dropped.is_none() {
        eprintln!("scratch databases not dropped within 30 s: {left:?}");
    }
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

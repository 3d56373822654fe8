//! Scratch databases for tests (feature `fixtures`): each made on `DATABASE_URL`'s server under
//! a name no other run uses, and dropped when the test process exits, whether its tests passed
//! or failed. A process that never reaches its exit (killed, or aborted) leaves its databases
//! to the sweep of the next process that makes one: it drops every scratch database whose
//! process is gone, or that is older than an hour.
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::{Connection, PgConnection, PgPool};

/// Every scratch database's name starts with this.
pub const PREFIX: &str = "relay_it_";

/// This process's scratch databases, dropped at its exit.
static CREATED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A name no other test of any run uses: `relay_it_<label>_<pid>_<n>_<micros>` (a per-process
/// counter because two tests of one binary can start in the same microsecond; the process and
/// the time last, for the sweep).
pub fn unique_name(label: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(
        "{PREFIX}{label}_{}_{n}_{}",
        std::process::id(),
        now_micros()
    )
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
    let name = unique_name(label);
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

/// Once per process: registers the drop at exit, and drops the scratch databases of processes
/// that are gone (or of any process, after an hour).
async fn sweep_once(admin: &mut PgConnection) {
    static SWEPT: Mutex<bool> = Mutex::new(false);
    {
        let mut swept = SWEPT.lock().unwrap_or_else(|poison| poison.into_inner());
        if *swept {
            return;
        }
        *swept = true;
    }
    unsafe extern "C" {
        fn atexit(callback: extern "C" fn()) -> std::os::raw::c_int;
    }
    // SAFETY: `atexit` is the C library's; the callback is a plain function that never unwinds
    // (it catches every panic).
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

/// Whether the scratch database `name` belongs to a process that is gone, or is over an hour
/// old. Names it cannot read are left alone.
fn stale(name: &str, now: u128) -> bool {
    let mut parts = name.rsplit('_');
    let (Some(micros), Some(_n), Some(pid)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let (Ok(created), Ok(pid)) = (micros.parse::<u128>(), pid.parse::<u32>()) else {
        return false;
    };
    let gone = pid != std::process::id()
        && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        && std::path::Path::new("/proc/self").exists();
    gone || now.saturating_sub(created) > 3_600_000_000
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
        runtime.block_on(async {
            let Ok(mut admin) = PgConnection::connect(&server_url()).await else {
                return;
            };
            for name in &names {
                drop_database(&mut admin, name).await;
            }
        });
    });
    let _ = dropping.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_databases_of_gone_processes_or_older_than_an_hour_are_stale() {
        let now = now_micros();
        let mine = format!("{PREFIX}x_{}_0_{now}", std::process::id());
        assert!(!stale(&mine, now));
        assert!(stale(&mine, now + 3_600_000_001), "over an hour old");
        // No process has a pid above the kernel's limit (2^22).
        let gone = format!("{PREFIX}x_y_{}_3_{now}", 1u32 << 30);
        assert!(stale(&gone, now));
        assert!(!stale(&format!("{PREFIX}unreadable"), now));
    }
}

//! A private PostgreSQL primary with a streaming standby, on free ports, made and stopped by the
//! test (never the machine's own server): PostgreSQL 15 from this machine's packages, or 17
//! from the Debian 13 root (`scripts/rabbitmq-root`). The commands are those of
//! `../shared/docs/FAULTS.md` ("PostgreSQL faults"): a standby cloned with `pg_basebackup -R
//! -C -S`, replication cut by clearing the standby's `primary_conninfo`, the primary killed
//! (SIGKILL of its postmaster), the standby promoted; a new standby cloned from the promoted
//! one for the next failover. Everything is stopped and removed when dropped, on failure too.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Which PostgreSQL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Postgres {
    /// The machine's (Debian 12).
    V15,
    /// Debian 13's, in the root `scripts/rabbitmq-root` builds (run with chroot).
    V17,
}

impl Postgres {
    fn bin(self) -> &'static str {
        match self {
            Postgres::V15 => "/usr/lib/postgresql/15/bin",
            Postgres::V17 => "/usr/lib/postgresql/17/bin",
        }
    }

    /// The directory a data path is seen at from here (inside the root for 17).
    fn host_path(self, path: &str) -> PathBuf {
        match self {
            Postgres::V15 => PathBuf::from(path),
            Postgres::V17 => {
                let root = crate::node::rabbitmq4_root();
                root.join(path.trim_start_matches('/'))
            }
        }
    }

    /// `tool args...` as the postgres user (in the root for 17).
    fn command(self, tool: &str, args: &[&str]) -> Command {
        let tool = format!("{}/{tool}", self.bin());
        match self {
            Postgres::V15 => {
                let mut command = Command::new("runuser");
                command.args(["-u", "postgres", "--", &tool]).args(args);
                command
            }
            Postgres::V17 => {
                let root = crate::node::rabbitmq4_root();
                let ids = std::fs::read_to_string(root.join("etc/passwd"))
                    .ok()
                    .and_then(|passwd| {
                        passwd.lines().find_map(|line| {
                            let fields: Vec<&str> = line.split(':').collect();
                            (fields.first() == Some(&"postgres"))
                                .then(|| format!("{}:{}", fields[2], fields[3]))
                        })
                    })
                    .expect("a postgres user in the Debian 13 root");
                let mut command = Command::new("chroot");
                command
                    .arg(format!("--userspec={ids}"))
                    .arg(root)
                    .arg(&tool)
                    .args(args);
                command
            }
        }
    }

    /// The postgres user's uid:gid here (15) or in the root (17), for `chown`.
    fn owner(self) -> String {
        match self {
            Postgres::V15 => "postgres:postgres".into(),
            Postgres::V17 => {
                let root = crate::node::rabbitmq4_root();
                let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
                passwd
                    .lines()
                    .find_map(|line| {
                        let fields: Vec<&str> = line.split(':').collect();
                        (fields.first() == Some(&"postgres"))
                            .then(|| format!("{}:{}", fields[2], fields[3]))
                    })
                    .unwrap()
            }
        }
    }
}

fn run(mut command: Command, what: &str) -> String {
    let output = command
        .output()
        .unwrap_or_else(|err| panic!("{what}: {err}"));
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// libfaketime's preload (Debian's `libfaketime`, which `.ci/run` installs).
const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The wall clock of the servers started with it (libfaketime, `../shared/docs/FAULTS.md`,
/// "Clock steps"): an offset in a file the servers read at every clock call, so a step
/// reaches open sessions at once. Their monotonic clock is left alone, as a real step (an
/// operator's `date -s`, a VM restored, NTP stepping) leaves it. Removed when dropped.
pub struct FakedClock {
    path: PathBuf,
}

impl FakedClock {
    /// A clock at the real time.
    pub fn new(label: &str) -> Self {
        let path = PathBuf::from(format!("/tmp/relay-clock-{}-{label}", std::process::id()));
        let clock = Self { path };
        clock.set("+0");
        clock
    }

    /// Steps the clock to `offset` from the real time (libfaketime's syntax: `+2h`, `-1h`,
    /// `+0`).
    pub fn set(&self, offset: &str) {
        let next = self.path.with_extension("next");
        std::fs::write(&next, format!("{offset}\n")).unwrap();
        // Renamed over the old one: a server never reads a half-written offset.
        std::fs::rename(&next, &self.path).unwrap();
    }

    /// The environment that makes a server's clock this one.
    fn env(&self) -> Vec<String> {
        vec![
            format!("LD_PRELOAD={FAKETIME}"),
            format!("FAKETIME_TIMESTAMP_FILE={}", self.path.display()),
            "FAKETIME_NO_CACHE=1".into(),
            "FAKETIME_DONT_FAKE_MONOTONIC=1".into(),
        ]
    }
}

impl Drop for FakedClock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One server of the pair.
#[derive(Debug)]
struct Server {
    /// Its data directory, as the server sees it.
    data: String,
    port: u16,
    name: String,
}

/// A primary and its standby (after a failover: the promoted server and a new standby).
pub struct PgPair {
    version: Postgres,
    dir: String,
    primary: Server,
    standby: Option<Server>,
    /// Servers stopped or killed but kept on disk (a killed primary is never started again:
    /// it would come back writable on the old timeline).
    dead: Vec<Server>,
    servers: u32,
    synchronous: bool,
    /// The environment each server starts with (a faked clock's).
    env: Vec<String>,
}

static PAIRS: AtomicU32 = AtomicU32::new(0);

impl PgPair {
    /// A primary (database `relay`, streaming replication allowed) and an asynchronous standby
    /// that caught up with it.
    pub fn start(version: Postgres, label: &str) -> Self {
        Self::start_with(version, label, Vec::new(), "", true)
    }

    /// A primary alone (database `relay`, no standby), `settings` added to its
    /// `postgresql.conf`: a server set as production sets it where this machine's is not
    /// (the machine's runs with autovacuum off).
    pub fn alone(version: Postgres, label: &str, settings: &str) -> Self {
        Self::start_with(version, label, Vec::new(), settings, false)
    }

    /// [`PgPair::start`], each server's wall clock `clock` (PostgreSQL 15 only: libfaketime is
    /// installed on this machine, not in the Debian 13 root).
    pub fn start_with_clock(version: Postgres, label: &str, clock: &FakedClock) -> Self {
        assert_eq!(
            version,
            Postgres::V15,
            "libfaketime is installed for 15 only"
        );
        Self::start_with(version, label, clock.env(), "", true)
    }

    fn start_with(
        version: Postgres,
        label: &str,
        env: Vec<String>,
        settings: &str,
        standby: bool,
    ) -> Self {
        let n = PAIRS.fetch_add(1, Ordering::SeqCst);
        let dir = format!("/var/tmp/relay-pgpair-{}-{n}-{label}", std::process::id());
        let host_dir = version.host_path(&dir);
        let _ = std::fs::remove_dir_all(&host_dir);
        std::fs::create_dir_all(&host_dir).unwrap();
        let mut chown = Command::new("chown");
        chown.args([&version.owner(), host_dir.to_str().unwrap()]);
        run(chown, "chown");
        let port = testkit::free_port();
        let primary = Server {
            data: format!("{dir}/s0"),
            port,
            name: "s0".into(),
        };
        run(
            version.command(
                "initdb",
                &[
                    "-D",
                    &primary.data,
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C.UTF-8",
                ],
            ),
            "initdb",
        );
        let conf = version.host_path(&format!("{}/postgresql.conf", primary.data));
        let mut conf_text = std::fs::read_to_string(&conf).unwrap();
        conf_text.push_str(&format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '/tmp'\n\
             wal_level = replica\nmax_wal_senders = 10\nwal_keep_size = '256MB'\n\
             max_connections = 100\ncluster_name = 's0'\n{settings}\n"
        ));
        std::fs::write(&conf, conf_text).unwrap();
        let mut pair = Self {
            version,
            dir,
            primary,
            standby: None,
            dead: Vec::new(),
            servers: 1,
            synchronous: false,
            env,
        };
        pair.start_server(&pair.primary.data.clone());
        pair.psql(pair.primary.port, "CREATE DATABASE relay");
        if standby {
            pair.clone_standby();
        }
        pair
    }

    fn start_server(&self, data: &str) {
        let log = format!("{data}/server.log");
        let args = ["-D", data, "-l", &log, "-w", "-t", "60", "start"];
        let command = if self.env.is_empty() {
            self.version.command("pg_ctl", &args)
        } else {
            // `env` after runuser: the preload reaches pg_ctl and the server it forks.
            let pg_ctl = format!("{}/pg_ctl", self.version.bin());
            let mut command = Command::new("runuser");
            command
                .args(["-u", "postgres", "--", "env"])
                .args(&self.env)
                .arg(pg_ctl)
                .args(args);
            command
        };
        run(command, "pg_ctl start");
    }

    /// A new standby cloned from the primary, streaming from it through a slot of its own.
    fn clone_standby(&mut self) {
        let name = format!("s{}", self.servers);
        self.servers += 1;
        let standby = Server {
            data: format!("{}/{name}", self.dir),
            port: testkit::free_port(),
            name: name.clone(),
        };
        let port = self.primary.port.to_string();
        run(
            self.version.command(
                "pg_basebackup",
                &[
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port,
                    "-U",
                    "postgres",
                    "-D",
                    &standby.data,
                    "-R",
                    "-X",
                    "stream",
                    "-C",
                    "-S",
                    &name,
                    // At once: the default spreads its first checkpoint over minutes.
                    "--checkpoint=fast",
                ],
            ),
            "pg_basebackup",
        );
        let conf = self
            .version
            .host_path(&format!("{}/postgresql.auto.conf", standby.data));
        let mut settings = std::fs::read_to_string(&conf).unwrap();
        // A clone inherits the primary's synchronous_standby_names, and a promoted server
        // with it waits for ever for a standby it does not have (FAULTS.md).
        settings.push_str(&format!(
            "port = {}\ncluster_name = '{name}'\nsynchronous_standby_names = ''\n",
            standby.port
        ));
        std::fs::write(&conf, settings).unwrap();
        self.start_server(&standby.data);
        self.standby = Some(standby);
        self.wait_streaming();
        if self.synchronous {
            self.set_synchronous(true);
        }
    }

    /// The primary's port (what a proxy should point at).
    pub fn primary_port(&self) -> u16 {
        self.primary.port
    }

    /// The standby's port.
    pub fn standby_port(&self) -> u16 {
        self.standby.as_ref().expect("a standby").port
    }

    /// `host:port` of the primary.
    pub fn primary_authority(&self) -> String {
        format!("127.0.0.1:{}", self.primary.port)
    }

    /// The URL of database `relay` on `port`.
    pub fn url(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/relay")
    }

    /// Runs `sql` with psql on `port` (database `relay` if it exists, else `postgres`);
    /// returns its unaligned output.
    pub fn psql(&self, port: u16, sql: &str) -> String {
        let mut command = Command::new("psql");
        let database = if sql.starts_with("CREATE DATABASE") {
            "postgres"
        } else {
            "relay"
        };
        command.args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "postgres",
            "-d",
            database,
            "-qAtX",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            sql,
        ]);
        run(command, &format!("psql -c {sql:?}")).trim().to_owned()
    }

    /// Waits until the standby streams from the primary.
    pub fn wait_streaming(&self) {
        let name = self.standby.as_ref().expect("a standby").name.clone();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let state = self.psql(
                self.primary.port,
                &format!("SELECT state FROM pg_stat_replication WHERE application_name = '{name}'"),
            );
            if state == "streaming" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{name} never streamed: {state:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the standby replayed everything the primary wrote so far.
    pub fn wait_caught_up(&self) {
        let standby = self.standby.as_ref().expect("a standby").port;
        let target = self.psql(self.primary.port, "SELECT pg_current_wal_lsn()");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let replayed = self.psql(
                standby,
                &format!("SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn"),
            );
            if replayed == "t" {
                return;
            }
            assert!(Instant::now() < deadline, "the standby never caught up");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Synchronous replication on (the standby by its name) or off.
    pub fn set_synchronous(&mut self, on: bool) {
        self.synchronous = on;
        let names = match (&self.standby, on) {
            (Some(standby), true) => standby.name.clone(),
            _ => String::new(),
        };
        self.psql(
            self.primary.port,
            &format!("ALTER SYSTEM SET synchronous_standby_names = '{names}'"),
        );
        self.psql(self.primary.port, "SELECT pg_reload_conf()");
        if on {
            let deadline = Instant::now() + Duration::from_secs(30);
            while self.psql(
                self.primary.port,
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
            ) != "1"
            {
                assert!(
                    Instant::now() < deadline,
                    "the standby never became synchronous"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    /// The standby stops receiving WAL (its `primary_conninfo` cleared): whatever commits from
    /// now on exists on the primary alone.
    pub fn cut_replication(&self) {
        let standby = self.standby.as_ref().expect("a standby").port;
        self.psql(standby, "ALTER SYSTEM SET primary_conninfo = ''");
        self.psql(standby, "SELECT pg_reload_conf()");
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.psql(
            self.primary.port,
            "SELECT count(*) FROM pg_stat_replication",
        ) != "0"
        {
            assert!(Instant::now() < deadline, "replication never stopped");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the standby (fast shutdown); `start_standby` starts it again.
    pub fn stop_standby(&self) {
        let standby = self.standby.as_ref().expect("a standby");
        run(
            self.version
                .command("pg_ctl", &["-D", &standby.data, "-m", "fast", "-w", "stop"]),
            "pg_ctl stop",
        );
    }

    /// Starts the stopped standby again.
    pub fn start_standby(&self) {
        let data = self.standby.as_ref().expect("a standby").data.clone();
        self.start_server(&data);
    }

    /// The running postmaster of `data`, if any (checked in /proc: a pid file outlives its
    /// process, and its pid may belong to another by now).
    fn postmaster_pid(&self, data: &str) -> Option<i32> {
        let pid =
            std::fs::read_to_string(self.version.host_path(&format!("{data}/postmaster.pid")))
                .ok()?;
        let pid: i32 = pid.lines().next()?.trim().parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        String::from_utf8_lossy(&cmdline)
            .contains(data)
            .then_some(pid)
    }

    /// The failover: the primary killed (SIGKILL of its postmaster; never started again), the
    /// standby promoted, and, if `clone_next`, a new standby cloned from it. Returns the new
    /// primary's port.
    pub fn fail_over(&mut self, clone_next: bool) -> u16 {
        self.kill_primary();
        self.promote(clone_next)
    }

    /// Kills the primary (SIGKILL of its postmaster); it is never started again.
    /// Stops the primary (SIGSTOP to its postmaster, then to every process it forked: a VM
    /// frozen, or a host stalled): connections stay open and new ones are accepted by the
    /// kernel, but nothing answers until [`PgPair::resume_primary`].
    pub fn pause_primary(&self) {
        signal_server(self.postmaster_pid(&self.primary.data), "-STOP");
    }

    /// Resumes a paused primary.
    pub fn resume_primary(&self) {
        signal_server(self.postmaster_pid(&self.primary.data), "-CONT");
    }

    pub fn kill_primary(&self) {
        if let Some(pid) = self.postmaster_pid(&self.primary.data) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }

    /// Promotes the standby (running) once the primary is dead, and, if `clone_next`, clones
    /// a new standby from it. Returns the new primary's port.
    pub fn promote(&mut self, clone_next: bool) -> u16 {
        let standby = self.standby.take().expect("a standby to promote");
        // Promoted once its replay ends (what it received is replayed first).
        run(
            self.version.command(
                "pg_ctl",
                &["-D", &standby.data, "-w", "-t", "60", "promote"],
            ),
            "pg_ctl promote",
        );
        let old = std::mem::replace(&mut self.primary, standby);
        self.dead.push(old);
        if clone_next {
            self.clone_standby();
        }
        self.primary.port
    }

    /// The primary's WAL timeline.
    pub fn timeline(&self) -> u64 {
        self.psql(
            self.primary.port,
            "SELECT ('x'||substr(pg_walfile_name(pg_current_wal_lsn()),1,8))::bit(32)::int",
        )
        .parse()
        .unwrap()
    }
}

/// Sends `signal` to the postmaster `pid` and then to every process it forked (a STOP never
/// races a fork: the postmaster is stopped first).
fn signal_server(pid: Option<i32>, signal: &str) {
    let Some(pid) = pid else {
        return;
    };
    let _ = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status();
    let children = Command::new("pgrep")
        .args(["-P", &pid.to_string()])
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
        .unwrap_or_default();
    for child in children.split_whitespace() {
        let _ = Command::new("kill").args([signal, child]).status();
    }
}

impl Drop for PgPair {
    fn drop(&mut self) {
        let mut servers: Vec<&Server> = self.dead.iter().collect();
        servers.push(&self.primary);
        servers.extend(self.standby.as_ref());
        for server in servers {
            // A paused server's processes are woken first: a stopped backend would outlive
            // its postmaster's kill.
            signal_server(self.postmaster_pid(&server.data), "-CONT");
            if let Some(pid) = self.postmaster_pid(&server.data) {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
        let _ = std::fs::remove_dir_all(self.version.host_path(&self.dir));
    }
}

/// The data directory of `pair`'s servers, for a failure's report.
pub fn logs(pair: &PgPair) -> Vec<PathBuf> {
    let mut logs = Vec::new();
    let host = pair.version.host_path(&pair.dir);
    if let Ok(entries) = std::fs::read_dir(&host) {
        for entry in entries.flatten() {
            let log = entry.path().join("server.log");
            if Path::new(&log).exists() {
                logs.push(log);
            }
        }
    }
    logs
}

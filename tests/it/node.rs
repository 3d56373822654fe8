//! A private RabbitMQ node a test starts, hurts and stops itself (never the machine's own on
//! 5672): its own node name, ports, data and log directories, started with `rabbitmq-server
//! -detached` and driven with `rabbitmqctl -n <node>`. Dropping it stops the node and removes
//! its files, on failure too (a panic unwinds through the drop).
//!
//! Its version is a parameter ([`Rabbit`]): the machine's packages (3.10), or RabbitMQ 4.0 from
//! the Debian 13 root `scripts/rabbitmq-root` builds once per machine (the first 4.0 node of a
//! run builds it if it is missing: under a minute here). A 4.0 node runs inside that root
//! (`chroot`) with the root's own epmd on port [`EPMD_4`], so it never meets the machine's.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Which RabbitMQ a private node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rabbit {
    /// This machine's packages (RabbitMQ 3.10, Erlang 25).
    V3_10,
    /// Debian 13's packages (RabbitMQ 4.0.5, Erlang 27), in the root of `scripts/rabbitmq-root`.
    V4_0,
}

/// The epmd port of nodes in the RabbitMQ 4 root (the machine's epmd keeps 4369).
pub const EPMD_4: u16 = 4370;

impl Rabbit {
    /// The root its programs run in (`None`: this machine's own).
    fn root(self) -> Option<&'static Path> {
        match self {
            Rabbit::V3_10 => None,
            Rabbit::V4_0 => Some(rabbitmq4_root()),
        }
    }

    /// `program`, run in the version's root with its epmd port.
    pub fn command(self, program: &str) -> Command {
        match self.root() {
            None => Command::new(program),
            Some(root) => {
                let mut command = Command::new("chroot");
                command
                    .arg(root)
                    .arg(program)
                    .env("ERL_EPMD_PORT", EPMD_4.to_string());
                command
            }
        }
    }

    /// A path as seen on this machine, for one as seen by the version's programs.
    fn outside(self, inside: &Path) -> PathBuf {
        match self.root() {
            None => inside.to_owned(),
            Some(root) => root.join(inside.strip_prefix("/").unwrap_or(inside)),
        }
    }
}

/// The RabbitMQ 4 root, built if missing (once per process; the script takes a lock, so
/// concurrent test processes build it once).
pub fn rabbitmq4_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let output = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/rabbitmq-root"
        ))
        .arg("ensure")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("scripts/rabbitmq-root runs");
        assert!(
            output.status.success(),
            "scripts/rabbitmq-root ensure failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
    })
}

pub struct PrivateNode {
    rabbit: Rabbit,
    name: String,
    port: u16,
    /// Its data and logs, as its programs see the path (inside its version's root).
    dir: PathBuf,
    /// The VM's OS pid (its node name is not on its command line), to kill it should it stop
    /// answering.
    pid: Option<u32>,
}

/// Stops private nodes of earlier test runs whose process is gone (killed before its nodes'
/// drops ran), and removes their directories. Once per process and version; never touches
/// other nodes.
fn sweep_stale_nodes(rabbit: Rabbit) {
    static SWEPT: [std::sync::Once; 2] = [std::sync::Once::new(), std::sync::Once::new()];
    static SWEPT_NETS: std::sync::Once = std::sync::Once::new();
    // Partitionable clusters (their namespaces, bridges and nodes) of processes gone.
    SWEPT_NETS.call_once(|| {
        let _ = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/rabbitmq-cluster"
        ))
        .arg("sweep")
        .stdin(std::process::Stdio::null())
        .status();
    });
    SWEPT[rabbit as usize].call_once(|| {
        let mut epmd = rabbit.command("epmd");
        if rabbit == Rabbit::V4_0 {
            epmd.args(["-port", &EPMD_4.to_string()]);
        }
        if let Ok(output) = epmd.arg("-names").output() {
            for line in String::from_utf8_lossy(&output.stdout).lines() {
                // "name relaynode_<pid>_<n>_<label> at port <port>"
                let Some(name) = line
                    .strip_prefix("name ")
                    .and_then(|rest| rest.split_whitespace().next())
                else {
                    continue;
                };
                let Some(pid) = name
                    .strip_prefix("relaynode_")
                    .and_then(|rest| rest.split('_').next())
                else {
                    continue;
                };
                if Path::new(&format!("/proc/{pid}")).exists() {
                    continue;
                }
                let _ = rabbit
                    .command("rabbitmqctl")
                    .args(["-n", &format!("{name}@localhost"), "stop"])
                    .output();
            }
        }
        let Ok(entries) = std::fs::read_dir(rabbit.outside(&std::env::temp_dir())) else {
            return;
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = file_name
                .strip_prefix("relay-node-")
                .and_then(|rest| rest.split('-').next())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    });
}

impl PrivateNode {
    /// Starts a node of this machine's RabbitMQ (3.10) and waits until it accepts AMQP
    /// connections (about 6 s here).
    pub fn start(label: &str) -> Self {
        Self::start_on(Rabbit::V3_10, label)
    }

    /// Starts a node of `rabbit`'s version and waits until it accepts AMQP connections.
    pub fn start_on(rabbit: Rabbit, label: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        sweep_stale_nodes(rabbit);
        let name = format!("relaynode_{}_{n}_{label}@localhost", std::process::id());
        let (port, dist) = (testkit::free_port(), testkit::free_port());
        // `/tmp` of the node's own root: the sweep above finds it there.
        let dir = std::env::temp_dir().join(format!("relay-node-{}-{n}", std::process::id()));
        let outside = rabbit.outside(&dir);
        let _ = std::fs::remove_dir_all(&outside);
        for sub in ["mnesia", "log"] {
            std::fs::create_dir_all(outside.join(sub)).unwrap();
        }
        std::fs::write(
            outside.join("rabbitmq.conf"),
            format!("loopback_users = none\nlisteners.tcp.default = 127.0.0.1:{port}\n"),
        )
        .unwrap();
        std::fs::write(outside.join("enabled_plugins"), "[].\n").unwrap();
        // The server runs as user rabbitmq (Debian's wrapper switches to it when run as root),
        // the root's own user for a 4.0 node.
        let chown = rabbit
            .command("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(chown.success(), "chown of {dir:?}");
        let mut node = Self {
            rabbit,
            name,
            port,
            dir,
            pid: None,
        };
        let status = rabbit
            .command("rabbitmq-server")
            .arg("-detached")
            .env("RABBITMQ_NODENAME", &node.name)
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", dist.to_string())
            .env("RABBITMQ_MNESIA_BASE", node.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", node.dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", node.dir.join("rabbitmq.conf"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                node.dir.join("enabled_plugins"),
            )
            .status()
            .expect("rabbitmq-server is installed");
        assert!(
            status.success(),
            "rabbitmq-server -detached for {}",
            node.name
        );
        node.await_startup();
        node.pid = node.os_pid();
        node
    }

    /// The version it runs.
    pub fn rabbit(&self) -> Rabbit {
        self.rabbit
    }

    fn os_pid(&self) -> Option<u32> {
        let pid = self.try_ctl(&["eval", "os:getpid()."]).ok()?;
        pid.chars()
            .filter(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .ok()
    }

    /// Waits until the node runs its application and its AMQP port answers. The node registers
    /// with epmd a few seconds after `-detached` returns; until then `await_startup` fails at
    /// once, so it is asked again until a deadline.
    fn await_startup(&self) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let up = self.try_ctl(&["await_startup", "--timeout", "60"]).is_ok()
                && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok();
            if up {
                return;
            }
            if Instant::now() >= deadline {
                // The drop removes the directory: the log's end goes into the failure.
                let log = self.rabbit.outside(&self.dir.join("log"));
                let tail: String = std::fs::read_dir(&log)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|file| {
                        let text = std::fs::read_to_string(file.path()).unwrap_or_default();
                        let lines: Vec<&str> = text.lines().collect();
                        let last = lines[lines.len().saturating_sub(20)..].join("\n");
                        format!("--- {:?}\n{last}\n", file.path())
                    })
                    .collect();
                let last = self.try_ctl(&["await_startup", "--timeout", "1"]);
                panic!(
                    "private node {} did not start within 90 s (rabbitmqctl: {last:?}); its logs:\n{tail}",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f` with test-speed heartbeats.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f?heartbeat=5", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    fn try_ctl(&self, args: &[&str]) -> Result<String, String> {
        let output = self
            .rabbit
            .command("rabbitmqctl")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|err| err.to_string())?;
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        if output.status.success() {
            Ok(text)
        } else {
            Err(format!("{text}{}", String::from_utf8_lossy(&output.stderr)))
        }
    }

    /// Runs `rabbitmqctl -n <node> args...`; panics with its output if it fails.
    pub fn ctl(&self, args: &[&str]) -> String {
        self.try_ctl(args)
            .unwrap_or_else(|err| panic!("rabbitmqctl {args:?} on {}: {err}", self.name))
    }

    /// The broker application stops (connections closed, queues gone from memory) and starts
    /// again: a node restart without the Erlang VM's own start-up time.
    pub fn stop_app(&self) {
        self.ctl(&["stop_app"]);
    }

    pub fn start_app(&self) {
        self.ctl(&["start_app"]);
        self.await_startup();
    }

    /// Raises (or clears) a memory alarm: every publishing connection is blocked until cleared.
    pub fn memory_alarm(&self, on: bool) {
        self.ctl(&[
            "set_vm_memory_high_watermark",
            if on { "0.00001" } else { "0.4" },
        ]);
    }

    /// Whether the node has an alarm in effect.
    pub fn alarmed(&self) -> bool {
        self.ctl(&["eval", "rabbit_alarm:get_alarms()."]).trim() != "[]"
    }

    /// The largest message the node accepts by its own default (its configuration sets none).
    pub fn default_max_message_size(&self) -> usize {
        let value = self.ctl(&["eval", "application:get_env(rabbit, max_message_size)."]);
        value
            .chars()
            .filter(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or_else(|_| panic!("max_message_size of {}: {value}", self.name))
    }

    /// The largest message the node accepts; applies to connections opened afterwards, so the
    /// node's connections are closed too. 3.10 reads the application's setting when a channel
    /// opens; 4.0 caches it in a `persistent_term` at boot (a bare `set_env` has no effect
    /// there, seen on 4.0.5), so both are set.
    pub fn max_message_size(&self, bytes: usize) {
        self.ctl(&[
            "eval",
            &format!(
                "application:set_env(rabbit, max_message_size, {bytes}), \
                 persistent_term:put(max_message_size, {bytes})."
            ),
        ]);
        self.ctl(&[
            "close_all_connections",
            "max_message_size changed by the test",
        ]);
    }
}

impl Drop for PrivateNode {
    fn drop(&mut self) {
        if self.try_ctl(&["stop"]).is_err()
            && let Some(pid) = self.pid
        {
            // Not answering: kill its VM, and nothing else.
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let _ = std::fs::remove_dir_all(self.rabbit.outside(&self.dir));
    }
}

/// A private 3-node RabbitMQ cluster (`scripts/rabbitmq-cluster`), stopped with its data when
/// dropped (on failure too). Nodes are numbered from 1.
pub struct PrivateCluster {
    rabbit: Rabbit,
    /// Its nodes' data, as seen from this machine (inside the version's root).
    dir: PathBuf,
    urls: String,
}

impl PrivateCluster {
    /// Starts three nodes of this machine's RabbitMQ (3.10) and joins them (about 35 s here).
    pub fn start(label: &str) -> Self {
        Self::start_on(Rabbit::V3_10, label)
    }

    /// Starts three nodes of `rabbit`'s version and joins them.
    pub fn start_on(rabbit: Rabbit, label: &str) -> Self {
        Self::start_with(rabbit, label, false)
    }

    /// Starts three nodes of `rabbit`'s version, each in a network namespace of its own (on a
    /// bridge of the cluster's own, `net_ticktime` 10, `pause_minority`), and joins them: a
    /// cluster whose links [`PrivateCluster::cut`] can drop without a reset.
    pub fn start_partitionable(rabbit: Rabbit, label: &str) -> Self {
        Self::start_with(rabbit, label, true)
    }

    fn start_with(rabbit: Rabbit, label: &str, namespaces: bool) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        // One cluster boots at a time: six nodes booting at once on two cores can outlast the
        // script's 120 s wait for a node.
        static BOOTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        sweep_stale_nodes(rabbit);
        // Names and directories the sweep above recognises, should this process be killed.
        let pid = std::process::id();
        let dir = rabbit
            .outside(&std::env::temp_dir())
            .join(format!("relay-node-{pid}-cluster{n}-{label}"));
        let _booting = BOOTING.lock().unwrap_or_else(|poison| poison.into_inner());
        let mut cluster = Self {
            rabbit,
            dir,
            urls: String::new(),
        };
        let mut start = cluster.script_command();
        start.env(
            "RABBITMQ_CLUSTER_PREFIX",
            format!("relaynode_{pid}_cluster{n}"),
        );
        if namespaces {
            start
                .env("RABBITMQ_CLUSTER_NET", "netns")
                .env("RABBITMQ_CLUSTER_OWNER", pid.to_string());
        }
        cluster.urls = run_script(start.arg("start").arg(&cluster.dir))
            .trim()
            .to_owned();
        cluster
    }

    fn script(&self, args: &[&str]) -> String {
        run_script(
            self.script_command()
                .arg(args[0])
                .arg(&self.dir)
                .args(&args[1..]),
        )
    }

    /// `scripts/rabbitmq-cluster`, pointed at the cluster's RabbitMQ (its root, if any).
    fn script_command(&self) -> Command {
        let mut command = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/rabbitmq-cluster"
        ));
        if let Some(root) = self.rabbit.root() {
            command
                .env("RABBITMQ_ROOT", root)
                .env("RABBITMQ_EPMD_PORT", EPMD_4.to_string());
        }
        command
    }

    /// Every node's AMQP URL, comma-separated (what `AMQP_URL` takes).
    pub fn urls(&self) -> &str {
        &self.urls
    }

    /// Node `n`'s name.
    pub fn node(&self, n: u8) -> String {
        self.script(&["node", &n.to_string()]).trim().to_owned()
    }

    /// Stops node `n` gracefully (its queues' leadership moves to the others).
    pub fn stop_node(&self, n: u8) {
        self.script(&["stop-node", &n.to_string()]);
    }

    /// Kills node `n`'s VM (SIGKILL): no goodbye to clients or peers.
    pub fn kill_node(&self, n: u8) {
        self.script(&["kill-node", &n.to_string()]);
    }

    /// Starts node `n` again and waits until it serves (it rejoins the cluster).
    pub fn start_node(&self, n: u8) {
        self.script(&["start-node", &n.to_string()]);
    }

    /// Copies the nodes' logs to a directory of their own, kept after the cluster stops (for
    /// a failed test's report); returns it.
    pub fn keep_logs(&self) -> PathBuf {
        let kept = std::env::temp_dir().join(format!(
            "relay-cluster-logs-{}",
            self.dir.file_name().unwrap().to_string_lossy()
        ));
        let _ = Command::new("cp")
            .arg("-r")
            .arg(&self.dir)
            .arg(&kept)
            .status();
        kept
    }

    /// `rabbitmqctl -n <node n> args...` (in the node's namespace, if it has one); its
    /// output, empty if it failed or took over 60 s.
    pub fn ctl(&self, n: u8, args: &[&str]) -> String {
        // Bounded: a node stuck in its boot holds `stop_app` for ever (seen on 4.0 after a
        // partition).
        let script = self.script_command();
        let output = Command::new("timeout")
            .arg("60")
            .arg(script.get_program())
            .envs(
                script
                    .get_envs()
                    .filter_map(|(key, value)| Some((key, value?))),
            )
            .arg("ctl")
            .arg(&self.dir)
            .arg(n.to_string())
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Drops every packet between `a` and `b`, both ways, without a reset (a cluster started
    /// by [`PrivateCluster::start_partitionable`]); cuts add up until [`PrivateCluster::heal`].
    pub fn cut(&self, a: End, b: End) {
        self.script(&["cut", &a.to_string(), &b.to_string()]);
    }

    /// How many AMQP connections node `n` of a partitionable cluster holds.
    pub fn clients(&self, n: u8) -> usize {
        let count = self.script(&["clients", &n.to_string()]);
        count
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("a count of connections: {count:?}"))
    }

    /// Lifts every cut. A connection whose packets were dropped resumes at its next
    /// retransmission (5-7 s after a drop of 6-8 s here), not at once.
    pub fn heal(&self) {
        self.script(&["heal"]);
    }
}

/// One end of a cut: a node of a partitionable cluster, or this machine's own namespace, where
/// the test, its relays and its consumers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Host,
    Node(u8),
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::Host => f.write_str("host"),
            End::Node(n) => write!(f, "{n}"),
        }
    }
}

/// Runs `scripts/rabbitmq-cluster` as `command` says; its output, or a panic with its errors.
fn run_script(command: &mut Command) -> String {
    let output = command
        .stdin(std::process::Stdio::null())
        .output()
        .expect("scripts/rabbitmq-cluster runs");
    assert!(
        output.status.success(),
        "rabbitmq-cluster {:?}: {}",
        command.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = self
            .script_command()
            .arg("stop")
            .arg(&self.dir)
            .stdin(std::process::Stdio::null())
            .status();
    }
}

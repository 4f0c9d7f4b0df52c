//! The settings of `lease-router serve`, and where they come from.
//!
//! Each setting is declared once, as a field of [`ServeArgs`] (or of [`NatsCredentialArgs`]):
//! the field's name is its TOML key, its `long` the flag, its `env` the environment variable,
//! its doc comment the help. The keys a config file accepts, and the `--config` help that
//! lists them ([`document_file_keys`]), are read from that declaration; a test checks that
//! README's settings table names the same keys, flags and variables.
//!
//! A setting can be given in four places; the first one that has it wins:
//!
//! 1. a command-line flag (`--http-addr 0.0.0.0:9464`),
//! 2. an environment variable (`LEASE_ROUTER_HTTP_ADDR`, or `NATS_URL` for the NATS servers),
//!    which clap reads into the same field,
//! 3. the TOML file named by `--config FILE` (or `LEASE_ROUTER_CONFIG`),
//! 4. the default (the library's, for what the library runs).
//!
//! [`resolve`] merges the layers in one place (`Layers`), then turns each value into its
//! typed setting, so that every mistake reads the same way, naming the setting, the value,
//! where it came from and what is accepted:
//!
//! ```text
//! invalid setting http_addr = "abc" from --http-addr: expected HOST:PORT such as 127.0.0.1:9464
//! ```
//!
//! A key of the file that is not a setting is an error naming the key.
//!
//! # Credentials
//! At most one authentication method: user and password (both), a token, an NKey seed file
//! or a credentials file. Any TLS setting makes TLS required; the client certificate and key
//! go together. Files are checked to be readable when the settings are resolved, and read
//! when connecting. Secrets never appear in `Debug` output, in logs or in errors: a bad
//! password or token is shown as `<redacted>`, a file by its path only. Prefer files or the
//! environment over flags for secrets (flags show in the process list), and keep the default
//! `max_event_bytes` (4096) well below the server's `max_payload` (1 MB by default), so that
//! an oversized event is dropped and counted by the router.
//!
//! Durations are a number of seconds (`300`) or a number with a unit, `ms`, `s`, `m` or `h`,
//! possibly several (`5m`, `1m30s`, `250ms`). A flag or variable given replaces the list of
//! the file, it does not add to it (that holds for `--deployment` too).

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use lease_router::service::{ApiAuth, BearerToken, HostSettings};
use lease_router::wire::{DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_EVENT_BYTES};
use lease_router::LeaseStreamConfig;
use lease_router::{DeploymentName, SubjectPrefix, DEFAULT_SUBJECT_PREFIX};
use lease_router::{NatsAuth, NatsConnectConfig, NatsTls, DEFAULT_NATS_URL};

/// The default HTTP listen address.
pub const DEFAULT_HTTP_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 9464);

/// The smallest accepted `max_event_bytes`: an `admitted` event with a short request id.
pub const MIN_MAX_EVENT_BYTES: usize = 64;
/// The largest accepted `max_event_bytes`: the NATS server's hard payload limit.
pub const MAX_MAX_EVENT_BYTES: usize = 64 * 1024 * 1024;

/// The largest accepted memory limit: any more is not a limit.
pub const MAX_LIMIT: usize = 100_000_000;

/// Four times async-nats' default: a router takes bursts from many workers at once.
pub const DEFAULT_SUBSCRIPTION_CAPACITY: usize = 262_144;

/// Below this, PINGs would be most of an idle connection's traffic.
const MIN_PING_INTERVAL: Duration = Duration::from_millis(100);
/// Above this, a silent partition goes unseen for hours.
const MAX_PING_INTERVAL: Duration = Duration::from_secs(3600);

/// The largest accepted `stream_replicas`: JetStream's limit.
const MAX_STREAM_REPLICAS: usize = 5;

/// The smallest accepted `stream_max_bytes`: below it a stream holds a few thousand events.
const MIN_STREAM_MAX_BYTES: i64 = 1 << 20;

/// What error messages show instead of a secret value.
const REDACTED: &str = "<redacted>";

/// The flags of `lease-router serve` (flatten it into the subcommand).
///
/// Every field is optional: what is not given on the command line or in the environment is
/// taken from the config file, else from the defaults, by [`resolve`].
/// `Debug` is written by hand: it shows whether a password or token was given, never which.
#[derive(Clone, Default, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct ServeArgs {
    /// TOML file with settings (`document_file_keys` lists its keys here).
    #[arg(long = "config", value_name = "FILE", env = "LEASE_ROUTER_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// NATS server URL, or several separated by commas [default: nats://127.0.0.1:4222].
    #[arg(long = "nats-url", value_name = "URLS", env = "NATS_URL")]
    pub nats_url: Option<String>,

    /// A deployment to host from the start; repeat the flag for several (comma-separated in
    /// the environment). More can be added over HTTP.
    #[arg(
        long = "deployment",
        value_name = "NAME",
        env = "LEASE_ROUTER_DEPLOYMENTS",
        value_delimiter = ','
    )]
    pub deployments: Option<Vec<String>>,

    /// Address of the HTTP API and /metrics, HOST:PORT (port 0: any free port)
    /// [default: 127.0.0.1:9464].
    #[arg(
        long = "http-addr",
        value_name = "HOST:PORT",
        env = "LEASE_ROUTER_HTTP_ADDR"
    )]
    pub http_addr: Option<String>,

    /// Bearer token the HTTP API asks of PUT and DELETE (and, with --http-protect-reads, of
    /// the reads); prefer --http-token-file or the environment: flags show in the process
    /// list [default: none, the API is open].
    #[arg(
        long = "http-token",
        value_name = "TOKEN",
        env = "LEASE_ROUTER_HTTP_TOKEN",
        hide_env_values = true
    )]
    pub http_token: Option<String>,

    /// File holding the HTTP API's bearer token (whitespace around it is trimmed); instead of
    /// --http-token.
    #[arg(
        long = "http-token-file",
        value_name = "FILE",
        env = "LEASE_ROUTER_HTTP_TOKEN_FILE"
    )]
    pub http_token_file: Option<String>,

    /// The reads need the token too: /metrics, the GETs of /v1 and POST .../route (not the
    /// probes /healthz and /readyz, nor the status page's HTML) [default: off;
    /// `--http-protect-reads` alone means true].
    #[arg(
        long = "http-protect-reads",
        value_name = "BOOL",
        env = "LEASE_ROUTER_HTTP_PROTECT_READS",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub http_protect_reads: Option<String>,

    /// First token(s) of every lease subject: {prefix}.{deployment}.{worker_id}
    /// [default: leases].
    #[arg(
        long = "subject-prefix",
        value_name = "PREFIX",
        env = "LEASE_ROUTER_SUBJECT_PREFIX"
    )]
    pub subject_prefix: Option<String>,

    /// How often leases are scanned; a silent lease expires after one to two intervals.
    /// Seconds, or with a unit: 300s, 5m, 1h [default: 300s].
    #[arg(
        long = "lease-scan-interval",
        value_name = "DURATION",
        env = "LEASE_ROUTER_LEASE_SCAN_INTERVAL"
    )]
    pub lease_scan_interval: Option<String>,

    /// Log line format: text or json [default: text].
    #[arg(
        long = "log-format",
        value_name = "FORMAT",
        env = "LEASE_ROUTER_LOG_FORMAT"
    )]
    pub log_format: Option<String>,

    /// How long to keep trying to reach NATS at startup [default: 30s].
    #[arg(
        long = "connect-deadline",
        value_name = "DURATION",
        env = "LEASE_ROUTER_CONNECT_DEADLINE"
    )]
    pub connect_deadline: Option<String>,

    /// Events larger than this many bytes are dropped as oversized [default: 4096].
    #[arg(
        long = "max-event-bytes",
        value_name = "BYTES",
        env = "LEASE_ROUTER_MAX_EVENT_BYTES"
    )]
    pub max_event_bytes: Option<String>,

    /// Batch messages (several events in one, wire 1.2) larger than this many bytes are
    /// dropped as oversized; each event inside is held to --max-event-bytes [default: 1048576].
    #[arg(
        long = "max-batch-bytes",
        value_name = "BYTES",
        env = "LEASE_ROUTER_MAX_BATCH_BYTES"
    )]
    pub max_batch_bytes: Option<String>,

    /// Live leases per deployment; past it new admissions are refused and counted
    /// [default: 1000000].
    #[arg(
        long = "max-active-leases",
        value_name = "N",
        env = "LEASE_ROUTER_MAX_ACTIVE_LEASES"
    )]
    pub max_active_leases: Option<String>,

    /// Completions kept for late admissions, per deployment; the oldest is evicted and
    /// counted past it [default: 100000].
    #[arg(
        long = "max-tombstones",
        value_name = "N",
        env = "LEASE_ROUTER_MAX_TOMBSTONES"
    )]
    pub max_tombstones: Option<String>,

    /// Progress events held for their admission, per deployment; the oldest is evicted and
    /// counted past it [default: 100000].
    #[arg(
        long = "max-held-progress",
        value_name = "N",
        env = "LEASE_ROUTER_MAX_HELD_PROGRESS"
    )]
    pub max_held_progress: Option<String>,

    /// Publishers whose sequence windows are tracked, per deployment; the least recent is
    /// forgotten past it [default: 10000].
    #[arg(
        long = "max-publishers",
        value_name = "N",
        env = "LEASE_ROUTER_MAX_PUBLISHERS"
    )]
    pub max_publishers: Option<String>,

    /// Messages a deployment's subscription buffers before the client drops them and counts a
    /// slow-consumer event; bursts beyond what the ingress applies at once wait here
    /// [default: 262144].
    #[arg(
        long = "subscription-capacity",
        value_name = "N",
        env = "LEASE_ROUTER_SUBSCRIPTION_CAPACITY"
    )]
    pub subscription_capacity: Option<String>,

    /// Durable mode: each deployment replays the JetStream lease stream (created or updated
    /// by the router) before following live events; `/readyz` is 503 until then
    /// [default: off; `--durable` alone means true].
    #[arg(
        long = "durable",
        value_name = "BOOL",
        env = "LEASE_ROUTER_DURABLE",
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub durable: Option<String>,

    /// Copies of the lease stream kept by a NATS cluster in durable mode (1 to 5; 3 on a
    /// three-node cluster) [default: 1].
    #[arg(
        long = "stream-replicas",
        value_name = "N",
        env = "LEASE_ROUTER_STREAM_REPLICAS"
    )]
    pub stream_replicas: Option<String>,

    /// Bytes each deployment's lease stream keeps in durable mode; past it the oldest events
    /// are discarded (and a replica that needed them says so). Size it with README's
    /// arithmetic: events/s x ~170 bytes x the stream's age limit [default: 1073741824].
    #[arg(
        long = "stream-max-bytes",
        value_name = "BYTES",
        env = "LEASE_ROUTER_STREAM_MAX_BYTES"
    )]
    pub stream_max_bytes: Option<String>,

    /// How often one replica per deployment (the holder of the writer entry) snapshots the
    /// deployment's state to JetStream in durable mode; a late replica loads the newest and
    /// replays only what follows. Seconds, or with a unit: 60s, 1m [default: 60s].
    #[arg(
        long = "snapshot-interval",
        value_name = "DURATION",
        env = "LEASE_ROUTER_SNAPSHOT_INTERVAL"
    )]
    pub snapshot_interval: Option<String>,

    /// Snapshot intervals each deployment's stream keeps in durable mode (its age limit is
    /// this many intervals, at least 60 s) [default: 4].
    #[arg(
        long = "snapshot-keep",
        value_name = "N",
        env = "LEASE_ROUTER_SNAPSHOT_KEEP"
    )]
    pub snapshot_keep: Option<String>,

    /// How new deployments choose a worker for `POST .../route`: weighted_cost,
    /// power_of_two, round_robin or random (a PUT body may set one per deployment)
    /// [default: weighted_cost].
    #[arg(
        long = "route-policy",
        value_name = "POLICY",
        env = "LEASE_ROUTER_ROUTE_POLICY"
    )]
    pub route_policy: Option<String>,

    /// A worker with no live lease that says nothing this long is forgotten. Seconds, or with
    /// a unit: 600s, 10m [default: twice the lease scan interval].
    #[arg(
        long = "worker-idle",
        value_name = "DURATION",
        env = "LEASE_ROUTER_WORKER_IDLE"
    )]
    pub worker_idle: Option<String>,

    /// Authentication and TLS to NATS (boxed: they make the struct large).
    #[command(flatten)]
    #[serde(flatten)]
    pub nats_credentials: Box<NatsCredentialArgs>,
}

impl fmt::Debug for ServeArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServeArgs")
            .field("config", &self.config)
            .field("nats_url", &self.nats_url.as_deref().map(redact_url_list))
            .field("deployments", &self.deployments)
            .field("http_addr", &self.http_addr)
            .field("http_token", &self.http_token.as_ref().map(|_| REDACTED))
            .field("http_token_file", &self.http_token_file)
            .field("http_protect_reads", &self.http_protect_reads)
            .field("subject_prefix", &self.subject_prefix)
            .field("lease_scan_interval", &self.lease_scan_interval)
            .field("log_format", &self.log_format)
            .field("connect_deadline", &self.connect_deadline)
            .field("max_event_bytes", &self.max_event_bytes)
            .field("max_batch_bytes", &self.max_batch_bytes)
            .field("max_active_leases", &self.max_active_leases)
            .field("max_tombstones", &self.max_tombstones)
            .field("max_held_progress", &self.max_held_progress)
            .field("max_publishers", &self.max_publishers)
            .field("subscription_capacity", &self.subscription_capacity)
            .field("durable", &self.durable)
            .field("stream_replicas", &self.stream_replicas)
            .field("stream_max_bytes", &self.stream_max_bytes)
            .field("snapshot_interval", &self.snapshot_interval)
            .field("snapshot_keep", &self.snapshot_keep)
            .field("route_policy", &self.route_policy)
            .field("worker_idle", &self.worker_idle)
            .field("nats_credentials", &self.nats_credentials)
            .finish()
    }
}

impl NatsCredentialArgs {
    /// Connection settings for `urls` (comma-separated) with these credentials: how
    /// `publish` and `simulate` connect exactly as `serve` does.
    ///
    /// # Errors
    /// [`ConfigError`] naming the URL or credential setting that is wrong.
    pub fn connect_config(&self, urls: &str) -> Result<NatsConnectConfig, ConfigError> {
        let args = ServeArgs {
            nats_url: Some(urls.to_owned()),
            nats_credentials: Box::new(self.clone()),
            ..ServeArgs::default()
        };
        Ok(resolve(&args)?.nats)
    }
}

/// How every command connects to NATS: authentication, TLS, the ping interval (flattened
/// into `serve`, `publish` and `simulate`). `Debug` shows whether a password or token was
/// given, never which.
#[derive(Clone, Default, PartialEq, Eq, clap::Args, serde::Serialize)]
pub struct NatsCredentialArgs {
    /// NATS user name; needs --nats-password.
    #[arg(long = "nats-user", value_name = "USER", env = "NATS_USER")]
    pub nats_user: Option<String>,

    /// NATS password (prefer the environment or the config file: flags show in the process
    /// list).
    #[arg(
        long = "nats-password",
        value_name = "PASSWORD",
        env = "NATS_PASSWORD",
        hide_env_values = true
    )]
    pub nats_password: Option<String>,

    /// NATS authentication token (prefer the environment or the config file).
    #[arg(
        long = "nats-token",
        value_name = "TOKEN",
        env = "NATS_TOKEN",
        hide_env_values = true
    )]
    pub nats_token: Option<String>,

    /// File holding the NKey seed to authenticate with.
    #[arg(long = "nats-nkey", value_name = "FILE", env = "NATS_NKEY")]
    pub nats_nkey: Option<String>,

    /// NATS credentials file (user JWT and NKey seed, .creds).
    #[arg(long = "nats-creds", value_name = "FILE", env = "NATS_CREDS")]
    pub nats_creds: Option<String>,

    /// PEM file of the CAs that sign the NATS server's certificate; makes TLS required.
    #[arg(long = "nats-tls-ca", value_name = "FILE", env = "NATS_TLS_CA")]
    pub nats_tls_ca: Option<String>,

    /// PEM file of a TLS client certificate (with --nats-tls-key); makes TLS required.
    #[arg(long = "nats-tls-cert", value_name = "FILE", env = "NATS_TLS_CERT")]
    pub nats_tls_cert: Option<String>,

    /// PEM file of the TLS client certificate's key (with --nats-tls-cert).
    #[arg(long = "nats-tls-key", value_name = "FILE", env = "NATS_TLS_KEY")]
    pub nats_tls_key: Option<String>,

    /// How often the client PINGs a silent server; a dead connection (a silent partition) is
    /// given up after three intervals without a word, and `/healthz` turns 503
    /// [default: 4s, so within 12s].
    #[arg(
        long = "nats-ping-interval",
        value_name = "DURATION",
        env = "LEASE_ROUTER_NATS_PING_INTERVAL"
    )]
    pub nats_ping_interval: Option<String>,
}

impl fmt::Debug for NatsCredentialArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secret = |v: &Option<String>| v.as_ref().map(|_| REDACTED);
        f.debug_struct("NatsCredentialArgs")
            .field("nats_user", &self.nats_user)
            .field("nats_password", &secret(&self.nats_password))
            .field("nats_token", &secret(&self.nats_token))
            .field("nats_nkey", &self.nats_nkey)
            .field("nats_creds", &self.nats_creds)
            .field("nats_tls_ca", &self.nats_tls_ca)
            .field("nats_tls_cert", &self.nats_tls_cert)
            .field("nats_tls_key", &self.nats_tls_key)
            .field("nats_ping_interval", &self.nats_ping_interval)
            .finish()
    }
}

/// A comma-separated URL list with any `user:password@` replaced.
fn redact_url_list(list: &str) -> String {
    list.split(',')
        .map(lease_router::redact_url)
        .collect::<Vec<_>>()
        .join(",")
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LogFormat {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(()),
        }
    }
}

/// The settings as declared: the arguments of [`ServeArgs`], whose ids are the file keys.
fn declared() -> clap::Command {
    <ServeArgs as clap::Args>::augment_args(clap::Command::new("serve"))
}

/// The declared settings but `--config` itself.
fn declared_settings() -> Vec<clap::Arg> {
    declared()
        .get_arguments()
        .filter(|arg| arg.get_id() != "config")
        .cloned()
        .collect()
}

/// The keys a config file may hold, in the order of the declaration.
pub fn file_keys() -> Vec<String> {
    declared_settings()
        .iter()
        .map(|arg| arg.get_id().to_string())
        .collect()
}

/// Adds the accepted file keys to the help of `--config` of the `serve` command: generated
/// from the declaration, so the list cannot drift from what the file accepts.
pub fn document_file_keys(serve: clap::Command) -> clap::Command {
    let help = format!(
        "TOML file with settings; its keys: {}",
        file_keys().join(", ")
    );
    serve.mut_arg("config", |arg| arg.help(help.clone()).long_help(help))
}

/// The resolved settings of `lease-router serve`: the library's own settings structs, with
/// what only the binary uses beside them.
#[derive(Clone, Debug)]
pub struct ServeSettings {
    /// How to connect to NATS (its `Debug` redacts secrets).
    pub nats: NatsConnectConfig,
    /// What each deployment's router runs with.
    pub host: HostSettings,
    /// Deployments hosted from the start, without duplicates, in the order given.
    pub deployments: Vec<DeploymentName>,
    pub http_addr: SocketAddr,
    /// The HTTP API's bearer token and what it guards; `None`: the API is open (its `Debug`
    /// redacts the token).
    pub http_auth: Option<ApiAuth>,
    pub log_format: LogFormat,
}

impl ServeSettings {
    /// The defaults: the library's, and the binary's own for the rest.
    fn defaults() -> Self {
        Self {
            nats: NatsConnectConfig::new([DEFAULT_NATS_URL])
                .with_name("lease-router serve")
                .with_subscription_capacity(DEFAULT_SUBSCRIPTION_CAPACITY),
            host: HostSettings::default(),
            deployments: Vec::new(),
            http_addr: DEFAULT_HTTP_ADDR,
            http_auth: None,
            log_format: LogFormat::default(),
        }
    }
}

/// Where a rejected value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValueOrigin {
    /// The command-line flag of this name (`--http-addr`).
    Flag(String),
    /// The environment variable of this name.
    Environment(String),
    /// The config file at this path.
    File(PathBuf),
}

impl fmt::Display for ValueOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueOrigin::Flag(flag) => write!(f, " from {flag}"),
            ValueOrigin::Environment(name) => write!(f, " from environment variable {name}"),
            ValueOrigin::File(path) => write!(f, " in config file {}", path.display()),
        }
    }
}

/// A setting that cannot be used. The message names the setting, the value, where it came
/// from and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid setting {setting} = {value:?}{origin}: {expected}")]
    Invalid {
        setting: String,
        value: String,
        origin: ValueOrigin,
        expected: String,
    },
    #[error("cannot read config file {}: {source}", path.display())]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {} is not valid TOML: {message}", path.display())]
    ParseFile { path: PathBuf, message: String },
    #[error(
        "unknown setting {key:?} in config file {}: the accepted keys are {}",
        path.display(),
        file_keys().join(", ")
    )]
    UnknownKey { path: PathBuf, key: String },
}

impl ConfigError {
    /// The setting (or file key) at fault, if it is one (the tests check it).
    #[cfg(test)]
    pub fn setting(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { setting, .. } => Some(setting),
            ConfigError::UnknownKey { key, .. } => Some(key),
            ConfigError::ReadFile { .. } | ConfigError::ParseFile { .. } => None,
        }
    }
}

/// A raw value: one string, or a list (a setting with a value delimiter, `deployments`).
enum Raw {
    One(String),
    List(Vec<String>),
}

/// The given values of every layer, merged: key -> (value, origin). No `Debug`: it holds
/// secrets.
struct Layers {
    values: BTreeMap<String, (Raw, ValueOrigin)>,
}

impl Layers {
    /// The file's values, then the flags' and the environment's over them.
    fn merge(args: &ServeArgs) -> Result<Self, ConfigError> {
        let settings = declared_settings();
        let mut values = BTreeMap::new();
        if let Some(path) = &args.config {
            for (key, raw) in read_file(path, &settings)? {
                values.insert(key, (raw, ValueOrigin::File(path.clone())));
            }
        }
        // clap has put each flag, or else its environment variable, into `args`.
        let given = match serde_json::to_value(args) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => unreachable!("ServeArgs serializes as a map of strings"),
        };
        for (key, value) in given {
            let raw = match value {
                serde_json::Value::Null => continue,
                serde_json::Value::String(s) => Raw::One(s),
                serde_json::Value::Array(items) => Raw::List(
                    items
                        .into_iter()
                        .filter_map(|item| item.as_str().map(str::to_owned))
                        .collect(),
                ),
                other => unreachable!("a setting is a string or a list, not {other}"),
            };
            let arg = settings
                .iter()
                .find(|arg| arg.get_id() == key.as_str())
                .expect("every field is a declared setting");
            let origin = command_line_origin(arg, &raw);
            values.insert(key, (raw, origin));
        }
        Ok(Self { values })
    }

    /// The value of one setting, as one string, and where it came from.
    fn one(&mut self, key: &str) -> Option<(String, ValueOrigin)> {
        debug_assert!(
            file_keys().iter().any(|k| k == key),
            "{key} is not declared"
        );
        self.values.remove(key).map(|(raw, origin)| match raw {
            Raw::One(value) => (value, origin),
            Raw::List(items) => (items.join(","), origin),
        })
    }

    /// The value of a list setting, and where it came from.
    fn list(&mut self, key: &str) -> Option<(Vec<String>, ValueOrigin)> {
        debug_assert!(
            file_keys().iter().any(|k| k == key),
            "{key} is not declared"
        );
        self.values.remove(key).map(|(raw, origin)| match raw {
            Raw::One(value) => (value.split(',').map(str::to_owned).collect(), origin),
            Raw::List(items) => (items, origin),
        })
    }
}

/// A value clap took: from the environment if it is the variable's value, else from the
/// flag. (A flag that repeats the variable's value is named as the variable: the same value.)
fn command_line_origin(arg: &clap::Arg, raw: &Raw) -> ValueOrigin {
    let from_env = arg
        .get_env()
        .and_then(|name| Some((name.to_str()?, std::env::var(name).ok()?)))
        .filter(|(_, env)| match raw {
            Raw::One(value) => env == value,
            Raw::List(items) => env.split(',').eq(items.iter().map(String::as_str)),
        });
    match from_env {
        Some((name, _)) => ValueOrigin::Environment(name.to_owned()),
        None => ValueOrigin::Flag(format!("--{}", arg.get_long().unwrap_or_default())),
    }
}

/// Resolves the settings: flags, then environment, then the config file, then the defaults.
///
/// # Errors
/// [`ConfigError`] naming the first setting that is invalid, the bad value, its origin and
/// the accepted values; or the config file that cannot be read or parsed, or holds an unknown
/// key.
pub fn resolve(args: &ServeArgs) -> Result<ServeSettings, ConfigError> {
    let mut given = Layers::merge(args)?;
    let mut settings = ServeSettings::defaults();

    if let Some((value, origin)) = given.one("nats_url") {
        settings.nats.urls = parse_nats_urls(&value, origin)?;
    }
    if let Some((list, origin)) = given.list("deployments") {
        settings.deployments = parse_deployments(&list, &origin)?;
    }
    if let Some((value, origin)) = given.one("http_addr") {
        settings.http_addr = parse_http_addr(&value, origin)?;
    }
    settings.http_auth = resolve_http_auth(&mut given)?;
    if let Some((value, origin)) = given.one("subject_prefix") {
        settings.host.subject_prefix =
            SubjectPrefix::new(value.trim()).map_err(|err| ConfigError::Invalid {
                setting: "subject_prefix".into(),
                value,
                origin,
                expected: format!(
                    "one or more tokens separated by '.', each of ASCII letters, digits, '-' \
                     and '_' (1 to 128 characters), such as {DEFAULT_SUBJECT_PREFIX} or \
                     acme.leases ({})",
                    err.setting()
                ),
            })?;
    }
    if let Some((value, origin)) = given.one("lease_scan_interval") {
        settings.host.lease_scan_interval = match parse_duration(&value) {
            Some(d) if !d.is_zero() => d,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "lease_scan_interval".into(),
                    value,
                    origin,
                    expected: "expected a positive duration: seconds (300) or a number with a \
                               unit ms, s, m or h (300s, 5m, 1m30s)"
                        .into(),
                })
            }
        };
    }
    if let Some((value, origin)) = given.one("log_format") {
        settings.log_format = value.parse().map_err(|()| ConfigError::Invalid {
            setting: "log_format".into(),
            value,
            origin,
            expected: "expected text or json".into(),
        })?;
    }
    if let Some((value, origin)) = given.one("connect_deadline") {
        settings.nats.connect_deadline =
            parse_duration(&value).ok_or_else(|| ConfigError::Invalid {
                setting: "connect_deadline".into(),
                value,
                origin,
                expected: "expected a duration: seconds (30) or a number with a unit ms, s, m \
                           or h (30s, 2m)"
                    .into(),
            })?;
    }
    if let Some((value, origin)) = given.one("max_event_bytes") {
        settings.host.apply.max_event_bytes = match value.trim().parse::<usize>() {
            Ok(n) if (MIN_MAX_EVENT_BYTES..=MAX_MAX_EVENT_BYTES).contains(&n) => n,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "max_event_bytes".into(),
                    value,
                    origin,
                    expected: format!(
                        "expected a whole number of bytes from {MIN_MAX_EVENT_BYTES} to \
                         {MAX_MAX_EVENT_BYTES} (default {DEFAULT_MAX_EVENT_BYTES}); keep it \
                         below the NATS server's max_payload"
                    ),
                })
            }
        };
    }
    if let Some((value, origin)) = given.one("max_batch_bytes") {
        settings.host.apply.max_batch_bytes = match value.trim().parse::<usize>() {
            Ok(n) if (MIN_MAX_EVENT_BYTES..=MAX_MAX_EVENT_BYTES).contains(&n) => n,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "max_batch_bytes".into(),
                    value,
                    origin,
                    expected: format!(
                        "expected a whole number of bytes from {MIN_MAX_EVENT_BYTES} to \
                         {MAX_MAX_EVENT_BYTES} (default {DEFAULT_MAX_BATCH_BYTES}); keep it \
                         at or below the NATS server's max_payload"
                    ),
                })
            }
        };
    }
    let mut capacity = DEFAULT_SUBSCRIPTION_CAPACITY;
    let host = &mut settings.host;
    for (setting, slot) in [
        ("max_active_leases", &mut host.max_active_leases),
        ("max_tombstones", &mut host.apply.max_tombstones),
        ("max_held_progress", &mut host.apply.max_held_progress),
        ("max_publishers", &mut host.apply.max_publishers),
        ("subscription_capacity", &mut capacity),
    ] {
        if let Some((value, origin)) = given.one(setting) {
            *slot = parse_limit(setting, value, origin, *slot)?;
        }
    }
    settings.nats = settings.nats.with_subscription_capacity(capacity);
    let mut durable = false;
    if let Some((value, origin)) = given.one("durable") {
        durable = match value.trim().to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" | "1" => true,
            "false" | "no" | "off" | "0" => false,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "durable".into(),
                    value,
                    origin,
                    expected: "expected true or false".into(),
                })
            }
        };
    }
    let mut replicas = 1;
    if let Some((value, origin)) = given.one("stream_replicas") {
        replicas = match value.trim().parse::<usize>() {
            Ok(n) if (1..=MAX_STREAM_REPLICAS).contains(&n) => n,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "stream_replicas".into(),
                    value,
                    origin,
                    expected: format!(
                        "expected a whole number from 1 to {MAX_STREAM_REPLICAS} (JetStream's \
                         limit), at most the number of NATS servers in the cluster"
                    ),
                })
            }
        };
    }
    let mut stream_max_bytes = lease_router::DEFAULT_STREAM_MAX_BYTES;
    if let Some((value, origin)) = given.one("stream_max_bytes") {
        stream_max_bytes = match value.trim().replace('_', "").parse::<i64>() {
            Ok(n) if n >= MIN_STREAM_MAX_BYTES => n,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "stream_max_bytes".into(),
                    value,
                    origin,
                    expected: format!(
                        "expected a whole number of bytes, at least {MIN_STREAM_MAX_BYTES} \
                         (default {}): events/s x ~170 bytes x the stream's age limit",
                        lease_router::DEFAULT_STREAM_MAX_BYTES
                    ),
                })
            }
        };
    }
    let mut snapshot_interval = lease_router::DEFAULT_SNAPSHOT_INTERVAL;
    if let Some((value, origin)) = given.one("snapshot_interval") {
        snapshot_interval = match parse_duration(&value) {
            Some(d) if d >= Duration::from_secs(1) => d,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "snapshot_interval".into(),
                    value,
                    origin,
                    expected: "expected a duration of at least 1s: seconds (60) or a number \
                               with a unit s, m or h (60s, 5m)"
                        .into(),
                })
            }
        };
    }
    let mut snapshot_keep = lease_router::DEFAULT_SNAPSHOT_KEEP;
    if let Some((value, origin)) = given.one("snapshot_keep") {
        snapshot_keep = match value.trim().parse::<u32>() {
            Ok(n) if (2..=1000).contains(&n) => n,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "snapshot_keep".into(),
                    value,
                    origin,
                    expected: format!(
                        "expected a whole number from 2 to 1000 (default {}): snapshot \
                         intervals the stream keeps",
                        lease_router::DEFAULT_SNAPSHOT_KEEP
                    ),
                })
            }
        };
    }
    if let Some((value, origin)) = given.one("route_policy") {
        settings.host.route_policy = value.trim().parse().map_err(|_| ConfigError::Invalid {
            setting: "route_policy".into(),
            value,
            origin,
            expected: "expected weighted_cost, power_of_two, round_robin or random".into(),
        })?;
    }
    if let Some((value, origin)) = given.one("worker_idle") {
        settings.host.worker_idle = match parse_duration(&value) {
            Some(d) if !d.is_zero() => Some(d),
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "worker_idle".into(),
                    value,
                    origin,
                    expected: "expected a positive duration: seconds (600) or a number with a \
                               unit ms, s, m or h (600s, 10m)"
                        .into(),
                })
            }
        };
    }
    settings.host.durable = durable.then(|| {
        LeaseStreamConfig::new()
            .with_snapshots(snapshot_interval, snapshot_keep)
            .with_replicas(replicas)
            .with_max_bytes(stream_max_bytes)
    });
    resolve_credentials(&mut given, &mut settings.nats)?;
    debug_assert!(
        given.values.is_empty(),
        "declared but not resolved: {:?}",
        given.values.keys().collect::<Vec<_>>()
    );
    Ok(settings)
}

/// The HTTP API's token, from `http_token` or the file `http_token_file` (one of them), and
/// whether it guards the reads. The token never enters an error.
fn resolve_http_auth(given: &mut Layers) -> Result<Option<ApiAuth>, ConfigError> {
    let inline = given.one("http_token");
    let file = given.one("http_token_file");
    let protect_reads = match given.one("http_protect_reads") {
        None => None,
        Some((value, origin)) => Some(match value.trim().to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" | "1" => (true, value, origin),
            "false" | "no" | "off" | "0" => (false, value, origin),
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "http_protect_reads".into(),
                    value,
                    origin,
                    expected: "expected true or false".into(),
                })
            }
        }),
    };
    let token = match (inline, file) {
        (Some(_), Some((path, origin))) => {
            return Err(ConfigError::Invalid {
                setting: "http_token_file".into(),
                value: path,
                origin,
                expected: "give the token once: http_token or http_token_file, not both".into(),
            })
        }
        (Some((value, origin)), None) => {
            Some(
                BearerToken::new(&value).map_err(|err| ConfigError::Invalid {
                    setting: "http_token".into(),
                    value: if value.is_empty() {
                        value
                    } else {
                        REDACTED.into()
                    },
                    origin,
                    expected: format!("{err}; an empty token would leave the API open"),
                })?,
            )
        }
        (None, Some((value, origin))) => {
            let path = PathBuf::from(value.trim());
            let text = std::fs::read_to_string(&path).map_err(|err| ConfigError::Invalid {
                setting: "http_token_file".into(),
                value: value.clone(),
                origin: origin.clone(),
                expected: format!(
                    "expected a readable file holding the token ({})",
                    err.kind()
                ),
            })?;
            Some(BearerToken::new(&text).map_err(|err| ConfigError::Invalid {
                setting: "http_token_file".into(),
                value,
                origin,
                expected: format!(
                    "the file holds no usable token: {err}; an empty token would leave the API \
                     open"
                ),
            })?)
        }
        (None, None) => None,
    };
    match (token, protect_reads) {
        (Some(token), protect) => Ok(Some(
            ApiAuth::new(token).protect_reads(protect.is_some_and(|(on, _, _)| on)),
        )),
        (None, Some((true, value, origin))) => Err(ConfigError::Invalid {
            setting: "http_protect_reads".into(),
            value,
            origin,
            expected: "protecting the reads needs a token: give http_token or http_token_file"
                .into(),
        }),
        (None, _) => Ok(None),
    }
}

/// The authentication and TLS settings. Secret values never enter an error.
fn resolve_credentials(
    given: &mut Layers,
    nats: &mut NatsConnectConfig,
) -> Result<(), ConfigError> {
    let secret = |setting: &'static str, value: Option<(String, ValueOrigin)>| match value {
        Some((v, origin)) if v.is_empty() => Err(ConfigError::Invalid {
            setting: setting.into(),
            value: String::new(),
            origin,
            expected: "expected a non-empty value".into(),
        }),
        Some((v, origin)) => Ok(Some((v, origin))),
        None => Ok(None),
    };
    let user = secret("nats_user", given.one("nats_user"))?;
    let password = secret("nats_password", given.one("nats_password"))?;
    let token = secret("nats_token", given.one("nats_token"))?;
    let nkey = readable_file("nats_nkey", given.one("nats_nkey"))?;
    let creds = readable_file("nats_creds", given.one("nats_creds"))?;

    let mut methods: Vec<(&'static str, NatsAuth, ValueOrigin)> = Vec::new();
    match (user, password) {
        (Some((user, origin)), Some((password, _))) => methods.push((
            "nats_user",
            NatsAuth::UserPassword { user, password },
            origin,
        )),
        (Some((user, origin)), None) => {
            return Err(ConfigError::Invalid {
                setting: "nats_user".into(),
                value: user,
                origin,
                expected: "a user needs a password: give nats_password too".into(),
            })
        }
        (None, Some((_, origin))) => {
            return Err(ConfigError::Invalid {
                setting: "nats_password".into(),
                value: REDACTED.into(),
                origin,
                expected: "a password needs a user: give nats_user too".into(),
            })
        }
        (None, None) => {}
    }
    if let Some((token, origin)) = token {
        methods.push(("nats_token", NatsAuth::Token(token), origin));
    }
    if let Some((path, origin)) = nkey {
        methods.push(("nats_nkey", NatsAuth::NKeySeedFile(path), origin));
    }
    if let Some((path, origin)) = creds {
        methods.push(("nats_creds", NatsAuth::CredentialsFile(path), origin));
    }
    if methods.len() > 1 {
        let (setting, auth, origin) = methods.swap_remove(1);
        let value = match auth {
            NatsAuth::NKeySeedFile(p) | NatsAuth::CredentialsFile(p) => p.display().to_string(),
            _ => REDACTED.into(),
        };
        return Err(ConfigError::Invalid {
            setting: setting.into(),
            value,
            origin,
            expected: format!(
                "give only one way to authenticate (user and password, token, nkey or \
                 creds); {} is given too",
                methods[0].0
            ),
        });
    }
    if let Some((_, auth, _)) = methods.pop() {
        nats.auth = auth;
    }

    let ca = readable_file("nats_tls_ca", given.one("nats_tls_ca"))?;
    let cert = readable_file("nats_tls_cert", given.one("nats_tls_cert"))?;
    let key = readable_file("nats_tls_key", given.one("nats_tls_key"))?;
    let (cert_file, key_file) = match (cert, key) {
        (Some((cert, _)), Some((key, _))) => (Some(cert), Some(key)),
        (None, None) => (None, None),
        (Some((path, origin)), None) => {
            return Err(ConfigError::Invalid {
                setting: "nats_tls_cert".into(),
                value: path.display().to_string(),
                origin,
                expected: "a client certificate needs its key: give nats_tls_key too".into(),
            })
        }
        (None, Some((path, origin))) => {
            return Err(ConfigError::Invalid {
                setting: "nats_tls_key".into(),
                value: path.display().to_string(),
                origin,
                expected: "a client key needs its certificate: give nats_tls_cert too".into(),
            })
        }
    };
    let ca_file = ca.map(|(path, _)| path);
    if ca_file.is_some() || cert_file.is_some() {
        nats.tls = Some(NatsTls {
            ca_file,
            cert_file,
            key_file,
        });
    }
    if let Some((value, origin)) = given.one("nats_ping_interval") {
        let interval = parse_duration(&value)
            .filter(|d| (MIN_PING_INTERVAL..=MAX_PING_INTERVAL).contains(d))
            .ok_or_else(|| ConfigError::Invalid {
                setting: "nats_ping_interval".into(),
                value,
                origin,
                expected: "expected a duration from 100ms to 1h, such as 4s (a silent \
                           partition is seen within three intervals)"
                    .into(),
            })?;
        nats.ping_interval = Some(interval);
    }
    Ok(())
}

/// A memory limit: a whole number from 1 to [`MAX_LIMIT`].
fn parse_limit(
    setting: &'static str,
    value: String,
    origin: ValueOrigin,
    default: usize,
) -> Result<usize, ConfigError> {
    match value.trim().replace('_', "").parse::<usize>() {
        Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
        _ => Err(ConfigError::Invalid {
            setting: setting.into(),
            value,
            origin,
            expected: format!(
                "expected a whole number from 1 to {MAX_LIMIT} (default {default}); past it \
                 new entries are refused or the oldest evicted, and counted"
            ),
        }),
    }
}

/// A path setting naming a file that can be opened (not read: it may hold a secret).
fn readable_file(
    setting: &'static str,
    value: Option<(String, ValueOrigin)>,
) -> Result<Option<(PathBuf, ValueOrigin)>, ConfigError> {
    let Some((value, origin)) = value else {
        return Ok(None);
    };
    let path = PathBuf::from(value.trim());
    match std::fs::File::open(&path) {
        Ok(_) if path.is_file() => Ok(Some((path, origin))),
        Ok(_) => Err(ConfigError::Invalid {
            setting: setting.into(),
            value,
            origin,
            expected: "expected a file, not a directory".into(),
        }),
        Err(err) => Err(ConfigError::Invalid {
            setting: setting.into(),
            value,
            origin,
            expected: format!("expected a readable file ({})", err.kind()),
        }),
    }
}

fn parse_nats_urls(value: &str, origin: ValueOrigin) -> Result<Vec<String>, ConfigError> {
    let invalid = |value: &str, origin: ValueOrigin| ConfigError::Invalid {
        setting: "nats_url".into(),
        value: lease_router::redact_url(value),
        origin,
        expected: "expected nats://HOST:PORT, or several separated by commas, such as \
                   nats://10.0.0.1:4222,nats://10.0.0.2:4222"
            .into(),
    };
    let urls: Vec<String> = value
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    if urls.is_empty() {
        return Err(invalid(value, origin));
    }
    for url in &urls {
        if url.parse::<async_nats::ServerAddr>().is_err() {
            return Err(invalid(url, origin));
        }
    }
    Ok(urls)
}

fn parse_deployments(
    list: &[String],
    origin: &ValueOrigin,
) -> Result<Vec<DeploymentName>, ConfigError> {
    let mut out: Vec<DeploymentName> = Vec::with_capacity(list.len());
    for raw in list {
        let raw = raw.trim();
        if raw.is_empty() {
            // `LEASE_ROUTER_DEPLOYMENTS=` or a trailing comma: nothing.
            continue;
        }
        let name = DeploymentName::new(raw).map_err(|_| ConfigError::Invalid {
            setting: "deployments".into(),
            value: raw.to_owned(),
            origin: origin.clone(),
            expected: "a deployment name may hold only ASCII letters, digits, '-' and '_' \
                       (1 to 128 characters), such as llama-70b_prod"
                .into(),
        })?;
        if !out.contains(&name) {
            out.push(name);
        }
    }
    Ok(out)
}

fn parse_http_addr(value: &str, origin: ValueOrigin) -> Result<SocketAddr, ConfigError> {
    let trimmed = value.trim();
    let parsed = trimmed.parse::<SocketAddr>().ok().or_else(|| {
        let port = trimmed.strip_prefix("localhost:")?.parse::<u16>().ok()?;
        Some(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port))
    });
    parsed.ok_or_else(|| ConfigError::Invalid {
        setting: "http_addr".into(),
        value: value.to_owned(),
        origin,
        expected: "expected HOST:PORT such as 127.0.0.1:9464 (an IP address or localhost; port \
                   0 picks a free port)"
            .into(),
    })
}

/// Parses `300` (seconds), `300s`, `5m`, `1h`, `250ms`, `1m30s`, `1.5s`.
pub fn parse_duration(value: &str) -> Option<Duration> {
    let s = value.trim();
    if s.is_empty() {
        return None;
    }
    if let Ok(secs) = s.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(number_len);
        if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
            return None;
        }
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let unit_secs = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        let number: f64 = number.parse().ok()?;
        total = total.checked_add(Duration::try_from_secs_f64(number * unit_secs).ok()?)?;
        rest = tail;
    }
    Some(total)
}

/// Reads the config file: a TOML table whose keys are declared settings.
fn read_file(path: &Path, settings: &[clap::Arg]) -> Result<Vec<(String, Raw)>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    })?;
    parse_file(path, &text, settings)
}

/// Each value as the string a flag would give (a list for a list setting). A key that is not
/// declared is an error; so is a value of a type the setting cannot take, and a secret of the
/// wrong type is reported without its value.
fn parse_file(
    path: &Path,
    text: &str,
    settings: &[clap::Arg],
) -> Result<Vec<(String, Raw)>, ConfigError> {
    let table: toml::Table = toml::from_str(text).map_err(|err| ConfigError::ParseFile {
        path: path.to_owned(),
        message: err.message().to_owned() + &location(text, err.span()),
    })?;
    let mut values = Vec::with_capacity(table.len());
    for (key, value) in table {
        let Some(arg) = settings.iter().find(|arg| arg.get_id() == key.as_str()) else {
            return Err(ConfigError::UnknownKey {
                path: path.to_owned(),
                key,
            });
        };
        // The declaration says what the setting takes: a list (a value delimiter), a switch
        // (a flag that may stand alone), a secret (its value hidden from the help).
        let is_list = arg.get_value_delimiter().is_some();
        let is_switch = arg.get_num_args().is_some_and(|n| n.min_values() == 0);
        let is_secret = arg.is_hide_env_values_set();
        let invalid = |value: &toml::Value, expected: String| ConfigError::Invalid {
            setting: key.clone(),
            value: if is_secret {
                REDACTED.into()
            } else {
                value.to_string()
            },
            origin: ValueOrigin::File(path.to_owned()),
            expected,
        };
        let raw = match value {
            toml::Value::String(s) => Raw::One(s),
            toml::Value::Integer(n) if !is_secret => Raw::One(n.to_string()),
            toml::Value::Boolean(b) if is_switch => Raw::One(b.to_string()),
            toml::Value::Array(items) if !is_secret => Raw::List(
                items
                    .into_iter()
                    .map(|item| match item {
                        toml::Value::String(s) => Ok(s),
                        other => Err(invalid(
                            &other,
                            format!("expected a list of strings, not of {}", other.type_str()),
                        )),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            other => {
                let expected = if is_secret {
                    format!("expected a string, not {}", other.type_str())
                } else if is_list {
                    format!(
                        "expected a list of names, such as [\"llama-70b\", \"mixtral\"], not {}",
                        other.type_str()
                    )
                } else {
                    format!("expected a string or a number, not {}", other.type_str())
                };
                return Err(invalid(&other, expected));
            }
        };
        values.push((key, raw));
    }
    Ok(values)
}

/// " at line L, column C" for a byte span of `text`.
fn location(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    let Some(span) = span else {
        return String::new();
    };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    format!(" (at line {line}, column {column})")
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use clap::Parser;

    use lease_router::ApplyConfig;
    use lease_router::DEFAULT_MAX_ACTIVE_LEASES;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    fn message(args: &ServeArgs) -> String {
        resolve(args).unwrap_err().to_string()
    }

    #[test]
    fn durable_mode_settings() {
        let f = file("durable = true\nstream_replicas = 3\nsnapshot_interval = \"2m\"\n");
        let args = ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        };
        let host = resolve(&args).unwrap().host;
        let stream = host.durable.expect("durable from the file");
        assert_eq!(stream.replicas, 3);
        assert_eq!(
            stream.max_age,
            Duration::from_secs(480),
            "four snapshot intervals by default"
        );

        // The flag wins over the file.
        let off = ServeArgs {
            durable: Some("false".into()),
            ..args
        };
        assert!(resolve(&off).unwrap().host.durable.is_none());
        assert!(resolve(&ServeArgs::default())
            .unwrap()
            .host
            .durable
            .is_none());

        let m = message(&ServeArgs {
            durable: Some("maybe".into()),
            ..ServeArgs::default()
        });
        assert!(
            m.contains("durable = \"maybe\"") && m.contains("true or false"),
            "{m}"
        );
        let m = message(&ServeArgs {
            stream_replicas: Some("9".into()),
            ..ServeArgs::default()
        });
        assert!(
            m.contains("stream_replicas = \"9\"") && m.contains("1 to 5"),
            "{m}"
        );
        let m = message(&ServeArgs {
            stream_max_bytes: Some("1000".into()),
            ..ServeArgs::default()
        });
        assert!(
            m.contains("stream_max_bytes = \"1000\"") && m.contains("at least 1048576"),
            "{m}"
        );
        let host = resolve(&ServeArgs {
            durable: Some("true".into()),
            ..ServeArgs::default()
        })
        .unwrap()
        .host;
        assert_eq!(host.durable.unwrap().max_bytes, 1 << 30, "1 GiB by default");
    }

    #[test]
    fn defaults() {
        let s = resolve(&ServeArgs::default()).unwrap();
        assert_eq!(s.nats.urls, vec!["nats://127.0.0.1:4222".to_string()]);
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:9464");
        assert_eq!(s.host.subject_prefix.as_str(), "leases");
        assert_eq!(s.host.lease_scan_interval, Duration::from_secs(300));
        assert_eq!(s.log_format, LogFormat::Text);
        assert_eq!(s.nats.connect_deadline, Duration::from_secs(30));
        assert_eq!(
            s.nats.ping_interval,
            Some(lease_router::DEFAULT_PING_INTERVAL)
        );
        assert_eq!(s.host.apply.max_event_bytes, 4096);
        assert!(s.deployments.is_empty());
        let host = &s.host;
        assert_eq!(host.apply.max_event_bytes, 4096);
        assert_eq!(host.apply.max_batch_bytes, 1 << 20);
        assert_eq!(host.lease_scan_interval, Duration::from_secs(300));
        assert_eq!(
            s.nats.subscription_capacity,
            Some(DEFAULT_SUBSCRIPTION_CAPACITY)
        );
    }

    #[test]
    fn file_overrides_defaults_and_flags_override_file() {
        let f = file(
            r#"
            nats_url = ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
            deployments = ["a", "b", "a"]
            http_addr = "0.0.0.0:0"
            subject_prefix = "acme.leases"
            lease_scan_interval = "5m"
            log_format = "json"
            connect_deadline = 10
            max_event_bytes = 8192
            "#,
        );
        let from_file = ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        };
        let s = resolve(&from_file).unwrap();
        assert_eq!(
            s.nats.urls,
            vec!["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
        );
        let names: Vec<&str> = s.deployments.iter().map(|d| d.as_str()).collect();
        assert_eq!(names, ["a", "b"], "duplicates are dropped");
        assert_eq!(s.http_addr.to_string(), "0.0.0.0:0");
        assert_eq!(s.host.subject_prefix.as_str(), "acme.leases");
        assert_eq!(s.host.lease_scan_interval, Duration::from_secs(300));
        assert_eq!(s.log_format, LogFormat::Json);
        assert_eq!(s.nats.connect_deadline, Duration::from_secs(10));
        assert_eq!(s.host.apply.max_event_bytes, 8192);

        // Flags (or the environment: clap puts both in the same field) beat the file.
        let flags = ServeArgs {
            nats_url: Some("nats://a:1,nats://b:2".into()),
            deployments: Some(vec!["c".into()]),
            http_addr: Some("localhost:8080".into()),
            lease_scan_interval: Some("1m30s".into()),
            log_format: Some("TEXT".into()),
            ..from_file.clone()
        };
        let s = resolve(&flags).unwrap();
        assert_eq!(s.nats.urls, vec!["nats://a:1", "nats://b:2"]);
        assert_eq!(s.deployments, vec![DeploymentName::new("c").unwrap()]);
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:8080");
        assert_eq!(s.host.lease_scan_interval, Duration::from_secs(90));
        assert_eq!(s.log_format, LogFormat::Text);
        // Not given as flags: still from the file.
        assert_eq!(s.host.subject_prefix.as_str(), "acme.leases");
        assert_eq!(s.host.apply.max_event_bytes, 8192);
    }

    /// The one test that touches the process environment, and only variables that nothing
    /// but this module reads.
    #[test]
    fn flags_beat_environment_beat_file() {
        let f = file("http_addr = \"127.0.0.1:1111\"\nlease_scan_interval = \"1h\"\n");
        let path = f.path().to_str().unwrap().to_owned();
        std::env::set_var("LEASE_ROUTER_HTTP_ADDR", "127.0.0.1:2222");
        std::env::set_var("LEASE_ROUTER_LEASE_SCAN_INTERVAL", "2m");
        let env_only = Cli::try_parse_from(["serve", "--config", &path]).map(|c| c.serve);
        let flag_and_env =
            Cli::try_parse_from(["serve", "--config", &path, "--http-addr", "127.0.0.1:3333"])
                .map(|c| c.serve);
        // A bad value from the environment is named as such.
        std::env::set_var("LEASE_ROUTER_LOG_FORMAT", "yaml");
        let bad_env = Cli::try_parse_from(["serve"]).unwrap().serve;
        let bad_env = resolve(&bad_env).unwrap_err().to_string();
        std::env::remove_var("LEASE_ROUTER_LOG_FORMAT");
        std::env::remove_var("LEASE_ROUTER_HTTP_ADDR");
        std::env::remove_var("LEASE_ROUTER_LEASE_SCAN_INTERVAL");
        assert_eq!(
            bad_env,
            "invalid setting log_format = \"yaml\" from environment variable \
             LEASE_ROUTER_LOG_FORMAT: expected text or json"
        );
        let file_only = Cli::try_parse_from(["serve", "--config", &path])
            .unwrap()
            .serve;

        let s = resolve(&file_only).unwrap();
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:1111");
        assert_eq!(s.host.lease_scan_interval, Duration::from_secs(3600));

        let s = resolve(&env_only.unwrap()).unwrap();
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:2222", "env beats file");
        assert_eq!(s.host.lease_scan_interval, Duration::from_secs(120));

        let s = resolve(&flag_and_env.unwrap()).unwrap();
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:3333", "flag beats env");
        assert_eq!(s.host.lease_scan_interval, Duration::from_secs(120));
    }

    #[test]
    fn repeated_and_comma_separated_deployment_flags() {
        let cli = Cli::try_parse_from([
            "serve",
            "--deployment",
            "a",
            "--deployment",
            "b,c",
            "--nats-url",
            "nats://x:1",
        ])
        .unwrap();
        let s = resolve(&cli.serve).unwrap();
        let names: Vec<&str> = s.deployments.iter().map(|d| d.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
    }

    #[test]
    fn error_messages_name_setting_value_and_fix() {
        let args = |f: fn(&mut ServeArgs)| {
            let mut a = ServeArgs::default();
            f(&mut a);
            a
        };
        assert_eq!(
            message(&args(|a| a.http_addr = Some("abc".into()))),
            "invalid setting http_addr = \"abc\" from --http-addr: expected HOST:PORT such as 127.0.0.1:9464 \
             (an IP address or localhost; port 0 picks a free port)"
        );
        assert_eq!(
            message(&args(
                |a| a.deployments = Some(vec!["ok".into(), "a.b".into()])
            )),
            "invalid setting deployments = \"a.b\" from --deployment: a deployment name may hold only ASCII \
             letters, digits, '-' and '_' (1 to 128 characters), such as llama-70b_prod"
        );
        assert_eq!(
            message(&args(|a| a.log_format = Some("xml".into()))),
            "invalid setting log_format = \"xml\" from --log-format: expected text or json"
        );
        let m = message(&args(|a| a.lease_scan_interval = Some("0s".into())));
        assert!(
            m.starts_with("invalid setting lease_scan_interval = \"0s\" from --lease-scan-interval: expected a positive"),
            "{m}"
        );
        let m = message(&args(|a| a.lease_scan_interval = Some("5 minutes".into())));
        assert!(m.contains("= \"5 minutes\"") && m.contains("5m"), "{m}");
        let m = message(&args(|a| a.connect_deadline = Some("soon".into())));
        assert!(
            m.starts_with("invalid setting connect_deadline = \"soon\" from --connect-deadline: expected a duration"),
            "{m}"
        );
        for bad in ["0s", "10ms", "2h", "often"] {
            let mut a = ServeArgs::default();
            a.nats_credentials.nats_ping_interval = Some(bad.into());
            let m = message(&a);
            assert!(
                m.starts_with(&format!(
                    "invalid setting nats_ping_interval = \"{bad}\" from --nats-ping-interval: \
                     expected a duration from 100ms to 1h"
                )),
                "{m}"
            );
        }
        let s = resolve(&args(|a| {
            a.nats_credentials.nats_ping_interval = Some("1500ms".into())
        }))
        .unwrap();
        assert_eq!(s.nats.ping_interval, Some(Duration::from_millis(1500)));
        // publish and simulate connect with the same setting.
        let creds = NatsCredentialArgs {
            nats_ping_interval: Some("2s".into()),
            ..NatsCredentialArgs::default()
        };
        let nats = creds.connect_config("nats://h:1").unwrap();
        assert_eq!(nats.ping_interval, Some(Duration::from_secs(2)));
        let m = message(&args(|a| a.max_event_bytes = Some("10".into())));
        assert!(
            m.starts_with(
                "invalid setting max_event_bytes = \"10\" from --max-event-bytes: expected a whole number of \
                 bytes from 64 to 67108864"
            ),
            "{m}"
        );
        let m = message(&args(|a| a.subject_prefix = Some("a.*".into())));
        assert!(
            m.starts_with("invalid setting subject_prefix = \"a.*\" from --subject-prefix: one or more tokens"),
            "{m}"
        );
        let m = message(&args(|a| {
            a.nats_url = Some("nats://ok:4222,http://u:secret@bad:1".into())
        }));
        assert!(
            m.starts_with(
                "invalid setting nats_url = \"http://***@bad:1\" from --nats-url: expected nats://"
            ),
            "the bad URL is named, its password is not: {m}"
        );
        let m = message(&args(|a| a.nats_url = Some(" , ".into())));
        assert!(m.starts_with("invalid setting nats_url = \" , \""), "{m}");
    }

    #[test]
    fn file_errors() {
        let f = file("http_addr = \"127.0.0.1:1\"\nlisten = \"x\"\n");
        let args = ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        };
        let err = resolve(&args).unwrap_err();
        assert_eq!(err.setting(), Some("listen"));
        let m = err.to_string();
        assert!(
            m.starts_with("unknown setting \"listen\" in config file ")
                && m.ends_with(
                    "the accepted keys are nats_url, deployments, http_addr, http_token, \
                     http_token_file, http_protect_reads, subject_prefix, \
                     lease_scan_interval, log_format, connect_deadline, max_event_bytes, \
                     max_batch_bytes, max_active_leases, max_tombstones, max_held_progress, max_publishers, \
                     subscription_capacity, durable, stream_replicas, stream_max_bytes, \
                     snapshot_interval, snapshot_keep, route_policy, \
                     worker_idle, nats_user, \
                     nats_password, nats_token, nats_nkey, nats_creds, nats_tls_ca, \
                     nats_tls_cert, nats_tls_key, nats_ping_interval"
                ),
            "{m}"
        );

        let f = file("http_addr = \"nope\"\n");
        let m = message(&ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        });
        assert_eq!(
            m,
            format!(
                "invalid setting http_addr = \"nope\" in config file {}: expected HOST:PORT such \
                 as 127.0.0.1:9464 (an IP address or localhost; port 0 picks a free port)",
                f.path().display()
            )
        );

        let f = file("max_event_bytes = true\n");
        let m = message(&ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        });
        assert!(
            m.starts_with("invalid setting max_event_bytes = \"true\" in config file")
                && m.ends_with("expected a string or a number, not boolean"),
            "{m}"
        );

        let f = file("http_addr = \n");
        let m = message(&ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        });
        assert!(
            m.contains("is not valid TOML") && m.contains("line 1"),
            "{m}"
        );

        let m = message(&ServeArgs {
            config: Some("/nonexistent/lease-router.toml".into()),
            ..ServeArgs::default()
        });
        assert!(
            m.starts_with("cannot read config file /nonexistent/lease-router.toml: "),
            "{m}"
        );
    }

    /// The settings named in README's table, row by row: (flag, variable, file key).
    fn readme_settings() -> Vec<(String, String, String)> {
        let code = |cell: &str| -> String {
            let inner = cell.split('`').nth(1).unwrap_or_default();
            inner
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned()
        };
        include_str!("../../README.md")
            .lines()
            .skip_while(|line| !line.starts_with("| flag | environment | TOML key | default |"))
            .skip(2)
            .take_while(|line| line.starts_with('|'))
            .map(|row| {
                let cells: Vec<&str> = row.split('|').collect();
                (code(cells[1]), code(cells[2]), code(cells[3]))
            })
            .collect()
    }

    /// Fails when README documents other settings (keys, flags or variables) than `serve`
    /// accepts, or in another order.
    #[test]
    fn readme_documents_exactly_the_declared_settings() {
        let declared: Vec<(String, String, String)> = declared_settings()
            .iter()
            .map(|arg| {
                (
                    format!("--{}", arg.get_long().unwrap()),
                    arg.get_env().unwrap().to_str().unwrap().to_owned(),
                    arg.get_id().to_string(),
                )
            })
            .collect();
        assert_eq!(declared.len(), 33);
        assert_eq!(
            readme_settings(),
            declared,
            "README's settings table (flag, environment, TOML key) must list exactly the \
             settings declared in ServeArgs, in their order"
        );
    }

    /// The `--config` help is generated from the declaration: every key, in order.
    #[test]
    fn config_help_lists_every_file_key() {
        let serve = document_file_keys(declared());
        let config = serve
            .get_arguments()
            .find(|arg| arg.get_id() == "config")
            .unwrap();
        let help = config.get_help().unwrap().to_string();
        assert_eq!(
            help,
            format!(
                "TOML file with settings; its keys: {}",
                file_keys().join(", ")
            )
        );
        for key in [
            "subscription_capacity",
            "durable",
            "stream_replicas",
            "nats_tls_key",
        ] {
            assert!(help.contains(key), "{help}");
        }
    }

    /// A file may hold every declared setting, and each one is resolved (the `debug_assert`
    /// at the end of `resolve` fails for a declared setting nothing reads).
    #[test]
    fn a_file_with_every_setting_resolves() {
        let ca = file("-----BEGIN CERTIFICATE-----\n");
        let mut text = String::new();
        for key in file_keys() {
            let value = match key.as_str() {
                "nats_url" => "\"nats://10.0.0.1:4222\"".to_owned(),
                "deployments" => "[\"a\", \"b\"]".to_owned(),
                "http_addr" => "\"0.0.0.0:9000\"".to_owned(),
                "subject_prefix" => "\"acme.leases\"".to_owned(),
                "lease_scan_interval"
                | "connect_deadline"
                | "nats_ping_interval"
                | "worker_idle"
                | "snapshot_interval" => "\"7s\"".to_owned(),
                "log_format" => "\"json\"".to_owned(),
                "durable" => "true".to_owned(),
                "stream_replicas" => "3".to_owned(),
                "stream_max_bytes" => "2_000_000".to_owned(),
                "snapshot_keep" => "5".to_owned(),
                "route_policy" => "\"round_robin\"".to_owned(),
                // One way to authenticate: user and password; the other ways stay unset.
                "nats_user" | "nats_password" => "\"router\"".to_owned(),
                "nats_token" | "nats_nkey" | "nats_creds" | "nats_tls_cert" | "nats_tls_key" => {
                    continue
                }
                "nats_tls_ca" => format!("{:?}", ca.path()),
                // The token inline; the file is the other way to give it.
                "http_token" => "\"s3cret-token\"".to_owned(),
                "http_token_file" => continue,
                "http_protect_reads" => "true".to_owned(),
                _ => "4242".to_owned(),
            };
            text.push_str(&format!("{key} = {value}\n"));
        }
        let f = file(&text);
        let s = resolve(&ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(s.host.apply.max_event_bytes, 4242);
        assert_eq!(s.host.apply.max_batch_bytes, 4242);
        assert_eq!(s.host.max_active_leases, 4242);
        assert_eq!(s.nats.subscription_capacity, Some(4242));
        let durable = s.host.durable.unwrap();
        assert_eq!((durable.replicas, durable.max_bytes), (3, 2_000_000));
        assert_eq!(durable.snapshot_interval, Duration::from_secs(7));
        assert_eq!(
            durable.max_age,
            Duration::from_secs(60),
            "5 x 7 s, at least 60 s"
        );
        assert_eq!(s.nats.connect_deadline, Duration::from_secs(7));
        assert_eq!(s.nats.ping_interval, Some(Duration::from_secs(7)));
        assert!(s.nats.tls.is_some());
        assert!(s.http_auth.expect("a token").reads_protected());
    }

    #[test]
    fn durations() {
        let d = |s| parse_duration(s);
        assert_eq!(d("300"), Some(Duration::from_secs(300)));
        assert_eq!(d("300s"), Some(Duration::from_secs(300)));
        assert_eq!(d("5m"), Some(Duration::from_secs(300)));
        assert_eq!(d("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(d("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(d("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(d("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(d(" 2m "), Some(Duration::from_secs(120)));
        for bad in ["", "s", "5x", "-5s", "5 m", ".5s", "5.s", "1e3s", "m5"] {
            assert_eq!(d(bad), None, "{bad:?}");
        }
    }

    const SECRETS: [&str; 2] = ["hunter2-pass", "tok-3f9a-secret"];

    fn assert_no_secret(text: &str) {
        for secret in SECRETS {
            assert!(!text.contains(secret), "a secret leaked: {text}");
        }
    }

    #[test]
    fn credentials_from_flags_and_file() {
        let cli = Cli::try_parse_from([
            "serve",
            "--nats-user",
            "router",
            "--nats-password",
            SECRETS[0],
        ])
        .unwrap();
        assert_no_secret(&format!("{:?}", cli.serve));
        let s = resolve(&cli.serve).unwrap();
        assert_eq!(
            s.nats.auth,
            NatsAuth::UserPassword {
                user: "router".into(),
                password: SECRETS[0].into()
            }
        );
        assert_eq!(s.nats.tls, None);
        let config = s.nats.clone();
        assert_eq!(config.auth, s.nats.auth);
        assert_no_secret(&format!("{s:?} {config:?}"));
        assert!(format!("{s:?}").contains("router"));

        let seed = file("SUAEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLEEXAMPLE\n");
        let ca = file("-----BEGIN CERTIFICATE-----\n");
        let cert = file("-----BEGIN CERTIFICATE-----\n");
        let key = file("-----BEGIN PRIVATE KEY-----\n");
        let conf = file(&format!(
            "nats_nkey = {:?}\nnats_tls_ca = {:?}\nnats_tls_cert = {:?}\nnats_tls_key = {:?}\n",
            seed.path(),
            ca.path(),
            cert.path(),
            key.path()
        ));
        let s = resolve(&ServeArgs {
            config: Some(conf.path().to_owned()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(s.nats.auth, NatsAuth::NKeySeedFile(seed.path().to_owned()));
        assert_eq!(
            s.nats.tls,
            Some(NatsTls {
                ca_file: Some(ca.path().to_owned()),
                cert_file: Some(cert.path().to_owned()),
                key_file: Some(key.path().to_owned()),
            })
        );
        let config = s.nats.clone();
        assert_eq!(config.tls, s.nats.tls);

        // A flag beats the file: the token replaces nothing, it conflicts with the nkey.
        let m = message(&ServeArgs {
            config: Some(conf.path().to_owned()),
            nats_credentials: Box::new(NatsCredentialArgs {
                nats_token: Some(SECRETS[1].into()),
                ..NatsCredentialArgs::default()
            }),
            ..ServeArgs::default()
        });
        assert!(m.contains("give only one way to authenticate"), "{m}");
        assert_no_secret(&m);
    }

    #[test]
    fn credential_errors_name_the_setting_never_the_secret() {
        let args = |f: &dyn Fn(&mut ServeArgs)| {
            let mut a = ServeArgs::default();
            f(&mut a);
            a
        };
        let cases: Vec<(ServeArgs, &str)> = vec![
            (
                args(&|a| a.nats_credentials.nats_password = Some(SECRETS[0].into())),
                "invalid setting nats_password = \"<redacted>\" from --nats-password: a password needs a user",
            ),
            (
                args(&|a| a.nats_credentials.nats_user = Some("router".into())),
                "invalid setting nats_user = \"router\" from --nats-user: a user needs a password",
            ),
            (
                args(&|a| {
                    a.nats_credentials.nats_user = Some("router".into());
                    a.nats_credentials.nats_password = Some(SECRETS[0].into());
                    a.nats_credentials.nats_token = Some(SECRETS[1].into());
                }),
                "invalid setting nats_token = \"<redacted>\" from --nats-token: give only one way",
            ),
            (
                args(&|a| a.nats_credentials.nats_token = Some(String::new())),
                "invalid setting nats_token = \"\" from --nats-token: expected a non-empty value",
            ),
            (
                args(&|a| a.nats_credentials.nats_creds = Some("/nonexistent/router.creds".into())),
                "invalid setting nats_creds = \"/nonexistent/router.creds\" from --nats-creds: expected a readable file",
            ),
            (
                args(&|a| a.nats_credentials.nats_tls_cert = Some("/nonexistent/cert.pem".into())),
                "invalid setting nats_tls_cert = \"/nonexistent/cert.pem\" from --nats-tls-cert: expected a readable",
            ),
        ];
        for (a, start) in cases {
            let err = resolve(&a).unwrap_err();
            let text = format!("{err} {err:?} {a:?}");
            assert!(err.to_string().starts_with(start), "{err}");
            assert_no_secret(&text);
        }

        let cert = file("x");
        let m = message(&args(&|a| {
            a.nats_credentials.nats_tls_cert = Some(cert.path().display().to_string())
        }));
        assert!(m.contains("a client certificate needs its key"), "{m}");

        // A secret of the wrong type in the file: not echoed either.
        let f = file("nats_password = 123456789\n");
        let m = message(&ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        });
        assert!(
            m.starts_with("invalid setting nats_password = \"<redacted>\""),
            "{m}"
        );
        assert!(!m.contains("123456789"), "{m}");
    }

    #[test]
    fn secret_env_values_are_hidden_from_help() {
        use clap::CommandFactory;
        let cmd = Cli::command();
        for id in ["nats_password", "nats_token", "http_token"] {
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_id().as_str() == id)
                .unwrap();
            assert!(arg.is_hide_env_values_set(), "{id}");
        }
    }

    #[test]
    fn http_token_from_a_flag_or_a_file_trimmed_and_never_shown() {
        let s = resolve(&ServeArgs::default()).unwrap();
        assert!(s.http_auth.is_none(), "no token: the API is open");

        let cli = Cli::try_parse_from(["serve", "--http-token", SECRETS[1]]).unwrap();
        assert_no_secret(&format!("{:?}", cli.serve));
        let s = resolve(&cli.serve).unwrap();
        assert_no_secret(&format!("{s:?}"));
        let auth = s.http_auth.expect("a token");
        assert!(auth.token().matches(SECRETS[1]));
        assert!(!auth.reads_protected());

        // A file, with the newline an editor leaves; `--http-protect-reads` alone is true.
        let token_file = file(&format!("  {}\n\n", SECRETS[1]));
        let path = token_file.path().to_str().unwrap();
        let cli = Cli::try_parse_from(["serve", "--http-token-file", path, "--http-protect-reads"])
            .unwrap();
        let auth = resolve(&cli.serve).unwrap().http_auth.expect("a token");
        assert!(auth.token().matches(SECRETS[1]));
        assert!(auth.reads_protected());

        // The config file's keys.
        let conf = file(&format!(
            "http_token_file = {path:?}\nhttp_protect_reads = false\n"
        ));
        let auth = resolve(&ServeArgs {
            config: Some(conf.path().to_owned()),
            ..ServeArgs::default()
        })
        .unwrap()
        .http_auth
        .expect("a token");
        assert!(auth.token().matches(SECRETS[1]));
        assert!(!auth.reads_protected());
    }

    #[test]
    fn http_token_errors_are_clear_and_never_show_the_token() {
        let args = |f: &dyn Fn(&mut ServeArgs)| {
            let mut a = ServeArgs::default();
            f(&mut a);
            a
        };
        let blank = file(" \n\t\n");
        let blank_path = blank.path().display().to_string();
        let token_file = file(SECRETS[1]);
        let token_path = token_file.path().display().to_string();
        let cases: Vec<(ServeArgs, String)> = vec![
            (
                args(&|a| a.http_token = Some(String::new())),
                "invalid setting http_token = \"\" from --http-token: the token is empty".into(),
            ),
            (
                args(&|a| a.http_token_file = Some(blank_path.clone())),
                format!(
                    "invalid setting http_token_file = {blank_path:?} from --http-token-file: the \
                     file holds no usable token: the token is empty"
                ),
            ),
            (
                args(&|a| a.http_token_file = Some("/nonexistent/token".into())),
                "invalid setting http_token_file = \"/nonexistent/token\" from \
                 --http-token-file: expected a readable file"
                    .into(),
            ),
            (
                args(&|a| a.http_token = Some(format!("{} x", SECRETS[1]))),
                "invalid setting http_token = \"<redacted>\" from --http-token: the token has a \
                 character"
                    .into(),
            ),
            (
                args(&|a| {
                    a.http_token = Some(SECRETS[1].into());
                    a.http_token_file = Some(token_path.clone());
                }),
                format!(
                    "invalid setting http_token_file = {token_path:?} from --http-token-file: give \
                     the token once"
                ),
            ),
            (
                args(&|a| a.http_protect_reads = Some("true".into())),
                "invalid setting http_protect_reads = \"true\" from --http-protect-reads: \
                 protecting the reads needs a token"
                    .into(),
            ),
            (
                args(&|a| {
                    a.http_token = Some(SECRETS[1].into());
                    a.http_protect_reads = Some("maybe".into());
                }),
                "invalid setting http_protect_reads = \"maybe\" from --http-protect-reads: \
                 expected true or false"
                    .into(),
            ),
        ];
        for (a, start) in cases {
            let err = resolve(&a).unwrap_err();
            assert!(
                err.to_string().starts_with(&start),
                "{err}\nwanted: {start}"
            );
            assert_no_secret(&format!("{err} {err:?} {a:?}"));
        }
        // A token of the wrong type in the config file: not echoed.
        let f = file("http_token = 987654321\n");
        let m = message(&ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        });
        assert!(
            m.starts_with("invalid setting http_token = \"<redacted>\""),
            "{m}"
        );
        assert!(!m.contains("987654321"), "{m}");
    }

    #[test]
    fn memory_limits() {
        let s = resolve(&ServeArgs::default()).unwrap();
        assert_eq!(s.host.max_active_leases, DEFAULT_MAX_ACTIVE_LEASES);
        let apply = &s.host.apply;
        assert_eq!(apply.max_tombstones, ApplyConfig::default().max_tombstones);

        let f = file("max_tombstones = 10\nmax_publishers = \"20\"\nmax_active_leases = 5\n");
        let cli = Cli::try_parse_from([
            "serve",
            "--config",
            f.path().to_str().unwrap(),
            "--max-held-progress",
            "1_000",
            "--max-publishers",
            "30",
        ])
        .unwrap();
        let s = resolve(&cli.serve).unwrap();
        assert_eq!(s.host.max_active_leases, 5);
        let apply = &s.host.apply;
        assert_eq!(
            (
                apply.max_tombstones,
                apply.max_held_progress,
                apply.max_publishers
            ),
            (10, 1000, 30)
        );
        for bad in ["0", "-1", "many", "100000001"] {
            let m = message(&ServeArgs {
                max_tombstones: Some(bad.into()),
                ..ServeArgs::default()
            });
            assert!(
                m.starts_with(&format!(
                    "invalid setting max_tombstones = {bad:?} from --max-tombstones: expected a whole \
                     number from 1"
                )),
                "{m}"
            );
        }
    }

    #[test]
    fn route_policy_and_worker_idle_resolve_and_refuse_nonsense() {
        let args = |f: fn(&mut ServeArgs)| {
            let mut a = ServeArgs::default();
            f(&mut a);
            a
        };
        let s = resolve(&args(|a| {
            a.route_policy = Some("round_robin".into());
            a.worker_idle = Some("90s".into());
        }))
        .unwrap();
        assert_eq!(s.host.route_policy, lease_router::RoutePolicy::RoundRobin);
        assert_eq!(s.host.worker_idle, Some(Duration::from_secs(90)));
        let s = resolve(&args(|_| {})).unwrap();
        assert_eq!(s.host.route_policy, lease_router::RoutePolicy::WeightedCost);
        assert_eq!(s.host.worker_idle, None);
        let m = message(&args(|a| a.route_policy = Some("fastest".into())));
        assert!(m.contains("route_policy = \"fastest\""), "{m}");
        let m = message(&args(|a| a.worker_idle = Some("0s".into())));
        assert!(m.contains("worker_idle = \"0s\""), "{m}");
    }
}

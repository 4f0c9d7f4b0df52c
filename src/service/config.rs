//! The settings of `lease-router serve`, and where they come from.
//!
//! Every setting can be given in four places; the first one that has it wins:
//!
//! 1. a command-line flag (`--http-addr 0.0.0.0:9464`),
//! 2. an environment variable (`LEASE_ROUTER_HTTP_ADDR`, or `NATS_URL` for the NATS servers),
//! 3. the TOML file named by `--config FILE` (or `LEASE_ROUTER_CONFIG`),
//! 4. the default.
//!
//! | setting | flag | environment | file key | default |
//! | --- | --- | --- | --- | --- |
//! | NATS servers (comma separated) | `--nats-url` | `NATS_URL` | `nats_url` | `nats://127.0.0.1:4222` |
//! | deployments | `--deployment` (repeatable) | `LEASE_ROUTER_DEPLOYMENTS` (comma separated) | `deployments` | none |
//! | HTTP listen address | `--http-addr` | `LEASE_ROUTER_HTTP_ADDR` | `http_addr` | `127.0.0.1:9464` |
//! | subject prefix | `--subject-prefix` | `LEASE_ROUTER_SUBJECT_PREFIX` | `subject_prefix` | `leases` |
//! | lease scan interval | `--lease-scan-interval` | `LEASE_ROUTER_LEASE_SCAN_INTERVAL` | `lease_scan_interval` | `300s` |
//! | log format | `--log-format` | `LEASE_ROUTER_LOG_FORMAT` | `log_format` | `text` |
//! | NATS connect deadline | `--connect-deadline` | `LEASE_ROUTER_CONNECT_DEADLINE` | `connect_deadline` | `30s` |
//! | largest event accepted | `--max-event-bytes` | `LEASE_ROUTER_MAX_EVENT_BYTES` | `max_event_bytes` | `4096` |
//! | live leases per deployment | `--max-active-leases` | `LEASE_ROUTER_MAX_ACTIVE_LEASES` | `max_active_leases` | `1000000` |
//! | tombstones per deployment | `--max-tombstones` | `LEASE_ROUTER_MAX_TOMBSTONES` | `max_tombstones` | `100000` |
//! | held progress per deployment | `--max-held-progress` | `LEASE_ROUTER_MAX_HELD_PROGRESS` | `max_held_progress` | `100000` |
//! | tracked publishers per deployment | `--max-publishers` | `LEASE_ROUTER_MAX_PUBLISHERS` | `max_publishers` | `10000` |
//! | messages buffered per subscription | `--subscription-capacity` | `LEASE_ROUTER_SUBSCRIPTION_CAPACITY` | `subscription_capacity` | `262144` |
//! | durable mode (JetStream replay) | `--durable` | `LEASE_ROUTER_DURABLE` | `durable` | off |
//! | lease stream replicas (durable) | `--stream-replicas` | `LEASE_ROUTER_STREAM_REPLICAS` | `stream_replicas` | `1` |
//! | routing policy of new deployments | `--route-policy` | `LEASE_ROUTER_ROUTE_POLICY` | `route_policy` | `weighted_cost` |
//! | idle time before a silent worker with nothing live is forgotten | `--worker-idle` | `LEASE_ROUTER_WORKER_IDLE` | `worker_idle` | twice the lease scan interval |
//! | NATS user (with a password) | `--nats-user` | `NATS_USER` | `nats_user` | none |
//! | NATS password | `--nats-password` | `NATS_PASSWORD` | `nats_password` | none |
//! | NATS token | `--nats-token` | `NATS_TOKEN` | `nats_token` | none |
//! | NKey seed file | `--nats-nkey` | `NATS_NKEY` | `nats_nkey` | none |
//! | credentials file (JWT + seed) | `--nats-creds` | `NATS_CREDS` | `nats_creds` | none |
//! | TLS: CA certificates (PEM) | `--nats-tls-ca` | `NATS_TLS_CA` | `nats_tls_ca` | system roots |
//! | TLS: client certificate (PEM) | `--nats-tls-cert` | `NATS_TLS_CERT` | `nats_tls_cert` | none |
//! | TLS: client key (PEM) | `--nats-tls-key` | `NATS_TLS_KEY` | `nats_tls_key` | none |
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
//!
//! Values are validated in [`resolve`], not by clap, so that every mistake reads the same
//! way, naming the setting, the value and what is accepted:
//!
//! ```text
//! invalid setting http_addr = "abc": expected HOST:PORT such as 127.0.0.1:9464
//! ```
//!
//! A key of the file that is not a setting is an error naming the key.

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use crate::connection::{NatsAuth, NatsConnectConfig, NatsTls, DEFAULT_NATS_URL};
use crate::durable::LeaseStreamConfig;
use crate::ingress::ApplyConfig;
use crate::lease::manager::{DEFAULT_MAX_ACTIVE_LEASES, DEFAULT_SCAN_INTERVAL};
use crate::subject::{DeploymentName, SubjectPrefix, DEFAULT_SUBJECT_PREFIX};
use crate::wire::DEFAULT_MAX_EVENT_BYTES;

use super::host::HostSettings;

/// The default HTTP listen address.
pub const DEFAULT_HTTP_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 9464);

/// The default bound on the first NATS connect.
pub const DEFAULT_CONNECT_DEADLINE: Duration = Duration::from_secs(30);

/// The smallest accepted `max_event_bytes`: an `admitted` event with a short request id.
pub const MIN_MAX_EVENT_BYTES: usize = 64;
/// The largest accepted `max_event_bytes`: the NATS server's hard payload limit.
pub const MAX_MAX_EVENT_BYTES: usize = 64 * 1024 * 1024;

/// The keys a config file may hold.
pub const FILE_KEYS: [&str; 25] = [
    "nats_url",
    "deployments",
    "http_addr",
    "subject_prefix",
    "lease_scan_interval",
    "log_format",
    "connect_deadline",
    "max_event_bytes",
    "max_active_leases",
    "max_tombstones",
    "max_held_progress",
    "max_publishers",
    "subscription_capacity",
    "durable",
    "stream_replicas",
    "route_policy",
    "worker_idle",
    "nats_user",
    "nats_password",
    "nats_token",
    "nats_nkey",
    "nats_creds",
    "nats_tls_ca",
    "nats_tls_cert",
    "nats_tls_key",
];

/// What error messages show instead of a secret value.
const REDACTED: &str = "<redacted>";

/// The flags of `lease-router serve` (flatten it into the subcommand).
///
/// Every field is optional: what is not given on the command line or in the environment is
/// taken from the config file, else from the defaults, by [`resolve`].
/// `Debug` is written by hand: it shows whether a password or token was given, never which.
#[derive(Clone, Default, PartialEq, Eq, clap::Args)]
pub struct ServeArgs {
    /// TOML file with settings (keys: nats_url, deployments, http_addr, subject_prefix,
    /// lease_scan_interval, log_format, connect_deadline, max_event_bytes, max_active_leases,
    /// max_tombstones, max_held_progress, max_publishers, nats_user, nats_password, nats_token, nats_nkey, nats_creds, nats_tls_ca, nats_tls_cert,
    /// nats_tls_key).
    #[arg(long = "config", value_name = "FILE", env = "LEASE_ROUTER_CONFIG")]
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

    /// Routing policy of new deployments: weighted_cost, power_of_two, round_robin or random
    /// (a PUT body may set another per deployment) [default: weighted_cost].
    #[arg(
        long = "route-policy",
        value_name = "POLICY",
        env = "LEASE_ROUTER_ROUTE_POLICY"
    )]
    pub route_policy: Option<String>,

    /// How long a worker with no live lease may say nothing before routers forget it
    /// [default: twice the lease scan interval, one lease lifetime].
    #[arg(
        long = "worker-idle",
        value_name = "DURATION",
        env = "LEASE_ROUTER_WORKER_IDLE"
    )]
    pub worker_idle: Option<String>,

    /// Authentication and TLS to NATS (boxed: they make the struct large).
    #[command(flatten)]
    pub nats_credentials: Box<NatsCredentialArgs>,
}

impl fmt::Debug for ServeArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServeArgs")
            .field("config", &self.config)
            .field("nats_url", &self.nats_url.as_deref().map(redact_url_list))
            .field("deployments", &self.deployments)
            .field("http_addr", &self.http_addr)
            .field("subject_prefix", &self.subject_prefix)
            .field("lease_scan_interval", &self.lease_scan_interval)
            .field("log_format", &self.log_format)
            .field("connect_deadline", &self.connect_deadline)
            .field("max_event_bytes", &self.max_event_bytes)
            .field("max_active_leases", &self.max_active_leases)
            .field("max_tombstones", &self.max_tombstones)
            .field("max_held_progress", &self.max_held_progress)
            .field("max_publishers", &self.max_publishers)
            .field("subscription_capacity", &self.subscription_capacity)
            .field("durable", &self.durable)
            .field("stream_replicas", &self.stream_replicas)
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
        Ok(resolve(&args)?.nats_connect_config())
    }
}

/// The authentication and TLS flags of [`ServeArgs`]. `Debug` shows whether a password or
/// token was given, never which.
#[derive(Clone, Default, PartialEq, Eq, clap::Args)]
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
            .finish()
    }
}

/// A comma-separated URL list with any `user:password@` replaced.
fn redact_url_list(list: &str) -> String {
    list.split(',')
        .map(crate::connection::redact_url)
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

/// The resolved settings of `lease-router serve`.
#[derive(Clone, Debug, PartialEq)]
pub struct ServeSettings {
    /// The NATS servers (setting `nats_url`), at least one.
    pub nats_urls: Vec<String>,
    /// Deployments hosted from the start, without duplicates, in the order given.
    pub deployments: Vec<DeploymentName>,
    pub http_addr: SocketAddr,
    pub subject_prefix: SubjectPrefix,
    pub lease_scan_interval: Duration,
    pub log_format: LogFormat,
    pub connect_deadline: Duration,
    pub max_event_bytes: usize,
    /// Live leases per deployment (the lease manager's `max_active_leases`).
    pub max_active_leases: usize,
    pub max_tombstones: usize,
    pub max_held_progress: usize,
    pub max_publishers: usize,
    /// Messages buffered per subscription.
    pub subscription_capacity: usize,
    /// Durable mode on JetStream.
    pub durable: bool,
    /// Replicas of the lease stream (durable mode).
    pub stream_replicas: usize,
    /// Routing policy of new deployments.
    pub route_policy: crate::routing::RoutePolicy,
    /// `None`: twice the lease scan interval.
    pub worker_idle: Option<Duration>,
    /// How to authenticate to NATS (its `Debug` redacts secrets).
    pub nats_auth: NatsAuth,
    /// TLS to NATS; `None`: plain TCP unless the URL or the server asks for TLS.
    pub nats_tls: Option<NatsTls>,
    /// The config file that was read, if any.
    pub config_file: Option<PathBuf>,
}

impl Default for ServeSettings {
    fn default() -> Self {
        Self {
            nats_urls: vec![DEFAULT_NATS_URL.to_string()],
            deployments: Vec::new(),
            http_addr: DEFAULT_HTTP_ADDR,
            subject_prefix: SubjectPrefix::default(),
            lease_scan_interval: DEFAULT_SCAN_INTERVAL,
            log_format: LogFormat::Text,
            connect_deadline: DEFAULT_CONNECT_DEADLINE,
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            max_active_leases: DEFAULT_MAX_ACTIVE_LEASES,
            max_tombstones: ApplyConfig::default().max_tombstones,
            max_held_progress: ApplyConfig::default().max_held_progress,
            max_publishers: ApplyConfig::default().max_publishers,
            subscription_capacity: DEFAULT_SUBSCRIPTION_CAPACITY,
            durable: false,
            stream_replicas: 1,
            route_policy: Default::default(),
            worker_idle: None,
            nats_auth: NatsAuth::None,
            nats_tls: None,
            config_file: None,
        }
    }
}

impl ServeSettings {
    /// How to connect to NATS.
    pub fn nats_connect_config(&self) -> NatsConnectConfig {
        let config = NatsConnectConfig::new(self.nats_urls.iter().cloned())
            .with_connect_deadline(self.connect_deadline)
            .with_name("lease-router serve")
            .with_subscription_capacity(self.subscription_capacity)
            .with_auth(self.nats_auth.clone());
        match &self.nats_tls {
            Some(tls) => config.with_tls(tls.clone()),
            None => config,
        }
    }

    /// The settings of the [`super::DeploymentHost`].
    pub fn host_settings(&self) -> HostSettings {
        HostSettings {
            subject_prefix: self.subject_prefix.clone(),
            lease_scan_interval: self.lease_scan_interval,
            apply: ApplyConfig {
                max_event_bytes: self.max_event_bytes,
                max_tombstones: self.max_tombstones,
                max_held_progress: self.max_held_progress,
                max_publishers: self.max_publishers,
                ..ApplyConfig::default()
            },
            max_active_leases: self.max_active_leases,
            route_policy: self.route_policy,
            worker_idle: self.worker_idle,
            durable: self.durable.then(|| {
                LeaseStreamConfig::new(self.subject_prefix.clone(), self.lease_scan_interval)
                    .with_replicas(self.stream_replicas)
            }),
            ..HostSettings::default()
        }
    }
}

/// Where a rejected value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValueOrigin {
    /// A command-line flag or an environment variable.
    CommandLineOrEnvironment,
    /// The config file at this path.
    File(PathBuf),
}

impl fmt::Display for ValueOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueOrigin::CommandLineOrEnvironment => Ok(()),
            ValueOrigin::File(path) => write!(f, " in config file {}", path.display()),
        }
    }
}

/// A setting that cannot be used. The message names the setting, the value and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid setting {setting} = {value:?}{origin}: {expected}")]
    Invalid {
        setting: &'static str,
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
        FILE_KEYS.join(", ")
    )]
    UnknownKey { path: PathBuf, key: String },
}

impl ConfigError {
    /// The setting (or file key) at fault, if it is one.
    pub fn setting(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { setting, .. } => Some(setting),
            ConfigError::UnknownKey { key, .. } => Some(key),
            ConfigError::ReadFile { .. } | ConfigError::ParseFile { .. } => None,
        }
    }
}

/// The raw values of the config file, as strings, each validated like a flag. No `Debug`: it
/// holds secrets.
#[derive(Default)]
struct FileValues {
    nats_url: Option<String>,
    deployments: Option<Vec<String>>,
    http_addr: Option<String>,
    subject_prefix: Option<String>,
    lease_scan_interval: Option<String>,
    log_format: Option<String>,
    connect_deadline: Option<String>,
    max_event_bytes: Option<String>,
    max_active_leases: Option<String>,
    max_tombstones: Option<String>,
    max_held_progress: Option<String>,
    max_publishers: Option<String>,
    subscription_capacity: Option<String>,
    durable: Option<String>,
    stream_replicas: Option<String>,
    route_policy: Option<String>,
    worker_idle: Option<String>,
    nats_user: Option<String>,
    nats_password: Option<String>,
    nats_token: Option<String>,
    nats_nkey: Option<String>,
    nats_creds: Option<String>,
    nats_tls_ca: Option<String>,
    nats_tls_cert: Option<String>,
    nats_tls_key: Option<String>,
}

/// Resolves the settings: flags, then environment (both already in `args`, clap reads the
/// environment), then the config file, then the defaults.
///
/// # Errors
/// [`ConfigError`] naming the first setting that is invalid, the bad value and the accepted
/// values; or the config file that cannot be read or parsed, or holds an unknown key.
pub fn resolve(args: &ServeArgs) -> Result<ServeSettings, ConfigError> {
    let file = match &args.config {
        Some(path) => read_file(path)?,
        None => FileValues::default(),
    };
    let file_origin = || match &args.config {
        Some(path) => ValueOrigin::File(path.clone()),
        None => ValueOrigin::CommandLineOrEnvironment,
    };
    // The value to use and where it came from.
    let pick = |cli: &Option<String>, file: &Option<String>| -> Option<(String, ValueOrigin)> {
        match (cli, file) {
            (Some(v), _) => Some((v.clone(), ValueOrigin::CommandLineOrEnvironment)),
            (None, Some(v)) => Some((v.clone(), file_origin())),
            (None, None) => None,
        }
    };
    let mut settings = ServeSettings {
        config_file: args.config.clone(),
        ..ServeSettings::default()
    };

    if let Some((value, origin)) = pick(&args.nats_url, &file.nats_url) {
        settings.nats_urls = parse_nats_urls(&value, origin)?;
    }
    let deployments = match (&args.deployments, &file.deployments) {
        (Some(list), _) => Some((list.clone(), ValueOrigin::CommandLineOrEnvironment)),
        (None, Some(list)) => Some((list.clone(), file_origin())),
        (None, None) => None,
    };
    if let Some((list, origin)) = deployments {
        settings.deployments = parse_deployments(&list, &origin)?;
    }
    if let Some((value, origin)) = pick(&args.http_addr, &file.http_addr) {
        settings.http_addr = parse_http_addr(&value, origin)?;
    }
    if let Some((value, origin)) = pick(&args.subject_prefix, &file.subject_prefix) {
        settings.subject_prefix =
            SubjectPrefix::new(value.trim()).map_err(|err| ConfigError::Invalid {
                setting: "subject_prefix",
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
    if let Some((value, origin)) = pick(&args.lease_scan_interval, &file.lease_scan_interval) {
        settings.lease_scan_interval = match parse_duration(&value) {
            Some(d) if !d.is_zero() => d,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "lease_scan_interval",
                    value,
                    origin,
                    expected: "expected a positive duration: seconds (300) or a number with a \
                               unit ms, s, m or h (300s, 5m, 1m30s)"
                        .into(),
                })
            }
        };
    }
    if let Some((value, origin)) = pick(&args.log_format, &file.log_format) {
        settings.log_format = value.parse().map_err(|()| ConfigError::Invalid {
            setting: "log_format",
            value,
            origin,
            expected: "expected text or json".into(),
        })?;
    }
    if let Some((value, origin)) = pick(&args.connect_deadline, &file.connect_deadline) {
        settings.connect_deadline = parse_duration(&value).ok_or_else(|| ConfigError::Invalid {
            setting: "connect_deadline",
            value,
            origin,
            expected: "expected a duration: seconds (30) or a number with a unit ms, s, m or h \
                       (30s, 2m)"
                .into(),
        })?;
    }
    if let Some((value, origin)) = pick(&args.max_event_bytes, &file.max_event_bytes) {
        settings.max_event_bytes = match value.trim().parse::<usize>() {
            Ok(n) if (MIN_MAX_EVENT_BYTES..=MAX_MAX_EVENT_BYTES).contains(&n) => n,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "max_event_bytes",
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
    for (setting, cli, file, slot) in [
        (
            "max_active_leases",
            &args.max_active_leases,
            &file.max_active_leases,
            &mut settings.max_active_leases,
        ),
        (
            "max_tombstones",
            &args.max_tombstones,
            &file.max_tombstones,
            &mut settings.max_tombstones,
        ),
        (
            "max_held_progress",
            &args.max_held_progress,
            &file.max_held_progress,
            &mut settings.max_held_progress,
        ),
        (
            "max_publishers",
            &args.max_publishers,
            &file.max_publishers,
            &mut settings.max_publishers,
        ),
        (
            "subscription_capacity",
            &args.subscription_capacity,
            &file.subscription_capacity,
            &mut settings.subscription_capacity,
        ),
    ] {
        if let Some((value, origin)) = pick(cli, file) {
            *slot = parse_limit(setting, value, origin, *slot)?;
        }
    }
    if let Some((value, origin)) = pick(&args.durable, &file.durable) {
        settings.durable = match value.trim().to_ascii_lowercase().as_str() {
            "true" | "yes" | "on" | "1" => true,
            "false" | "no" | "off" | "0" => false,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "durable",
                    value,
                    origin,
                    expected: "expected true or false".into(),
                })
            }
        };
    }
    if let Some((value, origin)) = pick(&args.stream_replicas, &file.stream_replicas) {
        settings.stream_replicas = match value.trim().parse::<usize>() {
            Ok(n) if (1..=5).contains(&n) => n,
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "stream_replicas",
                    value,
                    origin,
                    expected: "expected a whole number from 1 to 5 (JetStream's limit),                                at most the number of NATS servers in the cluster"
                        .into(),
                })
            }
        };
    }
    if let Some((value, origin)) = pick(&args.route_policy, &file.route_policy) {
        settings.route_policy = value.trim().parse().map_err(|err| ConfigError::Invalid {
            setting: "route_policy",
            value,
            origin,
            expected: format!("{err}"),
        })?;
    }
    if let Some((value, origin)) = pick(&args.worker_idle, &file.worker_idle) {
        settings.worker_idle = match parse_duration(&value) {
            Some(d) if !d.is_zero() => Some(d),
            _ => {
                return Err(ConfigError::Invalid {
                    setting: "worker_idle",
                    value,
                    origin,
                    expected: "expected a positive duration: seconds (600) or a number with a \
                               unit ms, s, m or h (600s, 10m)"
                        .into(),
                })
            }
        };
    }
    resolve_credentials(args, &file, &pick, &mut settings)?;
    Ok(settings)
}

type Pick<'a> = dyn Fn(&Option<String>, &Option<String>) -> Option<(String, ValueOrigin)> + 'a;

/// The authentication and TLS settings. Secret values never enter an error.
fn resolve_credentials(
    args: &ServeArgs,
    file: &FileValues,
    pick: &Pick<'_>,
    settings: &mut ServeSettings,
) -> Result<(), ConfigError> {
    let args = &*args.nats_credentials;
    let secret = |setting: &'static str, value: Option<(String, ValueOrigin)>| match value {
        Some((v, origin)) if v.is_empty() => Err(ConfigError::Invalid {
            setting,
            value: String::new(),
            origin,
            expected: "expected a non-empty value".into(),
        }),
        Some((v, origin)) => Ok(Some((v, origin))),
        None => Ok(None),
    };
    let user = secret("nats_user", pick(&args.nats_user, &file.nats_user))?;
    let password = secret(
        "nats_password",
        pick(&args.nats_password, &file.nats_password),
    )?;
    let token = secret("nats_token", pick(&args.nats_token, &file.nats_token))?;
    let nkey = readable_file("nats_nkey", pick(&args.nats_nkey, &file.nats_nkey))?;
    let creds = readable_file("nats_creds", pick(&args.nats_creds, &file.nats_creds))?;

    let mut methods: Vec<(&'static str, NatsAuth, ValueOrigin)> = Vec::new();
    match (user, password) {
        (Some((user, origin)), Some((password, _))) => methods.push((
            "nats_user",
            NatsAuth::UserPassword { user, password },
            origin,
        )),
        (Some((user, origin)), None) => {
            return Err(ConfigError::Invalid {
                setting: "nats_user",
                value: user,
                origin,
                expected: "a user needs a password: give nats_password too".into(),
            })
        }
        (None, Some((_, origin))) => {
            return Err(ConfigError::Invalid {
                setting: "nats_password",
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
            setting,
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
        settings.nats_auth = auth;
    }

    let ca = readable_file("nats_tls_ca", pick(&args.nats_tls_ca, &file.nats_tls_ca))?;
    let cert = readable_file(
        "nats_tls_cert",
        pick(&args.nats_tls_cert, &file.nats_tls_cert),
    )?;
    let key = readable_file("nats_tls_key", pick(&args.nats_tls_key, &file.nats_tls_key))?;
    let (cert_file, key_file) = match (cert, key) {
        (Some((cert, _)), Some((key, _))) => (Some(cert), Some(key)),
        (None, None) => (None, None),
        (Some((path, origin)), None) => {
            return Err(ConfigError::Invalid {
                setting: "nats_tls_cert",
                value: path.display().to_string(),
                origin,
                expected: "a client certificate needs its key: give nats_tls_key too".into(),
            })
        }
        (None, Some((path, origin))) => {
            return Err(ConfigError::Invalid {
                setting: "nats_tls_key",
                value: path.display().to_string(),
                origin,
                expected: "a client key needs its certificate: give nats_tls_cert too".into(),
            })
        }
    };
    let ca_file = ca.map(|(path, _)| path);
    if ca_file.is_some() || cert_file.is_some() {
        settings.nats_tls = Some(NatsTls {
            ca_file,
            cert_file,
            key_file,
        });
    }
    Ok(())
}

/// The largest accepted memory limit: any more is not a limit.
pub const MAX_LIMIT: usize = 100_000_000;

/// Four times async-nats' default: a router takes bursts from many workers at once.
pub const DEFAULT_SUBSCRIPTION_CAPACITY: usize = 262_144;

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
            setting,
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
            setting,
            value,
            origin,
            expected: "expected a file, not a directory".into(),
        }),
        Err(err) => Err(ConfigError::Invalid {
            setting,
            value,
            origin,
            expected: format!("expected a readable file ({})", err.kind()),
        }),
    }
}

fn parse_nats_urls(value: &str, origin: ValueOrigin) -> Result<Vec<String>, ConfigError> {
    let invalid = |value: &str, origin: ValueOrigin| ConfigError::Invalid {
        setting: "nats_url",
        value: crate::connection::redact_url(value),
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
            setting: "deployments",
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
        setting: "http_addr",
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

/// Reads the config file: a TOML table whose keys are in [`FILE_KEYS`].
fn read_file(path: &Path) -> Result<FileValues, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    })?;
    parse_file(path, &text)
}

fn parse_file(path: &Path, text: &str) -> Result<FileValues, ConfigError> {
    let table: toml::Table = toml::from_str(text).map_err(|err| ConfigError::ParseFile {
        path: path.to_owned(),
        message: err.message().to_owned() + &location(text, err.span()),
    })?;
    let origin = ValueOrigin::File(path.to_owned());
    let mut values = FileValues::default();
    for (key, value) in table {
        let scalar = |setting: &'static str, value: toml::Value| -> Result<String, ConfigError> {
            match value {
                toml::Value::String(s) => Ok(s),
                toml::Value::Integer(n) => Ok(n.to_string()),
                other => Err(ConfigError::Invalid {
                    setting,
                    value: other.to_string(),
                    origin: origin.clone(),
                    expected: format!("expected a string or a number, not {}", other.type_str()),
                }),
            }
        };
        // A secret must be a string; a wrong type is reported without its value.
        let secret = |setting: &'static str, value: toml::Value| -> Result<String, ConfigError> {
            match value {
                toml::Value::String(s) => Ok(s),
                other => Err(ConfigError::Invalid {
                    setting,
                    value: REDACTED.into(),
                    origin: origin.clone(),
                    expected: format!("expected a string, not {}", other.type_str()),
                }),
            }
        };
        match key.as_str() {
            "nats_url" => {
                values.nats_url = Some(match value {
                    toml::Value::Array(items) => string_list("nats_url", items, &origin)?.join(","),
                    other => scalar("nats_url", other)?,
                })
            }
            "deployments" => {
                values.deployments = Some(match value {
                    toml::Value::Array(items) => string_list("deployments", items, &origin)?,
                    toml::Value::String(s) => s.split(',').map(str::to_owned).collect(),
                    other => {
                        return Err(ConfigError::Invalid {
                            setting: "deployments",
                            value: other.to_string(),
                            origin,
                            expected: "expected a list of names, such as [\"llama-70b\", \
                                       \"mixtral\"]"
                                .into(),
                        })
                    }
                })
            }
            "http_addr" => values.http_addr = Some(scalar("http_addr", value)?),
            "subject_prefix" => values.subject_prefix = Some(scalar("subject_prefix", value)?),
            "lease_scan_interval" => {
                values.lease_scan_interval = Some(scalar("lease_scan_interval", value)?)
            }
            "log_format" => values.log_format = Some(scalar("log_format", value)?),
            "connect_deadline" => {
                values.connect_deadline = Some(scalar("connect_deadline", value)?)
            }
            "max_event_bytes" => values.max_event_bytes = Some(scalar("max_event_bytes", value)?),
            "max_active_leases" => {
                values.max_active_leases = Some(scalar("max_active_leases", value)?)
            }
            "max_tombstones" => values.max_tombstones = Some(scalar("max_tombstones", value)?),
            "max_held_progress" => {
                values.max_held_progress = Some(scalar("max_held_progress", value)?)
            }
            "max_publishers" => values.max_publishers = Some(scalar("max_publishers", value)?),
            "subscription_capacity" => {
                values.subscription_capacity = Some(scalar("subscription_capacity", value)?)
            }
            "durable" => {
                values.durable = Some(match value {
                    toml::Value::Boolean(b) => b.to_string(),
                    other => scalar("durable", other)?,
                })
            }
            "stream_replicas" => values.stream_replicas = Some(scalar("stream_replicas", value)?),
            "route_policy" => values.route_policy = Some(scalar("route_policy", value)?),
            "worker_idle" => values.worker_idle = Some(scalar("worker_idle", value)?),
            "nats_user" => values.nats_user = Some(scalar("nats_user", value)?),
            "nats_password" => values.nats_password = Some(secret("nats_password", value)?),
            "nats_token" => values.nats_token = Some(secret("nats_token", value)?),
            "nats_nkey" => values.nats_nkey = Some(scalar("nats_nkey", value)?),
            "nats_creds" => values.nats_creds = Some(scalar("nats_creds", value)?),
            "nats_tls_ca" => values.nats_tls_ca = Some(scalar("nats_tls_ca", value)?),
            "nats_tls_cert" => values.nats_tls_cert = Some(scalar("nats_tls_cert", value)?),
            "nats_tls_key" => values.nats_tls_key = Some(scalar("nats_tls_key", value)?),
            _ => {
                return Err(ConfigError::UnknownKey {
                    path: path.to_owned(),
                    key,
                })
            }
        }
    }
    Ok(values)
}

fn string_list(
    setting: &'static str,
    items: Vec<toml::Value>,
    origin: &ValueOrigin,
) -> Result<Vec<String>, ConfigError> {
    items
        .into_iter()
        .map(|item| match item {
            toml::Value::String(s) => Ok(s),
            other => Err(ConfigError::Invalid {
                setting,
                value: other.to_string(),
                origin: origin.clone(),
                expected: format!("expected a list of strings, not of {}", other.type_str()),
            }),
        })
        .collect()
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
    fn route_policy_from_flag_or_file_and_refused_when_unknown() {
        let s = resolve(&ServeArgs {
            route_policy: Some("round_robin".into()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(s.route_policy, crate::routing::RoutePolicy::RoundRobin);
        assert_eq!(
            s.host_settings().route_policy,
            crate::routing::RoutePolicy::RoundRobin
        );
        assert_eq!(
            resolve(&ServeArgs::default()).unwrap().route_policy,
            crate::routing::RoutePolicy::WeightedCost
        );
        let err = resolve(&ServeArgs {
            route_policy: Some("fastest".into()),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert_eq!(err.setting(), Some("route_policy"));
        assert!(err.to_string().contains("power_of_two"), "{err}");
        let s = resolve(&ServeArgs {
            worker_idle: Some("90s".into()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(s.host_settings().worker_idle, Some(Duration::from_secs(90)));
        assert_eq!(resolve(&ServeArgs::default()).unwrap().worker_idle, None);
        let err = resolve(&ServeArgs {
            worker_idle: Some("0s".into()),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert_eq!(err.setting(), Some("worker_idle"));
    }

    #[test]
    fn durable_mode_settings() {
        let f = file("durable = true\nstream_replicas = 3\nlease_scan_interval = \"60s\"\n");
        let args = ServeArgs {
            config: Some(f.path().to_owned()),
            ..ServeArgs::default()
        };
        let host = resolve(&args).unwrap().host_settings();
        let stream = host.durable.expect("durable from the file");
        assert_eq!(stream.replicas, 3);
        assert!(
            stream.max_age >= Duration::from_secs(240),
            "two lease lifetimes"
        );

        // The flag wins over the file.
        let off = ServeArgs {
            durable: Some("false".into()),
            ..args
        };
        assert!(resolve(&off).unwrap().host_settings().durable.is_none());
        assert!(resolve(&ServeArgs::default())
            .unwrap()
            .host_settings()
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
    }

    #[test]
    fn defaults() {
        let s = resolve(&ServeArgs::default()).unwrap();
        assert_eq!(s, ServeSettings::default());
        assert_eq!(s.nats_urls, vec!["nats://127.0.0.1:4222".to_string()]);
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:9464");
        assert_eq!(s.subject_prefix.as_str(), "leases");
        assert_eq!(s.lease_scan_interval, Duration::from_secs(300));
        assert_eq!(s.log_format, LogFormat::Text);
        assert_eq!(s.connect_deadline, Duration::from_secs(30));
        assert_eq!(s.max_event_bytes, 4096);
        assert!(s.deployments.is_empty());
        let host = s.host_settings();
        assert_eq!(host.apply.max_event_bytes, 4096);
        assert_eq!(host.lease_scan_interval, Duration::from_secs(300));
        assert_eq!(s.nats_connect_config().urls, s.nats_urls);
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
            s.nats_urls,
            vec!["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]
        );
        let names: Vec<&str> = s.deployments.iter().map(|d| d.as_str()).collect();
        assert_eq!(names, ["a", "b"], "duplicates are dropped");
        assert_eq!(s.http_addr.to_string(), "0.0.0.0:0");
        assert_eq!(s.subject_prefix.as_str(), "acme.leases");
        assert_eq!(s.lease_scan_interval, Duration::from_secs(300));
        assert_eq!(s.log_format, LogFormat::Json);
        assert_eq!(s.connect_deadline, Duration::from_secs(10));
        assert_eq!(s.max_event_bytes, 8192);
        assert_eq!(s.config_file.as_deref(), Some(f.path()));

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
        assert_eq!(s.nats_urls, vec!["nats://a:1", "nats://b:2"]);
        assert_eq!(s.deployments, vec![DeploymentName::new("c").unwrap()]);
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:8080");
        assert_eq!(s.lease_scan_interval, Duration::from_secs(90));
        assert_eq!(s.log_format, LogFormat::Text);
        // Not given as flags: still from the file.
        assert_eq!(s.subject_prefix.as_str(), "acme.leases");
        assert_eq!(s.max_event_bytes, 8192);
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
        std::env::remove_var("LEASE_ROUTER_HTTP_ADDR");
        std::env::remove_var("LEASE_ROUTER_LEASE_SCAN_INTERVAL");
        let file_only = Cli::try_parse_from(["serve", "--config", &path])
            .unwrap()
            .serve;

        let s = resolve(&file_only).unwrap();
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:1111");
        assert_eq!(s.lease_scan_interval, Duration::from_secs(3600));

        let s = resolve(&env_only.unwrap()).unwrap();
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:2222", "env beats file");
        assert_eq!(s.lease_scan_interval, Duration::from_secs(120));

        let s = resolve(&flag_and_env.unwrap()).unwrap();
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:3333", "flag beats env");
        assert_eq!(s.lease_scan_interval, Duration::from_secs(120));
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
            "invalid setting http_addr = \"abc\": expected HOST:PORT such as 127.0.0.1:9464 \
             (an IP address or localhost; port 0 picks a free port)"
        );
        assert_eq!(
            message(&args(
                |a| a.deployments = Some(vec!["ok".into(), "a.b".into()])
            )),
            "invalid setting deployments = \"a.b\": a deployment name may hold only ASCII \
             letters, digits, '-' and '_' (1 to 128 characters), such as llama-70b_prod"
        );
        assert_eq!(
            message(&args(|a| a.log_format = Some("xml".into()))),
            "invalid setting log_format = \"xml\": expected text or json"
        );
        let m = message(&args(|a| a.lease_scan_interval = Some("0s".into())));
        assert!(
            m.starts_with("invalid setting lease_scan_interval = \"0s\": expected a positive"),
            "{m}"
        );
        let m = message(&args(|a| a.lease_scan_interval = Some("5 minutes".into())));
        assert!(m.contains("= \"5 minutes\"") && m.contains("5m"), "{m}");
        let m = message(&args(|a| a.connect_deadline = Some("soon".into())));
        assert!(
            m.starts_with("invalid setting connect_deadline = \"soon\": expected a duration"),
            "{m}"
        );
        let m = message(&args(|a| a.max_event_bytes = Some("10".into())));
        assert!(
            m.starts_with(
                "invalid setting max_event_bytes = \"10\": expected a whole number of \
                 bytes from 64 to 67108864"
            ),
            "{m}"
        );
        let m = message(&args(|a| a.subject_prefix = Some("a.*".into())));
        assert!(
            m.starts_with("invalid setting subject_prefix = \"a.*\": one or more tokens"),
            "{m}"
        );
        let m = message(&args(|a| {
            a.nats_url = Some("nats://ok:4222,http://u:secret@bad:1".into())
        }));
        assert!(
            m.starts_with("invalid setting nats_url = \"http://***@bad:1\": expected nats://"),
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
                    "the accepted keys are nats_url, deployments, http_addr, subject_prefix, \
                     lease_scan_interval, log_format, connect_deadline, max_event_bytes, \
                     max_active_leases, max_tombstones, max_held_progress, max_publishers, \
                     subscription_capacity, durable, stream_replicas, route_policy, worker_idle, nats_user, nats_password, nats_token, nats_nkey, nats_creds, \
                     nats_tls_ca, nats_tls_cert, nats_tls_key"
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
            s.nats_auth,
            NatsAuth::UserPassword {
                user: "router".into(),
                password: SECRETS[0].into()
            }
        );
        assert_eq!(s.nats_tls, None);
        let config = s.nats_connect_config();
        assert_eq!(config.auth, s.nats_auth);
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
        assert_eq!(s.nats_auth, NatsAuth::NKeySeedFile(seed.path().to_owned()));
        assert_eq!(
            s.nats_tls,
            Some(NatsTls {
                ca_file: Some(ca.path().to_owned()),
                cert_file: Some(cert.path().to_owned()),
                key_file: Some(key.path().to_owned()),
            })
        );
        let config = s.nats_connect_config();
        assert_eq!(config.tls, s.nats_tls);

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
                "invalid setting nats_password = \"<redacted>\": a password needs a user",
            ),
            (
                args(&|a| a.nats_credentials.nats_user = Some("router".into())),
                "invalid setting nats_user = \"router\": a user needs a password",
            ),
            (
                args(&|a| {
                    a.nats_credentials.nats_user = Some("router".into());
                    a.nats_credentials.nats_password = Some(SECRETS[0].into());
                    a.nats_credentials.nats_token = Some(SECRETS[1].into());
                }),
                "invalid setting nats_token = \"<redacted>\": give only one way",
            ),
            (
                args(&|a| a.nats_credentials.nats_token = Some(String::new())),
                "invalid setting nats_token = \"\": expected a non-empty value",
            ),
            (
                args(&|a| a.nats_credentials.nats_creds = Some("/nonexistent/router.creds".into())),
                "invalid setting nats_creds = \"/nonexistent/router.creds\": expected a readable file",
            ),
            (
                args(&|a| a.nats_credentials.nats_tls_cert = Some("/nonexistent/cert.pem".into())),
                "invalid setting nats_tls_cert = \"/nonexistent/cert.pem\": expected a readable",
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
        for id in ["nats_password", "nats_token"] {
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_id().as_str() == id)
                .unwrap();
            assert!(arg.is_hide_env_values_set(), "{id}");
        }
    }

    #[test]
    fn memory_limits() {
        let s = resolve(&ServeArgs::default()).unwrap();
        assert_eq!(s.max_active_leases, DEFAULT_MAX_ACTIVE_LEASES);
        let apply = s.host_settings().apply;
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
        assert_eq!(s.max_active_leases, 5);
        let apply = s.host_settings().apply;
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
                    "invalid setting max_tombstones = {bad:?}: expected a whole number from 1"
                )),
                "{m}"
            );
        }
    }
}

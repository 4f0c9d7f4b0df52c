//! The settings of `lease-router serve` ([`ServeArgs`]), resolved into the library's settings
//! structs ([`resolve`]).
//!
//! Each setting is declared once, as a field of [`ServeArgs`] (or of [`NatsArgs`]): its name
//! is the TOML key, its `long` the flag, its `env` the variable, its doc comment the help, its
//! `value_parser` what it accepts. The file's keys and the `--config` help listing them
//! ([`document_file_keys`]) are read from it, and a test holds README's settings table to it.
//! Where each value comes from and how a bad one is reported: [`crate::layering`]. The default
//! `max_event_bytes` (4096) is well below the server's `max_payload` (1 MB by default), so
//! that the router drops and counts an oversized event.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use lease_router::service::{ApiAuth, BearerToken, HostSettings};
use lease_router::wire::{DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_EVENT_BYTES};
use lease_router::{AdmissionConfig, PrefixIndexConfig, PromptTokenizer, DEFAULT_AFFINITY_GAP};
use lease_router::{ApplyConfig, DeploymentName, LeaseStreamConfig, NatsConnectConfig};
use lease_router::{RoutePolicy, DEFAULT_MAX_ACTIVE_LEASES, DEFAULT_SNAPSHOT_INTERVAL};
use lease_router::{DEFAULT_SNAPSHOT_KEEP, DEFAULT_STREAM_MAX_BYTES};

use crate::layering::{declared, duration, get, secret, setting};
use crate::layering::{ConfigError, Origins, Parsed, Refused, Sourced};
use crate::nats_args::{NatsArgs, DEFAULT_SUBSCRIPTION_CAPACITY};

/// The default HTTP listen address.
pub const DEFAULT_HTTP_ADDR: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9464);

/// The smallest accepted `max_event_bytes`: an `admitted` event with a short request id.
pub const MIN_MAX_EVENT_BYTES: usize = 64;
/// The largest accepted `max_event_bytes`: the NATS server's hard payload limit.
pub const MAX_MAX_EVENT_BYTES: usize = 64 * 1024 * 1024;
/// The largest accepted memory limit: any more is not a limit.
pub const MAX_LIMIT: usize = 100_000_000;
/// The largest accepted `stream_replicas`: JetStream's limit.
const MAX_STREAM_REPLICAS: usize = 5;
/// The smallest accepted `stream_max_bytes`: below it a stream holds a few thousand events.
const MIN_STREAM_MAX_BYTES: i64 = 1 << 20;
/// Any duration but zero.
const POSITIVE: RangeInclusive<Duration> = Duration::from_nanos(1)..=Duration::MAX;

/// What a deployment name may be (the file's lists are held to it too).
pub(crate) const DEPLOYMENT_NAMES: &str = "a deployment name may hold only ASCII letters, \
    digits, '-' and '_' (1 to 128 characters), such as llama-70b_prod";

/// The flags of `lease-router serve` (flatten `Sourced<ServeArgs>` into the subcommand), all
/// optional: [`resolve`] takes the default of what no flag, variable or file gives. `Debug`
/// shows whether a password or token was given, never which.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// TOML file with settings (`document_file_keys` lists its keys here).
    #[arg(long, value_name = "FILE", env = "LEASE_ROUTER_CONFIG")]
    pub config: Option<PathBuf>,
    /// A deployment to host from the start; repeat the flag for several (comma-separated in
    /// the environment). More can be added over HTTP.
    #[arg(long = "deployment", value_name = "NAME", env = "LEASE_ROUTER_DEPLOYMENTS",
          value_delimiter = ',', value_parser = setting(parse_deployment))]
    pub deployments: Option<Vec<Parsed<Option<DeploymentName>>>>,
    /// Address of the HTTP API and /metrics, HOST:PORT (port 0: any free port)
    /// [default: 127.0.0.1:9464].
    #[arg(long, value_name = "HOST:PORT", env = "LEASE_ROUTER_HTTP_ADDR",
          value_parser = setting(parse_http_addr))]
    pub http_addr: Option<Parsed<SocketAddr>>,
    /// Bearer token the HTTP API asks of PUT and DELETE (and, with --http-protect-reads, of
    /// the reads); prefer --http-token-file or the environment: flags show in the process
    /// list [default: none, the API is open].
    #[arg(long, value_name = "TOKEN", env = "LEASE_ROUTER_HTTP_TOKEN", hide_env_values = true,
          value_parser = secret(parse_token))]
    pub http_token: Option<Parsed<BearerToken>>,
    /// File holding the HTTP API's bearer token (whitespace around it is trimmed); instead of
    /// --http-token.
    #[arg(long, value_name = "FILE", env = "LEASE_ROUTER_HTTP_TOKEN_FILE",
          value_parser = setting(|s: &str| Ok::<_, String>(PathBuf::from(s.trim()))))]
    pub http_token_file: Option<Parsed<PathBuf>>,
    /// The reads need the token too: /metrics, the GETs of /v1 and POST .../route (not the
    /// probes /healthz and /readyz, nor the status page's HTML) [default: off;
    /// `--http-protect-reads` alone means true].
    #[arg(long, value_name = "BOOL", env = "LEASE_ROUTER_HTTP_PROTECT_READS", num_args = 0..=1,
          default_missing_value = "true", value_parser = setting(parse_bool))]
    pub http_protect_reads: Option<Parsed<bool>>,
    /// How often leases are scanned; a silent lease expires after one to two intervals.
    /// Seconds, or with a unit: 300s, 5m, 1h [default: 300s].
    #[arg(long, value_name = "DURATION", env = "LEASE_ROUTER_LEASE_SCAN_INTERVAL",
          value_parser = setting(duration(POSITIVE, 300, "5m, 1m30s")))]
    pub lease_scan_interval: Option<Parsed<Duration>>,
    /// Log line format: text or json [default: text].
    #[arg(long, value_name = "FORMAT", env = "LEASE_ROUTER_LOG_FORMAT",
          value_parser = setting(parse_log_format))]
    pub log_format: Option<Parsed<LogFormat>>,
    /// How long to keep trying to reach NATS at startup [default: 30s].
    #[arg(long, value_name = "DURATION", env = "LEASE_ROUTER_CONNECT_DEADLINE",
          value_parser = setting(duration(Duration::ZERO..=Duration::MAX, 30, "2m")))]
    pub connect_deadline: Option<Parsed<Duration>>,
    /// Events larger than this many bytes are dropped as oversized [default: 4096].
    #[arg(long, value_name = "BYTES", env = "LEASE_ROUTER_MAX_EVENT_BYTES",
          value_parser = setting(whole(MIN_MAX_EVENT_BYTES..=MAX_MAX_EVENT_BYTES, false, format!(
              "expected a whole number of bytes from {MIN_MAX_EVENT_BYTES} to \
               {MAX_MAX_EVENT_BYTES} (default {DEFAULT_MAX_EVENT_BYTES}); keep it below the \
               NATS server's max_payload"))))]
    pub max_event_bytes: Option<Parsed<usize>>,
    /// Batch messages (several events in one, wire 1.2) larger than this many bytes are
    /// dropped as oversized; each event inside is held to --max-event-bytes [default: 1048576].
    #[arg(long, value_name = "BYTES", env = "LEASE_ROUTER_MAX_BATCH_BYTES",
          value_parser = setting(whole(MIN_MAX_EVENT_BYTES..=MAX_MAX_EVENT_BYTES, false, format!(
              "expected a whole number of bytes from {MIN_MAX_EVENT_BYTES} to \
               {MAX_MAX_EVENT_BYTES} (default {DEFAULT_MAX_BATCH_BYTES}); keep it at or below \
               the NATS server's max_payload"))))]
    pub max_batch_bytes: Option<Parsed<usize>>,
    /// Live leases per deployment; past it new admissions are refused and counted
    /// [default: 1000000].
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_MAX_ACTIVE_LEASES",
          value_parser = setting(limit(DEFAULT_MAX_ACTIVE_LEASES)))]
    pub max_active_leases: Option<Parsed<usize>>,
    /// Completions kept for late admissions, per deployment; the oldest is evicted and
    /// counted past it [default: 100000].
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_MAX_TOMBSTONES",
          value_parser = setting(limit(ApplyConfig::default().max_tombstones)))]
    pub max_tombstones: Option<Parsed<usize>>,
    /// Progress events held for their admission, per deployment; the oldest is evicted and
    /// counted past it [default: 100000].
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_MAX_HELD_PROGRESS",
          value_parser = setting(limit(ApplyConfig::default().max_held_progress)))]
    pub max_held_progress: Option<Parsed<usize>>,
    /// Publishers whose sequence windows are tracked, per deployment; the least recent is
    /// forgotten past it [default: 10000].
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_MAX_PUBLISHERS",
          value_parser = setting(limit(ApplyConfig::default().max_publishers)))]
    pub max_publishers: Option<Parsed<usize>>,
    /// Messages a deployment's subscription buffers before the client drops them and counts a
    /// slow-consumer event; bursts beyond what the ingress applies at once wait here
    /// [default: 262144].
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_SUBSCRIPTION_CAPACITY",
          value_parser = setting(limit(DEFAULT_SUBSCRIPTION_CAPACITY)))]
    pub subscription_capacity: Option<Parsed<usize>>,
    /// Durable mode: each deployment replays the JetStream lease stream (created or updated
    /// by the router) before following live events; `/readyz` is 503 until then
    /// [default: off; `--durable` alone means true].
    #[arg(long, value_name = "BOOL", env = "LEASE_ROUTER_DURABLE", num_args = 0..=1,
          default_missing_value = "true", value_parser = setting(parse_bool))]
    pub durable: Option<Parsed<bool>>,
    /// Copies of the lease stream kept by a NATS cluster in durable mode (1 to 5; 3 on a
    /// three-node cluster) [default: 1].
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_STREAM_REPLICAS",
          value_parser = setting(whole(1..=MAX_STREAM_REPLICAS, false, format!(
              "expected a whole number from 1 to {MAX_STREAM_REPLICAS} (JetStream's limit), at \
               most the number of NATS servers in the cluster"))))]
    pub stream_replicas: Option<Parsed<usize>>,
    /// Bytes each deployment's lease stream keeps in durable mode; past it the oldest events
    /// are discarded (and a replica that needed them says so). Size it with README's
    /// arithmetic: events/s x ~170 bytes x the stream's age limit [default: 1073741824].
    #[arg(long, value_name = "BYTES", env = "LEASE_ROUTER_STREAM_MAX_BYTES",
          value_parser = setting(whole(MIN_STREAM_MAX_BYTES..=i64::MAX, true, format!(
              "expected a whole number of bytes, at least {MIN_STREAM_MAX_BYTES} (default \
               {DEFAULT_STREAM_MAX_BYTES}): events/s x ~170 bytes x the stream's age limit"))))]
    pub stream_max_bytes: Option<Parsed<i64>>,
    /// How often one replica per deployment (the holder of the writer entry) snapshots the
    /// deployment's state to JetStream in durable mode; a late replica loads the newest and
    /// replays only what follows. Seconds, or with a unit: 60s, 1m [default: 60s].
    #[arg(long, value_name = "DURATION", env = "LEASE_ROUTER_SNAPSHOT_INTERVAL",
          value_parser = setting(duration(Duration::from_secs(1)..=Duration::MAX, 60, "5m")))]
    pub snapshot_interval: Option<Parsed<Duration>>,
    /// Snapshot intervals each deployment's stream keeps in durable mode (its age limit is
    /// this many intervals, at least 60 s) [default: 4].
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_SNAPSHOT_KEEP",
          value_parser = setting(whole(2..=1000u32, false, format!("expected a whole number from 2 \
              to 1000 (default {DEFAULT_SNAPSHOT_KEEP}): snapshot intervals the stream keeps"))))]
    pub snapshot_keep: Option<Parsed<u32>>,
    /// How new deployments choose a worker for `POST .../route`: weighted_cost,
    /// power_of_two, round_robin or random (a PUT body may set one per deployment)
    /// [default: weighted_cost].
    #[arg(long, value_name = "POLICY", env = "LEASE_ROUTER_ROUTE_POLICY",
          value_parser = setting(|s: &str| s.trim().parse::<RoutePolicy>().map_err(|_| "expected \
              weighted_cost, power_of_two, round_robin, random or least_bookings".to_owned())))]
    pub route_policy: Option<Parsed<RoutePolicy>>,
    /// A worker with no live lease that says nothing this long is forgotten. Seconds, or with
    /// a unit: 600s, 10m [default: twice the lease scan interval].
    #[arg(long, value_name = "DURATION", env = "LEASE_ROUTER_WORKER_IDLE",
          value_parser = setting(duration(POSITIVE, 600, "10m")))]
    pub worker_idle: Option<Parsed<Duration>>,
    /// A route decision's provisional booking whose worker's admitted has not come this long
    /// after the decision is released and counted (provisional_expired_total). Seconds, or
    /// with a unit: 5s, 1500ms [default: 5s].
    #[arg(long, value_name = "DURATION", env = "LEASE_ROUTER_PROVISIONAL_DEADLINE",
          value_parser = setting(duration(Duration::from_millis(10)..=Duration::from_secs(3600),
              5, "1500ms")))]
    pub provisional_deadline: Option<Parsed<Duration>>,
    /// Tokens per prefix block: the engines' KV block size, which route requests'
    /// token_ids are cut by and workers' block hashes (blk) are made with [default: 16].
    #[arg(long, value_name = "TOKENS", env = "LEASE_ROUTER_BLOCK_SIZE",
          value_parser = setting(whole(1..=65_536u32, false, "expected a whole number of \
              tokens from 1 to 65536 (default 16): the engines' KV block size".to_owned())))]
    pub block_size: Option<Parsed<u32>>,
    /// Blocks the prefix index takes a worker rank to hold at most, least recent first out,
    /// unless the worker announces its own (bcap) [default: 32768].
    #[arg(long, value_name = "BLOCKS", env = "LEASE_ROUTER_PREFIX_WORKER_CAPACITY",
          value_parser = setting(whole(1..=u32::MAX, true, format!("expected a whole number \
              of blocks, at least 1 (default {})", PrefixIndexConfig::DEFAULT_WORKER_CAPACITY))))]
    pub prefix_worker_capacity: Option<Parsed<u32>>,
    /// Entries (a block held by a worker rank, about 45 bytes each) of each deployment's
    /// prefix index; past it the rank holding the most gives up its least recent
    /// [default: 4000000].
    #[arg(long, value_name = "N", env = "LEASE_ROUTER_PREFIX_MAX_ENTRIES",
          value_parser = setting(whole(1..=u32::MAX - 1, true, format!("expected a whole \
              number of entries from 1 to {} (default {})", u32::MAX - 1,
              PrefixIndexConfig::DEFAULT_MAX_ENTRIES))))]
    pub prefix_max_entries: Option<Parsed<u32>>,
    /// The hot-worker guard: a worker's cached prefix counts in a decision only while its
    /// prefill tokens waiting are at most this many above the least waiting member's
    /// [default: 8192].
    #[arg(long, value_name = "TOKENS", env = "LEASE_ROUTER_AFFINITY_GAP",
          value_parser = setting(whole(0..=u32::MAX, true, format!("expected a whole number \
              of tokens (default {DEFAULT_AFFINITY_GAP})"))))]
    pub affinity_gap: Option<Parsed<u32>>,
    /// Admission of new deployments, as JSON (a PUT body may change it per deployment):
    /// {"classes": [{"name", "band", "weight"}], "default_class", "saturation", "queue"}
    /// [default: no classes, no admission].
    #[arg(long, value_name = "JSON", env = "LEASE_ROUTER_ADMISSION",
          value_parser = setting(parse_admission))]
    pub admission: Option<Parsed<AdmissionConfig>>,
    /// A Hugging Face tokenizer.json (the model's own): route requests may then carry the
    /// prompt as text ("prompt"), exactly as the engine will tokenize it (after any chat
    /// template) [default: none; such requests are refused].
    #[arg(long, value_name = "FILE", env = "LEASE_ROUTER_TOKENIZER",
          value_parser = setting(|s: &str| Ok::<_, String>(PathBuf::from(s.trim()))))]
    pub tokenizer: Option<Parsed<PathBuf>>,
    /// The NATS servers, subject prefix, authentication and TLS, as for every subcommand.
    #[command(flatten)]
    pub nats: NatsArgs,
}

/// How log lines are written: for people, or one JSON object per line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The keys a config file may hold, in the order of the declaration.
pub fn file_keys() -> Vec<String> {
    let settings = declared::<ServeArgs>().into_iter();
    settings.map(|arg| arg.get_id().to_string()).collect()
}

/// Adds the accepted file keys to the help of `--config` of the `serve` command: generated
/// from the declaration, so the list cannot drift from what the file accepts.
pub fn document_file_keys(serve: clap::Command) -> clap::Command {
    let keys = file_keys().join(", ");
    let help = format!("TOML file with settings; its keys: {keys}");
    serve.mut_arg("config", |arg| arg.help(help.clone()).long_help(help))
}

/// The resolved settings of `lease-router serve`: the library's settings structs and the binary's.
#[derive(Clone, Debug)]
pub struct ServeSettings {
    /// How to connect to NATS (its `Debug` redacts secrets).
    pub nats: NatsConnectConfig,
    /// What each deployment's router runs with.
    pub host: HostSettings,
    /// Deployments hosted from the start, without duplicates, in the order given.
    pub deployments: Vec<DeploymentName>,
    pub http_addr: SocketAddr,
    /// The HTTP API's token (`Debug` redacts it) and what it guards; `None`: the API is open.
    pub http_auth: Option<ApiAuth>,
    pub log_format: LogFormat,
}

/// Resolves what flags, environment and file gave into the library's settings (the defaults
/// for the rest) and checks the settings that go together; else the [`ConfigError`] naming
/// the first invalid setting.
pub fn resolve(given: &Sourced<ServeArgs>) -> Result<ServeSettings, ConfigError> {
    let o = &given.origins;
    // Every field, so that a setting declared but not resolved does not compile.
    let ServeArgs {
        config: _,
        deployments,
        http_addr,
        http_token,
        http_token_file,
        http_protect_reads,
        lease_scan_interval,
        log_format,
        connect_deadline,
        max_event_bytes,
        max_batch_bytes,
        max_active_leases,
        max_tombstones,
        max_held_progress,
        max_publishers,
        subscription_capacity,
        durable,
        stream_replicas,
        stream_max_bytes,
        snapshot_interval,
        snapshot_keep,
        route_policy,
        worker_idle,
        provisional_deadline,
        block_size,
        prefix_worker_capacity,
        prefix_max_entries,
        affinity_gap,
        admission,
        tokenizer,
        nats,
    } = &given.args;
    let (nats, subject_prefix) = nats.resolve(o)?;
    let mut names = Vec::new();
    for name in deployments.iter().flatten() {
        match o.get("deployments", &Some(name.clone()))? {
            Some(Some(name)) if !names.contains(&name) => names.push(name),
            _ => {}
        }
    }
    let http_addr = get!(o, http_addr).unwrap_or(DEFAULT_HTTP_ADDR);

    // The API's token, inline or from a file (not both), and whether it guards the reads.
    let protect_reads = get!(o, http_protect_reads);
    let token = match (http_token, get!(o, http_token_file)) {
        (Some(_), Some(path)) => {
            let give_once = "give the token once: http_token or http_token_file, not both";
            return Err(o.invalid("http_token_file", path.display(), give_once));
        }
        (_, None) => get!(o, http_token),
        (None, Some(path)) => Some(read_token(o, &path)?),
    };
    let http_auth = match (token, protect_reads) {
        (Some(token), protect) => Some(ApiAuth::new(token).protect_reads(protect == Some(true))),
        (None, Some(true)) => {
            let needs = "protecting the reads needs a token: give http_token or http_token_file";
            return Err(o.invalid("http_protect_reads", "true", needs));
        }
        (None, _) => None,
    };

    let mut h = HostSettings {
        subject_prefix,
        ..HostSettings::default()
    };
    h.route_policy = get!(o, route_policy).unwrap_or(h.route_policy);
    h.worker_idle = get!(o, worker_idle).or(h.worker_idle);
    h.provisional_deadline = get!(o, provisional_deadline).unwrap_or(h.provisional_deadline);
    let p = h.prefix;
    let p = p.with_block_size(get!(o, block_size).unwrap_or(p.block_size()));
    let p = p.with_worker_capacity(get!(o, prefix_worker_capacity).unwrap_or(p.worker_capacity()));
    h.prefix = p.with_max_entries(get!(o, prefix_max_entries).unwrap_or(p.max_entries()));
    h.affinity_gap = get!(o, affinity_gap).unwrap_or(h.affinity_gap);
    h.admission = get!(o, admission).unwrap_or(h.admission);
    if let Some(path) = get!(o, tokenizer) {
        let loaded = PromptTokenizer::from_file(&path)
            .map_err(|err| o.invalid("tokenizer", path.display(), &err.reason))?;
        h.tokenizer = Some(std::sync::Arc::new(loaded));
    }
    h.lease_scan_interval = get!(o, lease_scan_interval).unwrap_or(h.lease_scan_interval);
    h.apply.max_event_bytes = get!(o, max_event_bytes).unwrap_or(h.apply.max_event_bytes);
    h.apply.max_batch_bytes = get!(o, max_batch_bytes).unwrap_or(h.apply.max_batch_bytes);
    h.max_active_leases = get!(o, max_active_leases).unwrap_or(h.max_active_leases);
    h.apply.max_tombstones = get!(o, max_tombstones).unwrap_or(h.apply.max_tombstones);
    h.apply.max_held_progress = get!(o, max_held_progress).unwrap_or(h.apply.max_held_progress);
    h.apply.max_publishers = get!(o, max_publishers).unwrap_or(h.apply.max_publishers);
    let interval = get!(o, snapshot_interval).unwrap_or(DEFAULT_SNAPSHOT_INTERVAL);
    let keep = get!(o, snapshot_keep).unwrap_or(DEFAULT_SNAPSHOT_KEEP);
    let stream = LeaseStreamConfig::new().with_snapshots(interval, keep);
    let stream = stream.with_replicas(get!(o, stream_replicas).unwrap_or(1));
    let max_bytes = get!(o, stream_max_bytes).unwrap_or(DEFAULT_STREAM_MAX_BYTES);
    let stream = stream.with_max_bytes(max_bytes);
    h.durable = get!(o, durable).unwrap_or(false).then_some(stream);

    let capacity = get!(o, subscription_capacity).unwrap_or(DEFAULT_SUBSCRIPTION_CAPACITY);
    let nats = nats.with_name("lease-router serve");
    let nats = nats.with_subscription_capacity(capacity);
    let deadline = get!(o, connect_deadline).unwrap_or(nats.connect_deadline());
    Ok(ServeSettings {
        nats: nats.with_connect_deadline(deadline),
        host: h,
        deployments: names,
        http_addr,
        http_auth,
        log_format: get!(o, log_format).unwrap_or_default(),
    })
}

/// Why an empty token is refused.
const OPEN: &str = "an empty token would leave the API open";

/// The token in the file at `path`, else the error naming the file and what is wrong with it.
fn read_token(o: &Origins, path: &Path) -> Result<BearerToken, ConfigError> {
    let why = match std::fs::read_to_string(path).map_err(|err| err.kind()) {
        Err(kind) => format!("expected a readable file holding the token ({kind})"),
        Ok(text) => match BearerToken::new(&text) {
            Ok(token) => return Ok(token),
            Err(err) => format!("the file holds no usable token: {err}; {OPEN}"),
        },
    };
    Err(o.invalid("http_token_file", path.display(), &why))
}

fn parse_token(value: &str) -> Result<BearerToken, String> {
    BearerToken::new(value).map_err(|err| format!("{err}; {OPEN}"))
}

/// The admission of new deployments: the JSON of a PUT body's admission keys, checked.
fn parse_admission(value: &str) -> Result<AdmissionConfig, String> {
    let config: AdmissionConfig = serde_json::from_str(value).map_err(|err| {
        format!(
            "expected JSON such as {{\"classes\": [{{\"name\": \"premium\", \"band\": 1, \
             \"weight\": 4}}], \"default_class\": \"premium\"}} ({err})"
        )
    })?;
    config.validate().map_err(|err| err.to_string())?;
    Ok(config)
}

fn parse_bool(value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Ok(true),
        "false" | "no" | "off" | "0" => Ok(false),
        _ => Err("expected true or false".to_owned()),
    }
}

fn parse_log_format(value: &str) -> Result<LogFormat, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        _ => Err("expected text or json".to_owned()),
    }
}

/// A whole number in `range` (with `_` between digits if `underscores`), else `expected`.
fn whole<T: FromStr + PartialOrd + Clone + Send + Sync + 'static>(
    range: RangeInclusive<T>,
    underscores: bool,
    expected: String,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |value| {
        let digits = value.trim().chars().filter(|&c| !underscores || c != '_');
        let digits: String = digits.collect();
        let n = digits.parse::<T>().ok().filter(|n| range.contains(n));
        n.ok_or_else(|| expected.clone())
    }
}

/// A memory limit: a whole number from 1 to [`MAX_LIMIT`].
fn limit(default: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    let past = "past it new entries are refused or the oldest evicted, and counted";
    let expected =
        format!("expected a whole number from 1 to {MAX_LIMIT} (default {default}); {past}");
    whole(1..=MAX_LIMIT, true, expected)
}

/// One deployment name, or nothing for an empty item (`LEASE_ROUTER_DEPLOYMENTS=`, `a,`).
fn parse_deployment(value: &str) -> Result<Option<DeploymentName>, Refused> {
    match value.trim() {
        "" => Ok(None),
        name => DeploymentName::new(name).map(Some).map_err(|_| Refused {
            value: Some(name.to_owned()),
            expected: DEPLOYMENT_NAMES.to_owned(),
        }),
    }
}

fn parse_http_addr(value: &str) -> Result<SocketAddr, String> {
    let addr = value.trim();
    let port = addr.strip_prefix("localhost:").and_then(|p| p.parse().ok());
    let localhost = port.map(|port| SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port));
    let expected = "expected HOST:PORT such as 127.0.0.1:9464 (an IP address or localhost; \
                    port 0 picks a free port)";
    addr.parse()
        .ok()
        .or(localhost)
        .ok_or_else(|| expected.to_owned())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::ffi::OsString;
    use std::io::Write;

    use clap::{Args, CommandFactory, FromArgMatches};

    use super::*;
    use crate::layering::parse_layered;
    pub(crate) use crate::Cli;

    pub(crate) fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    pub(crate) fn path(f: &tempfile::NamedTempFile) -> &str {
        f.path().to_str().unwrap()
    }

    /// `serve ARGV` as `command` parses it, with the file `--config` names beneath.
    fn args_of(command: clap::Command, argv: &[&str]) -> Result<Sourced<ServeArgs>, ConfigError> {
        let argv = [&["lease-router", "serve"], argv].concat();
        let argv: Vec<OsString> = argv.into_iter().map(OsString::from).collect();
        let matches = parse_layered(command, &argv, DEPLOYMENT_NAMES)?;
        Ok(Sourced::from_arg_matches(matches.subcommand().unwrap().1).unwrap())
    }

    /// `serve ARGV` without the environment: only `flags_beat_environment_beat_file` reads it.
    pub(crate) fn args(argv: &[&str]) -> Result<Sourced<ServeArgs>, ConfigError> {
        let no_env = |serve: clap::Command| serve.mut_args(|arg| arg.env(None::<&str>));
        args_of(Cli::command().mut_subcommand("serve", no_env), argv)
    }

    /// The settings of `serve LINE`, its arguments split at whitespace.
    pub(crate) fn settings(line: &str) -> Result<ServeSettings, ConfigError> {
        resolve(&args(&line.split_whitespace().collect::<Vec<_>>())?)
    }

    /// The settings of `serve --config FILE LINE`, FILE holding `toml`.
    pub(crate) fn with_file(toml: &str, line: &str) -> Result<ServeSettings, ConfigError> {
        let f = file(toml);
        settings(&format!("--config {} {line}", path(&f)))
    }

    pub(crate) fn message(line: &str) -> String {
        settings(line).unwrap_err().to_string()
    }

    /// The message `serve --config FILE` is refused with, FILE holding `toml` (and its path
    /// shown as FILE).
    pub(crate) fn file_message(toml: &str) -> String {
        let f = file(toml);
        message(&format!("--config {}", path(&f))).replace(path(&f), "FILE")
    }

    /// Each `serve ARGV` is refused with a message that starts with its `start`, and no secret
    /// shows in the message, the error's `Debug` or the arguments' `Debug`.
    pub(crate) fn refused<S: AsRef<str>>(cases: &[(&[&str], S)]) {
        for (argv, start) in cases {
            let (given, start) = (args(argv).unwrap(), start.as_ref());
            let err = resolve(&given).unwrap_err();
            assert!(err.to_string().starts_with(start), "{err}\nwanted: {start}");
            assert_no_secret(&format!("{err} {err:?} {given:?}"));
        }
    }

    pub(crate) const SECRETS: [&str; 2] = ["hunter2-pass", "tok-3f9a-secret"];

    pub(crate) fn assert_no_secret(text: &str) {
        for secret in SECRETS {
            assert!(!text.contains(secret), "a secret leaked: {text}");
        }
    }

    fn names(s: &ServeSettings) -> Vec<&str> {
        s.deployments.iter().map(|d| d.as_str()).collect()
    }

    #[test]
    fn durable_mode_settings() {
        let toml = "durable = true\nstream_replicas = 3\nsnapshot_interval = \"2m\"\n";
        let stream = with_file(toml, "").unwrap().host.durable;
        let stream = stream.expect("durable from the file");
        assert_eq!(stream.replicas(), 3);
        let four = Duration::from_secs(480);
        assert_eq!(stream.max_age(), four, "four snapshot intervals by default");
        let off = with_file(toml, "--durable false").unwrap().host;
        assert!(off.durable.is_none(), "the flag wins over the file");
        assert!(settings("").unwrap().host.durable.is_none());
        let durable = settings("--durable true").unwrap().host.durable;
        assert_eq!(durable.unwrap().max_bytes(), 1 << 30, "1 GiB by default");
        refused(&[
            (&["--durable", "maybe"], "invalid setting durable = \"maybe\" from --durable: expected true or false"),
            (&["--stream-replicas", "9"], "invalid setting stream_replicas = \"9\" from --stream-replicas: expected a whole number from 1 to 5"),
            (&["--stream-max-bytes", "1000"], "invalid setting stream_max_bytes = \"1000\" from --stream-max-bytes: expected a whole number of bytes, at least 1048576"),
        ]);
    }

    #[test]
    fn defaults() {
        let s = settings("").unwrap();
        let (h, a) = (&s.host, &s.host.apply);
        assert_eq!(s.nats.urls(), ["nats://127.0.0.1:4222"]);
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:9464");
        assert_eq!(h.subject_prefix.as_str(), "leases");
        assert_eq!(h.lease_scan_interval, Duration::from_secs(300));
        assert_eq!(s.log_format, LogFormat::Text);
        assert_eq!(s.nats.connect_deadline(), Duration::from_secs(30));
        let ping = Some(lease_router::DEFAULT_PING_INTERVAL);
        assert_eq!(s.nats.ping_interval(), ping);
        assert!(s.deployments.is_empty());
        assert_eq!((a.max_event_bytes, a.max_batch_bytes), (4096, 1 << 20));
        let capacity = Some(DEFAULT_SUBSCRIPTION_CAPACITY);
        assert_eq!(s.nats.subscription_capacity(), capacity);
        assert_eq!(h.max_active_leases, DEFAULT_MAX_ACTIVE_LEASES);
        assert_eq!(a.max_tombstones, ApplyConfig::default().max_tombstones);
        assert_eq!(h.route_policy, RoutePolicy::WeightedCost);
        assert_eq!(h.worker_idle, None);
        assert!(s.http_auth.is_none(), "no token: the API is open");
    }

    /// The one test that reads the process environment, and only variables that nothing
    /// but this module reads.
    #[test]
    fn flags_beat_environment_beat_file() {
        let f = file("http_addr = \"127.0.0.1:1111\"\nlease_scan_interval = \"1h\"\n");
        // clap reads a variable when the command is built.
        let with_env = |argv: &[&str]| args_of(Cli::command(), argv).unwrap();
        std::env::set_var("LEASE_ROUTER_HTTP_ADDR", "127.0.0.1:2222");
        std::env::set_var("LEASE_ROUTER_LEASE_SCAN_INTERVAL", "2m");
        let env_only = with_env(&["--config", path(&f)]);
        let flag_and_env = with_env(&["--config", path(&f), "--http-addr", "127.0.0.1:3333"]);
        // A bad value from the environment is named as such.
        std::env::set_var("LEASE_ROUTER_LOG_FORMAT", "yaml");
        let bad_env = with_env(&[]);
        for name in ["LOG_FORMAT", "HTTP_ADDR", "LEASE_SCAN_INTERVAL"] {
            std::env::remove_var(format!("LEASE_ROUTER_{name}"));
        }
        let want = "invalid setting log_format = \"yaml\" from environment variable \
                    LEASE_ROUTER_LOG_FORMAT: expected text or json";
        assert_eq!(resolve(&bad_env).unwrap_err().to_string(), want);
        let file_only = with_env(&["--config", path(&f)]);
        let cases = [
            (file_only, 1111, 3600, "from the file"),
            (env_only, 2222, 120, "env beats file"),
            (flag_and_env, 3333, 120, "flag beats env"),
        ];
        for (given, port, secs, why) in cases {
            let s = resolve(&given).unwrap();
            let got = (s.http_addr.to_string(), s.host.lease_scan_interval);
            let want = (format!("127.0.0.1:{port}"), Duration::from_secs(secs));
            assert_eq!(got, want, "{why}");
        }
    }

    /// Admission of new deployments from a flag or the file, as JSON; a bad one is refused
    /// at start, naming why.
    #[test]
    fn admission_from_a_flag_or_the_file() {
        let json = r#"{"classes": [{"name": "premium", "band": 1, "weight": 4}, {"name": "regular", "band": 0, "weight": 1}], "default_class": "regular", "queue": {"max_queued": 7}}"#;
        let s = resolve(&args(&["--admission", json]).unwrap()).unwrap();
        let a = &s.host.admission;
        assert_eq!(a.classes().len(), 2);
        assert_eq!(
            (a.default_class(), a.queue().max_queued()),
            (Some("regular"), 7)
        );
        let s = with_file(&format!("admission = '{json}'"), "").unwrap();
        assert_eq!(s.host.admission.classes()[0].name(), "premium");
        assert!(
            !settings("").unwrap().host.admission.is_enabled(),
            "none by default"
        );
        for (json, why) in [
            (r#"{"classes": 3}"#, "expected JSON such as"),
            (r#"{"clases": []}"#, "unknown field `clases`"),
            (
                r#"{"classes": [{"name": "a", "band": 0, "weight": 0}], "default_class": "a"}"#,
                "weight must be a finite number above 0",
            ),
            (
                r#"{"classes": [{"name": "a", "band": 0, "weight": 1}]}"#,
                "default_class is required",
            ),
        ] {
            let err = resolve(&args(&["--admission", json]).unwrap())
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with("invalid setting admission = ") && err.contains("from --admission"),
                "{err}"
            );
            assert!(err.contains(why), "{err}\nwanted: {why}");
        }
    }

    #[test]
    fn error_messages_name_setting_value_and_fix() {
        for (line, want) in [
            ("--http-addr abc", "invalid setting http_addr = \"abc\" from --http-addr: expected HOST:PORT such as 127.0.0.1:9464 (an IP address or localhost; port 0 picks a free port)"),
            ("--deployment ok --deployment a.b", "invalid setting deployments = \"a.b\" from --deployment: a deployment name may hold only ASCII letters, digits, '-' and '_' (1 to 128 characters), such as llama-70b_prod"),
            ("--log-format xml", "invalid setting log_format = \"xml\" from --log-format: expected text or json"),
        ] {
            assert_eq!(message(line), want);
        }
        refused(&[
            (&["--lease-scan-interval", "0s"], "invalid setting lease_scan_interval = \"0s\" from --lease-scan-interval: expected a positive"),
            (&["--lease-scan-interval", "5 minutes"], "invalid setting lease_scan_interval = \"5 minutes\" from --lease-scan-interval: expected a positive duration: seconds (300) or a number with a unit ms, s, m or h (300s, 5m"),
            (&["--connect-deadline", "soon"], "invalid setting connect_deadline = \"soon\" from --connect-deadline: expected a duration"),
            (&["--snapshot-interval", "500ms"], "invalid setting snapshot_interval = \"500ms\" from --snapshot-interval: expected a duration of at least 1s: seconds (60)"),
            (&["--provisional-deadline", "2h"], "invalid setting provisional_deadline = \"2h\" from --provisional-deadline: expected a duration from 10ms to 1h: seconds (5)"),
            (&["--max-event-bytes", "10"], "invalid setting max_event_bytes = \"10\" from --max-event-bytes: expected a whole number of bytes from 64 to 67108864"),
            (&["--subject-prefix", "a.*"], "invalid setting subject_prefix = \"a.*\" from --subject-prefix: one or more tokens"),
            // The bad URL is named, its password is not.
            (&["--nats-url", "nats://ok:4222,http://u:secret@bad:1"], "invalid setting nats_url = \"http://***@bad:1\" from --nats-url: expected nats://"),
            (&["--nats-url", " , "], "invalid setting nats_url = \" , \""),
            (&["--route-policy", "fastest"], "invalid setting route_policy = \"fastest\" from --route-policy: expected weighted_cost"),
            (&["--worker-idle", "0s"], "invalid setting worker_idle = \"0s\" from --worker-idle: expected a positive duration"),
        ]);
    }

    #[test]
    fn file_errors() {
        let f = file("http_addr = \"127.0.0.1:1\"\nlisten = \"x\"\n");
        let err = settings(&format!("--config {}", path(&f))).unwrap_err();
        assert!(matches!(&err, ConfigError::UnknownKey { key, .. } if key == "listen"));
        // Every declared key, in order (README's settings table is held to the same list).
        let known = format!("the accepted keys are {}", file_keys().join(", "));
        let want = format!(
            "unknown setting \"listen\" in config file {}: {known}",
            path(&f)
        );
        assert_eq!(err.to_string(), want);
        for (toml, want) in [
            ("http_addr = \"nope\"\n", "invalid setting http_addr = \"nope\" in config file FILE: expected HOST:PORT such as 127.0.0.1:9464 (an IP address or localhost; port 0 picks a free port)"),
            ("max_event_bytes = true\n", "invalid setting max_event_bytes = \"true\" in config file FILE: expected a string or a number, not boolean"),
            // A list in the file is a list of names: clap's comma split does not reach into one.
            ("deployments = [\"a\", \"b,c\"]\n", "invalid setting deployments = \"b,c\" in config file FILE: a deployment name may hold only ASCII letters, digits, '-' and '_' (1 to 128 characters), such as llama-70b_prod"),
            // A secret of the wrong type: not echoed.
            ("http_token = 987654321\n", "invalid setting http_token = \"<redacted>\" in config file FILE: expected a string, not integer"),
            ("nats_password = 987654321\n", "invalid setting nats_password = \"<redacted>\" in config file FILE: expected a string, not integer"),
        ] {
            assert_eq!(file_message(toml), want);
        }
        let m = file_message("http_addr = \n");
        let (toml, line) = (m.contains("is not valid TOML"), m.contains("line 1"));
        assert!(toml && line, "{m}");
        let m = message("--config /nonexistent/lease-router.toml");
        let start = "cannot read config file /nonexistent/lease-router.toml: ";
        assert!(m.starts_with(start), "{m}");
    }

    /// Fails when README documents other settings (keys, flags or variables) than `serve`
    /// accepts, or in another order.
    #[test]
    fn readme_documents_exactly_the_declared_settings() {
        // README's settings table, row by row: the code in each of its first three cells
        // (flag, variable, file key), without what follows a space.
        let code = |cell: &'static str| {
            let inner = cell.split('`').nth(1).unwrap_or_default();
            inner.split_whitespace().next().unwrap_or_default()
        };
        let readme: Vec<Vec<&str>> = include_str!("../../README.md")
            .lines()
            .skip_while(|line| !line.starts_with("| flag | environment | TOML key | default |"))
            .skip(2)
            .take_while(|line| line.starts_with('|'))
            .map(|row| row.split('|').skip(1).take(3).map(code).collect())
            .collect();
        let declared = declared::<ServeArgs>().into_iter().map(|arg| {
            let (long, env) = (arg.get_long().unwrap(), arg.get_env().unwrap());
            let env = env.to_str().unwrap().to_owned();
            vec![format!("--{long}"), env, arg.get_id().to_string()]
        });
        let declared: Vec<Vec<String>> = declared.collect();
        assert_eq!(declared.len(), 40);
        assert_eq!(
            readme, declared,
            "README's settings table (flag, environment, TOML key) must list exactly the \
             settings declared in ServeArgs, in their order"
        );
    }

    /// The `--config` help is generated from the declaration: every key, in order. The
    /// secrets' values in the environment are hidden from the help.
    #[test]
    fn help_lists_every_file_key_and_hides_secret_values() {
        let serve = document_file_keys(ServeArgs::augment_args(clap::Command::new("serve")));
        let arg = |id: &str| serve.get_arguments().find(|a| a.get_id() == id).unwrap();
        let help = arg("config").get_help().unwrap().to_string();
        let keys = file_keys().join(", ");
        assert_eq!(help, format!("TOML file with settings; its keys: {keys}"));
        let some = "subscription_capacity durable stream_replicas nats_tls_key";
        assert!(some.split(' ').all(|key| help.contains(key)), "{help}");
        for id in ["nats_password", "nats_token", "http_token"] {
            assert!(arg(id).is_hide_env_values_set(), "{id}");
        }
    }

    /// A file may hold every declared setting, and each one lands where it belongs (that
    /// `resolve` reads every declared setting, its exhaustive destructuring makes sure); flags
    /// (or the environment: clap puts both in the same field) beat the file.
    /// A tokenizer.json of three words (a WordLevel model split on whitespace).
    pub(crate) const TOKENIZER: &str = r#"{"version": "1.0", "truncation": null,
        "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2},
        "unk_token": "[UNK]"}}"#;

    /// A tokenizer file is loaded when the settings are resolved: a good one tokenizes, a bad
    /// one (or none there) is refused naming the file and the loader's reason.
    #[test]
    fn a_tokenizer_file_loads_or_is_refused_at_start() {
        let good = file(TOKENIZER);
        let s = settings(&format!("--tokenizer {}", path(&good))).unwrap();
        let tokenizer = s.host.tokenizer.expect("loaded");
        assert_eq!(tokenizer.token_ids("hello world nope").unwrap(), [0, 1, 2]);
        let bad = file("{\"model\": 5}");
        let err = settings(&format!("--tokenizer {}", path(&bad)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid setting tokenizer") && err.contains(path(&bad)),
            "{err}"
        );
        let err = settings("--tokenizer /nonexistent/tokenizer.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");
        assert!(settings("").unwrap().host.tokenizer.is_none());
    }

    #[test]
    fn a_file_with_every_setting_resolves_and_flags_beat_it() {
        let ca = file("-----BEGIN CERTIFICATE-----\n");
        let ca = format!("{:?}", ca.path());
        let tokenizer = file(TOKENIZER);
        let tokenizer = format!("{:?}", tokenizer.path());
        let mut text = String::new();
        for key in file_keys() {
            let value = match key.as_str() {
                // A list of URLs, and one of names whose duplicates are dropped.
                "nats_url" => "[\"nats://10.0.0.1:4222\", \"nats://10.0.0.2:4222\"]",
                "deployments" => "[\"a\", \"b\", \"a\"]",
                "http_addr" => "\"0.0.0.0:0\"",
                "subject_prefix" => "\"acme.leases\"",
                "connect_deadline" => "7",
                "lease_scan_interval" | "nats_ping_interval" => "\"7s\"",
                "worker_idle" | "provisional_deadline" | "snapshot_interval" => "\"7s\"",
                "log_format" => "\"json\"",
                "durable" | "http_protect_reads" => "true",
                "stream_replicas" => "3",
                "stream_max_bytes" => "2_000_000",
                "snapshot_keep" => "5",
                "route_policy" => "\"round_robin\"",
                // One way to authenticate: user and password; the other ways stay unset.
                "nats_user" | "nats_password" => "\"router\"",
                "nats_token" | "nats_nkey" | "nats_creds" | "nats_tls_cert" | "nats_tls_key" => {
                    continue
                }
                "nats_tls_ca" => &ca,
                // The token inline; the file is the other way to give it.
                "http_token" => "\"s3cret-token\"",
                "http_token_file" => continue,
                "tokenizer" => &tokenizer,
                "admission" => {
                    r#"'{"classes": [{"name": "a", "band": 0, "weight": 1}], "default_class": "a"}'"#
                }
                _ => "4242",
            };
            text.push_str(&format!("{key} = {value}\n"));
        }
        let s = with_file(&text, "").unwrap();
        let (h, a, seven) = (&s.host, &s.host.apply, Duration::from_secs(7));
        let urls = ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"];
        assert_eq!(s.nats.urls(), urls);
        assert_eq!(names(&s), ["a", "b"], "duplicates are dropped");
        assert_eq!(s.http_addr.to_string(), "0.0.0.0:0");
        assert_eq!(h.subject_prefix.as_str(), "acme.leases");
        let durations = (h.lease_scan_interval, h.worker_idle, h.provisional_deadline);
        assert_eq!(durations, (seven, Some(seven), seven));
        assert_eq!(h.route_policy, RoutePolicy::RoundRobin);
        assert_eq!(s.log_format, LogFormat::Json);
        assert_eq!((a.max_event_bytes, a.max_batch_bytes), (4242, 4242));
        let held = (a.max_tombstones, a.max_held_progress, a.max_publishers);
        assert_eq!(held, (4242, 4242, 4242));
        assert_eq!(h.max_active_leases, 4242);
        let p = h.prefix;
        let prefix = (p.block_size(), p.worker_capacity(), p.max_entries());
        assert_eq!((prefix, h.affinity_gap), ((4242, 4242, 4242), 4242));
        assert_eq!(h.admission.default_class(), Some("a"));
        assert_eq!(s.nats.subscription_capacity(), Some(4242));
        let durable = h.durable.as_ref().unwrap();
        assert_eq!((durable.replicas(), durable.max_bytes()), (3, 2_000_000));
        assert_eq!(durable.snapshot_interval(), seven);
        let max_age = Duration::from_secs(60);
        assert_eq!(durable.max_age(), max_age, "5 x 7 s, at least 60 s");
        assert_eq!(s.nats.connect_deadline(), seven);
        assert_eq!(s.nats.ping_interval(), Some(seven));
        let user_password = matches!(s.nats.auth(), lease_router::NatsAuth::UserPassword { .. });
        assert!(user_password && s.nats.tls().is_some());
        assert!(s.http_auth.expect("a token").reads_protected());

        let flags = "--nats-url nats://a:1,nats://b:2 --deployment c --deployment d,e \
                     --http-addr localhost:8080 --lease-scan-interval 1m30s --log-format TEXT \
                     --route-policy random --worker-idle 90s";
        let s = with_file(&text, flags).unwrap();
        assert_eq!(s.nats.urls(), ["nats://a:1", "nats://b:2"]);
        // Repeated and comma-separated; the file's list is replaced, not added to.
        assert_eq!(names(&s), ["c", "d", "e"]);
        assert_eq!(s.http_addr.to_string(), "127.0.0.1:8080");
        assert_eq!(s.host.lease_scan_interval, Duration::from_secs(90));
        assert_eq!(s.log_format, LogFormat::Text);
        assert_eq!(s.host.route_policy, RoutePolicy::Random);
        assert_eq!(s.host.worker_idle, Some(Duration::from_secs(90)));
        // Not given as flags: still from the file.
        assert_eq!(s.host.subject_prefix.as_str(), "acme.leases");
        assert_eq!(s.host.apply.max_event_bytes, 4242);
    }

    #[test]
    fn http_token_from_a_flag_or_a_file_trimmed_and_never_shown() {
        let given = args(&["--http-token", SECRETS[1]]).unwrap();
        assert_no_secret(&format!("{given:?}"));
        // A file, with the newline an editor leaves; `--http-protect-reads` alone is true.
        let token_file = file(&format!("  {}\n\n", SECRETS[1]));
        let token_path = path(&token_file);
        let flags = format!("--http-token-file {token_path} --http-protect-reads");
        // The config file's keys.
        let toml = format!("http_token_file = {token_path:?}\nhttp_protect_reads = false\n");
        let cases = [(resolve(&given), false), (settings(&flags), true)];
        for (s, protected) in cases.into_iter().chain([(with_file(&toml, ""), false)]) {
            let s = s.unwrap();
            assert_no_secret(&format!("{s:?}"));
            let auth = s.http_auth.expect("a token");
            assert!(auth.token().matches(SECRETS[1]));
            assert_eq!(auth.reads_protected(), protected);
        }
    }

    #[test]
    fn http_token_errors_are_clear_and_never_show_the_token() {
        let token = SECRETS[1];
        let (blank, token_file) = (file(" \n\t\n"), file(token));
        let (blank, token_file) = (path(&blank), path(&token_file));
        refused::<String>(&[
            (&["--http-token", ""], "invalid setting http_token = \"\" from --http-token: the token is empty".into()),
            (&["--http-token-file", blank], format!("invalid setting http_token_file = {blank:?} from --http-token-file: the file holds no usable token: the token is empty")),
            (&["--http-token-file", "/nonexistent/token"], "invalid setting http_token_file = \"/nonexistent/token\" from --http-token-file: expected a readable file".into()),
            (&["--http-token", &format!("{token} x")], "invalid setting http_token = \"<redacted>\" from --http-token: the token has a character".into()),
            (&["--http-token", token, "--http-token-file", token_file], format!("invalid setting http_token_file = {token_file:?} from --http-token-file: give the token once")),
            (&["--http-protect-reads", "true"], "invalid setting http_protect_reads = \"true\" from --http-protect-reads: protecting the reads needs a token".into()),
            (&["--http-token", token, "--http-protect-reads", "maybe"], "invalid setting http_protect_reads = \"maybe\" from --http-protect-reads: expected true or false".into()),
        ]);
    }

    #[test]
    fn memory_limits() {
        let toml = "max_tombstones = 10\nmax_publishers = \"20\"\nmax_active_leases = 5\n";
        let s = with_file(toml, "--max-held-progress 1_000 --max-publishers 30").unwrap();
        let a = &s.host.apply;
        assert_eq!(s.host.max_active_leases, 5);
        let limits = (a.max_tombstones, a.max_held_progress, a.max_publishers);
        assert_eq!(limits, (10, 1000, 30));
        for bad in ["0", "-1", "many", "100000001"] {
            let from = format!("max_tombstones = {bad:?} from --max-tombstones");
            let want = format!("invalid setting {from}: expected a whole number from 1");
            refused(&[(&[&format!("--max-tombstones={bad}")], want)]);
        }
    }
}

//! Connecting to NATS.
//!
//! [`connect`] retries with exponential backoff (see [`crate::retry`]) while the servers are
//! unreachable, up to [`NatsConnectConfig::connect_deadline`]; an authorization failure is
//! permanent and reported at once. Once connected, the client reconnects on its own, forever,
//! with a bounded delay ([`NatsConnectConfig::with_reconnect`]).
//!
//! A silent partition (a dead middlebox, a network that drops packets without closing the
//! socket) is only seen by the client's PINGs: [`DEFAULT_PING_INTERVAL`] makes it seen within
//! [`NatsConnectConfig::dead_connection_bound`] (12 s) instead of the client's 3 minutes.
//!
//! [`ConnectionStats`] reads the client's own state: connected or not, and the connection
//! count, from which reconnects and disconnects are derived, so that no counter can miss a
//! change. The client's event callback (a queue of 128 that drops events when full) feeds
//! only what it alone knows, best-effort: slow-consumer events, errors, the log lines.
//! Failures are logged with a rate limit (`LogRateLimiter`), so a server that stays down
//! does not flood the log.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use async_nats::{Client, ConnectErrorKind, ConnectOptions, Event, ServerAddr};
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use crate::log_limit::LogRateLimiter;
use crate::retry::{retry, Attempt, RetryPolicy};

/// How often waits and the monitor look at the client's state.
const STATE_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The shortest time given to one connect attempt, even at the deadline.
const MIN_ATTEMPT_TIME: Duration = Duration::from_millis(250);

/// How often the client PINGs a server that has sent nothing. The client disconnects at the
/// third interval without a word from the server (two PINGs unanswered), so a silent
/// partition is seen within three intervals: 12 s, inside the 15 s an operator expects
/// `/healthz` to turn. Shorter costs a PING per interval per idle connection; any message
/// from the server resets the clock, so a busy connection sends none.
pub const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(4);

/// Intervals without a word from the server after which the client gives the connection up
/// (async-nats: more than two PINGs outstanding).
const PING_INTERVALS_TO_DISCONNECT: u32 = 3;

/// async-nats' own ping interval, used when [`NatsConnectConfig::ping_interval`] is `None`.
const CLIENT_DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(60);

/// The URL of the usual local server.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// How a client proves who it is. TLS (server verification, client certificates) is
/// separate, [`NatsTls`], and combines with any of these.
///
/// Secrets never show in `Debug` (nor in any error of this module): passwords and tokens are
/// redacted, and files are named by their path only, never by their contents.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials (or credentials embedded in the URLs, `nats://user:pass@host`).
    #[default]
    None,
    /// User and password.
    UserPassword {
        /// The user name.
        user: String,
        /// The password (redacted in `Debug`).
        password: String,
    },
    /// A bearer token.
    Token(String),
    /// A file holding an NKey seed (`SU...`), read at connect.
    NKeySeedFile(PathBuf),
    /// A credentials file (user JWT and NKey seed, `.creds`), read at connect.
    CredentialsFile(PathBuf),
}

impl fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatsAuth::None => f.write_str("None"),
            NatsAuth::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"<redacted>")
                .finish(),
            NatsAuth::Token(_) => f.write_str("Token(<redacted>)"),
            NatsAuth::NKeySeedFile(path) => f.debug_tuple("NKeySeedFile").field(path).finish(),
            NatsAuth::CredentialsFile(path) => {
                f.debug_tuple("CredentialsFile").field(path).finish()
            }
        }
    }
}

impl NatsAuth {
    /// The method, without any secret: for messages.
    pub fn method(&self) -> &'static str {
        match self {
            NatsAuth::None => "no credentials",
            NatsAuth::UserPassword { .. } => "user and password",
            NatsAuth::Token(_) => "token",
            NatsAuth::NKeySeedFile(_) => "nkey seed file",
            NatsAuth::CredentialsFile(_) => "credentials file",
        }
    }

    fn apply(&self, options: ConnectOptions) -> Result<ConnectOptions, ConnectNatsError> {
        Ok(match self {
            NatsAuth::None => options,
            NatsAuth::UserPassword { user, password } => {
                options.user_and_password(user.clone(), password.clone())
            }
            NatsAuth::Token(token) => options.token(token.clone()),
            NatsAuth::NKeySeedFile(path) => {
                let seed = read_secret_file("nkey seed", path)?;
                let seed = seed.trim();
                // Checked here so that a bad file reads as a bad file, not as a refusal of
                // the server; the key's own error text never holds the seed, but it is not
                // shown anyway.
                if !seed.starts_with('S') || seed.len() < 32 {
                    return Err(ConnectNatsError::Credentials {
                        what: "nkey seed",
                        path: path.clone(),
                        reason: "not an NKey seed (expected one line starting with SU)".into(),
                    });
                }
                options.nkey(seed.to_owned())
            }
            NatsAuth::CredentialsFile(path) => {
                let creds = read_secret_file("credentials", path)?;
                options
                    .credentials(&creds)
                    .map_err(|err| ConnectNatsError::Credentials {
                        what: "credentials",
                        path: path.clone(),
                        reason: match err.kind() {
                            // The parser's own messages name the part, never the content.
                            std::io::ErrorKind::InvalidData => err.to_string(),
                            kind => kind.to_string(),
                        },
                    })?
            }
        })
    }
}

/// Reads a file that holds a secret; an error names the file and the reason, never the
/// content.
fn read_secret_file(what: &'static str, path: &Path) -> Result<String, ConnectNatsError> {
    std::fs::read_to_string(path).map_err(|err| ConnectNatsError::Credentials {
        what,
        path: path.to_owned(),
        reason: err.kind().to_string(),
    })
}

/// TLS to the NATS server: required once configured.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// PEM file of the certificate authorities that sign the server's certificate; `None`:
    /// the system's roots.
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate, for servers that verify clients (`verify: true`);
    /// needs `key_file`.
    pub cert_file: Option<PathBuf>,
    /// PEM file of the client certificate's private key; needs `cert_file`.
    pub key_file: Option<PathBuf>,
}

impl NatsTls {
    fn apply(&self, options: ConnectOptions) -> Result<ConnectOptions, ConnectNatsError> {
        let mut options = options.require_tls(true);
        if let Some(ca) = &self.ca_file {
            check_readable("TLS CA", ca)?;
            options = options.add_root_certificates(ca.clone());
        }
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                check_readable("TLS client certificate", cert)?;
                check_readable("TLS client key", key)?;
                options = options.add_client_certificate(cert.clone(), key.clone());
            }
            (None, None) => {}
            (Some(path), None) | (None, Some(path)) => {
                return Err(ConnectNatsError::Credentials {
                    what: "TLS client certificate",
                    path: path.clone(),
                    reason: "a client certificate needs both a certificate and a key file".into(),
                })
            }
        }
        Ok(options)
    }
}

fn check_readable(what: &'static str, path: &Path) -> Result<(), ConnectNatsError> {
    std::fs::File::open(path)
        .map(drop)
        .map_err(|err| ConnectNatsError::Credentials {
            what,
            path: path.to_owned(),
            reason: err.kind().to_string(),
        })
}

/// Where and how to connect: [`new`](Self::new) with the server URLs, then the `with_*`
/// methods.
#[derive(Clone, Debug)]
pub struct NatsConnectConfig {
    urls: Vec<String>,
    connect_deadline: Duration,
    name: Option<String>,
    auth: NatsAuth,
    tls: Option<NatsTls>,
    connection_timeout: Duration,
    connect_retry: RetryPolicy,
    reconnect: RetryPolicy,
    ping_interval: Option<Duration>,
    subscription_capacity: Option<usize>,
}

impl Default for NatsConnectConfig {
    fn default() -> Self {
        Self {
            urls: vec![DEFAULT_NATS_URL.to_string()],
            connect_deadline: Duration::from_secs(30),
            name: None,
            auth: NatsAuth::None,
            tls: None,
            connection_timeout: Duration::from_secs(5),
            connect_retry: RetryPolicy::new()
                .with_initial(Duration::from_millis(100))
                .with_max_interval(Duration::from_secs(2))
                .with_randomization(0.2),
            reconnect: RetryPolicy::new()
                .with_initial(Duration::from_millis(50))
                .with_max_interval(Duration::from_secs(2))
                .with_randomization(0.2),
            ping_interval: Some(DEFAULT_PING_INTERVAL),
            subscription_capacity: None,
        }
    }
}

impl NatsConnectConfig {
    /// Defaults, with these server URLs.
    pub fn new<I, S>(urls: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            urls: urls.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    /// Defaults, with the URLs of a comma (or whitespace) separated list, as in `NATS_URL`.
    pub fn from_url_list(list: &str) -> Self {
        Self::new(
            list.split(|c: char| c == ',' || c.is_whitespace())
                .filter(|s| !s.is_empty()),
        )
    }

    /// Sets how long [`connect`] keeps retrying while no server answers. Default 30 s.
    pub fn with_connect_deadline(mut self, deadline: Duration) -> Self {
        self.connect_deadline = deadline;
        self
    }

    /// Sets the connection name shown by the server's monitoring.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Sets how the client authenticates. Default [`NatsAuth::None`].
    pub fn with_auth(mut self, auth: NatsAuth) -> Self {
        self.auth = auth;
        self
    }

    /// Authenticates with a user and password ([`NatsAuth::UserPassword`]).
    pub fn with_user_password(self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.with_auth(NatsAuth::UserPassword {
            user: user.into(),
            password: password.into(),
        })
    }

    /// Authenticates with a bearer token ([`NatsAuth::Token`]).
    pub fn with_token(self, token: impl Into<String>) -> Self {
        self.with_auth(NatsAuth::Token(token.into()))
    }

    /// Authenticates with the NKey seed in this file ([`NatsAuth::NKeySeedFile`]), read at connect.
    pub fn with_nkey_seed_file(self, path: impl Into<PathBuf>) -> Self {
        self.with_auth(NatsAuth::NKeySeedFile(path.into()))
    }

    /// Authenticates with this `.creds` file ([`NatsAuth::CredentialsFile`]), read at connect.
    pub fn with_credentials_file(self, path: impl Into<PathBuf>) -> Self {
        self.with_auth(NatsAuth::CredentialsFile(path.into()))
    }

    /// Requires TLS, with these settings. Default: plain TCP unless the URL or the server
    /// asks for TLS.
    pub fn with_tls(mut self, tls: NatsTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Sets the bound of one TCP connect + handshake to one server. Default 5 s.
    pub fn with_connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// Sets the delays between attempts of the first connect (its deadline is
    /// [`connect_deadline`](Self::connect_deadline)).
    pub fn with_connect_retry(mut self, policy: RetryPolicy) -> Self {
        self.connect_retry = policy;
        self
    }

    /// Sets the delays between reconnect attempts once connected (no deadline: retries
    /// forever; the first attempt after a disconnect is immediate).
    pub fn with_reconnect(mut self, policy: RetryPolicy) -> Self {
        self.reconnect = policy;
        self
    }

    /// Sets the client PING interval: a silent partition is seen within three of them
    /// ([`dead_connection_bound`](Self::dead_connection_bound)). Default
    /// [`DEFAULT_PING_INTERVAL`].
    pub fn with_ping_interval(mut self, interval: Duration) -> Self {
        self.ping_interval = Some(interval);
        self
    }

    /// The longest a connection that receives nothing (a silent partition) is still taken
    /// for up: three ping intervals.
    pub fn dead_connection_bound(&self) -> Duration {
        self.ping_interval.unwrap_or(CLIENT_DEFAULT_PING_INTERVAL) * PING_INTERVALS_TO_DISCONNECT
    }

    /// Sets the number of messages buffered per subscription. Default: the client's.
    pub fn with_subscription_capacity(mut self, capacity: usize) -> Self {
        self.subscription_capacity = Some(capacity);
        self
    }

    /// The servers: one, or several of a cluster (`nats://host:port`).
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// How long [`connect`] keeps retrying while no server answers.
    pub fn connect_deadline(&self) -> Duration {
        self.connect_deadline
    }

    /// How the client authenticates.
    pub fn auth(&self) -> &NatsAuth {
        &self.auth
    }

    /// The TLS settings; `None`: plain TCP unless the URL or the server asks for TLS.
    pub fn tls(&self) -> Option<&NatsTls> {
        self.tls.as_ref()
    }

    /// The client PING interval; `None`: the client's own (60 s, so three minutes to see a
    /// silent partition).
    pub fn ping_interval(&self) -> Option<Duration> {
        self.ping_interval
    }

    /// Messages buffered per subscription; `None`: the client's default.
    pub fn subscription_capacity(&self) -> Option<usize> {
        self.subscription_capacity
    }

    /// The URLs with any embedded password replaced, comma separated: safe to log.
    pub fn display_urls(&self) -> String {
        self.urls
            .iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn server_addrs(&self) -> Result<Vec<ServerAddr>, ConnectNatsError> {
        if self.urls.is_empty() {
            return Err(ConnectNatsError::NoUrls);
        }
        self.urls
            .iter()
            .map(|u| {
                u.trim()
                    .parse::<ServerAddr>()
                    .map_err(|e| ConnectNatsError::InvalidUrl {
                        url: redact_url(u),
                        reason: e.to_string(),
                    })
            })
            .collect()
    }
}

/// Replaces the user-info part of a URL (`nats://user:pass@host`) by `***`.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let rest = match rest.rsplit_once('@') {
        Some((_, host)) => format!("***@{host}"),
        None => rest.to_string(),
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{rest}"),
        None => rest,
    }
}

/// Why [`connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectNatsError {
    #[error("no NATS server URL was given")]
    /// The config holds no server URL.
    NoUrls,
    #[error("invalid NATS server URL {url:?}: {reason}")]
    /// A server URL does not parse.
    InvalidUrl {
        /// The URL, password redacted.
        url: String,
        /// Why it does not parse.
        reason: String,
    },
    #[error(
        "authorization failed connecting to NATS at {urls} with {method}: {source} \
         (check the credentials and the server's authorization settings)"
    )]
    /// The server rejected the credentials (authorization or authentication error).
    AuthorizationFailed {
        /// The configured URLs, passwords redacted, comma separated.
        urls: String,
        /// The method used ([`NatsAuth::method`]), never the secret.
        method: &'static str,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
    /// A credentials, key or certificate file cannot be used. Names the file, never its
    /// content.
    #[error("cannot use the {what} file {}: {reason}", path.display())]
    Credentials {
        /// Which kind of file it is (`"credentials"`, `"nkey seed"`, `"TLS CA"`, ...).
        what: &'static str,
        /// The file's path.
        path: PathBuf,
        /// Why it cannot be used (an I/O error kind or a format problem).
        reason: String,
    },
    #[error(
        "could not connect to NATS at {urls} within {deadline:?} ({attempts} attempts); \
         last error: {source}"
    )]
    /// No server could be reached before [`NatsConnectConfig::connect_deadline`] passed.
    Unreachable {
        /// The configured URLs, passwords redacted, comma separated.
        urls: String,
        /// The connect deadline that passed.
        deadline: Duration,
        /// How many connect attempts were made.
        attempts: u32,
        /// The error of the last attempt.
        #[source]
        source: async_nats::ConnectError,
    },
    #[error("could not connect to NATS at {urls}: {source}")]
    /// The connect failed with an error that retrying cannot fix (not an authorization error).
    Failed {
        /// The configured URLs, passwords redacted, comma separated.
        urls: String,
        /// The client's error.
        #[source]
        source: async_nats::ConnectError,
    },
}

impl ConnectNatsError {
    /// True for an authorization (or authentication) failure.
    pub fn is_authorization(&self) -> bool {
        matches!(self, ConnectNatsError::AuthorizationFailed { .. })
    }
}

fn classify(err: async_nats::ConnectError) -> Attempt<async_nats::ConnectError> {
    match err.kind() {
        ConnectErrorKind::AuthorizationViolation
        | ConnectErrorKind::Authentication
        | ConnectErrorKind::ServerParse
        | ConnectErrorKind::Tls => Attempt::Permanent(err),
        ConnectErrorKind::Dns
        | ConnectErrorKind::TimedOut
        | ConnectErrorKind::Io
        | ConnectErrorKind::MaxReconnects => Attempt::Transient(err),
    }
}

/// Connection health. Connected or not, and the connection count, are the client's own
/// (`Client::connection_state`, `Client::statistics`), read when asked: they cannot miss a
/// change. Slow-consumer events and errors come through the client's event callback, whose
/// queue (128) drops events when full: those counters are best-effort. All counters are
/// monotonic.
///
/// It holds the client once connected: keeping it keeps the connection open.
#[derive(Debug)]
pub struct ConnectionStats {
    client: OnceLock<Client>,
    /// The highest disconnect count reported, so that the derived count never goes back.
    disconnects_reported: AtomicU64,
    slow_consumer_events: AtomicU64,
    server_errors: AtomicU64,
    client_errors: AtomicU64,
    last_error: Mutex<Option<String>>,
    server_url: Mutex<Option<String>>,
    changed: Notify,
    disconnect_log: LogRateLimiter,
    reconnect_log: LogRateLimiter,
    error_log: LogRateLimiter,
    slow_consumer_log: LogRateLimiter,
}

impl Default for ConnectionStats {
    fn default() -> Self {
        Self {
            client: OnceLock::new(),
            disconnects_reported: AtomicU64::new(0),
            slow_consumer_events: AtomicU64::new(0),
            server_errors: AtomicU64::new(0),
            client_errors: AtomicU64::new(0),
            last_error: Mutex::new(None),
            server_url: Mutex::new(None),
            changed: Notify::new(),
            disconnect_log: LogRateLimiter::new(Duration::from_secs(1)),
            reconnect_log: LogRateLimiter::new(Duration::from_secs(1)),
            error_log: LogRateLimiter::new(Duration::from_secs(5)),
            slow_consumer_log: LogRateLimiter::new(Duration::from_secs(5)),
        }
    }
}

/// Connections lost, from the connection count and the state: every connection after the
/// first replaced a lost one, and a client that is not connected lost its last one.
fn derive_disconnects(connects: u64, connected: bool) -> u64 {
    match connects {
        0 => 0,
        n => n - 1 + u64::from(!connected),
    }
}

impl ConnectionStats {
    /// True while the client holds a connection to a server (the client's own state, not
    /// an event).
    pub fn is_connected(&self) -> bool {
        self.client.get().is_some_and(|client| {
            client.connection_state() == async_nats::connection::State::Connected
        })
    }

    /// Successful connections, the first one included (the client's own count).
    pub fn connects(&self) -> u64 {
        self.client.get().map_or(0, |client| {
            client.statistics().connects.load(Ordering::Acquire)
        })
    }

    /// Successful connections after the first one.
    pub fn reconnects(&self) -> u64 {
        self.connects().saturating_sub(1)
    }

    /// Connections lost: reconnects, plus one while disconnected. Derived from the client's
    /// state, so a lost event cannot hide one; it can count a loss a moment early (the
    /// client counts a new connection just before it says it is connected), never twice.
    pub fn disconnects(&self) -> u64 {
        // The count first, then the state: a reconnect between the two reads reads low,
        // which the maximum below hides.
        let connects = self.connects();
        let derived = derive_disconnects(connects, self.is_connected());
        self.disconnects_reported
            .fetch_max(derived, Ordering::AcqRel)
            .max(derived)
    }

    /// Times the client dropped messages of a subscription that was not read fast enough.
    /// Best-effort: a burst of them overflows the client's event queue. The messages lost
    /// are counted exactly by the sequence gaps of the deployments.
    pub fn slow_consumer_events(&self) -> u64 {
        self.slow_consumer_events.load(Ordering::Acquire)
    }

    /// Errors the server sent (`-ERR`), such as permission violations. Best-effort.
    pub fn server_errors(&self) -> u64 {
        self.server_errors.load(Ordering::Acquire)
    }

    /// Client-side errors, such as failed reconnect attempts. Best-effort.
    pub fn client_errors(&self) -> u64 {
        self.client_errors.load(Ordering::Acquire)
    }

    /// The last server or client error, as text.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().clone()
    }

    /// The server of the current connection (or of the last one, while disconnected), as
    /// `nats://<host>:<port>` from the server's INFO (the host is the server's listen
    /// address: `0.0.0.0` for a server listening on all interfaces).
    pub fn server_url(&self) -> Option<String> {
        self.server_url.lock().clone()
    }

    /// Waits until `pred(self)` holds (checked at every change), at most `timeout`.
    /// Returns the final value of `pred`.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        pred: impl Fn(&ConnectionStats) -> bool,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if pred(self) {
                return true;
            }
            // The client's state changes without a notification: look again now and then.
            let wake = deadline.min(tokio::time::Instant::now() + STATE_POLL_INTERVAL);
            if tokio::time::timeout_at(wake, notified).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                return pred(self);
            }
        }
    }

    fn set_error(&self, err: String) {
        *self.last_error.lock() = Some(err);
    }

    /// Counts an error event, keeps it as the last error and logs it, rate-limited.
    fn record_error(&self, counter: &AtomicU64, err: &impl std::fmt::Display, what: &str) {
        counter.fetch_add(1, Ordering::AcqRel);
        self.set_error(err.to_string());
        if let Some(suppressed) = self.error_log.check() {
            tracing::warn!(
                server = %self.server_url().unwrap_or_default(),
                error = %err,
                suppressed,
                "{what}"
            );
        }
    }

    /// Applies one client event: the best-effort counters, rate-limited log lines.
    fn on_event(&self, event: &Event) {
        match event {
            // The state and the counts are read from the client; these only log.
            Event::Connected => {}
            Event::Disconnected => {
                let server = self.server_url().unwrap_or_default();
                if let Some(suppressed) = self.disconnect_log.check() {
                    tracing::warn!(
                        server = %server,
                        disconnects = self.disconnects(),
                        suppressed,
                        "disconnected from NATS, reconnecting"
                    );
                }
            }
            Event::Closed => {
                tracing::info!(server = %self.server_url().unwrap_or_default(), "NATS connection closed");
            }
            Event::Draining => {
                tracing::info!(server = %self.server_url().unwrap_or_default(), "NATS connection draining");
            }
            Event::LameDuckMode => {
                tracing::warn!(
                    server = %self.server_url().unwrap_or_default(),
                    "NATS server entered lame duck mode, it will close the connection soon"
                );
            }
            Event::SlowConsumer(sid) => {
                let n = self.slow_consumer_events.fetch_add(1, Ordering::AcqRel) + 1;
                if let Some(suppressed) = self.slow_consumer_log.check() {
                    tracing::warn!(
                        server = %self.server_url().unwrap_or_default(),
                        subscription = sid,
                        slow_consumer_events = n,
                        suppressed,
                        "NATS slow consumer: messages were dropped"
                    );
                }
            }
            Event::ServerError(err) => {
                self.record_error(&self.server_errors, err, "NATS server error")
            }
            Event::ClientError(err) => self.record_error(
                &self.client_errors,
                err,
                "NATS client error (a reconnect attempt failed?)",
            ),
        }
        self.changed.notify_waiters();
    }
}

/// Cancels the connection's monitor task when the last [`NatsConnection`] clone is dropped.
#[derive(Debug)]
struct MonitorGuard(CancellationToken);

impl Drop for MonitorGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// A connected client and its health.
///
/// Cloning is cheap. The monitor task that logs which server the client is connected to
/// stops when the last clone is dropped (clients obtained from [`client`](Self::client) keep
/// working, and keep feeding [`ConnectionStats`]).
#[derive(Debug, Clone)]
pub struct NatsConnection {
    client: Client,
    state: Arc<ConnectionStats>,
    urls: Arc<str>,
    connect_deadline: Duration,
    _monitor: Arc<MonitorGuard>,
}

impl NatsConnection {
    /// The underlying `async_nats` client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The connection's health counters and state, shared with the monitor task.
    pub fn stats(&self) -> &Arc<ConnectionStats> {
        &self.state
    }

    /// The configured URLs (passwords redacted), comma separated.
    pub fn urls(&self) -> &str {
        &self.urls
    }

    /// True while the client holds a connection to a server
    /// ([`ConnectionStats::is_connected`]).
    pub fn is_connected(&self) -> bool {
        self.state.is_connected()
    }

    /// The [`NatsConnectConfig::connect_deadline`] it was made with: how long a caller is
    /// willing to wait for NATS, also for work that needs the server after the connect.
    pub fn connect_deadline(&self) -> Duration {
        self.connect_deadline
    }

    /// The client's own view of the connection (pending, connected, disconnected).
    pub fn connection_state(&self) -> async_nats::connection::State {
        self.client.connection_state()
    }

    /// The server of the current (or last) connection.
    pub fn server_url(&self) -> Option<String> {
        self.state.server_url()
    }
}

/// Connects to one of `config.urls()`, retrying while none answers until
/// `config.connect_deadline()`. The returned client reconnects on its own afterwards.
pub async fn connect(config: &NatsConnectConfig) -> Result<NatsConnection, ConnectNatsError> {
    let addrs = config.server_addrs()?;
    let urls = config.display_urls();
    let stats = Arc::new(ConnectionStats::default());
    let (event_tx, event_rx) = mpsc::channel::<Event>(256);
    let options = match connect_options(config, &stats, event_tx) {
        Ok(options) => options,
        Err(err) => {
            tracing::error!(error = %err, "NATS connect failed");
            return Err(err);
        }
    };

    let retry_log = LogRateLimiter::new(Duration::from_secs(5));
    let deadline = tokio::time::Instant::now() + config.connect_deadline;
    tracing::debug!(urls = %urls, deadline = ?config.connect_deadline, "connecting to NATS");
    let mut attempts = 0u32;
    let result = retry(
        &config.connect_retry,
        deadline,
        || {
            attempts += 1;
            // An attempt may not run (much) past the deadline, whatever the per-server
            // connection timeout.
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            attempt(options.clone(), addrs.clone(), left.max(MIN_ATTEMPT_TIME))
        },
        |err, delay| {
            if let Some(suppressed) = retry_log.check() {
                tracing::warn!(
                    urls = %urls,
                    error = %err,
                    retry_in = ?delay,
                    suppressed,
                    "NATS is not reachable yet, retrying"
                );
            }
        },
    )
    .await;

    let client = match result {
        Ok(client) => client,
        Err(last) => {
            let permanent = last.is_permanent();
            let error = last.into_inner();
            let err = match error.kind() {
                ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                    ConnectNatsError::AuthorizationFailed {
                        urls,
                        method: config.auth.method(),
                        source: error,
                    }
                }
                _ if permanent => ConnectNatsError::Failed {
                    urls,
                    source: error,
                },
                _ => ConnectNatsError::Unreachable {
                    urls,
                    deadline: config.connect_deadline,
                    attempts,
                    source: error,
                },
            };
            tracing::error!(error = %err, "NATS connect failed");
            return Err(err);
        }
    };

    // Connected already (the client sets its state before it returns); from here the stats
    // read it.
    let _ = stats.client.set(client.clone());
    let info = client.server_info();
    let server = format!("nats://{}:{}", info.host, info.port);
    *stats.server_url.lock() = Some(server.clone());

    let cancel = CancellationToken::new();
    tokio::spawn(monitor(
        client.clone(),
        stats.clone(),
        event_rx,
        cancel.clone(),
        (info.server_id.clone(), info.client_id),
    ));
    tracing::info!(server = %server, server_name = %info.server_name, urls = %urls, "connected to NATS");
    Ok(NatsConnection {
        client,
        state: stats,
        urls: Arc::from(urls),
        connect_deadline: config.connect_deadline,
        _monitor: Arc::new(MonitorGuard(cancel)),
    })
}

/// One connect attempt (each server of the list once), bounded by `limit`.
async fn attempt(
    options: ConnectOptions,
    addrs: Vec<ServerAddr>,
    limit: Duration,
) -> Result<Client, Attempt<async_nats::ConnectError>> {
    match tokio::time::timeout(limit, options.connect(addrs)).await {
        Ok(result) => result.map_err(classify),
        Err(_) => Err(Attempt::Transient(async_nats::ConnectError::new(
            ConnectErrorKind::TimedOut,
        ))),
    }
}

fn connect_options(
    config: &NatsConnectConfig,
    stats: &Arc<ConnectionStats>,
    event_tx: mpsc::Sender<Event>,
) -> Result<ConnectOptions, ConnectNatsError> {
    let reconnect = config.reconnect.clone();
    // Weak: the stats hold the client, and the client's event task holds this callback.
    let cb_stats = Arc::downgrade(stats);
    let mut options = ConnectOptions::new()
        .connection_timeout(config.connection_timeout)
        .max_reconnects(None)
        // attempts counts tries since the last success: the first one is immediate.
        .reconnect_delay_callback(move |attempts| {
            reconnect.delay_for_attempt(attempts.saturating_sub(1))
        })
        .event_callback(move |event| {
            if let Some(stats) = Weak::upgrade(&cb_stats) {
                stats.on_event(&event);
            }
            if matches!(event, Event::Connected) {
                // Wakes the monitor early; it also looks on its own.
                let _ = event_tx.try_send(event);
            }
            std::future::ready(())
        });
    if let Some(name) = &config.name {
        options = options.name(name);
    }
    if let Some(interval) = config.ping_interval {
        options = options.ping_interval(interval);
    }
    if let Some(capacity) = config.subscription_capacity {
        options = options.subscription_capacity(capacity);
    }
    if let Some(tls) = &config.tls {
        options = tls.apply(options)?;
    }
    config.auth.apply(options)
}

/// Logs reconnects with the server's URL and records it in the stats. It follows the
/// client's connection count (an event only wakes it sooner, events can be lost). The client
/// publishes the new server's INFO just after it connects, hence the short bounded wait for
/// it to change.
async fn monitor(
    client: Client,
    stats: Arc<ConnectionStats>,
    mut events: mpsc::Receiver<Event>,
    cancel: CancellationToken,
    first: (String, u64),
) {
    let mut last = first;
    let mut seen_connects = stats.connects();
    let mut events_open = true;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            event = events.recv(), if events_open => events_open = event.is_some(),
            _ = tokio::time::sleep(STATE_POLL_INTERVAL * 5) => {}
        }
        let connects = stats.connects();
        if connects == seen_connects {
            continue;
        }
        seen_connects = connects;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
        let info = loop {
            let info = client.server_info();
            if (info.server_id.as_str(), info.client_id) != (last.0.as_str(), last.1)
                || tokio::time::Instant::now() >= deadline
            {
                break info;
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        };
        last = (info.server_id.clone(), info.client_id);
        let server = format!("nats://{}:{}", info.host, info.port);
        *stats.server_url.lock() = Some(server.clone());
        stats.changed.notify_waiters();
        if let Some(suppressed) = stats.reconnect_log.check() {
            tracing::info!(
                server = %server,
                server_name = %info.server_name,
                reconnects = stats.reconnects(),
                suppressed,
                "reconnected to NATS"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_and_redacted() {
        let c = NatsConnectConfig::from_url_list("nats://a:4222, nats://u:secret@b:4223");
        assert_eq!(c.urls.len(), 2);
        assert_eq!(c.display_urls(), "nats://a:4222,nats://***@b:4223");
        assert_eq!(redact_url("u:p@host:1"), "***@host:1");
        assert_eq!(redact_url("localhost"), "localhost");
        assert!(c.server_addrs().is_ok());
        assert!(matches!(
            NatsConnectConfig::new(Vec::<String>::new()).server_addrs(),
            Err(ConnectNatsError::NoUrls)
        ));
    }

    #[test]
    fn auth_debug_hides_secrets() {
        let a = NatsAuth::UserPassword {
            user: "me".into(),
            password: "hunter2".into(),
        };
        let t = NatsAuth::Token("tok".into());
        let text = format!("{a:?} {t:?}");
        assert!(
            !text.contains("hunter2") && !text.contains("tok)"),
            "{text}"
        );
        assert!(text.contains("me"));
    }

    #[test]
    fn every_auth_method_hides_its_secret() {
        let dir = tempfile::tempdir().unwrap();
        let seed_path = dir.path().join("router.nk");
        std::fs::write(&seed_path, "SUSECRETSEEDSECRETSEEDSECRETSEEDSECRETSEED\n").unwrap();
        let creds_path = dir.path().join("router.creds");
        std::fs::write(&creds_path, "not a creds file: CREDSSECRET\n").unwrap();
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let configs = [
            NatsConnectConfig::new(["nats://u:urlsecret@h:1"]).with_user_password("me", "hunter2"),
            NatsConnectConfig::new(["nats://h:1"]).with_token("tok-secret"),
            NatsConnectConfig::new(["nats://h:1"]).with_nkey_seed_file(&seed_path),
            NatsConnectConfig::new(["nats://h:1"])
                .with_credentials_file(&creds_path)
                .with_tls(NatsTls {
                    ca_file: Some(ca_path.clone()),
                    ..NatsTls::default()
                }),
        ];
        for config in &configs {
            let text = format!("{config:?} {}", config.display_urls());
            for secret in ["hunter2", "tok-secret", "SUSECRET", "CREDSSECRET"] {
                assert!(!text.contains(secret), "{text}");
            }
            assert!(!config.auth.method().is_empty());
        }
        // Files are read only at connect; a bad one is an error that names the file only.
        let stats = Arc::new(ConnectionStats::default());
        let (tx, _rx) = mpsc::channel(1);
        let err = connect_options(&configs[3], &stats, tx)
            .map(drop)
            .unwrap_err();
        let text = format!("{err} {err:?}");
        assert!(
            text.contains("credentials") && text.contains("router.creds"),
            "{text}"
        );
        assert!(!text.contains("CREDSSECRET"), "{text}");
        std::fs::write(&seed_path, "NOTASEED-but-secret-anyway\n").unwrap();
        let (tx, _rx) = mpsc::channel(1);
        let err = connect_options(&configs[2], &stats, tx)
            .map(drop)
            .unwrap_err();
        let text = format!("{err} {err:?}");
        assert!(
            text.contains("nkey seed") && text.contains("router.nk"),
            "{text}"
        );
        assert!(!text.contains("secret-anyway"), "{text}");

        let missing = NatsConnectConfig::new(["nats://h:1"])
            .with_nkey_seed_file(dir.path().join("missing.nk"));
        let (tx, _rx) = mpsc::channel(1);
        let err = connect_options(&missing, &stats, tx).map(drop).unwrap_err();
        assert!(matches!(err, ConnectNatsError::Credentials { .. }), "{err}");
        let half_tls = NatsConnectConfig::new(["nats://h:1"]).with_tls(NatsTls {
            cert_file: Some(seed_path.clone()),
            ..NatsTls::default()
        });
        let (tx, _rx) = mpsc::channel(1);
        let err = connect_options(&half_tls, &stats, tx)
            .map(drop)
            .unwrap_err();
        assert!(
            err.to_string().contains("both a certificate and a key"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn event_counters_and_derived_disconnects() {
        let s = ConnectionStats::default();
        // No client yet: not connected, nothing counted.
        assert!(!s.is_connected());
        assert_eq!((s.connects(), s.reconnects(), s.disconnects()), (0, 0, 0));
        // Connection events only log: the state is the client's.
        s.on_event(&Event::Connected);
        assert!(!s.is_connected());
        s.on_event(&Event::SlowConsumer(7));
        s.on_event(&Event::ClientError(async_nats::ClientError::Other(
            "boom".into(),
        )));
        assert_eq!(s.slow_consumer_events(), 1);
        assert_eq!(s.client_errors(), 1);
        assert!(s.last_error().unwrap().contains("boom"));
        assert!(
            s.wait_until(Duration::from_millis(10), |s| s.client_errors() == 1)
                .await
        );
        assert!(
            !s.wait_until(Duration::from_millis(100), |s| s.is_connected())
                .await
        );

        assert_eq!(derive_disconnects(0, false), 0);
        assert_eq!(derive_disconnects(1, true), 0);
        assert_eq!(derive_disconnects(1, false), 1);
        assert_eq!(derive_disconnects(2, true), 1);
        assert_eq!(derive_disconnects(2, false), 2);
    }

    #[tokio::test]
    async fn unreachable_error_names_url_and_deadline() {
        // A port nobody listens on: bind, read the port, release.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("nats://127.0.0.1:{port}");
        let config =
            NatsConnectConfig::new([url.clone()]).with_connect_deadline(Duration::from_millis(300));
        let err = tokio::time::timeout(Duration::from_secs(10), connect(&config))
            .await
            .expect("connect must give up at its deadline")
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ConnectNatsError::Unreachable { .. }), "{msg}");
        assert!(msg.contains(&url) && msg.contains("300ms"), "{msg}");
    }
}

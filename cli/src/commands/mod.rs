//! The subcommands of `lease-router` and what they share: errors and exit codes, signals,
//! logging, argument parsers, the terminal.

pub mod demo;
pub mod publish;
pub mod relay;
pub mod serve;
pub mod simulate;

use std::fmt;
use std::io::{self, IsTerminal};
use std::time::Duration;

use crate::config::LogFormat;
use lease_router::{connect, ConnectNatsError, NatsConnectConfig, NatsConnection};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// Why a subcommand failed, and so its exit code.
#[derive(Debug)]
pub enum CliError {
    /// Invalid arguments or configuration: exit code 2.
    Usage(String),
    /// A failure at run time: exit code 1.
    Failed(String),
}

impl CliError {
    pub fn usage(message: impl fmt::Display) -> Self {
        CliError::Usage(message.to_string())
    }

    pub fn failed(message: impl fmt::Display) -> Self {
        CliError::Failed(message.to_string())
    }

    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Failed(_) => 1,
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(message) | CliError::Failed(message) => f.write_str(message),
        }
    }
}

impl From<ConnectNatsError> for CliError {
    fn from(error: ConnectNatsError) -> Self {
        match error {
            ConnectNatsError::NoUrls | ConnectNatsError::InvalidUrl { .. } => {
                CliError::usage(format!("invalid setting nats_url: {error}"))
            }
            other => CliError::failed(other),
        }
    }
}

/// SIGINT and SIGTERM: the first cancels `first` (a graceful stop), the second cancels
/// `force` (exit at once, code 130).
pub struct Signals {
    pub first: CancellationToken,
    pub force: CancellationToken,
}

impl Signals {
    /// Listens for SIGINT and SIGTERM from now on. Needs a tokio runtime.
    pub fn install() -> io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        let first = CancellationToken::new();
        let force = CancellationToken::new();
        let (first_tx, force_tx) = (first.clone(), force.clone());
        tokio::spawn(async move {
            let mut received = 0u32;
            loop {
                let name = tokio::select! {
                    Some(()) = interrupt.recv() => "SIGINT",
                    Some(()) = terminate.recv() => "SIGTERM",
                    else => return,
                };
                received += 1;
                if received == 1 {
                    tracing::info!(
                        signal = name,
                        "shutting down; send the signal again to exit at once"
                    );
                    first_tx.cancel();
                } else {
                    force_tx.cancel();
                    return;
                }
            }
        });
        Ok(Self { first, force })
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (else `default_filter`), as text or JSON lines.
pub fn init_logging(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr);
    let result = match format {
        LogFormat::Text => builder.with_ansi(io::stderr().is_terminal()).try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if let Err(error) = result {
        eprintln!("warning: logging is not set up: {error}");
    }
}

/// A duration argument: `500ms`, `30s`, `5m`, `1h`, `1m30s` (a bare number is seconds).
pub fn duration_arg(value: &str) -> Result<Duration, String> {
    crate::layering::parse_duration(value).ok_or_else(|| {
        "expected a duration such as 500ms, 30s, 5m or 1h (units ms, s, m, h; a bare number is \
         seconds)"
            .to_owned()
    })
}

/// A share argument: a number from 0 to 1.
pub fn share_arg(value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(share) if (0.0..=1.0).contains(&share) => Ok(share),
        _ => Err("expected a number from 0 to 1, such as 0.02".to_owned()),
    }
}

/// A rate argument: a positive number of requests per second.
pub fn rate_arg(value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 && rate <= 1_000_000.0 => Ok(rate),
        _ => Err("expected requests per second, above 0 and at most 1000000".to_owned()),
    }
}

/// Connects with `config` (its URLs, credentials and deadline), unless `cancel` fires first
/// (then `Ok(None)`).
pub async fn connect_or_cancel(
    config: NatsConnectConfig,
    name: &str,
    cancel: &CancellationToken,
) -> Result<Option<NatsConnection>, CliError> {
    let config = config.with_name(name);
    tokio::select! {
        result = connect(&config) => Ok(Some(result?)),
        _ = cancel.cancelled() => Ok(None),
    }
}

/// Whether stdout (or stderr) is a terminal that understands ANSI escapes.
pub fn is_tty(stream: Stream) -> bool {
    let term_ok = std::env::var("TERM").map_or(true, |t| t != "dumb");
    term_ok
        && match stream {
            Stream::Stdout => io::stdout().is_terminal(),
            Stream::Stderr => io::stderr().is_terminal(),
        }
}

#[derive(Clone, Copy, Debug)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// A bar of `width` cells, `fraction` of them full.
pub fn bar(fraction: f64, width: usize) -> String {
    let full = ((fraction.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("{}{}", "█".repeat(full), "·".repeat(width - full))
}

/// Durable publishing needs the deployment's lease stream, which only routers create: say
/// so plainly rather than retrying publishes that nothing stores.
pub async fn require_lease_stream(
    connection: &NatsConnection,
    subjects: &lease_router::Subjects,
) -> Result<(), CliError> {
    let js = async_nats::jetstream::new(connection.client().clone());
    lease_router::require_stream(&js, subjects)
        .await
        .map(drop)
        .map_err(CliError::failed)
}

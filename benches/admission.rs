//! Fleet-wide admission under overload: 4 router replicas share one deployment's admission
//! classes over the bus, or each enforces them from its own decisions only (`cargo bench
//! --bench admission`, issue 28 item 4; BENCHMARKS.md has the figures and their reading).
//!
//! # The deployment and the replicas
//! The routing bench's model (`routing.rs` has the parameters and their sources): 8 workers,
//! each a vLLM-like engine (continuous batching, chunked prefill of 2,048 tokens a step, FIFO
//! queue, 256 sequences, 400,000 KV tokens) serving the conversation mix of the Azure 2023
//! trace. Capacity is measured, not assumed: one worker kept saturated completes
//! `capacity / 8` requests a second (printed). Offered loads are shares of it.
//!
//! 4 replicas, each a real `Router` (policy weighted cost, the crate's default) with the
//! admission classes of the case, the crate's default saturation (16,384 prefill tokens
//! waiting per worker; the KV criterion off, as by default) and queue (1,024 requests, 2 s
//! wait). Every route request names its class and sets no wait of its own (so the queue's
//! 2 s); the routers are not told output lengths, so a class's in-flight tokens are its
//! prompts'. Settings:
//! - **shared**: the workers publish real lease events with [`LeasePublisher`]s (`admitted`
//!   with `cls`, prompt and cached tokens when a request reaches its worker, `progressed` at
//!   the first token and every 32 output tokens, `completed`) on a private nats-server; each
//!   replica hears them through a real `NatsIngress`, so every replica counts every class's
//!   in-flight work across the fleet.
//! - **isolated**: each replica hears only the events of the requests it routed (at once, as
//!   a proxy in their response path would: `NoIngress`, fed through its manager): it
//!   enforces the shares, and judges saturation, from its own decisions only, as per-router
//!   admission does (Dynamo's per-router policy queues, llm-d's per-picker flow control).
//!
//! # The cases
//! Two streams of requests, the same mix, Poisson, each its own seed:
//! - the **heavy** stream offers 100% of capacity, 85% of it through replica 0 and the rest
//!   through replicas 1 to 3 in turn (skewed ingress);
//! - the **light** stream offers 50% of capacity, through the 4 replicas in turn.
//!
//! **fair** (shared, then isolated): classes `heavy` (weight 4) and `light` (weight 1) in one
//! band, on those streams: 150% of capacity. Each class offers more than its fair share of
//! capacity (heavy 100% > 80%, light 50% > 20%): both are backlogged, so the fair answer is
//! the configured 4:1 (a class offering less than its share would get all it asks, and the
//! other the rest). Measured: each class's share of the work served in the measured window
//! (below) against 4/5 and 1/5; `fair_share_error` is the heavy class's `|measured share -
//! 0.8| / 0.8` (as `tests/admission.rs` defines it), the light class's error printed beside.
//!
//! **priority**: classes `high` (band 1) on the light stream and `low` (band 0) on the heavy
//! one (150% of capacity), at the default saturation and at one step's prefill (2,048 tokens
//! per worker: `_tight`); next to `high` alone on its stream (50% of capacity, never
//! saturated: the unloaded figure). `priority_ttft_p99_overload_vs_unloaded` is the high
//! band's p99 time to first token under overload over its p99 alone (goal <= 1.2). The
//! engines are FIFO, vLLM's default, so a high-band request waits behind the prefill the
//! threshold lets queue in its engine; `_engine_priority` is the same overload with engines
//! that schedule by priority (vLLM's `--scheduling-policy priority`, each request's band
//! passed as its priority, as a gateway would; no preemption), and `_engine_priority_kv` the
//! same with the KV criterion on at the engines' KV capacity (400,000 tokens, 0.9); the
//! last run again at lower `max_kv_share`s (0.8, 0.7, 0.6, 0.5: `_engine_priority_kv80`
//! and so on), since the KV the low band may hold is what each step the high band's prefill
//! joins must read, and the throughput each share leaves is printed beside it.
//!
//! # What is measured
//! - **Work served**: the tokens the engines served each class inside the measured window: a
//!   request's prompt in the step that completes its prefill (its first token), its output
//!   tokens as they are decoded (counted at each `progressed`, every 32, and at completion).
//!   `completed_work_share` (prompt + output of the requests that completed in the window)
//!   is printed too; it lags by the requests' time in the engines (tens of seconds here).
//! - **TTFT**: of the routed requests that arrived in the window, from their arrival (a wait
//!   in a replica's queue counts), to the end of the step that finishes their prefill.
//! - **Refused** (429 after the queue's 2 s, or at once with a full queue): counted per class
//!   and not retried (a client that gives up; a retry would only add offered load).
//! - The engines' prefill backlog per worker (tokens still to prefill: queued and
//!   running), sampled each second of the window: `fair_backlog_end_vs_threshold` is its
//!   value at the window's end over the saturation threshold, what admission let pile up.
//!
//! # The run
//! Real time on the bus (model second = wall second), like the routing bench's shared cases.
//! Warm-up 40 s: at 150% the engines' batches take ~35 s to fill (`ADMISSION_TRACE=1` shows
//! it), and before that the engines prefill faster than their steady capacity and the
//! classes' in-flight figures still carry the unsaturated start. Then 40 s measured, 5 s
//! more of arrivals; every answer is awaited, and the model runs on alone (as fast as it
//! computes, no events) until every measured routed request has completed. The fair cases
//! run at once on one nats-server (each its own deployment), then the priority cases, then
//! the KV shares: about 4.5 minutes.
//!
//! Output: per case, one `admission_class` line per class (offered, routed, refused, served
//! share, TTFT p50/p99 in ms, the p99 wait in the replicas' queues) and an `admission_case`
//! line (completions against capacity, prefill utilisation, the engines' backlog, how late
//! the driver ran, the bus's lag); then `fair_share_error=` with `fair_share_error_isolated=`
//! beside it, `fair_backlog_end_vs_threshold=` (and `_isolated=`),
//! `priority_ttft_p99_overload_vs_unloaded=`, `_tight=`, `_engine_priority=`,
//! `_engine_priority_kv=` and one `_engine_priority_kv<share in %>=` per lower share, each
//! with the completions against capacity and the low band's refused share beside it.
//!
//! Environment: `ADMISSION_SEED` (1), `ADMISSION_SECONDS` (measured, 40), `ADMISSION_WARMUP`
//! (40), `ADMISSION_TAIL` (5), `ADMISSION_TRACE=1` (each case's state every 5 s: backlog,
//! engine queue and batch, routed, refused and served per class), `ADMISSION_QUICK=1` (15 s
//! warm-up, 15 s measured, every case but the lower KV shares at once: ~40 s; its figures
//! are from the start-up transient, a smoke check only), `ADMISSION_KV_SHARES` (the lower
//! shares, comma-separated: `0.8,0.7,0.6,0.5`), `ADMISSION_ONLY=kv_shares` (only those, the
//! 0.9 one and the unloaded case, at once: ~2 minutes).
//!
//! [`LeasePublisher`]: lease_router::LeasePublisher
mod common;
#[path = "routing/fleet.rs"]
mod fleet;
#[path = "routing/model.rs"]
mod model;

use std::sync::Arc;
use std::time::Duration;

use common::Rng;
use fleet::{
    at_once, env, ms_percentile, request_id, worker_index, Admission, BusStats, Fleet, Plan,
    MAX_DRAIN,
};
use lease_router::{
    AdmissionClass, AdmissionConfig, LeaseConfig, RoutePolicy, RouteRequest, RouteRequestError,
    RouterConfig, RoutingConfig, SaturationConfig,
};
use model::{next_event, Happened, Request, Worker, ENGINE, MIX};
use tokio::sync::mpsc;
use tokio::time::Instant;

const WORKERS: usize = 8;
const REPLICAS: usize = 4;
/// The heavy class's share of its stream through replica 0 (the rest spread over the
/// others).
const SKEW: f64 = 0.85;

/// How a class's requests reach the replicas.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ingress {
    /// Each replica in turn.
    Spread,
    /// This share through replica 0, the rest through the others in turn.
    Skewed(f64),
}

impl Ingress {
    fn describe(self) -> String {
        match self {
            Self::Spread => "spread".into(),
            Self::Skewed(share) => format!("skewed({:.0}%_on_replica_0)", share * 100.0),
        }
    }
}

/// A stream of requests: its load (a share of the measured capacity) and its ingress. The
/// same stream gives the same requests wherever it is used.
#[derive(Clone, Copy, Debug)]
struct Stream {
    id: u64,
    load: f64,
    ingress: Ingress,
}

/// The heavy stream: 100% of capacity, mostly through replica 0.
const HEAVY: Stream = Stream {
    id: 1,
    load: 1.0,
    ingress: Ingress::Skewed(SKEW),
};
/// The light stream: 50% of capacity, spread.
const LIGHT: Stream = Stream {
    id: 2,
    load: 0.5,
    ingress: Ingress::Spread,
};

/// One class of a case and the stream that offers its requests.
#[derive(Clone, Debug)]
struct Class {
    name: &'static str,
    band: u8,
    weight: f64,
    stream: Stream,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setting {
    /// The workers publish lease events on NATS; every replica hears all of them.
    Shared,
    /// Each replica hears only the events of the requests it routed (at once, as a proxy in
    /// their response path would): it enforces the shares from its own decisions only.
    Isolated,
}

impl Setting {
    fn name(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::Isolated => "isolated",
        }
    }
}

#[derive(Clone, Debug)]
struct Case {
    name: String,
    setting: Setting,
    classes: Vec<Class>,
    /// When the deployment counts as saturated.
    saturation: SaturationConfig,
    /// The engines schedule by priority, each request's band passed as its priority (as a
    /// gateway would pass it to vLLM run with `--scheduling-policy priority`); FIFO
    /// otherwise, vLLM's default.
    engine_priority: bool,
}

impl Case {
    fn admission(&self) -> AdmissionConfig {
        let mut config = AdmissionConfig::default();
        for c in &self.classes {
            config = config.with_class(AdmissionClass::new(c.name, c.band, c.weight));
        }
        // The lowest band's first class takes what names no class (none here: every
        // request names its class).
        let default = self
            .classes
            .iter()
            .min_by_key(|c| c.band)
            .expect("a class")
            .name;
        config
            .with_default_class(default)
            .with_saturation(self.saturation)
    }

    fn label(&self) -> String {
        format!(
            "case={} setting={} {}",
            self.name,
            self.setting.name(),
            self.thresholds()
        )
    }

    /// The saturation thresholds, as the output lines print them.
    fn thresholds(&self) -> String {
        let prefill = format!(
            "max_prefill_tokens_per_worker={}",
            self.saturation.max_prefill_tokens_per_worker()
        );
        match self.saturation.kv_capacity_tokens() {
            Some(tokens) => format!(
                "{prefill} kv_capacity_tokens={tokens} max_kv_share={}",
                self.saturation.max_kv_share()
            ),
            None => prefill,
        }
    }
}

/// One request of a case: its class (index in the case's classes), its replica, its sizes.
#[derive(Clone, Copy, Debug)]
struct Arrival {
    class: usize,
    replica: usize,
    request: Request,
}

/// The requests of `classes`' streams, in arrival order.
fn arrivals(seed: u64, capacity: f64, until: f64, classes: &[Class]) -> Vec<Arrival> {
    let mut out = Vec::new();
    for (k, class) in classes.iter().enumerate() {
        let stream = class.stream;
        let stream_seed = seed.wrapping_mul(0x9E37_79B9).wrapping_add(stream.id);
        let mut pick = Rng::new(stream_seed ^ 0x001A_6E55);
        let mut turn = 0usize;
        for r in model::arrivals(stream_seed, stream.load * capacity, until, MIX) {
            let replica = match stream.ingress {
                Ingress::Spread => {
                    turn += 1;
                    turn % REPLICAS
                }
                Ingress::Skewed(share) => {
                    if model::uniform(&mut pick) < share {
                        0
                    } else {
                        turn += 1;
                        1 + turn % (REPLICAS - 1)
                    }
                }
            };
            out.push(Arrival {
                class: k,
                replica,
                request: r,
            });
        }
    }
    out.sort_by(|a, b| a.request.arrival.total_cmp(&b.request.arrival));
    out
}

fn router_config(deployment: &str, case: &Case) -> RouterConfig {
    // Nothing expires and no member is forgotten within a run (as in the routing bench).
    RouterConfig::new(deployment)
        .with_lease(LeaseConfig {
            scan_interval: Duration::from_secs(3600),
            ..LeaseConfig::default()
        })
        .with_routing(
            RoutingConfig::default()
                .with_policy(RoutePolicy::WeightedCost)
                .with_worker_idle(Duration::from_secs(3600)),
        )
        .with_admission(case.admission())
}

/// What became of one request.
#[derive(Clone, Copy, Debug)]
struct Fate {
    /// Model time of the route decision's answer (NaN: none yet).
    decided: f64,
    refused: bool,
    worker: usize,
    first_token: f64,
    completed: f64,
}

impl Default for Fate {
    fn default() -> Self {
        Self {
            decided: f64::NAN,
            refused: false,
            worker: usize::MAX,
            first_token: f64::NAN,
            completed: f64::NAN,
        }
    }
}

/// What one case measured.
#[derive(Debug, Default)]
struct Measured {
    fates: Vec<Fate>,
    /// Prefill (compute) share of each worker's time in the measured window.
    utilisation: Vec<f64>,
    /// Prefill tokens the engines had still to do, per worker, sampled each second of the
    /// measured window.
    backlog: Vec<f64>,
    /// Tokens the engines served to each class in the measured window: a request's prompt
    /// when its prefill completes (its first token), its output tokens as they are decoded
    /// (counted at each `progressed`, every 32, and at completion).
    served: Vec<u64>,
    /// The whole run, sampled every [`TRACE_EVERY`] model seconds.
    trace: Vec<Sample>,
    /// Wall seconds behind the schedule at each model event handled, sorted.
    driver_lag: Vec<f64>,
    /// Route requests that waited in a replica's queue (the routers' count).
    waited: u64,
    bus: BusStats,
}

/// How often the run is sampled for the trace (`ADMISSION_TRACE=1`).
const TRACE_EVERY: f64 = 5.0;

/// The state of a run at one moment, for the trace.
#[derive(Clone, Debug, Default)]
struct Sample {
    t: f64,
    /// Per worker: prefill tokens still to do, requests queued in the engine, running.
    backlog: f64,
    queued: f64,
    running: f64,
    /// Per class, since the start: routed, refused, tokens served.
    routed: Vec<u64>,
    refused: Vec<u64>,
    served: Vec<u64>,
}

/// A route decision's answer: the request, and its worker or a refusal (429).
type Answer = (usize, Result<usize, RouteRequestError>);

/// Runs one case in real time on `requests` and measures it.
async fn run(
    case: Case,
    plan: Plan,
    requests: Arc<Vec<Arrival>>,
    deployment: String,
    url: String,
) -> Measured {
    let bus = match case.setting {
        Setting::Shared => Some(url.as_str()),
        Setting::Isolated => None,
    };
    let fleet = Fleet::start(
        router_config(&deployment, &case),
        REPLICAS,
        plan.workers,
        bus,
    )
    .await;
    let names: Vec<&'static str> = case.classes.iter().map(|c| c.name).collect();

    let bands: Vec<u8> = case.classes.iter().map(|c| c.band).collect();
    let mut workers: Vec<Worker> = (0..plan.workers)
        .map(|_| {
            let worker = Worker::new(plan.engine);
            if case.engine_priority {
                worker.with_priorities()
            } else {
                worker
            }
        })
        .collect();
    let n = requests.len();
    let mut fates = vec![Fate::default(); n];
    let mut happened = Vec::new();
    let mut driver_lag = Vec::new();
    let mut backlog = Vec::new();
    let mut next_sample = plan.warmup;
    let classes = case.classes.len();
    let mut served = vec![0u64; classes];
    let mut reported = vec![0u32; n];
    let mut now = Sample {
        routed: vec![0; classes],
        refused: vec![0; classes],
        served: vec![0; classes],
        ..Sample::default()
    };
    let mut trace = Vec::new();
    let mut next_trace = 0.0;
    let (tx, mut rx) = mpsc::unbounded_channel::<Answer>();
    let mut answers: Vec<Answer> = Vec::new();
    let mut next = 0usize;
    let mut pending = 0usize;
    let start = Instant::now();

    // Real time: the model's events happen when the wall clock reaches them; a route
    // decision's answer places its request on its worker when it comes.
    loop {
        let wall = start.elapsed().as_secs_f64();
        loop {
            let arrival = requests.get(next).map(|a| a.request.arrival);
            let Some((t, step)) = next_event(&workers, arrival) else {
                break;
            };
            if t > wall {
                break;
            }
            driver_lag.push(wall - t);
            while next_trace <= t {
                let per_worker = |f: &dyn Fn(&Worker) -> f64| {
                    workers.iter().map(f).sum::<f64>() / plan.workers as f64
                };
                now.t = next_trace;
                now.backlog = per_worker(&|w| w.prefill_waiting() as f64);
                now.queued = per_worker(&|w| w.queued_and_running().0 as f64);
                now.running = per_worker(&|w| w.queued_and_running().1 as f64);
                trace.push(now.clone());
                next_trace += TRACE_EVERY;
            }
            while next_sample <= t && next_sample < plan.measure_end {
                let waiting: u64 = workers.iter().map(Worker::prefill_waiting).sum();
                backlog.push(waiting as f64 / plan.workers as f64);
                next_sample += 1.0;
            }
            match step {
                None => {
                    let index = next;
                    next += 1;
                    let a = requests[index];
                    let scheduler = fleet.routers[a.replica].scheduler().clone();
                    let request = RouteRequest::new(request_id(index), a.request.prompt)
                        .with_cached_tokens(a.request.cached)
                        .with_class(names[a.class]);
                    let tx = tx.clone();
                    pending += 1;
                    tokio::spawn(async move {
                        let answer = scheduler
                            .route(request)
                            .await
                            .map(|d| worker_index(d.booking.worker));
                        let _ = tx.send((index, answer));
                    });
                }
                Some(w) => {
                    workers[w].end_step(plan.in_window(t), &mut happened);
                    for h in happened.drain(..) {
                        let (index, tokens) = match h {
                            Happened::FirstToken(i) => {
                                fates[i].first_token = t;
                                reported[i] = 1;
                                (i, requests[i].request.prompt + 1)
                            }
                            Happened::Completed(i) => {
                                fates[i].completed = t;
                                let output = requests[i].request.output;
                                let more = output.saturating_sub(reported[i]);
                                reported[i] = output;
                                (i, more)
                            }
                            Happened::Progress(i, produced) => {
                                let more = produced - reported[i];
                                reported[i] = produced;
                                (i, more)
                            }
                        };
                        let class = requests[index].class;
                        now.served[class] += u64::from(tokens);
                        if plan.in_window(t) {
                            served[class] += u64::from(tokens);
                        }
                        fleet.feed.happened(h, w, requests[index].replica);
                    }
                }
            }
        }
        // The answers that came, placed now: after every model event up to now.
        while let Ok(answer) = rx.try_recv() {
            answers.push(answer);
        }
        for (index, answer) in answers.drain(..) {
            pending -= 1;
            let a = requests[index];
            let fate = &mut fates[index];
            fate.decided = wall;
            match answer {
                Ok(w) => {
                    now.routed[a.class] += 1;
                    fate.worker = w;
                    let admission = Admission {
                        prompt: a.request.prompt,
                        cached: a.request.cached,
                        class: Some(names[a.class]),
                        ..Admission::default()
                    };
                    fleet.feed.admitted(index, admission, w, a.replica);
                    workers[w].arrive_with_priority(wall, index, a.request, bands[a.class]);
                }
                Err(RouteRequestError::Overloaded { .. }) => {
                    now.refused[a.class] += 1;
                    fate.refused = true;
                }
                Err(other) => panic!("{}: request {index}: {other}", case.label()),
            }
        }
        let arrival = requests.get(next).map(|a| a.request.arrival);
        let coming = next_event(&workers, arrival);
        if next == n && pending == 0 {
            break;
        }
        match coming {
            Some((t, _)) => {
                let due = start + Duration::from_secs_f64(t);
                tokio::select! {
                    answer = rx.recv() => answers.extend(answer),
                    () = tokio::time::sleep_until(due) => {}
                }
            }
            None => answers.extend(rx.recv().await),
        }
    }

    // Every request has its answer: the model runs on alone, as fast as it computes, until
    // every measured routed request has completed.
    let measured_open = |fates: &[Fate]| {
        fates
            .iter()
            .zip(requests.iter())
            .filter(|(f, a)| {
                plan.in_window(a.request.arrival) && f.worker != usize::MAX && f.completed.is_nan()
            })
            .count()
    };
    let mut open = measured_open(&fates);
    while open > 0 {
        let Some((t, Some(w))) = next_event(&workers, None) else {
            break;
        };
        if t > plan.end + MAX_DRAIN {
            break;
        }
        workers[w].end_step(plan.in_window(t), &mut happened);
        for h in happened.drain(..) {
            match h {
                Happened::FirstToken(i) => fates[i].first_token = t,
                Happened::Completed(i) => {
                    fates[i].completed = t;
                    open -= usize::from(
                        plan.in_window(requests[i].request.arrival)
                            && fates[i].worker != usize::MAX,
                    );
                }
                Happened::Progress(..) => {}
            }
        }
    }

    let window = plan.measure_end - plan.warmup;
    let mut measured = Measured {
        fates,
        utilisation: workers.iter().map(|w| w.prefill_busy / window).collect(),
        backlog,
        served,
        trace,
        ..Measured::default()
    };
    driver_lag.sort_by(f64::total_cmp);
    measured.driver_lag = driver_lag;
    measured.waited = fleet.sum(|r| r.scheduler().stats().admission_waited);
    measured.bus = fleet.shutdown().await;
    measured
}

/// The figures of one class in one case.
#[derive(Clone, Copy, Debug, Default)]
struct ClassRow {
    /// Requests that arrived in the measured window, routed, refused.
    offered: usize,
    routed: usize,
    refused: usize,
    /// Tokens served in the window (see [`Measured::served`]).
    served: u64,
    /// Prompt + output tokens of the requests completed in the window (whenever they
    /// arrived).
    work: u64,
    completed: usize,
    ttft_p50: f64,
    ttft_p99: f64,
    wait_p99: f64,
    /// Routed requests without a first token when the run ended (counted with the time so
    /// far).
    cut: usize,
}

fn class_rows(m: &Measured, requests: &[Arrival], plan: Plan, classes: usize) -> Vec<ClassRow> {
    let mut rows = vec![ClassRow::default(); classes];
    let mut ttft: Vec<Vec<f64>> = vec![Vec::new(); classes];
    let mut wait: Vec<Vec<f64>> = vec![Vec::new(); classes];
    let last = plan.end + MAX_DRAIN;
    for (f, a) in m.fates.iter().zip(requests) {
        let row = &mut rows[a.class];
        if plan.in_window(f.completed) {
            row.work += u64::from(a.request.prompt + a.request.output);
            row.completed += 1;
        }
        if !plan.in_window(a.request.arrival) {
            continue;
        }
        row.offered += 1;
        if f.refused {
            row.refused += 1;
            continue;
        }
        row.routed += 1;
        wait[a.class].push(f.decided - a.request.arrival);
        if f.first_token.is_nan() {
            row.cut += 1;
        }
        let first = if f.first_token.is_nan() {
            last
        } else {
            f.first_token
        };
        ttft[a.class].push(first - a.request.arrival);
    }
    for (k, row) in rows.iter_mut().enumerate() {
        row.served = m.served[k];
        row.ttft_p50 = ms_percentile(&ttft[k], 0.5);
        row.ttft_p99 = ms_percentile(&ttft[k], 0.99);
        row.wait_p99 = ms_percentile(&wait[k], 0.99);
    }
    rows
}

/// Prints a case's lines; returns its class rows.
fn report(
    case: &Case,
    m: &Measured,
    requests: &[Arrival],
    plan: Plan,
    capacity: f64,
) -> Vec<ClassRow> {
    let rows = class_rows(m, requests, plan, case.classes.len());
    let total_work: u64 = rows.iter().map(|r| r.work).sum();
    let total_served: u64 = rows.iter().map(|r| r.served).sum();
    let total_weight: f64 = case.classes.iter().map(|c| c.weight).sum();
    // Weights share within a band: a configured share only where every class is in one.
    let one_band = case.classes.iter().all(|c| c.band == case.classes[0].band);
    for (class, row) in case.classes.iter().zip(&rows) {
        println!(
            "admission_class {} class={} band={} weight={} offered_load={:.0}% ingress={} \
             offered={} routed={} refused={} refused_share={:.3} served_share={:.3} \
             configured_share={} completed={} completed_work_share={:.3} ttft_p50_ms={:.0} ttft_p99_ms={:.0} queue_wait_p99_ms={:.0} \
             cut={}",
            case.label(),
            class.name,
            class.band,
            class.weight,
            class.stream.load * 100.0,
            class.stream.ingress.describe(),
            row.offered,
            row.routed,
            row.refused,
            row.refused as f64 / row.offered.max(1) as f64,
            row.served as f64 / total_served.max(1) as f64,
            if one_band {
                format!("{:.3}", class.weight / total_weight)
            } else {
                "none".into()
            },
            row.completed,
            row.work as f64 / total_work.max(1) as f64,
            row.ttft_p50,
            row.ttft_p99,
            row.wait_p99,
            row.cut,
        );
    }
    if env("ADMISSION_TRACE", 0u8) != 0 {
        for pair in m.trace.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let delta = |x: &[u64], y: &[u64]| -> Vec<u64> {
                x.iter().zip(y).map(|(x, y)| y - x).collect()
            };
            let served = delta(&a.served, &b.served);
            let total: u64 = served.iter().sum();
            println!(
                "admission_trace {} t={:.0} backlog_per_worker={:.0} queued_per_worker={:.1} \
                 running_per_worker={:.1} routed={:?} refused={:?} served_share={:?}",
                case.label(),
                b.t,
                b.backlog,
                b.queued,
                b.running,
                delta(&a.routed, &b.routed),
                delta(&a.refused, &b.refused),
                served
                    .iter()
                    .map(|s| (*s as f64 / total.max(1) as f64 * 1000.0).round() / 1000.0)
                    .collect::<Vec<_>>(),
            );
        }
    }
    let window = plan.measure_end - plan.warmup;
    let completed: usize = rows.iter().map(|r| r.completed).sum();
    let util_min = m.utilisation.iter().copied().fold(f64::MAX, f64::min);
    let util_max = m.utilisation.iter().copied().fold(0.0, f64::max);
    let backlog_mean = m.backlog.iter().sum::<f64>() / m.backlog.len().max(1) as f64;
    println!(
        "admission_case {} completed_per_s={:.1} completed_vs_capacity={:.2} util_min={:.2} \
         util_max={:.2} engine_prefill_backlog_per_worker_mean={:.0} first={:.0} last={:.0} \
         waited={} driver_lag_p99_ms={:.1} bus_events={} bus_lag_mean_ms={:.2} dropped={}",
        case.label(),
        completed as f64 / window,
        completed as f64 / window / capacity,
        util_min,
        util_max,
        backlog_mean,
        m.backlog.first().copied().unwrap_or(0.0),
        m.backlog.last().copied().unwrap_or(0.0),
        m.waited,
        ms_percentile(&m.driver_lag, 0.99),
        m.bus.lag_count,
        m.bus.lag_sum / m.bus.lag_count.max(1) as f64 * 1000.0,
        m.bus.dropped,
    );
    rows
}

fn main() {
    common::run(bench());
}

async fn bench() {
    let quick = env("ADMISSION_QUICK", 0u8) != 0;
    let seed: u64 = env("ADMISSION_SEED", 1);
    let measure: f64 = env("ADMISSION_SECONDS", if quick { 15.0 } else { 40.0 });
    let warmup: f64 = env("ADMISSION_WARMUP", if quick { 15.0 } else { 40.0 });
    let tail: f64 = env("ADMISSION_TAIL", if quick { 3.0 } else { 5.0 });
    // Real time: model second = wall second.
    let plan = Plan {
        speedup: Some(1.0),
        ..Plan::new(WORKERS, ENGINE, warmup, measure, tail)
    };
    let began = std::time::Instant::now();
    println!("{}", common::machine());
    let per_worker = model::saturated_throughput(ENGINE, seed, MIX);
    let capacity = per_worker * WORKERS as f64;
    let defaults = AdmissionConfig::default();
    println!(
        "admission_model workers={WORKERS} replicas={REPLICAS} capacity_rps={capacity:.1} \
         (saturated worker {per_worker:.2} requests/s) seed={seed} warmup_s={warmup} \
         measured_s={measure} tail_s={tail} policy=weighted_cost saturation={:?} queue={:?} \
         engine={ENGINE:?} mix={MIX:?}",
        defaults.saturation(),
        defaults.queue(),
    );

    let saturation = SaturationConfig::default();
    // One step's token budget: the engines never hold more than one step of prefill
    // waiting (the priority case's second setting).
    let tight = saturation.with_max_prefill_tokens_per_worker(u64::from(ENGINE.chunk_tokens));
    let fair = |setting| Case {
        name: "fair".into(),
        setting,
        saturation,
        classes: vec![
            Class {
                name: "heavy",
                band: 0,
                weight: 4.0,
                stream: HEAVY,
            },
            Class {
                name: "light",
                band: 0,
                weight: 1.0,
                stream: LIGHT,
            },
        ],
        engine_priority: false,
    };
    let high = Class {
        name: "high",
        band: 1,
        weight: 1.0,
        stream: LIGHT,
    };
    let low = Class {
        name: "low",
        band: 0,
        weight: 1.0,
        stream: HEAVY,
    };
    let overload = Case {
        name: "priority_overload".into(),
        setting: Setting::Shared,
        classes: vec![high.clone(), low],
        saturation,
        engine_priority: false,
    };
    let overload_tight = Case {
        name: "priority_overload_tight".into(),
        saturation: tight,
        ..overload.clone()
    };
    let overload_engine = Case {
        name: "priority_overload_engine_priority".into(),
        engine_priority: true,
        ..overload.clone()
    };
    // The KV criterion on, at the engines' real KV capacity and its default share (0.9)...
    let with_kv_share = |share: f64, name: String| Case {
        name,
        saturation: saturation
            .with_kv_capacity_tokens(ENGINE.kv_capacity)
            .with_max_kv_share(share),
        ..overload_engine.clone()
    };
    let overload_engine_kv = with_kv_share(
        SaturationConfig::default().max_kv_share(),
        "priority_overload_engine_priority_kv".into(),
    );
    // ... and at lower shares: the KV the low band may hold is what each of the high band's
    // steps reads, and the batch its prefill joins.
    let shares: Vec<f64> = std::env::var("ADMISSION_KV_SHARES")
        .unwrap_or_else(|_| "0.8,0.7,0.6,0.5".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let sweep: Vec<Case> = shares
        .iter()
        .map(|&share| {
            with_kv_share(
                share,
                format!("priority_overload_engine_priority_kv{:.0}", share * 100.0),
            )
        })
        .collect();
    let unloaded = Case {
        name: "priority_unloaded".into(),
        setting: Setting::Shared,
        classes: vec![high],
        saturation,
        engine_priority: false,
    };
    let only = std::env::var("ADMISSION_ONLY").unwrap_or_default();
    assert!(
        ["", "kv_shares"].contains(&only.as_str()),
        "ADMISSION_ONLY={only}: the one selection is kv_shares"
    );
    let groups: Vec<Vec<Case>> = if only == "kv_shares" {
        let mut group = sweep.clone();
        group.extend([overload_engine_kv.clone(), unloaded.clone()]);
        vec![group]
    } else if quick {
        vec![vec![
            fair(Setting::Shared),
            fair(Setting::Isolated),
            overload,
            overload_tight,
            overload_engine,
            overload_engine_kv,
            unloaded,
        ]]
    } else {
        vec![
            vec![fair(Setting::Shared), fair(Setting::Isolated)],
            vec![
                overload,
                overload_tight,
                overload_engine,
                overload_engine_kv,
                unloaded,
            ],
            sweep.clone(),
        ]
    };

    let server = common::bench_server().await;
    let url = server.server.url();
    let mut results: Vec<(Case, Vec<ClassRow>)> = Vec::new();
    let mut measured: Vec<(Case, Measured)> = Vec::new();
    let mut i = 0;
    for group in groups {
        let requests: Vec<_> = group
            .iter()
            .map(|case| Arc::new(arrivals(seed, capacity, plan.end, &case.classes)))
            .collect();
        let runs = at_once(group.iter().zip(&requests).map(|(case, requests)| {
            i += 1;
            let deployment = format!("adm-{i}");
            run(
                case.clone(),
                plan,
                requests.clone(),
                deployment,
                url.clone(),
            )
        }))
        .await;
        for ((case, requests), m) in group.into_iter().zip(&requests).zip(runs) {
            let rows = report(&case, &m, requests, plan, capacity);
            results.push((case.clone(), rows));
            measured.push((case, m));
        }
    }

    let find = |name: &str, setting: Setting| {
        results
            .iter()
            .find(|(c, _)| c.name == name && c.setting == setting)
            .map(|(c, rows)| (c, rows))
    };
    let error = |(case, rows): (&Case, &Vec<ClassRow>), k: usize| {
        let total: u64 = rows.iter().map(|r| r.served).sum();
        let weights: f64 = case.classes.iter().map(|c| c.weight).sum();
        let share = rows[k].served as f64 / total.max(1) as f64;
        let configured = case.classes[k].weight / weights;
        (share - configured).abs() / configured
    };
    if let (Some(shared), Some(isolated)) = (
        find("fair", Setting::Shared),
        find("fair", Setting::Isolated),
    ) {
        println!(
            "fair_share_error={:.3} fair_share_error_isolated={:.3} (heavy class; light class: \
         {:.3} shared, {:.3} isolated)",
            error(shared, 0),
            error(isolated, 0),
            error(shared, 1),
            error(isolated, 1),
        );
    }
    // The engines' prefill backlog at the window's end against the saturation threshold:
    // what the admission let pile up on the workers.
    let backlog = |name: &str, setting: Setting| {
        let (case, m) = measured
            .iter()
            .find(|(c, _)| c.name == name && c.setting == setting)?;
        Some(
            m.backlog.last().copied().unwrap_or(0.0)
                / case.saturation.max_prefill_tokens_per_worker() as f64,
        )
    };
    if let (Some(shared), Some(isolated)) = (
        backlog("fair", Setting::Shared),
        backlog("fair", Setting::Isolated),
    ) {
        println!(
            "fair_backlog_end_vs_threshold={shared:.2} \
             fair_backlog_end_vs_threshold_isolated={isolated:.2}",
        );
    }
    let alone = find("priority_unloaded", Setting::Shared)
        .expect("the unloaded case runs in every selection")
        .1[0]
        .ttft_p99;
    // Each overload case's high band against its p99 alone, with what the case completed.
    let window = plan.measure_end - plan.warmup;
    let mut keys: Vec<(String, String)> = [
        (
            "priority_overload",
            "priority_ttft_p99_overload_vs_unloaded",
        ),
        (
            "priority_overload_tight",
            "priority_ttft_p99_overload_vs_unloaded_tight",
        ),
        (
            "priority_overload_engine_priority",
            "priority_ttft_p99_overload_vs_unloaded_engine_priority",
        ),
        (
            "priority_overload_engine_priority_kv",
            "priority_ttft_p99_overload_vs_unloaded_engine_priority_kv",
        ),
    ]
    .into_iter()
    .map(|(name, key)| (name.to_owned(), key.to_owned()))
    .collect();
    keys.extend(sweep.iter().map(|case| {
        let suffix = case.name.trim_start_matches("priority_overload_");
        (
            case.name.clone(),
            format!("priority_ttft_p99_overload_vs_unloaded_{suffix}"),
        )
    }));
    for (name, key) in keys {
        let Some((case, rows)) = find(&name, Setting::Shared) else {
            continue;
        };
        let over = rows[0].ttft_p99;
        let completed: usize = rows.iter().map(|r| r.completed).sum();
        println!(
            "{key}={:.2} (high band p99 TTFT {over:.0} ms under overload at {}, {alone:.0} ms \
             alone; backlog at the end {:.2}x the threshold; completed {:.2}x capacity, low \
             band refused {:.3})",
            over / alone,
            case.thresholds(),
            backlog(&name, Setting::Shared).unwrap_or(0.0),
            completed as f64 / window / capacity,
            rows[1].refused as f64 / rows[1].offered.max(1) as f64,
        );
    }
    println!("admission_wall_s={:.1}", began.elapsed().as_secs_f64());
}

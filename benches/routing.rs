//! What the bus is worth: R router replicas route one model deployment, sharing leases over
//! the bus or not (`cargo bench --bench routing`; BENCHMARKS.md has the figures).
//!
//! # Settings, on the same arrivals
//! - **shared**: the model's workers publish real lease events with [`LeasePublisher`]s (one
//!   per worker: `admitted` with prompt and cached tokens when a request reaches the worker,
//!   `progressed` at the first token and every 32 output tokens, `completed`) on a private
//!   nats-server; each replica is a real `Router` fed by a real `NatsIngress`, and decides
//!   with the route API, its own decisions booked at once (provisional bookings). The bus's
//!   delay is in the result: this setting runs in real time (model second = wall second).
//! - **isolated**: each replica learns only about the requests it routed (admission,
//!   progress, completion, at once, as a proxy in their response path would), nothing of the
//!   others': a `Router` with `NoIngress` fed through its manager.
//! - **single**: one replica routes every request and learns every event at once: the bound.
//!
//! Without a bus a result does not depend on wall time, so isolated and single run as fast as
//! they compute. Arrival i goes to replica i mod R (a front balancer taking turns).
//!
//! # Policies
//! round robin, random, least bookings (fewest bookings, then fewest tokens), weighted cost
//! (prefill 1, KV 0.25: the crate's default) and power of two on it, each through
//! `SchedulerHandle::route`. The routers are not told output lengths.
//!
//! # The deployment model (`routing/model.rs`)
//! 8 workers, each an engine serving an 8B-class model (Llama-3.1-8B, bf16) on one
//! A100-80GB-class GPU, stepped like vLLM or SGLang with chunked prefill: each step gives one
//! token to every decoding sequence and the rest of a 2,048-token budget to prefill chunks,
//! first come first served; a queued request joins the batch while fewer than 256 sequences
//! run (vLLM's default `max_num_seqs`) and its prompt fits in 400,000 KV tokens. A step
//! takes 8 ms (the 16 GB of weights read once at ~2 TB/s) + prefill tokens / 10,000 per s
//! (~16 GFLOP per token at ~160 TFLOP/s, half the A100's dense bf16 peak) + KV tokens held /
//! 15,000,000 per s (128 KiB of KV per token, 32 layers x 8 KV heads x 128 x 2 x 2 bytes, read
//! at ~2 TB/s). 400,000 KV tokens is what ~52 GB left after weights holds at 128 KiB. Time to
//! first token = end of the step that finishes the prefill - arrival.
//!
//! Requests: prompt and output lengths lognormal around the medians of the conversation
//! service of the Azure LLM inference trace 2023 (Splitwise, Patel et al., ISCA 2024: median
//! prompt 1,020 tokens, median output 129), sigma 1 (assumed: a long tail, p99 about 10x
//! the median), capped at 16,384 and 2,048. ShareGPT (vLLM paper: mean prompt 161, output
//! 338 tokens) and LMSYS-Chat-1M (mean 69.5 / 214.5) have far shorter prompts, for which
//! prefill, and so routing, matters less; the conversation trace is the harder case. Half the
//! requests start with a prefix every worker has cached (a shared system prompt, earlier
//! turns), 50-90% of their prompt: an assumption, of the order of the prefix reuse SGLang's
//! RadixAttention and Mooncake papers report for chat.
//!
//! Capacity is measured, not assumed: one worker kept saturated with this mix completes
//! `capacity / 8` requests a second (printed). Arrivals are Poisson at 50%, 80% and 95% of
//! it; the same seed gives the same requests in the same order at every load (only the gaps
//! scale), and the same arrivals to every setting and policy.
//!
//! # The run
//! Warm-up 10 s, then requests arriving over 40 s are measured; the routers go on deciding
//! 5 s more, then the model runs on alone (arrivals placed in turn, no routing) until every
//! measured request has completed, so the request latency covers every measured request.
//! The shared cases of one load run at once on one nats-server (each its own deployment),
//! the three loads one after another: about 3 minutes. The bench prints the bus's
//! publish-to-apply lag and how late the driver ran, since both add to the delay the shared
//! replicas see.
//!
//! Output: one `routing setting=... replicas=... load=... policy=...` line per case (p50/p99
//! TTFT and request latency in ms; prefill utilisation of the least and most busy worker in
//! the measured window), the best policy per setting at 4 replicas and 80% load,
//! `routing_ttft_p99_bus_vs_isolated=` and `routing_ttft_p99_bus_vs_single=` there (each
//! setting with its own best policy), and the plot `benches/results/routing_ttft_p99.svg`.
//!
//! Environment: `ROUTING_SEED` (1), `ROUTING_SECONDS` (measured, 40), `ROUTING_WARMUP` (10),
//! `ROUTING_TAIL` (5), `ROUTING_SPEEDUP` (model seconds per wall second for the shared
//! setting, 1), `ROUTING_PLOT` (the SVG's path), `ROUTING_QUICK=1` (80% load, 4 replicas,
//! round robin and weighted cost, 15 s: about 25 s), `ROUTING_LOST=share` (only the phantom
//! booking comparison: that share of routed requests never reaches its worker, with the
//! provisional deadline and without; see `lost_requests`).
//!
//! [`LeasePublisher`]: lease_router::LeasePublisher
mod common;
#[path = "routing/fleet.rs"]
mod fleet;
#[path = "routing/model.rs"]
mod model;
#[path = "routing/plot.rs"]
mod plot;
#[path = "routing/sim.rs"]
mod sim;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use fleet::{at_once, env, ms_percentile, BusStats, Plan, MAX_DRAIN};
use lease_router::DEFAULT_PROVISIONAL_DEADLINE;
use model::{Request, ENGINE, MIX};
use sim::{Case, Measured, Policy, Setting};

const WORKERS: usize = 8;
const LOADS: [f64; 3] = [0.5, 0.8, 0.95];
const REPLICAS: [usize; 3] = [1, 2, 4];
/// Where the pinned figures are taken.
const PIN_REPLICAS: usize = 4;
const PIN_LOAD: f64 = 0.8;

/// The figures of one case.
#[derive(Clone, Copy, Debug)]
struct Row {
    requests: usize,
    ttft_p50: f64,
    ttft_p99: f64,
    latency_p50: f64,
    latency_p99: f64,
    util_min: f64,
    util_max: f64,
    /// Measured requests with no first token / not finished when the run ended (their
    /// time so far is counted: the percentiles are then lower bounds).
    cut: (usize, usize),
}

impl Row {
    fn of(m: &Measured) -> Self {
        let util_min = m.utilisation.iter().copied().fold(f64::MAX, f64::min);
        let util_max = m.utilisation.iter().copied().fold(0.0, f64::max);
        Row {
            requests: m.ttft.len(),
            ttft_p50: ms_percentile(&m.ttft, 0.5),
            ttft_p99: ms_percentile(&m.ttft, 0.99),
            latency_p50: ms_percentile(&m.latency, 0.5),
            latency_p99: ms_percentile(&m.latency, 0.99),
            util_min,
            util_max,
            cut: (m.no_first_token, m.unfinished),
        }
    }
}

type Key = (Setting, usize, u32, Policy);

fn key(case: &Case) -> Key {
    (
        case.setting,
        case.replicas,
        (case.load * 100.0).round() as u32,
        case.policy,
    )
}

fn print_row(case: &Case, row: &Row) {
    println!(
        "routing setting={} replicas={} load={:.0}% policy={} requests={} ttft_p50_ms={:.0} \
         ttft_p99_ms={:.0} latency_p50_ms={:.0} latency_p99_ms={:.0} util_min={:.2} \
         util_max={:.2} util_spread={:.2} cut={}/{}",
        case.setting.name(),
        case.replicas,
        case.load * 100.0,
        case.policy.name(),
        row.requests,
        row.ttft_p50,
        row.ttft_p99,
        row.latency_p50,
        row.latency_p99,
        row.util_min,
        row.util_max,
        row.util_max - row.util_min,
        row.cut.0,
        row.cut.1,
    );
}

fn main() {
    common::run(run());
}

async fn run() {
    let quick = env("ROUTING_QUICK", 0u8) != 0;
    let seed: u64 = env("ROUTING_SEED", 1);
    let measure: f64 = env("ROUTING_SECONDS", if quick { 15.0 } else { 40.0 });
    let warmup: f64 = env("ROUTING_WARMUP", if quick { 5.0 } else { 10.0 });
    let tail: f64 = env("ROUTING_TAIL", if quick { 3.0 } else { 5.0 });
    let speedup: f64 = env("ROUTING_SPEEDUP", 1.0);
    let plot_path: PathBuf = env(
        "ROUTING_PLOT",
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/results/routing_ttft_p99.svg"
        )),
    );
    let plan = Plan::new(WORKERS, ENGINE, warmup, measure, tail);
    let began = Instant::now();
    println!("{}", common::machine());
    let per_worker = model::saturated_throughput(ENGINE, seed, MIX);
    let capacity = per_worker * WORKERS as f64;
    println!(
        "routing_model workers={WORKERS} capacity_rps={capacity:.1} (saturated worker \
         {per_worker:.2} requests/s) seed={seed} warmup_s={warmup} measured_s={measure} \
         tail_s={tail} speedup={speedup} engine={ENGINE:?} mix={MIX:?}"
    );

    let phantom: f64 = env("ROUTING_LOST", 0.0);
    if phantom > 0.0 {
        return lost_requests(phantom, plan, speedup, seed, capacity).await;
    }

    let loads: Vec<f64> = if quick {
        vec![PIN_LOAD]
    } else {
        LOADS.to_vec()
    };
    let replicas: Vec<usize> = if quick {
        vec![PIN_REPLICAS]
    } else {
        REPLICAS.to_vec()
    };
    let policies: Vec<Policy> = if quick {
        vec![Policy::RoundRobin, Policy::WeightedCost]
    } else {
        Policy::ALL.to_vec()
    };
    let mut requests: BTreeMap<u32, Arc<Vec<Request>>> = BTreeMap::new();
    for &load in &loads {
        let r = model::arrivals(seed, load * capacity, plan.end + MAX_DRAIN, MIX);
        requests.insert((load * 100.0).round() as u32, Arc::new(r));
    }
    let mut cases = Vec::new();
    for &load in &loads {
        for &policy in &policies {
            cases.push(Case {
                setting: Setting::Single,
                policy,
                replicas: 1,
                load,
                lost: 0.0,
                provisional_deadline: Some(DEFAULT_PROVISIONAL_DEADLINE),
            });
            for &r in &replicas {
                for setting in [Setting::Shared, Setting::Isolated] {
                    cases.push(Case {
                        setting,
                        policy,
                        replicas: r,
                        load,
                        lost: 0.0,
                        provisional_deadline: Some(DEFAULT_PROVISIONAL_DEADLINE),
                    });
                }
            }
        }
    }
    let arrivals = |case: &Case| requests[&((case.load * 100.0).round() as u32)].clone();

    // Without a bus, a result does not depend on wall time: those run as fast as they
    // compute, one after another, before the real-time ones.
    let mut rows: BTreeMap<Key, Row> = BTreeMap::new();
    for (i, case) in cases
        .iter()
        .filter(|c| c.setting != Setting::Shared)
        .enumerate()
    {
        let m = sim::run(*case, plan, arrivals(case), format!("direct-{i}"), None).await;
        let row = Row::of(&m);
        print_row(case, &row);
        rows.insert(key(case), row);
    }
    println!(
        "routing_direct_done wall_s={:.1}",
        began.elapsed().as_secs_f64()
    );

    // The shared cases all at once, in real time, on one nats-server: each its own
    // deployment (subjects), replicas and publishers.
    let server = common::bench_server().await;
    let url = server.server.url();
    let shared_plan = Plan {
        speedup: Some(speedup),
        ..plan
    };
    let shared: Vec<Case> = cases
        .iter()
        .copied()
        .filter(|c| c.setting == Setting::Shared)
        .collect();
    let cpu_before = common::cpu_time(None);
    let nats_cpu_before = common::cpu_time(server.server.pid());
    let wall = Instant::now();
    let mut lag = Vec::new();
    let mut bus = BusStats::default();
    // One load at a time: all of a load's cases at once would load the bus (and these two
    // cores) more than one deployment's routers ever would.
    for &load in &loads {
        let group: Vec<(usize, Case)> = shared
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, c)| c.load == load)
            .collect();
        let measured = at_once(group.iter().map(|(i, case)| {
            sim::run(
                *case,
                shared_plan,
                arrivals(case),
                format!("shared-{i}"),
                Some(url.clone()),
            )
        }))
        .await;
        for ((_, case), m) in group.iter().zip(measured) {
            let row = Row::of(&m);
            print_row(case, &row);
            rows.insert(key(case), row);
            lag.extend_from_slice(&m.driver_lag);
            bus += m.bus;
        }
    }
    let wall = wall.elapsed().as_secs_f64();
    lag.sort_by(f64::total_cmp);
    let applied = bus.lag_count.max(1) as f64;
    println!(
        "routing_bus events_applied={} mean_publish_to_apply_ms={:.3} within_1ms={:.3} \
         within_5ms={:.3} dropped={} driver_lag_p50_ms={:.2} driver_lag_p99_ms={:.2} \
         driver_lag_max_ms={:.1} cases={} wall_s={wall:.1} bench_cpu_s={:.1} nats_cpu_s={:.1}",
        bus.lag_count,
        bus.lag_sum / applied * 1000.0,
        bus.lag_1ms as f64 / applied,
        bus.lag_5ms as f64 / applied,
        bus.dropped,
        ms_percentile(&lag, 0.5),
        ms_percentile(&lag, 0.99),
        lag.last().copied().unwrap_or(0.0) * 1000.0,
        shared.len(),
        (common::cpu_time(None) - cpu_before).as_secs_f64(),
        (common::cpu_time(server.server.pid()) - nats_cpu_before).as_secs_f64(),
    );

    report(&rows, &loads, &policies, &plot_path);
    println!("routing_wall_s={:.1}", began.elapsed().as_secs_f64());
}

/// The best policy of a setting: the lowest p99 TTFT at the pinned point.
fn best(
    rows: &BTreeMap<Key, Row>,
    setting: Setting,
    replicas: usize,
    policies: &[Policy],
) -> Policy {
    let pin = (PIN_LOAD * 100.0).round() as u32;
    *policies
        .iter()
        .min_by(|a, b| {
            let p99 = |p: &&Policy| rows[&(setting, replicas, pin, **p)].ttft_p99;
            p99(a).total_cmp(&p99(b))
        })
        .expect("a policy")
}

fn report(rows: &BTreeMap<Key, Row>, loads: &[f64], policies: &[Policy], plot_path: &Path) {
    let pin = (PIN_LOAD * 100.0).round() as u32;
    let shared = best(rows, Setting::Shared, PIN_REPLICAS, policies);
    let isolated = best(rows, Setting::Isolated, PIN_REPLICAS, policies);
    let single = best(rows, Setting::Single, 1, policies);
    let p99 = |s, r, p| rows[&(s, r, pin, p)].ttft_p99;
    let (s, i, o) = (
        p99(Setting::Shared, PIN_REPLICAS, shared),
        p99(Setting::Isolated, PIN_REPLICAS, isolated),
        p99(Setting::Single, 1, single),
    );
    println!(
        "routing_best replicas={PIN_REPLICAS} load={pin}% shared={} ({s:.0} ms) isolated={} \
         ({i:.0} ms) single={} ({o:.0} ms); same policy as shared: isolated {:.0} ms, single \
         {:.0} ms",
        shared.name(),
        isolated.name(),
        single.name(),
        p99(Setting::Isolated, PIN_REPLICAS, shared),
        p99(Setting::Single, 1, shared),
    );
    println!("routing_ttft_p99_bus_vs_isolated={:.3}", s / i);
    println!("routing_ttft_p99_bus_vs_single={:.3}", s / o);

    let line = |setting: Setting, replicas: usize, policy: Policy| {
        let label = format!(
            "{} ({}), {}",
            setting.name(),
            plot::replicas(replicas),
            policy.name()
        );
        plot::Line::over_loads(label, loads, |load| {
            rows[&(setting, replicas, load, policy)].ttft_p99
        })
    };
    let lines = [
        line(Setting::Shared, PIN_REPLICAS, shared),
        line(Setting::Isolated, PIN_REPLICAS, isolated),
        line(Setting::Single, 1, single),
    ];
    let title =
        format!("{WORKERS} workers: p99 TTFT against load, best policy of each setting at {pin}%");
    match plot::p99_ttft(plot_path, &title, &lines, plot::Scale::Linear) {
        Ok(()) => println!("routing_plot={}", plot_path.display()),
        Err(e) => println!("routing_plot_error={e}"),
    }
}

/// `ROUTING_LOST=share`: phantom bookings. Shared setting, 4 replicas, 80% load, weighted
/// cost; each `1 / share`-th request is routed and booked but never reaches its worker.
/// With the provisional deadline (the default, 5 s) the routers release those bookings
/// soon; without it (a deadline of an hour, as a lease lifetime would be) each stays as
/// phantom load on its worker for the whole run.
async fn lost_requests(share: f64, plan: Plan, speedup: f64, seed: u64, capacity: f64) {
    let server = common::bench_server().await;
    let url = server.server.url();
    let shared_plan = Plan {
        speedup: Some(speedup),
        ..plan
    };
    let arrivals = Arc::new(model::arrivals(
        seed,
        PIN_LOAD * capacity,
        plan.end + MAX_DRAIN,
        MIX,
    ));
    let mut p99 = Vec::new();
    for (name, deadline) in [("5s", Some(DEFAULT_PROVISIONAL_DEADLINE)), ("none", None)] {
        let case = Case {
            setting: Setting::Shared,
            policy: Policy::WeightedCost,
            replicas: PIN_REPLICAS,
            load: PIN_LOAD,
            lost: share,
            provisional_deadline: deadline,
        };
        let m = sim::run(
            case,
            shared_plan,
            arrivals.clone(),
            format!("lost-{name}"),
            Some(url.clone()),
        )
        .await;
        let row = Row::of(&m);
        println!(
            "routing_lost share={share} deadline={name} lost={} provisional_expired={} \
             phantom_at_end={} requests={} ttft_p50_ms={:.0} ttft_p99_ms={:.0} \
             latency_p99_ms={:.0} util_min={:.2} util_max={:.2}",
            m.lost,
            m.provisional_expired,
            m.phantom_at_end,
            row.requests,
            row.ttft_p50,
            row.ttft_p99,
            row.latency_p99,
            row.util_min,
            row.util_max,
        );
        p99.push(row.ttft_p99);
    }
    println!(
        "routing_lost_ttft_p99_without_vs_with_deadline={:.2}",
        p99[1] / p99[0]
    );
}

//! What prefix-aware routing is worth, and what the bus is worth to it: the `routing`
//! bench's deployment model with prefix locality (`cargo bench --bench routing_prefix`;
//! BENCHMARKS.md, "Prefix-aware routing (routing_prefix)", has the figures).
//!
//! In the `routing` bench a cached prefix is cached on every worker alike. Here each model
//! worker keeps its own prefix cache, so what a request finds cached, and so the prefill it
//! costs, depends on where it and the requests before it went.
//!
//! # Settings, on the same arrivals (all weighted cost, the crate's default policy)
//! - **shared-load-only**: the `routing` bench's shared setting: workers publish real lease
//!   events on a private nats-server, each replica a real `Router` fed by a `NatsIngress`;
//!   requests are routed without their blocks (`RouteRequest::new(id, prompt)`), so the
//!   decision weighs load only. R = 1, 2, 4.
//! - **shared-prefix**: the same, requests routed with their block hashes
//!   (`with_block_hashes`); every replica's prefix index learns from every `admitted` on
//!   the bus (its first [`MAX_BLOCK_HASHES`] block hashes) and from its own decisions (the
//!   provisional booking enters the index at once, with the same first [`MAX_BLOCK_HASHES`] blocks). R = 1, 2,
//!   4; at R = 4 and 80% also with the hot-worker guard off (`with_affinity_gap(u32::MAX)`)
//!   next to the default ([`DEFAULT_AFFINITY_GAP`]).
//! - **isolated-prefix**: prefix-aware, each replica a `Router` with `NoIngress` fed through
//!   its manager (`admit_current` etc.) with only the requests it routed: its index learns
//!   only from its own decisions, llm-d's active-active case. R = 4.
//! - **single-prefix**: one prefix-aware replica routes everything and learns every event.
//! - **shared-exact**: shared-prefix, and each worker's engine also says what its cache
//!   stores and evicts (wire 1.3 `kv_stored` / `kv_removed`, what `lease-router relay`
//!   publishes from vLLM's KV events): every replica's index takes those as the truth for
//!   the worker, so it follows the engine's evictions instead of its own guess. R = 4.
//!
//! Arrival i goes to replica i mod R, so a session's turns reach replicas at random.
//! Routers are told neither output lengths nor cached tokens (`cached_tokens` is not set):
//! what they count cached comes from their index only. The routers' index holds 25,000
//! blocks a worker, as the engines do (`PrefixIndexConfig::with_worker_capacity`, and each
//! `admitted` says so with `block_capacity`).
//!
//! # The deployment model (`routing/model.rs`)
//! The `routing` bench's: 8 workers, 8B-class model on A100-80GB-class GPUs, vLLM-like steps
//! with chunked prefill (2,048 tokens a step, 256 sequences, 400,000 KV tokens; a step takes
//! 8 ms plus prefill tokens / 10,000 per s plus KV held / 15,000,000 per s). Added: each worker's
//! **prefix cache**, least recently used blocks of 16 tokens named by chained hashes
//! (`lease_router::block_hashes`, the scheme the routers use), 25,000 blocks (its whole
//! 400,000 KV tokens). When a request joins the batch, its cached tokens are its longest
//! prefix of blocks in that cache x 16, at most prompt - 1 (vLLM recomputes the last prompt
//! token for its logits); it prefills only the rest, and its prompt blocks become the most
//! recently used. When it completes, its prompt and output blocks (full blocks) are used
//! again: they go back to the free pool cached, as vLLM's do, so the next turn of a
//! conversation finds the answer cached too. Pinning is not modelled: the blocks of running
//! requests are simply counted in the 25,000 (they are the most recently used, so eviction
//! reaches them only if 25,000 newer blocks arrive while they run, which the 400,000-token
//! KV bound on running requests all but rules out); the cache is thus the whole KV pool,
//! running and free, as in vLLM. A worker's `admitted` (sent when the request reaches it)
//! reports `cached_tokens: Some(what its cache holds of the prompt then)` and the prompt's
//! first 256 block hashes; the engine looks up again when the request joins the batch (the
//! two differ only if the cache changed while the request queued).
//!
//! # The workload (`routing/sessions.rs`)
//! Token ids are synthesized from the seed: a shared system prompt's from its number, a
//! session's or one-off prompt's from its id (uniform over a 128,256-token vocabulary), so
//! two prompts share blocks exactly where they share a prefix.
//! - **Sessions** (70% of requests): multi-turn conversations, each turn's prompt the
//!   conversation so far (previous prompt + previous answer + the new user message). Turns
//!   per session geometric with mean 4 (assumed; LMSYS-Chat-1M reports about 2 turns per
//!   conversation on average and ShareGPT more; 4 is a chat-assistant mix with some long
//!   conversations), ending early before a turn would pass the 16,384-token context. User
//!   messages lognormal, median 256 tokens, sigma 1, at most 4,096 (assumed). Answers
//!   lognormal around the Azure LLM inference trace 2023's conversation median output, 129
//!   tokens, sigma 1, at most 2,048 (as the `routing` bench). Between two turns' arrivals
//!   5 s + an exponential of mean 10 s (assumed: the answer streams for ~3 s, then the user
//!   reads and types); arrivals are open-loop, so a turn may arrive before the previous
//!   answer is done at high load (it then finds less cached). Sessions start as a Poisson
//!   stream from 120 s before time 0 (their earlier turns are not sent), so the mix of
//!   sessions under way is stationary from the start.
//! - **Shared system prompts**: 4, of 2,048, 2,560, 3,072 and 4,096 tokens; each opens 15%
//!   of sessions and of one-off prompts (60% in all; assumed, of the order of the prefix
//!   sharing SGLang's RadixAttention and Mooncake papers report for chat and agents).
//! - **One-off prompts** (30% of requests): optional system prompt, then their own tokens,
//!   lognormal around the conversation trace's median prompt, 1,020 tokens, sigma 1, cut to
//!   the context; a Poisson stream.
//!
//! Capacity is measured with the prefix model, locality-perfect: one worker kept saturated
//! (every request queued at once, in arrival order) with every turn of one session in 8 and
//! one one-off prompt in 8, so every turn reaches the worker that holds its history; its
//! completions a second between the 1,000th and the 5,000th, x 8. The workload at a given
//! rate depends on that rate (think times are fixed), so capacity is found at the rate it
//! predicts, twice (from the `routing` bench's capacity; printed). Loads are 50%, 80% and 95%
//! of it: what a locality-keeping router could serve, so load-only routing may be past its
//! own capacity there (that is the point: prefill it could have saved).
//!
//! # The run
//! Warm-up 30 s (the caches start empty and fill in it; a measured turn whose previous
//! turn came before time 0 finds its history nowhere, about 2% of the follow-up turns), then
//! requests arriving over 40 s are measured, the routers go on 5 s more, then the model runs
//! on alone (arrivals placed in turn) until every measured request has its first token. The
//! bus cases of one load (8 deployments at 80%, 7 at the others) run at once on one
//! nats-server in real time; isolated and single run as fast as they compute: about 4
//! minutes in all.
//!
//! Output: one `routing_prefix setting=... replicas=... load=... gap=...` line per case:
//! p50/p99 time to first token (ms); `hit_rate`, prompt tokens served from cache / prompt
//! tokens, over the measured requests; `history_hit`, the same over the follow-up turns of
//! sessions only; `moved`, the share of follow-up turns sent to another worker than their
//! previous turn; `predicted_hit`, the cached tokens the deciding replicas counted on /
//! prompt tokens; `prefill_tokens` computed (measured requests); the prefill utilisation of
//! the least and most busy worker; the first replica's index at the end. The arrivals' line
//! says what a perfect cache would serve (`reusable`: every prompt's earlier-sent prefix in
//! full blocks). Then at R = 4 and 80% load the pinned lines
//! `prefix_ttft_p99_aware_vs_blind=` (shared-prefix p99 / shared-load-only p99),
//! `prefix_ttft_p99_shared_vs_single=` (shared-prefix / single-prefix),
//! `prefix_hit_shared_vs_isolated=` (hit rates) and `prefix_guard_off_ttft_p99_vs_on=`;
//! at R = 4 and the highest load (95%) `prefix_hit_exact_vs_approx=` (shared-exact's hit
//! rate / shared-prefix's); and the plot `benches/results/routing_prefix_ttft_p99.svg`.
//!
//! Environment: `PREFIX_SEED` (1), `PREFIX_SECONDS` (measured, 40), `PREFIX_WARMUP` (30),
//! `PREFIX_TAIL` (5), `PREFIX_PLOT` (the SVG's path), `PREFIX_QUICK=1` (80% load, R = 4
//! only, 10 s measured: under a minute), `PREFIX_KV_WEIGHT` (the cost's KV weight, for
//! exploring; default the crate's 0.25).
//!
//! [`MAX_BLOCK_HASHES`]: lease_router::wire::MAX_BLOCK_HASHES
//! [`DEFAULT_AFFINITY_GAP`]: lease_router::DEFAULT_AFFINITY_GAP
mod common;
#[path = "routing/fleet.rs"]
mod fleet;
#[path = "routing/model.rs"]
mod model;
#[path = "routing/plot.rs"]
mod plot;
#[path = "routing/prefix_sim.rs"]
mod prefix_sim;
#[path = "routing/sessions.rs"]
mod sessions;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use fleet::{at_once, env, ms_percentile, BusStats, Plan, MAX_DRAIN};
use model::{ENGINE, MIX};
use prefix_sim::{Case, Measured, Setting, BLOCK_SIZE, CACHE_BLOCKS};
use sessions::{Arrival, WORKLOAD};

const WORKERS: usize = 8;
const LOADS: [f64; 3] = [0.5, 0.8, 0.95];
const REPLICAS: [usize; 3] = [1, 2, 4];
const PIN_REPLICAS: usize = 4;
const PIN_LOAD: f64 = 0.8;

#[derive(Clone, Copy, Debug)]
struct Row {
    requests: usize,
    ttft_p50: f64,
    ttft_p99: f64,
    hit: f64,
    history_hit: f64,
    moved: f64,
    predicted_hit: f64,
    prefill_tokens: u64,
    util_min: f64,
    util_max: f64,
    cut: usize,
}

impl Row {
    fn of(m: &Measured) -> Self {
        let prompt = m.prompt_tokens.max(1) as f64;
        Row {
            requests: m.ttft.len(),
            ttft_p50: ms_percentile(&m.ttft, 0.5),
            ttft_p99: ms_percentile(&m.ttft, 0.99),
            hit: m.cached_tokens as f64 / prompt,
            history_hit: m.history_cached as f64 / m.history_prompt.max(1) as f64,
            moved: m.moved as f64 / m.follow_ups.max(1) as f64,
            predicted_hit: m.predicted_cached as f64 / prompt,
            prefill_tokens: m.prompt_tokens - m.cached_tokens,
            util_min: m.utilisation.iter().copied().fold(f64::MAX, f64::min),
            util_max: m.utilisation.iter().copied().fold(0.0, f64::max),
            cut: m.no_first_token,
        }
    }
}

/// `(setting, replicas, load %, guard off)`.
type Key = (Setting, usize, u32, bool);

fn key(case: &Case) -> Key {
    (
        case.setting,
        case.replicas,
        (case.load * 100.0).round() as u32,
        case.affinity_gap.is_some(),
    )
}

fn print_row(case: &Case, row: &Row, m: &Measured) {
    let index = m.index.as_ref().map_or(String::new(), |f| {
        format!(
            " index_entries={} index_evicted={} index_learned={}",
            f.entries, f.evicted, f.learned_admissions
        )
    });
    println!(
        "routing_prefix setting={} replicas={} load={:.0}% gap={} requests={} ttft_p50_ms={:.0} \
         ttft_p99_ms={:.0} hit_rate={:.3} history_hit={:.3} moved={:.3} predicted_hit={:.3} prefill_tokens={} \
         util_min={:.2} util_max={:.2} cut={}{index}",
        case.setting.name(),
        case.replicas,
        case.load * 100.0,
        case.affinity_gap
            .map_or("default".to_string(), |g| if g == u32::MAX {
                "off".to_string()
            } else {
                g.to_string()
            }),
        row.requests,
        row.ttft_p50,
        row.ttft_p99,
        row.hit,
        row.history_hit,
        row.moved,
        row.predicted_hit,
        row.prefill_tokens,
        row.util_min,
        row.util_max,
        row.cut,
    );
}

fn main() {
    common::run(run());
}

async fn run() {
    let quick = env("PREFIX_QUICK", 0u8) != 0;
    let seed: u64 = env("PREFIX_SEED", 1);
    let measure: f64 = env("PREFIX_SECONDS", if quick { 10.0 } else { 40.0 });
    let warmup: f64 = env("PREFIX_WARMUP", 30.0);
    let tail: f64 = env("PREFIX_TAIL", if quick { 3.0 } else { 5.0 });
    let plot_path: PathBuf = env(
        "PREFIX_PLOT",
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/results/routing_prefix_ttft_p99.svg"
        )),
    );
    let plan = Plan::new(WORKERS, ENGINE, warmup, measure, tail);
    let began = Instant::now();
    println!("{}", common::machine());

    // Capacity, locality-perfect, at the rate it predicts (twice).
    let start_rate = model::saturated_throughput(ENGINE, seed, MIX) * WORKERS as f64;
    let mut capacity = start_rate;
    for _ in 0..2 {
        capacity = sessions::saturated_throughput(
            ENGINE,
            seed,
            capacity,
            &WORKLOAD,
            WORKERS,
            CACHE_BLOCKS,
            BLOCK_SIZE,
        ) * WORKERS as f64;
    }
    println!(
        "routing_prefix_model workers={WORKERS} capacity_rps={capacity:.1} (locality-perfect; \
         from {start_rate:.1}, the routing bench's) cache_blocks={CACHE_BLOCKS} \
         block_size={BLOCK_SIZE} seed={seed} warmup_s={warmup} measured_s={measure} \
         tail_s={tail} engine={ENGINE:?} workload={WORKLOAD:?}"
    );

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
    let weights = std::env::var("PREFIX_KV_WEIGHT").ok().map(|v| {
        let kv: f64 = v.parse().expect("PREFIX_KV_WEIGHT is a number");
        lease_router::CostWeights::default().with_kv(kv)
    });
    let mut arrivals: BTreeMap<u32, Arc<Vec<Arrival>>> = BTreeMap::new();
    for &load in &loads {
        let a = sessions::arrivals(
            seed,
            load * capacity,
            plan.end + MAX_DRAIN,
            &WORKLOAD,
            BLOCK_SIZE,
        );
        let window: Vec<&Arrival> = a
            .iter()
            .filter(|a| a.request.arrival >= plan.warmup && a.request.arrival < plan.measure_end)
            .collect();
        let prompt: u64 = window.iter().map(|a| u64::from(a.request.prompt)).sum();
        let turns = window.iter().filter(|a| a.session.is_some()).count();
        let reusable: u64 = window.iter().map(|a| u64::from(a.reusable)).sum();
        let history = |f: fn(&Arrival) -> u64| -> u64 {
            window
                .iter()
                .filter(|a| a.session.is_some_and(|(_, turn)| turn > 0))
                .map(|a| f(a))
                .sum()
        };
        println!(
            "routing_prefix_arrivals load={:.0}% offered_rps={:.1} measured={} session_turns={} \
             mean_prompt={:.0} reusable={:.3} history_reusable={:.3} history_prompt_share={:.3} \
             total={}",
            load * 100.0,
            window.len() as f64 / measure,
            window.len(),
            turns,
            prompt as f64 / window.len().max(1) as f64,
            reusable as f64 / prompt.max(1) as f64,
            history(|a| u64::from(a.reusable)) as f64
                / history(|a| u64::from(a.request.prompt)).max(1) as f64,
            history(|a| u64::from(a.request.prompt)) as f64 / prompt.max(1) as f64,
            a.len(),
        );
        arrivals.insert((load * 100.0).round() as u32, Arc::new(a));
    }
    let mut cases = Vec::new();
    for &load in &loads {
        let case = |setting, replicas| Case {
            setting,
            replicas,
            load,
            affinity_gap: None,
            weights,
        };
        cases.push(case(Setting::Single, 1));
        cases.push(case(Setting::Isolated, PIN_REPLICAS));
        cases.push(case(Setting::Exact, PIN_REPLICAS));
        for &r in &replicas {
            cases.push(case(Setting::Blind, r));
            cases.push(case(Setting::Aware, r));
        }
        if load == PIN_LOAD {
            cases.push(Case {
                affinity_gap: Some(u32::MAX),
                ..case(Setting::Aware, PIN_REPLICAS)
            });
        }
    }
    let arrivals_of = |case: &Case| arrivals[&((case.load * 100.0).round() as u32)].clone();

    let mut rows: BTreeMap<Key, Row> = BTreeMap::new();
    for (i, case) in cases.iter().filter(|c| !c.setting.bus()).enumerate() {
        let m = prefix_sim::run(*case, plan, arrivals_of(case), format!("direct-{i}"), None).await;
        let row = Row::of(&m);
        print_row(case, &row, &m);
        rows.insert(key(case), row);
    }
    println!(
        "routing_prefix_direct_done wall_s={:.1}",
        began.elapsed().as_secs_f64()
    );

    let server = common::bench_server().await;
    let url = server.server.url();
    let bus_plan = Plan {
        speedup: Some(1.0),
        ..plan
    };
    let mut lag = Vec::new();
    let mut bus = BusStats::default();
    for &load in &loads {
        let group: Vec<(usize, Case)> = cases
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, c)| c.setting.bus() && c.load == load)
            .collect();
        let measured = at_once(group.iter().map(|(i, case)| {
            prefix_sim::run(
                *case,
                bus_plan,
                arrivals_of(case),
                format!("prefix-{i}"),
                Some(url.clone()),
            )
        }))
        .await;
        for ((_, case), m) in group.iter().zip(measured) {
            let row = Row::of(&m);
            print_row(case, &row, &m);
            rows.insert(key(case), row);
            lag.extend_from_slice(&m.driver_lag);
            bus += m.bus;
        }
    }
    lag.sort_by(f64::total_cmp);
    println!(
        "routing_prefix_bus events_applied={} mean_publish_to_apply_ms={:.3} dropped={} \
         driver_lag_p50_ms={:.2} driver_lag_p99_ms={:.2} driver_lag_max_ms={:.1}",
        bus.lag_count,
        bus.lag_sum / bus.lag_count.max(1) as f64 * 1000.0,
        bus.dropped,
        ms_percentile(&lag, 0.5),
        ms_percentile(&lag, 0.99),
        lag.last().copied().unwrap_or(0.0) * 1000.0,
    );

    report(&rows, &loads, &plot_path);
    println!("routing_prefix_wall_s={:.1}", began.elapsed().as_secs_f64());
}

fn report(rows: &BTreeMap<Key, Row>, loads: &[f64], plot_path: &std::path::Path) {
    let pin = (PIN_LOAD * 100.0).round() as u32;
    let at = |s, r| rows[&(s, r, pin, false)];
    let aware = at(Setting::Aware, PIN_REPLICAS);
    let blind = at(Setting::Blind, PIN_REPLICAS);
    let single = at(Setting::Single, 1);
    let isolated = at(Setting::Isolated, PIN_REPLICAS);
    let guard_off = rows[&(Setting::Aware, PIN_REPLICAS, pin, true)];
    println!(
        "routing_prefix_pinned replicas={PIN_REPLICAS} load={pin}% p99_ms: shared-prefix={:.0} \
         shared-load-only={:.0} single-prefix={:.0} isolated-prefix={:.0} guard-off={:.0}; \
         hit: shared-prefix={:.3} isolated-prefix={:.3} single-prefix={:.3} \
         shared-load-only={:.3}; history_hit shared-prefix / isolated-prefix={:.3}",
        aware.ttft_p99,
        blind.ttft_p99,
        single.ttft_p99,
        isolated.ttft_p99,
        guard_off.ttft_p99,
        aware.hit,
        isolated.hit,
        single.hit,
        blind.hit,
        aware.history_hit / isolated.history_hit,
    );

    let line = |setting: Setting, replicas: usize| {
        let label = format!("{} ({})", setting.name(), plot::replicas(replicas));
        plot::Line::over_loads(label, loads, |load| {
            rows[&(setting, replicas, load, false)].ttft_p99
        })
    };
    let lines = [
        line(Setting::Blind, PIN_REPLICAS),
        line(Setting::Aware, PIN_REPLICAS),
        line(Setting::Exact, PIN_REPLICAS),
        line(Setting::Isolated, PIN_REPLICAS),
        line(Setting::Single, 1),
    ];
    let title = format!("{WORKERS} workers with prefix caches: p99 TTFT against load");
    match plot::p99_ttft(plot_path, &title, &lines, plot::Scale::Log) {
        Ok(()) => println!("routing_prefix_plot={}", plot_path.display()),
        Err(e) => println!("routing_prefix_plot_error={e}"),
    }

    println!(
        "prefix_ttft_p99_aware_vs_blind={:.3}",
        aware.ttft_p99 / blind.ttft_p99
    );
    println!(
        "prefix_ttft_p99_shared_vs_single={:.3}",
        aware.ttft_p99 / single.ttft_p99
    );
    println!(
        "prefix_hit_shared_vs_isolated={:.3}",
        aware.hit / isolated.hit
    );
    println!(
        "prefix_guard_off_ttft_p99_vs_on={:.3}",
        guard_off.ttft_p99 / aware.ttft_p99
    );

    // Exact (the engines' KV events) against approximate (learned from `admitted`), at the
    // highest load measured (95% in a full run).
    let top = loads
        .iter()
        .map(|&l| (l * 100.0).round() as u32)
        .max()
        .unwrap_or(pin);
    let exact = rows[&(Setting::Exact, PIN_REPLICAS, top, false)];
    let approx = rows[&(Setting::Aware, PIN_REPLICAS, top, false)];
    println!(
        "routing_prefix_exact replicas={PIN_REPLICAS} load={top}% hit: shared-exact={:.3} \
         shared-prefix={:.3}; predicted_hit (what the deciding index counted on): \
         shared-exact={:.3} shared-prefix={:.3}; p99_ms: shared-exact={:.0} shared-prefix={:.0}",
        exact.hit,
        approx.hit,
        exact.predicted_hit,
        approx.predicted_hit,
        exact.ttft_p99,
        approx.ttft_p99,
    );
    println!("prefix_hit_exact_vs_approx={:.3}", exact.hit / approx.hit);
}

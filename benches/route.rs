//! One routing decision's latency, in process, at 1,000 member workers
//! (`cargo bench --bench route`).
//!
//! A router's scheduler and lease manager with 1,000 workers (500 worker ids × 2 ranks), each
//! carrying live leases in both phases (admitted through the manager as the ingress admits
//! them, a share of them progressed). Each decision is `SchedulerHandle::route` as the HTTP
//! handler calls it: a message to the actor on another thread, the choice over the members,
//! the provisional booking through the lease manager, the answer back. Each decision's
//! booking is completed right after (untimed), so the picture stays the same size. Timed
//! one by one; percentiles per policy. Goal: p99 under 50 µs.
//!
//! Environment: `ROUTE_WORKERS` (default 1000, rounded down to an even number),
//! `ROUTE_DECISIONS` (default 20000 per policy), `ROUTE_LEASES_PER_WORKER` (default 16).
//!
//! Then the prefix index's part of a prefix-aware decision, before the decision uses it
//! (issue 25): the overlaps of an 8,192-token prompt (512 blocks) with every rank of a full
//! index (the same ranks, 10,000 blocks each, 10,000,000 entries; a 64-block system prompt
//! held by a tenth of them), the prompt sharing a random number of blocks with one rank's
//! earlier prompt: `prefix_overlaps_p99_us=`; and hashing that prompt,
//! `block_hashes_8k_p99_us=`. Last, whole prefix-aware decisions over that index:
//! `SchedulerHandle::route` with the 8,192-token prompt's 512 block hashes, on a second
//! scheduler whose index holds the same 10,000,000 entries for the same 1,000 members:
//! first back to back (`route_prefix_decision_back_to_back_p99_us=`: each decision also
//! waits for the learning of the previous one's booking, done after its answer), then one
//! every `ROUTE_PREFIX_GAP_US` (default 200 µs, 5,000 decisions a second, a fleet of 1,000
//! ranks admitting 5 requests a second each): `route_prefix_decision_p99_us=` (goal < 100);
//! then paced the same way without the hashes, load-only decisions on the same scheduler, so
//! that `route_prefix_decision_paced_vs_load_only` shows what the prefix part adds in the
//! same run (both include the two thread wake-ups of a paced decision). Each decision's
//! booking is completed after it (untimed); its provisional blocks stay, as they would.
//! Beside each mode's round trip, the scheduler's own time over the same decisions (its
//! `route_decision_seconds` histogram, so bucket bounds, warm-up included): what the
//! decision costs without the two wake-ups of the trip to and from the actor's task.
//! `route_prefix_decision_in_scheduler_within_100us=` is the share of the prefix-aware
//! decisions asked from a task that took the scheduler 100 µs at most (the goal is 0.99),
//! the load-only share beside it.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lease_router::{block_hashes, LeaseConfig, PrefixIndex, PrefixIndexConfig};
use lease_router::{
    RequestLeaseManager, RoutePolicy, RouteRequest, RoutingConfig, SchedulerHandle,
};
use lease_router::{RequestLoad, WorkerWithDpRank};
use tokio_util::task::TaskTracker;

use common::{machine, percentile, uuid_like, Rng};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let workers = env("ROUTE_WORKERS", 1000).max(2) / 2 * 2;
    let decisions = env("ROUTE_DECISIONS", 20_000).max(1);
    let per_worker = env("ROUTE_LEASES_PER_WORKER", 16);
    println!("{}", machine());
    println!("workers={workers} decisions_per_policy={decisions} leases_per_worker={per_worker}");
    common::run(async move {
        let tracker = TaskTracker::new();
        let (manager, scheduler, _task) = lease_router::internals::manager_and_scheduler(
            "route",
            LeaseConfig {
                scan_interval: Duration::from_secs(3600),
                ..LeaseConfig::default()
            },
            &tracker,
        );

        let mut rng = Rng::new(7);
        let members: Vec<_> = (0..workers)
            .map(|i| WorkerWithDpRank::new(i / 2, (i % 2) as u32))
            .collect();
        for (w, worker) in members.iter().enumerate() {
            for j in 0..per_worker {
                let id = uuid_like(1, w as u64 * per_worker + j);
                let prompt = 256 + rng.below(4096) as u32;
                let load = RequestLoad::new(prompt, Some(64 + rng.below(512) as u32))
                    .with_cached_tokens(rng.below(u64::from(prompt)) as u32);
                manager.admit_current(&id, *worker, load);
                if rng.below(2) == 0 {
                    manager.progress_current(&id, *worker, rng.below(300) as u32);
                }
            }
        }
        let listed = scheduler.loads().await.unwrap().len();
        assert_eq!(listed as u64, workers, "every worker is a member");

        let mut next = 0u64;
        for policy in RoutePolicy::ALL {
            scheduler
                .set_routing(RoutingConfig::default().with_policy(policy))
                .await
                .unwrap();
            let mut samples = Vec::with_capacity(decisions as usize);
            for round in 0..decisions + decisions / 10 {
                next += 1;
                let request = RouteRequest::new(uuid_like(2, next), 256 + (next % 2048) as u32)
                    .with_expected_output_tokens(128);
                let started = Instant::now();
                let decision = scheduler.route(request).await.expect("routed");
                let took = started.elapsed();
                // The first tenth warms up.
                if round >= decisions / 10 {
                    samples.push(took.as_nanos() as u64);
                }
                manager.complete_remote(&decision.booking);
            }
            samples.sort_unstable();
            let us = |q: f64| percentile(&samples, q) as f64 / 1000.0;
            println!(
                "route_latency policy={} p50_us={:.1} p90_us={:.1} p99_us={:.1} p999_us={:.1} max_us={:.1} goal_p99_us=50 met={}",
                policy.as_str(),
                us(0.50),
                us(0.90),
                us(0.99),
                us(0.999),
                us(1.0),
                us(0.99) < 50.0
            );
        }
        let stats = scheduler.stats();
        println!(
            "scheduler wakeups={} booked={}",
            stats.wakeups, stats.booked
        );
        let prompts = prefix_overlaps(&members, decisions);
        prefix_decisions(&members, &prompts, decisions).await;
    });
}

/// Fills `learn` with what every rank holds: a tenth of them the system prompt, then earlier
/// prompts' blocks up to `per_rank`; returns the prompts' seeds.
fn fill(
    members: &[WorkerWithDpRank],
    per_rank: u32,
    mut learn: impl FnMut(WorkerWithDpRank, &[u64]),
) -> Vec<u32> {
    let system = block_hashes(&prompt(u32::MAX), 16)[..SYSTEM_BLOCKS].to_vec();
    let mut prompts = Vec::new();
    for (r, rank) in members.iter().enumerate() {
        let mut held = 0;
        if r % 10 == 0 {
            learn(*rank, &system);
            held += SYSTEM_BLOCKS as u32;
        }
        while held < per_rank {
            let seed = prompts.len() as u32;
            let hashes = block_hashes(&prompt(seed), 16);
            let take = hashes.len().min((per_rank - held) as usize);
            learn(*rank, &hashes[..take]);
            held += take as u32;
            prompts.push(seed);
        }
    }
    prompts
}

/// A request sharing a random number of blocks with one of `prompts`.
fn request_tokens(rng: &mut Rng, prompts: &[u32]) -> Vec<u32> {
    let earlier = prompt(prompts[rng.below(prompts.len() as u64) as usize]);
    let shared = 16 * rng.below(512) as usize;
    let mut tokens = earlier[..shared].to_vec();
    tokens.extend((shared as u32..PROMPT_TOKENS).map(|t| t.wrapping_mul(2_654_435_761)));
    tokens
}

async fn prefix_decisions(members: &[WorkerWithDpRank], prompts: &[u32], decisions: u64) {
    let per_rank = PER_RANK;
    let tracker = TaskTracker::new();
    let (manager, scheduler, _task) = lease_router::internals::manager_and_scheduler_with_prefix(
        "route-prefix",
        LeaseConfig {
            scan_interval: Duration::from_secs(3600),
            ..LeaseConfig::default()
        },
        PrefixIndexConfig::new()
            .with_worker_capacity(per_rank)
            .with_max_entries(per_rank * members.len() as u32 + 1),
        &tracker,
    );
    for (i, rank) in members.iter().enumerate() {
        manager.admit_current(
            &uuid_like(3, i as u64),
            *rank,
            RequestLoad::new(512, Some(64)),
        );
    }
    fill(members, per_rank, |rank, hashes| {
        lease_router::internals::learn_prefix(&manager, rank, hashes)
    });
    let gap = Duration::from_micros(env("ROUTE_PREFIX_GAP_US", 200));
    let task_gap = Duration::from_millis(1);
    let prompts: Arc<[u32]> = prompts.into();
    let mut p99s = Vec::new();
    let mut within = Vec::new();
    // Back to back, then one every `gap`, then one every `gap` without the hashes (a
    // load-only decision on the same scheduler: what the prefix part adds, same run): from
    // this thread, a client beside the runtime. Last, the two paced ones from a task on the
    // runtime, as the HTTP handler asks, one a millisecond (tokio's timer).
    let modes = [
        (false, true, false),
        (true, true, false),
        (true, false, false),
        (true, true, true),
        (true, false, true),
    ];
    for (mode, (paced, with_hashes, from_task)) in modes.into_iter().enumerate() {
        let run = Decisions {
            scheduler: scheduler.clone(),
            manager: manager.clone(),
            prompts: prompts.clone(),
            seed: 13 + mode as u64,
            mode: mode as u64,
            gap: paced.then_some(if from_task { task_gap } else { gap }),
            with_hashes,
            decisions,
        };
        let times_before = scheduler.decision_times();
        let (mut samples, overlapping) = if from_task {
            tokio::spawn(run.run()).await.expect("decisions")
        } else {
            run.run().await
        };
        samples.sort_unstable();
        let us = |q: f64| percentile(&samples, q) as f64 / 1000.0;
        // The scheduler's own time per decision (its `route_decision_seconds` histogram):
        // the round trip less the trip to and from its task.
        let inside = scheduler.decision_times().since(&times_before);
        let inside_p99 = inside
            .bound_of_quantile(0.99)
            .map_or_else(|| "> 100000".to_string(), |b| format!("<= {:.0}", b * 1e6));
        println!(
            "route_prefix_decision: mode={}{}{} entries={} p50_us={:.1} p99_us={:.1} max_us={:.1} in_scheduler_p99_us{} in_scheduler_within_100us={:.4} chosen_with_overlap={:.2} goal_p99_us=100 met={}",
            match (paced, from_task) {
                (false, _) => "back_to_back".to_string(),
                (true, false) => format!("one_every_{}us", gap.as_micros()),
                (true, true) => format!("one_every_{}us", task_gap.as_micros()),
            },
            if with_hashes { "" } else { "_load_only" },
            if from_task { "_from_a_task" } else { "" },
            scheduler.prefix_figures().entries,
            us(0.5),
            us(0.99),
            us(1.0),
            inside_p99,
            inside.share_within(100e-6),
            overlapping as f64 / (decisions + decisions / 10) as f64,
            us(0.99) < 100.0
        );
        p99s.push((us(0.5), us(0.99)));
        within.push(inside.share_within(100e-6));
    }
    println!("route_prefix_decision_back_to_back_p99_us={:.1}", p99s[0].1);
    println!("route_prefix_decision_p99_us={:.1}", p99s[1].1);
    println!("route_prefix_decision_from_a_task_p99_us={:.1}", p99s[3].1);
    // The goal asks for 99% of decisions under 100 µs: the share the scheduler made within
    // it, from a task (warm-up included), and the same for load-only decisions beside it.
    println!(
        "route_prefix_decision_in_scheduler_within_100us={:.4} (load-only: {:.4})",
        within[3], within[4]
    );
    for (name, prefix, load_only) in [("", 1, 2), ("_from_a_task", 3, 4)] {
        println!(
            "route_prefix_decision{name}_vs_load_only p50={:.2} p99={:.2}",
            p99s[prefix].0 / p99s[load_only].0,
            p99s[prefix].1 / p99s[load_only].1
        );
    }
}

/// One mode's decisions: the latency of each (after a tenth to warm up), and how many
/// chose a rank with an overlap.
struct Decisions {
    scheduler: SchedulerHandle,
    manager: RequestLeaseManager,
    prompts: Arc<[u32]>,
    seed: u64,
    mode: u64,
    /// Paced one every this, or back to back.
    gap: Option<Duration>,
    with_hashes: bool,
    decisions: u64,
}

impl Decisions {
    async fn run(self) -> (Vec<u64>, u64) {
        let mut rng = Rng::new(self.seed);
        let mut samples = Vec::new();
        let mut overlapping = 0u64;
        let mut next = Instant::now();
        let mut tokio_next = tokio::time::Instant::now();
        for round in 0..self.decisions + self.decisions / 10 {
            let hashes = block_hashes(&request_tokens(&mut rng, &self.prompts), 16);
            let request = RouteRequest::new(uuid_like(4 + self.mode, round), PROMPT_TOKENS);
            let request = if self.with_hashes {
                request.with_block_hashes(hashes)
            } else {
                request
            };
            if let Some(gap) = self.gap {
                if gap >= Duration::from_millis(1) {
                    // On the runtime: asleep on tokio's timer, as a handler waits for its
                    // next request.
                    tokio_next += gap;
                    tokio::time::sleep_until(tokio_next).await;
                } else {
                    next += gap;
                    while Instant::now() < next {
                        std::hint::spin_loop();
                    }
                }
            }
            let started = Instant::now();
            let decision = self.scheduler.route(request).await.expect("routed");
            let took = started.elapsed();
            if round >= self.decisions / 10 {
                samples.push(took.as_nanos() as u64);
            }
            overlapping += u64::from(decision.candidates[0].overlap_blocks > 0);
            self.manager.complete_remote(&decision.booking);
        }
        (samples, overlapping)
    }
}

const PER_RANK: u32 = 10_000;

const PROMPT_TOKENS: u32 = 8_192;
const SYSTEM_BLOCKS: usize = 64;

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS)
        .map(|t| t ^ seed.rotate_left(13))
        .collect()
}

fn prefix_overlaps(members: &[WorkerWithDpRank], decisions: u64) -> Vec<u32> {
    let per_rank = PER_RANK;
    let mut index = PrefixIndex::new(
        PrefixIndexConfig::new()
            .with_worker_capacity(per_rank)
            .with_max_entries(per_rank * members.len() as u32 + 1),
    );
    let started = Instant::now();
    let prompts = fill(members, per_rank, |rank, hashes| index.learn(rank, hashes));
    println!(
        "prefix index: {} entries over {} ranks in {:.1} s",
        index.len(),
        members.len(),
        started.elapsed().as_secs_f64()
    );
    let mut rng = Rng::new(11);
    let (mut overlaps, mut hashing) = (Vec::new(), Vec::new());
    let mut matched = 0u64;
    for round in 0..decisions + decisions / 10 {
        // An earlier prompt's first `shared` blocks, then its own.
        let tokens = request_tokens(&mut rng, &prompts);
        let t0 = Instant::now();
        let hashes = block_hashes(&tokens, 16);
        let t1 = Instant::now();
        let found = index.overlaps(&hashes);
        let t2 = Instant::now();
        matched += found.len() as u64;
        if round >= decisions / 10 {
            hashing.push((t1 - t0).as_nanos() as u64);
            overlaps.push((t2 - t1).as_nanos() as u64);
        }
    }
    overlaps.sort_unstable();
    hashing.sort_unstable();
    let us = |v: &[u64], q: f64| percentile(v, q) as f64 / 1000.0;
    println!(
        "prefix overlaps: p50_us={:.1} p99_us={:.1} max_us={:.1}; ranks matched per request {:.2}",
        us(&overlaps, 0.5),
        us(&overlaps, 0.99),
        us(&overlaps, 1.0),
        matched as f64 / (decisions + decisions / 10) as f64
    );
    println!("prefix_overlaps_p99_us={:.1}", us(&overlaps, 0.99));
    println!("block_hashes_8k_p99_us={:.1}", us(&hashing, 0.99));
    prompts
}

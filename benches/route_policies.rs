//! Which policy and weights keep time-to-first-token low: a discrete-time model of a fleet,
//! routed with the crate's own cost function (`cargo bench --bench route_policies`).
//!
//! The figures are simulated time, deterministic for a seed: they do not depend on the
//! machine, so this runs as well in a debug build. The model (stated, not calibrated):
//! - 16 workers. Each prefills one request at a time, FIFO, at 20,000 uncached tokens/s
//!   (compute-bound), then decodes it at 40 tokens/s (every request at once: memory-bound).
//! - A worker holds at most 400,000 KV tokens (regime `kv_ample`) or 180,000 (`kv_tight`, where memory is about as busy as prefill): a
//!   request waits in its queue until prompt plus expected output fits (as engines reserve
//!   KV). KV held = prompt + output so far.
//! - Requests arrive as a Poisson stream; prompt 200..8,000 tokens (uniform), output
//!   50..600, of which 0..90% is a cached prefix (known at routing, on every worker alike).
//! - 4 router replicas take arrivals in turn. *Shared*: every replica sees every worker's
//!   true load (the bus) plus its own decisions at once. *Local*: a replica sees only the
//!   requests it routed itself.
//!   TTFT = prefill done − arrival.
//!
//! Environment: `POLICY_SECONDS` (simulated seconds, default 300), `POLICY_RATE`
//! (requests/s, default 70, about 85% of the fleet's prefill capacity).

mod common;

use std::collections::VecDeque;

use lease_router::CostWeights;
use lease_router::RequestLoad;
use lease_router::WorkerLoad;

use common::{percentile, Rng};

const WORKERS: usize = 16;
const REPLICAS: usize = 4;
const PREFILL_PER_S: f64 = 20_000.0;
const DECODE_PER_S: f64 = 40.0;

const DT: f64 = 0.001;

#[derive(Clone, Copy)]
struct Request {
    arrival: f64,
    prompt: u64,
    uncached: u64,
    output: u64,
    /// The replica that routed it.
    replica: usize,
}

#[derive(Clone, Copy)]
struct Decoding {
    request: Request,
    produced: f64,
}

#[derive(Default)]
struct Worker {
    /// Waiting for KV room, then for the prefill server; the front one may be prefilling.
    queue: VecDeque<Request>,
    /// Uncached tokens of the front request still to prefill, once it holds its KV.
    prefilling: Option<f64>,
    decoding: Vec<Decoding>,
    kv_reserved: u64,
}

impl Worker {
    /// The load as the router's leases count it, of the requests `seen` lets through.
    fn load(&self, seen: impl Fn(&Request) -> bool) -> WorkerLoad {
        let mut load = WorkerLoad::default();
        for (i, r) in self.queue.iter().enumerate().filter(|(_, r)| seen(r)) {
            load.active_bookings += 1;
            load.prefill_tokens += match (i, self.prefilling) {
                (0, Some(left)) => left as u64,
                _ => r.uncached,
            };
            load.kv_tokens += r.prompt;
        }
        for d in self.decoding.iter().filter(|d| seen(&d.request)) {
            load.active_bookings += 1;
            load.kv_tokens += d.request.prompt + d.produced as u64;
        }
        load
    }

    /// One step; returns the TTFTs of requests whose prefill finished.
    fn step(&mut self, now: f64, kv_capacity: u64, ttft: &mut Vec<f64>) {
        self.decoding.retain_mut(|d| {
            d.produced += DECODE_PER_S * DT;
            d.produced < d.request.output as f64
        });
        let held: u64 = self
            .decoding
            .iter()
            .map(|d| d.request.prompt + d.request.output)
            .sum();
        self.kv_reserved = held;
        let mut budget = PREFILL_PER_S * DT;
        while budget > 0.0 {
            let Some(front) = self.queue.front().copied() else {
                break;
            };
            if self.prefilling.is_none() {
                if self.kv_reserved + front.prompt + front.output > kv_capacity {
                    break;
                }
                self.prefilling = Some(front.uncached as f64);
            }
            let left = self.prefilling.as_mut().unwrap();
            let done = left.min(budget);
            *left -= done;
            budget -= done;
            if *left <= 0.0 {
                self.prefilling = None;
                self.queue.pop_front();
                ttft.push(now - front.arrival);
                self.kv_reserved += front.prompt + front.output;
                self.decoding.push(Decoding {
                    request: front,
                    produced: 0.0,
                });
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Choice {
    Weighted(CostWeights),
    PowerOfTwo(CostWeights),
    RoundRobin,
    Random,
}

fn simulate(choice: Choice, shared: bool, seconds: f64, rate: f64, kv: u64) -> (f64, f64, f64) {
    // Arrivals and routing draw from their own streams: every policy sees the same requests.
    let mut rng = Rng::new(42);
    let mut draw = Rng::new(7);
    let uniform = |rng: &mut Rng| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let mut workers: Vec<Worker> = (0..WORKERS).map(|_| Worker::default()).collect();
    let mut ttft = Vec::new();
    let mut next_arrival = 0.0;
    let mut arrivals = 0usize;
    let mut turn = [0usize; REPLICAS];
    let steps = (seconds / DT) as usize;
    for step in 0..steps {
        let now = step as f64 * DT;
        while next_arrival <= now {
            let prompt = 200 + (uniform(&mut rng) * 7800.0) as u64;
            let cached = (prompt as f64 * uniform(&mut rng) * 0.9) as u64;
            let output = 50 + (uniform(&mut rng) * 550.0) as u64;
            let replica = arrivals % REPLICAS;
            arrivals += 1;
            let request = Request {
                arrival: next_arrival,
                prompt,
                uncached: prompt - cached,
                output,
                replica,
            };
            let asked = RequestLoad::new(prompt as u32, Some(output as u32))
                .with_cached_tokens(cached as u32);
            let view = |w: &Worker| {
                if shared {
                    w.load(|_| true)
                } else {
                    w.load(|r| r.replica == replica)
                }
            };
            let cost = |w: usize, weights| lease_router::cost(weights, &view(&workers[w]), &asked);
            let chosen = match choice {
                Choice::Weighted(weights) => (0..WORKERS)
                    .min_by(|a, b| cost(*a, weights).total_cmp(&cost(*b, weights)))
                    .unwrap(),
                Choice::PowerOfTwo(weights) => {
                    let a = draw.below(WORKERS as u64) as usize;
                    let b = (a + 1 + draw.below(WORKERS as u64 - 1) as usize) % WORKERS;
                    if cost(b, weights) < cost(a, weights) {
                        b
                    } else {
                        a
                    }
                }
                Choice::RoundRobin => {
                    turn[replica] += 1;
                    (turn[replica] + replica * 4) % WORKERS
                }
                Choice::Random => draw.below(WORKERS as u64) as usize,
            };
            workers[chosen].queue.push_back(request);
            // Poisson arrivals: exponential gaps.
            next_arrival += -(1.0 - uniform(&mut rng)).ln() / rate;
        }
        for w in &mut workers {
            w.step(now, kv, &mut ttft);
        }
    }
    let mut ms: Vec<u64> = ttft.iter().map(|s| (s * 1000.0) as u64).collect();
    ms.sort_unstable();
    (
        percentile(&ms, 0.5) as f64,
        percentile(&ms, 0.99) as f64,
        ms.len() as f64,
    )
}

fn env(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let seconds = env("POLICY_SECONDS", 300.0);
    let rate = env("POLICY_RATE", 70.0);
    println!("simulated_seconds={seconds} rate_per_s={rate} workers={WORKERS} replicas={REPLICAS}");
    // Two regimes: KV to spare (prefill is the bottleneck), and KV that binds (a worker holds
    // about 40 requests: memory about as busy as prefill).
    let regimes = [("kv_ample", 400_000), ("kv_tight", 180_000)];
    let w = |prefill, kv| CostWeights::default().with_prefill(prefill).with_kv(kv);
    let cases = [
        (
            "weighted_cost prefill=1 kv=1",
            Choice::Weighted(w(1.0, 1.0)),
        ),
        (
            "weighted_cost prefill=1 kv=0",
            Choice::Weighted(w(1.0, 0.0)),
        ),
        (
            "weighted_cost prefill=0 kv=1",
            Choice::Weighted(w(0.0, 1.0)),
        ),
        (
            "weighted_cost prefill=1 kv=0.25",
            Choice::Weighted(w(1.0, 0.25)),
        ),
        (
            "power_of_two prefill=1 kv=1",
            Choice::PowerOfTwo(w(1.0, 1.0)),
        ),
        (
            "power_of_two prefill=1 kv=0.25",
            Choice::PowerOfTwo(w(1.0, 0.25)),
        ),
        ("round_robin", Choice::RoundRobin),
        ("random", Choice::Random),
    ];
    for (regime, kv) in regimes {
        for shared in [true, false] {
            for (name, choice) in cases {
                let (p50, p99, n) = simulate(choice, shared, seconds, rate, kv);
                println!(
                    "ttft regime={regime} view={} policy=\"{name}\" requests={n} p50_ms={p50} p99_ms={p99}",
                    if shared { "shared" } else { "local" }
                );
            }
        }
    }
}

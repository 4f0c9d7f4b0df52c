//! One case of the `routing_prefix` bench: a setting, a replica count and a load; its
//! routers (real [`Router`](lease_router::Router)s with a prefix index, in a [`Fleet`],
//! over the real bus or fed directly), and the driver that runs the model's workers, each
//! with its prefix cache, against them. The same shape as `sim.rs` (which the `routing`
//! bench runs), with blocks.

use std::sync::Arc;
use std::time::Duration;

use lease_router::{
    CostWeights, LeaseConfig, PrefixFigures, PrefixIndexConfig, RoutePolicy, RouteRequest,
    RouterConfig, RoutingConfig,
};
use tokio::time::Instant;

use crate::fleet::{
    request_id, worker, worker_index, Admission, BusStats, Feed, Fleet, Plan, MAX_DRAIN,
};
use crate::model::{next_event, Happened, KvChange, Worker};
use crate::sessions::Arrival;

/// Tokens per block: engines' and routers'.
pub const BLOCK_SIZE: usize = lease_router::DEFAULT_BLOCK_SIZE;
/// Blocks a worker's prefix cache holds: its whole KV capacity (400,000 tokens).
pub const CACHE_BLOCKS: usize = 400_000 / BLOCK_SIZE;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Setting {
    /// Shared bus, load only: requests routed without their blocks.
    Blind,
    /// Shared bus, prefix-aware: every replica's index learns from every `admitted`.
    Aware,
    /// Shared bus, prefix-aware, the workers' engines sending their KV events (what their
    /// caches store and evict), which every replica's index takes as the truth.
    Exact,
    /// Prefix-aware, each replica learning only about the requests it routed (its index only
    /// from its own decisions).
    Isolated,
    /// One prefix-aware replica routes everything and learns every event at once.
    Single,
}

impl Setting {
    pub fn name(self) -> &'static str {
        match self {
            Self::Blind => "shared-load-only",
            Self::Aware => "shared-prefix",
            Self::Exact => "shared-exact",
            Self::Isolated => "isolated-prefix",
            Self::Single => "single-prefix",
        }
    }

    pub fn bus(self) -> bool {
        matches!(self, Self::Blind | Self::Aware | Self::Exact)
    }

    fn aware(self) -> bool {
        !matches!(self, Self::Blind)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub setting: Setting,
    pub replicas: usize,
    /// Share of the deployment's capacity.
    pub load: f64,
    /// The hot-worker guard's gap; `None`: the default.
    pub affinity_gap: Option<u32>,
    /// The cost's weights; `None`: the crate's default.
    pub weights: Option<CostWeights>,
}

/// What one case measured.
#[derive(Debug, Default)]
pub struct Measured {
    /// Seconds, of the requests that arrived in the measured window.
    pub ttft: Vec<f64>,
    /// Measured requests still without a first token at the end.
    pub no_first_token: usize,
    /// Over the measured requests: prompt tokens, of them served from cache, and the cached
    /// tokens the deciding replicas predicted.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub predicted_cached: u64,
    /// The same of the session turns after the first (whose history is on some worker).
    pub history_prompt: u64,
    pub history_cached: u64,
    /// Of the measured session turns whose previous turn was sent: how many, and how many
    /// went to another worker than that turn.
    pub follow_ups: usize,
    pub moved: usize,
    /// Prefill share of each worker's time in the measured window.
    pub utilisation: Vec<f64>,
    /// How late the driver handled the model's events (real time only), sorted.
    pub driver_lag: Vec<f64>,
    pub bus: BusStats,
    /// The first replica's prefix index at the end.
    pub index: Option<PrefixFigures>,
}

/// Worker `w`'s engine says what its cache stored and evicted (on the bus only).
fn kv_changes(feed: &Feed, changes: Vec<KvChange>, w: usize) {
    let Feed::Bus(publishers) = feed else {
        return;
    };
    let id = worker(w).worker_id.0;
    for change in changes {
        let _ = match change {
            KvChange::Stored { parent, blocks } => publishers[w].kv_stored(id, 0, parent, blocks),
            KvChange::Removed(blocks) => publishers[w].kv_removed(id, 0, blocks),
        };
    }
}

fn router_config(deployment: &str, case: &Case) -> RouterConfig {
    let mut routing = RoutingConfig::default()
        .with_policy(RoutePolicy::WeightedCost)
        .with_worker_idle(Duration::from_secs(3600));
    if let Some(gap) = case.affinity_gap {
        routing = routing.with_affinity_gap(gap);
    }
    if let Some(weights) = case.weights {
        routing = routing.with_weights(weights);
    }
    RouterConfig::new(deployment)
        .with_lease(LeaseConfig {
            scan_interval: Duration::from_secs(3600),
            ..LeaseConfig::default()
        })
        .with_routing(routing)
        .with_prefix(
            PrefixIndexConfig::new()
                .with_block_size(BLOCK_SIZE as u32)
                .with_worker_capacity(CACHE_BLOCKS as u32),
        )
}

/// Chooses a worker for request `index` on `replica`, with its blocks if `aware`: the
/// worker, and the cached tokens the decision counted on there.
async fn route(
    fleet: &Fleet,
    aware: bool,
    replica: usize,
    index: usize,
    a: &Arrival,
) -> (usize, u32) {
    let scheduler = fleet.routers[replica].scheduler();
    let mut request = RouteRequest::new(request_id(index), a.request.prompt);
    if aware {
        request = request.with_block_hashes(a.blocks.prompt_hashes().to_vec());
    }
    let decision = scheduler.route(request).await.expect("routed");
    let predicted = decision
        .candidates
        .iter()
        .find(|c| c.worker == decision.booking.worker)
        .map_or(0, |c| c.cached_tokens);
    (worker_index(decision.booking.worker), predicted)
}

/// Runs one case on `arrivals` (already timed for its load) and measures it.
pub async fn run(
    case: Case,
    plan: Plan,
    arrivals: Arc<Vec<Arrival>>,
    deployment: String,
    nats_url: Option<String>,
) -> Measured {
    let bus = case.setting.bus().then(|| {
        nats_url
            .as_deref()
            .expect("the shared settings need the bench's nats-server")
    });
    let config = router_config(&deployment, &case);
    let fleet = Fleet::start(config, case.replicas, plan.workers, bus).await;

    let exact = case.setting == Setting::Exact;
    let mut workers: Vec<Worker> = (0..plan.workers)
        .map(|_| {
            let worker = Worker::with_prefix_cache(plan.engine, CACHE_BLOCKS, BLOCK_SIZE as u32);
            if exact {
                worker.with_kv_events()
            } else {
                worker
            }
        })
        .collect();
    let n = arrivals.len();
    let mut placed = vec![0usize; n];
    let mut placed_on = vec![usize::MAX; n];
    let mut first_token = vec![f64::NAN; n];
    let mut cached = vec![u32::MAX; n];
    let mut happened = Vec::new();
    let mut driver_lag = Vec::new();
    let mut next = 0usize;
    let mut drained = 0u64;
    let mut measured = Measured::default();
    let start = Instant::now();
    let mut measured_left = arrivals
        .iter()
        .filter(|a| plan.in_window(a.request.arrival))
        .count();
    let take_joined = |worker: &mut Worker, cached: &mut Vec<u32>| {
        for (i, c) in worker.joined.drain(..) {
            cached[i] = c;
        }
    };
    loop {
        let arrival = arrivals.get(next).map(|a| a.request.arrival);
        let Some((t, step)) = next_event(&workers, arrival) else {
            break;
        };
        let draining = t > plan.end;
        if (draining && measured_left == 0) || t > plan.end + MAX_DRAIN {
            break;
        }
        if draining {
            // Draining computes without waiting: let the cases still in real time (on the
            // same two runtime threads) run between stretches of it.
            drained += 1;
            if drained.is_multiple_of(256) {
                tokio::task::yield_now().await;
            }
        }
        if draining {
            // Draining computes without waiting: let the cases still in real time (on the
            // same two runtime threads) run between stretches of it.
            drained += 1;
            if drained.is_multiple_of(256) {
                tokio::task::yield_now().await;
            }
        } else {
            driver_lag.extend(plan.pace(start, t).await);
        }
        match step {
            None => {
                let index = next;
                next += 1;
                let a = &arrivals[index];
                let r = a.request;
                let replica = index % case.replicas;
                let w = if draining {
                    index % plan.workers
                } else {
                    let (w, predicted) =
                        route(&fleet, case.setting.aware(), replica, index, a).await;
                    if plan.in_window(r.arrival) {
                        measured.predicted_cached += u64::from(predicted);
                    }
                    // The worker says what its cache holds of the prompt now.
                    let admission = Admission {
                        prompt: r.prompt,
                        cached: workers[w].cached_now(&r, &a.blocks),
                        blocks: Some((a.blocks.prompt_hashes(), CACHE_BLOCKS as u32)),
                        ..Admission::default()
                    };
                    fleet.feed.admitted(index, admission, w, replica);
                    w
                };
                placed[index] = replica;
                placed_on[index] = w;
                workers[w].arrive_with_blocks(t, index, r, a.blocks.clone());
                take_joined(&mut workers[w], &mut cached);
                let changes = workers[w].take_kv_changes();
                if !draining {
                    kv_changes(&fleet.feed, changes, w);
                }
            }
            Some(w) => {
                workers[w].end_step(plan.in_window(t), &mut happened);
                take_joined(&mut workers[w], &mut cached);
                let changes = workers[w].take_kv_changes();
                if !draining {
                    kv_changes(&fleet.feed, changes, w);
                }
                for h in happened.drain(..) {
                    let index = match h {
                        Happened::FirstToken(i) => {
                            first_token[i] = t;
                            i
                        }
                        Happened::Completed(i) => {
                            measured_left -=
                                usize::from(plan.in_window(arrivals[i].request.arrival));
                            i
                        }
                        Happened::Progress(i, _) => i,
                    };
                    if !draining {
                        fleet.feed.happened(h, w, placed[index]);
                    }
                }
            }
        }
    }

    let mut turns = std::collections::HashMap::new();
    for (i, a) in arrivals.iter().enumerate() {
        let r = &a.request;
        if let Some(turn) = a.session {
            turns.insert(turn, i);
        }
        if !plan.in_window(r.arrival) {
            continue;
        }
        if let Some(&previous) = a
            .session
            .and_then(|(s, turn)| turn.checked_sub(1).and_then(|t| turns.get(&(s, t))))
        {
            measured.follow_ups += 1;
            measured.moved += usize::from(placed_on[previous] != placed_on[i]);
        }
        if first_token[i].is_nan() {
            measured.no_first_token += 1;
        }
        let or_end = |t: f64| if t.is_nan() { plan.end + MAX_DRAIN } else { t };
        measured.ttft.push(or_end(first_token[i]) - r.arrival);
        measured.prompt_tokens += u64::from(r.prompt);
        let c = if cached[i] == u32::MAX { 0 } else { cached[i] };
        measured.cached_tokens += u64::from(c);
        if a.session.is_some_and(|(_, turn)| turn > 0) {
            measured.history_prompt += u64::from(r.prompt);
            measured.history_cached += u64::from(c);
        }
    }
    let window = plan.measure_end - plan.warmup;
    measured.utilisation = workers.iter().map(|w| w.prefill_busy / window).collect();
    driver_lag.sort_by(f64::total_cmp);
    measured.driver_lag = driver_lag;
    measured.index = fleet
        .routers
        .first()
        .map(|r| r.scheduler().prefix_figures());
    measured.bus = fleet.shutdown().await;
    measured
}

//! One case of the `routing_prefix` bench: a setting, a replica count and a load; its
//! routers (real [`Router`]s with a prefix index, over the real bus or fed directly), and
//! the driver that runs the model's workers, each with its prefix cache, against them. The
//! same shape as `sim.rs` (which the `routing` bench runs), with blocks.

use std::sync::Arc;
use std::time::Duration;

use lease_router::wire::{
    Admitted, Completed, Outcome, ProgressStage, Progressed, MAX_BLOCK_HASHES,
};
use lease_router::{
    ApplyConfig, CostWeights, IngressStats, LeaseConfig, LeasePublisher, NatsIngress, NoIngress,
    PrefixFigures, PrefixIndexConfig, PublisherConfig, RequestLeaseManager, RequestLoad,
    RoutePolicy, RouteRequest, Router, RouterConfig, RoutingConfig, WorkerWithDpRank,
};
use tokio::time::Instant;

use crate::model::{Blocks, Happened, KvChange, Request, Worker};
use crate::sessions::Arrival;
use crate::sim::{Plan, MAX_DRAIN};

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
    pub bus_lag_sum: f64,
    pub bus_lag_count: u64,
    pub bus_dropped: u64,
    /// The first replica's prefix index at the end.
    pub index: Option<PrefixFigures>,
}

enum Feed {
    Bus(Vec<LeasePublisher>),
    Direct(Vec<RequestLeaseManager>),
}

fn worker(w: usize) -> WorkerWithDpRank {
    WorkerWithDpRank::new(w as u64 + 1, 0)
}

fn request_id(index: usize) -> String {
    format!("q{index:07}")
}

impl Feed {
    /// Request `index` reached worker `w`, which found `cached` of its prompt tokens cached.
    fn admitted(
        &self,
        index: usize,
        r: &Request,
        blocks: &Blocks,
        cached: u32,
        w: usize,
        replica: usize,
    ) {
        let id = request_id(index);
        match self {
            Self::Bus(publishers) => {
                let hashes = blocks.prompt_hashes();
                let _ = publishers[w].publish(Admitted {
                    request_id: id,
                    worker_id: worker(w).worker_id.0,
                    dp_rank: 0,
                    prompt_tokens: r.prompt,
                    expected_output_tokens: None,
                    cached_tokens: Some(cached),
                    block_hashes: hashes[..hashes.len().min(MAX_BLOCK_HASHES)].to_vec(),
                    block_capacity: Some(CACHE_BLOCKS as u32),
                    class: None,
                });
            }
            Self::Direct(managers) => {
                // Through the manager, as a proxy in the response path would: the lease,
                // not the index (which learns only from this replica's decisions).
                let load = RequestLoad::new(r.prompt, None).with_cached_tokens(cached);
                managers[replica].admit_current(&id, worker(w), load);
            }
        }
    }

    /// Worker `w`'s engine says what its cache stored and evicted (on the bus only).
    fn kv_changes(&self, changes: Vec<KvChange>, w: usize) {
        let Self::Bus(publishers) = self else {
            return;
        };
        let id = worker(w).worker_id.0;
        for change in changes {
            let _ = match change {
                KvChange::Stored { parent, blocks } => {
                    publishers[w].kv_stored(id, 0, parent, blocks)
                }
                KvChange::Removed(blocks) => publishers[w].kv_removed(id, 0, blocks),
            };
        }
    }

    fn happened(&self, h: Happened, w: usize, replica: usize) {
        let (index, stage, output) = match h {
            Happened::FirstToken(i) => (i, Some(ProgressStage::PrefillDone), 1),
            Happened::Progress(i, n) => (i, Some(ProgressStage::Decoding), n),
            Happened::Completed(i) => (i, None, 0),
        };
        let id = request_id(index);
        match (self, stage) {
            (Self::Bus(publishers), Some(stage)) => {
                let _ = publishers[w].publish(Progressed {
                    request_id: id,
                    worker_id: worker(w).worker_id.0,
                    dp_rank: 0,
                    stage,
                    output_tokens: output,
                });
            }
            (Self::Bus(publishers), None) => {
                let _ = publishers[w].publish(Completed {
                    request_id: id,
                    worker_id: worker(w).worker_id.0,
                    dp_rank: 0,
                    outcome: Outcome::Finished,
                });
            }
            (Self::Direct(managers), Some(_)) => {
                managers[replica].progress_current(&id, worker(w), output);
            }
            (Self::Direct(managers), None) => {
                managers[replica].complete_current(&id, worker(w));
            }
        }
    }
}

struct Replicas {
    routers: Vec<Router>,
    connections: Vec<lease_router::NatsConnection>,
    stats: Vec<Arc<IngressStats>>,
    feed: Feed,
    aware: bool,
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

impl Replicas {
    async fn start(case: &Case, plan: &Plan, deployment: &str, nats_url: Option<&str>) -> Self {
        let workers = plan.workers;
        let aware = case.setting.aware();
        if case.setting.bus() {
            let url = nats_url.expect("the shared settings need the bench's nats-server");
            let subjects = crate::common::subjects(deployment);
            let (mut routers, mut stats, mut connections) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..case.replicas {
                let connection = crate::common::nats(url, None).await;
                let s = Arc::new(IngressStats::new());
                let ingress = NatsIngress::new(
                    connection.client().clone(),
                    subjects.clone(),
                    ApplyConfig::default(),
                    s.clone(),
                );
                let router = Router::start(router_config(deployment, case), ingress)
                    .await
                    .expect("router starts");
                routers.push(router);
                stats.push(s);
                connections.push(connection);
            }
            let connection = crate::common::nats(url, None).await;
            let publishers: Vec<_> = (0..workers)
                .map(|_| {
                    LeasePublisher::start(
                        connection.client().clone(),
                        subjects.clone(),
                        PublisherConfig::default(),
                    )
                })
                .collect();
            for (w, publisher) in publishers.iter().enumerate() {
                publisher
                    .worker_reset(worker(w).worker_id.0, None)
                    .expect("queued");
                publisher.flush().await.expect("flushed");
            }
            connections.push(connection);
            Self {
                routers,
                connections,
                stats,
                feed: Feed::Bus(publishers),
                aware,
            }
        } else {
            let mut routers = Vec::new();
            for _ in 0..case.replicas {
                let router = Router::start(router_config(deployment, case), NoIngress)
                    .await
                    .expect("router starts");
                for w in 0..workers {
                    router.manager().reset_worker(worker(w).worker_id, None);
                }
                routers.push(router);
            }
            let managers = routers.iter().map(|r| r.manager().clone()).collect();
            Self {
                routers,
                connections: Vec::new(),
                stats: Vec::new(),
                feed: Feed::Direct(managers),
                aware,
            }
        }
    }

    async fn wait_members(&self, workers: usize) {
        for router in &self.routers {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while router.scheduler().loads().await.expect("scheduler").len() < workers {
                assert!(
                    std::time::Instant::now() < deadline,
                    "a replica did not learn every worker within 10 s"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    }

    /// Chooses a worker for request `index` on `replica`: the worker, and the cached tokens
    /// the decision counted on there.
    async fn route(&self, replica: usize, index: usize, a: &Arrival) -> (usize, u32) {
        let scheduler = self.routers[replica].scheduler();
        let mut request = RouteRequest::new(request_id(index), a.request.prompt);
        if self.aware {
            request = request.with_block_hashes(a.blocks.prompt_hashes().to_vec());
        }
        let decision = scheduler.route(request).await.expect("routed");
        let chosen = decision.booking.worker.worker_id.0 - 1;
        let predicted = decision
            .candidates
            .iter()
            .find(|c| c.worker == decision.booking.worker)
            .map_or(0, |c| c.cached_tokens);
        (chosen as usize, predicted)
    }

    async fn shutdown(self, measured: &mut Measured) {
        let Replicas {
            routers,
            connections,
            stats,
            feed,
            ..
        } = self;
        measured.index = routers.first().map(|r| r.scheduler().prefix_figures());
        match feed {
            Feed::Bus(publishers) => {
                for p in publishers {
                    let _ = p.close().await;
                }
            }
            Feed::Direct(managers) => drop(managers),
        }
        for s in &stats {
            let snap = s.snapshot();
            measured.bus_lag_sum += snap.lag.sum_seconds;
            measured.bus_lag_count += snap.lag.count;
            measured.bus_dropped += snap.dropped_total();
        }
        for router in routers {
            router.shutdown().await.expect("router shuts down cleanly");
        }
        drop(connections);
    }
}

/// Runs one case on `arrivals` (already timed for its load) and measures it.
pub async fn run(
    case: Case,
    plan: Plan,
    arrivals: Arc<Vec<Arrival>>,
    deployment: String,
    nats_url: Option<String>,
) -> Measured {
    let replicas = Replicas::start(&case, &plan, &deployment, nats_url.as_deref()).await;
    replicas.wait_members(plan.workers).await;

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
    let in_window = |t: f64| t >= plan.warmup && t < plan.measure_end;
    let mut measured_left = arrivals
        .iter()
        .filter(|a| in_window(a.request.arrival))
        .count();
    let take_joined = |worker: &mut Worker, cached: &mut Vec<u32>| {
        for (i, c) in worker.joined.drain(..) {
            cached[i] = c;
        }
    };
    loop {
        let step = workers
            .iter()
            .enumerate()
            .filter_map(|(w, k)| k.step_end.map(|t| (t, w)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let arrival = arrivals.get(next).map(|a| a.request.arrival);
        let (t, is_arrival) = match (arrival, step) {
            (Some(a), Some((s, _))) if a <= s => (a, true),
            (Some(a), None) => (a, true),
            (_, Some((s, _))) => (s, false),
            (None, None) => break,
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
        if let (Some(speedup), false) = (plan.speedup, draining) {
            let due = start + Duration::from_secs_f64(t / speedup);
            let now = Instant::now();
            if due > now {
                tokio::time::sleep_until(due).await;
            }
            driver_lag.push(Instant::now().saturating_duration_since(due).as_secs_f64());
        }
        if is_arrival {
            let index = next;
            next += 1;
            let a = &arrivals[index];
            let r = a.request;
            let replica = index % case.replicas;
            let w = if draining {
                index % plan.workers
            } else {
                let (w, predicted) = replicas.route(replica, index, a).await;
                if in_window(r.arrival) {
                    measured.predicted_cached += u64::from(predicted);
                }
                // The worker accepts it into its queue at once and says so, with what its
                // cache holds of the prompt now.
                let now_cached = workers[w].cached_now(&r, &a.blocks);
                replicas
                    .feed
                    .admitted(index, &r, &a.blocks, now_cached, w, replica);
                w
            };
            placed[index] = replica;
            placed_on[index] = w;
            workers[w].arrive_with_blocks(t, index, r, a.blocks.clone());
            take_joined(&mut workers[w], &mut cached);
            let changes = workers[w].take_kv_changes();
            if !draining {
                replicas.feed.kv_changes(changes, w);
            }
        } else {
            let w = step.expect("a step").1;
            workers[w].end_step(in_window(t), &mut happened);
            take_joined(&mut workers[w], &mut cached);
            let changes = workers[w].take_kv_changes();
            if !draining {
                replicas.feed.kv_changes(changes, w);
            }
            for h in happened.drain(..) {
                let index = match h {
                    Happened::FirstToken(i) => {
                        first_token[i] = t;
                        i
                    }
                    Happened::Completed(i) => {
                        measured_left -= usize::from(in_window(arrivals[i].request.arrival));
                        i
                    }
                    Happened::Progress(i, _) => i,
                };
                if !draining {
                    replicas.feed.happened(h, w, placed[index]);
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
        if !in_window(r.arrival) {
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
    replicas.shutdown(&mut measured).await;
    measured
}

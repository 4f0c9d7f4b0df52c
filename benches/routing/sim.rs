//! One case of the bench: a setting, a policy, a replica count and a load; its routers (real
//! [`Router`]s, over the real bus or fed directly), and the driver that runs the model's
//! workers and arrivals against them.

use std::sync::Arc;
use std::time::Duration;

use lease_router::wire::{Admitted, Completed, Outcome, ProgressStage, Progressed};
use lease_router::{
    ApplyConfig, IngressStats, LeaseConfig, LeasePublisher, NatsIngress, NoIngress,
    PublisherConfig, RequestId, RequestLeaseManager, RequestLoad, RoutePolicy, RouteRequest,
    Router, RouterConfig, RoutingConfig, WorkerWithDpRank,
};
use tokio::time::Instant;

use crate::model::{Engine, Happened, Request, Worker};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Setting {
    /// Workers publish lease events on NATS; every replica subscribes through the ingress.
    Shared,
    /// Each replica learns only about the requests it routed (as a proxy in their response
    /// path would), at once, and nothing else.
    Isolated,
    /// One replica routes everything and learns every event at once: the bound.
    Single,
}

impl Setting {
    pub fn name(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::Isolated => "isolated",
            Self::Single => "single",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Policy {
    RoundRobin,
    Random,
    /// Fewest bookings, then fewest tokens.
    LeastBookings,
    WeightedCost,
    PowerOfTwo,
}

impl Policy {
    pub const ALL: [Policy; 5] = [
        Self::RoundRobin,
        Self::Random,
        Self::LeastBookings,
        Self::WeightedCost,
        Self::PowerOfTwo,
    ];

    pub fn name(self) -> &'static str {
        self.route_policy().as_str()
    }

    /// The route API's policy.
    fn route_policy(self) -> RoutePolicy {
        match self {
            Self::RoundRobin => RoutePolicy::RoundRobin,
            Self::Random => RoutePolicy::Random,
            Self::LeastBookings => RoutePolicy::LeastBookings,
            Self::WeightedCost => RoutePolicy::WeightedCost,
            Self::PowerOfTwo => RoutePolicy::PowerOfTwo,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub setting: Setting,
    pub policy: Policy,
    pub replicas: usize,
    /// Share of the deployment's capacity.
    pub load: f64,
    /// Share of the routed requests lost between router and worker: booked by the decision,
    /// never admitted (each `1 / lost`-th request, so every case loses the same ones).
    pub lost: f64,
    /// The routers' provisional deadline; `None`: a lease lifetime (an hour here).
    pub provisional_deadline: Option<Duration>,
}

/// The model's time line, in model seconds, and how it maps to wall time.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub workers: usize,
    pub engine: Engine,
    /// Requests arriving from here on are measured...
    pub warmup: f64,
    /// ...until here; arrivals go on until `end` so the measured ones finish under load.
    pub measure_end: f64,
    pub end: f64,
    /// Model seconds per wall second, in real time; `None`: as fast as it computes (only
    /// for settings without a bus, whose results do not depend on wall time).
    pub speedup: Option<f64>,
}

/// How far past `end` the model may run for the measured requests to complete.
pub const MAX_DRAIN: f64 = 600.0;

/// What one case measured.
#[derive(Debug, Default)]
pub struct Measured {
    /// Seconds, of the requests that arrived in the measured window.
    pub ttft: Vec<f64>,
    pub latency: Vec<f64>,
    /// Measured requests still without a first token / without completion at the end.
    pub no_first_token: usize,
    pub unfinished: usize,
    /// Prefill share of each worker's time in the measured window.
    pub utilisation: Vec<f64>,
    /// How late the driver handled the model's events (wall seconds behind the schedule;
    /// real time only), sorted.
    pub driver_lag: Vec<f64>,
    /// Publish-to-apply lag of the bus events, summed over the replicas.
    pub bus_lag_sum: f64,
    pub bus_lag_count: u64,
    /// Of them, applied within 1 ms / 5 ms.
    pub bus_lag_1ms: u64,
    pub bus_lag_5ms: u64,
    /// Events the ingresses dropped (any reason).
    pub bus_dropped: u64,
    /// Measured requests lost between router and worker (not in the figures above).
    pub lost: usize,
    /// Provisional bookings the routers released at their deadline, summed over replicas.
    pub provisional_expired: u64,
    /// Bookings of lost requests still weighing on their workers when the run ended.
    pub phantom_at_end: usize,
}

/// Where the workers' lease events go.
enum Feed {
    /// One publisher per worker, on the bench's nats-server.
    Bus(Vec<LeasePublisher>),
    /// Straight into the manager of the replica that routed the request.
    Direct(Vec<RequestLeaseManager>),
}

fn worker(w: usize) -> WorkerWithDpRank {
    WorkerWithDpRank::new(w as u64 + 1, 0)
}

fn request_id(index: usize) -> String {
    format!("q{index:07}")
}

impl Feed {
    fn admitted(&self, index: usize, r: &Request, w: usize, replica: usize) {
        let id = request_id(index);
        match self {
            Self::Bus(publishers) => {
                let _ = publishers[w].publish(Admitted {
                    block_hashes: Vec::new(),
                    block_capacity: None,
                    class: None,
                    request_id: id,
                    worker_id: worker(w).worker_id.0,
                    dp_rank: 0,
                    prompt_tokens: r.prompt,
                    expected_output_tokens: None,
                    cached_tokens: Some(r.cached),
                });
            }
            Self::Direct(managers) => {
                let load = RequestLoad::new(r.prompt, None).with_cached_tokens(r.cached);
                managers[replica].admit_current(&id, worker(w), load);
            }
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

/// The routers of one case and what feeds them.
struct Replicas {
    routers: Vec<Router>,
    /// Kept for the case's length (each with its connection monitor), like a process's.
    connections: Vec<lease_router::NatsConnection>,
    stats: Vec<Arc<IngressStats>>,
    feed: Feed,
}

fn router_config(deployment: &str, case: &Case) -> RouterConfig {
    // Nothing expires and no member is forgotten within a run: every request completes,
    // and a replica that hears little (isolated) must not lose its workers.
    RouterConfig::new(deployment)
        .with_lease(LeaseConfig {
            scan_interval: Duration::from_secs(3600),
            provisional_deadline: case
                .provisional_deadline
                .unwrap_or(Duration::from_secs(3600)),
            ..LeaseConfig::default()
        })
        .with_routing(
            RoutingConfig::default()
                .with_policy(case.policy.route_policy())
                .with_worker_idle(Duration::from_secs(3600)),
        )
}

impl Replicas {
    async fn start(case: &Case, plan: &Plan, deployment: &str, nats_url: Option<&str>) -> Self {
        let workers = plan.workers;
        match case.setting {
            Setting::Shared => {
                let url = nats_url.expect("the shared setting needs the bench's nats-server");
                let subjects = crate::common::subjects(deployment);
                let mut routers = Vec::new();
                let mut stats = Vec::new();
                let mut connections = Vec::new();
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
                // The workers share one connection, each with its own publisher (id and
                // sequence), as worker processes on one host would.
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
                // A worker starting says so: every replica learns it as a member.
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
                }
            }
            Setting::Isolated | Setting::Single => {
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
                }
            }
        }
    }

    /// Until every replica counts every worker as a member.
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

    /// Chooses a worker for request `index` on `replica`.
    async fn route(&self, replica: usize, index: usize, r: &Request) -> usize {
        let scheduler = self.routers[replica].scheduler();
        let request = RouteRequest::new(request_id(index), r.prompt).with_cached_tokens(r.cached);
        let chosen = scheduler.route(request).await.expect("routed").booking;
        (chosen.worker.worker_id.0 - 1) as usize
    }

    async fn shutdown(self, measured: &mut Measured) {
        let Replicas {
            routers,
            connections,
            stats,
            feed,
        } = self;
        measured.provisional_expired = routers
            .iter()
            .map(|r| r.manager().stats().provisional_expired)
            .sum();
        // The direct feed holds the managers: dropped first, so the routers can end.
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
            let lag = snap.lag.clone();
            measured.bus_lag_sum += lag.sum_seconds;
            measured.bus_lag_count += lag.count;
            let upto = |bound: f64| {
                lag.buckets
                    .iter()
                    .find(|(b, _)| (*b - bound).abs() < 1e-9)
                    .map_or(0, |(_, c)| *c)
            };
            measured.bus_lag_1ms += upto(0.001);
            measured.bus_lag_5ms += upto(0.005);
            measured.bus_dropped += snap.dropped_total();
        }
        for router in routers {
            router.shutdown().await.expect("router shuts down cleanly");
        }
        drop(connections);
    }
}

/// Runs one case on `requests` (already timed for its load) and measures it.
pub async fn run(
    case: Case,
    plan: Plan,
    requests: Arc<Vec<Request>>,
    deployment: String,
    nats_url: Option<String>,
) -> Measured {
    let replicas = Replicas::start(&case, &plan, &deployment, nats_url.as_deref()).await;
    replicas.wait_members(plan.workers).await;

    let mut workers: Vec<Worker> = (0..plan.workers)
        .map(|_| Worker::new(plan.engine))
        .collect();
    let n = requests.len();
    let mut placed = vec![(0usize, 0usize); n];
    let mut first_token = vec![f64::NAN; n];
    let mut completed = vec![f64::NAN; n];
    let mut happened = Vec::new();
    let mut driver_lag = Vec::new();
    let mut next = 0usize;
    let mut measured = Measured::default();
    let mut lost_ids = Vec::new();
    let start = Instant::now();
    let in_window = |t: f64| t >= plan.warmup && t < plan.measure_end;
    let mut measured_left = requests.iter().filter(|r| in_window(r.arrival)).count();
    loop {
        let step = workers
            .iter()
            .enumerate()
            .filter_map(|(w, k)| k.step_end.map(|t| (t, w)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let arrival = requests.get(next).map(|r| r.arrival);
        let (t, is_arrival) = match (arrival, step) {
            (Some(a), Some((s, _))) if a <= s => (a, true),
            (Some(a), None) => (a, true),
            (_, Some((s, _))) => (s, false),
            (None, None) => break,
        };
        // Past `end` the routers' part is over: the model runs on in model time alone,
        // arrivals placed in turn only to keep the load on, until every measured request
        // has completed.
        let draining = t > plan.end;
        if (draining && measured_left == 0) || t > plan.end + MAX_DRAIN {
            break;
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
            let r = &requests[index];
            let replica = index % case.replicas;
            let lost = case.lost > 0.0 && index.is_multiple_of((1.0 / case.lost).round() as usize);
            if lost && !draining {
                // Routed and booked, then lost on the way: the worker never hears of it.
                replicas.route(replica, index, r).await;
                measured.lost += usize::from(in_window(r.arrival));
                lost_ids.push((replica, request_id(index)));
                placed[index] = (usize::MAX, replica);
                continue;
            }
            let w = if draining {
                index % plan.workers
            } else {
                let w = replicas.route(replica, index, r).await;
                // The worker accepts it into its queue at once and says so.
                replicas.feed.admitted(index, r, w, replica);
                w
            };
            placed[index] = (w, replica);
            workers[w].arrive(t, index, *r);
        } else {
            let w = step.expect("a step").1;
            workers[w].end_step(in_window(t), &mut happened);
            for h in happened.drain(..) {
                let index = match h {
                    Happened::FirstToken(i) => {
                        first_token[i] = t;
                        i
                    }
                    Happened::Completed(i) => {
                        completed[i] = t;
                        measured_left -= usize::from(in_window(requests[i].arrival));
                        i
                    }
                    Happened::Progress(i, _) => i,
                };
                if !draining {
                    replicas.feed.happened(h, w, placed[index].1);
                }
            }
        }
    }

    for (i, r) in requests.iter().enumerate() {
        if !in_window(r.arrival) || placed[i].0 == usize::MAX {
            continue;
        }
        // A request cut off by the end counts with its time so far: a lower bound.
        if first_token[i].is_nan() {
            measured.no_first_token += 1;
        }
        if completed[i].is_nan() {
            measured.unfinished += 1;
        }
        let or_end = |t: f64| if t.is_nan() { plan.end + MAX_DRAIN } else { t };
        measured.ttft.push(or_end(first_token[i]) - r.arrival);
        measured.latency.push(or_end(completed[i]) - r.arrival);
    }
    let window = plan.measure_end - plan.warmup;
    measured.utilisation = workers.iter().map(|w| w.prefill_busy / window).collect();
    driver_lag.sort_by(f64::total_cmp);
    measured.driver_lag = driver_lag;
    measured.phantom_at_end = lost_ids
        .iter()
        .filter(|(replica, id)| {
            replicas.routers[*replica]
                .manager()
                .lease(&RequestId::from(id.as_str()))
                .is_some()
        })
        .count();
    replicas.shutdown(&mut measured).await;
    measured
}

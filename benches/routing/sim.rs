//! One case of the bench: a setting, a policy, a replica count and a load; its routers (real
//! [`Router`](lease_router::Router)s in a [`Fleet`], over the real bus or fed directly), and
//! the driver that runs the model's workers and arrivals against them.

use std::sync::Arc;
use std::time::Duration;

use lease_router::{
    LeaseConfig, RequestId, RoutePolicy, RouteRequest, RouterConfig, RoutingConfig,
};
use tokio::time::Instant;

use crate::fleet::{request_id, worker_index, Admission, BusStats, Fleet, Plan, MAX_DRAIN};
use crate::model::{next_event, Happened, Request, Worker};

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
    /// What the replicas' ingresses saw of the bus.
    pub bus: BusStats,
    /// Measured requests lost between router and worker (not in the figures above).
    pub lost: usize,
    /// Provisional bookings the routers released at their deadline, summed over replicas.
    pub provisional_expired: u64,
    /// Bookings of lost requests still weighing on their workers when the run ended.
    pub phantom_at_end: usize,
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

/// Chooses a worker for request `index` on `replica`.
async fn route(fleet: &Fleet, replica: usize, index: usize, r: &Request) -> usize {
    let scheduler = fleet.routers[replica].scheduler();
    let request = RouteRequest::new(request_id(index), r.prompt).with_cached_tokens(r.cached);
    let decision = scheduler.route(request).await.expect("routed");
    worker_index(decision.booking.worker)
}

/// Runs one case on `requests` (already timed for its load) and measures it.
pub async fn run(
    case: Case,
    plan: Plan,
    requests: Arc<Vec<Request>>,
    deployment: String,
    nats_url: Option<String>,
) -> Measured {
    let bus = match case.setting {
        Setting::Shared => Some(
            nats_url
                .as_deref()
                .expect("the shared setting needs the bench's nats-server"),
        ),
        Setting::Isolated | Setting::Single => None,
    };
    let config = router_config(&deployment, &case);
    let fleet = Fleet::start(config, case.replicas, plan.workers, bus).await;

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
    let mut measured_left = requests
        .iter()
        .filter(|r| plan.in_window(r.arrival))
        .count();
    loop {
        let arrival = requests.get(next).map(|r| r.arrival);
        let Some((t, step)) = next_event(&workers, arrival) else {
            break;
        };
        // Past `end` the routers' part is over: the model runs on in model time alone,
        // arrivals placed in turn only to keep the load on, until every measured request
        // has completed.
        let draining = t > plan.end;
        if (draining && measured_left == 0) || t > plan.end + MAX_DRAIN {
            break;
        }
        if !draining {
            driver_lag.extend(plan.pace(start, t).await);
        }
        match step {
            None => {
                let index = next;
                next += 1;
                let r = &requests[index];
                let replica = index % case.replicas;
                let lost =
                    case.lost > 0.0 && index.is_multiple_of((1.0 / case.lost).round() as usize);
                if lost && !draining {
                    // Routed and booked, then lost on the way: the worker never hears of it.
                    route(&fleet, replica, index, r).await;
                    measured.lost += usize::from(plan.in_window(r.arrival));
                    lost_ids.push((replica, request_id(index)));
                    placed[index] = (usize::MAX, replica);
                    continue;
                }
                let w = if draining {
                    index % plan.workers
                } else {
                    let w = route(&fleet, replica, index, r).await;
                    let admission = Admission {
                        prompt: r.prompt,
                        cached: r.cached,
                        ..Admission::default()
                    };
                    fleet.feed.admitted(index, admission, w, replica);
                    w
                };
                placed[index] = (w, replica);
                workers[w].arrive(t, index, *r);
            }
            Some(w) => {
                workers[w].end_step(plan.in_window(t), &mut happened);
                for h in happened.drain(..) {
                    let index = match h {
                        Happened::FirstToken(i) => {
                            first_token[i] = t;
                            i
                        }
                        Happened::Completed(i) => {
                            completed[i] = t;
                            measured_left -= usize::from(plan.in_window(requests[i].arrival));
                            i
                        }
                        Happened::Progress(i, _) => i,
                    };
                    if !draining {
                        fleet.feed.happened(h, w, placed[index].1);
                    }
                }
            }
        }
    }

    for (i, r) in requests.iter().enumerate() {
        if !plan.in_window(r.arrival) || placed[i].0 == usize::MAX {
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
            fleet.routers[*replica]
                .manager()
                .lease(&RequestId::from(id.as_str()))
                .is_some()
        })
        .count();
    measured.provisional_expired = fleet.sum(|r| r.manager().stats().provisional_expired);
    measured.bus = fleet.shutdown().await;
    measured
}

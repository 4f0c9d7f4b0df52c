//! How a router chooses a worker for a new request, from the per-worker load by phase.
//!
//! A decision runs inside the scheduler actor ([`crate::scheduler::SchedulerHandle::route`]),
//! over the member workers only (a worker that left or was forgotten is never a candidate),
//! and books the request on the chosen worker at once, provisionally, so this replica's next
//! decision sees it before the worker's `admitted` comes over the bus.
//!
//! The cost of a candidate is `prefill_weight × (prefill tokens waiting + the request's
//! uncached prompt) + kv_weight × (KV tokens held + the request's prompt)`: what a new
//! request waits behind (prefill is compute-bound and served before it) and how full the
//! worker's KV cache would be with it (decode is memory-bound). The defaults, weighted cost
//! with prefill 1 and KV 0.25, come from `benches/route_policies.rs`: a model fleet of 16
//! workers and 4 replicas at ~85% load, 300 simulated seconds (see BENCHMARKS.md). p99
//! time-to-first-token, KV to spare / KV that binds: prefill 1 KV 0.25: 381 / 440 ms;
//! prefill alone: 344 / 1,039 ms (it piles requests onto workers short of memory); 1 : 1
//! (the reference router's): 514 / 562 ms; KV alone: 706 / 747 ms; power of two at
//! 1 : 0.25: 451 / 944 ms; round robin 376 / 4,519 ms; random 736 / 6,618 ms. Replicas that
//! see only their own decisions, at 1 : 0.25: 576 / 690 ms.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::scheduler::WorkerLoad;
use crate::types::{RequestId, RequestLoad, SchedulerBookingDescriptor, WorkerWithDpRank};

/// How a deployment's router chooses among its member workers.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutePolicy {
    /// The lowest weighted cost (ties: the lower worker). The default: the lowest p99 TTFT
    /// of the policies in the model fleet (see the module docs).
    #[default]
    WeightedCost,
    /// The lower cost of two workers drawn at random: replicas deciding at the same instant
    /// from the same picture do not all pick the same worker. The model does not have such
    /// simultaneous decisions, and there it does worse than the weighted cost.
    PowerOfTwo,
    /// Each member in turn (a baseline that ignores load).
    RoundRobin,
    /// A member drawn at random (a baseline that ignores load).
    Random,
}

impl RoutePolicy {
    pub const ALL: [RoutePolicy; 4] = [
        Self::WeightedCost,
        Self::PowerOfTwo,
        Self::RoundRobin,
        Self::Random,
    ];

    /// Its name in settings, JSON and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::WeightedCost => "weighted_cost",
            Self::PowerOfTwo => "power_of_two",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
        }
    }
}

impl std::str::FromStr for RoutePolicy {
    type Err = ParsePolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| ParsePolicyError(s.to_owned()))
    }
}

/// A policy name that is not one of [`RoutePolicy::ALL`].
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown routing policy {0:?}: expected weighted_cost, power_of_two, round_robin or random"
)]
pub struct ParsePolicyError(String);

/// The weights of the cost.
#[derive(Clone, Copy, PartialEq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostWeights {
    /// Per prefill token waiting (the request's own uncached prompt included).
    pub prefill: f64,
    /// Per KV token held (the request's own prompt included).
    pub kv: f64,
}

impl CostWeights {
    /// Refuses weights that would make costs meaningless.
    ///
    /// # Errors
    /// [`RouteRequestError::InvalidRequest`] for a negative, infinite or NaN weight.
    pub fn validate(&self) -> Result<(), RouteRequestError> {
        for (name, w) in [("prefill", self.prefill), ("kv", self.kv)] {
            if !w.is_finite() || w < 0.0 {
                return Err(RouteRequestError::InvalidRequest(format!(
                    "weight {name} must be a finite number, at least 0 (got {w})"
                )));
            }
        }
        Ok(())
    }
}

impl Default for CostWeights {
    /// Prefill 1, KV 0.25: see the module docs for the figures.
    fn default() -> Self {
        Self {
            prefill: 1.0,
            kv: 0.25,
        }
    }
}

/// Routing settings of one deployment.
#[derive(Clone, Copy, PartialEq, Debug, Default)]
pub struct RoutingConfig {
    pub policy: RoutePolicy,
    pub weights: CostWeights,
    /// How long a member with no live booking may say nothing before it is forgotten;
    /// `None`: one lease lifetime (twice the lease scan interval).
    pub worker_idle: Option<Duration>,
    /// Seeds the draws of [`RoutePolicy::Random`] and [`RoutePolicy::PowerOfTwo`], so that a
    /// simulation or a test makes the same choices from the same state each run; `None`:
    /// seeded from the OS. Changing it restarts the draws from the new seed.
    pub seed: Option<u64>,
}

/// What a route decision is asked to place.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRequest {
    pub request_id: RequestId,
    pub prompt_tokens: u32,
    /// Prompt tokens the caller knows to be cached on every worker (a shared system prompt,
    /// say); at most `prompt_tokens`.
    #[serde(default)]
    pub cached_tokens: Option<u32>,
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
}

impl RouteRequest {
    pub fn new(request_id: impl Into<RequestId>, prompt_tokens: u32) -> Self {
        Self {
            request_id: request_id.into(),
            prompt_tokens,
            cached_tokens: None,
            expected_output_tokens: None,
        }
    }

    pub fn with_cached_tokens(mut self, cached_tokens: u32) -> Self {
        self.cached_tokens = Some(cached_tokens);
        self
    }

    pub fn with_expected_output_tokens(mut self, expected: u32) -> Self {
        self.expected_output_tokens = Some(expected);
        self
    }

    /// What the provisional booking weighs until the worker's `admitted` replaces it.
    pub fn load(&self) -> RequestLoad {
        RequestLoad::new(self.prompt_tokens, self.expected_output_tokens)
            .with_cached_tokens(self.cached_tokens.unwrap_or(0))
    }

    /// Refuses what no worker could be asked to do.
    ///
    /// # Errors
    /// [`RouteRequestError::InvalidRequest`] for an empty request id, no prompt, or more
    /// cached tokens than prompt tokens.
    pub fn validate(&self) -> Result<(), RouteRequestError> {
        let invalid = |why: &str| Err(RouteRequestError::InvalidRequest(why.to_owned()));
        if self.request_id.is_empty() {
            return invalid("request_id is empty");
        }
        if self.prompt_tokens == 0 {
            return invalid("prompt_tokens must be at least 1");
        }
        if self.cached_tokens.is_some_and(|c| c > self.prompt_tokens) {
            return invalid("cached_tokens must not exceed prompt_tokens");
        }
        Ok(())
    }
}

/// A worker a decision considered.
#[derive(Clone, Copy, PartialEq, Debug, Serialize)]
pub struct Candidate {
    #[serde(flatten)]
    pub worker: WorkerWithDpRank,
    /// Its weighted cost with the request on it (see the module docs).
    pub cost: f64,
}

/// Candidates a weighted-cost decision reports: the cheapest few, not every member.
pub const REPORTED_CANDIDATES: usize = 8;

/// A decision: where the request goes, booked there provisionally.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteDecision {
    pub booking: SchedulerBookingDescriptor,
    pub policy: RoutePolicy,
    /// What the policy compared, cheapest first: every member up to
    /// [`REPORTED_CANDIDATES`] for weighted cost, the two drawn for power of two, the one
    /// chosen for round robin and random.
    pub candidates: Vec<Candidate>,
}

impl RouteDecision {
    pub fn worker(&self) -> WorkerWithDpRank {
        self.booking.worker
    }
}

/// Why a request could not be routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteRequestError {
    #[error("invalid route request: {0}")]
    InvalidRequest(String),
    #[error(
        "no live worker: the router learns workers from their lease events, and forgets those \
         that left or went idle"
    )]
    NoWorkers,
    #[error(
        "the lease manager refused the booking: max_active_leases are live (raise the limit, \
         or wait for leases to end)"
    )]
    LeasesFull,
    #[error("the lease manager is gone: the router was torn down")]
    ManagerGone,
    #[error("the scheduler has stopped")]
    Stopped,
}

impl RouteRequestError {
    /// Its label in the decision counters.
    pub const fn outcome(&self) -> RouteOutcome {
        match self {
            Self::InvalidRequest(_) => RouteOutcome::Invalid,
            Self::NoWorkers => RouteOutcome::NoWorkers,
            Self::LeasesFull | Self::ManagerGone | Self::Stopped => RouteOutcome::Refused,
        }
    }
}

/// How a decision ended, for its counter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RouteOutcome {
    Routed,
    NoWorkers,
    Invalid,
    /// The booking could not be made (leases full, router torn down).
    Refused,
}

impl RouteOutcome {
    pub const ALL: [RouteOutcome; 4] =
        [Self::Routed, Self::NoWorkers, Self::Invalid, Self::Refused];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Routed => "routed",
            Self::NoWorkers => "no_workers",
            Self::Invalid => "invalid",
            Self::Refused => "refused",
        }
    }
}

/// The cost of putting `request` on a worker carrying `load`.
pub fn cost(weights: CostWeights, load: &WorkerLoad, request: &RequestLoad) -> f64 {
    cost_of(
        weights,
        i64::try_from(load.prefill_tokens).unwrap_or(i64::MAX),
        i64::try_from(load.kv_tokens).unwrap_or(i64::MAX),
        request,
    )
}

/// [`cost`] from a worker's signed sums (briefly negative ones count as zero).
pub(crate) fn cost_of(weights: CostWeights, prefill: i64, kv: i64, request: &RequestLoad) -> f64 {
    let uncached = request.prompt_tokens.saturating_sub(request.cached_tokens);
    let prefill = prefill.max(0) as f64 + f64::from(uncached);
    let kv = kv.max(0) as f64 + f64::from(request.prompt_tokens);
    weights.prefill * prefill + weights.kv * kv
}

/// The order of candidates: cheaper first, then the lower worker.
pub(crate) fn cheaper(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    a.cost.total_cmp(&b.cost).then(a.worker.cmp(&b.worker))
}

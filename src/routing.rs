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
//! with prefill 1 and KV 0.25, had the lowest p99 time to first token of the policies and
//! weights tried in a model fleet (`cargo bench --bench route_policies`; the figures are in
//! BENCHMARKS.md).
//!
//! A request that carries its prompt's `token_ids` or `block_hashes` is costed per worker:
//! the uncached prompt is what that worker's prefix cache lacks (the prompt less its overlap
//! in the [prefix index](crate::PrefixIndex), in tokens), not one `cached_tokens` for all.
//! A guard keeps a shared prefix from piling requests on one worker: the overlap counts
//! only on a worker whose prefill tokens waiting are within
//! [`RoutingConfig::affinity_gap`] of the least waiting member's.
//!
//! [`Chooser`] is the policy code: it picks among the members the scheduler hands it, and
//! keeps what the policies remember between decisions (the turn, the draws).

use std::time::Duration;

use hashbrown::HashMap;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::load::{LoadSums, RequestLoad, WorkerLoad};
use crate::types::{RequestId, SchedulerBookingDescriptor, WorkerWithDpRank};

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
    /// The fewest bookings, then the fewest tokens (prompt plus expected output; ties: the
    /// lower worker): a baseline that counts requests, not their phases.
    LeastBookings,
}

impl RoutePolicy {
    /// Every policy, in the order of the decision counters.
    pub const ALL: [RoutePolicy; 5] = [
        Self::WeightedCost,
        Self::PowerOfTwo,
        Self::RoundRobin,
        Self::Random,
        Self::LeastBookings,
    ];

    /// Its name in settings, JSON and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::WeightedCost => "weighted_cost",
            Self::PowerOfTwo => "power_of_two",
            Self::RoundRobin => "round_robin",
            Self::Random => "random",
            Self::LeastBookings => "least_bookings",
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
    "unknown routing policy {0:?}: expected weighted_cost, power_of_two, round_robin, random \
     or least_bookings"
)]
pub struct ParsePolicyError(String);

/// The weights of the cost: [`Default`], then the `with_*` methods (or JSON: `{"prefill":
/// 1.0, "kv": 0.25}`).
#[derive(Clone, Copy, PartialEq, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostWeights {
    pub(crate) prefill: f64,
    pub(crate) kv: f64,
}

impl CostWeights {
    /// Sets the weight per prefill token waiting (the request's own uncached prompt
    /// included).
    pub fn with_prefill(mut self, prefill: f64) -> Self {
        self.prefill = prefill;
        self
    }

    /// Sets the weight per KV token held (the request's own prompt included).
    pub fn with_kv(mut self, kv: f64) -> Self {
        self.kv = kv;
        self
    }

    /// The weight per prefill token waiting.
    pub fn prefill(&self) -> f64 {
        self.prefill
    }

    /// The weight per KV token held.
    pub fn kv(&self) -> f64 {
        self.kv
    }

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

/// Default of [`RoutingConfig::affinity_gap`]: 8,192 prefill tokens, about half a second of
/// prefill on one GPU (see BENCHMARKS.md for the guard's measured effect).
pub const DEFAULT_AFFINITY_GAP: u32 = 8_192;

/// Bytes a route request's `request_id` may have: 1,024. A worker names the request in an
/// event of at most `max_event_bytes` (4,096 by default), so a longer id could rarely be
/// matched, and each provisional booking keeps its id until released.
pub const MAX_ROUTE_REQUEST_ID_BYTES: usize = 1 << 10;

/// Token ids a route request may carry: a million, longer than any model's context.
pub const MAX_ROUTE_TOKEN_IDS: usize = 1 << 20;

/// Block hashes a route request may carry: 65,536 (a million tokens of 16-token blocks).
pub const MAX_ROUTE_BLOCK_HASHES: usize = 1 << 16;

/// Routing settings of one deployment: [`Default`], then the `with_*` methods.
#[derive(Clone, Copy, PartialEq, Debug, Default)]
pub struct RoutingConfig {
    pub(crate) policy: RoutePolicy,
    pub(crate) weights: CostWeights,
    pub(crate) worker_idle: Option<Duration>,
    pub(crate) seed: Option<u64>,
    pub(crate) affinity_gap: Option<u32>,
}

impl RoutingConfig {
    /// Sets how a decision picks the worker. Default [`RoutePolicy::WeightedCost`].
    pub fn with_policy(mut self, policy: RoutePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the weights of the cost [`RoutePolicy::WeightedCost`] minimises.
    pub fn with_weights(mut self, weights: CostWeights) -> Self {
        self.weights = weights;
        self
    }

    /// Sets how long a member with no live booking may say nothing before it is forgotten.
    /// Default: one lease lifetime (twice the lease scan interval).
    pub fn with_worker_idle(mut self, idle: Duration) -> Self {
        self.worker_idle = Some(idle);
        self
    }

    /// Seeds the draws of [`RoutePolicy::Random`] and [`RoutePolicy::PowerOfTwo`], so that a
    /// simulation or a test makes the same choices from the same state each run. Default:
    /// seeded from the OS. A new seed restarts the draws.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Sets the hot-worker guard of prefix-aware decisions: a worker's cached prefix
    /// counts only while its prefill tokens waiting are at most `tokens` above the least
    /// waiting member's. Past that, cache affinity yields and the request is costed as if
    /// nothing were cached there, so a prefix everyone wants spreads to a second worker
    /// instead of queueing on one. Default [`DEFAULT_AFFINITY_GAP`].
    pub fn with_affinity_gap(mut self, tokens: u32) -> Self {
        self.affinity_gap = Some(tokens);
        self
    }

    /// The hot-worker guard's gap, in prefill tokens waiting.
    pub fn affinity_gap(&self) -> u32 {
        self.affinity_gap.unwrap_or(DEFAULT_AFFINITY_GAP)
    }

    /// How a decision picks the worker.
    pub fn policy(&self) -> RoutePolicy {
        self.policy
    }

    /// The weights of the cost [`RoutePolicy::WeightedCost`] minimises.
    pub fn weights(&self) -> CostWeights {
        self.weights
    }

    /// How long a silent member with no live booking is kept; `None`: one lease lifetime.
    pub fn worker_idle(&self) -> Option<Duration> {
        self.worker_idle
    }

    /// The seed of the random policies' draws; `None`: seeded from the OS.
    pub fn seed(&self) -> Option<u64> {
        self.seed
    }
}

/// What a route decision is asked to place.
///
/// Keys it does not know are ignored, as the wire contract ignores them: a gateway that
/// sends a field a newer router understands still gets a decision from an older one.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct RouteRequest {
    /// The request's id, under which the provisional booking is made.
    pub request_id: RequestId,
    /// Tokens of the prompt, at least 1; 0 (or absent in JSON) with `token_ids`: their
    /// number.
    #[serde(default)]
    pub prompt_tokens: u32,
    /// Prompt tokens the caller knows to be cached on every worker (a shared system prompt,
    /// say); at most `prompt_tokens`.
    #[serde(default)]
    pub cached_tokens: Option<u32>,
    /// Output tokens the caller expects; `None`: unknown (counts 0).
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
    /// The prompt's token ids, exactly as the engine will see them (after any chat
    /// template): cut into the deployment's blocks and hashed by
    /// [`block_hashes`](crate::block_hashes), for a prefix-aware decision. At most
    /// [`MAX_ROUTE_TOKEN_IDS`]; not with `block_hashes`.
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    /// The prompt's block hashes, as [`block_hashes`](crate::block_hashes) makes them at the
    /// deployment's block size, for a prefix-aware decision. At most
    /// [`MAX_ROUTE_BLOCK_HASHES`], and no more than the prompt's full blocks.
    #[serde(default)]
    pub block_hashes: Option<Vec<u64>>,
    /// The prompt as text, for the HTTP API of a router with a tokenizer file (`--tokenizer`):
    /// tokenized there into `token_ids` before the decision. Exactly what the engine will
    /// tokenize (after any chat template). Not with `token_ids` or `block_hashes`.
    #[serde(default)]
    pub prompt: Option<String>,
    /// The request's admission class (see [`AdmissionConfig`](crate::AdmissionConfig));
    /// `None`, or a class the deployment does not have: its default class. The worker
    /// should name the same class on its `admitted` (`cls`), which every replica counts.
    #[serde(default)]
    pub class: Option<String>,
    /// How long the request may wait for admission while the deployment is saturated
    /// (capped by the deployment's [`QueueConfig::max_wait_ms`](crate::QueueConfig)); `None`:
    /// that cap. 0: not at all. Only deployments with admission classes make requests wait.
    #[serde(default)]
    pub max_wait_ms: Option<u64>,
}

impl RouteRequest {
    /// A request of `prompt_tokens`, none known to be cached, output length unknown.
    pub fn new(request_id: impl Into<RequestId>, prompt_tokens: u32) -> Self {
        Self {
            request_id: request_id.into(),
            prompt_tokens,
            cached_tokens: None,
            expected_output_tokens: None,
            token_ids: None,
            block_hashes: None,
            prompt: None,
            class: None,
            max_wait_ms: None,
        }
    }

    /// Sets [`max_wait_ms`](Self::max_wait_ms).
    pub fn with_max_wait_ms(mut self, ms: u64) -> Self {
        self.max_wait_ms = Some(ms);
        self
    }

    /// Sets [`class`](Self::class).
    pub fn with_class(mut self, class: impl Into<String>) -> Self {
        self.class = Some(class.into());
        self
    }

    /// Sets [`token_ids`](Self::token_ids) (and the prompt's length to theirs).
    pub fn with_token_ids(mut self, token_ids: Vec<u32>) -> Self {
        self.prompt_tokens = u32::try_from(token_ids.len()).unwrap_or(u32::MAX);
        self.token_ids = Some(token_ids);
        self
    }

    /// Sets [`block_hashes`](Self::block_hashes).
    pub fn with_block_hashes(mut self, block_hashes: Vec<u64>) -> Self {
        self.block_hashes = Some(block_hashes);
        self
    }

    /// The prompt's length: `prompt_tokens`, or the number of `token_ids` when it is 0.
    pub fn prompt_len(&self) -> u32 {
        match (&self.token_ids, self.prompt_tokens) {
            (Some(ids), 0) => u32::try_from(ids.len()).unwrap_or(u32::MAX),
            _ => self.prompt_tokens,
        }
    }

    /// The request's block hashes at `block_size` tokens a block: given, made from its
    /// token ids, or none.
    /// Moves the hashes out of the request (the decision needs them, the request no longer).
    pub(crate) fn blocks(&mut self, block_size: u32) -> Result<Vec<u64>, RouteRequestError> {
        let full_blocks = self.prompt_len() / block_size.max(1);
        let hashes = match (self.block_hashes.take(), &self.token_ids) {
            (Some(hashes), _) => hashes,
            (None, Some(ids)) => crate::prefix::block_hashes(ids, block_size as usize),
            (None, None) => return Ok(Vec::new()),
        };
        if hashes.len() as u64 > u64::from(full_blocks) {
            return Err(RouteRequestError::InvalidRequest(format!(
                "block_hashes holds {} blocks, but a prompt of {} tokens has {full_blocks} \
                 full blocks of {block_size} tokens",
                hashes.len(),
                self.prompt_len()
            )));
        }
        Ok(hashes)
    }

    /// Sets [`cached_tokens`](Self::cached_tokens).
    pub fn with_cached_tokens(mut self, cached_tokens: u32) -> Self {
        self.cached_tokens = Some(cached_tokens);
        self
    }

    /// Sets [`expected_output_tokens`](Self::expected_output_tokens).
    pub fn with_expected_output_tokens(mut self, expected: u32) -> Self {
        self.expected_output_tokens = Some(expected);
        self
    }

    /// What the provisional booking weighs until the worker's `admitted` replaces it (before
    /// a prefix-aware decision adds what it found cached on the chosen worker).
    pub fn load(&self) -> RequestLoad {
        RequestLoad::new(self.prompt_len(), self.expected_output_tokens)
            .with_cached_tokens(self.cached_tokens.unwrap_or(0))
    }

    /// Refuses what no worker could be asked to do.
    ///
    /// # Errors
    /// [`RouteRequestError::InvalidRequest`] for an empty request id or one over
    /// [`MAX_ROUTE_REQUEST_ID_BYTES`], a class that is not a
    /// class name (a valid name the deployment does not have is its default class), prompt
    /// text (which only
    /// the HTTP API with a tokenizer turns into token ids), no prompt, more
    /// cached tokens than prompt tokens, both `token_ids` and `block_hashes`, more of either
    /// than their limit, or `token_ids` of another length than `prompt_tokens`.
    pub fn validate(&self) -> Result<(), RouteRequestError> {
        let invalid = |why: String| Err(RouteRequestError::InvalidRequest(why));
        if self.request_id.is_empty() {
            return invalid("request_id is empty".into());
        }
        if self.request_id.len() > MAX_ROUTE_REQUEST_ID_BYTES {
            return invalid(format!(
                "request_id is {} bytes: at most {MAX_ROUTE_REQUEST_ID_BYTES}",
                self.request_id.len()
            ));
        }
        if self.prompt.is_some() {
            return invalid(if self.token_ids.is_some() || self.block_hashes.is_some() {
                "give one of prompt, token_ids and block_hashes".into()
            } else {
                "prompt text needs the router's tokenizer (lease-router serve --tokenizer FILE): \
                 send token_ids or block_hashes instead"
                    .into()
            });
        }
        if let Some(ids) = &self.token_ids {
            if ids.len() > MAX_ROUTE_TOKEN_IDS {
                return invalid(format!(
                    "token_ids holds {} ids: at most {MAX_ROUTE_TOKEN_IDS}",
                    ids.len()
                ));
            }
            if self.prompt_tokens != 0 && ids.len() != self.prompt_tokens as usize {
                return invalid(format!(
                    "prompt_tokens is {} but token_ids holds {} ids (give the same prompt, or \
                     leave prompt_tokens out)",
                    self.prompt_tokens,
                    ids.len()
                ));
            }
            if self.block_hashes.is_some() {
                return invalid("give token_ids or block_hashes, not both".into());
            }
        }
        if let Some(hashes) = &self.block_hashes {
            if hashes.len() > MAX_ROUTE_BLOCK_HASHES {
                return invalid(format!(
                    "block_hashes holds {} hashes: at most {MAX_ROUTE_BLOCK_HASHES}",
                    hashes.len()
                ));
            }
        }
        if let Some(class) = &self.class {
            if !crate::admission::is_valid_class_name(class) {
                return invalid(format!(
                    "class {:?} is not a class name: 1 to {} ASCII letters, digits, '-' and '_'",
                    class.chars().take(80).collect::<String>(),
                    crate::admission::MAX_CLASS_NAME_LEN
                ));
            }
        }
        let prompt = self.prompt_len();
        if prompt == 0 {
            return invalid("prompt_tokens must be at least 1 (or token_ids not empty)".into());
        }
        if self.cached_tokens.is_some_and(|c| c > prompt) {
            return invalid("cached_tokens must not exceed prompt_tokens".into());
        }
        Ok(())
    }
}

/// A worker a decision considered.
#[derive(Clone, Copy, PartialEq, Debug, Serialize)]
pub struct Candidate {
    /// The worker.
    #[serde(flatten)]
    pub worker: WorkerWithDpRank,
    /// Its weighted cost with the request on it (see the module docs).
    pub cost: f64,
    /// How many of the request's blocks, from the first, the prefix index takes it to hold
    /// (0 for a request without `token_ids` or `block_hashes`).
    pub overlap_blocks: u32,
    /// The prompt tokens its cost counted as cached: the request's `cached_tokens` or its
    /// overlap in tokens, whichever is more, unless the hot-worker guard withheld the
    /// overlap.
    pub cached_tokens: u32,
}

/// Candidates a weighted-cost decision reports: the cheapest few, not every member.
pub(crate) const REPORTED_CANDIDATES: usize = 8;

/// A decision: where the request goes, booked there provisionally.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteDecision {
    /// The provisional booking made on the chosen worker.
    pub booking: SchedulerBookingDescriptor,
    /// The policy that decided.
    pub policy: RoutePolicy,
    /// What the policy compared, cheapest first: every member up to
    /// 8 for weighted cost, the two drawn for power of two, the one
    /// chosen for round robin and random.
    pub candidates: Vec<Candidate>,
}

impl RouteDecision {
    /// The worker the request goes to.
    pub fn worker(&self) -> WorkerWithDpRank {
        self.booking.worker
    }
}

/// Why a request could not be routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteRequestError {
    /// The request (or the cost weights) failed validation; holds why.
    #[error("invalid route request: {0}")]
    InvalidRequest(String),
    #[error(
        "no live worker: the router learns workers from their lease events, and forgets those \
         that left or went idle"
    )]
    /// No live worker is known to the router.
    NoWorkers,
    #[error(
        "the lease manager refused the booking: max_active_leases are live (raise the limit, \
         or wait for leases to end)"
    )]
    /// [`LeaseConfig::max_active_leases`](crate::LeaseConfig::max_active_leases) leases are live: the booking was refused.
    LeasesFull,
    /// The router (and its lease manager) was torn down.
    #[error("the lease manager is gone: the router was torn down")]
    ManagerGone,
    /// The scheduler task has stopped.
    #[error("the scheduler has stopped")]
    Stopped,
    /// The deployment is saturated and the request's class could not go within its wait,
    /// or this replica's queue was full: retry after `retry_after`.
    #[error("the deployment is saturated: {why}; retry after {} s", retry_after.as_secs())]
    Overloaded {
        /// Why it was refused.
        why: String,
        /// When a retry may find room (whole seconds, at least one).
        retry_after: Duration,
    },
}

impl RouteRequestError {
    /// Its label in the decision counters.
    pub const fn outcome(&self) -> RouteOutcome {
        match self {
            Self::InvalidRequest(_) => RouteOutcome::Invalid,
            Self::NoWorkers => RouteOutcome::NoWorkers,
            Self::LeasesFull | Self::ManagerGone | Self::Stopped | Self::Overloaded { .. } => {
                RouteOutcome::Refused
            }
        }
    }
}

/// How a decision ended, for its counter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RouteOutcome {
    /// A worker was chosen and booked.
    Routed,
    /// No live worker was known ([`RouteRequestError::NoWorkers`]).
    NoWorkers,
    /// The request was invalid ([`RouteRequestError::InvalidRequest`]).
    Invalid,
    /// The booking could not be made (leases full, router torn down), or admission refused
    /// it ([`RouteRequestError::Overloaded`]).
    Refused,
}

impl RouteOutcome {
    /// Every outcome.
    pub const ALL: [RouteOutcome; 4] =
        [Self::Routed, Self::NoWorkers, Self::Invalid, Self::Refused];

    /// Its label in the decision counters (`routed`, `no_workers`, `invalid`, `refused`).
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
        request.cached_tokens,
    )
}

/// [`cost`] from a worker's signed sums (briefly negative ones count as zero), with `cached`
/// of the prompt's tokens taken to be cached there.
fn cost_of(weights: CostWeights, prefill: i64, kv: i64, request: &RequestLoad, cached: u32) -> f64 {
    let uncached = request.prompt_tokens.saturating_sub(cached);
    let prefill = prefill.max(0) as f64 + f64::from(uncached);
    let kv = kv.max(0) as f64 + f64::from(request.prompt_tokens);
    weights.prefill * prefill + weights.kv * kv
}

/// The order of candidates: cheaper first, then the lower worker.
fn cheaper(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    a.cost.total_cmp(&b.cost).then(a.worker.cmp(&b.worker))
}

/// What a prefix-aware decision knows of the members: each one's overlap with the request
/// (from the prefix index), and the hot-worker guard.
pub(crate) struct PrefixCredit<'a> {
    overlaps: &'a HashMap<WorkerWithDpRank, u32>,
    block_size: u32,
    gap: i64,
    /// The least prefill waiting among the members (set by the decision).
    floor: i64,
}

/// The overlaps of a request without blocks.
#[cfg(test)]
static NO_OVERLAPS: std::sync::LazyLock<HashMap<WorkerWithDpRank, u32>> =
    std::sync::LazyLock::new(HashMap::new);

impl PrefixCredit<'static> {
    /// No overlap anywhere: a load-only decision.
    #[cfg(test)]
    pub(crate) fn none() -> Self {
        Self::new(&NO_OVERLAPS, 1)
    }
}

impl<'a> PrefixCredit<'a> {
    pub(crate) fn new(overlaps: &'a HashMap<WorkerWithDpRank, u32>, block_size: u32) -> Self {
        Self {
            overlaps,
            block_size,
            gap: i64::from(DEFAULT_AFFINITY_GAP),
            floor: 0,
        }
    }

    /// The worker's overlap in blocks, and the prompt tokens its cost counts as cached.
    fn credit(&self, worker: &WorkerWithDpRank, prefill: i64, request: &RequestLoad) -> (u32, u32) {
        let overlap = match self.overlaps.get(worker) {
            Some(&overlap) => overlap,
            _ => return (0, request.cached_tokens),
        };
        if prefill.max(0) > self.floor.saturating_add(self.gap) {
            // The guard: this worker is far busier than the least busy; its cache does not
            // count, so the request goes where the load says.
            return (overlap, request.cached_tokens);
        }
        (overlap, self.cached_on(overlap, request))
    }

    /// The prompt tokens `worker` has cached, guard or not: what a booking there weighs
    /// (a worker the guard held back may still be chosen, and its cache still serves).
    pub(crate) fn held_tokens(&self, worker: &WorkerWithDpRank, request: &RequestLoad) -> u32 {
        let overlap = self.overlaps.get(worker).copied().unwrap_or(0);
        self.cached_on(overlap, request)
    }

    fn cached_on(&self, overlap: u32, request: &RequestLoad) -> u32 {
        overlap
            .saturating_mul(self.block_size)
            .min(request.prompt_tokens)
            .max(request.cached_tokens)
    }

    fn candidate(
        &self,
        weights: CostWeights,
        worker: WorkerWithDpRank,
        prefill: i64,
        kv: i64,
        request: &RequestLoad,
    ) -> Candidate {
        let (overlap_blocks, cached_tokens) = self.credit(&worker, prefill, request);
        Candidate {
            worker,
            cost: cost_of(weights, prefill, kv, request, cached_tokens),
            overlap_blocks,
            cached_tokens,
        }
    }
}

/// The policy code and what it remembers between decisions: the turn of round robin, the
/// draws of the random policies, the members in order for the policies that pick by index.
pub(crate) struct Chooser {
    config: RoutingConfig,
    /// The members in worker order; rebuilt when membership has changed.
    members: Vec<WorkerWithDpRank>,
    members_dirty: bool,
    round_robin: usize,
    /// The draws of the random policies (see [`RoutingConfig::seed`]).
    rng: SmallRng,
}

impl Chooser {
    pub(crate) fn new() -> Self {
        Self {
            config: RoutingConfig::default(),
            members: Vec::new(),
            members_dirty: true,
            round_robin: 0,
            rng: SmallRng::from_os_rng(),
        }
    }

    pub(crate) fn config(&self) -> RoutingConfig {
        self.config
    }

    /// A new seed restarts the draws; the same one (a PUT that changes only the policy)
    /// leaves them where they are.
    pub(crate) fn set_config(&mut self, config: RoutingConfig) {
        if let Some(seed) = config.seed.filter(|&seed| Some(seed) != self.config.seed) {
            self.rng = SmallRng::seed_from_u64(seed);
        }
        self.config = config;
    }

    /// Some worker joined or left the members: the ordered list is rebuilt at the next
    /// decision that needs it.
    pub(crate) fn members_changed(&mut self) {
        self.members_dirty = true;
    }

    /// Picks one of `members` (each with its sums) for `request` by the policy in force,
    /// with the candidates it compared, cheapest first; `None` when there is no member.
    /// `sums_of` finds a member's sums for the policies that pick by index; `prefix` holds
    /// the members' overlaps with the request (none for a request without blocks).
    pub(crate) fn choose<'a>(
        &mut self,
        members: impl Iterator<Item = (&'a WorkerWithDpRank, &'a LoadSums)> + Clone,
        sums_of: impl Fn(&WorkerWithDpRank) -> WorkerLoad,
        request: &RequestLoad,
        mut prefix: PrefixCredit<'_>,
    ) -> Option<(WorkerWithDpRank, Vec<Candidate>)> {
        let weights = self.config.weights;
        prefix.gap = i64::from(self.config.affinity_gap());
        if !prefix.overlaps.is_empty() {
            prefix.floor = members
                .clone()
                .map(|(_, sums)| sums.prefill_tokens.max(0))
                .min()
                .unwrap_or(0);
        }
        match self.config.policy {
            RoutePolicy::WeightedCost => return cheapest(weights, members, request, &prefix),
            RoutePolicy::LeastBookings => {
                let (worker, load) = members
                    .map(|(w, sums)| (*w, sums.load()))
                    .min_by_key(|(w, load)| (load.rank(), *w))?;
                let candidate = prefix.candidate(
                    weights,
                    worker,
                    signed(load.prefill_tokens),
                    signed(load.kv_tokens),
                    request,
                );
                return Some((worker, vec![candidate]));
            }
            _ => {}
        }
        if self.members_dirty {
            self.members.clear();
            self.members.extend(members.map(|(w, _)| *w));
            self.members.sort_unstable();
            self.members_dirty = false;
        }
        let n = self.members.len();
        if n == 0 {
            return None;
        }
        let pick = |chooser: &Self, i: usize| {
            let worker = chooser.members[i];
            let load = sums_of(&worker);
            prefix.candidate(
                weights,
                worker,
                signed(load.prefill_tokens),
                signed(load.kv_tokens),
                request,
            )
        };
        let mut candidates = match self.config.policy {
            RoutePolicy::PowerOfTwo if n > 1 => {
                let first = self.rng.random_range(0..n);
                let second = (first + self.rng.random_range(1..n)) % n;
                vec![pick(self, first), pick(self, second)]
            }
            RoutePolicy::RoundRobin => {
                let i = self.round_robin % n;
                self.round_robin = self.round_robin.wrapping_add(1);
                vec![pick(self, i)]
            }
            _ => {
                let i = self.rng.random_range(0..n);
                vec![pick(self, i)]
            }
        };
        candidates.sort_unstable_by(cheaper);
        Some((candidates[0].worker, candidates))
    }
}

fn signed(tokens: u64) -> i64 {
    i64::try_from(tokens).unwrap_or(i64::MAX)
}

/// The weighted-cost choice, over the members as they come (no lookup per member), keeping
/// the cheapest few in a sorted array: most members cost one comparison with the dearest
/// kept.
fn cheapest<'a>(
    weights: CostWeights,
    members: impl Iterator<Item = (&'a WorkerWithDpRank, &'a LoadSums)>,
    request: &RequestLoad,
    prefix: &PrefixCredit<'_>,
) -> Option<(WorkerWithDpRank, Vec<Candidate>)> {
    const KEEP: usize = REPORTED_CANDIDATES;
    let mut best = [Candidate {
        worker: WorkerWithDpRank::default(),
        cost: f64::INFINITY,
        overlap_blocks: 0,
        cached_tokens: 0,
    }; KEEP];
    let mut kept = 0;
    for (worker, sums) in members {
        let c = prefix.candidate(
            weights,
            *worker,
            sums.prefill_tokens,
            sums.kv_tokens,
            request,
        );
        if kept == KEEP && cheaper(&c, &best[KEEP - 1]).is_ge() {
            continue;
        }
        let mut at = kept.min(KEEP - 1);
        while at > 0 && cheaper(&c, &best[at - 1]).is_lt() {
            best[at] = best[at - 1];
            at -= 1;
        }
        best[at] = c;
        kept = (kept + 1).min(KEEP);
    }
    (kept > 0).then(|| (best[0].worker, best[..kept].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each policy's name is its JSON name, and it parses back; anything else is refused,
    /// with the names that are accepted.
    #[test]
    fn policy_names_round_trip() {
        for policy in RoutePolicy::ALL {
            let json = serde_json::to_string(&policy).unwrap();
            assert_eq!(json, format!("\"{}\"", policy.as_str()));
            assert_eq!(policy.as_str().parse::<RoutePolicy>().unwrap(), policy);
        }
        let names: std::collections::HashSet<_> =
            RoutePolicy::ALL.iter().map(|p| p.as_str()).collect();
        assert_eq!(names.len(), RoutePolicy::ALL.len(), "distinct names");
        let err = "fastest".parse::<RoutePolicy>().unwrap_err().to_string();
        assert!(err.contains("\"fastest\""), "{err}");
        for policy in RoutePolicy::ALL {
            assert!(
                err.contains(policy.as_str()),
                "{err} lacks {}",
                policy.as_str()
            );
        }
    }

    /// What each builder sets, each accessor reads back.
    #[test]
    fn builders_set_what_accessors_read() {
        let weights = CostWeights::default().with_prefill(2.5).with_kv(0.75);
        assert_eq!((weights.prefill(), weights.kv()), (2.5, 0.75));
        let config = RoutingConfig::default()
            .with_policy(RoutePolicy::RoundRobin)
            .with_weights(weights)
            .with_worker_idle(Duration::from_secs(7))
            .with_seed(42);
        assert_eq!(config.policy(), RoutePolicy::RoundRobin);
        assert_eq!(config.weights(), weights);
        assert_eq!(config.worker_idle(), Some(Duration::from_secs(7)));
        assert_eq!(config.seed(), Some(42));
        assert_eq!(RoutingConfig::default().seed(), None);
    }

    #[test]
    fn weights_and_requests_are_checked_at_their_bounds() {
        let w = CostWeights::default();
        assert!(
            w.with_prefill(0.0).with_kv(0.0).validate().is_ok(),
            "0 is allowed"
        );
        for bad in [-0.1, f64::NAN, f64::INFINITY] {
            assert!(w.with_prefill(bad).validate().is_err(), "prefill {bad}");
            assert!(w.with_kv(bad).validate().is_err(), "kv {bad}");
        }
        let request = |prompt, cached| RouteRequest {
            class: None,
            max_wait_ms: None,
            prompt: None,
            token_ids: None,
            block_hashes: None,
            request_id: RequestId::from("r"),
            prompt_tokens: prompt,
            cached_tokens: Some(cached),
            expected_output_tokens: None,
        };
        assert!(request(10, 10).validate().is_ok(), "all cached is fine");
        assert!(request(10, 11).validate().is_err());
        // Token ids and block hashes up to their limits, not one more.
        let ids = |n: usize| RouteRequest::new("r", 0).with_token_ids(vec![7; n]);
        assert!(ids(MAX_ROUTE_TOKEN_IDS).validate().is_ok());
        let err = ids(MAX_ROUTE_TOKEN_IDS + 1).validate().unwrap_err();
        assert!(err.to_string().contains("at most 1048576"), "{err}");
        let hashes = |n: usize| RouteRequest::new("r", 16 << 16).with_block_hashes(vec![7; n]);
        assert!(hashes(MAX_ROUTE_BLOCK_HASHES).validate().is_ok());
        let err = hashes(MAX_ROUTE_BLOCK_HASHES + 1).validate().unwrap_err();
        assert!(err.to_string().contains("at most 65536"), "{err}");
        // Prompt text with ids or hashes is ambiguous; alone it needs the tokenizer.
        let text = |r: RouteRequest| RouteRequest {
            prompt: Some("hi".into()),
            ..r
        };
        for with in [ids(2), hashes(1)] {
            let err = text(with).validate().unwrap_err().to_string();
            assert!(err.contains("give one of"), "{err}");
        }
        let err = text(RouteRequest::new("r", 2)).validate().unwrap_err();
        assert!(err.to_string().contains("tokenizer"), "{err}");
        // Token ids give the prompt's length when prompt_tokens is 0, and must agree with it
        // otherwise.
        let mut told = ids(3);
        told.prompt_tokens = 0;
        assert_eq!(told.prompt_len(), 3);
        assert!(told.validate().is_ok());
        told.prompt_tokens = 4;
        let err = told.validate().unwrap_err().to_string();
        assert!(err.contains("prompt_tokens is 4"), "{err}");
    }

    /// A request's hashes are at most its prompt's full blocks.
    #[test]
    fn block_hashes_are_at_most_the_prompt_s_full_blocks() {
        let request = |prompt, n| RouteRequest::new("r", prompt).with_block_hashes(vec![7; n]);
        assert_eq!(request(33, 2).blocks(16).unwrap().len(), 2);
        let err = request(31, 2).blocks(16).unwrap_err().to_string();
        assert!(err.contains("1 full blocks"), "{err}");
        assert_eq!(
            RouteRequest::new("r", 33).blocks(16).unwrap(),
            Vec::<u64>::new()
        );
    }

    #[test]
    fn outcome_labels() {
        let labels: Vec<_> = RouteOutcome::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(labels, ["routed", "no_workers", "invalid", "refused"]);
    }

    /// The module docs' cost: weighted prefill waiting (with the request's uncached prompt)
    /// plus weighted KV held (with its whole prompt).
    #[test]
    fn cost_adds_the_request_to_the_load() {
        let load = WorkerLoad {
            prefill_tokens: 100,
            kv_tokens: 400,
            ..WorkerLoad::default()
        };
        let request = RequestLoad::new(50, None).with_cached_tokens(10);
        let weights = CostWeights::default().with_prefill(1.0).with_kv(0.25);
        assert_eq!(cost(weights, &load, &request), 140.0 + 0.25 * 450.0);
    }

    fn sums(prefill: u32) -> LoadSums {
        let mut sums = LoadSums::default();
        sums.add(1, RequestLoad::new(prefill, None).into());
        sums
    }

    fn chooser(policy: RoutePolicy) -> Chooser {
        let mut chooser = Chooser::new();
        chooser.set_config(RoutingConfig::default().with_policy(policy).with_seed(7));
        chooser
    }

    #[test]
    fn no_member_no_choice_and_one_member_is_chosen_by_every_policy() {
        let request = RequestLoad::new(10, None);
        let one = [(WorkerWithDpRank::new(3, 0), sums(5))];
        for policy in RoutePolicy::ALL {
            let mut c = chooser(policy);
            let none = c.choose(
                std::iter::empty(),
                |_| WorkerLoad::default(),
                &request,
                PrefixCredit::none(),
            );
            assert!(none.is_none(), "{policy:?}");
            c.members_changed();
            let (worker, candidates) = c
                .choose(
                    one.iter().map(|(w, s)| (w, s)),
                    |_| sums(5).load(),
                    &request,
                    PrefixCredit::none(),
                )
                .unwrap();
            assert_eq!(worker, one[0].0, "{policy:?}");
            assert_eq!(candidates.len(), 1, "{policy:?}");
        }
    }

    /// Power of two compares two different members, cheaper first, and over many draws
    /// every member is compared.
    #[test]
    fn power_of_two_compares_two_distinct_members() {
        let members: Vec<_> = (0..3)
            .map(|w| (WorkerWithDpRank::new(w, 0), sums(100 * (w as u32 + 1))))
            .collect();
        let load_of = |w: &WorkerWithDpRank| sums(100 * (w.worker_id.0 as u32 + 1)).load();
        let mut c = chooser(RoutePolicy::PowerOfTwo);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let (worker, candidates) = c
                .choose(
                    members.iter().map(|(w, s)| (w, s)),
                    load_of,
                    &RequestLoad::new(1, None),
                    PrefixCredit::none(),
                )
                .unwrap();
            assert_eq!(candidates.len(), 2);
            assert_ne!(candidates[0].worker, candidates[1].worker);
            assert!(candidates[0].cost <= candidates[1].cost);
            assert_eq!(worker, candidates[0].worker);
            seen.extend(candidates.iter().map(|c| c.worker));
        }
        assert_eq!(seen.len(), 3, "every member drawn: {seen:?}");
    }

    /// A worker's overlap counts (in tokens, at most the prompt, at least the request's own
    /// `cached_tokens`) while its prefill waiting is within the gap of the least busy
    /// member's; past it the guard withholds it from the cost, but not from the booking.
    #[test]
    fn the_guard_withholds_the_cache_of_a_worker_far_busier_than_the_least_busy() {
        let held = WorkerWithDpRank::new(1, 0);
        let other = WorkerWithDpRank::new(2, 0);
        let overlaps = HashMap::from([(held, 3)]);
        let mut credit = PrefixCredit::new(&overlaps, 16);
        credit.floor = 100;
        credit.gap = 1000;
        let short = RequestLoad::new(40, None).with_cached_tokens(5);
        assert_eq!(credit.credit(&held, 1100, &short), (3, 40), "at the gap");
        assert_eq!(credit.credit(&held, 1101, &short), (3, 5), "past the gap");
        assert_eq!(credit.held_tokens(&held, &short), 40);
        assert_eq!(credit.credit(&other, 0, &short), (0, 5));
        assert_eq!(credit.held_tokens(&other, &short), 5);
        let long = RequestLoad::new(100, None).with_cached_tokens(10);
        assert_eq!(credit.credit(&held, -50, &long), (3, 48));
        let told = RequestLoad::new(100, None).with_cached_tokens(60);
        assert_eq!(
            credit.credit(&held, 0, &told),
            (3, 60),
            "the request knew more"
        );
        assert_eq!(credit.held_tokens(&held, &told), 60);
    }

    /// The guard's floor is the least prefill waiting among the members, and the gap the
    /// configured one.
    #[test]
    fn the_guard_measures_from_the_least_busy_member() {
        let held = WorkerWithDpRank::new(1, 0);
        let members = [
            (held, sums(12_000)),
            (WorkerWithDpRank::new(2, 0), sums(5_000)),
        ];
        let overlaps = HashMap::from([(held, 100)]);
        let request = RequestLoad::new(1_600, None);
        let cached_on_held = |gap: u32| {
            let mut c = chooser(RoutePolicy::WeightedCost);
            c.set_config(c.config().with_affinity_gap(gap));
            let (_, candidates) = c
                .choose(
                    members.iter().map(|(w, s)| (w, s)),
                    |_| unreachable!(),
                    &request,
                    PrefixCredit::new(&overlaps, 16),
                )
                .unwrap();
            candidates
                .iter()
                .find(|c| c.worker == held)
                .unwrap()
                .cached_tokens
        };
        // 12,000 waiting is within 8,192 of 5,000, not within 6,000 of it.
        assert_eq!(cached_on_held(8_192), 1_600);
        assert_eq!(cached_on_held(7_000), 1_600);
        assert_eq!(cached_on_held(6_999), 0);
    }

    /// Weighted cost keeps the cheapest few in order; on a tie the lower worker wins.
    #[test]
    fn weighted_cost_orders_by_cost_then_worker() {
        let members: Vec<_> = [(5, 300), (1, 100), (2, 100), (4, 200)]
            .into_iter()
            .map(|(w, prefill)| (WorkerWithDpRank::new(w, 0), sums(prefill)))
            .collect();
        let mut c = chooser(RoutePolicy::WeightedCost);
        let (worker, candidates) = c
            .choose(
                members.iter().map(|(w, s)| (w, s)),
                |_| unreachable!("weighted cost reads the sums it is given"),
                &RequestLoad::new(1, None),
                PrefixCredit::none(),
            )
            .unwrap();
        let order: Vec<u64> = candidates.iter().map(|c| c.worker.worker_id.0).collect();
        assert_eq!(order, [1, 2, 4, 5]);
        assert_eq!(worker.worker_id.0, 1);
    }
}

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
//! worker's KV cache would be with it (decode is memory-bound). The defaults weigh both
//! alike, as the reference router does (its `overlap_score_weight` 1.0 on prefill blocks,
//! plus decode blocks).

use std::time::Duration;

use serde::{Deserialize, Serialize};


/// How a deployment's router chooses among its member workers.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutePolicy {
    /// The lowest weighted cost (ties: the lower worker).
    WeightedCost,
    /// The lower cost of two workers drawn at random: replicas deciding at the same instant
    /// from the same picture do not all pick the same worker.
    #[default]
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

impl Default for CostWeights {
    fn default() -> Self {
        Self {
            prefill: 1.0,
            kv: 1.0,
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
}

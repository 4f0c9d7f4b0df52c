//! lease-router mirrors the request leases of LLM workers, published on NATS, into one
//! router per deployment.
//!
//! Workers publish a small MessagePack event at each step of a request's life (admitted,
//! progressed, completed, worker reset). Each router replica subscribes to its deployment's
//! subjects, decodes the events and hands them to a *weak* replica observer: while the
//! router lives, the observer upgrades and updates the request-lease manager, which books
//! and releases load in the scheduler; once the router is torn down, late events are dropped
//! and counted, and nothing leaks.
//!
//! # Layout
//! The API is what this page re-exports; the modules are private, one concept each:
//! - `types`: identities: request, worker, data-parallel rank, attempt, booking.
//! - `load`: what a request weighs on its worker by phase ([`RequestLoad`]) and a worker's
//!   sums ([`WorkerLoad`]); a leaf that `lease`, `scheduler` and `routing` import.
//! - `lease`: the lease clock, the [`RequestLeaseManager`] and its scan cursor (run by the
//!   task that applies ingest).
//! - `observer`: the [`ReplicaRequestLeaseObserver`] contract; the weak implementation that
//!   breaks the router's ownership cycle lives beside the manager.
//! - `routing`: how a router chooses a worker ([`RoutePolicy`], [`RouteDecision`]): the
//!   policies, over the load the scheduler keeps.
//! - `admission`: a deployment's admission classes ([`AdmissionConfig`]: priority bands
//!   and weights) and what each class has in flight across the fleet ([`ClassLoad`]),
//!   kept from the leases, with what this replica's admission did with its requests
//!   ([`ClassAdmission`]); without classes there is no admission.
//! - `scheduler`: the actor that owns per-worker load (sums only: the leases are the
//!   per-booking record) and makes route decisions: [`SchedulerHandle`].
//! - `router`: one deployment's [`Router`]: one-pass wiring under a drop guard, teardown,
//!   shutdown; [`IngressStart`] for whatever feeds it.
//! - [`wire`]: the MessagePack wire contract (documented in `schemas/`).
//! - `subject`: NATS subjects and the validation of the names in them ([`Subjects`]).
//! - `ingress`: the core-NATS ingress ([`NatsIngress`]) and the per-event path shared with
//!   durable mode.
//! - `durable`: durable mode on JetStream: the lease stream, [`JetStreamIngress`], its
//!   catch-up ([`CatchUpState`]) and snapshots.
//! - `stats`: the counters of one deployment's ingress ([`IngressStats`]).
//! - `histogram`: the latency histograms ([`HistogramFigures`]) of ingest's lag, route
//!   decisions and admission queue waits.
//! - `publisher`: [`LeasePublisher`], what workers publish their events with, core or
//!   durable.
//! - `prefix`: where each prompt's prefix is cached: the [`block_hashes`] that name a
//!   prefix (the scheme in `schemas/README.md`) and the [`PrefixIndex`] of which worker
//!   holds which, one per deployment, taught by `admitted` events and resets, read by every
//!   prefix-aware decision ([`RouteRequest::with_block_hashes`]), kept in snapshots.
//! - `connection`: [`connect`]ing to NATS with retry, and connection state.
//! - `retry`: exponential backoff, the one module that uses the `backoff` crate.
//! - `log_limit`: rate-limited warnings.
//! - [`service`]: what `lease-router serve` runs: the multi-deployment host, the HTTP API
//!   and the Prometheus metrics, configured by plain structs.
//!
//! This package is the library only. Beside it in the workspace: `cli/` (package
//! `lease-router-cli`, the `lease-router` binary: `serve`, `publish`, `simulate`, `demo`,
//! the flag/environment/TOML settings, the simulated workers and the allocator setting) and
//! `testkit/` (`lease-router-testkit`, which starts real `nats-server` processes for the
//! tests, the benches and `demo`). An embedder compiles neither.

#![warn(unreachable_pub, unnameable_types, missing_docs)]

mod admission;
mod connection;
mod durable;
mod histogram;
mod ingress;
#[doc(hidden)]
pub mod internals;
mod lease;
mod load;
mod log_limit;
mod observer;
mod prefix;
mod publisher;
mod retry;
mod router;
mod routing;
mod scheduler;
pub mod service;
mod stats;
mod subject;
mod types;
pub mod wire;

pub use admission::{
    AdmissionClass, AdmissionConfig, ClassAdmission, ClassLoad, ConfigureAdmissionError,
    QueueConfig, Saturation, SaturationConfig, DEFAULT_MAX_KV_SHARE,
    DEFAULT_MAX_PREFILL_TOKENS_PER_WORKER, DEFAULT_MAX_QUEUED, DEFAULT_MAX_WAIT_MS, MAX_CLASSES,
    MAX_CLASS_NAME_LEN, MAX_CLASS_WEIGHT, MAX_QUEUED_LIMIT, MAX_WAIT_LIMIT_MS,
};
pub use connection::{
    connect, redact_url, ConnectNatsError, ConnectionStats, NatsAuth, NatsConnectConfig,
    NatsConnection, NatsTls, DEFAULT_NATS_URL, DEFAULT_PING_INTERVAL,
};
pub use durable::{
    delete_stream, ensure_stream, legacy_stream_name, require_stream, stream_name, CatchUpState,
    DeleteStreamError, EnsureStreamError, ForeignStream, JetStreamIngress, LeaseStreamConfig,
    LegacyStream, LookupStreamError, RequireStreamError, SnapshotFigures, StartDurableIngressError,
    StreamFigures, DEFAULT_SNAPSHOT_INTERVAL, DEFAULT_SNAPSHOT_KEEP, DEFAULT_STREAM_MAX_BYTES,
    MIN_STREAM_MAX_AGE,
};
pub use durable::{snapshot_bucket, snapshot_lock_bucket};
pub use histogram::HistogramFigures;
pub use ingress::{
    Applied, AppliedHook, ApplyConfig, BatchOutcome, EventApplier, NatsIngress, StartIngressError,
    PROBE_SUBJECTS,
};
pub use lease::{
    LeaseConfig, LeaseRecord, LeaseState, LeaseStats, Reaper, RequestLeaseManager, ScanReport,
    StepTime, WeakRequestLeaseManager, DEFAULT_MAX_ACTIVE_LEASES, DEFAULT_PROVISIONAL_DEADLINE,
    DEFAULT_SCAN_INTERVAL, INLINE_KEY_BYTES,
};
pub use load::{RequestLoad, WorkerLoad};
pub use observer::{
    AdmitOutcome, CompleteOutcome, DeliverEventError, ProgressOutcome, ReplicaRequestLeaseObserver,
};
pub use prefix::{
    block_hashes, chain_block_hash, PrefixFigures, PrefixIndex, PrefixIndexConfig,
    DEFAULT_BLOCK_SIZE, ROOT_PARENT_HASH,
};
#[cfg(feature = "tokenizer")]
pub use prefix::{LoadTokenizerError, PromptTokenizer, TokenizePromptError};
pub use publisher::{
    Batching, FlushPublisherError, LeasePublisher, PublishEventError, PublisherConfig,
    PublisherFigures,
};
pub use retry::RetryPolicy;
pub use router::{
    IngressContext, IngressStart, NoIngress, Router, RouterConfig, RouterTask, ShutdownRouterError,
    StartRouterError, TaskError, TaskFailure,
};
pub use routing::{
    cost, Candidate, CostWeights, ParsePolicyError, RouteDecision, RouteOutcome, RoutePolicy,
    RouteRequest, RouteRequestError, RoutingConfig, DEFAULT_AFFINITY_GAP, MAX_ROUTE_BLOCK_HASHES,
    MAX_ROUTE_REQUEST_ID_BYTES, MAX_ROUTE_TOKEN_IDS,
};
pub use scheduler::{
    QuerySchedulerError, ReleaseReason, SchedulerFigures, SchedulerHandle, WorkerStatus,
};
pub use stats::{DropReason, IngressFigures, IngressStats};
pub use subject::{
    DeploymentName, InvalidSubjectError, SubjectPrefix, Subjects, DEFAULT_SUBJECT_PREFIX,
    MAX_TOKEN_LEN,
};
pub use types::{
    AttemptId, DpRank, RequestId, SchedulerBookingDescriptor, WorkerId, WorkerWithDpRank,
};

/// The README's Rust examples, compiled by `cargo test` so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

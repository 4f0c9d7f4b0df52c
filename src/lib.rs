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
//! - [`allocator`]: the glibc setting the binary starts with (no fastbins: no
//!   millisecond-long merges in the middle of ingest).
//! - [`types`]: identities: request, worker, data-parallel rank, attempt, booking.
//! - [`lease`]: the lease clock ([`lease::clock`]), the [`lease::RequestLeaseManager`] and
//!   its reaper ([`lease::reaper`], whose steps the ingress runs between bursts);
//!   [`lease::LeaseBatch`] applies a burst of events at once.
//! - [`observer`]: [`observer::ReplicaRequestLeaseObserver`] and the weak observer that
//!   breaks the router's ownership cycle.
//! - [`scheduler`]: the actor that owns per-worker load (sums only: the leases are the
//!   per-booking record), and its handles.
//! - [`router`]: one deployment's [`router::Router`]: construction under a drop guard,
//!   teardown, shutdown.
//! - [`wire`]: the MessagePack wire contract (documented in `schemas/`).
//! - [`subject`]: NATS subjects and the validation of the names in them.
//! - [`durable`]: durable mode on JetStream: the lease stream and the replaying ingress.
//! - [`ingress`]: the core-NATS ingress (a receiving and an applying task, which also runs
//!   the reaper's steps) and the per-event path shared with durable mode.
//! - [`stats`]: the counters of one deployment's ingress.
//! - [`publisher`]: [`publisher::LeasePublisher`], what workers publish their events with.
//! - [`connection`]: connecting to NATS with retry, and connection state.
//! - [`retry`]: exponential backoff, the one module that uses the `backoff` crate.
//! - [`nats_server`]: starting a real `nats-server` (or a cluster) for tests, benches and
//!   the demo.
//! - [`service`]: what `lease-router serve` runs: the multi-deployment host, the HTTP API,
//!   the Prometheus metrics and the layered configuration.
//! - [`simulate`]: simulated workers publishing realistic request lifecycles.
//!
//! The binary (`src/bin/lease-router.rs`) only parses arguments and wires these together.

pub mod allocator;
pub mod connection;
pub mod durable;
pub mod ingress;
pub mod lease;
pub mod nats_server;
pub mod observer;
pub mod publisher;
pub mod retry;
pub mod router;
pub mod routing;
pub mod scheduler;
pub mod service;
pub mod simulate;
pub mod stats;
pub mod subject;
pub mod types;
pub mod wire;

/// The README's Rust examples, compiled by `cargo test` so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

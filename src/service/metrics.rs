//! The Prometheus exporter: every figure is read from the routers' atomics at scrape time by
//! a [`Collector`] and written by `prometheus-client`'s OpenMetrics text encoder (nothing is
//! formatted by hand, nothing is kept in a second set of counters).
//!
//! What each metric counts is stated once, in README.md's Metrics section; a test here keeps
//! that list and the names this module writes the same.
//!
//! The per-deployment counters of a removed deployment stay (its ingress counters are kept
//! by the host), so the `late` drops of its last events remain visible. The worker gauges
//! need a query to each scheduler actor, so they are gathered (bounded) by
//! [`Metrics::render`] before encoding, not by the collector.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::host::{DeploymentHost, HostFigures};
use crate::admission::ClassLoad;
use crate::histogram::HistogramFigures;
use crate::load::WorkerLoad;
use crate::routing::{RouteOutcome, RoutePolicy};
use crate::scheduler::SchedulerFigures;
use crate::types::WorkerWithDpRank;

/// The prefix of every metric name.
pub(super) const METRIC_PREFIX: &str = "lease_router";

/// The content type of what [`Metrics::render`] returns (`prometheus-client` writes
/// OpenMetrics text, which Prometheus scrapes natively).
pub(super) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long one scheduler may take to report its worker loads during a scrape.
const WORKER_LOAD_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the collector reads its figures.
pub trait MetricsSource: fmt::Debug + Send + Sync + 'static {
    /// The figures now, read at each scrape.
    fn snapshot(&self) -> HostFigures;
}

impl MetricsSource for DeploymentHost {
    fn snapshot(&self) -> HostFigures {
        self.figures()
    }
}

#[derive(Debug)]
struct HostCollector<S>(S);

impl<S: MetricsSource> Collector for HostCollector<S> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        encode_snapshot(&self.0.snapshot(), &mut encoder)
    }
}

/// The loads of the workers of one scrape.
#[derive(Debug, Default)]
struct WorkerLoads(Vec<(String, WorkerWithDpRank, WorkerLoad)>);

impl Collector for WorkerLoads {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let labels: Vec<[(&str, String); 3]> = self
            .0
            .iter()
            .map(|(deployment, worker, _)| {
                [
                    ("deployment", deployment.clone()),
                    ("worker_id", worker.worker_id.to_string()),
                    ("dp_rank", worker.dp_rank.to_string()),
                ]
            })
            .collect();
        type Pick = fn(&WorkerLoad) -> u64;
        let gauges: [(&str, &str, Pick); 6] = [
            (
                "worker_active_bookings",
                "Bookings counted against each worker by the scheduler.",
                |l| l.active_bookings,
            ),
            (
                "worker_prompt_tokens",
                "Prompt tokens of the bookings of each worker.",
                |l| l.prompt_tokens,
            ),
            (
                "worker_expected_output_tokens",
                "Expected output tokens of the bookings of each worker.",
                |l| l.expected_output_tokens,
            ),
            (
                "worker_prefill_tokens",
                "Prompt tokens waiting for prefill on each worker (uncached, prefill not done).",
                |l| l.prefill_tokens,
            ),
            (
                "worker_kv_tokens",
                "KV tokens held on each worker: prompt plus output so far of its bookings.",
                |l| l.kv_tokens,
            ),
            (
                "worker_remaining_output_tokens",
                "Expected output tokens still to come on each worker.",
                |l| l.remaining_output_tokens,
            ),
        ];
        for (name, help, pick) in gauges {
            let series: Vec<_> = labels
                .iter()
                .zip(&self.0)
                .map(|(labels, (_, _, load))| (labels.as_slice(), pick(load)))
                .collect();
            gauge_family(&mut encoder, name, help, &series)?;
        }
        Ok(())
    }
}

/// Each running deployment's saturation, and what each of its admission classes has in
/// flight across the fleet, at one scrape (deployments without classes have no class
/// series).
#[derive(Debug, Default)]
struct ClassLoads {
    saturated: Vec<(String, bool)>,
    classes: Vec<(String, Vec<ClassLoad>)>,
}

impl Collector for ClassLoads {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let saturated: Vec<_> = self
            .saturated
            .iter()
            .map(|(deployment, saturated)| {
                ([("deployment", deployment.as_str())], u64::from(*saturated))
            })
            .collect();
        gauge_family(
            &mut encoder,
            "saturated",
            "1 while the deployment is saturated: prefill waiting per member worker, or KV held \
             against capacity, past its threshold.",
            &saturated,
        )?;
        let series = |pick: fn(&ClassLoad) -> u64| {
            self.classes
                .iter()
                .flat_map(|(deployment, classes)| {
                    classes.iter().map(move |class| {
                        (
                            [
                                ("deployment", deployment.as_str()),
                                ("class", class.class.as_str()),
                            ],
                            pick(class),
                        )
                    })
                })
                .collect::<Vec<_>>()
        };
        gauge_family(
            &mut encoder,
            "class_inflight_requests",
            "Requests in flight of each admission class, over every worker of the fleet.",
            &series(|c| c.in_flight_requests),
        )?;
        gauge_family(
            &mut encoder,
            "class_inflight_tokens",
            "Prompt plus expected output tokens in flight of each admission class, fleet-wide.",
            &series(|c| c.in_flight_tokens),
        )?;
        type Pick = fn(&ClassLoad) -> u64;
        let counters: [(&str, &str, Pick); 4] = [
            (
                "class_admitted",
                "Route requests of each admission class this replica routed, at once or from \
                 its queue.",
                |c| c.admission.admitted,
            ),
            (
                "class_queued",
                "Route requests of each admission class that entered this replica's admission \
                 queue.",
                |c| c.admission.queued,
            ),
            (
                "class_refused",
                "Route requests of each admission class this replica refused with 429.",
                |c| c.admission.refused,
            ),
            (
                "class_abandoned",
                "Route requests of each admission class that left this replica's admission \
                 queue because their caller went away.",
                |c| c.admission.abandoned,
            ),
        ];
        for (name, help, pick) in counters {
            counter_family(&mut encoder, name, help, &series(pick))?;
        }
        gauge_family(
            &mut encoder,
            "class_waiting",
            "Route requests of each admission class waiting in this replica's admission queue.",
            &series(|c| c.admission.waiting),
        )?;
        let waits: Vec<_> = self
            .classes
            .iter()
            .flat_map(|(deployment, classes)| {
                classes.iter().map(move |class| {
                    (
                        [
                            ("deployment", deployment.as_str()),
                            ("class", class.class.as_str()),
                        ],
                        &class.admission.wait,
                    )
                })
            })
            .collect();
        histogram_family(
            &mut encoder,
            "class_queue_wait",
            "Time route requests of each admission class spent in this replica's admission \
             queue, observed as they left it (routed, refused or abandoned).",
            &waits,
        )
    }
}

/// The scheduler counters of the running deployments, at one scrape.
#[derive(Debug, Default)]
struct SchedulerCounters(Vec<(String, SchedulerFigures, HistogramFigures)>);

impl Collector for SchedulerCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let decisions: Vec<_> = self
            .0
            .iter()
            .flat_map(|(name, stats, _)| {
                RoutePolicy::ALL.into_iter().flat_map(move |policy| {
                    RouteOutcome::ALL.into_iter().map(move |outcome| {
                        (
                            [
                                ("deployment", name.as_str()),
                                ("policy", policy.as_str()),
                                ("outcome", outcome.as_str()),
                            ],
                            stats.decisions(policy, outcome),
                        )
                    })
                })
            })
            .collect();
        counter_family(
            &mut encoder,
            "route_decisions",
            "Route decisions of each running deployment, by policy and outcome.",
            &decisions,
        )?;
        type Pick = fn(&SchedulerFigures) -> u64;
        let counters: [(&str, &str, Pick); 4] = [
            (
                "workers_left",
                "Worker ranks that said they were leaving.",
                |s| s.workers_left,
            ),
            (
                "workers_forgotten",
                "Worker ranks forgotten after their idle time with no live booking.",
                |s| s.workers_forgotten,
            ),
            (
                "admission_waited",
                "Route requests that waited in this replica's admission queue.",
                |s| s.admission_waited,
            ),
            (
                "admission_abandoned",
                "Route requests that left the admission queue because their caller went away.",
                |s| s.admission_abandoned,
            ),
        ];
        for (name, help, pick) in counters {
            let series: Vec<_> = self
                .0
                .iter()
                .map(|(deployment, stats, _)| ([("deployment", deployment.as_str())], pick(stats)))
                .collect();
            counter_family(&mut encoder, name, help, &series)?;
        }
        let times: Vec<_> = self
            .0
            .iter()
            .map(|(deployment, _, times)| ([("deployment", deployment.as_str())], times))
            .collect();
        histogram_family(
            &mut encoder,
            "route_decision",
            "Time the scheduler took over each route decision, from taking the request to its \
             answer or its place in the admission queue.",
            &times,
        )
    }
}

/// Why the HTTP API refused a request its bearer token guards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AuthFailure {
    /// No `Authorization` header.
    Missing,
    /// Not one `Bearer <token>` header.
    Malformed,
    /// A token, not the API's.
    Wrong,
}

impl AuthFailure {
    const ALL: [AuthFailure; 3] = [Self::Missing, Self::Malformed, Self::Wrong];

    fn as_str(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Malformed => "malformed",
            Self::Wrong => "wrong",
        }
    }
}

/// The API's refusals, by [`AuthFailure`]: counted where they happen, so kept here.
#[derive(Clone, Debug, Default)]
struct AuthFailures(Arc<[AtomicU64; AuthFailure::ALL.len()]>);

impl Collector for AuthFailures {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let series: Vec<_> = AuthFailure::ALL
            .into_iter()
            .map(|why| {
                (
                    [("reason", why.as_str())],
                    self.0[why as usize].load(Ordering::Relaxed),
                )
            })
            .collect();
        counter_family(
            &mut encoder,
            "http_auth_failures",
            "HTTP requests refused (401) for want of the API's bearer token, by reason.",
            &series,
        )
    }
}

/// The registry of the service's metrics.
pub struct Metrics {
    registry: Registry,
    host: Option<DeploymentHost>,
    auth_failures: AuthFailures,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// The metrics of `host`, worker loads included.
    pub fn new(host: DeploymentHost) -> Self {
        let mut metrics = Self::from_source(host.clone());
        metrics.host = Some(host);
        metrics
    }

    /// The metrics of any source (without worker loads).
    pub fn from_source(source: impl MetricsSource) -> Self {
        let mut registry = Registry::with_prefix(METRIC_PREFIX);
        registry.register_collector(Box::new(HostCollector(source)));
        let auth_failures = AuthFailures::default();
        registry.register_collector(Box::new(auth_failures.clone()));
        Self {
            registry,
            host: None,
            auth_failures,
        }
    }

    pub(crate) fn count_auth_failure(&self, why: AuthFailure) {
        self.auth_failures.0[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The registry, to register more metrics or collectors with.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// OpenMetrics text of everything but the worker loads.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail, and the collectors only fail when the writer does.
        let _ = encode_registry(&mut out, &self.registry).and_then(|()| encode_eof(&mut out));
        out
    }

    /// OpenMetrics text of everything, worker loads included (each scheduler is asked, at
    /// most `WORKER_LOAD_TIMEOUT`; one that does not answer is left out).
    pub async fn render(&self) -> String {
        let mut loads = WorkerLoads::default();
        let mut counters = SchedulerCounters::default();
        let mut classes = ClassLoads::default();
        if let Some(host) = &self.host {
            for view in host.views() {
                counters.0.push((
                    view.name().to_string(),
                    view.scheduler().stats(),
                    view.scheduler().decision_times(),
                ));
                let answer =
                    tokio::time::timeout(WORKER_LOAD_TIMEOUT, view.scheduler().loads()).await;
                if let Ok(Ok(workers)) = answer {
                    let name = view.name().to_string();
                    let saturation = view.scheduler().admission().saturation();
                    let assessed = saturation.assess(workers.iter().map(|(_, load)| load));
                    classes.saturated.push((name.clone(), assessed.saturated));
                    loads.0.extend(
                        workers
                            .into_iter()
                            .map(|(worker, load)| (name.clone(), worker, load)),
                    );
                }
                if view.scheduler().admission().is_enabled() {
                    let answer =
                        tokio::time::timeout(WORKER_LOAD_TIMEOUT, view.scheduler().class_loads())
                            .await;
                    if let Ok(Ok(loads)) = answer {
                        classes.classes.push((view.name().to_string(), loads));
                    }
                }
            }
        }
        let mut per_scrape = Registry::with_prefix(METRIC_PREFIX);
        per_scrape.register_collector(Box::new(loads));
        per_scrape.register_collector(Box::new(counters));
        per_scrape.register_collector(Box::new(classes));
        let mut out = String::new();
        let _ = encode_registry(&mut out, &self.registry)
            .and_then(|()| encode_registry(&mut out, &per_scrape))
            .and_then(|()| encode_eof(&mut out));
        out
    }
}

fn counter_family<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(L, u64)],
) -> fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in series {
        metric
            .encode_family(labels)?
            .encode_counter::<NoLabelSet, u64, u64>(value, None)?;
    }
    Ok(())
}

fn gauge_family<L: EncodeLabelSet, V: prometheus_client::encoding::EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(L, V)],
) -> fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in series {
        metric.encode_family(labels)?.encode_gauge(value)?;
    }
    Ok(())
}

fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> fmt::Result {
    encoder
        .encode_descriptor(name, help, None, MetricType::Counter)?
        .encode_counter::<NoLabelSet, u64, u64>(&value, None)
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> fmt::Result {
    encoder
        .encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&value)
}

/// A histogram in seconds per label set.
fn histogram_family<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(L, &HistogramFigures)],
) -> fmt::Result {
    let mut metric =
        encoder.encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Histogram)?;
    for (labels, h) in series {
        metric
            .encode_family(labels)?
            .encode_histogram::<NoLabelSet>(
                h.sum_seconds,
                h.count,
                &histogram_buckets(&h.buckets, h.count),
                None,
            )?;
    }
    Ok(())
}

/// Per-bucket counts as the encoder wants them (it accumulates), from cumulative `buckets`
/// of `count` observations; the last bucket is +Inf (`f64::MAX` to the encoder).
fn histogram_buckets(cumulative: &[(f64, u64)], count: u64) -> Vec<(f64, u64)> {
    let mut previous = 0;
    let mut buckets: Vec<(f64, u64)> = cumulative
        .iter()
        .map(|&(bound, cumulative)| {
            let own = cumulative.saturating_sub(previous);
            previous = cumulative;
            (bound, own)
        })
        .collect();
    buckets.push((f64::MAX, count.saturating_sub(previous)));
    buckets
}

/// Writes every metric of `snapshot`.
pub(super) fn encode_snapshot(
    snapshot: &HostFigures,
    encoder: &mut DescriptorEncoder,
) -> fmt::Result {
    let deps = &snapshot.deployments;
    let by_deployment = |value: fn(&super::host::DeploymentFigures) -> u64| {
        deps.iter()
            .map(|d| ([("deployment", d.name.as_str())], value(d)))
            .collect::<Vec<_>>()
    };

    counter_family(
        encoder,
        "events_received",
        "Events received on the deployment's subjects: one per message, one per event a batch declares.",
        &by_deployment(|d| d.ingress.received),
    )?;
    counter_family(
        encoder,
        "batches_received",
        "Batch messages (wire 1.2) received on the deployment's subjects, readable or not.",
        &by_deployment(|d| d.ingress.batches),
    )?;
    let applied: Vec<_> = deps
        .iter()
        .flat_map(|d| {
            d.ingress
                .applied
                .iter()
                .map(|(kind, n)| ([("deployment", d.name.as_str()), ("kind", *kind)], *n))
        })
        .collect();
    counter_family(
        encoder,
        "events_applied",
        "Events applied to the deployment's leases, by kind.",
        &applied,
    )?;
    let dropped: Vec<_> = deps
        .iter()
        .flat_map(|d| {
            d.ingress
                .dropped
                .iter()
                .map(|(reason, n)| ([("deployment", d.name.as_str()), ("reason", *reason)], *n))
        })
        .collect();
    counter_family(
        encoder,
        "events_dropped",
        "Events not applied, by reason (late: the deployment's router was gone).",
        &dropped,
    )?;
    gauge_family(
        encoder,
        "events_held",
        "Events held now for the admission they depend on: received = applied + dropped + held.",
        &by_deployment(|d| d.ingress.held),
    )?;
    let active: Vec<_> = deps
        .iter()
        .filter_map(|d| Some(([("deployment", d.name.as_str())], d.active_leases?)))
        .collect();
    gauge_family(
        encoder,
        "active_leases",
        "Live request leases of each hosted deployment.",
        &active,
    )?;
    let bound: Vec<_> = deps
        .iter()
        .filter_map(|d| Some(([("deployment", d.name.as_str())], d.max_active_leases?)))
        .collect();
    gauge_family(
        encoder,
        "max_active_leases",
        "The bound of active_leases: past it new admissions are refused.",
        &bound,
    )?;
    let ended: Vec<_> = deps
        .iter()
        .filter_map(|d| Some(([("deployment", d.name.as_str())], d.router_tasks_ended?)))
        .collect();
    gauge_family(
        encoder,
        "router_tasks_ended",
        "Tasks of the deployment's running router that ended on their own (0 when healthy).",
        &ended,
    )?;
    let replay = |value: fn(&super::host::CatchUpFigures) -> f64| {
        deps.iter()
            .filter_map(|d| {
                Some((
                    [("deployment", d.name.as_str())],
                    value(d.catch_up.as_ref()?),
                ))
            })
            .collect::<Vec<_>>()
    };
    gauge_family(
        encoder,
        "catchup_done",
        "Durable mode: 1 once the router has replayed the lease stream and follows live events.",
        &replay(|c| f64::from(u8::from(c.done))),
    )?;
    gauge_family(
        encoder,
        "catchup_replayed_events",
        "Durable mode: events applied while replaying the lease stream.",
        &replay(|c| c.replayed as f64),
    )?;
    gauge_family(
        encoder,
        "catchup_seconds",
        "Durable mode: how long the replay took (0 until it is done).",
        &replay(|c| c.seconds),
    )?;
    let truncated: Vec<_> = deps
        .iter()
        .filter_map(|d| {
            Some((
                [("deployment", d.name.as_str())],
                d.catch_up.as_ref()?.truncated_events,
            ))
        })
        .collect();
    counter_family(
        encoder,
        "stream_truncated_events",
        "Durable mode: events the replica needed that the stream had discarded by its limits.",
        &truncated,
    )?;
    let snapshots = |value: fn(&crate::durable::SnapshotFigures) -> u64| {
        deps.iter()
            .filter_map(|d| {
                Some((
                    [("deployment", d.name.as_str())],
                    value(&d.catch_up.as_ref()?.snapshots),
                ))
            })
            .collect::<Vec<_>>()
    };
    counter_family(
        encoder,
        "snapshots_written",
        "Durable mode: snapshots this replica wrote as its deployment's snapshot writer.",
        &snapshots(|s| s.written),
    )?;
    counter_family(
        encoder,
        "snapshot_write_failures",
        "Durable mode: snapshot writes that failed, and attempts to open the snapshot buckets that failed (the next interval tries again).",
        &snapshots(|s| s.failed),
    )?;
    gauge_family(
        encoder,
        "snapshot_bytes",
        "Durable mode: size of the last snapshot this replica wrote.",
        &snapshots(|s| s.last_bytes),
    )?;
    gauge_family(
        encoder,
        "snapshot_sequence",
        "Durable mode: stream sequence the last snapshot this replica wrote reflects.",
        &snapshots(|s| s.last_sequence),
    )?;
    gauge_family(
        encoder,
        "catchup_snapshot_sequence",
        "Durable mode: stream sequence of the snapshot loaded at start (0: none, replayed all).",
        &snapshots(|s| s.loaded_sequence),
    )?;
    let fallbacks: Vec<_> = deps
        .iter()
        .filter_map(|d| Some((d.name.as_str(), d.catch_up.as_ref()?.snapshots)))
        .flat_map(|(name, s)| {
            [
                ([("deployment", name), ("reason", "missing")], s.missing),
                ([("deployment", name), ("reason", "invalid")], s.invalid),
            ]
        })
        .collect();
    counter_family(
        encoder,
        "catchup_snapshot_fallbacks",
        "Durable mode: starts that replayed the whole stream, by reason (missing: no \
         snapshot; invalid: unreadable, partial, corrupt or of another stream).",
        &fallbacks,
    )?;
    let stream = |value: fn(&crate::durable::StreamFigures) -> f64| {
        deps.iter()
            .filter_map(|d| {
                Some((
                    [("deployment", d.name.as_str())],
                    value(d.catch_up.as_ref()?.stream.as_ref()?),
                ))
            })
            .collect::<Vec<_>>()
    };
    gauge_family(
        encoder,
        "stream_bytes",
        "Durable mode: bytes the deployment's stream holds (see stream_max_bytes).",
        &stream(|s| s.bytes as f64),
    )?;
    gauge_family(
        encoder,
        "stream_max_bytes",
        "Durable mode: the stream's byte limit; past it the oldest events are discarded.",
        &stream(|s| s.max_bytes as f64),
    )?;
    gauge_family(
        encoder,
        "stream_messages",
        "Durable mode: events the deployment's stream holds.",
        &stream(|s| s.messages as f64),
    )?;
    gauge_family(
        encoder,
        "stream_age_seconds",
        "Durable mode: age of the oldest event the stream holds (see stream_max_age_seconds).",
        &stream(|s| s.oldest_age.as_secs_f64()),
    )?;
    gauge_family(
        encoder,
        "stream_max_age_seconds",
        "Durable mode: the stream's age limit; older events are discarded.",
        &stream(|s| s.max_age.as_secs_f64()),
    )?;
    let prefix = |value: fn(&crate::prefix::PrefixFigures) -> u64| {
        deps.iter()
            .filter_map(|d| Some(([("deployment", d.name.as_str())], value(d.prefix.as_ref()?))))
            .collect::<Vec<_>>()
    };
    gauge_family(
        encoder,
        "prefix_index_entries",
        "Entries of the prefix index now: a block held by a worker rank.",
        &prefix(|p| p.entries),
    )?;
    gauge_family(
        encoder,
        "prefix_index_workers",
        "Worker ranks the prefix index keeps (they hold a block or announced a capacity).",
        &prefix(|p| p.workers),
    )?;
    counter_family(
        encoder,
        "prefix_index_evicted",
        "Prefix index entries dropped to stay within a worker's capacity or the deployment's bound.",
        &prefix(|p| p.evicted),
    )?;
    counter_family(
        encoder,
        "prefix_learned_admissions",
        "Admissions (and this replica's route decisions) whose block hashes the prefix index learned.",
        &prefix(|p| p.learned_admissions),
    )?;
    counter_family(
        encoder,
        "prefix_forgotten_entries",
        "Prefix index entries forgotten because their worker restarted or left.",
        &prefix(|p| p.forgotten_entries),
    )?;
    gauge_family(
        encoder,
        "prefix_exact_workers",
        "Worker ranks whose prefix blocks come from their engines' KV events (kv_stored, kv_removed, kv_cleared).",
        &prefix(|p| p.exact_workers),
    )?;
    counter_family(
        encoder,
        "prefix_kv_stored_blocks",
        "Blocks that engines' kv_stored events reported stored.",
        &prefix(|p| p.kv_stored_blocks),
    )?;
    counter_family(
        encoder,
        "prefix_kv_removed_blocks",
        "Blocks that engines' kv_removed events removed from the prefix index.",
        &prefix(|p| p.kv_removed_blocks),
    )?;
    counter_family(
        encoder,
        "prefix_kv_clears",
        "Engines' kv_cleared events applied (an emptied cache, or a relay that lost track).",
        &prefix(|p| p.kv_clears),
    )?;
    counter_family(
        encoder,
        "prefix_compared_admissions",
        "Admissions of this replica's route decisions whose worker reported its cached tokens (ctok).",
        &prefix(|p| p.compared_admissions),
    )?;
    counter_family(
        encoder,
        "prefix_predicted_cached_tokens",
        "Over the compared admissions: the cached tokens the route decisions predicted.",
        &prefix(|p| p.predicted_cached_tokens),
    )?;
    counter_family(
        encoder,
        "prefix_reported_cached_tokens",
        "Over the compared admissions: the cached tokens the engines reported.",
        &prefix(|p| p.reported_cached_tokens),
    )?;
    counter_family(
        encoder,
        "prefix_overpredicted_tokens",
        "Over the compared admissions: tokens predicted cached that the engine did not find.",
        &prefix(|p| p.overpredicted_tokens),
    )?;
    counter_family(
        encoder,
        "prefix_underpredicted_tokens",
        "Over the compared admissions: cached tokens the prediction missed.",
        &prefix(|p| p.underpredicted_tokens),
    )?;
    counter_family(
        encoder,
        "leases_expired",
        "Leases released because nobody renewed them in time.",
        &by_deployment(|d| d.leases_expired),
    )?;
    counter_family(
        encoder,
        "provisional_expired",
        "Route decisions' provisional bookings released because their worker's admitted did not come within the provisional deadline.",
        &by_deployment(|d| d.provisional_expired),
    )?;
    counter_family(
        encoder,
        "routes_cancelled",
        "Route decisions' provisional bookings released at once by a gateway (DELETE .../route/{request_id}).",
        &by_deployment(|d| d.routes_cancelled),
    )?;
    counter_family(
        encoder,
        "sequence_gaps",
        "Publisher sequence numbers that left the 4096-number window without arriving (lost).",
        &by_deployment(|d| d.ingress.gaps),
    )?;
    counter_family(
        encoder,
        "reorders_held",
        "Events held for the admission they depend on, cumulative (events_held: held now).",
        &by_deployment(|d| d.ingress.reorders_held),
    )?;
    counter_family(
        encoder,
        "publisher_restarts",
        "New publisher ids heard on a worker subject that had another publisher id before.",
        &by_deployment(|d| d.ingress.publisher_restarts),
    )?;
    counter_family(
        encoder,
        "publishers_evicted",
        "Publishers forgotten because max_publishers were tracked (their duplicates are no \
         longer recognised).",
        &by_deployment(|d| d.ingress.publishers_evicted),
    )?;
    let lags: Vec<_> = deps
        .iter()
        .map(|d| ([("deployment", d.name.as_str())], &d.ingress.lag))
        .collect();
    histogram_family(
        encoder,
        "publish_to_apply_lag",
        "Time from an event's publication (its timestamp) to its application.",
        &lags,
    )?;
    gauge(
        encoder,
        "nats_connected",
        "1 while the NATS connection is up, else 0 (the client's own state).",
        u64::from(snapshot.nats_connected),
    )?;
    counter(
        encoder,
        "nats_reconnects",
        "Connections to NATS after the first one.",
        snapshot.nats_reconnects,
    )?;
    counter(
        encoder,
        "nats_disconnects",
        "Times the NATS connection was lost: reconnects, plus one while disconnected \
         (derived from the client's state, never misses one).",
        snapshot.nats_disconnects,
    )?;
    counter(
        encoder,
        "slow_consumer_events",
        "Times the NATS client dropped messages of a subscription that was not read fast \
         enough (per connection). Best-effort: a burst overflows the client's event queue; \
         sequence_gaps_total counts the lost events exactly.",
        snapshot.slow_consumer_events,
    )?;
    gauge(
        encoder,
        "deployments",
        "Deployments hosted (running, starting or stopping).",
        snapshot.hosted as u64,
    )?;
    gauge(
        encoder,
        "live_tasks",
        "Tasks of the routers still running, removed deployments' included.",
        snapshot.live_tasks as u64,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::service::host::DeploymentFigures;
    use crate::stats::{DropReason, IngressStats, PendingCounts};
    use crate::wire::EventKind;

    #[derive(Debug)]
    struct Fixed(HostFigures);

    impl MetricsSource for Fixed {
        fn snapshot(&self) -> HostFigures {
            self.0.clone()
        }
    }

    fn sample() -> HostFigures {
        let live = Arc::new(IngressStats::new());
        let mut counts = PendingCounts::default();
        for _ in 0..5 {
            counts.received();
        }
        counts.applied(EventKind::Admitted);
        counts.applied(EventKind::Admitted);
        counts.applied(EventKind::Completed);
        counts.set_held(2);
        counts.flush(&live);
        live.dropped(DropReason::Duplicate);
        live.gaps(3);
        live.reorder_held();
        live.publisher_restart();
        live.publishers_evicted(5);
        live.lag().observe_us(50); // 0.0001 bucket
        live.lag().observe_us(700); // 0.001 bucket
        live.lag().observe_us(60_000_000); // +Inf
        let removed = Arc::new(IngressStats::new());
        counts.received();
        counts.flush(&removed);
        removed.dropped(DropReason::Late);
        HostFigures {
            deployments: vec![
                DeploymentFigures {
                    name: "gone".into(),
                    ingress: removed.snapshot(),
                    active_leases: None,
                    max_active_leases: None,
                    router_tasks_ended: None,
                    catch_up: None,
                    leases_expired: 4,
                    provisional_expired: 3,
                    routes_cancelled: 2,
                    prefix: None,
                },
                DeploymentFigures {
                    name: "prod".into(),
                    ingress: live.snapshot(),
                    active_leases: Some(2),
                    max_active_leases: Some(100),
                    router_tasks_ended: Some(1),
                    catch_up: None,
                    leases_expired: 1,
                    provisional_expired: 0,
                    routes_cancelled: 5,
                    prefix: Some(crate::prefix::PrefixFigures {
                        entries: 12,
                        compared_admissions: 3,
                        predicted_cached_tokens: 96,
                        reported_cached_tokens: 80,
                        ..Default::default()
                    }),
                },
            ],
            hosted: 1,
            live_tasks: 3,
            nats_connected: true,
            nats_reconnects: 2,
            nats_disconnects: 2,
            slow_consumer_events: 7,
        }
    }

    fn lines(text: &str) -> Vec<&str> {
        text.lines().collect()
    }

    #[test]
    fn scrape_names_labels_and_values() {
        let text = Metrics::from_source(Fixed(sample())).encode();
        let lines = lines(&text);
        let has = |line: &str| assert!(lines.contains(&line), "missing line {line:?} in:\n{text}");
        has("# TYPE lease_router_events_received counter");
        has("lease_router_events_received_total{deployment=\"prod\"} 5");
        has("lease_router_events_received_total{deployment=\"gone\"} 1");
        has("lease_router_events_applied_total{deployment=\"prod\",kind=\"admitted\"} 2");
        has("lease_router_events_applied_total{deployment=\"prod\",kind=\"completed\"} 1");
        has("lease_router_events_applied_total{deployment=\"prod\",kind=\"worker_reset\"} 0");
        has("lease_router_events_dropped_total{deployment=\"prod\",reason=\"duplicate\"} 1");
        has("lease_router_events_dropped_total{deployment=\"gone\",reason=\"late\"} 1");
        for reason in DropReason::ALL {
            for dep in ["prod", "gone"] {
                let prefix = format!(
                    "lease_router_events_dropped_total{{deployment=\"{dep}\",reason=\"{}\"}} ",
                    reason.as_str()
                );
                assert!(
                    lines.iter().any(|l| l.starts_with(&prefix)),
                    "every reason has a series: {prefix}"
                );
            }
        }
        has("# TYPE lease_router_events_held gauge");
        has("lease_router_events_held{deployment=\"prod\"} 2");
        has("lease_router_events_held{deployment=\"gone\"} 0");
        has("# TYPE lease_router_active_leases gauge");
        has("lease_router_active_leases{deployment=\"prod\"} 2");
        has("# TYPE lease_router_max_active_leases gauge");
        has("lease_router_max_active_leases{deployment=\"prod\"} 100");
        has("# TYPE lease_router_router_tasks_ended gauge");
        has("lease_router_router_tasks_ended{deployment=\"prod\"} 1");
        assert!(
            !text.contains("deployment=\"gone\"} 100")
                && !text.contains("ended{deployment=\"gone\"}"),
            "no bound or task gauge for a removed deployment"
        );
        assert!(
            !text.contains("lease_router_active_leases{deployment=\"gone\"}"),
            "no lease gauge for a removed deployment"
        );
        has("lease_router_leases_expired_total{deployment=\"gone\"} 4");
        has("lease_router_leases_expired_total{deployment=\"prod\"} 1");
        has("lease_router_provisional_expired_total{deployment=\"gone\"} 3");
        has("lease_router_prefix_index_entries{deployment=\"prod\"} 12");
        has("lease_router_prefix_predicted_cached_tokens_total{deployment=\"prod\"} 96");
        has("lease_router_prefix_reported_cached_tokens_total{deployment=\"prod\"} 80");
        assert!(
            !text.contains("lease_router_prefix_index_entries{deployment=\"gone\"}"),
            "no router, no index"
        );
        has("lease_router_routes_cancelled_total{deployment=\"prod\"} 5");
        has("lease_router_sequence_gaps_total{deployment=\"prod\"} 3");
        has("lease_router_reorders_held_total{deployment=\"prod\"} 1");
        has("lease_router_publisher_restarts_total{deployment=\"prod\"} 1");
        has("lease_router_publishers_evicted_total{deployment=\"prod\"} 5");
        has("# TYPE lease_router_publish_to_apply_lag_seconds histogram");
        has("# UNIT lease_router_publish_to_apply_lag_seconds seconds");
        has("lease_router_publish_to_apply_lag_seconds_count{deployment=\"prod\"} 3");
        has(
            "lease_router_publish_to_apply_lag_seconds_bucket{le=\"0.0001\",deployment=\"prod\"} 1",
        );
        has("lease_router_publish_to_apply_lag_seconds_bucket{le=\"0.00025\",deployment=\"prod\"} 1");
        has("lease_router_publish_to_apply_lag_seconds_bucket{le=\"0.001\",deployment=\"prod\"} 2");
        has("lease_router_publish_to_apply_lag_seconds_bucket{le=\"30.0\",deployment=\"prod\"} 2");
        has("lease_router_publish_to_apply_lag_seconds_bucket{le=\"+Inf\",deployment=\"prod\"} 3");
        has("lease_router_publish_to_apply_lag_seconds_bucket{le=\"+Inf\",deployment=\"gone\"} 0");
        let sum = lines
            .iter()
            .find_map(|l| {
                l.strip_prefix(
                    "lease_router_publish_to_apply_lag_seconds_sum{deployment=\"prod\"} ",
                )
            })
            .expect("a sum");
        assert!(
            (sum.parse::<f64>().unwrap() - 60.00075).abs() < 1e-9,
            "{sum}"
        );
        has("lease_router_nats_connected 1");
        has("lease_router_nats_reconnects_total 2");
        has("lease_router_nats_disconnects_total 2");
        has("lease_router_slow_consumer_events_total 7");
        has("lease_router_deployments 1");
        has("lease_router_live_tasks 3");
        assert_eq!(lines.last(), Some(&"# EOF"));
    }

    #[test]
    fn empty_host_still_describes_every_metric() {
        let text = Metrics::from_source(Fixed(HostFigures::default())).encode();
        for name in [
            "events_received",
            "batches_received",
            "events_applied",
            "events_dropped",
            "events_held",
            "active_leases",
            "max_active_leases",
            "router_tasks_ended",
            "leases_expired",
            "provisional_expired",
            "routes_cancelled",
            "sequence_gaps",
            "reorders_held",
            "publisher_restarts",
            "publishers_evicted",
            "publish_to_apply_lag_seconds",
            "nats_connected",
            "nats_reconnects",
            "slow_consumer_events",
            "deployments",
            "live_tasks",
            "http_auth_failures",
        ] {
            assert!(
                text.contains(&format!("# TYPE lease_router_{name} ")),
                "{name} in:\n{text}"
            );
        }
        assert!(text.contains("lease_router_nats_connected 0"));
        for reason in AuthFailure::ALL {
            let series = format!(
                "lease_router_http_auth_failures_total{{reason=\"{}\"}} 0",
                reason.as_str()
            );
            assert!(text.lines().any(|l| l == series), "{series} in:\n{text}");
        }
    }

    /// The metrics README.md describes, by name as scraped and type, from its Metrics table.
    fn documented_metrics() -> BTreeMap<String, String> {
        let readme = include_str!("../../README.md");
        let section = readme
            .split("\n## Metrics\n")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("README.md has a Metrics section");
        let mut documented = BTreeMap::new();
        for row in section.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let (names, kind) = (cells[1], cells[2]);
            for name in names.split(',').map(|n| n.trim().trim_matches('`')) {
                let previous = documented.insert(name.to_string(), kind.to_string());
                assert!(previous.is_none(), "{name} documented twice");
            }
        }
        documented
    }

    /// Every metric the exporter writes (worker loads included), by name as scraped and type.
    fn exported_metrics() -> BTreeMap<String, String> {
        let mut metrics = Metrics::from_source(Fixed(HostFigures::default()));
        metrics
            .registry_mut()
            .register_collector(Box::new(WorkerLoads::default()));
        metrics
            .registry_mut()
            .register_collector(Box::new(SchedulerCounters::default()));
        metrics
            .registry_mut()
            .register_collector(Box::new(ClassLoads::default()));
        let text = metrics.encode();
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE lease_router_"))
            .map(|l| {
                let (name, kind) = l.split_once(' ').expect("name and type");
                // Counters are scraped with the `_total` suffix the README names them by.
                let scraped = match kind {
                    "counter" => format!("{name}_total"),
                    _ => name.to_string(),
                };
                (scraped, kind.to_string())
            })
            .collect()
    }

    #[test]
    fn readme_documents_exactly_the_exported_metrics() {
        let (documented, exported) = (documented_metrics(), exported_metrics());
        assert!(exported.len() > 20, "{exported:?}");
        assert_eq!(
            documented, exported,
            "README.md's Metrics table and the exporter differ"
        );
    }

    /// Each class's in-flight gauges and this replica's admission counters, queue gauge and
    /// wait histogram, labelled by deployment and class.
    #[test]
    fn class_series() {
        let mut counts = crate::admission::ClassCounts::default();
        counts.admitted = 7;
        counts.queued = 4;
        counts.refused = 2;
        counts.abandoned = 1;
        for ms in [3, 40, 40] {
            counts.left_queue(Duration::from_millis(ms));
        }
        let premium = ClassLoad {
            class: "premium".into(),
            band: 1,
            weight: 4.0,
            in_flight_requests: 3,
            in_flight_tokens: 900,
            admission: counts.figures(1),
        };
        let classes = ClassLoads {
            saturated: vec![("prod".into(), true)],
            classes: vec![("prod".into(), vec![premium])],
        };
        let mut registry = Registry::with_prefix(METRIC_PREFIX);
        registry.register_collector(Box::new(classes));
        let mut text = String::new();
        encode_registry(&mut text, &registry).unwrap();
        let labels = "deployment=\"prod\",class=\"premium\"";
        for line in [
            "lease_router_saturated{deployment=\"prod\"} 1".to_string(),
            format!("lease_router_class_inflight_requests{{{labels}}} 3"),
            format!("lease_router_class_inflight_tokens{{{labels}}} 900"),
            format!("lease_router_class_admitted_total{{{labels}}} 7"),
            format!("lease_router_class_queued_total{{{labels}}} 4"),
            format!("lease_router_class_refused_total{{{labels}}} 2"),
            format!("lease_router_class_abandoned_total{{{labels}}} 1"),
            format!("lease_router_class_waiting{{{labels}}} 1"),
            "# TYPE lease_router_class_queue_wait_seconds histogram".to_string(),
            format!("lease_router_class_queue_wait_seconds_count{{{labels}}} 3"),
            format!("lease_router_class_queue_wait_seconds_bucket{{le=\"0.005\",{labels}}} 1"),
            format!("lease_router_class_queue_wait_seconds_bucket{{le=\"0.025\",{labels}}} 1"),
            format!("lease_router_class_queue_wait_seconds_bucket{{le=\"0.05\",{labels}}} 3"),
            format!("lease_router_class_queue_wait_seconds_bucket{{le=\"10.0\",{labels}}} 3"),
            format!("lease_router_class_queue_wait_seconds_bucket{{le=\"+Inf\",{labels}}} 3"),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
        let sum = text
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "lease_router_class_queue_wait_seconds_sum{{{labels}}} "
                ))
            })
            .expect("a sum");
        assert!((sum.parse::<f64>().unwrap() - 0.083).abs() < 1e-9, "{sum}");
    }

    #[test]
    fn worker_loads() {
        let loads = WorkerLoads(vec![(
            "prod".into(),
            WorkerWithDpRank::new(7, 1),
            WorkerLoad {
                active_bookings: 2,
                prompt_tokens: 300,
                expected_output_tokens: 40,
                prefill_tokens: 250,
                kv_tokens: 310,
                remaining_output_tokens: 30,
            },
        )]);
        let mut registry = Registry::with_prefix(METRIC_PREFIX);
        registry.register_collector(Box::new(loads));
        let mut text = String::new();
        encode_registry(&mut text, &registry).unwrap();
        for line in [
            "lease_router_worker_active_bookings{deployment=\"prod\",worker_id=\"7\",dp_rank=\"1\"} 2",
            "lease_router_worker_prompt_tokens{deployment=\"prod\",worker_id=\"7\",dp_rank=\"1\"} 300",
            "lease_router_worker_expected_output_tokens{deployment=\"prod\",worker_id=\"7\",dp_rank=\"1\"} 40",
            "lease_router_worker_prefill_tokens{deployment=\"prod\",worker_id=\"7\",dp_rank=\"1\"} 250",
            "lease_router_worker_kv_tokens{deployment=\"prod\",worker_id=\"7\",dp_rank=\"1\"} 310",
            "lease_router_worker_remaining_output_tokens{deployment=\"prod\",worker_id=\"7\",dp_rank=\"1\"} 30",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
    }
}

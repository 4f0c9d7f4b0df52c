//! What the fleet benches (`routing`, `routing_prefix`, `admission`) share: the model's time
//! line, a deployment's router replicas, the feed that brings them the model workers' lease
//! events (over the bus or straight into their managers), and the mains' small helpers. The
//! benches differ only in their routers' configuration and in what a worker's `admitted`
//! carries.

use std::future::Future;
use std::ops::AddAssign;
use std::sync::Arc;
use std::time::Duration;

use lease_router::wire::{
    Admitted, Completed, Outcome, ProgressStage, Progressed, MAX_BLOCK_HASHES,
};
use lease_router::{
    ApplyConfig, IngressStats, LeasePublisher, NatsConnection, NatsIngress, NoIngress,
    PublisherConfig, RequestLeaseManager, RequestLoad, Router, RouterConfig, WorkerWithDpRank,
};
use tokio::time::Instant;

use crate::common::percentile;
use crate::model::{Engine, Happened};

/// How far past `end` the model may run for the measured requests to complete.
pub const MAX_DRAIN: f64 = 600.0;

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

impl Plan {
    /// `measure` seconds measured after a `warmup`, arrivals going on `tail` seconds more; as
    /// fast as it computes.
    pub fn new(workers: usize, engine: Engine, warmup: f64, measure: f64, tail: f64) -> Self {
        Self {
            workers,
            engine,
            warmup,
            measure_end: warmup + measure,
            end: warmup + measure + tail,
            speedup: None,
        }
    }

    /// Whether model time `t` is in the measured window.
    pub fn in_window(&self, t: f64) -> bool {
        t >= self.warmup && t < self.measure_end
    }

    /// In real time, waits until model time `t` is due (counted from `start`) and returns
    /// how late it is then, in wall seconds; as fast as it computes, `None` at once.
    #[allow(dead_code)] // `admission` paces itself: it waits for route answers too
    pub async fn pace(&self, start: Instant, t: f64) -> Option<f64> {
        let due = start + Duration::from_secs_f64(t / self.speedup?);
        if due > Instant::now() {
            tokio::time::sleep_until(due).await;
        }
        Some(Instant::now().saturating_duration_since(due).as_secs_f64())
    }
}

/// Model worker `w` as the routers know it (ids from 1).
pub fn worker(w: usize) -> WorkerWithDpRank {
    WorkerWithDpRank::new(w as u64 + 1, 0)
}

/// The model worker a router chose: [`worker`]'s inverse.
pub fn worker_index(chosen: WorkerWithDpRank) -> usize {
    (chosen.worker_id.0 - 1) as usize
}

pub fn request_id(index: usize) -> String {
    format!("q{index:07}")
}

/// What a worker says of a request it admits, beyond its id: the bench's `admitted`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Admission<'a> {
    pub prompt: u32,
    pub cached: u32,
    /// The request's admission class (`cls`).
    pub class: Option<&'a str>,
    /// The prompt's block hashes and the worker's cache capacity in blocks, for the routers'
    /// prefix indexes: on the bus only (a direct feed brings the lease, not the index).
    pub blocks: Option<(&'a [u64], u32)>,
}

/// Where the workers' lease events go.
pub enum Feed {
    /// One publisher per worker, on the bench's nats-server.
    Bus(Vec<LeasePublisher>),
    /// Straight into the manager of the replica that routed the request, as a proxy in its
    /// response path would.
    Direct(Vec<RequestLeaseManager>),
}

impl Feed {
    /// Request `index`, routed by `replica`, reached worker `w`, which takes it into its
    /// queue at once and says so.
    pub fn admitted(&self, index: usize, a: Admission, w: usize, replica: usize) {
        let id = request_id(index);
        match self {
            Self::Bus(publishers) => {
                let (hashes, capacity) = a.blocks.unzip();
                let hashes = hashes.unwrap_or_default();
                let _ = publishers[w].publish(Admitted {
                    block_hashes: hashes[..hashes.len().min(MAX_BLOCK_HASHES)].to_vec(),
                    block_capacity: capacity,
                    class: a.class.map(str::to_owned),
                    request_id: id,
                    worker_id: worker(w).worker_id.0,
                    dp_rank: 0,
                    prompt_tokens: a.prompt,
                    expected_output_tokens: None,
                    cached_tokens: Some(a.cached),
                });
            }
            Self::Direct(managers) => {
                let load = RequestLoad::new(a.prompt, None).with_cached_tokens(a.cached);
                managers[replica].admit_current_in_class(&id, worker(w), load, a.class);
            }
        }
    }

    /// Worker `w`'s lease event `h` of a request routed by `replica`.
    pub fn happened(&self, h: Happened, w: usize, replica: usize) {
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

/// What the replicas' ingresses saw of the bus, summed over them.
#[derive(Clone, Copy, Debug, Default)]
pub struct BusStats {
    /// Publish-to-apply lag of the events applied: sum (seconds) and count...
    pub lag_sum: f64,
    pub lag_count: u64,
    /// ...and of them, applied within 1 ms / 5 ms.
    pub lag_1ms: u64,
    pub lag_5ms: u64,
    /// Events dropped (any reason).
    pub dropped: u64,
}

impl AddAssign for BusStats {
    fn add_assign(&mut self, other: Self) {
        self.lag_sum += other.lag_sum;
        self.lag_count += other.lag_count;
        self.lag_1ms += other.lag_1ms;
        self.lag_5ms += other.lag_5ms;
        self.dropped += other.dropped;
    }
}

/// A deployment's router replicas and what feeds them.
pub struct Fleet {
    pub routers: Vec<Router>,
    pub feed: Feed,
    /// Each replica's ingress (on the bus).
    stats: Vec<Arc<IngressStats>>,
    /// Kept for the case's length (each with its connection monitor), like a process's.
    connections: Vec<NatsConnection>,
}

impl Fleet {
    /// Starts `replicas` routers of `config` for `workers` workers and returns once every
    /// replica counts every worker as a member. With `nats_url`, each replica hears the bus
    /// through its own `NatsIngress`, and the workers publish on it; without, each has
    /// `NoIngress` and the feed goes to its manager.
    pub async fn start(
        config: RouterConfig,
        replicas: usize,
        workers: usize,
        nats_url: Option<&str>,
    ) -> Self {
        let fleet = match nats_url {
            Some(url) => {
                let subjects = crate::common::subjects(config.deployment());
                let (mut routers, mut stats, mut connections) =
                    (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..replicas {
                    let connection = crate::common::nats(url, None).await;
                    let s = Arc::new(IngressStats::new());
                    let ingress = NatsIngress::new(
                        connection.client().clone(),
                        subjects.clone(),
                        ApplyConfig::default(),
                        s.clone(),
                    );
                    let router = Router::start(config.clone(), ingress)
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
                    feed: Feed::Bus(publishers),
                    stats,
                    connections,
                }
            }
            None => {
                let mut routers = Vec::new();
                for _ in 0..replicas {
                    let router = Router::start(config.clone(), NoIngress)
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
                    feed: Feed::Direct(managers),
                    stats: Vec::new(),
                    connections: Vec::new(),
                }
            }
        };
        for router in &fleet.routers {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while router.scheduler().loads().await.expect("scheduler").len() < workers {
                assert!(
                    std::time::Instant::now() < deadline,
                    "a replica did not learn every worker within 10 s"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        fleet
    }

    /// A figure of every replica, summed.
    #[allow(dead_code)] // `routing_prefix` reads one replica's index instead
    pub fn sum(&self, figure: impl Fn(&Router) -> u64) -> u64 {
        self.routers.iter().map(figure).sum()
    }

    /// Closes the feed, shuts the routers down and returns what their ingresses saw of the
    /// bus (nothing without one).
    pub async fn shutdown(self) -> BusStats {
        let Fleet {
            routers,
            feed,
            stats,
            connections,
        } = self;
        // The direct feed holds the managers: dropped first, so the routers can end.
        match feed {
            Feed::Bus(publishers) => {
                for p in publishers {
                    let _ = p.close().await;
                }
            }
            Feed::Direct(managers) => drop(managers),
        }
        let mut bus = BusStats::default();
        for s in &stats {
            let snap = s.snapshot();
            let lag = &snap.lag;
            bus += BusStats {
                lag_sum: lag.sum_seconds,
                lag_count: lag.count,
                lag_1ms: lag.count_within(0.001),
                lag_5ms: lag.count_within(0.005),
                dropped: snap.dropped_total(),
            };
        }
        for router in routers {
            router.shutdown().await.expect("router shuts down cleanly");
        }
        drop(connections);
        bus
    }
}

/// Spawns every case at once and returns their results in order.
pub async fn at_once<F>(cases: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let tasks: Vec<_> = cases.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.expect("a case panicked"));
    }
    out
}

/// The bench's setting `name`, parsed, or `default` when unset.
pub fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a valid value")),
        Err(_) => default,
    }
}

/// The quantile `q` of `values` (seconds), in milliseconds, at microsecond resolution.
pub fn ms_percentile(values: &[f64], q: f64) -> f64 {
    let mut us: Vec<u64> = values.iter().map(|s| (s * 1e6) as u64).collect();
    us.sort_unstable();
    percentile(&us, q) as f64 / 1000.0
}

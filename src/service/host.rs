//! [`DeploymentHost`]: one [`Router`] per deployment, all over one shared NATS connection,
//! added and removed at runtime.
//!
//! # State
//! One map, behind one short `parking_lot` lock that is never held across an `.await`, says
//! for each deployment name whether its router is running or an operation (start or stop)
//! is under way. Operations on the same name wait for each other; operations on different
//! names run side by side. The start and the stop of a router run in a task of their own, so
//! a caller that gives up (an HTTP client that hangs up) never leaves a half-built or
//! half-stopped deployment behind.
//!
//! # What survives removal
//! The [`IngressStats`] of a name are kept after the deployment is removed (and reused if it
//! is added again), so the `late` drops of events that were already on their way stay
//! visible in the metrics; so is the count of expired leases. Both are small and per name.
//!
//! # Tasks
//! Each router spawns its tasks on its own `TaskTracker`. [`DeploymentHost::live_tasks`] sums
//! them over running, starting and stopping deployments, and over removed ones whose tasks
//! did not end in time. [`DeploymentHost::remove`] returns once the removed router's tasks
//! have ended, or reports which did not.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn, Instrument};

use crate::connection::NatsConnection;
use crate::durable::{CatchUpState, JetStreamIngress, LeaseStreamConfig, StartDurableIngressError};
use crate::ingress::{ApplyConfig, NatsIngress, StartIngressError};
use crate::lease::{LeaseConfig, RequestLeaseManager};
use crate::router::{IngressContext, IngressStart, RouterTask};
use crate::router::{Router, RouterConfig, ShutdownRouterError, StartRouterError};
use crate::scheduler::SchedulerHandle;
use crate::stats::{IngressFigures, IngressStats};
use crate::subject::{DeploymentName, SubjectPrefix, Subjects};

/// How long [`DeploymentHost::remove`] waits for a removed router's tasks after its shutdown.
pub const DEFAULT_TASK_STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// The settings shared by every deployment of a host.
#[derive(Clone, Debug)]
pub struct HostSettings {
    /// Subjects are `{subject_prefix}.{deployment}.{worker_id}`.
    pub subject_prefix: SubjectPrefix,
    /// The lease reaper's scan interval.
    pub lease_scan_interval: Duration,
    /// Limits of each deployment's ingress.
    pub apply: ApplyConfig,
    /// How long a removal waits for the router's tasks to end after its shutdown.
    pub task_stop_timeout: Duration,
    /// Durable mode: replay each deployment from this JetStream stream before following it.
    pub durable: Option<LeaseStreamConfig>,
    /// Live leases per deployment; past it new admissions are refused and counted.
    pub max_active_leases: usize,
    /// Routing policy of each new deployment (a PUT body may change it).
    pub route_policy: crate::routing::RoutePolicy,
    /// How long a silent worker with nothing live stays a member; `None`: twice the lease
    /// scan interval.
    pub worker_idle: Option<Duration>,
    /// How long a route decision's provisional booking waits for its worker's `admitted`.
    pub provisional_deadline: Duration,
    /// Each deployment's prefix index: block size and bounds.
    pub prefix: crate::prefix::PrefixIndexConfig,
    /// The admission classes, saturation thresholds and queue of each new deployment (a PUT
    /// body may change them); default: none, no admission. Checked when a deployment starts.
    pub admission: crate::admission::AdmissionConfig,
    /// The hot-worker guard of prefix-aware decisions
    /// ([`RoutingConfig::with_affinity_gap`](crate::RoutingConfig::with_affinity_gap)).
    pub affinity_gap: u32,
    /// Turns the prompt text of route requests (`"prompt"`) into token ids, for every
    /// deployment; `None`: such requests are refused.
    #[cfg(feature = "tokenizer")]
    pub tokenizer: Option<Arc<crate::prefix::PromptTokenizer>>,
}

impl Default for HostSettings {
    fn default() -> Self {
        Self {
            subject_prefix: SubjectPrefix::default(),
            lease_scan_interval: crate::lease::DEFAULT_SCAN_INTERVAL,
            apply: ApplyConfig::default(),
            task_stop_timeout: DEFAULT_TASK_STOP_TIMEOUT,
            durable: None,
            max_active_leases: LeaseConfig::default().max_active_leases,
            route_policy: Default::default(),
            worker_idle: None,
            provisional_deadline: crate::lease::DEFAULT_PROVISIONAL_DEADLINE,
            prefix: crate::prefix::PrefixIndexConfig::default(),
            affinity_gap: crate::routing::DEFAULT_AFFINITY_GAP,
            admission: Default::default(),
            #[cfg(feature = "tokenizer")]
            tokenizer: None,
        }
    }
}

/// What [`DeploymentHost::add`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddOutcome {
    /// A router was started.
    Created,
    /// The deployment was already hosted.
    Existed,
}

/// Why a deployment could not be added.
#[derive(Debug, thiserror::Error)]
pub enum AddDeploymentError {
    /// [`DeploymentHost::shutdown_all`] has begun: no deployment is added any more.
    #[error("the service is shutting down: deployment {deployment} was not added")]
    ShuttingDown {
        /// The deployment.
        deployment: DeploymentName,
    },
    /// Building the deployment's router failed.
    #[error("starting the router of deployment {deployment} failed: {source}")]
    Start {
        /// The deployment.
        deployment: DeploymentName,
        /// The router's error.
        #[source]
        source: StartRouterError,
    },
    /// The start needs the server (core mode flushes its subscription; durable mode asks
    /// JetStream), and a client that waits for NATS to come back would wait without limit.
    #[error(
        "NATS did not answer within {waited:?} (the connect deadline): deployment {deployment} \
         was not added; try again once NATS is reachable"
    )]
    NatsTimeout {
        /// The deployment.
        deployment: DeploymentName,
        /// How long it waited: the connection's connect deadline.
        waited: Duration,
    },
    /// The task starting the router panicked.
    #[error("starting the router of deployment {deployment} panicked")]
    Panicked {
        /// The deployment.
        deployment: DeploymentName,
    },
}

/// Why a removal did not end cleanly. The deployment is removed in every case.
#[derive(Debug, thiserror::Error)]
pub enum RemoveDeploymentError {
    #[error(
        "deployment {deployment} was removed, but its router did not shut down cleanly: {source}"
    )]
    /// The router's shutdown reported failed tasks.
    Shutdown {
        /// The deployment.
        deployment: DeploymentName,
        /// The router's error.
        #[source]
        source: ShutdownRouterError,
    },
    #[error(
        "deployment {deployment} was removed, but {remaining} of its tasks were still running \
         {waited:?} after its shutdown"
    )]
    /// Tasks of the deployment still ran after [`HostSettings::task_stop_timeout`]; they are
    /// kept and counted in [`DeploymentHost::live_tasks`].
    TasksStillRunning {
        /// The deployment.
        deployment: DeploymentName,
        /// Tasks still running.
        remaining: usize,
        /// How long it waited for them.
        waited: Duration,
    },
    /// The task removing the deployment panicked.
    #[error("removing deployment {deployment} panicked")]
    Panicked {
        /// The deployment.
        deployment: DeploymentName,
    },
}

/// Removals of [`DeploymentHost::shutdown_all`] that did not end cleanly.
#[derive(Debug, thiserror::Error)]
#[error("{} deployment(s) did not shut down cleanly: {}", failures.len(), describe(failures))]
pub struct ShutdownAllError {
    /// One error per deployment whose removal did not end cleanly.
    pub failures: Vec<RemoveDeploymentError>,
}

fn describe(failures: &[RemoveDeploymentError]) -> String {
    failures
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Where a deployment is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeploymentPhase {
    /// Its router is being started.
    Starting,
    /// Its router runs.
    Running,
    /// Its router is being shut down.
    Stopping,
}

/// One line of [`DeploymentHost::deployments`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeploymentSummary {
    /// The deployment.
    pub name: DeploymentName,
    /// Where it is in its life.
    pub phase: DeploymentPhase,
    /// Leases of the running router (0 while starting or stopping).
    pub active_leases: u64,
    /// Running, and every task it started still runs.
    pub live: bool,
    /// Tasks of this deployment still running.
    pub tasks: usize,
    /// Seconds since the router started (0 unless running).
    pub uptime_seconds: u64,
}

/// A running deployment, for the lease and worker listings.
///
/// It holds the router's manager and scheduler handle: drop it when done. A removal waits
/// for views to go (the scheduler stops once the last handle is gone), and reports a
/// failure if one is still held ten seconds on.
#[derive(Clone)]
pub struct DeploymentView {
    name: DeploymentName,
    manager: RequestLeaseManager,
    scheduler: SchedulerHandle,
    stats: Arc<IngressStats>,
    started_at: Instant,
}

impl DeploymentView {
    /// The deployment.
    pub fn name(&self) -> &DeploymentName {
        &self.name
    }

    /// The lease manager of its router.
    pub fn manager(&self) -> &RequestLeaseManager {
        &self.manager
    }

    /// A handle on its router's scheduler, for route decisions.
    pub fn scheduler(&self) -> &SchedulerHandle {
        &self.scheduler
    }

    /// The counters of its ingress.
    pub fn ingress_stats(&self) -> &Arc<IngressStats> {
        &self.stats
    }

    /// Time since its router started.
    pub fn uptime(&self) -> Duration {
        self.started_at.elapsed()
    }
}

impl fmt::Debug for DeploymentView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeploymentView")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The figures of one deployment name (live or removed) for the metrics exporter.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeploymentFigures {
    /// The deployment name.
    pub name: String,
    /// Its ingress counters.
    pub ingress: IngressFigures,
    /// Leases now; `None` when no router runs for this name.
    pub active_leases: Option<u64>,
    /// The bound of `active_leases` (`HostSettings::max_active_leases`), so an alert can
    /// compare the two; `None` when no router runs for this name.
    pub max_active_leases: Option<u64>,
    /// Tasks of the running router that ended on their own (it is then not ready); `None`
    /// when no router runs for this name.
    pub router_tasks_ended: Option<u64>,
    /// Expired leases over every router this name has had.
    pub leases_expired: u64,
    /// Provisional bookings released at their deadline, over every router this name has had.
    pub provisional_expired: u64,
    /// Provisional bookings cancelled by gateways, over every router this name has had.
    pub routes_cancelled: u64,
    /// Durable mode only: the replay of the running router.
    pub catch_up: Option<CatchUpFigures>,
    /// The running router's prefix index (counts since it started); `None` when no router
    /// runs for this name.
    pub prefix: Option<crate::prefix::PrefixFigures>,
}

/// Where a durable router's replay stands, and its stream.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CatchUpFigures {
    /// True once catch-up has finished.
    pub done: bool,
    /// Events applied during catch-up.
    pub replayed: u64,
    /// How long catch-up took, in seconds (0 until it is done).
    pub seconds: f64,
    /// Events the replica needed that the stream had discarded.
    pub truncated_events: u64,
    /// `None` until the stream was first read.
    pub stream: Option<crate::durable::StreamFigures>,
    /// Snapshots this replica wrote and loaded.
    pub snapshots: crate::durable::SnapshotFigures,
}

/// Everything the metrics exporter reads, taken at scrape time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostFigures {
    /// Every name ever hosted, by name.
    pub deployments: Vec<DeploymentFigures>,
    /// Deployments hosted now (running, starting or stopping).
    pub hosted: usize,
    /// Tasks of every router of this host still running ([`DeploymentHost::live_tasks`]).
    pub live_tasks: usize,
    /// True while the NATS client holds a connection ([`ConnectionStats::is_connected`](crate::ConnectionStats::is_connected)).
    pub nats_connected: bool,
    /// Successful NATS connections after the first one.
    pub nats_reconnects: u64,
    /// NATS connections lost.
    pub nats_disconnects: u64,
    /// Times the NATS client dropped messages of a subscription not read fast enough
    /// (best-effort).
    pub slow_consumer_events: u64,
}

struct Running {
    router: Router,
    tracker: TaskTracker,
    stats: Arc<IngressStats>,
    /// Durable mode only: not ready until the replay is done.
    catch_up: Option<Arc<CatchUpState>>,
    started_at: Instant,
    /// Tasks right after the start: fewer later means one ended on its own.
    tasks_at_start: usize,
}

impl Running {
    fn is_live(&self) -> bool {
        self.tracker.len() >= self.tasks_at_start
    }

    /// Tasks that ended on their own since the start (0 while live).
    fn tasks_ended(&self) -> u64 {
        self.tasks_at_start.saturating_sub(self.tracker.len()) as u64
    }
}

enum Slot {
    Running(Box<Running>),
    /// A start or a stop under way; `done` fires when it is over.
    Pending {
        phase: DeploymentPhase,
        op: u64,
        done: CancellationToken,
        tracker: TaskTracker,
    },
}

/// What is kept per name, hosted or not.
#[derive(Default)]
struct Record {
    stats: Arc<IngressStats>,
    /// The releases of this name's previous routers.
    before: Released,
}

/// Releases that a dashboard counts over every router a name has had.
#[derive(Clone, Copy, Default)]
struct Released {
    expired: u64,
    provisional_expired: u64,
    routes_cancelled: u64,
}

impl Released {
    fn add(&mut self, stats: &crate::lease::LeaseStats) {
        self.expired += stats.expired;
        self.provisional_expired += stats.provisional_expired;
        self.routes_cancelled += stats.routes_cancelled;
    }
}

#[derive(Default)]
struct State {
    slots: BTreeMap<DeploymentName, Slot>,
    records: BTreeMap<DeploymentName, Record>,
    /// Trackers of removed routers whose tasks had not ended in time.
    stragglers: Vec<(DeploymentName, TaskTracker)>,
    closed: bool,
    next_op: u64,
}

struct Inner {
    connection: NatsConnection,
    settings: HostSettings,
    state: Mutex<State>,
}

/// Hosts one router per deployment over one NATS connection. Cheap to clone.
#[derive(Clone)]
pub struct DeploymentHost {
    inner: Arc<Inner>,
}

impl fmt::Debug for DeploymentHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self
            .inner
            .state
            .lock()
            .slots
            .keys()
            .map(ToString::to_string)
            .collect();
        f.debug_struct("DeploymentHost")
            .field("nats", &self.inner.connection.urls())
            .field("deployments", &names)
            .finish_non_exhaustive()
    }
}

enum Claim {
    /// Another operation on this name is under way: wait for it, then look again.
    Wait(CancellationToken),
    Proceed(u64, CancellationToken),
}

impl DeploymentHost {
    /// A host with no deployment, on this connection, with these settings.
    pub fn new(connection: NatsConnection, settings: HostSettings) -> Self {
        Self {
            inner: Arc::new(Inner {
                connection,
                settings,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// The NATS connection every deployment uses.
    pub fn connection(&self) -> &NatsConnection {
        &self.inner.connection
    }

    /// The settings every deployment is started with.
    pub fn settings(&self) -> &HostSettings {
        &self.inner.settings
    }

    /// Starts a router for `name`, unless there is one.
    ///
    /// # Errors
    /// [`AddDeploymentError`]: the host is shutting down, or the router did not start (the
    /// subscription failed, or NATS did not answer within the connection's connect
    /// deadline); nothing of it is left behind.
    pub async fn add(&self, name: &DeploymentName) -> Result<AddOutcome, AddDeploymentError> {
        let span = tracing::info_span!("add_deployment", deployment = %name);
        let (op, done) = loop {
            let claim = {
                let mut state = self.inner.state.lock();
                if state.closed {
                    return Err(AddDeploymentError::ShuttingDown {
                        deployment: name.clone(),
                    });
                }
                match state.slots.get(name) {
                    Some(Slot::Running(_)) => return Ok(AddOutcome::Existed),
                    Some(Slot::Pending { done, .. }) => Claim::Wait(done.clone()),
                    None => {
                        let op = state.next_op;
                        state.next_op += 1;
                        let done = CancellationToken::new();
                        let tracker = TaskTracker::new();
                        state.slots.insert(
                            name.clone(),
                            Slot::Pending {
                                phase: DeploymentPhase::Starting,
                                op,
                                done: done.clone(),
                                tracker,
                            },
                        );
                        Claim::Proceed(op, done)
                    }
                }
            };
            match claim {
                Claim::Wait(done) => done.cancelled().await,
                Claim::Proceed(op, done) => break (op, done),
            }
        };
        let guard = PendingGuard {
            inner: self.inner.clone(),
            name: name.clone(),
            op,
            done,
        };
        let task = tokio::spawn(start(self.inner.clone(), guard).instrument(span));
        match task.await {
            Ok(result) => result,
            Err(_) => Err(AddDeploymentError::Panicked {
                deployment: name.clone(),
            }),
        }
    }

    /// Tears the router of `name` down and waits for its tasks to end. Returns whether
    /// there was one.
    ///
    /// # Errors
    /// [`RemoveDeploymentError`] when a task failed, panicked or did not end in time; the
    /// deployment is removed all the same.
    pub async fn remove(&self, name: &DeploymentName) -> Result<bool, RemoveDeploymentError> {
        let span = tracing::info_span!("remove_deployment", deployment = %name);
        let (running, guard) = loop {
            let claim = {
                let mut state = self.inner.state.lock();
                match state.slots.get(name) {
                    None => return Ok(false),
                    Some(Slot::Pending { done, .. }) => Err(done.clone()),
                    Some(Slot::Running(_)) => {
                        let op = state.next_op;
                        state.next_op += 1;
                        let done = CancellationToken::new();
                        let Some(Slot::Running(running)) = state.slots.remove(name) else {
                            unreachable!("looked up above")
                        };
                        state.slots.insert(
                            name.clone(),
                            Slot::Pending {
                                phase: DeploymentPhase::Stopping,
                                op,
                                done: done.clone(),
                                tracker: running.tracker.clone(),
                            },
                        );
                        // From here on the metrics show this router's expiries as history.
                        let record = state.records.entry(name.clone()).or_default();
                        record.before.add(&running.router.manager().stats());
                        Ok((running, op, done))
                    }
                }
            };
            match claim {
                Err(done) => done.cancelled().await,
                Ok((running, op, done)) => {
                    let guard = PendingGuard {
                        inner: self.inner.clone(),
                        name: name.clone(),
                        op,
                        done,
                    };
                    break (running, guard);
                }
            }
        };
        let task = tokio::spawn(stop(self.inner.clone(), *running, guard).instrument(span));
        match task.await {
            Ok(Ok(())) => Ok(true),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(RemoveDeploymentError::Panicked {
                deployment: name.clone(),
            }),
        }
    }

    /// Refuses further additions, then removes every deployment (in parallel), waiting for
    /// operations under way.
    ///
    /// # Errors
    /// [`ShutdownAllError`] with every removal that did not end cleanly.
    pub async fn shutdown_all(&self) -> Result<(), ShutdownAllError> {
        self.inner.state.lock().closed = true;
        let mut failures = Vec::new();
        loop {
            let (names, pending): (Vec<DeploymentName>, Vec<CancellationToken>) = {
                let state = self.inner.state.lock();
                let mut names = Vec::new();
                let mut pending = Vec::new();
                for (name, slot) in &state.slots {
                    match slot {
                        Slot::Running(_) => names.push(name.clone()),
                        Slot::Pending { done, .. } => pending.push(done.clone()),
                    }
                }
                (names, pending)
            };
            if names.is_empty() && pending.is_empty() {
                break;
            }
            let removals = names.iter().map(|name| self.remove(name));
            for result in futures::future::join_all(removals).await {
                if let Err(err) = result {
                    failures.push(err);
                }
            }
            for done in pending {
                done.cancelled().await;
            }
        }
        info!("every deployment is shut down");
        if failures.is_empty() {
            Ok(())
        } else {
            Err(ShutdownAllError { failures })
        }
    }

    /// True once [`shutdown_all`](Self::shutdown_all) has begun.
    pub fn is_closed(&self) -> bool {
        self.inner.state.lock().closed
    }

    /// The hosted deployments, by name.
    pub fn deployments(&self) -> Vec<DeploymentSummary> {
        // Copy handles out under the lock; count leases (64 shard locks each) outside it.
        let entries: Vec<_> = {
            let state = self.inner.state.lock();
            state
                .slots
                .iter()
                .map(|(name, slot)| match slot {
                    Slot::Running(running) => (
                        name.clone(),
                        DeploymentPhase::Running,
                        Some(running.router.manager().downgrade()),
                        running.is_live(),
                        running.tracker.clone(),
                        running.started_at.elapsed(),
                    ),
                    Slot::Pending { phase, tracker, .. } => (
                        name.clone(),
                        *phase,
                        None,
                        false,
                        tracker.clone(),
                        Duration::ZERO,
                    ),
                })
                .collect()
        };
        entries
            .into_iter()
            .map(|(name, phase, manager, live, tracker, uptime)| {
                let active_leases = manager
                    .and_then(|weak| weak.upgrade())
                    .map_or(0, |m| m.active_leases() as u64);
                DeploymentSummary {
                    name,
                    phase,
                    active_leases,
                    live,
                    tasks: tracker.len(),
                    uptime_seconds: uptime.as_secs(),
                }
            })
            .collect()
    }

    /// Names of the hosted deployments, starting and stopping ones included.
    pub fn names(&self) -> Vec<DeploymentName> {
        self.inner.state.lock().slots.keys().cloned().collect()
    }

    /// The running deployment `name`, if there is one. Do not keep the view.
    pub fn get(&self, name: &DeploymentName) -> Option<DeploymentView> {
        let state = self.inner.state.lock();
        match state.slots.get(name)? {
            Slot::Running(running) => Some(DeploymentView {
                name: name.clone(),
                manager: running.router.manager().clone(),
                scheduler: running.router.scheduler().clone(),
                stats: running.stats.clone(),
                started_at: running.started_at,
            }),
            Slot::Pending { .. } => None,
        }
    }

    /// Views of every running deployment. Do not keep them.
    pub fn views(&self) -> Vec<DeploymentView> {
        let names = self.names();
        names.iter().filter_map(|name| self.get(name)).collect()
    }

    /// True when every hosted deployment's router is running with all its tasks (none is
    /// starting or stopping). True with no deployment.
    pub fn is_ready(&self) -> bool {
        self.not_ready().is_empty()
    }

    /// The deployments that are not live, with why.
    pub fn not_ready(&self) -> Vec<(DeploymentName, &'static str)> {
        let state = self.inner.state.lock();
        state
            .slots
            .iter()
            .filter_map(|(name, slot)| match slot {
                Slot::Running(running) if !running.is_live() => {
                    Some((name.clone(), "a router task has ended"))
                }
                Slot::Running(running)
                    if running.catch_up.as_ref().is_some_and(|c| !c.is_caught_up()) =>
                {
                    Some((name.clone(), "catching up from the lease stream"))
                }
                Slot::Running(_) => None,
                Slot::Pending {
                    phase: DeploymentPhase::Stopping,
                    ..
                } => Some((name.clone(), "stopping")),
                Slot::Pending { .. } => Some((name.clone(), "starting")),
            })
            .collect()
    }

    /// Running deployments that serve, but from an incomplete picture: in durable mode, the
    /// stream discarded events the replica needed within the last two lease scan intervals
    /// (the leases those events ended have expired by then; those they admitted stay
    /// unknown until they end).
    pub fn degraded(&self) -> Vec<(DeploymentName, String)> {
        let window = self.inner.settings.lease_scan_interval * 2;
        let state = self.inner.state.lock();
        state
            .slots
            .iter()
            .filter_map(|(name, slot)| {
                let Slot::Running(running) = slot else {
                    return None;
                };
                let catch_up = running.catch_up.as_ref()?;
                let since = catch_up.since_truncation().filter(|&s| s < window)?;
                Some((
                    name.clone(),
                    format!(
                        "the lease stream no longer held {} event(s) this replica needed \
                         ({}s ago): leases they admitted are missing",
                        catch_up.truncated_events(),
                        since.as_secs()
                    ),
                ))
            })
            .collect()
    }

    /// Tasks of every router of this host still running: hosted deployments, and removed
    /// ones whose tasks did not end in time.
    pub fn live_tasks(&self) -> usize {
        let mut state = self.inner.state.lock();
        state.stragglers.retain(|(_, tracker)| !tracker.is_empty());
        let hosted: usize = state
            .slots
            .values()
            .map(|slot| match slot {
                Slot::Running(running) => running.tracker.len(),
                Slot::Pending { tracker, .. } => tracker.len(),
            })
            .sum();
        hosted
            + state
                .stragglers
                .iter()
                .map(|(_, tracker)| tracker.len())
                .sum::<usize>()
    }

    /// The ingress counters of `name`, hosted now or in the past.
    pub fn ingress_stats(&self, name: &DeploymentName) -> Option<Arc<IngressStats>> {
        let state = self.inner.state.lock();
        state.records.get(name).map(|record| record.stats.clone())
    }

    /// Everything the metrics exporter needs, read now.
    pub fn figures(&self) -> HostFigures {
        struct Entry {
            name: String,
            stats: Arc<IngressStats>,
            before: Released,
            manager: Option<crate::lease::WeakRequestLeaseManager>,
            catch_up: Option<Arc<CatchUpState>>,
            tasks_ended: Option<u64>,
        }
        let (entries, hosted) = {
            let state = self.inner.state.lock();
            let entries: Vec<Entry> = state
                .records
                .iter()
                .map(|(name, record)| Entry {
                    name: name.to_string(),
                    stats: record.stats.clone(),
                    before: record.before,
                    manager: match state.slots.get(name) {
                        Some(Slot::Running(running)) => Some(running.router.manager().downgrade()),
                        _ => None,
                    },
                    catch_up: match state.slots.get(name) {
                        Some(Slot::Running(running)) => running.catch_up.clone(),
                        _ => None,
                    },
                    tasks_ended: match state.slots.get(name) {
                        Some(Slot::Running(running)) => Some(running.tasks_ended()),
                        _ => None,
                    },
                })
                .collect();
            (entries, state.slots.len())
        };
        let deployments = entries
            .into_iter()
            .map(|entry| {
                let manager = entry.manager.and_then(|weak| weak.upgrade());
                let lease_stats = manager.as_ref().map(|manager| manager.stats());
                let prefix = manager.as_ref().map(|manager| manager.prefix_figures());
                DeploymentFigures {
                    name: entry.name,
                    ingress: entry.stats.snapshot(),
                    active_leases: lease_stats.as_ref().map(|s| s.active),
                    max_active_leases: lease_stats.as_ref().map(|_| {
                        u64::try_from(self.inner.settings.max_active_leases).unwrap_or(u64::MAX)
                    }),
                    router_tasks_ended: entry.tasks_ended,
                    leases_expired: entry.before.expired
                        + lease_stats.as_ref().map_or(0, |s| s.expired),
                    provisional_expired: entry.before.provisional_expired
                        + lease_stats.as_ref().map_or(0, |s| s.provisional_expired),
                    routes_cancelled: entry.before.routes_cancelled
                        + lease_stats.as_ref().map_or(0, |s| s.routes_cancelled),
                    catch_up: entry.catch_up.map(|c| CatchUpFigures {
                        done: c.is_caught_up(),
                        replayed: c.replayed(),
                        seconds: c.duration().as_secs_f64(),
                        truncated_events: c.truncated_events(),
                        stream: c.stream_figures(),
                        snapshots: c.snapshot_figures(),
                    }),
                    prefix,
                }
            })
            .collect();
        let connection = self.inner.connection.stats();
        HostFigures {
            deployments,
            hosted,
            live_tasks: self.live_tasks(),
            nats_connected: connection.is_connected(),
            nats_reconnects: connection.reconnects(),
            nats_disconnects: connection.disconnects(),
            slow_consumer_events: connection.slow_consumer_events(),
        }
    }
}

/// The ingress of a hosted deployment: core NATS, or durable on JetStream.
enum DeploymentIngress {
    Core(NatsIngress),
    Durable(JetStreamIngress),
}

/// Why a hosted deployment's ingress could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartDeploymentIngressError {
    /// The core NATS ingress could not start.
    #[error(transparent)]
    Core(#[from] StartIngressError),
    /// The JetStream ingress could not start.
    #[error(transparent)]
    Durable(#[from] StartDurableIngressError),
}

impl IngressStart for DeploymentIngress {
    type Error = StartDeploymentIngressError;

    async fn start(self, ctx: IngressContext) -> Result<Vec<RouterTask>, Self::Error> {
        Ok(match self {
            Self::Core(ingress) => ingress.start(ctx).await?,
            Self::Durable(ingress) => ingress.start(ctx).await?,
        })
    }
}

/// Ends a pending operation on drop, whatever happened: removes the pending slot if it is
/// still this operation's (a failed start, a finished stop, a panic) and wakes the waiters.
struct PendingGuard {
    inner: Arc<Inner>,
    name: DeploymentName,
    op: u64,
    done: CancellationToken,
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        {
            let mut state = self.inner.state.lock();
            if matches!(state.slots.get(&self.name), Some(Slot::Pending { op, .. }) if *op == self.op)
            {
                state.slots.remove(&self.name);
            }
        }
        self.done.cancel();
    }
}

async fn start(inner: Arc<Inner>, guard: PendingGuard) -> Result<AddOutcome, AddDeploymentError> {
    let name = guard.name.clone();
    let (stats, tracker) = {
        let mut state = inner.state.lock();
        let stats = state.records.entry(name.clone()).or_default().stats.clone();
        let tracker = match state.slots.get(&name) {
            Some(Slot::Pending { tracker, .. }) => tracker.clone(),
            _ => TaskTracker::new(),
        };
        (stats, tracker)
    };
    let settings = &inner.settings;
    let client = inner.connection.client().clone();
    let subjects = Subjects::new(settings.subject_prefix.clone(), name.clone());
    let (ingress, catch_up) = match &settings.durable {
        None => (
            DeploymentIngress::Core(NatsIngress::new(
                client,
                subjects,
                settings.apply.clone(),
                stats.clone(),
            )),
            None,
        ),
        Some(stream) => {
            let catch_up = Arc::new(CatchUpState::new());
            let ingress = JetStreamIngress::new(
                client,
                subjects,
                stream.clone(),
                settings.apply.clone(),
                stats.clone(),
                catch_up.clone(),
            );
            (DeploymentIngress::Durable(ingress), Some(catch_up))
        }
    };
    let config = RouterConfig::new(name.to_string())
        .with_lease(LeaseConfig {
            scan_interval: settings.lease_scan_interval,
            max_active_leases: settings.max_active_leases,
            provisional_deadline: settings.provisional_deadline,
            ..LeaseConfig::default()
        })
        .with_routing(crate::routing::RoutingConfig {
            policy: settings.route_policy,
            worker_idle: settings.worker_idle,
            affinity_gap: Some(settings.affinity_gap),
            ..Default::default()
        })
        .with_prefix(settings.prefix)
        .with_admission(settings.admission.clone());
    // Bounded for both modes: dropping an unfinished start cancels whatever it spawned.
    let waited = inner.connection.connect_deadline();
    let started = tokio::time::timeout(
        waited,
        Router::start_tracked(config, ingress, tracker.clone()),
    )
    .await;
    let started = match started {
        Ok(result) => result.map_err(|source| AddDeploymentError::Start {
            deployment: name.clone(),
            source,
        }),
        Err(_) => Err(AddDeploymentError::NatsTimeout {
            deployment: name.clone(),
            waited,
        }),
    };
    let router = match started {
        Ok(router) => router,
        Err(err) => {
            warn!(error = %err, "deployment not added");
            // Whatever the failed start spawned is cancelled; count it until it is gone.
            tracker.close();
            if !tracker.is_empty() {
                inner.state.lock().stragglers.push((name, tracker));
            }
            return Err(err);
        }
    };
    let running = Running {
        tasks_at_start: tracker.len(),
        router,
        tracker,
        stats,
        catch_up,
        started_at: Instant::now(),
    };
    inner
        .state
        .lock()
        .slots
        .insert(name, Slot::Running(Box::new(running)));
    info!("deployment added");
    drop(guard);
    Ok(AddOutcome::Created)
}

async fn stop(
    inner: Arc<Inner>,
    running: Running,
    guard: PendingGuard,
) -> Result<(), RemoveDeploymentError> {
    let name = guard.name.clone();
    let Running {
        router, tracker, ..
    } = running;
    tracker.close();
    let shutdown = router.shutdown().await;
    let waited = inner.settings.task_stop_timeout;
    let ended = tokio::time::timeout(waited, tracker.wait()).await.is_ok();
    if !ended {
        inner
            .state
            .lock()
            .stragglers
            .push((name.clone(), tracker.clone()));
    }
    drop(guard);
    match (shutdown, ended) {
        (Err(source), _) => {
            warn!(error = %source, "deployment removed, with failures");
            Err(RemoveDeploymentError::Shutdown {
                deployment: name,
                source,
            })
        }
        (Ok(()), false) => {
            let remaining = tracker.len();
            warn!(remaining, "deployment removed, but tasks are still running");
            Err(RemoveDeploymentError::TasksStillRunning {
                deployment: name,
                remaining,
                waited,
            })
        }
        (Ok(()), true) => {
            info!("deployment removed");
            Ok(())
        }
    }
}

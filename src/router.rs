//! The router of one deployment: it owns the scheduler, the lease manager and the ingress,
//! and wires them so that dropping it, or failing half-way through building it, leaves no
//! task and no lease behind.
//!
//! Ownership (an arrow is an `Arc` or a channel sender):
//!
//! ```text
//! Router ──> RequestLeaseManager ──> SchedulerBookingCleanup ──> scheduler channel
//!   │                 ^ (Weak only)
//!   ├──> SchedulerHandle ──> scheduler channel ──> scheduler task ──> weak observer
//!   ├──> CancellationToken (drop guard) ──> ingress tasks (and the reaper they run)
//!   └──> JoinHandles
//! ingress task ──> weak observer, WeakRequestLeaseManager, Reaper ··> manager (Weak)
//! ```
//!
//! Nothing points back at the router or, strongly, at the manager, so dropping the router
//! drops the manager, which drops the last sender, which ends the scheduler.
//!
//! Wiring is one pass: the scheduler's channel first, then the manager with its cleanup
//! handle, then the actor with the manager's weak observer, so no half-wired state exists.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;
use tracing::{debug, info, Instrument};

use crate::lease::{LeaseConfig, Reaper, RequestLeaseManager, WeakRequestLeaseManager};
use crate::observer::ReplicaRequestLeaseObserver;
use crate::prefix::PrefixIndexConfig;
use crate::scheduler::{Scheduler, SchedulerHandle};

/// How long [`Router::shutdown`] waits for the scheduler to see its last handle go.
const SCHEDULER_STOP_GRACE: Duration = Duration::from_secs(10);

/// An error a router task ended with.
pub type TaskError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A task an ingress started, for [`Router::shutdown`] to wait for.
pub struct RouterTask {
    /// The task's name, for logs and [`TaskFailure::task`].
    pub name: &'static str,
    /// The task itself; its error (or panic) is reported by [`Router::shutdown`].
    pub handle: JoinHandle<Result<(), TaskError>>,
}

/// What an ingress gets to work with. Nothing in it keeps the router's manager alive.
pub struct IngressContext {
    /// The router's deployment.
    pub deployment: Arc<str>,
    /// The weak observer, for events that name their attempt.
    pub observer: Arc<dyn ReplicaRequestLeaseObserver>,
    /// The manager, weakly: wire events (which carry no attempt id) are applied in batches
    /// through it, and a failed upgrade says the router is gone.
    pub manager: WeakRequestLeaseManager,
    /// The manager's scan cursor. The ingress must run it: between its units of work on the
    /// task that applies events ([`Reaper::tick`] in its `select!`, so ingest never waits on
    /// a lock a scan holds), or on a task of its own ([`Reaper::run`], as [`NoIngress`]
    /// does). Dropped unrun, no lease ever expires.
    pub reaper: Reaper,
    /// Cancelled when the router is dropped or shut down.
    pub cancel: CancellationToken,
    /// Spawn tasks here so the router's owner can see them end.
    pub tracker: TaskTracker,
}

/// The last step of building a router: whatever feeds it events.
pub trait IngressStart: Send {
    /// Why the ingress could not start.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Starts the ingress; the tasks returned are awaited by [`Router::shutdown`].
    fn start(
        self,
        ctx: IngressContext,
    ) -> impl Future<Output = Result<Vec<RouterTask>, Self::Error>> + Send;
}

/// No ingress: events are fed through [`Router::observer`] by the caller, and the reaper
/// runs on a task of its own.
pub struct NoIngress;

impl IngressStart for NoIngress {
    type Error = std::convert::Infallible;

    async fn start(self, ctx: IngressContext) -> Result<Vec<RouterTask>, Self::Error> {
        let span = tracing::info_span!("reaper", deployment = %ctx.deployment);
        let reaper = async move {
            ctx.reaper.run(ctx.cancel).await;
            Ok(())
        };
        Ok(vec![RouterTask {
            name: "reaper",
            handle: ctx.tracker.spawn(reaper.instrument(span)),
        }])
    }
}

/// Settings of one deployment's router: [`new`](Self::new), then the `with_*` methods.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    deployment: String,
    lease: LeaseConfig,
    routing: crate::routing::RoutingConfig,
    prefix: PrefixIndexConfig,
    admission: crate::admission::AdmissionConfig,
}

impl RouterConfig {
    /// Defaults for this deployment.
    pub fn new(deployment: impl Into<String>) -> Self {
        Self {
            deployment: deployment.into(),
            lease: LeaseConfig::default(),
            routing: Default::default(),
            prefix: PrefixIndexConfig::default(),
            admission: Default::default(),
        }
    }

    /// Sets the deployment's admission classes (default: none, no admission); checked when
    /// the router starts ([`StartRouterError::Admission`]), and changed later with
    /// [`SchedulerHandle::set_admission`](crate::SchedulerHandle::set_admission).
    pub fn with_admission(mut self, admission: crate::admission::AdmissionConfig) -> Self {
        self.admission = admission;
        self
    }

    /// The deployment's admission classes.
    pub fn admission(&self) -> &crate::admission::AdmissionConfig {
        &self.admission
    }

    /// Sets the prefix index's block size and bounds.
    pub fn with_prefix(mut self, prefix: PrefixIndexConfig) -> Self {
        self.prefix = prefix;
        self
    }

    /// The prefix index's block size and bounds.
    pub fn prefix(&self) -> PrefixIndexConfig {
        self.prefix
    }

    /// Sets the lease lifetimes, scan interval and limits.
    pub fn with_lease(mut self, lease: LeaseConfig) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the lease reaper's [`scan_interval`](LeaseConfig::scan_interval).
    pub fn with_scan_interval(mut self, interval: Duration) -> Self {
        self.lease.scan_interval = interval;
        self
    }

    /// Sets how route decisions pick a worker.
    pub fn with_routing(mut self, routing: crate::routing::RoutingConfig) -> Self {
        self.routing = routing;
        self
    }

    /// The deployment this router serves.
    pub fn deployment(&self) -> &str {
        &self.deployment
    }

    /// Lease lifetimes, scan interval and limits.
    pub fn lease(&self) -> &LeaseConfig {
        &self.lease
    }

    /// How route decisions pick a worker.
    pub fn routing(&self) -> crate::routing::RoutingConfig {
        self.routing
    }
}

/// Why a router could not be built. Whatever was started before the failure is torn down.
#[derive(Debug, thiserror::Error)]
pub enum StartRouterError {
    /// The ingress's [`IngressStart::start`] failed.
    #[error("deployment {deployment}: starting the ingress failed: {source}")]
    Ingress {
        /// The router's deployment.
        deployment: String,
        /// The ingress's error.
        #[source]
        source: TaskError,
    },
    /// The [`RouterConfig::with_admission`] classes were refused.
    #[error("deployment {deployment}: {source}")]
    Admission {
        /// The router's deployment.
        deployment: String,
        /// Why the classes were refused.
        #[source]
        source: crate::admission::ConfigureAdmissionError,
    },
}

/// One task that ended badly during [`Router::shutdown`].
#[derive(Debug)]
pub struct TaskFailure {
    /// The task's name (`"scheduler"` for the scheduler).
    pub task: &'static str,
    /// What it ended with: its error, its panic, or that it outlived the shutdown grace.
    pub error: String,
}

/// Tasks of a router that failed or panicked.
#[derive(Debug, thiserror::Error)]
#[error("deployment {deployment}: {} router task(s) failed: {}", failures.len(), describe(failures))]
pub struct ShutdownRouterError {
    /// The router's deployment.
    pub deployment: String,
    /// Every task that failed, in the order they were awaited.
    pub failures: Vec<TaskFailure>,
}

fn describe(failures: &[TaskFailure]) -> String {
    failures
        .iter()
        .map(|f| format!("{}: {}", f.task, f.error))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The router of one deployment. Dropping it cancels every task it started.
pub struct Router {
    deployment: Arc<str>,
    manager: RequestLeaseManager,
    scheduler: SchedulerHandle,
    observer: Arc<dyn ReplicaRequestLeaseObserver>,
    tracker: TaskTracker,
    cancel: CancellationToken,
    scheduler_task: JoinHandle<()>,
    ingress_tasks: Vec<RouterTask>,
    _cancel_on_drop: DropGuard,
}

impl Router {
    /// Builds a router: the scheduler's handle, the manager with its cleanup handle, the
    /// scheduler actor with the manager's weak observer, then `ingress`. If any step fails, everything started so far is torn down.
    ///
    /// # Errors
    /// [`StartRouterError`] naming the step that failed.
    pub async fn start<I: IngressStart>(
        config: RouterConfig,
        ingress: I,
    ) -> Result<Self, StartRouterError> {
        Self::start_tracked(config, ingress, TaskTracker::new()).await
    }

    /// Like [`Router::start`], spawning every task on `tracker`, so the caller can count the
    /// tasks and wait for them to end.
    pub async fn start_tracked<I: IngressStart>(
        config: RouterConfig,
        ingress: I,
        tracker: TaskTracker,
    ) -> Result<Self, StartRouterError> {
        Self::start_with(
            config,
            ingress,
            tracker,
            RequestLeaseManager::replica_observer,
        )
        .await
    }

    pub(crate) async fn start_with<I: IngressStart>(
        config: RouterConfig,
        ingress: I,
        tracker: TaskTracker,
        observer_for: impl FnOnce(&RequestLeaseManager) -> Arc<dyn ReplicaRequestLeaseObserver>,
    ) -> Result<Self, StartRouterError> {
        let deployment: Arc<str> = Arc::from(config.deployment.as_str());
        let cancel = CancellationToken::new();
        // Until construction succeeds, dropping this guard (on any early return) cancels
        // whatever was started.
        let guard = cancel.clone().drop_guard();

        let (scheduler, actor) = Scheduler::with_prefix(&deployment, config.prefix);
        scheduler
            .set_admission(config.admission)
            .map_err(|source| StartRouterError::Admission {
                deployment: deployment.to_string(),
                source,
            })?;
        let worker_idle = config.routing.worker_idle;
        let actor = actor
            .with_routing(config.routing)
            .with_worker_idle(worker_idle.unwrap_or(2 * config.lease.scan_interval));
        let manager = RequestLeaseManager::new(&deployment, config.lease, scheduler.cleanup());
        let scheduler_task = actor.spawn(Some(observer_for(&manager)), &tracker);
        let observer = manager.replica_observer();
        let ctx = IngressContext {
            deployment: deployment.clone(),
            observer: observer.clone(),
            manager: manager.downgrade(),
            reaper: manager.reaper(),
            cancel: cancel.child_token(),
            tracker: tracker.clone(),
        };
        let ingress_tasks =
            ingress
                .start(ctx)
                .await
                .map_err(|source| StartRouterError::Ingress {
                    deployment: deployment.to_string(),
                    source: Box::new(source),
                })?;
        info!(deployment = %deployment, "router started");
        // Success: the router itself now cancels on drop.
        let cancel = guard.disarm();
        Ok(Self {
            _cancel_on_drop: cancel.clone().drop_guard(),
            deployment,
            manager,
            scheduler,
            observer,
            tracker,
            cancel,
            scheduler_task,
            ingress_tasks,
        })
    }

    /// The deployment this router serves.
    pub fn deployment(&self) -> &str {
        &self.deployment
    }

    /// The router's lease manager.
    pub fn manager(&self) -> &RequestLeaseManager {
        &self.manager
    }

    /// A handle on the router's scheduler, for route decisions and its stats.
    pub fn scheduler(&self) -> &SchedulerHandle {
        &self.scheduler
    }

    /// The weak observer, for feeding events by hand.
    pub fn observer(&self) -> Arc<dyn ReplicaRequestLeaseObserver> {
        self.observer.clone()
    }

    /// The tracker every task of this router was spawned on.
    pub fn task_tracker(&self) -> TaskTracker {
        self.tracker.clone()
    }

    /// Fires when the router is dropped or shut down.
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.child_token()
    }

    /// Tears the router down and waits for every task: the ingress stops, the manager and
    /// scheduler handles go first, so whatever the ingress still hands over (events already
    /// buffered or in flight) reaches a dead observer and is counted as late, never applied.
    ///
    /// The scheduler ends once the last clone of the manager is gone; if a caller still
    /// holds one ten seconds on, that is reported as a failure rather than waited for.
    ///
    /// # Errors
    /// [`ShutdownRouterError`] listing every task that failed or panicked.
    pub async fn shutdown(self) -> Result<(), ShutdownRouterError> {
        let Router {
            deployment,
            manager,
            scheduler,
            observer,
            tracker: _,
            cancel,
            scheduler_task,
            ingress_tasks,
            _cancel_on_drop,
        } = self;
        cancel.cancel();
        drop((manager, scheduler, observer));
        let mut failures = Vec::new();
        let mut record = |task: &'static str, error: String| {
            failures.push(TaskFailure { task, error });
        };
        for task in ingress_tasks {
            match task.handle.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => record(task.name, e.to_string()),
                Err(e) => record(task.name, e.to_string()),
            }
        }
        match tokio::time::timeout(SCHEDULER_STOP_GRACE, scheduler_task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => record("scheduler", e.to_string()),
            Err(_) => record(
                "scheduler",
                format!(
                    "still running {SCHEDULER_STOP_GRACE:?} after shutdown: something still \
                     holds the lease manager or a scheduler handle"
                ),
            ),
        }
        debug!(deployment = %deployment, "router shut down");
        if failures.is_empty() {
            Ok(())
        } else {
            Err(ShutdownRouterError {
                deployment: deployment.to_string(),
                failures,
            })
        }
    }
}

#[cfg(test)]
mod tests;

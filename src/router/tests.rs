use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio_util::task::TaskTracker;

use super::*;
use crate::lease::{LeaseState, StrongRequestLeaseObserver, WeakRequestLeaseManager};
use crate::load::RequestLoad;
use crate::load::WorkerLoad;
use crate::observer::{AdmitOutcome, CompleteOutcome, DeliverEventError, ProgressOutcome};
use crate::routing::RouteRequest;
use crate::types::{DpRank, RequestId, SchedulerBookingDescriptor, WorkerId, WorkerWithDpRank};

const BOUND: Duration = Duration::from_secs(5);

/// A router whose manager and tasks a test can watch after the router is gone.
pub(crate) struct TrackedRouter {
    pub router: Router,
    pub manager: WeakRequestLeaseManager,
    pub tracker: TaskTracker,
}

impl TrackedRouter {
    async fn start(config: RouterConfig, strong: bool) -> Self {
        let tracker = TaskTracker::new();
        let router = if strong {
            Router::start_with(config, NoIngress, tracker.clone(), |m| {
                Arc::new(StrongRequestLeaseObserver(m.clone()))
            })
            .await
        } else {
            Router::start_tracked(config, NoIngress, tracker.clone()).await
        }
        .expect("router starts");
        Self {
            manager: router.manager().downgrade(),
            router,
            tracker,
        }
    }
}

pub(crate) async fn tracked_router(config: RouterConfig) -> TrackedRouter {
    TrackedRouter::start(config, false).await
}

/// True when every task on `tracker` (scheduler, reaper, ingress) ended within `bound`.
async fn tasks_end_within(tracker: &TaskTracker, bound: Duration) -> bool {
    tracker.close();
    tokio::time::timeout(bound, tracker.wait()).await.is_ok()
}

fn booking(id: &str, worker: u64, rank: u32) -> SchedulerBookingDescriptor {
    SchedulerBookingDescriptor::new(RequestId::from(id), WorkerWithDpRank::new(worker, rank))
}

fn load(bookings: u64, prompt: u64, output: u64) -> WorkerLoad {
    WorkerLoad {
        active_bookings: bookings,
        prompt_tokens: prompt,
        expected_output_tokens: output,
        // The observer's `progressed` carries no output count: still in prefill.
        prefill_tokens: prompt,
        kv_tokens: prompt,
        remaining_output_tokens: output,
    }
}

/// Drives admitted, progressed, completed through the router's observer, checking the lease
/// record and the scheduler's load after each step. Returns the observer and the booking.
async fn drive_lifecycle(
    tracked: &TrackedRouter,
) -> (
    Arc<dyn ReplicaRequestLeaseObserver>,
    SchedulerBookingDescriptor,
) {
    let router = &tracked.router;
    let manager = router.manager();
    let observer = router.observer();
    let b = booking("req-1", 7, 1);

    assert_eq!(
        observer.admitted(b.clone(), RequestLoad::new(128, Some(32))),
        Ok(AdmitOutcome::Registered)
    );
    let record = manager.lease(&b.request_id).expect("lease registered");
    assert_eq!(record.booking, b);
    assert_eq!(record.state, LeaseState::Touched);
    assert_eq!(
        router.scheduler().load(b.worker).await.unwrap(),
        load(1, 128, 32)
    );

    // A scan takes the lease to QUIET; progress renews it.
    manager.scan().await;
    assert_eq!(
        manager.lease(&b.request_id).unwrap().state,
        LeaseState::Quiet
    );
    assert_eq!(observer.progressed(&b), Ok(ProgressOutcome::Renewed));
    assert_eq!(
        manager.lease(&b.request_id).unwrap().state,
        LeaseState::Touched
    );
    assert_eq!(observer.progressed(&b), Ok(ProgressOutcome::Coalesced));
    assert_eq!(
        router.scheduler().load(b.worker).await.unwrap(),
        load(1, 128, 32)
    );

    assert_eq!(observer.completed(&b), Ok(CompleteOutcome::Released));
    assert!(manager.lease(&b.request_id).is_none());
    assert_eq!(
        router.scheduler().load(b.worker).await.unwrap(),
        WorkerLoad::default()
    );
    assert_eq!(router.scheduler().stats().released_completed, 1);
    (observer, b)
}

#[tokio::test]
async fn replica_observer_forwards_live_callbacks_without_retaining_manager() {
    let tracked = tracked_router(RouterConfig::new("observer")).await;
    let (observer, b) = drive_lifecycle(&tracked).await;
    let TrackedRouter {
        router,
        manager,
        tracker,
    } = tracked;

    drop(router);
    assert!(
        tasks_end_within(&tracker, BOUND).await,
        "scheduler and reaper must end once the router is dropped ({} still running)",
        tracker.len()
    );
    assert!(manager.upgrade().is_none(), "the manager must be released");

    // The dangling observer: no panic, nothing revived, every callback reports the manager
    // gone (which the ingress counts as a late drop).
    assert_eq!(
        observer.admitted(b.clone(), RequestLoad::new(1, None)),
        Err(DeliverEventError::ManagerGone)
    );
    assert_eq!(observer.progressed(&b), Err(DeliverEventError::ManagerGone));
    assert_eq!(observer.completed(&b), Err(DeliverEventError::ManagerGone));
    assert_eq!(
        observer.worker_reset(b.worker.worker_id, None),
        Err(DeliverEventError::ManagerGone)
    );
    assert!(manager.upgrade().is_none(), "nothing was revived");
}

/// Proves the test above can fail: an observer that owns the manager closes the ring
/// scheduler -> observer -> manager -> cleanup -> scheduler, and the router leaks.
#[tokio::test]
async fn strong_replica_observer_leaks_manager_and_scheduler() {
    let tracked = TrackedRouter::start(RouterConfig::new("strong"), true).await;
    let _ = drive_lifecycle(&tracked).await;
    let TrackedRouter {
        router,
        manager,
        tracker,
    } = tracked;

    drop(router);
    assert!(
        !tasks_end_within(&tracker, Duration::from_millis(300)).await,
        "with a strong observer the scheduler task cannot end"
    );
    assert!(
        manager.upgrade().is_some(),
        "with a strong observer the manager outlives its router"
    );
}

/// An ingress step that fails after it has started using the router: it admits a lease,
/// spawns a task that waits for cancellation, and hands its observer out to the test.
struct FailingIngress {
    observer_out: Arc<Mutex<Option<Arc<dyn ReplicaRequestLeaseObserver>>>>,
}

#[derive(Debug, thiserror::Error)]
#[error("subscription refused")]
struct IngressRefused;

impl IngressStart for FailingIngress {
    type Error = IngressRefused;

    async fn start(self, ctx: IngressContext) -> Result<Vec<RouterTask>, IngressRefused> {
        let outcome = ctx
            .observer
            .admitted(booking("half-built", 1, 0), RequestLoad::new(10, None));
        assert_eq!(outcome, Ok(AdmitOutcome::Registered));
        let cancel = ctx.cancel.clone();
        ctx.tracker.spawn(async move { cancel.cancelled().await });
        *self.observer_out.lock() = Some(ctx.observer);
        Err(IngressRefused)
    }
}

#[tokio::test]
async fn failed_router_construction_releases_scheduler_and_leases() {
    let tracker = TaskTracker::new();
    let observer_out = Arc::new(Mutex::new(None));
    let result = Router::start_tracked(
        RouterConfig::new("half-built"),
        FailingIngress {
            observer_out: observer_out.clone(),
        },
        tracker.clone(),
    )
    .await;
    let err = result.err().expect("construction fails");
    assert!(matches!(err, StartRouterError::Ingress { .. }), "{err}");
    assert!(err.to_string().contains("half-built"), "{err}");

    assert!(
        tasks_end_within(&tracker, BOUND).await,
        "no task may survive a failed construction ({} still running)",
        tracker.len()
    );
    let observer = observer_out.lock().take().expect("ingress ran");
    assert_eq!(
        observer.progressed(&booking("half-built", 1, 0)),
        Err(DeliverEventError::ManagerGone),
        "the manager and its lease must be gone"
    );
}

#[tokio::test(start_paused = true)]
async fn reaper_expires_untouched_lease_between_one_and_two_intervals() {
    let interval = Duration::from_secs(10);
    let tracked = tracked_router(RouterConfig::new("reaper").with_scan_interval(interval)).await;
    let router = &tracked.router;
    let observer = router.observer();
    let manager = router.manager();

    // Scans run at 10 s, 20 s, 30 s ... after start. Admit the silent lease at 3 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let silent = booking("silent", 1, 0);
    let busy = booking("busy", 2, 0);
    observer
        .admitted(silent.clone(), RequestLoad::new(10, None))
        .unwrap();
    observer
        .admitted(busy.clone(), RequestLoad::new(10, None))
        .unwrap();

    // Still alive just before two scans have passed (19.9 s: 16.9 s after its last touch).
    tokio::time::sleep(Duration::from_millis(16_900)).await;
    observer.progressed(&busy).unwrap();
    assert!(manager.lease(&silent.request_id).is_some());
    assert_eq!(
        router
            .scheduler()
            .load(silent.worker)
            .await
            .unwrap()
            .active_bookings,
        1
    );

    // Gone once the second scan is through (it starts at 20 s and spreads its shards over
    // at most a quarter interval).
    tokio::time::sleep(Duration::from_millis(100) + interval / 4).await;
    assert!(manager.lease(&silent.request_id).is_none(), "expired");
    assert_eq!(
        router.scheduler().load(silent.worker).await.unwrap(),
        WorkerLoad::default()
    );

    // The busy lease, touched every few seconds, survives many intervals.
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        observer.progressed(&busy).unwrap();
    }
    assert!(manager.lease(&busy.request_id).is_some());
    assert_eq!(
        router
            .scheduler()
            .load(busy.worker)
            .await
            .unwrap()
            .active_bookings,
        1
    );

    // The expiry released the booking exactly once; a late completion frees nothing more.
    assert_eq!(observer.completed(&silent), Ok(CompleteOutcome::Stale));
    let stats = router.scheduler().stats();
    assert_eq!(stats.released_expired, 1);
    assert_eq!(stats.released_completed, 0);
    assert_eq!(manager.stats().expired, 1);

    let TrackedRouter {
        router, tracker, ..
    } = tracked;
    drop(router);
    assert!(
        tasks_end_within(&tracker, BOUND).await,
        "the reaper ends with its router"
    );
}

#[tokio::test]
async fn late_completion_of_old_attempt_does_not_free_new_attempt() {
    let tracked = tracked_router(RouterConfig::new("fencing")).await;
    let router = &tracked.router;
    let observer = router.observer();
    let first = booking("reused", 1, 0);
    let second = booking("reused", 2, 0);
    assert_ne!(first.attempt_id, second.attempt_id);

    observer
        .admitted(first.clone(), RequestLoad::new(10, None))
        .unwrap();
    assert_eq!(
        observer.admitted(second.clone(), RequestLoad::new(20, None)),
        Ok(AdmitOutcome::Superseded)
    );
    assert_eq!(observer.completed(&first), Ok(CompleteOutcome::Stale));
    assert_eq!(observer.progressed(&first), Ok(ProgressOutcome::Stale));

    let lease = router
        .manager()
        .lease(&second.request_id)
        .expect("attempt 2 lives");
    assert_eq!(lease.booking, second);
    assert_eq!(
        router.scheduler().load(first.worker).await.unwrap(),
        WorkerLoad::default()
    );
    assert_eq!(
        router.scheduler().load(second.worker).await.unwrap(),
        load(1, 20, 0)
    );

    assert_eq!(observer.completed(&second), Ok(CompleteOutcome::Released));
    assert_eq!(
        router.scheduler().load(second.worker).await.unwrap(),
        WorkerLoad::default()
    );
}

#[tokio::test]
async fn duplicate_admit_is_a_touch() {
    let tracked = tracked_router(RouterConfig::new("dup")).await;
    let router = &tracked.router;
    let observer = router.observer();
    let b = booking("twice", 3, 0);
    observer
        .admitted(b.clone(), RequestLoad::new(10, None))
        .unwrap();
    router.manager().scan().await;
    assert_eq!(
        observer.admitted(b.clone(), RequestLoad::new(10, None)),
        Ok(AdmitOutcome::Duplicate)
    );
    assert_eq!(
        router.manager().lease(&b.request_id).unwrap().state,
        LeaseState::Touched
    );
    assert_eq!(
        router.scheduler().load(b.worker).await.unwrap(),
        load(1, 10, 0)
    );
}

#[tokio::test]
async fn worker_reset_drops_every_lease_of_that_worker() {
    let tracked = tracked_router(RouterConfig::new("reset")).await;
    let router = &tracked.router;
    let observer = router.observer();
    for (id, worker, rank) in [("a", 1, 0), ("b", 1, 1), ("c", 1, 1), ("d", 2, 0)] {
        observer
            .admitted(booking(id, worker, rank), RequestLoad::new(5, Some(5)))
            .unwrap();
    }
    assert_eq!(observer.worker_reset(WorkerId(1), Some(DpRank(1))), Ok(2));
    assert_eq!(router.manager().active_leases(), 2);
    assert_eq!(observer.worker_reset(WorkerId(1), None), Ok(1));
    assert_eq!(router.manager().active_leases(), 1);
    let loads = router.scheduler().loads().await.unwrap();
    for (worker, l) in loads {
        let expected = if worker.worker_id == WorkerId(2) {
            1
        } else {
            0
        };
        assert_eq!(l.active_bookings, expected, "{worker}");
    }
    assert_eq!(router.scheduler().stats().released_reset, 3);
}

#[tokio::test]
async fn a_route_decision_books_and_leases_through_the_observer() {
    let tracked = tracked_router(RouterConfig::new("local")).await;
    let router = &tracked.router;
    router
        .observer()
        .admitted(booking("seed", 4, 0), RequestLoad::new(1, None))
        .unwrap();
    let placed = router
        .scheduler()
        .route(RouteRequest::new("local-1", 7).with_expected_output_tokens(3))
        .await
        .unwrap()
        .booking;
    assert_eq!(placed.worker, WorkerWithDpRank::new(4, 0));
    let lease = router.manager().lease(&placed.request_id).expect("leased");
    assert_eq!(lease.booking, placed);
    // Counted once, although both the scheduler and the manager booked it.
    assert_eq!(
        router.scheduler().load(placed.worker).await.unwrap(),
        load(2, 8, 3)
    );
}

struct ErringIngress;

impl IngressStart for ErringIngress {
    type Error = std::convert::Infallible;

    async fn start(self, ctx: IngressContext) -> Result<Vec<RouterTask>, Self::Error> {
        let cancel = ctx.cancel.clone();
        let handle = ctx.tracker.spawn(async move {
            cancel.cancelled().await;
            Err::<(), TaskError>("drain failed".into())
        });
        Ok(vec![RouterTask {
            name: "ingress",
            handle,
        }])
    }
}

#[tokio::test]
async fn shutdown_waits_for_tasks_and_returns_their_errors() {
    let tracked = tracked_router(RouterConfig::new("clean")).await;
    let TrackedRouter {
        router,
        manager,
        tracker,
    } = tracked;
    router.shutdown().await.expect("clean shutdown");
    assert!(manager.upgrade().is_none());
    assert!(tasks_end_within(&tracker, Duration::from_millis(1)).await);

    let router = Router::start(RouterConfig::new("erring"), ErringIngress)
        .await
        .unwrap();
    let err = router.shutdown().await.expect_err("the ingress failed");
    assert_eq!(err.failures.len(), 1);
    assert_eq!(err.failures[0].task, "ingress");
    assert!(err.to_string().contains("drain failed"), "{err}");
}

#[tokio::test]
async fn a_lease_batch_hands_over_at_its_end_and_holds_the_manager_only_while_it_lives() {
    let tracked = tracked_router(RouterConfig::new("batch")).await;
    let router = &tracked.router;
    let worker = WorkerWithDpRank::new(3, 0);
    let mut batch = router.manager().batch();
    assert_eq!(
        batch.admit_current("b-1", worker, RequestLoad::new(5, Some(2))),
        AdmitOutcome::Registered
    );
    assert_eq!(
        batch.admit_current("b-1", worker, RequestLoad::new(5, Some(2))),
        AdmitOutcome::Duplicate,
        "a re-sent admission on the same worker renews the lease"
    );
    assert_eq!(
        batch.touch_current("b-1", worker),
        Some(ProgressOutcome::Coalesced)
    );
    assert_eq!(
        batch.admit_current("b-2", worker, RequestLoad::new(1, None)),
        AdmitOutcome::Registered
    );
    assert_eq!(
        batch.complete_current("b-2", worker),
        Some(CompleteOutcome::Released)
    );
    assert_eq!(batch.complete_current("b-2", worker), None);
    // The leases changed at once; counters and the scheduler wait for the batch's end.
    assert!(router.manager().lease(&RequestId::from("b-1")).is_some());
    assert_eq!(router.manager().stats().registered, 0);
    assert_eq!(
        router.scheduler().load(worker).await.unwrap(),
        WorkerLoad::default()
    );
    drop(batch);
    let stats = router.manager().stats();
    assert_eq!(
        (
            stats.registered,
            stats.duplicate_admits,
            stats.coalesced,
            stats.completed
        ),
        (2, 1, 1, 1)
    );
    assert_eq!(
        router.scheduler().load(worker).await.unwrap(),
        load(1, 5, 2)
    );

    // A batch still open when the router goes keeps the manager only until it ends.
    let batch = router.manager().batch();
    let TrackedRouter {
        router,
        manager,
        tracker,
    } = tracked;
    drop(router);
    assert!(manager.upgrade().is_some(), "held by the open batch");
    drop(batch);
    assert!(manager.upgrade().is_none());
    assert!(tasks_end_within(&tracker, BOUND).await);
}

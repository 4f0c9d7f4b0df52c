//! The load picture a router decides with, against a real nats-server: load by phase from the
//! events on the bus, worker membership, and the routing decision.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use lease_router::wire::{Admitted, ProgressStage, Progressed, WorkerReset};
use lease_router::IngressStats;
use lease_router::NatsConnection;
use lease_router::WorkerWithDpRank;
use lease_router::{ApplyConfig, NatsIngress};
use lease_router::{RoutePolicy, RouteRequest, RouteRequestError, RoutingConfig};
use lease_router::{Router, RouterConfig};
use lease_router::{SchedulerHandle, WorkerLoad};
use tokio_util::task::TaskTracker;

const NO_EXPIRY: Duration = Duration::from_secs(3600);

fn w(worker: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::new(worker, 0)
}

/// Waits until the scheduler shows `expected` for `worker`; the last load seen otherwise.
async fn wait_load(
    scheduler: &SchedulerHandle,
    worker: WorkerWithDpRank,
    expected: WorkerLoad,
) -> WorkerLoad {
    eventually(BOUND, || async {
        scheduler.load(worker).await.unwrap() == expected
    })
    .await;
    scheduler.load(worker).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_moves_by_phase_from_the_bus() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let h = router(&conn, "phases", NO_EXPIRY, ApplyConfig::default()).await;
    let scheduler = h.router.scheduler().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "phases", 1);

    let progressed = |otok| Progressed {
        stage: if otok == 0 {
            ProgressStage::PrefillDone
        } else {
            ProgressStage::Decoding
        },
        output_tokens: otok,
        ..progressed("r-1", 3)
    };
    // Progress that overtakes its admission is held, then applied with it.
    publisher.send(progressed(4)).await;
    publisher
        .send(Admitted {
            cached_tokens: Some(200),
            ..admitted("r-1", 3, 1000)
        })
        .await;
    publisher.send(admitted("r-2", 3, 300)).await;
    publisher.flush().await;
    let expected = WorkerLoad {
        active_bookings: 2,
        prompt_tokens: 1300,
        expected_output_tokens: 32,
        prefill_tokens: 300,
        kv_tokens: 1304,
        remaining_output_tokens: 12 + 16,
    };
    assert_eq!(wait_load(&scheduler, w(3), expected).await, expected);

    // Prefill done for r-2, output grows for r-1 (a late, lower count changes nothing).
    publisher.send(progressed(0).clone_for("r-2")).await;
    publisher.send(progressed(20)).await;
    publisher.send(progressed(9)).await;
    publisher.flush().await;
    let expected = WorkerLoad {
        prefill_tokens: 0,
        kv_tokens: 1320,
        remaining_output_tokens: 16,
        ..expected
    };
    assert_eq!(wait_load(&scheduler, w(3), expected).await, expected);

    publisher.send(completed("r-1", 3)).await;
    publisher.send(completed("r-2", 3)).await;
    publisher.flush().await;
    let zero = WorkerLoad::default();
    assert_eq!(wait_load(&scheduler, w(3), zero).await, zero);
    assert_eq!(h.router.manager().live_loads(), Vec::new());
}

trait CloneFor {
    fn clone_for(&self, request_id: &str) -> Self;
}

impl CloneFor for Progressed {
    fn clone_for(&self, request_id: &str) -> Self {
        Progressed {
            request_id: request_id.to_owned(),
            ..self.clone()
        }
    }
}

/// A router with `config`, fed from NATS.
async fn router_with(connection: &NatsConnection, config: RouterConfig) -> Harness {
    let stats = Arc::new(IngressStats::new());
    let tracker = TaskTracker::new();
    let ingress = NatsIngress::new(
        connection.client().clone(),
        subjects(config.deployment()),
        ApplyConfig::default(),
        stats.clone(),
    );
    let router = Router::start_tracked(config, ingress, tracker.clone())
        .await
        .expect("router starts");
    Harness {
        router,
        stats,
        tracker,
    }
}

fn reset(worker_id: u64, leaving: bool) -> WorkerReset {
    WorkerReset {
        worker_id,
        dp_rank: None,
        leaving,
    }
}

async fn members(scheduler: &SchedulerHandle) -> Vec<WorkerWithDpRank> {
    let loads = scheduler.loads().await.unwrap();
    loads.into_iter().map(|(w, _)| w).collect()
}

/// Waits until the members are `expected`; returns the members then.
async fn wait_members(
    scheduler: &SchedulerHandle,
    expected: &[WorkerWithDpRank],
) -> Vec<WorkerWithDpRank> {
    eventually(BOUND, || async { members(scheduler).await == expected }).await;
    members(scheduler).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_leaves_is_gone_until_it_publishes_again_and_a_restart_stays() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let h = router(&conn, "members", NO_EXPIRY, ApplyConfig::default()).await;
    let scheduler = h.router.scheduler().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "members", 1);

    publisher.send(reset(3, false)).await;
    publisher.send(admitted("a", 4, 100)).await;
    publisher.send(admitted("b", 5, 100)).await;
    publisher.flush().await;
    assert_eq!(
        wait_members(&scheduler, &[w(3), w(4), w(5)]).await,
        [w(3), w(4), w(5)]
    );

    // Leaving drops its lease and takes it out; a restart drops the lease and keeps it.
    publisher.send(reset(4, true)).await;
    publisher.send(reset(5, false)).await;
    publisher.flush().await;
    assert_eq!(wait_members(&scheduler, &[w(3), w(5)]).await, [w(3), w(5)]);
    assert_eq!(scheduler.load(w(4)).await.unwrap(), WorkerLoad::default());
    assert_eq!(scheduler.load(w(5)).await.unwrap(), WorkerLoad::default());
    assert_eq!(scheduler.stats().workers_left, 1);
    let workers = scheduler.workers().await.unwrap();
    assert!(workers.iter().all(|s| s.last_seen < BOUND), "{workers:?}");

    publisher.send(progressed("x", 4)).await;
    publisher.flush().await;
    assert_eq!(
        wait_members(&scheduler, &[w(3), w(4), w(5)]).await,
        [w(3), w(4), w(5)],
        "publishing again makes it a member again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provisional_booking_is_taken_over_released_or_expires() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let scan = Duration::from_millis(500);
    // Members stay while this test is slower than a lease lifetime between events.
    let config = RouterConfig::new("provisional")
        .with_scan_interval(scan)
        .with_routing(RoutingConfig::default().with_worker_idle(Duration::from_secs(3600)));
    let h = router_with(&conn, config).await;
    let scheduler = h.router.scheduler().clone();
    let manager = h.router.manager().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "provisional", 1);
    let set = |policy| RoutingConfig::default().with_policy(policy);
    scheduler
        .set_routing(set(RoutePolicy::RoundRobin))
        .await
        .unwrap();
    publisher.send(reset(3, false)).await;
    publisher.send(reset(4, false)).await;
    publisher.flush().await;
    assert_eq!(wait_members(&scheduler, &[w(3), w(4)]).await, [w(3), w(4)]);

    // Routed to 3 (round robin starts at the lowest), then taken over by its admission.
    let first = scheduler
        .route(RouteRequest::new("p-1", 1000).with_expected_output_tokens(50))
        .await
        .unwrap();
    assert_eq!(first.worker(), w(3));
    assert_eq!(
        scheduler.load(w(3)).await.unwrap().prefill_tokens,
        1000,
        "seen at once"
    );
    publisher
        .send(Admitted {
            cached_tokens: Some(600),
            ..admitted("p-1", 3, 900)
        })
        .await;
    // Routed to 4, then admitted on 3 instead: 4's booking is released.
    let second = scheduler
        .route(RouteRequest::new("p-2", 500))
        .await
        .unwrap();
    assert_eq!(second.worker(), w(4));
    publisher.send(admitted("p-2", 3, 70)).await;
    publisher.flush().await;
    let on_3 = WorkerLoad {
        active_bookings: 2,
        prompt_tokens: 970,
        expected_output_tokens: 32,
        prefill_tokens: 300 + 70,
        kv_tokens: 970,
        remaining_output_tokens: 32,
    };
    assert_eq!(
        wait_load(&scheduler, w(3), on_3).await,
        on_3,
        "taken over, counted once"
    );
    assert_eq!(
        scheduler.load(w(4)).await.unwrap(),
        WorkerLoad::default(),
        "released"
    );
    let stats = manager.stats();
    assert_eq!(
        (stats.provisional, stats.taken_over, stats.superseded),
        (2, 1, 1)
    );

    // One whose admission never comes expires like any lease.
    publisher.send(completed("p-1", 3)).await;
    publisher.send(completed("p-2", 3)).await;
    publisher.flush().await;
    let zero = WorkerLoad::default();
    assert_eq!(wait_load(&scheduler, w(3), zero).await, zero);
    let third = scheduler.route(RouteRequest::new("p-3", 10)).await.unwrap();
    assert_eq!(third.worker(), w(3));
    assert_eq!(scheduler.load(w(3)).await.unwrap().active_bookings, 1);
    assert_eq!(wait_load(&scheduler, w(3), zero).await, zero, "expired");
    assert_eq!(manager.stats().expired, 1);

    // A worker that left is never chosen, by any policy.
    publisher.send(reset(3, true)).await;
    publisher.flush().await;
    assert_eq!(wait_members(&scheduler, &[w(4)]).await, [w(4)]);
    for policy in RoutePolicy::ALL {
        scheduler.set_routing(set(policy)).await.unwrap();
        for i in 0..20 {
            let id = format!("{}-{i}", policy.as_str());
            let decision = scheduler.route(RouteRequest::new(id, 1)).await.unwrap();
            assert_eq!(decision.worker(), w(4), "{policy:?}");
        }
    }
    publisher.send(reset(4, true)).await;
    publisher.flush().await;
    assert_eq!(wait_members(&scheduler, &[]).await, []);
    assert_eq!(
        scheduler.route(RouteRequest::new("none", 1)).await,
        Err(RouteRequestError::NoWorkers)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_with_nothing_live_is_forgotten_and_one_with_a_lease_is_not() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let config = RouterConfig::new("idle")
        .with_scan_interval(NO_EXPIRY)
        .with_routing(RoutingConfig::default().with_worker_idle(Duration::from_millis(300)));
    let h = router_with(&conn, config).await;
    let scheduler = h.router.scheduler().clone();
    let mut publisher = RawPublisher::new(conn.client().clone(), "idle", 1);

    publisher.send(admitted("done", 3, 10)).await;
    publisher.send(completed("done", 3)).await;
    publisher.send(admitted("live", 4, 10)).await;
    publisher.flush().await;
    assert_eq!(wait_members(&scheduler, &[w(3), w(4)]).await, [w(3), w(4)]);
    // Queries keep coming (they run the idle sweep); worker 3 goes, worker 4 stays.
    assert_eq!(wait_members(&scheduler, &[w(4)]).await, [w(4)]);
    assert_eq!(scheduler.stats().workers_forgotten, 1);
    let decision = scheduler.route(RouteRequest::new("r", 5)).await.unwrap();
    assert_eq!(decision.worker(), w(4));

    publisher.send(admitted("back", 3, 10)).await;
    publisher.flush().await;
    assert_eq!(
        wait_members(&scheduler, &[w(3), w(4)]).await,
        [w(3), w(4)],
        "publishing again makes it a member again"
    );
}

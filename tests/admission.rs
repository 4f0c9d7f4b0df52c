//! Fleet-wide admission against a real nats-server: every replica of a deployment counts
//! each admission class's in-flight work from the workers' events on the bus, so replicas
//! fed by skewed ingress still agree on it.

mod common;

use std::sync::Arc;

use common::*;
use lease_router::wire::{Admitted, WorkerReset};
use lease_router::SchedulerHandle;
use lease_router::{AdmissionClass, AdmissionConfig, ClassLoad, IngressStats, NatsConnection};
use lease_router::{ApplyConfig, NatsIngress, RouteRequest, Router, RouterConfig};
use tokio_util::task::TaskTracker;

const DEPLOYMENT: &str = "adm";

fn classes() -> AdmissionConfig {
    AdmissionConfig::default()
        .with_class(AdmissionClass::new("premium", 1, 4.0))
        .with_class(AdmissionClass::new("regular", 0, 1.0))
        .with_default_class("regular")
}

/// One replica of the deployment, with the classes, over its own connection.
async fn replica(connection: &NatsConnection) -> (Router, TaskTracker) {
    let tracker = TaskTracker::new();
    let ingress = NatsIngress::new(
        connection.client().clone(),
        subjects(DEPLOYMENT),
        ApplyConfig::default(),
        Arc::new(IngressStats::new()),
    );
    let config = RouterConfig::new(DEPLOYMENT).with_admission(classes());
    let router = Router::start_tracked(config, ingress, tracker.clone())
        .await
        .expect("router starts");
    (router, tracker)
}

/// (class, requests, tokens) of each class, in the order of the classes.
async fn in_flight(scheduler: &SchedulerHandle) -> Vec<(String, u64, u64)> {
    let loads: Vec<ClassLoad> = scheduler.class_loads().await.unwrap();
    loads
        .into_iter()
        .map(|c| (c.class, c.in_flight_requests, c.in_flight_tokens))
        .collect()
}

/// Waits until both replicas show `expected`; their figures then.
async fn both_show(
    a: &SchedulerHandle,
    b: &SchedulerHandle,
    expected: &[(&str, u64, u64)],
) -> [Vec<(String, u64, u64)>; 2] {
    let expected: Vec<(String, u64, u64)> = expected
        .iter()
        .map(|(c, r, t)| (c.to_string(), *r, *t))
        .collect();
    eventually(BOUND, || async {
        in_flight(a).await == expected && in_flight(b).await == expected
    })
    .await;
    [in_flight(a).await, in_flight(b).await]
}

fn in_class(request_id: &str, worker_id: u64, class: Option<&str>) -> Admitted {
    Admitted {
        class: class.map(str::to_owned),
        ..admitted(request_id, worker_id, 100)
    }
}

/// Replica A routes all the premium requests, replica B the regular ones: each sees the
/// other's through the workers' `admitted` (with `cls`), so both count the whole fleet's
/// in-flight work per class, and both release it as the workers complete, leave or restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_count_every_class_of_the_fleet_alike() {
    let server = server().await;
    let (conn_a, conn_b, conn_w) = (
        client(&server.url()).await,
        client(&server.url()).await,
        client(&server.url()).await,
    );
    let (a, tracker_a) = replica(&conn_a).await;
    let (b, tracker_b) = replica(&conn_b).await;
    let (sa, sb) = (a.scheduler().clone(), b.scheduler().clone());
    let mut worker1 = RawPublisher::new(conn_w.client().clone(), DEPLOYMENT, 1);
    let mut worker2 = RawPublisher::new(conn_w.client().clone(), DEPLOYMENT, 2);
    // Both workers known to both replicas.
    worker1
        .send(WorkerReset {
            worker_id: 1,
            dp_rank: None,
            leaving: false,
        })
        .await;
    worker2
        .send(WorkerReset {
            worker_id: 2,
            dp_rank: None,
            leaving: false,
        })
        .await;
    worker1.flush().await;
    assert!(
        eventually(BOUND, || async {
            sa.loads().await.unwrap().len() == 2 && sb.loads().await.unwrap().len() == 2
        })
        .await
    );

    // Skewed ingress: four premium decisions on A, one regular on B.
    let mut placed = Vec::new();
    for i in 0..4 {
        let id = format!("p{i}");
        let decision = sa
            .route(
                RouteRequest::new(id.as_str(), 100)
                    .with_expected_output_tokens(16)
                    .with_class("premium"),
            )
            .await
            .unwrap();
        placed.push((id, decision.worker().worker_id.0, Some("premium")));
    }
    let decision = sb
        .route(
            RouteRequest::new("r0", 100)
                .with_expected_output_tokens(16)
                .with_class("regular"),
        )
        .await
        .unwrap();
    placed.push(("r0".into(), decision.worker().worker_id.0, Some("regular")));
    // This replica's own decisions count at once, before any admission.
    assert_eq!(in_flight(&sa).await[0], ("premium".into(), 4, 464));
    assert_eq!(in_flight(&sb).await[0], ("premium".into(), 0, 0));
    // And a request routed by neither replica, with no class: the default (regular).
    placed.push(("x0".into(), 2, None));
    for (id, worker, class) in &placed {
        let publisher = if *worker == 1 {
            &mut worker1
        } else {
            &mut worker2
        };
        publisher.send(in_class(id, *worker, *class)).await;
    }
    worker1.flush().await;
    let [seen_a, seen_b] = both_show(&sa, &sb, &[("premium", 4, 464), ("regular", 2, 232)]).await;
    assert_eq!(seen_a, seen_b);
    assert_eq!(seen_a[0], ("premium".to_owned(), 4, 464), "{seen_a:?}");

    // Two premium requests complete: both replicas release them.
    for (id, worker, _) in placed.iter().filter(|(id, ..)| id == "p0" || id == "p1") {
        let publisher = if *worker == 1 {
            &mut worker1
        } else {
            &mut worker2
        };
        publisher.send(completed(id, *worker)).await;
    }
    worker1.flush().await;
    let [seen_a, seen_b] = both_show(&sa, &sb, &[("premium", 2, 232), ("regular", 2, 232)]).await;
    assert_eq!(seen_a, seen_b);
    assert_eq!(seen_a[0].1, 2, "{seen_a:?}");

    // Every worker restarts: nothing of any class is left in flight.
    worker1
        .send(WorkerReset {
            worker_id: 1,
            dp_rank: None,
            leaving: false,
        })
        .await;
    worker2
        .send(WorkerReset {
            worker_id: 2,
            dp_rank: None,
            leaving: true,
        })
        .await;
    worker1.flush().await;
    let [seen_a, seen_b] = both_show(&sa, &sb, &[("premium", 0, 0), ("regular", 0, 0)]).await;
    assert_eq!(seen_a, seen_b);
    assert_eq!(seen_a[1], ("regular".to_owned(), 0, 0), "{seen_a:?}");

    drop((sa, sb));
    for (router, tracker) in [(a, tracker_a), (b, tracker_b)] {
        router.shutdown().await.expect("clean shutdown");
        tracker.close();
        tracker.wait().await;
    }
}

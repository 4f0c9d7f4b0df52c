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
use lease_router::{QueueConfig, RouteRequestError, SaturationConfig};
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
    replica_of(connection, DEPLOYMENT, classes()).await
}

/// One replica of `deployment` with `admission`, over its own connection.
async fn replica_of(
    connection: &NatsConnection,
    deployment: &str,
    admission: AdmissionConfig,
) -> (Router, TaskTracker) {
    let tracker = TaskTracker::new();
    let ingress = NatsIngress::new(
        connection.client().clone(),
        subjects(deployment),
        ApplyConfig::default(),
        Arc::new(IngressStats::new()),
    );
    let config = RouterConfig::new(deployment).with_admission(admission);
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

/// Premium 4 and regular 1 in one band, saturated past 150 prefill tokens waiting per worker
/// (a room of 300 on two workers: premium's part 240, regular's 60), refusing at once
/// whatever may not go.
fn strict() -> AdmissionConfig {
    AdmissionConfig::default()
        .with_class(AdmissionClass::new("premium", 0, 4.0))
        .with_class(AdmissionClass::new("regular", 0, 1.0))
        .with_default_class("regular")
        .with_saturation(SaturationConfig::default().with_max_prefill_tokens_per_worker(150))
        .with_queue(QueueConfig::default().with_max_queued(0))
}

/// Rounds before [`offer`] counts: the fleet fills to its saturation threshold first.
const WARM_ROUNDS: usize = 10;

/// Offers `rounds` premium requests to the first replica and as many regular ones to the
/// second, alternating, 100 prompt tokens each; each routed one is admitted by its worker on
/// its replica's deployment. After each round the oldest request in flight anywhere
/// completes: the fleet finishes one request's prefill while two are offered, an overload
/// of 2x. Each decision waits until each replica sees what it can: with `shared`, both
/// replicas see every request (one deployment); without, each sees its own only. Returns
/// the requests routed per class (premium, regular) after [`WARM_ROUNDS`].
async fn offer(
    rounds: usize,
    replicas: [(&SchedulerHandle, &mut RawPublisher); 2],
    shared: bool,
) -> (u64, u64) {
    let [(premium_to, premium_pub), (regular_to, regular_pub)] = replicas;
    let publishers = [premium_pub, regular_pub];
    let schedulers = [premium_to, regular_to];
    let mut routed = [0u64; 2];
    // (request, worker, which replica routed it), oldest first.
    let mut live: std::collections::VecDeque<(String, u64, usize)> = Default::default();
    let settled = |live: &std::collections::VecDeque<(String, u64, usize)>| {
        let seen: Vec<u64> = (0..2)
            .map(|k| live.iter().filter(|(_, _, by)| shared || *by == k).count() as u64)
            .collect();
        let schedulers = schedulers.map(Clone::clone);
        async move {
            for (k, scheduler) in schedulers.iter().enumerate() {
                let total = || async {
                    in_flight(scheduler)
                        .await
                        .iter()
                        .map(|(_, r, _)| r)
                        .sum::<u64>()
                        == seen[k]
                };
                assert!(
                    eventually(BOUND, total).await,
                    "replica {k} sees {}",
                    seen[k]
                );
            }
        }
    };
    for i in 0..rounds {
        for (k, class) in ["premium", "regular"].into_iter().enumerate() {
            let id = format!("{class}-{i}");
            let request = RouteRequest::new(id.as_str(), 100)
                .with_expected_output_tokens(16)
                .with_class(class);
            match schedulers[k].route(request).await {
                Ok(decision) => {
                    if i >= WARM_ROUNDS {
                        routed[k] += 1;
                    }
                    let worker = decision.worker().worker_id.0;
                    publishers[k].send(in_class(&id, worker, Some(class))).await;
                    publishers[k].flush().await;
                    live.push_back((id, worker, k));
                    settled(&live).await;
                }
                Err(RouteRequestError::Overloaded { .. }) => {}
                Err(other) => panic!("{id}: {other}"),
            }
        }
        if let Some((id, worker, k)) = live.pop_front() {
            publishers[k].send(completed(&id, worker)).await;
            publishers[k].flush().await;
            settled(&live).await;
        }
    }
    (routed[0], routed[1])
}

/// Premium (weight 4) through one replica only, regular (1) through the other, offered
/// twice what the fleet completes: replicas sharing the bus admit them 4:1 fleet-wide once
/// saturated, and what waits for prefill stays at the threshold; replicas that each count
/// only their own decisions (each sees the admissions of its own requests only) admit 1:1,
/// each class alone taking all of its replica's room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_the_bus_hold_the_shares_where_isolated_ones_do_not() {
    let server = server().await;
    let conn: Vec<NatsConnection> = vec![
        client(&server.url()).await,
        client(&server.url()).await,
        client(&server.url()).await,
        client(&server.url()).await,
        client(&server.url()).await,
    ];
    let (a, ta) = replica_of(&conn[0], "shared", strict()).await;
    let (b, tb) = replica_of(&conn[1], "shared", strict()).await;
    let (c, tc) = replica_of(&conn[2], "alone-a", strict()).await;
    let (d, td) = replica_of(&conn[3], "alone-b", strict()).await;
    let workers = conn[4].client().clone();
    let mut shared = RawPublisher::new(workers.clone(), "shared", 1);
    let mut shared_too = RawPublisher::new(workers.clone(), "shared", 2);
    let mut alone_a = RawPublisher::new(workers.clone(), "alone-a", 3);
    let mut alone_b = RawPublisher::new(workers.clone(), "alone-b", 4);
    let (sa, sb, sc, sd) = (
        a.scheduler().clone(),
        b.scheduler().clone(),
        c.scheduler().clone(),
        d.scheduler().clone(),
    );
    for publisher in [&mut shared, &mut alone_a, &mut alone_b] {
        for worker_id in [1, 2] {
            publisher
                .send(WorkerReset {
                    worker_id,
                    dp_rank: None,
                    leaving: false,
                })
                .await;
        }
        publisher.flush().await;
    }
    for s in [&sa, &sb, &sc, &sd] {
        assert!(eventually(BOUND, || async { s.loads().await.unwrap().len() == 2 }).await);
    }

    let rounds = WARM_ROUNDS + 20;
    let fleet = offer(rounds, [(&sa, &mut shared), (&sb, &mut shared_too)], true).await;
    let isolated = offer(rounds, [(&sc, &mut alone_a), (&sd, &mut alone_b)], false).await;
    let share = |(premium, regular): (u64, u64)| premium as f64 / (premium + regular) as f64;
    let error = |routed| (share(routed) - 0.8f64).abs() / 0.8;
    eprintln!(
        "routed premium:regular, shared bus {fleet:?} (fair_share_error={:.3}), isolated \
         {isolated:?} (fair_share_error={:.3})",
        error(fleet),
        error(isolated)
    );
    assert_eq!(fleet, (16, 4), "the shares, fleet-wide");
    assert!(error(fleet) <= 0.05);
    assert_eq!(
        isolated,
        (10, 10),
        "each replica alone sees only its own class"
    );
    assert!(error(isolated) > 0.3);
    assert_eq!(in_flight(&sa).await, in_flight(&sb).await);
    // Bounded: no more waits for prefill than the room (150 tokens on each of two workers)
    // and the one request that crossed it.
    let requests: u64 = in_flight(&sa).await.iter().map(|(_, r, _)| r).sum();
    assert!(
        requests <= 4,
        "{requests} in flight, 100 prompt tokens each"
    );
    // What each replica's admission did is its own: A was asked only premium requests, B
    // only regular ones (none waited: the queue holds none).
    let decided = |scheduler: &SchedulerHandle| {
        let scheduler = scheduler.clone();
        async move {
            let loads = scheduler.class_loads().await.unwrap();
            loads
                .iter()
                .map(|c| {
                    let a = &c.admission;
                    (c.class.clone(), a.admitted, a.refused, a.queued)
                })
                .collect::<Vec<_>>()
        }
    };
    let class = |name: &str, admitted, refused| (name.to_owned(), admitted, refused, 0);
    assert_eq!(
        decided(&sa).await,
        [class("premium", 25, 5), class("regular", 0, 0)]
    );
    assert_eq!(
        decided(&sb).await,
        [class("premium", 0, 0), class("regular", 8, 22)]
    );

    drop((sa, sb, sc, sd));
    for (router, tracker) in [(a, ta), (b, tb), (c, tc), (d, td)] {
        router.shutdown().await.expect("clean shutdown");
        tracker.close();
        tracker.wait().await;
    }
}

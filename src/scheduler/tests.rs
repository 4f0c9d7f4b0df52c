use std::time::Duration;

use tokio_util::task::TaskTracker;

use super::*;
use crate::load::RequestLoad;
use crate::CostWeights;

/// Operations of bookings without an admission class.
const NO_CLASS: ClassId = ClassId(0);

fn worker(id: u64) -> WorkerWithDpRank {
    WorkerWithDpRank::new(id, 0)
}

fn weight(prompt: u32, output: Option<u32>) -> BookingWeight {
    RequestLoad::new(prompt, output).into()
}

fn submit(cleanup: &SchedulerBookingCleanup, ops: &[Op]) {
    cleanup.submit(&mut ops.to_vec());
}

#[tokio::test]
async fn bookings_and_releases_move_worker_load() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor.spawn(None, &tracker);
    let cleanup = handle.cleanup();
    let a = weight(100, Some(10));
    submit(
        &cleanup,
        &[
            Op::Book(NO_CLASS, worker(1), a),
            Op::Book(NO_CLASS, worker(2), weight(5, None)),
        ],
    );
    assert_eq!(
        handle.load(worker(1)).await.unwrap(),
        WorkerLoad {
            active_bookings: 1,
            prompt_tokens: 100,
            expected_output_tokens: 10,
            prefill_tokens: 100,
            kv_tokens: 100,
            remaining_output_tokens: 10,
        }
    );
    assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, worker(2));
    submit(
        &cleanup,
        &[Op::Release(
            NO_CLASS,
            worker(1),
            a,
            ReleaseReason::Completed,
        )],
    );
    assert_eq!(handle.load(worker(1)).await.unwrap(), WorkerLoad::default());
    assert_eq!(handle.load(worker(2)).await.unwrap().active_bookings, 1);
    let stats = handle.stats();
    assert_eq!((stats.booked, stats.released_completed), (2, 1));
}

#[tokio::test]
async fn a_release_that_overtakes_its_booking_still_adds_up() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor.spawn(None, &tracker);
    let cleanup = handle.cleanup();
    let w = weight(30, Some(7));
    submit(
        &cleanup,
        &[Op::Release(NO_CLASS, worker(1), w, ReleaseReason::Expired)],
    );
    // Briefly below zero: shown as zero, not as a huge unsigned number.
    assert_eq!(handle.load(worker(1)).await.unwrap(), WorkerLoad::default());
    submit(
        &cleanup,
        &[
            Op::Book(NO_CLASS, worker(1), weight(5, None)),
            Op::Book(NO_CLASS, worker(1), w),
        ],
    );
    assert_eq!(
        handle.load(worker(1)).await.unwrap(),
        WorkerLoad {
            active_bookings: 1,
            prompt_tokens: 5,
            expected_output_tokens: 0,
            prefill_tokens: 5,
            kv_tokens: 5,
            remaining_output_tokens: 0,
        }
    );
}

#[tokio::test(flavor = "current_thread")]
async fn bursts_of_releases_merge_into_one_wakeup() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor.spawn(None, &tracker);
    let cleanup = handle.cleanup();
    let w = weight(1, None);
    for i in 0..1000 {
        submit(&cleanup, &[Op::Book(NO_CLASS, worker(i % 8), w)]);
    }
    handle.loads().await.unwrap();
    let before = handle.stats().wakeups;
    // On one thread the actor cannot run between these calls: one burst.
    for i in 0..1000 {
        submit(
            &cleanup,
            &[Op::Release(
                NO_CLASS,
                worker(i % 8),
                w,
                ReleaseReason::Completed,
            )],
        );
    }
    let loads = handle.loads().await.unwrap();
    assert!(loads.iter().all(|(_, l)| l.active_bookings == 0));
    assert_eq!(handle.stats().wakeups - before, 1);
    assert_eq!(handle.stats().released_completed, 1000);
}

#[tokio::test(flavor = "current_thread")]
async fn a_few_operations_wait_for_a_query_and_many_wake_the_actor() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor.spawn(None, &tracker);
    let cleanup = handle.cleanup();
    let w = weight(1, None);
    submit(&cleanup, &[Op::Book(NO_CLASS, worker(1), w); 10]);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(handle.stats().wakeups, 0, "nothing woke the actor yet");
    assert_eq!(handle.load(worker(1)).await.unwrap().active_bookings, 10);
    assert_eq!(
        handle.stats().wakeups,
        1,
        "the query applied the inbox first"
    );

    submit(&cleanup, &vec![Op::Book(NO_CLASS, worker(1), w); WAKE_AT]);
    tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while handle.stats().booked < 10 + WAKE_AT as u64 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("a full inbox wakes the actor without a query");
}

#[tokio::test]
async fn actor_ends_when_every_handle_is_gone() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    let task = actor.spawn(None, &tracker);
    let cleanup = handle.cleanup();
    drop(handle);
    assert!(!task.is_finished());
    drop(cleanup);
    tokio::time::timeout(std::time::Duration::from_secs(5), task)
        .await
        .expect("scheduler ended")
        .unwrap();
}

fn members(loads: &[(WorkerWithDpRank, WorkerLoad)]) -> Vec<WorkerWithDpRank> {
    loads.iter().map(|(w, _)| *w).collect()
}

#[tokio::test]
async fn a_worker_that_leaves_is_no_member_until_it_speaks_again() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor.spawn(None, &tracker);
    let cleanup = handle.cleanup();
    let w = weight(10, None);
    let leave = |worker_id, dp_rank| Op::Membership {
        worker_id: WorkerId(worker_id),
        dp_rank,
        leaving: true,
    };
    let a = WorkerWithDpRank::new(1, 0);
    let b = WorkerWithDpRank::new(1, 1);
    submit(
        &cleanup,
        &[
            Op::Seen(a),
            Op::Seen(b),
            Op::Book(NO_CLASS, worker(2), w),
            Op::Book(NO_CLASS, a, w),
        ],
    );
    assert_eq!(
        members(&handle.loads().await.unwrap()),
        vec![a, b, worker(2)]
    );
    // Its release comes after the leave (the reaper's, say): the worker stays gone, and
    // its sums come back to zero.
    submit(&cleanup, &[leave(1, None)]);
    assert_eq!(members(&handle.loads().await.unwrap()), vec![worker(2)]);
    assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, worker(2));
    assert_eq!(handle.load(a).await.unwrap().active_bookings, 1);
    submit(
        &cleanup,
        &[Op::Release(NO_CLASS, a, w, ReleaseReason::Expired)],
    );
    assert_eq!(handle.load(a).await.unwrap(), WorkerLoad::default());
    assert_eq!(members(&handle.loads().await.unwrap()), vec![worker(2)]);
    assert_eq!(handle.stats().workers_left, 2);
    // Speaking again makes it a member again; a restart of an unknown worker makes one.
    submit(
        &cleanup,
        &[
            Op::Seen(b),
            Op::Membership {
                worker_id: WorkerId(5),
                dp_rank: None,
                leaving: false,
            },
        ],
    );
    assert_eq!(
        members(&handle.loads().await.unwrap()),
        vec![b, worker(2), worker(5)]
    );
    // One rank leaving leaves the others.
    submit(&cleanup, &[Op::Seen(a), leave(1, Some(DpRank(1)))]);
    assert_eq!(
        members(&handle.loads().await.unwrap()),
        vec![a, worker(2), worker(5)]
    );
}

#[tokio::test]
async fn operations_of_a_worker_that_spoke_refresh_it_and_the_others_do_not() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor.spawn(None, &tracker);
    let cleanup = handle.cleanup();
    let w = weight(10, None);
    let mut moved = w;
    moved.prefill_tokens = 0;
    let spoke = [
        Op::Admitted(NO_CLASS, worker(1), w),
        Op::Shift(NO_CLASS, worker(2), w, moved),
        Op::Release(NO_CLASS, worker(3), w, ReleaseReason::Completed),
        Op::Seen(worker(4)),
    ];
    let silent = [
        Op::Release(NO_CLASS, worker(5), w, ReleaseReason::Expired),
        Op::Release(NO_CLASS, worker(6), w, ReleaseReason::Superseded),
    ];
    submit(&cleanup, &spoke);
    submit(&cleanup, &silent);
    let members: Vec<_> = handle
        .workers()
        .await
        .unwrap()
        .iter()
        .map(|s| s.worker)
        .collect();
    assert_eq!(members, [1, 2, 3, 4].map(worker));
    tokio::time::sleep(Duration::from_millis(50)).await;
    submit(
        &cleanup,
        &[Op::Release(NO_CLASS, worker(1), w, ReleaseReason::Expired)],
    );
    submit(&cleanup, &[Op::Shift(NO_CLASS, worker(2), moved, w)]);
    let ages: Vec<_> = handle
        .workers()
        .await
        .unwrap()
        .iter()
        .map(|s| s.last_seen)
        .collect();
    assert!(
        ages[0] >= Duration::from_millis(50),
        "an expiry is not the worker: {ages:?}"
    );
    assert!(ages[1] < Duration::from_millis(50), "a shift is: {ages:?}");
}

#[tokio::test]
async fn an_idle_worker_is_forgotten_but_not_one_with_a_live_booking() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    let idle = Duration::from_millis(200);
    actor.with_worker_idle(idle).spawn(None, &tracker);
    let cleanup = handle.cleanup();
    submit(
        &cleanup,
        &[
            Op::Seen(worker(1)),
            Op::Seen(worker(2)),
            Op::Book(NO_CLASS, worker(3), weight(1, None)),
        ],
    );
    let workers = handle.workers().await.unwrap();
    assert_eq!(workers.len(), 3);
    assert!(workers.iter().all(|w| w.last_seen < idle), "{workers:?}");
    tokio::time::sleep(idle / 2).await;
    submit(&cleanup, &[Op::Seen(worker(2))]);
    let workers = handle.workers().await.unwrap();
    assert!(workers[0].last_seen >= idle / 2, "{workers:?}");
    assert!(workers[1].last_seen < idle / 2, "{workers:?}");
    tokio::time::sleep(idle * 3 / 4).await;
    handle.loads().await.unwrap();
    tokio::time::sleep(idle / 2).await;
    // Workers 1 and 2 have been silent longer than the idle time; worker 3 is booked.
    let left: Vec<_> = handle
        .workers()
        .await
        .unwrap()
        .iter()
        .map(|w| w.worker)
        .collect();
    assert_eq!(left, vec![worker(3)]);
    assert_eq!(handle.stats().workers_forgotten, 2);
}

async fn routed(policy: RoutePolicy, members: &[WorkerWithDpRank]) -> SchedulerHandle {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    // Equal weights keep the expected costs below easy to follow.
    actor
        .with_routing(RoutingConfig {
            policy,
            weights: CostWeights {
                prefill: 1.0,
                kv: 1.0,
            },
            ..RoutingConfig::default()
        })
        .spawn(None, &tracker);
    let seen: Vec<_> = members.iter().map(|w| Op::Seen(*w)).collect();
    submit(&handle.cleanup(), &seen);
    handle
}

fn request(id: &str, prompt: u32) -> RouteRequest {
    RouteRequest::new(id, prompt)
}

#[tokio::test]
async fn weighted_cost_takes_the_cheapest_and_sees_its_own_bookings_at_once() {
    let handle = routed(
        RoutePolicy::WeightedCost,
        &[worker(1), worker(2), worker(3)],
    )
    .await;
    let cleanup = handle.cleanup();
    // Worker 1 holds much KV, worker 2 has prefill waiting, worker 3 a little of both.
    submit(
        &cleanup,
        &[
            Op::Book(NO_CLASS, worker(1), weight(1000, None)),
            Op::Shift(NO_CLASS, worker(1), weight(1000, None), {
                let mut w = weight(1000, None);
                w.prefill_tokens = 0;
                w.kv_tokens = 5000;
                w
            }),
            Op::Book(NO_CLASS, worker(2), weight(3000, None)),
            Op::Book(NO_CLASS, worker(3), weight(100, None)),
        ],
    );
    let decision = handle.route(request("a", 1000)).await.unwrap();
    assert_eq!(decision.worker(), worker(3));
    assert_eq!(decision.policy, RoutePolicy::WeightedCost);
    let costs: Vec<_> = decision
        .candidates
        .iter()
        .map(|c| (c.worker, c.cost))
        .collect();
    // prefill + kv, the request's own 1000 + 1000 included.
    assert_eq!(
        costs,
        vec![
            (worker(3), 100.0 + 100.0 + 2000.0),
            (worker(1), 0.0 + 5000.0 + 2000.0),
            (worker(2), 3000.0 + 3000.0 + 2000.0)
        ]
    );
    // Booked at once: worker 3 now costs 2200 + 2000 more, so the next goes elsewhere
    // only when that makes it dearer than worker 1.
    assert_eq!(handle.load(worker(3)).await.unwrap().active_bookings, 2);
    let next = handle.route(request("b", 2000)).await.unwrap();
    assert_eq!(next.worker(), worker(3), "1100 + 1100 + 4000 < 5000 + 4000");
    let next = handle.route(request("c", 2000)).await.unwrap();
    assert_eq!(next.worker(), worker(1), "3100 + 3100 + 4000 > 5000 + 4000");
    let stats = handle.stats();
    assert_eq!(
        stats.decisions(RoutePolicy::WeightedCost, RouteOutcome::Routed),
        3
    );
}

#[tokio::test]
async fn every_decision_the_actor_makes_is_timed_and_no_other() {
    let handle = routed(RoutePolicy::WeightedCost, &[worker(1)]).await;
    let before = handle.decision_times();
    assert_eq!(before.count, 0);
    handle.route(request("a", 100)).await.unwrap();
    handle.route(request("b", 100)).await.unwrap();
    // Refused before the actor (no request id): counted as invalid, not timed.
    assert!(handle.route(request("", 100)).await.is_err());
    handle.loads().await.unwrap();
    let times = handle.decision_times();
    assert_eq!(
        times.count, 2,
        "two decisions, not the invalid one nor the query"
    );
    assert_eq!(
        times.buckets.last().map(|(_, n)| *n),
        Some(2),
        "both under 100 ms"
    );
    // A scheduler with no member decides too (no workers), and is timed.
    let empty = routed(RoutePolicy::WeightedCost, &[]).await;
    assert!(empty.route(request("d", 100)).await.is_err());
    assert_eq!(empty.decision_times().count, 1);
    assert_eq!(
        empty
            .stats()
            .decisions(RoutePolicy::WeightedCost, RouteOutcome::NoWorkers),
        1
    );
}

#[tokio::test]
async fn weighted_cost_reports_the_cheapest_few_in_order() {
    let members: Vec<_> = (0..30).map(worker).collect();
    let handle = routed(RoutePolicy::WeightedCost, &members).await;
    // Loads in a scrambled order: worker i carries (i * 7 mod 30) * 10 prompt tokens.
    let books: Vec<_> = (0..30)
        .map(|i| Op::Book(NO_CLASS, worker(i), weight((i as u32 * 7 % 30) * 10, None)))
        .collect();
    submit(&handle.cleanup(), &books);
    let decision = handle.route(request("a", 1)).await.unwrap();
    let mut expected: Vec<_> = (0..30u64)
        .map(|i| ((i * 7 % 30) * 20 + 2, worker(i)))
        .collect();
    expected.sort();
    let got: Vec<_> = decision
        .candidates
        .iter()
        .map(|c| (c.cost as u64, c.worker))
        .collect();
    assert_eq!(
        got,
        expected[..crate::routing::REPORTED_CANDIDATES].to_vec()
    );
    assert_eq!(decision.worker(), worker(0));
}

#[tokio::test]
async fn power_of_two_never_takes_the_dearest_and_spreads_over_the_rest() {
    let members: Vec<_> = (0..6).map(worker).collect();
    let handle = routed(RoutePolicy::PowerOfTwo, &members).await;
    submit(
        &handle.cleanup(),
        &[Op::Book(NO_CLASS, worker(5), weight(1_000_000, None))],
    );
    let mut chosen = std::collections::BTreeSet::new();
    for i in 0..200 {
        let decision = handle.route(request(&format!("r{i}"), 10)).await.unwrap();
        assert_eq!(decision.candidates.len(), 2);
        assert!(decision.candidates[0].cost <= decision.candidates[1].cost);
        assert_eq!(decision.worker(), decision.candidates[0].worker);
        chosen.insert(decision.worker());
    }
    assert!(
        !chosen.contains(&worker(5)),
        "the lower of two is never the dearest"
    );
    assert_eq!(chosen.len(), 5, "{chosen:?}");
}

#[tokio::test]
async fn round_robin_takes_members_in_turn_and_random_only_members() {
    let handle = routed(RoutePolicy::RoundRobin, &[worker(1), worker(2), worker(3)]).await;
    let mut turns = Vec::new();
    for i in 0..6 {
        turns.push(
            handle
                .route(request(&format!("r{i}"), 1))
                .await
                .unwrap()
                .worker(),
        );
    }
    assert_eq!(turns, [1, 2, 3, 1, 2, 3].map(worker));

    let leave = Op::Membership {
        worker_id: WorkerId(2),
        dp_rank: None,
        leaving: true,
    };
    submit(&handle.cleanup(), &[leave]);
    handle
        .set_routing(RoutingConfig {
            policy: RoutePolicy::Random,
            ..RoutingConfig::default()
        })
        .await
        .unwrap();
    for i in 0..100 {
        let decision = handle.route(request(&format!("x{i}"), 1)).await.unwrap();
        assert_ne!(
            decision.worker(),
            worker(2),
            "a worker that left is never chosen"
        );
        assert_eq!(decision.policy, RoutePolicy::Random);
    }
}

/// The idle sweep takes a forgotten worker out of the index policies' turns at once, and
/// keeps the load of a worker that left with a live booking.
#[tokio::test]
async fn the_idle_sweep_updates_the_turns_and_keeps_live_load() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    let idle = Duration::from_millis(200);
    actor
        .with_worker_idle(idle)
        .with_routing(RoutingConfig::default().with_policy(RoutePolicy::RoundRobin))
        .spawn(None, &tracker);
    let cleanup = handle.cleanup();
    let w = weight(10, None);
    let leave = Op::Membership {
        worker_id: WorkerId(3),
        dp_rank: None,
        leaving: true,
    };
    submit(&cleanup, &[Op::Seen(worker(1)), Op::Seen(worker(2))]);
    submit(&cleanup, &[Op::Book(NO_CLASS, worker(3), w), leave]);
    // The first turn goes to worker 1, whose booking keeps it a member.
    let first = handle.route(request("i0", 1)).await.unwrap().worker();
    assert_eq!(first, worker(1));
    tokio::time::sleep(idle + idle / 2).await;
    handle.loads().await.unwrap();
    let turns: Vec<_> = [
        handle.route(request("i1", 1)).await.unwrap().worker(),
        handle.route(request("i2", 1)).await.unwrap().worker(),
    ]
    .into();
    assert_eq!(turns, [1, 1].map(worker), "worker 2 was forgotten");
    assert_eq!(handle.stats().workers_forgotten, 1);
    assert_eq!(
        handle.load(worker(3)).await.unwrap().active_bookings,
        1,
        "a worker that left keeps its live load through the sweep"
    );
}

/// Setting the routing keeps the idle time; a request refused before it was read is
/// counted under the policy in force.
#[tokio::test]
async fn set_routing_keeps_the_idle_time_and_unread_requests_are_counted() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    let idle = Duration::from_secs(42);
    actor
        .with_routing(RoutingConfig::default().with_worker_idle(idle))
        .spawn(None, &tracker);
    let routing = RoutingConfig::default()
        .with_policy(RoutePolicy::RoundRobin)
        .with_worker_idle(Duration::from_secs(1));
    handle.set_routing(routing).await.unwrap();
    let now = handle.routing().await.unwrap();
    assert_eq!(now.policy(), RoutePolicy::RoundRobin);
    assert_eq!(now.worker_idle(), Some(idle), "the idle time is kept");
    handle.count_invalid_request().await;
    let stats = handle.stats();
    assert_eq!(
        stats.decisions(RoutePolicy::RoundRobin, RouteOutcome::Invalid),
        1
    );
}

/// A leave of a worker never seen changes nothing: it does not become a member.
#[tokio::test]
async fn an_unknown_worker_leaving_is_no_member() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor.spawn(None, &tracker);
    submit(
        &handle.cleanup(),
        &[
            Op::Seen(worker(1)),
            Op::Membership {
                worker_id: WorkerId(9),
                dp_rank: None,
                leaving: true,
            },
        ],
    );
    assert_eq!(members(&handle.loads().await.unwrap()), vec![worker(1)]);
    assert_eq!(handle.stats().workers_left, 0);
}

/// A worker that speaks after the first decision is in the next turns at once.
#[tokio::test]
async fn round_robin_takes_in_a_member_that_joins_later() {
    let handle = routed(RoutePolicy::RoundRobin, &[worker(1)]).await;
    let mut turns = Vec::new();
    let mut turn = async |i: usize| {
        let decision = handle.route(request(&format!("j{i}"), 1)).await.unwrap();
        turns.push(decision.worker());
    };
    turn(0).await;
    submit(&handle.cleanup(), &[Op::Seen(worker(2))]);
    turn(1).await;
    turn(2).await;
    assert_eq!(turns, [1, 2, 1].map(worker));
}

/// The same seed and the same state make the same draws; a different seed, and setting
/// the seed again mid-run, restart them.
#[tokio::test]
async fn a_seed_makes_the_random_policies_repeatable() {
    let members: Vec<_> = (1..=16).map(worker).collect();
    let draws = |policy, seed: Option<u64>, reseed_after: Option<usize>| {
        let members = members.clone();
        async move {
            let handle = routed(policy, &members).await;
            let set = |seed| RoutingConfig {
                policy,
                seed,
                ..RoutingConfig::default()
            };
            handle.set_routing(set(seed)).await.unwrap();
            let mut picks = Vec::new();
            for i in 0..40 {
                if reseed_after == Some(i) {
                    // The same seed again: no restart.
                    handle.set_routing(set(seed)).await.unwrap();
                    handle.set_routing(set(seed.map(|s| s + 1))).await.unwrap();
                    handle.set_routing(set(seed)).await.unwrap();
                }
                let decision = handle.route(request(&format!("r{i}"), 1)).await.unwrap();
                // The workers drawn, not the one chosen: the choice also depends on the
                // loads, which the bookings change.
                let mut drawn: Vec<_> = decision.candidates.iter().map(|c| c.worker).collect();
                drawn.sort_unstable();
                picks.push(drawn);
            }
            picks
        }
    };
    for policy in [RoutePolicy::Random, RoutePolicy::PowerOfTwo] {
        let a = draws(policy, Some(7), None).await;
        assert_eq!(a, draws(policy, Some(7), None).await, "{policy:?}");
        assert_ne!(a, draws(policy, Some(8), None).await, "{policy:?}");
        assert_ne!(a, draws(policy, None, None).await, "{policy:?}");
        // Reseeded with 7 after 20 draws: the first 20 picks come again.
        let restarted = draws(policy, Some(7), Some(20)).await;
        assert_eq!(restarted[..20], a[..20], "{policy:?}");
        assert_eq!(restarted[20..], a[..20], "{policy:?}");
    }
}

#[tokio::test]
async fn bad_requests_and_no_members_are_refused_and_counted() {
    let handle = routed(RoutePolicy::PowerOfTwo, &[]).await;
    assert_eq!(
        handle.route(request("a", 10)).await,
        Err(RouteRequestError::NoWorkers)
    );
    let longest = "r".repeat(crate::MAX_ROUTE_REQUEST_ID_BYTES);
    let too_long = "r".repeat(crate::MAX_ROUTE_REQUEST_ID_BYTES + 1);
    assert_eq!(
        handle.route(request(&longest, 10)).await,
        Err(RouteRequestError::NoWorkers),
        "an id of the most bytes allowed is valid"
    );
    for bad in [
        request("a", 0),
        request("", 10),
        request(&too_long, 10),
        request("a", 10).with_cached_tokens(11),
    ] {
        assert!(matches!(
            handle.route(bad).await,
            Err(RouteRequestError::InvalidRequest(_))
        ));
    }
    let bad_weights = RoutingConfig {
        weights: CostWeights {
            prefill: f64::NAN,
            kv: 1.0,
        },
        ..RoutingConfig::default()
    };
    assert!(handle.set_routing(bad_weights).await.is_err());
    let stats = handle.stats();
    assert_eq!(
        stats.decisions(RoutePolicy::PowerOfTwo, RouteOutcome::NoWorkers),
        2
    );
    assert_eq!(
        stats.decisions(RoutePolicy::PowerOfTwo, RouteOutcome::Invalid),
        4
    );
    assert_eq!(
        stats.decisions(RoutePolicy::PowerOfTwo, RouteOutcome::Routed),
        0
    );
}

#[tokio::test]
async fn least_bookings_takes_the_fewest_bookings_then_the_fewest_tokens() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor
        .with_routing(RoutingConfig {
            policy: RoutePolicy::LeastBookings,
            ..RoutingConfig::default()
        })
        .spawn(None, &tracker);
    assert_eq!(
        handle.route(RouteRequest::new("x", 1)).await,
        Err(RouteRequestError::NoWorkers)
    );
    let w = weight(10, None);
    submit(
        &handle.cleanup(),
        &[
            Op::Admitted(NO_CLASS, worker(1), w),
            Op::Admitted(NO_CLASS, worker(2), weight(1, None)),
            Op::Admitted(NO_CLASS, worker(2), weight(1, None)),
            Op::Admitted(NO_CLASS, worker(3), w),
        ],
    );
    let first = handle.route(RouteRequest::new("x", 1)).await.unwrap();
    assert_eq!(
        first.worker(),
        worker(1),
        "one booking each: fewer tokens, then the lower"
    );
    assert_eq!(first.policy, RoutePolicy::LeastBookings);
    assert_eq!(first.candidates.len(), 1);
    assert_eq!(handle.load(worker(1)).await.unwrap().active_bookings, 2);
    let second = handle.route(RouteRequest::new("y", 1)).await.unwrap();
    assert_eq!(
        second.worker(),
        worker(3),
        "its own booking counted at once"
    );
    let third = handle.route(RouteRequest::new("z", 1)).await.unwrap();
    assert_eq!(
        third.worker(),
        worker(2),
        "two bookings each: the fewest tokens"
    );
    assert_eq!(
        handle
            .stats()
            .decisions(RoutePolicy::LeastBookings, RouteOutcome::Routed),
        3
    );
}

/// Fewest bookings first; between equal bookings, fewest tokens (prompt plus expected
/// output), whatever the worker ids.
#[tokio::test]
async fn equal_bookings_are_ranked_by_their_tokens() {
    for (a, b) in [
        // Tokens: 30 against 10 (a product would rank them the other way).
        (weight(30, None), weight(5, Some(5))),
        // Tokens: 15 against 12 (a difference would rank them the other way).
        (weight(10, Some(5)), weight(12, None)),
    ] {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        submit(
            &handle.cleanup(),
            &[
                Op::Book(NO_CLASS, worker(1), a),
                Op::Book(NO_CLASS, worker(2), b),
            ],
        );
        assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, worker(2));
        // One booking more outweighs any tokens.
        submit(
            &handle.cleanup(),
            &[Op::Book(NO_CLASS, worker(2), weight(0, None))],
        );
        assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, worker(1));
    }
    let load = WorkerLoad {
        active_bookings: 2,
        prompt_tokens: 3,
        expected_output_tokens: 4,
        ..WorkerLoad::default()
    };
    assert_eq!(load.rank(), (2, 7));
}

/// A worker the hot-worker guard held back may still be chosen (here by least bookings);
/// its booking then weighs what it has cached, not the whole prompt.
#[tokio::test]
async fn a_booking_on_a_guarded_worker_weighs_its_cache() {
    let tracker = TaskTracker::new();
    let (handle, actor) = Scheduler::new("t");
    actor
        .with_routing(RoutingConfig {
            policy: RoutePolicy::LeastBookings,
            ..RoutingConfig::default()
        })
        .spawn(None, &tracker);
    submit(
        &handle.cleanup(),
        &[
            Op::Admitted(NO_CLASS, worker(1), weight(20_000, None)),
            Op::Admitted(NO_CLASS, worker(2), weight(1, None)),
            Op::Admitted(NO_CLASS, worker(2), weight(1, None)),
        ],
    );
    let ids: Vec<u32> = (0..72).collect();
    handle
        .cleanup()
        .prefix()
        .learn(worker(1), &crate::prefix::block_hashes(&ids, 16), None);
    let before = handle.load(worker(1)).await.unwrap().prefill_tokens;
    let decision = handle
        .route(RouteRequest::new("x", 72).with_token_ids(ids))
        .await
        .unwrap();
    assert_eq!(decision.worker(), worker(1));
    assert_eq!(decision.candidates[0].overlap_blocks, 4);
    assert_eq!(
        decision.candidates[0].cached_tokens, 0,
        "the guard withheld it"
    );
    let after = handle.load(worker(1)).await.unwrap().prefill_tokens;
    assert_eq!(after - before, 72 - 64, "its 4 blocks need no prefill");
}

/// A decision learns its booking's blocks after its answer (the next decision sees them),
/// within the worker's capacity, the prompt's tail first.
#[tokio::test]
async fn a_decision_learns_its_booking_within_the_capacity() {
    let tracker = TaskTracker::new();
    let (handle, actor) =
        Scheduler::with_prefix("t", crate::PrefixIndexConfig::new().with_worker_capacity(3));
    actor.spawn(None, &tracker);
    submit(&handle.cleanup(), &[Op::Seen(worker(1))]);
    let ids: Vec<u32> = (0..80).collect();
    let first = handle
        .route(RouteRequest::new("a", 80).with_token_ids(ids.clone()))
        .await
        .unwrap();
    assert_eq!(first.candidates[0].overlap_blocks, 0);
    let second = handle
        .route(RouteRequest::new("b", 80).with_token_ids(ids))
        .await
        .unwrap();
    assert_eq!(
        second.candidates[0].overlap_blocks, 3,
        "the first 3 of 5 blocks"
    );
    assert_eq!(second.candidates[0].cached_tokens, 48);
    handle.load(worker(1)).await.unwrap();
    assert_eq!(handle.prefix_figures().entries, 3);
}

/// A reset applied between a decision's answer and the learning of its booking wins: the
/// restarted engine holds nothing, so nothing is learned; without one, the booking is.
#[test]
fn a_reset_after_the_answer_is_not_overtaken_by_the_booking() {
    for reset in [false, true] {
        let (handle, mut actor) = Scheduler::new("t");
        submit(
            &handle.cleanup(),
            &[Op::Seen(worker(1)), Op::Seen(worker(2))],
        );
        actor.state.drain();
        let ids: Vec<u32> = (0..80).collect();
        let decision = actor
            .state
            .route(RouteRequest::new("a", 80).with_token_ids(ids))
            .unwrap();
        assert_eq!(
            handle.prefix_figures().entries,
            0,
            "learned after the answer"
        );
        if reset {
            handle
                .cleanup()
                .prefix()
                .forget(|w| w == decision.worker(), false);
        }
        actor.state.learn_booked();
        let expected = if reset { 0 } else { 5 };
        assert_eq!(handle.prefix_figures().entries, expected, "reset: {reset}");
        let learned = handle.prefix_figures().learned_admissions;
        assert_eq!(learned, u64::from(!reset), "reset: {reset}");
    }
}

mod admission {
    use super::*;
    use crate::admission::{AdmissionClass, AdmissionConfig, QueueConfig, SaturationConfig};

    /// A scheduler with one member worker and the classes premium (weight 4) and regular
    /// (1, the default) in `premium_band` and 0, saturated past 100 prefill tokens waiting.
    fn saturable(premium_band: u8, queue: QueueConfig) -> (SchedulerHandle, ClassId) {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        handle
            .set_admission(
                AdmissionConfig::default()
                    .with_class(AdmissionClass::new("premium", premium_band, 4.0))
                    .with_class(AdmissionClass::new("regular", 0, 1.0))
                    .with_default_class("regular")
                    .with_saturation(
                        SaturationConfig::default().with_max_prefill_tokens_per_worker(100),
                    )
                    .with_queue(queue),
            )
            .unwrap();
        let premium = handle.mailbox.classes.resolve(Some("premium"));
        submit(&handle.cleanup(), &[Op::Seen(worker(1))]);
        (handle, premium)
    }

    fn request(id: &str, class: &str) -> RouteRequest {
        RouteRequest::new(id, 10).with_class(class)
    }

    fn overloaded(result: Result<RouteDecision, RouteRequestError>) -> String {
        match result {
            Err(RouteRequestError::Overloaded { why, retry_after }) => {
                assert!(retry_after >= Duration::from_secs(1));
                why
            }
            other => panic!("not refused: {other:?}"),
        }
    }

    /// While saturated, a class under its part of the room (100 prefill tokens) is routed
    /// and one over it waits (bounded: a full queue or no wait refuses at once); once the
    /// deployment is not saturated, those waiting are routed. Without saturation nothing
    /// waits.
    #[tokio::test(start_paused = true)]
    async fn a_class_over_its_share_waits_while_saturated_and_goes_when_room_is_made() {
        let queue = QueueConfig::default()
            .with_max_queued(2)
            .with_max_wait_ms(60_000);
        let (handle, premium) = saturable(0, queue);
        // Not saturated: premium goes at once, whatever its part.
        assert!(handle.route(request("p0", "premium")).await.is_ok());
        // Another replica's premium request, 1,000 prefill tokens: saturated, premium over
        // its part (4/5 of the room, 80 tokens).
        let heavy = weight(1000, None);
        submit(
            &handle.cleanup(),
            &[Op::Admitted(premium, worker(1), heavy)],
        );
        // Regular is under its part (0 of 20 tokens): routed, and unknown counts as regular
        // (10 of 20).
        assert!(handle.route(request("r0", "regular")).await.is_ok());
        assert!(handle.route(request("r1", "no-such-class")).await.is_ok());
        // Premium may not wait, or waits; the queue holds two.
        let why = overloaded(
            handle
                .route(request("p1", "premium").with_max_wait_ms(0))
                .await,
        );
        assert!(why.contains("may not wait"), "{why}");
        let waiting: Vec<_> = ["p2", "p3"]
            .into_iter()
            .map(|id| {
                let handle = handle.clone();
                tokio::spawn(async move { handle.route(request(id, "premium")).await })
            })
            .collect();
        while handle.stats().admission_waited < 2 {
            tokio::task::yield_now().await;
        }
        let why = overloaded(handle.route(request("p4", "premium")).await);
        assert!(why.contains("queue is full"), "{why}");
        assert!(waiting.iter().all(|w| !w.is_finished()));
        let counted = |class: usize| {
            let handle = handle.clone();
            async move {
                let loads = handle.class_loads().await.unwrap();
                let a = &loads[class].admission;
                [
                    a.admitted,
                    a.queued,
                    a.waiting,
                    a.refused,
                    a.abandoned,
                    a.wait.count,
                ]
            }
        };
        assert_eq!(
            counted(0).await,
            [1, 2, 2, 2, 0, 0],
            "premium: p0; p2, p3; p1, p4"
        );
        assert_eq!(
            counted(1).await,
            [2, 0, 0, 0, 0, 0],
            "regular: r0, r1 (unknown)"
        );
        // The heavy request completes: not saturated any more, both go.
        completes(&handle, premium, heavy);
        for w in waiting {
            let decision = w.await.unwrap().unwrap();
            assert_eq!(decision.worker(), worker(1));
        }
        assert_eq!(
            counted(0).await,
            [3, 2, 0, 2, 0, 2],
            "p2 and p3 left the queue routed"
        );
        assert_eq!(counted(1).await, [2, 0, 0, 0, 0, 0]);
        let stats = handle.stats();
        assert_eq!(stats.admission_waited, 2);
        assert_eq!(
            stats.decisions(RoutePolicy::WeightedCost, RouteOutcome::Refused),
            2
        );
        assert_eq!(
            stats.decisions(RoutePolicy::WeightedCost, RouteOutcome::Routed),
            5,
            "p0, r0, r1, p2, p3"
        );
    }

    /// While saturated, each class is bounded by its part of the room (the threshold times
    /// the members, split by weight), not by its share of what is in flight: with both
    /// classes over their parts neither goes, though regular holds far under its share of
    /// the band's tokens, so what the band admits stays near the threshold.
    #[tokio::test(start_paused = true)]
    async fn a_class_under_its_share_but_over_its_part_of_the_room_waits() {
        let (handle, premium) = saturable(0, QueueConfig::default().with_max_queued(0));
        let regular = handle.mailbox.classes.resolve(Some("regular"));
        // Another replica's: premium 800 prefill tokens, regular 50. Room 100: premium's
        // part 80, regular's 20; regular holds 50 / 850 of the band, under its 1/5.
        let (heavy, light) = (weight(800, None), weight(50, None));
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(premium, worker(1), heavy),
                Op::Admitted(regular, worker(1), light),
            ],
        );
        let why = overloaded(handle.route(request("r1", "regular")).await);
        assert!(why.contains("over its part"), "{why}");
        overloaded(handle.route(request("p1", "premium")).await);
        // Regular's 50 complete: it holds nothing, under any part: it goes, saturated.
        completes(&handle, regular, light);
        assert!(handle.route(request("r2", "regular")).await.is_ok());
        // 10 of 20: 15 more would pass the part (though 10 is under it), 10 more fits; then
        // 20 of 20, full.
        let sized = |id: &str, prompt| RouteRequest::new(id, prompt).with_class("regular");
        overloaded(handle.route(sized("r3", 15)).await);
        assert!(handle.route(sized("r4", 10)).await.is_ok());
        overloaded(handle.route(request("r5", "regular")).await);
        overloaded(handle.route(request("p2", "premium")).await);
    }

    /// A band's room is what the bands above it leave: premium alone in band 1 has the whole
    /// room as its part, regular in band 0 only what premium does not use.
    #[tokio::test(start_paused = true)]
    async fn a_lower_band_has_the_room_a_higher_band_leaves() {
        let (handle, premium) = saturable(1, QueueConfig::default().with_max_queued(0));
        let regular = handle.mailbox.classes.resolve(Some("regular"));
        // 80 + 30 waiting against a room of 100: saturated. Regular's room is 20, its use 30.
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(premium, worker(1), weight(80, None)),
                Op::Admitted(regular, worker(1), weight(30, None)),
            ],
        );
        overloaded(handle.route(request("r1", "regular")).await);
        // Premium, alone in its band, counts none of regular's: 80 + 10 of 100.
        assert!(handle.route(request("p1", "premium")).await.is_ok());
        assert!(handle.route(request("p2", "premium")).await.is_ok());
        overloaded(handle.route(request("p3", "premium")).await);
    }

    /// The classes that share a band's room are those using some of it, those waiting in
    /// this replica, and the class itself: an idle class's part goes to the others until
    /// it uses some.
    #[tokio::test(start_paused = true)]
    async fn an_idle_class_s_part_goes_to_the_others_until_it_uses_some() {
        let config = SaturationConfig::default();
        let (handle, ids) = classes(&[("a", 4.0), ("b", 1.0), ("c", 5.0)], config);
        let [a, b] = [ids[0], ids[1]];
        // a 50, b 55: saturated; c idle, so a's part is 4/5 of 100.
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(a, worker(1), weight(50, None)),
                Op::Admitted(b, worker(1), weight(55, None)),
            ],
        );
        assert!(handle.route(request("a1", "a")).await.is_ok(), "60 of 80");
        // A request of c goes at once: c uses none.
        assert!(handle.route(request("c1", "c")).await.is_ok(), "uses none");
        // Now c shares: a's part is 4/10 of 100, and a uses 60.
        overloaded(handle.route(request("a2", "a").with_max_wait_ms(0)).await);
    }

    /// A class under its part goes at once although another class of its band waits.
    #[tokio::test(start_paused = true)]
    async fn a_class_under_its_part_passes_another_class_waiting_in_its_band() {
        let queue = QueueConfig::default().with_max_wait_ms(60_000);
        let (handle, premium) = saturable(0, queue);
        let regular = handle.mailbox.classes.resolve(Some("regular"));
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(premium, worker(1), weight(50, None)),
                Op::Admitted(regular, worker(1), weight(60, None)),
            ],
        );
        let waiting = waits(&handle, request("r1", "regular"), 1).await;
        assert!(
            handle.route(request("p1", "premium")).await.is_ok(),
            "60 of 80"
        );
        assert_eq!(handle.stats().admission_waited, 1, "p1 did not wait");
        assert!(!waiting.is_finished());
    }

    /// With the KV criterion on, a class over its part of the KV room waits though it
    /// prefills nothing; waiting, it shares the prefill room too, so another class of its
    /// band gets only its weighted part of that.
    #[tokio::test(start_paused = true)]
    async fn the_kv_criterion_holds_a_class_and_a_waiting_class_shares_every_room() {
        let kv = SaturationConfig::default()
            .with_kv_capacity_tokens(1000)
            .with_max_kv_share(0.5);
        let (handle, ids) = classes(&[("premium", 4.0), ("regular", 1.0), ("c", 1.0)], kv);
        let cached =
            |tokens| BookingWeight::from(RequestLoad::new(tokens, None).with_cached_tokens(tokens));
        // Prefill: premium 65, c 40: 105 of a room of 100. KV: premium 65 + 235, regular 200
        // (all cached: no prefill), c 40: 540 of a room of 500.
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(ids[0], worker(1), weight(65, None)),
                Op::Admitted(ids[0], worker(1), cached(235)),
                Op::Admitted(ids[1], worker(1), cached(200)),
                Op::Admitted(ids[2], worker(1), weight(40, None)),
            ],
        );
        // Regular holds 200 of its KV part of 83: it waits, though it prefills nothing.
        let r1 = waits(&handle, request("r1", "regular"), 1).await;
        // Premium: 310 of its KV part of 333; but regular waits, so premium's prefill part
        // is 4/6 of 100, not 4/5: 75 is over it.
        let why = overloaded(
            handle
                .route(request("p1", "premium").with_max_wait_ms(0))
                .await,
        );
        assert!(why.contains("may not wait"), "{why}");
        assert!(!r1.is_finished());
    }

    /// A scheduler with one member worker and `classes` (name, weight) in band 0, the
    /// first the default, saturated past 100 prefill tokens waiting and `saturation`'s KV
    /// criterion; each class's id.
    fn classes(
        classes: &[(&str, f64)],
        saturation: SaturationConfig,
    ) -> (SchedulerHandle, Vec<ClassId>) {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        let mut config = AdmissionConfig::default()
            .with_default_class(classes[0].0)
            .with_saturation(saturation.with_max_prefill_tokens_per_worker(100))
            .with_queue(QueueConfig::default().with_max_wait_ms(60_000));
        for (name, weight) in classes {
            config = config.with_class(AdmissionClass::new(*name, 0, *weight));
        }
        handle.set_admission(config).unwrap();
        submit(&handle.cleanup(), &[Op::Seen(worker(1))]);
        let ids = classes
            .iter()
            .map(|(name, _)| handle.mailbox.classes.resolve(Some(name)))
            .collect();
        (handle, ids)
    }

    /// `class`'s request of `weight` on worker 1 completes (its booking released).
    fn completes(handle: &SchedulerHandle, class: ClassId, weight: BookingWeight) {
        submit(
            &handle.cleanup(),
            &[Op::Release(
                class,
                worker(1),
                weight,
                ReleaseReason::Completed,
            )],
        );
    }

    /// Starts routing `request` and returns once it waits (the `n`th to wait).
    async fn waits(handle: &SchedulerHandle, request: RouteRequest, n: u64) -> WaitingRoute {
        let routing = {
            let handle = handle.clone();
            tokio::spawn(async move { handle.route(request).await })
        };
        while handle.stats().admission_waited < n {
            tokio::task::yield_now().await;
        }
        routing
    }

    type WaitingRoute = tokio::task::JoinHandle<Result<RouteDecision, RouteRequestError>>;

    /// The KV room is the share of every member's capacity: two members of 1,000 at 0.5
    /// hold 1,000; premium's part is 800 of it, regular's 200.
    #[tokio::test(start_paused = true)]
    async fn the_kv_room_counts_every_member() {
        let kv = SaturationConfig::default()
            .with_kv_capacity_tokens(1000)
            .with_max_kv_share(0.5);
        let (handle, ids) = classes(&[("premium", 4.0), ("regular", 1.0)], kv);
        submit(&handle.cleanup(), &[Op::Seen(worker(2))]);
        let cached =
            |tokens| BookingWeight::from(RequestLoad::new(tokens, None).with_cached_tokens(tokens));
        // KV held 700 + 320 of 1,000; no prefill waiting.
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(ids[0], worker(1), cached(700)),
                Op::Admitted(ids[1], worker(2), cached(320)),
            ],
        );
        assert!(
            handle.route(request("p1", "premium")).await.is_ok(),
            "710 of 800"
        );
        overloaded(
            handle
                .route(request("r1", "regular").with_max_wait_ms(0))
                .await,
        );
    }

    /// Classes waiting equally far over their parts go in arrival order.
    #[tokio::test(start_paused = true)]
    async fn classes_equally_full_go_in_arrival_order() {
        let config = SaturationConfig::default();
        let (handle, ids) = classes(&[("a", 4.0), ("b", 1.0), ("c", 5.0)], config);
        let last = weight(10, None);
        // a 40 of its 40, b 10 of its 10, c 50 + 10: 110 of 100.
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(ids[0], worker(1), weight(40, None)),
                Op::Admitted(ids[1], worker(1), weight(10, None)),
                Op::Admitted(ids[2], worker(1), weight(50, None)),
                Op::Admitted(ids[2], worker(1), last),
            ],
        );
        let b1 = waits(&handle, request("b1", "b"), 1).await;
        let a1 = waits(&handle, request("a1", "a"), 2).await;
        // 100 of 100: room for one; a and b equally full, b came first; its 10 saturate.
        submit(
            &handle.cleanup(),
            &[Op::Release(
                ids[2],
                worker(1),
                last,
                ReleaseReason::Completed,
            )],
        );
        assert!(b1.await.unwrap().is_ok());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!a1.is_finished(), "a, later, still waits");
    }

    /// A request larger than its class's whole part still goes while its class uses
    /// nothing, and only then; a request does not overtake its own class's earlier ones
    /// that wait, even one that would fit.
    #[tokio::test(start_paused = true)]
    async fn a_class_s_requests_go_in_order_and_a_large_one_alone() {
        let sized = |id: &str, prompt| RouteRequest::new(id, prompt).with_class("regular");
        let queue = QueueConfig::default().with_max_wait_ms(60_000);
        let heavy = weight(800, None);
        // Saturated by premium's 800; regular's part is 20 tokens and it uses none.
        let (handle, premium) = saturable(0, queue);
        submit(
            &handle.cleanup(),
            &[Op::Admitted(premium, worker(1), heavy)],
        );
        assert!(handle.route(sized("big", 500)).await.is_ok(), "alone");
        overloaded(handle.route(sized("small", 1)).await);

        let (handle, premium) = saturable(0, queue);
        let regular = handle.mailbox.classes.resolve(Some("regular"));
        let light = weight(15, None);
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(premium, worker(1), heavy),
                Op::Admitted(regular, worker(1), light),
            ],
        );
        // 15 of 20: 10 waits; 5 would fit but may not pass it.
        let first = waits(&handle, sized("w1", 10), 1).await;
        let why = overloaded(handle.route(sized("w2", 5).with_max_wait_ms(0)).await);
        assert!(why.contains("may not wait"), "{why}");
        assert!(!first.is_finished());
        completes(&handle, regular, light);
        assert!(first.await.unwrap().is_ok());
    }

    /// When room is made, the waiting class furthest under its part goes first, whatever
    /// the order the requests came in.
    #[tokio::test(start_paused = true)]
    async fn the_queue_lets_the_class_furthest_under_its_part_go_first() {
        let queue = QueueConfig::default().with_max_wait_ms(60_000);
        let (handle, premium) = saturable(0, queue);
        let regular = handle.mailbox.classes.resolve(Some("regular"));
        // Premium 85 + 65, regular 30: 180 waiting against 100, both over their parts (80
        // and 20).
        let (first, second, light) = (weight(85, None), weight(65, None), weight(30, None));
        submit(
            &handle.cleanup(),
            &[
                Op::Admitted(premium, worker(1), first),
                Op::Admitted(premium, worker(1), second),
                Op::Admitted(regular, worker(1), light),
            ],
        );
        let r1 = waits(&handle, request("r1", "regular"), 1).await;
        let p1 = waits(&handle, request("p1", "premium"), 2).await;
        // 85 complete: 95 waiting, room for one request. Premium holds 65 of its 80 (0.81),
        // regular 30 of its 20 (1.5): premium goes, and its 10 saturate the deployment again.
        completes(&handle, premium, first);
        assert!(p1.await.unwrap().is_ok());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!r1.is_finished(), "regular, first in, still waits");
        completes(&handle, premium, second);
        assert!(r1.await.unwrap().is_ok());
    }

    /// A waiting request is refused at its deadline (its own `max_wait_ms`, capped by the
    /// queue's), and one whose caller went away leaves the queue.
    #[tokio::test(start_paused = true)]
    async fn nothing_waits_past_its_deadline_and_a_caller_that_left_leaves_the_queue() {
        let queue = QueueConfig::default().with_max_wait_ms(1_000);
        let (handle, premium) = saturable(0, queue);
        submit(
            &handle.cleanup(),
            &[Op::Admitted(premium, worker(1), weight(1000, None))],
        );
        let started = tokio::time::Instant::now();
        let why = overloaded(
            handle
                .route(request("p1", "premium").with_max_wait_ms(50))
                .await,
        );
        assert!(why.contains("whole wait"), "{why}");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(50) && waited < Duration::from_millis(100),
            "{waited:?}"
        );
        let started = tokio::time::Instant::now();
        overloaded(
            handle
                .route(request("p2", "premium").with_max_wait_ms(60_000))
                .await,
        );
        assert!(started.elapsed() < Duration::from_millis(1_100), "capped");

        let gone = waits(&handle, request("p3", "premium"), 3).await;
        gone.abort();
        while handle.stats().admission_abandoned < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(handle.stats().admission_abandoned, 1);
        // Per class: premium's three waits, observed as each left the queue (the clock is
        // paused: p1 its 50 ms, p2 the queue's 1,000, p3 until it was seen gone).
        let premium = handle.class_loads().await.unwrap()[0].admission.clone();
        assert_eq!(
            (
                premium.queued,
                premium.refused,
                premium.abandoned,
                premium.waiting
            ),
            (3, 2, 1, 0)
        );
        assert_eq!(premium.wait.count, 3);
        // Cumulative; each seen at the queue's next 5 ms pass: p3 at once, p1 at 50 ms, p2 at
        // 1 s.
        let at_most = |seconds: f64| {
            let bucket = premium.wait.buckets.iter().find(|(b, _)| *b == seconds);
            bucket.expect("a bucket").1
        };
        assert_eq!(
            [at_most(0.025), at_most(0.1), at_most(0.5), at_most(2.5)],
            [1, 2, 2, 3],
            "{premium:?}"
        );
        assert!(
            (1.05..1.07).contains(&premium.wait.sum_seconds),
            "{premium:?}"
        );
    }

    /// While saturated, a request of a lower band stays behind one of a higher band that
    /// waits, even when its own class is under its part.
    #[tokio::test(start_paused = true)]
    async fn a_lower_band_waits_behind_a_higher_band_waiting() {
        let (handle, premium) = saturable(1, QueueConfig::default());
        // Premium alone in band 1 with 1,000 tokens: over its part (all of the room).
        submit(
            &handle.cleanup(),
            &[Op::Admitted(premium, worker(1), weight(1000, None))],
        );
        let high = waits(&handle, request("p1", "premium"), 1).await;
        // Regular, band 0, has nothing in flight, but premium waits (and leaves band 0 no
        // room).
        let low = handle
            .route(request("r1", "regular").with_max_wait_ms(20))
            .await;
        overloaded(low);
        // Room: both bands go, the high first.
        submit(
            &handle.cleanup(),
            &[Op::Release(
                premium,
                worker(1),
                weight(1000, None),
                ReleaseReason::Completed,
            )],
        );
        assert!(high.await.unwrap().is_ok());
        assert!(handle.route(request("r2", "regular")).await.is_ok());
    }

    /// The queue is looked at on time even while other commands keep the actor busy: a
    /// waiting request is refused at its deadline, not when the stream of queries stops.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_actor_still_serves_its_queue_on_time() {
        let (handle, premium) = saturable(0, QueueConfig::default());
        submit(
            &handle.cleanup(),
            &[Op::Admitted(premium, worker(1), weight(1000, None))],
        );
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let busy = {
            let (handle, stop) = (handle.clone(), stop.clone());
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                while !stop.load(std::sync::atomic::Ordering::Relaxed)
                    && started.elapsed() < Duration::from_secs(5)
                {
                    let _ = handle.loads().await;
                }
            })
        };
        let started = std::time::Instant::now();
        overloaded(
            handle
                .route(request("p1", "premium").with_max_wait_ms(100))
                .await,
        );
        let waited = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        busy.await.unwrap();
        assert!(
            waited >= Duration::from_millis(100) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
    }

    /// Without classes nothing waits, saturated or not.
    #[tokio::test]
    async fn without_classes_every_request_is_routed() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        handle
            .set_admission(
                AdmissionConfig::default().with_saturation(
                    SaturationConfig::default().with_max_prefill_tokens_per_worker(1),
                ),
            )
            .unwrap();
        submit(
            &handle.cleanup(),
            &[Op::Admitted(NO_CLASS, worker(1), weight(1000, None))],
        );
        for i in 0..5 {
            let decision = handle
                .route(RouteRequest::new(format!("r{i}"), 10).with_class("premium"))
                .await;
            assert!(decision.is_ok(), "{decision:?}");
        }
        assert_eq!(handle.stats().admission_waited, 0);
    }
}

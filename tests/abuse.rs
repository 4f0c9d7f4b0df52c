//! Bounded memory under abuse: a worker (or anyone who may publish on a deployment's subjects)
//! floods each bounded structure of the router; each stays at its limit and the overflow is
//! counted, never an unbounded growth.
//!
//! The bounds live in the ingress's `EventApplier` (tombstones, held progress, publishers) and
//! in the lease manager (active leases). The applier is fed synchronously here: a NATS server
//! would add nothing but time (the real ingress calls the same `apply`). One test floods the
//! lease bound through a real server and router, end to end.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use lease_router::wire::{self, Envelope, LeaseEvent};
use lease_router::AdmitOutcome;
use lease_router::LeaseConfig;
use lease_router::Subjects;
use lease_router::{Applied, ApplyConfig, EventApplier};
use lease_router::{DropReason, IngressStats};
use lease_router::{NoIngress, Router, RouterConfig};
use lease_router::{RequestLoad, SchedulerBookingDescriptor, WorkerWithDpRank};

const DEPLOYMENT: &str = "abuse";
const FLOOD: usize = 5_000;

fn small_limits() -> ApplyConfig {
    ApplyConfig {
        max_tombstones: 100,
        max_held_progress: 100,
        max_publishers: 100,
        ..ApplyConfig::default()
    }
}

async fn router_with(lease: LeaseConfig) -> Router {
    let config = RouterConfig::new(DEPLOYMENT).with_lease(LeaseConfig {
        scan_interval: Duration::from_secs(3600),
        ..lease
    });
    Router::start(config, NoIngress)
        .await
        .expect("router starts")
}

fn applier(router: &Router, config: ApplyConfig) -> (EventApplier, Arc<IngressStats>, Subjects) {
    let stats = Arc::new(IngressStats::new());
    let subjects = subjects(DEPLOYMENT);
    let applier = EventApplier::new(
        subjects.clone(),
        router.manager().downgrade(),
        stats.clone(),
        config,
    );
    (applier, stats, subjects)
}

/// Encodes and applies one event from `publisher` with sequence `seq`.
fn feed(
    applier: &mut EventApplier,
    subjects: &Subjects,
    publisher: u64,
    seq: u64,
    event: impl Into<LeaseEvent>,
) -> Applied {
    let envelope = Envelope::new(publisher, seq, wire::unix_micros_now(), event);
    let subject = subjects.worker_subject(envelope.event.worker_id());
    let bytes = wire::encode(&envelope).unwrap();
    applier.apply(&subject, &bytes).expect("router alive")
}

#[tokio::test]
async fn tombstone_flood_stays_at_its_limit_and_counts_overflow() {
    let router = router_with(LeaseConfig::default()).await;
    let (mut applier, stats, subjects) = applier(&router, small_limits());
    // Completions of requests nobody admitted: each would leave a tombstone.
    for i in 0..FLOOD {
        let outcome = feed(
            &mut applier,
            &subjects,
            1,
            i as u64 + 1,
            completed(&format!("ghost-{i}"), 1),
        );
        assert_eq!(outcome, Applied::Held);
        assert!(applier.reorder_buffers().0 <= 100);
    }
    assert_eq!(applier.reorder_buffers(), (100, 0));
    let s = stats.snapshot();
    assert_eq!(s.dropped(DropReason::Overflow), (FLOOD - 100) as u64);
    assert_eq!(s.received, FLOOD as u64);
    assert_eq!(s.held, 100, "what the tombstones hold is held");
    assert_eq!(s.accounted(), s.received, "{s:?}");
    assert_eq!(router.manager().active_leases(), 0);
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn held_progress_flood_stays_at_its_limit_and_counts_overflow() {
    let router = router_with(LeaseConfig::default()).await;
    let (mut applier, stats, subjects) = applier(&router, small_limits());
    // Progress of requests nobody admitted: each would be held for its admission.
    for i in 0..FLOOD {
        let outcome = feed(
            &mut applier,
            &subjects,
            1,
            i as u64 + 1,
            progressed(&format!("ghost-{i}"), 1),
        );
        assert_eq!(outcome, Applied::Held);
        assert!(applier.reorder_buffers().1 <= 100);
    }
    assert_eq!(applier.reorder_buffers(), (0, 100));
    let s = stats.snapshot();
    assert_eq!(s.dropped(DropReason::Overflow), (FLOOD - 100) as u64);
    assert_eq!((s.held, s.accounted()), (100, s.received), "{s:?}");
    assert_eq!(router.manager().active_leases(), 0);
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn publisher_flood_stays_at_its_limit() {
    // (The tracker's own bound is pinned by the unit tests in src/ingress/sequence.rs.)
    // Through the applier: a flood of publisher ids (one event each) makes the router forget
    // the least recent publishers, so a re-sent event of the first one is no longer known as
    // a duplicate; with room for every publisher, it is.
    for (max_publishers, expect_duplicate) in [(100, false), (FLOOD + 1, true)] {
        let router = router_with(LeaseConfig::default()).await;
        let config = ApplyConfig {
            max_publishers,
            max_tombstones: FLOOD * 2,
            ..small_limits()
        };
        let (mut applier, stats, subjects) = applier(&router, config);
        for publisher in 0..FLOOD as u64 {
            feed(
                &mut applier,
                &subjects,
                publisher + 1,
                1,
                completed(&format!("ghost-{publisher}"), 1),
            );
        }
        let again = feed(&mut applier, &subjects, 1, 1, completed("ghost-0", 1));
        assert_eq!(
            again == Applied::Dropped(DropReason::Duplicate),
            expect_duplicate,
            "max_publishers {max_publishers}: {again:?}"
        );
        let s = stats.snapshot();
        assert_eq!(s.received, FLOOD as u64 + 1);
        // Each flooding publisher is new: what the tracker forgot is counted.
        if expect_duplicate {
            assert_eq!(s.publishers_evicted, 0);
        } else {
            assert!(
                s.publishers_evicted >= FLOOD as u64 - 100,
                "{}",
                s.publishers_evicted
            );
        }
        router.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn lease_flood_is_refused_past_max_active_leases() {
    let router = router_with(LeaseConfig {
        max_active_leases: 100,
        ..LeaseConfig::default()
    })
    .await;
    let (mut applier, stats, subjects) = applier(&router, small_limits());
    for i in 0..FLOOD {
        let outcome = feed(
            &mut applier,
            &subjects,
            1,
            i as u64 + 1,
            admitted(&format!("flood-{i}"), 1, 10),
        );
        let expected = if i < 100 {
            Applied::Applied
        } else {
            Applied::Dropped(DropReason::Overflow)
        };
        assert_eq!(outcome, expected, "admission {i}");
    }
    let manager = router.manager();
    assert_eq!(manager.active_leases(), 100);
    let lease_stats = manager.stats();
    assert_eq!(lease_stats.active, 100);
    assert_eq!(lease_stats.registered, 100);
    assert_eq!(lease_stats.refused_full, (FLOOD - 100) as u64);
    assert_eq!(
        stats.snapshot().dropped(DropReason::Overflow),
        (FLOOD - 100) as u64
    );

    // A live lease is still renewed and completed while full; a completion frees a slot.
    let mut seq = FLOOD as u64;
    let mut next = || {
        seq += 1;
        seq
    };
    assert_eq!(
        feed(
            &mut applier,
            &subjects,
            1,
            next(),
            admitted("flood-0", 1, 10)
        ),
        Applied::Applied
    );
    assert_eq!(
        feed(&mut applier, &subjects, 1, next(), progressed("flood-1", 1)),
        Applied::Applied
    );
    assert_eq!(
        feed(&mut applier, &subjects, 1, next(), completed("flood-2", 1)),
        Applied::Applied
    );
    assert_eq!(manager.active_leases(), 99);
    assert_eq!(
        feed(&mut applier, &subjects, 1, next(), admitted("late", 1, 10)),
        Applied::Applied
    );
    assert_eq!(
        feed(
            &mut applier,
            &subjects,
            1,
            next(),
            admitted("refused", 1, 10)
        ),
        Applied::Dropped(DropReason::Overflow)
    );
    assert_eq!(manager.active_leases(), 100);

    // A worker reset and expiry free slots too (the live count follows every removal).
    manager.reset_worker(lease_router::WorkerId(1), None);
    assert_eq!(manager.active_leases(), 0);
    let worker = WorkerWithDpRank::new(2, 0);
    for i in 0..150 {
        let booking = SchedulerBookingDescriptor::new(format!("direct-{i}").into(), worker);
        let outcome = manager.register_remote(booking, RequestLoad::new(1, Some(1)));
        let expected = if i < 100 {
            AdmitOutcome::Registered
        } else {
            AdmitOutcome::Full
        };
        assert_eq!(outcome, expected, "direct admission {i}");
    }
    manager.scan().await;
    manager.scan().await;
    assert_eq!(manager.active_leases(), 0);
    let booking = SchedulerBookingDescriptor::new("after-expiry".into(), worker);
    assert_eq!(
        manager.register_remote(booking, RequestLoad::new(1, Some(1))),
        AdmitOutcome::Registered
    );
    router.shutdown().await.unwrap();
}

#[tokio::test]
async fn lease_flood_through_nats_is_bounded_and_counted() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let stats = Arc::new(IngressStats::new());
    let ingress = lease_router::NatsIngress::new(
        conn.client().clone(),
        subjects(DEPLOYMENT),
        ApplyConfig::default(),
        stats.clone(),
    );
    let config = RouterConfig::new(DEPLOYMENT).with_lease(LeaseConfig {
        scan_interval: Duration::from_secs(3600),
        max_active_leases: 50,
        ..LeaseConfig::default()
    });
    let router = Router::start(config, ingress).await.expect("router starts");

    let publisher_conn = client(&server.url()).await;
    let mut publisher = RawPublisher::new(publisher_conn.client().clone(), DEPLOYMENT, 7);
    const N: usize = 1_000;
    for i in 0..N {
        publisher.send(admitted(&format!("r{i}"), 3, 5)).await;
    }
    publisher.flush().await;
    let done = eventually(BOUND, || {
        let s = stats.snapshot();
        async move { s.applied_total() + s.dropped_total() >= N as u64 }
    })
    .await;
    assert!(done, "{:?}", stats.snapshot());
    assert_eq!(router.manager().active_leases(), 50);
    assert_eq!(router.manager().stats().refused_full, (N - 50) as u64);
    assert_eq!(
        stats.snapshot().dropped(DropReason::Overflow),
        (N - 50) as u64
    );
    router.shutdown().await.unwrap();
}

/// An event larger than the router's `max_event_bytes` (default 4096) but well within the
/// server's `max_payload` (default 1 MB) reaches the router and is dropped, counted as
/// oversized, without being decoded; the next normal event is applied.
#[tokio::test]
async fn event_between_limit_and_max_payload_is_dropped_as_oversized() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let h = router(
        &conn,
        DEPLOYMENT,
        Duration::from_secs(3600),
        ApplyConfig::default(),
    )
    .await;
    let max_payload = conn.client().server_info().max_payload;
    assert!(wire::DEFAULT_MAX_EVENT_BYTES < max_payload, "{max_payload}");

    let publisher_conn = client(&server.url()).await;
    let mut publisher = RawPublisher::new(publisher_conn.client().clone(), DEPLOYMENT, 9);
    let huge = "x".repeat(64 * 1024);
    let envelope = publisher.envelope(admitted(&huge, 4, 1));
    let bytes = wire::encode(&envelope).unwrap();
    assert!(bytes.len() > wire::DEFAULT_MAX_EVENT_BYTES && bytes.len() < max_payload);
    publisher
        .send_bytes(publisher.subjects.worker_subject(4), bytes)
        .await;
    publisher.send(admitted("normal", 4, 1)).await;
    publisher.flush().await;

    let done = eventually(BOUND, || {
        let s = h.stats.snapshot();
        async move { s.received >= 2 }
    })
    .await;
    assert!(done, "{:?}", h.stats.snapshot());
    let s = h.stats.snapshot();
    assert_eq!(s.dropped(DropReason::Oversized), 1, "{s:?}");
    assert_eq!(s.applied_total(), 1, "{s:?}");
    assert_eq!(h.router.manager().active_leases(), 1);
    h.router.shutdown().await.unwrap();
}

/// A batch of the largest size filled with the smallest possible non-events, and batches
/// that claim more events than they could hold: every declared event is counted once, the
/// count never exceeds the bytes sent, and the router goes on applying.
#[tokio::test]
async fn batch_floods_are_counted_per_event_and_bounded_by_bytes() {
    let router = router_with(LeaseConfig::default()).await;
    let (mut applier, stats, subjects) = applier(&router, ApplyConfig::default());
    let subject = subjects.worker_subject(1);
    // {"v": 1, "kind": "batch", "events": [7, 7, 7, ...]}: each element is one byte.
    let header = wire::encode_batch(&[Envelope::new(1, 1, 1, common::admitted("x", 1, 1))])
        .unwrap()[..22]
        .to_vec();
    let elements = wire::DEFAULT_MAX_BATCH_BYTES - 22 - 5;
    let mut flood = header.clone();
    rmp::encode::write_array_len(&mut flood, elements as u32).unwrap();
    flood.resize(flood.len() + elements, 0x07);
    assert_eq!(flood.len(), wire::DEFAULT_MAX_BATCH_BYTES);
    let outcome = applier.apply(&subject, &flood).expect("router alive");
    let Applied::Batch(batch) = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(batch.dropped as usize, elements);
    // One byte more is over the limit: dropped unread, once.
    flood.push(0x07);
    assert_eq!(
        applier.apply(&subject, &flood).unwrap(),
        Applied::Dropped(DropReason::Oversized)
    );
    // A claim of 4 billion events in 28 bytes: at most one per byte is counted.
    let mut liar = header;
    liar.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x07]);
    let Applied::Batch(batch) = applier.apply(&subject, &liar).unwrap() else {
        panic!("a refused batch is a batch outcome")
    };
    assert!(batch.dropped as usize <= liar.len(), "{batch:?}");
    // The router still applies what comes next.
    assert_eq!(
        feed(&mut applier, &subjects, 9, 1, admitted("after", 1, 1)),
        Applied::Applied
    );
    applier.end_batch();
    let s = stats.snapshot();
    assert_eq!(
        s.dropped(DropReason::Decode),
        (elements + batch.dropped as usize) as u64
    );
    assert_eq!(s.dropped(DropReason::Oversized), 1);
    assert_eq!(s.accounted(), s.received);
    assert_eq!(s.batches, 2, "the oversized one was not read");
    router.shutdown().await.unwrap();
}

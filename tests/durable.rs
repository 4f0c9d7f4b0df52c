//! Durable mode against real JetStream: a replica that starts late catches up from the
//! stream, follows live events with no gap and no double count, survives restarts, and on a
//! three-node cluster ends with exactly the leases of a reference that was never interrupted.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use bytes::Bytes;
use common::*;
use futures::StreamExt;
use lease_router::ApplyConfig;
use lease_router::NatsConnection;
use lease_router::SubjectPrefix;
use lease_router::{
    ensure_stream, CatchUpState, EnsureStreamError, JetStreamIngress, LeaseStreamConfig,
};
use lease_router::{DropReason, IngressStats};
use lease_router::{Router, RouterConfig};
use lease_router_testkit::NatsCluster;

use lease_router::wire::{self, Envelope, LeaseEvent};
use tokio_util::task::TaskTracker;

const NO_EXPIRY: Duration = Duration::from_secs(3600);

fn stream_config(replicas: usize) -> LeaseStreamConfig {
    LeaseStreamConfig::new(SubjectPrefix::default(), NO_EXPIRY).with_replicas(replicas)
}

struct DurableHarness {
    router: Router,
    stats: Arc<IngressStats>,
    catch_up: Arc<CatchUpState>,
}

async fn durable_router(
    conn: &NatsConnection,
    deployment: &str,
    replicas: usize,
) -> DurableHarness {
    durable_router_scanning(conn, deployment, replicas, NO_EXPIRY).await
}

async fn durable_router_scanning(
    conn: &NatsConnection,
    deployment: &str,
    replicas: usize,
    scan_interval: Duration,
) -> DurableHarness {
    let stats = Arc::new(IngressStats::new());
    let catch_up = Arc::new(CatchUpState::new());
    let ingress = JetStreamIngress::new(
        conn.client().clone(),
        subjects(deployment),
        stream_config(replicas),
        ApplyConfig::default(),
        stats.clone(),
        catch_up.clone(),
    );
    let router = Router::start_tracked(
        RouterConfig::new(deployment).with_scan_interval(scan_interval),
        ingress,
        TaskTracker::new(),
    )
    .await
    .expect("durable router starts");
    DurableHarness {
        router,
        stats,
        catch_up,
    }
}

/// Publishes envelopes to JetStream with `Nats-Msg-Id` = publisher id and sequence, many
/// acks in flight, retrying each until it is acknowledged: what a durable worker does.
struct JsPublisher {
    js: jetstream::Context,
    raw: RawPublisher,
}

impl JsPublisher {
    fn new(client: async_nats::Client, deployment: &str, publisher_id: u64) -> Self {
        Self {
            js: jetstream::new(client.clone()),
            raw: RawPublisher::new(client, deployment, publisher_id),
        }
    }

    /// Sends in order with up to 1,000 acknowledgements outstanding; an event whose
    /// acknowledgement fails is re-sent (same `Nats-Msg-Id`) until it is stored.
    async fn publish_all(&mut self, events: Vec<LeaseEvent>) {
        let mut in_flight = std::collections::VecDeque::new();
        for event in events {
            let env = self.raw.envelope(event);
            let subject = self.raw.subjects.worker_subject(env.event.worker_id());
            let ack = self
                .js
                .publish_with_headers(subject.clone(), msg_id_headers(&env), encoded(&env))
                .await
                .ok();
            in_flight.push_back((subject, env, ack));
            if in_flight.len() >= 1000 {
                let (subject, env, ack) = in_flight.pop_front().unwrap();
                if !acked(ack).await {
                    // The cluster is electing: re-send everything outstanding at once rather
                    // than waiting out one acknowledgement timeout after another.
                    in_flight.push_front((subject, env, None));
                    self.resend_all(&mut in_flight).await;
                }
            }
        }
        let pending: Vec<_> = in_flight.drain(..).collect();
        let failed: std::collections::VecDeque<_> = futures::stream::iter(pending)
            .map(|(subject, env, ack)| async move {
                (!acked(ack).await).then_some((subject, env, None))
            })
            .buffer_unordered(1000)
            .filter_map(|x| async move { x })
            .collect()
            .await;
        let mut failed = failed;
        self.resend_all(&mut failed).await;
    }

    /// Re-sends every outstanding event (same `Nats-Msg-Id`) until each is stored.
    async fn resend_all(
        &self,
        in_flight: &mut std::collections::VecDeque<(
            String,
            Envelope,
            Option<jetstream::context::PublishAckFuture>,
        )>,
    ) {
        let outstanding: Vec<_> = in_flight.drain(..).collect();
        futures::stream::iter(outstanding)
            .map(|(subject, env, _)| {
                let js = self.js.clone();
                async move { publish_until_acked(&js, subject, &env).await }
            })
            .buffer_unordered(256)
            .collect::<Vec<()>>()
            .await;
    }
}

async fn acked(ack: Option<jetstream::context::PublishAckFuture>) -> bool {
    match ack {
        Some(ack) => tokio::time::timeout(Duration::from_secs(5), ack)
            .await
            .is_ok_and(|a| a.is_ok()),
        None => false,
    }
}

fn encoded(env: &Envelope) -> Bytes {
    Bytes::from(wire::encode(env).unwrap())
}

fn msg_id_headers(env: &Envelope) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        "Nats-Msg-Id",
        format!("{}-{}", env.publisher_id, env.sequence).as_str(),
    );
    headers
}

async fn publish_until_acked(js: &jetstream::Context, subject: String, env: &Envelope) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let acked = match js
            .publish_with_headers(subject.clone(), msg_id_headers(env), encoded(env))
            .await
        {
            Ok(ack) => tokio::time::timeout(Duration::from_secs(5), ack)
                .await
                .is_ok_and(|a| a.is_ok()),
            Err(_) => false,
        };
        if acked {
            return;
        }
        assert!(Instant::now() < deadline, "publish never acknowledged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn lifecycle_events(
    prefix: &str,
    n: usize,
    complete_every: usize,
) -> (Vec<LeaseEvent>, HashSet<String>) {
    let mut events = Vec::new();
    let mut live = HashSet::new();
    for i in 0..n {
        let id = format!("{prefix}-{i}");
        let worker = (i % 64) as u64;
        events.push(admitted(&id, worker, 10).into());
        if complete_every > 0 && i % complete_every == 0 {
            events.push(completed(&id, worker).into());
        } else {
            live.insert(id);
        }
    }
    (events, live)
}

fn live_ids(router: &Router) -> HashSet<String> {
    router
        .manager()
        .leases(usize::MAX)
        .into_iter()
        .map(|l| l.booking.request_id.as_str().to_string())
        .collect()
}

/// A bare ordered consumer that only decodes: the replay ceiling.
async fn raw_replay_rate(client: &async_nats::Client, deployment: &str, expected: u64) -> f64 {
    let js = jetstream::new(client.clone());
    let stream = js
        .get_stream(lease_router::stream_name(&SubjectPrefix::default()))
        .await
        .unwrap();
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: subjects(deployment).deployment_filter(),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let started = Instant::now();
    let mut n = 0u64;
    while n < expected {
        let m = tokio::time::timeout(BOUND, messages.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        wire::decode(&m.payload, wire::DEFAULT_MAX_EVENT_BYTES).unwrap();
        n += 1;
    }
    n as f64 / started.elapsed().as_secs_f64()
}

/// A JetStream server whose lease stream already holds `n` admissions for `deployment`
/// (published while no router ran); returns it, a connection and the live request ids.
async fn stream_with_live_leases(
    deployment: &str,
    n: usize,
) -> (
    lease_router_testkit::NatsServer,
    NatsConnection,
    HashSet<String>,
) {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    ensure_stream(&jetstream::new(conn.client().clone()), &stream_config(1))
        .await
        .unwrap();
    let (events, live) = lifecycle_events(deployment, n, 0);
    JsPublisher::new(conn.client().clone(), deployment, 1)
        .publish_all(events)
        .await;
    (server, conn, live)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_replica_catches_up_on_100k_live_leases() {
    const LEASES: usize = 100_000;
    // Published while no router runs.
    let (_server, conn, live) = stream_with_live_leases("catchup", LEASES).await;

    let raw_rate = raw_replay_rate(conn.client(), "catchup", LEASES as u64).await;
    let started = Instant::now();
    let h = durable_router(&conn, "catchup", 1).await;
    tokio::time::timeout(Duration::from_secs(120), h.catch_up.wait())
        .await
        .expect("catches up");
    let took = started.elapsed();
    let rate = LEASES as f64 / took.as_secs_f64();
    println!(
        "catch-up of {LEASES} leases: {:.2} s ({rate:.0} events/s); raw JetStream replay: {raw_rate:.0} events/s; ratio {:.2}",
        took.as_secs_f64(),
        rate / raw_rate
    );
    assert_eq!(h.catch_up.replayed(), LEASES as u64);
    assert_eq!(h.router.manager().active_leases(), LEASES);
    assert_eq!(live_ids(&h.router), live);
    assert_eq!(h.stats.snapshot().dropped_total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_during_catch_up_are_applied_exactly_once() {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    ensure_stream(&jetstream::new(conn.client().clone()), &stream_config(1))
        .await
        .unwrap();
    let (before, mut live) = lifecycle_events("before", 30_000, 3);
    JsPublisher::new(conn.client().clone(), "seam", 1)
        .publish_all(before.clone())
        .await;

    // Publish more while the router replays.
    let publisher_conn = client(&server.url()).await;
    let (during, live_during) = lifecycle_events("during", 5_000, 3);
    let during_count = during.len() as u64;
    let publishing = tokio::spawn({
        let client = publisher_conn.client().clone();
        async move {
            JsPublisher::new(client, "seam", 2)
                .publish_all(during)
                .await
        }
    });
    let h = durable_router(&conn, "seam", 1).await;
    publishing.await.unwrap();
    live.extend(live_during);
    let total = before.len() as u64 + during_count;
    let stats = h.stats.clone();
    assert!(
        eventually(Duration::from_secs(60), || async {
            stats.snapshot().received >= total
        })
        .await
    );
    assert!(h.catch_up.is_caught_up());
    let s = stats.snapshot();
    assert_eq!(s.received, total, "nothing twice: {s:?}");
    assert_eq!(s.applied_total(), total, "{s:?}");
    assert_eq!(s.dropped(DropReason::Duplicate), 0);
    assert_eq!(live_ids(&h.router), live);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_durable_publish_is_stored_once() {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let js = jetstream::new(conn.client().clone());
    let stream = ensure_stream(&js, &stream_config(1)).await.unwrap();
    let mut raw = RawPublisher::new(conn.client().clone(), "retry", 5);
    let env = raw.envelope(admitted("once", 1, 1));
    let subject = raw.subjects.worker_subject(1);
    publish_until_acked(&js, subject.clone(), &env).await;
    publish_until_acked(&js, subject, &env).await;
    let mut stream = stream;
    assert_eq!(stream.info().await.unwrap().state.messages, 1);

    // Ensuring the stream again (another replica starting) is idempotent.
    ensure_stream(&js, &stream_config(1)).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_without_jetstream_gives_a_clear_error() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let err = ensure_stream(&jetstream::new(conn.client().clone()), &stream_config(1))
        .await
        .expect_err("no JetStream");
    assert!(
        matches!(err, EnsureStreamError::JetStreamUnavailable),
        "{err}"
    );
    assert!(err.to_string().contains("-js"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_ingress_survives_a_server_restart() {
    let mut server = js_server().await;
    let conn = client(&server.url()).await;
    let h = durable_router(&conn, "restart", 1).await;
    let publisher_conn = client(&server.url()).await;
    let (first, mut live) = lifecycle_events("first", 2_000, 4);
    JsPublisher::new(publisher_conn.client().clone(), "restart", 1)
        .publish_all(first.clone())
        .await;
    let stats = h.stats.clone();
    assert!(
        eventually(BOUND, || async {
            stats.snapshot().received == first.len() as u64
        })
        .await
    );

    server.kill().await;
    server.restart().await.expect("restarts with its store");
    let (second, live_second) = lifecycle_events("second", 2_000, 4);
    JsPublisher::new(publisher_conn.client().clone(), "restart", 2)
        .publish_all(second.clone())
        .await;
    live.extend(live_second);
    let total = (first.len() + second.len()) as u64;
    assert!(
        eventually(Duration::from_secs(60), || async {
            stats.snapshot().applied_total() >= total
        })
        .await,
        "{:?}",
        stats.snapshot()
    );
    let s = stats.snapshot();
    assert_eq!(s.received, total, "{s:?}");
    assert_eq!(s.dropped_total(), 0, "{s:?}");
    assert_eq!(live_ids(&h.router), live);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_expire_while_the_durable_ingress_waits_for_nats() {
    let mut server = js_server().await;
    let conn = client(&server.url()).await;
    // Long enough that the leases expire only once the ingress has given up on its consumer
    // (it checks every 2 s) and is recreating it: the reaper's steps must be served there too.
    let scan = Duration::from_secs(5);
    let h = durable_router_scanning(&conn, "outage", 1, scan).await;
    let (events, live) = lifecycle_events("outage", 40, 2);
    JsPublisher::new(client(&server.url()).await.client().clone(), "outage", 1)
        .publish_all(events)
        .await;
    let manager = h.router.manager().clone();
    assert!(
        eventually(BOUND, || async { manager.active_leases() == live.len() }).await,
        "{:?}",
        h.stats.snapshot()
    );
    // NATS goes away for good: the ingress waits for it (and recreates its consumer in
    // vain), and the reaper's steps, which it serves, still run.
    server.kill().await;
    assert!(
        eventually(4 * scan + BOUND, || async { manager.active_leases() == 0 }).await,
        "leases left: {}",
        manager.active_leases()
    );
    assert_eq!(manager.stats().expired, live.len() as u64);
}

/// Publishes `events` in batches, killing the node the router is connected to after the
/// first batch; returns the live set of a reference that saw everything.
async fn publish_through_failover(
    cluster: &mut NatsCluster,
    router_conn: &NatsConnection,
    publisher: &mut JsPublisher,
    prefix: &str,
) -> HashSet<String> {
    let (events, live) = lifecycle_events(prefix, 6_000, 3);
    let half = events.len() / 2;
    publisher.publish_all(events[..half].to_vec()).await;
    let url = router_conn.server_url().expect("connected");
    let port: u16 = url
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let node = cluster.node_by_port(port).expect("the router's node");
    cluster.kill(node).await;
    publisher.publish_all(events[half..].to_vec()).await;
    live
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_durable_ends_with_exact_leases() {
    init_tracing();
    let mut cluster = NatsCluster::start(3, true)
        .await
        .expect("three-node cluster");
    let urls = cluster.urls();
    let router_conn = client_of(&urls).await;
    ensure_stream(
        &jetstream::new(router_conn.client().clone()),
        &stream_config(3),
    )
    .await
    .unwrap();
    let h = durable_router(&router_conn, "cluster", 3).await;
    let publisher_conn = client_of(&urls).await;
    let mut publisher = JsPublisher::new(publisher_conn.client().clone(), "cluster", 77);

    let live = publish_through_failover(&mut cluster, &router_conn, &mut publisher, "c").await;
    let total = publisher.raw.next_seq - 1;
    let stats = h.stats.clone();
    // Re-sent events may land after newer ones (the tombstones sort that out), and a stream
    // may hold a re-sent event twice after a leader change (the sequence window drops the
    // copy): judge by the leases, which must end exactly as the reference's.
    let router = &h.router;
    let converged = eventually(Duration::from_secs(90), || async {
        stats.snapshot().received >= total && live_ids(router) == live
    })
    .await;
    let s = stats.snapshot();
    assert!(converged, "leases differ from the reference: {s:?}");
    assert!(s.received >= total, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_core_counts_gap_and_converges_after_expiry() {
    init_tracing();
    let mut cluster = NatsCluster::start(3, false)
        .await
        .expect("three-node cluster");
    let urls = cluster.urls();
    let router_conn = client_of(&urls).await;
    let scan = Duration::from_millis(300);
    let h = router(&router_conn, "core-cluster", scan, ApplyConfig::default()).await;
    let publisher_conn = client_of(&urls).await;
    let mut p = RawPublisher::new(publisher_conn.client().clone(), "core-cluster", 88);

    // Live leases that the workers keep renewing, then a failover during which events are
    // lost (the router is away), then renewals again.
    for i in 0..200 {
        p.send(admitted(&format!("k{i}"), i % 8, 1)).await;
    }
    p.flush().await;
    let manager = h.router.manager().clone();
    assert!(eventually(BOUND, || async { manager.active_leases() == 200 }).await);
    let url = router_conn.server_url().unwrap();
    let port: u16 = url
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap();
    cluster.kill(cluster.node_by_port(port).unwrap()).await;
    // While the router reconnects, half of the requests complete: those events are lost.
    p.next_seq += 100;
    assert!(
        eventually(BOUND, || async {
            router_conn.is_connected() && router_conn.stats().reconnects() >= 1
        })
        .await
    );
    // The surviving half keeps renewing; the rest is never heard of again.
    let renew = tokio::spawn({
        let client = p.client.clone();
        let subjects = p.subjects.clone();
        let mut seq = p.next_seq;
        async move {
            loop {
                for i in 100..200u64 {
                    let env = Envelope::new(
                        88,
                        seq,
                        wire::unix_micros_now(),
                        progressed(&format!("k{i}"), i % 8),
                    );
                    seq += 1;
                    let _ = client
                        .publish(
                            subjects.worker_subject(i % 8),
                            wire::encode(&env).unwrap().into(),
                        )
                        .await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let stats = h.stats.clone();
    assert!(
        eventually(BOUND, || async { stats.snapshot().gaps >= 100 }).await,
        "{:?}",
        stats.snapshot()
    );
    assert!(
        eventually(BOUND, || async { manager.active_leases() == 100 }).await,
        "converged after expiry"
    );
    let expected: HashSet<String> = (100..200).map(|i| format!("k{i}")).collect();
    assert_eq!(live_ids(&h.router), expected);
    renew.abort();
}

async fn client_of(urls: &[String]) -> NatsConnection {
    lease_router::connect(
        &lease_router::NatsConnectConfig::new(urls.iter().cloned())
            .with_connect_deadline(Duration::from_secs(10)),
    )
    .await
    .expect("connects to the cluster")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_published_while_no_router_ran_are_there_when_one_starts() {
    use lease_router::{LeasePublisher, PublisherConfig};
    let server = js_server().await;
    let conn = client(&server.url()).await;
    ensure_stream(&jetstream::new(conn.client().clone()), &stream_config(1))
        .await
        .unwrap();
    let publisher = LeasePublisher::start_durable(
        conn.client().clone(),
        subjects("offline"),
        PublisherConfig::default(),
        256,
    );
    let mut live = HashSet::new();
    for i in 0..3_000u64 {
        let id = format!("offline-{i}");
        publisher
            .admitted(id.clone(), i % 16, 0, 100, None)
            .unwrap();
        if i % 5 == 0 {
            publisher
                .completed(id, i % 16, 0, wire::Outcome::Finished)
                .unwrap();
        } else {
            live.insert(id);
        }
    }
    let stats = tokio::time::timeout(BOUND, publisher.close())
        .await
        .expect("close is bounded")
        .expect("every publish acknowledged");
    assert_eq!(stats.published, 3_600);

    let h = durable_router(&conn, "offline", 1).await;
    tokio::time::timeout(BOUND, h.catch_up.wait())
        .await
        .expect("catches up");
    assert_eq!(h.catch_up.replayed(), 3_600);
    assert_eq!(live_ids(&h.router), live);
    let s = h.stats.snapshot();
    assert_eq!(s.applied_total(), 3_600, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosted_durable_deployment_is_not_ready_until_caught_up() {
    use lease_router::service::{DeploymentHost, HostSettings};
    use lease_router::DeploymentName;
    const EVENTS: usize = 60_000;
    let (_server, conn, live) = stream_with_live_leases("hosted", EVENTS).await;

    let settings = HostSettings {
        lease_scan_interval: NO_EXPIRY,
        durable: Some(stream_config(1)),
        ..HostSettings::default()
    };
    let host = DeploymentHost::new(conn.clone(), settings);
    let name = DeploymentName::new("hosted").unwrap();
    host.add(&name).await.expect("durable deployment starts");
    let not_ready = host.not_ready();
    assert!(
        not_ready
            .iter()
            .any(|(n, why)| n == &name && why.contains("catching up")),
        "a replaying deployment is not ready: {not_ready:?}"
    );
    assert!(eventually(Duration::from_secs(60), || async { host.is_ready() }).await);
    let view = host.get(&name).unwrap();
    assert_eq!(view.manager().active_leases(), live.len());
    // A view holds the manager: let it go before shutting down.
    drop(view);
    let metrics = host.metrics_snapshot();
    let catch_up = metrics.deployments[0].catch_up.expect("durable");
    assert!(catch_up.done);
    assert_eq!(catch_up.replayed, EVENTS as u64);
    host.shutdown_all().await.unwrap();
}

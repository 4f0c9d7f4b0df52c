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
use lease_router::{
    ensure_stream, stream_name, CatchUpState, EnsureStreamError, JetStreamIngress,
    LeaseStreamConfig,
};
use lease_router::{DropReason, IngressStats, RouteRequest};
use lease_router::{Router, RouterConfig};
use lease_router_testkit::NatsCluster;

use lease_router::wire::{self, Envelope, LeaseEvent};
use tokio_util::task::TaskTracker;

const NO_EXPIRY: Duration = Duration::from_secs(3600);

fn stream_config(replicas: usize) -> LeaseStreamConfig {
    LeaseStreamConfig::new().with_replicas(replicas)
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
    durable_router_with(conn, deployment, stream_config(replicas), scan_interval).await
}

async fn durable_router_with(
    conn: &NatsConnection,
    deployment: &str,
    stream: LeaseStreamConfig,
    scan_interval: Duration,
) -> DurableHarness {
    durable_router_applying(
        conn,
        deployment,
        stream,
        scan_interval,
        ApplyConfig::default(),
    )
    .await
}

async fn durable_router_applying(
    conn: &NatsConnection,
    deployment: &str,
    stream: LeaseStreamConfig,
    scan_interval: Duration,
    apply: ApplyConfig,
) -> DurableHarness {
    let stats = Arc::new(IngressStats::new());
    let catch_up = Arc::new(CatchUpState::new());
    let ingress = JetStreamIngress::new(
        conn.client().clone(),
        subjects(deployment),
        stream,
        apply,
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

/// A bare ordered consumer that only decodes: the replay ceiling.
async fn raw_replay_rate(client: &async_nats::Client, deployment: &str, expected: u64) -> f64 {
    let js = jetstream::new(client.clone());
    let stream = js
        .get_stream(lease_router::stream_name(&subjects(deployment)))
        .await
        .unwrap();
    let consumer = stream
        // Unfiltered, as the router's replay consumer is (the stream holds only this
        // deployment's subjects).
        .create_consumer(consumer::pull::OrderedConfig::default())
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
    ensure_stream(
        &jetstream::new(conn.client().clone()),
        &stream_config(1),
        &subjects(deployment),
    )
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

    // The replay consumer takes the whole stream, unfiltered: with a filter that selects every
    // message anyway, nats-server 2.9 counted pending messages by scanning the stream, at
    // times once per delivered message, and a replay crawled at 150-250 events/s.
    let stream = jetstream::new(conn.client().clone())
        .get_stream(lease_router::stream_name(&subjects("catchup")))
        .await
        .expect("the deployment's stream");
    let consumers: Vec<_> = stream
        .consumers()
        .map(|info| info.expect("consumer info"))
        .collect()
        .await;
    assert!(!consumers.is_empty(), "the router's replay consumer");
    for info in &consumers {
        assert_eq!(info.config.filter_subject, "", "{:?}", info.config);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_during_catch_up_are_applied_exactly_once() {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    ensure_stream(
        &jetstream::new(conn.client().clone()),
        &stream_config(1),
        &subjects("seam"),
    )
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
    let stream = ensure_stream(&js, &stream_config(1), &subjects("retry"))
        .await
        .unwrap();
    let mut raw = RawPublisher::new(conn.client().clone(), "retry", 5);
    let env = raw.envelope(admitted("once", 1, 1));
    let subject = raw.subjects.worker_subject(1);
    publish_until_acked(&js, subject.clone(), &env).await;
    publish_until_acked(&js, subject, &env).await;
    let mut stream = stream;
    assert_eq!(stream.info().await.unwrap().state.messages, 1);

    // Ensuring the stream again (another replica starting) is idempotent.
    ensure_stream(&js, &stream_config(1), &subjects("retry"))
        .await
        .unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
}

/// Where the server compresses streams (2.10 and later) the lease stream is S2-compressed,
/// and turning compression off or on again updates a stream that exists; an older server
/// (Debian's 2.9.10) gets a stream without the setting, and ensuring it again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_is_compressed_where_the_server_can() {
    use async_nats::jetstream::stream::Compression;
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let js = jetstream::new(conn.client().clone());
    let compresses = conn.client().is_server_compatible(2, 10, 0);
    let on = stream_config(1);
    assert!(on.compression(), "on by default");
    let compression = |stream: &async_nats::jetstream::stream::Stream| {
        stream
            .cached_info()
            .config
            .compression
            .clone()
            .unwrap_or(Compression::None)
    };
    let created = ensure_stream(&js, &on, &subjects("s2")).await.unwrap();
    let expected = if compresses {
        Compression::S2
    } else {
        Compression::None
    };
    assert_eq!(compression(&created), expected);
    let off = ensure_stream(&js, &on.clone().with_compression(false), &subjects("s2"))
        .await
        .unwrap();
    assert_eq!(compression(&off), Compression::None);
    let again = ensure_stream(&js, &on, &subjects("s2")).await.unwrap();
    assert_eq!(compression(&again), expected, "updated back");
    // Events go into a compressed stream alike, and its byte count (what `max_bytes` and the
    // `stream_bytes` metric compare) is of the events as published, not of the compressed
    // blocks: README's sizing arithmetic holds either way.
    let mut raw = RawPublisher::new(conn.client().clone(), "s2", 5);
    let mut payload_bytes = 0;
    for i in 0..200 {
        let env = raw.envelope(admitted(&format!("squeezed-{i}"), 1, 1));
        payload_bytes += wire::encode(&env).unwrap().len() as u64;
        publish_until_acked(&js, raw.subjects.worker_subject(1), &env).await;
    }
    let mut stream = js.get_stream(stream_name(&subjects("s2"))).await.unwrap();
    let state = &stream.info().await.unwrap().state;
    assert_eq!(state.messages, 200);
    assert!(
        state.bytes > payload_bytes,
        "{} bytes counted for {payload_bytes} bytes of events",
        state.bytes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_without_jetstream_gives_a_clear_error() {
    let server = server().await;
    let conn = client(&server.url()).await;
    let err = ensure_stream(
        &jetstream::new(conn.client().clone()),
        &stream_config(1),
        &subjects("nojs"),
    )
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
    // A cluster just formed may still be electing its JetStream leaders: a request then
    // times out, and is retried as the durable ingress retries it.
    let js = jetstream::new(router_conn.client().clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match ensure_stream(&js, &stream_config(3), &subjects("cluster")).await {
            Ok(_) => break,
            Err(e @ (EnsureStreamError::Create { .. } | EnsureStreamError::Lookup { .. }))
                if Instant::now() < deadline =>
            {
                eprintln!("the cluster is not ready yet: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("the stream on a three-node cluster: {e}"),
        }
    }
    // With snapshots written every 200 ms through the failover (their buckets replicated
    // three times too).
    let h = durable_router_with(
        &router_conn,
        "cluster",
        snapshotting().with_replicas(3),
        NO_EXPIRY,
    )
    .await;
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
    let catch_up = h.catch_up.clone();
    assert!(
        eventually(Duration::from_secs(30), || async {
            catch_up.snapshot_figures().written >= 1
        })
        .await,
        "snapshots are written after the failover: {:?}",
        catch_up.snapshot_figures()
    );
    // A replica that starts now loads a snapshot written through the failover.
    let late = durable_router_with(
        &router_conn,
        "cluster",
        snapshotting().with_replicas(3),
        NO_EXPIRY,
    )
    .await;
    tokio::time::timeout(Duration::from_secs(60), late.catch_up.wait())
        .await
        .expect("catches up");
    let router = &late.router;
    assert!(
        eventually(Duration::from_secs(30), || async {
            live_ids(router) == live
        })
        .await,
        "{:?}",
        late.catch_up.snapshot_figures()
    );
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
    ensure_stream(
        &jetstream::new(conn.client().clone()),
        &stream_config(1),
        &subjects("offline"),
    )
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
    let metrics = host.figures();
    let catch_up = metrics.deployments[0].catch_up.expect("durable");
    assert!(catch_up.done);
    assert_eq!(catch_up.replayed, EVENTS as u64);
    host.shutdown_all().await.unwrap();
}

/// A publisher with a deep acknowledgement window: its first event is stored only after
/// more than a sequence window (4,096) of its later events. JetStream stored it once, so
/// durable mode applies it, live and when a late replica replays the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stored_behind_the_sequence_window_is_applied_live_and_on_replay() {
    const LATER: usize = 5_000;
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let live_router = durable_router(&conn, "deep", 1).await;
    let mut raw = RawPublisher::new(conn.client().clone(), "deep", 42);
    let first = raw.envelope(admitted("deep-first", 1, 10));
    let later: Vec<Envelope> = (0..LATER)
        .map(|i| raw.envelope(admitted(&format!("deep-{i}"), (i % 8) as u64, 10)))
        .collect();
    let js = jetstream::new(conn.client().clone());
    for env in later.iter().chain(std::iter::once(&first)) {
        let subject = raw.subjects.worker_subject(env.event.worker_id());
        publish_until_acked(&js, subject, env).await;
    }
    let mut expected: HashSet<String> = (0..LATER).map(|i| format!("deep-{i}")).collect();
    expected.insert("deep-first".into());

    let stats = live_router.stats.clone();
    assert!(
        eventually(BOUND, || async {
            stats.snapshot().received == LATER as u64 + 1
        })
        .await,
        "{:?}",
        stats.snapshot()
    );
    let s = stats.snapshot();
    assert_eq!(s.dropped(DropReason::Stale), 0, "live: {s:?}");
    assert_eq!(live_ids(&live_router.router), expected, "live");

    let late = durable_router(&conn, "deep", 1).await;
    tokio::time::timeout(BOUND, late.catch_up.wait())
        .await
        .expect("catches up");
    let s = late.stats.snapshot();
    assert_eq!(s.dropped(DropReason::Stale), 0, "replayed: {s:?}");
    assert_eq!(live_ids(&late.router), expected, "replayed");
}

/// One stream per deployment, created when the deployment is added, kept when it is
/// removed (other replicas still need it), deleted only on request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_deployment_has_its_own_stream_kept_until_deleted_on_request() {
    use lease_router::service::{DeploymentHost, HostSettings};
    use lease_router::{
        delete_stream, require_stream, stream_name, DeploymentName, RequireStreamError,
    };
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let js = jetstream::new(conn.client().clone());
    let settings = HostSettings {
        lease_scan_interval: NO_EXPIRY,
        durable: Some(stream_config(1)),
        ..HostSettings::default()
    };
    let host = DeploymentHost::new(conn.clone(), settings);
    for name in ["alpha", "beta"] {
        host.add(&DeploymentName::new(name).unwrap()).await.unwrap();
    }
    for name in ["alpha", "beta"] {
        let mut stream = require_stream(&js, &subjects(name)).await.expect("created");
        let info = stream.info().await.unwrap();
        assert_eq!(info.config.name, format!("LEASE_ROUTER_leases__{name}"));
        assert_eq!(info.config.subjects, vec![format!("leases.{name}.>")]);
    }
    // Events of one deployment land in its stream only.
    JsPublisher::new(conn.client().clone(), "alpha", 1)
        .publish_all(lifecycle_events("a", 10, 0).0)
        .await;
    let messages = |name: &'static str| {
        let js = js.clone();
        async move {
            js.get_stream(stream_name(&subjects(name)))
                .await
                .unwrap()
                .info()
                .await
                .unwrap()
                .state
                .messages
        }
    };
    assert_eq!((messages("alpha").await, messages("beta").await), (10, 0));

    host.remove(&DeploymentName::new("alpha").unwrap())
        .await
        .unwrap();
    assert_eq!(messages("alpha").await, 10, "removal keeps the stream");
    assert!(delete_stream(&js, &subjects("alpha")).await.unwrap());
    assert!(!delete_stream(&js, &subjects("alpha")).await.unwrap());
    let err = require_stream(&js, &subjects("alpha"))
        .await
        .expect_err("deleted");
    assert!(matches!(err, RequireStreamError::Missing { .. }), "{err:?}");
    host.shutdown_all().await.unwrap();
}

/// A durable publisher whose deployment has no stream is told which stream and how to get
/// it; so is one beside an installation's single stream, and a router refuses to start
/// there, saying what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_legacy_stream_is_refused_with_what_to_do() {
    use lease_router::service::{DeploymentHost, HostSettings};
    use lease_router::{
        legacy_stream_name, require_stream, DeploymentName, RequireStreamError, SubjectPrefix,
    };
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let js = jetstream::new(conn.client().clone());
    let err = require_stream(&js, &subjects("nowhere"))
        .await
        .expect_err("no stream");
    let m = err.to_string();
    assert!(
        m.contains("LEASE_ROUTER_leases__nowhere")
            && m.contains("leases.nowhere.>")
            && m.contains("serve --durable --deployment nowhere"),
        "{m}"
    );

    // The single stream of a previous version, over every deployment.
    let legacy = legacy_stream_name(&SubjectPrefix::default());
    js.create_stream(jetstream::stream::Config {
        name: legacy.clone(),
        subjects: vec!["leases.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let err = require_stream(&js, &subjects("old"))
        .await
        .expect_err("legacy");
    assert!(matches!(err, RequireStreamError::Legacy(_)), "{err:?}");
    let host = DeploymentHost::new(
        conn.clone(),
        HostSettings {
            durable: Some(stream_config(1)),
            ..HostSettings::default()
        },
    );
    let err = host
        .add(&DeploymentName::new("old").unwrap())
        .await
        .expect_err("refused beside the legacy stream");
    let m = format!("{:#}", error_chain(&err));
    assert!(
        m.contains(&format!("nats stream rm {legacy}")) && m.contains("stop the durable routers"),
        "{m}"
    );
    assert!(host.names().is_empty(), "nothing left behind");
    host.shutdown_all().await.unwrap();
}

/// An error with its sources, as a CLI would print it.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// A stream too small for its traffic discards events a late replica needs: the replica
/// counts them, lists the deployment as degraded on `/readyz`'s terms, exports the stream's
/// bytes next to its limit, and serves from what the stream still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_stream_is_told_counted_and_the_replica_starts_from_what_it_has() {
    use lease_router::service::{DeploymentHost, HostSettings, Metrics};
    use lease_router::{stream_name, DeploymentName};
    const MAX_BYTES: i64 = 64 * 1024;
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let js = jetstream::new(conn.client().clone());
    let config = stream_config(1).with_max_bytes(MAX_BYTES);
    ensure_stream(&js, &config, &subjects("small"))
        .await
        .unwrap();
    let (events, _) = lifecycle_events("small", 3_000, 0);
    JsPublisher::new(conn.client().clone(), "small", 1)
        .publish_all(events)
        .await;
    let info = js
        .get_stream(stream_name(&subjects("small")))
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    let (first, held) = (info.state.first_sequence, info.state.messages);
    assert!(first > 1, "the limit discarded the oldest events: {info:?}");

    let host = DeploymentHost::new(
        conn.clone(),
        HostSettings {
            lease_scan_interval: NO_EXPIRY,
            durable: Some(config),
            ..HostSettings::default()
        },
    );
    let name = DeploymentName::new("small").unwrap();
    host.add(&name).await.unwrap();
    assert!(
        eventually(BOUND, || async { host.is_ready() }).await,
        "ready from what the stream holds: {:?}",
        host.not_ready()
    );
    let view = host.get(&name).unwrap();
    assert_eq!(view.manager().active_leases() as u64, held);
    drop(view);
    let degraded = host.degraded();
    assert_eq!(degraded.len(), 1, "{degraded:?}");
    assert!(
        degraded[0].1.contains(&format!("{} event(s)", first - 1)),
        "{degraded:?}"
    );
    let metrics = Metrics::new(host.clone());
    let scraped = eventually(Duration::from_secs(15), || async {
        metrics.encode().contains(&format!(
            "lease_router_stream_max_bytes{{deployment=\"small\"}} {MAX_BYTES}"
        ))
    })
    .await;
    let text = metrics.encode();
    assert!(scraped, "{text}");
    assert!(
        text.contains(&format!(
            "lease_router_stream_truncated_events_total{{deployment=\"small\"}} {}",
            first - 1
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "lease_router_stream_messages{{deployment=\"small\"}} {held}"
        )),
        "{text}"
    );
    assert!(
        text.contains(
            "lease_router_catchup_snapshot_fallbacks_total{deployment=\"small\",reason=\"missing\"} 1"
        ),
        "{text}"
    );
    host.shutdown_all().await.unwrap();
    assert_eq!(
        host.live_tasks(),
        0,
        "the stream monitor and the snapshot writer ended with their router"
    );
}

/// Snapshots every 200 ms; the stream keeps ten minutes (a test replaying everything after a
/// failed snapshot load must find everything, however slow the machine).
fn snapshotting() -> LeaseStreamConfig {
    stream_config(1).with_snapshots(Duration::from_millis(200), 3_000)
}

/// Waits until `writer` has stored a snapshot of the stream's first `count` events.
async fn snapshot_covers(writer: &DurableHarness, count: u64, what: &str) {
    let catch_up = writer.catch_up.clone();
    assert!(
        eventually(BOUND, || async {
            catch_up.snapshot_figures().last_sequence == count
        })
        .await,
        "{what}: {:?}",
        catch_up.snapshot_figures()
    );
}

/// A replica of `deployment` that starts now (snapshotting) and has caught up.
async fn late_replica(conn: &NatsConnection, deployment: &str) -> DurableHarness {
    let late = durable_router_with(conn, deployment, snapshotting(), NO_EXPIRY).await;
    tokio::time::timeout(BOUND, late.catch_up.wait())
        .await
        .expect("catches up");
    late
}

/// Events that leave leases with progress (output counts) and completions, for `workers`.
fn lifecycle_with_progress(prefix: &str, n: usize) -> (Vec<LeaseEvent>, HashSet<String>) {
    let mut events = Vec::new();
    let mut live = HashSet::new();
    for i in 0..n {
        let id = format!("{prefix}-{i}");
        let worker = (i % 16) as u64;
        events.push(admitted(&id, worker, 100 + i as u32 % 50).into());
        if i % 3 == 0 {
            let mut p = progressed(&id, worker);
            p.output_tokens = (i % 40) as u32;
            events.push(p.into());
        }
        if i % 4 == 0 {
            events.push(completed(&id, worker).into());
        } else {
            live.insert(id);
        }
    }
    (events, live)
}

fn sorted_loads(router: &Router) -> Vec<String> {
    let mut loads: Vec<String> = router
        .manager()
        .live_loads()
        .into_iter()
        .map(|(w, l)| format!("{w:?} {l:?}"))
        .collect();
    loads.sort();
    loads
}

/// A late replica loads the newest snapshot (leases with their load, sequence windows, the
/// stream sequence) and replays only the events after it, ending exactly as the writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_loads_the_newest_snapshot_and_replays_only_what_follows() {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let writer = durable_router_with(&conn, "snap", snapshotting(), NO_EXPIRY).await;
    let (events, mut live) = lifecycle_with_progress("before", 6_000);
    let before = events.len() as u64;
    // A completed request near the end: its admission, re-stored later, is a duplicate.
    let ended = "before-5996";
    let ended_seq = 1 + events
        .iter()
        .position(|e| matches!(e, LeaseEvent::Admitted(a) if a.request_id == ended))
        .unwrap() as u64;
    let ended_admission = events[ended_seq as usize - 1].clone();
    let mut publisher = JsPublisher::new(conn.client().clone(), "snap", 7);
    publisher.publish_all(events).await;
    snapshot_covers(&writer, before, "a snapshot of everything published").await;
    let (after, live_after) = lifecycle_with_progress("after", 500);
    let after_count = after.len() as u64;
    publisher.publish_all(after).await;
    live.extend(live_after);

    let late = late_replica(&conn, "snap").await;
    let figures = late.catch_up.snapshot_figures();
    assert!(
        figures.loaded_sequence >= before,
        "loaded a snapshot: {figures:?}"
    );
    assert!(
        late.catch_up.replayed() <= after_count,
        "replayed {} events, at most the {after_count} after the snapshot",
        late.catch_up.replayed()
    );
    let stats = writer.stats.clone();
    assert!(
        eventually(BOUND, || async {
            stats.snapshot().received == before + after_count
        })
        .await
    );
    assert_eq!(live_ids(&late.router), live);
    assert_eq!(live_ids(&writer.router), live);
    assert_eq!(sorted_loads(&late.router), sorted_loads(&writer.router));
    let s = late.stats.snapshot();
    assert_eq!(s.dropped_total(), 0, "{s:?}");
    assert_eq!(late.catch_up.truncated_events(), 0);

    // The restored windows know what was published before the snapshot: the admission of
    // an ended request, stored again (another message id, as after a failover), is a
    // duplicate for both replicas and revives nothing.
    let env = Envelope::new(7, ended_seq, wire::unix_micros_now(), ended_admission);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "stored-twice");
    jetstream::new(conn.client().clone())
        .publish_with_headers(
            subjects("snap").worker_subject(env.event.worker_id()),
            headers,
            encoded(&env),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    for (who, h) in [("writer", &writer), ("late", &late)] {
        let stats = h.stats.clone();
        assert!(
            eventually(BOUND, || async {
                stats.snapshot().dropped(DropReason::Duplicate) == 1
            })
            .await,
            "{who}: {:?}",
            stats.snapshot()
        );
        assert_eq!(live_ids(&h.router), live, "{who}");
    }
}

/// What the writer held for events out of order is in its snapshot: a replica started from
/// it judges the late admissions as the writer does. A completion that came before its
/// admission keeps the request ended (no lease revived), and progress that came before its
/// admission is applied when the admission comes (its output count in the load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_keeps_the_writers_tombstones_and_held_progress() {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let writer = durable_router_with(&conn, "held", snapshotting(), NO_EXPIRY).await;
    let mut early_progress = progressed("progress-first", 2);
    early_progress.output_tokens = 9;
    let before: Vec<LeaseEvent> = vec![
        admitted("steady", 1, 100).into(),
        completed("completion-first", 1).into(),
        early_progress.into(),
    ];
    let count = before.len() as u64;
    let mut publisher = JsPublisher::new(conn.client().clone(), "held", 3);
    publisher.publish_all(before).await;
    snapshot_covers(&writer, count, "a snapshot with both held").await;
    let late = late_replica(&conn, "held").await;
    assert_eq!(late.catch_up.snapshot_figures().loaded_sequence, count);
    assert_eq!(
        late.catch_up.replayed(),
        0,
        "everything came from the snapshot"
    );

    publisher
        .publish_all(vec![
            admitted("completion-first", 1, 100).into(),
            admitted("progress-first", 2, 100).into(),
        ])
        .await;
    let expected: HashSet<String> = ["steady", "progress-first"].map(String::from).into();
    for (who, h, received) in [("writer", &writer, count + 2), ("late", &late, 2)] {
        let stats = h.stats.clone();
        assert!(
            eventually(BOUND, || async {
                let s = stats.snapshot();
                s.received == received && s.accounted() == received && s.held == 0
            })
            .await,
            "{who}: {:?}",
            stats.snapshot()
        );
    }
    assert_eq!(live_ids(&writer.router), expected, "writer");
    assert_eq!(live_ids(&late.router), expected, "late: no lease revived");
    assert_eq!(
        sorted_loads(&late.router),
        sorted_loads(&writer.router),
        "the held output count applied on both"
    );
    let s = late.stats.snapshot();
    assert_eq!(
        (s.received, s.dropped(DropReason::Stale), s.held),
        (2, 1, 0),
        "the revival refused as stale; the restored entries stood for no event here: {s:?}"
    );
}

/// The prefix index is part of the snapshot: a late replica that replays nothing holds what
/// the writer learned from the stream, evicts in the same order, and decides alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_starts_with_the_writers_prefix_index() {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let writer = durable_router_with(&conn, "prefix", snapshotting(), NO_EXPIRY).await;
    let prompt = |conversation: u32, len: u32| -> Vec<u32> {
        (0..len).map(|i| conversation * 10_000 + i).collect()
    };
    let admitted_with = |rid: &str, worker: u64, tokens: &[u32]| wire::Admitted {
        block_hashes: lease_router::block_hashes(tokens, 16),
        ..admitted(rid, worker, tokens.len() as u32)
    };
    let events: Vec<LeaseEvent> = vec![
        admitted_with("a", 1, &prompt(1, 640)).into(),
        admitted_with("b", 2, &prompt(2, 320)).into(),
        admitted_with("c", 2, &prompt(1, 160)).into(),
        wire::Admitted {
            block_capacity: Some(12),
            class: None,
            ..admitted_with("d", 3, &prompt(3, 320))
        }
        .into(),
    ];
    let count = events.len() as u64;
    let mut publisher = JsPublisher::new(conn.client().clone(), "prefix", 3);
    publisher.publish_all(events).await;
    snapshot_covers(&writer, count, "a snapshot of every admission").await;
    let late = late_replica(&conn, "prefix").await;
    assert_eq!(
        late.catch_up.replayed(),
        0,
        "everything came from the snapshot"
    );
    let (w, l) = (
        writer.router.scheduler().prefix_figures(),
        late.router.scheduler().prefix_figures(),
    );
    assert_eq!(
        (w.entries, l.entries),
        (40 + 30 + 12, 40 + 30 + 12),
        "{w:?} {l:?}"
    );
    for conversation in 1..=3 {
        let hashes = lease_router::block_hashes(&prompt(conversation, 800), 16);
        let request = |id: &str| RouteRequest::new(id, 800).with_block_hashes(hashes.clone());
        let on_writer = writer.router.scheduler().route(request("w")).await.unwrap();
        let on_late = late.router.scheduler().route(request("l")).await.unwrap();
        assert_eq!(
            overlaps(&on_late),
            overlaps(&on_writer),
            "conversation {conversation}"
        );
        assert!(on_late.candidates.iter().any(|c| c.overlap_blocks > 0));
    }
}

/// In durable mode the holds count on the stream's clock: a replica replaying, in a few
/// milliseconds, events that the stream stored further apart than the hold judges them as
/// the replica that heard them live (on the wall clock it would still hold them: the
/// progress applied, the late admission kept out, and the replicas would differ).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_replica_times_the_holds_as_the_stream_stored_the_events() {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    const HOLD: Duration = Duration::from_millis(400);
    let apply = ApplyConfig {
        tombstone_ttl: HOLD,
        held_progress_ttl: HOLD,
        ..ApplyConfig::default()
    };
    let live =
        durable_router_applying(&conn, "clock", stream_config(1), NO_EXPIRY, apply.clone()).await;
    let mut early_progress = progressed("progress-first", 2);
    early_progress.output_tokens = 9;
    let mut publisher = JsPublisher::new(conn.client().clone(), "clock", 3);
    publisher
        .publish_all(vec![
            completed("completion-first", 1).into(),
            early_progress.into(),
        ])
        .await;
    tokio::time::sleep(HOLD * 3).await;
    publisher
        .publish_all(vec![
            admitted("completion-first", 1, 100).into(),
            admitted("progress-first", 2, 100).into(),
        ])
        .await;
    let stats = live.stats.clone();
    assert!(
        eventually(BOUND, || async {
            let s = stats.snapshot();
            s.received == 4 && s.accounted() == 4 && s.held == 0
        })
        .await,
        "{:?}",
        stats.snapshot()
    );
    let both: HashSet<String> = ["completion-first", "progress-first"]
        .map(String::from)
        .into();
    assert_eq!(
        live_ids(&live.router),
        both,
        "the holds ran out before the admissions"
    );

    let late = durable_router_applying(&conn, "clock", stream_config(1), NO_EXPIRY, apply).await;
    tokio::time::timeout(BOUND, late.catch_up.wait())
        .await
        .expect("catches up");
    assert_eq!(late.catch_up.replayed(), 4);
    assert_eq!(live_ids(&late.router), both, "late");
    assert_eq!(sorted_loads(&late.router), sorted_loads(&live.router));
    let s = late.stats.snapshot();
    assert_eq!(s.dropped(DropReason::Unmatched), 2, "{s:?}");
}

/// A snapshot that is garbage, or cut short, is not trusted: the replica replays the whole
/// stream, says why and counts it. No snapshot at all is counted as missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_partial_or_missing_snapshot_falls_back_to_replay() {
    use lease_router::snapshot_bucket;
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let js = jetstream::new(conn.client().clone());
    // Snapshots every hour: none is written during the test but the ones it plants.
    let config = stream_config(1).with_snapshots(Duration::from_secs(3600), 1);
    let first = durable_router_with(&conn, "bad", config.clone(), NO_EXPIRY).await;
    assert_eq!(first.catch_up.snapshot_figures().missing, 1, "none yet");
    let (events, live) = lifecycle_with_progress("bad", 2_000);
    let total = events.len() as u64;
    JsPublisher::new(conn.client().clone(), "bad", 3)
        .publish_all(events)
        .await;
    let store = js
        .get_object_store(snapshot_bucket(&subjects("bad")))
        .await
        .unwrap();
    for (what, bytes) in [
        ("garbage", b"not a snapshot at all".to_vec()),
        ("cut short", {
            let mut b = b"LRSNAP01".to_vec();
            b.extend_from_slice(&[0x93, 0x95, 0xa3]);
            b
        }),
    ] {
        store.put("snapshot", &mut bytes.as_slice()).await.unwrap();
        let late = durable_router_with(&conn, "bad", config.clone(), NO_EXPIRY).await;
        tokio::time::timeout(BOUND, late.catch_up.wait())
            .await
            .expect("catches up");
        let figures = late.catch_up.snapshot_figures();
        assert_eq!(
            (figures.invalid, figures.loaded_sequence),
            (1, 0),
            "{what}: {figures:?}"
        );
        assert_eq!(late.catch_up.replayed(), total, "{what}: the whole stream");
        assert_eq!(live_ids(&late.router), live, "{what}");
    }
}

/// Snapshot buckets that cannot be opened when a replica starts (here a stream that holds
/// their subjects; in a cluster under load, buckets not placed yet) are opened as soon as
/// they can be: each failed attempt is counted, and then snapshots are written, instead of
/// none for the replica's whole life.
#[tokio::test]
async fn snapshot_buckets_that_cannot_be_opened_at_start_are_opened_later() {
    use lease_router::snapshot_bucket;
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let js = jetstream::new(conn.client().clone());
    let bucket = snapshot_bucket(&subjects("late-open"));
    js.create_stream(jetstream::stream::Config {
        name: "blocks-the-snapshots".into(),
        subjects: vec![format!("$O.{bucket}.>")],
        ..Default::default()
    })
    .await
    .expect("a stream on the object store's subjects");
    let writer = durable_router_with(&conn, "late-open", snapshotting(), NO_EXPIRY).await;
    let (events, live) = lifecycle_with_progress("late-open", 200);
    let total = events.len() as u64;
    JsPublisher::new(conn.client().clone(), "late-open", 5)
        .publish_all(events)
        .await;
    let catch_up = writer.catch_up.clone();
    assert!(
        eventually(BOUND, || async { catch_up.snapshot_figures().failed >= 2 }).await,
        "each interval tries to open the buckets: {:?}",
        catch_up.snapshot_figures()
    );
    assert_eq!(catch_up.snapshot_figures().written, 0);

    js.delete_stream("blocks-the-snapshots")
        .await
        .expect("the blocking stream goes");
    snapshot_covers(&writer, total, "a snapshot once the buckets open").await;
    let late = late_replica(&conn, "late-open").await;
    let figures = late.catch_up.snapshot_figures();
    assert!(figures.loaded_sequence >= total, "{figures:?}");
    assert_eq!(live_ids(&late.router), live);
}

/// One writer per deployment: of two caught-up replicas one writes; when it goes, the other
/// takes over once the writer's entry has aged out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_snapshot_writer_at_a_time_and_another_takes_over() {
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let a = durable_router_with(&conn, "one", snapshotting(), NO_EXPIRY).await;
    let b = durable_router_with(&conn, "one", snapshotting(), NO_EXPIRY).await;
    JsPublisher::new(conn.client().clone(), "one", 1)
        .publish_all(lifecycle_events("one", 100, 0).0)
        .await;
    let (ca, cb) = (a.catch_up.clone(), b.catch_up.clone());
    assert!(
        eventually(BOUND, || async {
            ca.snapshot_figures().written + cb.snapshot_figures().written >= 5
        })
        .await
    );
    let (wa, wb) = (ca.snapshot_figures().written, cb.snapshot_figures().written);
    assert!(wa == 0 || wb == 0, "one writer: {wa} and {wb}");
    let (writer, other) = if wa > 0 { (a, cb) } else { (b, ca) };
    writer.router.shutdown().await.unwrap();
    let before = other.snapshot_figures().written;
    assert!(
        eventually(BOUND, || async {
            other.snapshot_figures().written > before
        })
        .await,
        "the other replica takes over: {:?}",
        other.snapshot_figures()
    );
}

/// On a three-node cluster with snapshots: the node that leads the snapshot bucket dies
/// before a late replica loads from it, and the snapshot writer is torn down at staggered
/// moments of its writes. Every late replica ends with exactly the leases of a reference that
/// was never interrupted, and never trusts a half-written snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_faults_on_a_cluster_end_with_the_reference_leases() {
    use lease_router::snapshot_bucket;
    init_tracing();
    let mut cluster = NatsCluster::start(3, true)
        .await
        .expect("three-node cluster");
    let urls = cluster.urls();
    let conn = client_of(&urls).await;
    let config = snapshotting().with_replicas(3);
    let reference = durable_router_with(&conn, "fault", config.clone(), NO_EXPIRY).await;
    let publisher_conn = client_of(&urls).await;
    let mut publisher = JsPublisher::new(publisher_conn.client().clone(), "fault", 5);
    let (events, mut live) = lifecycle_with_progress("f1", 6_000);
    publisher.publish_all(events).await;
    let published = publisher.raw.next_seq - 1;
    let catch_up = reference.catch_up.clone();
    assert!(
        eventually(Duration::from_secs(60), || async {
            catch_up.snapshot_figures().last_sequence >= published
        })
        .await,
        "{:?}",
        catch_up.snapshot_figures()
    );

    // The node leading the snapshot bucket dies.
    let js = jetstream::new(conn.client().clone());
    let objects = format!("OBJ_{}", snapshot_bucket(&subjects("fault")));
    let info = js
        .get_stream(&objects)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    let leader = info.cluster.and_then(|c| c.leader).expect("a leader");
    let node = cluster
        .nodes()
        .iter()
        .position(|n| n.server_name() == leader)
        .expect("the leader is a node");
    cluster.kill(node).await;
    let late_conn = client_of(&urls).await;
    let late = durable_router_with(&late_conn, "fault", config.clone(), NO_EXPIRY).await;
    tokio::time::timeout(Duration::from_secs(90), late.catch_up.wait())
        .await
        .expect("catches up");
    let router = &late.router;
    assert!(
        eventually(Duration::from_secs(60), || async {
            live_ids(router) == live
        })
        .await,
        "after the snapshot node died: {:?}",
        late.catch_up.snapshot_figures()
    );

    // Writers torn down at staggered moments of their writes (the late replica takes the
    // writer's entry once the reference's has aged out; then it goes, and so on), while
    // events keep coming.
    let mut writers = vec![late];
    for round in 0..4u64 {
        let (events, more) = lifecycle_with_progress(&format!("r{round}"), 1_000);
        publisher.publish_all(events).await;
        live.extend(more);
        let writer = writers.pop().unwrap();
        tokio::time::sleep(Duration::from_millis(200 + 37 * round)).await;
        writer.router.shutdown().await.unwrap();
        let next = durable_router_with(&late_conn, "fault", config.clone(), NO_EXPIRY).await;
        tokio::time::timeout(Duration::from_secs(90), next.catch_up.wait())
            .await
            .expect("catches up");
        let router = &next.router;
        assert!(
            eventually(Duration::from_secs(60), || async {
                live_ids(router) == live
            })
            .await,
            "round {round}: {:?}",
            next.catch_up.snapshot_figures()
        );
        writers.push(next);
    }
    let router = &reference.router;
    assert!(
        eventually(Duration::from_secs(60), || async {
            live_ids(router) == live
        })
        .await,
        "the reference"
    );
}

/// A stream the server cannot hold (three copies on one server) is refused at once with the
/// server's reason; only timeouts of a cluster electing leaders are tried again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_server_cannot_hold_is_refused_with_its_reason() {
    use lease_router::service::{AddDeploymentError, DeploymentHost, HostSettings};
    use lease_router::DeploymentName;
    let server = js_server().await;
    let conn = client(&server.url()).await;
    let host = DeploymentHost::new(
        conn.clone(),
        HostSettings {
            durable: Some(stream_config(3)),
            ..HostSettings::default()
        },
    );
    let err = host
        .add(&DeploymentName::new("big").unwrap())
        .await
        .expect_err("three copies on one server");
    assert!(
        matches!(err, AddDeploymentError::Start { .. }),
        "refused, not waited out: {err:?}"
    );
    let m = error_chain(&err);
    assert!(m.contains("LEASE_ROUTER_leases__big"), "{m}");
    host.shutdown_all().await.unwrap();
}

//! Durable ingest throughput with batches against the raw JetStream ceiling, in one run
//! (`cargo bench --bench durable_ingest`).
//!
//! The ingest bench's stream (8 publishers on their own connections, 64 workers, realistic
//! lifecycles), published to the deployment's lease stream on a private JetStream server, each
//! publisher awaiting its acknowledgements in a window of `DURABLE_WINDOW` (default 256, what
//! `lease-router simulate --durable` gives `LeasePublisher::start_durable`), with a
//! `Nats-Msg-Id` per message as the durable publisher sends it:
//! (a) raw ceiling: one event a message, nothing consuming; timed from the first publish to
//!     the last acknowledgement (stored messages/s);
//! (b) a durable router (`JetStreamIngress`, caught up on the empty stream first) while the
//!     same events are published one a message; timed to the router having applied the last
//!     event;
//! (c) the same, the events batched (wire 1.2) per worker subject as a batching
//!     `LeasePublisher` batches them (up to 256 events or 64 KiB; msg id
//!     `{publisher}-{first}-{last}`).
//!
//! Each run on a fresh server; the three take turns over `DURABLE_ROUNDS` rounds and the
//! medians are compared. Pinned lines: `durable_single_ratio=<b/a>` and
//! `durable_batched_ratio=<c/a>` (router events/s against acknowledged messages/s).
//!
//! Environment: `DURABLE_EVENTS` (default 300000), `DURABLE_ROUNDS` (default 3),
//! `DURABLE_WINDOW` (default 256), `DURABLE_COMPRESSION=0` for a stream without S2
//! compression (the default compresses where the server can: 2.10 and later). Each run also
//! prints the server's store on disk per event (`durable_disk_bytes_per_event=`, the median).

mod common;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use lease_router::{
    ensure_stream, stream_name, ApplyConfig, Batching, CatchUpState, IngressStats,
    JetStreamIngress, LeaseStreamConfig, Router, RouterConfig,
};
use lease_router_testkit::NatsServerBuilder;
use tokio_util::task::TaskTracker;

use common::{batch_stream, cpu_time, encoded_stream, nats, subjects, wait_for_count};
use common::{BatchMessage, LifecycleShape};

const PUBLISHERS: u64 = 8;
const WORKERS: u64 = 64;
const DEPLOYMENT: &str = "durable";
/// A router that applies nothing more for this long has seen everything it will get.
const STALL: Duration = Duration::from_secs(10);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What each publisher sends, and what it holds.
struct Streams {
    messages: Arc<Vec<Vec<BatchMessage>>>,
    events: u64,
    /// Messages of two events or more.
    batches: u64,
}

impl Streams {
    fn new(messages: Vec<Vec<BatchMessage>>) -> Self {
        Self {
            events: messages.iter().flatten().map(|m| m.events as u64).sum(),
            batches: messages.iter().flatten().filter(|m| m.events > 1).count() as u64,
            messages: Arc::new(messages),
        }
    }

    fn count(&self) -> u64 {
        self.messages.iter().map(|s| s.len() as u64).sum()
    }
}

/// Publishes every stream on its own connection to JetStream, each with at most `window`
/// acknowledgements outstanding (the oldest awaited before one more goes out, as the durable
/// publisher does); returns once every message is stored.
async fn publish_acked(clients: &[async_nats::Client], streams: &Streams, window: usize) {
    let mut tasks = Vec::new();
    for (p, client) in clients.iter().enumerate() {
        let js = jetstream::new(client.clone());
        let streams = streams.messages.clone();
        tasks.push(tokio::spawn(async move {
            let mut acks = VecDeque::with_capacity(window + 1);
            for m in &streams[p] {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", m.msg_id.as_str());
                let ack = js
                    .publish_with_headers(
                        m.message.subject.clone(),
                        headers,
                        m.message.payload.clone(),
                    )
                    .await
                    .expect("publishes");
                acks.push_back(ack);
                if acks.len() > window {
                    let ack = acks.pop_front().unwrap().await.expect("stored");
                    assert!(!ack.duplicate, "every message id is new");
                }
            }
            for ack in acks {
                assert!(!ack.await.expect("stored").duplicate);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

struct Run {
    events: u64,
    elapsed: Duration,
    /// From the first publish to the last acknowledgement.
    acked: Duration,
    cpu: Duration,
    server_cpu: Duration,
}

impl Run {
    fn rate(&self) -> f64 {
        self.events as f64 / self.elapsed.as_secs_f64()
    }
}

/// The lease stream's settings: the routers' defaults, compression as `DURABLE_COMPRESSION`
/// says.
fn stream_config() -> LeaseStreamConfig {
    let compress = std::env::var("DURABLE_COMPRESSION").map_or(true, |v| v != "0");
    LeaseStreamConfig::new().with_compression(compress)
}

/// The lease stream as the routers create it, on a fresh server.
async fn stream_ready(conn: &lease_router::NatsConnection) -> jetstream::Context {
    let js = jetstream::new(conn.client().clone());
    ensure_stream(&js, &stream_config(), &subjects(DEPLOYMENT))
        .await
        .expect("lease stream");
    js
}

/// What the stream holds: every message sent, once.
async fn check_stored(js: &jetstream::Context, streams: &Streams) {
    let mut stream = js
        .get_stream(stream_name(&subjects(DEPLOYMENT)))
        .await
        .expect("stream");
    let info = stream.info().await.expect("stream info");
    assert_eq!(info.state.messages, streams.count(), "stored once each");
}

/// (a) Publishing alone: acknowledged messages/s.
async fn raw(
    url: &str,
    server_pid: Option<u32>,
    clients: &[async_nats::Client],
    streams: &Streams,
    window: usize,
) -> Run {
    let conn = nats(url, None).await;
    let js = stream_ready(&conn).await;
    let (cpu0, server0) = (cpu_time(None), cpu_time(server_pid));
    let start = Instant::now();
    publish_acked(clients, streams, window).await;
    let elapsed = start.elapsed();
    let (cpu, server_cpu) = (cpu_time(None) - cpu0, cpu_time(server_pid) - server0);
    check_stored(&js, streams).await;
    Run {
        events: streams.count(),
        elapsed,
        acked: elapsed,
        cpu,
        server_cpu,
    }
}

/// (b), (c) A durable router applying what is published.
async fn router(
    url: &str,
    server_pid: Option<u32>,
    clients: &[async_nats::Client],
    streams: &Streams,
    window: usize,
) -> Run {
    let total = streams.events;
    let conn = nats(url, Some(1 << 21)).await;
    let js = stream_ready(&conn).await;
    let stats = Arc::new(IngressStats::new());
    let catch_up = Arc::new(CatchUpState::new());
    let ingress = JetStreamIngress::new(
        conn.client().clone(),
        subjects(DEPLOYMENT),
        stream_config(),
        ApplyConfig::default(),
        stats.clone(),
        catch_up.clone(),
    );
    let router = Router::start_tracked(RouterConfig::new(DEPLOYMENT), ingress, TaskTracker::new())
        .await
        .expect("durable router starts");
    tokio::time::timeout(Duration::from_secs(30), catch_up.wait())
        .await
        .expect("caught up on the empty stream");
    let (cpu0, server0) = (cpu_time(None), cpu_time(server_pid));
    let start = Instant::now();
    let publishing = async {
        publish_acked(clients, streams, window).await;
        Instant::now()
    };
    let done = wait_for_count(total, STALL, || stats.snapshot().received);
    let (acked, (end, got)) = tokio::join!(publishing, done);
    let (cpu, server_cpu) = (cpu_time(None) - cpu0, cpu_time(server_pid) - server0);
    let s = stats.snapshot();
    // Every event was applied, nothing dropped, and every batch was read as one.
    assert_eq!(got, total, "{s:?}");
    assert_eq!(s.applied_total(), total, "{s:?}");
    assert_eq!(s.batches, streams.batches, "{s:?}");
    check_stored(&js, streams).await;
    let loads = router.scheduler().loads().await.unwrap();
    let booked: u64 = loads.iter().map(|(_, l)| l.active_bookings).sum();
    assert_eq!(booked, router.manager().active_leases() as u64);
    router.shutdown().await.expect("router shuts down");
    Run {
        events: got,
        elapsed: end - start,
        acked: acked - start,
        cpu,
        server_cpu,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn bench() {
    let events = env_u64("DURABLE_EVENTS", 300_000);
    let rounds = env_u64("DURABLE_ROUNDS", 3).max(1);
    let window = env_u64("DURABLE_WINDOW", 256).max(1) as usize;
    println!("machine: {}", common::machine());
    let subjects = subjects(DEPLOYMENT);
    // ~4.9 events per request (1 + 3 + 0.9), as in the ingest bench.
    let requests = (events as f64 / 4.9 / PUBLISHERS as f64).ceil() as u64;
    let encoded: Vec<_> = (0..PUBLISHERS)
        .map(|p| {
            let workers = (0..WORKERS).filter(|w| w % PUBLISHERS == p).collect();
            let shape = LifecycleShape::default();
            encoded_stream(&subjects, 0xD0_0000 + p, p, workers, requests, shape)
        })
        .collect();
    let batching = Batching::default();
    let one_each = Batching {
        max_events: 1,
        ..batching
    };
    let single = Streams::new(encoded.iter().map(|s| batch_stream(s, one_each)).collect());
    let batched = Streams::new(encoded.iter().map(|s| batch_stream(s, batching)).collect());
    assert_eq!(single.events, batched.events);
    let bytes = |s: &Streams| -> usize {
        s.messages
            .iter()
            .flatten()
            .map(|m| m.message.payload.len())
            .sum()
    };
    println!(
        "stream: {} events from {PUBLISHERS} publishers over {WORKERS} workers, mean {:.1} \
         bytes/event; batched: {} messages ({} batches), mean {:.1} events and {:.0} bytes per \
         message; {window} acknowledgements in flight per publisher",
        single.events,
        bytes(&single) as f64 / single.events as f64,
        batched.count(),
        batched.batches,
        single.events as f64 / batched.count() as f64,
        bytes(&batched) as f64 / batched.count() as f64,
    );

    println!(
        "stream compression: {}",
        if stream_config().compression() {
            "S2 where the server can (2.10 and later)"
        } else {
            "off"
        }
    );
    let mut rates = [Vec::new(), Vec::new(), Vec::new()];
    let mut disk = Vec::new();
    for round in 0..rounds {
        for phase in 0..3 {
            let kind = (phase + round as usize) % 3;
            let server = NatsServerBuilder::new()
                .jetstream(true)
                .spawn()
                .await
                .expect("nats-server with JetStream starts");
            let url = server.url();
            let mut clients = Vec::new();
            for _ in 0..PUBLISHERS {
                clients.push(nats(&url, None).await.client().clone());
            }
            let (run, name) = match kind {
                0 => (
                    raw(&url, server.pid(), &clients, &single, window).await,
                    "raw",
                ),
                1 => (
                    router(&url, server.pid(), &clients, &single, window).await,
                    "single",
                ),
                _ => (
                    router(&url, server.pid(), &clients, &batched, window).await,
                    "batched",
                ),
            };
            let unit = if kind == 0 { "messages" } else { "events" };
            println!(
                "round {round} {name:>7}: {} {unit} in {:.3} s = {:.0} {unit}/s (all acknowledged \
                 after {:.3} s); CPU per event: this process {:.2} us, nats-server {:.2} us",
                run.events,
                run.elapsed.as_secs_f64(),
                run.rate(),
                run.acked.as_secs_f64(),
                run.cpu.as_secs_f64() * 1e6 / run.events as f64,
                run.server_cpu.as_secs_f64() * 1e6 / run.events as f64,
            );
            rates[kind].push(run.rate());
            let stored = common::dir_bytes(server.store_dir());
            println!(
                "round {round} {name:>7}: the server's store on disk {stored} bytes, {:.1} per event",
                stored as f64 / single.events as f64
            );
            disk.push(stored as f64 / single.events as f64);
            drop(clients);
            drop(server);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let [raw, single, batched] = rates.map(median);
    println!("raw_jetstream_messages_per_sec={raw:.0}");
    println!("durable_single_events_per_sec={single:.0}");
    println!("durable_batched_events_per_sec={batched:.0}");
    println!("durable_single_ratio={:.3}", single / raw);
    println!("durable_batched_ratio={:.3}", batched / raw);
    println!("durable_disk_bytes_per_event={:.1}", median(disk));
}

fn main() {
    common::run(bench());
}

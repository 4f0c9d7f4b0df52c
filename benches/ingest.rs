//! Ingest throughput of a full router against the raw NATS ceiling, in one run
//! (`cargo bench --bench ingest`).
//!
//! The same pre-encoded stream (8 publishers on their own connections, 64 workers, realistic
//! lifecycles: admitted, 2 to 4 progressed, completed for ~90% of requests) is published as
//! fast as possible to
//! (a) a bare async-nats subscriber that only decodes each event, and
//! (b) a router: NATS ingress, weak observer, lease manager, scheduler.
//! (c) the same router, the same events batched (wire 1.2) per worker subject as a batching
//! `LeasePublisher` batches them (up to 256 events or 64 KiB), by the same 8 publishers.
//! All are timed the same way, from the start of publishing to the moment the consumer has
//! taken the last event, and take turns over a few rounds; the medians are compared.
//! Pinned lines: `ingest_ratio=<b/a>` (events/s against the raw subscriber's messages/s, one
//! event a message), `batched_ingest_ratio=<c/a>`, and nats-server's CPU time per million
//! events, single-event messages (b) and batches (c), summed over the rounds:
//! `nats_cpu_ms_per_million_events_single=`, `nats_cpu_ms_per_million_events_batched=`.
//!
//! Environment: `INGEST_EVENTS` (default 600000), `INGEST_ROUNDS` (default 7),
//! `INGEST_BLOCK_HASHES` (default 0; 256: every `admitted` carries its prompt's block hashes,
//! one per 16 tokens up to 256, as wire 1.3 allows, and the router's prefix index learns them),
//! `INGEST_BREAKDOWN_ONLY` (set: only the in-process breakdown, e.g. under callgrind).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lease_router::wire::{self, LeaseEvent, DEFAULT_MAX_EVENT_BYTES};
use lease_router::LeaseConfig;
use lease_router::NatsConnection;
use lease_router::{ApplyConfig, EventApplier, NatsIngress};
use lease_router::{Batching, IngressStats};
use lease_router::{Router, RouterConfig};
use tokio_util::task::TaskTracker;

use common::{
    batch_stream, cpu_time, encoded_stream, nats, subjects, wait_for_count, Encoded, LifecycleShape,
};

const PUBLISHERS: u64 = 8;
const WORKERS: u64 = 64;
const DEPLOYMENT: &str = "ingest";
/// Messages a subscription may buffer: the whole burst, so nothing is dropped as slow.
const CAPACITY: usize = 1 << 21;
/// A consumer that takes nothing for this long has seen everything it will get.
const STALL: Duration = Duration::from_secs(3);

/// A note on events that never reached the consumer (core NATS drops for slow consumers),
/// with what the subscribing client saw.
fn lost(total: u64, got: u64, conn: &NatsConnection) -> String {
    if got >= total {
        return String::new();
    }
    let client = conn.client().statistics();
    format!(
        ", LOST {} events (subscribing client: {} messages in, {} connects, {} slow-consumer \
         events)",
        total - got,
        client.in_messages.load(Ordering::Relaxed),
        client.connects.load(Ordering::Relaxed),
        conn.stats().slow_consumer_events()
    )
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Publishes every stream on its own connection, as fast as the clients take it.
async fn publish_all(clients: &[async_nats::Client], streams: &Arc<Vec<Vec<Encoded>>>) {
    let mut tasks = Vec::new();
    for (p, client) in clients.iter().enumerate() {
        let client = client.clone();
        let streams = streams.clone();
        tasks.push(tokio::spawn(async move {
            for e in &streams[p] {
                client
                    .publish(e.subject.clone(), e.payload.clone())
                    .await
                    .expect("publish");
            }
            client.flush().await.expect("flush");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

struct Run {
    events: u64,
    elapsed: Duration,
    /// CPU time of this process and of nats-server during the run.
    cpu: Duration,
    server_cpu: Duration,
    note: String,
}

impl Run {
    fn rate(&self) -> f64 {
        self.events as f64 / self.elapsed.as_secs_f64()
    }
}

/// (a) A bare subscriber that decodes each event and nothing else.
async fn raw(
    url: &str,
    server_pid: Option<u32>,
    clients: &[async_nats::Client],
    streams: &Arc<Vec<Vec<Encoded>>>,
) -> Run {
    let total: u64 = streams.iter().map(|s| s.len() as u64).sum();
    let conn = nats(url, Some(CAPACITY)).await;
    let mut sub = conn
        .client()
        .subscribe(subjects(DEPLOYMENT).deployment_filter())
        .await
        .unwrap();
    conn.client().flush().await.unwrap();
    let received = Arc::new(AtomicU64::new(0));
    let counter = received.clone();
    let consumer = tokio::spawn(async move {
        let mut decoded = 0u64;
        while let Some(message) = sub.next().await {
            if wire::decode(&message.payload, DEFAULT_MAX_EVENT_BYTES).is_ok() {
                decoded += 1;
            }
            counter.fetch_add(1, Ordering::Relaxed);
        }
        decoded
    });
    let (cpu0, server0) = (cpu_time(None), cpu_time(server_pid));
    let start = Instant::now();
    let publishing = publish_all(clients, streams);
    let done = wait_for_count(total, STALL, || received.load(Ordering::Relaxed));
    let ((), (end, got)) = tokio::join!(publishing, done);
    let (cpu, server_cpu) = (cpu_time(None) - cpu0, cpu_time(server_pid) - server0);
    let mut note = lost(total, got, &conn);
    if got < total {
        tokio::time::sleep(Duration::from_secs(5)).await;
        note.push_str(&format!(
            "; {} more within 5 s",
            received.load(Ordering::Relaxed) - got
        ));
    }
    drop(conn);
    consumer.abort();
    Run {
        events: got,
        elapsed: end - start,
        cpu,
        server_cpu,
        note,
    }
}

/// The messages each publisher sends, and what they hold.
struct Streams {
    messages: Arc<Vec<Vec<Encoded>>>,
    events: u64,
    /// Messages of two events or more.
    batches: u64,
}

/// (b), (c) A full router applying the stream.
async fn router(
    url: &str,
    server_pid: Option<u32>,
    clients: &[async_nats::Client],
    streams: &Streams,
) -> Run {
    let total = streams.events;
    let conn = nats(url, Some(CAPACITY)).await;
    let stats = Arc::new(IngressStats::new());
    let ingress = NatsIngress::new(
        conn.client().clone(),
        subjects(DEPLOYMENT),
        ApplyConfig::default(),
        stats.clone(),
    );
    let router = Router::start_tracked(RouterConfig::new(DEPLOYMENT), ingress, TaskTracker::new())
        .await
        .expect("router starts");
    let (cpu0, server0) = (cpu_time(None), cpu_time(server_pid));
    let start = Instant::now();
    let publishing = publish_all(clients, &streams.messages);
    let done = wait_for_count(total, STALL, || stats.snapshot().received);
    let ((), (end, got)) = tokio::join!(publishing, done);
    let (cpu, server_cpu) = (cpu_time(None) - cpu0, cpu_time(server_pid) - server0);
    let s = stats.snapshot();
    let mut note = lost(total, got, &conn);
    if got < total {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let later = stats.snapshot();
        note.push_str(&format!(
            "; {} more within 5 s; the router counted {} sequence gaps",
            later.received - got,
            later.gaps
        ));
    }
    if got == total {
        // Everything was applied, nothing dropped, and every batch was read as one.
        assert_eq!(s.applied_total(), total, "{s:?}");
        assert_eq!(s.batches, streams.batches, "{s:?}");
    }
    let loads = router.scheduler().loads().await.unwrap();
    let booked: u64 = loads.iter().map(|(_, l)| l.active_bookings).sum();
    assert_eq!(booked, router.manager().active_leases() as u64);
    let wakeups = router.scheduler().stats().wakeups;
    router.shutdown().await.expect("router shuts down");
    note.push_str(&format!(
        ", scheduler woke {wakeups} times ({:.1} events per wake-up)",
        got as f64 / wakeups.max(1) as f64
    ));
    Run {
        events: got,
        elapsed: end - start,
        cpu,
        server_cpu,
        note,
    }
}

/// Where a router's CPU time per event goes, without NATS: the same stream (publishers
/// interleaved as a subscriber sees them) through `wire::decode` alone, then through an
/// `EventApplier` (ingress checks, observer, manager), then the scheduler applying the
/// bookings and releases queued by the latter. Runs on its own current-thread runtime so the
/// scheduler cannot run until it is asked, and the three parts are timed apart. Last, the
/// `batched` messages of the same events through an `EventApplier` of their own.
fn breakdown(streams: &[Vec<Encoded>], batched: &[Vec<Encoded>]) {
    fn interleave(streams: &[Vec<Encoded>]) -> Vec<&Encoded> {
        let longest = streams.iter().map(Vec::len).max().unwrap_or(0);
        (0..longest)
            .flat_map(|i| streams.iter().filter_map(move |s| s.get(i)))
            .collect()
    }
    let interleaved = interleave(streams);
    let n = interleaved.len() as f64;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let start = Instant::now();
        let mut ok = 0u64;
        for e in &interleaved {
            ok += u64::from(wire::decode(&e.payload, DEFAULT_MAX_EVENT_BYTES).is_ok());
        }
        let decode = start.elapsed();
        assert_eq!(ok as f64, n);

        let fresh = || {
            let tracker = TaskTracker::new();
            let (manager, scheduler, _task) = lease_router::internals::manager_and_scheduler(
                DEPLOYMENT,
                LeaseConfig {
                    max_active_leases: 4_000_000,
                    ..LeaseConfig::default()
                },
                &tracker,
            );
            (manager, scheduler)
        };

        // The lease manager's own calls, made directly (no observer, no ingress checks): what
        // the applier asks of it per event, in the same batches.
        let (manager, scheduler) = fresh();
        let start = Instant::now();
        for chunk in interleaved.chunks(256) {
            let mut batch = manager.batch();
            for e in chunk {
                let envelope = wire::decode(&e.payload, DEFAULT_MAX_EVENT_BYTES).unwrap();
                match envelope.event {
                    LeaseEvent::Admitted(a) => {
                        batch.admit_current(&a.request_id, a.worker(), a.load());
                    }
                    LeaseEvent::Progressed(p) => {
                        batch.touch_current(&p.request_id, p.worker());
                    }
                    LeaseEvent::Completed(c) => {
                        batch.complete_current(&c.request_id, c.worker());
                    }
                    // The generated traffic holds neither resets nor KV events.
                    LeaseEvent::WorkerReset(_)
                    | LeaseEvent::KvStored(_)
                    | LeaseEvent::KvRemoved(_)
                    | LeaseEvent::KvCleared(_) => {}
                }
            }
        }
        let direct = start.elapsed();
        scheduler.loads().await.unwrap();
        drop((manager, scheduler));

        let (manager, scheduler) = fresh();
        let stats = Arc::new(IngressStats::new());
        let mut applier = EventApplier::new(
            subjects(DEPLOYMENT),
            manager.downgrade(),
            stats.clone(),
            ApplyConfig::default(),
        );
        let start = Instant::now();
        // In batches of up to 256 messages, as the NATS ingress takes them.
        for batch in interleaved.chunks(256) {
            applier.begin_batch();
            for e in batch {
                applier.apply(&e.subject, &e.payload).unwrap();
            }
            applier.end_batch();
        }
        let apply = start.elapsed();
        let start = Instant::now();
        scheduler.loads().await.unwrap();
        let schedule = start.elapsed();
        assert_eq!(stats.snapshot().applied_total() as f64, n);
        let ns = |d: Duration| d.as_nanos() as f64 / n;
        println!(
            "in-process, per event: decode only {:.0} ns; decode + direct manager calls {:.0} \
             ns; full ingress apply (decode, checks, stats, observer, manager) {:.0} ns; \
             scheduler actor {:.0} ns; router total {:.0} ns = decode + {:.0} ns",
            ns(decode),
            ns(direct),
            ns(apply),
            ns(schedule),
            ns(apply + schedule),
            ns(apply + schedule) - ns(decode),
        );

        let (manager, scheduler) = fresh();
        let stats = Arc::new(IngressStats::new());
        let mut applier = EventApplier::new(
            subjects(DEPLOYMENT),
            manager.downgrade(),
            stats.clone(),
            ApplyConfig::default(),
        );
        let messages = interleave(batched);
        let start = Instant::now();
        for burst in messages.chunks(256) {
            applier.begin_batch();
            for e in burst {
                applier.apply(&e.subject, &e.payload).unwrap();
            }
            applier.end_batch();
        }
        let apply = start.elapsed();
        let start = Instant::now();
        scheduler.loads().await.unwrap();
        let schedule = start.elapsed();
        assert_eq!(stats.snapshot().applied_total() as f64, n);
        println!(
            "in-process, batched (the same events in {} messages): full ingress apply {:.0} ns \
             per event; scheduler actor {:.0} ns; router total {:.0} ns per event",
            messages.len(),
            ns(apply),
            ns(schedule),
            ns(apply + schedule),
        );
    });
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn bench() {
    let events = env_u64("INGEST_EVENTS", 600_000);
    let rounds = env_u64("INGEST_ROUNDS", 7).max(1);
    println!("machine: {}", common::machine());
    let subjects = subjects(DEPLOYMENT);
    let shape = LifecycleShape {
        block_hashes: env_u64("INGEST_BLOCK_HASHES", 0) as usize,
        ..LifecycleShape::default()
    };
    println!("block hashes per admitted: up to {}", shape.block_hashes);
    // ~4.9 events per request (1 + 3 + 0.9).
    let requests = (events as f64 / 4.9 / PUBLISHERS as f64).ceil() as u64;
    let streams: Vec<Vec<Encoded>> = (0..PUBLISHERS)
        .map(|p| {
            // Each publisher is a node agent for 8 of the 64 workers.
            let workers = (0..WORKERS).filter(|w| w % PUBLISHERS == p).collect();
            encoded_stream(&subjects, 0xA11C_E000 + p, p, workers, requests, shape)
        })
        .collect();
    let total: u64 = streams.iter().map(|s| s.len() as u64).sum();
    let bytes: usize = streams.iter().flatten().map(|e| e.payload.len()).sum();
    println!(
        "stream: {total} events from {PUBLISHERS} publishers over {WORKERS} workers, \
         {} requests, mean {:.1} bytes/event",
        requests * PUBLISHERS,
        bytes as f64 / total as f64
    );
    let batching = Batching::default();
    let batched: Vec<Vec<common::BatchMessage>> =
        streams.iter().map(|s| batch_stream(s, batching)).collect();
    let messages: u64 = batched.iter().map(|s| s.len() as u64).sum();
    let batch_bytes: usize = batched
        .iter()
        .flatten()
        .map(|b| b.message.payload.len())
        .sum();
    let batched = Streams {
        batches: batched.iter().flatten().filter(|b| b.events > 1).count() as u64,
        events: batched.iter().flatten().map(|b| b.events as u64).sum(),
        messages: Arc::new(
            batched
                .into_iter()
                .map(|s| s.into_iter().map(|b| b.message).collect())
                .collect(),
        ),
    };
    assert_eq!(batched.events, total);
    println!(
        "batched: {messages} messages ({} batches), mean {:.1} events and {:.0} bytes per \
         message (at most {} events, {} bytes)",
        batched.batches,
        total as f64 / messages as f64,
        batch_bytes as f64 / messages as f64,
        batching.max_events,
        batching.max_bytes,
    );
    // On a thread of its own: it runs its own runtime.
    std::thread::scope(|scope| {
        scope
            .spawn(|| breakdown(&streams, &batched.messages))
            .join()
            .unwrap()
    });
    if std::env::var_os("INGEST_BREAKDOWN_ONLY").is_some() {
        return;
    }
    let streams = Streams {
        messages: Arc::new(streams),
        events: total,
        batches: 0,
    };

    let (mut raw_rates, mut router_rates, mut batched_rates) = (Vec::new(), Vec::new(), Vec::new());
    // nats-server CPU time and events, summed over the rounds: router, batched router.
    let mut server_cpu = [(Duration::ZERO, 0u64); 2];
    for round in 0..rounds {
        // Take turns at going first, so none always gets the warmer machine.
        for phase in 0..3 {
            let kind = (phase + round as usize) % 3;
            // A fresh server and fresh publisher connections for every run: with one server for
            // all runs, nats-server 2.9 was seen to deliver a few thousand events of a later run
            // to nobody (counted in its in_msgs, missing from out_msgs, no slow consumer).
            let nats_server = common::bench_server().await;
            let server = &nats_server.server;
            let url = server.url();
            let server_pid = server.pid();
            let mut clients = Vec::new();
            for _ in 0..PUBLISHERS {
                clients.push(nats(&url, None).await.client().clone());
            }
            let (run, name) = match kind {
                0 => (
                    raw(&url, server_pid, &clients, &streams.messages).await,
                    "raw",
                ),
                1 => (router(&url, server_pid, &clients, &streams).await, "router"),
                _ => (
                    router(&url, server_pid, &clients, &batched).await,
                    "batched",
                ),
            };
            if run.note.contains("LOST") {
                // What the server says about it.
                if let Ok(varz) = server.monitor_json("/varz").await {
                    println!(
                        "nats-server /varz: in_msgs {}, out_msgs {}, slow_consumers {}",
                        varz["in_msgs"], varz["out_msgs"], varz["slow_consumers"]
                    );
                }
                let log = server.log_tail(1000);
                for line in log
                    .lines()
                    .filter(|l| !l.contains("[INF]") || l.contains("Slow"))
                    .take(5)
                {
                    println!("nats-server log: {line}");
                }
            }
            println!(
                "round {round} {name:>7}: {} events in {:.3} s = {:.0} events/s; CPU per event: \
                 this process {:.2} us, nats-server {:.2} us{}",
                run.events,
                run.elapsed.as_secs_f64(),
                run.rate(),
                run.cpu.as_secs_f64() * 1e6 / run.events as f64,
                run.server_cpu.as_secs_f64() * 1e6 / run.events as f64,
                run.note,
            );
            match kind {
                0 => raw_rates.push(run.rate()),
                1 => router_rates.push(run.rate()),
                _ => batched_rates.push(run.rate()),
            }
            if kind > 0 {
                let sum = &mut server_cpu[kind - 1];
                sum.0 += run.server_cpu;
                sum.1 += run.events;
            }
            drop(clients);
            drop(nats_server);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let raw_rate = median(raw_rates);
    let router_rate = median(router_rates);
    println!("raw_events_per_sec={raw_rate:.0}");
    println!("router_events_per_sec={router_rate:.0}");
    let batched_rate = median(batched_rates);
    let ms_per_million =
        |(cpu, events): (Duration, u64)| cpu.as_secs_f64() * 1e3 * 1e6 / events.max(1) as f64;
    println!("batched_events_per_sec={batched_rate:.0}");
    println!("ingest_ratio={:.3}", router_rate / raw_rate);
    println!("batched_ingest_ratio={:.3}", batched_rate / raw_rate);
    println!(
        "nats_cpu_ms_per_million_events_single={:.0}",
        ms_per_million(server_cpu[0])
    );
    println!(
        "nats_cpu_ms_per_million_events_batched={:.0}",
        ms_per_million(server_cpu[1])
    );
}

fn main() {
    // `cargo bench` passes `--bench`; there is nothing to configure from the command line.
    common::run(bench());
}

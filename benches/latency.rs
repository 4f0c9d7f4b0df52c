//! Publish-to-applied latency at 50,000 events/s on loopback, idle and while reaper scans over
//! 1,000,000 leases run (`cargo bench --bench latency`).
//!
//! Each event's envelope carries its send time (`ts`, unix µs, taken just before `publish`).
//! The router's NATS ingress calls a hook after each burst is applied and handed to the
//! scheduler ([`NatsIngress::on_applied`]); the hook notes that moment for every event of the
//! burst. The k-th applied event of a request is its k-th event (one publisher per request, and
//! NATS keeps a publisher's order). That gives every event's latency at 1 µs resolution,
//! through the batched path the router really takes. The router's lag histogram (buckets
//! 100 µs, 250 µs, 500 µs, 1 ms, 2.5 ms, ...) is printed next to it as a cross-check.
//!
//! In the second phase a million extra leases are held and the router's own reaper scans them
//! with a scan interval of `LATENCY_SCAN_PERIOD_MS` (default 1000; the production interval is
//! 300 s), on the ingress's applying task between bursts, as in production. The bench
//! re-touches the million leases in the background so none expires. Besides the whole phase,
//! the events in flight while a scan ran are reported on their own (`during_scan`), with the
//! length of every shard step (the time it holds one shard's lock and the applying task).
//!
//! Between the two, a third phase sends the same load through batching publishers
//! (`LeasePublisher` with `Batching::default()`: 1 ms linger, wire 1.2): there an event's
//! latency runs from the call to `publish` to its application, the linger included. Pinned
//! line: `batched_latency_p99_us=`.
//!
//! Environment: `LATENCY_SECS` (seconds per phase, default 8), `LATENCY_RATE` (default 50000),
//! `LATENCY_SCAN_PERIOD_MS` (default 1000).

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use lease_router::wire::{self, Envelope, Message, MessageLimits};
use lease_router::Subjects;
use lease_router::{ApplyConfig, NatsIngress};
use lease_router::{Batching, LeasePublisher, PublisherConfig};
use lease_router::{HistogramFigures, IngressStats, LeaseConfig};
use lease_router::{RequestId, RequestLoad, SchedulerBookingDescriptor, WorkerWithDpRank};
use lease_router::{RequestLeaseManager, StepTime};
use lease_router::{Router, RouterConfig};
use tokio_util::task::TaskTracker;

use common::{nats, percentile, subjects, LifecycleGen, LifecycleShape, StepStats};

const PUBLISHERS: u64 = 8;
const WORKERS: u64 = 64;
const DEPLOYMENT: &str = "latency";
const PREFILL: u64 = 1_000_000;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// When each event was applied, in apply order: (request id, unix µs).
#[derive(Default)]
struct ApplyLog(Mutex<Vec<(RequestId, u64)>>);

impl ApplyLog {
    /// Notes one applied burst: every event in it, batched or not, was applied at the same
    /// moment.
    fn note_burst(&self, burst: &[async_nats::Message]) {
        let now = wire::unix_micros_now();
        let mut log = self.0.lock().unwrap();
        let mut note = |envelope: Result<Envelope, _>| {
            if let Some(id) = envelope.ok().as_ref().and_then(|e| e.event.request_id()) {
                log.push((RequestId::from(id), now));
            }
        };
        for message in burst {
            match wire::decode_message(&message.payload, MessageLimits::default()) {
                Message::Event(envelope) => note(envelope),
                Message::Batch(events) => events.for_each(&mut note),
                Message::Refused { .. } => {}
            }
        }
    }

    fn take(&self) -> Vec<(RequestId, u64)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// How a paced publisher sends.
#[derive(Clone)]
enum Sender {
    /// Encodes and publishes each event itself, one message each, under this publisher id.
    Plain(async_nats::Client, u64),
    /// Hands each event to a `LeasePublisher` (which batches).
    Publisher(LeasePublisher),
}

/// Sends one publisher's share of the rate, paced on 1 ms ticks. `Plain` stamps each
/// envelope just before it is published; with a `LeasePublisher`, the send time is when
/// `publish` is called. Returns `(request id, send µs)` per event, in send order.
async fn paced_publisher(
    sender: Sender,
    subjects: Subjects,
    mut gen: LifecycleGen,
    rate: f64,
    duration: Duration,
) -> Vec<(String, u64)> {
    let worker_subjects: HashMap<u64, async_nats::Subject> = (0..WORKERS)
        .map(|w| (w, subjects.worker_subject(w).into()))
        .collect();
    let mut sent = Vec::with_capacity((rate * duration.as_secs_f64() * 1.1) as usize);
    let mut buf = Vec::with_capacity(128);
    let mut seq = 0;
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    let start = Instant::now();
    loop {
        ticker.tick().await;
        let elapsed = start.elapsed();
        if elapsed >= duration {
            break;
        }
        let due = (elapsed.as_secs_f64() * rate) as usize;
        while sent.len() < due {
            let event = gen
                .next_event()
                .expect("enough requests for the whole phase");
            let rid = event.request_id().expect("per-request event").to_string();
            let ts = wire::unix_micros_now();
            match &sender {
                Sender::Plain(client, publisher_id) => {
                    seq += 1;
                    let subject = worker_subjects[&event.worker_id()].clone();
                    buf.clear();
                    wire::encode_into(&Envelope::new(*publisher_id, seq, ts, event), &mut buf)
                        .unwrap();
                    client
                        .publish(subject, Bytes::copy_from_slice(&buf))
                        .await
                        .expect("publish");
                }
                Sender::Publisher(publisher) => publisher.publish(event).expect("queued"),
            }
            sent.push((rid, ts));
        }
    }
    match &sender {
        Sender::Plain(client, _) => client.flush().await.expect("flush"),
        Sender::Publisher(publisher) => publisher.flush().await.expect("flush"),
    }
    sent
}

struct Phase {
    /// `(send µs, latency µs)` of every matched event.
    samples: Vec<(u64, u64)>,
    lag: HistogramFigures,
}

/// The smallest bucket bound (µs) under which at least a fraction `q` of the events fall.
fn bucket_quantile(lag: &HistogramFigures, q: f64) -> String {
    lag.bound_of_quantile(q).map_or_else(
        || "> 30 s".to_string(),
        |bound| format!("<= {:.0} us", bound * 1e6),
    )
}

#[allow(clippy::too_many_arguments)]
async fn phase(
    name: &str,
    senders: &[Sender],
    subjects: &Subjects,
    stats: &IngressStats,
    log: &ApplyLog,
    space: u64,
    rate: f64,
    duration: Duration,
) -> Phase {
    log.take();
    let lag_before = stats.snapshot().lag;
    let per_publisher = rate / PUBLISHERS as f64;
    let shape = LifecycleShape {
        concurrency: 64,
        ..LifecycleShape::default()
    };
    let requests = (per_publisher * duration.as_secs_f64() / 3.0) as u64 + 1000;
    let mut tasks = Vec::new();
    for (p, sender) in senders.iter().enumerate() {
        let p = p as u64;
        let workers = (0..WORKERS).filter(|w| w % PUBLISHERS == p).collect();
        let gen = LifecycleGen::new(space * 100 + p, workers, requests, shape);
        tasks.push(tokio::spawn(paced_publisher(
            sender.clone(),
            subjects.clone(),
            gen,
            per_publisher,
            duration,
        )));
    }
    let mut sends: HashMap<String, Vec<u64>> = HashMap::new();
    let mut total = 0usize;
    for t in tasks {
        for (rid, ts) in t.await.unwrap() {
            sends.entry(rid).or_default().push(ts);
            total += 1;
        }
    }
    // Let the router apply what is still on its way.
    let settle = Instant::now();
    while log.len() < total && settle.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let applied = log.take();
    let lag = stats.snapshot().lag.since(&lag_before);

    let mut by_request: HashMap<&str, Vec<u64>> = HashMap::new();
    for (rid, t) in &applied {
        by_request.entry(rid.as_str()).or_default().push(*t);
    }
    let mut samples = Vec::with_capacity(total);
    let mut unmatched_requests = 0;
    for (rid, sent) in &sends {
        match by_request.get(rid.as_str()) {
            Some(done) if done.len() == sent.len() => samples.extend(
                sent.iter()
                    .zip(done)
                    .map(|(s, d)| (*s, d.saturating_sub(*s))),
            ),
            _ => unmatched_requests += 1,
        }
    }
    println!(
        "{name}: sent {total} events at {rate:.0}/s for {:?}, applied {}, matched {} \
         ({unmatched_requests} requests with missing or extra applications left out)",
        duration,
        applied.len(),
        samples.len()
    );
    Phase { samples, lag }
}

/// Prints the percentiles of the events `keep` selects; `lag` is the router's histogram for
/// the whole phase, when it covers the same events.
fn report(
    name: &str,
    samples: &[(u64, u64)],
    keep: impl Fn(u64, u64) -> bool,
    lag: Option<&HistogramFigures>,
) {
    let mut l: Vec<u64> = samples
        .iter()
        .filter(|(sent, latency)| keep(*sent, *latency))
        .map(|(_, latency)| *latency)
        .collect();
    l.sort_unstable();
    let us = |q| percentile(&l, q);
    let histogram = lag.map_or(String::new(), |lag| {
        format!(
            " (router lag histogram: p50 {}, p99 {}, p99.9 {})",
            bucket_quantile(lag, 0.5),
            bucket_quantile(lag, 0.99),
            bucket_quantile(lag, 0.999),
        )
    });
    println!(
        "{name}: {} events, publish-to-applied p50 {} us, p99 {} us, p99.9 {} us, max {} \
         us{histogram}",
        l.len(),
        us(0.5),
        us(0.99),
        us(0.999),
        l.last().copied().unwrap_or(0),
    );
    println!("latency_{name}_p50_us={}", us(0.5));
    println!("latency_{name}_p99_us={}", us(0.99));
    println!("latency_{name}_p999_us={}", us(0.999));
}

struct ScanLoop {
    /// Every shard step the router's reaper ran meanwhile.
    steps: Vec<StepTime>,
    passes: u64,
    touching: Duration,
}

/// Until `stop`, re-touches every prefilled lease (in chunks, standing in for their
/// `progressed` traffic) a few times per scan interval so that none expires and every scan
/// walks the full million, and collects the reaper's step timings.
async fn touch_loop(
    manager: RequestLeaseManager,
    prefilled: Vec<SchedulerBookingDescriptor>,
    period: Duration,
    stop: Arc<AtomicBool>,
) -> ScanLoop {
    let mut out = ScanLoop {
        steps: Vec::new(),
        passes: 0,
        touching: Duration::ZERO,
    };
    manager.take_scan_steps();
    while !stop.load(Ordering::Relaxed) {
        let start = Instant::now();
        for chunk in prefilled.chunks(512) {
            for bk in chunk {
                manager.touch_booking(bk);
            }
            tokio::task::yield_now().await;
        }
        out.touching += start.elapsed();
        out.passes += 1;
        out.steps.extend(manager.take_scan_steps());
        tokio::time::sleep(period / 4).await;
    }
    out.steps.extend(manager.take_scan_steps());
    out
}

/// `(start, end)` unix µs of each stretch of scanning: steps less than `gap` apart belong to
/// one stretch.
fn scan_windows(steps: &[StepTime], gap: u64) -> Vec<(u64, u64)> {
    let mut windows: Vec<(u64, u64)> = Vec::new();
    for step in steps {
        let end = step.started_us + step.wall.as_micros() as u64;
        match windows.last_mut() {
            Some(last) if step.started_us <= last.1 + gap => last.1 = end,
            _ => windows.push((step.started_us, end)),
        }
    }
    windows
}

async fn bench() {
    let secs = env_u64("LATENCY_SECS", 8);
    let rate = env_u64("LATENCY_RATE", 50_000) as f64;
    let duration = Duration::from_secs(secs);
    let scan_period = Duration::from_millis(env_u64("LATENCY_SCAN_PERIOD_MS", 1000));
    println!("machine: {}", common::machine());
    let nats_server = common::bench_server().await;
    let server = &nats_server.server;
    let url = server.url();
    let subjects = subjects(DEPLOYMENT);
    let conn = nats(&url, Some(1 << 20)).await;
    let stats = Arc::new(IngressStats::new());
    let log = Arc::new(ApplyLog::default());
    let ingress = NatsIngress::new(
        conn.client().clone(),
        subjects.clone(),
        ApplyConfig::default(),
        stats.clone(),
    )
    .on_applied({
        let log = log.clone();
        Arc::new(move |burst| log.note_burst(burst))
    });
    // Room for the prefilled million and the stream's own leases.
    let config = RouterConfig::new(DEPLOYMENT).with_lease(LeaseConfig {
        scan_interval: scan_period,
        max_active_leases: 4_000_000,
        ..LeaseConfig::default()
    });
    let router = Router::start_tracked(config, ingress, TaskTracker::new())
        .await
        .expect("router starts");
    let mut clients = Vec::new();
    for _ in 0..PUBLISHERS {
        clients.push(nats(&url, None).await.client().clone());
    }

    // One message per event, each publisher under its own id.
    let plain = |space: u64| -> Vec<Sender> {
        clients
            .iter()
            .enumerate()
            .map(|(p, c)| Sender::Plain(c.clone(), (space << 32) + p as u64 + 1))
            .collect()
    };
    let idle = phase(
        "idle",
        &plain(1),
        &subjects,
        &stats,
        &log,
        1,
        rate,
        duration,
    )
    .await;

    // The same load through batching publishers (default batching: 1 ms linger).
    let publishers: Vec<Sender> = clients
        .iter()
        .map(|c| {
            Sender::Publisher(LeasePublisher::start(
                c.clone(),
                subjects.clone(),
                PublisherConfig::default().with_batching(Batching::default()),
            ))
        })
        .collect();
    let before = stats.snapshot();
    let batched = phase(
        "batched",
        &publishers,
        &subjects,
        &stats,
        &log,
        3,
        rate,
        duration,
    )
    .await;
    let after = stats.snapshot();
    for sender in publishers {
        if let Sender::Publisher(publisher) = sender {
            let s = publisher.close().await.expect("publisher closes");
            assert_eq!(s.published, s.queued, "every event sent: {s:?}");
        }
    }
    let (events, batches, in_batches) = (
        after.received - before.received,
        after.batches - before.batches,
        after.batched_events - before.batched_events,
    );
    let messages = batches + events - in_batches;
    println!(
        "batched: {events} events in {messages} messages ({:.2} events per message); \
         {batches} batches of {:.2} events on average, {} events sent alone",
        events as f64 / messages.max(1) as f64,
        in_batches as f64 / batches.max(1) as f64,
        events - in_batches,
    );

    // Prefill a million leases on workers the stream does not use.
    let start = Instant::now();
    let prefilled: Vec<SchedulerBookingDescriptor> = (0..PREFILL)
        .map(|i| {
            SchedulerBookingDescriptor::new(
                RequestId::from(common::uuid_like(77, i)),
                WorkerWithDpRank::new(10_000 + i % WORKERS, 0),
            )
        })
        .collect();
    for (i, bk) in prefilled.iter().enumerate() {
        router
            .manager()
            .register_remote(bk.clone(), RequestLoad::new(512, Some(128)));
        if i % 256 == 255 {
            tokio::task::yield_now().await;
        }
        // The reaper runs meanwhile: re-touch what is in so far, so none expires before the
        // touch loop takes over.
        if i % 65_536 == 65_535 {
            for bk in &prefilled[..i] {
                router.manager().touch_booking(bk);
            }
        }
    }
    router.scheduler().loads().await.unwrap();
    println!(
        "prefilled {} leases in {:.2} s",
        router.manager().active_leases(),
        start.elapsed().as_secs_f64()
    );
    // Touched again between scans in the order the shards hold them (much faster than in
    // insertion order), so the scans take a larger part of the phase.
    drop(prefilled);
    let in_table_order: Vec<SchedulerBookingDescriptor> = router
        .manager()
        .leases(usize::MAX)
        .into_iter()
        .map(|record| record.booking)
        .filter(|booking| booking.worker.worker_id.0 >= 10_000)
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let scanner = tokio::spawn(touch_loop(
        router.manager().clone(),
        in_table_order,
        scan_period,
        stop.clone(),
    ));
    let scanning = phase(
        "scan",
        &plain(2),
        &subjects,
        &stats,
        &log,
        2,
        rate,
        duration,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let ScanLoop {
        steps: step_log,
        passes,
        touching: touch_time,
    } = scanner.await.unwrap();
    let windows = scan_windows(&step_log, 50_000);
    let steps = StepStats::new(&step_log);
    let scans = step_log.len() as f64 / router.manager().shard_count() as f64;
    println!(
        "during the scan phase: {scans:.1} full scans over {} leases (every {scan_period:?}); \
         one shard step, run by the ingress's applying task between bursts (what it held \
         ingest up): {}; re-touching all leases took {:.1} ms per pass",
        router.manager().active_leases(),
        steps.describe(),
        touch_time.as_secs_f64() * 1e3 / passes.max(1) as f64,
    );
    println!("scan_step_p99_us={}", percentile(&steps.wall, 0.99));
    println!("scan_longest_step_us={}", steps.max_wall());
    println!("scan_step_cpu_p99_us={}", percentile(&steps.cpu, 0.99));
    println!("scan_longest_step_cpu_us={}", steps.max_cpu());
    let s = stats.snapshot();
    println!(
        "ingress: received {}, applied {}, dropped {:?}",
        s.received,
        s.applied_total(),
        s.dropped.iter().filter(|(_, n)| *n > 0).collect::<Vec<_>>()
    );
    report("idle", &idle.samples, |_, _| true, Some(&idle.lag));
    // The publisher stamps an event as it takes it from its queue, before the linger: the
    // router's histogram covers the linger too.
    report("batched", &batched.samples, |_, _| true, Some(&batched.lag));
    report("scan", &scanning.samples, |_, _| true, Some(&scanning.lag));
    // The events in flight while a scan ran: sent before it ended, applied after it started.
    let during = |sent: u64, latency: u64| {
        let applied = sent + latency;
        let i = windows.partition_point(|(_, end)| *end < sent);
        windows.get(i).is_some_and(|(start, _)| *start <= applied)
    };
    let busy: u64 = windows.iter().map(|(a, b)| b - a).sum();
    println!(
        "scans ran {:.1} s in all, {:.0}% of the scan phase",
        busy as f64 / 1e6,
        busy as f64 / 1e4 / (duration.as_secs_f64() + 0.05)
    );
    report("during_scan", &scanning.samples, during, None);
    let mut l: Vec<u64> = batched
        .samples
        .iter()
        .map(|(_, latency)| *latency)
        .collect();
    l.sort_unstable();
    println!("batched_latency_p99_us={}", percentile(&l, 0.99));
    drop(router);
}

fn main() {
    common::run(bench());
}

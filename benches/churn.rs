//! 1,000 cycles of adding and removing a deployment's router while events for it keep
//! arriving (`cargo bench --bench churn`).
//!
//! A publisher sends lifecycles for the deployment at a steady rate the whole time, from a
//! child process (this bench binary run again with `CHURN_PUBLISH_TO` set), as workers are
//! other processes: the resident memory measured is the router process's alone.
//! Each cycle starts a router (NATS ingress on a shared connection, manager, scheduler,
//! reaper) on one shared `TaskTracker`, lets it apply events for a moment, then removes it:
//! even cycles with `shutdown()`, odd ones by dropping it. Resident memory and live tasks are
//! measured after the first 10 cycles and at the end, each after the removed routers' tasks
//! have wound down; the last line is `churn_rss_growth=<fraction>`. The bench counts the heap
//! bytes allocated and not yet freed too (its global allocator wraps the system one): what
//! the process holds, apart from what the allocator keeps for itself.
//!
//! Environment: `CHURN_CYCLES` (default 1000), `CHURN_RATE` (events/s, default 20000).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use lease_router::wire::{self, Envelope};
use lease_router::IngressStats;
use lease_router::Subjects;
use lease_router::{ApplyConfig, NatsIngress};
use lease_router::{Router, RouterConfig};
use tokio_util::task::TaskTracker;

use common::{nats, rss_bytes, subjects, LifecycleGen, LifecycleShape};

/// The system allocator, counting the bytes it has handed out and not yet been given back:
/// live heap memory, which (unlike resident memory) the allocator's caching and
/// fragmentation do not move.
struct Counting;

static LIVE_HEAP: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is passed to `System` unchanged; the counter is only arithmetic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_HEAP.fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE_HEAP.fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE_HEAP.fetch_sub(layout.size() as i64, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_HEAP.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const DEPLOYMENT: &str = "churn";
const WORKERS: u64 = 16;
/// How long each router lives.
const LIFETIME: Duration = Duration::from_millis(3);

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The child process: publishes to the server at `url` until its stdin closes (the bench
/// ended or died), then prints how many events it sent.
async fn publisher_process(url: String) {
    let rate = env_u64("CHURN_RATE", 20_000) as f64;
    let stop = Arc::new(AtomicBool::new(false));
    let publishing = tokio::spawn(publisher(
        nats(&url, None).await.client().clone(),
        subjects(DEPLOYMENT),
        rate,
        stop.clone(),
    ));
    // Blocks until the parent closes our stdin (or exits).
    tokio::task::spawn_blocking(|| std::io::copy(&mut std::io::stdin(), &mut std::io::sink()))
        .await
        .expect("stdin reader")
        .ok();
    stop.store(true, Ordering::Relaxed);
    println!("{}", publishing.await.expect("publisher"));
}

/// Starts [`publisher_process`] as a child of this process.
fn spawn_publisher(url: &str) -> tokio::process::Child {
    tokio::process::Command::new(std::env::current_exe().expect("own executable"))
        .env(PUBLISH_TO_ENV, url)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("publisher process starts")
}

/// Set in the publisher child: the NATS URL to publish to.
const PUBLISH_TO_ENV: &str = "CHURN_PUBLISH_TO";

/// Publishes lifecycles for the deployment until `stop`, paced on 1 ms ticks.
async fn publisher(
    client: async_nats::Client,
    subjects: Subjects,
    rate: f64,
    stop: Arc<AtomicBool>,
) -> u64 {
    let mut gen = LifecycleGen::new(
        4242,
        (0..WORKERS).collect(),
        u64::MAX,
        LifecycleShape {
            concurrency: 64,
            ..LifecycleShape::default()
        },
    );
    let worker_subjects: Vec<async_nats::Subject> = (0..WORKERS)
        .map(|w| subjects.worker_subject(w).into())
        .collect();
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    let start = Instant::now();
    let mut seq = 0u64;
    let mut buf = Vec::with_capacity(128);
    while !stop.load(Ordering::Relaxed) {
        ticker.tick().await;
        let due = (start.elapsed().as_secs_f64() * rate) as u64;
        while seq < due {
            let event = gen.next_event().expect("endless requests");
            seq += 1;
            let subject = worker_subjects[event.worker_id() as usize].clone();
            buf.clear();
            wire::encode_into(
                &Envelope::new(0xC4A2, seq, wire::unix_micros_now(), event),
                &mut buf,
            )
            .unwrap();
            client
                .publish(subject, Bytes::copy_from_slice(&buf))
                .await
                .expect("publish");
        }
    }
    seq
}

/// Waits (bounded) until no removed router's task is still winding down, then measures
/// resident memory and live heap bytes, live router tasks and the runtime's live tasks.
async fn settle(tracker: &TaskTracker) -> ((u64, i64), usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tracker.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Give the allocator and the client's subscription bookkeeping a moment too.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let alive = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let memory = (rss_bytes(), LIVE_HEAP.load(Ordering::Relaxed));
    (memory, tracker.len(), alive)
}

fn growth(base: f64, end: f64) -> f64 {
    if base == 0.0 {
        if end == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (end - base) / base
    }
}

async fn bench() {
    let cycles = env_u64("CHURN_CYCLES", 1000).max(11);
    println!("machine: {}", common::machine());
    let nats_server = common::bench_server().await;
    let server = &nats_server.server;
    let url = server.url();
    let subjects = subjects(DEPLOYMENT);
    // One connection for every router, as a service host has.
    let conn = nats(&url, None).await;
    let stats = Arc::new(IngressStats::new());
    let tracker = TaskTracker::new();
    let mut publishing = spawn_publisher(&url);

    let mut live_during = 0;
    let mut base = None;
    let start = Instant::now();
    for cycle in 1..=cycles {
        let ingress = NatsIngress::new(
            conn.client().clone(),
            subjects.clone(),
            ApplyConfig::default(),
            stats.clone(),
        );
        let router = Router::start_tracked(RouterConfig::new(DEPLOYMENT), ingress, tracker.clone())
            .await
            .expect("router starts");
        tokio::time::sleep(LIFETIME).await;
        live_during = live_during.max(tracker.len());
        if cycle % 2 == 0 {
            router.shutdown().await.expect("router shuts down cleanly");
        } else {
            drop(router);
        }
        if cycle % 250 == 0 {
            // The trend, unsettled (removed routers may still be winding down).
            println!(
                "cycle {cycle}: rss {:.2} MiB, live heap {:.2} MiB, live router tasks {}",
                rss_bytes() as f64 / 1048576.0,
                LIVE_HEAP.load(Ordering::Relaxed) as f64 / 1048576.0,
                tracker.len()
            );
        }
        if cycle == 10 {
            let (rss, tasks, alive) = settle(&tracker).await;
            println!(
                "after 10 cycles: rss {:.2} MiB, live heap {:.2} MiB, live router tasks {tasks}, \
                 runtime tasks {alive}",
                rss.0 as f64 / 1048576.0,
                rss.1 as f64 / 1048576.0
            );
            base = Some((rss, tasks, alive));
        }
    }
    let elapsed = start.elapsed();
    let (rss, tasks, alive) = settle(&tracker).await;
    drop(publishing.stdin.take());
    let out = publishing
        .wait_with_output()
        .await
        .expect("publisher exits");
    let published = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let (base_rss, base_tasks, base_alive) = base.expect("at least 10 cycles");
    let s = stats.snapshot();
    println!(
        "after {cycles} cycles ({:.1} s, {:.1} ms per cycle): rss {:.2} MiB, live heap {:.2} \
         MiB, live router tasks {tasks} (at most {live_during} while a router ran), runtime \
         tasks {alive}",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e3 / cycles as f64,
        rss.0 as f64 / 1048576.0,
        rss.1 as f64 / 1048576.0
    );
    println!(
        "events: published {published}, received by routers {}, applied {}, dropped {:?}",
        s.received,
        s.applied_total(),
        s.dropped.iter().filter(|(_, n)| *n > 0).collect::<Vec<_>>()
    );
    let task_growth = growth(base_tasks as f64, tasks as f64);
    let runtime_task_growth = growth(base_alive as f64, alive as f64);
    println!("churn_live_tasks_after_10={base_tasks}");
    println!("churn_live_tasks_end={tasks}");
    println!("churn_task_growth={task_growth:.3}");
    println!("churn_runtime_tasks_after_10={base_alive}");
    println!("churn_runtime_tasks_end={alive}");
    println!("churn_runtime_task_growth={runtime_task_growth:.3}");
    println!("churn_live_heap_bytes_after_10={}", base_rss.1);
    println!("churn_live_heap_bytes_end={}", rss.1);
    println!(
        "churn_rss_growth={:.4}",
        growth(base_rss.0 as f64, rss.0 as f64)
    );
}

fn main() {
    match std::env::var(PUBLISH_TO_ENV) {
        Ok(url) => common::run(publisher_process(url)),
        Err(_) => common::run(bench()),
    }
}

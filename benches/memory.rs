//! Resident memory per active lease at 1,000,000 leases, lease manager and scheduler together
//! (`cargo bench --bench memory`).
//!
//! Request ids are 36-character UUID-like strings, admitted in batches of 256 as the ingress
//! does. The lease tables keep such ids inline and the scheduler keeps only per-worker sums
//! (each lease carries its booking's weight), so the growth of resident memory is the lease
//! manager's shard tables, ids included: `bytes_per_lease`.

mod common;

use std::time::Instant;

use lease_router::{LeaseConfig, INLINE_KEY_BYTES};
use lease_router::{RequestLoad, WorkerWithDpRank};
use tokio_util::task::TaskTracker;

use common::{rss_bytes, uuid_like};

const LEASES: u64 = 1_000_000;
const WORKERS: u64 = 64;
/// Admissions between two yields, as the ingress applies a batch of up to 256 messages and
/// lets the scheduler drain.
const BATCH: u64 = 256;

fn per_lease(bytes: i64) -> f64 {
    bytes as f64 / LEASES as f64
}

async fn bench() {
    println!("machine: {}", common::machine());
    let tracker = TaskTracker::new();
    let (manager, scheduler, _task) = lease_router::internals::manager_and_scheduler(
        "memory",
        LeaseConfig {
            max_active_leases: 4_000_000,
            ..LeaseConfig::default()
        },
        &tracker,
    );
    // Warm the allocator and the runtime a little so the baseline is not the bare process.
    scheduler.loads().await.unwrap();

    let rss0 = rss_bytes() as i64;
    let start = Instant::now();
    let mut id = String::new();
    for first in (0..LEASES).step_by(BATCH as usize) {
        // As the ingress applies a burst of messages: one batch, ids borrowed from decoded
        // events that are dropped afterwards.
        let mut batch = manager.batch();
        for i in first..(first + BATCH).min(LEASES) {
            id.clear();
            id.push_str(&uuid_like(9, i));
            batch.admit_current(
                &id,
                WorkerWithDpRank::new(i % WORKERS, 0),
                RequestLoad::new(256 + (i % 4096) as u32, Some(64 + (i % 512) as u32)),
            );
        }
        drop(batch);
        tokio::task::yield_now().await;
    }
    // The scheduler has applied every booking once it answers a query.
    let loads = scheduler.loads().await.unwrap();
    let registered = start.elapsed();
    let booked: u64 = loads.iter().map(|(_, l)| l.active_bookings).sum();
    assert_eq!(booked, LEASES);
    assert_eq!(manager.active_leases() as u64, LEASES);
    let rss1 = rss_bytes() as i64;
    println!(
        "registered {LEASES} leases in {:.2} s (manager + scheduler)",
        registered.as_secs_f64()
    );
    println!(
        "rss: baseline {:.1} MiB, after leases {:.1} MiB",
        rss0 as f64 / 1048576.0,
        rss1 as f64 / 1048576.0,
    );
    println!(
        "per lease: request ids of {} bytes are kept inline (up to {INLINE_KEY_BYTES}); the \
         scheduler keeps sums for {} workers, no per-booking record",
        uuid_like(9, 0).len(),
        loads.len()
    );
    println!("bytes_per_lease={:.0}", per_lease(rss1 - rss0));
    drop(manager);
}

fn main() {
    // The registering loop runs on the main thread (standing in for the ingress task), the
    // scheduler actor on a runtime worker.
    common::run(bench());
}

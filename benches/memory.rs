//! Resident memory per active lease at 1,000,000 leases, lease manager and scheduler together
//! (`cargo bench --bench memory`).
//!
//! Request ids are 36-character UUID-like strings. The ids are made first and kept in a
//! vector (whose own 16 bytes per id are subtracted), so the figure splits into the ids and the
//! structures. The scheduler keeps only per-worker sums (each lease carries its booking's
//! weight), so the structures are the lease manager's shard tables. The main figure is
//! `bytes_per_lease` (ids included).

mod common;

use std::time::Instant;

use lease_router::lease::{LeaseConfig, RequestLeaseManager};
use lease_router::scheduler::spawn_scheduler;
use lease_router::types::{RequestId, RequestLoad, SchedulerBookingDescriptor, WorkerWithDpRank};
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
    let manager = RequestLeaseManager::new(
        "memory",
        LeaseConfig {
            max_active_leases: 4_000_000,
            ..LeaseConfig::default()
        },
    );
    let (scheduler, _task) = spawn_scheduler("memory", Some(manager.replica_observer()), &tracker);
    manager.set_scheduler(scheduler.cleanup()).unwrap();
    // Warm the allocator and the runtime a little so the baseline is not the bare process.
    scheduler.loads().await.unwrap();

    let rss0 = rss_bytes() as i64;
    let ids: Vec<RequestId> = (0..LEASES)
        .map(|i| RequestId::from(uuid_like(9, i)))
        .collect();
    let ids_vec_bytes = (ids.capacity() * std::mem::size_of::<RequestId>()) as i64;
    let rss1 = rss_bytes() as i64;

    let start = Instant::now();
    for (i, id) in ids.iter().enumerate() {
        let i = i as u64;
        let booking =
            SchedulerBookingDescriptor::new(id.clone(), WorkerWithDpRank::new(i % WORKERS, 0));
        manager.register_remote(
            booking,
            RequestLoad::new(256 + (i % 4096) as u32, Some(64 + (i % 512) as u32)),
        );
        if i % BATCH == BATCH - 1 {
            tokio::task::yield_now().await;
        }
    }
    // The scheduler has applied every booking once it answers a query.
    let loads = scheduler.loads().await.unwrap();
    let registered = start.elapsed();
    let booked: u64 = loads.iter().map(|(_, l)| l.active_bookings).sum();
    assert_eq!(booked, LEASES);
    assert_eq!(manager.active_leases() as u64, LEASES);
    let rss2 = rss_bytes() as i64;

    let ids_only = rss1 - rss0 - ids_vec_bytes;
    let structures = rss2 - rss1;
    let total = ids_only + structures;
    println!(
        "registered {LEASES} leases in {:.2} s (manager + scheduler)",
        registered.as_secs_f64()
    );
    println!(
        "rss: baseline {:.1} MiB, after ids {:.1} MiB, after leases {:.1} MiB",
        rss0 as f64 / 1048576.0,
        rss1 as f64 / 1048576.0,
        rss2 as f64 / 1048576.0
    );
    println!(
        "per lease: request id (Arc<str>, 36 chars) {:.1} B, manager + scheduler structures \
         {:.1} B (the scheduler keeps sums for {} workers, no per-booking record)",
        per_lease(ids_only),
        per_lease(structures),
        loads.len()
    );
    println!("bytes_per_lease={:.0}", per_lease(total));
    drop((ids, manager));
}

fn main() {
    // The registering loop runs on the main thread (standing in for the ingress task), the
    // scheduler actor on a runtime worker.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench());
}

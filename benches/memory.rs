//! Resident memory per active lease at 1,000,000 leases, lease manager and scheduler together
//! (`cargo bench --bench memory`).
//!
//! Request ids are 36-character UUID-like strings, admitted in batches of 256 as the ingress
//! does. The lease tables keep such ids inline and the scheduler keeps only per-worker sums
//! (each lease carries its booking's weight), so the growth of resident memory is the lease
//! manager's shard tables, ids included: `bytes_per_lease`.
//!
//! Then the prefix index: 10,000,000 entries (one block held by one worker rank: 1,000 ranks
//! of 10,000 blocks each, every block its own), learned 512 blocks at a time as from
//! 8,192-token prompts: `bytes_per_index_entry` (goal <= 48).

mod common;

use std::time::Instant;

use lease_router::{block_hashes, LeaseConfig, PrefixIndex, PrefixIndexConfig, INLINE_KEY_BYTES};
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
    index_entries();
}

const INDEX_ENTRIES: u32 = 10_000_000;
const INDEX_WORKERS: u32 = 1_000;
const PROMPT_BLOCKS: usize = 512;

fn index_entries() {
    let per_worker = INDEX_ENTRIES / INDEX_WORKERS;
    let mut index = PrefixIndex::new(
        PrefixIndexConfig::new()
            .with_worker_capacity(per_worker)
            .with_max_entries(INDEX_ENTRIES),
    );
    let rss0 = rss_bytes() as i64;
    let start = Instant::now();
    let mut tokens: Vec<u32> = Vec::with_capacity(PROMPT_BLOCKS * 16);
    let mut prompts = 0u32;
    for worker in 0..INDEX_WORKERS {
        let rank = WorkerWithDpRank::new(u64::from(worker), 0);
        let mut held = 0;
        while held < per_worker {
            tokens.clear();
            tokens.extend((0..PROMPT_BLOCKS as u32 * 16).map(|t| t ^ prompts.rotate_left(13)));
            prompts += 1;
            let hashes = block_hashes(&tokens, 16);
            let take = hashes.len().min((per_worker - held) as usize);
            index.learn(rank, &hashes[..take]);
            held += take as u32;
        }
    }
    let built = start.elapsed();
    assert_eq!(index.len(), INDEX_ENTRIES as usize);
    assert_eq!(index.evicted(), 0);
    let rss1 = rss_bytes() as i64;
    println!(
        "prefix index: {INDEX_ENTRIES} entries ({INDEX_WORKERS} ranks x {per_worker} blocks, \
         {prompts} prompts of {PROMPT_BLOCKS} blocks hashed and learned) in {:.2} s",
        built.as_secs_f64()
    );
    println!(
        "bytes_per_index_entry={:.1}",
        (rss1 - rss0) as f64 / f64::from(INDEX_ENTRIES)
    );
}

fn main() {
    // The registering loop runs on the main thread (standing in for the ingress task), the
    // scheduler actor on a runtime worker.
    common::run(bench());
}

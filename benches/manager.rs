//! The request-lease manager's per-event work at 1,000, 100,000 and 1,000,000 active leases,
//! and one reaper scan over 1,000,000 (`cargo bench --bench manager`).
//!
//! Every manager has a scheduler actor attached, as in a router: an admission or a completion
//! includes queueing its booking or release for it. The actor runs on a current-thread
//! runtime and is given time only between timed chunks (untimed), so the figures are the
//! manager's own cost, without the noise of a second thread draining the queue meanwhile.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode};
use lease_router::SchedulerHandle;
use lease_router::{LeaseConfig, RequestLeaseManager};
use lease_router::{RequestId, RequestLoad, SchedulerBookingDescriptor, WorkerWithDpRank};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use common::{uuid_like, Rng};

const SIZES: [usize; 3] = [1_000, 100_000, 1_000_000];
const WORKERS: u64 = 64;
/// Fresh admissions (or completions) timed at once; the population then goes back to size.
const CHUNK: usize = 100;

struct Fixture {
    rt: Runtime,
    manager: RequestLeaseManager,
    scheduler: SchedulerHandle,
    live: Vec<SchedulerBookingDescriptor>,
    next_fresh: u64,
    _scheduler_task: JoinHandle<()>,
}

fn load(i: u64) -> RequestLoad {
    RequestLoad::new(256 + (i % 4096) as u32, Some(64 + (i % 512) as u32))
}

fn booking(space: u64, i: u64) -> SchedulerBookingDescriptor {
    SchedulerBookingDescriptor::new(
        RequestId::from(uuid_like(space, i)),
        WorkerWithDpRank::new(i % WORKERS, (i / WORKERS % 2) as u32),
    )
}

impl Fixture {
    fn new(size: usize) -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let tracker = TaskTracker::new();
        let (manager, scheduler, task) = {
            let _enter = rt.enter();
            lease_router::internals::manager_and_scheduler(
                "bench",
                LeaseConfig {
                    max_active_leases: 4_000_000,
                    ..LeaseConfig::default()
                },
                &tracker,
            )
        };
        let mut live = Vec::with_capacity(size);
        for i in 0..size as u64 {
            let b = booking(1, i);
            manager.register_remote(b.clone(), load(i));
            live.push(b);
            if i % 10_000 == 9_999 {
                rt.block_on(scheduler.loads()).unwrap();
            }
        }
        let fixture = Self {
            rt,
            manager,
            scheduler,
            live,
            next_fresh: 0,
            _scheduler_task: task,
        };
        fixture.sync();
        assert_eq!(fixture.manager.active_leases(), size);
        fixture
    }

    /// Waits until the scheduler has applied everything queued.
    fn sync(&self) {
        self.rt.block_on(self.scheduler.loads()).unwrap();
    }

    fn fresh_chunk(&mut self) -> Vec<SchedulerBookingDescriptor> {
        let start = self.next_fresh;
        self.next_fresh += CHUNK as u64;
        (start..self.next_fresh).map(|i| booking(2, i)).collect()
    }
}

fn apply(c: &mut Criterion) {
    common::allocator::tune_for_latency();
    let mut group = c.benchmark_group("manager");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500));
    for size in SIZES {
        let mut f = Fixture::new(size);

        // admit: a new booking (lease inserted, booking queued to the scheduler).
        group.bench_function(BenchmarkId::new("admit", size), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    let chunk = f.fresh_chunk();
                    let n = chunk.len().min((iters - done) as usize);
                    let start = Instant::now();
                    for (i, bk) in chunk[..n].iter().enumerate() {
                        black_box(f.manager.register_remote(bk.clone(), load(i as u64)));
                    }
                    total += start.elapsed();
                    for bk in &chunk[..n] {
                        f.manager.complete_remote(bk);
                    }
                    f.sync();
                    done += n as u64;
                }
                total
            })
        });

        // touch: `progressed` on a random live lease (mostly coalesced: already TOUCHED).
        let mut rng = Rng::new(size as u64);
        group.bench_function(BenchmarkId::new("touch", size), |b| {
            b.iter(|| {
                let bk = &f.live[rng.below(f.live.len() as u64) as usize];
                black_box(f.manager.touch_booking(bk))
            })
        });

        // lookup: what every wire event does first (events carry no attempt id).
        group.bench_function(BenchmarkId::new("lookup", size), |b| {
            b.iter(|| {
                let bk = &f.live[rng.below(f.live.len() as u64) as usize];
                black_box(f.manager.current_booking(&bk.request_id, bk.worker))
            })
        });

        // touch_current: a wire `progressed` (request id and worker, no attempt id) renewing
        // its live lease in one lookup.
        group.bench_function(BenchmarkId::new("touch_current", size), |b| {
            b.iter(|| {
                let bk = &f.live[rng.below(f.live.len() as u64) as usize];
                black_box(f.manager.touch_current(&bk.request_id, bk.worker))
            })
        });

        // complete: claim, remove and queue the release of a live lease.
        group.bench_function(BenchmarkId::new("complete", size), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                while done < iters {
                    let chunk = f.fresh_chunk();
                    let n = chunk.len().min((iters - done) as usize);
                    for (i, bk) in chunk[..n].iter().enumerate() {
                        f.manager.register_remote(bk.clone(), load(i as u64));
                    }
                    f.sync();
                    let start = Instant::now();
                    for bk in &chunk[..n] {
                        black_box(f.manager.complete_remote(bk));
                    }
                    total += start.elapsed();
                    f.sync();
                    done += n as u64;
                }
                total
            })
        });
        f.sync();
        assert_eq!(f.manager.active_leases(), size);

        if size == 1_000_000 {
            scan(&mut group, &f);
        }
    }
    group.finish();
}

/// One full reaper scan over 1,000,000 leases that all survive it (every lease is touched
/// again, untimed, before each scan, so the population stays the same).
fn scan(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>, f: &Fixture) {
    let steps = std::cell::RefCell::new(Vec::new());
    group.sampling_mode(SamplingMode::Flat).sample_size(10);
    group.bench_function(BenchmarkId::new("scan", f.live.len()), |b| {
        b.to_async(&f.rt).iter_custom(|iters| {
            let (manager, live) = (&f.manager, &f.live);
            let steps = &steps;
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    for bk in live {
                        manager.touch_booking(bk);
                    }
                    let start = Instant::now();
                    let report = manager.scan().await;
                    total += start.elapsed();
                    assert_eq!(report.expired, 0);
                    steps.borrow_mut().extend_from_slice(&report.steps);
                }
                total
            }
        })
    });
    println!(
        "scan over {} leases, one shard step: {}",
        f.live.len(),
        common::StepStats::new(&steps.into_inner()).describe()
    );
}

criterion_group!(benches, apply);
criterion_main!(benches);

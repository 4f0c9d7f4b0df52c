//! The request-lease manager: one lease per live booking, renewed by `progressed`, ended by
//! `completed`, a worker reset, or the reaper when nobody renews it.
//!
//! Leases live in a fixed number of shards, each a hash map behind its own lock, so that a
//! reaper scan over a million leases never holds up ingest for more than one shard's worth
//! of work, and touches only take a shard's read lock. Every claim happens under the shard's
//! write lock together with the removal and the scheduler release, so a booking is released
//! exactly once and its release is queued after its booking.
//!
//! # Events before `set_scheduler`
//! A manager that has no scheduler yet refuses admissions ([`AdmitOutcome::NotWired`]) and
//! counts them in [`LeaseStats::refused_unwired`]: it stores nothing it could not later
//! release. [`crate::router::Router`] wires the scheduler before it starts any ingress, so a
//! refusal means a library user fed events to an unwired manager.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use hashbrown::hash_map::Entry;
use hashbrown::{DefaultHashBuilder, HashMap};
use parking_lot::RwLock;
use serde::Serialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, Instrument};

use super::clock::{LeaseClock, LeaseState, ReapOutcome, TouchOutcome};
use crate::observer::{ReplicaRequestLeaseObserver, WeakRequestLeaseObserver};
use crate::scheduler::{ReleaseReason, SchedulerBookingCleanup};
use crate::types::{
    AttemptId, DpRank, RequestId, RequestLoad, SchedulerBookingDescriptor, WorkerId,
    WorkerWithDpRank,
};

/// The reference router's scan interval: a silent lease lives 5 to 10 minutes.
pub const DEFAULT_SCAN_INTERVAL: Duration = Duration::from_secs(300);
/// Default bound of [`LeaseConfig::max_active_leases`]: far above any real deployment's
/// in-flight requests, far below what would exhaust a router's memory (a lease costs about a
/// hundred bytes plus its request id).
pub const DEFAULT_MAX_ACTIVE_LEASES: usize = 1_000_000;
/// Enough shards that one shard's scan step stays well under a millisecond at a million
/// leases.
const DEFAULT_SHARDS: usize = 256;
/// The reaper's pause between two shards.
const SCAN_STEP_PAUSE: Duration = Duration::from_millis(1);

/// Settings of a [`RequestLeaseManager`].
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// How often the reaper scans; a lease expires one to two intervals after its last touch
    /// (plus the scan's own length: its shards are spread over at most a quarter interval).
    pub scan_interval: Duration,
    /// Number of lock shards (rounded up to a power of two).
    pub shards: usize,
    /// At most this many live leases. Past it, an admission that would create a new lease is
    /// refused ([`AdmitOutcome::Full`], counted in [`LeaseStats::refused_full`]); duplicates
    /// and new attempts of a live request id (which replace their lease) are still accepted.
    /// The bound may be passed by at most the number of concurrent admitters: the count is
    /// shared by all shards, and each admitter holds only its own shard's lock.
    pub max_active_leases: usize,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            scan_interval: DEFAULT_SCAN_INTERVAL,
            shards: DEFAULT_SHARDS,
            max_active_leases: DEFAULT_MAX_ACTIVE_LEASES,
        }
    }
}

/// The result of an admission.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AdmitOutcome {
    /// A new lease.
    Registered,
    /// The same booking again: counted as a touch.
    Duplicate,
    /// A new attempt replaced an older attempt of the same request id, whose booking was
    /// released.
    Superseded,
    /// No scheduler is wired yet: refused, nothing stored.
    NotWired,
    /// [`LeaseConfig::max_active_leases`] live leases already: refused, nothing stored.
    Full,
}

/// The result of a renewal.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ProgressOutcome {
    /// The lease was QUIET and is TOUCHED again.
    Renewed,
    /// The lease was already TOUCHED since the last scan.
    Coalesced,
    /// No live lease has this attempt: unknown, completed, expired or superseded.
    Stale,
}

/// The result of a completion.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CompleteOutcome {
    /// This completion claimed the lease and released its booking.
    Released,
    /// No live lease has this attempt: nothing released.
    Stale,
}

/// `set_scheduler` may be called only once.
#[derive(Debug, thiserror::Error)]
pub enum SetSchedulerError {
    #[error("the request-lease manager already has a scheduler")]
    AlreadySet,
}

/// Counters of a manager, for dashboards and tests.
#[derive(Debug, Default)]
pub struct LeaseStatsCounters {
    registered: AtomicU64,
    duplicate_admits: AtomicU64,
    superseded: AtomicU64,
    renewed: AtomicU64,
    coalesced: AtomicU64,
    stale_progress: AtomicU64,
    completed: AtomicU64,
    stale_completions: AtomicU64,
    expired: AtomicU64,
    reset_released: AtomicU64,
    refused_unwired: AtomicU64,
    refused_full: AtomicU64,
    scans: AtomicU64,
}

/// A point-in-time copy of a manager's counters.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct LeaseStats {
    pub active: u64,
    pub registered: u64,
    pub duplicate_admits: u64,
    pub superseded: u64,
    pub renewed: u64,
    pub coalesced: u64,
    pub stale_progress: u64,
    pub completed: u64,
    pub stale_completions: u64,
    pub expired: u64,
    pub reset_released: u64,
    pub refused_unwired: u64,
    /// Admissions refused because [`LeaseConfig::max_active_leases`] were live.
    pub refused_full: u64,
    pub scans: u64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// One live lease. The request id is the map key.
#[derive(Debug)]
struct Lease {
    attempt_id: AttemptId,
    worker: WorkerWithDpRank,
    clock: LeaseClock,
    /// Seconds since the manager started; four bytes instead of an `Instant`'s sixteen.
    admitted_at: u32,
}

impl Lease {
    fn booking(&self, request_id: &RequestId) -> SchedulerBookingDescriptor {
        SchedulerBookingDescriptor {
            request_id: request_id.clone(),
            worker: self.worker,
            attempt_id: self.attempt_id,
        }
    }
}

/// A lease as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    pub booking: SchedulerBookingDescriptor,
    pub state: LeaseState,
    pub age: Duration,
}

type Shard = RwLock<HashMap<RequestId, Lease>>;

pub(crate) struct RequestLeaseManagerInner {
    deployment: Arc<str>,
    shards: Box<[Shard]>,
    shard_hasher: DefaultHashBuilder,
    scheduler: OnceLock<SchedulerBookingCleanup>,
    stats: LeaseStatsCounters,
    epoch: Instant,
    scan_interval: Duration,
    /// Live leases across all shards, kept in step with insertions and removals (each under
    /// its shard's write lock), for the [`LeaseConfig::max_active_leases`] check.
    active: AtomicU64,
    max_active_leases: u64,
}

impl RequestLeaseManagerInner {
    /// `retain` on one shard's map, keeping the live-lease count in step.
    fn retain_counted(
        &self,
        map: &mut HashMap<RequestId, Lease>,
        keep: impl FnMut(&RequestId, &mut Lease) -> bool,
    ) {
        let before = map.len();
        map.retain(keep);
        let removed = before - map.len();
        self.active.fetch_sub(removed as u64, Ordering::Relaxed);
    }
}

/// The liveness record of every booking of one deployment.
///
/// Cheap to clone: clones share one state. See the module docs for what happens to events
/// that arrive before [`RequestLeaseManager::set_scheduler`].
#[derive(Clone)]
pub struct RequestLeaseManager {
    inner: Arc<RequestLeaseManagerInner>,
}

/// A handle that does not keep the manager alive.
#[derive(Clone)]
pub struct WeakRequestLeaseManager(Weak<RequestLeaseManagerInner>);

impl WeakRequestLeaseManager {
    pub fn upgrade(&self) -> Option<RequestLeaseManager> {
        self.0.upgrade().map(|inner| RequestLeaseManager { inner })
    }
}

impl RequestLeaseManager {
    pub fn new(deployment: &str, config: LeaseConfig) -> Self {
        let shards = config.shards.max(1).next_power_of_two();
        Self {
            inner: Arc::new(RequestLeaseManagerInner {
                deployment: Arc::from(deployment),
                shards: (0..shards).map(|_| RwLock::new(HashMap::new())).collect(),
                shard_hasher: DefaultHashBuilder::default(),
                scheduler: OnceLock::new(),
                stats: LeaseStatsCounters::default(),
                epoch: Instant::now(),
                scan_interval: config.scan_interval,
                active: AtomicU64::new(0),
                max_active_leases: u64::try_from(config.max_active_leases).unwrap_or(u64::MAX),
            }),
        }
    }

    pub(crate) fn from_inner(inner: Arc<RequestLeaseManagerInner>) -> Self {
        Self { inner }
    }

    pub fn deployment(&self) -> &str {
        &self.inner.deployment
    }

    pub fn downgrade(&self) -> WeakRequestLeaseManager {
        WeakRequestLeaseManager(Arc::downgrade(&self.inner))
    }

    /// The observer to hand to the scheduler and the ingress: it holds only a `Weak` of this
    /// manager, so it never keeps the manager (and through it the scheduler) alive.
    pub fn replica_observer(&self) -> Arc<dyn ReplicaRequestLeaseObserver> {
        Arc::new(WeakRequestLeaseObserver::new(Arc::downgrade(&self.inner)))
    }

    /// Wires the scheduler that bookings are counted in and released from.
    ///
    /// # Errors
    /// [`SetSchedulerError::AlreadySet`] on a second call.
    pub fn set_scheduler(&self, cleanup: SchedulerBookingCleanup) -> Result<(), SetSchedulerError> {
        self.inner
            .scheduler
            .set(cleanup)
            .map_err(|_| SetSchedulerError::AlreadySet)
    }

    fn shard(&self, request_id: &str) -> &Shard {
        let hash = self.inner.shard_hasher.hash_one(request_id);
        // The high bits: the map inside the shard uses the low ones.
        let index = (hash >> 32) as usize & (self.inner.shards.len() - 1);
        &self.inner.shards[index]
    }

    fn now_secs(&self) -> u32 {
        u32::try_from(self.inner.epoch.elapsed().as_secs()).unwrap_or(u32::MAX)
    }

    /// Records a booking admitted by a worker (ours or another replica's) and counts it in
    /// the scheduler. A second admission of the same booking is a touch; a new attempt under
    /// a live request id replaces the old attempt and releases its booking.
    pub fn register_remote(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
    ) -> AdmitOutcome {
        let stats = &self.inner.stats;
        let Some(scheduler) = self.inner.scheduler.get() else {
            bump(&stats.refused_unwired);
            return AdmitOutcome::NotWired;
        };
        let lease = Lease {
            attempt_id: booking.attempt_id,
            worker: booking.worker,
            clock: LeaseClock::touched(),
            admitted_at: self.now_secs(),
        };
        let mut shard = self.shard(&booking.request_id).write();
        // Bookings and releases are queued while the shard lock is held, so the scheduler
        // sees them in the order the leases changed.
        match shard.entry(booking.request_id.clone()) {
            Entry::Occupied(mut entry) => {
                if entry.get().attempt_id == booking.attempt_id {
                    entry.get().clock.touch();
                    bump(&stats.duplicate_admits);
                    return AdmitOutcome::Duplicate;
                }
                let old = entry.insert(lease);
                if old.clock.claim() {
                    scheduler.release(old.booking(&booking.request_id), ReleaseReason::Superseded);
                }
                scheduler.book(booking, load);
                bump(&stats.superseded);
                AdmitOutcome::Superseded
            }
            Entry::Vacant(entry) => {
                // Counted across shards without their locks: approximate by the number of
                // concurrent admitters, which is enough to bound memory.
                if self.inner.active.load(Ordering::Relaxed) >= self.inner.max_active_leases {
                    bump(&stats.refused_full);
                    return AdmitOutcome::Full;
                }
                entry.insert(lease);
                self.inner.active.fetch_add(1, Ordering::Relaxed);
                scheduler.book(booking, load);
                bump(&stats.registered);
                AdmitOutcome::Registered
            }
        }
    }

    /// Renews the lease of `booking`, if that attempt is still live.
    pub fn touch_booking(&self, booking: &SchedulerBookingDescriptor) -> ProgressOutcome {
        self.touch_where(&booking.request_id, |lease| {
            lease.attempt_id == booking.attempt_id
        })
        .unwrap_or_else(|| self.count_touch(ProgressOutcome::Stale))
    }

    /// Renews the live lease of `request_id` if it runs on `worker`, in one lookup: how a
    /// wire `progressed` (which carries no attempt id) is applied. `None` when there is no
    /// such lease, so the caller can hold the event for an admission still on its way.
    pub fn touch_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<ProgressOutcome> {
        self.touch_where(request_id, |lease| lease.worker == worker)
    }

    fn touch_where(
        &self,
        request_id: &str,
        matches: impl Fn(&Lease) -> bool,
    ) -> Option<ProgressOutcome> {
        let shard = self.shard(request_id).read();
        let lease = shard.get(request_id).filter(|lease| matches(lease))?;
        let outcome = match lease.clock.touch() {
            TouchOutcome::Renewed => ProgressOutcome::Renewed,
            TouchOutcome::Coalesced => ProgressOutcome::Coalesced,
            TouchOutcome::Claimed => ProgressOutcome::Stale,
        };
        drop(shard);
        Some(self.count_touch(outcome))
    }

    fn count_touch(&self, outcome: ProgressOutcome) -> ProgressOutcome {
        let stats = &self.inner.stats;
        bump(match outcome {
            ProgressOutcome::Renewed => &stats.renewed,
            ProgressOutcome::Coalesced => &stats.coalesced,
            ProgressOutcome::Stale => &stats.stale_progress,
        });
        outcome
    }

    /// Ends the lease of `booking` and releases its booking, if that attempt is still live.
    pub fn complete_remote(&self, booking: &SchedulerBookingDescriptor) -> CompleteOutcome {
        self.complete_where(&booking.request_id, |lease| {
            lease.attempt_id == booking.attempt_id
        })
        .unwrap_or_else(|| self.count_completion(false))
    }

    /// Ends the live lease of `request_id` if it runs on `worker`, in one lookup: how a wire
    /// `completed` is applied. `None` when there is no such lease, so the caller can keep a
    /// tombstone against an admission still on its way.
    pub fn complete_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<CompleteOutcome> {
        self.complete_where(request_id, |lease| lease.worker == worker)
    }

    fn complete_where(
        &self,
        request_id: &str,
        matches: impl Fn(&Lease) -> bool,
    ) -> Option<CompleteOutcome> {
        let mut shard = self.shard(request_id).write();
        let hashbrown::hash_map::EntryRef::Occupied(entry) = shard.entry_ref(request_id) else {
            return None;
        };
        if !matches(entry.get()) {
            return None;
        }
        let (key, lease) = entry.remove_entry();
        self.inner.active.fetch_sub(1, Ordering::Relaxed);
        let released = lease.clock.claim();
        if released {
            if let Some(scheduler) = self.inner.scheduler.get() {
                // Queued under the shard lock: after this booking's own `book`.
                scheduler.release(lease.booking(&key), ReleaseReason::Completed);
            }
        }
        drop(shard);
        Some(self.count_completion(released))
    }

    fn count_completion(&self, released: bool) -> CompleteOutcome {
        let stats = &self.inner.stats;
        if released {
            bump(&stats.completed);
            CompleteOutcome::Released
        } else {
            bump(&stats.stale_completions);
            CompleteOutcome::Stale
        }
    }

    /// Drops every lease of a worker that restarted or left (all its ranks when `dp_rank` is
    /// `None`) and releases their bookings. Returns how many were dropped.
    pub fn reset_worker(&self, worker_id: WorkerId, dp_rank: Option<DpRank>) -> usize {
        let matches = |w: &WorkerWithDpRank| {
            w.worker_id == worker_id && dp_rank.is_none_or(|rank| w.dp_rank == rank)
        };
        let scheduler = self.inner.scheduler.get();
        let mut dropped = 0;
        for shard in self.inner.shards.iter() {
            self.inner
                .retain_counted(&mut shard.write(), |request_id, lease| {
                    if !matches(&lease.worker) {
                        return true;
                    }
                    if lease.clock.claim() {
                        dropped += 1;
                        if let Some(scheduler) = scheduler {
                            scheduler
                                .release(lease.booking(request_id), ReleaseReason::WorkerReset);
                        }
                    }
                    false
                });
        }
        self.inner
            .stats
            .reset_released
            .fetch_add(dropped as u64, Ordering::Relaxed);
        debug!(deployment = %self.inner.deployment, worker = %worker_id, dropped, "worker reset");
        dropped
    }

    /// The live booking of `request_id`, if it runs on `worker`: how events that carry no
    /// attempt id (every event on the wire) find the attempt they are about.
    pub fn current_booking(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<SchedulerBookingDescriptor> {
        let shard = self.shard(request_id).read();
        shard
            .get_key_value(request_id)
            .filter(|(_, lease)| lease.worker == worker)
            .map(|(key, lease)| lease.booking(key))
    }

    /// The lease of `request_id`, if it is live.
    pub fn lease(&self, request_id: &RequestId) -> Option<LeaseRecord> {
        let shard = self.shard(request_id).read();
        shard.get(request_id).map(|l| self.record(request_id, l))
    }

    fn record(&self, request_id: &RequestId, lease: &Lease) -> LeaseRecord {
        let age = self.now_secs().saturating_sub(lease.admitted_at);
        LeaseRecord {
            booking: lease.booking(request_id),
            state: lease.clock.state(),
            age: Duration::from_secs(u64::from(age)),
        }
    }

    /// Up to `limit` live leases, in no particular order.
    pub fn leases(&self, limit: usize) -> Vec<LeaseRecord> {
        let mut out = Vec::new();
        for shard in self.inner.shards.iter() {
            let shard = shard.read();
            for (request_id, lease) in shard.iter() {
                if out.len() >= limit {
                    return out;
                }
                out.push(self.record(request_id, lease));
            }
        }
        out
    }

    pub fn active_leases(&self) -> usize {
        self.inner.shards.iter().map(|s| s.read().len()).sum()
    }

    pub fn stats(&self) -> LeaseStats {
        let c = &self.inner.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LeaseStats {
            active: self.active_leases() as u64,
            registered: get(&c.registered),
            duplicate_admits: get(&c.duplicate_admits),
            superseded: get(&c.superseded),
            renewed: get(&c.renewed),
            coalesced: get(&c.coalesced),
            stale_progress: get(&c.stale_progress),
            completed: get(&c.completed),
            stale_completions: get(&c.stale_completions),
            expired: get(&c.expired),
            reset_released: get(&c.reset_released),
            refused_unwired: get(&c.refused_unwired),
            refused_full: get(&c.refused_full),
            scans: get(&c.scans),
        }
    }

    /// One reaper pass over one shard; returns how many leases expired.
    fn scan_shard(&self, index: usize) -> usize {
        let scheduler = self.inner.scheduler.get();
        let mut expired = 0;
        let inner = &self.inner;
        inner.retain_counted(
            &mut inner.shards[index].write(),
            |request_id, lease| match lease.clock.reap() {
                ReapOutcome::SecondChance => true,
                ReapOutcome::Expired => {
                    expired += 1;
                    debug!(request_id = %request_id, worker = %lease.worker, "lease expired");
                    if let Some(scheduler) = scheduler {
                        scheduler.release(lease.booking(request_id), ReleaseReason::Expired);
                    }
                    false
                }
                ReapOutcome::AlreadyClaimed => false,
            },
        );
        // Counted as the shard is done, not at the end of the scan: a scan is spread out.
        inner
            .stats
            .expired
            .fetch_add(expired as u64, Ordering::Relaxed);
        expired
    }

    /// Runs one full reaper scan now, pausing between shards as the reaper does so ingest
    /// keeps flowing. Returns how many leases expired.
    pub async fn scan(&self) -> usize {
        let mut expired = 0;
        for index in 0..self.inner.shards.len() {
            expired += self.scan_shard(index);
            tokio::time::sleep(SCAN_STEP_PAUSE).await;
        }
        bump(&self.inner.stats.scans);
        expired
    }

    /// Starts the reaper on `tracker`. It holds only a `Weak` of the manager, and ends when
    /// `cancel` fires or the manager is gone.
    pub fn spawn_reaper(&self, cancel: CancellationToken, tracker: &TaskTracker) -> JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        let interval = self.inner.scan_interval;
        let span = tracing::info_span!("reaper", deployment = %self.inner.deployment);
        tracker.spawn(reaper(weak, interval, cancel).instrument(span))
    }
}

async fn reaper(
    weak: Weak<RequestLeaseManagerInner>,
    interval: Duration,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = ticker.tick() => {}
        }
        let shards = match weak.upgrade() {
            Some(inner) => inner.shards.len(),
            None => break,
        };
        // At most a quarter of the interval goes into pauses, so short intervals still scan
        // on time.
        let pause = SCAN_STEP_PAUSE.min(interval / (4 * shards.max(1) as u32));
        let mut expired = 0;
        for index in 0..shards {
            // Upgrade per shard: a scan never keeps a torn-down manager alive for long.
            let Some(inner) = weak.upgrade() else {
                debug!("reaper stopped: the manager is gone");
                return;
            };
            expired += RequestLeaseManager::from_inner(inner).scan_shard(index);
            // A pause, not just a yield: on two cores a scan that runs flat out takes one
            // core from ingest for its whole length. Spread over the interval it costs
            // nothing (a 300 s interval, a ~0.3 s scan).
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        if let Some(inner) = weak.upgrade() {
            bump(&inner.stats.scans);
        }
        if expired > 0 {
            debug!(expired, "reaper scan expired leases");
        }
    }
    debug!("reaper stopped");
}

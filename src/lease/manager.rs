//! The request-lease manager: one lease per live booking, renewed by `progressed`, ended by
//! `completed`, a worker reset, or the reaper when nobody renews it.
//!
//! Leases live in a fixed number of shards, each a hash map behind its own lock, so that a
//! reaper scan over a million leases never holds up ingest for more than one shard's worth
//! of work, and touches only take a shard's read lock. A booking is released by whoever
//! claims its lease's clock (an atomic swap), so exactly once: completions, supersessions and
//! resets claim under the shard's write lock as they remove the lease; the reaper claims
//! under the read lock and removes what it claimed afterwards. A lease
//! keeps its booking's weight, and the release gives that weight back: the scheduler keeps
//! only per-worker sums, so the lease table is the one per-booking record.
//!
//! Scheduler operations and counters are gathered per call, or per [`LeaseBatch`] of events,
//! and handed over after the shard lock is released. A manager is built with the scheduler's
//! cleanup handle, so every booking it stores can be released.

use std::collections::VecDeque;
use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use hashbrown::{hash_table, DefaultHashBuilder, HashTable};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tracing::debug;

use super::clock::{LeaseClock, LeaseState, ReapOutcome, TouchOutcome};
use super::key::{hash_id, LeaseKey};
use super::weight::LeaseWeight;
use crate::admission::ClassId;
use crate::load::RequestLoad;
use crate::load::WorkerLoad;
use crate::observer::{AdmitOutcome, CompleteOutcome, ProgressOutcome};
use crate::prefix::PrefixState;
use crate::scheduler::{Op, ReleaseReason, SchedulerBookingCleanup};
use crate::types::{
    AttemptId, DpRank, RequestId, SchedulerBookingDescriptor, WorkerId, WorkerWithDpRank,
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
    /// How long a route decision's provisional booking waits for its worker's `admitted`
    /// before it is released ([`LeaseStats::provisional_expired`]): the time from a decision
    /// to its worker's admission is milliseconds, so a booking still provisional after this
    /// is a request that never reached its worker, and would otherwise weigh on it as
    /// phantom load for a whole lease lifetime.
    pub provisional_deadline: Duration,
}

/// Default of [`LeaseConfig::provisional_deadline`].
pub const DEFAULT_PROVISIONAL_DEADLINE: Duration = Duration::from_secs(5);

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            scan_interval: DEFAULT_SCAN_INTERVAL,
            shards: DEFAULT_SHARDS,
            max_active_leases: DEFAULT_MAX_ACTIVE_LEASES,
            provisional_deadline: DEFAULT_PROVISIONAL_DEADLINE,
        }
    }
}

/// Step timings kept for [`RequestLeaseManager::take_scan_steps`]: a few scans' worth.
const STEP_LOG: usize = 4096;

/// How long one scan step took.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepTime {
    /// When it started, unix µs: to line steps up with other wall-clock records.
    pub started_us: u64,
    /// Wall time: what the step held its task (and, for the claims, its shard) up, including
    /// any time the OS kept the thread off the CPU meanwhile.
    pub wall: Duration,
    /// The thread's CPU time: the step's own cost.
    pub cpu: Duration,
}

/// The most recent step timings of a manager's reaper, oldest dropped first.
#[derive(Default)]
pub(super) struct StepLog(Mutex<VecDeque<StepTime>>);

impl StepLog {
    pub(super) fn push(&self, step: StepTime) {
        let mut log = self.0.lock();
        if log.len() == STEP_LOG {
            log.pop_front();
        }
        log.push_back(step);
    }

    pub(super) fn take(&self) -> Vec<StepTime> {
        self.0.lock().drain(..).collect()
    }
}

/// What a manager counts, one slot each in [`LeaseStatsCounters`] and in a batch's
/// pending counts.
#[derive(Clone, Copy, Debug)]
enum Counter {
    Registered,
    DuplicateAdmits,
    Superseded,
    Renewed,
    Coalesced,
    StaleProgress,
    Completed,
    StaleCompletions,
    Expired,
    ResetReleased,
    RefusedFull,
    Scans,
    Provisional,
    TakenOver,
    ProvisionalExpired,
    RoutesCancelled,
}

const COUNTERS: usize = Counter::RoutesCancelled as usize + 1;

/// Counters of a manager, for dashboards and tests.
#[derive(Debug, Default)]
pub(super) struct LeaseStatsCounters([AtomicU64; COUNTERS]);

impl LeaseStatsCounters {
    fn add(&self, counter: Counter, n: u64) {
        self.0[counter as usize].fetch_add(n, Ordering::Relaxed);
    }

    fn get(&self, counter: Counter) -> u64 {
        self.0[counter as usize].load(Ordering::Relaxed)
    }
}

/// A point-in-time copy of a manager's counters.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct LeaseStats {
    /// Live leases now (a gauge, not a counter).
    pub active: u64,
    /// Leases admitted by a worker (new, or replacing a dead attempt).
    pub registered: u64,
    /// `admitted` events for a request whose lease was already live on that worker.
    pub duplicate_admits: u64,
    /// Live leases replaced by a new attempt of the same request on another worker.
    pub superseded: u64,
    /// `progressed` events that renewed a QUIET lease (see [`ProgressOutcome::Renewed`](crate::ProgressOutcome::Renewed)).
    pub renewed: u64,
    /// `progressed` events on a lease already renewed since the last scan.
    pub coalesced: u64,
    /// `progressed` events that matched no live lease.
    pub stale_progress: u64,
    /// Leases released by their `completed` event.
    pub completed: u64,
    /// `completed` events that matched no live lease.
    pub stale_completions: u64,
    /// Leases the reaper expired (QUIET at a scan: no progress since the scan before).
    pub expired: u64,
    /// Leases released because their worker reset.
    pub reset_released: u64,
    /// Admissions refused because [`LeaseConfig::max_active_leases`] were live.
    pub refused_full: u64,
    /// Completed reaper scans over all shards.
    pub scans: u64,
    /// Bookings made by this replica's route decisions, before any `admitted`.
    pub provisional: u64,
    /// Provisional bookings taken over by their worker's `admitted` (same request, same
    /// worker): the admission's sizes replace the estimate, counted once.
    pub taken_over: u64,
    /// Provisional bookings released because their worker's `admitted` did not come within
    /// [`LeaseConfig::provisional_deadline`].
    pub provisional_expired: u64,
    /// Provisional bookings released at once by [`RequestLeaseManager::cancel_route`] (a
    /// gateway whose request never reached the worker).
    pub routes_cancelled: u64,
}

/// One live lease. The request id is the other half of its table entry.
#[derive(Debug)]
struct Lease {
    attempt_id: AttemptId,
    worker: WorkerWithDpRank,
    /// What the booking weighs on its worker, phase by phase; every change is sent to the
    /// scheduler as a shift and the release gives back the last weight: the scheduler keeps
    /// no per-booking record of its own.
    weight: LeaseWeight,
    clock: LeaseClock,
    /// Booked by a route decision of this replica; the worker's `admitted` has not come.
    provisional: bool,
    /// Seconds since the manager started; four bytes instead of an `Instant`'s sixteen.
    admitted_at: u32,
    /// Its admission class, resolved once at admission; every operation of the booking
    /// carries it, so the class's fleet-wide sums move with the booking.
    class: ClassId,
}

impl Lease {
    fn booking(&self, key: &LeaseKey) -> SchedulerBookingDescriptor {
        SchedulerBookingDescriptor {
            request_id: RequestId::from(key.as_str()),
            worker: self.worker,
            attempt_id: self.attempt_id,
        }
    }

    /// The release of a lease the caller has claimed: seals its weight and gives it back.
    fn release(&self, reason: ReleaseReason) -> Op {
        Op::Release(self.class, self.worker, self.weight.seal(), reason)
    }

    fn new(
        attempt_id: AttemptId,
        worker: WorkerWithDpRank,
        load: RequestLoad,
        provisional: bool,
        admitted_at: u32,
        class: ClassId,
    ) -> Self {
        Self {
            attempt_id,
            worker,
            weight: LeaseWeight::new(load),
            clock: LeaseClock::touched(),
            provisional,
            admitted_at,
            class,
        }
    }
}

/// A live lease as a snapshot keeps it (see [`LeaseBatch::restore`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct LeaseImage {
    pub request_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub load: RequestLoad,
    /// Set once prefill is done.
    pub output_tokens: Option<u32>,
    /// Not renewed since the last scan: the next scan expires it.
    pub quiet: bool,
    /// Its admission class's name, when it has one the deployment has (last, and left
    /// out when `None`: older snapshots load, and unclassed ones are written as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
}

/// A lease as the API shows it ([`RequestLeaseManager::lease`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    /// The booking it holds on the scheduler.
    pub booking: SchedulerBookingDescriptor,
    /// Where the lease is in its expiry clock.
    pub state: LeaseState,
    /// Time since its admission, in whole seconds.
    pub age: Duration,
}

/// A shard's table: entries are found by the hash that also picked the shard, so an event
/// hashes its request id once.
type Table = HashTable<(LeaseKey, Lease)>;
type Shard = RwLock<Table>;

/// Slots of [`Pending`]'s filter of workers already reported seen.
const SEEN_SLOTS: usize = 32;

/// Scheduler operations and counts gathered by one or more calls, handed over at once.
#[derive(Default)]
struct Pending {
    ops: Vec<Op>,
    counts: [u64; COUNTERS],
    now_secs: Option<u32>,
    /// Workers this batch has reported seen, direct-mapped by id and rank: a burst of events
    /// of a few workers sends a few `Seen` operations, not one per event.
    seen: [Option<WorkerWithDpRank>; SEEN_SLOTS],
}

impl Pending {
    fn count(&mut self, counter: Counter) {
        self.counts[counter as usize] += 1;
    }

    /// `worker` spoke (an event of its own): the scheduler keeps it a member, and its
    /// last-seen time fresh.
    fn seen(&mut self, worker: WorkerWithDpRank) {
        let mixed = (worker.worker_id.0 ^ u64::from(worker.dp_rank.0).rotate_left(32))
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let slot = (mixed >> 59) as usize % SEEN_SLOTS;
        if self.seen[slot] != Some(worker) {
            self.seen[slot] = Some(worker);
            self.ops.push(Op::Seen(worker));
        }
    }

    fn flush(&mut self, inner: &RequestLeaseManagerInner) {
        for (slot, n) in self.counts.iter_mut().enumerate() {
            if *n > 0 {
                inner.stats.0[slot].fetch_add(mem::take(n), Ordering::Relaxed);
            }
        }
        inner.scheduler.submit(&mut self.ops);
    }
}

pub(crate) struct RequestLeaseManagerInner {
    deployment: Arc<str>,
    shards: Box<[Shard]>,
    hasher: DefaultHashBuilder,
    scheduler: SchedulerBookingCleanup,
    stats: LeaseStatsCounters,
    epoch: Instant,
    scan_interval: Duration,
    /// Live leases across all shards, kept in step with insertions and removals (each under
    /// its shard's write lock), for the [`LeaseConfig::max_active_leases`] check.
    active: AtomicU64,
    max_active_leases: u64,
    steps: StepLog,
    provisional_deadline: Duration,
    /// This replica's provisional bookings in the order they were made (so in deadline
    /// order), until their deadline: most are taken over long before, and are then skipped.
    unconfirmed: Mutex<VecDeque<Unconfirmed>>,
}

/// A provisional booking waiting for its worker's `admitted`.
#[derive(Debug)]
struct Unconfirmed {
    /// Tokio's clock, so that tests with a paused clock can pass the deadline.
    due: tokio::time::Instant,
    request_id: RequestId,
    attempt_id: AttemptId,
}

impl RequestLeaseManagerInner {
    pub(super) fn step_log(&self) -> &StepLog {
        &self.steps
    }

    pub(super) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    pub(super) fn scan_interval(&self) -> Duration {
        self.scan_interval
    }

    pub(super) fn provisional_deadline(&self) -> Duration {
        self.provisional_deadline
    }

    pub(super) fn count_scan(&self) {
        self.stats.add(Counter::Scans, 1);
    }

    fn hash(&self, request_id: &str) -> u64 {
        hash_id(&self.hasher, request_id.as_bytes())
    }

    fn shard(&self, hash: u64) -> &Shard {
        // Bits the table inside the shard does not use: it takes the low bits for the
        // bucket and the top seven for its control bytes.
        let index = (hash >> 32) as usize & (self.shards.len() - 1);
        &self.shards[index]
    }

    fn now_secs(&self) -> u32 {
        u32::try_from(self.epoch.elapsed().as_secs()).unwrap_or(u32::MAX)
    }

    /// `retain` on one shard's table, keeping the live-lease count in step.
    fn retain_counted(&self, table: &mut Table, mut keep: impl FnMut(&LeaseKey, &Lease) -> bool) {
        let before = table.len();
        table.retain(|(request_id, lease)| keep(request_id, lease));
        let removed = before - table.len();
        self.active.fetch_sub(removed as u64, Ordering::Relaxed);
    }

    /// Finds or creates the lease of `request_id` under one shard lock and one hash: `same`
    /// says whether a live lease is this very booking (then the admission is a touch),
    /// `fresh` makes the key and attempt of a new lease.
    ///
    /// A `provisional` admission is a route decision's booking; a non-provisional one that
    /// finds the same booking provisional takes it over: its sizes replace the estimate.
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &self,
        pending: &mut Pending,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
        provisional: bool,
        class: ClassId,
        same: impl FnOnce(&Lease) -> bool,
        fresh: impl FnOnce() -> (LeaseKey, AttemptId),
    ) -> AdmitOutcome {
        // One clock read per batch: every admission of a burst shares it.
        let admitted_at = *pending.now_secs.get_or_insert_with(|| self.now_secs());
        let hash = self.hash(request_id);
        let mut table = self.shard(hash).write();
        let entry = table.entry(
            hash,
            |(key, _)| key.is(request_id),
            |(key, _)| hash_id(&self.hasher, key.as_bytes()),
        );
        match entry {
            hash_table::Entry::Occupied(mut entry) => {
                let (key, lease) = entry.get_mut();
                // A lease the reaper has claimed but not removed yet is dead: replaced below
                // like a vacant slot (the reaper releases its booking).
                if same(lease) && lease.clock.touch() != TouchOutcome::Claimed {
                    if lease.provisional && !provisional {
                        // The worker's own sizes replace the route decision's estimate;
                        // under the write lock, so no claim runs meanwhile.
                        lease.provisional = false;
                        let (from, to) = lease.weight.readmit(load);
                        pending.ops.push(Op::Shift(lease.class, worker, from, to));
                        // The worker's class is what every replica counts.
                        if lease.class != class {
                            pending.ops.push(Op::Reclass(lease.class, class, to));
                            lease.class = class;
                        }
                        pending.count(Counter::TakenOver);
                        return AdmitOutcome::Registered;
                    }
                    if !provisional {
                        pending.seen(worker);
                    }
                    pending.count(Counter::DuplicateAdmits);
                    return AdmitOutcome::Duplicate;
                }
                let (_, attempt_id) = fresh();
                let old = mem::replace(
                    lease,
                    Lease::new(attempt_id, worker, load, provisional, admitted_at, class),
                );
                pending.ops.push(book(lease, provisional));
                if provisional {
                    pending.count(Counter::Provisional);
                }
                if old.clock.claim() {
                    pending.ops.push(old.release(ReleaseReason::Superseded));
                    debug!(request_id = %key, worker = %worker, "a new attempt superseded a live lease");
                    pending.count(Counter::Superseded);
                    AdmitOutcome::Superseded
                } else {
                    pending.count(Counter::Registered);
                    AdmitOutcome::Registered
                }
            }
            hash_table::Entry::Vacant(entry) => {
                // Counted across shards without their locks: approximate by the number of
                // concurrent admitters, which is enough to bound memory.
                if self.active.load(Ordering::Relaxed) >= self.max_active_leases {
                    if !provisional {
                        pending.seen(worker);
                    }
                    pending.count(Counter::RefusedFull);
                    return AdmitOutcome::Full;
                }
                let (key, attempt_id) = fresh();
                let lease = Lease::new(attempt_id, worker, load, provisional, admitted_at, class);
                pending.ops.push(book(&lease, provisional));
                entry.insert((key, lease));
                self.active.fetch_add(1, Ordering::Relaxed);
                pending.count(if provisional {
                    Counter::Provisional
                } else {
                    Counter::Registered
                });
                AdmitOutcome::Registered
            }
        }
    }

    /// The reaper's pass over one shard under its read lock: TOUCHED leases get their
    /// second chance, QUIET ones are claimed, and their releases queued. Returns how many
    /// it claimed; they stay in the table until [`Self::remove_claimed`].
    fn claim_expired(&self, index: usize, pending: &mut Pending) -> usize {
        let table = self.shards[index].read();
        let mut expired = 0;
        for (key, lease) in table.iter() {
            if lease.clock.reap() == ReapOutcome::Expired {
                expired += 1;
                debug!(request_id = %key, worker = %lease.worker, "lease expired");
                pending.count(Counter::Expired);
                pending.ops.push(lease.release(ReleaseReason::Expired));
            }
        }
        expired
    }

    /// Removes the claimed leases of one shard.
    fn remove_claimed(&self, index: usize) {
        self.retain_counted(&mut self.shards[index].write(), |_, lease| {
            lease.clock.state() != LeaseState::Claimed
        });
    }

    /// Renews the lease of `request_id` if `matches` it, and with `output_tokens` (a
    /// `progressed`) moves its load to the decode phase. `None` when there is no such lease.
    ///
    /// Under the read lock: the load moves through its atomic progress word, which a
    /// claimer seals (see [`super::load`]).
    fn touch(
        &self,
        pending: &mut Pending,
        request_id: &str,
        output_tokens: Option<u32>,
        matches: impl FnOnce(&Lease) -> bool,
    ) -> Option<ProgressOutcome> {
        let hash = self.hash(request_id);
        let table = self.shard(hash).read();
        let (_, lease) = table
            .find(hash, |(key, _)| key.is(request_id))
            .filter(|(_, lease)| matches(lease))?;
        let outcome = match lease.clock.touch() {
            TouchOutcome::Renewed => ProgressOutcome::Renewed,
            TouchOutcome::Coalesced => ProgressOutcome::Coalesced,
            TouchOutcome::Claimed => ProgressOutcome::Stale,
        };
        let shift = (outcome != ProgressOutcome::Stale)
            .then(|| output_tokens.and_then(|n| lease.weight.advance(n)))
            .flatten();
        match shift {
            // The worker spoke: a shift says so itself.
            Some((from, to)) => pending
                .ops
                .push(Op::Shift(lease.class, lease.worker, from, to)),
            None => pending.seen(lease.worker),
        }
        drop(table);
        Some(count_touch(pending, outcome))
    }

    /// Releases the lease of `request_id` if it is still a provisional booking (its worker's
    /// `admitted` has not taken it over), of attempt `attempt_id` when given. Returns whether
    /// it did.
    fn release_provisional(
        &self,
        pending: &mut Pending,
        request_id: &str,
        attempt_id: Option<AttemptId>,
        counter: Counter,
    ) -> bool {
        let hash = self.hash(request_id);
        let mut table = self.shard(hash).write();
        let Ok(entry) = table.find_entry(hash, |(key, lease)| {
            key.is(request_id)
                && lease.provisional
                && attempt_id.is_none_or(|attempt| lease.attempt_id == attempt)
        }) else {
            return false;
        };
        let ((_, lease), _) = entry.remove();
        drop(table);
        self.active.fetch_sub(1, Ordering::Relaxed);
        // Claimed already: the reaper expired it and releases it itself.
        let released = lease.clock.claim();
        if released {
            pending.count(counter);
            pending.ops.push(lease.release(ReleaseReason::Unconfirmed));
        }
        released
    }

    /// Ends the lease of `request_id` if `matches` it, releasing its booking. `None` when
    /// there is no such lease.
    fn complete(
        &self,
        pending: &mut Pending,
        request_id: &str,
        matches: impl FnOnce(&Lease) -> bool,
    ) -> Option<CompleteOutcome> {
        let hash = self.hash(request_id);
        let mut table = self.shard(hash).write();
        let entry = table
            .find_entry(hash, |(key, _)| key.is(request_id))
            .ok()
            .filter(|entry| matches(&entry.get().1))?;
        let ((_, lease), _) = entry.remove();
        drop(table);
        self.active.fetch_sub(1, Ordering::Relaxed);
        let released = lease.clock.claim();
        if released {
            // The worker spoke: a completion's release says so itself.
            pending.ops.push(lease.release(ReleaseReason::Completed));
        } else {
            pending.seen(lease.worker);
        }
        Some(count_completion(pending, released))
    }
}

/// The booking of a new lease: a worker's admission also says the worker spoke; a route
/// decision's does not.
fn book(lease: &Lease, provisional: bool) -> Op {
    let weight = lease.weight.weight();
    if provisional {
        Op::Book(lease.class, lease.worker, weight)
    } else {
        Op::Admitted(lease.class, lease.worker, weight)
    }
}

fn count_touch(pending: &mut Pending, outcome: ProgressOutcome) -> ProgressOutcome {
    pending.count(match outcome {
        ProgressOutcome::Renewed => Counter::Renewed,
        ProgressOutcome::Coalesced => Counter::Coalesced,
        ProgressOutcome::Stale => Counter::StaleProgress,
    });
    outcome
}

fn count_completion(pending: &mut Pending, released: bool) -> CompleteOutcome {
    if released {
        pending.count(Counter::Completed);
        CompleteOutcome::Released
    } else {
        pending.count(Counter::StaleCompletions);
        CompleteOutcome::Stale
    }
}

/// The liveness record of every booking of one deployment.
///
/// Cheap to clone: clones share one state.
#[derive(Clone)]
pub struct RequestLeaseManager {
    inner: Arc<RequestLeaseManagerInner>,
}

/// A handle that does not keep the manager alive.
#[derive(Clone)]
pub struct WeakRequestLeaseManager(Weak<RequestLeaseManagerInner>);

impl WeakRequestLeaseManager {
    /// The manager, if it is still alive.
    pub fn upgrade(&self) -> Option<RequestLeaseManager> {
        self.0.upgrade().map(|inner| RequestLeaseManager { inner })
    }
}

/// A run of events applied to one manager: its scheduler operations and counters are
/// handed over once, when the batch is dropped, instead of once per event (a lock and a
/// cache line the scheduler keeps taking back). Holds the manager for its length, so keep
/// it short; the ingress keeps one for at most one burst of messages, never across an
/// `.await`.
pub struct LeaseBatch {
    manager: RequestLeaseManager,
    pending: Pending,
}

impl LeaseBatch {
    /// [`RequestLeaseManager::admit_current`] within the batch.
    pub fn admit_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
    ) -> AdmitOutcome {
        self.admit_current_in_class(request_id, worker, load, None)
    }

    /// [`RequestLeaseManager::admit_current_in_class`] within the batch.
    pub fn admit_current_in_class(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
        class: Option<&str>,
    ) -> AdmitOutcome {
        self.manager
            .admit_current_in(&mut self.pending, request_id, worker, load, class)
    }

    /// The cached tokens this replica's route decision counted on for `request_id` on
    /// `worker`, while its lease is still that decision's provisional booking.
    pub(crate) fn predicted_cached(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<u32> {
        self.manager
            .find(request_id, |_, lease| {
                (lease.provisional && lease.worker == worker)
                    .then(|| lease.weight.image().0.cached_tokens)
            })
            .flatten()
    }

    /// The deployment's prefix index.
    pub(crate) fn prefix(&self) -> &PrefixState {
        self.manager.inner.scheduler.prefix()
    }

    /// Rebuilds a lease from a snapshot: admitted with its sizes, advanced to its output
    /// count, and left quiet if it was (so it expires when it would have at the writer).
    pub(crate) fn restore(&mut self, image: &LeaseImage) -> AdmitOutcome {
        let worker = WorkerWithDpRank::new(image.worker_id, image.dp_rank);
        let outcome = self.admit_current_in_class(
            &image.request_id,
            worker,
            image.load,
            image.class.as_deref(),
        );
        if let Some(output) = image.output_tokens {
            self.progress_current(&image.request_id, worker, output);
        }
        if image.quiet {
            self.manager.find(&image.request_id, |_, lease| {
                if lease.worker == worker {
                    lease.clock.reap();
                }
            });
        }
        outcome
    }

    /// [`RequestLeaseManager::touch_current`] within the batch.
    pub fn touch_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<ProgressOutcome> {
        let outcome = self
            .manager
            .inner
            .touch(&mut self.pending, request_id, None, |l| l.worker == worker);
        if outcome.is_none() {
            self.pending.seen(worker);
        }
        outcome
    }

    /// [`RequestLeaseManager::progress_current`] within the batch.
    pub fn progress_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
        output_tokens: u32,
    ) -> Option<ProgressOutcome> {
        let outcome =
            self.manager
                .inner
                .touch(&mut self.pending, request_id, Some(output_tokens), |l| {
                    l.worker == worker
                });
        if outcome.is_none() {
            self.pending.seen(worker);
        }
        outcome
    }

    /// [`RequestLeaseManager::complete_current`] within the batch.
    pub fn complete_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<CompleteOutcome> {
        let outcome = self
            .manager
            .inner
            .complete(&mut self.pending, request_id, |l| l.worker == worker);
        if outcome.is_none() {
            self.pending.seen(worker);
        }
        outcome
    }

    /// [`RequestLeaseManager::reset_worker`] (or, `leaving`,
    /// [`RequestLeaseManager::worker_left`]) within the batch: its operations follow the
    /// batch's earlier ones, so a departure is never overtaken by the worker's own events.
    pub fn reset_worker(
        &mut self,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        leaving: bool,
    ) -> usize {
        self.manager
            .reset_in(&mut self.pending, worker_id, dp_rank, leaving)
    }

    /// Gathers this batch's scheduler operations in `buffer` (emptied first): a caller that
    /// opens batch after batch hands the same allocation round instead of growing a new
    /// vector each time.
    pub(crate) fn use_buffer(&mut self, mut buffer: Vec<Op>) {
        buffer.clear();
        buffer.append(&mut self.pending.ops);
        self.pending.ops = buffer;
    }

    /// Ends the batch (as dropping it does) and returns its empty operations buffer, for
    /// [`LeaseBatch::use_buffer`] next time.
    pub(crate) fn finish(mut self) -> Vec<Op> {
        self.pending.flush(&self.manager.inner);
        mem::take(&mut self.pending.ops)
    }
}

impl Drop for LeaseBatch {
    fn drop(&mut self) {
        self.pending.flush(&self.manager.inner);
    }
}

impl RequestLeaseManager {
    /// A manager whose bookings are counted in and released from the scheduler behind
    /// `scheduler` (see `Scheduler::new`).
    pub(crate) fn new(
        deployment: &str,
        config: LeaseConfig,
        scheduler: SchedulerBookingCleanup,
    ) -> Self {
        let shards = config.shards.max(1).next_power_of_two();
        Self {
            inner: Arc::new(RequestLeaseManagerInner {
                deployment: Arc::from(deployment),
                shards: (0..shards).map(|_| RwLock::new(HashTable::new())).collect(),
                hasher: DefaultHashBuilder::default(),
                scheduler,
                stats: LeaseStatsCounters::default(),
                epoch: Instant::now(),
                scan_interval: config.scan_interval,
                active: AtomicU64::new(0),
                max_active_leases: u64::try_from(config.max_active_leases).unwrap_or(u64::MAX),
                steps: StepLog::default(),
                provisional_deadline: config.provisional_deadline,
                unconfirmed: Mutex::new(VecDeque::new()),
            }),
        }
    }

    pub(crate) fn from_inner(inner: Arc<RequestLeaseManagerInner>) -> Self {
        Self { inner }
    }

    pub(super) fn inner(&self) -> &Arc<RequestLeaseManagerInner> {
        &self.inner
    }

    /// The deployment this manager tracks.
    pub fn deployment(&self) -> &str {
        &self.inner.deployment
    }

    /// A handle that does not keep the manager alive.
    pub fn downgrade(&self) -> WeakRequestLeaseManager {
        WeakRequestLeaseManager(Arc::downgrade(&self.inner))
    }

    /// Starts a batch (see [`LeaseBatch`]): for the benches; the ingress batches its own.
    #[doc(hidden)]
    pub fn batch(&self) -> LeaseBatch {
        LeaseBatch {
            manager: self.clone(),
            pending: Pending::default(),
        }
    }

    /// Runs one call with its own pending operations, handed over before it returns.
    fn single<T>(&self, call: impl FnOnce(&RequestLeaseManagerInner, &mut Pending) -> T) -> T {
        let mut pending = Pending::default();
        let result = call(&self.inner, &mut pending);
        pending.flush(&self.inner);
        result
    }

    /// Records a booking admitted by a worker (ours or another replica's) and counts it in
    /// the scheduler. A second admission of the same booking is a touch; a new attempt under
    /// a live request id replaces the old attempt and releases its booking.
    pub fn register_remote(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
    ) -> AdmitOutcome {
        self.admit_booking(booking, load, false, None)
    }

    /// Admits `request_id` on `worker` in one lookup, as a wire `admitted` (which carries
    /// no attempt id) is applied: a live lease of the request on that worker is renewed (a
    /// re-sent admission), anything else becomes a new attempt.
    pub fn admit_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
    ) -> AdmitOutcome {
        self.admit_current_in_class(request_id, worker, load, None)
    }

    /// [`Self::admit_current`] of a request of admission class `class` (a wire `admitted`
    /// with `cls`): its lease counts under that class if the deployment has it, under the
    /// default class otherwise (see [`AdmissionConfig`](crate::AdmissionConfig)).
    pub fn admit_current_in_class(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
        class: Option<&str>,
    ) -> AdmitOutcome {
        self.single(|_, pending| self.admit_current_in(pending, request_id, worker, load, class))
    }

    fn admit_current_in(
        &self,
        pending: &mut Pending,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
        class: Option<&str>,
    ) -> AdmitOutcome {
        let class = self.inner.scheduler.classes().resolve(class);
        self.inner.admit(
            pending,
            request_id,
            worker,
            load,
            false,
            class,
            |lease| lease.worker == worker,
            || (LeaseKey::new(request_id), AttemptId::mint()),
        )
    }

    /// Renews the lease of `booking`, if that attempt is still live.
    pub fn touch_booking(&self, booking: &SchedulerBookingDescriptor) -> ProgressOutcome {
        self.single(|inner, pending| {
            inner
                .touch(pending, &booking.request_id, None, |lease| {
                    lease.attempt_id == booking.attempt_id
                })
                .unwrap_or_else(|| count_touch(pending, ProgressOutcome::Stale))
        })
    }

    /// Renews the live lease of `request_id` if it runs on `worker`, in one lookup: how a
    /// wire `progressed` (which carries no attempt id) is applied. `None` when there is no
    /// such lease, so the caller can hold the event for an admission still on its way.
    pub fn touch_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<ProgressOutcome> {
        self.single(|inner, pending| inner.touch(pending, request_id, None, |l| l.worker == worker))
    }

    /// A wire `progressed` with `output_tokens` so far: renews the live lease of
    /// `request_id` on `worker`, ends its prefill and counts its output as KV held (the count
    /// never goes backwards). `None` when there is no such lease.
    pub fn progress_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
        output_tokens: u32,
    ) -> Option<ProgressOutcome> {
        self.single(|inner, pending| {
            inner.touch(pending, request_id, Some(output_tokens), |l| {
                l.worker == worker
            })
        })
    }

    /// Books `booking` provisionally: a route decision of this replica counted on its worker
    /// before the worker's `admitted` arrives. That admission (same request id, same worker)
    /// takes it over; one on another worker supersedes it; if none comes, it expires.
    pub fn book_provisional(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
    ) -> AdmitOutcome {
        self.book_provisional_in_class(booking, load, None)
    }

    /// [`Self::book_provisional`] for a route request of admission class `class`. The
    /// worker's `admitted`, when it takes the booking over, sets the class every replica
    /// counts (its `cls`, or the default class without one).
    pub fn book_provisional_in_class(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
        class: Option<&str>,
    ) -> AdmitOutcome {
        let request_id = booking.request_id.clone();
        let attempt_id = booking.attempt_id;
        let outcome = self.admit_booking(booking, load, true, class);
        if matches!(outcome, AdmitOutcome::Registered | AdmitOutcome::Superseded) {
            let due = tokio::time::Instant::now() + self.inner.provisional_deadline;
            self.inner.unconfirmed.lock().push_back(Unconfirmed {
                due,
                request_id,
                attempt_id,
            });
        }
        outcome
    }

    /// Releases `booking` at once if it is still a provisional booking of a route decision
    /// (its worker's `admitted` has not come): for a gateway whose request never reached the
    /// worker. Idempotent: `false` when there is nothing (any more) to release, because it
    /// was released already, taken over by its admission, superseded or expired.
    pub fn cancel_route(&self, booking: &SchedulerBookingDescriptor) -> bool {
        self.single(|inner, pending| {
            inner.release_provisional(
                pending,
                &booking.request_id,
                Some(booking.attempt_id),
                Counter::RoutesCancelled,
            )
        })
    }

    /// [`Self::cancel_route`] by request id alone, whatever the attempt: what the HTTP API
    /// offers a gateway, which knows only the request id.
    pub(crate) fn cancel_route_of(&self, request_id: &str) -> bool {
        self.single(|inner, pending| {
            inner.release_provisional(pending, request_id, None, Counter::RoutesCancelled)
        })
    }

    /// Releases the provisional bookings whose deadline has passed by `now` and whose
    /// worker's `admitted` has not come. Returns how many it released.
    pub(super) fn expire_unconfirmed(&self, now: tokio::time::Instant) -> usize {
        let due: Vec<Unconfirmed> = {
            let mut queue = self.inner.unconfirmed.lock();
            let n = queue.iter().take_while(|u| u.due <= now).count();
            queue.drain(..n).collect()
        };
        if due.is_empty() {
            return 0;
        }
        self.single(|inner, pending| {
            due.iter()
                .filter(|u| {
                    inner.release_provisional(
                        pending,
                        &u.request_id,
                        Some(u.attempt_id),
                        Counter::ProvisionalExpired,
                    )
                })
                .count()
        })
    }

    /// Admits a booking that names its attempt: a duplicate is the same attempt again.
    fn admit_booking(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
        provisional: bool,
        class: Option<&str>,
    ) -> AdmitOutcome {
        let SchedulerBookingDescriptor {
            request_id,
            worker,
            attempt_id,
        } = booking;
        let class = self.inner.scheduler.classes().resolve(class);
        self.single(|inner, pending| {
            inner.admit(
                pending,
                &request_id,
                worker,
                load,
                provisional,
                class,
                |lease| lease.attempt_id == attempt_id,
                || (LeaseKey::new(&request_id), attempt_id),
            )
        })
    }

    /// Per-worker sums over the live leases, computed from the lease table (O(leases)):
    /// what the scheduler's sums must equal once it has applied everything handed over.
    pub fn live_loads(&self) -> Vec<(WorkerWithDpRank, WorkerLoad)> {
        let mut sums: hashbrown::HashMap<WorkerWithDpRank, WorkerLoad> = Default::default();
        for shard in self.inner.shards.iter() {
            for (_, lease) in shard.read().iter() {
                if lease.clock.state() == LeaseState::Claimed {
                    continue;
                }
                sums.entry(lease.worker)
                    .or_default()
                    .add(lease.weight.weight());
            }
        }
        let mut sums: Vec<_> = sums.into_iter().collect();
        sums.sort_unstable_by_key(|(w, _)| *w);
        sums
    }

    /// Ends the lease of `booking` and releases its booking, if that attempt is still live;
    /// an unknown, finished or superseded attempt is a counted no-op.
    pub fn complete_remote(&self, booking: &SchedulerBookingDescriptor) -> CompleteOutcome {
        self.single(|inner, pending| {
            inner
                .complete(pending, &booking.request_id, |lease| {
                    lease.attempt_id == booking.attempt_id
                })
                .unwrap_or_else(|| count_completion(pending, false))
        })
    }

    /// Ends the live lease of `request_id` if it runs on `worker`, in one lookup: how a wire
    /// `completed` is applied. `None` when there is no such lease, so the caller can keep a
    /// tombstone against an admission still on its way.
    pub fn complete_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<CompleteOutcome> {
        self.single(|inner, pending| inner.complete(pending, request_id, |l| l.worker == worker))
    }

    /// Drops every lease of a worker that (re)started (all its ranks when `dp_rank` is
    /// `None`) and releases their bookings; the worker stays a member. Returns how many were
    /// dropped.
    pub fn reset_worker(&self, worker_id: WorkerId, dp_rank: Option<DpRank>) -> usize {
        self.single(|_, pending| self.reset_in(pending, worker_id, dp_rank, false))
    }

    /// As [`Self::reset_worker`], for a worker that is leaving: it also leaves the scheduler's
    /// membership, so no decision chooses it until it publishes again.
    pub fn worker_left(&self, worker_id: WorkerId, dp_rank: Option<DpRank>) -> usize {
        self.single(|_, pending| self.reset_in(pending, worker_id, dp_rank, true))
    }

    fn reset_in(
        &self,
        pending: &mut Pending,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        leaving: bool,
    ) -> usize {
        let matches = |w: &WorkerWithDpRank| {
            w.worker_id == worker_id && dp_rank.is_none_or(|rank| w.dp_rank == rank)
        };
        let mut dropped = 0;
        for shard in self.inner.shards.iter() {
            self.inner.retain_counted(&mut shard.write(), |_, lease| {
                if !matches(&lease.worker) {
                    return true;
                }
                if lease.clock.claim() {
                    dropped += 1;
                    pending.count(Counter::ResetReleased);
                    pending.ops.push(lease.release(ReleaseReason::WorkerReset));
                }
                false
            });
        }
        // A restarted engine starts with an empty cache; a departed one holds nothing.
        self.inner
            .scheduler
            .prefix()
            .forget(|w| matches(&w), leaving);
        // After the releases, in the same hand-over: the scheduler forgets a departed worker
        // once its sums are back to zero.
        pending.ops.push(Op::Membership {
            worker_id,
            dp_rank,
            leaving,
        });
        // Later events of these workers in the same batch must report them seen again.
        pending.seen = Default::default();
        debug!(deployment = %self.inner.deployment, worker = %worker_id, dropped, leaving, "worker reset");
        dropped
    }

    /// The live booking of `request_id`, if it runs on `worker`: how events that carry no
    /// attempt id (every event on the wire) find the attempt they are about.
    pub fn current_booking(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Option<SchedulerBookingDescriptor> {
        self.find(request_id, |key, lease| {
            (lease.worker == worker).then(|| lease.booking(key))
        })
        .flatten()
    }

    /// Runs `f` on the live lease of `request_id` under its shard's read lock.
    fn find<T>(&self, request_id: &str, f: impl FnOnce(&LeaseKey, &Lease) -> T) -> Option<T> {
        let hash = self.inner.hash(request_id);
        let table = self.inner.shard(hash).read();
        table
            .find(hash, |(key, _)| key.is(request_id))
            .map(|(key, lease)| f(key, lease))
    }

    /// The lease of `request_id`, if it is live.
    pub fn lease(&self, request_id: &RequestId) -> Option<LeaseRecord> {
        self.find(request_id, |key, lease| self.record(key, lease))
    }

    fn record(&self, key: &LeaseKey, lease: &Lease) -> LeaseRecord {
        let age = self.inner.now_secs().saturating_sub(lease.admitted_at);
        LeaseRecord {
            booking: lease.booking(key),
            state: lease.clock.state(),
            age: Duration::from_secs(u64::from(age)),
        }
    }

    /// Teaches the prefix index that `worker` holds `hashes` (what an `admitted` with them
    /// does).
    pub(crate) fn learn_prefix(&self, worker: WorkerWithDpRank, hashes: &[u64]) {
        self.inner.scheduler.prefix().learn(worker, hashes, None);
    }

    /// The prefix index's counters.
    pub(crate) fn prefix_figures(&self) -> crate::prefix::PrefixFigures {
        self.inner.scheduler.prefix().figures()
    }

    /// Adds a snapshot's prefix index.
    pub(crate) fn restore_prefix(&self, image: &crate::prefix::PrefixImage) {
        self.inner.scheduler.prefix().restore(image);
    }

    /// The prefix index, as a snapshot keeps it.
    pub(crate) fn prefix_image(&self) -> crate::prefix::PrefixImage {
        self.inner.scheduler.prefix().image()
    }

    /// Every live lease that a worker admitted (not this replica's provisional bookings), as
    /// a snapshot keeps it. One shard's read lock at a time: ingest waits at most for the
    /// copy of one shard.
    pub(crate) fn lease_images(&self) -> Vec<LeaseImage> {
        let classes = self.inner.scheduler.classes();
        let mut out = Vec::with_capacity(self.active_leases());
        for shard in self.inner.shards.iter() {
            let shard = shard.read();
            for (key, lease) in shard.iter() {
                let state = lease.clock.state();
                if lease.provisional || state == LeaseState::Claimed {
                    continue;
                }
                let (load, output_tokens) = lease.weight.image();
                out.push(LeaseImage {
                    request_id: key.as_str().to_owned(),
                    worker_id: lease.worker.worker_id.0,
                    dp_rank: lease.worker.dp_rank.0,
                    load,
                    output_tokens,
                    quiet: state == LeaseState::Quiet,
                    class: classes.name(lease.class).map(|name| name.to_string()),
                });
            }
        }
        out
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

    /// Lock shards, each one reaper step.
    pub fn shard_count(&self) -> usize {
        self.inner.shards.len()
    }

    /// Number of live leases, summed over shards (each read-locked in turn).
    pub fn active_leases(&self) -> usize {
        self.inner.shards.iter().map(|s| s.read().len()).sum()
    }

    /// A point-in-time copy of the manager's counters.
    pub fn stats(&self) -> LeaseStats {
        let c = &self.inner.stats;
        LeaseStats {
            active: self.active_leases() as u64,
            registered: c.get(Counter::Registered),
            duplicate_admits: c.get(Counter::DuplicateAdmits),
            superseded: c.get(Counter::Superseded),
            renewed: c.get(Counter::Renewed),
            coalesced: c.get(Counter::Coalesced),
            stale_progress: c.get(Counter::StaleProgress),
            completed: c.get(Counter::Completed),
            stale_completions: c.get(Counter::StaleCompletions),
            expired: c.get(Counter::Expired),
            reset_released: c.get(Counter::ResetReleased),
            refused_full: c.get(Counter::RefusedFull),
            scans: c.get(Counter::Scans),
            provisional: c.get(Counter::Provisional),
            taken_over: c.get(Counter::TakenOver),
            provisional_expired: c.get(Counter::ProvisionalExpired),
            routes_cancelled: c.get(Counter::RoutesCancelled),
        }
    }

    /// One reaper pass over one shard; returns how many leases expired. Counted as the
    /// shard is done, not at the end of the scan: a scan is spread out.
    ///
    /// Second chances and expiries are atomic steps of each lease's clock, so they are taken
    /// under the shard's read lock: lookups and renewals (most events) never wait for a scan.
    /// The write lock is taken afterwards, and only when something expired, to remove the
    /// claimed leases; until then a claimed lease is dead to every event (see `admit`).
    pub(super) fn scan_shard(&self, index: usize) -> usize {
        let expired = self.single(|inner, pending| inner.claim_expired(index, pending));
        if expired > 0 {
            self.inner.remove_claimed(index);
        }
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::WorkerLoad;
    use crate::scheduler::{Scheduler, SchedulerHandle};
    use tokio_util::task::TaskTracker;

    #[tokio::test]
    async fn a_lease_expired_but_not_yet_removed_is_dead_to_every_event() {
        let tracker = TaskTracker::new();
        let (scheduler, actor) = Scheduler::new("t");
        let manager = RequestLeaseManager::new("t", LeaseConfig::default(), scheduler.cleanup());
        actor.spawn(None, &tracker);
        let worker = WorkerWithDpRank::new(1, 0);
        let load = RequestLoad::new(10, Some(1));
        manager.admit_current("r", worker, load);
        let index = (manager.inner.hash("r") >> 32) as usize & (manager.inner.shards.len() - 1);
        // Two read-lock passes: a second chance, then the claim; nothing removed yet.
        for expected in [0, 1] {
            let claimed = manager.single(|inner, pending| inner.claim_expired(index, pending));
            assert_eq!(claimed, expected);
        }
        assert_eq!(manager.active_leases(), 1, "claimed, still in the table");
        assert_eq!(
            manager.touch_current("r", worker),
            Some(ProgressOutcome::Stale)
        );
        // A new admission of the same request on the same worker is a new lease, not a
        // duplicate of the dead one; the reaper's claim released the old booking.
        assert_eq!(
            manager.admit_current("r", worker, load),
            AdmitOutcome::Registered
        );
        manager.inner.remove_claimed(index);
        let lease = manager
            .lease(&RequestId::from("r"))
            .expect("the new lease lives");
        assert_eq!(lease.state, LeaseState::Touched);
        assert_eq!(
            scheduler.load(worker).await.unwrap(),
            WorkerLoad {
                active_bookings: 1,
                prompt_tokens: 10,
                expected_output_tokens: 1,
                prefill_tokens: 10,
                kv_tokens: 10,
                remaining_output_tokens: 1,
            }
        );
        let stats = manager.stats();
        assert_eq!(
            (stats.registered, stats.expired, stats.superseded),
            (2, 1, 0)
        );
        assert_eq!(
            manager.complete_current("r", worker),
            Some(CompleteOutcome::Released)
        );
        assert_eq!(scheduler.load(worker).await.unwrap(), WorkerLoad::default());
    }

    /// Each class's requests in flight, in the order of the classes.
    async fn in_flight(scheduler: &SchedulerHandle) -> Vec<(String, u64, u64)> {
        scheduler
            .class_loads()
            .await
            .unwrap()
            .into_iter()
            .map(|c| (c.class, c.in_flight_requests, c.in_flight_tokens))
            .collect()
    }

    /// A lease carries its class from its admission to its release, whichever wins the
    /// claim: completion, expiry, supersession, worker reset; a route decision's booking
    /// counts under the class the worker's `admitted` names when it takes it over; no class
    /// and an unknown class count under the default.
    #[tokio::test]
    async fn class_sums_follow_every_lease_to_its_release() {
        use crate::admission::{AdmissionClass, AdmissionConfig};
        let tracker = TaskTracker::new();
        let (scheduler, manager) = manager(one_shard(), &tracker);
        scheduler
            .set_admission(
                AdmissionConfig::default()
                    .with_class(AdmissionClass::new("premium", 1, 4.0))
                    .with_class(AdmissionClass::new("regular", 0, 1.0))
                    .with_default_class("regular"),
            )
            .unwrap();
        let (a, b) = (WorkerWithDpRank::new(1, 0), WorkerWithDpRank::new(2, 0));
        let load = RequestLoad::new(10, Some(5));
        let premium = Some("premium");
        manager.admit_current_in_class("p1", a, load, premium);
        manager.admit_current_in_class("p2", b, load, premium);
        manager.admit_current_in_class("p3", a, load, premium);
        manager.admit_current_in_class("r1", a, load, None);
        manager.admit_current_in_class("g1", b, load, Some("gold"));
        assert_eq!(
            in_flight(&scheduler).await,
            [("premium".into(), 3, 45), ("regular".into(), 2, 30)]
        );
        // A duplicate admission counts nothing; progress moves no class figure.
        manager.admit_current_in_class("p1", a, load, premium);
        manager.progress_current("p1", a, 3);
        assert_eq!(in_flight(&scheduler).await[0], ("premium".into(), 3, 45));

        // Completion, supersession (a new attempt on another worker, unclassed), reset.
        manager.complete_current("p1", a);
        manager.admit_current("p2", a, load);
        assert_eq!(
            in_flight(&scheduler).await,
            [("premium".into(), 1, 15), ("regular".into(), 3, 45)]
        );
        manager.reset_worker(WorkerId(1), None);
        assert_eq!(
            in_flight(&scheduler).await,
            [("premium".into(), 0, 0), ("regular".into(), 1, 15)]
        );
        // Expiry: two scans.
        for _ in 0..2 {
            manager.scan_shard(0);
        }
        assert_eq!(manager.active_leases(), 0);
        assert_eq!(
            in_flight(&scheduler).await,
            [("premium".into(), 0, 0), ("regular".into(), 0, 0)]
        );

        // A route decision's booking of class premium, taken over by an admission that
        // names none: the worker's class is what every replica counts.
        let booking = SchedulerBookingDescriptor::new(RequestId::from("q"), a);
        manager.book_provisional_in_class(booking.clone(), load, premium);
        assert_eq!(in_flight(&scheduler).await[0], ("premium".into(), 1, 15));
        manager.admit_current("q", a, RequestLoad::new(20, Some(5)));
        assert_eq!(
            in_flight(&scheduler).await,
            [("premium".into(), 0, 0), ("regular".into(), 1, 25)]
        );
        manager.complete_current("q", a);
        // And one confirmed in its own class, then cancelled before: nothing left.
        let booking = SchedulerBookingDescriptor::new(RequestId::from("s"), b);
        manager.book_provisional_in_class(booking.clone(), load, premium);
        assert!(manager.cancel_route(&booking));
        assert_eq!(
            in_flight(&scheduler).await,
            [("premium".into(), 0, 0), ("regular".into(), 0, 0)]
        );
    }

    /// A snapshot keeps each lease's class by name (unclassed leases write no class, as
    /// before), and a replica that loads it counts them in the same classes; a snapshot
    /// written before classes (no class field) still loads.
    #[tokio::test]
    async fn a_snapshot_keeps_each_lease_class() {
        use crate::admission::{AdmissionClass, AdmissionConfig};
        let classes = AdmissionConfig::default()
            .with_class(AdmissionClass::new("premium", 1, 4.0))
            .with_class(AdmissionClass::new("regular", 0, 1.0))
            .with_default_class("regular");
        let tracker = TaskTracker::new();
        let (writer_scheduler, writer) = manager(one_shard(), &tracker);
        writer_scheduler.set_admission(classes.clone()).unwrap();
        let w = WorkerWithDpRank::new(1, 0);
        let load = RequestLoad::new(10, Some(5));
        writer.admit_current_in_class("p", w, load, Some("premium"));
        writer.admit_current_in_class("r", w, load, None);
        let mut images = writer.lease_images();
        images.sort_by(|a, b| a.request_id.cmp(&b.request_id));
        let named: Vec<_> = images.iter().map(|i| i.class.as_deref()).collect();
        assert_eq!(named, [Some("premium"), None]);
        let unclassed = rmp_serde::to_vec(&images[1]).unwrap();
        let old = rmp_serde::to_vec(&("r", 1u64, 0u32, load, Option::<u32>::None, false)).unwrap();
        assert_eq!(unclassed, old, "an unclassed lease is written as before");
        let back: LeaseImage = rmp_serde::from_slice(&old).unwrap();
        assert_eq!(back, images[1]);

        let (reader_scheduler, reader) = manager(one_shard(), &tracker);
        reader_scheduler.set_admission(classes).unwrap();
        let mut batch = reader.batch();
        for image in &images {
            batch.restore(image);
        }
        drop(batch);
        assert_eq!(
            in_flight(&reader_scheduler).await,
            in_flight(&writer_scheduler).await
        );
        assert_eq!(in_flight(&reader_scheduler).await[0].1, 1);
    }

    fn manager(
        config: LeaseConfig,
        tracker: &TaskTracker,
    ) -> (SchedulerHandle, RequestLeaseManager) {
        let (scheduler, actor) = Scheduler::new("t");
        let manager = RequestLeaseManager::new("t", config, scheduler.cleanup());
        actor.spawn(None, tracker);
        (scheduler, manager)
    }

    fn one_shard() -> LeaseConfig {
        LeaseConfig {
            shards: 1,
            ..LeaseConfig::default()
        }
    }

    const LOAD: RequestLoad = RequestLoad {
        prompt_tokens: 10,
        expected_output_tokens: Some(1),
        cached_tokens: 0,
    };

    /// Issue 18: removals keep the live-lease count in step (a count that wraps refuses
    /// every later admission as `Full`), through a reset and through expiry.
    #[tokio::test]
    async fn the_live_count_follows_resets_and_expiries_so_admissions_go_on() {
        let tracker = TaskTracker::new();
        let config = LeaseConfig {
            max_active_leases: 3,
            ..one_shard()
        };
        let (scheduler, manager) = manager(config, &tracker);
        let w = WorkerWithDpRank::new;
        manager.admit_current("a", w(1, 0), LOAD);
        manager.admit_current("b", w(1, 1), LOAD);
        manager.admit_current("c", w(2, 0), LOAD);
        assert_eq!(manager.reset_worker(WorkerId(1), None), 2);
        assert_eq!(manager.inner.active.load(Ordering::Relaxed), 1);
        for id in ["d", "e"] {
            assert_eq!(
                manager.admit_current(id, w(3, 0), LOAD),
                AdmitOutcome::Registered
            );
        }
        assert_eq!(
            manager.admit_current("f", w(3, 0), LOAD),
            AdmitOutcome::Full
        );
        assert_eq!(scheduler.load(w(3, 0)).await.unwrap().active_bookings, 2);
        manager.scan().await;
        assert_eq!(manager.scan().await.expired, 3);
        assert_eq!(manager.inner.active.load(Ordering::Relaxed), 0);
        for id in ["g", "h", "i"] {
            assert_eq!(
                manager.admit_current(id, w(3, 0), LOAD),
                AdmitOutcome::Registered
            );
        }
        assert_eq!(
            manager.admit_current("j", w(3, 0), LOAD),
            AdmitOutcome::Full
        );
    }

    /// Issue 18: lookups must hash as the table's growth rehashes, or leases are lost once
    /// it grows.
    #[tokio::test]
    async fn every_lease_of_a_growing_shard_is_found_again() {
        let tracker = TaskTracker::new();
        let (scheduler, manager) = manager(one_shard(), &tracker);
        let worker = WorkerWithDpRank::new(1, 0);
        for i in 0..100 {
            let id = format!("r{i}");
            assert_eq!(
                manager.admit_current(&id, worker, LOAD),
                AdmitOutcome::Registered
            );
        }
        for i in 0..100 {
            assert_eq!(
                manager.complete_current(&format!("r{i}"), worker),
                Some(CompleteOutcome::Released),
                "r{i}"
            );
        }
        assert_eq!(manager.active_leases(), 0);
        assert_eq!(scheduler.load(worker).await.unwrap(), WorkerLoad::default());
    }

    /// The shard is picked from the request id's hash, so leases spread over the shards.
    #[tokio::test]
    async fn leases_spread_over_the_shards() {
        let tracker = TaskTracker::new();
        let (_scheduler, manager) = manager(LeaseConfig::default(), &tracker);
        for i in 0..1_000 {
            manager.admit_current(&format!("r{i}"), WorkerWithDpRank::new(1, 0), LOAD);
        }
        let used = manager
            .inner
            .shards
            .iter()
            .filter(|s| !s.read().is_empty())
            .count();
        assert!(
            used > DEFAULT_SHARDS / 2,
            "{used} shards of {DEFAULT_SHARDS} used"
        );
    }

    #[tokio::test]
    async fn current_booking_and_leases_show_the_live_leases() {
        let tracker = TaskTracker::new();
        let (_scheduler, manager) = manager(LeaseConfig::default(), &tracker);
        let (w1, w2) = (WorkerWithDpRank::new(1, 0), WorkerWithDpRank::new(2, 0));
        let remote = SchedulerBookingDescriptor::new(RequestId::from("a"), w1);
        manager.register_remote(remote.clone(), LOAD);
        assert_eq!(manager.current_booking("a", w1), Some(remote.clone()));
        assert_eq!(manager.current_booking("a", w2), None, "another worker");
        assert_eq!(manager.current_booking("zz", w1), None, "unknown");
        let ids = ["b", "c", "d", "e"];
        for id in ids {
            manager.admit_current(id, w2, LOAD);
        }
        let booking = manager.current_booking("c", w2).expect("live");
        assert_eq!(
            booking,
            manager.lease(&RequestId::from("c")).unwrap().booking
        );
        assert_eq!((booking.request_id.as_str(), booking.worker), ("c", w2));

        let mut all = manager.leases(100);
        all.sort_by(|x, y| x.booking.request_id.cmp(&y.booking.request_id));
        let names: Vec<&str> = all.iter().map(|l| l.booking.request_id.as_str()).collect();
        assert_eq!(names, ["a", "b", "c", "d", "e"]);
        assert_eq!(all[0].booking, remote);
        assert!(all.iter().all(|l| l.state == LeaseState::Touched));
        assert_eq!(manager.leases(3).len(), 3);
        assert_eq!(manager.leases(5).len(), 5);
        assert!(manager.leases(0).is_empty());
    }

    #[tokio::test]
    async fn a_lease_shows_its_age_in_whole_seconds() {
        let tracker = TaskTracker::new();
        let (_scheduler, mut manager) = manager(LeaseConfig::default(), &tracker);
        let worker = WorkerWithDpRank::new(1, 0);
        manager.admit_current("old", worker, LOAD);
        // As if the manager, and the lease, were 42 s older.
        Arc::get_mut(&mut manager.inner)
            .expect("nothing else holds the manager")
            .epoch -= Duration::from_secs(42);
        manager.admit_current("new", worker, LOAD);
        let age = |id: &str| manager.lease(&RequestId::from(id)).unwrap().age;
        assert_eq!(age("old"), Duration::from_secs(42));
        assert_eq!(age("new"), Duration::ZERO);
        let mut listed: Vec<_> = manager.leases(10).into_iter().map(|l| l.age).collect();
        listed.sort();
        assert_eq!(listed, [Duration::ZERO, Duration::from_secs(42)]);
    }

    /// Each counter counts its own event, once.
    #[tokio::test]
    async fn each_outcome_is_counted_in_its_own_statistic() {
        let tracker = TaskTracker::new();
        let config = LeaseConfig {
            shards: 4,
            max_active_leases: 2,
            ..LeaseConfig::default()
        };
        let (scheduler, manager) = manager(config, &tracker);
        let (w1, w2, w3) = (
            WorkerWithDpRank::new(1, 0),
            WorkerWithDpRank::new(2, 0),
            WorkerWithDpRank::new(3, 0),
        );
        let first = SchedulerBookingDescriptor::new(RequestId::from("a"), w1);
        let second = SchedulerBookingDescriptor::new(RequestId::from("a"), w1);
        assert_eq!(
            manager.register_remote(first.clone(), LOAD),
            AdmitOutcome::Registered
        );
        assert_eq!(
            manager.register_remote(first.clone(), LOAD),
            AdmitOutcome::Duplicate
        );
        assert_eq!(manager.touch_booking(&first), ProgressOutcome::Coalesced);
        let report = manager.scan().await;
        assert_eq!(
            (report.expired, report.steps.len()),
            (0, 4),
            "a second chance"
        );
        assert_eq!(manager.touch_booking(&first), ProgressOutcome::Renewed);
        assert_eq!(
            manager.register_remote(second.clone(), LOAD),
            AdmitOutcome::Superseded
        );
        assert_eq!(manager.touch_booking(&first), ProgressOutcome::Stale);
        assert_eq!(manager.complete_remote(&first), CompleteOutcome::Stale);
        assert_eq!(manager.complete_remote(&second), CompleteOutcome::Released);
        manager.admit_current("x", w2, LOAD);
        manager.admit_current("y", w3, LOAD);
        assert_eq!(manager.admit_current("z", w3, LOAD), AdmitOutcome::Full);
        assert_eq!(manager.reset_worker(WorkerId(3), None), 1);
        manager.scan().await;
        assert_eq!(manager.scan().await.expired, 1, "x");
        assert_eq!(
            manager.stats(),
            LeaseStats {
                active: 0,
                registered: 3,
                duplicate_admits: 1,
                superseded: 1,
                renewed: 1,
                coalesced: 1,
                stale_progress: 1,
                completed: 1,
                stale_completions: 1,
                expired: 1,
                reset_released: 1,
                refused_full: 1,
                scans: 3,
                ..LeaseStats::default()
            }
        );
        for w in [w1, w2, w3] {
            assert_eq!(scheduler.load(w).await.unwrap(), WorkerLoad::default());
        }
        let s = scheduler.stats();
        assert_eq!(
            (s.booked, s.released_completed, s.released_superseded),
            (4, 1, 1)
        );
        assert_eq!((s.released_expired, s.released_reset), (1, 1));
    }

    #[tokio::test]
    async fn a_manager_names_its_deployment_and_rounds_its_shards_up() {
        let tracker = TaskTracker::new();
        let (scheduler, actor) = Scheduler::new("d");
        let config = LeaseConfig {
            shards: 3,
            ..LeaseConfig::default()
        };
        let manager = RequestLeaseManager::new("deploy-a", config, scheduler.cleanup());
        actor.spawn(None, &tracker);
        assert_eq!(manager.deployment(), "deploy-a");
        assert_eq!(manager.shard_count(), 4, "a power of two");
        assert_eq!(manager.inner.shard_count(), 4);
        assert_eq!(manager.inner.scan_interval(), DEFAULT_SCAN_INTERVAL);
    }

    /// A batch's reset is the manager's: its count, its releases.
    async fn members(scheduler: &SchedulerHandle) -> Vec<WorkerWithDpRank> {
        let workers = scheduler.workers().await.unwrap();
        workers.into_iter().map(|w| w.worker).collect()
    }

    /// Events that change no load still say the worker is there: an admission refused as
    /// `Full` and a duplicate admission make it a member again. A route decision's
    /// provisional booking is not the worker speaking, so it does not.
    #[tokio::test]
    async fn a_worker_that_speaks_without_changing_load_is_a_member() {
        let tracker = TaskTracker::new();
        let config = LeaseConfig {
            max_active_leases: 1,
            ..one_shard()
        };
        let (scheduler, manager) = manager(config, &tracker);
        let (a, b, c) = (
            WorkerWithDpRank::new(1, 0),
            WorkerWithDpRank::new(2, 0),
            WorkerWithDpRank::new(3, 0),
        );
        assert_eq!(
            manager.admit_current("r", a, LOAD),
            AdmitOutcome::Registered
        );
        // Full: refused, but `b` spoke; a provisional booking on `c` did not make it speak.
        assert_eq!(manager.admit_current("s", b, LOAD), AdmitOutcome::Full);
        let on_c = SchedulerBookingDescriptor::new(RequestId::from("t"), c);
        assert_eq!(manager.book_provisional(on_c, LOAD), AdmitOutcome::Full);
        assert_eq!(members(&scheduler).await, [a, b]);

        // `a` leaves the membership (as a leaving reset would, but its lease stays): a
        // duplicate admission of its live lease brings it back.
        let mut leave = vec![Op::Membership {
            worker_id: WorkerId(1),
            dp_rank: None,
            leaving: true,
        }];
        scheduler.cleanup().submit(&mut leave);
        assert_eq!(members(&scheduler).await, [b]);
        assert_eq!(manager.admit_current("r", a, LOAD), AdmitOutcome::Duplicate);
        assert_eq!(members(&scheduler).await, [a, b]);
        // A provisional duplicate does not.
        scheduler.cleanup().submit(&mut vec![Op::Membership {
            worker_id: WorkerId(1),
            dp_rank: None,
            leaving: true,
        }]);
        let again = manager.lease(&RequestId::from("r")).unwrap().booking;
        assert_eq!(
            manager.book_provisional(again, LOAD),
            AdmitOutcome::Duplicate
        );
        assert_eq!(members(&scheduler).await, [b]);
    }

    /// A burst of events of a few workers sends about one `Seen` a worker, not one an event.
    #[test]
    fn seen_workers_are_filtered_within_a_batch() {
        let workers: Vec<_> = (1..=8)
            .flat_map(|id| (0..2).map(move |rank| WorkerWithDpRank::new(id, rank)))
            .collect();
        let mut pending = Pending::default();
        for _ in 0..10 {
            for &w in &workers {
                pending.seen(w);
            }
        }
        let seen: Vec<_> = pending
            .ops
            .iter()
            .map(|op| match op {
                Op::Seen(w) => *w,
                other => panic!("{other:?}"),
            })
            .collect();
        for w in &workers {
            assert!(seen.contains(w), "{w} never reported");
        }
        assert!(
            seen.len() < 40,
            "{} Seen for 160 events of 16 workers",
            seen.len()
        );
    }

    #[tokio::test]
    async fn progress_renews_and_grows_only_the_lease_of_its_worker() {
        let tracker = TaskTracker::new();
        let (scheduler, manager) = manager(LeaseConfig::default(), &tracker);
        let (a, b) = (WorkerWithDpRank::new(1, 0), WorkerWithDpRank::new(2, 0));
        let load = RequestLoad::new(10, Some(5));
        manager.admit_current("r", a, load);
        assert_eq!(manager.progress_current("r", b, 3), None, "not b's lease");
        assert_eq!(manager.progress_current("x", a, 3), None, "no such lease");
        let untouched = scheduler.load(a).await.unwrap();
        assert_eq!((untouched.prefill_tokens, untouched.kv_tokens), (10, 10));
        assert_eq!(
            manager.progress_current("r", a, 3),
            Some(ProgressOutcome::Coalesced),
            "touched at admission"
        );
        let grown = scheduler.load(a).await.unwrap();
        assert_eq!(
            (
                grown.prefill_tokens,
                grown.kv_tokens,
                grown.remaining_output_tokens
            ),
            (0, 13, 2)
        );
        assert_eq!(scheduler.load(b).await.unwrap(), WorkerLoad::default());
    }

    /// A leaving worker's leases go, as a reset's do, and it leaves the membership; the
    /// count returned is what was dropped.
    #[tokio::test]
    async fn a_worker_that_leaves_drops_its_leases_and_its_membership() {
        let tracker = TaskTracker::new();
        let (scheduler, manager) = manager(LeaseConfig::default(), &tracker);
        let (r0, r1, other) = (
            WorkerWithDpRank::new(1, 0),
            WorkerWithDpRank::new(1, 1),
            WorkerWithDpRank::new(2, 0),
        );
        for (id, w) in [("a", r0), ("b", r0), ("c", r1), ("d", other)] {
            manager.admit_current(id, w, LOAD);
        }
        assert_eq!(manager.worker_left(WorkerId(1), Some(DpRank(0))), 2);
        assert_eq!(members(&scheduler).await, [r1, other]);
        assert_eq!(scheduler.load(r0).await.unwrap(), WorkerLoad::default());
        assert_eq!(manager.worker_left(WorkerId(1), None), 1);
        assert_eq!(members(&scheduler).await, [other]);
        assert_eq!(manager.active_leases(), 1);
        assert_eq!(manager.worker_left(WorkerId(1), None), 0);
    }

    #[tokio::test]
    async fn a_batch_resets_a_worker_as_the_manager_does() {
        let tracker = TaskTracker::new();
        let (scheduler, manager) = manager(LeaseConfig::default(), &tracker);
        let worker = WorkerWithDpRank::new(1, 0);
        let mut batch = manager.batch();
        for id in ["a", "b"] {
            assert_eq!(
                batch.admit_current(id, worker, LOAD),
                AdmitOutcome::Registered
            );
        }
        batch.finish();
        let mut batch = manager.batch();
        assert_eq!(batch.reset_worker(WorkerId(1), None, false), 2);
        drop(batch);
        assert_eq!(manager.active_leases(), 0);
        assert_eq!(scheduler.load(worker).await.unwrap(), WorkerLoad::default());
        assert_eq!(manager.stats().reset_released, 2);
    }
}

#[cfg(test)]
mod sizes {
    /// Guards what the load by phase costs per lease (+16 bytes: the sizes and the progress
    /// word) and per queued operation (a shift carries two weights); BENCHMARKS.md's
    /// bytes-per-lease figure was taken with a 40-byte lease and a 32-byte operation.
    #[test]
    fn lease_and_operation_sizes() {
        assert_eq!(std::mem::size_of::<super::Lease>(), 56);
        assert_eq!(std::mem::size_of::<crate::scheduler::Op>(), 64);
    }
}

/// A route decision's provisional booking and its own deadline.
#[cfg(test)]
mod provisional_deadline {
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;
    use tokio_util::task::TaskTracker;

    use super::*;
    use crate::scheduler::Scheduler;

    const LOAD: RequestLoad = RequestLoad {
        prompt_tokens: 10,
        expected_output_tokens: Some(5),
        cached_tokens: 0,
    };

    /// A route decision's booking that its worker never admits is released at its deadline,
    /// not after a lease lifetime; one that is admitted in time, or cancelled first, is not
    /// released by the deadline.
    #[tokio::test(start_paused = true)]
    async fn unconfirmed_bookings_end_at_their_deadline_or_when_cancelled() {
        let tracker = TaskTracker::new();
        let (scheduler, actor) = Scheduler::new("t");
        let deadline = Duration::from_secs(4);
        let config = LeaseConfig {
            provisional_deadline: deadline,
            ..LeaseConfig::default()
        };
        let manager = RequestLeaseManager::new("t", config, scheduler.cleanup());
        actor.spawn(Some(manager.replica_observer()), &tracker);
        let reaper = tracker.spawn(manager.reaper().run(CancellationToken::new()));
        let worker = WorkerWithDpRank::new(1, 0);
        let lost = SchedulerBookingDescriptor::new(RequestId::from("lost"), worker);
        let admitted = SchedulerBookingDescriptor::new(RequestId::from("admitted"), worker);
        let cancelled = SchedulerBookingDescriptor::new(RequestId::from("cancelled"), worker);
        for b in [&lost, &admitted, &cancelled] {
            assert_eq!(
                manager.book_provisional(b.clone(), LOAD),
                AdmitOutcome::Registered
            );
        }
        assert_eq!(
            manager.register_remote(admitted.clone(), LOAD),
            AdmitOutcome::Registered
        );
        assert!(manager.cancel_route(&cancelled), "released at once");
        assert!(!manager.cancel_route(&cancelled), "idempotent");
        assert!(
            !manager.cancel_route(&admitted),
            "admitted: not provisional any more"
        );
        assert_eq!(scheduler.load(worker).await.unwrap().active_bookings, 2);

        tokio::time::sleep(deadline - Duration::from_millis(100)).await;
        assert_eq!(manager.active_leases(), 2, "before the deadline");
        tokio::time::sleep(deadline).await;
        assert_eq!(manager.active_leases(), 1, "the lost one is gone");
        assert!(manager.lease(&RequestId::from("admitted")).is_some());
        assert_eq!(scheduler.load(worker).await.unwrap().active_bookings, 1);
        let stats = manager.stats();
        assert_eq!((stats.provisional_expired, stats.routes_cancelled), (1, 1));
        assert_eq!(stats.expired, 0, "not a lease expiry");
        assert_eq!(scheduler.stats().released_unconfirmed, 2);
        assert!(!manager.cancel_route(&lost), "released already");
        drop(manager);
        tokio::time::timeout(Duration::from_secs(60), reaper)
            .await
            .expect("the reaper ends with its manager")
            .unwrap();
    }

    /// A provisional booking superseded by a new attempt elsewhere is not released by the
    /// first booking's deadline: the deadline is the attempt's, not the request id's.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_belongs_to_the_attempt() {
        let tracker = TaskTracker::new();
        let (scheduler, actor) = Scheduler::new("t");
        let config = LeaseConfig {
            provisional_deadline: Duration::from_secs(2),
            ..LeaseConfig::default()
        };
        let manager = RequestLeaseManager::new("t", config, scheduler.cleanup());
        actor.spawn(Some(manager.replica_observer()), &tracker);
        let first =
            SchedulerBookingDescriptor::new(RequestId::from("r"), WorkerWithDpRank::new(1, 0));
        manager.book_provisional(first.clone(), LOAD);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let second =
            SchedulerBookingDescriptor::new(RequestId::from("r"), WorkerWithDpRank::new(2, 0));
        assert_eq!(
            manager.book_provisional(second.clone(), LOAD),
            AdmitOutcome::Superseded
        );
        let now = tokio::time::Instant::now();
        assert_eq!(
            manager.expire_unconfirmed(now + Duration::from_millis(1500)),
            0,
            "first's deadline: nothing"
        );
        assert_eq!(manager.active_leases(), 1);
        assert_eq!(
            manager.expire_unconfirmed(now + Duration::from_secs(2)),
            1,
            "second's"
        );
        assert_eq!(manager.active_leases(), 0);
    }
}

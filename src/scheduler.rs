//! The scheduler actor: the per-worker load of one deployment that routing decisions read.
//!
//! The actor keeps only per-worker sums. The lease manager is the one record of every live
//! booking: it keeps each booking's weight in its lease, and its lease clock lets exactly one
//! of completion, expiry, supersession or worker reset release a booking, so a release always
//! carries the weight its booking added. That is also why "release an unknown or superseded
//! attempt" cannot reach the actor: those calls end at the manager, which finds no live lease
//! and counts them as stale ([`crate::lease::LeaseStats::stale_completions`]).
//!
//! Bookings and releases arrive through an inbox (a vector behind a short lock) rather than
//! one channel message each. Every query applies the inbox before it is answered, so the
//! actor is woken only when `WAKE_AT` operations are waiting (to bound the inbox), and
//! applies them all at once. The ingress hands over a whole batch of events' operations with
//! one lock. The sums are signed, so operations commute: a release
//! that overtakes its booking (the reaper's, ahead of an ingress batch still being applied)
//! only makes a sum briefly low, never wrong once both have arrived. Queries go over the same
//! channel, after the actor has applied everything queued before them.
//!
//! The actor ends when every sender of its channel is gone. It holds the replica observer it
//! was given, which is why that observer must not own the lease manager strongly: the
//! manager holds a [`SchedulerBookingCleanup`], that is a sender, and a strong ring would keep
//! the channel open for ever.

use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;
use tracing::{debug, Instrument};

use crate::observer::{AdmitOutcome, DeliverEventError, ReplicaRequestLeaseObserver};
use crate::routing::{
    self, Candidate, RouteDecision, RouteOutcome, RoutePolicy, RouteRequest, RouteRequestError,
    RoutingConfig,
};
use crate::types::{
    DpRank, RequestId, RequestLoad, SchedulerBookingDescriptor, WorkerId, WorkerWithDpRank,
};

/// How long a worker with no live booking may stay silent before the scheduler forgets it,
/// unless set: one lease lifetime at the default scan interval (a silent lease dies one to
/// two intervals after its last touch).
pub const DEFAULT_WORKER_IDLE: Duration = Duration::from_secs(600);

/// Why a booking is released.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ReleaseReason {
    /// The request ended (finished, cancelled or failed).
    Completed,
    /// Its lease was not renewed in time.
    Expired,
    /// A newer attempt of the same request id took its place.
    Superseded,
    /// Its worker restarted or left.
    WorkerReset,
}

/// The load of one worker as the scheduler counts it: sums over its live bookings.
///
/// `active_bookings`, `prompt_tokens` and `expected_output_tokens` are the sizes the
/// bookings were admitted with; they move only at admission and release. The other three
/// follow each request's phase (see [`crate::lease::load`]):
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct WorkerLoad {
    /// Live bookings (provisional ones included).
    pub active_bookings: u64,
    /// Prompt tokens of the live bookings, as admitted.
    pub prompt_tokens: u64,
    /// Expected output tokens of the live bookings, as admitted (unknown counts 0).
    pub expected_output_tokens: u64,
    /// Prefill tokens waiting: the uncached prompt of bookings whose prefill is not done
    /// (up at admission, down at the first `progressed`).
    pub prefill_tokens: u64,
    /// KV tokens held: prompt plus output so far (up with each `progressed`, down at
    /// release).
    pub kv_tokens: u64,
    /// Expected output still to come: expected minus produced, never below zero.
    pub remaining_output_tokens: u64,
}

impl WorkerLoad {
    /// The order in which the least-loaded worker is chosen: fewest bookings, then fewest
    /// tokens.
    fn rank(&self) -> (u64, u64) {
        (
            self.active_bookings,
            self.prompt_tokens + self.expected_output_tokens,
        )
    }
}

/// What one booking adds to its worker's load at one moment. Its lease computes it from
/// the request's sizes and progress ([`crate::lease::load`]); no per-booking record is
/// kept here.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct BookingWeight {
    pub(crate) prompt_tokens: u32,
    pub(crate) expected_output_tokens: u32,
    pub(crate) prefill_tokens: u32,
    pub(crate) kv_tokens: u32,
    pub(crate) remaining_output_tokens: u32,
}

impl From<RequestLoad> for BookingWeight {
    /// The weight at admission, before any progress.
    fn from(load: RequestLoad) -> Self {
        crate::lease::load::LeaseLoad::new(load).weight()
    }
}

/// A worker's sums. Signed, so that operations applied in any order add up (see the module
/// docs); shown clamped at zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tally {
    bookings: i64,
    prompt_tokens: i64,
    expected_output_tokens: i64,
    prefill_tokens: i64,
    kv_tokens: i64,
    remaining_output_tokens: i64,
}

impl Tally {
    fn add(&mut self, sign: i64, weight: BookingWeight) {
        self.bookings += sign;
        self.add_tokens(sign, weight);
    }

    fn add_tokens(&mut self, sign: i64, weight: BookingWeight) {
        self.prompt_tokens += sign * i64::from(weight.prompt_tokens);
        self.expected_output_tokens += sign * i64::from(weight.expected_output_tokens);
        self.prefill_tokens += sign * i64::from(weight.prefill_tokens);
        self.kv_tokens += sign * i64::from(weight.kv_tokens);
        self.remaining_output_tokens += sign * i64::from(weight.remaining_output_tokens);
    }

    fn is_zero(&self) -> bool {
        *self == Self::default()
    }

    fn load(&self) -> WorkerLoad {
        let clamp = |n: i64| u64::try_from(n).unwrap_or(0);
        WorkerLoad {
            active_bookings: clamp(self.bookings),
            prompt_tokens: clamp(self.prompt_tokens),
            expected_output_tokens: clamp(self.expected_output_tokens),
            prefill_tokens: clamp(self.prefill_tokens),
            kv_tokens: clamp(self.kv_tokens),
            remaining_output_tokens: clamp(self.remaining_output_tokens),
        }
    }
}

/// Counters of the scheduler, for dashboards and tests.
#[derive(Debug, Default)]
pub struct SchedulerStats {
    wakeups: AtomicU64,
    booked: AtomicU64,
    released_completed: AtomicU64,
    released_expired: AtomicU64,
    released_superseded: AtomicU64,
    released_reset: AtomicU64,
    workers_left: AtomicU64,
    workers_forgotten: AtomicU64,
    /// Route decisions by policy and outcome.
    decisions: [[AtomicU64; RouteOutcome::ALL.len()]; RoutePolicy::ALL.len()],
}

/// A point-in-time copy of the scheduler's counters.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct SchedulerStatsSnapshot {
    /// Times the actor woke to apply queued bookings and releases.
    pub wakeups: u64,
    pub booked: u64,
    pub released_completed: u64,
    pub released_expired: u64,
    pub released_superseded: u64,
    pub released_reset: u64,
    /// Workers (ranks) that said they were leaving.
    pub workers_left: u64,
    /// Workers (ranks) forgotten after their idle time with no live booking.
    pub workers_forgotten: u64,
    /// Route decisions, by [`RoutePolicy::ALL`] then [`RouteOutcome::ALL`] order.
    pub decisions: [[u64; RouteOutcome::ALL.len()]; RoutePolicy::ALL.len()],
}

impl SchedulerStatsSnapshot {
    /// Route decisions of `policy` that ended as `outcome`.
    pub fn decisions(&self, policy: RoutePolicy, outcome: RouteOutcome) -> u64 {
        self.decisions[policy as usize][outcome as usize]
    }
}

impl SchedulerStats {
    pub fn snapshot(&self) -> SchedulerStatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SchedulerStatsSnapshot {
            wakeups: get(&self.wakeups),
            booked: get(&self.booked),
            released_completed: get(&self.released_completed),
            released_expired: get(&self.released_expired),
            released_superseded: get(&self.released_superseded),
            released_reset: get(&self.released_reset),
            workers_left: get(&self.workers_left),
            workers_forgotten: get(&self.workers_forgotten),
            decisions: self.decisions.each_ref().map(|row| row.each_ref().map(get)),
        }
    }

    /// Counts one route decision.
    pub fn count_decision(&self, policy: RoutePolicy, outcome: RouteOutcome) {
        self.decisions[policy as usize][outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn count_release(&self, reason: ReleaseReason) {
        let counter = match reason {
            ReleaseReason::Completed => &self.released_completed,
            ReleaseReason::Expired => &self.released_expired,
            ReleaseReason::Superseded => &self.released_superseded,
            ReleaseReason::WorkerReset => &self.released_reset,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// The scheduler actor is gone, so it cannot answer.
#[derive(Debug, thiserror::Error)]
pub enum QuerySchedulerError {
    #[error("the scheduler has stopped")]
    Stopped,
}

/// Why [`SchedulerHandle::schedule`] could not place a request.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleRequestError {
    #[error("no worker is known yet: the scheduler learns workers from their lease events")]
    NoWorkers,
    #[error("the scheduler has stopped")]
    Stopped,
    #[error(
        "the lease manager refused the booking: max_active_leases are live (raise the limit, \
         or wait for leases to end)"
    )]
    LeasesFull,
    #[error("the lease manager is gone: the router was torn down")]
    ManagerGone,
}

/// One change to a worker's load, queued by the lease manager.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    /// A booking that its worker did not announce (a route decision's).
    Book(WorkerWithDpRank, BookingWeight),
    /// A booking its worker admitted: the worker spoke.
    Admitted(WorkerWithDpRank, BookingWeight),
    /// A release; one by completion also says the worker spoke.
    Release(WorkerWithDpRank, BookingWeight, ReleaseReason),
    /// A live booking's weight moved (its request progressed, or an admission took a
    /// provisional booking over): from the first weight to the second. The worker spoke.
    Shift(WorkerWithDpRank, BookingWeight, BookingWeight),
    /// The worker sent an event of its own that changed no load: a member, seen now.
    Seen(WorkerWithDpRank),
    /// A `worker_reset` (every rank when `dp_rank` is `None`), after its releases: a
    /// restart keeps the worker a member, leaving takes it out of every decision.
    Membership {
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
        leaving: bool,
    },
}

/// Operations that may wait in the inbox before the actor is woken to apply them. Every
/// query applies the inbox first, so waiting changes no answer; it only spares the runtime a
/// wake-up (a thread unpark, often) per burst of events, and bounds the inbox (64 bytes an
/// operation).
const WAKE_AT: usize = 256;

enum Command {
    /// Apply what is in the inbox.
    Drain,
    Loads(oneshot::Sender<Vec<(WorkerWithDpRank, WorkerLoad)>>),
    Workers(oneshot::Sender<Vec<WorkerStatus>>),
    Route(
        RouteRequest,
        oneshot::Sender<Result<RouteDecision, RouteRequestError>>,
    ),
    SetRouting(RoutingConfig, oneshot::Sender<()>),
    Routing(oneshot::Sender<RoutingConfig>),
    Load(WorkerWithDpRank, oneshot::Sender<WorkerLoad>),
    LeastLoaded(oneshot::Sender<Option<(WorkerWithDpRank, WorkerLoad)>>),
    Schedule(
        RequestId,
        RequestLoad,
        oneshot::Sender<Result<SchedulerBookingDescriptor, ScheduleRequestError>>,
    ),
}

struct Inbox {
    ops: Mutex<Vec<Op>>,
}

/// What every handle to the actor shares: the inbox, the channel and the counters.
#[derive(Clone)]
struct Mailbox {
    inbox: Arc<Inbox>,
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<SchedulerStats>,
}

impl Mailbox {
    /// Moves every operation of `ops` into the inbox, leaving it empty.
    fn submit(&self, ops: &mut Vec<Op>) {
        if ops.is_empty() {
            return;
        }
        let mut inbox = self.inbox.ops.lock();
        let before = inbox.len();
        if before == 0 && ops.capacity() >= inbox.capacity() {
            // Hand the whole vector over instead of copying it; the caller gets the
            // actor's empty one back. Never a smaller one: the inbox would have to grow
            // again, and a growing vector is a large allocation now and then, under this
            // lock (glibc's can take milliseconds when it first merges freed small chunks).
            mem::swap(&mut *inbox, ops);
        } else {
            inbox.append(ops);
        }
        if before < WAKE_AT && inbox.len() >= WAKE_AT {
            // Sent under the lock, so a wake-up is never behind a query that should see
            // these operations. A closed channel means the actor is gone: nothing to do.
            let _ = self.tx.send(Command::Drain);
        }
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, QuerySchedulerError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .map_err(|_| QuerySchedulerError::Stopped)?;
        rx.await.map_err(|_| QuerySchedulerError::Stopped)
    }
}

/// The cloneable handle through which the lease manager books and releases.
///
/// Holding one keeps the scheduler actor alive. Only the lease manager uses it (see the
/// module docs for why the scheduler takes no releases from anyone else).
#[derive(Clone)]
pub struct SchedulerBookingCleanup {
    mailbox: Mailbox,
}

impl SchedulerBookingCleanup {
    /// Hands over queued bookings and releases, leaving `ops` empty.
    pub(crate) fn submit(&self, ops: &mut Vec<Op>) {
        self.mailbox.submit(ops);
    }
}

/// The handle a router keeps: queries, and the cleanup handle for the manager.
#[derive(Clone)]
pub struct SchedulerHandle {
    mailbox: Mailbox,
}

impl SchedulerHandle {
    pub fn cleanup(&self) -> SchedulerBookingCleanup {
        SchedulerBookingCleanup {
            mailbox: self.mailbox.clone(),
        }
    }

    pub fn stats(&self) -> SchedulerStatsSnapshot {
        self.mailbox.stats.snapshot()
    }

    /// The load of every member worker, ordered by worker: a worker that left or was
    /// forgotten is not listed.
    pub async fn loads(&self) -> Result<Vec<(WorkerWithDpRank, WorkerLoad)>, QuerySchedulerError> {
        self.mailbox.ask(Command::Loads).await
    }

    /// Every member worker with its load and how long ago it was last heard, ordered by
    /// worker.
    pub async fn workers(&self) -> Result<Vec<WorkerStatus>, QuerySchedulerError> {
        self.mailbox.ask(Command::Workers).await
    }

    /// Chooses a member worker for `request` by the deployment's policy and books it there
    /// provisionally (see [`crate::routing`]): the next decision sees it at once, the
    /// worker's `admitted` takes it over, and it expires like any lease if none comes.
    ///
    /// # Errors
    /// [`RouteRequestError::InvalidRequest`] for nonsense sizes,
    /// [`RouteRequestError::NoWorkers`] when no worker is a member, and the others when the
    /// booking cannot be made. Each decision is counted by policy and outcome.
    pub async fn route(&self, request: RouteRequest) -> Result<RouteDecision, RouteRequestError> {
        if let Err(err) = request.validate() {
            // Counted under the policy in force, which only the actor knows: one more ask
            // for a request that is refused anyway.
            let policy = self
                .routing()
                .await
                .map_or_else(|_| RoutePolicy::default(), |r| r.policy);
            self.mailbox.stats.count_decision(policy, err.outcome());
            return Err(err);
        }
        self.mailbox
            .ask(|reply| Command::Route(request, reply))
            .await
            .map_err(|_| RouteRequestError::Stopped)?
    }

    /// Counts a route request refused before it could be read (a body that is not one).
    pub async fn count_invalid_request(&self) {
        let policy = self
            .routing()
            .await
            .map_or_else(|_| RoutePolicy::default(), |r| r.policy);
        self.mailbox
            .stats
            .count_decision(policy, RouteOutcome::Invalid);
    }

    /// Sets the policy and weights of later decisions (the idle time is kept).
    ///
    /// # Errors
    /// [`RouteRequestError::InvalidRequest`] for meaningless weights;
    /// [`RouteRequestError::Stopped`] when the actor is gone.
    pub async fn set_routing(&self, routing: RoutingConfig) -> Result<(), RouteRequestError> {
        routing.weights.validate()?;
        self.mailbox
            .ask(|reply| Command::SetRouting(routing, reply))
            .await
            .map_err(|_| RouteRequestError::Stopped)
    }

    /// The routing settings in force.
    pub async fn routing(&self) -> Result<RoutingConfig, QuerySchedulerError> {
        self.mailbox.ask(Command::Routing).await
    }

    /// The load of one worker, member or not (zero when it is unknown).
    pub async fn load(&self, worker: WorkerWithDpRank) -> Result<WorkerLoad, QuerySchedulerError> {
        self.mailbox.ask(|reply| Command::Load(worker, reply)).await
    }

    /// The least-loaded member worker: fewest bookings, then fewest tokens.
    pub async fn least_loaded(
        &self,
    ) -> Result<Option<(WorkerWithDpRank, WorkerLoad)>, QuerySchedulerError> {
        self.mailbox.ask(Command::LeastLoaded).await
    }

    /// Places a local request on the least-loaded worker and books it there.
    ///
    /// The booking is made through the replica observer, so the lease manager gives it a
    /// lease: a request whose worker never reports on it expires instead of leaking load.
    ///
    /// # Errors
    /// [`ScheduleRequestError::NoWorkers`] until a worker has been seen; the `Leases*` and
    /// `Manager*` variants when the lease manager would not take the booking (nothing is
    /// counted then).
    pub async fn schedule(
        &self,
        request_id: RequestId,
        load: RequestLoad,
    ) -> Result<SchedulerBookingDescriptor, ScheduleRequestError> {
        self.mailbox
            .ask(|reply| Command::Schedule(request_id, load, reply))
            .await
            .map_err(|_| ScheduleRequestError::Stopped)?
    }
}

/// A worker as [`SchedulerHandle::workers`] shows it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct WorkerStatus {
    pub worker: WorkerWithDpRank,
    pub load: WorkerLoad,
    /// Since its last event of its own, measured when the scheduler applied it (to within
    /// the inbox's wait, see the module docs).
    pub last_seen: Duration,
}

/// What the actor keeps of one worker.
#[derive(Clone, Copy, Debug)]
struct WorkerEntry {
    tally: Tally,
    /// Chosen by decisions and listed: it spoke, and has not left nor been forgotten since.
    /// A non-member is kept only while releases still have to bring its sums to zero.
    member: bool,
    last_seen: Instant,
}

struct SchedulerState {
    workers: HashMap<WorkerWithDpRank, WorkerEntry>,
    /// Read once per drain: when the operations applied were (about) made.
    now: Instant,
    worker_idle: Duration,
    last_sweep: Instant,
    routing: RoutingConfig,
    /// The members in worker order, for the policies that draw by index; rebuilt when
    /// membership has changed.
    members: Vec<WorkerWithDpRank>,
    members_dirty: bool,
    round_robin: usize,
    /// The draws of the random policies (see [`RoutingConfig::seed`]).
    rng: SmallRng,

    inbox: Arc<Inbox>,
    /// The actor's side of the inbox, swapped with it at each drain.
    batch: Vec<Op>,
    observer: Option<Arc<dyn ReplicaRequestLeaseObserver>>,
    stats: Arc<SchedulerStats>,
}

impl SchedulerState {
    fn entry(&mut self, worker: WorkerWithDpRank) -> &mut WorkerEntry {
        let now = self.now;
        self.workers.entry(worker).or_insert_with(|| WorkerEntry {
            tally: Tally::default(),
            member: false,
            last_seen: now,
        })
    }

    /// A new seed restarts the draws; the same one (a PUT that changes only the policy)
    /// leaves them where they are.
    fn set_routing(&mut self, routing: RoutingConfig) {
        if let Some(seed) = routing.seed.filter(|&seed| Some(seed) != self.routing.seed) {
            self.rng = SmallRng::seed_from_u64(seed);
        }
        self.routing = routing;
    }

    /// `worker` spoke: a member, seen now.
    fn seen(&mut self, worker: WorkerWithDpRank) {
        let now = self.now;
        let entry = self.entry(worker);
        let joined = !mem::replace(&mut entry.member, true);
        entry.last_seen = now;
        self.members_dirty |= joined;
    }

    /// Drops a non-member whose sums are back to zero.
    fn collect(&mut self, worker: WorkerWithDpRank) {
        if let Some(entry) = self.workers.get(&worker) {
            if !entry.member && entry.tally.is_zero() {
                self.workers.remove(&worker);
            }
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Book(worker, weight) => {
                let entry = self.entry(worker);
                entry.tally.add(1, weight);
                // Booked on by a decision, which chose a member.
                let joined = !mem::replace(&mut entry.member, true);
                self.members_dirty |= joined;
                self.stats.booked.fetch_add(1, Ordering::Relaxed);
            }
            Op::Admitted(worker, weight) => {
                self.entry(worker).tally.add(1, weight);
                self.stats.booked.fetch_add(1, Ordering::Relaxed);
                self.seen(worker);
            }
            Op::Release(worker, weight, reason) => {
                self.entry(worker).tally.add(-1, weight);
                self.stats.count_release(reason);
                if reason == ReleaseReason::Completed {
                    self.seen(worker);
                } else {
                    self.collect(worker);
                }
            }
            Op::Shift(worker, from, to) => {
                let entry = self.entry(worker);
                entry.tally.add_tokens(-1, from);
                entry.tally.add_tokens(1, to);
                self.seen(worker);
            }
            Op::Seen(worker) => self.seen(worker),
            Op::Membership {
                worker_id,
                dp_rank,
                leaving,
            } => self.membership(worker_id, dp_rank, leaving),
        }
    }

    fn membership(&mut self, worker_id: WorkerId, dp_rank: Option<DpRank>, leaving: bool) {
        self.members_dirty = true;
        let now = self.now;
        let mut matched = false;
        let mut left = 0;
        self.workers.retain(|w, entry| {
            if w.worker_id != worker_id || dp_rank.is_some_and(|rank| w.dp_rank != rank) {
                return true;
            }
            matched = true;
            if leaving {
                left += u64::from(entry.member);
                entry.member = false;
                !entry.tally.is_zero()
            } else {
                entry.member = true;
                entry.last_seen = now;
                true
            }
        });
        self.stats.workers_left.fetch_add(left, Ordering::Relaxed);
        if !leaving && !matched {
            // A worker starting: a member from now on, with the rank it named (rank 0 when
            // it named none; its other ranks join with their first event).
            let worker = WorkerWithDpRank {
                worker_id,
                dp_rank: dp_rank.unwrap_or_default(),
            };
            self.entry(worker).member = true;
        }
    }

    /// Forgets members with no live booking that have said nothing for the idle time;
    /// looks at most four times per idle time.
    fn forget_idle(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < self.worker_idle / 4 {
            return;
        }
        self.last_sweep = now;
        let idle = self.worker_idle;
        let mut forgotten = 0;
        self.workers.retain(|_, entry| {
            if entry.member
                && entry.tally.bookings <= 0
                && now.saturating_duration_since(entry.last_seen) >= idle
            {
                entry.member = false;
                forgotten += 1;
            }
            entry.member || !entry.tally.is_zero()
        });
        self.members_dirty |= forgotten > 0;
        self.stats
            .workers_forgotten
            .fetch_add(forgotten, Ordering::Relaxed);
    }

    fn tally_load(&self, worker: &WorkerWithDpRank) -> WorkerLoad {
        self.workers
            .get(worker)
            .map(|e| e.tally.load())
            .unwrap_or_default()
    }

    /// Picks a member by the policy in force; `None` when there is none.
    fn choose(&mut self, request: &RequestLoad) -> Option<(WorkerWithDpRank, Vec<Candidate>)> {
        let weights = self.routing.weights;
        let candidate = |worker: WorkerWithDpRank, load: &WorkerLoad| Candidate {
            worker,
            cost: routing::cost(weights, load, request),
        };
        if self.routing.policy == RoutePolicy::WeightedCost {
            // Over the map itself (no lookup per member), keeping the cheapest few in a
            // sorted array: most members cost one comparison with the dearest kept.
            const KEEP: usize = routing::REPORTED_CANDIDATES;
            let mut best = [Candidate {
                worker: WorkerWithDpRank::default(),
                cost: f64::INFINITY,
            }; KEEP];
            let mut kept = 0;
            for (worker, entry) in self.workers.iter().filter(|(_, e)| e.member) {
                let c = Candidate {
                    worker: *worker,
                    cost: routing::cost_of(
                        weights,
                        entry.tally.prefill_tokens,
                        entry.tally.kv_tokens,
                        request,
                    ),
                };
                if kept == KEEP && routing::cheaper(&c, &best[KEEP - 1]).is_ge() {
                    continue;
                }
                let mut at = kept.min(KEEP - 1);
                while at > 0 && routing::cheaper(&c, &best[at - 1]).is_lt() {
                    best[at] = best[at - 1];
                    at -= 1;
                }
                best[at] = c;
                kept = (kept + 1).min(KEEP);
            }
            if kept == 0 {
                return None;
            }
            return Some((best[0].worker, best[..kept].to_vec()));
        }
        if self.members_dirty {
            self.members.clear();
            self.members.extend(
                self.workers
                    .iter()
                    .filter(|(_, e)| e.member)
                    .map(|(w, _)| *w),
            );
            self.members.sort_unstable();
            self.members_dirty = false;
        }
        let n = self.members.len();
        if n == 0 {
            return None;
        }
        let pick = |state: &Self, i: usize| {
            let worker = state.members[i];
            candidate(worker, &state.tally_load(&worker))
        };
        let mut candidates = match self.routing.policy {
            RoutePolicy::PowerOfTwo if n > 1 => {
                let first = self.rng.random_range(0..n);
                let second = (first + self.rng.random_range(1..n)) % n;
                vec![pick(self, first), pick(self, second)]
            }
            RoutePolicy::RoundRobin => {
                let i = self.round_robin % n;
                self.round_robin = self.round_robin.wrapping_add(1);
                vec![pick(self, i)]
            }
            _ => {
                let i = self.rng.random_range(0..n);
                vec![pick(self, i)]
            }
        };
        candidates.sort_unstable_by(routing::cheaper);
        Some((candidates[0].worker, candidates))
    }

    fn route(&mut self, request: RouteRequest) -> Result<RouteDecision, RouteRequestError> {
        let policy = self.routing.policy;
        let decided = self.route_inner(request);
        let outcome = match &decided {
            Ok(_) => RouteOutcome::Routed,
            Err(err) => err.outcome(),
        };
        self.stats.count_decision(policy, outcome);
        decided
    }

    fn route_inner(&mut self, request: RouteRequest) -> Result<RouteDecision, RouteRequestError> {
        let load = request.load();
        let (worker, candidates) = self.choose(&load).ok_or(RouteRequestError::NoWorkers)?;
        let booking = SchedulerBookingDescriptor::new(request.request_id, worker);
        match &self.observer {
            None => self.apply(Op::Book(worker, load.into())),
            Some(observer) => {
                match observer.routed(booking.clone(), load) {
                    Ok(AdmitOutcome::Full) => return Err(RouteRequestError::LeasesFull),
                    Ok(_) => {}
                    Err(DeliverEventError::ManagerGone) => {
                        return Err(RouteRequestError::ManagerGone)
                    }
                }
                // The manager queued the booking: applied now, so the next decision sees it.
                self.drain();
            }
        }
        Ok(RouteDecision {
            booking,
            policy: self.routing.policy,
            candidates,
        })
    }

    /// Applies everything queued so far.
    fn drain(&mut self) {
        mem::swap(&mut *self.inbox.ops.lock(), &mut self.batch);
        if self.batch.is_empty() {
            return;
        }
        self.stats.wakeups.fetch_add(1, Ordering::Relaxed);
        self.now = Instant::now();
        let mut batch = mem::take(&mut self.batch);
        for op in batch.drain(..) {
            self.apply(op);
        }
        self.batch = batch;
    }

    /// The members and their loads.
    fn loads(&self) -> impl Iterator<Item = (WorkerWithDpRank, WorkerLoad)> + '_ {
        self.workers
            .iter()
            .filter(|(_, e)| e.member)
            .map(|(w, e)| (*w, e.tally.load()))
    }

    fn least_loaded(&self) -> Option<(WorkerWithDpRank, WorkerLoad)> {
        self.loads().min_by_key(|(w, l)| (l.rank(), *w))
    }

    fn schedule(
        &mut self,
        request_id: RequestId,
        load: RequestLoad,
    ) -> Result<SchedulerBookingDescriptor, ScheduleRequestError> {
        let (worker, _) = self.least_loaded().ok_or(ScheduleRequestError::NoWorkers)?;
        let booking = SchedulerBookingDescriptor::new(request_id, worker);
        let Some(observer) = &self.observer else {
            // No lease manager to keep the booking: counted here, and only here.
            self.apply(Op::Book(worker, load.into()));
            return Ok(booking);
        };
        match observer.admitted(booking.clone(), load) {
            Ok(AdmitOutcome::Registered | AdmitOutcome::Duplicate | AdmitOutcome::Superseded) => {}
            Ok(AdmitOutcome::Full) => return Err(ScheduleRequestError::LeasesFull),
            Err(DeliverEventError::ManagerGone) => return Err(ScheduleRequestError::ManagerGone),
        }
        // The manager queued the booking; apply it now so the next decision sees it.
        self.drain();
        Ok(booking)
    }
}

/// The scheduler actor of one deployment, made before it runs: its handle exists first, so
/// the lease manager can be built with its cleanup handle, and the actor is then started
/// with the manager's weak observer. No half-wired state exists in between.
pub struct Scheduler {
    deployment: String,
    state: SchedulerState,
    rx: mpsc::UnboundedReceiver<Command>,
}

impl Scheduler {
    /// The actor's channel and the handle to it; nothing runs until [`Scheduler::spawn`].
    pub fn new(deployment: &str) -> (SchedulerHandle, Self) {
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(SchedulerStats::default());
        let inbox = Arc::new(Inbox {
            ops: Mutex::new(Vec::new()),
        });
        let now = Instant::now();
        let state = SchedulerState {
            workers: HashMap::new(),
            now,
            worker_idle: DEFAULT_WORKER_IDLE,
            last_sweep: now,
            routing: RoutingConfig::default(),
            members: Vec::new(),
            members_dirty: false,
            round_robin: 0,
            rng: SmallRng::from_os_rng(),
            inbox: inbox.clone(),
            batch: Vec::new(),
            observer: None,
            stats: stats.clone(),
        };
        let handle = SchedulerHandle {
            mailbox: Mailbox { inbox, tx, stats },
        };
        let actor = Self {
            deployment: deployment.to_owned(),
            state,
            rx,
        };
        (handle, actor)
    }

    /// Forgets a member with no live booking after `idle` without an event of its own
    /// (default [`DEFAULT_WORKER_IDLE`]).
    pub fn with_worker_idle(mut self, idle: Duration) -> Self {
        self.state.worker_idle = idle;
        self
    }

    /// The policy and weights of [`SchedulerHandle::route`].
    pub fn with_routing(mut self, routing: RoutingConfig) -> Self {
        self.state.set_routing(routing);
        self
    }

    /// Starts the actor on `tracker`. `observer` is where [`SchedulerHandle::schedule`]
    /// books (the lease manager's weak observer); without one it counts bookings itself.
    ///
    /// The actor runs until every [`SchedulerHandle`] and [`SchedulerBookingCleanup`] is gone.
    pub fn spawn(
        mut self,
        observer: Option<Arc<dyn ReplicaRequestLeaseObserver>>,
        tracker: &TaskTracker,
    ) -> JoinHandle<()> {
        self.state.observer = observer;
        let span = tracing::info_span!("scheduler", deployment = %self.deployment);
        tracker.spawn(run(self.state, self.rx).instrument(span))
    }
}

async fn run(mut state: SchedulerState, mut rx: mpsc::UnboundedReceiver<Command>) {
    debug!("scheduler started");
    while let Some(command) = rx.recv().await {
        // Every command first applies what is queued, so answers reflect it.
        state.drain();
        state.forget_idle();
        match command {
            Command::Drain => {}
            Command::Loads(reply) => {
                let mut loads: Vec<_> = state.loads().collect();
                loads.sort_unstable_by_key(|(w, _)| *w);
                let _ = reply.send(loads);
            }
            Command::Workers(reply) => {
                let now = Instant::now();
                let mut workers: Vec<_> = state
                    .workers
                    .iter()
                    .filter(|(_, e)| e.member)
                    .map(|(worker, e)| WorkerStatus {
                        worker: *worker,
                        load: e.tally.load(),
                        last_seen: now.saturating_duration_since(e.last_seen),
                    })
                    .collect();
                workers.sort_unstable_by_key(|w| w.worker);
                let _ = reply.send(workers);
            }
            Command::Load(worker, reply) => {
                let load = state.workers.get(&worker).map(|e| e.tally.load());
                let _ = reply.send(load.unwrap_or_default());
            }
            Command::LeastLoaded(reply) => {
                let _ = reply.send(state.least_loaded());
            }
            Command::Route(request, reply) => {
                let _ = reply.send(state.route(request));
            }
            Command::SetRouting(routing, reply) => {
                state.set_routing(RoutingConfig {
                    worker_idle: state.routing.worker_idle,
                    ..routing
                });
                let _ = reply.send(());
            }
            Command::Routing(reply) => {
                let _ = reply.send(state.routing);
            }
            Command::Schedule(request_id, load, reply) => {
                let _ = reply.send(state.schedule(request_id, load));
            }
        }
    }
    debug!("scheduler stopped: every handle is gone");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: u64) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, 0)
    }

    fn weight(prompt: u32, output: Option<u32>) -> BookingWeight {
        RequestLoad::new(prompt, output).into()
    }

    fn submit(cleanup: &SchedulerBookingCleanup, ops: &[Op]) {
        cleanup.submit(&mut ops.to_vec());
    }

    #[tokio::test]
    async fn bookings_and_releases_move_worker_load() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        let cleanup = handle.cleanup();
        let a = weight(100, Some(10));
        submit(
            &cleanup,
            &[Op::Book(worker(1), a), Op::Book(worker(2), weight(5, None))],
        );
        assert_eq!(
            handle.load(worker(1)).await.unwrap(),
            WorkerLoad {
                active_bookings: 1,
                prompt_tokens: 100,
                expected_output_tokens: 10,
                prefill_tokens: 100,
                kv_tokens: 100,
                remaining_output_tokens: 10,
            }
        );
        assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, worker(2));
        submit(
            &cleanup,
            &[Op::Release(worker(1), a, ReleaseReason::Completed)],
        );
        assert_eq!(handle.load(worker(1)).await.unwrap(), WorkerLoad::default());
        assert_eq!(handle.load(worker(2)).await.unwrap().active_bookings, 1);
        let stats = handle.stats();
        assert_eq!((stats.booked, stats.released_completed), (2, 1));
    }

    #[tokio::test]
    async fn a_release_that_overtakes_its_booking_still_adds_up() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        let cleanup = handle.cleanup();
        let w = weight(30, Some(7));
        submit(
            &cleanup,
            &[Op::Release(worker(1), w, ReleaseReason::Expired)],
        );
        // Briefly below zero: shown as zero, not as a huge unsigned number.
        assert_eq!(handle.load(worker(1)).await.unwrap(), WorkerLoad::default());
        submit(
            &cleanup,
            &[Op::Book(worker(1), weight(5, None)), Op::Book(worker(1), w)],
        );
        assert_eq!(
            handle.load(worker(1)).await.unwrap(),
            WorkerLoad {
                active_bookings: 1,
                prompt_tokens: 5,
                expected_output_tokens: 0,
                prefill_tokens: 5,
                kv_tokens: 5,
                remaining_output_tokens: 0,
            }
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn bursts_of_releases_merge_into_one_wakeup() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        let cleanup = handle.cleanup();
        let w = weight(1, None);
        for i in 0..1000 {
            submit(&cleanup, &[Op::Book(worker(i % 8), w)]);
        }
        handle.loads().await.unwrap();
        let before = handle.stats().wakeups;
        // On one thread the actor cannot run between these calls: one burst.
        for i in 0..1000 {
            submit(
                &cleanup,
                &[Op::Release(worker(i % 8), w, ReleaseReason::Completed)],
            );
        }
        let loads = handle.loads().await.unwrap();
        assert!(loads.iter().all(|(_, l)| l.active_bookings == 0));
        assert_eq!(handle.stats().wakeups - before, 1);
        assert_eq!(handle.stats().released_completed, 1000);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_few_operations_wait_for_a_query_and_many_wake_the_actor() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        let cleanup = handle.cleanup();
        let w = weight(1, None);
        submit(&cleanup, &[Op::Book(worker(1), w); 10]);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(handle.stats().wakeups, 0, "nothing woke the actor yet");
        assert_eq!(handle.load(worker(1)).await.unwrap().active_bookings, 10);
        assert_eq!(
            handle.stats().wakeups,
            1,
            "the query applied the inbox first"
        );

        submit(&cleanup, &vec![Op::Book(worker(1), w); WAKE_AT]);
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while handle.stats().booked < 10 + WAKE_AT as u64 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("a full inbox wakes the actor without a query");
    }

    #[tokio::test]
    async fn actor_ends_when_every_handle_is_gone() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        let task = actor.spawn(None, &tracker);
        let cleanup = handle.cleanup();
        drop(handle);
        assert!(!task.is_finished());
        drop(cleanup);
        tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("scheduler ended")
            .unwrap();
    }

    fn members(loads: &[(WorkerWithDpRank, WorkerLoad)]) -> Vec<WorkerWithDpRank> {
        loads.iter().map(|(w, _)| *w).collect()
    }

    #[tokio::test]
    async fn a_worker_that_leaves_is_no_member_until_it_speaks_again() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        let cleanup = handle.cleanup();
        let w = weight(10, None);
        let leave = |worker_id, dp_rank| Op::Membership {
            worker_id: WorkerId(worker_id),
            dp_rank,
            leaving: true,
        };
        let a = WorkerWithDpRank::new(1, 0);
        let b = WorkerWithDpRank::new(1, 1);
        submit(
            &cleanup,
            &[
                Op::Seen(a),
                Op::Seen(b),
                Op::Book(worker(2), w),
                Op::Book(a, w),
            ],
        );
        assert_eq!(
            members(&handle.loads().await.unwrap()),
            vec![a, b, worker(2)]
        );
        // Its release comes after the leave (the reaper's, say): the worker stays gone, and
        // its sums come back to zero.
        submit(&cleanup, &[leave(1, None)]);
        assert_eq!(members(&handle.loads().await.unwrap()), vec![worker(2)]);
        assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, worker(2));
        assert_eq!(handle.load(a).await.unwrap().active_bookings, 1);
        submit(&cleanup, &[Op::Release(a, w, ReleaseReason::Expired)]);
        assert_eq!(handle.load(a).await.unwrap(), WorkerLoad::default());
        assert_eq!(members(&handle.loads().await.unwrap()), vec![worker(2)]);
        assert_eq!(handle.stats().workers_left, 2);
        // Speaking again makes it a member again; a restart of an unknown worker makes one.
        submit(
            &cleanup,
            &[
                Op::Seen(b),
                Op::Membership {
                    worker_id: WorkerId(5),
                    dp_rank: None,
                    leaving: false,
                },
            ],
        );
        assert_eq!(
            members(&handle.loads().await.unwrap()),
            vec![b, worker(2), worker(5)]
        );
        // One rank leaving leaves the others.
        submit(&cleanup, &[Op::Seen(a), leave(1, Some(DpRank(1)))]);
        assert_eq!(
            members(&handle.loads().await.unwrap()),
            vec![a, worker(2), worker(5)]
        );
    }

    #[tokio::test]
    async fn operations_of_a_worker_that_spoke_refresh_it_and_the_others_do_not() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        let cleanup = handle.cleanup();
        let w = weight(10, None);
        let mut moved = w;
        moved.prefill_tokens = 0;
        let spoke = [
            Op::Admitted(worker(1), w),
            Op::Shift(worker(2), w, moved),
            Op::Release(worker(3), w, ReleaseReason::Completed),
            Op::Seen(worker(4)),
        ];
        let silent = [
            Op::Release(worker(5), w, ReleaseReason::Expired),
            Op::Release(worker(6), w, ReleaseReason::Superseded),
        ];
        submit(&cleanup, &spoke);
        submit(&cleanup, &silent);
        let members: Vec<_> = handle
            .workers()
            .await
            .unwrap()
            .iter()
            .map(|s| s.worker)
            .collect();
        assert_eq!(members, [1, 2, 3, 4].map(worker));
        tokio::time::sleep(Duration::from_millis(50)).await;
        submit(
            &cleanup,
            &[Op::Release(worker(1), w, ReleaseReason::Expired)],
        );
        submit(&cleanup, &[Op::Shift(worker(2), moved, w)]);
        let ages: Vec<_> = handle
            .workers()
            .await
            .unwrap()
            .iter()
            .map(|s| s.last_seen)
            .collect();
        assert!(
            ages[0] >= Duration::from_millis(50),
            "an expiry is not the worker: {ages:?}"
        );
        assert!(ages[1] < Duration::from_millis(50), "a shift is: {ages:?}");
    }

    #[tokio::test]
    async fn an_idle_worker_is_forgotten_but_not_one_with_a_live_booking() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        let idle = Duration::from_millis(200);
        actor.with_worker_idle(idle).spawn(None, &tracker);
        let cleanup = handle.cleanup();
        submit(
            &cleanup,
            &[
                Op::Seen(worker(1)),
                Op::Seen(worker(2)),
                Op::Book(worker(3), weight(1, None)),
            ],
        );
        let workers = handle.workers().await.unwrap();
        assert_eq!(workers.len(), 3);
        assert!(workers.iter().all(|w| w.last_seen < idle), "{workers:?}");
        tokio::time::sleep(idle / 2).await;
        submit(&cleanup, &[Op::Seen(worker(2))]);
        let workers = handle.workers().await.unwrap();
        assert!(workers[0].last_seen >= idle / 2, "{workers:?}");
        assert!(workers[1].last_seen < idle / 2, "{workers:?}");
        tokio::time::sleep(idle * 3 / 4).await;
        handle.loads().await.unwrap();
        tokio::time::sleep(idle / 2).await;
        // Workers 1 and 2 have been silent longer than the idle time; worker 3 is booked.
        let left: Vec<_> = handle
            .workers()
            .await
            .unwrap()
            .iter()
            .map(|w| w.worker)
            .collect();
        assert_eq!(left, vec![worker(3)]);
        assert_eq!(handle.stats().workers_forgotten, 2);
    }

    async fn routed(policy: RoutePolicy, members: &[WorkerWithDpRank]) -> SchedulerHandle {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        // Equal weights keep the expected costs below easy to follow.
        actor
            .with_routing(RoutingConfig {
                policy,
                weights: routing::CostWeights {
                    prefill: 1.0,
                    kv: 1.0,
                },
                ..RoutingConfig::default()
            })
            .spawn(None, &tracker);
        let seen: Vec<_> = members.iter().map(|w| Op::Seen(*w)).collect();
        submit(&handle.cleanup(), &seen);
        handle
    }

    fn request(id: &str, prompt: u32) -> RouteRequest {
        RouteRequest::new(id, prompt)
    }

    #[tokio::test]
    async fn weighted_cost_takes_the_cheapest_and_sees_its_own_bookings_at_once() {
        let handle = routed(
            RoutePolicy::WeightedCost,
            &[worker(1), worker(2), worker(3)],
        )
        .await;
        let cleanup = handle.cleanup();
        // Worker 1 holds much KV, worker 2 has prefill waiting, worker 3 a little of both.
        submit(
            &cleanup,
            &[
                Op::Book(worker(1), weight(1000, None)),
                Op::Shift(worker(1), weight(1000, None), {
                    let mut w = weight(1000, None);
                    w.prefill_tokens = 0;
                    w.kv_tokens = 5000;
                    w
                }),
                Op::Book(worker(2), weight(3000, None)),
                Op::Book(worker(3), weight(100, None)),
            ],
        );
        let decision = handle.route(request("a", 1000)).await.unwrap();
        assert_eq!(decision.worker(), worker(3));
        assert_eq!(decision.policy, RoutePolicy::WeightedCost);
        let costs: Vec<_> = decision
            .candidates
            .iter()
            .map(|c| (c.worker, c.cost))
            .collect();
        // prefill + kv, the request's own 1000 + 1000 included.
        assert_eq!(
            costs,
            vec![
                (worker(3), 100.0 + 100.0 + 2000.0),
                (worker(1), 0.0 + 5000.0 + 2000.0),
                (worker(2), 3000.0 + 3000.0 + 2000.0)
            ]
        );
        // Booked at once: worker 3 now costs 2200 + 2000 more, so the next goes elsewhere
        // only when that makes it dearer than worker 1.
        assert_eq!(handle.load(worker(3)).await.unwrap().active_bookings, 2);
        let next = handle.route(request("b", 2000)).await.unwrap();
        assert_eq!(next.worker(), worker(3), "1100 + 1100 + 4000 < 5000 + 4000");
        let next = handle.route(request("c", 2000)).await.unwrap();
        assert_eq!(next.worker(), worker(1), "3100 + 3100 + 4000 > 5000 + 4000");
        let stats = handle.stats();
        assert_eq!(
            stats.decisions(RoutePolicy::WeightedCost, RouteOutcome::Routed),
            3
        );
    }

    #[tokio::test]
    async fn weighted_cost_reports_the_cheapest_few_in_order() {
        let members: Vec<_> = (0..30).map(worker).collect();
        let handle = routed(RoutePolicy::WeightedCost, &members).await;
        // Loads in a scrambled order: worker i carries (i * 7 mod 30) * 10 prompt tokens.
        let books: Vec<_> = (0..30)
            .map(|i| Op::Book(worker(i), weight((i as u32 * 7 % 30) * 10, None)))
            .collect();
        submit(&handle.cleanup(), &books);
        let decision = handle.route(request("a", 1)).await.unwrap();
        let mut expected: Vec<_> = (0..30u64)
            .map(|i| ((i * 7 % 30) * 20 + 2, worker(i)))
            .collect();
        expected.sort();
        let got: Vec<_> = decision
            .candidates
            .iter()
            .map(|c| (c.cost as u64, c.worker))
            .collect();
        assert_eq!(got, expected[..routing::REPORTED_CANDIDATES].to_vec());
        assert_eq!(decision.worker(), worker(0));
    }

    #[tokio::test]
    async fn power_of_two_never_takes_the_dearest_and_spreads_over_the_rest() {
        let members: Vec<_> = (0..6).map(worker).collect();
        let handle = routed(RoutePolicy::PowerOfTwo, &members).await;
        submit(
            &handle.cleanup(),
            &[Op::Book(worker(5), weight(1_000_000, None))],
        );
        let mut chosen = std::collections::BTreeSet::new();
        for i in 0..200 {
            let decision = handle.route(request(&format!("r{i}"), 10)).await.unwrap();
            assert_eq!(decision.candidates.len(), 2);
            assert!(decision.candidates[0].cost <= decision.candidates[1].cost);
            assert_eq!(decision.worker(), decision.candidates[0].worker);
            chosen.insert(decision.worker());
        }
        assert!(
            !chosen.contains(&worker(5)),
            "the lower of two is never the dearest"
        );
        assert_eq!(chosen.len(), 5, "{chosen:?}");
    }

    #[tokio::test]
    async fn round_robin_takes_members_in_turn_and_random_only_members() {
        let handle = routed(RoutePolicy::RoundRobin, &[worker(1), worker(2), worker(3)]).await;
        let mut turns = Vec::new();
        for i in 0..6 {
            turns.push(
                handle
                    .route(request(&format!("r{i}"), 1))
                    .await
                    .unwrap()
                    .worker(),
            );
        }
        assert_eq!(turns, [1, 2, 3, 1, 2, 3].map(worker));

        let leave = Op::Membership {
            worker_id: WorkerId(2),
            dp_rank: None,
            leaving: true,
        };
        submit(&handle.cleanup(), &[leave]);
        handle
            .set_routing(RoutingConfig {
                policy: RoutePolicy::Random,
                ..RoutingConfig::default()
            })
            .await
            .unwrap();
        for i in 0..100 {
            let decision = handle.route(request(&format!("x{i}"), 1)).await.unwrap();
            assert_ne!(
                decision.worker(),
                worker(2),
                "a worker that left is never chosen"
            );
            assert_eq!(decision.policy, RoutePolicy::Random);
        }
    }

    /// The same seed and the same state make the same draws; a different seed, and setting
    /// the seed again mid-run, restart them.
    #[tokio::test]
    async fn a_seed_makes_the_random_policies_repeatable() {
        let members: Vec<_> = (1..=16).map(worker).collect();
        let draws = |policy, seed: Option<u64>, reseed_after: Option<usize>| {
            let members = members.clone();
            async move {
                let handle = routed(policy, &members).await;
                let set = |seed| RoutingConfig {
                    policy,
                    seed,
                    ..RoutingConfig::default()
                };
                handle.set_routing(set(seed)).await.unwrap();
                let mut picks = Vec::new();
                for i in 0..40 {
                    if reseed_after == Some(i) {
                        // The same seed again: no restart.
                        handle.set_routing(set(seed)).await.unwrap();
                        handle.set_routing(set(seed.map(|s| s + 1))).await.unwrap();
                        handle.set_routing(set(seed)).await.unwrap();
                    }
                    let decision = handle.route(request(&format!("r{i}"), 1)).await.unwrap();
                    // The workers drawn, not the one chosen: the choice also depends on the
                    // loads, which the bookings change.
                    let mut drawn: Vec<_> = decision.candidates.iter().map(|c| c.worker).collect();
                    drawn.sort_unstable();
                    picks.push(drawn);
                }
                picks
            }
        };
        for policy in [RoutePolicy::Random, RoutePolicy::PowerOfTwo] {
            let a = draws(policy, Some(7), None).await;
            assert_eq!(a, draws(policy, Some(7), None).await, "{policy:?}");
            assert_ne!(a, draws(policy, Some(8), None).await, "{policy:?}");
            assert_ne!(a, draws(policy, None, None).await, "{policy:?}");
            // Reseeded with 7 after 20 draws: the first 20 picks come again.
            let restarted = draws(policy, Some(7), Some(20)).await;
            assert_eq!(restarted[..20], a[..20], "{policy:?}");
            assert_eq!(restarted[20..], a[..20], "{policy:?}");
        }
    }

    #[tokio::test]
    async fn bad_requests_and_no_members_are_refused_and_counted() {
        let handle = routed(RoutePolicy::PowerOfTwo, &[]).await;
        assert_eq!(
            handle.route(request("a", 10)).await,
            Err(RouteRequestError::NoWorkers)
        );
        for bad in [
            request("a", 0),
            request("", 10),
            request("a", 10).with_cached_tokens(11),
        ] {
            assert!(matches!(
                handle.route(bad).await,
                Err(RouteRequestError::InvalidRequest(_))
            ));
        }
        let bad_weights = RoutingConfig {
            weights: routing::CostWeights {
                prefill: f64::NAN,
                kv: 1.0,
            },
            ..RoutingConfig::default()
        };
        assert!(handle.set_routing(bad_weights).await.is_err());
        let stats = handle.stats();
        assert_eq!(
            stats.decisions(RoutePolicy::PowerOfTwo, RouteOutcome::NoWorkers),
            1
        );
        assert_eq!(
            stats.decisions(RoutePolicy::PowerOfTwo, RouteOutcome::Invalid),
            3
        );
        assert_eq!(
            stats.decisions(RoutePolicy::PowerOfTwo, RouteOutcome::Routed),
            0
        );
    }

    #[tokio::test]
    async fn schedule_places_on_least_loaded_worker() {
        let tracker = TaskTracker::new();
        let (handle, actor) = Scheduler::new("t");
        actor.spawn(None, &tracker);
        assert!(matches!(
            handle
                .schedule(RequestId::from("x"), RequestLoad::default())
                .await,
            Err(ScheduleRequestError::NoWorkers)
        ));
        let w = weight(10, None);
        submit(
            &handle.cleanup(),
            &[
                Op::Book(worker(1), w),
                Op::Book(worker(2), w),
                Op::Book(worker(2), w),
            ],
        );
        let placed = handle
            .schedule(RequestId::from("x"), RequestLoad::new(1, None))
            .await
            .unwrap();
        assert_eq!(placed.worker, worker(1));
        assert_eq!(handle.load(placed.worker).await.unwrap().active_bookings, 2);
    }

    /// Fewest bookings first; between equal bookings, fewest tokens (prompt plus expected
    /// output), whatever the worker ids.
    #[tokio::test]
    async fn equal_bookings_are_ranked_by_their_tokens() {
        for (a, b) in [
            // Tokens: 30 against 10 (a product would rank them the other way).
            (weight(30, None), weight(5, Some(5))),
            // Tokens: 15 against 12 (a difference would rank them the other way).
            (weight(10, Some(5)), weight(12, None)),
        ] {
            let tracker = TaskTracker::new();
            let (handle, actor) = Scheduler::new("t");
            actor.spawn(None, &tracker);
            submit(
                &handle.cleanup(),
                &[Op::Book(worker(1), a), Op::Book(worker(2), b)],
            );
            assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, worker(2));
            // One booking more outweighs any tokens.
            submit(&handle.cleanup(), &[Op::Book(worker(2), weight(0, None))]);
            assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, worker(1));
        }
        let load = WorkerLoad {
            active_bookings: 2,
            prompt_tokens: 3,
            expected_output_tokens: 4,
            ..WorkerLoad::default()
        };
        assert_eq!(load.rank(), (2, 7));
    }
}

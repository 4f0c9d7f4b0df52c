//! What the actor keeps: each worker's sums and membership, and the routing choice made
//! over them.

use std::mem;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;

use super::{Inbox, Op, ReleaseReason, SchedulerStats, WorkerStatus, DEFAULT_WORKER_IDLE};
use tokio::sync::oneshot;

use crate::admission::{
    AdmissionClass, AdmissionConfig, AdmissionCounts, ClassLoad, ClassSums, ClassTable,
};
use crate::load::{BookingWeight, LoadSums, RequestLoad, WorkerLoad};
use crate::observer::{AdmitOutcome, DeliverEventError, ReplicaRequestLeaseObserver};
use crate::prefix::PrefixState;
use crate::routing::{
    Candidate, Chooser, PrefixCredit, RouteDecision, RouteOutcome, RouteRequest, RouteRequestError,
    RoutingConfig,
};
use crate::types::{DpRank, SchedulerBookingDescriptor, WorkerId, WorkerWithDpRank};

/// What the actor keeps of one worker.
#[derive(Clone, Copy, Debug)]
struct WorkerEntry {
    sums: LoadSums,
    /// Chosen by decisions and listed: it spoke, and has not left nor been forgotten since.
    /// A non-member is kept only while releases still have to bring its sums to zero.
    member: bool,
    last_seen: Instant,
}

pub(super) struct SchedulerState {
    workers: HashMap<WorkerWithDpRank, WorkerEntry>,
    /// Read once per drain: when the operations applied were (about) made.
    now: Instant,
    worker_idle: Duration,
    last_sweep: Instant,
    chooser: Chooser,

    inbox: Arc<Inbox>,
    /// The actor's side of the inbox, swapped with it at each drain.
    batch: Vec<Op>,
    observer: Option<Arc<dyn ReplicaRequestLeaseObserver>>,
    stats: Arc<SchedulerStats>,
    prefix: Arc<PrefixState>,
    /// The last decision's booking, for [`learn_booked`](Self::learn_booked): its worker,
    /// its blocks and the index's count of forgets its overlaps were read at.
    booked_blocks: Option<(WorkerWithDpRank, Vec<u64>, u64)>,
    classes: Arc<ClassTable>,
    /// Every admission class's sums over the live bookings of every worker.
    class_sums: ClassSums,
    /// Route requests waiting for admission, highest band first, then in arrival order
    /// (they leave in [`Self::next_to_go`]'s order).
    waiting: Vec<Waiting>,
    /// Arrival number of the next waiting request.
    arrivals: u64,
    /// What this replica's admission did with each class's requests.
    admission_counts: AdmissionCounts,
}

/// Where a route decision's answer goes.
pub(super) type RouteReply = oneshot::Sender<Result<RouteDecision, RouteRequestError>>;

/// One saturation criterion as an admission decision reads it.
struct Criterion {
    /// What the members hold before the deployment saturates by it: members × its
    /// threshold (prefill tokens waiting, or KV tokens held).
    room: f64,
    /// Each configured class's use of it across the fleet, in the config's order.
    used: Vec<u64>,
    /// The members' use of it: the deployment is saturated by it past the room.
    total: u64,
}

/// What one request adds to each criterion, in [`Picture::criteria`]'s order, as its
/// booking weighs at admission: its uncached prompt to prefill waiting, its prompt to KV
/// held.
type Need = [u64; 2];

fn need(request: &RouteRequest) -> Need {
    let weight = BookingWeight::from(request.load());
    [weight.prefill_tokens, weight.kv_tokens].map(u64::from)
}

/// What an admission decision reads ([`SchedulerState::picture`]): the same figures in
/// every replica but for `waits`, this replica's own queue.
struct Picture {
    config: AdmissionConfig,
    /// Prefill tokens waiting; then, with a KV capacity configured, KV tokens held.
    criteria: Vec<Criterion>,
    /// Whether a request of each configured class waits in this replica.
    waits: Vec<bool>,
}

impl Picture {
    /// Where `class` is in the config: a class no longer configured counts as the default
    /// class, as its leases do. `None` without classes.
    fn index(&self, class: &AdmissionClass) -> Option<usize> {
        let name = self.config.class_of(Some(class.name()))?.name();
        self.config.classes().iter().position(|c| c.name() == name)
    }

    /// The class at `at`'s part of `criterion`'s room: its weight over the weights of its
    /// band's classes that share, times the room less what higher bands use. The classes
    /// that share are those using some of it, those waiting in this replica, and the class
    /// itself: an idle class's part goes to the others.
    fn part(&self, criterion: &Criterion, at: usize) -> f64 {
        let classes = self.config.classes();
        let band = classes[at].band();
        let (mut weights, mut higher) = (0.0, 0u64);
        for (i, other) in classes.iter().enumerate() {
            let used = criterion.used.get(i).copied().unwrap_or(0);
            if other.band() > band {
                higher = higher.saturating_add(used);
            } else if other.band() == band
                && (i == at || used > 0 || self.waits.get(i).copied().unwrap_or(false))
            {
                weights += other.weight();
            }
        }
        let room = (criterion.room - higher as f64).max(0.0);
        classes[at].weight() / weights * room
    }

    /// What the class at `at` uses of its part: its use over its part, the most over the
    /// criteria (0 when it uses nothing). The queue lets the least-filled class go first.
    fn fill(&self, at: usize) -> f64 {
        self.criteria
            .iter()
            .map(|criterion| {
                let used = criterion.used.get(at).copied().unwrap_or(0);
                if used == 0 {
                    0.0
                } else {
                    used as f64 / self.part(criterion, at)
                }
            })
            .fold(0.0, f64::max)
    }

    /// Whether a request of `class` that adds `need` may be routed now (before the queue is
    /// considered): always while the deployment is not saturated; while it is, only while,
    /// for each criterion it is past, its class's use with `need` stays within its part, or
    /// its class uses none of it (a request larger than its class's whole part still goes,
    /// alone). The parts of a band add up to its room, so what is admitted stays at the
    /// threshold, split by the weights. Checking use *with* the request keeps a class from
    /// passing its part by a request in each replica that admits at the same moment: such
    /// overshoots weigh most on the smallest parts. (Holding a request that would only take
    /// the deployment past the room to its part too was tried: the gap under the threshold
    /// then goes to the smallest requests of the replicas that see it first, which skewed
    /// both the shares and the mix; BENCHMARKS.md.)
    fn admits(&self, class: &AdmissionClass, need: Need) -> bool {
        let at = self.index(class);
        self.criteria.iter().zip(need).all(|(criterion, need)| {
            if criterion.total as f64 <= criterion.room {
                // Not past this criterion.
                return true;
            }
            let Some(at) = at else {
                return true;
            };
            let used = criterion.used.get(at).copied().unwrap_or(0);
            used == 0 || (used.saturating_add(need) as f64) <= self.part(criterion, at)
        })
    }

    /// The queue's order among the classes of one band: the least-filled first.
    fn fill_of(&self, class: &AdmissionClass) -> f64 {
        self.index(class).map_or(0.0, |at| self.fill(at))
    }
}

/// A route request waiting for admission while its deployment is saturated.
struct Waiting {
    request: RouteRequest,
    class: AdmissionClass,
    reply: RouteReply,
    /// Tokio's clock, so that tests with a paused clock can pass it.
    deadline: tokio::time::Instant,
    /// When it entered the queue (tokio's clock, as the deadline).
    since: tokio::time::Instant,
    arrival: u64,
}

impl SchedulerState {
    pub(super) fn new(
        inbox: Arc<Inbox>,
        stats: Arc<SchedulerStats>,
        prefix: Arc<PrefixState>,
        classes: Arc<ClassTable>,
    ) -> Self {
        let now = Instant::now();
        Self {
            workers: HashMap::new(),
            now,
            worker_idle: DEFAULT_WORKER_IDLE,
            last_sweep: now,
            chooser: Chooser::new(),
            inbox,
            batch: Vec::new(),
            observer: None,
            stats,
            prefix,
            booked_blocks: None,
            classes,
            class_sums: ClassSums::default(),
            waiting: Vec::new(),
            arrivals: 0,
            admission_counts: AdmissionCounts::default(),
        }
    }

    pub(super) fn set_worker_idle(&mut self, idle: Duration) {
        self.worker_idle = idle;
    }

    pub(super) fn set_observer(&mut self, observer: Option<Arc<dyn ReplicaRequestLeaseObserver>>) {
        self.observer = observer;
    }

    pub(super) fn routing(&self) -> RoutingConfig {
        self.chooser.config()
    }

    pub(super) fn set_routing(&mut self, routing: RoutingConfig) {
        self.chooser.set_config(routing);
    }

    fn entry(&mut self, worker: WorkerWithDpRank) -> &mut WorkerEntry {
        let now = self.now;
        self.workers.entry(worker).or_insert_with(|| WorkerEntry {
            sums: LoadSums::default(),
            member: false,
            last_seen: now,
        })
    }

    /// `worker` spoke: a member, seen now.
    fn seen(&mut self, worker: WorkerWithDpRank) {
        let now = self.now;
        let entry = self.entry(worker);
        let joined = !mem::replace(&mut entry.member, true);
        entry.last_seen = now;
        if joined {
            self.chooser.members_changed();
        }
    }

    /// Drops a non-member whose sums are back to zero.
    fn collect(&mut self, worker: WorkerWithDpRank) {
        if let Some(entry) = self.workers.get(&worker) {
            if !entry.member && entry.sums.is_zero() {
                self.workers.remove(&worker);
            }
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Book(class, worker, weight) => {
                self.class_sums.add(class, 1, weight);
                let entry = self.entry(worker);
                entry.sums.add(1, weight);
                // Booked on by a decision, which chose a member.
                if !mem::replace(&mut entry.member, true) {
                    self.chooser.members_changed();
                }
                self.stats.booked.fetch_add(1, Ordering::Relaxed);
            }
            Op::Admitted(class, worker, weight) => {
                self.class_sums.add(class, 1, weight);
                self.entry(worker).sums.add(1, weight);
                self.stats.booked.fetch_add(1, Ordering::Relaxed);
                self.seen(worker);
            }
            Op::Release(class, worker, weight, reason) => {
                self.class_sums.add(class, -1, weight);
                self.entry(worker).sums.add(-1, weight);
                self.stats.count_release(reason);
                if reason == ReleaseReason::Completed {
                    self.seen(worker);
                } else {
                    self.collect(worker);
                }
            }
            Op::Shift(class, worker, from, to) => {
                self.class_sums.shift(class, from, to);
                let entry = self.entry(worker);
                entry.sums.shift(from, to);
                self.seen(worker);
            }
            Op::Reclass(from, to, weight) => self.class_sums.reclass(from, to, weight),
            Op::Seen(worker) => self.seen(worker),
            Op::Membership {
                worker_id,
                dp_rank,
                leaving,
            } => self.membership(worker_id, dp_rank, leaving),
        }
    }

    fn membership(&mut self, worker_id: WorkerId, dp_rank: Option<DpRank>, leaving: bool) {
        self.chooser.members_changed();
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
                !entry.sums.is_zero()
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
    pub(super) fn forget_idle(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < self.worker_idle / 4 {
            return;
        }
        self.last_sweep = now;
        let idle = self.worker_idle;
        let mut forgotten = 0;
        self.workers.retain(|_, entry| {
            if entry.member
                && entry.sums.bookings <= 0
                && now.saturating_duration_since(entry.last_seen) >= idle
            {
                entry.member = false;
                forgotten += 1;
            }
            entry.member || !entry.sums.is_zero()
        });
        if forgotten > 0 {
            self.chooser.members_changed();
        }
        self.stats
            .workers_forgotten
            .fetch_add(forgotten, Ordering::Relaxed);
    }

    /// The load of one worker, member or not (zero when it is unknown).
    pub(super) fn load(&self, worker: &WorkerWithDpRank) -> WorkerLoad {
        self.workers
            .get(worker)
            .map(|e| e.sums.load())
            .unwrap_or_default()
    }

    /// Picks a member by the policy in force; `None` when there is none.
    fn choose(
        &mut self,
        request: &RequestLoad,
        prefix: PrefixCredit<'_>,
    ) -> Option<(WorkerWithDpRank, Vec<Candidate>)> {
        let workers = &self.workers;
        let members = workers
            .iter()
            .filter(|(_, e)| e.member)
            .map(|(w, e)| (w, &e.sums));
        let sums_of =
            |w: &WorkerWithDpRank| workers.get(w).map(|e| e.sums.load()).unwrap_or_default();
        self.chooser.choose(members, sums_of, request, prefix)
    }

    pub(super) fn route(
        &mut self,
        request: RouteRequest,
    ) -> Result<RouteDecision, RouteRequestError> {
        let policy = self.chooser.config().policy;
        let decided = self.route_inner(request);
        let outcome = match &decided {
            Ok(_) => RouteOutcome::Routed,
            Err(err) => err.outcome(),
        };
        self.stats.count_decision(policy, outcome);
        decided
    }

    fn route_inner(
        &mut self,
        mut request: RouteRequest,
    ) -> Result<RouteDecision, RouteRequestError> {
        // The previous decision's booking first (one the admission queue routed just now).
        self.learn_booked();
        let block_size = self.prefix.config().block_size();
        let blocks = request.blocks(block_size)?;
        let (overlaps, forgets): (HashMap<WorkerWithDpRank, u32>, u64) = if blocks.is_empty() {
            (HashMap::new(), 0)
        } else {
            let (overlaps, forgets) = self.prefix.overlaps(&blocks);
            (overlaps.into_iter().collect(), forgets)
        };
        let mut load = request.load();
        let (worker, candidates) = self
            .choose(&load, PrefixCredit::new(&overlaps, block_size))
            .ok_or(RouteRequestError::NoWorkers)?;
        // The booking weighs what the chosen worker has cached, even where the hot-worker
        // guard did not count it: that prefix needs no prefill there (and is the prediction
        // its `admitted` is compared with).
        load.cached_tokens = PrefixCredit::new(&overlaps, block_size).held_tokens(&worker, &load);
        let booking = SchedulerBookingDescriptor::new(request.request_id, worker);
        match &self.observer {
            None => {
                let class = self.classes.resolve(request.class.as_deref());
                self.apply(Op::Book(class, worker, load.into()));
            }
            Some(observer) => {
                match observer.routed_in_class(booking.clone(), load, request.class.as_deref()) {
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
        // The worker will hold the prompt's blocks, as much as its `admitted` can tell (its
        // first MAX_BLOCK_HASHES): learned right after the answer (`learn_booked`), before
        // this actor's next command, so the next decision sees them.
        if !blocks.is_empty() {
            let mut blocks = blocks;
            blocks.truncate(crate::wire::MAX_BLOCK_HASHES);
            self.booked_blocks = Some((worker, blocks, forgets));
        }
        Ok(RouteDecision {
            booking,
            policy: self.chooser.config().policy,
            candidates,
        })
    }

    /// The counters the actor shares with its handles.
    pub(super) fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    /// Whether the last decision left blocks for [`learn_booked`](Self::learn_booked).
    pub(super) fn has_booked_blocks(&self) -> bool {
        self.booked_blocks.is_some()
    }

    /// Teaches the prefix index the blocks of the last decision's booking, after its answer:
    /// a map insert and an eviction a block, in an index of millions of entries, are most
    /// of a prefix-aware decision's cost and no answer depends on them.
    pub(super) fn learn_booked(&mut self) {
        if let Some((worker, blocks, forgets)) = self.booked_blocks.take() {
            self.prefix.learn_booked(worker, &blocks, forgets);
        }
    }

    /// Applies everything queued so far.
    pub(super) fn drain(&mut self) {
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
    pub(super) fn loads(&self) -> impl Iterator<Item = (WorkerWithDpRank, WorkerLoad)> + '_ {
        self.workers
            .iter()
            .filter(|(_, e)| e.member)
            .map(|(w, e)| (*w, e.sums.load()))
    }

    /// The members as [`super::SchedulerHandle::workers`] shows them, unordered.
    pub(super) fn statuses(&self, now: Instant) -> Vec<WorkerStatus> {
        self.workers
            .iter()
            .filter(|(_, e)| e.member)
            .map(|(worker, e)| WorkerStatus {
                worker: *worker,
                load: e.sums.load(),
                last_seen: now.saturating_duration_since(e.last_seen),
            })
            .collect()
    }

    /// Whether route requests wait for admission.
    pub(super) fn has_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Decides `request` now, or, while the deployment is saturated and its class may not go
    /// yet, keeps it waiting (bounded, until its deadline); the answer goes to `reply`.
    /// Without admission classes every request is decided at once.
    pub(super) fn route_or_wait(&mut self, request: RouteRequest, reply: RouteReply) {
        if !self.classes.is_enabled() && self.waiting.is_empty() {
            let _ = reply.send(self.route(request));
            return;
        }
        // Those already waiting go first.
        self.admit_waiting();
        let picture = self.picture();
        let Some(class) = picture.config.class_of(request.class.as_deref()).cloned() else {
            let _ = reply.send(self.route(request));
            return;
        };
        // Behind a higher band waiting, and behind its own class's earlier requests (a
        // smaller request does not overtake them).
        let behind = self
            .waiting
            .iter()
            .any(|w| w.class.band() > class.band() || w.class.name() == class.name());
        if !behind && picture.admits(&class, need(&request)) {
            let _ = reply.send(self.route_admitted(request, &class));
            return;
        }
        let queue = picture.config.queue();
        let wait_ms = request
            .max_wait_ms
            .unwrap_or(queue.max_wait_ms())
            .min(queue.max_wait_ms());
        if wait_ms == 0 || self.waiting.len() >= queue.max_queued() {
            let why = if wait_ms == 0 {
                format!("class {:?} is over its part and may not wait", class.name())
            } else {
                format!(
                    "class {:?} is over its part and this replica's queue is full ({} waiting)",
                    class.name(),
                    self.waiting.len()
                )
            };
            self.refuse(reply, why, &class, &picture.config);
            return;
        }
        let arrival = self.arrivals;
        self.arrivals += 1;
        self.stats.admission_waited.fetch_add(1, Ordering::Relaxed);
        self.admission_counts.of(class.name()).queued += 1;
        let now = tokio::time::Instant::now();
        let at = self
            .waiting
            .partition_point(|w| w.class.band() >= class.band());
        self.waiting.insert(
            at,
            Waiting {
                request,
                class,
                reply,
                // Cannot overflow: every config in force passed `QueueConfig::validate`
                // (`ClassTable::set`), which bounds the wait.
                deadline: now + Duration::from_millis(wait_ms),
                since: now,
                arrival,
            },
        );
        debug_assert!(self.waiting.windows(2).all(|w| {
            (w[0].class.band(), std::cmp::Reverse(w[0].arrival))
                >= (w[1].class.band(), std::cmp::Reverse(w[1].arrival))
        }));
    }

    /// Routes the waiting requests that may go now, in [`Self::next_to_go`]'s order; refuses
    /// those past their deadline; forgets those whose caller went away. What it decides with
    /// is read once, and again after the queue changes (each request routed moves the
    /// figures).
    pub(super) fn admit_waiting(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        let mut picture = self.picture();
        let now = tokio::time::Instant::now();
        let (mut i, mut left) = (0, false);
        while i < self.waiting.len() {
            let waiting = &self.waiting[i];
            if waiting.reply.is_closed() {
                let waiting = self.waiting.remove(i);
                self.stats.count_abandoned();
                let counts = self.admission_counts.of(waiting.class.name());
                counts.abandoned += 1;
                counts.left_queue(now.saturating_duration_since(waiting.since));
            } else if waiting.deadline <= now {
                let waiting = self.waiting.remove(i);
                let why = format!(
                    "class {:?} stayed over its part for the whole wait",
                    waiting.class.name()
                );
                self.admission_counts
                    .of(waiting.class.name())
                    .left_queue(now.saturating_duration_since(waiting.since));
                self.refuse(waiting.reply, why, &waiting.class, &picture.config);
            } else {
                i += 1;
                continue;
            }
            left = true;
        }
        if left {
            // Who waits here moved the parts.
            picture = self.picture();
        }
        while let Some(i) = self.next_to_go(&picture) {
            let waiting = self.waiting.remove(i);
            self.admission_counts
                .of(waiting.class.name())
                .left_queue(now.saturating_duration_since(waiting.since));
            let decided = self.route_admitted(waiting.request, &waiting.class);
            let _ = waiting.reply.send(decided);
            picture = self.picture();
        }
    }

    /// The waiting request to route next, if one may go: in the highest band waiting (a
    /// lower band stays behind a higher one left waiting), of the classes that may go, the
    /// one furthest under its part ([`Picture::fill`]), then the earliest.
    fn next_to_go(&self, picture: &Picture) -> Option<usize> {
        let band = self.waiting.first()?.class.band();
        let mut looked: Vec<&str> = Vec::new();
        let mut best: Option<(f64, usize)> = None;
        for (i, waiting) in self.waiting.iter().enumerate() {
            if waiting.class.band() != band {
                break;
            }
            // A class's earliest request stands for it.
            let name = waiting.class.name();
            if looked.contains(&name) {
                continue;
            }
            looked.push(name);
            if !picture.admits(&waiting.class, need(&waiting.request)) {
                continue;
            }
            let fill = picture.fill_of(&waiting.class);
            if best.is_none_or(|(least, _)| fill < least) {
                best = Some((fill, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// Routes a request its admission let through, counted under its class when routed.
    fn route_admitted(
        &mut self,
        request: RouteRequest,
        class: &AdmissionClass,
    ) -> Result<RouteDecision, RouteRequestError> {
        let decided = self.route(request);
        if decided.is_ok() {
            self.admission_counts.of(class.name()).admitted += 1;
        }
        decided
    }

    fn refuse(
        &mut self,
        reply: RouteReply,
        why: String,
        class: &AdmissionClass,
        admission: &AdmissionConfig,
    ) {
        self.admission_counts.of(class.name()).refused += 1;
        let secs = admission.queue().max_wait_ms().div_ceil(1000).max(1);
        self.stats
            .count_decision(self.chooser.config().policy, RouteOutcome::Refused);
        let _ = reply.send(Err(RouteRequestError::Overloaded {
            why,
            retry_after: Duration::from_secs(secs),
        }));
    }

    /// What an admission decision reads: the classes, whether the deployment is saturated,
    /// each saturation criterion's room and each class's use of it across the fleet, and
    /// which classes have a request waiting here.
    fn picture(&self) -> Picture {
        let members: Vec<WorkerLoad> = self.loads().map(|(_, load)| load).collect();
        let (config, loads) = self.classes.snapshot(&self.class_sums);
        let saturation = config.saturation();
        let count = members.len() as f64;
        let mut criteria = vec![Criterion {
            room: saturation.max_prefill_tokens_per_worker() as f64 * count,
            used: loads.iter().map(|load| load.prefill_tokens).collect(),
            total: members.iter().map(|load| load.prefill_tokens).sum(),
        }];
        if let Some(capacity) = saturation.kv_capacity_tokens() {
            criteria.push(Criterion {
                room: saturation.max_kv_share() * capacity as f64 * count,
                used: loads.iter().map(|load| load.kv_tokens).collect(),
                total: members.iter().map(|load| load.kv_tokens).sum(),
            });
        }
        let mut waits = vec![false; config.classes().len()];
        for waiting in &self.waiting {
            let name = waiting.class.name();
            if let Some(i) = config.classes().iter().position(|c| c.name() == name) {
                waits[i] = true;
            }
        }
        Picture {
            config,
            criteria,
            waits,
        }
    }

    /// Each configured class with what it has in flight across the fleet, and what this
    /// replica's admission did with its requests.
    pub(super) fn class_loads(&self) -> Vec<ClassLoad> {
        let mut loads = self.classes.loads(&self.class_sums);
        for load in &mut loads {
            let waiting = self
                .waiting
                .iter()
                .filter(|w| w.class.name() == load.class)
                .count() as u64;
            load.admission = self.admission_counts.figures(&load.class, waiting);
        }
        loads
    }

    /// The least-loaded member: fewest bookings, then fewest tokens.
    pub(super) fn least_loaded(&self) -> Option<(WorkerWithDpRank, WorkerLoad)> {
        self.loads().min_by_key(|(w, l)| (l.rank(), *w))
    }
}

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
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;
use tracing::{debug, Instrument};

use crate::admission::{AdmissionConfig, ClassId, ClassLoad, ClassTable, ConfigureAdmissionError};
use crate::histogram::HistogramFigures;
use crate::load::{BookingWeight, WorkerLoad};
use crate::observer::ReplicaRequestLeaseObserver;
use crate::prefix::{PrefixFigures, PrefixIndexConfig, PrefixState};
use crate::routing::{
    RouteDecision, RouteOutcome, RoutePolicy, RouteRequest, RouteRequestError, RoutingConfig,
};
use crate::types::{DpRank, WorkerId, WorkerWithDpRank};

mod state;
mod stats;
#[cfg(test)]
mod tests;

use state::SchedulerState;
pub use stats::SchedulerFigures;
pub(crate) use stats::SchedulerStats;

/// How long a worker with no live booking may stay silent before the scheduler forgets it,
/// unless set: one lease lifetime at the default scan interval (a silent lease dies one to
/// two intervals after its last touch).
pub(crate) const DEFAULT_WORKER_IDLE: Duration = Duration::from_secs(600);

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
    /// A route decision's provisional booking that its worker never admitted: its deadline
    /// passed, or the gateway cancelled it.
    Unconfirmed,
}

/// The scheduler actor is gone, so it cannot answer.
#[derive(Debug, thiserror::Error)]
pub enum QuerySchedulerError {
    /// The scheduler task has stopped, so the query got no answer.
    #[error("the scheduler has stopped")]
    Stopped,
}

/// One change to a worker's load, queued by the lease manager. Each booking's change also
/// names its admission class (0: none, see [`crate::admission`]), whose fleet-wide sums move
/// with it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    /// A booking that its worker did not announce (a route decision's).
    Book(ClassId, WorkerWithDpRank, BookingWeight),
    /// A booking its worker admitted: the worker spoke.
    Admitted(ClassId, WorkerWithDpRank, BookingWeight),
    /// A release; one by completion also says the worker spoke.
    Release(ClassId, WorkerWithDpRank, BookingWeight, ReleaseReason),
    /// A live booking's weight moved (its request progressed, or an admission took a
    /// provisional booking over): from the first weight to the second. The worker spoke.
    Shift(ClassId, WorkerWithDpRank, BookingWeight, BookingWeight),
    /// A live booking of this weight moved from the first class to the second (an
    /// admission that took over a route decision's booking named another class).
    Reclass(ClassId, ClassId, BookingWeight),
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
    ClassLoads(oneshot::Sender<Vec<ClassLoad>>),
}

struct Inbox {
    ops: Mutex<Vec<Op>>,
}

/// What every handle to the actor shares: the inbox, the channel, the counters, the
/// prefix index (which the actor reads in its decisions and the manager teaches) and the
/// admission classes (which the manager resolves at admission and the actor reports on).
#[derive(Clone)]
struct Mailbox {
    inbox: Arc<Inbox>,
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<SchedulerStats>,
    prefix: Arc<PrefixState>,
    classes: Arc<ClassTable>,
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
pub(crate) struct SchedulerBookingCleanup {
    mailbox: Mailbox,
}

impl SchedulerBookingCleanup {
    /// Hands over queued bookings and releases, leaving `ops` empty.
    pub(crate) fn submit(&self, ops: &mut Vec<Op>) {
        self.mailbox.submit(ops);
    }

    /// The deployment's prefix index, which admissions and resets teach.
    pub(crate) fn prefix(&self) -> &PrefixState {
        &self.mailbox.prefix
    }

    /// The deployment's admission classes, by which admissions are counted.
    pub(crate) fn classes(&self) -> &ClassTable {
        &self.mailbox.classes
    }
}

/// The handle a router keeps: queries, and the cleanup handle for the manager.
#[derive(Clone)]
pub struct SchedulerHandle {
    mailbox: Mailbox,
}

impl SchedulerHandle {
    pub(crate) fn cleanup(&self) -> SchedulerBookingCleanup {
        SchedulerBookingCleanup {
            mailbox: self.mailbox.clone(),
        }
    }

    /// A point-in-time copy of the scheduler's counters.
    pub fn stats(&self) -> SchedulerFigures {
        self.mailbox.stats.snapshot()
    }

    /// How long this scheduler took over its route decisions: each from its actor taking the
    /// request to the answer (or to the request's place in the admission queue), not the
    /// trip to and from the actor. A request let out of the queue later is not timed again.
    pub fn decision_times(&self) -> HistogramFigures {
        self.mailbox.stats.decision_times()
    }

    /// A point-in-time copy of the prefix index's counters.
    pub fn prefix_figures(&self) -> PrefixFigures {
        self.mailbox.prefix.figures()
    }

    /// What the prefix index holds of each rank of worker `worker_id`.
    pub(crate) fn prefix_view(&self, worker_id: u64) -> Vec<crate::prefix::RankView> {
        self.mailbox.prefix.worker_view(worker_id)
    }

    /// The prefix index's settings (block size, bounds).
    pub fn prefix_config(&self) -> PrefixIndexConfig {
        self.mailbox.prefix.config()
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
    /// provisionally: the next decision sees it at once, the
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
        // Token ids are hashed here, on the caller's task, not in the actor that every
        // decision and booking waits for.
        let mut request = request;
        if let Some(ids) = request.token_ids.take() {
            request.prompt_tokens = request.prompt_tokens.max(ids.len() as u32);
            let block_size = self.mailbox.prefix.config().block_size() as usize;
            request.block_hashes = Some(crate::prefix::block_hashes(&ids, block_size));
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

    /// The deployment's admission classes ([`AdmissionConfig::default`]: none, no
    /// admission).
    pub fn admission(&self) -> AdmissionConfig {
        self.mailbox.classes.config()
    }

    /// Puts admission classes in force for later admissions; live bookings keep the class
    /// they were admitted with (one no longer configured counts under the default class).
    ///
    /// # Errors
    /// [`ConfigureAdmissionError`] for classes [`AdmissionConfig::validate`] refuses.
    pub fn set_admission(&self, admission: AdmissionConfig) -> Result<(), ConfigureAdmissionError> {
        self.mailbox.classes.set(admission)
    }

    /// Each configured class with its requests and tokens in flight across the whole fleet
    /// (from every worker's leases, so the same in every replica), in the order of the
    /// classes; empty without classes.
    pub async fn class_loads(&self) -> Result<Vec<ClassLoad>, QuerySchedulerError> {
        self.mailbox.ask(Command::ClassLoads).await
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
}

/// A worker as [`SchedulerHandle::workers`] shows it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
pub struct WorkerStatus {
    /// The worker (and data-parallel rank).
    pub worker: WorkerWithDpRank,
    /// Its load: sums over its live bookings.
    pub load: WorkerLoad,
    /// Since its last event of its own, measured when the scheduler applied it (to within
    /// the inbox's wait, see the module docs).
    pub last_seen: Duration,
}

/// The scheduler actor of one deployment, made before it runs: its handle exists first, so
/// the lease manager can be built with its cleanup handle, and the actor is then started
/// with the manager's weak observer. No half-wired state exists in between.
pub(crate) struct Scheduler {
    deployment: String,
    state: SchedulerState,
    rx: mpsc::UnboundedReceiver<Command>,
}

impl Scheduler {
    /// The actor's channel and the handle to it; nothing runs until [`Scheduler::spawn`].
    #[cfg(test)]
    pub(crate) fn new(deployment: &str) -> (SchedulerHandle, Self) {
        Self::with_prefix(deployment, PrefixIndexConfig::default())
    }

    /// As [`Scheduler::new`], with the prefix index's settings.
    pub(crate) fn with_prefix(
        deployment: &str,
        prefix: PrefixIndexConfig,
    ) -> (SchedulerHandle, Self) {
        let (tx, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(SchedulerStats::default());
        let inbox = Arc::new(Inbox {
            ops: Mutex::new(Vec::new()),
        });
        let prefix = Arc::new(PrefixState::new(prefix));
        let classes = Arc::new(ClassTable::default());
        let state = SchedulerState::new(
            inbox.clone(),
            stats.clone(),
            prefix.clone(),
            classes.clone(),
        );
        let handle = SchedulerHandle {
            mailbox: Mailbox {
                inbox,
                tx,
                stats,
                prefix,
                classes,
            },
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
    pub(crate) fn with_worker_idle(mut self, idle: Duration) -> Self {
        self.state.set_worker_idle(idle);
        self
    }

    /// The policy and weights of [`SchedulerHandle::route`].
    pub(crate) fn with_routing(mut self, routing: RoutingConfig) -> Self {
        self.state.set_routing(routing);
        self
    }

    /// Starts the actor on `tracker`. `observer` is where [`SchedulerHandle::route`] books
    /// (the lease manager's weak observer); without one it counts bookings itself.
    ///
    /// The actor runs until every [`SchedulerHandle`] and [`SchedulerBookingCleanup`] is gone.
    pub(crate) fn spawn(
        mut self,
        observer: Option<Arc<dyn ReplicaRequestLeaseObserver>>,
        tracker: &TaskTracker,
    ) -> JoinHandle<()> {
        self.state.set_observer(observer);
        let span = tracing::info_span!("scheduler", deployment = %self.deployment);
        tracker.spawn(run(self.state, self.rx).instrument(span))
    }
}

/// How often the actor looks at the route requests waiting for admission: what releases
/// room (completions in the inbox, which wake it only in bursts) and deadlines.
const ADMISSION_RECHECK: Duration = Duration::from_millis(5);

async fn run(mut state: SchedulerState, mut rx: mpsc::UnboundedReceiver<Command>) {
    debug!("scheduler started");
    // When the waiting route requests are looked at next: on time even while commands keep
    // the actor busy.
    let mut next_pass = tokio::time::Instant::now();
    loop {
        let command = if state.has_waiting() {
            tokio::select! {
                command = rx.recv() => command,
                () = tokio::time::sleep_until(next_pass) => None,
            }
        } else {
            match rx.recv().await {
                Some(command) => Some(command),
                None => break,
            }
        };
        if state.has_waiting() && tokio::time::Instant::now() >= next_pass {
            state.drain();
            state.admit_waiting();
            state.learn_booked();
            next_pass = tokio::time::Instant::now() + ADMISSION_RECHECK;
        }
        let Some(command) = command else {
            if rx.is_closed() && rx.is_empty() {
                break;
            }
            continue;
        };
        // A route decision is timed from here: the queued work it applies first is part of it.
        let taken = Instant::now();
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
                let mut workers = state.statuses(Instant::now());
                workers.sort_unstable_by_key(|w| w.worker);
                let _ = reply.send(workers);
            }
            Command::Load(worker, reply) => {
                let _ = reply.send(state.load(&worker));
            }
            Command::LeastLoaded(reply) => {
                let _ = reply.send(state.least_loaded());
            }
            Command::ClassLoads(reply) => {
                let _ = reply.send(state.class_loads());
            }
            Command::Route(request, reply) => {
                state.route_or_wait(request, reply);
                state.stats().decision_took(taken.elapsed());
                // What the decision booked is learned after its answer, and after the task
                // that waits for the answer had its turn: woken from this worker thread, it
                // runs next here (tokio's LIFO slot), not behind the learning.
                if state.has_booked_blocks() {
                    tokio::task::yield_now().await;
                    state.learn_booked();
                }
            }
            Command::SetRouting(routing, reply) => {
                let worker_idle = state.routing().worker_idle;
                state.set_routing(RoutingConfig {
                    worker_idle,
                    ..routing
                });
                let _ = reply.send(());
            }
            Command::Routing(reply) => {
                let _ = reply.send(state.routing());
            }
        }
    }
    debug!("scheduler stopped: every handle is gone");
}

//! The scheduler actor: the per-worker load of one deployment that routing decisions read.
//!
//! Bookings and releases arrive through an inbox (a vector behind a short lock) rather than
//! one channel message each: the first operation into an empty inbox sends a single wake-up,
//! and the actor applies the whole burst at once. Queries go over the same channel, after
//! the actor has applied everything queued before them.
//!
//! The actor ends when every sender of its channel is gone. It holds the replica observer it
//! was given, which is why that observer must not own the lease manager strongly: the
//! manager holds a [`SchedulerBookingCleanup`], that is a sender, and a strong ring would keep
//! the channel open for ever.

use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;
use tracing::{debug, Instrument};

use crate::observer::ReplicaRequestLeaseObserver;
use crate::types::{
    AttemptId, RequestId, RequestLoad, SchedulerBookingDescriptor, WorkerWithDpRank,
};

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

/// The load of one worker as the scheduler counts it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct WorkerLoad {
    pub active_bookings: u64,
    pub prompt_tokens: u64,
    pub expected_output_tokens: u64,
}

impl WorkerLoad {
    fn add(&mut self, load: &Booked) {
        self.active_bookings += 1;
        self.prompt_tokens += u64::from(load.prompt_tokens);
        self.expected_output_tokens += u64::from(load.expected_output_tokens);
    }

    fn remove(&mut self, load: &Booked) {
        self.active_bookings = self.active_bookings.saturating_sub(1);
        self.prompt_tokens = self
            .prompt_tokens
            .saturating_sub(u64::from(load.prompt_tokens));
        self.expected_output_tokens = self
            .expected_output_tokens
            .saturating_sub(u64::from(load.expected_output_tokens));
    }

    /// The order in which the least-loaded worker is chosen: fewest bookings, then fewest
    /// tokens.
    fn rank(&self) -> (u64, u64) {
        (
            self.active_bookings,
            self.prompt_tokens + self.expected_output_tokens,
        )
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
    stale_releases: AtomicU64,
}

/// A point-in-time copy of [`SchedulerStats`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct SchedulerStatsSnapshot {
    /// Times the actor woke to apply queued bookings and releases.
    pub wakeups: u64,
    pub booked: u64,
    pub released_completed: u64,
    pub released_expired: u64,
    pub released_superseded: u64,
    pub released_reset: u64,
    /// Releases of unknown or superseded attempts, ignored.
    pub stale_releases: u64,
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
            stale_releases: get(&self.stale_releases),
        }
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
}

enum Op {
    Book(SchedulerBookingDescriptor, RequestLoad),
    Release(SchedulerBookingDescriptor, ReleaseReason),
}

enum Command {
    /// Apply what is in the inbox.
    Drain,
    Loads(oneshot::Sender<Vec<(WorkerWithDpRank, WorkerLoad)>>),
    Load(WorkerWithDpRank, oneshot::Sender<WorkerLoad>),
    LeastLoaded(oneshot::Sender<Option<(WorkerWithDpRank, WorkerLoad)>>),
    Schedule(
        RequestId,
        RequestLoad,
        oneshot::Sender<Option<SchedulerBookingDescriptor>>,
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
    fn push(&self, op: Op) {
        let mut ops = self.inbox.ops.lock();
        let was_empty = ops.is_empty();
        ops.push(op);
        if was_empty {
            // Sent under the lock so that a wake-up is never behind a query that should see
            // this operation. A closed channel means the actor is gone: nothing to release.
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

/// The cloneable handle through which the lease manager releases bookings.
///
/// Holding one keeps the scheduler actor alive.
#[derive(Clone)]
pub struct SchedulerBookingCleanup {
    mailbox: Mailbox,
}

impl SchedulerBookingCleanup {
    /// Releases one booking. Releasing an unknown or superseded attempt is a quiet no-op.
    pub fn release(&self, booking: SchedulerBookingDescriptor, reason: ReleaseReason) {
        self.mailbox.push(Op::Release(booking, reason));
    }

    /// Counts a booking against its worker.
    pub(crate) fn book(&self, booking: SchedulerBookingDescriptor, load: RequestLoad) {
        self.mailbox.push(Op::Book(booking, load));
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

    /// The load of every worker the scheduler knows, ordered by worker.
    pub async fn loads(&self) -> Result<Vec<(WorkerWithDpRank, WorkerLoad)>, QuerySchedulerError> {
        self.mailbox.ask(Command::Loads).await
    }

    /// The load of one worker (zero when it is unknown).
    pub async fn load(&self, worker: WorkerWithDpRank) -> Result<WorkerLoad, QuerySchedulerError> {
        self.mailbox.ask(|reply| Command::Load(worker, reply)).await
    }

    /// The least-loaded known worker: fewest bookings, then fewest tokens.
    pub async fn least_loaded(
        &self,
    ) -> Result<Option<(WorkerWithDpRank, WorkerLoad)>, QuerySchedulerError> {
        self.mailbox.ask(Command::LeastLoaded).await
    }

    /// Places a local request on the least-loaded worker and books it there.
    ///
    /// The booking is also reported to the replica observer, so the lease manager gives it a
    /// lease: a request whose worker never reports on it expires instead of leaking load.
    ///
    /// # Errors
    /// [`ScheduleRequestError::NoWorkers`] until a worker has been seen.
    pub async fn schedule(
        &self,
        request_id: RequestId,
        load: RequestLoad,
    ) -> Result<SchedulerBookingDescriptor, ScheduleRequestError> {
        self.mailbox
            .ask(|reply| Command::Schedule(request_id, load, reply))
            .await
            .map_err(|_| ScheduleRequestError::Stopped)?
            .ok_or(ScheduleRequestError::NoWorkers)
    }
}

/// One booking as the scheduler counts it.
struct Booked {
    attempt_id: AttemptId,
    worker: WorkerWithDpRank,
    prompt_tokens: u32,
    expected_output_tokens: u32,
}

struct SchedulerState {
    workers: HashMap<WorkerWithDpRank, WorkerLoad>,
    bookings: HashMap<RequestId, Booked>,
    observer: Option<Arc<dyn ReplicaRequestLeaseObserver>>,
    stats: Arc<SchedulerStats>,
}

impl SchedulerState {
    fn book(&mut self, booking: SchedulerBookingDescriptor, load: RequestLoad) {
        let booked = Booked {
            attempt_id: booking.attempt_id,
            worker: booking.worker,
            prompt_tokens: load.prompt_tokens,
            expected_output_tokens: load.expected_output_tokens.unwrap_or(0),
        };
        if let Some(old) = self.bookings.get(&booking.request_id) {
            if old.attempt_id == booking.attempt_id {
                return; // The same booking twice (a local decision echoed by its lease).
            }
        }
        self.workers.entry(booked.worker).or_default().add(&booked);
        self.stats.booked.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = self.bookings.insert(booking.request_id, booked) {
            // A newer attempt replaces an older one whose release has not arrived yet.
            self.unload(&old);
            self.stats.count_release(ReleaseReason::Superseded);
        }
    }

    fn release(&mut self, booking: &SchedulerBookingDescriptor, reason: ReleaseReason) {
        match self.bookings.get(&booking.request_id) {
            Some(b) if b.attempt_id == booking.attempt_id => {
                let old = self
                    .bookings
                    .remove(&booking.request_id)
                    .expect("present: just looked up");
                self.unload(&old);
                self.stats.count_release(reason);
            }
            _ => {
                self.stats.stale_releases.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn unload(&mut self, booked: &Booked) {
        if let Some(w) = self.workers.get_mut(&booked.worker) {
            w.remove(booked);
        }
    }

    fn apply(&mut self, ops: &mut Vec<Op>) {
        for op in ops.drain(..) {
            match op {
                Op::Book(booking, load) => self.book(booking, load),
                Op::Release(booking, reason) => self.release(&booking, reason),
            }
        }
    }

    fn least_loaded(&self) -> Option<(WorkerWithDpRank, WorkerLoad)> {
        self.workers
            .iter()
            .min_by_key(|(w, l)| (l.rank(), **w))
            .map(|(w, l)| (*w, *l))
    }

    fn schedule(
        &mut self,
        request_id: RequestId,
        load: RequestLoad,
    ) -> Option<SchedulerBookingDescriptor> {
        let (worker, _) = self.least_loaded()?;
        let booking = SchedulerBookingDescriptor::new(request_id, worker);
        self.book(booking.clone(), load);
        if let Some(observer) = &self.observer {
            // The manager books it again with the same attempt id, which is a no-op here.
            let _ = observer.admitted(booking.clone(), load);
        }
        Some(booking)
    }
}

/// Starts the scheduler actor of one deployment on `tracker`.
///
/// The actor runs until every [`SchedulerHandle`] and [`SchedulerBookingCleanup`] is gone.
pub fn spawn_scheduler(
    deployment: &str,
    observer: Option<Arc<dyn ReplicaRequestLeaseObserver>>,
    tracker: &TaskTracker,
) -> (SchedulerHandle, JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let stats = Arc::new(SchedulerStats::default());
    let inbox = Arc::new(Inbox {
        ops: Mutex::new(Vec::new()),
    });
    let state = SchedulerState {
        workers: HashMap::new(),
        bookings: HashMap::new(),
        observer,
        stats: stats.clone(),
    };
    let span = tracing::info_span!("scheduler", deployment = %deployment);
    let task = tracker.spawn(run(state, inbox.clone(), rx).instrument(span));
    let handle = SchedulerHandle {
        mailbox: Mailbox { inbox, tx, stats },
    };
    (handle, task)
}

async fn run(
    mut state: SchedulerState,
    inbox: Arc<Inbox>,
    mut rx: mpsc::UnboundedReceiver<Command>,
) {
    debug!("scheduler started");
    let mut batch = Vec::new();
    let mut drain = |state: &mut SchedulerState| {
        mem::swap(&mut *inbox.ops.lock(), &mut batch);
        if !batch.is_empty() {
            state.stats.wakeups.fetch_add(1, Ordering::Relaxed);
            state.apply(&mut batch);
        }
    };
    while let Some(command) = rx.recv().await {
        // Every command first applies what is queued, so answers reflect it.
        drain(&mut state);
        match command {
            Command::Drain => {}
            Command::Loads(reply) => {
                let mut loads: Vec<_> = state.workers.iter().map(|(w, l)| (*w, *l)).collect();
                loads.sort_unstable_by_key(|(w, _)| *w);
                let _ = reply.send(loads);
            }
            Command::Load(worker, reply) => {
                let _ = reply.send(state.workers.get(&worker).copied().unwrap_or_default());
            }
            Command::LeastLoaded(reply) => {
                let _ = reply.send(state.least_loaded());
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

    fn booking(id: &str, worker: u64) -> SchedulerBookingDescriptor {
        SchedulerBookingDescriptor::new(RequestId::from(id), WorkerWithDpRank::new(worker, 0))
    }

    #[tokio::test]
    async fn bookings_and_releases_move_worker_load() {
        let tracker = TaskTracker::new();
        let (handle, _task) = spawn_scheduler("t", None, &tracker);
        let cleanup = handle.cleanup();
        let a = booking("a", 1);
        let b = booking("b", 2);
        cleanup.book(a.clone(), RequestLoad::new(100, Some(10)));
        cleanup.book(b.clone(), RequestLoad::new(5, None));
        let load = handle.load(a.worker).await.unwrap();
        assert_eq!(
            load,
            WorkerLoad {
                active_bookings: 1,
                prompt_tokens: 100,
                expected_output_tokens: 10
            }
        );
        assert_eq!(handle.least_loaded().await.unwrap().unwrap().0, b.worker);
        cleanup.release(a.clone(), ReleaseReason::Completed);
        assert_eq!(handle.load(a.worker).await.unwrap(), WorkerLoad::default());
        // Releasing it again, or releasing an unknown booking, changes nothing.
        cleanup.release(a.clone(), ReleaseReason::Expired);
        cleanup.release(booking("nope", 1), ReleaseReason::Completed);
        let stats = handle.stats();
        assert_eq!(stats.released_completed, 1);
        assert_eq!(stats.released_expired, 0);
        assert_eq!(handle.load(b.worker).await.unwrap().active_bookings, 1);
        assert_eq!(handle.stats().stale_releases, 2);
    }

    #[tokio::test]
    async fn release_of_superseded_attempt_is_a_no_op() {
        let tracker = TaskTracker::new();
        let (handle, _task) = spawn_scheduler("t", None, &tracker);
        let cleanup = handle.cleanup();
        let first = booking("r", 1);
        let second = booking("r", 2);
        cleanup.book(first.clone(), RequestLoad::new(10, None));
        cleanup.book(second.clone(), RequestLoad::new(20, None));
        cleanup.release(first.clone(), ReleaseReason::Completed);
        assert_eq!(handle.load(first.worker).await.unwrap().active_bookings, 0);
        assert_eq!(
            handle.load(second.worker).await.unwrap(),
            WorkerLoad {
                active_bookings: 1,
                prompt_tokens: 20,
                expected_output_tokens: 0
            }
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn bursts_of_releases_merge_into_one_wakeup() {
        let tracker = TaskTracker::new();
        let (handle, _task) = spawn_scheduler("t", None, &tracker);
        let cleanup = handle.cleanup();
        let bookings: Vec<_> = (0..1000)
            .map(|i| booking(&format!("r{i}"), i % 8))
            .collect();
        for b in &bookings {
            cleanup.book(b.clone(), RequestLoad::new(1, None));
        }
        handle.loads().await.unwrap();
        let before = handle.stats().wakeups;
        // On one thread the actor cannot run between these calls: one burst.
        for b in &bookings {
            cleanup.release(b.clone(), ReleaseReason::Completed);
        }
        let loads = handle.loads().await.unwrap();
        assert!(loads.iter().all(|(_, l)| l.active_bookings == 0));
        assert_eq!(handle.stats().wakeups - before, 1);
        assert_eq!(handle.stats().released_completed, 1000);
    }

    #[tokio::test]
    async fn actor_ends_when_every_handle_is_gone() {
        let tracker = TaskTracker::new();
        let (handle, task) = spawn_scheduler("t", None, &tracker);
        let cleanup = handle.cleanup();
        drop(handle);
        assert!(!task.is_finished());
        drop(cleanup);
        tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("scheduler ended")
            .unwrap();
    }

    #[tokio::test]
    async fn schedule_places_on_least_loaded_worker() {
        let tracker = TaskTracker::new();
        let (handle, _task) = spawn_scheduler("t", None, &tracker);
        assert!(matches!(
            handle
                .schedule(RequestId::from("x"), RequestLoad::default())
                .await,
            Err(ScheduleRequestError::NoWorkers)
        ));
        let cleanup = handle.cleanup();
        cleanup.book(booking("a", 1), RequestLoad::new(10, None));
        cleanup.book(booking("b", 2), RequestLoad::new(10, None));
        cleanup.book(booking("c", 2), RequestLoad::new(10, None));
        let placed = handle
            .schedule(RequestId::from("x"), RequestLoad::new(1, None))
            .await
            .unwrap();
        assert_eq!(placed.worker, WorkerWithDpRank::new(1, 0));
        assert_eq!(handle.load(placed.worker).await.unwrap().active_bookings, 2);
    }
}

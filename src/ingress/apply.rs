//! From received bytes to the weak observer: the one path every event takes, live or
//! replayed.
//!
//! Checks run cheapest first (subject, size, decode, identity, sequence), then the event is
//! matched to the attempt it is about and handed to the observer. Out-of-order events are
//! held or tombstoned in bounded, short-lived maps (see [`super::reorder`]).

use std::mem;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use super::reorder::{ExpiringMap, InsertOutcome};
use super::sequence::{SequenceTracker, SequenceVerdict};
use crate::connection::LogRateLimiter;
use crate::lease::{LeaseBatch, WeakRequestLeaseManager};
use crate::observer::{AdmitOutcome, CompleteOutcome, DeliverEventError, ProgressOutcome};
use crate::scheduler::Op;
use crate::stats::{DropReason, IngressStats, PendingCounts};
use crate::subject::Subjects;
use crate::types::{DpRank, RequestId, RequestLoad, WorkerId, WorkerWithDpRank};
use crate::wire::{self, Admitted, Completed, LeaseEvent, Progressed, WorkerReset};

/// Limits of the ingress's own memory and checks.
#[derive(Clone, Debug)]
pub struct ApplyConfig {
    /// Larger events are dropped as `oversized`; keep it below the server's max_payload.
    pub max_event_bytes: usize,
    /// How long a completion that beat its admission keeps the late admission out.
    pub tombstone_ttl: Duration,
    pub max_tombstones: usize,
    /// How long progress that beat its admission waits for it.
    pub held_progress_ttl: Duration,
    pub max_held_progress: usize,
    /// Publishers whose sequence windows are kept; the least recent is forgotten past this.
    pub max_publishers: usize,
    /// Drop events older than a publisher's sequence window (core NATS, where they cannot
    /// be told from duplicates). Durable mode turns this off: JetStream already stored each
    /// event once, and a retried publish may land far behind its neighbours.
    pub drop_behind_window: bool,
}

impl Default for ApplyConfig {
    fn default() -> Self {
        Self {
            max_event_bytes: wire::DEFAULT_MAX_EVENT_BYTES,
            tombstone_ttl: Duration::from_secs(60),
            max_tombstones: 100_000,
            held_progress_ttl: Duration::from_secs(10),
            max_held_progress: 100_000,
            max_publishers: 10_000,
            drop_behind_window: true,
        }
    }
}

/// What became of one message.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Applied {
    Applied,
    /// Held until the admission it depends on arrives, or tombstoned.
    Held,
    Dropped(DropReason),
}

/// Applies received events of one deployment to its router, reaching the manager only
/// through a `Weak`.
pub struct EventApplier {
    subjects: Subjects,
    manager: WeakRequestLeaseManager,
    stats: Arc<IngressStats>,
    config: ApplyConfig,
    sequences: SequenceTracker,
    tombstones: ExpiringMap,
    held_progress: ExpiringMap,
    warn_limit: LogRateLimiter,
    record_lag: bool,
    /// The current batch, if one is open: see [`EventApplier::begin_batch`].
    batch: Option<Batch>,
    /// Per-event counts not yet added to `stats`.
    counts: PendingCounts,
    /// The scheduler operations buffer handed from one lease batch to the next.
    spare_ops: Vec<Op>,
}

/// What a batch of messages shares.
struct Batch {
    /// The wall clock, read once for all its events.
    clock_us: u64,
    /// The manager, upgraded once; `None` once the router is gone.
    leases: Option<LeaseBatch>,
}

impl EventApplier {
    /// `manager` is the router's ([`crate::router::IngressContext::manager`]).
    pub fn new(
        subjects: Subjects,
        manager: WeakRequestLeaseManager,
        stats: Arc<IngressStats>,
        config: ApplyConfig,
    ) -> Self {
        Self {
            subjects,
            manager,
            stats,
            sequences: SequenceTracker::new(config.max_publishers),
            tombstones: ExpiringMap::new(config.tombstone_ttl, config.max_tombstones),
            held_progress: ExpiringMap::new(config.held_progress_ttl, config.max_held_progress),
            warn_limit: LogRateLimiter::new(Duration::from_secs(5)),
            record_lag: true,
            batch: None,
            counts: PendingCounts::default(),
            spare_ops: Vec::new(),
            config,
        }
    }

    /// Starts a batch of messages taken at once. Their lag is measured against one reading
    /// of the clock, their counts are added to the stats at the end, and they go to one
    /// [`LeaseBatch`]: per event, a clock read, a few atomic increments, a `Weak` upgrade
    /// and a scheduler hand-over each cost about as much as the lease update itself. Apply
    /// the batch without awaiting in between: it holds the manager until
    /// [`EventApplier::end_batch`].
    pub fn begin_batch(&mut self) {
        self.end_batch();
        let leases = self.manager.upgrade().map(|manager| {
            let mut leases = manager.batch();
            leases.use_buffer(mem::take(&mut self.spare_ops));
            leases
        });
        self.batch = Some(Batch {
            clock_us: wire::unix_micros_now(),
            leases,
        });
    }

    /// Ends the batch: hands its scheduler operations and counts over and lets the manager
    /// go. Single events read the clock and count for themselves again.
    pub fn end_batch(&mut self) {
        // The lease batch first: a reader that sees the counts sees the leases' effects.
        if let Some(leases) = self.batch.take().and_then(|batch| batch.leases) {
            self.spare_ops = leases.finish();
        }
        self.counts.flush(&self.stats);
    }

    /// Whether publish-to-apply lag is recorded: not while replaying old events.
    pub fn set_record_lag(&mut self, record: bool) {
        self.record_lag = record;
    }

    pub fn stats(&self) -> &Arc<IngressStats> {
        &self.stats
    }

    /// Tombstones and held events currently kept.
    pub fn reorder_buffers(&self) -> (usize, usize) {
        (self.tombstones.len(), self.held_progress.len())
    }

    /// Applies one message.
    ///
    /// # Errors
    /// [`DeliverEventError::ManagerGone`] once the router is torn down: the event is counted
    /// as a late drop, and the caller should stop.
    pub fn apply(&mut self, subject: &str, payload: &[u8]) -> Result<Applied, DeliverEventError> {
        if self.batch.is_none() {
            self.begin_batch();
            let outcome = self.apply(subject, payload);
            self.end_batch();
            return outcome;
        }
        self.counts.received();
        let outcome = self.apply_inner(subject, payload);
        match outcome {
            Ok(Applied::Dropped(reason)) => self.stats.dropped(reason),
            Err(DeliverEventError::ManagerGone) => self.stats.dropped(DropReason::Late),
            Ok(_) => {}
        }
        outcome
    }

    fn apply_inner(&mut self, subject: &str, payload: &[u8]) -> Result<Applied, DeliverEventError> {
        let Some(subject_worker) = self.subjects.parse_worker(subject) else {
            self.warn(|| warn!(subject, "dropped an event on a subject outside the layout"));
            return Ok(Applied::Dropped(DropReason::Subject));
        };
        let envelope = match wire::decode(payload, self.config.max_event_bytes) {
            Ok(envelope) => envelope,
            Err(error) => {
                self.warn(|| {
                    warn!(worker = subject_worker, bytes = payload.len(), %error, "dropped an undecodable event")
                });
                return Ok(Applied::Dropped(DropReason::from_decode(&error)));
            }
        };
        if envelope.event.worker_id() != subject_worker {
            self.warn(|| {
                warn!(
                    worker = subject_worker,
                    body_worker = envelope.event.worker_id(),
                    request_id = envelope.event.request_id().unwrap_or(""),
                    "dropped an event whose body names another worker than its subject"
                )
            });
            return Ok(Applied::Dropped(DropReason::Identity));
        }
        let known_publisher = self.sequences.knows(envelope.publisher_id);
        let evicted_before = self.sequences.evicted();
        let verdict = self
            .sequences
            .observe(envelope.publisher_id, envelope.sequence);
        if !known_publisher {
            let evicted = self.sequences.evicted() - evicted_before;
            if evicted > 0 {
                self.stats.publishers_evicted(evicted);
                self.warn(|| {
                    warn!(
                        evicted,
                        max_publishers = self.config.max_publishers,
                        "forgot the least recently heard publishers: raise max_publishers if \
                         this many publishers are real"
                    )
                });
            }
        }
        match verdict {
            SequenceVerdict::Fresh { missing } => {
                if missing > 0 {
                    self.stats.gaps(missing);
                    self.warn(|| {
                        warn!(
                            worker = subject_worker,
                            publisher = envelope.publisher_id,
                            missing,
                            "sequence gap: events were lost"
                        )
                    });
                }
                if !known_publisher && envelope.sequence == 1 {
                    self.stats.publisher_restart();
                }
            }
            SequenceVerdict::Late => {}
            SequenceVerdict::Duplicate => return Ok(Applied::Dropped(DropReason::Duplicate)),
            SequenceVerdict::TooOld if self.config.drop_behind_window => {
                return Ok(Applied::Dropped(DropReason::Stale))
            }
            SequenceVerdict::TooOld => {}
        }
        let kind = envelope.event.kind();
        let outcome = match envelope.event {
            LeaseEvent::Admitted(e) => self.admitted(e)?,
            LeaseEvent::Progressed(e) => self.progressed(e)?,
            LeaseEvent::Completed(e) => self.completed(e)?,
            LeaseEvent::WorkerReset(e) => self.worker_reset(e)?,
        };
        if outcome == Applied::Applied {
            self.counts.applied(kind);
            if self.record_lag {
                let now = self
                    .batch
                    .as_ref()
                    .map_or_else(wire::unix_micros_now, |batch| batch.clock_us);
                self.counts
                    .lag_us(now.saturating_sub(envelope.published_at_us));
            }
        }
        Ok(outcome)
    }

    fn warn(&self, log: impl FnOnce()) {
        if self.warn_limit.check().is_some() {
            log();
        }
    }

    fn hold(&mut self, map: Hold, request_id: RequestId, e: WorkerWithDpRank) -> Applied {
        let map = match map {
            Hold::Tombstone => &mut self.tombstones,
            Hold::Progress => &mut self.held_progress,
        };
        match map.insert(request_id, e) {
            InsertOutcome::Inserted => {
                self.stats.reorder_held();
                Applied::Held
            }
            InsertOutcome::EvictedOldest => {
                self.stats.reorder_held();
                // The evicted entry is the one lost; this one is kept.
                self.stats.dropped(DropReason::Overflow);
                Applied::Held
            }
        }
    }

    /// The open lease batch, or the router is gone.
    fn leases(&mut self) -> Result<&mut LeaseBatch, DeliverEventError> {
        self.batch
            .as_mut()
            .and_then(|batch| batch.leases.as_mut())
            .ok_or(DeliverEventError::ManagerGone)
    }

    fn admit_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        Ok(self.leases()?.admit_current(request_id, worker, load))
    }

    fn progress_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<ProgressOutcome>, DeliverEventError> {
        Ok(self.leases()?.touch_current(request_id, worker))
    }

    fn complete_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<CompleteOutcome>, DeliverEventError> {
        Ok(self.leases()?.complete_current(request_id, worker))
    }

    fn admitted(&mut self, e: Admitted) -> Result<Applied, DeliverEventError> {
        let worker = e.worker();
        let load = e.load();
        let request_id = e.request_id.as_str();
        if self.tombstones.take(request_id, worker) {
            debug!(request_id, worker = %worker, "ignored an admission that arrived after its completion");
            self.held_progress.take(request_id, worker);
            return Ok(Applied::Dropped(DropReason::Stale));
        }
        // A re-sent admission of a live lease renews it; otherwise this is a new attempt.
        match self.admit_current(request_id, worker, load)? {
            AdmitOutcome::Full => {
                // Refused by the manager's max_active_leases (counted there as refused_full);
                // progress held for it would wait for nothing.
                self.held_progress.take(request_id, worker);
                return Ok(Applied::Dropped(DropReason::Overflow));
            }
            AdmitOutcome::Registered | AdmitOutcome::Duplicate | AdmitOutcome::Superseded => {}
        }
        if self.held_progress.take(request_id, worker) {
            self.progress_current(request_id, worker)?;
        }
        Ok(Applied::Applied)
    }

    fn progressed(&mut self, e: Progressed) -> Result<Applied, DeliverEventError> {
        let worker = e.worker();
        match self.progress_current(&e.request_id, worker)? {
            Some(ProgressOutcome::Renewed | ProgressOutcome::Coalesced) => Ok(Applied::Applied),
            Some(ProgressOutcome::Stale) => Ok(Applied::Dropped(DropReason::Stale)),
            None => {
                if self.tombstones.contains(&e.request_id, worker) {
                    Ok(Applied::Dropped(DropReason::Stale))
                } else {
                    let request_id = RequestId::from(e.request_id);
                    Ok(self.hold(Hold::Progress, request_id, worker))
                }
            }
        }
    }

    fn completed(&mut self, e: Completed) -> Result<Applied, DeliverEventError> {
        let worker = e.worker();
        match self.complete_current(&e.request_id, worker)? {
            Some(CompleteOutcome::Released) => Ok(Applied::Applied),
            Some(CompleteOutcome::Stale) => Ok(Applied::Dropped(DropReason::Stale)),
            None => {
                self.held_progress.take(&e.request_id, worker);
                let request_id = RequestId::from(e.request_id);
                Ok(self.hold(Hold::Tombstone, request_id, worker))
            }
        }
    }

    fn worker_reset(&mut self, e: WorkerReset) -> Result<Applied, DeliverEventError> {
        let dropped = self
            .leases()?
            .reset_worker(WorkerId(e.worker_id), e.dp_rank.map(DpRank));
        self.tombstones.forget_worker(|w| e.covers(w));
        self.held_progress.forget_worker(|w| e.covers(w));
        debug!(worker = e.worker_id, dropped, "worker reset applied");
        Ok(Applied::Applied)
    }
}

enum Hold {
    Tombstone,
    Progress,
}

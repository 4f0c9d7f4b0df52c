//! From received bytes to the weak observer: the one path every event takes, live or
//! replayed.
//!
//! Checks run cheapest first (subject, size, decode, identity, sequence), then the event is
//! matched to the attempt it is about and handed to the observer. Out-of-order events are
//! held or tombstoned in bounded, short-lived maps (see [`super::reorder`]).
//!
//! Every received message is counted exactly once as applied, dropped (by reason) or held
//! (see [`crate::stats`]); a held event is counted again only when it leaves the hold, as
//! applied when its admission arrives or as dropped otherwise.

use std::mem;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tracing::{debug, warn};

use super::reorder::{ExpiringMap, HeldImage, InsertOutcome};
use super::sequence::{SequenceTracker, SequenceVerdict};
use crate::lease::{LeaseBatch, WeakRequestLeaseManager};
use crate::load::RequestLoad;
use crate::log_limit::LogRateLimiter;
use crate::observer::{AdmitOutcome, CompleteOutcome, DeliverEventError, ProgressOutcome};
use crate::scheduler::Op;
use crate::stats::{DropReason, IngressStats, PendingCounts};
use crate::subject::Subjects;
use crate::types::{DpRank, RequestId, WorkerId, WorkerWithDpRank};
use crate::wire::{
    self, Admitted, Completed, EventKind, LeaseEvent, Message, Progressed, WorkerReset,
};

/// Limits of the ingress's own memory and checks.
#[derive(Clone, Debug)]
pub struct ApplyConfig {
    /// Larger events are dropped as `oversized`; keep it below the server's max_payload.
    pub max_event_bytes: usize,
    /// Larger batch messages (wire 1.2) are dropped as `oversized`, once each; the events
    /// inside a batch are held to `max_event_bytes` each.
    pub max_batch_bytes: usize,
    /// How long a completion that beat its admission keeps the late admission out. This
    /// and `held_progress_ttl` count on the wall clock in core mode and on the stream's
    /// clock (when the server stored each event) in durable mode, so that every durable
    /// replica, however late or fast it reads, holds and expires the same events.
    pub tombstone_ttl: Duration,
    /// Most early completions kept as tombstones; past it the oldest is evicted.
    pub max_tombstones: usize,
    /// How long progress that beat its admission waits for it.
    pub held_progress_ttl: Duration,
    /// Most progress events held for their admission; past it the oldest is evicted.
    pub max_held_progress: usize,
    /// Publishers whose sequence windows are kept; the least recent is forgotten past this.
    pub max_publishers: usize,
    /// Drop events older than a publisher's sequence window (core NATS, where they cannot
    /// be told from duplicates). [`crate::JetStreamIngress`] turns it off whatever is given:
    /// JetStream already stored each event once, and a retried publish may land far behind
    /// its neighbours.
    pub drop_behind_window: bool,
}

impl Default for ApplyConfig {
    fn default() -> Self {
        Self {
            max_event_bytes: wire::DEFAULT_MAX_EVENT_BYTES,
            max_batch_bytes: wire::DEFAULT_MAX_BATCH_BYTES,
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
    /// Applied to the lease manager.
    Applied,
    /// Held until the admission it depends on arrives (a `progressed`), or kept as a
    /// tombstone against it (a `completed`): counted as held until then.
    Held,
    /// Not applied, for this reason (counted in the ingress stats).
    Dropped(DropReason),
    /// A batch message (wire 1.2): what became of its events, each counted on its own.
    Batch(BatchOutcome),
}

/// What became of the events of one batch message.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct BatchOutcome {
    /// Events applied.
    pub applied: u32,
    /// Events held (see [`Applied::Held`]).
    pub held: u32,
    /// Events dropped, including those that could not be delivered.
    pub dropped: u32,
}

impl BatchOutcome {
    fn add(&mut self, outcome: Result<Applied, DeliverEventError>) {
        match outcome {
            Ok(Applied::Applied) => self.applied += 1,
            Ok(Applied::Held) => self.held += 1,
            Ok(Applied::Dropped(_)) | Err(_) => self.dropped += 1,
            Ok(Applied::Batch(inner)) => {
                self.applied += inner.applied;
                self.held += inner.held;
                self.dropped += inner.dropped;
            }
        }
    }

    /// Events of the batch.
    pub fn events(&self) -> u32 {
        self.applied + self.held + self.dropped
    }
}

/// What a snapshot keeps of an [`EventApplier`]'s memory of events out of order.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ReorderImage {
    tombstones: HeldImage,
    held_progress: HeldImage,
    /// The stream's clock at the cut, which the entries' times left count from.
    stream_time_us: Option<u64>,
}

/// What times the holds (tombstones, progress held for its admission).
///
/// Live, the wall clock. A durable replica counts on the stream's clock instead, the time
/// the server stored each event: every replica then holds and expires the same events,
/// whenever it reads them (replaying an hour in a second, or catching up after a freeze or
/// a partition longer than a hold), and a quiet stream keeps what it holds until its next
/// event (within the bounds).
#[derive(Clone, Copy, Debug)]
enum HoldClock {
    Wall,
    Stream {
        /// When the first stream time was heard, and that time.
        base: Instant,
        base_us: u64,
        /// The latest stream time heard (never goes back).
        latest_us: u64,
    },
}

impl HoldClock {
    fn stream_time_us(&self) -> Option<u64> {
        match *self {
            Self::Wall => None,
            Self::Stream { latest_us, .. } => Some(latest_us),
        }
    }
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
    hold_clock: HoldClock,
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
    /// The same, for the holds.
    instant: Instant,
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
            hold_clock: HoldClock::Wall,
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
            instant: Instant::now(),
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
        self.flush_counts();
    }

    /// Adds the pending counts to the stats, with the held events that expired meanwhile
    /// dropped as `unmatched` and the held gauge brought up to date: the identity holds at
    /// every flush. One clock read, only while something is held.
    fn flush_counts(&mut self) {
        if !self.tombstones.is_empty() || !self.held_progress.is_empty() {
            let now = self.hold_now();
            self.tombstones.expire(now);
            self.held_progress.expire(now);
        }
        let expired = self.tombstones.take_expired() + self.held_progress.take_expired();
        self.counts.dropped_n(DropReason::Unmatched, expired);
        self.counts
            .set_held(self.tombstones.events() + self.held_progress.events());
        self.counts.flush(&self.stats);
    }

    /// The sequence windows, for a snapshot.
    pub(crate) fn sequence_image(&self) -> super::sequence::SequenceImage {
        self.sequences.image()
    }

    /// Takes the sequence windows of a snapshot: the events after it are judged as the
    /// writer judged them.
    pub(crate) fn restore_sequences(&mut self, image: super::sequence::SequenceImage) {
        self.sequences.restore(image);
    }

    /// The tombstones and held progress, for a snapshot: without them a replica started
    /// from it would let a late admission revive a request the writer saw complete, and
    /// lose the progress that came before its admission.
    pub(crate) fn reorder_image(&self) -> ReorderImage {
        let now = self.hold_now();
        ReorderImage {
            tombstones: self.tombstones.image(now),
            held_progress: self.held_progress.image(now),
            stream_time_us: self.hold_clock.stream_time_us(),
        }
    }

    /// Takes a snapshot's tombstones and held progress (standing for no event of this
    /// replica: the writer counted them).
    pub(crate) fn restore_reorder(&mut self, image: ReorderImage) {
        if let Some(us) = image.stream_time_us {
            self.set_stream_time(us);
        }
        let now = self.hold_now();
        self.tombstones.restore(image.tombstones, now);
        self.held_progress.restore(image.held_progress, now);
    }

    /// Times the holds by the stream (see [`HoldClock`]): `unix_us` is when the server
    /// stored the message about to be applied.
    pub(crate) fn set_stream_time(&mut self, unix_us: u64) {
        match &mut self.hold_clock {
            HoldClock::Wall => {
                self.hold_clock = HoldClock::Stream {
                    base: Instant::now(),
                    base_us: unix_us,
                    latest_us: unix_us,
                };
            }
            HoldClock::Stream { latest_us, .. } => *latest_us = (*latest_us).max(unix_us),
        }
    }

    /// Now, for the holds.
    fn hold_now(&self) -> Instant {
        match self.hold_clock {
            HoldClock::Stream {
                base,
                base_us,
                latest_us,
            } => base + Duration::from_micros(latest_us.saturating_sub(base_us)),
            HoldClock::Wall => self
                .batch
                .as_ref()
                .map_or_else(Instant::now, |batch| batch.instant),
        }
    }

    /// Whether publish-to-apply lag is recorded: not while replaying old events.
    pub fn set_record_lag(&mut self, record: bool) {
        self.record_lag = record;
    }

    /// The counters this applier updates.
    pub fn stats(&self) -> &Arc<IngressStats> {
        &self.stats
    }

    /// Tombstones and held events currently kept.
    pub fn reorder_buffers(&self) -> (usize, usize) {
        (self.tombstones.len(), self.held_progress.len())
    }

    /// Applies one message: one event, or each event of a batch in order.
    ///
    /// # Errors
    /// [`DeliverEventError::ManagerGone`] once the router is torn down: the events are
    /// counted as late drops, and the caller should stop.
    pub fn apply(&mut self, subject: &str, payload: &[u8]) -> Result<Applied, DeliverEventError> {
        if self.batch.is_none() {
            self.begin_batch();
            let outcome = self.apply(subject, payload);
            self.end_batch();
            return outcome;
        }
        let Some(subject_worker) = self.subjects.parse_worker(subject) else {
            self.warn(|| warn!(subject, "dropped an event on a subject outside the layout"));
            // Not read: counted once, whatever the message holds.
            return self.count(Ok(Applied::Dropped(DropReason::Subject)));
        };
        let limits = wire::MessageLimits {
            max_event_bytes: self.config.max_event_bytes,
            max_batch_bytes: self.config.max_batch_bytes,
        };
        match wire::decode_message(payload, limits) {
            Message::Event(decoded) => {
                let outcome = self.apply_event(subject_worker, decoded, payload.len());
                self.count(outcome)
            }
            Message::Refused { events, error } => {
                self.warn(|| {
                    warn!(worker = subject_worker, bytes = payload.len(), events, %error, "dropped an unreadable batch")
                });
                let reason = DropReason::from_decode(&error);
                self.counts.batch(events);
                let mut summary = BatchOutcome::default();
                for _ in 0..events {
                    summary.add(self.count(Ok(Applied::Dropped(reason))));
                }
                Ok(Applied::Batch(summary))
            }
            Message::Batch(events) => {
                self.counts.batch(events.len());
                let mut summary = BatchOutcome::default();
                let mut gone = false;
                for decoded in events {
                    let outcome = self.apply_event(subject_worker, decoded, payload.len());
                    gone |= outcome.is_err();
                    summary.add(self.count(outcome));
                }
                if gone {
                    return Err(DeliverEventError::ManagerGone);
                }
                Ok(Applied::Batch(summary))
            }
        }
    }

    /// Counts one received event by what became of it.
    fn count(
        &mut self,
        outcome: Result<Applied, DeliverEventError>,
    ) -> Result<Applied, DeliverEventError> {
        self.counts.received();
        match outcome {
            Ok(Applied::Dropped(reason)) => self.counts.dropped(reason),
            Err(DeliverEventError::ManagerGone) => self.counts.dropped(DropReason::Late),
            Ok(_) => {}
        }
        outcome
    }

    /// Applies one decoded event that arrived on `subject_worker`'s subject.
    fn apply_event(
        &mut self,
        subject_worker: u64,
        decoded: Result<wire::Envelope, wire::DecodeEventError>,
        message_bytes: usize,
    ) -> Result<Applied, DeliverEventError> {
        let envelope = match decoded {
            Ok(envelope) => envelope,
            Err(error) => {
                self.warn(|| {
                    warn!(worker = subject_worker, bytes = message_bytes, %error, "dropped an undecodable event")
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
        let lost_evicted_before = self.sequences.lost_evicted();
        let verdict = self
            .sequences
            .observe(envelope.publisher_id, envelope.sequence);
        if !known_publisher {
            if self
                .sequences
                .new_publisher_of(subject_worker, envelope.publisher_id)
            {
                self.stats.publisher_restart();
            }
            let evicted = self.sequences.evicted() - evicted_before;
            if evicted > 0 {
                self.stats.publishers_evicted(evicted);
                // Numbers still missing from the forgotten windows can no longer be told.
                self.stats
                    .gaps(self.sequences.lost_evicted() - lost_evicted_before);
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
            SequenceVerdict::Fresh { lost } => {
                if lost > 0 {
                    self.stats.gaps(lost);
                    self.warn(|| {
                        warn!(
                            worker = subject_worker,
                            publisher = envelope.publisher_id,
                            lost,
                            "sequence gap: events were lost"
                        )
                    });
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
            LeaseEvent::KvStored(e) => {
                self.leases()?
                    .prefix()
                    .kv_stored(e.worker(), &e.block_hashes);
                Applied::Applied
            }
            LeaseEvent::KvRemoved(e) => {
                self.leases()?
                    .prefix()
                    .kv_removed(e.worker(), &e.block_hashes);
                Applied::Applied
            }
            LeaseEvent::KvCleared(e) => {
                self.leases()?.prefix().kv_cleared(e.worker_id, e.dp_rank);
                debug!(worker = e.worker_id, dp_rank = ?e.dp_rank, "engine KV cache cleared");
                Applied::Applied
            }
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
        self.stats.reorder_held();
        let now = self.hold_now();
        let inserted = match map {
            Hold::Tombstone => self.tombstones.insert(request_id, e, now),
            Hold::Progress(output_tokens) => {
                self.held_progress
                    .insert_progress(request_id, e, output_tokens, now)
            }
        };
        match inserted {
            InsertOutcome::Inserted => {}
            // The evicted entry's events are the ones lost; this one is kept.
            InsertOutcome::EvictedOldest { events } => {
                self.counts.dropped_n(DropReason::Overflow, events);
            }
            // Held for the same request on another worker: that attempt is not live.
            InsertOutcome::Displaced { events } => {
                self.counts.dropped_n(DropReason::Stale, events);
            }
        }
        Applied::Held
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
        class: Option<&str>,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        Ok(self
            .leases()?
            .admit_current_in_class(request_id, worker, load, class))
    }

    fn progress_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
        output_tokens: u32,
    ) -> Result<Option<ProgressOutcome>, DeliverEventError> {
        Ok(self
            .leases()?
            .progress_current(request_id, worker, output_tokens))
    }

    fn complete_current(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<CompleteOutcome>, DeliverEventError> {
        Ok(self.leases()?.complete_current(request_id, worker))
    }

    fn admitted(&mut self, e: Admitted) -> Result<Applied, DeliverEventError> {
        let now = self.hold_now();
        let worker = e.worker();
        let load = e.load();
        let request_id = e.request_id.as_str();
        if let Some(completions) = self.tombstones.take(request_id, worker, now) {
            debug!(request_id, worker = %worker, "ignored an admission that arrived after its completion");
            // The held completion has done its work: the request it ended stays ended.
            self.counts.applied_n(EventKind::Completed, completions);
            let progress = self.held_progress.take(request_id, worker, now);
            self.counts
                .dropped_n(DropReason::Stale, progress.unwrap_or(0));
            return Ok(Applied::Dropped(DropReason::Stale));
        }
        if let Some(reported) = e.cached_tokens {
            // A decision of this replica predicted what its engine would find cached.
            let leases = self.leases()?;
            if let Some(predicted) = leases.predicted_cached(request_id, worker) {
                leases.prefix().compare(predicted, reported);
            }
        }
        // A re-sent admission of a live lease renews it; otherwise this is a new attempt.
        match self.admit_current(request_id, worker, load, e.class.as_deref())? {
            AdmitOutcome::Full => {
                // Refused by the manager's max_active_leases (counted there as refused_full);
                // progress held for it would wait for nothing.
                let progress = self.held_progress.take(request_id, worker, now);
                self.counts
                    .dropped_n(DropReason::Overflow, progress.unwrap_or(0));
                return Ok(Applied::Dropped(DropReason::Overflow));
            }
            AdmitOutcome::Registered | AdmitOutcome::Duplicate | AdmitOutcome::Superseded => {}
        }
        // The worker holds the prompt's blocks from now on.
        self.leases()?
            .prefix()
            .learn(worker, &e.block_hashes, e.block_capacity);
        if let Some((progress, output_tokens)) =
            self.held_progress.take_progress(request_id, worker, now)
        {
            // One touch applies them all, as touches between two scans coalesce, with the
            // highest output count they carried (the count never goes backwards anyway).
            match self.progress_current(request_id, worker, output_tokens) {
                Ok(Some(ProgressOutcome::Renewed | ProgressOutcome::Coalesced)) => {
                    self.counts.applied_n(EventKind::Progressed, progress);
                }
                Ok(_) => self.counts.dropped_n(DropReason::Stale, progress),
                Err(error) => {
                    self.counts.dropped_n(DropReason::Late, progress);
                    return Err(error);
                }
            }
        }
        Ok(Applied::Applied)
    }

    fn progressed(&mut self, e: Progressed) -> Result<Applied, DeliverEventError> {
        let worker = e.worker();
        match self.progress_current(&e.request_id, worker, e.output_tokens)? {
            Some(ProgressOutcome::Renewed | ProgressOutcome::Coalesced) => Ok(Applied::Applied),
            Some(ProgressOutcome::Stale) => Ok(Applied::Dropped(DropReason::Stale)),
            None => {
                if self
                    .tombstones
                    .contains(&e.request_id, worker, self.hold_now())
                {
                    Ok(Applied::Dropped(DropReason::Stale))
                } else {
                    let request_id = RequestId::from(e.request_id);
                    Ok(self.hold(Hold::Progress(e.output_tokens), request_id, worker))
                }
            }
        }
    }

    fn completed(&mut self, e: Completed) -> Result<Applied, DeliverEventError> {
        let now = self.hold_now();
        let worker = e.worker();
        match self.complete_current(&e.request_id, worker)? {
            Some(CompleteOutcome::Released) => Ok(Applied::Applied),
            Some(CompleteOutcome::Stale) => Ok(Applied::Dropped(DropReason::Stale)),
            None => {
                // Progress held for a request that ended: there is nothing left to renew.
                let progress = self.held_progress.take(&e.request_id, worker, now);
                self.counts
                    .dropped_n(DropReason::Stale, progress.unwrap_or(0));
                let request_id = RequestId::from(e.request_id);
                Ok(self.hold(Hold::Tombstone, request_id, worker))
            }
        }
    }

    fn worker_reset(&mut self, e: WorkerReset) -> Result<Applied, DeliverEventError> {
        let dropped =
            self.leases()?
                .reset_worker(WorkerId(e.worker_id), e.dp_rank.map(DpRank), e.leaving);
        // Held events of the reset worker's requests: their leases are gone.
        let forgotten = self.tombstones.forget_worker(|w| e.covers(w))
            + self.held_progress.forget_worker(|w| e.covers(w));
        self.counts.dropped_n(DropReason::Stale, forgotten);
        debug!(worker = e.worker_id, dropped, "worker reset applied");
        Ok(Applied::Applied)
    }
}

enum Hold {
    Tombstone,
    /// With the event's output token count.
    Progress(u32),
}

impl Drop for EventApplier {
    /// The router is gone (or going): what is still held will never be applied, so it is
    /// counted as `late`, and the held gauge comes back down.
    fn drop(&mut self) {
        self.end_batch();
        let held = self.tombstones.events() + self.held_progress.events();
        self.counts.dropped_n(DropReason::Late, held);
        self.counts.set_held(0);
        self.counts.flush(&self.stats);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::{NoIngress, Router, RouterConfig};
    use crate::subject::DeploymentName;
    use crate::wire::{Envelope, Outcome, ProgressStage};

    /// An applier on a live router, fed synchronously, with short hold times.
    struct Fixture {
        router: Router,
        applier: Option<EventApplier>,
        stats: Arc<IngressStats>,
        subjects: Subjects,
        received: u64,
    }

    const HOLD: Duration = Duration::from_millis(200);

    impl Fixture {
        async fn new() -> Self {
            let config = RouterConfig::new("unit").with_scan_interval(Duration::from_secs(3600));
            let router = Router::start(config, NoIngress).await.expect("starts");
            let subjects = Subjects::with_default_prefix(DeploymentName::new("unit").unwrap());
            let stats = Arc::new(IngressStats::new());
            let config = ApplyConfig {
                tombstone_ttl: HOLD,
                held_progress_ttl: HOLD,
                ..ApplyConfig::default()
            };
            let applier = EventApplier::new(
                subjects.clone(),
                router.manager().downgrade(),
                stats.clone(),
                config,
            );
            Self {
                router,
                applier: Some(applier),
                stats,
                subjects,
                received: 0,
            }
        }

        fn bytes(&mut self, subject: &str, bytes: &[u8]) -> Applied {
            self.received += 1;
            let applier = self.applier.as_mut().expect("not dropped");
            applier.apply(subject, bytes).expect("router alive")
        }

        fn feed(&mut self, publisher: u64, seq: u64, event: impl Into<LeaseEvent>) -> Applied {
            let envelope = Envelope::new(publisher, seq, wire::unix_micros_now(), event);
            let subject = self.subjects.worker_subject(envelope.event.worker_id());
            self.bytes(&subject, &wire::encode(&envelope).unwrap())
        }

        /// Checks the counts, and that they add up to what was received.
        #[track_caller]
        fn check(&self, applied: u64, dropped: u64, held: u64) {
            let s = self.stats.snapshot();
            assert_eq!(s.received, self.received, "{s:?}");
            assert_eq!(
                (s.applied_total(), s.dropped_total(), s.held),
                (applied, dropped, held),
                "{s:?}"
            );
            assert_eq!(s.accounted(), s.received, "the identity: {s:?}");
        }
    }

    fn admitted(id: &str, worker: u64) -> Admitted {
        Admitted {
            block_hashes: Vec::new(),
            block_capacity: None,
            class: None,
            request_id: id.into(),
            worker_id: worker,
            dp_rank: 0,
            prompt_tokens: 10,
            expected_output_tokens: None,
            cached_tokens: None,
        }
    }

    fn progressed(id: &str, worker: u64) -> Progressed {
        Progressed {
            request_id: id.into(),
            worker_id: worker,
            dp_rank: 0,
            stage: ProgressStage::Decoding,
            output_tokens: 1,
        }
    }

    fn completed(id: &str, worker: u64) -> Completed {
        Completed {
            request_id: id.into(),
            worker_id: worker,
            dp_rank: 0,
            outcome: Outcome::Finished,
        }
    }

    fn stamped(publisher: u64, seq: u64, event: impl Into<LeaseEvent>) -> Envelope {
        Envelope::new(publisher, seq, wire::unix_micros_now(), event)
    }

    /// A batch counts per event: each is judged (identity, sequence, hold, stale) as if it
    /// had come alone, in order.
    #[tokio::test]
    async fn each_event_of_a_batch_counts_on_its_own() {
        let mut f = Fixture::new().await;
        let subject = f.subjects.worker_subject(1);
        let batch = wire::encode_batch(&[
            stamped(1, 1, admitted("a", 1)),
            stamped(1, 2, progressed("b", 1)), // held for its admission
            stamped(1, 2, progressed("b", 1)), // duplicate
            stamped(1, 3, admitted("x", 2)),   // another worker than the subject's
            stamped(1, 4, completed("a", 1)),
            stamped(1, 5, admitted("c", 1)),
        ])
        .unwrap();
        f.received += 5;
        let outcome = f.bytes(&subject, &batch);
        assert_eq!(
            outcome,
            Applied::Batch(BatchOutcome {
                applied: 3,
                held: 1,
                dropped: 2
            })
        );
        f.check(3, 2, 1);
        let s = f.stats.snapshot();
        assert_eq!((s.batches, s.batched_events), (1, 6));
        assert_eq!(s.dropped(DropReason::Duplicate), 1);
        assert_eq!(s.dropped(DropReason::Identity), 1);
        let manager = f.router.manager();
        assert!(
            manager.lease(&"a".into()).is_none(),
            "admitted then completed"
        );
        assert!(manager.lease(&"c".into()).is_some());
        // The held progress is applied when its admission comes, alone this time.
        assert_eq!(f.feed(1, 6, admitted("b", 1)), Applied::Applied);
        f.check(5, 2, 0);
        // The same batch again: every event a duplicate, counted per event.
        f.received += 5;
        assert_eq!(
            f.bytes(&subject, &batch),
            Applied::Batch(BatchOutcome {
                applied: 0,
                held: 0,
                dropped: 6
            })
        );
        f.check(5, 8, 0);
        let s = f.stats.snapshot();
        assert_eq!(s.dropped(DropReason::Duplicate), 6);
        assert_eq!(
            s.dropped(DropReason::Identity),
            2,
            "checked before the sequence"
        );
    }

    #[tokio::test]
    async fn an_unreadable_batch_drops_each_event_it_declares_and_a_bad_subject_once() {
        let mut f = Fixture::new().await;
        let subject = f.subjects.worker_subject(1);
        let events: Vec<_> = (1..=4)
            .map(|seq| stamped(1, seq, admitted(&format!("r{seq}"), 1)))
            .collect();
        let batch = wire::encode_batch(&events).unwrap();
        f.received += 3;
        let cut = f.bytes(&subject, &batch[..batch.len() - 1]);
        assert_eq!(
            cut,
            Applied::Batch(BatchOutcome {
                applied: 0,
                held: 0,
                dropped: 4
            })
        );
        f.check(0, 4, 0);
        assert_eq!(f.stats.snapshot().dropped(DropReason::Decode), 4);
        // On a subject outside the layout it is not read: one drop.
        assert_eq!(
            f.bytes("leases.unit.07", &batch),
            Applied::Dropped(DropReason::Subject)
        );
        f.check(0, 5, 0);
        // Over the batch limit: not read either.
        let mut small = Fixture::new().await;
        small.applier.as_mut().unwrap().config.max_batch_bytes = batch.len() - 1;
        assert_eq!(
            small.bytes(&subject, &batch),
            Applied::Dropped(DropReason::Oversized)
        );
        small.check(0, 1, 0);
        // The batch itself, whole: every event applied, one batch counted.
        f.received += 3;
        assert_eq!(
            f.bytes(&subject, &batch),
            Applied::Batch(BatchOutcome {
                applied: 4,
                held: 0,
                dropped: 0
            })
        );
        f.check(4, 5, 0);
        let s = f.stats.snapshot();
        assert_eq!((s.batches, s.batched_events), (2, 8));
    }

    /// Once the router is gone every event of a batch is late, each counted.
    #[tokio::test]
    async fn a_batch_after_the_router_is_gone_is_late_per_event() {
        let f = Fixture::new().await;
        let subject = f.subjects.worker_subject(1);
        let batch = wire::encode_batch(&[
            stamped(1, 1, admitted("a", 1)),
            stamped(1, 2, admitted("b", 1)),
            stamped(1, 3, admitted("c", 1)),
        ])
        .unwrap();
        let Fixture {
            router,
            applier,
            stats,
            ..
        } = f;
        router.shutdown().await.expect("shuts down");
        let mut applier = applier.unwrap();
        assert_eq!(
            applier.apply(&subject, &batch),
            Err(DeliverEventError::ManagerGone)
        );
        let s = stats.snapshot();
        assert_eq!((s.received, s.dropped(DropReason::Late)), (3, 3));
        assert_eq!(s.accounted(), 3);
    }

    /// Every way into and out of the hold, with received == applied + dropped + held after
    /// each step.
    #[tokio::test]
    async fn every_event_is_applied_dropped_or_held_exactly_once() {
        use Applied::{Dropped, Held};
        const APPLIED: Applied = Applied::Applied;
        let mut f = Fixture::new().await;
        let mut seq = 0;
        let mut next = || {
            seq += 1;
            seq
        };
        assert_eq!(f.feed(1, next(), admitted("a", 1)), APPLIED);
        assert_eq!(
            f.feed(1, 1, admitted("a", 1)),
            Dropped(DropReason::Duplicate)
        );
        f.check(1, 1, 0);
        // Progress before its admission, twice: held, then applied with it.
        assert_eq!(f.feed(1, next(), progressed("b", 1)), Held);
        assert_eq!(f.feed(1, next(), progressed("b", 1)), Held);
        f.check(1, 1, 2);
        assert_eq!(f.feed(1, next(), admitted("b", 1)), APPLIED);
        f.check(4, 1, 0);
        // A completion before its admission: held, applied when the admission comes (which
        // is dropped as stale).
        assert_eq!(f.feed(1, next(), completed("c", 1)), Held);
        f.check(4, 1, 1);
        assert_eq!(
            f.feed(1, next(), admitted("c", 1)),
            Dropped(DropReason::Stale)
        );
        f.check(5, 2, 0);
        assert!(f.router.manager().lease(&"c".into()).is_none());
        // Held progress of a request that completes before its admission: stale.
        assert_eq!(f.feed(1, next(), progressed("d", 1)), Held);
        assert_eq!(f.feed(1, next(), completed("d", 1)), Held);
        f.check(5, 3, 1);
        // A worker reset drops what is held for the worker.
        assert_eq!(f.feed(1, next(), progressed("e", 1)), Held);
        f.check(5, 3, 2);
        let reset = WorkerReset {
            worker_id: 1,
            dp_rank: None,
            leaving: false,
        };
        assert_eq!(f.feed(1, next(), reset), APPLIED);
        f.check(6, 5, 0);
        // What waits in vain for its admission expires as unmatched.
        assert_eq!(f.feed(1, next(), progressed("f", 2)), Held);
        assert_eq!(f.feed(1, next(), completed("g", 2)), Held);
        f.check(6, 5, 2);
        tokio::time::sleep(HOLD + Duration::from_millis(50)).await;
        assert_eq!(f.feed(1, next(), admitted("h", 2)), APPLIED);
        f.check(7, 7, 0);
        assert_eq!(f.stats.snapshot().dropped(DropReason::Unmatched), 2);
        // Bad bytes, a forged identity, a subject outside the layout.
        let subject = f.subjects.worker_subject(3);
        assert_eq!(f.bytes(&subject, b"\xc1"), Dropped(DropReason::Decode));
        let forged = Envelope::new(1, next(), 0, admitted("x", 4));
        let forged = wire::encode(&forged).unwrap();
        assert_eq!(f.bytes(&subject, &forged), Dropped(DropReason::Identity));
        assert_eq!(f.bytes("elsewhere", &forged), Dropped(DropReason::Subject));
        f.check(7, 10, 0);
        // What is still held when the router goes is late.
        assert_eq!(f.feed(1, next(), progressed("i", 3)), Held);
        f.check(7, 10, 1);
        drop(f.applier.take());
        f.check(7, 11, 0);
        assert_eq!(f.stats.snapshot().dropped(DropReason::Late), 1);
        assert_eq!(f.stats.snapshot().gaps, 0, "nothing was skipped");
        f.router.shutdown().await.unwrap();
    }

    /// On the stream's clock a hold lasts as long in stream time, however fast or late the
    /// replica reads: a backlog read after a pause longer than the hold finds what it held
    /// (the wall clock would have expired it), and a gap in stream time longer than the
    /// hold expires it at once (the wall clock of a fast replay would have kept it).
    #[tokio::test(start_paused = true)]
    async fn on_the_stream_clock_holds_last_in_stream_time() {
        use Applied::{Dropped, Held};
        let mut f = Fixture::new().await;
        let stream_us = 1_700_000_000_000_000;
        let hold_us = u64::try_from(HOLD.as_micros()).unwrap();
        let applier = f.applier.as_mut().unwrap();
        applier.set_stream_time(stream_us);
        assert_eq!(f.feed(1, 1, progressed("paused", 1)), Held);
        assert_eq!(f.feed(1, 2, completed("ended", 1)), Held);
        tokio::time::advance(HOLD * 50).await;
        let applier = f.applier.as_mut().unwrap();
        applier.set_stream_time(stream_us + hold_us / 2);
        assert_eq!(f.feed(1, 3, admitted("paused", 1)), Applied::Applied);
        assert_eq!(
            f.feed(1, 4, admitted("ended", 1)),
            Dropped(DropReason::Stale),
            "the tombstone outlived the pause"
        );
        f.check(3, 1, 0);
        let loads = f.router.manager().live_loads();
        assert_eq!(loads.len(), 1);
        assert_eq!(
            (loads[0].1.prefill_tokens, loads[0].1.kv_tokens),
            (0, 11),
            "the held progress was applied: prefill done, one output token"
        );

        assert_eq!(f.feed(1, 5, progressed("late", 1)), Held);
        let applier = f.applier.as_mut().unwrap();
        applier.set_stream_time(stream_us + hold_us / 2 + hold_us);
        applier.set_stream_time(stream_us);
        assert_eq!(f.feed(1, 6, admitted("late", 1)), Applied::Applied);
        f.check(4, 2, 0);
        assert_eq!(
            f.stats.snapshot().dropped(DropReason::Unmatched),
            1,
            "expired by the stream's clock, which an older time does not turn back"
        );
        f.router.shutdown().await.unwrap();
    }

    /// What is held expires at a flush too, with no event to apply: a tombstone alone, or
    /// held progress alone, leaves the held gauge on time.
    #[tokio::test(start_paused = true)]
    async fn a_flush_expires_what_either_map_holds() {
        for early in [
            completed("c", 1).into(),
            LeaseEvent::from(progressed("p", 1)),
        ] {
            let mut f = Fixture::new().await;
            assert_eq!(f.feed(1, 1, early), Applied::Held);
            f.check(0, 0, 1);
            tokio::time::advance(HOLD).await;
            let applier = f.applier.as_mut().unwrap();
            applier.begin_batch();
            applier.end_batch();
            f.check(0, 1, 0);
            assert_eq!(f.stats.snapshot().dropped(DropReason::Unmatched), 1);
            f.router.shutdown().await.unwrap();
        }
    }

    /// A snapshot's image of the holds carries the stream's clock: a replica that restores
    /// it counts the time left from the writer's clock at the cut, not from its own.
    #[tokio::test(start_paused = true)]
    async fn a_restored_image_counts_the_time_left_on_the_writers_stream_clock() {
        let stream_us = 1_700_000_000_000_000;
        let hold_us = u64::try_from(HOLD.as_micros()).unwrap();
        let mut writer = Fixture::new().await;
        writer.applier.as_mut().unwrap().set_stream_time(stream_us);
        assert_eq!(writer.feed(1, 1, completed("ended", 1)), Applied::Held);
        let mut p = progressed("early", 1);
        p.output_tokens = 4;
        assert_eq!(writer.feed(1, 2, p), Applied::Held);
        let image = writer.applier.as_ref().unwrap().reorder_image();

        for (later_us, held) in [(hold_us * 9 / 10, true), (hold_us * 11 / 10, false)] {
            let mut late = Fixture::new().await;
            tokio::time::advance(HOLD * 3).await;
            let applier = late.applier.as_mut().unwrap();
            applier.restore_reorder(image.clone());
            applier.set_stream_time(stream_us + later_us);
            let revived = late.feed(1, 3, admitted("ended", 1));
            assert_eq!(late.feed(1, 4, admitted("early", 1)), Applied::Applied);
            let loads = late.router.manager().live_loads();
            if held {
                assert_eq!(revived, Applied::Dropped(DropReason::Stale), "still held");
                assert_eq!(loads.len(), 1);
                assert_eq!(loads[0].1.kv_tokens, 14, "the held output count applied");
                late.check(1, 1, 0);
            } else {
                assert_eq!(revived, Applied::Applied, "expired by the writer's clock");
                assert_eq!(loads[0].1.kv_tokens, 20, "two leases, no progress applied");
                late.check(2, 0, 0);
            }
            late.router.shutdown().await.unwrap();
        }
        writer.router.shutdown().await.unwrap();
    }

    /// A completion that overtakes its admission is no gap; numbers that never come are, once
    /// they leave the window.
    #[tokio::test]
    async fn only_numbers_that_never_arrive_are_gaps() {
        let mut f = Fixture::new().await;
        f.feed(1, 1, admitted("a", 1));
        f.feed(1, 3, completed("b", 1));
        f.feed(1, 2, admitted("b", 1));
        f.feed(1, 5, progressed("a", 1));
        f.feed(1, 4, progressed("a", 1));
        assert_eq!(f.stats.snapshot().gaps, 0);
        // 6..=8 are lost; counted once 4,096 later numbers have been seen.
        let applier = f.applier.as_mut().unwrap();
        applier.begin_batch();
        for seq in 9..9 + 4096 {
            let envelope = Envelope::new(1, seq, 0, progressed("a", 1));
            let subject = f.subjects.worker_subject(1);
            applier
                .apply(&subject, &wire::encode(&envelope).unwrap())
                .unwrap();
            f.received += 1;
        }
        applier.end_batch();
        let s = f.stats.snapshot();
        assert_eq!(s.gaps, 3, "{s:?}");
        assert_eq!(s.accounted(), s.received);
        f.router.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn first_sight_of_publishers_is_no_restart_and_a_new_publisher_for_a_worker_is() {
        let mut f = Fixture::new().await;
        for worker in 0..10 {
            f.feed(100 + worker, 1, admitted(&format!("r{worker}"), worker));
            f.feed(100 + worker, 2, progressed(&format!("r{worker}"), worker));
        }
        assert_eq!(f.stats.snapshot().publisher_restarts, 0);
        // Worker 4's process restarts: a new publisher id, from 1 again.
        let reset = WorkerReset {
            worker_id: 4,
            dp_rank: None,
            leaving: false,
        };
        f.feed(999, 1, reset);
        f.feed(999, 2, admitted("again", 4));
        assert_eq!(f.stats.snapshot().publisher_restarts, 1);
        f.router.shutdown().await.unwrap();
    }
}

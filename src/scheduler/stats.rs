//! The scheduler's counters.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::ReleaseReason;
use crate::histogram::{Histogram, HistogramFigures, DECISION_BOUNDS_US};
use crate::routing::{RouteOutcome, RoutePolicy};

/// Counters of the scheduler, for dashboards and tests.
#[derive(Debug, Default)]
pub(crate) struct SchedulerStats {
    pub(super) wakeups: AtomicU64,
    pub(super) booked: AtomicU64,
    released_completed: AtomicU64,
    released_expired: AtomicU64,
    released_superseded: AtomicU64,
    released_reset: AtomicU64,
    released_unconfirmed: AtomicU64,
    pub(super) workers_left: AtomicU64,
    pub(super) workers_forgotten: AtomicU64,
    pub(super) admission_waited: AtomicU64,
    admission_abandoned: AtomicU64,
    /// Route decisions by policy and outcome.
    decisions: [[AtomicU64; RouteOutcome::ALL.len()]; RoutePolicy::ALL.len()],
    decision_time: DecisionTimes,
}

/// The time the actor takes per route decision (a `Default` for [`SchedulerStats`]).
#[derive(Debug)]
struct DecisionTimes(Histogram);

impl Default for DecisionTimes {
    fn default() -> Self {
        Self(Histogram::new(&DECISION_BOUNDS_US))
    }
}

/// A point-in-time copy of the scheduler's counters.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct SchedulerFigures {
    /// Times the actor woke to apply queued bookings and releases.
    pub wakeups: u64,
    /// Bookings applied, provisional ones (route decisions) and admissions alike.
    pub booked: u64,
    /// Bookings released because their request completed.
    pub released_completed: u64,
    /// Bookings released because their lease expired.
    pub released_expired: u64,
    /// Bookings released because a new attempt of the request superseded them.
    pub released_superseded: u64,
    /// Bookings released because their worker reset.
    pub released_reset: u64,
    /// Provisional bookings released unconfirmed (deadline passed, or cancelled).
    pub released_unconfirmed: u64,
    /// Workers (ranks) that said they were leaving.
    pub workers_left: u64,
    /// Workers (ranks) forgotten after their idle time with no live booking.
    pub workers_forgotten: u64,
    /// Route requests that waited for admission (each once, whatever became of it).
    pub admission_waited: u64,
    /// Route requests that left the admission queue because their caller went away.
    pub admission_abandoned: u64,
    /// Route decisions, by [`RoutePolicy::ALL`] then [`RouteOutcome::ALL`] order.
    pub decisions: [[u64; RouteOutcome::ALL.len()]; RoutePolicy::ALL.len()],
}

impl SchedulerFigures {
    /// Route decisions of `policy` that ended as `outcome`.
    pub fn decisions(&self, policy: RoutePolicy, outcome: RouteOutcome) -> u64 {
        self.decisions[policy as usize][outcome as usize]
    }
}

impl SchedulerStats {
    pub(crate) fn snapshot(&self) -> SchedulerFigures {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SchedulerFigures {
            wakeups: get(&self.wakeups),
            booked: get(&self.booked),
            released_completed: get(&self.released_completed),
            released_expired: get(&self.released_expired),
            released_superseded: get(&self.released_superseded),
            released_reset: get(&self.released_reset),
            released_unconfirmed: get(&self.released_unconfirmed),
            workers_left: get(&self.workers_left),
            workers_forgotten: get(&self.workers_forgotten),
            admission_waited: get(&self.admission_waited),
            admission_abandoned: get(&self.admission_abandoned),
            decisions: self.decisions.each_ref().map(|row| row.each_ref().map(get)),
        }
    }

    /// Counts one route decision.
    pub(crate) fn count_decision(&self, policy: RoutePolicy, outcome: RouteOutcome) {
        self.decisions[policy as usize][outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// One route decision took `took`, from the actor taking the request to its answer (or
    /// to its place in the admission queue).
    pub(super) fn decision_took(&self, took: std::time::Duration) {
        self.decision_time.0.observe(took);
    }

    pub(super) fn decision_times(&self) -> HistogramFigures {
        self.decision_time.0.snapshot()
    }

    pub(super) fn count_abandoned(&self) {
        self.admission_abandoned.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn count_release(&self, reason: ReleaseReason) {
        let counter = match reason {
            ReleaseReason::Completed => &self.released_completed,
            ReleaseReason::Expired => &self.released_expired,
            ReleaseReason::Superseded => &self.released_superseded,
            ReleaseReason::WorkerReset => &self.released_reset,
            ReleaseReason::Unconfirmed => &self.released_unconfirmed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

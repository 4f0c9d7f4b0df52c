//! How lifecycle events reach a deployment's lease manager, without keeping it alive.
//!
//! The scheduler and the ingress hold the observer that
//! [`RequestLeaseManager::replica_observer`](crate::RequestLeaseManager::replica_observer)
//! returns: each callback upgrades a `Weak` of the manager and forwards, or reports
//! [`DeliverEventError::ManagerGone`] once the router has been torn down, so a late event is
//! dropped and counted instead of reviving anything. This module holds only the contract (the
//! trait and its outcomes); the weak implementation lives with the manager it points at.

use crate::load::RequestLoad;
use crate::types::{DpRank, SchedulerBookingDescriptor, WorkerId};

/// The event could not be delivered.
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
pub enum DeliverEventError {
    /// The router of this deployment has been torn down: a late event.
    #[error("the request-lease manager is gone (its router was torn down)")]
    ManagerGone,
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
    /// `max_active_leases` live leases already: refused, nothing stored.
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

/// The lifecycle callbacks of request leases, as seen from another replica or a worker.
pub trait ReplicaRequestLeaseObserver: Send + Sync {
    /// A worker admitted `booking`; forwards to `register_remote`.
    fn admitted(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
    ) -> Result<AdmitOutcome, DeliverEventError>;

    /// `booking` is alive and moving; forwards to `touch_booking`.
    fn progressed(
        &self,
        booking: &SchedulerBookingDescriptor,
    ) -> Result<ProgressOutcome, DeliverEventError>;

    /// `booking` ended; forwards to `complete_remote`.
    fn completed(
        &self,
        booking: &SchedulerBookingDescriptor,
    ) -> Result<CompleteOutcome, DeliverEventError>;

    /// A route decision of this replica booked `booking` before its worker's `admitted`;
    /// forwards to `book_provisional`. The default treats it as an admission.
    fn routed(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        self.admitted(booking, load)
    }

    /// [`Self::routed`] for a request of admission class `class` (see
    /// [`AdmissionConfig`](crate::AdmissionConfig)); forwards to
    /// `book_provisional_in_class`. The default ignores the class.
    fn routed_in_class(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
        class: Option<&str>,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        let _ = class;
        self.routed(booking, load)
    }

    /// A worker restarted or left (all its ranks when `dp_rank` is `None`); forwards to
    /// `reset_worker`. Returns the leases dropped.
    fn worker_reset(
        &self,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
    ) -> Result<usize, DeliverEventError>;
}

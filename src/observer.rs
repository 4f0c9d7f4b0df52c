//! How lifecycle events reach a deployment's lease manager, without keeping it alive.
//!
//! The scheduler and the ingress hold an `Arc<dyn ReplicaRequestLeaseObserver>`. The one
//! [`RequestLeaseManager::replica_observer`] returns is a [`WeakRequestLeaseObserver`]: each
//! callback upgrades a `Weak` of the manager and forwards, or reports
//! [`DeliverEventError::ManagerGone`] once the router has been torn down, so a late event is
//! dropped and counted instead of reviving anything.
//!
//! For a burst of messages the ingress asks for one [`LeaseBatch`] instead
//! ([`ReplicaRequestLeaseObserver::lease_batch`]): one upgrade for up to a few hundred events
//! applied back to back, without an `.await` in between, and the manager is let go again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Weak;

use crate::lease::manager::RequestLeaseManagerInner;
use crate::lease::{
    AdmitOutcome, CompleteOutcome, LeaseBatch, ProgressOutcome, RequestLeaseManager,
};
use crate::types::{
    DpRank, RequestId, RequestLoad, SchedulerBookingDescriptor, WorkerId, WorkerWithDpRank,
};

/// The event could not be delivered.
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
pub enum DeliverEventError {
    /// The router of this deployment has been torn down: a late event.
    #[error("the request-lease manager is gone (its router was torn down)")]
    ManagerGone,
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

    /// A worker restarted or left; forwards to `reset_worker`. Returns the leases dropped.
    fn worker_reset(
        &self,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
    ) -> Result<usize, DeliverEventError>;

    /// The live booking of `request_id` on `worker`: wire events carry no attempt id.
    fn current_booking(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<SchedulerBookingDescriptor>, DeliverEventError>;

    /// `admitted` as a wire event gives it (no attempt id): a live lease of `request_id` on
    /// `worker` is renewed, anything else becomes a new attempt. The default resolves the
    /// booking, then admits it.
    fn admitted_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        let booking = match self.current_booking(request_id, worker)? {
            Some(live) => live,
            None => SchedulerBookingDescriptor::new(RequestId::from(request_id), worker),
        };
        self.admitted(booking, load)
    }

    /// `progressed` for the live lease of `request_id` on `worker`, in one lookup; `None`
    /// when there is none. The default resolves the booking, then renews it.
    fn progressed_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<ProgressOutcome>, DeliverEventError> {
        match self.current_booking(request_id, worker)? {
            Some(booking) => self.progressed(&booking).map(Some),
            None => Ok(None),
        }
    }

    /// `completed` for the live lease of `request_id` on `worker`, in one lookup; `None`
    /// when there is none.
    fn completed_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<CompleteOutcome>, DeliverEventError> {
        match self.current_booking(request_id, worker)? {
            Some(booking) => self.completed(&booking).map(Some),
            None => Ok(None),
        }
    }

    /// Callbacks this observer dropped because the manager was gone.
    fn dropped_late(&self) -> u64 {
        0
    }

    /// A [`LeaseBatch`] on the live manager, for a burst of `*_current` events applied in
    /// one go; `None` (the default, and once the manager is gone) means one call per event,
    /// which is also how a gone manager is reported and counted.
    fn lease_batch(&self) -> Option<LeaseBatch> {
        None
    }
}

/// The observer that holds only a `Weak` of the manager's state.
pub(crate) struct WeakRequestLeaseObserver {
    manager: Weak<RequestLeaseManagerInner>,
    dropped_late: AtomicU64,
}

impl WeakRequestLeaseObserver {
    pub(crate) fn new(manager: Weak<RequestLeaseManagerInner>) -> Self {
        Self {
            manager,
            dropped_late: AtomicU64::new(0),
        }
    }

    fn with_manager<T>(
        &self,
        f: impl FnOnce(&RequestLeaseManager) -> T,
    ) -> Result<T, DeliverEventError> {
        match self.manager.upgrade() {
            Some(inner) => Ok(f(&RequestLeaseManager::from_inner(inner))),
            None => {
                self.dropped_late.fetch_add(1, Ordering::Relaxed);
                Err(DeliverEventError::ManagerGone)
            }
        }
    }
}

impl ReplicaRequestLeaseObserver for WeakRequestLeaseObserver {
    fn admitted(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        self.with_manager(|m| m.register_remote(booking, load))
    }

    fn progressed(
        &self,
        booking: &SchedulerBookingDescriptor,
    ) -> Result<ProgressOutcome, DeliverEventError> {
        self.with_manager(|m| m.touch_booking(booking))
    }

    fn completed(
        &self,
        booking: &SchedulerBookingDescriptor,
    ) -> Result<CompleteOutcome, DeliverEventError> {
        self.with_manager(|m| m.complete_remote(booking))
    }

    fn worker_reset(
        &self,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
    ) -> Result<usize, DeliverEventError> {
        self.with_manager(|m| m.reset_worker(worker_id, dp_rank))
    }

    fn current_booking(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<SchedulerBookingDescriptor>, DeliverEventError> {
        self.with_manager(|m| m.current_booking(request_id, worker))
    }

    fn admitted_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
        load: RequestLoad,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        self.with_manager(|m| m.admit_current(request_id, worker, load))
    }

    fn progressed_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<ProgressOutcome>, DeliverEventError> {
        self.with_manager(|m| m.touch_current(request_id, worker))
    }

    fn completed_current(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<CompleteOutcome>, DeliverEventError> {
        self.with_manager(|m| m.complete_current(request_id, worker))
    }

    fn dropped_late(&self) -> u64 {
        self.dropped_late.load(Ordering::Relaxed)
    }

    fn lease_batch(&self) -> Option<LeaseBatch> {
        self.manager
            .upgrade()
            .map(|inner| RequestLeaseManager::from_inner(inner).batch())
    }
}

/// An observer that owns the manager, as the reference router did before the weak one:
/// kept only so tests can show that it leaks.
#[cfg(test)]
pub(crate) struct StrongRequestLeaseObserver(pub(crate) RequestLeaseManager);

#[cfg(test)]
impl ReplicaRequestLeaseObserver for StrongRequestLeaseObserver {
    fn admitted(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        Ok(self.0.register_remote(booking, load))
    }

    fn progressed(
        &self,
        booking: &SchedulerBookingDescriptor,
    ) -> Result<ProgressOutcome, DeliverEventError> {
        Ok(self.0.touch_booking(booking))
    }

    fn completed(
        &self,
        booking: &SchedulerBookingDescriptor,
    ) -> Result<CompleteOutcome, DeliverEventError> {
        Ok(self.0.complete_remote(booking))
    }

    fn worker_reset(
        &self,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
    ) -> Result<usize, DeliverEventError> {
        Ok(self.0.reset_worker(worker_id, dp_rank))
    }

    fn current_booking(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
    ) -> Result<Option<SchedulerBookingDescriptor>, DeliverEventError> {
        Ok(self.0.current_booking(request_id, worker))
    }
}

//! The observer that holds only a `Weak` of the manager: what breaks the router's ownership
//! cycle (the manager holds the scheduler's cleanup handle, the scheduler actor holds the
//! observer). Each callback upgrades and forwards, or reports the manager gone.

use std::sync::Arc;

use super::manager::{RequestLeaseManager, WeakRequestLeaseManager};
use crate::load::RequestLoad;
use crate::observer::{
    AdmitOutcome, CompleteOutcome, DeliverEventError, ProgressOutcome, ReplicaRequestLeaseObserver,
};
use crate::types::{DpRank, SchedulerBookingDescriptor, WorkerId};

struct WeakRequestLeaseObserver(WeakRequestLeaseManager);

impl WeakRequestLeaseObserver {
    fn with_manager<T>(
        &self,
        f: impl FnOnce(&RequestLeaseManager) -> T,
    ) -> Result<T, DeliverEventError> {
        self.0
            .upgrade()
            .map(|manager| f(&manager))
            .ok_or(DeliverEventError::ManagerGone)
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

    fn routed(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        self.with_manager(|m| m.book_provisional(booking, load))
    }

    fn routed_in_class(
        &self,
        booking: SchedulerBookingDescriptor,
        load: RequestLoad,
        class: Option<&str>,
    ) -> Result<AdmitOutcome, DeliverEventError> {
        self.with_manager(|m| m.book_provisional_in_class(booking, load, class))
    }

    fn worker_reset(
        &self,
        worker_id: WorkerId,
        dp_rank: Option<DpRank>,
    ) -> Result<usize, DeliverEventError> {
        self.with_manager(|m| m.reset_worker(worker_id, dp_rank))
    }
}

impl RequestLeaseManager {
    /// The observer to hand to the scheduler and to whoever feeds events: it holds only a
    /// `Weak` of this manager, so it never keeps the manager (and through it the scheduler)
    /// alive.
    pub fn replica_observer(&self) -> Arc<dyn ReplicaRequestLeaseObserver> {
        Arc::new(WeakRequestLeaseObserver(self.downgrade()))
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
}

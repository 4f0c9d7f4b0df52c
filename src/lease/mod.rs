//! Request leases: the liveness record of every booking a router mirrors.
//!
//! [`clock`] is the per-lease second-chance clock; [`manager`] owns the leases, applies
//! lifecycle events to them and runs the reaper that expires the ones nobody renews.

pub mod clock;
pub mod manager;

pub use clock::{LeaseClock, LeaseState, ReapOutcome, TouchOutcome};
pub use manager::{
    AdmitOutcome, CompleteOutcome, LeaseBatch, LeaseConfig, LeaseRecord, LeaseStats,
    ProgressOutcome, RequestLeaseManager, SetSchedulerError, WeakRequestLeaseManager,
};

//! Request leases: the liveness record of every booking a router mirrors.
//!
//! [`clock`] is the per-lease second-chance clock; [`manager`] owns the leases, applies
//! lifecycle events to them and runs the reaper that expires the ones nobody renews; `key`
//! is how its tables keep request ids (inline up to [`INLINE_KEY_BYTES`] bytes).

pub mod clock;
mod key;
pub mod manager;

pub use clock::{LeaseClock, LeaseState, ReapOutcome, TouchOutcome};
pub use key::INLINE_KEY_BYTES;
pub use manager::{
    AdmitOutcome, CompleteOutcome, LeaseBatch, LeaseConfig, LeaseRecord, LeaseStats,
    ProgressOutcome, RequestLeaseManager, SetSchedulerError, WeakRequestLeaseManager,
};

//! Request leases: the liveness record of every booking a router mirrors.
//!
//! [`clock`] is the per-lease second-chance clock; [`manager`] owns the leases and applies
//! lifecycle events to them; [`reaper`] scans for the ones nobody renews (on the task that
//! applies ingest, when a router gives it one); `key` is how the tables keep request ids
//! (inline up to [`INLINE_KEY_BYTES`] bytes).

pub mod clock;
mod key;
pub mod manager;
pub mod reaper;

pub use clock::{LeaseClock, LeaseState, ReapOutcome, TouchOutcome};
pub use key::INLINE_KEY_BYTES;
pub use manager::{
    AdmitOutcome, CompleteOutcome, LeaseBatch, LeaseConfig, LeaseRecord, LeaseStats,
    ProgressOutcome, RequestLeaseManager, SetSchedulerError, WeakRequestLeaseManager,
};
pub use reaper::{ScanLane, ScanReport, ScanStep, StepTime};

//! Request leases: the liveness record of every booking a router mirrors.
//!
//! [`clock`] is the per-lease second-chance clock; [`manager`] owns the leases and applies
//! lifecycle events to them; [`reaper`] is the scan cursor that expires the ones nobody
//! renews (run by the task that applies ingest, when a router has one); `weak_observer` is
//! the observer that reaches the manager without keeping it alive; `key` is how the tables
//! keep request ids (inline up to [`INLINE_KEY_BYTES`] bytes).

mod clock;
mod key;
mod manager;
mod reaper;
mod weak_observer;
mod weight;

pub use clock::LeaseState;
pub use key::INLINE_KEY_BYTES;
pub(crate) use manager::LeaseImage;
pub use manager::{
    LeaseBatch, LeaseConfig, LeaseRecord, LeaseStats, RequestLeaseManager, StepTime,
    WeakRequestLeaseManager, DEFAULT_MAX_ACTIVE_LEASES, DEFAULT_PROVISIONAL_DEADLINE,
    DEFAULT_SCAN_INTERVAL,
};
pub use reaper::{Reaper, ScanReport};
#[cfg(test)]
pub(crate) use weak_observer::StrongRequestLeaseObserver;

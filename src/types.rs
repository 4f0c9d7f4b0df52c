//! Identities shared by every part of a router: who a request is, where it runs, which attempt.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A request's id as the serving stack names it.
///
/// Backed by `Arc<str>` so the lease manager and the scheduler share one allocation per
/// booking instead of each holding its own copy.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(Arc<str>);

impl RequestId {
    /// A request id of this string.
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Self(id.into())
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Lets maps keyed by `RequestId` be searched with a borrowed `&str` (same hash, same
/// equality), so looking up a wire event's request allocates nothing.
impl std::borrow::Borrow<str> for RequestId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for RequestId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<&str> for RequestId {
    fn from(s: &str) -> Self {
        Self(Arc::from(s))
    }
}

impl From<String> for RequestId {
    fn from(s: String) -> Self {
        Self(Arc::from(s))
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestId({:?})", &*self.0)
    }
}

/// A worker process of a deployment.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct WorkerId(pub u64);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A data-parallel rank inside one worker.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct DpRank(pub u32);

impl fmt::Display for DpRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The unit the scheduler balances over: one data-parallel rank of one worker.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default, Serialize, Deserialize,
)]
pub struct WorkerWithDpRank {
    /// The worker.
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
}

impl WorkerWithDpRank {
    /// Rank `dp_rank` of worker `worker_id`.
    pub fn new(worker_id: u64, dp_rank: u32) -> Self {
        Self {
            worker_id: WorkerId(worker_id),
            dp_rank: DpRank(dp_rank),
        }
    }
}

impl fmt::Display for WorkerWithDpRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// Fences a reused request id: minted locally for every booking and never sent on the wire,
/// so a late cleanup of an old attempt can never free a newer one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct AttemptId(u64);

impl AttemptId {
    /// A process-wide unique attempt id.
    pub fn mint() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The number.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// One attempt of one request counted against one worker.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct SchedulerBookingDescriptor {
    /// The request.
    pub request_id: RequestId,
    /// The worker (rank) it is counted against.
    pub worker: WorkerWithDpRank,
    /// The attempt: tells this booking from older or newer ones of the same request id.
    pub attempt_id: AttemptId,
}

impl SchedulerBookingDescriptor {
    /// A booking for a new attempt of `request_id` on `worker`.
    pub fn new(request_id: RequestId, worker: WorkerWithDpRank) -> Self {
        Self {
            request_id,
            worker,
            attempt_id: AttemptId::mint(),
        }
    }
}

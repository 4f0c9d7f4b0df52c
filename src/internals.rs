//! Not part of the API: the wiring below [`crate::Router`] that the project's own benches
//! measure on its own. An embedder builds a [`crate::Router`], whose drop guard ends every
//! task this wiring starts; nothing here is covered by semver.

use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

pub use crate::lease::LeaseBatch;
use crate::lease::{LeaseConfig, RequestLeaseManager};
use crate::prefix::PrefixIndexConfig;
use crate::scheduler::{Scheduler, SchedulerHandle};
use crate::types::WorkerWithDpRank;

/// A lease manager and its scheduler actor, wired as a router wires them but with no ingress
/// and no reaper: the actor (on `tracker`) ends once the manager and the handle are dropped.
pub fn manager_and_scheduler(
    deployment: &str,
    config: LeaseConfig,
    tracker: &TaskTracker,
) -> (RequestLeaseManager, SchedulerHandle, JoinHandle<()>) {
    manager_and_scheduler_with_prefix(deployment, config, PrefixIndexConfig::default(), tracker)
}

/// As [`manager_and_scheduler`], with the prefix index's settings.
pub fn manager_and_scheduler_with_prefix(
    deployment: &str,
    config: LeaseConfig,
    prefix: PrefixIndexConfig,
    tracker: &TaskTracker,
) -> (RequestLeaseManager, SchedulerHandle, JoinHandle<()>) {
    let (scheduler, actor) = Scheduler::with_prefix(deployment, prefix);
    let manager = RequestLeaseManager::new(deployment, config, scheduler.cleanup());
    let task = actor.spawn(Some(manager.replica_observer()), tracker);
    (manager, scheduler, task)
}

/// Teaches the manager's prefix index that `worker` holds `hashes`, as an `admitted` with
/// them would.
pub fn learn_prefix(manager: &RequestLeaseManager, worker: WorkerWithDpRank, hashes: &[u64]) {
    manager.learn_prefix(worker, hashes);
}

//! Not part of the API: the wiring below [`crate::Router`] that the project's own benches
//! measure on its own. An embedder builds a [`crate::Router`], whose drop guard ends every
//! task this wiring starts; nothing here is covered by semver.

use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

pub use crate::lease::LeaseBatch;
use crate::lease::{LeaseConfig, RequestLeaseManager};
use crate::scheduler::{Scheduler, SchedulerHandle};

/// A lease manager and its scheduler actor, wired as a router wires them but with no ingress
/// and no reaper: the actor (on `tracker`) ends once the manager and the handle are dropped.
pub fn manager_and_scheduler(
    deployment: &str,
    config: LeaseConfig,
    tracker: &TaskTracker,
) -> (RequestLeaseManager, SchedulerHandle, JoinHandle<()>) {
    let (scheduler, actor) = Scheduler::new(deployment);
    let manager = RequestLeaseManager::new(deployment, config, scheduler.cleanup());
    let task = actor.spawn(Some(manager.replica_observer()), tracker);
    (manager, scheduler, task)
}

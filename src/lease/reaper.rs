//! The reaper: scans that expire the leases nobody renews, one shard per step.
//!
//! A step claims expired leases under its shard's read lock, and admissions and completions
//! of that shard wait for it. Run on a task of its own, a step whose thread the OS
//! deschedules would hold them up for as long as the thread is off the CPU (milliseconds on a
//! busy machine). So a router hands its steps to the task that applies its ingest, through a
//! [`ScanLane`]: that task runs a step between two bursts, ingest never waits on a lock a
//! scan holds, and a step costs ingest only its own length (well under a millisecond at a
//! million leases). An ingress serves the lane also while it waits on anything else (a
//! reconnect), so leases go on expiring through a NATS outage. Without a lane (a manager fed
//! by calls, or an ingress that does not serve one) the reaper runs its steps itself.

use std::convert::Infallible;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, Instrument};

use super::manager::{RequestLeaseManager, RequestLeaseManagerInner};

/// The reaper's pause between two shards.
const SCAN_STEP_PAUSE: Duration = Duration::from_millis(1);

/// What one full scan did.
#[derive(Clone, Debug, Default)]
pub struct ScanReport {
    /// Leases the scan expired.
    pub expired: usize,
    /// Each step (one shard) as it ran on the task that ran it.
    pub steps: Vec<StepTime>,
}

/// How long one scan step took.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepTime {
    /// Wall time: what the step held its task (and, for the claims, its shard) up, including
    /// any time the OS kept the thread off the CPU meanwhile.
    pub wall: Duration,
    /// The thread's CPU time: the step's own cost.
    pub cpu: Duration,
}

/// The receiving end of a manager's scan steps, served by the task that applies its ingest
/// (see the module documentation). Dropping it hands the steps back to the reaper.
pub struct ScanLane {
    steps: mpsc::Receiver<ScanStep>,
}

impl ScanLane {
    /// The next step to run; `None` once the manager is gone.
    pub async fn next(&mut self) -> Option<ScanStep> {
        self.steps.recv().await
    }

    /// Runs each step as it arrives, and waits forever once the manager is gone: a branch
    /// for a `select!` beside the caller's own work (which wins whenever it is ready).
    pub async fn serve(&mut self) -> Infallible {
        while let Some(step) = self.next().await {
            step.run();
        }
        std::future::pending().await
    }
}

/// One shard's scan step, to be run by the receiver of a [`ScanLane`].
pub struct ScanStep {
    manager: Arc<RequestLeaseManagerInner>,
    shard: usize,
    done: oneshot::Sender<(usize, StepTime)>,
}

impl ScanStep {
    /// Runs the step now, on the calling task.
    pub fn run(self) {
        let outcome = timed_step(&self.manager, self.shard);
        // The scan may have been cancelled meanwhile: nobody waits for the outcome then.
        let _ = self.done.send(outcome);
    }
}

/// Where a manager's steps go: the sending end of its lane, if one was opened.
#[derive(Default)]
pub(super) struct StepRoute(Mutex<Option<mpsc::Sender<ScanStep>>>);

fn timed_step(manager: &Arc<RequestLeaseManagerInner>, shard: usize) -> (usize, StepTime) {
    let (start, cpu_start) = (Instant::now(), thread_cpu_time());
    let expired = RequestLeaseManager::from_inner(manager.clone()).scan_shard(shard);
    // CPU time read inside the wall-time interval, so it never exceeds it.
    let cpu = thread_cpu_time().saturating_sub(cpu_start);
    let wall = start.elapsed();
    (expired, StepTime { wall, cpu })
}

/// The calling thread's CPU time so far (zero if the clock cannot be read).
fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec that outlives the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

/// Runs one step through the manager's lane if a task serves it, else here.
async fn step(manager: Arc<RequestLeaseManagerInner>, shard: usize) -> (usize, StepTime) {
    let lane = manager.step_route().0.lock().clone();
    if let Some(lane) = lane {
        let (done, outcome) = oneshot::channel();
        let request = ScanStep {
            manager: manager.clone(),
            shard,
            done,
        };
        if lane.send(request).await.is_ok() {
            if let Ok(outcome) = outcome.await {
                return outcome;
            }
        }
        // The serving task has ended (its router is stopping): run the steps here, unless a
        // new lane has been opened meanwhile.
        let mut route = manager.step_route().0.lock();
        if route.as_ref().is_some_and(|open| open.same_channel(&lane)) {
            *route = None;
        }
    }
    timed_step(&manager, shard)
}

impl RequestLeaseManager {
    /// Opens the lane that this manager's scan steps go through from now on (replacing any
    /// earlier one); the caller runs each step it receives, between its own units of work.
    pub fn scan_lane(&self) -> ScanLane {
        let (sender, steps) = mpsc::channel(1);
        *self.inner().step_route().0.lock() = Some(sender);
        ScanLane { steps }
    }

    /// Runs one full reaper scan now, pausing between shards as the reaper does so ingest
    /// keeps flowing.
    pub async fn scan(&self) -> ScanReport {
        let shards = self.inner().shard_count();
        let mut report = ScanReport {
            expired: 0,
            steps: Vec::with_capacity(shards),
        };
        for shard in 0..shards {
            let (expired, took) = step(self.inner().clone(), shard).await;
            report.expired += expired;
            report.steps.push(took);
            tokio::time::sleep(SCAN_STEP_PAUSE).await;
        }
        self.inner().count_scan();
        report
    }

    /// Starts the reaper on `tracker`. It holds only a `Weak` of the manager, and ends when
    /// `cancel` fires or the manager is gone.
    pub fn spawn_reaper(&self, cancel: CancellationToken, tracker: &TaskTracker) -> JoinHandle<()> {
        let weak = Arc::downgrade(self.inner());
        let interval = self.inner().scan_interval();
        let span = tracing::info_span!("reaper", deployment = %self.deployment());
        tracker.spawn(reaper(weak, interval, cancel).instrument(span))
    }
}

async fn reaper(
    weak: Weak<RequestLeaseManagerInner>,
    interval: Duration,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = ticker.tick() => {}
        }
        let shards = match weak.upgrade() {
            Some(inner) => inner.shard_count(),
            None => break,
        };
        // At most a quarter of the interval goes into pauses, so short intervals still scan
        // on time.
        let pause = SCAN_STEP_PAUSE.min(interval / (4 * shards.max(1) as u32));
        let mut expired = 0;
        for shard in 0..shards {
            // Upgrade per shard: a scan never keeps a torn-down manager alive for long.
            let Some(inner) = weak.upgrade() else {
                debug!("reaper stopped: the manager is gone");
                return;
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                (n, _) = step(inner, shard) => expired += n,
            }
            // A pause, not just a yield: on two cores a scan that runs flat out takes one
            // core from ingest for its whole length. Spread over the interval it costs
            // nothing (a 300 s interval, a ~0.3 s scan).
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        if let Some(inner) = weak.upgrade() {
            inner.count_scan();
        }
        if expired > 0 {
            debug!(expired, "reaper scan expired leases");
        }
    }
    debug!("reaper stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::LeaseConfig;
    use crate::scheduler::spawn_scheduler;
    use crate::types::{RequestLoad, WorkerWithDpRank};

    const BOUND: Duration = Duration::from_secs(30);

    fn wired_manager(tracker: &TaskTracker) -> RequestLeaseManager {
        let manager = RequestLeaseManager::new(
            "t",
            LeaseConfig {
                shards: 4,
                ..LeaseConfig::default()
            },
        );
        let (scheduler, _task) = spawn_scheduler("t", None, tracker);
        manager.set_scheduler(scheduler.cleanup()).unwrap();
        manager
    }

    #[tokio::test(start_paused = true)]
    async fn steps_run_on_the_task_that_serves_the_lane() {
        let tracker = TaskTracker::new();
        let manager = wired_manager(&tracker);
        let worker = WorkerWithDpRank::new(1, 0);
        manager.admit_current("r", worker, RequestLoad::new(1, Some(1)));
        let mut lane = manager.scan_lane();
        let scan = tokio::spawn({
            let manager = manager.clone();
            async move { (manager.scan().await, manager.scan().await) }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            !scan.is_finished(),
            "nobody served the lane, yet the scan ran"
        );
        let mut served = 0;
        while !scan.is_finished() {
            tokio::select! {
                Some(step) = lane.next() => {
                    step.run();
                    served += 1;
                }
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
        let (first, second) = scan.await.unwrap();
        assert_eq!(served, 8, "two scans of four shards");
        assert_eq!((first.steps.len(), second.steps.len()), (4, 4));
        let steps = first.steps.iter().chain(&second.steps);
        assert!(steps.clone().all(|s| s.cpu <= s.wall), "{first:?}");
        assert!(steps.map(|s| s.cpu).sum::<Duration>() > Duration::ZERO);
        // A second chance, then the expiry.
        assert_eq!((first.expired, second.expired), (0, 1));
        assert_eq!(manager.active_leases(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_lane_hands_the_steps_back() {
        let tracker = TaskTracker::new();
        let manager = wired_manager(&tracker);
        manager.admit_current("r", WorkerWithDpRank::new(1, 0), RequestLoad::new(1, None));
        drop(manager.scan_lane());
        let scans = async { (manager.scan().await, manager.scan().await) };
        let (first, second) = tokio::time::timeout(BOUND, scans).await.expect("bounded");
        assert_eq!((first.expired, second.expired), (0, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn reaper_and_lane_end_when_the_manager_is_gone() {
        let tracker = TaskTracker::new();
        let manager = wired_manager(&tracker);
        let mut lane = manager.scan_lane();
        let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let serving = tokio::spawn({
            let served = served.clone();
            async move {
                while let Some(step) = lane.next().await {
                    step.run();
                    served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        let cancel = CancellationToken::new();
        let reaper = manager.spawn_reaper(cancel.clone(), &tracker);
        // Interval 300 s: let a few scans run through the lane.
        tokio::time::sleep(Duration::from_secs(1000)).await;
        assert!(served.load(std::sync::atomic::Ordering::Relaxed) >= 4);
        drop(manager);
        // It notices at its next tick.
        tokio::time::timeout(Duration::from_secs(301), reaper)
            .await
            .expect("the reaper ends without its manager")
            .unwrap();
        tokio::time::timeout(BOUND, serving)
            .await
            .expect("the lane closes with its manager")
            .unwrap();
        assert!(!cancel.is_cancelled());
    }
}

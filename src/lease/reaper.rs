//! The reaper: scans that expire the leases nobody renews, one shard per step.
//!
//! A step claims expired leases under its shard's read lock, and admissions and completions
//! of that shard wait for it. Run on a task of its own, a step whose thread the OS
//! deschedules would hold them up for as long as the thread is off the CPU (milliseconds on a
//! busy machine). So a [`Reaper`] is a cursor, not a task: the router hands it to the task
//! that applies its ingest, which runs a step between two bursts ([`Reaper::tick`] in its
//! `select!`), so ingest never waits on a lock a scan holds and a step costs ingest only its
//! own length (well under a millisecond at a million leases). A router without such a task
//! runs the cursor on a task of its own ([`Reaper::run`]).
//!
//! The same cursor releases the provisional bookings of route decisions that their worker's
//! `admitted` did not take over within [`crate::LeaseConfig::provisional_deadline`]: it looks
//! twice per deadline, so such a booking lives one to one and a half deadlines.

use std::pin::Pin;
use std::sync::Weak;
use std::time::{Duration, Instant};

use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::manager::{RequestLeaseManager, RequestLeaseManagerInner, StepTime};

/// The reaper's pause between two shards.
const SCAN_STEP_PAUSE: Duration = Duration::from_millis(1);

/// Unconfirmed bookings are looked at no more often than this, whatever the deadline.
const MIN_UNCONFIRMED_CHECK: Duration = Duration::from_millis(10);

/// What one full scan did.
#[derive(Clone, Debug, Default)]
pub struct ScanReport {
    /// Leases the scan expired.
    pub expired: usize,
    /// Each step (one shard) as it ran.
    pub steps: Vec<StepTime>,
}

/// The scan cursor of one manager: which shard is next and when. Holds only a `Weak` of the
/// manager, so whoever runs it never keeps a torn-down router's leases alive.
#[must_use = "a reaper that nobody runs expires nothing"]
pub struct Reaper {
    manager: Weak<RequestLeaseManagerInner>,
    interval: Duration,
    pause: Duration,
    next_shard: usize,
    scan_started: tokio::time::Instant,
    expired: usize,
    /// When the next step is due; kept registered across `tick`s so serving the reaper in a
    /// loop costs no timer registration per iteration.
    due: Pin<Box<Sleep>>,
    /// Half the provisional deadline: how often unconfirmed bookings are looked at.
    unconfirmed_every: Duration,
    unconfirmed_due: Pin<Box<Sleep>>,
}

impl Reaper {
    pub(super) fn new(manager: &RequestLeaseManager) -> Self {
        let inner = manager.inner();
        let interval = inner.scan_interval();
        let shards = inner.shard_count().max(1) as u32;
        let now = tokio::time::Instant::now();
        let unconfirmed_every = (inner.provisional_deadline() / 2).max(MIN_UNCONFIRMED_CHECK);
        Self {
            manager: std::sync::Arc::downgrade(inner),
            interval,
            // At most a quarter of the interval goes into pauses, so short intervals still
            // scan on time.
            pause: SCAN_STEP_PAUSE.min(interval / (4 * shards)),
            next_shard: 0,
            scan_started: now,
            expired: 0,
            due: Box::pin(tokio::time::sleep_until(now + interval)),
            unconfirmed_every,
            unconfirmed_due: Box::pin(tokio::time::sleep_until(now + unconfirmed_every)),
        }
    }

    /// Waits until the next step is due and runs it on the calling task. Cancel-safe (a
    /// `select!` branch beside the caller's own work); never returns once the manager is
    /// gone.
    pub async fn tick(&mut self) {
        loop {
            tokio::select! {
                biased;
                () = self.due.as_mut() => break,
                () = self.unconfirmed_due.as_mut() => {
                    if self.release_unconfirmed().is_none() {
                        std::future::pending::<()>().await;
                    }
                }
            }
        }
        if self.step().is_none() {
            std::future::pending::<()>().await;
        }
    }

    /// Releases the provisional bookings past their deadline; `None` once the manager is
    /// gone.
    fn release_unconfirmed(&mut self) -> Option<usize> {
        let manager = RequestLeaseManager::from_inner(self.manager.upgrade()?);
        let now = tokio::time::Instant::now();
        self.unconfirmed_due
            .as_mut()
            .reset(now + self.unconfirmed_every);
        Some(manager.expire_unconfirmed(now))
    }

    /// Runs `work` to its end, running the steps that fall due meanwhile: so leases go on
    /// expiring while the serving task waits on something long (a reconnect).
    pub async fn beside<F: std::future::Future>(&mut self, work: F) -> F::Output {
        tokio::pin!(work);
        loop {
            tokio::select! {
                biased;
                out = &mut work => return out,
                () = self.tick() => {}
            }
        }
    }

    /// Runs the steps on this task until `cancel` fires or the manager is gone.
    pub async fn run(mut self, cancel: CancellationToken) {
        loop {
            let alive = tokio::select! {
                _ = cancel.cancelled() => break,
                _ = self.due.as_mut() => self.step().is_some(),
                _ = self.unconfirmed_due.as_mut() => self.release_unconfirmed().is_some(),
            };
            if !alive {
                break;
            }
        }
        debug!("reaper stopped");
    }

    /// Runs the next step now, whether due or not, and schedules the one after. `None` once
    /// the manager is gone.
    fn step(&mut self) -> Option<StepTime> {
        // Upgraded per step: a scan never keeps a torn-down manager alive for long.
        let manager = RequestLeaseManager::from_inner(self.manager.upgrade()?);
        if self.next_shard == 0 {
            self.scan_started = tokio::time::Instant::now();
        }
        let (expired, took) = timed_step(&manager, self.next_shard);
        self.expired += expired;
        self.next_shard += 1;
        let now = tokio::time::Instant::now();
        let next = if self.next_shard < manager.inner().shard_count() {
            // A pause, not just a yield: on two cores a scan that runs flat out takes one
            // core from ingest for its whole length. Spread over the interval it costs
            // nothing (a 300 s interval, a ~0.3 s scan).
            now + self.pause
        } else {
            manager.inner().count_scan();
            if self.expired > 0 {
                debug!(expired = self.expired, "reaper scan expired leases");
            }
            self.next_shard = 0;
            self.expired = 0;
            (self.scan_started + self.interval).max(now + self.pause)
        };
        self.due.as_mut().reset(next);
        Some(took)
    }
}

fn timed_step(manager: &RequestLeaseManager, shard: usize) -> (usize, StepTime) {
    let started_us = crate::wire::unix_micros_now();
    let (start, cpu_start) = (Instant::now(), thread_cpu_time());
    let expired = manager.scan_shard(shard);
    // CPU time read inside the wall-time interval, so it never exceeds it.
    let cpu = thread_cpu_time().saturating_sub(cpu_start);
    let took = StepTime {
        started_us,
        wall: start.elapsed(),
        cpu,
    };
    manager.inner().step_log().push(took);
    (expired, took)
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

impl RequestLeaseManager {
    /// The scan cursor of this manager, first due one scan interval from now. Run exactly one
    /// per manager: between the units of work of the task that applies events
    /// ([`Reaper::tick`]), or on a task of its own ([`Reaper::run`]).
    ///
    /// # Panics
    /// Outside a tokio runtime (the cursor holds a timer).
    pub fn reaper(&self) -> Reaper {
        Reaper::new(self)
    }

    /// Runs one full scan now on the calling task, pausing between shards as the reaper does
    /// so ingest keeps flowing.
    pub async fn scan(&self) -> ScanReport {
        let shards = self.inner().shard_count();
        let mut report = ScanReport {
            expired: 0,
            steps: Vec::with_capacity(shards),
        };
        for shard in 0..shards {
            let (expired, took) = timed_step(self, shard);
            report.expired += expired;
            report.steps.push(took);
            tokio::time::sleep(SCAN_STEP_PAUSE).await;
        }
        self.inner().count_scan();
        report
    }

    /// The timings of the reaper's most recent steps (up to a few thousand), oldest first,
    /// and forgets them: how long a scan step held up the task that ran it.
    pub fn take_scan_steps(&self) -> Vec<StepTime> {
        self.inner().step_log().take()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio_util::task::TaskTracker;

    use super::*;
    use crate::lease::LeaseConfig;
    use crate::load::RequestLoad;
    use crate::scheduler::Scheduler;
    use crate::types::WorkerWithDpRank;

    const INTERVAL: Duration = Duration::from_secs(300);

    fn manager(tracker: &TaskTracker) -> RequestLeaseManager {
        let (scheduler, actor) = Scheduler::new("t");
        let manager = RequestLeaseManager::new(
            "t",
            LeaseConfig {
                shards: 4,
                scan_interval: INTERVAL,
                ..LeaseConfig::default()
            },
            scheduler.cleanup(),
        );
        actor.spawn(None, tracker);
        manager
    }

    #[tokio::test(start_paused = true)]
    async fn ticks_run_one_step_each_and_a_scan_per_interval() {
        let tracker = TaskTracker::new();
        let manager = manager(&tracker);
        manager.admit_current(
            "r",
            WorkerWithDpRank::new(1, 0),
            RequestLoad::new(1, Some(1)),
        );
        let mut reaper = manager.reaper();
        let start = tokio::time::Instant::now();
        reaper.tick().await;
        assert_eq!(
            start.elapsed(),
            INTERVAL,
            "the first step waits one interval"
        );
        for _ in 0..3 {
            reaper.tick().await;
        }
        assert_eq!(
            manager.stats().scans,
            1,
            "four ticks, four shards, one scan"
        );
        assert_eq!(manager.active_leases(), 1, "a second chance first");
        assert_eq!(
            start.elapsed(),
            INTERVAL + 3 * SCAN_STEP_PAUSE,
            "the steps of a scan follow each other, a pause apart"
        );
        reaper.tick().await;
        assert_eq!(
            start.elapsed(),
            2 * INTERVAL,
            "the next scan starts an interval later"
        );
        for _ in 0..3 {
            reaper.tick().await;
        }
        assert_eq!((manager.stats().scans, manager.active_leases()), (2, 0));
        let steps = manager.take_scan_steps();
        assert_eq!(steps.len(), 8);
        assert!(steps.iter().all(|s| s.cpu <= s.wall), "{steps:?}");
        assert!(manager.take_scan_steps().is_empty(), "taken once");
    }

    #[tokio::test(start_paused = true)]
    async fn a_tick_in_a_select_loses_nothing_when_the_other_branch_wins() {
        let tracker = TaskTracker::new();
        let manager = manager(&tracker);
        let mut reaper = manager.reaper();
        let mut other = tokio::time::interval(Duration::from_millis(7));
        let mut ticks = 0;
        while manager.stats().scans < 3 {
            assert!(ticks <= 12, "three scans are twelve steps");
            tokio::select! {
                biased;
                _ = reaper.tick() => ticks += 1,
                _ = other.tick() => {}
            }
        }
        assert_eq!(ticks, 12, "three scans of four shards, each step once");
    }

    #[tokio::test(start_paused = true)]
    async fn the_reaper_ends_when_its_manager_is_gone_or_cancelled() {
        let tracker = TaskTracker::new();
        let manager = manager(&tracker);
        let running = tokio::spawn(manager.reaper().run(CancellationToken::new()));
        tokio::time::sleep(3 * INTERVAL).await;
        assert_eq!(manager.stats().scans, 2, "it ran while the manager lived");
        let weak = Arc::downgrade(manager.inner());
        drop(manager);
        assert!(
            weak.upgrade().is_none(),
            "the reaper holds no strong reference"
        );
        tokio::time::timeout(2 * INTERVAL, running)
            .await
            .expect("the reaper ends without its manager")
            .unwrap();

        let manager = self::manager(&tracker);
        let cancel = CancellationToken::new();
        let running = tokio::spawn(manager.reaper().run(cancel.clone()));
        cancel.cancel();
        tokio::time::timeout(Duration::from_secs(1), running)
            .await
            .expect("the reaper ends when cancelled")
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_tick_never_returns_once_the_manager_is_gone() {
        let tracker = TaskTracker::new();
        let manager = manager(&tracker);
        let mut reaper = manager.reaper();
        drop(manager);
        let ticked = tokio::time::timeout(10 * INTERVAL, reaper.tick()).await;
        assert!(ticked.is_err(), "a gone manager has no steps");
    }

    /// A scan whose steps outlast the interval starts the next one a pause after it ends,
    /// not at once.
    #[tokio::test(start_paused = true)]
    async fn a_scan_longer_than_the_interval_is_followed_by_a_pause() {
        let tracker = TaskTracker::new();
        let manager = manager(&tracker);
        let mut reaper = manager.reaper();
        for _ in 0..4 {
            assert!(reaper.step().is_some());
            // As if each step had run for half an interval.
            tokio::time::advance(INTERVAL / 2).await;
        }
        assert_eq!(manager.stats().scans, 1);
        let now = tokio::time::Instant::now() - INTERVAL / 2;
        assert_eq!(reaper.due.deadline(), now + reaper.pause);
        assert_eq!(reaper.pause, SCAN_STEP_PAUSE);
    }

    #[test]
    fn thread_cpu_time_counts_this_threads_work() {
        let start = thread_cpu_time();
        let wall = Instant::now();
        let mut spin = 0u64;
        while thread_cpu_time() <= start {
            spin = std::hint::black_box(spin.wrapping_add(1));
            assert!(
                wall.elapsed() < Duration::from_secs(5),
                "CPU time never moved"
            );
        }
    }
}

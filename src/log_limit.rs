//! Rate-limited warnings: a failure that repeats (a server down, a flood of bad events) is
//! logged at most once per interval, with the count of lines held back since.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Lets a log line through at most once per interval; counts the ones held back.
///
/// `check()` returns `Some(suppressed)` when a line may be logged now (`suppressed`: how many
/// were held back since the last one), `None` when it must be suppressed. Lock-free.
#[derive(Debug)]
pub(crate) struct LogRateLimiter {
    interval_nanos: u64,
    epoch: std::time::Instant,
    /// Nanoseconds since `epoch` from which the next line is allowed.
    next_allowed: AtomicU64,
    suppressed: AtomicU64,
}

impl LogRateLimiter {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            interval_nanos: u64::try_from(interval.as_nanos()).unwrap_or(u64::MAX),
            epoch: std::time::Instant::now(),
            next_allowed: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(suppressed since the last allowed line)` when a line may be logged now.
    pub(crate) fn check(&self) -> Option<u64> {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.check_at(now)
    }

    fn check_at(&self, now_nanos: u64) -> Option<u64> {
        let next = self.next_allowed.load(Ordering::Acquire);
        if now_nanos >= next
            && self
                .next_allowed
                .compare_exchange(
                    next,
                    now_nanos.saturating_add(self.interval_nanos).max(1),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            Some(self.suppressed.swap(0, Ordering::AcqRel))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }

    /// Held back since the last allowed line.
    #[cfg(test)]
    fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }
}

impl Default for LogRateLimiter {
    /// One line per 5 seconds.
    fn default() -> Self {
        Self::new(Duration::from_secs(5))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn rate_limiter_allows_once_per_interval_and_counts() {
        let l = LogRateLimiter::new(Duration::from_secs(1));
        let s = 1_000_000_000u64;
        assert_eq!(l.check_at(0), Some(0));
        assert_eq!(l.check_at(1), None);
        assert_eq!(l.check_at(s / 2), None);
        assert_eq!(l.suppressed(), 2);
        assert_eq!(l.check_at(s), Some(2));
        assert_eq!(l.check_at(s + 1), None);
        assert_eq!(l.check_at(3 * s), Some(1));
        assert_eq!(l.suppressed(), 0);
    }

    #[test]
    fn rate_limiter_zero_interval_allows_all() {
        let l = LogRateLimiter::new(Duration::ZERO);
        for _ in 0..10 {
            assert_eq!(l.check(), Some(0));
        }
    }

    #[test]
    fn rate_limiter_is_shared_across_threads() {
        let l = Arc::new(LogRateLimiter::new(Duration::from_secs(3600)));
        let allowed = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if l.check().is_some() {
                            allowed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(allowed.load(Ordering::Relaxed), 1);
        assert_eq!(l.suppressed(), 3999);
    }
}

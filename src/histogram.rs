//! Latency histograms over fixed bucket bounds, read as Prometheus wants them: the
//! publish-to-apply lag of ingest, the time a scheduler takes per route decision (lock-free,
//! [`Histogram`]) and a class's wait in the admission queue (plain counts the scheduler
//! keeps, read with [`figures`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// Upper bounds, in microseconds, of the publish-to-apply lag buckets: 100 µs to 30 s.
pub(crate) const LAG_BOUNDS_US: [u64; 14] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
    5_000_000, 30_000_000,
];

/// Upper bounds, in microseconds, of the route decision time buckets: 10 µs to 100 ms, with
/// 100 µs (the decision's goal at 1,000 workers, BENCHMARKS.md) one of them.
pub(crate) const DECISION_BOUNDS_US: [u64; 12] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000,
];

/// Upper bounds, in microseconds, of a class's queue wait buckets: from the queue's
/// resolution (it is looked at every 5 ms) to past the default longest wait.
pub(crate) const QUEUE_WAIT_BOUNDS_US: [u64; 11] = [
    5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000,
    10_000_000,
];

/// `d` in whole microseconds, rounded up: a time just over a bound is counted past it.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000)).unwrap_or(u64::MAX)
}

/// The figures of observations counted `per_bucket` (not cumulative, in the order of
/// `bounds_us`; a further +Inf count is ignored: it is `count` less the others).
pub(crate) fn figures(
    bounds_us: &[u64],
    per_bucket: impl IntoIterator<Item = u64>,
    sum_seconds: f64,
    count: u64,
) -> HistogramFigures {
    let mut cumulative = 0;
    let buckets = bounds_us
        .iter()
        .zip(per_bucket)
        .map(|(&bound, n)| {
            cumulative += n;
            (bound as f64 / 1e6, cumulative)
        })
        .collect();
    HistogramFigures {
        sum_seconds,
        count,
        buckets,
    }
}

/// The bucket of `us` among `bounds` (sorted): the first bound at or above it, or
/// `bounds.len()` (+Inf).
pub(crate) fn bucket(bounds: &[u64], us: u64) -> usize {
    bounds.partition_point(|&bound| bound < us)
}

/// Observations counted per bucket (not cumulative; the last one is +Inf), with their sum
/// and count.
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds_us: &'static [u64],
    buckets: Box<[AtomicU64]>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub(crate) fn new(bounds_us: &'static [u64]) -> Self {
        Self {
            bounds_us,
            buckets: (0..=bounds_us.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// One observation of `took`.
    pub(crate) fn observe(&self, took: Duration) {
        self.observe_us(micros(took));
    }

    /// One observation of `us` microseconds.
    pub(crate) fn observe_us(&self, us: u64) {
        self.buckets[bucket(self.bounds_us, us)].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Observations counted elsewhere: `per_bucket` (one count per bucket, +Inf last),
    /// their sum and count, each taken (left at zero).
    pub(crate) fn add(&self, per_bucket: &mut [u64], sum_us: &mut u64, count: &mut u64) {
        fn add(counter: &AtomicU64, n: &mut u64) {
            if *n > 0 {
                counter.fetch_add(std::mem::take(n), Ordering::Relaxed);
            }
        }
        for (counter, n) in self.buckets.iter().zip(per_bucket) {
            add(counter, n);
        }
        add(&self.sum_us, sum_us);
        add(&self.count, count);
    }

    pub(crate) fn snapshot(&self) -> HistogramFigures {
        figures(
            self.bounds_us,
            self.buckets.iter().map(|n| n.load(Ordering::Relaxed)),
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
            self.count.load(Ordering::Relaxed),
        )
    }
}

/// A copy of a histogram, buckets cumulative as Prometheus wants them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HistogramFigures {
    /// Sum of the observations, in seconds.
    pub sum_seconds: f64,
    /// Observations.
    pub count: u64,
    /// `(upper bound in seconds, cumulative count)`, without +Inf (that is `count`).
    pub buckets: Vec<(f64, u64)>,
}

impl HistogramFigures {
    /// What was observed between `earlier` (a copy of the same histogram) and this.
    pub fn since(&self, earlier: &HistogramFigures) -> HistogramFigures {
        HistogramFigures {
            sum_seconds: self.sum_seconds - earlier.sum_seconds,
            count: self.count.saturating_sub(earlier.count),
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(&(bound, now), &(_, then))| (bound, now.saturating_sub(then)))
                .collect(),
        }
    }

    /// The smallest bucket bound, in seconds, at or under which at least a fraction `q` of
    /// the observations fall; `None` when that is past the last bound (or nothing was
    /// observed).
    pub fn bound_of_quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let want = (q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64;
        self.buckets
            .iter()
            .find(|(_, cumulative)| *cumulative >= want)
            .map(|(bound, _)| *bound)
    }

    /// The observations at or under `seconds` (a bucket bound; otherwise the largest bound
    /// under it).
    pub fn count_within(&self, seconds: f64) -> u64 {
        self.buckets
            .iter()
            .take_while(|(bound, _)| *bound <= seconds)
            .last()
            .map_or(0, |(_, n)| *n)
    }

    /// The fraction of the observations at or under `seconds` (as [`count_within`]), 0 with
    /// none.
    ///
    /// [`count_within`]: Self::count_within
    pub fn share_within(&self, seconds: f64) -> f64 {
        self.count_within(seconds) as f64 / self.count.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_bounds_inclusive() {
        let h = Histogram::new(&LAG_BOUNDS_US);
        h.observe_us(50);
        h.observe_us(100);
        h.observe_us(700);
        h.observe_us(60_000_000);
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert_eq!(s.buckets.len(), LAG_BOUNDS_US.len());
        assert_eq!(s.buckets[0], (0.0001, 2), "100 µs is in the 100 µs bucket");
        assert_eq!(s.buckets[1], (0.00025, 2));
        assert_eq!(s.buckets[3], (0.001, 3));
        assert_eq!(s.buckets.last().unwrap().1, 3, "+Inf holds the 60 s one");
        assert!((s.sum_seconds - 60.00085).abs() < 1e-9);
    }

    #[test]
    fn a_time_just_over_a_bound_counts_past_it() {
        let h = Histogram::new(&DECISION_BOUNDS_US);
        h.observe(Duration::from_micros(100));
        h.observe(Duration::from_nanos(100_001));
        let s = h.snapshot();
        assert_eq!(
            s.buckets[3],
            (0.0001, 1),
            "100 µs at the bound, 100.001 µs past it"
        );
        assert_eq!(s.buckets[4], (0.00025, 2));
        assert_eq!(micros(Duration::MAX), u64::MAX);
    }

    #[test]
    fn counts_added_from_elsewhere_are_taken() {
        let h = Histogram::new(&DECISION_BOUNDS_US);
        let mut per_bucket = [0u64; DECISION_BOUNDS_US.len() + 1];
        per_bucket[bucket(&DECISION_BOUNDS_US, 30)] += 1;
        per_bucket[bucket(&DECISION_BOUNDS_US, 1_000_000)] += 1;
        let (mut sum, mut count) = (1_000_030, 2);
        h.add(&mut per_bucket, &mut sum, &mut count);
        assert_eq!((per_bucket, sum, count), ([0; 13], 0, 0), "taken");
        let s = h.snapshot();
        assert_eq!((s.count, s.buckets[2]), (2, (0.00005, 1)));
        assert_eq!(s.buckets.last().unwrap().1, 1, "the 1 s one is past 100 ms");
    }

    #[test]
    fn quantile_bounds_and_shares() {
        let h = Histogram::new(&DECISION_BOUNDS_US);
        assert_eq!(h.snapshot().bound_of_quantile(0.99), None);
        let before = h.snapshot();
        for _ in 0..98 {
            h.observe_us(20);
        }
        h.observe_us(90);
        h.observe_us(300);
        let s = h.snapshot().since(&before);
        assert!((s.sum_seconds - 0.00235).abs() < 1e-12, "{}", s.sum_seconds);
        assert_eq!(s.bound_of_quantile(0.98), Some(0.000025));
        assert_eq!(s.bound_of_quantile(0.99), Some(0.0001));
        assert_eq!(s.bound_of_quantile(1.0), Some(0.0005));
        assert!((s.share_within(0.0001) - 0.99).abs() < 1e-12);
        assert!(
            (s.share_within(0.00011) - 0.99).abs() < 1e-12,
            "the bound under it"
        );
        assert_eq!(s.share_within(0.000001), 0.0);
        assert_eq!((s.count_within(0.0001), s.count_within(0.000001)), (99, 0));
        let mid = h.snapshot();
        h.observe_us(200_000);
        let last = h.snapshot().since(&mid);
        assert_eq!(last.count, 1);
        assert!(
            (last.sum_seconds - 0.2).abs() < 1e-12,
            "only what came after"
        );
        let later = h.snapshot().since(&before);
        assert_eq!(later.bound_of_quantile(1.0), None, "past the last bound");
        assert_eq!((later.count, later.buckets[0].1), (101, 0));
    }
}

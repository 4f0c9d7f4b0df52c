//! Retrying with exponential backoff: the one module that names the `backoff` crate.
//!
//! That crate is unmaintained (RUSTSEC-2025-0012), so none of its types leave this module and
//! swapping it touches nothing else. It draws the delays (doubling, capped, jittered); the
//! connect deadline is kept here on tokio's clock, so a paused test clock governs it exactly
//! like the sleeps.

use std::future::Future;
use std::time::Duration;

use backoff::backoff::Backoff as _;
use tokio::time::Instant;

/// Delays that start at `initial` and double up to `max_interval`, each drawn from
/// `d * (1 ± randomization)` and capped, so that clients that failed together do not all
/// retry at the same instant.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    initial: Duration,
    max_interval: Duration,
    randomization: f64,
}

impl Default for RetryPolicy {
    /// 100 ms, doubling, at most 5 s, 10 % jitter.
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max_interval: Duration::from_secs(5),
            randomization: 0.1,
        }
    }
}

impl RetryPolicy {
    /// The default policy: 100 ms, doubling, at most 5 s, 10 % jitter.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the first delay.
    pub fn with_initial(mut self, initial: Duration) -> Self {
        self.initial = initial;
        self
    }

    /// Sets the longest delay: doubling stops there.
    pub fn with_max_interval(mut self, max_interval: Duration) -> Self {
        self.max_interval = max_interval;
        self
    }

    /// Jitter factor, clamped to `0.0..=1.0` (NaN counts as 0.0, never as zero delays);
    /// 0.0 gives exact delays, for tests.
    pub fn with_randomization(mut self, randomization: f64) -> Self {
        self.randomization = if randomization.is_nan() {
            0.0
        } else {
            randomization.clamp(0.0, 1.0)
        };
        self
    }

    /// A fresh delay sequence following this policy.
    pub(crate) fn backoff(&self) -> Backoff {
        Backoff(
            backoff::ExponentialBackoffBuilder::new()
                .with_initial_interval(self.initial)
                .with_max_interval(self.max_interval)
                .with_multiplier(2.0)
                .with_randomization_factor(self.randomization)
                .with_max_elapsed_time(None)
                .build(),
        )
    }

    /// The delay before retry number `attempt` (1-based; zero for 0), the same as the
    /// `attempt`-th delay of a fresh backoff sequence of this policy. Stateless, for the NATS client's
    /// reconnect callback, which is handed an attempt count rather than kept between calls.
    pub fn delay_for_attempt(&self, attempt: usize) -> Duration {
        let Some(doublings) = attempt.checked_sub(1) else {
            return Duration::ZERO;
        };
        let doublings = u32::try_from(doublings).unwrap_or(u32::MAX);
        let mut backoff = self.backoff();
        backoff.0.current_interval = self
            .initial
            .saturating_mul(2u32.saturating_pow(doublings))
            .min(self.max_interval);
        backoff.next_delay()
    }
}

/// A delay sequence, for loops that sleep on their own (a publisher, a consumer that
/// recreates itself). It never runs out: those loops bound themselves.
#[derive(Debug)]
pub(crate) struct Backoff(backoff::ExponentialBackoff);

impl Backoff {
    /// The next delay, capped: the crate's jitter may draw above `max_interval`.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let max = self.0.max_interval;
        self.0.next_backoff().unwrap_or(max).min(max)
    }

    /// Starts over from `initial` (after a success).
    pub(crate) fn reset(&mut self) {
        self.0.reset();
    }
}

/// A failed attempt, classified: worth retrying, or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Attempt<E> {
    /// Retry after a delay (connection refused, timeout).
    Transient(E),
    /// Give up at once (authorization failed, invalid configuration).
    Permanent(E),
}

impl<E> Attempt<E> {
    pub(crate) fn is_permanent(&self) -> bool {
        matches!(self, Attempt::Permanent(_))
    }

    pub(crate) fn inner(&self) -> &E {
        match self {
            Attempt::Transient(e) | Attempt::Permanent(e) => e,
        }
    }

    pub(crate) fn into_inner(self) -> E {
        match self {
            Attempt::Transient(e) | Attempt::Permanent(e) => e,
        }
    }
}

/// Runs `op` until it succeeds, fails permanently, or `deadline` passes, and returns the last
/// error as classified (`Transient`: the deadline passed). The delay before the last attempt
/// is shortened so that it runs at the deadline, not after it. `on_retry(&error, delay)` is
/// called before each sleep, to log.
pub(crate) async fn retry<T, E, Fut>(
    policy: &RetryPolicy,
    deadline: Instant,
    mut op: impl FnMut() -> Fut,
    mut on_retry: impl FnMut(&E, Duration),
) -> Result<T, Attempt<E>>
where
    Fut: Future<Output = Result<T, Attempt<E>>>,
{
    let mut backoff = policy.backoff();
    loop {
        let error = match op().await {
            Err(Attempt::Transient(error)) => error,
            done => return done,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Attempt::Transient(error));
        }
        let delay = backoff.next_delay().min(left);
        on_retry(&error, delay);
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    fn exact(initial_ms: u64, max_ms: u64) -> RetryPolicy {
        RetryPolicy::new()
            .with_initial(ms(initial_ms))
            .with_max_interval(ms(max_ms))
            .with_randomization(0.0)
    }

    /// What one `retry` did, on the paused clock.
    #[derive(Debug, PartialEq)]
    struct Run {
        result: Result<u32, Attempt<u32>>,
        attempts: u32,
        delays_ms: Vec<u128>,
        elapsed: Duration,
    }

    /// Retries an op whose attempt `n` (1-based) gives `outcome(n)`, with the deadline
    /// `deadline` from now.
    async fn observe(
        policy: RetryPolicy,
        deadline: Duration,
        outcome: impl Fn(u32) -> Result<u32, Attempt<u32>>,
    ) -> Run {
        let start = Instant::now();
        let attempts = Cell::new(0);
        let mut delays_ms = Vec::new();
        let result = retry(
            &policy,
            start + deadline,
            || {
                attempts.set(attempts.get() + 1);
                std::future::ready(outcome(attempts.get()))
            },
            |_, d| delays_ms.push(d.as_millis()),
        )
        .await;
        Run {
            result,
            attempts: attempts.get(),
            delays_ms,
            elapsed: start.elapsed(),
        }
    }

    const HOUR: Duration = Duration::from_secs(3_600);

    #[tokio::test(start_paused = true)]
    async fn retries_with_doubling_delays_until_success() {
        let outcome = |n| {
            if n < 5 {
                Err(Attempt::Transient(n))
            } else {
                Ok(n)
            }
        };
        let run = observe(exact(100, 1_000), HOUR, outcome).await;
        assert_eq!(run.result, Ok(5));
        assert_eq!(run.delays_ms, [100, 200, 400, 800]);
        assert_eq!(run.elapsed, ms(1_500));
    }

    #[tokio::test(start_paused = true)]
    async fn the_last_attempt_runs_at_the_deadline() {
        let run = observe(exact(100, 400), ms(2_000), |n| Err(Attempt::Transient(n))).await;
        // 100 + 200 + 400 * 4 = 1900 ms, then the delay is cut to the 100 ms left.
        assert_eq!(run.delays_ms, [100, 200, 400, 400, 400, 400, 100]);
        assert_eq!(run.elapsed, ms(2_000));
        assert_eq!(run.attempts, 8);
        assert_eq!(run.result, Err(Attempt::Transient(8)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_error_stops_at_once() {
        let run = observe(RetryPolicy::default(), HOUR, |n| Err(Attempt::Permanent(n))).await;
        assert_eq!(run.result, Err(Attempt::Permanent(1)));
        assert!(run.delays_ms.is_empty());
        assert_eq!(run.elapsed, Duration::ZERO);

        let outcome = |n| {
            if n < 3 {
                Err(Attempt::Transient(n))
            } else {
                Err(Attempt::Permanent(n))
            }
        };
        let run = observe(exact(50, 50), HOUR, outcome).await;
        assert_eq!(run.result, Err(Attempt::Permanent(3)));
        assert_eq!(run.delays_ms, [50, 50]);
    }

    #[test]
    fn delays_are_capped_and_reset_starts_over() {
        let mut b = exact(100, 300).backoff();
        let delays: Vec<u128> = (0..5).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 300, 300, 300]);
        b.reset();
        assert_eq!(b.next_delay(), ms(100));
    }

    #[test]
    fn stateless_delays_match_the_sequence() {
        let policy = exact(100, 1_000);
        let mut b = policy.backoff();
        assert_eq!(policy.delay_for_attempt(0), Duration::ZERO);
        for attempt in 1..=8 {
            assert_eq!(
                policy.delay_for_attempt(attempt),
                b.next_delay(),
                "{attempt}"
            );
        }
        assert_eq!(policy.delay_for_attempt(usize::MAX), ms(1_000));
    }

    #[test]
    fn jitter_spreads_delays_within_bounds() {
        let policy = exact(100, 1_000).with_randomization(0.5);
        let first: Vec<Duration> = (0..1_000).map(|_| policy.delay_for_attempt(1)).collect();
        assert!(first.iter().all(|d| (ms(50)..=ms(150)).contains(d)));
        // Spread, not a constant: replicas that failed together retry apart.
        assert!(first.iter().min().unwrap() < &ms(70));
        assert!(first.iter().max().unwrap() > &ms(130));
        for _ in 0..1_000 {
            let d = policy.delay_for_attempt(40);
            assert!((ms(500)..=ms(1_000)).contains(&d), "{d:?}");
            let d = policy.backoff().next_delay();
            assert!((ms(50)..=ms(150)).contains(&d), "{d:?}");
        }
        // An unusable factor means no jitter, never zero delays.
        let nan = exact(100, 1_000).with_randomization(f64::NAN);
        assert_eq!(nan.delay_for_attempt(1), ms(100));
    }
}

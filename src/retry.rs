//! Retrying with exponential backoff.
//!
//! This is the only module that uses the `backoff` crate. That crate is flagged unmaintained
//! (RUSTSEC-2025-0012), so nothing of it leaks out of here: callers see [`RetryPolicy`],
//! [`Attempt`], [`Backoff`] and [`retry`], and the crate underneath can be swapped without
//! touching them.
//!
//! Time is read from the tokio clock (`tokio::time::Instant`), so deadlines follow a paused
//! test clock exactly like the sleeps do.

use std::future::Future;
use std::time::Duration;

use backoff::backoff::Backoff as _;

/// How to space out retries: exponential growth from `initial` by `multiplier`, capped at
/// `max_interval`, each delay randomised by `+/- randomization` (0.0 = exact), optionally
/// giving up once `max_elapsed` has passed since the first attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Delay before the first retry.
    pub initial: Duration,
    /// Upper bound of a single delay.
    pub max_interval: Duration,
    /// Growth factor between consecutive delays (>= 1.0).
    pub multiplier: f64,
    /// Give up after this much time since the start (`None`: retry forever).
    pub max_elapsed: Option<Duration>,
    /// Jitter: each delay is drawn from `[d * (1 - r), d * (1 + r)]`, then capped at
    /// `max_interval`. Clamped to `0.0..=1.0`.
    pub randomization: f64,
}

impl Default for RetryPolicy {
    /// 100 ms, doubling, at most 5 s between attempts, 10 % jitter, no deadline.
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max_interval: Duration::from_secs(5),
            multiplier: 2.0,
            max_elapsed: None,
            randomization: 0.1,
        }
    }
}

impl RetryPolicy {
    /// The default policy (see [`Default`]).
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_initial(mut self, initial: Duration) -> Self {
        self.initial = initial;
        self
    }

    pub fn with_max_interval(mut self, max_interval: Duration) -> Self {
        self.max_interval = max_interval;
        self
    }

    pub fn with_multiplier(mut self, multiplier: f64) -> Self {
        self.multiplier = multiplier;
        self
    }

    /// Give up once this much time has passed since the first attempt.
    pub fn with_max_elapsed(mut self, max_elapsed: Option<Duration>) -> Self {
        self.max_elapsed = max_elapsed;
        self
    }

    /// Jitter factor, clamped to `0.0..=1.0` (0.0: deterministic delays, handy in tests).
    pub fn with_randomization(mut self, randomization: f64) -> Self {
        self.randomization = randomization;
        self
    }

    /// A fresh [`Backoff`] following this policy, its deadline counted from now.
    pub fn backoff(&self) -> Backoff {
        Backoff::new(self)
    }

    /// The delay before retry number `attempt` (1-based), without deadline: 0 for attempt 0,
    /// `initial * multiplier^(attempt-1)` capped at `max_interval`, with jitter.
    ///
    /// Stateless, for callbacks that are handed an attempt counter (such as the NATS client's
    /// reconnect delay callback).
    pub fn delay_for_attempt(&self, attempt: usize) -> Duration {
        if attempt == 0 {
            return Duration::ZERO;
        }
        let exp = i32::try_from(attempt - 1).unwrap_or(i32::MAX).min(1_000);
        let base = self.initial.as_secs_f64() * self.sane_multiplier().powi(exp);
        let max = self.max_interval.as_secs_f64();
        let base = if base.is_finite() { base.min(max) } else { max };
        let r = self.sane_randomization();
        let jittered = if r > 0.0 {
            let u: f64 = rand::random::<f64>() * 2.0 - 1.0;
            base * (1.0 + r * u)
        } else {
            base
        };
        Duration::from_secs_f64(jittered.clamp(0.0, max.max(0.0)))
    }

    fn sane_multiplier(&self) -> f64 {
        if self.multiplier.is_finite() && self.multiplier >= 1.0 {
            self.multiplier
        } else {
            1.0
        }
    }

    fn sane_randomization(&self) -> f64 {
        if self.randomization.is_finite() {
            self.randomization.clamp(0.0, 1.0)
        } else {
            0.0
        }
    }
}

/// The outcome of one failed attempt: worth retrying, or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt<E> {
    /// Retry after a delay (for example: connection refused, timeout).
    Transient(E),
    /// Give up at once (for example: authorization failed, invalid configuration).
    Permanent(E),
}

impl<E> Attempt<E> {
    pub fn transient(err: E) -> Self {
        Attempt::Transient(err)
    }

    pub fn permanent(err: E) -> Self {
        Attempt::Permanent(err)
    }

    pub fn is_permanent(&self) -> bool {
        matches!(self, Attempt::Permanent(_))
    }

    pub fn into_inner(self) -> E {
        match self {
            Attempt::Transient(e) | Attempt::Permanent(e) => e,
        }
    }

    pub fn inner(&self) -> &E {
        match self {
            Attempt::Transient(e) | Attempt::Permanent(e) => e,
        }
    }
}

/// Why [`retry_detailed`] gave up, with the last error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GaveUp<E> {
    /// The error of the last attempt.
    pub error: E,
    /// How many attempts were made (>= 1).
    pub attempts: u32,
    /// Time from the first attempt until giving up.
    pub elapsed: Duration,
    /// True when the last error was [`Attempt::Permanent`]; false when the deadline passed.
    pub permanent: bool,
}

/// Runs `op` until it succeeds, fails permanently, or the policy's deadline passes.
///
/// `on_retry(&err, delay)` is called before each sleep, with the transient error and the
/// delay about to be slept (use it to log). The last delay is shortened so that the final
/// attempt happens at the deadline, never after it.
pub async fn retry<T, E, F, Fut>(
    policy: &RetryPolicy,
    op: F,
    on_retry: impl FnMut(&E, Duration),
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Attempt<E>>>,
{
    retry_detailed(policy, op, on_retry)
        .await
        .map_err(|g| g.error)
}

/// Like [`retry`], but on failure says how many attempts were made, how long it took and
/// whether the last error was permanent.
pub async fn retry_detailed<T, E, F, Fut>(
    policy: &RetryPolicy,
    mut op: F,
    mut on_retry: impl FnMut(&E, Duration),
) -> Result<T, GaveUp<E>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Attempt<E>>>,
{
    let start = tokio::time::Instant::now();
    let mut backoff = Backoff::new(policy);
    let mut attempts: u32 = 0;
    loop {
        attempts = attempts.saturating_add(1);
        match op().await {
            Ok(v) => return Ok(v),
            Err(Attempt::Permanent(error)) => {
                return Err(GaveUp {
                    error,
                    attempts,
                    elapsed: start.elapsed(),
                    permanent: true,
                })
            }
            Err(Attempt::Transient(error)) => match backoff.next_delay() {
                Some(delay) => {
                    on_retry(&error, delay);
                    tokio::time::sleep(delay).await;
                }
                None => {
                    return Err(GaveUp {
                        error,
                        attempts,
                        elapsed: start.elapsed(),
                        permanent: false,
                    })
                }
            },
        }
    }
}

/// Clock for the `backoff` crate that reads tokio's (pausable) clock.
#[derive(Debug, Clone, Copy, Default)]
struct TokioClock;

impl backoff::Clock for TokioClock {
    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }
}

/// A backoff sequence for loops that sleep on their own (a publisher task, a consumer that
/// recreates itself): `next_delay()` gives the next delay, or `None` once the deadline has
/// passed; `reset()` after a success starts over from `initial` (and restarts the deadline).
#[derive(Debug)]
pub struct Backoff {
    inner: backoff::exponential::ExponentialBackoff<TokioClock>,
    max_elapsed: Option<Duration>,
    started: tokio::time::Instant,
}

impl Backoff {
    pub fn new(policy: &RetryPolicy) -> Self {
        let max_interval = policy.max_interval.max(Duration::from_nanos(1));
        let initial = policy.initial.min(max_interval);
        let mut inner = backoff::exponential::ExponentialBackoff::<TokioClock> {
            current_interval: initial,
            initial_interval: initial,
            randomization_factor: policy.sane_randomization(),
            multiplier: policy.sane_multiplier(),
            max_interval,
            // The deadline is enforced here (see next_delay), not by the crate: it gives up
            // as soon as the next delay would cross the deadline, we shorten that last delay.
            max_elapsed_time: None,
            clock: TokioClock,
            start_time: tokio::time::Instant::now().into_std(),
        };
        inner.reset();
        Self {
            inner,
            max_elapsed: policy.max_elapsed,
            started: tokio::time::Instant::now(),
        }
    }

    /// The next delay to sleep, or `None` when the deadline has passed.
    pub fn next_delay(&mut self) -> Option<Duration> {
        let delay = self.inner.next_backoff()?.min(self.inner.max_interval);
        match self.max_elapsed {
            None => Some(delay),
            Some(max) => {
                let elapsed = self.started.elapsed();
                if elapsed >= max {
                    None
                } else {
                    Some(delay.min(max - elapsed))
                }
            }
        }
    }

    /// Starts over: the next delay is `initial` again and the deadline restarts from now.
    pub fn reset(&mut self) {
        self.inner.reset();
        self.started = tokio::time::Instant::now();
    }

    /// Time since creation or the last [`reset`](Self::reset).
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn exact(initial_ms: u64, max_ms: u64) -> RetryPolicy {
        RetryPolicy::new()
            .with_initial(Duration::from_millis(initial_ms))
            .with_max_interval(Duration::from_millis(max_ms))
            .with_multiplier(2.0)
            .with_randomization(0.0)
    }

    #[tokio::test(start_paused = true)]
    async fn retries_until_success() {
        let policy = exact(100, 1_000);
        let calls = Cell::new(0u32);
        let mut delays = Vec::new();
        let start = tokio::time::Instant::now();
        let out: Result<u32, &str> = retry(
            &policy,
            || {
                calls.set(calls.get() + 1);
                let n = calls.get();
                async move {
                    if n < 5 {
                        Err(Attempt::Transient("down"))
                    } else {
                        Ok(n)
                    }
                }
            },
            |_, d| delays.push(d),
        )
        .await;
        assert_eq!(out, Ok(5));
        assert_eq!(calls.get(), 5);
        let ms: Vec<u128> = delays.iter().map(|d| d.as_millis()).collect();
        assert_eq!(ms, vec![100, 200, 400, 800]);
        assert_eq!(start.elapsed(), Duration::from_millis(1_500));
    }

    #[tokio::test(start_paused = true)]
    async fn delays_are_capped() {
        let mut b = exact(100, 300).backoff();
        let ms: Vec<u128> = (0..5)
            .map(|_| b.next_delay().unwrap().as_millis())
            .collect();
        assert_eq!(ms, vec![100, 200, 300, 300, 300]);
        b.reset();
        assert_eq!(b.next_delay(), Some(Duration::from_millis(100)));
    }

    #[tokio::test(start_paused = true)]
    async fn stops_at_the_deadline() {
        let policy = exact(100, 400).with_max_elapsed(Some(Duration::from_secs(2)));
        let calls = Cell::new(0u32);
        let start = tokio::time::Instant::now();
        let out: Result<(), GaveUp<&str>> = retry_detailed(
            &policy,
            || {
                calls.set(calls.get() + 1);
                async { Err(Attempt::Transient("down")) }
            },
            |_, _| {},
        )
        .await;
        let gave_up = out.unwrap_err();
        assert!(!gave_up.permanent);
        assert_eq!(gave_up.error, "down");
        // 100 + 200 + 400 + 400 + 400 + 400 = 1900, then a last 100 ms shortened delay
        // puts the final attempt exactly at the deadline.
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        assert_eq!(gave_up.elapsed, Duration::from_secs(2));
        assert_eq!(calls.get(), 8);
        assert_eq!(gave_up.attempts, 8);
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_error_stops_at_once() {
        let policy = RetryPolicy::default();
        let calls = Cell::new(0u32);
        let retried = Cell::new(false);
        let start = tokio::time::Instant::now();
        let out: Result<(), &str> = retry(
            &policy,
            || {
                calls.set(calls.get() + 1);
                async { Err(Attempt::Permanent("denied")) }
            },
            |_, _| retried.set(true),
        )
        .await;
        assert_eq!(out, Err("denied"));
        assert_eq!(calls.get(), 1);
        assert!(!retried.get());
        assert_eq!(start.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_after_transient() {
        let policy = exact(50, 50);
        let calls = Cell::new(0u32);
        let out: Result<(), GaveUp<u32>> = retry_detailed(
            &policy,
            || {
                calls.set(calls.get() + 1);
                let n = calls.get();
                async move {
                    if n < 3 {
                        Err(Attempt::Transient(n))
                    } else {
                        Err(Attempt::Permanent(n))
                    }
                }
            },
            |_, _| {},
        )
        .await;
        let g = out.unwrap_err();
        assert!(g.permanent);
        assert_eq!((g.error, g.attempts), (3, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_deadline_follows_paused_clock() {
        let mut b = exact(100, 100)
            .with_max_elapsed(Some(Duration::from_millis(250)))
            .backoff();
        assert_eq!(b.next_delay(), Some(Duration::from_millis(100)));
        tokio::time::advance(Duration::from_millis(200)).await;
        assert_eq!(b.next_delay(), Some(Duration::from_millis(50)));
        tokio::time::advance(Duration::from_millis(50)).await;
        assert_eq!(b.next_delay(), None);
        b.reset();
        assert_eq!(b.next_delay(), Some(Duration::from_millis(100)));
    }

    #[test]
    fn jitter_stays_in_bounds() {
        let policy = RetryPolicy::new()
            .with_initial(Duration::from_millis(100))
            .with_max_interval(Duration::from_millis(1_000))
            .with_randomization(0.5);
        for _ in 0..1_000 {
            let d = policy.delay_for_attempt(1);
            assert!(d >= Duration::from_millis(50) && d <= Duration::from_millis(150));
            let d = policy.delay_for_attempt(40);
            assert!(d >= Duration::from_millis(500) && d <= Duration::from_millis(1_000));
        }
        assert_eq!(policy.delay_for_attempt(0), Duration::ZERO);
        let exact = policy.with_randomization(0.0);
        assert_eq!(exact.delay_for_attempt(3), Duration::from_millis(400));
        assert_eq!(exact.delay_for_attempt(usize::MAX), Duration::from_secs(1));
    }
}

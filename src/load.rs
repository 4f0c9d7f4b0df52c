//! Load: what a request weighs on its worker, and what a worker carries in all.
//!
//! A request costs its worker differently in its two phases. Until prefill is done, its
//! uncached prompt is **prefill waiting** (compute-bound work queued ahead of a new request);
//! from admission to release, prompt plus output so far is **KV held** (the memory decode is
//! bound by); expected output minus output so far is **output still to come**.
//!
//! Three shapes of one idea, and the only arithmetic on them:
//! - [`RequestLoad`]: the sizes a request is admitted (or routed) with;
//! - [`BookingWeight`]: what one booking adds to its worker's load at one moment, computed
//!   from its sizes and its progress;
//! - [`WorkerLoad`]: a worker's sums over its live bookings. The scheduler keeps them signed
//!   ([`LoadSums`]), so that bookings, shifts and releases add up in any order.
//!
//! This module is a leaf: the lease manager, the scheduler and routing all import it, and it
//! imports none of them.

use serde::{Deserialize, Serialize};

/// The sizes of one request: how much its booking weighs on its worker.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct RequestLoad {
    /// Tokens of the prompt.
    pub prompt_tokens: u32,
    /// `None` when the worker does not know yet how long the answer will be.
    pub expected_output_tokens: Option<u32>,
    /// Prompt tokens the worker's prefix cache already holds: they are never prefilled, so
    /// they do not count as prefill waiting (they do count as KV held). At most
    /// `prompt_tokens` is taken into account.
    #[serde(default)]
    pub cached_tokens: u32,
}

impl RequestLoad {
    /// A request of `prompt_tokens`, none of them cached.
    pub fn new(prompt_tokens: u32, expected_output_tokens: Option<u32>) -> Self {
        Self {
            prompt_tokens,
            expected_output_tokens,
            cached_tokens: 0,
        }
    }

    /// The same load with `cached_tokens` of its prompt already cached on the worker.
    pub fn with_cached_tokens(mut self, cached_tokens: u32) -> Self {
        self.cached_tokens = cached_tokens;
        self
    }
}

/// A request's sizes as a booking keeps them: 12 bytes, the uncached part computed once.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct BookingSizes {
    prompt_tokens: u32,
    /// Prompt tokens not in the worker's prefix cache: what prefill has to do.
    uncached_tokens: u32,
    /// 0 when unknown.
    expected_output_tokens: u32,
}

impl From<RequestLoad> for BookingSizes {
    fn from(load: RequestLoad) -> Self {
        Self {
            prompt_tokens: load.prompt_tokens,
            uncached_tokens: load.prompt_tokens.saturating_sub(load.cached_tokens),
            expected_output_tokens: load.expected_output_tokens.unwrap_or(0),
        }
    }
}

impl From<BookingSizes> for RequestLoad {
    /// The load these sizes were made from (cached tokens beyond the prompt read as the
    /// whole prompt, which weighs the same).
    fn from(sizes: BookingSizes) -> Self {
        Self {
            prompt_tokens: sizes.prompt_tokens,
            expected_output_tokens: (sizes.expected_output_tokens > 0)
                .then_some(sizes.expected_output_tokens),
            cached_tokens: sizes.prompt_tokens - sizes.uncached_tokens,
        }
    }
}

impl BookingSizes {
    /// What the booking weighs once prefill is done (or not) and `output_tokens` have been
    /// produced. Output beyond the expected leaves nothing still to come, never less.
    pub(crate) fn weight(self, prefill_done: bool, output_tokens: u32) -> BookingWeight {
        BookingWeight {
            prompt_tokens: self.prompt_tokens,
            expected_output_tokens: self.expected_output_tokens,
            prefill_tokens: if prefill_done {
                0
            } else {
                self.uncached_tokens
            },
            kv_tokens: self.prompt_tokens.saturating_add(output_tokens),
            remaining_output_tokens: self.expected_output_tokens.saturating_sub(output_tokens),
        }
    }
}

/// What one booking adds to its worker's load at one moment. Its lease computes it from
/// the request's sizes and progress; no per-booking record is kept by the scheduler.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct BookingWeight {
    pub(crate) prompt_tokens: u32,
    pub(crate) expected_output_tokens: u32,
    pub(crate) prefill_tokens: u32,
    pub(crate) kv_tokens: u32,
    pub(crate) remaining_output_tokens: u32,
}

impl From<RequestLoad> for BookingWeight {
    /// The weight at admission, before any progress.
    fn from(load: RequestLoad) -> Self {
        BookingSizes::from(load).weight(false, 0)
    }
}

/// The load of one worker as the scheduler counts it: sums over its live bookings.
///
/// `active_bookings`, `prompt_tokens` and `expected_output_tokens` are the sizes the
/// bookings were admitted with; they move only at admission and release. The other three
/// follow each request's phase (prefill waiting, KV held, output still to come). A provisional booking (a route
/// decision's, before its worker's `admitted`) weighs exactly as the admission it stands for.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize)]
pub struct WorkerLoad {
    /// Live bookings (provisional ones included).
    pub active_bookings: u64,
    /// Prompt tokens of the live bookings, as admitted.
    pub prompt_tokens: u64,
    /// Expected output tokens of the live bookings, as admitted (unknown counts 0).
    pub expected_output_tokens: u64,
    /// Prefill tokens waiting: the uncached prompt of bookings whose prefill is not done
    /// (up at admission, down at the first `progressed`).
    pub prefill_tokens: u64,
    /// KV tokens held: prompt plus output so far (up with each `progressed`, down at
    /// release).
    pub kv_tokens: u64,
    /// Expected output still to come: expected minus produced, never below zero.
    pub remaining_output_tokens: u64,
}

impl WorkerLoad {
    /// Adds one live booking of `weight`.
    pub(crate) fn add(&mut self, weight: BookingWeight) {
        self.active_bookings += 1;
        self.prompt_tokens += u64::from(weight.prompt_tokens);
        self.expected_output_tokens += u64::from(weight.expected_output_tokens);
        self.prefill_tokens += u64::from(weight.prefill_tokens);
        self.kv_tokens += u64::from(weight.kv_tokens);
        self.remaining_output_tokens += u64::from(weight.remaining_output_tokens);
    }

    /// The order of the least-loaded worker: fewest bookings, then fewest tokens.
    pub(crate) fn rank(&self) -> (u64, u64) {
        (
            self.active_bookings,
            self.prompt_tokens + self.expected_output_tokens,
        )
    }
}

/// A worker's sums, signed, so that operations applied in any order add up (a release that
/// overtakes its booking only makes a sum briefly low); shown clamped at zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LoadSums {
    pub(crate) bookings: i64,
    prompt_tokens: i64,
    expected_output_tokens: i64,
    pub(crate) prefill_tokens: i64,
    pub(crate) kv_tokens: i64,
    remaining_output_tokens: i64,
}

impl LoadSums {
    /// One booking of `weight` more (`sign` 1) or less (`sign` -1).
    pub(crate) fn add(&mut self, sign: i64, weight: BookingWeight) {
        self.bookings += sign;
        self.add_tokens(sign, weight);
    }

    /// A live booking's weight moved from `from` to `to`.
    pub(crate) fn shift(&mut self, from: BookingWeight, to: BookingWeight) {
        self.add_tokens(-1, from);
        self.add_tokens(1, to);
    }

    fn add_tokens(&mut self, sign: i64, weight: BookingWeight) {
        self.prompt_tokens += sign * i64::from(weight.prompt_tokens);
        self.expected_output_tokens += sign * i64::from(weight.expected_output_tokens);
        self.prefill_tokens += sign * i64::from(weight.prefill_tokens);
        self.kv_tokens += sign * i64::from(weight.kv_tokens);
        self.remaining_output_tokens += sign * i64::from(weight.remaining_output_tokens);
    }

    /// Adds another's sums to these.
    pub(crate) fn merge(&mut self, other: &LoadSums) {
        self.bookings += other.bookings;
        self.prompt_tokens += other.prompt_tokens;
        self.expected_output_tokens += other.expected_output_tokens;
        self.prefill_tokens += other.prefill_tokens;
        self.kv_tokens += other.kv_tokens;
        self.remaining_output_tokens += other.remaining_output_tokens;
    }

    pub(crate) fn is_zero(&self) -> bool {
        *self == Self::default()
    }

    /// The sums as a load, each clamped at zero.
    pub(crate) fn load(&self) -> WorkerLoad {
        let clamp = |n: i64| u64::try_from(n).unwrap_or(0);
        WorkerLoad {
            active_bookings: clamp(self.bookings),
            prompt_tokens: clamp(self.prompt_tokens),
            expected_output_tokens: clamp(self.expected_output_tokens),
            prefill_tokens: clamp(self.prefill_tokens),
            kv_tokens: clamp(self.kv_tokens),
            remaining_output_tokens: clamp(self.remaining_output_tokens),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(w: BookingWeight) -> (u32, u32, u32, u32, u32) {
        (
            w.prompt_tokens,
            w.expected_output_tokens,
            w.prefill_tokens,
            w.kv_tokens,
            w.remaining_output_tokens,
        )
    }

    #[test]
    fn the_weight_follows_the_phase() {
        let sizes = BookingSizes::from(RequestLoad::new(100, Some(20)).with_cached_tokens(30));
        assert_eq!(parts(sizes.weight(false, 0)), (100, 20, 70, 100, 20));
        assert_eq!(parts(sizes.weight(true, 0)), (100, 20, 0, 100, 20));
        assert_eq!(parts(sizes.weight(true, 5)), (100, 20, 0, 105, 15));
        assert_eq!(parts(sizes.weight(true, 50)), (100, 20, 0, 150, 0));
        assert_eq!(
            parts(BookingWeight::from(
                RequestLoad::new(10, None).with_cached_tokens(50)
            )),
            (10, 0, 0, 10, 0),
            "cached beyond the prompt leaves no prefill; unknown output counts nothing"
        );
    }

    #[test]
    fn sizes_give_back_the_load_they_were_made_from() {
        for load in [
            RequestLoad::new(100, Some(20)).with_cached_tokens(30),
            RequestLoad::new(7, None),
            RequestLoad::new(0, Some(1)),
        ] {
            assert_eq!(RequestLoad::from(BookingSizes::from(load)), load);
        }
        assert_eq!(
            RequestLoad::from(BookingSizes::from(
                RequestLoad::new(10, None).with_cached_tokens(50)
            )),
            RequestLoad::new(10, None).with_cached_tokens(10),
            "cached beyond the prompt is the whole prompt"
        );
    }

    #[test]
    fn sums_add_up_in_any_order_and_clamp_at_zero() {
        let a = BookingWeight::from(RequestLoad::new(100, Some(20)).with_cached_tokens(30));
        let b = BookingSizes::from(RequestLoad::new(100, Some(20)).with_cached_tokens(30))
            .weight(true, 5);
        let mut sums = LoadSums::default();
        sums.add(-1, b);
        assert_eq!(sums.load(), WorkerLoad::default(), "clamped while negative");
        sums.shift(a, b);
        sums.add(1, a);
        assert!(
            sums.is_zero(),
            "book, shift, release in reverse order: {sums:?}"
        );

        sums.add(1, a);
        sums.shift(a, b);
        let mut expected = WorkerLoad::default();
        expected.add(b);
        assert_eq!(sums.load(), expected);
        assert_eq!(
            expected,
            WorkerLoad {
                active_bookings: 1,
                prompt_tokens: 100,
                expected_output_tokens: 20,
                prefill_tokens: 0,
                kv_tokens: 105,
                remaining_output_tokens: 15,
            }
        );
        assert_eq!(expected.rank(), (1, 120));
    }
}

//! The second-chance (CLOCK) state of one lease, in one atomic byte.
//!
//! A touch costs one relaxed load when the lease is already TOUCHED, so a stream of
//! `progressed` events for a busy request collapses into nothing; no timestamp is kept per
//! touch. The reaper's scans give a lease one to two scan intervals after its last touch.

use std::sync::atomic::{AtomicU8, Ordering};

const QUIET: u8 = 0;
const TOUCHED: u8 = 1;
const CLAIMED: u8 = 2;

/// What a lease's clock says about it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Not touched since the last scan: the next scan expires it.
    Quiet,
    /// Touched since the last scan: the next scan gives it a second chance.
    Touched,
    /// Completed, expired or torn down: dead for good.
    Claimed,
}

/// The result of [`LeaseClock::touch`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum TouchOutcome {
    /// QUIET became TOUCHED.
    Renewed,
    /// Already TOUCHED: this touch collapsed into the earlier one.
    Coalesced,
    /// The lease is claimed; a touch never revives it.
    Claimed,
}

/// The result of [`LeaseClock::reap`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum ReapOutcome {
    /// TOUCHED became QUIET: the lease lives until the next scan.
    SecondChance,
    /// QUIET became CLAIMED by this scan: the caller owns the expiry.
    Expired,
    /// Someone else claimed it first.
    AlreadyClaimed,
}

/// QUIET / TOUCHED / CLAIMED in one atomic.
#[derive(Debug)]
pub(super) struct LeaseClock(AtomicU8);

impl Default for LeaseClock {
    fn default() -> Self {
        Self::touched()
    }
}

impl LeaseClock {
    /// A fresh lease starts TOUCHED so that it gets the full second chance.
    pub(super) fn touched() -> Self {
        Self(AtomicU8::new(TOUCHED))
    }

    #[cfg(test)]
    fn quiet() -> Self {
        Self(AtomicU8::new(QUIET))
    }

    pub(super) fn state(&self) -> LeaseState {
        match self.0.load(Ordering::Acquire) {
            QUIET => LeaseState::Quiet,
            TOUCHED => LeaseState::Touched,
            _ => LeaseState::Claimed,
        }
    }

    /// Renews the lease: QUIET to TOUCHED only.
    pub(super) fn touch(&self) -> TouchOutcome {
        // The plain load keeps repeated touches off the cache line's write path.
        match self.0.load(Ordering::Acquire) {
            TOUCHED => TouchOutcome::Coalesced,
            CLAIMED => TouchOutcome::Claimed,
            _ => match self
                .0
                .compare_exchange(QUIET, TOUCHED, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => TouchOutcome::Renewed,
                Err(TOUCHED) => TouchOutcome::Coalesced,
                Err(_) => TouchOutcome::Claimed,
            },
        }
    }

    /// Claims the lease; exactly one caller over the lease's life gets `true`.
    pub(super) fn claim(&self) -> bool {
        self.0.swap(CLAIMED, Ordering::AcqRel) != CLAIMED
    }

    /// One reaper pass: TOUCHED to QUIET, QUIET to CLAIMED.
    pub(super) fn reap(&self) -> ReapOutcome {
        let mut current = self.0.load(Ordering::Acquire);
        loop {
            let (next, outcome) = match current {
                TOUCHED => (QUIET, ReapOutcome::SecondChance),
                QUIET => (CLAIMED, ReapOutcome::Expired),
                _ => return ReapOutcome::AlreadyClaimed,
            };
            match self
                .0
                .compare_exchange(current, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return outcome,
                Err(actual) => current = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};

    #[test]
    fn touches_coalesce() {
        let clock = LeaseClock::quiet();
        assert_eq!(clock.touch(), TouchOutcome::Renewed);
        for _ in 0..100 {
            assert_eq!(clock.touch(), TouchOutcome::Coalesced);
        }
        // However many touches, one scan takes it back to QUIET and the next expires it.
        assert_eq!(clock.reap(), ReapOutcome::SecondChance);
        assert_eq!(clock.reap(), ReapOutcome::Expired);
    }

    #[test]
    fn second_chance_then_expiry() {
        let clock = LeaseClock::touched();
        assert_eq!(clock.reap(), ReapOutcome::SecondChance);
        assert_eq!(clock.state(), LeaseState::Quiet);
        assert_eq!(clock.touch(), TouchOutcome::Renewed);
        assert_eq!(clock.reap(), ReapOutcome::SecondChance);
        assert_eq!(clock.reap(), ReapOutcome::Expired);
        assert_eq!(clock.reap(), ReapOutcome::AlreadyClaimed);
    }

    #[test]
    fn claimed_lease_cannot_be_revived() {
        let clock = LeaseClock::touched();
        assert!(clock.claim());
        assert_eq!(clock.touch(), TouchOutcome::Claimed);
        assert_eq!(clock.state(), LeaseState::Claimed);
        assert_eq!(clock.reap(), ReapOutcome::AlreadyClaimed);
        assert!(!clock.claim());
        assert_eq!(clock.state(), LeaseState::Claimed);
    }

    #[test]
    fn exactly_one_claimer_wins_under_many_threads() {
        const THREADS: usize = 16;
        for round in 0..200 {
            let clock = Arc::new(if round % 2 == 0 {
                LeaseClock::quiet()
            } else {
                LeaseClock::touched()
            });
            let winners = Arc::new(AtomicUsize::new(0));
            let barrier = Arc::new(Barrier::new(THREADS));
            let threads: Vec<_> = (0..THREADS)
                .map(|i| {
                    let (clock, winners, barrier) =
                        (clock.clone(), winners.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        // A mix of claimers, reapers and touchers, as on a live router.
                        let won = match i % 3 {
                            0 => clock.claim(),
                            1 => clock.reap() == ReapOutcome::Expired,
                            _ => {
                                clock.touch();
                                clock.claim()
                            }
                        };
                        if won {
                            winners.fetch_add(1, Ordering::SeqCst);
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            // Reapers may leave it QUIET/TOUCHED only if nobody claimed; claimers always claim.
            assert_eq!(winners.load(Ordering::SeqCst), 1, "round {round}");
            assert_eq!(clock.state(), LeaseState::Claimed);
        }
    }
}

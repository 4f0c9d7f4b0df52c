//! Per-publisher sequence tracking: duplicates, gaps and publisher restarts.
//!
//! Each publisher numbers its events from 1. A sliding window of the last 4,096 sequence
//! numbers (a ring of bits, 512 bytes per publisher) tells a duplicate (seen in the window)
//! from a late arrival that fills a hole: wide enough for a durable publisher's retries,
//! which land behind up to a window of outstanding acknowledgements, and for a stream that
//! stored a retried event twice during a failover.
//! A restarted publisher has a new id, so it starts a new window.
//!
//! A skipped number is not lost yet: it may be on its way (a `completed` overtaking its
//! `admitted`, a retry). It is counted lost once it can no longer arrive: when it leaves the
//! window unseen (any later arrival is too old to tell from a duplicate), or when its
//! publisher is forgotten. So a late arrival is never counted, and every real loss is, a
//! window later. (Durable mode applies events even from behind the window: one that late was
//! counted lost, the one case where an arrival is.)
//!
//! A publisher restart is a new publisher id heard on a worker subject that had another one
//! (schemas/README.md: a restarted process picks a new `pub`). The first publisher of a worker
//! is not a restart, whatever its first sequence number.

use hashbrown::HashMap;

const WINDOW: u64 = 4096;
const WORDS: usize = (WINDOW / 64) as usize;

/// What one `(publisher, sequence)` means.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum SequenceVerdict {
    /// The next one, or ahead of it. `lost`: numbers of this publisher that this one pushed
    /// out of the window without their having arrived.
    Fresh { lost: u64 },
    /// Behind the highest, inside the window, not seen yet: fills a hole.
    Late,
    /// Seen already.
    Duplicate,
    /// Behind the window: cannot tell, so not applied.
    TooOld,
}

#[derive(Debug)]
struct PublisherWindow {
    /// The first number heard: numbers below it were before this router listened, never lost.
    first: u64,
    highest: u64,
    /// Bit `s % WINDOW` set: sequence `s` (within `WINDOW` of `highest`) was seen.
    seen: Box<[u64; WORDS]>,
    last_used: u64,
}

/// What a snapshot keeps of a [`SequenceTracker`]: each publisher's window, and which
/// publisher each worker had (to tell a restart).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct SequenceImage {
    /// `(publisher, first, highest, seen bits)`, least recently heard first.
    publishers: Vec<(u64, u64, u64, Vec<u64>)>,
    worker_publishers: Vec<(u64, u64)>,
}

/// The windows of every publisher heard from, bounded in number.
#[derive(Debug)]
pub(super) struct SequenceTracker {
    publishers: HashMap<u64, PublisherWindow>,
    max_publishers: usize,
    clock: u64,
    evicted: u64,
    /// Numbers missing from the windows of evicted publishers: they can no longer be told.
    lost_evicted: u64,
    /// The last new publisher heard on each worker subject, to tell a restart. Written only
    /// when a publisher is first heard, bounded by `2 * max_publishers`.
    worker_publishers: HashMap<u64, u64>,
}

impl SequenceTracker {
    pub(super) fn new(max_publishers: usize) -> Self {
        Self {
            publishers: HashMap::new(),
            max_publishers: max_publishers.max(1),
            clock: 0,
            evicted: 0,
            lost_evicted: 0,
            worker_publishers: HashMap::new(),
        }
    }

    /// Publishers forgotten to stay within the bound.
    pub(super) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Numbers that were missing from the windows of the publishers forgotten so far: lost.
    pub(super) fn lost_evicted(&self) -> u64 {
        self.lost_evicted
    }

    /// Records that `publisher`, heard for the first time, speaks for `worker`; true if the
    /// worker had another publisher before (a restart). Call it once per new publisher, not
    /// per event.
    pub(super) fn new_publisher_of(&mut self, worker: u64, publisher: u64) -> bool {
        if self.worker_publishers.len() >= 2 * self.max_publishers {
            // Each new publisher adds at most one entry: keeping only those whose publisher
            // is still tracked halves the map at worst, so this runs once per
            // `max_publishers` new ones (a flood of forged worker subjects stays bounded).
            let publishers = &self.publishers;
            self.worker_publishers
                .retain(|_, p| publishers.contains_key(p));
        }
        self.worker_publishers
            .insert(worker, publisher)
            .is_some_and(|before| before != publisher)
    }

    /// The tracker as a snapshot keeps it.
    pub(crate) fn image(&self) -> SequenceImage {
        let mut publishers: Vec<_> = self.publishers.iter().collect();
        publishers.sort_unstable_by_key(|(_, w)| w.last_used);
        SequenceImage {
            publishers: publishers
                .into_iter()
                .map(|(&id, w)| (id, w.first, w.highest, w.seen.to_vec()))
                .collect(),
            worker_publishers: self
                .worker_publishers
                .iter()
                .map(|(&w, &p)| (w, p))
                .collect(),
        }
    }

    /// Replaces the tracked state with a snapshot's. A window of the wrong size is skipped:
    /// its publisher is heard afresh.
    pub(crate) fn restore(&mut self, image: SequenceImage) {
        self.publishers.clear();
        for (id, first, highest, seen) in image.publishers {
            let Ok(seen) = <[u64; WORDS]>::try_from(seen) else {
                continue;
            };
            self.clock += 1;
            self.publishers.insert(
                id,
                PublisherWindow {
                    first,
                    highest,
                    seen: Box::new(seen),
                    last_used: self.clock,
                },
            );
        }
        self.worker_publishers = image.worker_publishers.into_iter().collect();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.publishers.len()
    }

    /// Whether `publisher` has been heard from (and not forgotten).
    pub(super) fn knows(&self, publisher: u64) -> bool {
        self.publishers.contains_key(&publisher)
    }

    pub(super) fn observe(&mut self, publisher: u64, sequence: u64) -> SequenceVerdict {
        self.clock += 1;
        let clock = self.clock;
        if let Some(window) = self.publishers.get_mut(&publisher) {
            window.last_used = clock;
            return window.observe(sequence);
        }
        if self.publishers.len() >= self.max_publishers {
            self.evict_older_half();
        }
        // A publisher first heard mid-stream is not a gap: this router joined late.
        self.publishers
            .insert(publisher, PublisherWindow::starting_at(sequence, clock));
        SequenceVerdict::Fresh { lost: 0 }
    }

    /// Forgets the least recently heard half at once: a flood of new publisher ids then
    /// costs amortised O(1) each instead of a full scan each.
    fn evict_older_half(&mut self) {
        let mut ages: Vec<u64> = self.publishers.values().map(|w| w.last_used).collect();
        let middle = ages.len() / 2;
        let (_, cutoff, _) = ages.select_nth_unstable(middle);
        let cutoff = *cutoff;
        let before = self.publishers.len();
        let mut lost = 0;
        self.publishers.retain(|_, w| {
            let keep = w.last_used > cutoff;
            if !keep {
                lost += w.missing();
            }
            keep
        });
        self.evicted += (before - self.publishers.len()) as u64;
        self.lost_evicted += lost;
    }
}

impl PublisherWindow {
    fn starting_at(sequence: u64, clock: u64) -> Self {
        let mut window = Self {
            first: sequence,
            highest: sequence,
            seen: Box::new([0; WORDS]),
            last_used: clock,
        };
        window.set(sequence);
        window
    }

    fn slot(sequence: u64) -> (usize, u64) {
        let bit = sequence % WINDOW;
        ((bit / 64) as usize, 1 << (bit % 64))
    }

    fn set(&mut self, sequence: u64) {
        let (word, mask) = Self::slot(sequence);
        self.seen[word] |= mask;
    }

    fn is_set(&self, sequence: u64) -> bool {
        let (word, mask) = Self::slot(sequence);
        self.seen[word] & mask != 0
    }

    /// The oldest number the window still tells: `highest` and the `WINDOW - 1` before it,
    /// none before `first`.
    fn oldest(&self) -> u64 {
        (self.highest + 1).saturating_sub(WINDOW).max(self.first)
    }

    /// Numbers in the window not seen: skipped and not (yet) arrived. A word at a time: an
    /// eviction asks this of thousands of publishers at once.
    fn missing(&self) -> u64 {
        let (from, to) = (self.oldest() % WINDOW, self.highest % WINDOW);
        let seen = if from <= to {
            self.count_set(from, to)
        } else {
            self.count_set(from, WINDOW - 1) + self.count_set(0, to)
        };
        self.highest - self.oldest() + 1 - seen
    }

    /// Set bits among slots `from..=to`.
    fn count_set(&self, from: u64, to: u64) -> u64 {
        let (first_word, last_word) = ((from / 64) as usize, (to / 64) as usize);
        (first_word..=last_word)
            .map(|w| {
                let mut word = self.seen[w];
                if w == first_word {
                    word &= u64::MAX << (from % 64);
                }
                if w == last_word {
                    word &= u64::MAX >> (63 - to % 64);
                }
                u64::from(word.count_ones())
            })
            .sum()
    }

    fn observe(&mut self, sequence: u64) -> SequenceVerdict {
        if sequence > self.highest {
            let shift = sequence - self.highest;
            let lost;
            if shift >= WINDOW {
                // The whole window leaves, and the skipped numbers that never enter it.
                let never_in = (sequence - WINDOW).saturating_sub(self.highest);
                lost = self.missing() + never_in;
                self.seen.fill(0);
            } else {
                // Each number from `highest + 1` on takes the slot of the one `WINDOW` before
                // it, which leaves the window: lost if it never arrived. Usually one slot.
                let mut left_unseen = 0;
                let oldest = self.oldest();
                for next in self.highest + 1..=sequence {
                    let (word, mask) = Self::slot(next);
                    let leaving = next.checked_sub(WINDOW);
                    if leaving.is_some_and(|l| l >= oldest) && self.seen[word] & mask == 0 {
                        left_unseen += 1;
                    }
                    self.seen[word] &= !mask;
                }
                lost = left_unseen;
            }
            self.set(sequence);
            self.highest = sequence;
            return SequenceVerdict::Fresh { lost };
        }
        if self.highest - sequence >= WINDOW {
            return SequenceVerdict::TooOld;
        }
        if self.is_set(sequence) {
            SequenceVerdict::Duplicate
        } else {
            self.set(sequence);
            SequenceVerdict::Late
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SequenceVerdict::*;

    const NONE_LOST: SequenceVerdict = Fresh { lost: 0 };

    #[test]
    fn in_order_duplicates_gaps_and_late_fills() {
        let mut t = SequenceTracker::new(10);
        assert_eq!(t.observe(1, 1), NONE_LOST);
        assert_eq!(t.observe(1, 2), NONE_LOST);
        assert_eq!(t.observe(1, 2), Duplicate);
        assert_eq!(t.observe(1, 5), NONE_LOST, "3 and 4 may still come");
        assert_eq!(t.observe(1, 4), Late);
        assert_eq!(t.observe(1, 4), Duplicate);
        assert_eq!(t.observe(1, 1), Duplicate);
        assert_eq!(t.observe(1, 1000), NONE_LOST);
        assert_eq!(t.observe(1, 5), Duplicate, "still inside the window");
        assert_eq!(t.observe(1, 999), Late);
        // 3 and 6..=998 never came: they leave the window with this jump, and so do the
        // skipped 1001..=15_904 that never enter it.
        assert_eq!(
            t.observe(1, 20_000),
            Fresh {
                lost: 1 + 993 + (20_000 - 4096 - 1000)
            }
        );
        assert_eq!(t.observe(1, 1000), TooOld);
        assert_eq!(
            t.observe(1, 20_000 - 4095),
            Late,
            "the oldest slot still in the window"
        );
        assert_eq!(t.observe(1, 20_000 - 4096), TooOld);
        // Another publisher (a restart) has its own numbering.
        assert_eq!(t.observe(2, 1), NONE_LOST);
        assert_eq!(t.observe(2, 2), NONE_LOST);
    }

    /// A jump to the last slot of the window is not a whole window: the first number is
    /// still in it, so it comes again as a duplicate.
    #[test]
    fn a_jump_just_short_of_a_window_keeps_what_was_seen() {
        let mut t = SequenceTracker::new(10);
        assert_eq!(t.observe(1, 1), NONE_LOST);
        assert_eq!(t.observe(1, 4096), NONE_LOST);
        assert_eq!(t.observe(1, 1), Duplicate);
        assert_eq!(t.observe(1, 2), Late);
        assert_eq!(t.observe(1, 4097), NONE_LOST);
        assert_eq!(t.observe(1, 1), TooOld);
    }

    /// A tracker restored from its image tells duplicates, holes and restarts as the
    /// original does.
    #[test]
    fn a_restored_tracker_judges_as_the_original() {
        let mut t = SequenceTracker::new(10);
        for s in (1..=100).filter(|s| s % 10 != 0) {
            t.observe(1, s);
        }
        t.observe(2, 7);
        t.new_publisher_of(5, 1);
        let mut r = SequenceTracker::new(10);
        r.restore(t.image());
        for (p, s) in [(1, 99), (1, 50), (1, 101), (2, 7), (2, 8), (3, 1)] {
            assert_eq!(r.observe(p, s), t.observe(p, s), "({p}, {s})");
        }
        assert!(r.new_publisher_of(5, 9), "worker 5 had publisher 1");
    }

    #[test]
    fn joining_mid_stream_is_not_a_gap() {
        let mut t = SequenceTracker::new(10);
        assert_eq!(t.observe(9, 40_000), NONE_LOST);
        assert_eq!(t.observe(9, 40_001), NONE_LOST);
        // The numbers before 40_000 leave the window: never counted.
        for s in 40_002..50_000 {
            assert_eq!(t.observe(9, s), NONE_LOST, "{s}");
        }
        assert_eq!(
            t.observe(9, 49_999 + 4096),
            NONE_LOST,
            "a whole window ahead: nothing missing in the one it leaves, nothing skipped past"
        );
    }

    /// A number that arrives out of order (a `completed` before its `admitted`) is never lost.
    #[test]
    fn a_late_arrival_is_never_counted_lost() {
        let mut t = SequenceTracker::new(10);
        assert_eq!(t.observe(1, 1), NONE_LOST);
        assert_eq!(t.observe(1, 3), NONE_LOST);
        assert_eq!(t.observe(1, 2), Late);
        let lost: u64 = (4..10_000)
            .map(|s| match t.observe(1, s) {
                Fresh { lost } => lost,
                other => panic!("{s}: {other:?}"),
            })
            .sum();
        assert_eq!(lost, 0);
    }

    /// Skipped numbers that never come are counted once each, when they leave the window.
    #[test]
    fn a_real_loss_is_counted_when_it_leaves_the_window() {
        let mut t = SequenceTracker::new(10);
        let mut lost = 0;
        for s in (1..=10_000).filter(|s| !(100..105).contains(s)) {
            let Fresh { lost: l } = t.observe(1, s) else {
                panic!("{s}")
            };
            if l > 0 {
                assert!(
                    (100 + 4096..=104 + 4096).contains(&s),
                    "counted as each leaves: {s}"
                );
            }
            lost += l;
        }
        assert_eq!(lost, 5);
    }

    #[test]
    fn missing_counts_word_by_word_as_bit_by_bit() {
        let mut w = PublisherWindow::starting_at(5_000, 0);
        for s in (5_001..9_500).filter(|s| s % 7 != 0 && s % 64 != 3) {
            w.observe(s);
            let slow = (w.oldest()..=w.highest).filter(|&s| !w.is_set(s)).count();
            assert_eq!(w.missing(), slow as u64, "at {s}");
        }
    }

    #[test]
    fn missing_numbers_of_a_forgotten_publisher_are_lost() {
        let mut t = SequenceTracker::new(2);
        t.observe(1, 1);
        t.observe(1, 5); // 2..=4 missing
        t.observe(1, 3); // arrived late
        t.observe(2, 1);
        t.observe(3, 1); // full: the older half (publisher 1) goes
        assert!(!t.knows(1));
        assert_eq!(t.lost_evicted(), 2);
    }

    #[test]
    fn a_restart_is_a_new_publisher_on_a_worker_that_had_one() {
        let mut t = SequenceTracker::new(10);
        for worker in 0..5 {
            assert!(!t.new_publisher_of(worker, 100 + worker), "first sight");
        }
        assert!(t.new_publisher_of(3, 200), "worker 3's publisher restarted");
        assert!(
            !t.new_publisher_of(3, 200),
            "the same publisher again (forgotten, back)"
        );
    }

    #[test]
    fn workers_are_bounded_under_a_flood_of_new_publishers() {
        let mut t = SequenceTracker::new(100);
        for p in 0..10_000 {
            t.observe(p, 1);
            t.new_publisher_of(p, p);
            assert!(t.worker_publishers.len() <= 200);
        }
    }

    #[test]
    fn publishers_are_bounded_and_the_recent_ones_kept() {
        let mut t = SequenceTracker::new(100);
        for p in 0..10_000 {
            t.observe(p, 1);
            // Publisher 7 keeps talking: it is never the least recently heard.
            t.observe(7, p + 2);
        }
        assert!(t.len() <= 100);
        assert_eq!(t.evicted() + t.len() as u64, 10_000);
        assert!(t.knows(9_999) && t.knows(7) && !t.knows(0));
    }

    /// Past `max_publishers`, the least recently heard half goes at once (the median and
    /// older), then the new one is added.
    #[test]
    fn a_full_tracker_forgets_the_older_half_at_once() {
        let mut t = SequenceTracker::new(100);
        for p in 0..100 {
            t.observe(p, 1);
        }
        assert_eq!(
            (t.len(), t.evicted()),
            (100, 0),
            "full, nothing forgotten yet"
        );
        t.observe(100, 1);
        assert_eq!(
            (t.evicted(), t.len()),
            (51, 50),
            "51 forgotten, 49 kept, 1 added"
        );
        assert!(!t.knows(50) && t.knows(51) && t.knows(99) && t.knows(100));

        let mut t = SequenceTracker::new(1);
        t.observe(1, 1);
        t.observe(2, 1);
        assert_eq!((t.evicted(), t.len()), (1, 1));
        assert!(t.knows(2) && !t.knows(1));
        assert_eq!(SequenceTracker::new(0).max_publishers, 1, "at least one");
    }

    /// The worker map is pruned once it holds twice `max_publishers` workers, not before:
    /// until then a restart is told even for a worker whose publisher was forgotten.
    #[test]
    fn workers_are_pruned_only_at_twice_the_publisher_bound() {
        let mut t = SequenceTracker::new(100);
        for worker in 0..199 {
            assert!(!t.new_publisher_of(worker, 1_000 + worker));
        }
        assert!(
            t.new_publisher_of(150, 5),
            "worker 150 had another publisher"
        );
        assert!(!t.new_publisher_of(199, 1_199));
        assert_eq!(t.worker_publishers.len(), 200);
        t.new_publisher_of(200, 1_200);
        assert_eq!(
            t.worker_publishers.len(),
            1,
            "pruned: no other worker's publisher is tracked"
        );
    }
}

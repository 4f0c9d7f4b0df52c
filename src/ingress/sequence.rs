//! Per-publisher sequence tracking: duplicates, gaps and publisher restarts.
//!
//! Each publisher numbers its events from 1. A sliding window of the last 4,096 sequence
//! numbers (a ring of bits, 512 bytes per publisher) tells a duplicate (seen in the window)
//! from a late arrival that fills a hole: wide enough for a durable publisher's retries,
//! which land behind up to a window of outstanding acknowledgements, and for a stream that
//! stored a retried event twice during a failover.
//! A restarted publisher has a new id, so it starts a new window.

use hashbrown::HashMap;

const WINDOW: u64 = 4096;
const WORDS: usize = (WINDOW / 64) as usize;

/// What one `(publisher, sequence)` means.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SequenceVerdict {
    /// The next one, or ahead of it: `missing` numbers were skipped.
    Fresh { missing: u64 },
    /// Behind the highest, inside the window, not seen yet: fills a hole.
    Late,
    /// Seen already.
    Duplicate,
    /// Behind the window: cannot tell, so not applied.
    TooOld,
}

#[derive(Debug)]
struct PublisherWindow {
    highest: u64,
    /// Bit `s % WINDOW` set: sequence `s` (within `WINDOW` of `highest`) was seen.
    seen: Box<[u64; WORDS]>,
    last_used: u64,
}

/// The windows of every publisher heard from, bounded in number.
#[derive(Debug)]
pub struct SequenceTracker {
    publishers: HashMap<u64, PublisherWindow>,
    max_publishers: usize,
    clock: u64,
    evicted: u64,
}

impl SequenceTracker {
    pub fn new(max_publishers: usize) -> Self {
        Self {
            publishers: HashMap::new(),
            max_publishers: max_publishers.max(1),
            clock: 0,
            evicted: 0,
        }
    }

    /// Publishers forgotten to stay within the bound.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    pub fn len(&self) -> usize {
        self.publishers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.publishers.is_empty()
    }

    /// Whether `publisher` has been heard from (and not forgotten).
    pub fn knows(&self, publisher: u64) -> bool {
        self.publishers.contains_key(&publisher)
    }

    pub fn observe(&mut self, publisher: u64, sequence: u64) -> SequenceVerdict {
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
        SequenceVerdict::Fresh { missing: 0 }
    }

    /// Forgets the least recently heard half at once: a flood of new publisher ids then
    /// costs amortised O(1) each instead of a full scan each.
    fn evict_older_half(&mut self) {
        let mut ages: Vec<u64> = self.publishers.values().map(|w| w.last_used).collect();
        let middle = ages.len() / 2;
        let (_, cutoff, _) = ages.select_nth_unstable(middle);
        let cutoff = *cutoff;
        let before = self.publishers.len();
        self.publishers.retain(|_, w| w.last_used > cutoff);
        self.evicted += (before - self.publishers.len()) as u64;
    }
}

impl PublisherWindow {
    fn starting_at(sequence: u64, clock: u64) -> Self {
        let mut window = Self {
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

    fn observe(&mut self, sequence: u64) -> SequenceVerdict {
        if sequence > self.highest {
            let shift = sequence - self.highest;
            if shift >= WINDOW {
                self.seen.fill(0);
            } else {
                // The numbers skipped over reuse slots of ones that fell out of the window.
                for skipped in self.highest + 1..sequence {
                    let (word, mask) = Self::slot(skipped);
                    self.seen[word] &= !mask;
                }
            }
            self.set(sequence);
            self.highest = sequence;
            return SequenceVerdict::Fresh { missing: shift - 1 };
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

    #[test]
    fn in_order_duplicates_gaps_and_late_fills() {
        let mut t = SequenceTracker::new(10);
        assert_eq!(t.observe(1, 1), Fresh { missing: 0 });
        assert_eq!(t.observe(1, 2), Fresh { missing: 0 });
        assert_eq!(t.observe(1, 2), Duplicate);
        assert_eq!(t.observe(1, 5), Fresh { missing: 2 });
        assert_eq!(t.observe(1, 4), Late);
        assert_eq!(t.observe(1, 4), Duplicate);
        assert_eq!(t.observe(1, 1), Duplicate);
        assert_eq!(t.observe(1, 1000), Fresh { missing: 994 });
        assert_eq!(t.observe(1, 5), Duplicate, "still inside the window");
        assert_eq!(t.observe(1, 999), Late);
        assert_eq!(t.observe(1, 20_000), Fresh { missing: 18_999 });
        assert_eq!(t.observe(1, 1000), TooOld);
        assert_eq!(
            t.observe(1, 20_000 - 4095),
            Late,
            "the oldest slot still in the window"
        );
        assert_eq!(t.observe(1, 20_000 - 4096), TooOld);
        // Another publisher (a restart) has its own numbering.
        assert_eq!(t.observe(2, 1), Fresh { missing: 0 });
        assert_eq!(t.observe(2, 2), Fresh { missing: 0 });
    }

    #[test]
    fn joining_mid_stream_is_not_a_gap() {
        let mut t = SequenceTracker::new(10);
        assert_eq!(t.observe(9, 40_000), Fresh { missing: 0 });
        assert_eq!(t.observe(9, 40_001), Fresh { missing: 0 });
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
}

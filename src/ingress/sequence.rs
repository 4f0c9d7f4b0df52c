//! Per-publisher sequence tracking: duplicates, gaps and publisher restarts.
//!
//! Each publisher numbers its events from 1. A sliding window of the last 128 sequence
//! numbers tells a duplicate (seen in the window) from a late arrival that fills a hole.
//! A restarted publisher has a new id, so it starts a new window.

use hashbrown::HashMap;

const WINDOW: u64 = 128;

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
    /// Bit `i` set: `highest - i` was seen.
    seen: u128,
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
        self.publishers.insert(
            publisher,
            PublisherWindow {
                highest: sequence,
                seen: 1,
                last_used: clock,
            },
        );
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
    fn observe(&mut self, sequence: u64) -> SequenceVerdict {
        if sequence > self.highest {
            let shift = sequence - self.highest;
            self.seen = if shift >= WINDOW {
                0
            } else {
                self.seen << shift
            } | 1;
            let missing = shift - 1;
            self.highest = sequence;
            return SequenceVerdict::Fresh { missing };
        }
        let behind = self.highest - sequence;
        if behind >= WINDOW {
            return SequenceVerdict::TooOld;
        }
        let bit = 1u128 << behind;
        if self.seen & bit != 0 {
            SequenceVerdict::Duplicate
        } else {
            self.seen |= bit;
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
        assert_eq!(t.observe(1, 5), TooOld);
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

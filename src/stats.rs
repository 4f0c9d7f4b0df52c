//! The counters of one deployment's ingress: what arrived, what was applied, what was dropped
//! and why, and how late events are. Plain atomics, written by one ingress task and read by
//! the metrics exporter at scrape time.
//!
//! The accounting identity, checked by the tests and stated in README.md: every received
//! message is exactly one of applied (by kind), dropped (by reason) or held (waiting for the
//! admission it depends on), so `received == applied + dropped + held` whenever the ingress is
//! between bursts (the counts of a burst are added at its end).

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::histogram::{bucket, Histogram, HistogramFigures, LAG_BOUNDS_US};
use crate::wire::EventKind;

/// Why an event was not applied. What each reason means for a worker is stated once, in
/// schemas/README.md (`tests/wire_contract.rs` checks that list against [`DropReason::ALL`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum DropReason {
    /// The subject is not `{prefix}.{deployment}.{worker_id}`.
    Subject,
    /// Larger than the event size limit.
    Oversized,
    /// Not a decodable event: garbage, truncated, wrong field types.
    Decode,
    /// A wire version this router does not read.
    Version,
    /// An event kind this router does not know.
    UnknownKind,
    /// The body names another worker than its subject.
    Identity,
    /// Seen before (same publisher and sequence).
    Duplicate,
    /// The deployment's router was torn down.
    Late,
    /// About a request that is no longer live, or older than the sequence window.
    Stale,
    /// A bounded buffer (tombstones, held events, publishers) was full.
    Overflow,
    /// A `progressed` or `completed` held for an admission that did not arrive in time.
    Unmatched,
}

impl DropReason {
    /// Every reason, in the order of the metrics' series.
    pub const ALL: [DropReason; 11] = [
        Self::Subject,
        Self::Oversized,
        Self::Decode,
        Self::Version,
        Self::UnknownKind,
        Self::Identity,
        Self::Duplicate,
        Self::Late,
        Self::Stale,
        Self::Overflow,
        Self::Unmatched,
    ];

    /// The metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Subject => "subject",
            Self::Oversized => "oversized",
            Self::Decode => "decode",
            Self::Version => "version",
            Self::UnknownKind => "unknown_kind",
            Self::Identity => "identity",
            Self::Duplicate => "duplicate",
            Self::Late => "late",
            Self::Stale => "stale",
            Self::Overflow => "overflow",
            Self::Unmatched => "unmatched",
        }
    }

    /// The position in [`DropReason::ALL`] (a match, not a search: this runs per event).
    fn index(self) -> usize {
        self as usize
    }

    pub(crate) fn from_decode(reason: &crate::wire::DecodeEventError) -> Self {
        use crate::wire::DecodeEventError as E;
        match reason {
            E::Oversized { .. } => Self::Oversized,
            E::Malformed(_) => Self::Decode,
            E::UnsupportedVersion { .. } => Self::Version,
            E::UnknownKind { .. } => Self::UnknownKind,
        }
    }
}

pub(crate) const EVENT_KINDS: [EventKind; EventKind::ALL.len()] = EventKind::ALL;

fn kind_index(kind: EventKind) -> usize {
    kind as usize
}

/// The publish-to-apply lag histogram, a field of [`IngressStats`] (which derives `Default`).
#[derive(Debug)]
pub(crate) struct LagHistogram(Histogram);

impl Default for LagHistogram {
    fn default() -> Self {
        Self(Histogram::new(&LAG_BOUNDS_US))
    }
}

/// The per-event counts of a batch of messages, kept in plain fields by the one task that
/// applies them and added to [`IngressStats`] once per batch: three or four atomic
/// increments per event cost about as much as a lease update.
#[derive(Debug, Default)]
pub(crate) struct PendingCounts {
    received: u64,
    batches: u64,
    batched_events: u64,
    applied: [u64; EVENT_KINDS.len()],
    dropped: [u64; DropReason::ALL.len()],
    /// Events held now by the applier, and what of it [`IngressStats`] shows already: the
    /// gauge moves by the difference, so appliers that share the stats add up.
    held: u64,
    held_shown: u64,
    lag_buckets: [u64; LAG_BOUNDS_US.len() + 1],
    lag_sum_us: u64,
    lag_count: u64,
}

impl PendingCounts {
    pub(crate) fn received(&mut self) {
        self.received += 1;
    }

    /// A batch message declaring `events` events (each is also counted as received).
    pub(crate) fn batch(&mut self, events: usize) {
        self.batches += 1;
        self.batched_events += events as u64;
    }

    pub(crate) fn applied(&mut self, kind: EventKind) {
        self.applied[kind_index(kind)] += 1;
    }

    /// `n` events of `kind` applied at once: held ones, when their admission arrives.
    pub(crate) fn applied_n(&mut self, kind: EventKind, n: u64) {
        self.applied[kind_index(kind)] += n;
    }

    pub(crate) fn dropped(&mut self, reason: DropReason) {
        self.dropped[reason.index()] += 1;
    }

    /// `n` events dropped at once: held ones, released without being applied.
    pub(crate) fn dropped_n(&mut self, reason: DropReason, n: u64) {
        self.dropped[reason.index()] += n;
    }

    /// How many events the applier holds now (shown at the next flush).
    pub(crate) fn set_held(&mut self, held: u64) {
        self.held = held;
    }

    pub(crate) fn lag_us(&mut self, lag_us: u64) {
        self.lag_buckets[bucket(&LAG_BOUNDS_US, lag_us)] += 1;
        self.lag_sum_us += lag_us;
        self.lag_count += 1;
    }

    /// Adds everything to `stats` and starts again from zero.
    pub(crate) fn flush(&mut self, stats: &IngressStats) {
        fn add(counter: &AtomicU64, n: &mut u64) {
            if *n > 0 {
                counter.fetch_add(std::mem::take(n), Ordering::Relaxed);
            }
        }
        add(&stats.received, &mut self.received);
        add(&stats.batches, &mut self.batches);
        add(&stats.batched_events, &mut self.batched_events);
        for (counter, n) in stats.applied.iter().zip(&mut self.applied) {
            add(counter, n);
        }
        for (counter, n) in stats.dropped.iter().zip(&mut self.dropped) {
            add(counter, n);
        }
        if self.held > self.held_shown {
            stats
                .held
                .fetch_add(self.held - self.held_shown, Ordering::Relaxed);
        } else if self.held < self.held_shown {
            stats
                .held
                .fetch_sub(self.held_shown - self.held, Ordering::Relaxed);
        }
        self.held_shown = self.held;
        stats.lag.0.add(
            &mut self.lag_buckets,
            &mut self.lag_sum_us,
            &mut self.lag_count,
        );
    }
}

/// Counters of one deployment's ingress.
#[derive(Debug, Default)]
pub struct IngressStats {
    received: AtomicU64,
    batches: AtomicU64,
    batched_events: AtomicU64,
    applied: [AtomicU64; EVENT_KINDS.len()],
    dropped: [AtomicU64; DropReason::ALL.len()],
    /// A gauge: events held now by the appliers writing these stats.
    held: AtomicU64,
    gaps: AtomicU64,
    reorders_held: AtomicU64,
    publisher_restarts: AtomicU64,
    publishers_evicted: AtomicU64,
    lag: LagHistogram,
}

/// A point-in-time copy of [`IngressStats`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct IngressFigures {
    /// Events received: one per single-event message, one per event a batch declares.
    pub received: u64,
    /// Batch messages received (wire 1.2), readable or not.
    pub batches: u64,
    /// Events those batches declared (included in `received`).
    pub batched_events: u64,
    /// By event kind label.
    pub applied: Vec<(&'static str, u64)>,
    /// By drop reason label.
    pub dropped: Vec<(&'static str, u64)>,
    /// Events held now: a `progressed` or `completed` waiting for its admission. Each leaves
    /// as applied or dropped, so `received == applied + dropped + held`.
    pub held: u64,
    /// Sequence numbers that will not arrive any more: they left their publisher's window
    /// (4,096 numbers) unseen, or the publisher was forgotten with them missing. A number
    /// that arrives late, within the window, is never counted.
    pub gaps: u64,
    /// Events that entered the hold (cumulative); see `held` for those still in it.
    pub reorders_held: u64,
    /// Publisher ids heard on a worker subject that had another publisher id before.
    pub publisher_restarts: u64,
    /// Publishers whose sequence windows were forgotten because `max_publishers` were
    /// tracked: their duplicates are no longer recognised.
    pub publishers_evicted: u64,
    /// Publish-to-apply lag of live events (not recorded while replaying).
    pub lag: HistogramFigures,
}

impl IngressFigures {
    /// Events of this kind applied.
    pub fn applied(&self, kind: EventKind) -> u64 {
        lookup(&self.applied, kind.as_str())
    }

    /// Events applied, all kinds.
    pub fn applied_total(&self) -> u64 {
        self.applied.iter().map(|(_, n)| n).sum()
    }

    /// Events dropped for this reason.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        lookup(&self.dropped, reason.as_str())
    }

    /// Events dropped, all reasons.
    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().map(|(_, n)| n).sum()
    }

    /// What the identity adds up to: equal to `received` whenever the ingress is between
    /// bursts.
    pub fn accounted(&self) -> u64 {
        self.applied_total() + self.dropped_total() + self.held
    }
}

fn lookup(pairs: &[(&'static str, u64)], key: &str) -> u64 {
    pairs.iter().find(|(k, _)| *k == key).map_or(0, |(_, n)| *n)
}

impl IngressStats {
    /// Counters all at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// One drop counted at once (the applier batches its drops in [`PendingCounts`]).
    #[cfg(test)]
    pub(crate) fn dropped(&self, reason: DropReason) {
        self.dropped[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn gaps(&self, missing: u64) {
        self.gaps.fetch_add(missing, Ordering::Relaxed);
    }

    pub(crate) fn reorder_held(&self) {
        self.reorders_held.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn publisher_restart(&self) {
        self.publisher_restarts.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn publishers_evicted(&self, n: u64) {
        self.publishers_evicted.fetch_add(n, Ordering::Relaxed);
    }

    #[cfg(test)]
    pub(crate) fn lag(&self) -> &Histogram {
        &self.lag.0
    }

    /// A point-in-time copy of the counters.
    pub fn snapshot(&self) -> IngressFigures {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        IngressFigures {
            received: get(&self.received),
            batches: get(&self.batches),
            batched_events: get(&self.batched_events),
            applied: EVENT_KINDS
                .iter()
                .zip(&self.applied)
                .map(|(k, c)| (k.as_str(), get(c)))
                .collect(),
            dropped: DropReason::ALL
                .iter()
                .zip(&self.dropped)
                .map(|(r, c)| (r.as_str(), get(c)))
                .collect(),
            held: get(&self.held),
            gaps: get(&self.gaps),
            reorders_held: get(&self.reorders_held),
            publisher_restarts: get(&self.publisher_restarts),
            publishers_evicted: get(&self.publishers_evicted),
            lag: self.lag.0.snapshot(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_by_label() {
        let stats = IngressStats::new();
        stats.dropped(DropReason::Late);
        stats.dropped(DropReason::Late);
        let mut pending = PendingCounts::default();
        pending.received();
        pending.applied(EventKind::Completed);
        pending.lag_us(700);
        // Past the last bound: the pending counts have the +Inf bucket too.
        pending.lag_us(60_000_000);
        assert_eq!(
            stats.snapshot().received,
            0,
            "nothing is shown before the flush"
        );
        pending.flush(&stats);
        pending.flush(&stats);
        let s = stats.snapshot();
        assert_eq!(s.received, 1);
        assert_eq!((s.lag.count, s.lag.buckets[3]), (2, (0.001, 1)));
        assert_eq!(
            s.lag.buckets.last().map(|(_, n)| *n),
            Some(1),
            "+Inf holds the 60 s one"
        );
        assert_eq!(s.dropped(DropReason::Late), 2);
        assert_eq!(s.dropped_total(), 2);
        assert_eq!(s.applied(EventKind::Completed), 1);
        assert_eq!(s.applied(EventKind::Admitted), 0);
    }

    #[test]
    fn reasons_are_listed_in_index_order() {
        for (i, reason) in DropReason::ALL.into_iter().enumerate() {
            assert_eq!(reason.index(), i, "{reason:?}");
        }
    }

    #[test]
    fn held_gauge_moves_by_difference_and_appliers_add_up() {
        let stats = IngressStats::new();
        let (mut a, mut b) = (PendingCounts::default(), PendingCounts::default());
        a.set_held(3);
        b.set_held(2);
        a.flush(&stats);
        b.flush(&stats);
        assert_eq!(stats.snapshot().held, 5);
        a.set_held(1);
        a.dropped_n(DropReason::Unmatched, 2);
        a.flush(&stats);
        let s = stats.snapshot();
        assert_eq!((s.held, s.dropped(DropReason::Unmatched)), (3, 2));
    }
}

//! How far a durable ingress has caught up, and the figures of its stream and snapshots:
//! shared by the ingress, the snapshot writer, `/readyz` and the metrics.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::info;

/// Progress of a durable ingress's catch-up and the state of its stream, shared with
/// `/readyz` and the metrics.
#[derive(Debug, Default)]
pub struct CatchUpState {
    caught_up: AtomicBool,
    pub(super) replayed: AtomicU64,
    micros: AtomicU64,
    pub(super) last_stream_sequence: AtomicU64,
    pub(super) consumer_recreations: AtomicU64,
    truncated_events: AtomicU64,
    last_truncation: Mutex<Option<std::time::Instant>>,
    pub(super) stream: Mutex<Option<StreamFigures>>,
    pub(crate) snapshots: SnapshotCounters,
    notify: Notify,
}

/// What became of this replica's snapshots, written and loaded.
#[derive(Debug, Default)]
pub(crate) struct SnapshotCounters {
    pub written: AtomicU64,
    pub failed: AtomicU64,
    /// Size of the last one written.
    pub bytes: AtomicU64,
    /// Stream sequence of the last one written.
    pub sequence: AtomicU64,
    /// Stream sequence of the one loaded at start (0: none).
    pub loaded_sequence: AtomicU64,
    /// Leases it held.
    pub loaded_leases: AtomicU64,
    /// Starts that found no snapshot.
    pub missing: AtomicU64,
    /// Starts whose snapshot was unreadable, partial, corrupt or of another stream.
    pub invalid: AtomicU64,
}

/// A copy of [`CatchUpState`]'s snapshot counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotFigures {
    /// Snapshots this replica wrote.
    pub written: u64,
    /// Snapshot writes that failed, and failed attempts to open the snapshot buckets after
    /// they could not be opened at start.
    pub failed: u64,
    /// Size in bytes of the last snapshot written.
    pub last_bytes: u64,
    /// Stream sequence of the last snapshot written.
    pub last_sequence: u64,
    /// Stream sequence of the snapshot loaded at start (0: none).
    pub loaded_sequence: u64,
    /// Leases the loaded snapshot held.
    pub loaded_leases: u64,
    /// Starts that found no snapshot.
    pub missing: u64,
    /// Starts whose snapshot was unreadable, partial, corrupt or of another stream.
    pub invalid: u64,
}

/// The deployment's stream as last read from the server, next to its limits.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StreamFigures {
    /// Bytes the stream holds.
    pub bytes: u64,
    /// Events (messages) the stream holds.
    pub messages: u64,
    /// Sequence of the oldest message held.
    pub first_sequence: u64,
    /// Sequence of the newest message held.
    pub last_sequence: u64,
    /// Age of the oldest event held (zero when empty).
    pub oldest_age: Duration,
    /// The limits the stream was configured with (`max_bytes` -1: none).
    pub max_bytes: i64,
    /// The stream's configured age limit.
    pub max_age: Duration,
}

impl CatchUpState {
    /// A state that has not caught up yet, with all counters at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// True once catch-up has finished (the replay reached the stream's end at start).
    pub fn is_caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire)
    }

    /// Events applied during catch-up.
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Ordering::Relaxed)
    }

    /// How long catch-up took (0 until it is done).
    pub fn duration(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::Relaxed))
    }

    /// The last stream sequence applied.
    pub fn last_stream_sequence(&self) -> u64 {
        self.last_stream_sequence.load(Ordering::Relaxed)
    }

    /// Times the consumer was lost and recreated.
    pub fn consumer_recreations(&self) -> u64 {
        self.consumer_recreations.load(Ordering::Relaxed)
    }

    /// Events this replica needed (the next stream sequence it expected, and those after)
    /// that the stream no longer held when it read on: discarded by the stream's limits.
    /// Leases they admitted or ended are missing or linger until they expire.
    pub fn truncated_events(&self) -> u64 {
        self.truncated_events.load(Ordering::Relaxed)
    }

    /// How long ago the stream last turned out truncated, if it ever did.
    pub fn since_truncation(&self) -> Option<Duration> {
        self.last_truncation.lock().map(|at| at.elapsed())
    }

    /// Snapshots written and loaded by this replica.
    pub fn snapshot_figures(&self) -> SnapshotFigures {
        let s = &self.snapshots;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SnapshotFigures {
            written: get(&s.written),
            failed: get(&s.failed),
            last_bytes: get(&s.bytes),
            last_sequence: get(&s.sequence),
            loaded_sequence: get(&s.loaded_sequence),
            loaded_leases: get(&s.loaded_leases),
            missing: get(&s.missing),
            invalid: get(&s.invalid),
        }
    }

    /// The stream's size and age next to its limits, refreshed every few seconds.
    pub fn stream_figures(&self) -> Option<StreamFigures> {
        *self.stream.lock()
    }

    pub(super) fn truncated(&self, events: u64) {
        self.truncated_events.fetch_add(events, Ordering::Relaxed);
        *self.last_truncation.lock() = Some(std::time::Instant::now());
    }

    /// Resolves once catch-up is done.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_caught_up() {
                return;
            }
            notified.await;
        }
    }

    pub(super) fn finish(&self, started: Instant) {
        self.micros
            .store(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.caught_up.store(true, Ordering::Release);
        self.notify.notify_waiters();
        info!(
            replayed = self.replayed(),
            seconds = self.duration().as_secs_f64(),
            "catch-up done: following live events"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the ingress and the snapshot writer record is what the accessors read.
    #[test]
    fn the_accessors_read_what_was_recorded() {
        let state = CatchUpState::new();
        assert_eq!(state.since_truncation(), None);
        assert_eq!(state.stream_figures(), None);
        state.replayed.store(7, Ordering::Relaxed);
        state.last_stream_sequence.store(42, Ordering::Relaxed);
        state.consumer_recreations.store(2, Ordering::Relaxed);
        state.truncated(3);
        state.truncated(2);
        let figures = StreamFigures {
            bytes: 100,
            messages: 5,
            ..StreamFigures::default()
        };
        *state.stream.lock() = Some(figures);
        state.snapshots.written.store(2, Ordering::Relaxed);
        state.snapshots.loaded_leases.store(9, Ordering::Relaxed);
        assert_eq!(state.replayed(), 7);
        assert_eq!(state.last_stream_sequence(), 42);
        assert_eq!(state.consumer_recreations(), 2);
        assert_eq!(state.truncated_events(), 5);
        assert!(state
            .since_truncation()
            .is_some_and(|d| d < Duration::from_secs(60)));
        assert_eq!(state.stream_figures(), Some(figures));
        let snapshots = state.snapshot_figures();
        assert_eq!((snapshots.written, snapshots.loaded_leases), (2, 9));
    }

    /// `wait` returns once catch-up is done, also for a waiter that came first.
    #[tokio::test]
    async fn wait_ends_when_caught_up() {
        let state = std::sync::Arc::new(CatchUpState::new());
        let waiter = tokio::spawn({
            let state = state.clone();
            async move { state.wait().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        assert!(!state.is_caught_up());
        assert_eq!(state.duration(), Duration::ZERO, "0 until done");
        state.finish(Instant::now() - Duration::from_millis(5));
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter ends")
            .unwrap();
        assert!(state.is_caught_up());
        assert!(state.duration() >= Duration::from_millis(5));
        state.wait().await;
    }
}

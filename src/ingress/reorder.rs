//! Short-lived, bounded memory of requests whose events arrived out of order: tombstones of
//! requests completed before their admission arrived, and progress held until it does.
//!
//! Each entry counts the events it stands for, and every way out (taken, expired, evicted,
//! displaced, forgotten) reports that count: the applier accounts each held event exactly once.
//! An entry restored from a snapshot ([`HeldImage`]) stands for no event of this replica (the
//! writer received and counted them) but acts as the writer's did: a late replica judges a
//! late admission as the replica that heard the early completion.

use std::collections::VecDeque;
use std::time::Duration;

use hashbrown::HashMap;
use tokio::time::Instant;

use crate::types::{RequestId, WorkerWithDpRank};

/// Entries by request id that expire after a fixed time, at most `capacity` of them.
///
/// Insertion order is expiry order (one TTL for all), so expiring is popping the front.
#[derive(Debug)]
pub(super) struct ExpiringMap {
    entries: HashMap<RequestId, Entry>,
    /// One slot per insertion, in expiry order: the request, when it expires, and the
    /// insertion's number. Only the slot whose number its entry still has stands for it.
    order: VecDeque<(RequestId, Instant, u64)>,
    /// The number the next insertion gets.
    next_slot: u64,
    ttl: Duration,
    capacity: usize,
    /// Events of all entries.
    events: u64,
    /// Events of entries that expired, not yet collected by [`ExpiringMap::take_expired`].
    expired: u64,
}

#[derive(Debug)]
struct Entry {
    worker: WorkerWithDpRank,
    expires: Instant,
    /// The number of the insertion that last (re)set it: its slot in the order queue. Not
    /// the expiry time, which two insertions of the same id can share (a coarse or paused
    /// clock): then a stale slot would stand for the live entry, and never be compacted.
    slot: u64,
    /// Events this entry stands for: the same request held again adds one.
    events: u64,
    /// The highest output token count of the held `progressed` events (0 for tombstones),
    /// applied with them when the admission arrives.
    output_tokens: u32,
}

/// What [`ExpiringMap::insert`] had to do to stay within its bound.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum InsertOutcome {
    Inserted,
    /// The oldest entry was evicted to make room; it stood for `events` events.
    EvictedOldest {
        events: u64,
    },
    /// An entry of the same request on another worker was replaced; it stood for `events`.
    Displaced {
        events: u64,
    },
}

/// What a snapshot keeps of an [`ExpiringMap`]: its live entries in expiry order, each with
/// the time it had left.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct HeldImage {
    /// `(request id, worker, dp rank, milliseconds left, output tokens)`.
    entries: Vec<(String, u64, u32, u64, u32)>,
}

impl ExpiringMap {
    pub(super) fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            order: VecDeque::new(),
            next_slot: 0,
            ttl,
            capacity: capacity.max(1),
            events: 0,
            expired: 0,
        }
    }

    /// Events held by all entries (expired ones not yet removed included).
    pub(super) fn events(&self) -> u64 {
        self.events
    }

    /// The live entries, for a snapshot.
    pub(super) fn image(&self, now: Instant) -> HeldImage {
        let entries = self
            .order
            .iter()
            .filter_map(|(id, _, slot)| {
                let e = self.entries.get(id).filter(|e| e.slot == *slot)?;
                let left = e.expires.checked_duration_since(now)?;
                if left.is_zero() {
                    return None;
                }
                let left_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
                Some((
                    id.as_str().to_owned(),
                    e.worker.worker_id.0,
                    e.worker.dp_rank.0,
                    left_ms,
                    e.output_tokens,
                ))
            })
            .collect();
        HeldImage { entries }
    }

    /// Adds a snapshot's entries, each for the time it had left (at most the TTL), standing
    /// for no event of this replica. Within the bound: past it the oldest are left out.
    pub(super) fn restore(&mut self, image: HeldImage, now: Instant) {
        let room = self.capacity.saturating_sub(self.entries.len());
        let skip = image.entries.len().saturating_sub(room);
        for (id, worker, rank, left_ms, output_tokens) in image.entries.into_iter().skip(skip) {
            let request_id = RequestId::from(id);
            if self.entries.contains_key(&request_id) {
                continue;
            }
            let expires = now + Duration::from_millis(left_ms).min(self.ttl);
            let slot = self.next_slot;
            self.next_slot += 1;
            self.order.push_back((request_id.clone(), expires, slot));
            let entry = Entry {
                worker: WorkerWithDpRank::new(worker, rank),
                expires,
                slot,
                events: 0,
                output_tokens,
            };
            self.entries.insert(request_id, entry);
        }
        // The queue must stay in expiry order (expiring pops its front), also where the
        // snapshot's entries join entries of this replica or come capped by a shorter TTL.
        self.order
            .make_contiguous()
            .sort_by_key(|(_, expires, slot)| (*expires, *slot));
    }

    /// Events of the entries that expired since the last call.
    pub(super) fn take_expired(&mut self) -> u64 {
        std::mem::take(&mut self.expired)
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Remembers one event of `request_id` on `worker` until the TTL passes (an entry of
    /// the same request and worker counts one event more and lives on from now).
    pub(super) fn insert(
        &mut self,
        request_id: RequestId,
        worker: WorkerWithDpRank,
        now: Instant,
    ) -> InsertOutcome {
        self.insert_progress(request_id, worker, 0, now)
    }

    /// [`ExpiringMap::insert`] of a `progressed` with `output_tokens` so far: the entry keeps
    /// the highest count of the events it holds.
    pub(super) fn insert_progress(
        &mut self,
        request_id: RequestId,
        worker: WorkerWithDpRank,
        mut output_tokens: u32,
        now: Instant,
    ) -> InsertOutcome {
        let expires = now + self.ttl;
        self.expire(now);
        let mut outcome = InsertOutcome::Inserted;
        let mut events = 1;
        match self.entries.get(&request_id) {
            Some(old) if old.worker == worker => {
                events += old.events;
                output_tokens = output_tokens.max(old.output_tokens);
            }
            Some(old) => {
                outcome = InsertOutcome::Displaced { events: old.events };
                self.events -= old.events;
            }
            None if self.entries.len() >= self.capacity => {
                // Slots of taken or renewed entries are skipped: one live entry must go.
                let mut evicted = None;
                while evicted.is_none() && !self.order.is_empty() {
                    evicted = self.pop_oldest();
                }
                outcome = InsertOutcome::EvictedOldest {
                    events: evicted.unwrap_or(0),
                };
            }
            None => {}
        }
        if self.order.len() >= 2 * self.capacity {
            // Slots of taken entries pile up under churn: keep the queue bounded too.
            let entries = &self.entries;
            self.order
                .retain(|(id, _, slot)| entries.get(id).is_some_and(|x| x.slot == *slot));
        }
        let slot = self.next_slot;
        self.next_slot += 1;
        self.order.push_back((request_id.clone(), expires, slot));
        // The same worker's earlier events are in `events` already.
        self.events += 1;
        let entry = Entry {
            worker,
            expires,
            slot,
            events,
            output_tokens,
        };
        self.entries.insert(request_id, entry);
        outcome
    }

    /// Takes the live entry of `request_id` if it names `worker`: how many events it stood
    /// for (`None`: there was none; `Some(0)`: one restored from a snapshot).
    pub(super) fn take(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
        now: Instant,
    ) -> Option<u64> {
        self.take_progress(request_id, worker, now)
            .map(|(events, _)| events)
    }

    /// [`ExpiringMap::take`], with the highest output token count the entry held.
    pub(super) fn take_progress(
        &mut self,
        request_id: &str,
        worker: WorkerWithDpRank,
        now: Instant,
    ) -> Option<(u64, u32)> {
        if self.entries.is_empty() {
            // The common case, on every admission.
            return None;
        }
        self.expire(now);
        match self.entries.get(request_id) {
            Some(entry) if entry.worker == worker => {
                let taken = (entry.events, entry.output_tokens);
                self.entries.remove(request_id);
                self.events -= taken.0;
                Some(taken)
            }
            _ => None,
        }
    }

    /// Whether a live entry for `request_id` on `worker` exists.
    pub(super) fn contains(
        &self,
        request_id: &str,
        worker: WorkerWithDpRank,
        now: Instant,
    ) -> bool {
        self.entries
            .get(request_id)
            .is_some_and(|e| e.worker == worker && e.expires > now)
    }

    /// Forgets every entry of the workers `reset` covers; returns how many events they
    /// stood for.
    pub(super) fn forget_worker(&mut self, reset: impl Fn(WorkerWithDpRank) -> bool) -> u64 {
        let mut forgotten = 0;
        self.entries.retain(|_, e| {
            let covered = reset(e.worker);
            if covered {
                forgotten += e.events;
            }
            !covered
        });
        self.events -= forgotten;
        forgotten
    }

    /// Drops expired entries (their events are collected by [`ExpiringMap::take_expired`]);
    /// returns how many entries.
    pub(super) fn expire(&mut self, now: Instant) -> usize {
        let mut expired = 0;
        while let Some((_, expires, _)) = self.order.front() {
            if *expires > now {
                break;
            }
            if let Some(events) = self.pop_oldest() {
                self.expired += events;
                expired += 1;
            }
        }
        expired
    }

    /// Pops the front of the order queue; returns the events of the live entry it removed
    /// (`None`: the slot stood for none).
    fn pop_oldest(&mut self) -> Option<u64> {
        let (request_id, _, slot) = self.order.pop_front()?;
        // The queue may hold entries already taken or re-inserted later: only remove the
        // map entry this queue slot stands for.
        match self.entries.get(&request_id) {
            Some(e) if e.slot == slot => {
                let events = e.events;
                self.entries.remove(&request_id);
                self.events -= events;
                Some(events)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, 0)
    }

    #[tokio::test(start_paused = true)]
    async fn entries_expire_after_ttl() {
        let mut m = ExpiringMap::new(Duration::from_secs(10), 100);
        assert!(m.is_empty());
        m.insert("a".into(), w(1), Instant::now());
        assert!(!m.is_empty(), "the applier expires nothing in an empty map");
        tokio::time::advance(Duration::from_secs(5)).await;
        m.insert("b".into(), w(1), Instant::now());
        assert!(m.contains("a", w(1), Instant::now()));
        assert!(
            !m.contains("a", w(2), Instant::now()),
            "another worker's request"
        );
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(m.take("a", w(1), Instant::now()), None, "expired");
        assert_eq!(m.take_expired(), 1, "the expired event is reported once");
        assert_eq!(m.take_expired(), 0);
        assert_eq!(m.take("b", w(1), Instant::now()), Some(1));
        assert!(m.is_empty());
        assert_eq!(m.events(), 0);
    }

    #[tokio::test]
    async fn every_held_event_leaves_once() {
        let mut m = ExpiringMap::new(Duration::from_secs(60), 2);
        assert_eq!(
            m.insert("a".into(), w(1), Instant::now()),
            InsertOutcome::Inserted
        );
        assert_eq!(
            m.insert("a".into(), w(1), Instant::now()),
            InsertOutcome::Inserted
        );
        assert_eq!((m.len(), m.events()), (1, 2), "one entry, two events");
        assert_eq!(
            m.insert("a".into(), w(2), Instant::now()),
            InsertOutcome::Displaced { events: 2 },
            "the same request on another worker"
        );
        assert_eq!(
            m.insert("b".into(), w(3), Instant::now()),
            InsertOutcome::Inserted
        );
        assert_eq!(
            m.insert("b".into(), w(3), Instant::now()),
            InsertOutcome::Inserted
        );
        assert_eq!(
            m.insert("c".into(), w(1), Instant::now()),
            InsertOutcome::EvictedOldest { events: 1 },
            "a (on worker 2) was the oldest"
        );
        assert_eq!(m.events(), 3);
        assert_eq!(m.forget_worker(|x| x == w(3)), 2);
        assert_eq!(m.take("c", w(1), Instant::now()), Some(1));
        assert_eq!((m.len(), m.events()), (0, 0));
    }

    #[tokio::test]
    async fn bounded_by_evicting_the_oldest() {
        let mut m = ExpiringMap::new(Duration::from_secs(60), 3);
        for i in 0..3 {
            assert_eq!(
                m.insert(format!("r{i}").into(), w(1), Instant::now()),
                InsertOutcome::Inserted
            );
        }
        assert_eq!(
            m.insert("r3".into(), w(1), Instant::now()),
            InsertOutcome::EvictedOldest { events: 1 }
        );
        assert_eq!(m.len(), 3);
        assert!(!m.contains("r0", w(1), Instant::now()));
        assert!(m.contains("r3", w(1), Instant::now()));
    }

    /// Issue 18: a `take` leaves its slot at the front of the order queue; a full map must
    /// still evict a live entry, not just that stale slot, and say what it evicted.
    #[tokio::test]
    async fn a_taken_slot_at_the_front_does_not_let_the_map_pass_its_bound() {
        let mut m = ExpiringMap::new(Duration::from_secs(60), 3);
        for i in 0..3 {
            m.insert(format!("r{i}").into(), w(1), Instant::now());
        }
        assert_eq!(m.take("r0", w(1), Instant::now()), Some(1));
        assert_eq!(
            m.insert("r3".into(), w(1), Instant::now()),
            InsertOutcome::Inserted
        );
        assert_eq!(
            m.insert("r4".into(), w(1), Instant::now()),
            InsertOutcome::EvictedOldest { events: 1 },
            "r1, the oldest live entry, not r0's stale slot"
        );
        assert_eq!((m.len(), m.events()), (3, 3));
        assert!(!m.contains("r1", w(1), Instant::now()));
        for id in ["r2", "r3", "r4"] {
            assert!(m.contains(id, w(1), Instant::now()), "{id}");
        }
    }

    /// A snapshot keeps each live entry with the time it had left; the restored entries act
    /// as the writer's (found, taken with their output count, expiring on time) but stand
    /// for no event of the replica that restores them.
    #[tokio::test(start_paused = true)]
    async fn an_image_restores_the_entries_with_their_time_left_and_no_events() {
        let mut m = ExpiringMap::new(Duration::from_secs(10), 10);
        m.insert("a".into(), w(1), Instant::now());
        tokio::time::advance(Duration::from_secs(4)).await;
        m.insert_progress("b".into(), WorkerWithDpRank::new(2, 3), 7, Instant::now());
        m.insert("gone".into(), w(1), Instant::now());
        m.take("gone", w(1), Instant::now());
        tokio::time::advance(Duration::from_secs(2)).await;
        let image = m.image(Instant::now());
        assert_eq!(
            image.entries,
            vec![
                ("a".to_owned(), 1, 0, 4_000, 0),
                ("b".to_owned(), 2, 3, 8_000, 7)
            ],
            "live entries in expiry order, taken ones left out"
        );

        let mut late = ExpiringMap::new(Duration::from_secs(10), 10);
        late.insert("own".into(), w(5), Instant::now());
        late.restore(image.clone(), Instant::now());
        assert_eq!(
            (late.len(), late.events()),
            (3, 1),
            "restored entries hold no event"
        );
        assert!(late.contains("a", w(1), Instant::now()));
        assert_eq!(
            late.take("a", w(2), Instant::now()),
            None,
            "another worker's request"
        );
        tokio::time::advance(Duration::from_millis(3_999)).await;
        assert!(
            late.contains("a", w(1), Instant::now()),
            "just before its time is up"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(late.expire(Instant::now()), 1, "a, at its time");
        assert_eq!(late.take_expired(), 0, "it stood for no event here");
        assert_eq!(
            late.take_progress("b", WorkerWithDpRank::new(2, 3), Instant::now()),
            Some((0, 7)),
            "found, with its output count"
        );
        assert_eq!(late.take("own", w(5), Instant::now()), Some(1));

        // A shorter TTL caps the time left; the bound keeps the newest entries.
        let mut short = ExpiringMap::new(Duration::from_secs(1), 10);
        short.restore(image.clone(), Instant::now());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(short.expire(Instant::now()), 2, "both after the 1 s TTL");
        let mut small = ExpiringMap::new(Duration::from_secs(10), 1);
        small.restore(image, Instant::now());
        assert_eq!(small.len(), 1);
        assert!(
            small.contains("b", WorkerWithDpRank::new(2, 3), Instant::now()),
            "the newest is kept"
        );
        assert_eq!(
            small.insert("c".into(), w(1), Instant::now()),
            InsertOutcome::EvictedOldest { events: 0 },
            "a full map of restored entries evicts one of them, no event"
        );
        assert_eq!((small.len(), small.events()), (1, 1));
        assert!(small.contains("c", w(1), Instant::now()));
    }

    /// A restored entry's slot is its own: taken and held again, the request lives a full
    /// TTL from then, not until the restored entry's time was up.
    #[tokio::test(start_paused = true)]
    async fn a_restored_entry_taken_and_held_again_lives_a_full_ttl() {
        let ttl = Duration::from_secs(10);
        let mut writer = ExpiringMap::new(ttl, 10);
        writer.insert("a".into(), w(1), Instant::now());
        tokio::time::advance(Duration::from_secs(9)).await;
        let image = writer.image(Instant::now());
        let mut m = ExpiringMap::new(ttl, 10);
        m.restore(image, Instant::now());
        assert_eq!(m.take("a", w(1), Instant::now()), Some(0));
        m.insert("a".into(), w(1), Instant::now());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(m.expire(Instant::now()), 0, "the restored slot is stale");
        assert!(m.contains("a", w(1), Instant::now()));
        assert_eq!(m.events(), 1);
    }

    #[tokio::test]
    async fn take_names_the_worker() {
        let mut m = ExpiringMap::new(Duration::from_secs(60), 10);
        m.insert("a".into(), w(1), Instant::now());
        assert_eq!(
            m.take("a", w(2), Instant::now()),
            None,
            "another worker's entry stays"
        );
        assert!(m.contains("a", w(1), Instant::now()));
        assert_eq!(m.take("b", w(1), Instant::now()), None, "unknown");
        assert_eq!(m.take("a", w(1), Instant::now()), Some(1));
        assert_eq!(m.take("a", w(1), Instant::now()), None, "taken once");
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_dies_exactly_at_its_ttl() {
        let ttl = Duration::from_secs(10);
        let mut m = ExpiringMap::new(ttl, 10);
        m.insert("a".into(), w(1), Instant::now());
        tokio::time::advance(ttl - Duration::from_nanos(1)).await;
        assert!(m.contains("a", w(1), Instant::now()), "just before the ttl");
        assert_eq!(m.expire(Instant::now()), 0);
        tokio::time::advance(Duration::from_nanos(1)).await;
        assert!(!m.contains("a", w(1), Instant::now()), "at the ttl");
        assert_eq!(m.len(), 1, "contains removes nothing");
        assert_eq!(m.expire(Instant::now()), 1, "expire agrees with contains");
        assert_eq!((m.len(), m.events(), m.take_expired()), (0, 0, 1));
    }

    #[tokio::test]
    async fn forgetting_a_worker_drops_its_entries_and_their_events() {
        let mut m = ExpiringMap::new(Duration::from_secs(60), 10);
        m.insert("a".into(), w(1), Instant::now());
        m.insert("a".into(), w(1), Instant::now());
        m.insert("b".into(), w(2), Instant::now());
        m.insert("c".into(), w(1), Instant::now());
        assert_eq!(m.forget_worker(|x| x == w(1)), 3, "a twice, c once");
        assert_eq!((m.len(), m.events()), (1, 1));
        assert!(m.contains("b", w(2), Instant::now()));
        assert_eq!(m.forget_worker(|x| x == w(3)), 0);
        assert_eq!(m.take("b", w(2), Instant::now()), Some(1));
    }

    /// A slot left by an earlier life of the same id (taken, or renewed) must not end the
    /// entry it has now.
    #[tokio::test(start_paused = true)]
    async fn a_reinserted_id_lives_a_full_ttl_from_its_last_insertion() {
        let ttl = Duration::from_secs(10);
        let mut m = ExpiringMap::new(ttl, 10);
        m.insert("taken".into(), w(1), Instant::now());
        m.insert("renewed".into(), w(1), Instant::now());
        m.take("taken", w(1), Instant::now());
        tokio::time::advance(Duration::from_secs(5)).await;
        m.insert("taken".into(), w(1), Instant::now());
        m.insert("renewed".into(), w(1), Instant::now());
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(m.expire(Instant::now()), 0, "the old slots are stale");
        assert!(
            m.contains("taken", w(1), Instant::now())
                && m.contains("renewed", w(1), Instant::now())
        );
        assert_eq!(m.events(), 3);
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(m.expire(Instant::now()), 2);
        assert_eq!((m.len(), m.events(), m.take_expired()), (0, 0, 3));
    }

    /// The queue compaction (slots of taken entries pile up under churn) runs once the
    /// queue holds twice the capacity, not before (amortised O(1) an insertion), and keeps
    /// the slot of every live entry: an entry whose slot is dropped would never expire.
    #[tokio::test(start_paused = true)]
    async fn compacting_the_queue_keeps_every_live_entry_expiring() {
        let ttl = Duration::from_secs(10);
        let mut m = ExpiringMap::new(ttl, 3);
        m.insert("live".into(), w(1), Instant::now());
        for i in 0..5 {
            let id = format!("stale{i}");
            m.insert(id.as_str().into(), w(1), Instant::now());
            m.take(&id, w(1), Instant::now());
        }
        assert_eq!(m.order.len(), 6, "stale slots wait for the queue to fill");
        m.insert("d".into(), w(1), Instant::now());
        assert_eq!(m.order.len(), 2, "compacted to the live entries' slots");
        tokio::time::advance(ttl).await;
        assert_eq!(m.expire(Instant::now()), 2);
        assert_eq!((m.len(), m.events(), m.take_expired()), (0, 0, 2));
    }

    /// Random operations against the bound and the accounting: every event held leaves
    /// once (taken, expired, evicted, displaced or forgotten), the map never passes its
    /// capacity, and the queue never passes twice that.
    #[tokio::test(start_paused = true)]
    async fn random_operations_keep_the_bound_and_account_every_event() {
        let capacity = 4;
        let mut m = ExpiringMap::new(Duration::from_secs(10), capacity);
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let (mut held, mut left) = (0, 0);
        for _ in 0..20_000 {
            let id = RequestId::from(format!("r{}", next(8)));
            let worker = w(next(2));
            match next(12) {
                0..=5 => {
                    held += 1;
                    match m.insert(id, worker, Instant::now()) {
                        InsertOutcome::Inserted => {}
                        InsertOutcome::EvictedOldest { events } => {
                            assert!(events > 0, "an eviction evicts something");
                            left += events;
                        }
                        InsertOutcome::Displaced { events } => left += events,
                    }
                }
                6..=8 => left += m.take(&id, worker, Instant::now()).unwrap_or(0),
                9 | 10 => tokio::time::advance(Duration::from_secs(next(4))).await,
                _ => left += m.forget_worker(|x| x == worker),
            }
            left += m.take_expired();
            assert!(m.len() <= capacity, "{m:?}");
            assert_eq!(m.is_empty(), m.entries.is_empty());
            assert!(m.order.len() <= 2 * capacity, "{m:?}");
            assert_eq!(held, left + m.events(), "{m:?}");
            let sum: u64 = m.entries.values().map(|e| e.events).sum();
            assert_eq!(sum, m.events());
        }
    }
}

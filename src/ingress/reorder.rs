//! Short-lived, bounded memory of requests whose events arrived out of order: tombstones of
//! requests completed before their admission arrived, and progress held until it does.
//!
//! Each entry counts the events it stands for, and every way out (taken, expired, evicted,
//! displaced, forgotten) reports that count: the applier accounts each held event exactly once.

use std::collections::VecDeque;
use std::time::Duration;

use hashbrown::HashMap;
use tokio::time::Instant;

use crate::types::{RequestId, WorkerWithDpRank};

/// Entries by request id that expire after a fixed time, at most `capacity` of them.
///
/// Insertion order is expiry order (one TTL for all), so expiring is popping the front.
#[derive(Debug)]
pub struct ExpiringMap {
    entries: HashMap<RequestId, Entry>,
    order: VecDeque<(RequestId, Instant)>,
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
    /// Events this entry stands for: the same request held again adds one.
    events: u64,
    /// The highest output token count of the held `progressed` events (0 for tombstones),
    /// applied with them when the admission arrives.
    output_tokens: u32,
}

/// What [`ExpiringMap::insert`] had to do to stay within its bound.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum InsertOutcome {
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

impl ExpiringMap {
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            order: VecDeque::new(),
            ttl,
            capacity: capacity.max(1),
            events: 0,
            expired: 0,
        }
    }

    /// Events held by all entries (expired ones not yet removed included).
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Events of the entries that expired since the last call.
    pub fn take_expired(&mut self) -> u64 {
        std::mem::take(&mut self.expired)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Remembers one event of `request_id` on `worker` until the TTL passes (an entry of
    /// the same request and worker counts one event more and lives on from now).
    pub fn insert(&mut self, request_id: RequestId, worker: WorkerWithDpRank) -> InsertOutcome {
        self.insert_progress(request_id, worker, 0)
    }

    /// [`ExpiringMap::insert`] of a `progressed` with `output_tokens` so far: the entry keeps
    /// the highest count of the events it holds.
    pub fn insert_progress(
        &mut self,
        request_id: RequestId,
        worker: WorkerWithDpRank,
        mut output_tokens: u32,
    ) -> InsertOutcome {
        let now = Instant::now();
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
                let mut evicted = 0;
                while evicted == 0 && !self.order.is_empty() {
                    evicted = self.pop_oldest();
                }
                outcome = InsertOutcome::EvictedOldest { events: evicted };
            }
            None => {}
        }
        if self.order.len() >= 2 * self.capacity {
            // Slots of taken entries pile up under churn: keep the queue bounded too.
            let entries = &self.entries;
            self.order
                .retain(|(id, e)| entries.get(id).is_some_and(|x| x.expires == *e));
        }
        self.order.push_back((request_id.clone(), expires));
        // The same worker's earlier events are in `events` already.
        self.events += 1;
        let entry = Entry {
            worker,
            expires,
            events,
            output_tokens,
        };
        self.entries.insert(request_id, entry);
        outcome
    }

    /// Takes the live entry of `request_id` if it names `worker`: how many events it stood
    /// for (0: none).
    pub fn take(&mut self, request_id: &str, worker: WorkerWithDpRank) -> u64 {
        self.take_progress(request_id, worker).0
    }

    /// [`ExpiringMap::take`], with the highest output token count the entry held.
    pub fn take_progress(&mut self, request_id: &str, worker: WorkerWithDpRank) -> (u64, u32) {
        if self.entries.is_empty() {
            // The common case, on every admission: no clock read.
            return (0, 0);
        }
        self.expire(Instant::now());
        match self.entries.get(request_id) {
            Some(entry) if entry.worker == worker => {
                let taken = (entry.events, entry.output_tokens);
                self.entries.remove(request_id);
                self.events -= taken.0;
                taken
            }
            _ => (0, 0),
        }
    }

    /// Whether a live entry for `request_id` on `worker` exists.
    pub fn contains(&self, request_id: &str, worker: WorkerWithDpRank) -> bool {
        self.entries
            .get(request_id)
            .is_some_and(|e| e.worker == worker && e.expires > Instant::now())
    }

    /// Forgets every entry of the workers `reset` covers; returns how many events they
    /// stood for.
    pub fn forget_worker(&mut self, reset: impl Fn(WorkerWithDpRank) -> bool) -> u64 {
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
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut expired = 0;
        while let Some((_, expires)) = self.order.front() {
            if *expires > now {
                break;
            }
            let events = self.pop_oldest();
            self.expired += events;
            expired += usize::from(events > 0);
        }
        expired
    }

    /// Pops the front of the order queue; returns the events of the live entry it removed
    /// (0: none).
    fn pop_oldest(&mut self) -> u64 {
        let Some((request_id, expires)) = self.order.pop_front() else {
            return 0;
        };
        // The queue may hold entries already taken or re-inserted later: only remove the
        // map entry this queue slot stands for.
        match self.entries.get(&request_id) {
            Some(e) if e.expires == expires => {
                let events = e.events;
                self.entries.remove(&request_id);
                self.events -= events;
                events
            }
            _ => 0,
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
        m.insert("a".into(), w(1));
        tokio::time::advance(Duration::from_secs(5)).await;
        m.insert("b".into(), w(1));
        assert!(m.contains("a", w(1)));
        assert!(!m.contains("a", w(2)), "another worker's request");
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(m.take("a", w(1)), 0, "expired");
        assert_eq!(m.take_expired(), 1, "the expired event is reported once");
        assert_eq!(m.take_expired(), 0);
        assert_eq!(m.take("b", w(1)), 1);
        assert!(m.is_empty());
        assert_eq!(m.events(), 0);
    }

    #[tokio::test]
    async fn every_held_event_leaves_once() {
        let mut m = ExpiringMap::new(Duration::from_secs(60), 2);
        assert_eq!(m.insert("a".into(), w(1)), InsertOutcome::Inserted);
        assert_eq!(m.insert("a".into(), w(1)), InsertOutcome::Inserted);
        assert_eq!((m.len(), m.events()), (1, 2), "one entry, two events");
        assert_eq!(
            m.insert("a".into(), w(2)),
            InsertOutcome::Displaced { events: 2 },
            "the same request on another worker"
        );
        assert_eq!(m.insert("b".into(), w(3)), InsertOutcome::Inserted);
        assert_eq!(m.insert("b".into(), w(3)), InsertOutcome::Inserted);
        assert_eq!(
            m.insert("c".into(), w(1)),
            InsertOutcome::EvictedOldest { events: 1 },
            "a (on worker 2) was the oldest"
        );
        assert_eq!(m.events(), 3);
        assert_eq!(m.forget_worker(|x| x == w(3)), 2);
        assert_eq!(m.take("c", w(1)), 1);
        assert_eq!((m.len(), m.events()), (0, 0));
    }

    #[tokio::test]
    async fn bounded_by_evicting_the_oldest() {
        let mut m = ExpiringMap::new(Duration::from_secs(60), 3);
        for i in 0..3 {
            assert_eq!(
                m.insert(format!("r{i}").into(), w(1)),
                InsertOutcome::Inserted
            );
        }
        assert_eq!(
            m.insert("r3".into(), w(1)),
            InsertOutcome::EvictedOldest { events: 1 }
        );
        assert_eq!(m.len(), 3);
        assert!(!m.contains("r0", w(1)));
        assert!(m.contains("r3", w(1)));
    }
}

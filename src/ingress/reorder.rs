//! Short-lived, bounded memory of requests whose events arrived out of order: tombstones of
//! requests completed before their admission arrived, and progress held until it does.

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
    entries: HashMap<RequestId, (WorkerWithDpRank, Instant)>,
    order: VecDeque<(RequestId, Instant)>,
    ttl: Duration,
    capacity: usize,
}

/// What [`ExpiringMap::insert`] had to do to stay within its bound.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum InsertOutcome {
    Inserted,
    /// The oldest entry was evicted to make room.
    EvictedOldest,
}

impl ExpiringMap {
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            order: VecDeque::new(),
            ttl,
            capacity: capacity.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Remembers `request_id` on `worker` until the TTL passes.
    pub fn insert(&mut self, request_id: RequestId, worker: WorkerWithDpRank) -> InsertOutcome {
        let now = Instant::now();
        let expires = now + self.ttl;
        self.expire(now);
        let mut outcome = InsertOutcome::Inserted;
        if self.entries.len() >= self.capacity && !self.entries.contains_key(&request_id) {
            self.pop_oldest();
            outcome = InsertOutcome::EvictedOldest;
        }
        if self.order.len() >= 2 * self.capacity {
            // Slots of taken entries pile up under churn: keep the queue bounded too.
            let entries = &self.entries;
            self.order
                .retain(|(id, e)| entries.get(id).is_some_and(|(_, x)| x == e));
        }
        self.order.push_back((request_id.clone(), expires));
        self.entries.insert(request_id, (worker, expires));
        outcome
    }

    /// Takes the live entry of `request_id` if it names `worker`.
    pub fn take(&mut self, request_id: &str, worker: WorkerWithDpRank) -> bool {
        if self.entries.is_empty() {
            // The common case, on every admission: no clock read.
            return false;
        }
        self.expire(Instant::now());
        match self.entries.get(request_id) {
            Some((w, _)) if *w == worker => {
                self.entries.remove(request_id);
                true
            }
            _ => false,
        }
    }

    /// Whether a live entry for `request_id` on `worker` exists.
    pub fn contains(&self, request_id: &str, worker: WorkerWithDpRank) -> bool {
        self.entries
            .get(request_id)
            .is_some_and(|(w, expires)| *w == worker && *expires > Instant::now())
    }

    /// Forgets every entry of the workers `reset` covers.
    pub fn forget_worker(&mut self, reset: impl Fn(WorkerWithDpRank) -> bool) {
        self.entries.retain(|_, (w, _)| !reset(*w));
    }

    /// Drops expired entries; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut expired = 0;
        while let Some((_, expires)) = self.order.front() {
            if *expires > now {
                break;
            }
            expired += usize::from(self.pop_oldest());
        }
        expired
    }

    /// Pops the front of the order queue; true if it removed a live entry.
    fn pop_oldest(&mut self) -> bool {
        let Some((request_id, expires)) = self.order.pop_front() else {
            return false;
        };
        // The queue may hold entries already taken or re-inserted later: only remove the
        // map entry this queue slot stands for.
        match self.entries.get(&request_id) {
            Some((_, e)) if *e == expires => {
                self.entries.remove(&request_id);
                true
            }
            _ => false,
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
        assert!(!m.take("a", w(1)), "expired");
        assert!(m.take("b", w(1)));
        assert!(m.is_empty());
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
        assert_eq!(m.insert("r3".into(), w(1)), InsertOutcome::EvictedOldest);
        assert_eq!(m.len(), 3);
        assert!(!m.contains("r0", w(1)));
        assert!(m.contains("r3", w(1)));
    }
}

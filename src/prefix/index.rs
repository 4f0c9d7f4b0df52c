//! Which workers hold which prefix blocks, as far as the events tell: the picture a
//! prefix-aware decision scores workers with.
//!
//! Each entry is one block (named by its [`block_hashes`](super::block_hashes) hash) held by
//! one worker rank. A hash names its whole prefix, so a worker that holds block k is taken
//! to hold the blocks before it too: a request's overlap with a worker is the deepest of the
//! request's blocks that the worker holds, whichever of the blocks before it were told.
//!
//! Bounded twice, as an engine's cache is: each worker rank holds at most its capacity in
//! blocks (the least recently learned or refreshed goes first, as engines evict), and the
//! whole index at most `max_entries` (past it the worker holding the most gives up its least
//! recent blocks, a 1/1024 of the bound at a time so that the search for it stays rare).
//!
//! # Layout
//! `blocks` maps a hash to its one holder, `(worker slot, entry)`, the common case; a block
//! that several ranks hold is marked there and its holders, sorted by slot, are in `shared`.
//! Each holder names its entry in `entries`, a slab whose entries are linked per rank in
//! recency order (and, when free, into the free list): 16 bytes an entry, plus the map's
//! 16-byte bucket of a block one rank holds, 8 more bytes a further holder.
//!
//! # Exact ranks
//! A worker rank whose engine's KV events are relayed (wire 1.3 `kv_stored`, `kv_removed`,
//! `kv_cleared`) is *exact*: the first such event empties what was learned of it, and from
//! then on only those events change what it holds; `admitted` block hashes and this
//! replica's own decisions no longer teach it anything. An engine evicts blocks in its own
//! order, so an exact rank may hold a block without the ones before it: its overlap is
//! counted block by block from the first. A reset keeps a rank exact (its relay tells the
//! restarted engine's cache); a rank that leaves is no longer exact.

use hashbrown::{HashMap, HashSet};

use crate::types::WorkerWithDpRank;

const NIL: u32 = u32::MAX;

/// The bounds of a [`PrefixIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixIndexConfig {
    block_size: u32,
    worker_capacity: u32,
    max_entries: u32,
}

impl PrefixIndexConfig {
    /// Blocks a worker rank holds unless it says otherwise: 32,768 (half a million tokens of
    /// 16-token blocks).
    pub const DEFAULT_WORKER_CAPACITY: u32 = 32_768;
    /// Entries (a block held by a worker rank) of a deployment's index: 4,000,000.
    pub const DEFAULT_MAX_ENTRIES: u32 = 4_000_000;

    /// The defaults.
    pub fn new() -> Self {
        Self {
            block_size: super::DEFAULT_BLOCK_SIZE as u32,
            worker_capacity: Self::DEFAULT_WORKER_CAPACITY,
            max_entries: Self::DEFAULT_MAX_ENTRIES,
        }
    }

    /// Tokens per block: the engines' block size, which a route request's `token_ids` are
    /// cut by (at least 1). Default [`DEFAULT_BLOCK_SIZE`](super::DEFAULT_BLOCK_SIZE), 16.
    pub fn with_block_size(mut self, tokens: u32) -> Self {
        self.block_size = tokens.max(1);
        self
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks each worker rank holds at most (at least 1).
    pub fn with_worker_capacity(mut self, blocks: u32) -> Self {
        self.worker_capacity = blocks.max(1);
        self
    }

    /// Entries the index holds at most (at least 1; below `u32::MAX`).
    pub fn with_max_entries(mut self, entries: u32) -> Self {
        self.max_entries = entries.clamp(1, NIL - 1);
        self
    }

    /// Blocks each worker rank holds at most.
    pub fn worker_capacity(&self) -> u32 {
        self.worker_capacity
    }

    /// Entries the index holds at most.
    pub fn max_entries(&self) -> u32 {
        self.max_entries
    }
}

impl Default for PrefixIndexConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// A [`PrefixIndex`] as a snapshot keeps it: per worker rank, its capacity and its blocks,
/// least recent first, so that the restored index evicts in the same order.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct PrefixImage {
    workers: Vec<WorkerImage>,
    /// The exact ranks, sorted (last, and optional: an image written before it still loads).
    #[serde(default)]
    exact: Vec<WorkerWithDpRank>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct WorkerImage {
    worker: WorkerWithDpRank,
    capacity: u32,
    /// Least recent first.
    blocks: Vec<u64>,
}

impl PrefixImage {
    /// Entries it holds.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.workers.iter().map(|w| w.blocks.len()).sum()
    }
}

/// Which worker ranks hold which prefix blocks (see the module's documentation).
#[derive(Debug)]
pub struct PrefixIndex {
    config: PrefixIndexConfig,
    blocks: HashMap<u64, Holder>,
    /// The holders of the blocks that `blocks` marks [`SHARED`], sorted by slot.
    shared: HashMap<u64, Vec<Holder>>,
    entries: Vec<Entry>,
    /// First free entry, linked through `next`.
    free: u32,
    workers: Vec<WorkerBlocks>,
    slots: HashMap<WorkerWithDpRank, u32>,
    free_slots: Vec<u32>,
    len: u32,
    evicted: u64,
    /// Calls that forgot worker ranks (restarted, left, made exact), whether they held
    /// blocks or not: a decision's learning, done after its answer, is dropped if this moved
    /// since its overlaps.
    forgets: u64,
    /// The exact ranks (see the module's documentation), whether they hold blocks or not.
    exact: HashSet<WorkerWithDpRank>,
}

/// `(worker slot, entry)`.
type Holder = (u32, u32);

/// The slot of a `blocks` holder that stands for several, kept in `shared`.
const SHARED: u32 = NIL;

#[derive(Clone, Copy, Debug)]
struct Entry {
    hash: u64,
    /// The worker's next older and next newer entries.
    older: u32,
    newer: u32,
}

#[derive(Debug)]
struct WorkerBlocks {
    worker: WorkerWithDpRank,
    oldest: u32,
    newest: u32,
    len: u32,
    capacity: u32,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new(config: PrefixIndexConfig) -> Self {
        Self {
            config,
            blocks: HashMap::new(),
            shared: HashMap::new(),
            entries: Vec::new(),
            free: NIL,
            workers: Vec::new(),
            slots: HashMap::new(),
            free_slots: Vec::new(),
            len: 0,
            evicted: 0,
            forgets: 0,
            exact: HashSet::new(),
        }
    }

    /// Entries held (a block held by a worker rank).
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Entries dropped to stay within the bounds, since the start.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Worker ranks it keeps: those that hold a block or announced a capacity.
    pub fn workers(&self) -> usize {
        self.slots.len()
    }

    /// Blocks `worker` holds at most: its own figure if it announced one, else the
    /// deployment's.
    pub fn worker_capacity(&self, worker: WorkerWithDpRank) -> u32 {
        self.slots
            .get(&worker)
            .map_or(self.config.worker_capacity, |&s| {
                self.workers[s as usize].capacity
            })
    }

    /// Blocks `worker` is taken to hold.
    pub fn worker_blocks(&self, worker: WorkerWithDpRank) -> usize {
        self.slots
            .get(&worker)
            .map_or(0, |&s| self.workers[s as usize].len as usize)
    }

    /// Sets what `worker` holds at most (an engine that announces its own capacity); the
    /// least recent blocks past it go at once.
    pub fn set_worker_capacity(&mut self, worker: WorkerWithDpRank, blocks: u32) {
        let slot = self.slot(worker);
        self.workers[slot as usize].capacity = blocks.max(1);
        self.keep_capacity(slot);
    }

    /// `worker` holds the blocks `hashes`: a prompt's, in prompt order from its first block
    /// (all of them or the first few). The first block becomes the most recent and the
    /// deepest the least, so a worker past its capacity gives up a prompt's tail before its
    /// head, as an engine's cache does (a block is only of use with the blocks before it).
    /// Nothing for an exact rank, which only its engine's events teach.
    pub fn learn(&mut self, worker: WorkerWithDpRank, hashes: &[u64]) {
        if self.exact.contains(&worker) {
            return;
        }
        self.learn_bounded(worker, hashes);
    }

    fn learn_bounded(&mut self, worker: WorkerWithDpRank, hashes: &[u64]) {
        if let Some(slot) = self.learn_slot(worker, hashes) {
            for &hash in hashes.iter().rev() {
                self.learn_one(slot, hash);
            }
        }
    }

    /// How many calls forgot worker ranks: unchanged between two readings, no rank was
    /// reset (or left) in between.
    pub(crate) fn forgets(&self) -> u64 {
        self.forgets
    }

    /// The slot of `worker`, when there is something to learn; the map's buckets of
    /// `hashes` are read first, all at once: independent lookups whose cache misses the
    /// processor overlaps, where the learning's own lookups would wait on one another.
    fn learn_slot(&mut self, worker: WorkerWithDpRank, hashes: &[u64]) -> Option<u32> {
        if hashes.is_empty() {
            return None;
        }
        let known = hashes
            .iter()
            .filter(|h| self.blocks.contains_key(*h))
            .count();
        std::hint::black_box(known);
        Some(self.slot(worker))
    }

    fn keep_capacity(&mut self, slot: u32) {
        while self.workers[slot as usize].len > self.workers[slot as usize].capacity {
            self.evict_oldest(slot);
        }
    }

    /// The holders of `hash`, sorted by slot.
    fn holders(&self, hash: &u64) -> &[Holder] {
        match self.blocks.get(hash) {
            None => &[],
            Some((SHARED, _)) => self.shared.get(hash).map_or(&[], Vec::as_slice),
            Some(one) => std::slice::from_ref(one),
        }
    }

    fn holds(&self, hash: &u64, slot: u32) -> Option<u32> {
        let holders = self.holders(hash);
        holders
            .binary_search_by_key(&slot, |&(s, _)| s)
            .ok()
            .map(|i| holders[i].1)
    }

    fn add_holder(&mut self, hash: u64, holder: Holder) {
        match self.blocks.get_mut(&hash) {
            None => {
                self.blocks.insert(hash, holder);
            }
            Some((SHARED, _)) => {
                let holders = self.shared.entry(hash).or_default();
                let at = holders.partition_point(|&(s, _)| s < holder.0);
                holders.insert(at, holder);
            }
            Some(one) => {
                let first = *one;
                *one = (SHARED, 0);
                let pair = if first.0 < holder.0 {
                    vec![first, holder]
                } else {
                    vec![holder, first]
                };
                self.shared.insert(hash, pair);
            }
        }
    }

    fn remove_holder(&mut self, hash: u64, slot: u32) {
        match self.blocks.get_mut(&hash) {
            None => {}
            Some((SHARED, _)) => {
                let Some(holders) = self.shared.get_mut(&hash) else {
                    return;
                };
                if let Ok(i) = holders.binary_search_by_key(&slot, |&(s, _)| s) {
                    holders.remove(i);
                }
                if holders.len() == 1 {
                    let last = holders[0];
                    self.shared.remove(&hash);
                    self.blocks.insert(hash, last);
                }
            }
            Some(&mut (s, _)) if s == slot => {
                self.blocks.remove(&hash);
            }
            Some(_) => {}
        }
    }

    fn learn_one(&mut self, slot: u32, hash: u64) {
        if let Some(entry) = self.holds(&hash, slot) {
            self.unlink(slot, entry);
            self.link_newest(slot, entry);
            return;
        }
        let entry = Self::alloc(&mut self.entries, &mut self.free, hash);
        self.add_holder(hash, (slot, entry));
        self.link_newest(slot, entry);
        self.workers[slot as usize].len += 1;
        self.len += 1;
        self.keep_capacity(slot);
        if self.len > self.config.max_entries {
            self.shrink();
        }
    }

    /// How many ranks are exact.
    pub fn exact_workers(&self) -> usize {
        self.exact.len()
    }

    /// Whether `worker`'s blocks come from its engine's KV events.
    pub fn is_exact(&self, worker: WorkerWithDpRank) -> bool {
        self.exact.contains(&worker)
    }

    /// Makes `worker` exact; the first time, what was learned of it is forgotten (its
    /// capacity kept). Returns the entries forgotten.
    fn make_exact(&mut self, worker: WorkerWithDpRank) -> usize {
        if !self.exact.insert(worker) {
            return 0;
        }
        self.empty_keeping_capacity(worker)
    }

    /// Forgets what `worker` holds, keeping the capacity it announced.
    fn empty_keeping_capacity(&mut self, worker: WorkerWithDpRank) -> usize {
        let Some(&slot) = self.slots.get(&worker) else {
            return 0;
        };
        let capacity = self.workers[slot as usize].capacity;
        let forgotten = self.forget_worker(worker);
        if capacity != self.config.worker_capacity {
            let slot = self.slot(worker);
            self.workers[slot as usize].capacity = capacity;
        }
        forgotten
    }

    /// `worker`'s engine stored `hashes` (`kv_stored`): an exact rank holds them from now on,
    /// within its capacity and the index's bound. Returns the entries forgotten because
    /// this made the rank exact.
    pub fn store_exact(&mut self, worker: WorkerWithDpRank, hashes: &[u64]) -> usize {
        let forgotten = self.make_exact(worker);
        self.learn_bounded(worker, hashes);
        forgotten
    }

    /// `worker`'s engine evicted `hashes` (`kv_removed`); those it does not hold are
    /// ignored. Returns `(entries forgotten because this made the rank exact, blocks
    /// removed)`.
    pub fn remove_exact(&mut self, worker: WorkerWithDpRank, hashes: &[u64]) -> (usize, usize) {
        let forgotten = self.make_exact(worker);
        let Some(&slot) = self.slots.get(&worker) else {
            return (forgotten, 0);
        };
        let mut removed = 0;
        for hash in hashes {
            if let Some(entry) = self.holds(hash, slot) {
                self.drop_entry(slot, entry);
                removed += 1;
            }
        }
        (forgotten, removed)
    }

    /// `worker`'s engine emptied its cache (`kv_cleared`): the rank is exact and holds
    /// nothing. Returns the entries forgotten.
    pub fn clear_exact(&mut self, worker: WorkerWithDpRank) -> usize {
        self.exact.insert(worker);
        self.empty_keeping_capacity(worker)
    }

    /// Every rank of worker `worker_id` that the index knows (it holds blocks, announced a
    /// capacity, or is exact) emptied its cache (`kv_cleared` without a rank).
    pub fn clear_exact_worker(&mut self, worker_id: u64) -> usize {
        let ranks = self.ranks_of(worker_id);
        ranks.into_iter().map(|w| self.clear_exact(w)).sum()
    }

    /// The ranks `covers` names left: they are no longer exact (a rank that comes back is
    /// exact again from its relay's first event).
    pub fn forget_exact_where(&mut self, covers: impl Fn(WorkerWithDpRank) -> bool) {
        self.exact.retain(|&w| !covers(w));
    }

    /// The blocks `worker` is taken to hold, sorted.
    pub fn worker_hashes(&self, worker: WorkerWithDpRank) -> Vec<u64> {
        let Some(&slot) = self.slots.get(&worker) else {
            return Vec::new();
        };
        let mut hashes = self.blocks_of(slot);
        hashes.sort_unstable();
        hashes
    }

    /// The ranks of worker `worker_id` that the index knows, sorted.
    pub fn ranks_of(&self, worker_id: u64) -> Vec<WorkerWithDpRank> {
        let mut ranks: Vec<WorkerWithDpRank> = self
            .slots
            .keys()
            .chain(self.exact.iter())
            .copied()
            .filter(|w| w.worker_id.0 == worker_id)
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }

    /// Forgets everything `worker` was taken to hold (its engine restarted, or it left).
    pub fn forget_worker(&mut self, worker: WorkerWithDpRank) -> usize {
        self.forgets += 1;
        let Some(slot) = self.slots.remove(&worker) else {
            return 0;
        };
        let forgotten = self.workers[slot as usize].len as usize;
        while self.workers[slot as usize].len > 0 {
            self.evict_oldest(slot);
        }
        // Counted as forgotten, not as evicted to stay within the bounds.
        self.evicted -= forgotten as u64;
        self.free_slots.push(slot);
        forgotten
    }

    /// Forgets every worker rank that `covers` names (a reset of all of a worker's ranks).
    pub fn forget_where(&mut self, covers: impl Fn(WorkerWithDpRank) -> bool) -> usize {
        self.forgets += 1;
        let workers: Vec<_> = self.slots.keys().copied().filter(|&w| covers(w)).collect();
        workers.into_iter().map(|w| self.forget_worker(w)).sum()
    }

    /// For each worker rank that holds the first of `hashes` (a request's, in prompt order),
    /// its overlap: how many of the request's blocks, from the first, it holds. Ranks that
    /// hold none are left out.
    ///
    /// Learned as [`learn`](Self::learn) learns (whole prompts' first blocks, the head
    /// refreshed last), a rank that holds a block holds the blocks before it, so a rank's
    /// overlap is the position of the deepest block it holds: found from the deepest block
    /// anyone holds (a binary search) back towards the first, each rank at the first
    /// position it shows up, until every holder of the first block has been seen.
    pub fn overlaps(&self, hashes: &[u64]) -> Vec<(WorkerWithDpRank, u32)> {
        let Some(first) = hashes.first() else {
            return Vec::new();
        };
        let wanted = self.holders(first).len();
        if wanted == 0 {
            return Vec::new();
        }
        // Blocks held by someone form a prefix of `hashes`: the end of it.
        let deepest = hashes.partition_point(|hash| !self.holders(hash).is_empty());
        let mut found: Vec<(WorkerWithDpRank, u32)> = Vec::with_capacity(wanted);
        let mut seen: HashSet<u32> = HashSet::with_capacity(wanted);
        for position in (0..deepest).rev() {
            for &(slot, _) in self.holders(&hashes[position]) {
                // A rank without the first block (a learned list that did not start at a
                // prompt's head) has no prefix of the request.
                if seen.insert(slot) && self.holds(first, slot).is_some() {
                    let worker = self.workers[slot as usize].worker;
                    let blocks = if self.exact.contains(&worker) {
                        // Its engine may have evicted a block before this one.
                        self.overlap(worker, &hashes[..=position])
                    } else {
                        u32::try_from(position + 1).unwrap_or(u32::MAX)
                    };
                    found.push((worker, blocks));
                }
            }
            if found.len() >= wanted {
                break;
            }
        }
        found
    }

    /// The overlap of one worker rank with `hashes`: how many of them, from the first, it
    /// holds (0: none).
    pub fn overlap(&self, worker: WorkerWithDpRank, hashes: &[u64]) -> u32 {
        let Some(&slot) = self.slots.get(&worker) else {
            return 0;
        };
        let held = hashes
            .iter()
            .position(|hash| self.holds(hash, slot).is_none())
            .unwrap_or(hashes.len());
        u32::try_from(held).unwrap_or(u32::MAX)
    }

    /// `slot`'s blocks, least recent first.
    fn blocks_of(&self, slot: u32) -> Vec<u64> {
        let w = &self.workers[slot as usize];
        let mut blocks = Vec::with_capacity(w.len as usize);
        let mut at = w.oldest;
        while at != NIL {
            blocks.push(self.entries[at as usize].hash);
            at = self.entries[at as usize].newer;
        }
        blocks
    }

    /// What a snapshot keeps of it, ordered by worker.
    pub(crate) fn image(&self) -> PrefixImage {
        let mut workers: Vec<WorkerImage> = self
            .slots
            .values()
            .map(|&slot| {
                let w = &self.workers[slot as usize];
                WorkerImage {
                    worker: w.worker,
                    capacity: w.capacity,
                    blocks: self.blocks_of(slot),
                }
            })
            .collect();
        workers.sort_unstable_by_key(|w| w.worker);
        let mut exact: Vec<WorkerWithDpRank> = self.exact.iter().copied().collect();
        exact.sort_unstable();
        PrefixImage { workers, exact }
    }

    /// Adds what `image` holds, each worker's blocks in their order of recency (on an
    /// empty index: the index the image was taken of, within this index's bounds).
    pub(crate) fn restore(&mut self, image: &PrefixImage) {
        self.exact.extend(image.exact.iter().copied());
        for w in &image.workers {
            let slot = self.slot(w.worker);
            self.workers[slot as usize].capacity = w.capacity.max(1);
            for &hash in &w.blocks {
                self.learn_one(slot, hash);
            }
        }
    }

    fn slot(&mut self, worker: WorkerWithDpRank) -> u32 {
        if let Some(&slot) = self.slots.get(&worker) {
            return slot;
        }
        let blocks = WorkerBlocks {
            worker,
            oldest: NIL,
            newest: NIL,
            len: 0,
            capacity: self.config.worker_capacity,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = blocks;
                slot
            }
            None => {
                self.workers.push(blocks);
                u32::try_from(self.workers.len() - 1).expect("fewer than 2^32 worker ranks")
            }
        };
        self.slots.insert(worker, slot);
        slot
    }

    fn alloc(entries: &mut Vec<Entry>, free: &mut u32, hash: u64) -> u32 {
        let entry = Entry {
            hash,
            older: NIL,
            newer: NIL,
        };
        if *free != NIL {
            let index = *free;
            *free = entries[index as usize].newer;
            entries[index as usize] = entry;
            index
        } else {
            entries.push(entry);
            // max_entries < u32::MAX bounds the slab's length.
            (entries.len() - 1) as u32
        }
    }

    fn link_newest(&mut self, slot: u32, entry: u32) {
        let w = &mut self.workers[slot as usize];
        self.entries[entry as usize].older = w.newest;
        self.entries[entry as usize].newer = NIL;
        if w.newest != NIL {
            self.entries[w.newest as usize].newer = entry;
        } else {
            w.oldest = entry;
        }
        w.newest = entry;
    }

    fn unlink(&mut self, slot: u32, entry: u32) {
        let Entry { older, newer, .. } = self.entries[entry as usize];
        let w = &mut self.workers[slot as usize];
        if older != NIL {
            self.entries[older as usize].newer = newer;
        } else {
            w.oldest = newer;
        }
        if newer != NIL {
            self.entries[newer as usize].older = older;
        } else {
            w.newest = older;
        }
    }

    /// Drops `slot`'s least recent entry (it has one).
    fn evict_oldest(&mut self, slot: u32) {
        let entry = self.workers[slot as usize].oldest;
        debug_assert_ne!(entry, NIL);
        if entry == NIL {
            return;
        }
        self.drop_entry(slot, entry);
        self.evicted += 1;
    }

    /// Takes `entry` out of `slot`'s blocks and back to the free list.
    fn drop_entry(&mut self, slot: u32, entry: u32) {
        self.unlink(slot, entry);
        let hash = self.entries[entry as usize].hash;
        self.remove_holder(hash, slot);
        self.entries[entry as usize].newer = self.free;
        self.free = entry;
        self.workers[slot as usize].len -= 1;
        self.len -= 1;
    }

    /// Past `max_entries`: the rank holding the most gives up its least recent blocks.
    fn shrink(&mut self) {
        let chunk = (self.config.max_entries / 1024).max(1);
        let target = self.config.max_entries.saturating_sub(chunk - 1);
        while self.len > target {
            let Some(largest) = (0..self.workers.len() as u32)
                .filter(|&s| self.workers[s as usize].len > 0)
                .max_by_key(|&s| self.workers[s as usize].len)
            else {
                return;
            };
            for _ in 0..chunk.min(self.workers[largest as usize].len) {
                self.evict_oldest(largest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, 0)
    }

    fn index(capacity: u32, max: u32) -> PrefixIndex {
        PrefixIndex::new(
            PrefixIndexConfig::new()
                .with_worker_capacity(capacity)
                .with_max_entries(max),
        )
    }

    fn sorted(mut v: Vec<(WorkerWithDpRank, u32)>) -> Vec<(WorkerWithDpRank, u32)> {
        v.sort();
        v
    }

    /// The settings read back what was set, within their floors and ceiling; an index
    /// counts the ranks it keeps, those with blocks and those that only announced a capacity.
    #[test]
    fn settings_and_counts_read_back() {
        let config = PrefixIndexConfig::new();
        assert_eq!(config, PrefixIndexConfig::default());
        assert_eq!(
            (
                config.block_size(),
                config.worker_capacity(),
                config.max_entries()
            ),
            (16, 32_768, 4_000_000)
        );
        let set = config
            .with_block_size(32)
            .with_worker_capacity(9)
            .with_max_entries(77);
        assert_eq!(
            (set.block_size(), set.worker_capacity(), set.max_entries()),
            (32, 9, 77)
        );
        let floors = config
            .with_block_size(0)
            .with_worker_capacity(0)
            .with_max_entries(0);
        assert_eq!(
            (
                floors.block_size(),
                floors.worker_capacity(),
                floors.max_entries()
            ),
            (1, 1, 1)
        );
        assert_eq!(
            config.with_max_entries(u32::MAX).max_entries(),
            u32::MAX - 1
        );
        let mut ix = PrefixIndex::new(set);
        assert!(ix.is_empty() && ix.workers() == 0);
        assert_eq!(ix.worker_capacity(w(1)), 9, "the deployment's");
        ix.set_worker_capacity(w(1), 4);
        assert!(ix.is_empty(), "a capacity holds no block");
        assert_eq!((ix.workers(), ix.worker_capacity(w(1))), (1, 4));
        ix.learn(w(2), &[1]);
        assert!(!ix.is_empty());
        assert_eq!((ix.workers(), ix.len()), (2, 1));
    }

    #[test]
    fn the_overlap_is_the_longest_prefix_held() {
        let mut ix = index(100, 1000);
        ix.learn(w(1), &[10, 11, 12, 13]);
        ix.learn(w(2), &[10, 11]);
        ix.learn(w(3), &[20, 21]);
        // Not from a prompt's head: no prefix of any request that starts at 10.
        ix.learn(w(4), &[11, 12, 13]);
        let request = [10, 11, 12, 13, 14];
        assert_eq!(
            sorted(ix.overlaps(&request)),
            vec![(w(1), 4), (w(2), 2)],
            "worker 3 holds another prompt, worker 4 not the first block"
        );
        for (worker, expected) in [(w(1), 4), (w(2), 2), (w(3), 0), (w(4), 0), (w(9), 0)] {
            assert_eq!(ix.overlap(worker, &request), expected, "{worker:?}");
        }
        assert_eq!(ix.overlap(w(1), &[10, 99, 12]), 1, "up to the first miss");
        assert_eq!(
            sorted(ix.overlaps(&[10, 99, 12])),
            vec![(w(1), 1), (w(2), 1)]
        );
        assert!(ix.overlaps(&[]).is_empty());
        assert!(ix.overlaps(&[99, 10]).is_empty());
        assert_eq!((ix.len(), ix.worker_blocks(w(1))), (11, 4));
    }

    #[test]
    fn a_worker_keeps_its_capacity_least_recent_first() {
        let mut ix = index(3, 1000);
        // Recency, least first: 3, 2, 1 (a prompt's tail goes before its head).
        ix.learn(w(1), &[1, 2, 3]);
        ix.learn(w(1), &[4]);
        assert_eq!(ix.worker_blocks(w(1)), 3);
        assert_eq!(ix.overlap(w(1), &[1, 2, 3]), 2, "the tail went first");
        ix.learn(w(1), &[2]); // refreshed: 1 is now the least recent
        ix.learn(w(1), &[5]);
        for (held, expected) in [(1, 0), (2, 1), (4, 1), (5, 1)] {
            assert_eq!(ix.overlap(w(1), &[held]), expected, "{held}");
        }
        assert_eq!(ix.evicted(), 2);
        ix.set_worker_capacity(w(1), 1);
        assert_eq!(ix.worker_blocks(w(1)), 1);
        assert_eq!(ix.overlap(w(1), &[5]), 1, "the most recent stays");
        ix.learn(w(1), &[6, 7]);
        assert_eq!((ix.worker_blocks(w(1)), ix.overlap(w(1), &[6])), (1, 1));
    }

    /// Every reset moves the count of forgets, whether the rank held blocks or not (a
    /// decision's learning after its answer relies on it), as does a rank made exact;
    /// learning and evicting leave it.
    #[test]
    fn forgets_count_every_reset() {
        let mut ix = index(2, 1000);
        ix.learn(w(1), &[1, 2, 3]);
        ix.set_worker_capacity(w(1), 1);
        assert_eq!(
            (ix.forgets(), ix.evicted()),
            (0, 2),
            "evictions are not forgets"
        );
        assert_eq!(ix.forget_worker(w(9)), 0);
        assert_eq!(ix.forgets(), 1, "a rank it did not know");
        assert_eq!(ix.forget_worker(w(1)), 1);
        assert_eq!(ix.forgets(), 2);
        assert_eq!(ix.forget_where(|x| x.worker_id.0 == 7), 0);
        assert_eq!(ix.forgets(), 3, "no rank it knew");
        ix.learn(w(3), &[5]);
        ix.store_exact(w(3), &[6]);
        assert_eq!(ix.forgets(), 4, "made exact: what was learned went");
        ix.store_exact(w(3), &[7]);
        assert_eq!(ix.forgets(), 4, "exact already");
    }

    fn rank(id: u64, dp: u32) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, dp)
    }

    /// A rank's first KV event forgets what was learned of it; from then on only KV events
    /// teach it, and its overlap stops at the first block its engine evicted.
    #[test]
    fn an_exact_rank_holds_what_its_engine_says() {
        let mut ix = index(100, 1000);
        ix.learn(w(1), &[1, 2, 3]);
        ix.learn(w(2), &[20, 21, 22]);
        assert_eq!(
            ix.store_exact(w(1), &[20, 21, 22]),
            3,
            "the learned blocks go"
        );
        assert!(ix.is_exact(w(1)) && !ix.is_exact(w(2)));
        assert_eq!(ix.worker_hashes(w(1)), vec![20, 21, 22]);
        assert_eq!(ix.store_exact(w(1), &[23]), 0, "once");
        ix.learn(w(1), &[1, 2]);
        assert_eq!(
            ix.worker_hashes(w(1)),
            vec![20, 21, 22, 23],
            "nothing learned"
        );
        assert_eq!(
            ix.remove_exact(w(1), &[21, 99]),
            (0, 1),
            "99 it did not hold"
        );
        let mut overlaps = ix.overlaps(&[20, 21, 22, 23]);
        overlaps.sort_unstable();
        assert_eq!(overlaps, vec![(w(1), 1), (w(2), 3)]);
        assert_eq!(ix.overlap(w(1), &[20, 21, 22]), 1);
        assert_eq!(ix.remove_exact(w(1), &[20]), (0, 1));
        assert_eq!(ix.overlaps(&[20, 21, 22, 23]), vec![(w(2), 3)]);
        // A rank the index never saw: removing makes it exact, and holds nothing.
        assert_eq!(ix.remove_exact(w(3), &[1]), (0, 0));
        assert!(ix.is_exact(w(3)));
        assert_eq!(ix.exact_workers(), 2);
        assert_eq!(ix.len(), 3 + 2);
    }

    /// A clear empties a rank and keeps it exact with the capacity it announced; a reset
    /// keeps it exact, leaving does not; a clear of a worker clears every rank it knows.
    #[test]
    fn clears_resets_and_leaving_of_exact_ranks() {
        let mut ix = index(100, 1000);
        ix.set_worker_capacity(rank(1, 0), 7);
        ix.store_exact(rank(1, 0), &[1, 2]);
        ix.learn(rank(1, 1), &[3]);
        ix.learn(rank(2, 0), &[4]);
        assert_eq!(ix.clear_exact(rank(1, 0)), 2);
        assert_eq!(ix.worker_blocks(rank(1, 0)), 0);
        assert_eq!(
            ix.worker_capacity(rank(1, 0)),
            7,
            "its announced capacity stays"
        );
        assert!(ix.is_exact(rank(1, 0)));
        assert_eq!(ix.ranks_of(1), vec![rank(1, 0), rank(1, 1)]);
        assert_eq!(ix.clear_exact_worker(1), 1, "rank 1's learned block");
        assert!(ix.is_exact(rank(1, 1)) && !ix.is_exact(rank(2, 0)));
        assert_eq!(ix.worker_hashes(rank(2, 0)), vec![4]);
        ix.store_exact(rank(1, 1), &[5]);
        assert_eq!(ix.forget_where(|w| w.worker_id.0 == 1), 1);
        assert!(ix.is_exact(rank(1, 1)), "a restart keeps its relay's word");
        ix.learn(rank(1, 1), &[6]);
        assert_eq!(ix.worker_blocks(rank(1, 1)), 0);
        ix.forget_exact_where(|w| w == rank(1, 1));
        assert!(!ix.is_exact(rank(1, 1)) && ix.is_exact(rank(1, 0)));
        ix.learn(rank(1, 1), &[6]);
        assert_eq!(
            ix.worker_hashes(rank(1, 1)),
            vec![6],
            "learned again once it left"
        );
    }

    #[test]
    fn an_image_keeps_the_exact_ranks() {
        let mut ix = index(100, 1000);
        ix.store_exact(w(1), &[1, 2]);
        ix.clear_exact(w(2));
        ix.learn(w(3), &[3]);
        let mut restored = index(100, 1000);
        restored.restore(&ix.image());
        assert_eq!(restored.image(), ix.image());
        assert!(restored.is_exact(w(1)) && restored.is_exact(w(2)) && !restored.is_exact(w(3)));
        // An image written before exact ranks existed still loads.
        let old = rmp_serde::to_vec(&(vec![(w(3), 5u32, vec![9u64])],)).unwrap();
        let image: PrefixImage = rmp_serde::from_slice(&old).unwrap();
        let mut from_old = index(100, 1000);
        from_old.restore(&image);
        assert_eq!(
            (from_old.worker_hashes(w(3)), from_old.exact_workers()),
            (vec![9], 0)
        );
    }

    #[test]
    fn the_whole_index_is_bounded_by_shrinking_the_largest_worker() {
        let mut ix = index(1000, 10);
        ix.learn(w(1), &[1, 2, 3, 4, 5, 6, 7]);
        ix.learn(w(2), &[1, 2, 3]);
        assert_eq!(ix.len(), 10);
        ix.learn(w(3), &[100]);
        assert_eq!(ix.len(), 10, "at the bound");
        assert_eq!(
            ix.worker_blocks(w(1)),
            6,
            "the largest gave up its least recent"
        );
        assert_eq!(
            ix.overlap(w(1), &[1, 2, 3, 4, 5, 6, 7]),
            6,
            "its prompt's tail went"
        );
        ix.learn(w(1), &[1, 2, 3, 4, 5, 6]);
        ix.learn(w(3), &[100, 101]);
        assert_eq!(
            ix.overlap(w(1), &[1, 2, 3, 4, 5, 6]),
            5,
            "the largest again"
        );
        assert_eq!(
            ix.overlap(w(2), &[1, 2, 3]),
            3,
            "another holder of the same blocks keeps them"
        );
        assert_eq!(ix.overlap(w(3), &[100, 101]), 2);
        assert_eq!(ix.len(), 10);
    }

    /// Past a large bound the index gives up a 1/1024 of it at once (so that the search for
    /// the largest rank stays rare), and not before the bound is passed.
    #[test]
    fn a_large_bound_shrinks_by_a_chunk_once_passed() {
        let mut ix = index(10_000, 4096);
        let blocks: Vec<u64> = (1..=4096).collect();
        ix.learn(w(1), &blocks[..3000]);
        ix.learn(w(2), &blocks[3000..]);
        assert_eq!(
            (ix.len(), ix.evicted()),
            (4096, 0),
            "at the bound, nothing goes"
        );
        ix.learn(w(3), &[9999]);
        // 4097 entries: down to 4096 - (4 - 1), the largest rank's 4 least recent.
        assert_eq!((ix.len(), ix.evicted()), (4093, 4));
        assert_eq!(ix.worker_blocks(w(1)), 2996);
        assert_eq!(ix.worker_blocks(w(2)), 1096);
    }

    #[test]
    fn forgetting_a_worker_leaves_the_others_and_reuses_the_room() {
        let mut ix = index(100, 1000);
        ix.learn(w(1), &[1, 2, 3]);
        ix.learn(WorkerWithDpRank::new(1, 1), &[1, 2]);
        ix.learn(w(2), &[1, 2]);
        assert_eq!(ix.forget_worker(w(1)), 3);
        assert_eq!(ix.forget_worker(w(1)), 0, "once");
        assert_eq!(ix.overlap(w(1), &[1, 2, 3]), 0);
        assert_eq!(ix.overlap(w(2), &[1, 2]), 2);
        assert_eq!(ix.forget_where(|x| x.worker_id.0 == 1), 2, "the other rank");
        assert_eq!((ix.len(), ix.evicted()), (2, 0), "forgotten is not evicted");
        let slab = ix.entries.len();
        ix.learn(w(3), &[7, 8, 9]);
        assert_eq!(ix.entries.len(), slab, "freed entries are reused");
        assert_eq!(ix.overlap(w(3), &[7, 8, 9]), 3);
    }

    #[test]
    fn an_image_restores_the_same_index_and_the_same_order_of_eviction() {
        let mut ix = index(4, 1000);
        ix.learn(w(1), &[1, 2, 3]);
        ix.learn(w(2), &[1, 2]);
        ix.set_worker_capacity(w(2), 3);
        ix.learn(w(1), &[1, 5]);
        let image = ix.image();
        assert_eq!(image.len(), ix.len());
        let bytes = rmp_serde::to_vec_named(&image).unwrap();
        let back: PrefixImage = rmp_serde::from_slice(&bytes).unwrap();
        let mut restored = index(4, 1000);
        restored.restore(&back);
        assert_eq!(restored.image(), image);
        for ix in [&mut ix, &mut restored] {
            ix.learn(w(1), &[7]);
            ix.learn(w(2), &[8, 9]);
        }
        assert_eq!(restored.image(), ix.image(), "the same blocks went");
        assert_eq!(restored.worker_capacity(w(2)), 3);
    }

    /// Random operations against a plain model: per worker an ordered list of its blocks,
    /// the least recent first. Prompts are paths from the root of a small tree of blocks (a
    /// block's hash names its prefix, as [`super::super::block_hashes`] chains them), learned
    /// whole or their first blocks, as events carry them.
    #[test]
    fn random_operations_match_a_plain_model() {
        let (capacity, workers) = (7usize, 4u64);
        let mut ix = index(capacity as u32, 1000);
        let mut model: Vec<Vec<u64>> = vec![Vec::new(); workers as usize];
        let mut rng: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut draws = Vec::new();
        for _ in 0..40_000 {
            draws.push((next(workers), next(10), next(5), next(6)));
        }
        // A path of `len` blocks, each of 3 children: the hash is the path so far.
        let mut prompt = |len: u64| -> Vec<u64> {
            let mut node = 1u64;
            (0..len)
                .map(|_| {
                    node = node * 3 + next(3);
                    node
                })
                .collect()
        };
        for (worker, op, learned, asked) in draws {
            match op {
                0 => {
                    ix.forget_worker(w(worker));
                    model[worker as usize].clear();
                }
                _ => {
                    let hashes = prompt(learned);
                    ix.learn(w(worker), &hashes);
                    let held = &mut model[worker as usize];
                    for &h in hashes.iter().rev() {
                        held.retain(|&x| x != h);
                        held.push(h);
                        if held.len() > capacity {
                            held.remove(0);
                        }
                    }
                }
            }
            let request = prompt(asked);
            let mut expected: Vec<(WorkerWithDpRank, u32)> = Vec::new();
            for (id, held) in model.iter().enumerate() {
                let prefix = request.iter().take_while(|h| held.contains(h)).count();
                if prefix > 0 {
                    expected.push((w(id as u64), prefix as u32));
                }
                assert_eq!(ix.worker_blocks(w(id as u64)), held.len());
                assert_eq!(ix.overlap(w(id as u64), &request), prefix as u32);
            }
            assert_eq!(sorted(ix.overlaps(&request)), expected);
            assert_eq!(ix.len(), model.iter().map(Vec::len).sum::<usize>());
        }
    }
}

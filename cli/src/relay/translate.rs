//! From the engine's events to ours: [`Translator`] computes our block hashes from each
//! `BlockStored`'s token ids (chained as `lease_router::block_hashes` chains them), keeps the
//! engine-hash to our-hash map that `BlockRemoved` and the next store's parent need
//! ([`BlockMap`], bounded), and tells a [`KvSink`] what the index should learn.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;

use lease_router::wire::MAX_BLOCK_HASHES;
use lease_router::{chain_block_hash, ROOT_PARENT_HASH};

use super::frames::{EngineEvent, EngineKey, Removed, Stored};
use super::metrics::{Metrics, Skip};

/// Where the translated events go (a `LeasePublisher` in the relay, a recorder in tests).
/// Each call carries at most [`MAX_BLOCK_HASHES`] blocks.
pub trait KvSink {
    /// `blocks` (chain order) entered the engine's cache; `parent` is our hash of the block
    /// before `blocks[0]`, `None` when `blocks[0]` is a prompt's first block.
    fn stored(&mut self, parent: Option<u64>, blocks: Vec<u64>);
    /// `blocks` left the engine's cache (or this relay can no longer follow them).
    fn removed(&mut self, blocks: Vec<u64>);
    /// Forget everything the index holds for this rank.
    fn cleared(&mut self);
    /// Whether an event was lost on its way (not queued) since the last `cleared` that was
    /// not: the index may then hold what the engine no longer does, and must be cleared.
    fn take_lost(&mut self) -> bool {
        false
    }
    /// Waits until what the sink holds back (a publisher's full queue) is handed on.
    fn settle(&mut self) -> impl std::future::Future<Output = ()> + Send {
        async {}
    }
}

/// The engine-hash to our-hash map, at most `capacity` blocks; past that the block entered
/// longest ago leaves (and the index is told it left: a block whose removal could no longer
/// be translated must not stay in the index).
#[derive(Debug)]
pub struct BlockMap {
    capacity: usize,
    entries: HashMap<EngineKey, (u64, u64)>,
    /// (key, stamp) in insertion order; an entry whose stamp differs from the map's is stale.
    order: VecDeque<(EngineKey, u64)>,
    stamp: u64,
}

impl BlockMap {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
            stamp: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn get(&self, key: EngineKey) -> Option<u64> {
        self.entries.get(&key).map(|&(ours, _)| ours)
    }

    /// Inserts (or refreshes) `key`; our hashes of the blocks that left to make room go into
    /// `evicted`.
    pub fn insert(&mut self, key: EngineKey, ours: u64, evicted: &mut Vec<u64>) {
        self.stamp += 1;
        self.entries.insert(key, (ours, self.stamp));
        self.order.push_back((key, self.stamp));
        while self.entries.len() > self.capacity {
            let Some((old, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.entries.get(&old).is_some_and(|&(_, s)| s == stamp) {
                if let Some((gone, _)) = self.entries.remove(&old) {
                    evicted.push(gone);
                }
            }
        }
        if self.order.len() > 2 * self.capacity + 1024 {
            let entries = &self.entries;
            self.order
                .retain(|(k, s)| entries.get(k).is_some_and(|&(_, live)| live == *s));
        }
    }

    pub fn remove(&mut self, key: EngineKey) -> Option<u64> {
        self.entries.remove(&key).map(|(ours, _)| ours)
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }
}

/// The engine's events of one rank, translated.
#[derive(Debug)]
pub struct Translator {
    block_size: usize,
    map: BlockMap,
}

impl Translator {
    pub fn new(block_size: usize, max_blocks: usize) -> Self {
        Self {
            block_size,
            map: BlockMap::new(max_blocks),
        }
    }

    #[cfg(test)]
    pub fn blocks(&self) -> usize {
        self.map.len()
    }

    /// A fresh start: the index is told to forget the rank, and so is the map.
    pub fn clear(&mut self, sink: &mut impl KvSink, metrics: &Metrics) {
        self.map.clear();
        sink.cleared();
        metrics.map_blocks.store(0, Relaxed);
    }

    pub fn apply(&mut self, event: EngineEvent, sink: &mut impl KvSink, metrics: &Metrics) {
        match event {
            EngineEvent::Stored(stored) => self.stored(stored, sink, metrics),
            EngineEvent::Removed(removed) => self.removed(removed, sink, metrics),
            EngineEvent::Cleared => {
                metrics.events_cleared.fetch_add(1, Relaxed);
                metrics.clears_engine.fetch_add(1, Relaxed);
                self.clear(sink, metrics);
            }
            EngineEvent::Unknown(tag) => metrics.skip(Skip::UnknownKind, &tag),
        }
        metrics.map_blocks.store(self.map.len() as u64, Relaxed);
    }

    /// Whether an event of this medium and KV cache group is about the cache the router
    /// routes on: the GPU's (vLLM's `medium` is nil before 0.10), the first group.
    fn followed(medium: &Option<String>, group: Option<i64>, metrics: &Metrics) -> bool {
        if let Some(medium) = medium.as_deref().filter(|m| *m != "GPU") {
            metrics.skip(Skip::Medium, medium);
            return false;
        }
        if let Some(group) = group.filter(|&g| g != 0) {
            metrics.skip(Skip::KvGroup, &group.to_string());
            return false;
        }
        true
    }

    fn stored(&mut self, stored: Stored, sink: &mut impl KvSink, metrics: &Metrics) {
        if !Self::followed(&stored.medium, stored.group_idx, metrics) {
            return;
        }
        if stored.block_size != self.block_size as u64 {
            metrics.block_size_mismatch(stored.block_size, self.block_size);
            return;
        }
        if stored.keyed_beyond_tokens {
            metrics.skip(Skip::ExtraKeys, "lora or extra keys");
            return;
        }
        if stored.block_hashes.is_empty()
            || stored.token_ids.len() != stored.block_hashes.len() * self.block_size
        {
            metrics.malformed_event(&format!(
                "BlockStored of {} blocks with {} token ids (block size {})",
                stored.block_hashes.len(),
                stored.token_ids.len(),
                self.block_size
            ));
            return;
        }
        let parent = match stored.parent {
            None => None,
            Some(engine_parent) => match self.map.get(engine_parent) {
                Some(ours) => Some(ours),
                None => {
                    metrics.unknown_parent();
                    return;
                }
            },
        };
        let mut chained = parent.unwrap_or(ROOT_PARENT_HASH);
        let mut ours = Vec::with_capacity(stored.block_hashes.len());
        let mut evicted = Vec::new();
        for (key, tokens) in stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(self.block_size))
        {
            chained = chain_block_hash(chained, tokens);
            self.map.insert(*key, chained, &mut evicted);
            ours.push(chained);
        }
        if !evicted.is_empty() {
            metrics
                .map_evictions
                .fetch_add(evicted.len() as u64, Relaxed);
            metrics
                .blocks_removed
                .fetch_add(evicted.len() as u64, Relaxed);
            for chunk in evicted.chunks(MAX_BLOCK_HASHES) {
                sink.removed(chunk.to_vec());
            }
        }
        metrics.events_stored.fetch_add(1, Relaxed);
        metrics.blocks_stored.fetch_add(ours.len() as u64, Relaxed);
        let mut parent = parent;
        for chunk in ours.chunks(MAX_BLOCK_HASHES) {
            sink.stored(parent, chunk.to_vec());
            parent = chunk.last().copied();
        }
    }

    fn removed(&mut self, removed: Removed, sink: &mut impl KvSink, metrics: &Metrics) {
        if !Self::followed(&removed.medium, removed.group_idx, metrics) {
            return;
        }
        let total = removed.block_hashes.len();
        let ours: Vec<u64> = removed
            .block_hashes
            .into_iter()
            .filter_map(|key| self.map.remove(key))
            .collect();
        let unknown = (total - ours.len()) as u64;
        if unknown > 0 {
            metrics.unknown_removed.fetch_add(unknown, Relaxed);
        }
        metrics.events_removed.fetch_add(1, Relaxed);
        metrics.blocks_removed.fetch_add(ours.len() as u64, Relaxed);
        for chunk in ours.chunks(MAX_BLOCK_HASHES) {
            sink.removed(chunk.to_vec());
        }
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use lease_router::block_hashes;

    /// What a sink was told, in order.
    #[derive(Debug, Default, PartialEq)]
    pub struct Recorder(pub Vec<Told>);

    #[derive(Debug, PartialEq)]
    pub enum Told {
        Stored(Option<u64>, Vec<u64>),
        Removed(Vec<u64>),
        Cleared,
    }

    impl KvSink for Recorder {
        fn stored(&mut self, parent: Option<u64>, blocks: Vec<u64>) {
            self.0.push(Told::Stored(parent, blocks));
        }
        fn removed(&mut self, blocks: Vec<u64>) {
            self.0.push(Told::Removed(blocks));
        }
        fn cleared(&mut self) {
            self.0.push(Told::Cleared);
        }
    }

    fn store(keys: &[u128], parent: Option<u128>, tokens: &[u32], size: u64) -> EngineEvent {
        EngineEvent::Stored(Stored {
            block_hashes: keys.to_vec(),
            parent,
            token_ids: tokens.to_vec(),
            block_size: size,
            keyed_beyond_tokens: false,
            medium: Some("GPU".into()),
            group_idx: None,
        })
    }

    fn remove(keys: &[u128]) -> EngineEvent {
        EngineEvent::Removed(Removed {
            block_hashes: keys.to_vec(),
            medium: None,
            group_idx: Some(0),
        })
    }

    #[test]
    fn a_prompt_stored_in_two_steps_has_the_hashes_of_the_whole_prompt() {
        let metrics = Metrics::default();
        let mut t = Translator::new(4, 100);
        let mut sink = Recorder::default();
        let prompt: Vec<u32> = (100..116).collect();
        let ours = block_hashes(&prompt, 4);
        t.apply(store(&[1, 2], None, &prompt[..8], 4), &mut sink, &metrics);
        t.apply(
            store(&[3, 4], Some(2), &prompt[8..], 4),
            &mut sink,
            &metrics,
        );
        t.apply(remove(&[4, 9]), &mut sink, &metrics);
        assert_eq!(
            sink.0,
            vec![
                Told::Stored(None, ours[..2].to_vec()),
                Told::Stored(Some(ours[1]), ours[2..].to_vec()),
                Told::Removed(vec![ours[3]]),
            ]
        );
        assert_eq!(metrics.unknown_removed.load(Relaxed), 1);
        assert_eq!(t.blocks(), 3);
    }

    #[test]
    fn skipped_stores_are_counted_and_their_children_have_unknown_parents() {
        let metrics = Metrics::default();
        let mut t = Translator::new(4, 100);
        let mut sink = Recorder::default();
        let tokens: Vec<u32> = (0..8).collect();
        t.apply(store(&[1], None, &tokens[..2], 2), &mut sink, &metrics);
        t.apply(store(&[2], Some(1), &tokens[..4], 4), &mut sink, &metrics);
        let mut cpu = store(&[3], None, &tokens[..4], 4);
        if let EngineEvent::Stored(s) = &mut cpu {
            s.medium = Some("CPU".into());
        }
        t.apply(cpu, &mut sink, &metrics);
        t.apply(store(&[4], None, &tokens[..5], 4), &mut sink, &metrics);
        t.apply(EngineEvent::Unknown("X".into()), &mut sink, &metrics);
        assert!(sink.0.is_empty(), "{:?}", sink.0);
        assert_eq!(metrics.block_size_mismatches.load(Relaxed), 1);
        assert_eq!(metrics.unknown_parents.load(Relaxed), 1);
        assert_eq!(metrics.malformed_events.load(Relaxed), 1);
        assert_eq!(metrics.skipped(Skip::Medium), 1);
        assert_eq!(metrics.skipped(Skip::UnknownKind), 1);
    }

    #[test]
    fn long_stores_are_split_and_the_bound_evicts_with_a_removal() {
        let metrics = Metrics::default();
        let mut t = Translator::new(1, 300);
        let mut sink = Recorder::default();
        let tokens: Vec<u32> = (0..600).collect();
        let keys: Vec<u128> = (0..600).collect();
        let ours = block_hashes(&tokens, 1);
        t.apply(
            store(&keys[..300], None, &tokens[..300], 1),
            &mut sink,
            &metrics,
        );
        assert_eq!(
            sink.0,
            vec![
                Told::Stored(None, ours[..256].to_vec()),
                Told::Stored(Some(ours[255]), ours[256..300].to_vec()),
            ]
        );
        sink.0.clear();
        t.apply(
            store(&keys[300..302], Some(299), &tokens[300..302], 1),
            &mut sink,
            &metrics,
        );
        assert_eq!(
            sink.0,
            vec![
                Told::Removed(ours[..2].to_vec()),
                Told::Stored(Some(ours[299]), ours[300..302].to_vec()),
            ]
        );
        assert_eq!(t.blocks(), 300);
        for round in 0..20u128 {
            let k = 1000 + round * 300;
            let keys: Vec<u128> = (k..k + 300).collect();
            t.apply(store(&keys, None, &tokens[..300], 1), &mut sink, &metrics);
        }
        assert_eq!(t.blocks(), 300);
        assert!(t.map.order.len() <= 2 * 300 + 1024 + 1);
        sink.0.clear();
        t.apply(EngineEvent::Cleared, &mut sink, &metrics);
        assert_eq!(sink.0, vec![Told::Cleared]);
        assert_eq!(t.blocks(), 0);
    }
}

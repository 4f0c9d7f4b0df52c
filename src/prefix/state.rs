//! A deployment's prefix index as its router shares it: the ingress teaches it (each
//! `admitted`'s block hashes, each `worker_reset`), the scheduler reads it in every decision
//! and teaches it the decision's own booking, the snapshot carries it; with the counters a
//! dashboard shows of it.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

use super::{PrefixImage, PrefixIndex, PrefixIndexConfig};
use crate::types::WorkerWithDpRank;

/// The index behind one short lock (a decision's overlaps, one event's learning), and its
/// counters.
#[derive(Debug)]
pub(crate) struct PrefixState {
    config: PrefixIndexConfig,
    index: Mutex<PrefixIndex>,
    learned: AtomicU64,
    forgotten: AtomicU64,
    compared: AtomicU64,
    predicted_tokens: AtomicU64,
    reported_tokens: AtomicU64,
    overpredicted_tokens: AtomicU64,
    underpredicted_tokens: AtomicU64,
    kv_stored_blocks: AtomicU64,
    kv_removed_blocks: AtomicU64,
    kv_clears: AtomicU64,
}

impl PrefixState {
    pub(crate) fn new(config: PrefixIndexConfig) -> Self {
        Self {
            config,
            index: Mutex::new(PrefixIndex::new(config)),
            learned: AtomicU64::new(0),
            forgotten: AtomicU64::new(0),
            compared: AtomicU64::new(0),
            predicted_tokens: AtomicU64::new(0),
            reported_tokens: AtomicU64::new(0),
            overpredicted_tokens: AtomicU64::new(0),
            underpredicted_tokens: AtomicU64::new(0),
            kv_stored_blocks: AtomicU64::new(0),
            kv_removed_blocks: AtomicU64::new(0),
            kv_clears: AtomicU64::new(0),
        }
    }

    pub(crate) fn config(&self) -> PrefixIndexConfig {
        self.config
    }

    /// A worker's `admitted` said it holds `hashes` (and, if it said so, how many blocks it
    /// holds at most).
    pub(crate) fn learn(&self, worker: WorkerWithDpRank, hashes: &[u64], capacity: Option<u32>) {
        if hashes.is_empty() && capacity.is_none() {
            return;
        }
        let mut index = self.index.lock();
        if let Some(capacity) = capacity {
            if index.worker_capacity(worker) != capacity.max(1) {
                index.set_worker_capacity(worker, capacity);
            }
        }
        index.learn(worker, hashes);
        drop(index);
        if !hashes.is_empty() {
            self.learned.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The overlaps of a request's `hashes` with each rank that holds its first block, and
    /// the index's count of forgets to hand back to [`learn_booked`](Self::learn_booked).
    pub(crate) fn overlaps(&self, hashes: &[u64]) -> (Vec<(WorkerWithDpRank, u32)>, u64) {
        let index = self.index.lock();
        (index.overlaps(hashes), index.forgets())
    }

    /// This replica booked a request with `hashes` on `worker`, deciding on the index as it
    /// was at `forgets` ([`overlaps`](Self::overlaps)). Learned after the answer, so
    /// nothing unless no rank was forgotten since: a reset of `worker` applied in between
    /// must not be overtaken (its engine restarted empty), and resets are rare enough that
    /// the others' do not matter. The worker's own `admitted` teaches the blocks anyway.
    pub(crate) fn learn_booked(&self, worker: WorkerWithDpRank, hashes: &[u64], forgets: u64) {
        if hashes.is_empty() {
            return;
        }
        let mut index = self.index.lock();
        if index.forgets() != forgets {
            return;
        }
        index.learn(worker, hashes);
        drop(index);
        self.learned.fetch_add(1, Ordering::Relaxed);
    }

    /// A worker (every rank `covers` names) restarted or left: its cache is empty. A rank
    /// that left is no longer exact.
    pub(crate) fn forget(&self, covers: impl Fn(WorkerWithDpRank) -> bool, leaving: bool) {
        let mut index = self.index.lock();
        let forgotten = index.forget_where(&covers);
        if leaving {
            index.forget_exact_where(covers);
        }
        drop(index);
        self.forgot(forgotten);
    }

    fn forgot(&self, entries: usize) {
        self.forgotten.fetch_add(entries as u64, Ordering::Relaxed);
    }

    /// `kv_stored`: `worker`'s engine holds `hashes`.
    pub(crate) fn kv_stored(&self, worker: WorkerWithDpRank, hashes: &[u64]) {
        let forgotten = self.index.lock().store_exact(worker, hashes);
        self.forgot(forgotten);
        self.kv_stored_blocks
            .fetch_add(hashes.len() as u64, Ordering::Relaxed);
    }

    /// `kv_removed`: `worker`'s engine evicted `hashes`.
    pub(crate) fn kv_removed(&self, worker: WorkerWithDpRank, hashes: &[u64]) {
        let (forgotten, removed) = self.index.lock().remove_exact(worker, hashes);
        self.forgot(forgotten);
        self.kv_removed_blocks
            .fetch_add(removed as u64, Ordering::Relaxed);
    }

    /// `kv_cleared`: the engine of `worker_id` (its rank `dp_rank`, or every rank) holds
    /// nothing.
    pub(crate) fn kv_cleared(&self, worker_id: u64, dp_rank: Option<u32>) {
        let forgotten = {
            let mut index = self.index.lock();
            match dp_rank {
                Some(dp_rank) => index.clear_exact(WorkerWithDpRank::new(worker_id, dp_rank)),
                None => index.clear_exact_worker(worker_id),
            }
        };
        self.forgot(forgotten);
        self.kv_clears.fetch_add(1, Ordering::Relaxed);
    }

    /// What the index holds of each known rank of `worker_id`.
    pub(crate) fn worker_view(&self, worker_id: u64) -> Vec<RankView> {
        let index = self.index.lock();
        index
            .ranks_of(worker_id)
            .into_iter()
            .map(|w| {
                let hashes = index.worker_hashes(w);
                RankView {
                    dp_rank: w.dp_rank.0,
                    exact: index.is_exact(w),
                    blocks: hashes.len() as u64,
                    hashes,
                }
            })
            .collect()
    }

    /// A route decision counted on `predicted` cached tokens; the worker's `admitted` says its
    /// engine found `reported`.
    pub(crate) fn compare(&self, predicted: u32, reported: u32) {
        self.compared.fetch_add(1, Ordering::Relaxed);
        self.predicted_tokens
            .fetch_add(u64::from(predicted), Ordering::Relaxed);
        self.reported_tokens
            .fetch_add(u64::from(reported), Ordering::Relaxed);
        let (over, under) = (
            predicted.saturating_sub(reported),
            reported.saturating_sub(predicted),
        );
        self.overpredicted_tokens
            .fetch_add(u64::from(over), Ordering::Relaxed);
        self.underpredicted_tokens
            .fetch_add(u64::from(under), Ordering::Relaxed);
    }

    /// What a snapshot keeps of the index.
    pub(crate) fn image(&self) -> PrefixImage {
        self.index.lock().image()
    }

    /// Adds a snapshot's index (on an empty one: the writer's).
    pub(crate) fn restore(&self, image: &PrefixImage) {
        self.index.lock().restore(image);
    }

    pub(crate) fn figures(&self) -> PrefixFigures {
        let (entries, workers, evicted, exact_workers) = {
            let index = self.index.lock();
            (
                index.len() as u64,
                index.workers() as u64,
                index.evicted(),
                index.exact_workers() as u64,
            )
        };
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PrefixFigures {
            entries,
            workers,
            evicted,
            learned_admissions: get(&self.learned),
            forgotten_entries: get(&self.forgotten),
            compared_admissions: get(&self.compared),
            predicted_cached_tokens: get(&self.predicted_tokens),
            reported_cached_tokens: get(&self.reported_tokens),
            overpredicted_tokens: get(&self.overpredicted_tokens),
            underpredicted_tokens: get(&self.underpredicted_tokens),
            exact_workers,
            kv_stored_blocks: get(&self.kv_stored_blocks),
            kv_removed_blocks: get(&self.kv_removed_blocks),
            kv_clears: get(&self.kv_clears),
        }
    }
}

/// A point-in-time copy of a deployment's prefix index counters
/// ([`SchedulerHandle::prefix_figures`](crate::SchedulerHandle::prefix_figures)). Counts are since the router
/// started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefixFigures {
    /// Entries held now (a block held by a worker rank).
    pub entries: u64,
    /// Worker ranks it keeps: those that hold a block or announced a capacity.
    pub workers: u64,
    /// Entries dropped to stay within a worker's capacity or the deployment's bound.
    pub evicted: u64,
    /// `admitted` events (and this replica's decisions) whose block hashes were learned.
    pub learned_admissions: u64,
    /// Entries forgotten because their worker restarted or left.
    pub forgotten_entries: u64,
    /// Admissions of this replica's route decisions whose worker reported its cached tokens
    /// (`ctok`): each compares the decision's prediction with the engine's figure.
    pub compared_admissions: u64,
    /// Over those admissions: the cached tokens the decisions predicted.
    pub predicted_cached_tokens: u64,
    /// Over the same admissions: the cached tokens the engines reported.
    pub reported_cached_tokens: u64,
    /// Over the same admissions: tokens predicted cached that were not (prediction above the
    /// report).
    pub overpredicted_tokens: u64,
    /// Over the same admissions: cached tokens the prediction missed.
    pub underpredicted_tokens: u64,
    /// Worker ranks whose blocks come from their engines' KV events (exact ranks).
    pub exact_workers: u64,
    /// Blocks that `kv_stored` events reported stored.
    pub kv_stored_blocks: u64,
    /// Blocks that `kv_removed` events removed from the index (those it held).
    pub kv_removed_blocks: u64,
    /// `kv_cleared` events applied.
    pub kv_clears: u64,
}

/// What the index holds of one worker rank (`GET /v1/deployments/{name}/prefix/{worker_id}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct RankView {
    /// The rank.
    pub(crate) dp_rank: u32,
    /// Whether its blocks come from its engine's KV events.
    pub(crate) exact: bool,
    /// How many blocks it holds.
    pub(crate) blocks: u64,
    /// The block hashes it holds, sorted.
    pub(crate) hashes: Vec<u64>,
}

//! The deployment model: the requests (sizes and Poisson arrivals) and the engine of one
//! worker, stepped like a continuous-batching server with chunked prefill. Pure and
//! deterministic: the same seed gives the same requests, the same decisions give the same
//! times. The parameters and their sources are in the bench's module docs.
//!
//! A worker may keep a prefix cache ([`Worker::with_prefix_cache`], used by the
//! `routing_prefix` bench): its requests then carry their [`Blocks`], and what a request
//! finds cached depends on where earlier requests went. Without one (the `routing` bench) a
//! request's `cached` tokens are taken as cached on every worker, as before.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::common::Rng;

/// The engine of one worker (see the bench's module docs for where each figure comes from).
#[derive(Clone, Copy, Debug)]
pub struct Engine {
    /// Prompt tokens prefilled per second of step time (compute-bound).
    pub prefill_rate: f64,
    /// Time of a step that reads the weights once (every step pays it).
    pub step_base: f64,
    /// KV tokens read per second of step time (every step reads the KV of every running
    /// sequence: decode is memory-bound).
    pub kv_read_rate: f64,
    /// KV tokens the cache holds; a request is let into the batch only while its prompt fits.
    pub kv_capacity: u64,
    /// Sequences in the batch at most (prefilling or decoding).
    pub max_running: usize,
    /// Tokens one step works on: one per decoding sequence, the rest goes to prefill chunks.
    pub chunk_tokens: u32,
}

pub const ENGINE: Engine = Engine {
    prefill_rate: 10_000.0,
    step_base: 0.008,
    kv_read_rate: 15_000_000.0,
    kv_capacity: 400_000,
    max_running: 256,
    chunk_tokens: 2048,
};

/// A `progressed` event every this many output tokens (and one at the first token).
pub const PROGRESS_EVERY: u32 = 32;

/// The request mix (see the bench's module docs).
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    pub prompt_median: f64,
    pub prompt_sigma: f64,
    pub prompt_max: u32,
    pub output_median: f64,
    pub output_sigma: f64,
    pub output_max: u32,
    /// Share of requests whose prompt starts with a prefix every worker has cached.
    pub cached_share: f64,
    /// That prefix's share of the prompt: uniform in this range.
    pub cached_fraction: (f64, f64),
}

pub const MIX: Mix = Mix {
    prompt_median: 1020.0,
    prompt_sigma: 1.0,
    prompt_max: 16_384,
    output_median: 129.0,
    output_sigma: 1.0,
    output_max: 2048,
    cached_share: 0.5,
    cached_fraction: (0.5, 0.9),
};

#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// Model seconds since the start.
    pub arrival: f64,
    pub prompt: u32,
    /// Prompt tokens every worker already holds (no prefill needed).
    pub cached: u32,
    pub output: u32,
}

impl Request {
    pub fn uncached(&self) -> u32 {
        self.prompt - self.cached
    }
}

pub fn uniform(rng: &mut Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

pub fn normal(rng: &mut Rng) -> f64 {
    // Box-Muller; 1 - u keeps the logarithm finite.
    let (u, v) = (1.0 - uniform(rng), uniform(rng));
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

pub fn lognormal(rng: &mut Rng, median: f64, sigma: f64, max: u32) -> u32 {
    ((median * (sigma * normal(rng)).exp()).round() as u32).clamp(1, max)
}

/// The sizes of `n` requests, the same for every load: only the gaps between them scale.
pub fn sizes(seed: u64, n: usize, mix: Mix) -> Vec<(u32, u32, u32)> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| {
            let prompt = lognormal(
                &mut rng,
                mix.prompt_median,
                mix.prompt_sigma,
                mix.prompt_max,
            );
            let output = lognormal(
                &mut rng,
                mix.output_median,
                mix.output_sigma,
                mix.output_max,
            );
            let cached = if uniform(&mut rng) < mix.cached_share {
                let (lo, hi) = mix.cached_fraction;
                (f64::from(prompt) * (lo + (hi - lo) * uniform(&mut rng))) as u32
            } else {
                0
            };
            (prompt, cached.min(prompt - 1), output)
        })
        .collect()
}

/// Requests arriving as a Poisson stream of `rate` per second until `until`.
#[allow(dead_code)] // `routing_prefix` draws sessions instead (`sessions.rs`)
pub fn arrivals(seed: u64, rate: f64, until: f64, mix: Mix) -> Vec<Request> {
    // Enough sizes for the stream with a wide margin; the gaps draw from their own stream.
    let sizes = sizes(seed, (rate * until * 1.5) as usize + 1000, mix);
    let mut gaps = Rng::new(seed ^ 0xA5A5_5A5A);
    let mut t = 0.0;
    let mut out = Vec::new();
    for (prompt, cached, output) in sizes {
        t += -(1.0 - uniform(&mut gaps)).ln() / rate;
        if t >= until {
            break;
        }
        out.push(Request {
            arrival: t,
            prompt,
            cached,
            output,
        });
    }
    out
}

/// What a worker tells the world at the end of a step: the lease events it publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Happened {
    /// The first token of request `index` (prefill done).
    FirstToken(usize),
    /// `output` tokens of `index` so far (every [`PROGRESS_EVERY`]).
    Progress(usize, u32),
    /// `index` ended.
    Completed(usize),
}

/// A request's prompt and output as blocks, for a worker with a prefix cache: prefixes of
/// the block hashes of the token stream they belong to (a conversation's, which each turn
/// extends), so that one stream serves every turn.
#[allow(dead_code)]
#[derive(Clone, Debug)]
pub struct Blocks {
    /// The chained block hashes of the whole stream.
    pub stream: Arc<[u64]>,
    /// Full blocks of the prompt.
    pub prompt: usize,
    /// Full blocks of the prompt and the output together.
    pub sequence: usize,
}

#[allow(dead_code)]
impl Blocks {
    /// The prompt's block hashes.
    pub fn prompt_hashes(&self) -> &[u64] {
        &self.stream[..self.prompt]
    }
}

/// An engine's prefix cache: blocks by chained hash, least recently used evicted first, at
/// most `capacity` blocks. A block is used when a request holding it joins the batch and
/// again when that request completes (its blocks go back to the free pool then, as vLLM's
/// do); a prompt's first block is used last, so a prompt's tail goes before its head.
#[allow(dead_code)]
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    tick: u64,
    last_use: HashMap<u64, u64>,
    /// `(tick, hash)` in use order; entries whose tick is not the block's last use are stale.
    order: VecDeque<(u64, u64)>,
    /// With KV events on: what the cache stored and evicted, in the order an engine says it.
    changes: Option<Vec<KvChange>>,
}

/// What an engine's KV events say of its cache (wire 1.3 `kv_stored` / `kv_removed`).
#[allow(dead_code)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvChange {
    /// A run of blocks in chain order, after `parent` (`None`: from a stream's first block).
    Stored {
        parent: Option<u64>,
        blocks: Vec<u64>,
    },
    Removed(Vec<u64>),
}

#[allow(dead_code)]
impl PrefixCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            tick: 0,
            last_use: HashMap::new(),
            order: VecDeque::new(),
            changes: None,
        }
    }

    /// Records what the cache stores and evicts from now on, for [`take_changes`].
    ///
    /// [`take_changes`]: Self::take_changes
    pub fn with_changes(mut self) -> Self {
        self.changes = Some(Vec::new());
        self
    }

    /// What the cache stored and evicted since the last call (empty without
    /// [`with_changes`](Self::with_changes)).
    pub fn take_changes(&mut self) -> Vec<KvChange> {
        self.changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// How many of `hashes`, from the first, the cache holds.
    pub fn hit(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.last_use.contains_key(*h))
            .count()
    }

    /// Uses `hashes` (a stream's, from its first block): each becomes the most recent, the
    /// first last; then evicts down to the capacity.
    pub fn touch(&mut self, hashes: &[u64]) {
        // The runs of blocks new to the cache, as `(first index, end)`.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        if self.changes.is_some() {
            for (i, h) in hashes.iter().enumerate() {
                if self.last_use.contains_key(h) {
                    continue;
                }
                match runs.last_mut() {
                    Some((_, end)) if *end == i => *end = i + 1,
                    _ => runs.push((i, i + 1)),
                }
            }
        }
        for &h in hashes.iter().rev() {
            self.tick += 1;
            self.last_use.insert(h, self.tick);
            self.order.push_back((self.tick, h));
        }
        let mut evicted = Vec::new();
        while self.last_use.len() > self.capacity {
            let Some((tick, h)) = self.order.pop_front() else {
                break;
            };
            if self.last_use.get(&h) == Some(&tick) {
                self.last_use.remove(&h);
                if self.changes.is_some() {
                    evicted.push(h);
                }
            }
        }
        if let Some(changes) = &mut self.changes {
            // An engine evicts to make room before it stores; said in that order, a router
            // bounded at the same capacity never evicts on its own.
            for chunk in evicted.chunks(lease_router::wire::MAX_BLOCK_HASHES) {
                changes.push(KvChange::Removed(chunk.to_vec()));
            }
            for (first, end) in runs {
                for at in (first..end).step_by(lease_router::wire::MAX_BLOCK_HASHES) {
                    let to = (at + lease_router::wire::MAX_BLOCK_HASHES).min(end);
                    changes.push(KvChange::Stored {
                        parent: at.checked_sub(1).map(|p| hashes[p]),
                        blocks: hashes[at..to].to_vec(),
                    });
                }
            }
        }
        if self.order.len() > 4 * self.capacity.max(1024) {
            let last_use = &self.last_use;
            self.order.retain(|(tick, h)| last_use.get(h) == Some(tick));
        }
    }
}

#[derive(Clone, Debug)]
struct Running {
    index: usize,
    prompt: u32,
    output: u32,
    prefill_left: u32,
    produced: u32,
    /// Tokens of prefill this step works on (0: none).
    chunk: u32,
    /// Decodes one token this step.
    decoding: bool,
    /// Its blocks, with a prefix cache.
    blocks: Option<Blocks>,
    /// Its priority, with [`Worker::with_priorities`] (higher first; 0 otherwise).
    priority: u8,
}

/// One worker's engine: a FIFO queue, a running batch, and the step in progress.
#[derive(Debug)]
pub struct Worker {
    engine: Engine,
    queue: VecDeque<(usize, Request, Option<Blocks>)>,
    running: Vec<Running>,
    /// Prompt plus output so far of every running sequence.
    kv_held: u64,
    /// When the step in progress ends; `None` when idle.
    pub step_end: Option<f64>,
    /// Prefill seconds of the step in progress.
    step_prefill: f64,
    /// Prefill (compute) seconds of the steps that ended inside the measured window.
    pub prefill_busy: f64,
    /// The prefix cache, if the worker keeps one, and its block size in tokens.
    cache: Option<(PrefixCache, u32)>,
    /// With a prefix cache: `(index, cached tokens)` of each request as it joined the batch
    /// (for the driver to take).
    pub joined: Vec<(usize, u32)>,
    /// With [`Worker::with_priorities`]: each queued or running request's priority.
    priorities: Option<HashMap<usize, u8>>,
}

impl Worker {
    pub fn new(engine: Engine) -> Self {
        Self {
            engine,
            queue: VecDeque::new(),
            running: Vec::new(),
            kv_held: 0,
            step_end: None,
            step_prefill: 0.0,
            prefill_busy: 0.0,
            cache: None,
            joined: Vec::new(),
            priorities: None,
        }
    }

    /// Request `index` reaches this worker at `now`: it queues, and an idle engine starts.
    pub fn arrive(&mut self, now: f64, index: usize, request: Request) {
        self.queue.push_back((index, request, None));
        if self.step_end.is_none() {
            self.start_step(now);
        }
    }

    /// Lets queued requests into the batch (FIFO, while a slot and KV for the prompt are
    /// free) and plans the next step from `now`: one token for every decoding sequence, the
    /// rest of the step's budget to prefill chunks in arrival order.
    fn start_step(&mut self, now: f64) {
        let e = self.engine;
        while let Some((_, r, _)) = self.queue.front() {
            if self.running.len() >= e.max_running
                || self.kv_held + u64::from(r.prompt) > e.kv_capacity
            {
                break;
            }
            let (index, r, blocks) = self.queue.pop_front().expect("a queued request");
            self.kv_held += u64::from(r.prompt);
            let mut prefill_left = r.uncached();
            if let (Some((cache, block_size)), Some(b)) = (&mut self.cache, &blocks) {
                // The engine looks its cache up as the request joins the batch, and the
                // prompt's blocks are in use (most recent) from then on.
                let cached = cached_tokens(cache, *block_size, &r, b);
                cache.touch(b.prompt_hashes());
                prefill_left = r.prompt - cached;
                self.joined.push((index, cached));
            }
            let priority = self
                .priorities
                .as_mut()
                .and_then(|p| p.remove(&index))
                .unwrap_or(0);
            // Higher priority first in the batch's prefill order, arrival order within one.
            let at = self.running.partition_point(|s| s.priority >= priority);
            self.running.insert(
                at,
                Running {
                    index,
                    prompt: r.prompt,
                    output: r.output,
                    prefill_left,
                    produced: 0,
                    chunk: 0,
                    decoding: false,
                    blocks,
                    priority,
                },
            );
        }
        let mut decoders = 0u32;
        for s in &mut self.running {
            s.decoding = s.prefill_left == 0;
            s.chunk = 0;
            decoders += u32::from(s.decoding);
        }
        let mut budget = e.chunk_tokens.saturating_sub(decoders);
        let mut prefill = 0u32;
        for s in self.running.iter_mut().filter(|s| s.prefill_left > 0) {
            if budget == 0 {
                break;
            }
            s.chunk = s.prefill_left.min(budget);
            budget -= s.chunk;
            prefill += s.chunk;
        }
        if decoders == 0 && prefill == 0 {
            self.step_end = None;
            return;
        }
        self.step_prefill = f64::from(prefill) / e.prefill_rate;
        let time = e.step_base + self.step_prefill + self.kv_held as f64 / e.kv_read_rate;
        self.step_end = Some(now + time);
    }

    /// Ends the step in progress (at its end time) and starts the next; `measure` says
    /// whether its prefill counts towards utilisation. Pushes what happened to `out`.
    pub fn end_step(&mut self, measure: bool, out: &mut Vec<Happened>) {
        let Some(now) = self.step_end.take() else {
            return;
        };
        if measure {
            self.prefill_busy += self.step_prefill;
        }
        let mut kv = self.kv_held;
        self.running.retain_mut(|s| {
            if s.decoding {
                s.produced += 1;
                kv += 1;
                if s.produced % PROGRESS_EVERY == 0 && s.produced < s.output {
                    out.push(Happened::Progress(s.index, s.produced));
                }
            } else if s.chunk > 0 {
                s.prefill_left -= s.chunk;
                if s.prefill_left == 0 {
                    s.produced = 1;
                    kv += 1;
                    out.push(Happened::FirstToken(s.index));
                }
            }
            if s.produced >= s.output {
                out.push(Happened::Completed(s.index));
                if let (Some((cache, _)), Some(b)) = (&mut self.cache, &s.blocks) {
                    // Prompt and output blocks go back to the free pool, cached.
                    cache.touch(&b.stream[..b.sequence]);
                }
                kv -= u64::from(s.prompt + s.produced);
                return false;
            }
            true
        });
        self.kv_held = kv;
        self.start_step(now);
    }
}

/// With a prefix cache (the `routing_prefix` bench; unused by the `routing` bench).
#[allow(dead_code)]
impl Worker {
    /// A worker whose engine keeps a prefix cache of `blocks` blocks of `block_size` tokens:
    /// a request arriving with [`arrive_with_blocks`](Self::arrive_with_blocks) prefills
    /// only what the cache lacks when it joins the batch (at most `prompt - 1` tokens
    /// cached, as vLLM recomputes the last prompt token for its logits).
    pub fn with_prefix_cache(engine: Engine, blocks: usize, block_size: u32) -> Self {
        Self {
            cache: Some((PrefixCache::new(blocks), block_size)),
            ..Self::new(engine)
        }
    }

    /// Its engine says what its cache stores and evicts ([`take_kv_changes`]), as vLLM's
    /// KV events through `lease-router relay` do.
    ///
    /// [`take_kv_changes`]: Self::take_kv_changes
    pub fn with_kv_events(mut self) -> Self {
        if let Some((cache, size)) = self.cache.take() {
            self.cache = Some((cache.with_changes(), size));
        }
        self
    }

    /// What the cache stored and evicted since the last call.
    pub fn take_kv_changes(&mut self) -> Vec<KvChange> {
        self.cache
            .as_mut()
            .map(|(cache, _)| cache.take_changes())
            .unwrap_or_default()
    }

    /// The prompt tokens of `request` the cache holds now (0 without a cache).
    pub fn cached_now(&self, request: &Request, blocks: &Blocks) -> u32 {
        match &self.cache {
            Some((cache, block_size)) => cached_tokens(cache, *block_size, request, blocks),
            None => request.cached,
        }
    }

    /// Request `index` with its blocks reaches this worker at `now` (see
    /// [`arrive`](Self::arrive)).
    pub fn arrive_with_blocks(&mut self, now: f64, index: usize, request: Request, blocks: Blocks) {
        self.queue.push_back((index, request, Some(blocks)));
        if self.step_end.is_none() {
            self.start_step(now);
        }
    }
}

/// What the engine has still to prefill, and priority scheduling (the `admission` bench;
/// unused by the others).
#[allow(dead_code)]
impl Worker {
    /// An engine that schedules by priority, as vLLM's `--scheduling-policy priority`: its
    /// queue and its batch's prefill chunks in order of priority (higher first here), then
    /// of arrival. Running requests are not preempted.
    pub fn with_priorities(mut self) -> Self {
        self.priorities = Some(HashMap::new());
        self
    }

    /// Request `index` of `priority` reaches this worker at `now` (see
    /// [`arrive`](Self::arrive)); without [`with_priorities`](Self::with_priorities) the
    /// priority is ignored.
    pub fn arrive_with_priority(&mut self, now: f64, index: usize, request: Request, priority: u8) {
        let Some(priorities) = self.priorities.as_mut() else {
            return self.arrive(now, index, request);
        };
        priorities.insert(index, priority);
        let at = self
            .queue
            .partition_point(|(i, _, _)| priorities.get(i).copied().unwrap_or(0) >= priority);
        self.queue.insert(at, (index, request, None));
        if self.step_end.is_none() {
            self.start_step(now);
        }
    }

    /// Prompt tokens this engine has still to prefill: those of its queued requests (less
    /// what every worker holds cached) and the rest of its running prefills.
    pub fn prefill_waiting(&self) -> u64 {
        let queued: u64 = self
            .queue
            .iter()
            .map(|(_, r, _)| u64::from(r.uncached()))
            .sum();
        let running: u64 = self.running.iter().map(|s| u64::from(s.prefill_left)).sum();
        queued + running
    }

    /// Requests in its queue (not yet in the batch) and in its batch.
    pub fn queued_and_running(&self) -> (usize, usize) {
        (self.queue.len(), self.running.len())
    }
}

/// The prompt tokens of `request` that `cache` holds: its longest cached prefix of blocks,
/// at most `prompt - 1` (and at least what the request says every worker holds).
fn cached_tokens(cache: &PrefixCache, block_size: u32, request: &Request, blocks: &Blocks) -> u32 {
    let hit = cache.hit(blocks.prompt_hashes()) as u64 * u64::from(block_size);
    (hit.min(u64::from(request.prompt.saturating_sub(1))) as u32).max(request.cached)
}

/// The model's next event, the earlier of the next arrival (at `arrival`) and the first
/// step to end: `(time, None)` for the arrival (first on a tie), `(time, Some(w))` for
/// worker `w`'s step; `None` when neither is left.
pub fn next_event(workers: &[Worker], arrival: Option<f64>) -> Option<(f64, Option<usize>)> {
    let step = workers
        .iter()
        .enumerate()
        .filter_map(|(w, k)| k.step_end.map(|t| (t, w)))
        .min_by(|a, b| a.0.total_cmp(&b.0));
    match (arrival, step) {
        (Some(a), Some((s, _))) if a <= s => Some((a, None)),
        (Some(a), None) => Some((a, None)),
        (_, Some((s, w))) => Some((s, Some(w))),
        (None, None) => None,
    }
}

/// Completed requests per second of one worker kept saturated (an endless queue of the
/// mix's requests): what "100% load" means for one worker.
pub fn saturated_throughput(engine: Engine, seed: u64, mix: Mix) -> f64 {
    const N: usize = 6000;
    let mut worker = Worker::new(engine);
    for (i, (prompt, cached, output)) in sizes(seed ^ 0x5A7, N, mix).into_iter().enumerate() {
        let r = Request {
            arrival: 0.0,
            prompt,
            cached,
            output,
        };
        worker.arrive(0.0, i, r);
    }
    // The rate between the 1,000th and the 5,000th completion: past the start, before the
    // queue runs dry.
    let mut out = Vec::new();
    let (mut done, mut from) = (0usize, 0.0);
    while let Some(end) = worker.step_end {
        worker.end_step(false, &mut out);
        for h in out.drain(..) {
            if let Happened::Completed(_) = h {
                done += 1;
                if done == 1000 {
                    from = end;
                }
                if done == 5000 {
                    return 4000.0 / (end - from);
                }
            }
        }
    }
    unreachable!("the queue holds {N} requests")
}

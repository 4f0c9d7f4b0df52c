//! `lease-router relay`: one engine's own KV cache events (vLLM's, SGLang's in the same
//! format), read from its ZeroMQ sockets, turned into wire 1.3 `kv_stored` / `kv_removed` /
//! `kv_cleared` with our block hashes, published through [`LeasePublisher`] on the worker's
//! own subject. The pieces: [`frames`] (the engine's messages decoded), [`translate`] (our
//! hashes and the engine-hash map), [`metrics`] (counters and their Prometheus text), and here
//! the sequence logic ([`Relay`]: gaps, replay, restarts) and the sockets ([`run`]).
//!
//! # The engine's wire layout
//!
//! Read from vLLM's `vllm/distributed/kv_events.py` at two points of its history (0.9, commit
//! b4e69e0, and the main branch of 2026, commit 0181ea3) and its
//! `examples/online_serving/kv_events_subscriber.py` (0.10/0.11, with `medium`):
//!
//! - **The PUB socket** (`endpoint`, such as `tcp://*:5557`; with data parallelism the port
//!   is offset by the rank, one relay per rank) sends messages of three frames:
//!   `[topic, seq, payload]`. `topic` is the configured topic (UTF-8, may be empty; a SUB
//!   filters on its prefix). `seq` is 8 bytes, big-endian, counting from 0 per engine process
//!   (an engine restart starts over at 0). `payload` is one MessagePack `KVEventBatch`.
//! - **`KVEventBatch`**: msgspec `array_like` structs up to 0.11, so an array
//!   `[ts, events]` (0.9) or `[ts, events, data_parallel_rank]` (0.10 on); later versions
//!   encode plain structs, a map `{"ts", "events", "data_parallel_rank"}`. `ts` is a float
//!   (seconds since the epoch).
//! - **Events** are tagged unions: in the array form `[tag, field...]` with the tag the
//!   class name, in the map form `{"type": tag, field: value...}`. `omit_defaults` drops
//!   trailing fields left at their default (array form) or absent fields (map form), so
//!   every field after the first few may be missing:
//!   - `BlockStored`: `block_hashes` (list of `int`, or `bytes` from 0.11 with some hash
//!     algorithms), `parent_block_hash` (same, or nil for a prompt's first block),
//!     `token_ids` (the stored blocks' tokens: `block_size` per block), `block_size`,
//!     `lora_id` (int or nil), then `medium` ("GPU", "CPU"... or nil; 0.10 on),
//!     `lora_name`, `extra_keys` (per block, nil or a tuple of multimodal hashes, cache
//!     salt...), `group_idx` (the KV cache group), `kv_cache_spec_kind`,
//!     `kv_cache_spec_sliding_window`. SGLang puts a metadata map where vLLM has
//!     `lora_name`.
//!   - `BlockRemoved`: `block_hashes`, then `medium`, `group_idx`.
//!   - `AllBlocksCleared`: no field.
//! - **The replay socket** (`replay_endpoint`, a ROUTER such as `tcp://*:5558`): a client
//!   sends the 8-byte big-endian sequence number to start from (a REQ sends `[seq]`, a DEALER
//!   `["", seq]`: the ROUTER wants `[identity, "", seq]`); the engine answers with every
//!   batch it still buffers from that number on (vLLM keeps the last 10,000), one message
//!   `["", seq, payload]` each, the very bytes it published, then an end marker whose seq
//!   is -1 (`ff` x 8) and whose payload is empty.
//!
//! # What the relay does with them
//!
//! On start it publishes `kv_cleared` for its rank (whatever a previous relay said is
//! forgotten), subscribes, and asks the replay socket for everything from 0: the engine's
//! cache is rebuilt from its buffered history. Then, for each message:
//!
//! - seq = last + 1: applied.
//! - seq > last + 1 (a gap: the PUB dropped messages, or the relay was slow to subscribe):
//!   the missing ones are asked of the replay socket from last + 1 and applied in order
//!   (the live ones that replay already gave are dropped as duplicates). A gap replay cannot
//!   fill (no replay socket, its buffer no longer reaches back, a timeout) becomes
//!   `kv_cleared` and a fresh start from the current message: the index then holds less
//!   than the engine, never more.
//! - seq <= last (not one the replay gave): the engine restarted. `kv_cleared`, and a fresh
//!   start from the new engine's replay buffer.
//! - When the SUB socket reconnects (the engine or the network went away), the relay asks
//!   for a replay from `last` and compares its first batch with the bytes it had: the same
//!   engine continues (and what was missed meanwhile is filled in); another one is a restart.
//! - A payload that is not a `KVEventBatch` is counted and becomes `kv_cleared` (its events
//!   are lost for good: a replay would give the same bytes); messages of the wrong frames
//!   are counted and dropped (the next good one shows the gap).
//!
//! Stored blocks are translated as [`translate`] says (our hashes from the token ids, the
//! engine-hash map bounded by `--max-blocks`); events of another block size, another medium
//! than the GPU, another KV cache group than the first, or keyed on more than tokens (LoRA,
//! multimodal inputs, a cache salt) are counted and skipped. A full publisher queue holds
//! the relay back (the engine's messages wait in ZeroMQ); an event lost on the way (the queue
//! full for 5 s, NATS down) is made up for with `kv_cleared`. On shutdown the relay publishes `kv_cleared` (no
//! one reports the engine's evictions any more) and flushes.

pub mod frames;
pub mod metrics;
pub mod translate;

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use lease_router::wire::{KvCleared, KvRemoved, KvStored, LeaseEvent};
use lease_router::{LeasePublisher, PublishEventError};
use tokio_util::sync::CancellationToken;
use xxhash_rust::xxh3::xxh3_64;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend};
use zeromq::{SubSocket, ZmqMessage};

use frames::{decode_batch, pub_frame, replay_frame, Frame, END_SEQ};
use metrics::Metrics;
use translate::{KvSink, Translator};

/// Replies of one replay read at most: vLLM buffers 10,000 batches.
const MAX_REPLAY_FRAMES: usize = 1_000_000;

/// What one relay follows and how.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub block_size: usize,
    pub max_blocks: usize,
    pub dp_rank: u32,
    /// How long a replay may wait for its connection and for each reply.
    pub replay_timeout: Duration,
}

/// Why the relay told the index to forget the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearReason {
    Start,
    Gap,
    EngineRestart,
    Malformed,
    PublishLost,
    Shutdown,
}

/// The engine's replay socket, or a stand-in in tests.
pub trait ReplaySource {
    /// The batches the engine still buffers from `from` on, in its order, up to (not
    /// including) its end marker. `Err` when it does not answer in time; replies past a
    /// malformed one are not read (what came before is returned).
    fn replay(&mut self, from: u64) -> impl Future<Output = Result<Vec<Frame>, String>> + Send;
}

/// The sequence logic: one engine's messages in, the index's events out through `S`.
pub struct Relay<S, R> {
    translator: Translator,
    sink: S,
    replay: Option<R>,
    metrics: Arc<Metrics>,
    dp_rank: u32,
    /// The engine's sequence number expected next; `None`: any (nothing is known of the
    /// engine's history, a fresh start takes the first message that comes).
    next: Option<u64>,
    /// XXH3-64 of the last applied message's payload: an engine is known again by it after
    /// a reconnect.
    last_hash: u64,
    /// The sequence numbers the last replay applied: the live stream still delivers them.
    replayed: Option<(u64, u64)>,
}

impl<S: KvSink, R: ReplaySource> Relay<S, R> {
    pub fn new(
        settings: &RelaySettings,
        sink: S,
        replay: Option<R>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            translator: Translator::new(settings.block_size, settings.max_blocks),
            sink,
            replay,
            metrics,
            dp_rank: settings.dp_rank,
            next: None,
            last_hash: 0,
            replayed: None,
        }
    }

    /// Forgets the rank (index and map) and counts why. The sequence state is the caller's.
    pub fn clear(&mut self, reason: ClearReason) {
        let m = &self.metrics;
        match reason {
            ClearReason::Start => &m.clears_start,
            ClearReason::Gap => &m.clears_gap,
            ClearReason::EngineRestart => &m.clears_restart,
            ClearReason::Malformed => &m.clears_malformed,
            ClearReason::PublishLost => &m.clears_publish,
            ClearReason::Shutdown => &m.clears_shutdown,
        }
        .fetch_add(1, Relaxed);
        self.translator.clear(&mut self.sink, &self.metrics);
    }

    /// The start: `kv_cleared`, then the engine's history from its replay socket (`run` does
    /// the two apart, connecting in between).
    #[cfg(test)]
    pub async fn start(&mut self) {
        self.clear(ClearReason::Start);
        self.refill_from_zero().await;
    }

    /// A fresh start's history (the rank was just cleared): whatever the replay buffer
    /// holds, from its first batch. An empty buffer is an engine that has published
    /// nothing: its next message is 0.
    async fn refill_from_zero(&mut self) {
        self.next = None;
        self.replayed = None;
        if let Some(frames) = self.fetch(0).await {
            self.apply_replies(frames);
            if self.next.is_none() {
                self.next = Some(0);
            }
        }
    }

    async fn fetch(&mut self, from: u64) -> Option<Vec<Frame>> {
        let replay = self.replay.as_mut()?;
        match replay.replay(from).await {
            Ok(frames) => Some(frames),
            Err(error) => {
                self.metrics.replay_failed(&error);
                None
            }
        }
    }

    /// Applies replies in order from the one expected (any first one when none is),
    /// dropping those already applied. A hole (the buffer lacks a message) clears the rank
    /// and starts afresh from the reply after it; returns whether one did.
    fn apply_replies(&mut self, frames: Vec<Frame>) -> bool {
        let mut first = None;
        let mut holes = false;
        for frame in frames {
            if frame.seq == END_SEQ {
                break;
            }
            match self.next {
                Some(next) if frame.seq < next => continue,
                Some(next) if frame.seq > next => {
                    self.metrics.gap_cleared(next, frame.seq);
                    self.clear(ClearReason::Gap);
                    holes = true;
                    first = None;
                }
                _ => {}
            }
            first.get_or_insert(frame.seq);
            self.apply(&frame, true);
        }
        self.replayed = match (first, self.next) {
            (Some(first), Some(next)) => Some((first, next - 1)),
            _ => self.replayed,
        };
        holes
    }

    /// One message of the PUB socket, as its frames.
    pub async fn on_live(&mut self, frames: &[Bytes]) {
        match pub_frame(frames) {
            Ok(frame) => self.on_frame(frame).await,
            Err(error) => self.metrics.malformed_frame(&error.to_string()),
        }
        self.settle().await;
    }

    /// Waits for the sink to take what it held back; an event it lost clears the rank.
    pub async fn settle(&mut self) {
        self.sink.settle().await;
        if self.sink.take_lost() {
            self.clear(ClearReason::PublishLost);
            self.sink.settle().await;
        }
    }

    async fn on_frame(&mut self, frame: Frame) {
        let seq = frame.seq;
        if seq == END_SEQ {
            self.metrics
                .malformed_frame("a live message with the end marker's sequence number");
            return;
        }
        if let Some((lo, hi)) = self.replayed {
            if (lo..=hi).contains(&seq) {
                self.metrics.duplicates.fetch_add(1, Relaxed);
                return;
            }
            if seq > hi {
                self.replayed = None;
            }
        }
        match self.next {
            None => self.apply(&frame, false),
            Some(next) if seq == next => self.apply(&frame, false),
            Some(next) if seq > next => self.gap(next, frame).await,
            Some(next) => {
                self.metrics.engine_restart(next - 1, Some(seq));
                self.clear(ClearReason::EngineRestart);
                self.refill_from_zero().await;
                // Not a gap repaired: a restart.
                self.after_replay(frame, true);
            }
        }
    }

    /// The live message after a replay: applied unless the replay gave it (a gap repaired,
    /// unless `cleared`: a hole in the replies cleared the rank, or this is a restart's
    /// replay); when the replay did not reach it, what lies between is lost: the rank is
    /// cleared and starts afresh from it.
    fn after_replay(&mut self, frame: Frame, cleared: bool) {
        match self.next {
            Some(next) if frame.seq < next => {
                self.metrics.duplicates.fetch_add(1, Relaxed);
            }
            Some(next) if frame.seq > next => {
                self.metrics.gap_cleared(next, frame.seq);
                self.clear(ClearReason::Gap);
                self.replayed = None;
                self.apply(&frame, false);
            }
            _ => {
                if !cleared {
                    self.metrics.gaps_repaired.fetch_add(1, Relaxed);
                }
                self.apply(&frame, false)
            }
        }
    }

    async fn gap(&mut self, next: u64, frame: Frame) {
        let mut cleared = false;
        if let Some(frames) = self.fetch(next).await {
            cleared = self.apply_replies(frames);
        }
        match self.next {
            Some(now) if now > frame.seq => {
                if !cleared {
                    self.metrics.gaps_repaired.fetch_add(1, Relaxed);
                }
                self.metrics.duplicates.fetch_add(1, Relaxed);
            }
            _ => self.after_replay(frame, cleared),
        }
    }

    /// The SUB socket connected again: the same engine (fill in what was missed) or another?
    pub async fn on_reconnect(&mut self) {
        self.check_reconnect().await;
        self.settle().await;
    }

    async fn check_reconnect(&mut self) {
        let last = match self.next {
            // Nothing known: the start found no replay socket.
            None => return,
            // Nothing applied since the fresh start: whatever the engine holds is news.
            Some(0) => return self.refill_from_zero().await,
            Some(next) => next - 1,
        };
        let Some(frames) = self.fetch(last).await else {
            return;
        };
        match frames.first() {
            Some(first) if first.seq == last && xxh3_64(&first.payload) == self.last_hash => {
                let before = self.metrics.batches.load(Relaxed);
                if !self.apply_replies(frames) && self.metrics.batches.load(Relaxed) > before {
                    self.metrics.gaps_repaired.fetch_add(1, Relaxed);
                }
            }
            Some(first) if first.seq > last => {
                // The buffer no longer reaches back to what was applied: cannot tell.
                self.metrics.gap_cleared(last + 1, first.seq);
                self.clear(ClearReason::Gap);
                self.next = None;
                self.replayed = None;
                self.apply_replies(frames);
            }
            _ => {
                self.metrics.engine_restart(last, None);
                self.clear(ClearReason::EngineRestart);
                self.refill_from_zero().await;
            }
        }
    }

    /// Applies one batch (or, when its payload is not one, forgets the rank) and moves the
    /// sequence on.
    fn apply(&mut self, frame: &Frame, replayed: bool) {
        let metrics = self.metrics.clone();
        match decode_batch(&frame.payload) {
            Ok(batch) => {
                if let Some(rank) = batch.dp_rank.filter(|&r| r != i64::from(self.dp_rank)) {
                    metrics.dp_rank_mismatch(rank, self.dp_rank);
                }
                for event in batch.events {
                    self.translator.apply(event, &mut self.sink, &metrics);
                }
                metrics.batches.fetch_add(1, Relaxed);
                if replayed {
                    metrics.replayed_batches.fetch_add(1, Relaxed);
                }
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                if batch.ts.is_finite() {
                    metrics.set_lag((now - batch.ts).max(0.0));
                }
            }
            Err(error) => {
                metrics.malformed_frame(&format!("payload of seq {}: {error}", frame.seq));
                self.clear(ClearReason::Malformed);
            }
        }
        if self.sink.take_lost() {
            self.clear(ClearReason::PublishLost);
        }
        self.next = Some(frame.seq + 1);
        self.last_hash = xxh3_64(&frame.payload);
        metrics.last_seq.store(frame.seq, Relaxed);
        metrics.has_seq.store(true, Relaxed);
    }
}

/// How long the relay waits for its publisher's queue to take the events held back before
/// it gives them up (then `kv_cleared` follows): NATS is down that long.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The index's events into a [`LeasePublisher`], for one worker rank. A full queue holds the
/// relay back (the engine's messages wait in ZeroMQ, its replay covers what its PUB socket
/// drops meanwhile) rather than losing events.
pub struct PublisherSink {
    publisher: LeasePublisher,
    worker_id: u64,
    dp_rank: u32,
    metrics: Arc<Metrics>,
    /// Events the queue had no room for, in order, for [`KvSink::settle`].
    pending: VecDeque<LeaseEvent>,
    /// An event was lost since the last `kv_cleared` that was queued.
    lost: bool,
}

impl PublisherSink {
    pub fn new(
        publisher: LeasePublisher,
        worker_id: u64,
        dp_rank: u32,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            publisher,
            worker_id,
            dp_rank,
            metrics,
            pending: VecDeque::new(),
            lost: false,
        }
    }

    fn offer(&mut self, event: LeaseEvent) {
        if !self.pending.is_empty() {
            self.pending.push_back(event);
            return;
        }
        match self.publisher.publish(event.clone()) {
            Ok(()) => self.queued(&event),
            Err(PublishEventError::QueueFull) => self.pending.push_back(event),
            Err(error) => self.lose(1, &error.to_string()),
        }
    }

    fn queued(&mut self, event: &LeaseEvent) {
        if matches!(event, LeaseEvent::KvCleared(_)) {
            // Everything before it is forgotten by the index, the losses too.
            self.lost = false;
        }
    }

    fn lose(&mut self, events: u64, why: &str) {
        self.metrics.publish_dropped(events, why);
        self.lost = true;
    }
}

impl KvSink for PublisherSink {
    fn stored(&mut self, parent: Option<u64>, blocks: Vec<u64>) {
        self.offer(LeaseEvent::KvStored(KvStored {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            parent_hash: parent,
            block_hashes: blocks,
        }));
    }

    fn removed(&mut self, blocks: Vec<u64>) {
        self.offer(LeaseEvent::KvRemoved(KvRemoved {
            worker_id: self.worker_id,
            dp_rank: self.dp_rank,
            block_hashes: blocks,
        }));
    }

    fn cleared(&mut self) {
        self.offer(LeaseEvent::KvCleared(KvCleared {
            worker_id: self.worker_id,
            dp_rank: Some(self.dp_rank),
        }));
    }

    fn take_lost(&mut self) -> bool {
        self.lost
    }

    async fn settle(&mut self) {
        while let Some(event) = self.pending.front().cloned() {
            match self.publisher.publish(event.clone()) {
                Ok(()) => {
                    self.pending.pop_front();
                    self.queued(&event);
                }
                Err(PublishEventError::QueueFull) => {
                    self.metrics.publish_waits.fetch_add(1, Relaxed);
                    let flushed =
                        tokio::time::timeout(SETTLE_TIMEOUT, self.publisher.flush()).await;
                    if flushed.is_err() {
                        let held = self.pending.len() as u64;
                        self.pending.clear();
                        self.lose(held, "the publisher's queue stayed full");
                    }
                }
                Err(error) => {
                    self.pending.pop_front();
                    self.lose(1, &error.to_string());
                }
            }
        }
    }
}

/// The engine's replay socket: one DEALER connection per request.
pub struct ZmqReplay {
    endpoint: String,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

impl ZmqReplay {
    pub fn new(endpoint: String, timeout: Duration, metrics: Arc<Metrics>) -> Self {
        Self {
            endpoint,
            timeout,
            metrics,
        }
    }
}

impl ReplaySource for ZmqReplay {
    fn replay(&mut self, from: u64) -> impl Future<Output = Result<Vec<Frame>, String>> + Send {
        let endpoint = self.endpoint.clone();
        let timeout = self.timeout;
        let metrics = self.metrics.clone();
        async move {
            metrics.replay_requests.fetch_add(1, Relaxed);
            let mut options = SocketOptions::default();
            options.connect_timeout(timeout);
            let mut socket = DealerSocket::with_options(options);
            let within = |what: &str| format!("{what} within {timeout:?} ({endpoint})");
            tokio::time::timeout(timeout, socket.connect(&endpoint))
                .await
                .map_err(|_| within("no connection to the replay socket"))?
                .map_err(|e| format!("cannot connect to the replay socket {endpoint}: {e}"))?;
            let mut request = ZmqMessage::from(Bytes::new());
            request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
            tokio::time::timeout(timeout, socket.send(request))
                .await
                .map_err(|_| within("the replay request was not sent"))?
                .map_err(|e| format!("the replay request failed: {e}"))?;
            let mut frames = Vec::new();
            loop {
                let message = tokio::time::timeout(timeout, socket.recv())
                    .await
                    .map_err(|_| within("no end marker from the replay socket"))?
                    .map_err(|e| format!("the replay socket failed: {e}"))?;
                match replay_frame(&message.into_vec()) {
                    Ok(frame) if frame.seq == END_SEQ => break,
                    Ok(frame) => frames.push(frame),
                    Err(error) => {
                        metrics.malformed_frame(&format!("replay reply: {error}"));
                        break;
                    }
                }
                if frames.len() >= MAX_REPLAY_FRAMES {
                    break;
                }
            }
            Ok(frames)
        }
    }
}

/// How long one attempt to reach the engine's PUB socket may take before the next.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);

/// Follows the engine until `cancel`: the start (after `kv_cleared` has been queued), then
/// every message, with the gap, restart and reconnect handling of [`Relay`]. Ends with
/// `kv_cleared` (the relay no longer follows the engine). `Err` only when the SUB socket
/// cannot be set up (an invalid endpoint).
pub async fn run<S: KvSink + Send>(
    settings: RelaySettings,
    sink: S,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) -> Result<S, String> {
    let replay = settings
        .replay_endpoint
        .clone()
        .map(|endpoint| ZmqReplay::new(endpoint, settings.replay_timeout, metrics.clone()));
    let mut relay = Relay::new(&settings, sink, replay, metrics.clone());
    relay.clear(ClearReason::Start);

    let mut options = SocketOptions::default();
    options.connect_timeout(CONNECT_ATTEMPT);
    let mut socket = SubSocket::with_options(options);
    let mut monitor = socket.monitor();
    socket
        .subscribe(&settings.topic)
        .await
        .map_err(|e| format!("cannot subscribe to topic {:?}: {e}", settings.topic))?;
    let mut attempts = 0u64;
    loop {
        let connected = tokio::select! {
            result = socket.connect(&settings.endpoint) => result,
            _ = cancel.cancelled() => return Ok(finish(relay).await),
        };
        match connected {
            Ok(()) => break,
            Err(zeromq::ZmqError::Endpoint(error)) => {
                return Err(format!("invalid --endpoint {}: {error}", settings.endpoint));
            }
            Err(error) => {
                attempts += 1;
                if attempts == 1 || attempts.is_multiple_of(30) {
                    tracing::warn!(endpoint = %settings.endpoint, %error, attempts,
                        "the engine's PUB socket does not answer yet; retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                    _ = cancel.cancelled() => return Ok(finish(relay).await),
                }
            }
        }
    }
    metrics.engine_connected.store(true, Relaxed);
    tracing::info!(endpoint = %settings.endpoint, "subscribed to the engine's KV events");
    // The start's `kv_cleared` went out above; now the history.
    relay.refill_from_zero().await;
    relay.settle().await;

    let mut disconnected = false;
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            event = monitor.next() => match event {
                Some(SocketEvent::Disconnected(_)) => {
                    metrics.engine_connected.store(false, Relaxed);
                    metrics.engine_disconnects.fetch_add(1, Relaxed);
                    tracing::warn!(endpoint = %settings.endpoint,
                        "the engine's PUB socket went away; reconnecting");
                    disconnected = true;
                }
                Some(SocketEvent::Connected(..)) => {
                    metrics.engine_connected.store(true, Relaxed);
                    if std::mem::take(&mut disconnected) {
                        tracing::info!(endpoint = %settings.endpoint, "the engine is back");
                        relay.on_reconnect().await;
                    }
                }
                Some(_) => {}
                None => monitor = socket.monitor(),
            },
            message = socket.recv() => match message {
                Ok(message) => relay.on_live(&message.into_vec()).await,
                Err(error) => {
                    // A connection that broke mid-message: the monitor says it went away,
                    // the reconnect verifies the engine.
                    tracing::debug!(%error, "the SUB socket's connection failed");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                        _ = cancel.cancelled() => break,
                    }
                }
            },
        }
    }
    Ok(finish(relay).await)
}

async fn finish<S: KvSink, R: ReplaySource>(mut relay: Relay<S, R>) -> S {
    relay.clear(ClearReason::Shutdown);
    relay.sink.settle().await;
    relay.sink
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::translate::tests::{Recorder, Told};
    use lease_router::block_hashes;
    use rmpv::Value;
    use std::collections::BTreeMap;

    /// A replay buffer in memory.
    #[derive(Default, Clone)]
    struct Buffer(Vec<Frame>, bool);

    impl ReplaySource for Buffer {
        fn replay(&mut self, from: u64) -> impl Future<Output = Result<Vec<Frame>, String>> + Send {
            let result = if self.1 {
                Err("down".to_owned())
            } else {
                Ok(self.0.iter().filter(|f| f.seq >= from).cloned().collect())
            };
            async move { result }
        }
    }

    fn settings() -> RelaySettings {
        RelaySettings {
            endpoint: String::new(),
            replay_endpoint: None,
            topic: String::new(),
            block_size: 2,
            max_blocks: 1000,
            dp_rank: 0,
            replay_timeout: Duration::from_secs(1),
        }
    }

    fn payload(events: Vec<Value>) -> Bytes {
        let batch = Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::from(0)]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &batch).unwrap();
        out.into()
    }

    fn store(key: u64, parent: Option<u64>, tokens: &[u32]) -> Value {
        Value::Array(vec![
            "BlockStored".into(),
            Value::Array(vec![key.into()]),
            parent.map_or(Value::Nil, Value::from),
            Value::Array(tokens.iter().map(|&t| t.into()).collect()),
            2.into(),
            Value::Nil,
            "GPU".into(),
        ])
    }

    fn remove(key: u64) -> Value {
        Value::Array(vec!["BlockRemoved".into(), Value::Array(vec![key.into()])])
    }

    /// What a recorder's events leave in the index.
    fn held(sink: &Recorder) -> Vec<u64> {
        let mut held = BTreeMap::new();
        for told in &sink.0 {
            match told {
                Told::Stored(_, blocks) => blocks.iter().for_each(|b| {
                    held.insert(*b, ());
                }),
                Told::Removed(blocks) => blocks.iter().for_each(|b| {
                    held.remove(b);
                }),
                Told::Cleared => held.clear(),
            }
        }
        held.into_keys().collect()
    }

    fn frame(seq: u64, payload: Bytes) -> Frame {
        Frame { seq, payload }
    }

    fn relay(buffer: Option<Buffer>) -> Relay<Recorder, Buffer> {
        Relay::new(&settings(), Recorder::default(), buffer, Arc::default())
    }

    fn ours(tokens: &[u32]) -> Vec<u64> {
        let mut h = block_hashes(tokens, 2);
        h.sort();
        h
    }

    #[tokio::test]
    async fn gaps_are_filled_from_replay_and_duplicates_dropped() {
        let frames = vec![
            frame(0, payload(vec![store(10, None, &[1, 2])])),
            frame(1, payload(vec![store(11, Some(10), &[3, 4])])),
            frame(2, payload(vec![remove(10)])),
            frame(3, payload(vec![store(12, Some(11), &[5, 6])])),
        ];
        let mut r = relay(Some(Buffer(frames.clone(), false)));
        r.start().await;
        assert_eq!(r.next, Some(4));
        // The live stream repeats what replay gave, then skips 4 (in the buffer by now).
        for f in &frames {
            r.on_frame(f.clone()).await;
        }
        let next = frame(4, payload(vec![remove(12)]));
        let after = frame(5, payload(vec![store(13, None, &[7, 8])]));
        r.replay.as_mut().unwrap().0.extend([next, after.clone()]);
        r.on_frame(after).await;
        let all = block_hashes(&[1, 2, 3, 4, 5, 6], 2);
        let mut want = vec![all[1], block_hashes(&[7, 8], 2)[0]];
        want.sort();
        assert_eq!(held(&r.sink), want);
        let m = &r.metrics;
        assert_eq!(
            m.duplicates.load(Relaxed),
            5,
            "the four again, then 5 after its replay"
        );
        assert_eq!(m.gaps_repaired.load(Relaxed), 1);
        assert_eq!(m.gaps_cleared.load(Relaxed), 0);
    }

    #[tokio::test]
    async fn an_unfillable_gap_clears_and_starts_afresh() {
        let mut r = relay(Some(Buffer(Vec::new(), false)));
        r.start().await;
        r.on_frame(frame(0, payload(vec![store(10, None, &[1, 2])])))
            .await;
        // 1 is in no buffer.
        r.on_frame(frame(2, payload(vec![store(20, None, &[9, 9])])))
            .await;
        assert_eq!(held(&r.sink), ours(&[9, 9]));
        assert_eq!(r.metrics.gaps_cleared.load(Relaxed), 1);
        // Without a replay socket, the same.
        let mut r = relay(None);
        r.start().await;
        r.on_frame(frame(5, payload(vec![store(10, None, &[1, 2])])))
            .await;
        r.on_frame(frame(7, payload(vec![store(11, Some(10), &[3, 4])])))
            .await;
        assert!(held(&r.sink).is_empty(), "its parent went with the clear");
        assert_eq!(r.metrics.unknown_parents.load(Relaxed), 1);
        assert_eq!(r.metrics.clears_gap.load(Relaxed), 1);
    }

    #[tokio::test]
    async fn a_restart_is_seen_by_the_sequence_or_by_the_reconnect() {
        let old = vec![
            frame(0, payload(vec![store(10, None, &[1, 2])])),
            frame(1, payload(vec![store(11, None, &[3, 4])])),
        ];
        let mut r = relay(Some(Buffer(old.clone(), false)));
        r.start().await;
        let mut both = vec![block_hashes(&[1, 2], 2)[0], block_hashes(&[3, 4], 2)[0]];
        both.sort();
        assert_eq!(held(&r.sink), both);
        // The same engine after a reconnect: nothing changes.
        r.on_reconnect().await;
        assert_eq!(r.metrics.engine_restarts.load(Relaxed), 0);
        // A new engine: seq 0 again, its own history.
        let new = vec![frame(0, payload(vec![store(30, None, &[5, 6])]))];
        r.replay = Some(Buffer(new.clone(), false));
        r.on_reconnect().await;
        assert_eq!(held(&r.sink), ours(&[5, 6]));
        assert_eq!(r.metrics.engine_restarts.load(Relaxed), 1);
        r.on_frame(new[0].clone()).await;
        assert_eq!(r.metrics.duplicates.load(Relaxed), 1);
        // By the sequence alone: 0 after 0 that is not a replayed one.
        r.replayed = None;
        let newer = frame(0, payload(vec![store(40, None, &[7, 8])]));
        r.replay = Some(Buffer(Vec::new(), true));
        r.on_frame(newer).await;
        assert_eq!(held(&r.sink), ours(&[7, 8]));
        assert_eq!(r.metrics.engine_restarts.load(Relaxed), 2);
    }

    #[tokio::test]
    async fn a_hole_in_the_replay_buffer_clears_and_goes_on_after_it() {
        // 2 was lost for good; a relay starting now sees what the running one saw.
        let frames = vec![
            frame(0, payload(vec![store(10, None, &[1, 2])])),
            frame(1, payload(vec![store(11, None, &[3, 4])])),
            frame(3, payload(vec![store(12, Some(10), &[5, 6])])),
            frame(4, payload(vec![store(13, None, &[7, 8])])),
        ];
        let mut r = relay(Some(Buffer(frames, false)));
        r.start().await;
        assert_eq!(
            held(&r.sink),
            ours(&[7, 8]),
            "12's parent went with the clear"
        );
        assert_eq!(r.next, Some(5));
        assert_eq!(r.metrics.gaps_cleared.load(Relaxed), 1);
        assert_eq!(r.metrics.unknown_parents.load(Relaxed), 1);
        r.on_frame(frame(4, payload(vec![]))).await;
        assert_eq!(r.metrics.duplicates.load(Relaxed), 1);
        assert_eq!(r.metrics.engine_restarts.load(Relaxed), 0);
    }

    /// Decode and translate alone, in process (BENCHMARKS.md, "KV event relay: ZeroMQ
    /// crate"): batches of one `BlockStored` of 4 blocks of 16 tokens each, as vLLM encodes
    /// them. `cargo test --release -p lease-router-cli --bin lease-router decode_and_translate
    /// -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn decode_and_translate_rate() {
        let n = 200_000u64;
        let payloads: Vec<Bytes> = (0..n)
            .map(|i| {
                let tokens: Vec<Value> = (0..64)
                    .map(|j| Value::from((i * 64 + j) % 150_000))
                    .collect();
                let keys: Vec<Value> = (0..4).map(|k| Value::from(i * 4 + k)).collect();
                let stored = Value::Array(vec![
                    "BlockStored".into(),
                    Value::Array(keys),
                    Value::Nil,
                    Value::Array(tokens),
                    16.into(),
                    Value::Nil,
                    "GPU".into(),
                    Value::Nil,
                ]);
                payload(vec![stored])
            })
            .collect();
        #[derive(Default)]
        struct Count(u64);
        impl KvSink for Count {
            fn stored(&mut self, _: Option<u64>, blocks: Vec<u64>) {
                self.0 += blocks.len() as u64;
            }
            fn removed(&mut self, _: Vec<u64>) {}
            fn cleared(&mut self) {}
        }
        let metrics = Metrics::default();
        let mut translator = Translator::new(16, 262_144);
        let mut sink = Count::default();
        let started = std::time::Instant::now();
        for payload in &payloads {
            for event in decode_batch(payload).unwrap().events {
                translator.apply(event, &mut sink, &metrics);
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        assert_eq!(sink.0, 4 * n);
        println!(
            "relay_decode_translate_batches_per_second={:.0} ({n} batches of 4 blocks in {seconds:.2} s, {:.2} us each)",
            n as f64 / seconds,
            seconds * 1e6 / n as f64
        );
    }

    /// A publisher queue far smaller than a burst: the sink holds the relay back until every
    /// event is queued, in order, and loses none.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_publisher_queue_holds_back_and_loses_nothing() {
        use lease_router::{DeploymentName, PublisherConfig, SubjectPrefix, Subjects};
        let server = lease_router_testkit::NatsServerBuilder::new()
            .spawn()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let client = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::new(
            SubjectPrefix::default(),
            DeploymentName::new("relay-unit").unwrap(),
        );
        let mut events = client.subscribe(subjects.worker_subject(7)).await.unwrap();
        let config = PublisherConfig::default().with_queue_capacity(4);
        let publisher = LeasePublisher::start(client.clone(), subjects, config);
        let metrics = Arc::new(Metrics::default());
        let mut sink = PublisherSink::new(publisher.clone(), 7, 0, metrics.clone());
        let n = 2_000u64;
        for i in 0..n {
            sink.stored(None, vec![i]);
        }
        sink.cleared();
        sink.settle().await;
        assert!(sink.pending.is_empty());
        assert!(!sink.take_lost());
        assert!(
            metrics.publish_waits.load(Relaxed) > 0,
            "the queue was never full"
        );
        assert_eq!(metrics.publish_drops.load(Relaxed), 0);
        let figures = publisher.close().await.unwrap();
        assert_eq!(figures.published, n + 1, "{figures:?}");
        // In order on the subject: the last one is the clear.
        let mut last = None;
        for _ in 0..=n {
            let message = tokio::time::timeout(Duration::from_secs(10), events.next())
                .await
                .expect("every event arrives")
                .unwrap();
            let envelope = lease_router::wire::decode(&message.payload, 1 << 20).unwrap();
            last = Some(envelope.event);
        }
        assert!(matches!(last, Some(LeaseEvent::KvCleared(_))), "{last:?}");
    }

    #[tokio::test]
    async fn malformed_messages_are_counted_and_a_bad_payload_clears() {
        let mut r = relay(None);
        r.start().await;
        r.on_frame(frame(0, payload(vec![store(10, None, &[1, 2])])))
            .await;
        r.on_live(&[Bytes::from_static(b"t"), Bytes::from_static(b"x")])
            .await;
        r.on_live(&[Bytes::new(), Bytes::from_static(&[0; 4]), Bytes::new()])
            .await;
        assert_eq!(held(&r.sink), ours(&[1, 2]));
        r.on_frame(frame(1, Bytes::from_static(&[0xc1, 0x00])))
            .await;
        assert!(held(&r.sink).is_empty());
        r.on_frame(frame(2, payload(vec![store(20, None, &[3, 4])])))
            .await;
        assert_eq!(held(&r.sink), ours(&[3, 4]));
        assert_eq!(r.metrics.malformed_frames.load(Relaxed), 3);
        assert_eq!(r.metrics.clears_malformed.load(Relaxed), 1);
        assert_eq!(r.metrics.gaps_cleared.load(Relaxed), 0);
    }
}

//! Publishing a worker's lease events: [`LeasePublisher`].
//!
//! A worker calls [`LeasePublisher::publish`] (or one of the convenience methods) at each step
//! of a request's life. The call never blocks and never awaits: the event goes into a bounded
//! queue, and when that queue is full the event is dropped, counted, and
//! [`PublishEventError::QueueFull`] is returned. Losing an event is survivable by design (core
//! NATS is at-most-once anyway; the routers see the gap in the sequence numbers and the lease
//! expires on its own); stalling a worker's request path on the bus is not.
//!
//! One background task takes the events in order, stamps each with this publisher's id, the
//! next sequence number (from 1) and the publish time, encodes it (see [`crate::wire`]) and
//! publishes it on the worker's subject ([`Subjects::worker_subject`]). A publish that fails
//! with an error worth retrying is retried with backoff ([`PublisherConfig::with_retry`]), at
//! most [`PublisherConfig::with_max_publish_attempts`] attempts, then dropped and counted as
//! failed (its sequence number is spent, so the receivers see the loss as a gap).
//!
//! [`flush`](LeasePublisher::flush) waits until everything queued before it has been handed to
//! the NATS client and the client has written it out; [`close`](LeasePublisher::close)
//! stops accepting, delivers the queue, flushes and ends the task. Dropping the last handle
//! without closing lets the task drain the queue and end on its own.
//!
//! # Disconnections
//!
//! The NATS client buffers publishes while it is disconnected (up to its command-channel
//! capacity) and sends them once reconnected: a server restart is mostly absorbed there.
//! Once that buffer is full the client's publish waits, so the task stalls, the queue fills
//! up and further events are dropped at [`publish`](LeasePublisher::publish), never blocking
//! the caller. Whatever was in the client's socket buffer when the connection broke may be
//! lost; that is the at-most-once delivery of core NATS.
//!
//! # Durable publishing
//!
//! The one step "send one encoded envelope to a subject" is the private `EnvelopeSink`
//! trait (in `task`, with the background task); core NATS is one implementation of it. A JetStream publish that waits for acks
//! (and a flush that waits for all outstanding acks) can be another without touching the
//! queueing, stamping, retry or accounting here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use parking_lot::Mutex;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::log_limit::LogRateLimiter;
use crate::retry::RetryPolicy;
use crate::subject::Subjects;
mod jetstream;
mod task;
#[cfg(test)]
mod tests;

use task::{CoreNatsSink, EnvelopeSink, PublishLoop};

use crate::wire::{
    Admitted, Completed, KvCleared, KvRemoved, KvStored, LeaseEvent, Outcome, ProgressStage,
    Progressed, WorkerReset,
};

/// The most worker subjects kept in the cache; past that it starts over (a worker process
/// publishes for a handful of workers, this only bounds a misuse).
const MAX_CACHED_SUBJECTS: usize = 4096;

/// How a [`LeasePublisher`] queues, retries and logs: [`Default`], then the `with_*`
/// methods.
#[derive(Debug, Clone, PartialEq)]
pub struct PublisherConfig {
    queue_capacity: usize,
    retry: RetryPolicy,
    max_publish_attempts: usize,
    max_batch: usize,
    warn_interval: Duration,
    drop_flush_timeout: Duration,
    batching: Option<Batching>,
}

/// How a [`LeasePublisher`] batches (wire 1.2).
///
/// A worker subject's events wait at most `linger` for company; a batch goes out earlier
/// when it holds `max_events` events or one more would make it larger than `max_bytes`.
/// Flush and close send every open batch first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// How long the first event of a batch waits for more, at most (the timer ticks every
    /// millisecond: the batch leaves on the last tick before the linger is over). Default 1 ms.
    pub linger: Duration,
    /// Events per batch message. Default 256, at least 1.
    pub max_events: usize,
    /// Bytes per batch message; keep it at or below the routers' `max_batch_bytes` and the
    /// server's `max_payload`. Default 64 KiB.
    pub max_bytes: usize,
}

impl Default for Batching {
    fn default() -> Self {
        Self {
            linger: Duration::from_millis(1),
            max_events: 256,
            max_bytes: 64 * 1024,
        }
    }
}

/// Events held in open batches, over all subjects, at most: a router judges sequence numbers
/// in windows of 4,096 per publisher, and batches of different subjects leave out of
/// sequence order, so they must stay well inside one window.
const MAX_OPEN_BATCH_EVENTS: usize = 2048;

/// The resolution of tokio's timer.
const TIMER_TICK: Duration = Duration::from_millis(1);

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 8192,
            retry: RetryPolicy::new()
                .with_initial(Duration::from_millis(20))
                .with_max_interval(Duration::from_secs(1))
                .with_randomization(0.2),
            max_publish_attempts: 5,
            max_batch: 256,
            warn_interval: Duration::from_secs(5),
            drop_flush_timeout: Duration::from_secs(5),
            batching: None,
        }
    }
}

impl PublisherConfig {
    /// Sets the events waiting for the background task; beyond that
    /// [`LeasePublisher::publish`] drops the new event and returns
    /// [`PublishEventError::QueueFull`]. Flush and close markers travel through the same
    /// queue (they wait for room instead of being dropped). At least 1. Default 8192.
    pub fn with_queue_capacity(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity;
        self
    }

    /// Sets the delays between the attempts of one publish. Default: 20 ms, doubling, at
    /// most 1 s, 20 % jitter, no deadline (the attempt count bounds it).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Sets the attempts of one publish (the first one included) before the event is
    /// dropped and counted as failed. At least 1. Default 5.
    pub fn with_max_publish_attempts(mut self, attempts: usize) -> Self {
        self.max_publish_attempts = attempts;
        self
    }

    /// Sets the most events the task takes from the queue before awaiting it again.
    /// Default 256.
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch;
        self
    }

    /// Sets the interval of the warnings for dropped or failed events: at most one per
    /// interval. Default 5 s.
    pub fn with_warn_interval(mut self, interval: Duration) -> Self {
        self.warn_interval = interval;
        self
    }

    /// Sets how long the task waits for the client to flush when the last handle is dropped
    /// without [`LeasePublisher::close`] (after draining the queue). Default 5 s.
    pub fn with_drop_flush_timeout(mut self, timeout: Duration) -> Self {
        self.drop_flush_timeout = timeout;
        self
    }

    /// Sends several events of one worker subject in one message (wire 1.2, see
    /// [`crate::wire::BatchWriter`]). Default: one message per event, which every router
    /// version reads; turn batching on once every router reads batches.
    pub fn with_batching(mut self, batching: Batching) -> Self {
        self.batching = Some(batching);
        self
    }
}

/// Why [`LeasePublisher::publish`] did not queue an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PublishEventError {
    /// The queue is full (the bus is slow or unreachable): this event was dropped and counted.
    #[error("lease event queue is full: the event was dropped")]
    QueueFull,
    /// The publisher was closed.
    #[error("lease publisher is closed")]
    Closed,
    /// A per-request event with an empty request id: it could never be encoded.
    #[error("lease event has an empty request id")]
    EmptyRequestId,
    /// A `kv_stored` or `kv_removed` of no block hashes or of more than
    /// [`MAX_BLOCK_HASHES`](crate::wire::MAX_BLOCK_HASHES): it could never be encoded (split
    /// a longer chain; each part's parent is the last hash of the part before).
    #[error("KV event of {blocks} block hashes (1 to 256)")]
    BlockCount {
        /// How many it holds.
        blocks: usize,
    },
}

/// Why [`LeasePublisher::flush`] or [`LeasePublisher::close`] failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlushPublisherError {
    /// The publisher was closed (or its task ended) before the flush could be done.
    #[error("lease publisher is closed")]
    Closed,
    /// The NATS client could not flush (its connection is closed for good).
    #[error("flushing lease events to NATS failed: {0}")]
    Flush(String),
}

/// Counters of one publisher, shared with its task. All monotonic.
#[derive(Debug, Default)]
pub(crate) struct PublisherStats {
    queued: AtomicU64,
    published: AtomicU64,
    batches: AtomicU64,
    dropped_queue_full: AtomicU64,
    failed: AtomicU64,
    retries: AtomicU64,
    rejected_invalid: AtomicU64,
}

impl PublisherStats {
    /// A consistent-enough copy: `published + failed <= queued` always holds in it.
    pub(crate) fn snapshot(&self) -> PublisherFigures {
        // Read the task's counters before `queued`: every event the task counted was counted
        // as queued before it was sent into the queue, so `queued` read last covers it.
        let published = self.published.load(Ordering::Acquire);
        let batches = self.batches.load(Ordering::Acquire);
        let failed = self.failed.load(Ordering::Acquire);
        let retries = self.retries.load(Ordering::Acquire);
        let dropped_queue_full = self.dropped_queue_full.load(Ordering::Acquire);
        let rejected_invalid = self.rejected_invalid.load(Ordering::Acquire);
        let queued = self.queued.load(Ordering::Acquire);
        PublisherFigures {
            queued,
            published,
            batches,
            dropped_queue_full,
            failed,
            retries,
            rejected_invalid,
        }
    }
}

/// A copy of the publisher's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublisherFigures {
    /// Events accepted into the queue.
    pub queued: u64,
    /// Events handed to the NATS client.
    pub published: u64,
    /// Batch messages (of two events or more) handed to the NATS client.
    pub batches: u64,
    /// Events dropped because the queue was full ([`PublishEventError::QueueFull`]).
    pub dropped_queue_full: u64,
    /// Events dropped after their last failed attempt (or that could not be encoded).
    pub failed: u64,
    /// Publish attempts after the first one, over all events.
    pub retries: u64,
    /// Events refused at [`LeasePublisher::publish`] as invalid
    /// ([`PublishEventError::EmptyRequestId`]).
    pub rejected_invalid: u64,
}

impl PublisherFigures {
    /// Accepted events not yet published nor failed: in the queue, or being sent. Zero once
    /// [`LeasePublisher::close`] has returned.
    pub fn pending(&self) -> u64 {
        self.queued
            .saturating_sub(self.published)
            .saturating_sub(self.failed)
    }

    /// Every event offered to `publish` while the publisher was open:
    /// `queued + dropped_queue_full + rejected_invalid`.
    pub fn attempted(&self) -> u64 {
        self.queued + self.dropped_queue_full + self.rejected_invalid
    }
}

/// What travels through the queue.
enum Command {
    Event(LeaseEvent),
    /// Answer once everything before it is handed to the client and the client flushed.
    Flush(oneshot::Sender<Result<(), FlushPublisherError>>),
    /// Stop accepting, deliver what is queued, flush, answer, end.
    Close(oneshot::Sender<Result<(), FlushPublisherError>>),
}

/// State shared by every handle of one publisher.
#[derive(Debug)]
struct Shared {
    publisher_id: u64,
    subjects: Subjects,
    stats: Arc<PublisherStats>,
    /// Set by `close`: every handle refuses new events from then on.
    closing: AtomicBool,
    task: Mutex<Option<JoinHandle<()>>>,
    drop_log: LogRateLimiter,
}

/// Publishes a worker's lease events on NATS, in order, without ever blocking the caller.
///
/// Cheap to clone: the clones share the queue, the publisher id, the sequence and the stats.
/// [`close`](Self::close) on any handle closes all of them. When the last handle is dropped
/// without `close`, the background task delivers what is queued and ends by itself.
#[derive(Debug, Clone)]
pub struct LeasePublisher {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

impl LeasePublisher {
    /// Starts a publisher with a new random publisher id and its background task.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn start(client: Client, subjects: Subjects, config: PublisherConfig) -> LeasePublisher {
        Self::start_with_sink(CoreNatsSink { client }, subjects, config)
    }

    /// [`start`](Self::start) with any [`EnvelopeSink`].
    pub(crate) fn start_with_sink<S: EnvelopeSink>(
        sink: S,
        subjects: Subjects,
        config: PublisherConfig,
    ) -> LeasePublisher {
        let publisher_id: u64 = rand::random();
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        let stats = Arc::new(PublisherStats::default());
        let span = tracing::info_span!(
            "lease_publisher",
            publisher_id,
            deployment = %subjects.deployment()
        );
        let worker = PublishLoop::new(sink, subjects.clone(), publisher_id, stats.clone(), &config);
        let task = tokio::spawn(worker.run(rx).instrument(span));
        LeasePublisher {
            tx,
            shared: Arc::new(Shared {
                publisher_id,
                subjects,
                stats,
                closing: AtomicBool::new(false),
                task: Mutex::new(Some(task)),
                drop_log: LogRateLimiter::new(config.warn_interval),
            }),
        }
    }

    /// Random per publisher: the `pub` of every envelope it sends.
    pub fn publisher_id(&self) -> u64 {
        self.shared.publisher_id
    }

    /// The subjects this publisher publishes on.
    pub fn subjects(&self) -> &Subjects {
        &self.shared.subjects
    }

    /// Its counters, read now.
    pub fn stats(&self) -> PublisherFigures {
        self.shared.stats.snapshot()
    }

    /// Queues one event. Never blocks, never awaits.
    ///
    /// When the queue is full, this event is dropped and counted, and
    /// [`PublishEventError::QueueFull`] is returned; the caller carries on.
    pub fn publish(&self, event: impl Into<LeaseEvent>) -> Result<(), PublishEventError> {
        let event = event.into();
        let stats = &self.shared.stats;
        if self.shared.closing.load(Ordering::Acquire) {
            return Err(PublishEventError::Closed);
        }
        if event.request_id() == Some("") {
            stats.rejected_invalid.fetch_add(1, Ordering::AcqRel);
            if let Some(suppressed) = self.shared.drop_log.check() {
                tracing::warn!(
                    publisher_id = self.shared.publisher_id,
                    worker = event.worker_id(),
                    kind = %event.kind(),
                    suppressed,
                    "lease event with an empty request id refused"
                );
            }
            return Err(PublishEventError::EmptyRequestId);
        }
        if let LeaseEvent::KvStored(KvStored { block_hashes, .. })
        | LeaseEvent::KvRemoved(KvRemoved { block_hashes, .. }) = &event
        {
            let blocks = block_hashes.len();
            if blocks == 0 || blocks > crate::wire::MAX_BLOCK_HASHES {
                stats.rejected_invalid.fetch_add(1, Ordering::AcqRel);
                return Err(PublishEventError::BlockCount { blocks });
            }
        }
        // Counted before it is sent, so that the task can never count it published first.
        stats.queued.fetch_add(1, Ordering::AcqRel);
        match self.tx.try_send(Command::Event(event)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(command)) => {
                stats.queued.fetch_sub(1, Ordering::AcqRel);
                let dropped = stats.dropped_queue_full.fetch_add(1, Ordering::AcqRel) + 1;
                if let Some(suppressed) = self.shared.drop_log.check() {
                    if let Command::Event(event) = &command {
                        tracing::warn!(
                            publisher_id = self.shared.publisher_id,
                            worker = event.worker_id(),
                            request_id = event.request_id(),
                            dropped_queue_full = dropped,
                            suppressed,
                            "lease event queue full, dropping the event"
                        );
                    }
                }
                Err(PublishEventError::QueueFull)
            }
            Err(TrySendError::Closed(_)) => {
                stats.queued.fetch_sub(1, Ordering::AcqRel);
                Err(PublishEventError::Closed)
            }
        }
    }

    /// Queues an [`Admitted`] event.
    pub fn admitted(
        &self,
        request_id: impl Into<String>,
        worker_id: u64,
        dp_rank: u32,
        prompt_tokens: u32,
        expected_output_tokens: Option<u32>,
    ) -> Result<(), PublishEventError> {
        self.publish(Admitted::new(
            request_id,
            worker_id,
            dp_rank,
            prompt_tokens,
            expected_output_tokens,
        ))
    }

    /// Queues an [`Admitted`] event of a request in admission class `class` (wire 1.4,
    /// `cls`): every router replica counts the request under that class, fleet-wide, or
    /// under the deployment's default class when it has no such class (see
    /// [`AdmissionConfig`](crate::AdmissionConfig)). Name the class the route request
    /// named. For the other optional fields, build the [`Admitted`] and
    /// [`publish`](Self::publish) it.
    pub fn admitted_in_class(
        &self,
        request_id: impl Into<String>,
        worker_id: u64,
        dp_rank: u32,
        prompt_tokens: u32,
        expected_output_tokens: Option<u32>,
        class: impl Into<String>,
    ) -> Result<(), PublishEventError> {
        self.publish(Admitted {
            class: Some(class.into()),
            ..Admitted::new(
                request_id,
                worker_id,
                dp_rank,
                prompt_tokens,
                expected_output_tokens,
            )
        })
    }

    /// Queues a [`Progressed`] event.
    pub fn progressed(
        &self,
        request_id: impl Into<String>,
        worker_id: u64,
        dp_rank: u32,
        stage: ProgressStage,
        output_tokens: u32,
    ) -> Result<(), PublishEventError> {
        self.publish(Progressed {
            request_id: request_id.into(),
            worker_id,
            dp_rank,
            stage,
            output_tokens,
        })
    }

    /// Queues a [`Completed`] event.
    pub fn completed(
        &self,
        request_id: impl Into<String>,
        worker_id: u64,
        dp_rank: u32,
        outcome: Outcome,
    ) -> Result<(), PublishEventError> {
        self.publish(Completed {
            request_id: request_id.into(),
            worker_id,
            dp_rank,
            outcome,
        })
    }

    /// Queues a [`WorkerReset`] event (`dp_rank: None`: every rank of the worker).
    pub fn worker_reset(
        &self,
        worker_id: u64,
        dp_rank: Option<u32>,
    ) -> Result<(), PublishEventError> {
        self.publish(WorkerReset {
            worker_id,
            dp_rank,
            leaving: false,
        })
    }

    /// Queues a [`WorkerReset`] that says the worker is leaving (wire 1.1): routers stop
    /// choosing it until it publishes again. Send it on a clean shutdown.
    pub fn worker_left(
        &self,
        worker_id: u64,
        dp_rank: Option<u32>,
    ) -> Result<(), PublishEventError> {
        self.publish(WorkerReset {
            worker_id,
            dp_rank,
            leaving: true,
        })
    }

    /// Queues a [`KvStored`] (wire 1.3): the engine of `worker_id`'s rank `dp_rank` stored
    /// `blocks` (our hashes, chain order, 1 to 256), after the block `parent` (`None`: the
    /// first is a prompt's first block). A rank that sends KV events is exact: routers take
    /// only these for what it holds.
    pub fn kv_stored(
        &self,
        worker_id: u64,
        dp_rank: u32,
        parent: Option<u64>,
        blocks: Vec<u64>,
    ) -> Result<(), PublishEventError> {
        self.publish(KvStored {
            worker_id,
            dp_rank,
            parent_hash: parent,
            block_hashes: blocks,
        })
    }

    /// Queues a [`KvRemoved`] (wire 1.3): the engine evicted `blocks` (1 to 256).
    pub fn kv_removed(
        &self,
        worker_id: u64,
        dp_rank: u32,
        blocks: Vec<u64>,
    ) -> Result<(), PublishEventError> {
        self.publish(KvRemoved {
            worker_id,
            dp_rank,
            block_hashes: blocks,
        })
    }

    /// Queues a [`KvCleared`] (wire 1.3; `dp_rank: None`: every rank): the engine holds
    /// nothing, or its relay can no longer tell what it holds.
    pub fn kv_cleared(
        &self,
        worker_id: u64,
        dp_rank: Option<u32>,
    ) -> Result<(), PublishEventError> {
        self.publish(KvCleared { worker_id, dp_rank })
    }

    /// Resolves once every event queued before the call has been handed to the NATS client
    /// and the client has flushed it to the server (or dropped it as failed).
    ///
    /// Waits for room in the queue when it is full (the marker is never dropped), and while
    /// the server is unreachable; bound it with `tokio::time::timeout` if needed.
    pub async fn flush(&self) -> Result<(), FlushPublisherError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Flush(reply))
            .await
            .map_err(|_| FlushPublisherError::Closed)?;
        answer.await.unwrap_or(Err(FlushPublisherError::Closed))
    }

    /// Stops accepting events (on every handle), delivers everything queued, flushes, ends the
    /// background task and returns the final stats (`pending() == 0`).
    ///
    /// Waits while the server is unreachable; bound it with `tokio::time::timeout` if needed
    /// (the task keeps draining after the timeout). `Err(Closed)` when the publisher was
    /// already closed through another handle.
    pub async fn close(self) -> Result<PublisherFigures, FlushPublisherError> {
        self.shared.closing.store(true, Ordering::Release);
        let (reply, answer) = oneshot::channel();
        let result = match self.tx.send(Command::Close(reply)).await {
            Ok(()) => answer.await.unwrap_or(Err(FlushPublisherError::Closed)),
            Err(_) => Err(FlushPublisherError::Closed),
        };
        let task = self.shared.task.lock().take();
        if let Some(task) = task {
            if let Err(err) = task.await {
                tracing::error!(
                    publisher_id = self.shared.publisher_id,
                    error = %err,
                    "lease publisher task failed"
                );
            }
        }
        result.map(|()| self.shared.stats.snapshot())
    }
}

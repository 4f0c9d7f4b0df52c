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
//! with an error worth retrying is retried with backoff ([`PublisherConfig::retry`]), at most
//! [`PublisherConfig::max_publish_attempts`] attempts, then dropped and counted as failed (its
//! sequence number is spent, so the receivers see the loss as a gap).
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
//! trait; core NATS is one implementation of it. A JetStream publish that waits for acks
//! (and a flush that waits for all outstanding acks) can be another without touching the
//! queueing, stamping, retry or accounting here.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, PublishErrorKind, Subject};
use bytes::Bytes;
use hashbrown::HashMap;
use parking_lot::Mutex;
use tokio::sync::mpsc::error::{TryRecvError, TrySendError};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::connection::LogRateLimiter;
use crate::retry::{Attempt, Backoff, RetryPolicy};
use crate::subject::Subjects;
use crate::wire::{
    self, Admitted, Completed, Envelope, LeaseEvent, Outcome, ProgressStage, Progressed,
    WorkerReset,
};

/// The most worker subjects kept in the cache; past that it starts over (a worker process
/// publishes for a handful of workers, this only bounds a misuse).
const MAX_CACHED_SUBJECTS: usize = 4096;

/// How a [`LeasePublisher`] queues, retries and logs.
#[derive(Debug, Clone, PartialEq)]
pub struct PublisherConfig {
    /// Events waiting for the background task; beyond that [`LeasePublisher::publish`] drops
    /// the new event and returns [`PublishEventError::QueueFull`]. Flush and close markers
    /// travel through the same queue (they wait for room instead of being dropped). At least
    /// 1. Default 8192.
    pub queue_capacity: usize,
    /// Delays between the attempts of one publish. Default: 20 ms, doubling, at most 1 s,
    /// 20 % jitter, no deadline (the attempt count bounds it).
    pub retry: RetryPolicy,
    /// Attempts of one publish (the first one included) before the event is dropped and
    /// counted as failed. At least 1. Default 5.
    pub max_publish_attempts: usize,
    /// The most events the task takes from the queue before awaiting it again. Default 256.
    pub max_batch: usize,
    /// At most one warning per interval for dropped or failed events. Default 5 s.
    pub warn_interval: Duration,
    /// When the last handle is dropped without [`LeasePublisher::close`], the task drains the
    /// queue and then waits at most this long for the client to flush. Default 5 s.
    pub drop_flush_timeout: Duration,
    /// Several events of one worker subject in one message (wire 1.2, see
    /// [`crate::wire::BatchWriter`]), or `None`: one message per event, which every router
    /// version reads. Default `None`: turn it on once every router reads batches.
    pub batching: Option<Batching>,
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
    pub fn with_queue_capacity(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity;
        self
    }

    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    pub fn with_max_publish_attempts(mut self, attempts: usize) -> Self {
        self.max_publish_attempts = attempts;
        self
    }

    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch;
        self
    }

    pub fn with_warn_interval(mut self, interval: Duration) -> Self {
        self.warn_interval = interval;
        self
    }

    pub fn with_drop_flush_timeout(mut self, timeout: Duration) -> Self {
        self.drop_flush_timeout = timeout;
        self
    }

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
pub struct PublisherStats {
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
    pub fn snapshot(&self) -> PublisherStatsSnapshot {
        // Read the task's counters before `queued`: every event the task counted was counted
        // as queued before it was sent into the queue, so `queued` read last covers it.
        let published = self.published.load(Ordering::Acquire);
        let batches = self.batches.load(Ordering::Acquire);
        let failed = self.failed.load(Ordering::Acquire);
        let retries = self.retries.load(Ordering::Acquire);
        let dropped_queue_full = self.dropped_queue_full.load(Ordering::Acquire);
        let rejected_invalid = self.rejected_invalid.load(Ordering::Acquire);
        let queued = self.queued.load(Ordering::Acquire);
        PublisherStatsSnapshot {
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
pub struct PublisherStatsSnapshot {
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

impl PublisherStatsSnapshot {
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

/// The one step that differs between core NATS and a durable (JetStream) publisher: sending
/// one encoded envelope, and waiting until everything sent so far is out.
pub(crate) trait EnvelopeSink: Send + 'static {
    /// Sends one encoded envelope. `Attempt::Transient` is retried, `Attempt::Permanent` is not.
    /// `msg_id` (`{publisher_id}-{sequence}`) lets a durable sink store a re-sent event once.
    fn send(
        &mut self,
        subject: &Subject,
        payload: Bytes,
        msg_id: &str,
    ) -> impl Future<Output = Result<(), Attempt<String>>> + Send;

    /// Resolves once everything sent before the call is flushed. The future must not borrow
    /// the sink: the task hands it off and keeps publishing meanwhile.
    fn flush(&self) -> impl Future<Output = Result<(), String>> + Send + 'static;
}

/// Core NATS: at-most-once, the client's flush is the delivery point.
struct CoreNatsSink {
    client: Client,
}

impl EnvelopeSink for CoreNatsSink {
    fn send(
        &mut self,
        subject: &Subject,
        payload: Bytes,
        _msg_id: &str,
    ) -> impl Future<Output = Result<(), Attempt<String>>> + Send {
        let publish = self.client.publish(subject.clone(), payload);
        async move {
            publish.await.map_err(|err| match err.kind() {
                // The same bytes would fail the same way again.
                PublishErrorKind::MaxPayloadExceeded | PublishErrorKind::InvalidSubject => {
                    Attempt::Permanent(err.to_string())
                }
                PublishErrorKind::Send => Attempt::Transient(err.to_string()),
            })
        }
    }

    fn flush(&self) -> impl Future<Output = Result<(), String>> + Send + 'static {
        let client = self.client.clone();
        async move { client.flush().await.map_err(|err| err.to_string()) }
    }
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
        let worker = PublishLoop {
            sink,
            subjects: subjects.clone(),
            subject_cache: HashMap::new(),
            publisher_id,
            next_sequence: 1,
            buf: Vec::with_capacity(128),
            stats: stats.clone(),
            backoff: config.retry.backoff(),
            max_attempts: config.max_publish_attempts.max(1),
            max_batch: config.max_batch.max(1),
            failure_log: LogRateLimiter::new(config.warn_interval),
            drop_flush_timeout: config.drop_flush_timeout,
            batching: config.batching.map(|b| Batching {
                linger: b.linger,
                max_events: b.max_events.max(1),
                max_bytes: b.max_bytes,
            }),
            open: HashMap::new(),
            open_events: 0,
            linger_deadline: None,
        };
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

    pub fn subjects(&self) -> &Subjects {
        &self.shared.subjects
    }

    /// The live counters.
    pub fn stats(&self) -> &Arc<PublisherStats> {
        &self.shared.stats
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
        self.publish(Admitted {
            request_id: request_id.into(),
            worker_id,
            dp_rank,
            prompt_tokens,
            expected_output_tokens,
            cached_tokens: None,
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
    pub async fn close(self) -> Result<PublisherStatsSnapshot, FlushPublisherError> {
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

/// What one message carries, for the counts and the logs.
struct Sent<'a> {
    worker_id: u64,
    first_sequence: u64,
    events: u64,
    /// The event's, when the message is a single event.
    request_id: Option<&'a str>,
    kind: Option<wire::EventKind>,
}

/// The background task's state.
struct PublishLoop<S> {
    sink: S,
    subjects: Subjects,
    subject_cache: HashMap<u64, Subject>,
    publisher_id: u64,
    next_sequence: u64,
    /// The encoding buffer, reused for every event.
    buf: Vec<u8>,
    stats: Arc<PublisherStats>,
    /// One backoff, reset at the first failure of each event.
    backoff: Backoff,
    max_attempts: usize,
    max_batch: usize,
    failure_log: LogRateLimiter,
    drop_flush_timeout: Duration,
    batching: Option<Batching>,
    /// Open batches by worker id, while batching.
    open: HashMap<u64, OpenBatch>,
    /// Events in `open`.
    open_events: usize,
    /// When the oldest open batch must go out.
    linger_deadline: Option<tokio::time::Instant>,
}

/// A batch of one worker subject that is still filling.
struct OpenBatch {
    writer: wire::BatchWriter,
    subject: Subject,
    first_sequence: u64,
    last_sequence: u64,
}

impl<S: EnvelopeSink> PublishLoop<S> {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        tracing::debug!("lease publisher started");
        let mut batch: Vec<Command> = Vec::with_capacity(self.max_batch.min(1024));
        let mut closers: Vec<oneshot::Sender<Result<(), FlushPublisherError>>> = Vec::new();
        // Ends once the channel is closed (by `close`, or by the last handle being dropped)
        // and everything in it has been taken.
        loop {
            let first = match self.linger_deadline {
                Some(deadline) => tokio::select! {
                    biased;
                    command = rx.recv() => command,
                    () = tokio::time::sleep_until(deadline) => {
                        self.send_open_batches().await;
                        continue;
                    }
                },
                None => rx.recv().await,
            };
            let Some(first) = first else { break };
            batch.push(first);
            while batch.len() < self.max_batch {
                match rx.try_recv() {
                    Ok(command) => batch.push(command),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            for command in batch.drain(..) {
                match command {
                    Command::Event(event) if self.batching.is_some() => {
                        self.batch_event(event).await;
                    }
                    Command::Event(event) => self.send_event(event).await,
                    Command::Flush(reply) => {
                        self.send_open_batches().await;
                        // Everything before the marker is in the client now; the wait for
                        // the client's flush runs beside the task, which keeps publishing.
                        let flush = self.sink.flush();
                        tokio::spawn(async move {
                            let result = flush.await.map_err(FlushPublisherError::Flush);
                            let _ = reply.send(result);
                        });
                    }
                    Command::Close(reply) => {
                        // No more sends; what is already queued is still taken and sent.
                        rx.close();
                        closers.push(reply);
                    }
                }
            }
            // A queue that never runs dry must not keep the linger from ending.
            if self
                .linger_deadline
                .is_some_and(|deadline| deadline <= tokio::time::Instant::now())
            {
                self.send_open_batches().await;
            }
        }
        self.send_open_batches().await;

        if closers.is_empty() {
            // Every handle was dropped: a bounded last flush, nobody is waiting for it.
            match tokio::time::timeout(self.drop_flush_timeout, self.sink.flush()).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::warn!(error = %err, "last flush of lease events failed"),
                Err(_) => tracing::warn!(
                    timeout = ?self.drop_flush_timeout,
                    "last flush of lease events timed out"
                ),
            }
        } else {
            let result = self.sink.flush().await.map_err(FlushPublisherError::Flush);
            for reply in closers {
                let _ = reply.send(result.clone());
            }
        }
        let stats = self.stats.snapshot();
        tracing::debug!(
            published = stats.published,
            failed = stats.failed,
            dropped_queue_full = stats.dropped_queue_full,
            retries = stats.retries,
            "lease publisher stopped"
        );
    }

    /// The cached subject of `worker_id`.
    fn subject(&mut self, worker_id: u64) -> Subject {
        if let Some(subject) = self.subject_cache.get(&worker_id) {
            return subject.clone();
        }
        if self.subject_cache.len() >= MAX_CACHED_SUBJECTS {
            self.subject_cache.clear();
        }
        let subject = Subject::from(self.subjects.worker_subject(worker_id));
        self.subject_cache.insert(worker_id, subject.clone());
        subject
    }

    /// Stamps and encodes one event into `self.buf`, spending a sequence number; `None`
    /// (counted and logged) if it cannot be encoded.
    fn stamp(&mut self, event: LeaseEvent) -> Option<Envelope> {
        let envelope = Envelope::new(
            self.publisher_id,
            self.next_sequence,
            wire::unix_micros_now(),
            event,
        );
        self.buf.clear();
        if let Err(err) = wire::encode_into(&envelope, &mut self.buf) {
            // Not sent, so no sequence number spent.
            self.stats.failed.fetch_add(1, Ordering::AcqRel);
            self.warn_failed(&envelope, 0, &err.to_string());
            return None;
        }
        self.next_sequence += 1;
        Some(envelope)
    }

    /// Stamps, encodes and sends one event, retrying transient failures.
    async fn send_event(&mut self, event: LeaseEvent) {
        let worker_id = event.worker_id();
        let Some(envelope) = self.stamp(event) else {
            return;
        };
        let payload = Bytes::copy_from_slice(&self.buf);
        let subject = self.subject(worker_id);
        let msg_id = format!("{}-{}", envelope.publisher_id, envelope.sequence);
        let sent = Sent {
            worker_id,
            first_sequence: envelope.sequence,
            events: 1,
            request_id: envelope.event.request_id(),
            kind: Some(envelope.kind()),
        };
        self.send_message(&subject, payload, &msg_id, sent).await;
    }

    /// Stamps and encodes one event into its subject's open batch; sends the batch once it
    /// is full, and every open batch once too many events wait.
    async fn batch_event(&mut self, event: LeaseEvent) {
        let Some(batching) = self.batching else {
            return self.send_event(event).await;
        };
        let worker_id = event.worker_id();
        let Some(envelope) = self.stamp(event) else {
            return;
        };
        let len = self.buf.len();
        if self
            .open
            .get(&worker_id)
            .is_some_and(|open| open.writer.message_len(len) > batching.max_bytes)
        {
            self.send_open_batch(worker_id).await;
        }
        if !self.open.contains_key(&worker_id) {
            let subject = self.subject(worker_id);
            self.open.insert(
                worker_id,
                OpenBatch {
                    writer: wire::BatchWriter::with_capacity(
                        (len * batching.max_events).min(batching.max_bytes),
                    ),
                    subject,
                    first_sequence: envelope.sequence,
                    last_sequence: envelope.sequence,
                },
            );
        }
        let open = self.open.get_mut(&worker_id).expect("inserted above");
        open.writer.push_encoded(&self.buf);
        open.last_sequence = envelope.sequence;
        let full = open.writer.events() >= batching.max_events;
        self.open_events += 1;
        if self.linger_deadline.is_none() {
            // tokio's timer fires on the millisecond tick at or after its deadline: aim a
            // tick early, so that the first event waits at most the linger, not a tick more.
            let early = batching.linger.min(TIMER_TICK);
            self.linger_deadline = Some(tokio::time::Instant::now() + batching.linger - early);
        }
        if self.open_events >= MAX_OPEN_BATCH_EVENTS {
            self.send_open_batches().await;
        } else if full {
            self.send_open_batch(worker_id).await;
        }
    }

    /// Sends every open batch, oldest first.
    async fn send_open_batches(&mut self) {
        self.linger_deadline = None;
        if self.open.is_empty() {
            return;
        }
        let mut open: Vec<_> = self.open.drain().collect();
        open.sort_unstable_by_key(|(_, batch)| batch.first_sequence);
        self.open_events = 0;
        for (worker_id, batch) in open {
            self.send_batch(worker_id, batch).await;
        }
    }

    /// Sends the open batch of `worker_id`.
    async fn send_open_batch(&mut self, worker_id: u64) {
        if let Some(batch) = self.open.remove(&worker_id) {
            self.open_events -= batch.writer.events();
            if self.open.is_empty() {
                self.linger_deadline = None;
            }
            self.send_batch(worker_id, batch).await;
        }
    }

    async fn send_batch(&mut self, worker_id: u64, mut batch: OpenBatch) {
        let events = batch.writer.events();
        let Some(payload) = batch.writer.finish() else {
            return;
        };
        // One event goes as a plain message, under the id a single event has.
        let msg_id = if events == 1 {
            format!("{}-{}", self.publisher_id, batch.first_sequence)
        } else {
            format!(
                "{}-{}-{}",
                self.publisher_id, batch.first_sequence, batch.last_sequence
            )
        };
        let sent = Sent {
            worker_id,
            first_sequence: batch.first_sequence,
            events: events as u64,
            request_id: None,
            kind: None,
        };
        if self
            .send_message(&batch.subject, payload, &msg_id, sent)
            .await
            && events > 1
        {
            self.stats.batches.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Sends one message of `sent.events` events, retrying transient failures; whether it
    /// was sent.
    async fn send_message(
        &mut self,
        subject: &Subject,
        payload: Bytes,
        msg_id: &str,
        sent: Sent<'_>,
    ) -> bool {
        let mut attempts = 0usize;
        loop {
            attempts += 1;
            let error = match self.sink.send(subject, payload.clone(), msg_id).await {
                Ok(()) => {
                    self.stats
                        .published
                        .fetch_add(sent.events, Ordering::AcqRel);
                    return true;
                }
                Err(error) => error,
            };
            let permanent = error.is_permanent();
            let delay = if permanent || attempts >= self.max_attempts {
                None
            } else {
                if attempts == 1 {
                    self.backoff.reset();
                }
                Some(self.backoff.next_delay())
            };
            match delay {
                Some(delay) => {
                    self.stats.retries.fetch_add(1, Ordering::AcqRel);
                    tracing::debug!(
                        worker = sent.worker_id,
                        request_id = sent.request_id,
                        sequence = sent.first_sequence,
                        events = sent.events,
                        attempt = attempts,
                        error = %error.inner(),
                        retry_in = ?delay,
                        "publishing lease events failed, retrying"
                    );
                    tokio::time::sleep(delay).await;
                }
                None => {
                    self.stats.failed.fetch_add(sent.events, Ordering::AcqRel);
                    self.warn_failed_message(&sent, attempts, error.inner());
                    return false;
                }
            }
        }
    }

    fn warn_failed_message(&self, sent: &Sent<'_>, attempts: usize, error: &str) {
        if let Some(suppressed) = self.failure_log.check() {
            tracing::warn!(
                worker = sent.worker_id,
                request_id = sent.request_id,
                kind = sent.kind.map(|kind| kind.as_str()),
                sequence = sent.first_sequence,
                events = sent.events,
                attempts,
                error,
                failed = self.stats.failed.load(Ordering::Acquire),
                suppressed,
                "publishing lease events failed, events dropped"
            );
        }
    }

    /// An event that could not be encoded (so was never sent).
    fn warn_failed(&self, envelope: &Envelope, attempts: usize, error: &str) {
        let sent = Sent {
            worker_id: envelope.event.worker_id(),
            first_sequence: envelope.sequence,
            events: 1,
            request_id: envelope.event.request_id(),
            kind: Some(envelope.kind()),
        };
        self.warn_failed_message(&sent, attempts, error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subject::{DeploymentName, SubjectPrefix};
    use std::collections::VecDeque;
    use tokio::sync::Semaphore;
    use tokio::time::timeout;

    const WAIT: Duration = Duration::from_secs(10);

    /// A sink that records what it is sent; fails on script; can be held shut.
    #[derive(Clone, Default)]
    struct MockSink {
        sent: Arc<Mutex<Vec<(String, Bytes)>>>,
        /// The message id of each send that succeeded, in order.
        msg_ids: Arc<Mutex<Vec<String>>>,
        /// Results of the next sends (then Ok).
        script: Arc<Mutex<VecDeque<Attempt<String>>>>,
        /// Each send takes a permit when set (none: the sink stalls).
        gate: Option<Arc<Semaphore>>,
        flushes: Arc<AtomicU64>,
        dropped: Option<Arc<AtomicBool>>,
    }

    struct DropFlag(Arc<AtomicBool>);

    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }

    struct Sink {
        mock: MockSink,
        _flag: Option<DropFlag>,
    }

    impl EnvelopeSink for Sink {
        fn send(
            &mut self,
            subject: &Subject,
            payload: Bytes,
            msg_id: &str,
        ) -> impl Future<Output = Result<(), Attempt<String>>> + Send {
            let mock = self.mock.clone();
            let subject = subject.to_string();
            let msg_id = msg_id.to_string();
            async move {
                if let Some(gate) = &mock.gate {
                    gate.acquire().await.unwrap().forget();
                }
                if let Some(failure) = mock.script.lock().pop_front() {
                    return Err(failure);
                }
                mock.sent.lock().push((subject, payload));
                mock.msg_ids.lock().push(msg_id);
                Ok(())
            }
        }

        fn flush(&self) -> impl Future<Output = Result<(), String>> + Send + 'static {
            let flushes = self.mock.flushes.clone();
            async move {
                flushes.fetch_add(1, Ordering::AcqRel);
                Ok(())
            }
        }
    }

    fn subjects() -> Subjects {
        Subjects::new(
            SubjectPrefix::new("t").unwrap(),
            DeploymentName::new("dep").unwrap(),
        )
    }

    fn start(mock: &MockSink, config: PublisherConfig) -> LeasePublisher {
        let sink = Sink {
            mock: mock.clone(),
            _flag: mock.dropped.clone().map(DropFlag),
        };
        LeasePublisher::start_with_sink(sink, subjects(), config)
    }

    fn fast_retry() -> PublisherConfig {
        PublisherConfig::default().with_retry(
            RetryPolicy::new()
                .with_initial(Duration::from_millis(10))
                .with_max_interval(Duration::from_millis(40))
                .with_randomization(0.0),
        )
    }

    fn decoded(sent: &[(String, Bytes)]) -> Vec<(String, Envelope)> {
        sent.iter()
            .map(|(s, p)| (s.clone(), wire::decode(p, 4096).unwrap()))
            .collect()
    }

    /// Each sent message as its events: one for a plain message, several for a batch.
    fn messages(sent: &[(String, Bytes)]) -> Vec<(String, Vec<Envelope>)> {
        sent.iter()
            .map(|(subject, payload)| {
                let events = match wire::decode_message(payload, wire::MessageLimits::default()) {
                    wire::Message::Event(event) => vec![event.unwrap()],
                    wire::Message::Batch(events) => events.map(Result::unwrap).collect(),
                    wire::Message::Refused { error, .. } => panic!("{error}"),
                };
                (subject.clone(), events)
            })
            .collect()
    }

    fn batching(linger: Duration, max_events: usize, max_bytes: usize) -> PublisherConfig {
        PublisherConfig::default().with_batching(Batching {
            linger,
            max_events,
            max_bytes,
        })
    }

    const LONG: Duration = Duration::from_secs(3600);

    #[tokio::test]
    async fn batches_hold_one_subjects_events_up_to_the_event_bound() {
        let mock = MockSink::default();
        let publisher = start(&mock, batching(LONG, 4, 64 * 1024));
        for i in 0..10u32 {
            publisher.admitted(format!("r{i}"), 1, 0, i, None).unwrap();
            if i < 3 {
                publisher
                    .completed(format!("r{i}"), 2, 0, Outcome::Finished)
                    .unwrap();
            }
        }
        timeout(WAIT, publisher.flush()).await.unwrap().unwrap();
        let sent = messages(&mock.sent.lock());
        let sizes: Vec<_> = sent.iter().map(|(s, e)| (s.as_str(), e.len())).collect();
        // Full batches as they fill, the rest at the flush, oldest first.
        assert_eq!(
            sizes,
            [
                ("t.dep.1", 4),
                ("t.dep.1", 4),
                ("t.dep.2", 3),
                ("t.dep.1", 2)
            ]
        );
        let mut sequences = Vec::new();
        for ((subject, events), msg_id) in sent.iter().zip(mock.msg_ids.lock().iter()) {
            for event in events {
                assert_eq!(*subject, format!("t.dep.{}", event.event.worker_id()));
                assert_eq!(event.publisher_id, publisher.publisher_id());
            }
            let (first, last) = (events[0].sequence, events.last().unwrap().sequence);
            assert!(events.windows(2).all(|w| w[0].sequence < w[1].sequence));
            assert_eq!(
                *msg_id,
                format!("{}-{first}-{last}", publisher.publisher_id())
            );
            sequences.extend(events.iter().map(|e| e.sequence));
        }
        sequences.sort_unstable();
        assert_eq!(sequences, (1..=13).collect::<Vec<_>>(), "each number once");
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!(
            (stats.published, stats.batches, stats.pending()),
            (13, 4, 0)
        );
    }

    #[tokio::test]
    async fn batches_stay_within_the_byte_bound() {
        let mock = MockSink::default();
        let publisher = start(&mock, batching(LONG, 256, 400));
        for i in 0..50u32 {
            publisher
                .admitted(format!("request-{i}"), 1, 0, i, None)
                .unwrap();
        }
        timeout(WAIT, publisher.flush()).await.unwrap().unwrap();
        let sent = mock.sent.lock().clone();
        assert!(sent.len() > 1);
        assert!(
            sent.iter().all(|(_, payload)| payload.len() <= 400),
            "{sent:?}"
        );
        assert!(
            sent.iter().any(|(_, payload)| payload.len() > 300),
            "batches fill up"
        );
        let events: usize = messages(&sent).iter().map(|(_, e)| e.len()).sum();
        assert_eq!(events, 50);
    }

    #[tokio::test(start_paused = true)]
    async fn the_linger_sends_what_waits_and_one_event_goes_plain() {
        let mock = MockSink::default();
        let publisher = start(&mock, batching(Duration::from_millis(5), 256, 64 * 1024));
        publisher.admitted("a", 1, 0, 1, None).unwrap();
        publisher.admitted("b", 1, 0, 1, None).unwrap();
        publisher.admitted("c", 2, 0, 1, None).unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert!(mock.sent.lock().is_empty(), "the linger is not over");
        tokio::time::sleep(Duration::from_millis(10)).await;
        let sent = mock.sent.lock().clone();
        let sizes: Vec<_> = messages(&sent)
            .iter()
            .map(|(s, e)| (s.clone(), e.len()))
            .collect();
        assert_eq!(
            sizes,
            [("t.dep.1".to_string(), 2), ("t.dep.2".to_string(), 1)]
        );
        // The lone event is a plain 1.0 message, under a single event's id.
        assert!(matches!(
            wire::decode_message(&sent[1].1, wire::MessageLimits::default()),
            wire::Message::Event(Ok(_))
        ));
        assert_eq!(
            mock.msg_ids.lock()[1],
            format!("{}-3", publisher.publisher_id())
        );
        assert_eq!(
            mock.flushes.load(Ordering::Acquire),
            0,
            "no flush was asked"
        );
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!((stats.published, stats.batches), (3, 1));
    }

    #[tokio::test]
    async fn too_many_open_events_send_every_batch() {
        let mock = MockSink::default();
        let publisher = start(&mock, batching(LONG, 256, 64 * 1024));
        let workers = MAX_OPEN_BATCH_EVENTS as u64 / 2;
        for i in 0..2 * workers {
            publisher
                .admitted(format!("r{i}"), i % workers, 0, 1, None)
                .unwrap();
        }
        // No flush, and the linger is an hour: only the bound on open events sends them.
        let all_sent = async {
            while mock.sent.lock().len() < workers as usize {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        timeout(WAIT, all_sent).await.expect("sent without a flush");
        let sent = messages(&mock.sent.lock());
        assert!(sent.iter().all(|(_, events)| events.len() == 2));
        let first: Vec<_> = sent.iter().map(|(_, e)| e[0].sequence).collect();
        assert!(first.windows(2).all(|w| w[0] < w[1]), "oldest batch first");
        publisher.close().await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_batch_fails_each_of_its_events() {
        let mock = MockSink::default();
        mock.script
            .lock()
            .push_back(Attempt::Permanent("too big".to_string()));
        let publisher = start(&mock, batching(LONG, 3, 64 * 1024));
        for i in 0..5u32 {
            publisher.admitted(format!("r{i}"), 1, 0, i, None).unwrap();
        }
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!((stats.failed, stats.published, stats.batches), (3, 2, 1));
        assert_eq!(stats.pending(), 0);
    }

    #[tokio::test]
    async fn stamps_in_order_on_the_worker_subject() {
        let mock = MockSink::default();
        let publisher = start(&mock, PublisherConfig::default());
        for i in 0..100u32 {
            let worker = u64::from(i % 3);
            publisher
                .admitted(format!("r{i}"), worker, 1, i, None)
                .unwrap();
        }
        publisher.worker_reset(7, None).unwrap();
        timeout(WAIT, publisher.flush()).await.unwrap().unwrap();
        let sent = decoded(&mock.sent.lock());
        assert_eq!(sent.len(), 101);
        for (i, (subject, env)) in sent.iter().enumerate() {
            assert_eq!(env.sequence, i as u64 + 1);
            assert_eq!(env.publisher_id, publisher.publisher_id());
            assert_eq!(*subject, format!("t.dep.{}", env.event.worker_id()));
        }
        assert_eq!(mock.flushes.load(Ordering::Acquire), 1);
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.queued, 101);
        assert_eq!(stats.published, 101);
        assert_eq!(stats.pending(), 0);
        assert_eq!(mock.flushes.load(Ordering::Acquire), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried() {
        let mock = MockSink::default();
        mock.script.lock().extend([
            Attempt::Transient("down".to_string()),
            Attempt::Transient("down".to_string()),
        ]);
        let publisher = start(&mock, fast_retry().with_max_publish_attempts(3));
        let started = tokio::time::Instant::now();
        publisher.completed("r1", 1, 0, Outcome::Finished).unwrap();
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.published, 1);
        assert_eq!(stats.retries, 2);
        assert_eq!(stats.failed, 0);
        // 10 ms then 20 ms of backoff.
        assert_eq!(started.elapsed(), Duration::from_millis(30));
        assert_eq!(mock.sent.lock().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_max_attempts_and_leaves_a_gap() {
        let mock = MockSink::default();
        mock.script
            .lock()
            .extend((0..3).map(|_| Attempt::Transient("down".to_string())));
        let publisher = start(&mock, fast_retry().with_max_publish_attempts(3));
        publisher.admitted("lost", 1, 0, 10, Some(5)).unwrap();
        publisher.admitted("kept", 1, 0, 10, Some(5)).unwrap();
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.failed, 1);
        assert_eq!(stats.retries, 2);
        assert_eq!(stats.published, 1);
        assert_eq!(stats.queued, 2);
        let sent = decoded(&mock.sent.lock());
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].1.event.request_id(), Some("kept"));
        assert_eq!(sent[0].1.sequence, 2, "the lost event's sequence is a gap");
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_failures_are_not_retried() {
        let mock = MockSink::default();
        mock.script
            .lock()
            .push_back(Attempt::Permanent("too big".to_string()));
        let publisher = start(&mock, fast_retry());
        publisher.worker_reset(3, Some(1)).unwrap();
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!((stats.failed, stats.retries, stats.published), (1, 0, 0));
    }

    #[tokio::test]
    async fn full_queue_drops_the_newest_and_counts() {
        let gate = Arc::new(Semaphore::new(0));
        let mock = MockSink {
            gate: Some(gate.clone()),
            ..MockSink::default()
        };
        let publisher = start(&mock, PublisherConfig::default().with_queue_capacity(4));
        let mut full = 0u64;
        for i in 0..1_000u32 {
            match publisher.progressed(format!("r{i}"), 1, 0, ProgressStage::Decoding, i) {
                Ok(()) => {}
                Err(PublishEventError::QueueFull) => full += 1,
                Err(other) => panic!("unexpected {other}"),
            }
        }
        assert!(full >= 1_000 - 4 - 256, "{full} dropped");
        let before = publisher.stats().snapshot();
        assert_eq!(before.dropped_queue_full, full);
        assert_eq!(before.queued + full, 1_000);
        gate.add_permits(10_000);
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.published + stats.dropped_queue_full, 1_000);
        assert_eq!(stats.pending(), 0);
        // The survivors are the oldest ones, in order.
        let sent = decoded(&mock.sent.lock());
        for (i, (_, env)) in sent.iter().enumerate() {
            assert_eq!(env.event.request_id(), Some(format!("r{i}").as_str()));
        }
    }

    #[tokio::test]
    async fn flush_waits_for_events_before_it() {
        let gate = Arc::new(Semaphore::new(0));
        let mock = MockSink {
            gate: Some(gate.clone()),
            ..MockSink::default()
        };
        let publisher = start(&mock, PublisherConfig::default());
        for i in 0..10 {
            publisher.admitted(format!("r{i}"), 1, 0, 1, None).unwrap();
        }
        let flush = publisher.flush();
        tokio::pin!(flush);
        assert!(timeout(Duration::from_millis(50), &mut flush)
            .await
            .is_err());
        assert!(mock.sent.lock().len() < 10);
        gate.add_permits(10);
        timeout(WAIT, flush).await.unwrap().unwrap();
        assert_eq!(mock.sent.lock().len(), 10);
    }

    #[tokio::test]
    async fn close_stops_every_handle() {
        let mock = MockSink::default();
        let publisher = start(&mock, PublisherConfig::default());
        let other = publisher.clone();
        other.worker_reset(1, None).unwrap();
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.published, 1);
        assert_eq!(other.worker_reset(1, None), Err(PublishEventError::Closed));
        assert_eq!(
            timeout(WAIT, other.flush()).await.unwrap(),
            Err(FlushPublisherError::Closed)
        );
        assert_eq!(
            timeout(WAIT, other.close()).await.unwrap(),
            Err(FlushPublisherError::Closed)
        );
    }

    #[tokio::test]
    async fn empty_request_id_is_refused() {
        let mock = MockSink::default();
        let publisher = start(&mock, PublisherConfig::default());
        assert_eq!(
            publisher.admitted("", 1, 0, 1, None),
            Err(PublishEventError::EmptyRequestId)
        );
        let stats = timeout(WAIT, publisher.close()).await.unwrap().unwrap();
        assert_eq!(stats.rejected_invalid, 1);
        assert_eq!(stats.attempted(), 1);
        assert_eq!(stats.queued, 0);
    }

    #[tokio::test]
    async fn dropped_publisher_drains_and_ends() {
        let gate = Arc::new(Semaphore::new(0));
        let ended = Arc::new(AtomicBool::new(false));
        let mock = MockSink {
            gate: Some(gate.clone()),
            dropped: Some(ended.clone()),
            ..MockSink::default()
        };
        let publisher = start(&mock, PublisherConfig::default());
        for i in 0..20 {
            publisher.admitted(format!("r{i}"), 1, 0, 1, None).unwrap();
        }
        let stats = publisher.stats().clone();
        drop(publisher);
        assert!(!ended.load(Ordering::Acquire));
        gate.add_permits(20);
        timeout(WAIT, async {
            while !ended.load(Ordering::Acquire) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the task ends once the queue is drained");
        assert_eq!(mock.sent.lock().len(), 20);
        assert_eq!(stats.snapshot().published, 20);
        assert_eq!(mock.flushes.load(Ordering::Acquire), 1);
    }
}

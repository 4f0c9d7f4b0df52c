//! The publisher's background task: takes the queued events in order, stamps, encodes,
//! batches and sends them through an [`EnvelopeSink`], retrying with backoff.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, PublishErrorKind, Subject};
use bytes::Bytes;
use hashbrown::HashMap;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};

use super::{
    Batching, Command, FlushPublisherError, PublisherConfig, PublisherStats, MAX_CACHED_SUBJECTS,
    MAX_OPEN_BATCH_EVENTS, TIMER_TICK,
};
use crate::log_limit::LogRateLimiter;
use crate::retry::{Attempt, Backoff};
use crate::subject::Subjects;
use crate::wire::{self, Envelope, LeaseEvent};

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
pub(super) struct CoreNatsSink {
    pub(super) client: Client,
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
pub(super) struct PublishLoop<S> {
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
    pub(super) fn new(
        sink: S,
        subjects: Subjects,
        publisher_id: u64,
        stats: Arc<PublisherStats>,
        config: &PublisherConfig,
    ) -> Self {
        Self {
            sink,
            subjects,
            subject_cache: HashMap::new(),
            publisher_id,
            next_sequence: 1,
            buf: Vec::with_capacity(128),
            stats,
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
        }
    }

    pub(super) async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
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

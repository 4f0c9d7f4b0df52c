//! The durable ingress: replay a deployment's subjects from the lease stream, then follow
//! them live, through the same [`EventApplier`] as the core-NATS ingress.
//!
//! One ordered consumer does both, so the seam between catch-up and live events is just
//! the next stream sequence: nothing is skipped and nothing is applied twice. When the
//! consumer is lost (server restart, failover, deletion), it is recreated with backoff from
//! the last stream sequence applied.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::{FutureExt, StreamExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use super::catch_up::{CatchUpState, StreamFigures};
use super::snapshot::{self, SnapshotStore};
use super::stream::{ensure_stream, EnsureStreamError, LeaseStreamConfig};
use crate::ingress::{Applied, ApplyConfig, EventApplier, BURST};
use crate::lease::Reaper;
use crate::log_limit::LogRateLimiter;
use crate::retry::RetryPolicy;
use crate::router::{IngressContext, IngressStart, RouterTask, TaskError};
use crate::stats::IngressStats;
use crate::subject::Subjects;
use tokio::sync::mpsc;

/// Why the durable ingress could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartDurableIngressError {
    /// The deployment's stream could not be created or checked.
    #[error(transparent)]
    Stream(#[from] EnsureStreamError),
    /// The replay consumer could not be created (after retrying transient errors).
    #[error("creating the replay consumer on {filter} failed: {source}")]
    Consumer {
        /// The subject filter of the consumer.
        filter: String,
        /// The last error.
        #[source]
        source: TaskError,
    },
    /// The ingress's subjects are for another deployment than the router it was given to.
    #[error("the ingress is for deployment {ingress} but the router is for {router}")]
    DeploymentMismatch {
        /// The deployment of the ingress's subjects.
        ingress: String,
        /// The deployment of the router.
        router: String,
    },
}

/// The JetStream ingress of one deployment.
pub struct JetStreamIngress {
    client: async_nats::Client,
    subjects: Subjects,
    stream: LeaseStreamConfig,
    apply: ApplyConfig,
    stats: Arc<IngressStats>,
    catch_up: Arc<CatchUpState>,
    retry: RetryPolicy,
}

impl JetStreamIngress {
    /// A JetStream ingress of these subjects, applying with these limits, sharing `stats`
    /// and `catch_up` with the caller (metrics, `/readyz`).
    pub fn new(
        client: async_nats::Client,
        subjects: Subjects,
        stream: LeaseStreamConfig,
        apply: ApplyConfig,
        stats: Arc<IngressStats>,
        catch_up: Arc<CatchUpState>,
    ) -> Self {
        Self {
            client,
            subjects,
            stream,
            // JetStream stored each event once (`Nats-Msg-Id`), so an event far behind its
            // publisher's latest is a deep acknowledgement window or a retry, not a copy.
            apply: ApplyConfig {
                drop_behind_window: false,
                ..apply
            },
            stats,
            catch_up,
            retry: RetryPolicy::default()
                .with_initial(Duration::from_millis(100))
                .with_max_interval(Duration::from_secs(5)),
        }
    }
}

/// The consumer position to (re)start from: everything the stream retains, or what
/// follows the last event applied.
fn deliver_policy(last_applied: u64) -> consumer::DeliverPolicy {
    if last_applied > 0 {
        consumer::DeliverPolicy::ByStartSequence {
            start_sequence: last_applied + 1,
        }
    } else {
        consumer::DeliverPolicy::All
    }
}

type Messages = consumer::pull::Ordered;
type OrderedConsumer = consumer::Consumer<consumer::pull::OrderedConfig>;

/// How long the ingress may hear nothing before it asks the server whether its consumer
/// still works: after a failover the client's ordered consumer can take a minute to notice.
const IDLE_CHECK: Duration = Duration::from_secs(2);

struct Follower {
    stream: jetstream::stream::Stream,
    filter: String,
}

impl Follower {
    /// The consumer's subject filter: none when the stream holds only the deployment's
    /// subjects (as [`ensure_stream`] checks). A filter there selects every message all the
    /// same, but nats-server 2.9 then counts a consumer's pending messages by scanning the
    /// stream from the consumer's position (`FilteredState`), at times once per delivered
    /// message: a replay from the middle of a 7 MB block went at 150-250 events/s (a core of
    /// the server busy) for up to 24 s. Without a filter the count is a subtraction.
    fn consumer_filter(&self) -> String {
        let subjects = &self.stream.cached_info().config.subjects;
        if subjects.len() == 1 && subjects[0] == self.filter {
            String::new()
        } else {
            self.filter.clone()
        }
    }

    /// Opens an ordered consumer from after `last_applied`; returns its messages, the
    /// consumer (for health checks) and the number of messages pending at creation.
    async fn open(
        &mut self,
        last_applied: u64,
    ) -> Result<(Messages, OrderedConsumer, u64), TaskError> {
        let config = consumer::pull::OrderedConfig {
            filter_subject: self.consumer_filter(),
            deliver_policy: deliver_policy(last_applied),
            ..Default::default()
        };
        let mut consumer = self.stream.create_consumer(config).await?;
        let pending = consumer
            .info()
            .await
            .map(|i| i.num_pending)
            .unwrap_or(u64::MAX);
        Ok((consumer.clone().messages().await?, consumer, pending))
    }
}

impl IngressStart for JetStreamIngress {
    type Error = StartDurableIngressError;

    async fn start(self, ctx: IngressContext) -> Result<Vec<RouterTask>, Self::Error> {
        if self.subjects.deployment().as_str() != &*ctx.deployment {
            return Err(StartDurableIngressError::DeploymentMismatch {
                ingress: self.subjects.deployment().to_string(),
                router: ctx.deployment.to_string(),
            });
        }
        let js = jetstream::new(self.client.clone());
        let mut backoff = self.retry.backoff();
        let mut attempts = 0;
        let stream = loop {
            match ensure_stream(&js, &self.stream, &self.subjects).await {
                Ok(stream) => break stream,
                // Failed requests (timeouts while a cluster elects) are retried; what the
                // stream's state refuses is not.
                Err(
                    error @ (EnsureStreamError::Create { .. } | EnsureStreamError::Lookup { .. }),
                ) if attempts < START_ATTEMPTS && is_transient(&error) => {
                    attempts += 1;
                    let delay = backoff.next_delay();
                    warn!(%error, ?delay, "the lease stream is not ready; retrying");
                    tokio::time::sleep(delay).await;
                }
                Err(error) => return Err(error.into()),
            }
        };
        let started = Instant::now();
        // Catch-up is done once everything in the stream at start has been applied.
        let target = stream.cached_info().state.last_sequence;
        let stream_created = stream.cached_info().created.unix_timestamp();
        let filter = self.subjects.deployment_filter();
        let stream_handle = stream.clone();
        let mut applier = EventApplier::new(
            self.subjects.clone(),
            ctx.manager.clone(),
            self.stats,
            self.apply,
        );
        let opener = snapshot::StoreOpener {
            js: js.clone(),
            subjects: self.subjects.clone(),
            config: self.stream.clone(),
        };
        let store = match opener.open().await {
            Ok(store) => Some(store),
            Err(error) => {
                warn!(%error, "the snapshot buckets are not available: replaying the whole stream; the snapshot writer tries again every interval");
                None
            }
        };
        let from = match &store {
            Some(store) => {
                load_snapshot(
                    store,
                    &ctx,
                    stream.cached_info(),
                    &mut applier,
                    &self.catch_up,
                )
                .await
            }
            _ => 0,
        };
        self.catch_up
            .last_stream_sequence
            .store(from, Ordering::Relaxed);
        let mut follower = Follower {
            stream,
            filter: filter.clone(),
        };
        // A cluster electing leaders (a node just died) answers with timeouts for a while:
        // retried with backoff; the caller bounds the whole start (the host by its connect
        // deadline).
        let mut backoff = self.retry.backoff();
        let mut attempts = 0;
        let (messages, consumer, pending) = loop {
            match follower.open(from).await {
                Ok(opened) => break opened,
                Err(source) if attempts >= START_ATTEMPTS || !is_transient(&*source) => {
                    return Err(StartDurableIngressError::Consumer {
                        filter: filter.clone(),
                        source,
                    })
                }
                Err(error) => {
                    attempts += 1;
                    let delay = backoff.next_delay();
                    warn!(%error, ?delay, "creating the replay consumer failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        };
        if pending == 0 || from >= target {
            self.catch_up.finish(started);
        }
        info!(deployment = %ctx.deployment, %filter, from, pending, "durable ingress replaying");
        let replaying = !self.catch_up.is_caught_up();
        applier.set_record_lag(!replaying);
        let run = Run {
            follower,
            applier,
            catch_up: self.catch_up.clone(),
            retry: self.retry,
            target,
            started,
            replaying,
            expect_from: Some(1),
            truncation_warn: LogRateLimiter::new(TRUNCATION_WARN_INTERVAL),
        };
        let span = tracing::info_span!("durable_ingress", deployment = %ctx.deployment);
        let monitor = ctx.tracker.spawn(
            monitor_stream(stream_handle, self.catch_up.clone(), ctx.cancel.clone())
                .instrument(span.clone()),
        );
        let (cut_requests, cuts) = mpsc::channel(1);
        let writer = snapshot::write_snapshots(
            store,
            opener,
            format!("{:016x}", rand::random::<u64>()),
            ctx.deployment.to_string(),
            stream_created,
            self.stream.snapshot_interval(),
            ctx.manager.clone(),
            cut_requests,
            self.catch_up.clone(),
            ctx.cancel.clone(),
        );
        let mut tasks = vec![RouterTask {
            name: "snapshot-writer",
            handle: ctx.tracker.spawn(writer.instrument(span.clone())),
        }];
        let handle = ctx.tracker.spawn(
            run.run(messages, consumer, cuts, ctx.reaper, ctx.cancel)
                .instrument(span),
        );
        tasks.extend([
            RouterTask {
                name: "durable-ingress",
                handle,
            },
            RouterTask {
                name: "stream-monitor",
                handle: monitor,
            },
        ]);
        Ok(tasks)
    }
}

/// What became of one stream message.
enum Step {
    /// Applied (or counted as dropped by the applier).
    Done,
    /// Done, and the replay has caught up with the stream.
    CaughtUp,
    /// The router is gone.
    Gone,
}

/// Why a burst ended the ingress's loop.
enum Stop {
    /// The router is gone.
    Gone,
    /// The consumer failed: recreate it.
    Failed(TaskError),
}

struct Run {
    follower: Follower,
    applier: EventApplier,
    catch_up: Arc<CatchUpState>,
    retry: RetryPolicy,
    target: u64,
    started: Instant,
    /// Still replaying: events are counted as replayed, their lag is not recorded.
    replaying: bool,
    /// The stream sequence the replay needs first, if it needs one (not when it starts from
    /// a point in time).
    expect_from: Option<u64>,
    truncation_warn: LogRateLimiter,
}

impl Run {
    async fn run(
        mut self,
        mut messages: Messages,
        mut consumer: OrderedConsumer,
        mut cuts: mpsc::Receiver<snapshot::CutRequest>,
        mut reaper: Reaper,
        cancel: CancellationToken,
    ) -> Result<(), TaskError> {
        let warn_limit = LogRateLimiter::new(Duration::from_secs(5));
        let mut idle_check = tokio::time::interval(IDLE_CHECK);
        idle_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heard = true;
        loop {
            // The reaper's steps run here between bursts, and also while the consumer is
            // checked or recreated below: leases go on expiring through an outage.
            let next = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Ok(()),
                () = reaper.tick() => continue,
                // Between two bursts: everything up to the last sequence is applied.
                Some(reply) = cuts.recv() => {
                    let _ = reply.send(snapshot::Cut {
                        stream_sequence: self.catch_up.last_stream_sequence(),
                        sequences: self.applier.sequence_image(),
                        reorder: self.applier.reorder_image(),
                    });
                    continue;
                }
                next = messages.next() => Next::Message(next),
                _ = idle_check.tick() => Next::Quiet,
            };
            let error: TaskError = match next {
                Next::Message(Some(Ok(message))) => {
                    heard = true;
                    match self.apply_burst(message, &mut messages) {
                        Ok(()) => continue,
                        Err(Stop::Gone) => {
                            info!("router is gone: the durable ingress stops");
                            return Ok(());
                        }
                        Err(Stop::Failed(error)) => error,
                    }
                }
                Next::Message(Some(Err(e))) => Box::new(e),
                Next::Message(None) => "the consumer's message stream ended".into(),
                Next::Quiet => {
                    if std::mem::replace(&mut heard, false) {
                        continue;
                    }
                    match reaper.beside(stalled(&mut consumer)).await {
                        Some(why) => why,
                        None => continue,
                    }
                }
            };
            if warn_limit.check().is_some() {
                warn!(%error, last = self.catch_up.last_stream_sequence(), "replay consumer lost; recreating");
            }
            match reaper.beside(self.reopen(&cancel)).await {
                Some((m, c)) => (messages, consumer) = (m, c),
                None => return Ok(()),
            }
        }
    }

    /// Applies `first` and the messages already buffered behind it (up to a burst) as one
    /// batch of the applier, as the core-NATS ingress does: a replay of a long stream is
    /// mostly full bursts.
    fn apply_burst(
        &mut self,
        first: jetstream::Message,
        messages: &mut Messages,
    ) -> Result<(), Stop> {
        self.applier.begin_batch();
        let mut message = first;
        let mut applied = 0;
        let mut caught_up = false;
        let result = loop {
            match self.apply(&message) {
                Step::Gone => break Err(Stop::Gone),
                Step::CaughtUp => caught_up = true,
                Step::Done => {}
            }
            applied += 1;
            if applied == BURST {
                break Ok(());
            }
            match messages.next().now_or_never() {
                Some(Some(Ok(next))) => message = next,
                Some(Some(Err(error))) => break Err(Stop::Failed(Box::new(error))),
                Some(None) => {
                    break Err(Stop::Failed("the consumer's message stream ended".into()))
                }
                None => break Ok(()),
            }
        };
        self.applier.end_batch();
        if caught_up {
            // After the batch's counts and scheduler updates are handed over: whoever waits
            // for the catch-up sees everything replayed.
            self.catch_up.finish(self.started);
        }
        result
    }

    /// Applies one stream message.
    fn apply(&mut self, message: &jetstream::Message) -> Step {
        let (sequence, pending) = match message.info() {
            Ok(info) => {
                let stored_us = info.published.unix_timestamp_nanos() / 1_000;
                self.applier
                    .set_stream_time(u64::try_from(stored_us).unwrap_or(0));
                (info.stream_sequence, info.pending)
            }
            Err(_) => (self.catch_up.last_stream_sequence() + 1, u64::MAX),
        };
        let last = self.catch_up.last_stream_sequence();
        let expected = if last > 0 {
            Some(last + 1)
        } else {
            self.expect_from
        };
        if let Some(expected) = expected.filter(|&e| sequence > e) {
            self.truncated(expected, sequence);
        }
        let events = match self.applier.apply(&message.subject, &message.payload) {
            Err(_) => return Step::Gone,
            Ok(Applied::Batch(batch)) => u64::from(batch.events()),
            Ok(_) => 1,
        };
        self.catch_up
            .last_stream_sequence
            .store(sequence, Ordering::Relaxed);
        if self.replaying {
            self.catch_up.replayed.fetch_add(events, Ordering::Relaxed);
            if sequence >= self.target || pending == 0 {
                self.applier.set_record_lag(true);
                self.replaying = false;
                return Step::CaughtUp;
            }
        }
        Step::Done
    }

    /// The stream skipped from `expected` to `got`: it discarded (by its limits) events
    /// this replica needed. Counted and told, and the replica goes on from what there is.
    fn truncated(&self, expected: u64, got: u64) {
        let missing = got - expected;
        self.catch_up.truncated(missing);
        if self.truncation_warn.check().is_some() {
            warn!(
                missing,
                from = expected,
                to = got - 1,
                total = self.catch_up.truncated_events(),
                "the lease stream no longer holds events this replica needs (its limits \
                 discarded them): going on from what it has; leases they admitted are \
                 missing and leases they ended linger until they expire. Raise \
                 stream_max_bytes or lower the event rate (README: Durable mode at scale)"
            );
        }
    }

    /// Recreates the consumer after the last applied sequence, with backoff, until it
    /// works or the router is cancelled.
    async fn reopen(&mut self, cancel: &CancellationToken) -> Option<(Messages, OrderedConsumer)> {
        let mut backoff = self.retry.backoff();
        loop {
            let delay = backoff.next_delay();
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(delay) => {}
            }
            let last = self.catch_up.last_stream_sequence();
            match self.follower.open(last).await {
                Ok((messages, consumer, _)) => {
                    self.catch_up
                        .consumer_recreations
                        .fetch_add(1, Ordering::Relaxed);
                    info!(from = last + 1, "replay consumer recreated");
                    return Some((messages, consumer));
                }
                Err(error) => {
                    warn!(%error, ?delay, "recreating the replay consumer failed; retrying");
                }
            }
        }
    }
}

/// Loads the newest snapshot into the router and the applier; returns the stream sequence
/// it reflects (0 when there is none or it cannot be used: the whole stream is replayed).
async fn load_snapshot(
    store: &SnapshotStore,
    ctx: &IngressContext,
    stream: &jetstream::stream::Info,
    applier: &mut EventApplier,
    state: &CatchUpState,
) -> u64 {
    // A read that fails (a node of the cluster just died) is tried again before the
    // replica falls back to the whole stream.
    let mut loaded = store.load().await;
    for _ in 0..2 {
        if !matches!(loaded, Err(ref e) if e.is_transient()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        loaded = store.load().await;
    }
    let snapshot = match loaded {
        Ok(Some(snapshot)) => snapshot,
        Ok(None) => {
            state.snapshots.missing.fetch_add(1, Ordering::Relaxed);
            info!("no snapshot yet: replaying the whole stream");
            return 0;
        }
        Err(error) => {
            state.snapshots.invalid.fetch_add(1, Ordering::Relaxed);
            snapshot::log_fallback(&error);
            return 0;
        }
    };
    if let Err(error) = snapshot::check(&snapshot, &ctx.deployment, stream) {
        state.snapshots.invalid.fetch_add(1, Ordering::Relaxed);
        snapshot::log_fallback(&error);
        return 0;
    }
    let Some(manager) = ctx.manager.upgrade() else {
        return 0;
    };
    let mut batch = manager.batch();
    for lease in &snapshot.leases {
        batch.restore(lease);
    }
    batch.finish();
    manager.restore_prefix(&snapshot.prefix);
    applier.restore_sequences(snapshot.sequences);
    applier.restore_reorder(snapshot.reorder);
    let header = snapshot.header;
    snapshot::log_loaded(&header);
    state
        .snapshots
        .loaded_sequence
        .store(header.stream_sequence, Ordering::Relaxed);
    state
        .snapshots
        .loaded_leases
        .store(header.leases, Ordering::Relaxed);
    header.stream_sequence
}

/// Whether a failed JetStream request may work when tried again: a timeout or a system
/// that is electing leaders (async-nats reports both only in its messages).
fn is_transient(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        let text = e.to_string().to_ascii_lowercase();
        if text.contains("timed out") || text.contains("temporarily unavailable") {
            return true;
        }
        current = e.source();
    }
    false
}

/// Tries to create the replay consumer at start before giving up (about 30 s of backoff).
const START_ATTEMPTS: u32 = 10;

/// How often the stream's size and age are read for the metrics.
const STREAM_POLL: Duration = Duration::from_secs(5);
/// At most one truncation warning per deployment this often (each is counted).
const TRUNCATION_WARN_INTERVAL: Duration = Duration::from_secs(30);

/// Reads the stream's state every [`STREAM_POLL`] until `cancel`: its bytes and age next to
/// its limits, for the metrics. A failed read keeps the last figures.
async fn monitor_stream(
    mut stream: jetstream::stream::Stream,
    state: Arc<CatchUpState>,
    cancel: CancellationToken,
) -> Result<(), TaskError> {
    let mut tick = tokio::time::interval(STREAM_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let info = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            info = tokio::time::timeout(STREAM_POLL, stream.info()) => info,
        };
        if let Ok(Ok(info)) = info {
            let oldest = if info.state.messages == 0 {
                Duration::ZERO
            } else {
                let age = time::OffsetDateTime::now_utc() - info.state.first_timestamp;
                age.try_into().unwrap_or(Duration::ZERO)
            };
            *state.stream.lock() = Some(StreamFigures {
                bytes: info.state.bytes,
                messages: info.state.messages,
                first_sequence: info.state.first_sequence,
                last_sequence: info.state.last_sequence,
                oldest_age: oldest,
                max_bytes: info.config.max_bytes,
                max_age: info.config.max_age,
            });
        }
    }
}

/// What woke the ingress. Lives on the stack for one iteration; boxing the message to even
/// out the variants would cost an allocation per event.
#[allow(clippy::large_enum_variant)]
enum Next {
    Message(Option<Result<jetstream::Message, consumer::pull::OrderedError>>),
    /// A check interval passed.
    Quiet,
}

/// After a quiet check interval: why the consumer looks stuck (the server no longer knows
/// it, or it has messages it does not deliver), or `None` if it is merely idle.
async fn stalled(consumer: &mut OrderedConsumer) -> Option<TaskError> {
    match tokio::time::timeout(IDLE_CHECK, consumer.info()).await {
        Ok(Ok(info)) if info.num_pending == 0 => None,
        Ok(Ok(info)) => Some(
            format!(
                "{} messages pending but none delivered for {IDLE_CHECK:?}",
                info.num_pending
            )
            .into(),
        ),
        Ok(Err(e)) => Some(Box::new(e)),
        Err(_) => Some(format!("consumer info did not answer within {IDLE_CHECK:?}").into()),
    }
}

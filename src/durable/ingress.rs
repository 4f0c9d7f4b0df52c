//! The durable ingress: replay a deployment's subjects from the lease stream, then follow
//! them live, through the same [`EventApplier`] as the core-NATS ingress.
//!
//! One ordered consumer does both, so the seam between catch-up and live events is just
//! the next stream sequence: nothing is skipped and nothing is applied twice. When the
//! consumer is lost (server restart, failover, deletion), it is recreated with backoff from
//! the last stream sequence applied.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::{FutureExt, StreamExt};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn, Instrument};

use super::stream::{ensure_stream, EnsureStreamError, LeaseStreamConfig};
use crate::connection::LogRateLimiter;
use crate::ingress::{ApplyConfig, EventApplier, BURST};
use crate::lease::Reaper;
use crate::retry::RetryPolicy;
use crate::router::{IngressContext, IngressStart, RouterTask, TaskError};
use crate::stats::IngressStats;
use crate::subject::Subjects;

/// Progress of a durable ingress's catch-up, shared with `/readyz` and the metrics.
#[derive(Debug, Default)]
pub struct CatchUpState {
    caught_up: AtomicBool,
    replayed: AtomicU64,
    micros: AtomicU64,
    last_stream_sequence: AtomicU64,
    consumer_recreations: AtomicU64,
    notify: Notify,
}

impl CatchUpState {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire)
    }

    /// Events applied during catch-up.
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Ordering::Relaxed)
    }

    /// How long catch-up took (0 until it is done).
    pub fn duration(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::Relaxed))
    }

    /// The last stream sequence applied.
    pub fn last_stream_sequence(&self) -> u64 {
        self.last_stream_sequence.load(Ordering::Relaxed)
    }

    /// Times the consumer was lost and recreated.
    pub fn consumer_recreations(&self) -> u64 {
        self.consumer_recreations.load(Ordering::Relaxed)
    }

    /// Resolves once catch-up is done.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.is_caught_up() {
                return;
            }
            notified.await;
        }
    }

    fn finish(&self, started: Instant) {
        self.micros
            .store(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.caught_up.store(true, Ordering::Release);
        self.notify.notify_waiters();
        info!(
            replayed = self.replayed(),
            seconds = self.duration().as_secs_f64(),
            "catch-up done: following live events"
        );
    }
}

/// Where a new router replica starts reading the stream.
#[derive(Clone, Copy, Debug)]
pub enum ReplayFrom {
    /// Everything the stream retains.
    All,
    /// Events published in the last `Duration` (for example one lease lifetime).
    Last(Duration),
}

/// Why the durable ingress could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartDurableIngressError {
    #[error(transparent)]
    Stream(#[from] EnsureStreamError),
    #[error("creating the replay consumer on {filter} failed: {source}")]
    Consumer {
        filter: String,
        #[source]
        source: TaskError,
    },
    #[error("the ingress is for deployment {ingress} but the router is for {router}")]
    DeploymentMismatch { ingress: String, router: String },
}

/// The JetStream ingress of one deployment.
pub struct JetStreamIngress {
    client: async_nats::Client,
    subjects: Subjects,
    stream: LeaseStreamConfig,
    apply: ApplyConfig,
    stats: Arc<IngressStats>,
    catch_up: Arc<CatchUpState>,
    replay_from: ReplayFrom,
    retry: RetryPolicy,
}

impl JetStreamIngress {
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
            apply,
            stats,
            catch_up,
            replay_from: ReplayFrom::All,
            retry: RetryPolicy::default()
                .with_initial(Duration::from_millis(100))
                .with_max_interval(Duration::from_secs(5)),
        }
    }

    pub fn with_replay_from(mut self, from: ReplayFrom) -> Self {
        self.replay_from = from;
        self
    }
}

/// The consumer position to (re)start from.
fn deliver_policy(from: ReplayFrom, last_applied: u64) -> consumer::DeliverPolicy {
    if last_applied > 0 {
        return consumer::DeliverPolicy::ByStartSequence {
            start_sequence: last_applied + 1,
        };
    }
    match from {
        ReplayFrom::All => consumer::DeliverPolicy::All,
        ReplayFrom::Last(window) => consumer::DeliverPolicy::ByStartTime {
            start_time: time::OffsetDateTime::now_utc() - window,
        },
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
    replay_from: ReplayFrom,
}

impl Follower {
    /// Opens an ordered consumer from after `last_applied`; returns its messages, the
    /// consumer (for health checks) and the number of messages pending at creation.
    async fn open(
        &mut self,
        last_applied: u64,
    ) -> Result<(Messages, OrderedConsumer, u64), TaskError> {
        let config = consumer::pull::OrderedConfig {
            filter_subject: self.filter.clone(),
            deliver_policy: deliver_policy(self.replay_from, last_applied),
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
        let stream = ensure_stream(&js, &self.stream).await?;
        // Catch-up is done once everything in the stream at start has been applied.
        let target = stream.cached_info().state.last_sequence;
        let filter = self.subjects.deployment_filter();
        let mut follower = Follower {
            stream,
            filter: filter.clone(),
            replay_from: self.replay_from,
        };
        let (messages, consumer, pending) =
            follower
                .open(0)
                .await
                .map_err(|source| StartDurableIngressError::Consumer {
                    filter: filter.clone(),
                    source,
                })?;
        let started = Instant::now();
        if pending == 0 {
            self.catch_up.finish(started);
        }
        info!(deployment = %ctx.deployment, %filter, pending, "durable ingress replaying");
        let mut applier = EventApplier::new(self.subjects, ctx.manager, self.stats, self.apply);
        let replaying = !self.catch_up.is_caught_up();
        applier.set_record_lag(!replaying);
        let run = Run {
            follower,
            applier,
            catch_up: self.catch_up,
            retry: self.retry,
            target,
            started,
            replaying,
        };
        let span = tracing::info_span!("durable_ingress", deployment = %ctx.deployment);
        let handle = ctx.tracker.spawn(
            run.run(messages, consumer, ctx.reaper, ctx.cancel)
                .instrument(span),
        );
        Ok(vec![RouterTask {
            name: "durable-ingress",
            handle,
        }])
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
}

impl Run {
    async fn run(
        mut self,
        mut messages: Messages,
        mut consumer: OrderedConsumer,
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
            Ok(info) => (info.stream_sequence, info.pending),
            Err(_) => (self.catch_up.last_stream_sequence() + 1, u64::MAX),
        };
        if self
            .applier
            .apply(&message.subject, &message.payload)
            .is_err()
        {
            return Step::Gone;
        }
        self.catch_up
            .last_stream_sequence
            .store(sequence, Ordering::Relaxed);
        if self.replaying {
            self.catch_up.replayed.fetch_add(1, Ordering::Relaxed);
            if sequence >= self.target || pending == 0 {
                self.applier.set_record_lag(true);
                self.replaying = false;
                return Step::CaughtUp;
            }
        }
        Step::Done
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

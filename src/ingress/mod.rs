//! The NATS ingress of one deployment: a subscription to `{prefix}.{deployment}.>` whose
//! messages go through [`apply::EventApplier`] to the router's weak observer.
//!
//! Two tasks form a short pipeline: one takes bursts of up to 256 messages off the
//! subscription, the other decodes and applies each burst as one batch, so receiving runs
//! beside applying (at most 8 bursts wait between them, then the subscription's own buffer
//! fills and NATS reports a slow consumer). The applying task also runs the reaper's steps
//! between bursts (see [`crate::lease::reaper`]). When the observer reports the router gone,
//! the applying task stops the receiving one; when the router cancels, the receiving task
//! stops. Either way it unsubscribes and hands over what was already buffered (bounded): on a
//! router torn down those reach the dead observer and are counted as late, never lost silently.

mod apply;
mod reorder;
mod sequence;

use std::sync::Arc;
use std::time::Duration;

use async_nats::Message;
use futures::{FutureExt, StreamExt};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

pub(crate) use apply::ReorderImage;
pub use apply::{Applied, ApplyConfig, BatchOutcome, EventApplier};
pub(crate) use sequence::SequenceImage;

use crate::lease::Reaper;
use crate::router::{IngressContext, IngressStart, RouterTask, TaskError};
use crate::stats::IngressStats;
use crate::subject::Subjects;

/// How long a drain at shutdown may take before the rest is abandoned.
const DRAIN_BOUND: Duration = Duration::from_secs(5);
/// Messages taken and applied as one batch at most (both ingresses).
pub(crate) const BURST: usize = 256;
/// Bursts that may wait between receiving and applying.
const PIPELINE_BATCHES: usize = 8;
/// How long a start waits for the server to confirm its subscription.
const CONFIRM_BOUND: Duration = Duration::from_secs(2);
/// The subjects a core-mode router publishes to itself, once per start, to learn that the
/// server has its subscription (a router's NATS user needs publish and subscribe on them).
pub const PROBE_SUBJECTS: &str = "_LEASE_ROUTER.probe.*";

/// Why the ingress could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartIngressError {
    /// Subscribing to the deployment's subjects failed.
    #[error("subscribing to {filter} failed: {source}")]
    Subscribe {
        /// The subject filter subscribed to.
        filter: String,
        /// The client's error.
        #[source]
        source: async_nats::SubscribeError,
    },
    /// Flushing the subscription to the server failed.
    #[error("the NATS server did not confirm the subscription to {filter}: {source}")]
    Flush {
        /// The subject filter subscribed to.
        filter: String,
        /// The client's error.
        #[source]
        source: async_nats::client::FlushError,
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

/// Called with each burst of messages once it is applied and handed to the scheduler, on the
/// applying task (keep it short): for measuring publish-to-apply latency, or for reacting to
/// fresh load at once.
pub type AppliedHook = Arc<dyn Fn(&[Message]) + Send + Sync>;

/// The core-NATS ingress: at-most-once, live events only.
pub struct NatsIngress {
    client: async_nats::Client,
    subjects: Subjects,
    config: ApplyConfig,
    stats: Arc<IngressStats>,
    on_applied: Option<AppliedHook>,
}

impl NatsIngress {
    /// `stats` is shared with whoever exports it (and may outlive the router, so that late
    /// drops after teardown stay visible).
    pub fn new(
        client: async_nats::Client,
        subjects: Subjects,
        config: ApplyConfig,
        stats: Arc<IngressStats>,
    ) -> Self {
        Self {
            client,
            subjects,
            config,
            stats,
            on_applied: None,
        }
    }

    /// Calls `hook` after each burst is applied (see [`AppliedHook`]).
    pub fn on_applied(mut self, hook: AppliedHook) -> Self {
        self.on_applied = Some(hook);
        self
    }
}

impl IngressStart for NatsIngress {
    type Error = StartIngressError;

    async fn start(self, ctx: IngressContext) -> Result<Vec<RouterTask>, StartIngressError> {
        if self.subjects.deployment().as_str() != &*ctx.deployment {
            return Err(StartIngressError::DeploymentMismatch {
                ingress: self.subjects.deployment().to_string(),
                router: ctx.deployment.to_string(),
            });
        }
        let filter = self.subjects.deployment_filter();
        let subscriber = self
            .client
            .subscribe(filter.clone())
            .await
            .map_err(|source| StartIngressError::Subscribe {
                filter: filter.clone(),
                source,
            })?;
        // Started means subscribed: the server has the interest before we return.
        self.client
            .flush()
            .await
            .map_err(|source| StartIngressError::Flush {
                filter: filter.clone(),
                source,
            })?;
        if let Err(reason) = confirm_read(&self.client, CONFIRM_BOUND).await {
            warn!(
                deployment = %ctx.deployment, %filter, %reason,
                "the server did not confirm the subscription; events published at once may be missed"
            );
        }
        info!(deployment = %ctx.deployment, %filter, "ingress subscribed");
        let applier = EventApplier::new(self.subjects, ctx.manager, self.stats, self.config);
        let (batches, inbox) = mpsc::channel(PIPELINE_BATCHES);
        let pipe = Pipe::default();
        // Cancelled by the router, or by the applying task once the router is gone.
        let stop = ctx.cancel.child_token();
        let span = tracing::info_span!("ingress", deployment = %ctx.deployment);
        let receive = ctx.tracker.spawn(
            receive(subscriber, batches, pipe.clone(), stop.clone()).instrument(span.clone()),
        );
        let apply = ctx
            .tracker
            .spawn(apply(inbox, ctx.reaper, pipe, applier, self.on_applied, stop).instrument(span));
        Ok(vec![
            RouterTask {
                name: "ingress",
                handle: receive,
            },
            RouterTask {
                name: "ingress-apply",
                handle: apply,
            },
        ])
    }
}

/// Emptied burst vectors, handed back from the applying task to the receiving one so a
/// burst costs no allocation.
#[derive(Clone, Default)]
struct Pipe {
    spare: Arc<Mutex<Vec<Vec<Message>>>>,
}

impl Pipe {
    fn take(&self) -> Vec<Message> {
        self.spare.lock().pop().unwrap_or_default()
    }

    fn give_back(&self, mut burst: Vec<Message>) {
        burst.clear();
        let mut spare = self.spare.lock();
        if spare.len() <= PIPELINE_BATCHES {
            spare.push(burst);
        }
    }
}

/// Waits until the server has read everything `client` sent before: `flush` only empties the
/// socket's buffer, so a publisher on another connection could still beat our SUB to the
/// server. A message to a subject of our own comes back only once the server has read what
/// came before it (it reads a connection in order). It needs echo (the NATS default) and,
/// under subject permissions, publish and subscribe rights on [`PROBE_SUBJECTS`]; without
/// them the start goes on unconfirmed, as before, after `bound`.
async fn confirm_read(client: &async_nats::Client, bound: Duration) -> Result<(), String> {
    let probe = PROBE_SUBJECTS.replace('*', &format!("{:016x}", rand::random::<u64>()));
    let mut echo = client
        .subscribe(probe.clone())
        .await
        .map_err(|e| format!("subscribing to {probe} failed: {e}"))?;
    client
        .publish(probe.clone(), bytes::Bytes::new())
        .await
        .map_err(|e| format!("publishing to {probe} failed: {e}"))?;
    let outcome = match tokio::time::timeout(bound, echo.next()).await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(format!("the subscription to {probe} closed")),
        Err(_) => Err(format!(
            "nothing came back on {probe} within {bound:?} (a NATS user needs publish and \
             subscribe rights on {PROBE_SUBJECTS}, see deploy/nats/permissions.conf)"
        )),
    };
    // Best effort: a failed unsubscribe leaves one idle subscription behind.
    let _ = echo.unsubscribe().await;
    outcome
}

/// Takes messages off the subscription in bursts and hands each to the applying task, so
/// receiving runs beside decoding and applying. Stops when `stop` fires (the router is
/// cancelled or gone), then unsubscribes and hands over what was already buffered.
async fn receive(
    mut subscriber: async_nats::Subscriber,
    batches: mpsc::Sender<Vec<Message>>,
    pipe: Pipe,
    stop: CancellationToken,
) -> Result<(), TaskError> {
    loop {
        let message = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            message = subscriber.next() => message,
        };
        let Some(message) = message else {
            debug!("subscription closed by the client");
            return Ok(());
        };
        if batches
            .send(burst(message, &mut subscriber, &pipe))
            .await
            .is_err()
        {
            // Only if the applying task failed: nobody is left to count these.
            return Err("the applying task ended before the receiving one".into());
        }
    }
    drain(subscriber, &batches, &pipe).await;
    Ok(())
}

/// `first` and the messages already buffered behind it, up to [`BURST`].
fn burst(first: Message, subscriber: &mut async_nats::Subscriber, pipe: &Pipe) -> Vec<Message> {
    let mut burst = pipe.take();
    burst.push(first);
    while burst.len() < BURST {
        match subscriber.next().now_or_never() {
            Some(Some(next)) => burst.push(next),
            _ => break,
        }
    }
    burst
}

/// Decodes and applies the bursts, each as one batch, and runs the reaper's steps between
/// them. Once the router is gone it stops the receiving task and goes on counting what still
/// arrives as late, until that task is done.
async fn apply(
    mut inbox: mpsc::Receiver<Vec<Message>>,
    mut reaper: Reaper,
    pipe: Pipe,
    mut applier: EventApplier,
    on_applied: Option<AppliedHook>,
    stop: CancellationToken,
) -> Result<(), TaskError> {
    loop {
        let burst = tokio::select! {
            // Steps first: the reaper paces them, so a burst waits for at most one.
            biased;
            () = reaper.tick() => continue,
            burst = inbox.recv() => match burst {
                Some(burst) => burst,
                None => break,
            },
        };
        applier.begin_batch();
        for message in &burst {
            if applier.apply(&message.subject, &message.payload).is_err() && !stop.is_cancelled() {
                info!("router is gone: the ingress stops");
                stop.cancel();
            }
        }
        applier.end_batch();
        if let Some(hook) = &on_applied {
            hook(&burst);
        }
        pipe.give_back(burst);
    }
    Ok(())
}

/// Unsubscribes and hands over what was already on its way: applied while the router
/// lives, counted as late once it is gone.
async fn drain(
    mut subscriber: async_nats::Subscriber,
    batches: &mpsc::Sender<Vec<Message>>,
    pipe: &Pipe,
) {
    if let Err(error) = subscriber.drain().await {
        warn!(%error, "draining the subscription failed; buffered events are abandoned");
        return;
    }
    let drained = tokio::time::timeout(DRAIN_BOUND, async {
        let mut n = 0u64;
        while let Some(message) = subscriber.next().await {
            let burst = burst(message, &mut subscriber, pipe);
            n += burst.len() as u64;
            if batches.send(burst).await.is_err() {
                break;
            }
        }
        n
    })
    .await;
    match drained {
        Ok(n) => debug!(drained = n, "subscription drained"),
        Err(_) => warn!("draining the subscription took too long; the rest is abandoned"),
    }
}

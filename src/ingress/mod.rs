//! The NATS ingress of one deployment: a subscription to `{prefix}.{deployment}.>` whose
//! messages go through [`apply::EventApplier`] to the router's weak observer.
//!
//! The task ends by itself when the observer reports the router gone, and drains its
//! subscription (bounded) when the router cancels it, so events already buffered are counted
//! as late rather than silently lost.

pub mod apply;
pub mod reorder;
pub mod sequence;

use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

pub use apply::{Applied, ApplyConfig, EventApplier};

use crate::router::{IngressContext, IngressStart, RouterTask, TaskError};
use crate::stats::IngressStats;
use crate::subject::Subjects;

/// How long a drain at shutdown may take before the rest is abandoned.
const DRAIN_BOUND: Duration = Duration::from_secs(5);
/// Messages applied per wake-up before yielding to the runtime.
const BATCH: usize = 256;

/// Why the ingress could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartIngressError {
    #[error("subscribing to {filter} failed: {source}")]
    Subscribe {
        filter: String,
        #[source]
        source: async_nats::SubscribeError,
    },
    #[error("the NATS server did not confirm the subscription to {filter}: {source}")]
    Flush {
        filter: String,
        #[source]
        source: async_nats::client::FlushError,
    },
    #[error("the ingress is for deployment {ingress} but the router is for {router}")]
    DeploymentMismatch { ingress: String, router: String },
}

/// The core-NATS ingress: at-most-once, live events only.
pub struct NatsIngress {
    client: async_nats::Client,
    subjects: Subjects,
    config: ApplyConfig,
    stats: Arc<IngressStats>,
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
        }
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
        info!(deployment = %ctx.deployment, %filter, "ingress subscribed");
        let applier = EventApplier::new(self.subjects, ctx.observer, self.stats, self.config);
        let span = tracing::info_span!("ingress", deployment = %ctx.deployment);
        let handle = ctx
            .tracker
            .spawn(run(subscriber, applier, ctx.cancel).instrument(span));
        Ok(vec![RouterTask {
            name: "ingress",
            handle,
        }])
    }
}

async fn run(
    mut subscriber: async_nats::Subscriber,
    mut applier: EventApplier,
    cancel: CancellationToken,
) -> Result<(), TaskError> {
    'receive: loop {
        let message = tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            message = subscriber.next() => message,
        };
        let Some(mut message) = message else {
            debug!("subscription closed by the client");
            return Ok(());
        };
        // Apply what is already buffered too, without going back through select!.
        applier.begin_batch();
        for _ in 0..BATCH {
            if applier.apply(&message.subject, &message.payload).is_err() {
                info!("router is gone: the ingress stops");
                break 'receive;
            }
            match subscriber.next().now_or_never() {
                Some(Some(next)) => message = next,
                Some(None) => return Ok(()),
                None => break,
            }
        }
        applier.end_batch();
    }
    drain(subscriber, &mut applier).await;
    Ok(())
}

/// Unsubscribes and counts what was already on its way: applied while the router lives,
/// late drops once it is gone.
async fn drain(mut subscriber: async_nats::Subscriber, applier: &mut EventApplier) {
    applier.end_batch();
    if let Err(error) = subscriber.drain().await {
        warn!(%error, "draining the subscription failed; buffered events are abandoned");
        return;
    }
    let drained = tokio::time::timeout(DRAIN_BOUND, async {
        let mut n = 0u64;
        while let Some(message) = subscriber.next().await {
            let _ = applier.apply(&message.subject, &message.payload);
            n += 1;
        }
        n
    })
    .await;
    match drained {
        Ok(n) => debug!(drained = n, "subscription drained"),
        Err(_) => warn!("draining the subscription took too long; the rest is abandoned"),
    }
}

//! The JetStream stream that keeps lease events for late router replicas.

use std::time::Duration;

use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
use async_nats::jetstream::{self, stream};
use tracing::info;

use crate::subject::SubjectPrefix;

/// Settings of the lease stream.
#[derive(Clone, Debug)]
pub struct LeaseStreamConfig {
    /// Stream name; derived from the subject prefix by default.
    pub name: String,
    pub prefix: SubjectPrefix,
    /// How long events are kept: at least two lease lifetimes, so a replica that starts
    /// late sees the admission of every lease that can still be live.
    pub max_age: Duration,
    /// Bound on the stream's size; the oldest events go first.
    pub max_bytes: i64,
    /// Window in which a re-sent event (same `Nats-Msg-Id`) is stored once.
    pub duplicate_window: Duration,
    /// Copies kept in a cluster (1 on a single server, 3 on a three-node cluster).
    pub replicas: usize,
}

impl LeaseStreamConfig {
    /// A stream for `prefix` that keeps two lease lifetimes (a lease lives up to two scan
    /// intervals after its last renewal).
    pub fn new(prefix: SubjectPrefix, scan_interval: Duration) -> Self {
        let lease_lifetime = scan_interval * 2;
        Self {
            name: stream_name(&prefix),
            prefix,
            max_age: (lease_lifetime * 2).max(Duration::from_secs(60)),
            max_bytes: 1 << 30,
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
        }
    }

    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    fn to_stream_config(&self) -> stream::Config {
        stream::Config {
            name: self.name.clone(),
            description: Some("lease-router request-lease events".into()),
            subjects: vec![format!("{}.>", self.prefix)],
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::Old,
            storage: stream::StorageType::File,
            max_age: self.max_age,
            max_bytes: self.max_bytes,
            duplicate_window: self.duplicate_window.min(self.max_age),
            num_replicas: self.replicas,
            ..Default::default()
        }
    }
}

/// `leases` becomes `LEASE_ROUTER_leases`; dots (not allowed in names) become `_`.
pub fn stream_name(prefix: &SubjectPrefix) -> String {
    format!("LEASE_ROUTER_{}", prefix.as_str().replace('.', "_"))
}

/// Why the lease stream could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum EnsureStreamError {
    #[error(
        "the NATS server has no JetStream: start nats-server with -js (or `jetstream {{}}` \
         in its config) to use durable mode, or run without --durable"
    )]
    JetStreamUnavailable,
    #[error(
        "no JetStream stream {name} holds {prefix}.>: start a router with `serve --durable` \
         first (it creates the stream), or publish without --durable"
    )]
    Missing { name: String, prefix: String },
    #[error("creating or updating stream {name} failed: {source}")]
    Create {
        name: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Creates the stream, or updates it to `config` if it exists: safe to call from every
/// replica at every start.
///
/// # Errors
/// [`EnsureStreamError::JetStreamUnavailable`] when the server runs without JetStream.
pub async fn ensure_stream(
    js: &jetstream::Context,
    config: &LeaseStreamConfig,
) -> Result<stream::Stream, EnsureStreamError> {
    let wanted = config.to_stream_config();
    let create_error =
        |source: Box<dyn std::error::Error + Send + Sync>| EnsureStreamError::Create {
            name: config.name.clone(),
            source,
        };
    let stream = match js.get_or_create_stream(wanted.clone()).await {
        Ok(stream) => stream,
        Err(e) if is_unavailable(e.kind()) => return Err(EnsureStreamError::JetStreamUnavailable),
        Err(e) => return Err(create_error(Box::new(e))),
    };
    let current = &stream.cached_info().config;
    let differs = current.subjects != wanted.subjects
        || current.max_age != wanted.max_age
        || current.max_bytes != wanted.max_bytes
        || current.duplicate_window != wanted.duplicate_window
        || current.num_replicas != wanted.num_replicas;
    if differs {
        js.update_stream(wanted)
            .await
            .map_err(|e| create_error(Box::new(e)))?;
        info!(stream = %config.name, "lease stream updated");
        return js
            .get_stream(&config.name)
            .await
            .map_err(|e| create_error(Box::new(e)));
    }
    Ok(stream)
}

/// Checks that the lease stream of `prefix` exists, without creating or changing it: what
/// a durable publisher does, so that only routers decide the stream's settings.
///
/// # Errors
/// [`EnsureStreamError::Missing`] when no router has created it yet.
pub async fn require_stream(
    js: &jetstream::Context,
    prefix: &SubjectPrefix,
) -> Result<stream::Stream, EnsureStreamError> {
    let name = stream_name(prefix);
    match js.get_stream(&name).await {
        Ok(stream) => Ok(stream),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(j) if j.code() == 404 => {
                Err(EnsureStreamError::Missing {
                    name,
                    prefix: prefix.to_string(),
                })
            }
            GetStreamErrorKind::JetStream(j) if j.code() == 503 => {
                Err(EnsureStreamError::JetStreamUnavailable)
            }
            _ => Err(EnsureStreamError::Create {
                name,
                source: Box::new(e),
            }),
        },
    }
}

fn is_unavailable(kind: CreateStreamErrorKind) -> bool {
    match kind {
        CreateStreamErrorKind::JetStreamUnavailable => true,
        // 503 "JetStream not enabled", or no responder on the API subject.
        CreateStreamErrorKind::JetStream(e) => e.code() == 503,
        _ => false,
    }
}

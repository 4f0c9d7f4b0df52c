//! The JetStream streams that keep lease events for late router replicas: one per
//! deployment, so that a NATS cluster can place each on other nodes and one deployment's
//! traffic cannot push another's events out.

use std::time::Duration;

use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
use async_nats::jetstream::{self, stream};
use tracing::info;

use crate::subject::{SubjectPrefix, Subjects};

/// Default bound on each deployment's stream: 1 GiB holds about 6.5M events of ~166 bytes.
pub const DEFAULT_STREAM_MAX_BYTES: i64 = 1 << 30;

/// Limits of each deployment's lease stream (the name and subjects follow from the
/// deployment, see [`stream_name`]). Set through the `with_*` methods, which keep the limits
/// consistent (the age follows from the snapshots).
#[derive(Clone, Debug)]
pub struct LeaseStreamConfig {
    max_age: Duration,
    max_bytes: i64,
    /// Window in which a re-sent event (same `Nats-Msg-Id`) is stored once.
    duplicate_window: Duration,
    replicas: usize,
    snapshot_interval: Duration,
    snapshot_keep: u32,
    /// S2-compress the stream's stored blocks where the server can (2.10 and later).
    compress: bool,
}

/// Default interval between two snapshots of a deployment.
pub const DEFAULT_SNAPSHOT_INTERVAL: Duration = Duration::from_secs(60);
/// Default number of snapshot intervals a stream keeps.
pub const DEFAULT_SNAPSHOT_KEEP: u32 = 4;
/// The shortest age limit of a stream: the window in which a re-sent event is stored once
/// needs some history.
pub const MIN_STREAM_MAX_AGE: Duration = Duration::from_secs(60);

impl Default for LeaseStreamConfig {
    fn default() -> Self {
        Self {
            max_age: DEFAULT_SNAPSHOT_INTERVAL * DEFAULT_SNAPSHOT_KEEP,
            max_bytes: DEFAULT_STREAM_MAX_BYTES,
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
            snapshot_interval: DEFAULT_SNAPSHOT_INTERVAL,
            snapshot_keep: DEFAULT_SNAPSHOT_KEEP,
            compress: true,
        }
    }
}

impl LeaseStreamConfig {
    /// Streams that keep [`DEFAULT_SNAPSHOT_KEEP`] snapshot intervals of
    /// [`DEFAULT_SNAPSHOT_INTERVAL`]: with snapshots, a stream need not hold two lease
    /// lifetimes (a long-lived lease's admission is in the snapshot).
    pub fn new() -> Self {
        Self::default().with_snapshots(DEFAULT_SNAPSHOT_INTERVAL, DEFAULT_SNAPSHOT_KEEP)
    }

    /// Snapshots every `interval` (at least 100 ms); the stream keeps `keep` intervals (at
    /// least one, and at least [`MIN_STREAM_MAX_AGE`]), so a replica finds the events after
    /// any of the last few snapshots.
    pub fn with_snapshots(mut self, interval: Duration, keep: u32) -> Self {
        self.snapshot_interval = interval.max(Duration::from_millis(100));
        self.snapshot_keep = keep.max(1);
        self.max_age = (self.snapshot_interval * self.snapshot_keep).max(MIN_STREAM_MAX_AGE);
        self
    }

    /// Sets the copies kept in a cluster (at least 1; 3 on a three-node cluster), of the
    /// stream and of the snapshot buckets.
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.max(1);
        self
    }

    /// Sets the stream's size limit in bytes (-1: none); past it the oldest events go first
    /// (and a replica that needed them says so: see
    /// [`CatchUpState::truncated_events`](crate::CatchUpState::truncated_events)).
    pub fn with_max_bytes(mut self, max_bytes: i64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Whether the stream's stored blocks are S2-compressed where the server can (2.10 and
    /// later; an older server stores them as they are). On by default: lease events are
    /// small MessagePack maps with the same keys, so the stream takes a fraction of the disk
    /// (see BENCHMARKS.md), for some CPU on the server. Applies to blocks written after a
    /// change.
    pub fn with_compression(mut self, compress: bool) -> Self {
        self.compress = compress;
        self
    }

    /// Whether the stream is compressed where the server can.
    pub fn compression(&self) -> bool {
        self.compress
    }

    /// How long events are kept: [`snapshot_keep`](Self::snapshot_keep) snapshot intervals,
    /// at least [`MIN_STREAM_MAX_AGE`].
    pub fn max_age(&self) -> Duration {
        self.max_age
    }

    /// The stream's size limit in bytes (-1: none).
    pub fn max_bytes(&self) -> i64 {
        self.max_bytes
    }

    /// Copies kept in a cluster, of the stream and of the snapshot buckets.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// How often the writer replica snapshots the deployment's state.
    pub fn snapshot_interval(&self) -> Duration {
        self.snapshot_interval
    }

    /// Snapshot intervals the stream keeps: a replica finds the events after any of them.
    pub fn snapshot_keep(&self) -> u32 {
        self.snapshot_keep
    }

    /// `compresses`: whether the server takes a stream's `compression` (2.10 and later).
    fn to_stream_config(&self, subjects: &Subjects, compresses: bool) -> stream::Config {
        stream::Config {
            name: stream_name(subjects),
            description: Some(format!(
                "lease-router request-lease events of deployment {}",
                subjects.deployment()
            )),
            subjects: vec![subjects.deployment_filter()],
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::Old,
            storage: stream::StorageType::File,
            max_age: self.max_age,
            max_bytes: self.max_bytes,
            duplicate_window: self.duplicate_window.min(self.max_age),
            num_replicas: self.replicas,
            compression: compresses.then_some(if self.compress {
                stream::Compression::S2
            } else {
                stream::Compression::None
            }),
            ..Default::default()
        }
    }
}

/// The stream of one deployment: `leases` and `llama-70b` give
/// `LEASE_ROUTER_leases__llama-70b` (dots, not allowed in names, become `_`).
pub fn stream_name(subjects: &Subjects) -> String {
    format!(
        "LEASE_ROUTER_{}__{}",
        subjects.prefix().as_str().replace('.', "_"),
        subjects.deployment()
    )
}

/// The single stream of every deployment that versions before per-deployment streams
/// created: `LEASE_ROUTER_{prefix}` over `{prefix}.>`.
pub fn legacy_stream_name(prefix: &SubjectPrefix) -> String {
    format!("LEASE_ROUTER_{}", prefix.as_str().replace('.', "_"))
}

/// The hint of every `JetStreamUnavailable`.
const NO_JETSTREAM: &str = "the NATS server has no JetStream: start nats-server with -js (or \
     `jetstream {}` in its config) to use durable mode, or run without --durable";

/// Why looking the deployment's stream up failed: what all three stream operations share.
#[derive(Debug, thiserror::Error)]
enum FindStreamError {
    #[error("{}", NO_JETSTREAM)]
    JetStreamUnavailable,
    #[error(transparent)]
    Legacy(LegacyStream),
    #[error(transparent)]
    Foreign(ForeignStream),
    #[error(transparent)]
    Lookup(LookupStreamError),
}

/// An installation from before per-deployment streams: its one stream takes every
/// deployment's subjects, so no deployment stream can be created beside it.
#[derive(Debug, thiserror::Error)]
#[error(
    "JetStream stream {name} holds every deployment's events ({prefix}.>), the layout of \
     lease-router before one stream per deployment; a stream per deployment cannot be \
     created beside it. To move on: stop the durable routers and publishers of prefix \
     {prefix}, delete it (`nats stream rm {name}`), then start the routers again (each \
     creates its deployment's stream). Leases admitted before the switch are unknown to \
     replicas that start afterwards until they end. Or keep running the previous version"
)]
pub struct LegacyStream {
    /// The single stream's name.
    pub name: String,
    /// The subject prefix it covers.
    pub prefix: String,
}

/// The deployment's stream name is taken by a stream over other subjects.
#[derive(Debug, thiserror::Error)]
#[error(
    "JetStream stream {name} exists over {found:?}, not {wanted}: it is not this \
     deployment's lease stream; delete or rename it, or choose another subject prefix"
)]
pub struct ForeignStream {
    /// The stream's name.
    pub name: String,
    /// The subjects it has.
    pub found: Vec<String>,
    /// The subject the deployment's stream takes.
    pub wanted: String,
}

/// A request about the deployment's stream failed (a timeout while a cluster elects its
/// leaders, say).
#[derive(Debug, thiserror::Error)]
#[error("reading stream {name} failed: {source}")]
pub struct LookupStreamError {
    /// The stream.
    pub name: String,
    /// What the client said.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// Why [`ensure_stream`] could not make the deployment's stream ready.
#[derive(Debug, thiserror::Error)]
pub enum EnsureStreamError {
    /// The server runs without JetStream.
    #[error("{}", NO_JETSTREAM)]
    JetStreamUnavailable,
    /// Only an older installation's single stream exists.
    #[error(transparent)]
    Legacy(LegacyStream),
    /// The name is taken by another stream.
    #[error(transparent)]
    Foreign(ForeignStream),
    /// A request to the server failed (retried by the durable ingress when transient).
    #[error(transparent)]
    Lookup(LookupStreamError),
    /// Creating or updating the stream failed.
    #[error("creating or updating stream {name} failed: {source}")]
    Create {
        /// The stream.
        name: String,
        /// What the client said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Why [`require_stream`] found no stream to publish to.
#[derive(Debug, thiserror::Error)]
pub enum RequireStreamError {
    /// The server runs without JetStream.
    #[error("{}", NO_JETSTREAM)]
    JetStreamUnavailable,
    /// No router has added the deployment yet.
    #[error(
        "no JetStream stream {name} holds deployment {deployment}'s events ({filter}): a \
         durable router creates it when the deployment is added (`serve --durable \
         --deployment {deployment}`, or PUT /v1/deployments/{deployment}); add the \
         deployment first, or publish without --durable"
    )]
    Missing {
        /// The stream it looked for.
        name: String,
        /// The deployment.
        deployment: String,
        /// The subjects the stream would take.
        filter: String,
    },
    /// Only an older installation's single stream exists.
    #[error(transparent)]
    Legacy(LegacyStream),
    /// The name is taken by another stream.
    #[error(transparent)]
    Foreign(ForeignStream),
    /// A request to the server failed.
    #[error(transparent)]
    Lookup(LookupStreamError),
}

/// Why [`delete_stream`] could not delete the deployment's stream.
#[derive(Debug, thiserror::Error)]
pub enum DeleteStreamError {
    /// The server runs without JetStream.
    #[error("{}", NO_JETSTREAM)]
    JetStreamUnavailable,
    /// The name is taken by another stream, which is left alone.
    #[error(transparent)]
    Foreign(ForeignStream),
    /// A request to the server failed.
    #[error(transparent)]
    Lookup(LookupStreamError),
    /// The delete request failed.
    #[error("deleting stream {name} failed: {source}")]
    Delete {
        /// The stream.
        name: String,
        /// What the client said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl From<FindStreamError> for EnsureStreamError {
    fn from(e: FindStreamError) -> Self {
        match e {
            FindStreamError::JetStreamUnavailable => Self::JetStreamUnavailable,
            FindStreamError::Legacy(l) => Self::Legacy(l),
            FindStreamError::Foreign(f) => Self::Foreign(f),
            FindStreamError::Lookup(l) => Self::Lookup(l),
        }
    }
}

impl From<FindStreamError> for RequireStreamError {
    fn from(e: FindStreamError) -> Self {
        match e {
            FindStreamError::JetStreamUnavailable => Self::JetStreamUnavailable,
            FindStreamError::Legacy(l) => Self::Legacy(l),
            FindStreamError::Foreign(f) => Self::Foreign(f),
            FindStreamError::Lookup(l) => Self::Lookup(l),
        }
    }
}

impl From<FindStreamError> for DeleteStreamError {
    fn from(e: FindStreamError) -> Self {
        match e {
            FindStreamError::JetStreamUnavailable => Self::JetStreamUnavailable,
            // Deleting never looks for the legacy stream.
            FindStreamError::Legacy(l) => Self::Lookup(LookupStreamError {
                name: l.name.clone(),
                source: Box::new(l),
            }),
            FindStreamError::Foreign(f) => Self::Foreign(f),
            FindStreamError::Lookup(l) => Self::Lookup(l),
        }
    }
}

/// Creates the stream of `subjects`' deployment, or updates its limits to `config` if it
/// exists: safe to call from every replica at every start. Never deletes anything.
///
/// # Errors
/// [`EnsureStreamError::JetStreamUnavailable`] when the server runs without JetStream,
/// [`EnsureStreamError::Legacy`] beside an installation's single stream,
/// [`EnsureStreamError::Foreign`] when the name is taken by another stream,
/// [`EnsureStreamError::Lookup`] and [`EnsureStreamError::Create`] when a request fails.
pub async fn ensure_stream(
    js: &jetstream::Context,
    config: &LeaseStreamConfig,
    subjects: &Subjects,
) -> Result<stream::Stream, EnsureStreamError> {
    let compresses = js.client().is_server_compatible(2, 10, 0);
    let wanted = config.to_stream_config(subjects, compresses);
    let name = wanted.name.clone();
    let create_error =
        |source: Box<dyn std::error::Error + Send + Sync>| EnsureStreamError::Create {
            name: name.clone(),
            source,
        };
    let stream = match find_stream(js, subjects).await? {
        Some(stream) => stream,
        None => {
            refuse_legacy(js, subjects.prefix()).await?;
            match js.create_stream(wanted.clone()).await {
                Ok(stream) => {
                    info!(stream = %name, "lease stream created");
                    stream
                }
                // Another replica created it meanwhile.
                Err(e) if is_already_in_use(e.kind()) => find_stream(js, subjects)
                    .await?
                    .ok_or_else(|| create_error(Box::new(e)))?,
                Err(e) if is_unavailable(e.kind()) => {
                    return Err(EnsureStreamError::JetStreamUnavailable)
                }
                Err(e) => return Err(create_error(Box::new(e))),
            }
        }
    };
    let current = &stream.cached_info().config;
    let differs = current.max_age != wanted.max_age
        || current.max_bytes != wanted.max_bytes
        || current.duplicate_window != wanted.duplicate_window
        || current.num_replicas != wanted.num_replicas
        // A server that does not say is one without compression (before 2.10).
        || (compresses
            && current.compression.as_ref().unwrap_or(&stream::Compression::None)
                != wanted.compression.as_ref().unwrap_or(&stream::Compression::None));
    if differs {
        js.update_stream(wanted)
            .await
            .map_err(|e| create_error(Box::new(e)))?;
        info!(stream = %name, "lease stream limits updated");
        return js
            .get_stream(&name)
            .await
            .map_err(|e| create_error(Box::new(e)));
    }
    Ok(stream)
}

/// Checks that the stream of `subjects`' deployment exists, without creating or changing
/// it: what a durable publisher does, so that only routers decide the stream's settings.
///
/// # Errors
/// [`RequireStreamError::Missing`] when no router has added the deployment yet,
/// [`RequireStreamError::Legacy`] when only an installation's single stream exists.
pub async fn require_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, RequireStreamError> {
    if let Some(stream) = find_stream(js, subjects).await? {
        return Ok(stream);
    }
    refuse_legacy(js, subjects.prefix()).await?;
    Err(RequireStreamError::Missing {
        name: stream_name(subjects),
        deployment: subjects.deployment().to_string(),
        filter: subjects.deployment_filter(),
    })
}

/// Deletes the stream of `subjects`' deployment and every event in it: only on an explicit
/// request (removing a deployment from a router keeps its stream for the other replicas).
/// Returns whether there was one.
///
/// # Errors
/// [`DeleteStreamError::Foreign`] when the name is taken by another stream (left alone),
/// [`DeleteStreamError::Delete`] when the server refuses.
pub async fn delete_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<bool, DeleteStreamError> {
    let name = stream_name(subjects);
    if find_stream(js, subjects).await?.is_none() {
        return Ok(false);
    }
    js.delete_stream(&name)
        .await
        .map_err(|e| DeleteStreamError::Delete {
            name: name.clone(),
            source: Box::new(e),
        })?;
    info!(stream = %name, "lease stream deleted");
    Ok(true)
}

/// The deployment's stream if it exists, checked to be over its subjects.
async fn find_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<Option<stream::Stream>, FindStreamError> {
    let name = stream_name(subjects);
    let Some(stream) = get_stream(js, &name).await? else {
        return Ok(None);
    };
    let wanted = subjects.deployment_filter();
    let found = &stream.cached_info().config.subjects;
    if found.len() != 1 || found[0] != wanted {
        return Err(FindStreamError::Foreign(ForeignStream {
            name,
            found: found.clone(),
            wanted,
        }));
    }
    Ok(Some(stream))
}

/// Fails with [`FindStreamError::Legacy`] when the single stream of an older installation
/// holds the prefix.
async fn refuse_legacy(
    js: &jetstream::Context,
    prefix: &SubjectPrefix,
) -> Result<(), FindStreamError> {
    let name = legacy_stream_name(prefix);
    match get_stream(js, &name).await? {
        Some(stream)
            if stream
                .cached_info()
                .config
                .subjects
                .contains(&format!("{prefix}.>")) =>
        {
            Err(FindStreamError::Legacy(LegacyStream {
                name,
                prefix: prefix.to_string(),
            }))
        }
        _ => Ok(()),
    }
}

async fn get_stream(
    js: &jetstream::Context,
    name: &str,
) -> Result<Option<stream::Stream>, FindStreamError> {
    match js.get_stream(name).await {
        Ok(stream) => Ok(Some(stream)),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(j) if j.code() == 404 => Ok(None),
            GetStreamErrorKind::JetStream(j) if j.code() == 503 => {
                Err(FindStreamError::JetStreamUnavailable)
            }
            // No responder on the API subject: a server without JetStream.
            GetStreamErrorKind::Request if is_no_responders(&e) => {
                Err(FindStreamError::JetStreamUnavailable)
            }
            _ => Err(FindStreamError::Lookup(LookupStreamError {
                name: name.to_owned(),
                source: Box::new(e),
            })),
        },
    }
}

fn is_no_responders(e: &(dyn std::error::Error + 'static)) -> bool {
    std::error::Error::source(e)
        .and_then(|source| source.downcast_ref::<jetstream::context::RequestError>())
        .is_some_and(|r| r.kind() == jetstream::context::RequestErrorKind::NoResponders)
}

fn is_unavailable(kind: CreateStreamErrorKind) -> bool {
    match kind {
        CreateStreamErrorKind::JetStreamUnavailable => true,
        // 503 "JetStream not enabled", or no responder on the API subject.
        CreateStreamErrorKind::JetStream(e) => e.code() == 503,
        _ => false,
    }
}

/// "stream name already in use" (JetStream error 10058): a concurrent create won.
fn is_already_in_use(kind: CreateStreamErrorKind) -> bool {
    matches!(kind, CreateStreamErrorKind::JetStream(e)
        if e.error_code() == async_nats::jetstream::ErrorCode::STREAM_NAME_EXIST)
}

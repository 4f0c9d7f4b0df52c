//! Snapshots of a deployment's state, so that a late replica loads the newest one and
//! replays only the events after it: catch-up then grows with the live state, not with the
//! history.
//!
//! # Layout
//! Per deployment, a JetStream object store `LEASE_ROUTER_SNAP_{prefix}__{deployment}` holds
//! one object, `snapshot`: the bytes `LRSNAP01` then MessagePack of [`Snapshot`] (header,
//! sequence windows, live leases, then the tombstones and held progress of events that came
//! out of order: a field that snapshots of earlier versions lack and are read without). The object store cuts it into 128 KiB chunks and checks
//! its SHA-256 on read; a new snapshot becomes visible only once all its chunks are stored
//! (its metadata is written last), so a writer killed mid-write leaves the previous one.
//!
//! # One writer
//! A KV bucket `LEASE_ROUTER_SNAPLOCK_{prefix}__{deployment}` whose entries live
//! [`LOCK_INTERVALS`] snapshot intervals: the replica whose id is in `writer` writes; it
//! renews the entry at each write, and when it stops another replica takes over once the
//! entry has aged out.
//!
//! # A consistent cut without stalling ingest
//! The ingress hands over, between two bursts, the last stream sequence it applied, its
//! sequence windows and its tombstones and held progress (cheap); the leases are copied afterwards, one shard lock at a time, while
//! ingest goes on. A lease may so reflect a few events past the cut; replaying from the cut
//! applies them again, in order, which ends in the same state (a re-sent admission renews, a
//! completion of an ended lease is held and dropped).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, kv, object_store};
use bytes::Bytes;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::catch_up::CatchUpState;
use super::stream::LeaseStreamConfig;
use crate::ingress::{ReorderImage, SequenceImage};
use crate::lease::{LeaseImage, WeakRequestLeaseManager};
use crate::log_limit::LogRateLimiter;
use crate::prefix::PrefixImage;
use crate::router::TaskError;
use crate::subject::Subjects;

const MAGIC: &[u8; 8] = b"LRSNAP01";
const OBJECT: &str = "snapshot";
const LOCK_KEY: &str = "writer";
/// The writer's entry lives this many snapshot intervals unless renewed.
pub(crate) const LOCK_INTERVALS: u32 = 3;
/// How long a load may take before the replica falls back to replay.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// At most one warning this often while the snapshot buckets cannot be opened.
const OPEN_WARN_INTERVAL: Duration = Duration::from_secs(30);

/// What a snapshot holds.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct Snapshot {
    pub header: Header,
    pub sequences: SequenceImage,
    pub leases: Vec<LeaseImage>,
    /// Last, and optional: a snapshot written before it existed still loads.
    #[serde(default)]
    pub reorder: ReorderImage,
    /// The prefix index (after `reorder`, and optional, for the same reason).
    #[serde(default)]
    pub prefix: PrefixImage,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Header {
    pub deployment: String,
    /// The last stream sequence applied: replay goes on from the next one.
    pub stream_sequence: u64,
    /// When the stream was created (Unix seconds): a snapshot of a deleted and recreated
    /// stream does not match its sequences.
    pub stream_created: i64,
    pub written_at_us: u64,
    pub leases: u64,
}

/// The object store of `subjects`' deployment.
pub fn snapshot_bucket(subjects: &Subjects) -> String {
    format!(
        "LEASE_ROUTER_SNAP_{}__{}",
        subjects.prefix().as_str().replace('.', "_"),
        subjects.deployment()
    )
}

/// The KV bucket whose `writer` entry names the deployment's snapshot writer.
pub fn snapshot_lock_bucket(subjects: &Subjects) -> String {
    format!(
        "LEASE_ROUTER_SNAPLOCK_{}__{}",
        subjects.prefix().as_str().replace('.', "_"),
        subjects.deployment()
    )
}

/// Why a snapshot was not used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LoadSnapshotError {
    #[error("reading the snapshot failed (partial or corrupt: {0})")]
    Read(String),
    #[error("the snapshot is not readable: {0}")]
    Decode(String),
    #[error("the snapshot is of deployment {found}, not {wanted}")]
    Deployment { found: String, wanted: String },
    #[error(
        "the snapshot reflects stream sequence {snapshot} of a stream created at {created}, \
         but the stream (created at {stream_created}) ends at {last}: it is of another stream"
    )]
    OtherStream {
        snapshot: u64,
        created: i64,
        stream_created: i64,
        last: u64,
    },
    #[error("loading the snapshot took longer than {0:?}")]
    TimedOut(Duration),
}

impl LoadSnapshotError {
    /// A failed read, which another try may get past (a damaged snapshot is not).
    pub(crate) fn is_transient(&self) -> bool {
        matches!(self, Self::Read(_) | Self::TimedOut(_))
    }
}

/// The snapshot store of one deployment.
#[derive(Clone)]
pub(crate) struct SnapshotStore {
    objects: object_store::ObjectStore,
    locks: kv::Store,
}

fn boxed(e: impl std::error::Error + Send + Sync + 'static) -> TaskError {
    Box::new(e)
}

impl SnapshotStore {
    /// Opens (creating if needed) the deployment's object store and lock bucket.
    pub(crate) async fn open(
        js: &jetstream::Context,
        subjects: &Subjects,
        config: &LeaseStreamConfig,
    ) -> Result<Self, TaskError> {
        let bucket = snapshot_bucket(subjects);
        let objects = match js.get_object_store(&bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: bucket.clone(),
                    description: Some(format!(
                        "lease-router snapshots of deployment {}",
                        subjects.deployment()
                    )),
                    num_replicas: config.replicas(),
                    storage: jetstream::stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(boxed)?,
        };
        let lock_bucket = snapshot_lock_bucket(subjects);
        // The KV bucket's stream, made by hand as `create_key_value` would: that call asks
        // for account information that servers before 2.10 answer in a form it rejects.
        js.get_or_create_stream(jetstream::stream::Config {
            name: format!("KV_{lock_bucket}"),
            description: Some(format!(
                "lease-router snapshot writer of deployment {}",
                subjects.deployment()
            )),
            subjects: vec![format!("$KV.{lock_bucket}.>")],
            max_messages_per_subject: 1,
            max_age: config.snapshot_interval() * LOCK_INTERVALS,
            storage: jetstream::stream::StorageType::File,
            num_replicas: config.replicas(),
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: jetstream::stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await
        .map_err(boxed)?;
        let locks = js.get_key_value(&lock_bucket).await.map_err(boxed)?;
        Ok(Self { objects, locks })
    }

    /// Takes or renews the writer's entry; false when another replica holds it.
    pub(crate) async fn acquire(&self, writer: &str) -> Result<bool, TaskError> {
        match self
            .locks
            .create(LOCK_KEY, Bytes::from(writer.to_owned()))
            .await
        {
            Ok(_) => return Ok(true),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(boxed(e)),
        }
        match self.locks.entry(LOCK_KEY).await.map_err(boxed)? {
            Some(entry) if entry.value == writer.as_bytes() => {
                self.locks
                    .update(LOCK_KEY, Bytes::from(writer.to_owned()), entry.revision)
                    .await
                    .map_err(boxed)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Writes `snapshot` as the newest; returns its size in bytes.
    pub(crate) async fn put(&self, snapshot: Snapshot) -> Result<usize, TaskError> {
        let bytes = tokio::task::spawn_blocking(move || encode(&snapshot))
            .await
            .map_err(boxed)??;
        let size = bytes.len();
        let meta = object_store::ObjectMetadata {
            name: OBJECT.into(),
            ..Default::default()
        };
        self.objects
            .put(meta, &mut bytes.as_slice())
            .await
            .map_err(boxed)?;
        Ok(size)
    }

    /// The newest snapshot, `None` if there is none.
    pub(crate) async fn load(&self) -> Result<Option<Snapshot>, LoadSnapshotError> {
        let read = async {
            let mut object = match self.objects.get(OBJECT).await {
                Ok(object) => object,
                Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(LoadSnapshotError::Read(e.to_string())),
            };
            let mut bytes = Vec::new();
            object
                .read_to_end(&mut bytes)
                .await
                .map_err(|e| LoadSnapshotError::Read(e.to_string()))?;
            Ok(Some(bytes))
        };
        let bytes = match tokio::time::timeout(LOAD_TIMEOUT, read).await {
            Ok(result) => result?,
            Err(_) => return Err(LoadSnapshotError::TimedOut(LOAD_TIMEOUT)),
        };
        let Some(bytes) = bytes else { return Ok(None) };
        tokio::task::spawn_blocking(move || decode(&bytes))
            .await
            .map_err(|e| LoadSnapshotError::Decode(e.to_string()))?
            .map(Some)
    }
}

fn encode(snapshot: &Snapshot) -> Result<Vec<u8>, TaskError> {
    let mut out = MAGIC.to_vec();
    rmp_serde::encode::write(&mut out, snapshot).map_err(boxed)?;
    Ok(out)
}

fn decode(bytes: &[u8]) -> Result<Snapshot, LoadSnapshotError> {
    let body = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| LoadSnapshotError::Decode("it does not start with LRSNAP01".into()))?;
    let snapshot: Snapshot =
        rmp_serde::from_slice(body).map_err(|e| LoadSnapshotError::Decode(e.to_string()))?;
    if snapshot.header.leases != snapshot.leases.len() as u64 {
        return Err(LoadSnapshotError::Decode(format!(
            "its header counts {} leases, it holds {}",
            snapshot.header.leases,
            snapshot.leases.len()
        )));
    }
    Ok(snapshot)
}

/// Checks a loaded snapshot against the deployment and its stream.
pub(crate) fn check(
    snapshot: &Snapshot,
    deployment: &str,
    stream: &jetstream::stream::Info,
) -> Result<(), LoadSnapshotError> {
    let header = &snapshot.header;
    if header.deployment != deployment {
        return Err(LoadSnapshotError::Deployment {
            found: header.deployment.clone(),
            wanted: deployment.to_owned(),
        });
    }
    let stream_created = stream.created.unix_timestamp();
    if header.stream_created != stream_created
        || header.stream_sequence > stream.state.last_sequence
    {
        return Err(LoadSnapshotError::OtherStream {
            snapshot: header.stream_sequence,
            created: header.stream_created,
            stream_created,
            last: stream.state.last_sequence,
        });
    }
    Ok(())
}

/// What the ingress hands over for a snapshot, between two bursts.
pub(crate) struct Cut {
    pub stream_sequence: u64,
    pub sequences: SequenceImage,
    pub reorder: ReorderImage,
}

/// A request for a cut, answered by the ingress task.
pub(crate) type CutRequest = oneshot::Sender<Cut>;

/// What opens a deployment's snapshot buckets: at start, and again in the writer while
/// they could not be opened.
pub(crate) struct StoreOpener {
    pub(crate) js: jetstream::Context,
    pub(crate) subjects: Subjects,
    pub(crate) config: LeaseStreamConfig,
}

impl StoreOpener {
    pub(crate) async fn open(&self) -> Result<SnapshotStore, TaskError> {
        SnapshotStore::open(&self.js, &self.subjects, &self.config).await
    }
}

/// Writes a snapshot every `interval` while this replica is caught up and holds the
/// writer's entry; ends with `cancel`. A failed write is logged and counted; the next
/// interval tries again. Without `store` (the buckets could not be opened at start: a
/// cluster still placing them, say), each interval first tries to open them, each failure
/// counted as a failed write: one transient error at start must not leave a replica that
/// never writes a snapshot.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn write_snapshots(
    mut store: Option<SnapshotStore>,
    opener: StoreOpener,
    writer: String,
    deployment: String,
    stream_created: i64,
    interval: Duration,
    manager: WeakRequestLeaseManager,
    cuts: mpsc::Sender<CutRequest>,
    state: Arc<CatchUpState>,
    cancel: CancellationToken,
) -> Result<(), TaskError> {
    let mut tick = tokio::time::interval_at(Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let open_warn = LogRateLimiter::new(OPEN_WARN_INTERVAL);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let opened = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            opened = open_if_needed(&mut store, &opener, &state, &open_warn) => opened,
        };
        let Some(opened) = opened else {
            continue;
        };
        if !state.is_caught_up() {
            continue;
        }
        let started = Instant::now();
        let write = write_one(
            opened,
            &writer,
            &deployment,
            stream_created,
            &manager,
            &cuts,
        );
        let outcome = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            outcome = write => outcome,
        };
        match outcome {
            Ok(Some((sequence, bytes, leases))) => {
                state.snapshots.written.fetch_add(1, Ordering::Relaxed);
                state.snapshots.bytes.store(bytes as u64, Ordering::Relaxed);
                state.snapshots.sequence.store(sequence, Ordering::Relaxed);
                debug!(
                    sequence,
                    bytes,
                    leases,
                    seconds = started.elapsed().as_secs_f64(),
                    "snapshot written"
                );
            }
            Ok(None) => {}
            Err(Stop::Gone) => return Ok(()),
            Err(Stop::Failed(error)) => {
                state.snapshots.failed.fetch_add(1, Ordering::Relaxed);
                warn!(%error, "writing a snapshot failed; the next interval tries again");
            }
        }
    }
}

/// `store`, opened first if it is not yet; `None` (counted as a failed write, warned at
/// most every [`OPEN_WARN_INTERVAL`]) while the buckets cannot be opened.
async fn open_if_needed<'a>(
    store: &'a mut Option<SnapshotStore>,
    opener: &StoreOpener,
    state: &CatchUpState,
    open_warn: &LogRateLimiter,
) -> Option<&'a SnapshotStore> {
    if store.is_none() {
        match opener.open().await {
            Ok(opened) => {
                info!("the snapshot buckets are open: snapshots are written from now on");
                *store = Some(opened);
            }
            Err(error) => {
                state.snapshots.failed.fetch_add(1, Ordering::Relaxed);
                if let Some(suppressed) = open_warn.check() {
                    warn!(%error, suppressed, "the snapshot buckets are still not available; the next interval tries again");
                }
            }
        }
    }
    store.as_ref()
}

enum Stop {
    Gone,
    Failed(TaskError),
}

/// One snapshot: `None` when another replica is the writer.
async fn write_one(
    store: &SnapshotStore,
    writer: &str,
    deployment: &str,
    stream_created: i64,
    manager: &WeakRequestLeaseManager,
    cuts: &mpsc::Sender<CutRequest>,
) -> Result<Option<(u64, usize, usize)>, Stop> {
    if !store.acquire(writer).await.map_err(Stop::Failed)? {
        return Ok(None);
    }
    let (reply, cut) = oneshot::channel();
    cuts.send(reply).await.map_err(|_| Stop::Gone)?;
    let cut = cut.await.map_err(|_| Stop::Gone)?;
    let manager = manager.upgrade().ok_or(Stop::Gone)?;
    let (leases, prefix) =
        tokio::task::spawn_blocking(move || (manager.lease_images(), manager.prefix_image()))
            .await
            .map_err(|e| Stop::Failed(boxed(e)))?;
    let count = leases.len();
    let snapshot = Snapshot {
        header: Header {
            deployment: deployment.to_owned(),
            stream_sequence: cut.stream_sequence,
            stream_created,
            written_at_us: crate::wire::unix_micros_now(),
            leases: count as u64,
        },
        sequences: cut.sequences,
        leases,
        reorder: cut.reorder,
        prefix,
    };
    let bytes = store.put(snapshot).await.map_err(Stop::Failed)?;
    Ok(Some((cut.stream_sequence, bytes, count)))
}

/// Logs what became of a snapshot load.
pub(crate) fn log_fallback(error: &LoadSnapshotError) {
    warn!(%error, "the snapshot is not used: replaying the whole stream");
}

pub(crate) fn log_loaded(header: &Header) {
    info!(
        sequence = header.stream_sequence,
        leases = header.leases,
        "snapshot loaded: replaying the events after it"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            deployment: "d".into(),
            stream_sequence: 42,
            stream_created: 7,
            written_at_us: 1,
            leases: 0,
        }
    }

    /// Snapshots written before the tombstones and held progress were kept still load:
    /// a replica upgraded beside older ones is not sent back to a whole replay.
    #[test]
    fn a_snapshot_without_the_reorder_field_still_loads() {
        #[derive(serde::Serialize)]
        struct Before {
            header: Header,
            sequences: SequenceImage,
            leases: Vec<LeaseImage>,
        }
        let mut bytes = MAGIC.to_vec();
        let before = Before {
            header: header(),
            sequences: SequenceImage::default(),
            leases: Vec::new(),
        };
        rmp_serde::encode::write(&mut bytes, &before).unwrap();
        let loaded = decode(&bytes).expect("loads");
        assert_eq!(loaded.header.stream_sequence, 42);
        assert_eq!(loaded.reorder, ReorderImage::default());
        assert!(decode(&bytes[..bytes.len() - 1]).is_err(), "cut short");
    }
}

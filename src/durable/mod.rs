//! Durable mode on JetStream: lease events are kept in a stream, so a router replica that
//! starts (or restarts) late first replays what it missed and then follows live events.
//!
//! - [`stream`]: one stream per deployment, created or updated idempotently when the
//!   deployment is added, deleted only by [`delete_stream`].
//! - [`ingress`]: the durable ingress: loads the deployment's newest snapshot, then one
//!   ordered consumer replays the stream after it and keeps following it, so there is no
//!   seam between catch-up and live events; recreated from the last applied stream sequence
//!   when it is lost. It counts events the stream discarded before it read them.
//! - `catch_up`: how far the ingress has caught up ([`CatchUpState`]), with the figures of
//!   its stream and snapshots.
//! - `snapshot`: the deployment's state in a JetStream object store, written by one replica
//!   at a time (a KV entry with a TTL), so catch-up grows with the live state.

mod catch_up;
mod ingress;
mod snapshot;
mod stream;

pub use catch_up::{CatchUpState, SnapshotFigures, StreamFigures};
pub use ingress::{JetStreamIngress, StartDurableIngressError};
pub use snapshot::{snapshot_bucket, snapshot_lock_bucket};
pub use stream::{
    delete_stream, ensure_stream, legacy_stream_name, require_stream, stream_name,
    DeleteStreamError, EnsureStreamError, ForeignStream, LeaseStreamConfig, LegacyStream,
    LookupStreamError, RequireStreamError, DEFAULT_SNAPSHOT_INTERVAL, DEFAULT_SNAPSHOT_KEEP,
    DEFAULT_STREAM_MAX_BYTES, MIN_STREAM_MAX_AGE,
};

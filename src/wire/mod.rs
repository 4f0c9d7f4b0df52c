//! The wire contract for request-lease lifecycle events.
//!
//! Workers publish one small MessagePack message per step of a request's life; every router
//! replica of the deployment decodes it here. `schemas/README.md` is the language-neutral
//! description of the same contract, and `schemas/fixtures/` holds golden encodings that
//! `tests/wire_contract.rs` keeps in step with this module.
//!
//! # Layout
//!
//! One flat MessagePack **map with string keys**: the envelope fields and the event's own fields
//! side by side, the event named by a `kind` string. For example an `admitted` event:
//!
//! ```text
//! { "v": 1, "pub": 12345678901234567890, "seq": 1, "ts": 1700000000123456,
//!   "kind": "admitted", "rid": "req-7f3a", "wid": 3, "dp": 1, "ptok": 512, "etok": 128 }
//! ```
//!
//! | key | type | meaning |
//! | --- | --- | --- |
//! | `v` | u16 | schema major version, [`WIRE_VERSION`] |
//! | `pub` | u64 | publisher id, random per publisher process |
//! | `seq` | u64 | per-publisher sequence number, from 1 |
//! | `ts` | u64 | publish time, unix microseconds |
//! | `kind` | string | `admitted`, `progressed`, `completed`, `worker_reset`; 1.3: `kv_stored`, `kv_removed`, `kv_cleared` |
//! | `rid` | string | request id (not empty); `admitted`, `progressed`, `completed` |
//! | `wid` | u64 | worker id; every kind; must equal the worker named by the subject |
//! | `dp` | u32 | data-parallel rank; nil or absent in `worker_reset` and `kv_cleared` = every rank |
//! | `ptok` | u32 | `admitted`: prompt tokens |
//! | `etok` | u32 or nil | `admitted`: expected output tokens; nil or absent = unknown |
//! | `ctok` | u32 or nil | `admitted` (1.1, optional): prompt tokens already in the worker's prefix cache |
//! | `stage` | string | `progressed`: `prefill_done` or `decoding` |
//! | `otok` | u32 | `progressed`: output tokens produced so far |
//! | `outcome` | string | `completed`: `finished`, `cancelled` or `failed` |
//! | `leaving` | bool or nil | `worker_reset` (1.1, optional): true = the worker is leaving; absent = it (re)started |
//! | `blk` | array of u64, or nil | `admitted` (1.3, optional): the prompt's first block hashes, at most [`MAX_BLOCK_HASHES`] |
//! | `bcap` | u32 or nil | `admitted` (1.3, optional): blocks the worker rank's prefix cache holds at most |
//! | `cls` | string or nil | `admitted` (1.4, optional): the request's admission class; nil or absent = none (the deployment's default class) |
//! | `blk` | array of 1 to [`MAX_BLOCK_HASHES`] u64 | `kv_stored`, `kv_removed` (1.3): the blocks the engine stored or evicted, a stored chain in chain order |
//! | `par` | u64 or nil | `kv_stored` (1.3, optional): the hash of the block before `blk[0]`; nil or absent = `blk[0]` is a prompt's first block |
//!
//! # Compatibility
//!
//! - Integers of any MessagePack width (and signedness) decode as long as the value fits.
//! - Unknown keys are ignored, so a v1.x publisher may add fields. A key defined here must
//!   have its defined type in every kind (the names are reserved).
//! - An unknown `kind` is [`DecodeEventError::UnknownKind`].
//! - A `v` other than [`WIRE_VERSION`] is [`DecodeEventError::UnsupportedVersion`], detected
//!   even when the rest of the body does not parse as version 1.
//! - Duplicate keys, trailing bytes after the map, a `seq` of 0 or an empty `rid` are
//!   [`DecodeEventError::Malformed`].
//!
//! # Performance
//!
//! An event written the plain way (known keys, each once, scalar values of their types: what
//! every encoder of this contract writes) is read by a byte-level reader without serde, in one
//! pass and with the request id as its only allocation. Anything else goes to the full
//! decoder, which gives every answer the plain reader does not, errors included.
//!
//! The full decoder is one pass over the map with a hand-written visitor: keys are matched as borrowed
//! strings (no allocation), values go straight into typed slots, and the only allocation of a
//! successful decode is the request id. Serde's internally tagged enums (`#[serde(tag = ..)]`)
//! are deliberately not used: they buffer the whole map into an intermediate `Content` tree
//! (one allocation per key and string) before picking the variant. The error path may take a
//! second, lenient pass that only looks for `v` and `kind`, so that a newer version or an
//! unknown kind is reported as such.
//!
//! # Code
//!
//! This file holds the contract's types and its entry points ([`encode`], [`decode`],
//! [`decode_message`]). Below it, in the order they depend on one another:
//!
//! - `reader`: the one MessagePack byte reader (headers, scalars, skipping a whole value);
//! - `raw`: the fields a decoder has seen, and the checks that make them an [`Envelope`];
//! - `plain`: the event as every encoder writes it, read byte by byte over `reader`;
//! - `full`: every other event map, and every error, read through serde;
//! - `batch`: batches (wire 1.2), their structure walked over `reader`, their events read
//!   by [`decode`].

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::{self, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::load::RequestLoad;
use crate::types::{RequestId, WorkerWithDpRank};

mod batch;
mod full;
mod plain;
mod raw;
mod reader;
#[cfg(test)]
mod tests;

pub use batch::{
    encode_batch, BatchEvents, BatchWriter, BATCH_KIND, DEFAULT_MAX_BATCH_BYTES, EVENTS_KEY,
};

/// The schema major version this module writes and reads.
pub const WIRE_VERSION: u16 = 1;

/// Block hashes an `admitted` may carry (`blk`): the first 256 blocks of the prompt, 4,096
/// tokens at the default block size. An 8,192-token prompt's event stays about 2.4 KB, well
/// inside [`DEFAULT_MAX_EVENT_BYTES`]; more hashes are malformed.
pub const MAX_BLOCK_HASHES: usize = 256;

/// The default limit on the size of one encoded event.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 4096;

/// How deeply containers may nest inside an event (the envelope map itself counts as one);
/// only unknown fields can nest at all.
const MAX_NESTING_DEPTH: usize = 16;

/// The keys of the envelope map.
pub mod keys {
    /// Schema major version (u16).
    pub const VERSION: &str = "v";
    /// Publisher id (u64), random per publisher process.
    pub const PUBLISHER_ID: &str = "pub";
    /// Per-publisher sequence number (u64), from 1.
    pub const SEQUENCE: &str = "seq";
    /// Publish time (u64), unix microseconds.
    pub const PUBLISHED_AT_US: &str = "ts";
    /// Event kind (string).
    pub const KIND: &str = "kind";
    /// Request id (non-empty string).
    pub const REQUEST_ID: &str = "rid";
    /// Worker id (u64).
    pub const WORKER_ID: &str = "wid";
    /// Data-parallel rank (u32; nil allowed in `worker_reset` only).
    pub const DP_RANK: &str = "dp";
    /// Prompt tokens (u32), `admitted`.
    pub const PROMPT_TOKENS: &str = "ptok";
    /// Expected output tokens (u32 or nil), `admitted`.
    pub const EXPECTED_OUTPUT_TOKENS: &str = "etok";
    /// Progress stage (string), `progressed`.
    pub const STAGE: &str = "stage";
    /// Output tokens so far (u32), `progressed`.
    pub const OUTPUT_TOKENS: &str = "otok";
    /// How the request ended (string), `completed`.
    pub const OUTCOME: &str = "outcome";
    /// Prompt tokens already cached on the worker (u32 or nil), `admitted`; since 1.1.
    pub const CACHED_TOKENS: &str = "ctok";
    /// The worker is leaving (bool or nil), `worker_reset`; since 1.1.
    pub const LEAVING: &str = "leaving";
    /// The prompt's block hashes (array of u64, or nil), `admitted`; since 1.3.
    pub const BLOCK_HASHES: &str = "blk";
    /// Blocks the worker rank's prefix cache holds at most (u32 or nil), `admitted`; since 1.3.
    pub const BLOCK_CAPACITY: &str = "bcap";
    /// The hash of the block before the stored ones (u64 or nil), `kv_stored`; since 1.3.
    pub const PARENT_HASH: &str = "par";
    /// The request's admission class (string or nil), `admitted`; since 1.4.
    pub const CLASS: &str = "cls";

    /// Every key this version defines, in the order the encoder writes them.
    pub const ALL: [&str; 19] = [
        VERSION,
        PUBLISHER_ID,
        SEQUENCE,
        PUBLISHED_AT_US,
        KIND,
        REQUEST_ID,
        WORKER_ID,
        DP_RANK,
        PROMPT_TOKENS,
        EXPECTED_OUTPUT_TOKENS,
        CACHED_TOKENS,
        BLOCK_HASHES,
        BLOCK_CAPACITY,
        CLASS,
        PARENT_HASH,
        STAGE,
        OUTPUT_TOKENS,
        OUTCOME,
        LEAVING,
    ];
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

/// One published event with its publisher's stamp.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// Schema major version, [`WIRE_VERSION`] for everything [`decode`] returns.
    pub version: u16,
    /// Random per publisher process; a restarted publisher has a new one.
    pub publisher_id: u64,
    /// Per publisher id, from 1, one step per published event.
    pub sequence: u64,
    /// Publish time, unix microseconds.
    pub published_at_us: u64,
    /// The event itself.
    pub event: LeaseEvent,
}

impl Envelope {
    /// An envelope of the current [`WIRE_VERSION`].
    pub fn new(
        publisher_id: u64,
        sequence: u64,
        published_at_us: u64,
        event: impl Into<LeaseEvent>,
    ) -> Self {
        Self {
            version: WIRE_VERSION,
            publisher_id,
            sequence,
            published_at_us,
            event: event.into(),
        }
    }

    /// The kind of its event.
    pub fn kind(&self) -> EventKind {
        self.event.kind()
    }
}

/// A request-lease lifecycle event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseEvent {
    /// A worker accepted a request.
    Admitted(Admitted),
    /// A request moved on.
    Progressed(Progressed),
    /// A request ended.
    Completed(Completed),
    /// A worker restarted or left.
    WorkerReset(WorkerReset),
    /// A worker's engine stored prefix blocks in its KV cache (wire 1.3).
    KvStored(KvStored),
    /// A worker's engine evicted prefix blocks (wire 1.3).
    KvRemoved(KvRemoved),
    /// A worker's engine emptied its KV cache (wire 1.3).
    KvCleared(KvCleared),
}

impl LeaseEvent {
    /// Its kind, the `kind` on the wire.
    pub fn kind(&self) -> EventKind {
        match self {
            Self::Admitted(_) => EventKind::Admitted,
            Self::Progressed(_) => EventKind::Progressed,
            Self::Completed(_) => EventKind::Completed,
            Self::WorkerReset(_) => EventKind::WorkerReset,
            Self::KvStored(_) => EventKind::KvStored,
            Self::KvRemoved(_) => EventKind::KvRemoved,
            Self::KvCleared(_) => EventKind::KvCleared,
        }
    }

    /// The worker the body names; the ingress checks it against the subject's worker.
    pub fn worker_id(&self) -> u64 {
        match self {
            Self::Admitted(e) => e.worker_id,
            Self::Progressed(e) => e.worker_id,
            Self::Completed(e) => e.worker_id,
            Self::WorkerReset(e) => e.worker_id,
            Self::KvStored(e) => e.worker_id,
            Self::KvRemoved(e) => e.worker_id,
            Self::KvCleared(e) => e.worker_id,
        }
    }

    /// The rank the body names; `None` for a reset (or a clear) of every rank of a worker.
    pub fn dp_rank(&self) -> Option<u32> {
        match self {
            Self::Admitted(e) => Some(e.dp_rank),
            Self::Progressed(e) => Some(e.dp_rank),
            Self::Completed(e) => Some(e.dp_rank),
            Self::WorkerReset(e) => e.dp_rank,
            Self::KvStored(e) => Some(e.dp_rank),
            Self::KvRemoved(e) => Some(e.dp_rank),
            Self::KvCleared(e) => e.dp_rank,
        }
    }

    /// The request the event is about; `None` for a worker reset and the KV events.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            Self::Admitted(e) => Some(&e.request_id),
            Self::Progressed(e) => Some(&e.request_id),
            Self::Completed(e) => Some(&e.request_id),
            Self::WorkerReset(_) | Self::KvStored(_) | Self::KvRemoved(_) | Self::KvCleared(_) => {
                None
            }
        }
    }

    /// The worker and rank of a per-request event; `None` for a worker reset and the KV
    /// events.
    pub fn worker(&self) -> Option<WorkerWithDpRank> {
        match self {
            Self::Admitted(e) => Some(e.worker()),
            Self::Progressed(e) => Some(e.worker()),
            Self::Completed(e) => Some(e.worker()),
            Self::WorkerReset(_) | Self::KvStored(_) | Self::KvRemoved(_) | Self::KvCleared(_) => {
                None
            }
        }
    }
}

impl From<Admitted> for LeaseEvent {
    fn from(e: Admitted) -> Self {
        Self::Admitted(e)
    }
}

impl From<Progressed> for LeaseEvent {
    fn from(e: Progressed) -> Self {
        Self::Progressed(e)
    }
}

impl From<Completed> for LeaseEvent {
    fn from(e: Completed) -> Self {
        Self::Completed(e)
    }
}

impl From<WorkerReset> for LeaseEvent {
    fn from(e: WorkerReset) -> Self {
        Self::WorkerReset(e)
    }
}

impl From<KvStored> for LeaseEvent {
    fn from(e: KvStored) -> Self {
        Self::KvStored(e)
    }
}

impl From<KvRemoved> for LeaseEvent {
    fn from(e: KvRemoved) -> Self {
        Self::KvRemoved(e)
    }
}

impl From<KvCleared> for LeaseEvent {
    fn from(e: KvCleared) -> Self {
        Self::KvCleared(e)
    }
}

/// A worker accepted a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted {
    /// The request, never empty.
    pub request_id: String,
    /// The worker, as the subject names it.
    pub worker_id: u64,
    /// The data-parallel rank of the worker that holds the request.
    pub dp_rank: u32,
    /// Tokens of the prompt.
    pub prompt_tokens: u32,
    /// `None` when the worker does not know yet how long the answer will be.
    pub expected_output_tokens: Option<u32>,
    /// Prompt tokens the worker's prefix cache already held (wire 1.1, `ctok`): they need no
    /// prefill. `None` from publishers that do not say (counted as nothing cached).
    pub cached_tokens: Option<u32>,
    /// The prompt's block hashes in prompt order (wire 1.3, `blk`), the first
    /// [`MAX_BLOCK_HASHES`] at most: from then on the worker rank is taken to hold them.
    /// Empty from publishers that do not say.
    pub block_hashes: Vec<u64>,
    /// Blocks the worker rank's prefix cache holds at most (wire 1.3, `bcap`); `None`: the
    /// deployment's setting.
    pub block_capacity: Option<u32>,
    /// The request's admission class (wire 1.4, `cls`); `None` from publishers that do not
    /// say. Every replica counts the request under it, or under the deployment's default
    /// class when it has no such class (see [`AdmissionConfig`](crate::AdmissionConfig)).
    /// Any string decodes; one that is not a class name never matches a class.
    pub class: Option<String>,
}

impl Admitted {
    /// An admission with none of the optional fields (no cached tokens, blocks, capacity or
    /// class): what the publisher's shorthands start from.
    pub(crate) fn new(
        request_id: impl Into<String>,
        worker_id: u64,
        dp_rank: u32,
        prompt_tokens: u32,
        expected_output_tokens: Option<u32>,
    ) -> Self {
        Self {
            request_id: request_id.into(),
            worker_id,
            dp_rank,
            prompt_tokens,
            expected_output_tokens,
            cached_tokens: None,
            block_hashes: Vec::new(),
            block_capacity: None,
            class: None,
        }
    }

    /// The worker and rank that hold the request.
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }

    /// The load the request puts on its worker.
    pub fn load(&self) -> RequestLoad {
        RequestLoad::new(self.prompt_tokens, self.expected_output_tokens)
            .with_cached_tokens(self.cached_tokens.unwrap_or(0))
    }

    /// The request id, as the lease tables key it.
    pub fn to_request_id(&self) -> RequestId {
        RequestId::from(self.request_id.as_str())
    }
}

/// A request is alive and moving; renews its lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progressed {
    /// The request, never empty.
    pub request_id: String,
    /// The worker, as the subject names it.
    pub worker_id: u64,
    /// The data-parallel rank of the worker that holds the request.
    pub dp_rank: u32,
    /// How far the request has moved.
    pub stage: ProgressStage,
    /// Output tokens produced so far.
    pub output_tokens: u32,
}

impl Progressed {
    /// The worker and rank that hold the request.
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }

    /// The request id, as the lease tables key it.
    pub fn to_request_id(&self) -> RequestId {
        RequestId::from(self.request_id.as_str())
    }
}

/// A request ended; its lease and load are released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completed {
    /// The request, never empty.
    pub request_id: String,
    /// The worker, as the subject names it.
    pub worker_id: u64,
    /// The data-parallel rank of the worker that holds the request.
    pub dp_rank: u32,
    /// How it ended.
    pub outcome: Outcome,
}

impl Completed {
    /// The worker and rank that hold the request.
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }

    /// The request id, as the lease tables key it.
    pub fn to_request_id(&self) -> RequestId {
        RequestId::from(self.request_id.as_str())
    }
}

/// A worker restarted or left: drop all of its leases (of one rank, or of every rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerReset {
    /// The worker, as the subject names it.
    pub worker_id: u64,
    /// `None`: every rank of the worker.
    pub dp_rank: Option<u32>,
    /// The worker is going away (wire 1.1, `leaving`), rather than starting or restarting:
    /// routers stop choosing it until it publishes again. Absent on the wire means `false`.
    pub leaving: bool,
}

impl WorkerReset {
    /// The single rank reset, or `None` when every rank is.
    pub fn worker(&self) -> Option<WorkerWithDpRank> {
        self.dp_rank
            .map(|dp_rank| WorkerWithDpRank::new(self.worker_id, dp_rank))
    }

    /// Whether this reset drops the leases of `worker`.
    pub fn covers(&self, worker: WorkerWithDpRank) -> bool {
        worker.worker_id.0 == self.worker_id
            && self
                .dp_rank
                .is_none_or(|dp_rank| worker.dp_rank.0 == dp_rank)
    }
}

/// A worker's engine stored blocks in its KV cache (wire 1.3, `kv_stored`): from then on the
/// rank is exact, and holds them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvStored {
    /// The worker, as the subject names it.
    pub worker_id: u64,
    /// The data-parallel rank whose cache stored them.
    pub dp_rank: u32,
    /// Our hash ([`block_hashes`](crate::block_hashes)) of the block before `block_hashes[0]`;
    /// `None` when that is a prompt's first block. Routers do not need it (a hash names its
    /// whole prefix); it lets a reader rebuild the engine's tree.
    pub parent_hash: Option<u64>,
    /// Our hashes of the stored blocks, in chain order: 1 to [`MAX_BLOCK_HASHES`].
    pub block_hashes: Vec<u64>,
}

impl KvStored {
    /// The worker and rank whose cache stored them.
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }
}

/// A worker's engine evicted blocks from its KV cache (wire 1.3, `kv_removed`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvRemoved {
    /// The worker, as the subject names it.
    pub worker_id: u64,
    /// The data-parallel rank whose cache evicted them.
    pub dp_rank: u32,
    /// Our hashes of the evicted blocks: 1 to [`MAX_BLOCK_HASHES`].
    pub block_hashes: Vec<u64>,
}

impl KvRemoved {
    /// The worker and rank whose cache evicted them.
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }
}

/// A worker's engine emptied its KV cache, or its relay can no longer tell what it holds
/// (wire 1.3, `kv_cleared`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCleared {
    /// The worker, as the subject names it.
    pub worker_id: u64,
    /// `None`: every rank of the worker.
    pub dp_rank: Option<u32>,
}

// ---------------------------------------------------------------------------------------------
// Enums written as strings
// ---------------------------------------------------------------------------------------------

/// Gives an enum its wire strings, each written once, here: `ALL`, `as_str`, `from_wire`,
/// `Display`, `Serialize` and `Deserialize` all come from the one list (`$expecting` is what a
/// serde error says it expected).
macro_rules! wire_strings {
    ($ty:ident, $expecting:literal, { $($variant:ident => $wire:literal,)+ }) => {
        impl $ty {
            /// Every value, in the contract's order.
            pub const ALL: [Self; [$($wire),+].len()] = [$(Self::$variant),+];

            /// The wire strings of [`ALL`](Self::ALL), in the same order.
            const WIRE_NAMES: &'static [&'static str] = &[$($wire),+];

            /// The string that names this value on the wire.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $wire,)+
                }
            }

            /// The value a wire string names, if this version knows it.
            #[inline]
            pub fn from_wire(name: &str) -> Option<Self> {
                Self::from_wire_bytes(name.as_bytes())
            }

            /// The value whose wire string has the bytes `name` (not yet checked to be UTF-8:
            /// every wire string is ASCII).
            #[inline]
            fn from_wire_bytes(name: &[u8]) -> Option<Self> {
                Self::ALL
                    .into_iter()
                    .find(|value| value.as_str().as_bytes() == name)
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct WireVisitor;

                impl Visitor<'_> for WireVisitor {
                    type Value = $ty;

                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str($expecting)
                    }

                    fn visit_str<E: de::Error>(self, value: &str) -> Result<$ty, E> {
                        $ty::from_wire(value)
                            .ok_or_else(|| E::unknown_variant(value, $ty::WIRE_NAMES))
                    }
                }

                deserializer.deserialize_str(WireVisitor)
            }
        }
    };
}

/// What kind of event an envelope carries; `as_str` is its `kind` on the wire and its metrics
/// label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// An [`Admitted`] event.
    Admitted,
    /// A [`Progressed`] event.
    Progressed,
    /// A [`Completed`] event.
    Completed,
    /// A [`WorkerReset`] event.
    WorkerReset,
    /// A [`KvStored`] event.
    KvStored,
    /// A [`KvRemoved`] event.
    KvRemoved,
    /// A [`KvCleared`] event.
    KvCleared,
}

wire_strings!(EventKind, "an event kind string", {
    Admitted => "admitted",
    Progressed => "progressed",
    Completed => "completed",
    WorkerReset => "worker_reset",
    KvStored => "kv_stored",
    KvRemoved => "kv_removed",
    KvCleared => "kv_cleared",
});

/// How far a request has moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProgressStage {
    /// The prompt has been processed; decoding is about to start.
    PrefillDone,
    /// Output tokens are flowing.
    Decoding,
}

wire_strings!(ProgressStage, "a progress stage string", {
    PrefillDone => "prefill_done",
    Decoding => "decoding",
});

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// It ran to its end.
    Finished,
    /// It was cancelled before its end.
    Cancelled,
    /// It ended in an error.
    Failed,
}

wire_strings!(Outcome, "an outcome string", {
    Finished => "finished",
    Cancelled => "cancelled",
    Failed => "failed",
});

// ---------------------------------------------------------------------------------------------
// Publishing helpers
// ---------------------------------------------------------------------------------------------

/// The current time in unix microseconds (0 if the clock is before 1970).
pub fn unix_micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Stamps the events of one publisher process: one publisher id, sequence numbers from 1.
#[derive(Debug)]
pub struct EnvelopeStamper {
    publisher_id: u64,
    next_sequence: AtomicU64,
}

impl EnvelopeStamper {
    /// A stamper with a random publisher id, as every publisher process should have.
    pub fn new_random() -> Self {
        Self::with_publisher_id(rand::random())
    }

    /// A stamper with the given publisher id (tests, replays).
    pub fn with_publisher_id(publisher_id: u64) -> Self {
        Self {
            publisher_id,
            next_sequence: AtomicU64::new(1),
        }
    }

    /// The publisher id it stamps.
    pub fn publisher_id(&self) -> u64 {
        self.publisher_id
    }

    /// The envelope for the next event of this publisher, stamped now.
    pub fn stamp(&self, event: impl Into<LeaseEvent>) -> Envelope {
        let sequence = self.next_sequence.fetch_add(1, Ordering::Relaxed);
        Envelope::new(self.publisher_id, sequence, unix_micros_now(), event)
    }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why received bytes are not an event this router can apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeEventError {
    /// Longer than the limit it was read with, so not read at all.
    #[error("event of {len} bytes is larger than the limit of {max} bytes")]
    Oversized {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not MessagePack, truncated, not a map, a wrong type, a missing or duplicate field.
    #[error("malformed event: {0}")]
    Malformed(String),
    /// A `v` other than the one this router reads (a newer major, or 0).
    #[error("unsupported wire version {found} (this router reads version {supported})")]
    UnsupportedVersion {
        /// The `v` the message carries.
        found: u16,
        /// The version this router reads, [`WIRE_VERSION`].
        supported: u16,
    },
    /// A `kind` this version does not know (a newer kind, or a batch on a router before 1.2).
    #[error("unknown event kind {kind:?}")]
    UnknownKind {
        /// The kind, cut to 64 bytes for the logs.
        kind: String,
    },
}

impl DecodeEventError {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Oversized { .. } => "oversized",
            Self::Malformed(_) => "decode",
            Self::UnsupportedVersion { .. } => "version",
            Self::UnknownKind { .. } => "unknown_kind",
        }
    }
}

/// Why an envelope cannot be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeEventError {
    /// A per-request event without a request id.
    #[error("cannot encode a {kind} event with an empty request id")]
    EmptyRequestId {
        /// The kind of the event.
        kind: EventKind,
    },
    /// Sequence 0, which no router accepts.
    #[error("cannot encode an event with sequence 0: sequences start at 1")]
    ZeroSequence,
    /// The serializer failed.
    #[error("cannot encode event: {0}")]
    Serialize(String),
    /// [`encode_batch`] of no events.
    #[error("cannot encode a batch of no events")]
    EmptyBatch,
    /// A `kv_stored` or `kv_removed` of no blocks, or of more than [`MAX_BLOCK_HASHES`]
    /// (split them).
    #[error("cannot encode a {kind} event of {blocks} block hashes (1 to {MAX_BLOCK_HASHES})")]
    BlockCount {
        /// The kind of the event.
        kind: EventKind,
        /// How many hashes it holds.
        blocks: usize,
    },
}

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

/// Appends the MessagePack encoding of `envelope` to `out`; on error `out` is left as it was.
///
/// Integers are written in their smallest width and absent optional fields are left out, so the
/// encoding of an envelope is canonical (the golden fixtures rely on it).
pub fn encode_into(envelope: &Envelope, out: &mut Vec<u8>) -> Result<(), EncodeEventError> {
    if envelope.sequence == 0 {
        return Err(EncodeEventError::ZeroSequence);
    }
    if envelope.event.request_id() == Some("") {
        return Err(EncodeEventError::EmptyRequestId {
            kind: envelope.kind(),
        });
    }
    if let LeaseEvent::KvStored(KvStored { block_hashes, .. })
    | LeaseEvent::KvRemoved(KvRemoved { block_hashes, .. }) = &envelope.event
    {
        let blocks = block_hashes.len();
        if blocks == 0 || blocks > MAX_BLOCK_HASHES {
            return Err(EncodeEventError::BlockCount {
                kind: envelope.kind(),
                blocks,
            });
        }
    }
    let start = out.len();
    let result = envelope.serialize(&mut rmp_serde::Serializer::new(&mut *out));
    result.map_err(|err| {
        out.truncate(start);
        EncodeEventError::Serialize(err.to_string())
    })
}

/// The MessagePack encoding of `envelope`.
pub fn encode(envelope: &Envelope) -> Result<Vec<u8>, EncodeEventError> {
    let mut out = Vec::with_capacity(96);
    encode_into(envelope, &mut out)?;
    Ok(out)
}

/// The envelope as one flat map; the same keys in JSON (`serde_json`) and in MessagePack.
impl Serialize for Envelope {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let event_fields = match &self.event {
            LeaseEvent::Admitted(e) => {
                4 + usize::from(e.expected_output_tokens.is_some())
                    + usize::from(e.cached_tokens.is_some())
                    + usize::from(!e.block_hashes.is_empty())
                    + usize::from(e.block_capacity.is_some())
                    + usize::from(e.class.is_some())
            }
            LeaseEvent::Progressed(_) => 5,
            LeaseEvent::Completed(_) => 4,
            LeaseEvent::WorkerReset(e) => {
                1 + usize::from(e.dp_rank.is_some()) + usize::from(e.leaving)
            }
            LeaseEvent::KvStored(e) => 3 + usize::from(e.parent_hash.is_some()),
            LeaseEvent::KvRemoved(_) => 3,
            LeaseEvent::KvCleared(e) => 1 + usize::from(e.dp_rank.is_some()),
        };
        let mut map = serializer.serialize_map(Some(5 + event_fields))?;
        map.serialize_entry(keys::VERSION, &self.version)?;
        map.serialize_entry(keys::PUBLISHER_ID, &self.publisher_id)?;
        map.serialize_entry(keys::SEQUENCE, &self.sequence)?;
        map.serialize_entry(keys::PUBLISHED_AT_US, &self.published_at_us)?;
        map.serialize_entry(keys::KIND, self.kind().as_str())?;
        match &self.event {
            LeaseEvent::Admitted(e) => {
                map.serialize_entry(keys::REQUEST_ID, &e.request_id)?;
                map.serialize_entry(keys::WORKER_ID, &e.worker_id)?;
                map.serialize_entry(keys::DP_RANK, &e.dp_rank)?;
                map.serialize_entry(keys::PROMPT_TOKENS, &e.prompt_tokens)?;
                if let Some(expected) = &e.expected_output_tokens {
                    map.serialize_entry(keys::EXPECTED_OUTPUT_TOKENS, expected)?;
                }
                if let Some(cached) = &e.cached_tokens {
                    map.serialize_entry(keys::CACHED_TOKENS, cached)?;
                }
                if !e.block_hashes.is_empty() {
                    map.serialize_entry(keys::BLOCK_HASHES, &e.block_hashes)?;
                }
                if let Some(capacity) = &e.block_capacity {
                    map.serialize_entry(keys::BLOCK_CAPACITY, capacity)?;
                }
                if let Some(class) = &e.class {
                    map.serialize_entry(keys::CLASS, class)?;
                }
            }
            LeaseEvent::Progressed(e) => {
                map.serialize_entry(keys::REQUEST_ID, &e.request_id)?;
                map.serialize_entry(keys::WORKER_ID, &e.worker_id)?;
                map.serialize_entry(keys::DP_RANK, &e.dp_rank)?;
                map.serialize_entry(keys::STAGE, e.stage.as_str())?;
                map.serialize_entry(keys::OUTPUT_TOKENS, &e.output_tokens)?;
            }
            LeaseEvent::Completed(e) => {
                map.serialize_entry(keys::REQUEST_ID, &e.request_id)?;
                map.serialize_entry(keys::WORKER_ID, &e.worker_id)?;
                map.serialize_entry(keys::DP_RANK, &e.dp_rank)?;
                map.serialize_entry(keys::OUTCOME, e.outcome.as_str())?;
            }
            LeaseEvent::WorkerReset(e) => {
                map.serialize_entry(keys::WORKER_ID, &e.worker_id)?;
                if let Some(dp_rank) = &e.dp_rank {
                    map.serialize_entry(keys::DP_RANK, dp_rank)?;
                }
                if e.leaving {
                    map.serialize_entry(keys::LEAVING, &true)?;
                }
            }
            LeaseEvent::KvStored(e) => {
                map.serialize_entry(keys::WORKER_ID, &e.worker_id)?;
                map.serialize_entry(keys::DP_RANK, &e.dp_rank)?;
                map.serialize_entry(keys::BLOCK_HASHES, &e.block_hashes)?;
                if let Some(parent) = &e.parent_hash {
                    map.serialize_entry(keys::PARENT_HASH, parent)?;
                }
            }
            LeaseEvent::KvRemoved(e) => {
                map.serialize_entry(keys::WORKER_ID, &e.worker_id)?;
                map.serialize_entry(keys::DP_RANK, &e.dp_rank)?;
                map.serialize_entry(keys::BLOCK_HASHES, &e.block_hashes)?;
            }
            LeaseEvent::KvCleared(e) => {
                map.serialize_entry(keys::WORKER_ID, &e.worker_id)?;
                if let Some(dp_rank) = &e.dp_rank {
                    map.serialize_entry(keys::DP_RANK, dp_rank)?;
                }
            }
        }
        map.end()
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

/// Decodes one event, refusing anything longer than `max_len` bytes before looking at it.
///
/// Never panics; every failure is a [`DecodeEventError`]. The checks come in this order: size,
/// version (even if the rest does not parse), structure, kind, then the kind's fields.
pub fn decode(bytes: &[u8], max_len: usize) -> Result<Envelope, DecodeEventError> {
    if bytes.len() > max_len {
        return Err(DecodeEventError::Oversized {
            len: bytes.len(),
            max: max_len,
        });
    }
    match plain::read(bytes) {
        Some((raw, end)) if end == bytes.len() => raw.validate(false),
        _ => full::decode_full(bytes, max_len),
    }
}

/// The limits a router reads messages with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessageLimits {
    /// A single event, and each event inside a batch, at most this long.
    pub max_event_bytes: usize,
    /// A batch message at most this long.
    pub max_batch_bytes: usize,
}

impl Default for MessageLimits {
    fn default() -> Self {
        Self {
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
        }
    }
}

/// What one received message holds.
#[derive(Debug)]
pub enum Message<'a> {
    /// A message of one event, or the reason it is not one.
    Event(Result<Envelope, DecodeEventError>),
    /// A batch whose structure was read to its end: its events, each decoded on its own.
    Batch(BatchEvents<'a>),
    /// A batch that cannot be read as a whole: each of the `events` it declares (at least
    /// one, at most one per byte of the message) is dropped for `error`.
    Refused {
        /// How many events the batch declares, as far as that can be read.
        events: usize,
        /// Why the batch cannot be read.
        error: DecodeEventError,
    },
}

/// Reads one received message: a single event or a batch.
///
/// Never panics. A single event costs what [`decode`] costs: a batch is recognised by its
/// canonical first bytes, or, in another key order, only once the message failed to decode
/// as one event.
pub fn decode_message(bytes: &[u8], limits: MessageLimits) -> Message<'_> {
    let max = limits.max_event_bytes.max(limits.max_batch_bytes);
    if bytes.len() > max {
        return Message::Event(Err(DecodeEventError::Oversized {
            len: bytes.len(),
            max,
        }));
    }
    if batch::starts_canonically(bytes) {
        return batch::read_batch(bytes, limits);
    }
    if bytes.len() > limits.max_event_bytes {
        if batch::is_batch(bytes) {
            return batch::read_batch(bytes, limits);
        }
        return Message::Event(Err(DecodeEventError::Oversized {
            len: bytes.len(),
            max: limits.max_event_bytes,
        }));
    }
    match decode(bytes, limits.max_event_bytes) {
        Ok(envelope) => Message::Event(Ok(envelope)),
        Err(_) if batch::is_batch(bytes) => batch::read_batch(bytes, limits),
        Err(error) => Message::Event(Err(error)),
    }
}

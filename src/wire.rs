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
//! | `kind` | string | `admitted`, `progressed`, `completed` or `worker_reset` |
//! | `rid` | string | request id (not empty); every kind but `worker_reset` |
//! | `wid` | u64 | worker id; every kind; must equal the worker named by the subject |
//! | `dp` | u32 | data-parallel rank; nil or absent in `worker_reset` = every rank |
//! | `ptok` | u32 | `admitted`: prompt tokens |
//! | `etok` | u32 or nil | `admitted`: expected output tokens; nil or absent = unknown |
//! | `ctok` | u32 or nil | `admitted` (1.1, optional): prompt tokens already in the worker's prefix cache |
//! | `stage` | string | `progressed`: `prefill_done` or `decoding` |
//! | `otok` | u32 | `progressed`: output tokens produced so far |
//! | `outcome` | string | `completed`: `finished`, `cancelled` or `failed` |
//! | `leaving` | bool or nil | `worker_reset` (1.1, optional): true = the worker is leaving; absent = it (re)started |
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
//! decoder below, which gives every answer the plain reader does not, errors included.
//!
//! The full decoder is one pass over the map with a hand-written visitor: keys are matched as borrowed
//! strings (no allocation), values go straight into typed slots, and the only allocation of a
//! successful decode is the request id. Serde's internally tagged enums (`#[serde(tag = ..)]`)
//! are deliberately not used: they buffer the whole map into an intermediate `Content` tree
//! (one allocation per key and string) before picking the variant. The error path may take a
//! second, lenient pass that only looks for `v` and `kind`, so that a newer version or an
//! unknown kind is reported as such.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::types::{RequestId, RequestLoad, WorkerWithDpRank};

mod batch;
mod plain;
pub use batch::{
    decode_message, encode_batch, BatchEvents, BatchWriter, Message, MessageLimits, BATCH_KIND,
    DEFAULT_MAX_BATCH_BYTES, EVENTS_KEY,
};

/// The schema major version this module writes and reads.
pub const WIRE_VERSION: u16 = 1;

/// The default limit on the size of one encoded event.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 4096;

/// How deeply containers may nest inside an event (the envelope map itself counts as one);
/// only unknown fields can nest at all.
const MAX_NESTING_DEPTH: usize = 16;

/// An unknown `kind` longer than this is cut in the error, which ends up in logs.
const MAX_REPORTED_KIND_BYTES: usize = 64;

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

    /// Every key this version defines, in the order the encoder writes them.
    pub const ALL: [&str; 15] = [
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

    pub fn kind(&self) -> EventKind {
        self.event.kind()
    }
}

/// A request-lease lifecycle event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseEvent {
    Admitted(Admitted),
    Progressed(Progressed),
    Completed(Completed),
    WorkerReset(WorkerReset),
}

impl LeaseEvent {
    pub fn kind(&self) -> EventKind {
        match self {
            Self::Admitted(_) => EventKind::Admitted,
            Self::Progressed(_) => EventKind::Progressed,
            Self::Completed(_) => EventKind::Completed,
            Self::WorkerReset(_) => EventKind::WorkerReset,
        }
    }

    /// The worker the body names; the ingress checks it against the subject's worker.
    pub fn worker_id(&self) -> u64 {
        match self {
            Self::Admitted(e) => e.worker_id,
            Self::Progressed(e) => e.worker_id,
            Self::Completed(e) => e.worker_id,
            Self::WorkerReset(e) => e.worker_id,
        }
    }

    /// The rank the body names; `None` for a reset of every rank of a worker.
    pub fn dp_rank(&self) -> Option<u32> {
        match self {
            Self::Admitted(e) => Some(e.dp_rank),
            Self::Progressed(e) => Some(e.dp_rank),
            Self::Completed(e) => Some(e.dp_rank),
            Self::WorkerReset(e) => e.dp_rank,
        }
    }

    /// The request the event is about; `None` for a worker reset.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            Self::Admitted(e) => Some(&e.request_id),
            Self::Progressed(e) => Some(&e.request_id),
            Self::Completed(e) => Some(&e.request_id),
            Self::WorkerReset(_) => None,
        }
    }

    /// The worker and rank of a per-request event; `None` for a worker reset.
    pub fn worker(&self) -> Option<WorkerWithDpRank> {
        match self {
            Self::Admitted(e) => Some(e.worker()),
            Self::Progressed(e) => Some(e.worker()),
            Self::Completed(e) => Some(e.worker()),
            Self::WorkerReset(_) => None,
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

/// A worker accepted a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub request_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub prompt_tokens: u32,
    /// `None` when the worker does not know yet how long the answer will be.
    pub expected_output_tokens: Option<u32>,
    /// Prompt tokens the worker's prefix cache already held (wire 1.1, `ctok`): they need no
    /// prefill. `None` from publishers that do not say (counted as nothing cached).
    pub cached_tokens: Option<u32>,
}

impl Admitted {
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }

    pub fn load(&self) -> RequestLoad {
        RequestLoad::new(self.prompt_tokens, self.expected_output_tokens)
            .with_cached_tokens(self.cached_tokens.unwrap_or(0))
    }

    pub fn to_request_id(&self) -> RequestId {
        RequestId::from(self.request_id.as_str())
    }
}

/// A request is alive and moving; renews its lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progressed {
    pub request_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub stage: ProgressStage,
    /// Output tokens produced so far.
    pub output_tokens: u32,
}

impl Progressed {
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }

    pub fn to_request_id(&self) -> RequestId {
        RequestId::from(self.request_id.as_str())
    }
}

/// A request ended; its lease and load are released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completed {
    pub request_id: String,
    pub worker_id: u64,
    pub dp_rank: u32,
    pub outcome: Outcome,
}

impl Completed {
    pub fn worker(&self) -> WorkerWithDpRank {
        WorkerWithDpRank::new(self.worker_id, self.dp_rank)
    }

    pub fn to_request_id(&self) -> RequestId {
        RequestId::from(self.request_id.as_str())
    }
}

/// A worker restarted or left: drop all of its leases (of one rank, or of every rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerReset {
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

/// What kind of event an envelope carries; `as_str` is its `kind` on the wire and its metrics
/// label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    Admitted,
    Progressed,
    Completed,
    WorkerReset,
}

impl EventKind {
    pub const ALL: [EventKind; 4] = [
        Self::Admitted,
        Self::Progressed,
        Self::Completed,
        Self::WorkerReset,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Progressed => "progressed",
            Self::Completed => "completed",
            Self::WorkerReset => "worker_reset",
        }
    }

    /// The kind a wire `kind` string names, if this version knows it.
    pub fn from_wire(kind: &str) -> Option<Self> {
        match kind {
            "admitted" => Some(Self::Admitted),
            "progressed" => Some(Self::Progressed),
            "completed" => Some(Self::Completed),
            "worker_reset" => Some(Self::WorkerReset),
            _ => None,
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How far a request has moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProgressStage {
    /// The prompt has been processed; decoding is about to start.
    PrefillDone,
    /// Output tokens are flowing.
    Decoding,
}

impl ProgressStage {
    pub const ALL: [ProgressStage; 2] = [Self::PrefillDone, Self::Decoding];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PrefillDone => "prefill_done",
            Self::Decoding => "decoding",
        }
    }

    pub fn from_wire(stage: &str) -> Option<Self> {
        match stage {
            "prefill_done" => Some(Self::PrefillDone),
            "decoding" => Some(Self::Decoding),
            _ => None,
        }
    }
}

impl fmt::Display for ProgressStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Finished,
    Cancelled,
    Failed,
}

impl Outcome {
    pub const ALL: [Outcome; 3] = [Self::Finished, Self::Cancelled, Self::Failed];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Finished => "finished",
            Self::Cancelled => "cancelled",
            Self::Failed => "failed",
        }
    }

    pub fn from_wire(outcome: &str) -> Option<Self> {
        match outcome {
            "finished" => Some(Self::Finished),
            "cancelled" => Some(Self::Cancelled),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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

    pub fn with_publisher_id(publisher_id: u64) -> Self {
        Self {
            publisher_id,
            next_sequence: AtomicU64::new(1),
        }
    }

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
    #[error("event of {len} bytes is larger than the limit of {max} bytes")]
    Oversized { len: usize, max: usize },
    /// Not MessagePack, truncated, not a map, a wrong type, a missing or duplicate field.
    #[error("malformed event: {0}")]
    Malformed(String),
    /// A `v` other than the one this router reads (a newer major, or 0).
    #[error("unsupported wire version {found} (this router reads version {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("unknown event kind {kind:?}")]
    UnknownKind { kind: String },
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
    #[error("cannot encode a {kind} event with an empty request id")]
    EmptyRequestId { kind: EventKind },
    #[error("cannot encode an event with sequence 0: sequences start at 1")]
    ZeroSequence,
    #[error("cannot encode event: {0}")]
    Serialize(String),
    #[error("cannot encode a batch of no events")]
    EmptyBatch,
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
            }
            LeaseEvent::Progressed(_) => 5,
            LeaseEvent::Completed(_) => 4,
            LeaseEvent::WorkerReset(e) => {
                1 + usize::from(e.dp_rank.is_some()) + usize::from(e.leaving)
            }
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
        }
        map.end()
    }
}

impl Serialize for ProgressStage {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl Serialize for Outcome {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl Serialize for EventKind {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
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
        _ => decode_full(bytes, max_len),
    }
}

/// [`decode`] through serde alone: every input the plain reader leaves, and every error.
fn decode_full(bytes: &[u8], max_len: usize) -> Result<Envelope, DecodeEventError> {
    if bytes.len() > max_len {
        return Err(DecodeEventError::Oversized {
            len: bytes.len(),
            max: max_len,
        });
    }
    let mut raw = RawEnvelope::default();
    let mut last_key_end = None;
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_NESTING_DEPTH);
    let seed = RawSeed {
        raw: &mut raw,
        probe: false,
        last_key_end: &mut last_key_end,
    };
    match seed.deserialize(&mut de) {
        Ok(()) => {
            // The borrowing reader cannot say where it stopped: measure where the map ends,
            // so that any byte after it, complete value or not, is refused.
            let trailing = map_end(bytes, last_key_end) != Some(bytes.len());
            raw.validate(trailing)
        }
        Err(err) => Err(classify_failure(bytes, &err)),
    }
}

/// Where the map that starts `bytes` ends, once it has been read: right after its last value,
/// which starts where its last key ends. Only that value is measured; without the last key's
/// position (an empty map, or a key not borrowed from `bytes`) the whole map is.
fn map_end(bytes: &[u8], last_key_end: Option<usize>) -> Option<usize> {
    let last_value = last_key_end
        .map(|end| end.wrapping_sub(bytes.as_ptr() as usize))
        .filter(|&start| start <= bytes.len());
    match last_value {
        Some(start) => Some(start + value_len(&bytes[start..], MAX_NESTING_DEPTH - 1)?),
        None => value_len(bytes, MAX_NESTING_DEPTH),
    }
}

/// The length in bytes of the one MessagePack value that starts `bytes`, or `None` if it is
/// cut short, malformed or nested deeper than `depth`.
fn value_len(bytes: &[u8], depth: usize) -> Option<usize> {
    use rmp::Marker;
    let big_endian = |n: usize| -> Option<usize> {
        let field = bytes.get(1..1 + n)?;
        Some(
            field
                .iter()
                .fold(0usize, |acc, b| (acc << 8) | usize::from(*b)),
        )
    };
    // (header bytes, payload bytes, nested values)
    let (header, payload, nested) = match Marker::from_u8(*bytes.first()?) {
        Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
            (1, 0, 0)
        }
        Marker::U8 | Marker::I8 => (1, 1, 0),
        Marker::U16 | Marker::I16 => (1, 2, 0),
        Marker::U32 | Marker::I32 | Marker::F32 => (1, 4, 0),
        Marker::U64 | Marker::I64 | Marker::F64 => (1, 8, 0),
        Marker::FixStr(n) => (1, usize::from(n), 0),
        Marker::Str8 | Marker::Bin8 => (2, big_endian(1)?, 0),
        Marker::Str16 | Marker::Bin16 => (3, big_endian(2)?, 0),
        Marker::Str32 | Marker::Bin32 => (5, big_endian(4)?, 0),
        Marker::FixArray(n) => (1, 0, usize::from(n)),
        Marker::Array16 => (3, 0, big_endian(2)?),
        Marker::Array32 => (5, 0, big_endian(4)?),
        Marker::FixMap(n) => (1, 0, 2 * usize::from(n)),
        Marker::Map16 => (3, 0, 2 * big_endian(2)?),
        Marker::Map32 => (5, 0, 2 * big_endian(4)?),
        Marker::FixExt1 => (2, 1, 0),
        Marker::FixExt2 => (2, 2, 0),
        Marker::FixExt4 => (2, 4, 0),
        Marker::FixExt8 => (2, 8, 0),
        Marker::FixExt16 => (2, 16, 0),
        Marker::Ext8 => (3, big_endian(1)?, 0),
        Marker::Ext16 => (4, big_endian(2)?, 0),
        Marker::Ext32 => (6, big_endian(4)?, 0),
        Marker::Reserved => return None,
    };
    let mut len = header + payload;
    if len > bytes.len() {
        return None;
    }
    if nested > 0 {
        let depth = depth.checked_sub(1)?;
        for _ in 0..nested {
            len += value_len(bytes.get(len..)?, depth)?;
        }
    }
    Some(len)
}

/// The decoder failed; a second, lenient pass that reads only `v` and `kind` tells whether a
/// newer version or an unknown kind is the better answer than "malformed".
#[cold]
fn classify_failure(bytes: &[u8], err: &rmp_serde::decode::Error) -> DecodeEventError {
    let mut probe = RawEnvelope::default();
    let mut de = rmp_serde::Deserializer::new(bytes);
    de.set_max_depth(MAX_NESTING_DEPTH);
    let probed = RawSeed {
        raw: &mut probe,
        probe: true,
        last_key_end: &mut None,
    }
    .deserialize(&mut de)
    .is_ok();
    match (probe.version, probe.kind) {
        (Some(found), _) if found != WIRE_VERSION => DecodeEventError::UnsupportedVersion {
            found,
            supported: WIRE_VERSION,
        },
        (Some(_), Some(WireKind::Unknown(kind))) if probed && de.get_ref().is_empty() => {
            DecodeEventError::UnknownKind { kind }
        }
        _ => DecodeEventError::Malformed(err.to_string()),
    }
}

/// Whatever the decoder has seen of an envelope, before validation.
#[derive(Default)]
struct RawEnvelope {
    version: Option<u16>,
    publisher_id: Option<u64>,
    sequence: Option<u64>,
    published_at_us: Option<u64>,
    kind: Option<WireKind>,
    request_id: Option<String>,
    worker_id: Option<u64>,
    /// `Some(None)`: present as nil.
    dp_rank: Option<Option<u32>>,
    prompt_tokens: Option<u32>,
    expected_output_tokens: Option<Option<u32>>,
    stage: Option<ProgressStage>,
    output_tokens: Option<u32>,
    outcome: Option<Outcome>,
    cached_tokens: Option<Option<u32>>,
    leaving: Option<Option<bool>>,
}

fn missing(key: &str, kind: Option<EventKind>) -> DecodeEventError {
    DecodeEventError::Malformed(match kind {
        Some(kind) => format!("missing field `{key}` (required in a `{kind}` event)"),
        None => format!("missing field `{key}`"),
    })
}

fn required<T>(slot: Option<T>, key: &str, kind: Option<EventKind>) -> Result<T, DecodeEventError> {
    slot.ok_or_else(|| missing(key, kind))
}

impl RawEnvelope {
    fn validate(self, trailing_bytes: bool) -> Result<Envelope, DecodeEventError> {
        let version = required(self.version, keys::VERSION, None)?;
        if version != WIRE_VERSION {
            return Err(DecodeEventError::UnsupportedVersion {
                found: version,
                supported: WIRE_VERSION,
            });
        }
        if trailing_bytes {
            return Err(DecodeEventError::Malformed(
                "trailing bytes after the event map".to_owned(),
            ));
        }
        let kind = match self.kind {
            None => return Err(missing(keys::KIND, None)),
            Some(WireKind::Unknown(kind)) => return Err(DecodeEventError::UnknownKind { kind }),
            Some(WireKind::Known(kind)) => kind,
        };
        let publisher_id = required(self.publisher_id, keys::PUBLISHER_ID, None)?;
        let sequence = required(self.sequence, keys::SEQUENCE, None)?;
        if sequence == 0 {
            return Err(DecodeEventError::Malformed(
                "field `seq` is 0: sequences start at 1".to_owned(),
            ));
        }
        let published_at_us = required(self.published_at_us, keys::PUBLISHED_AT_US, None)?;
        let k = Some(kind);
        let worker_id = required(self.worker_id, keys::WORKER_ID, k)?;
        let event = if kind == EventKind::WorkerReset {
            LeaseEvent::WorkerReset(WorkerReset {
                worker_id,
                dp_rank: self.dp_rank.flatten(),
                leaving: self.leaving.flatten().unwrap_or(false),
            })
        } else {
            let request_id = required(self.request_id, keys::REQUEST_ID, k)?;
            if request_id.is_empty() {
                return Err(DecodeEventError::Malformed(
                    "field `rid` is empty".to_owned(),
                ));
            }
            let dp_rank = match self.dp_rank {
                Some(Some(dp_rank)) => dp_rank,
                Some(None) => {
                    return Err(DecodeEventError::Malformed(format!(
                        "field `dp` is nil (a rank is required in a `{kind}` event)"
                    )))
                }
                None => return Err(missing(keys::DP_RANK, k)),
            };
            match kind {
                EventKind::Admitted => LeaseEvent::Admitted(Admitted {
                    request_id,
                    worker_id,
                    dp_rank,
                    prompt_tokens: required(self.prompt_tokens, keys::PROMPT_TOKENS, k)?,
                    expected_output_tokens: self.expected_output_tokens.flatten(),
                    cached_tokens: self.cached_tokens.flatten(),
                }),
                EventKind::Progressed => LeaseEvent::Progressed(Progressed {
                    request_id,
                    worker_id,
                    dp_rank,
                    stage: required(self.stage, keys::STAGE, k)?,
                    output_tokens: required(self.output_tokens, keys::OUTPUT_TOKENS, k)?,
                }),
                EventKind::Completed | EventKind::WorkerReset => LeaseEvent::Completed(Completed {
                    request_id,
                    worker_id,
                    dp_rank,
                    outcome: required(self.outcome, keys::OUTCOME, k)?,
                }),
            }
        };
        Ok(Envelope {
            version,
            publisher_id,
            sequence,
            published_at_us,
            event,
        })
    }
}

/// The keys the decoder knows; anything else is skipped.
enum Key {
    Version,
    PublisherId,
    Sequence,
    PublishedAtUs,
    Kind,
    RequestId,
    WorkerId,
    DpRank,
    PromptTokens,
    ExpectedOutputTokens,
    Stage,
    OutputTokens,
    Outcome,
    CachedTokens,
    Leaving,
    Unknown,
}

/// Reads a map key, noting where it ends in the input when the key is borrowed from it: the
/// last key's end is where the map's last value starts, which is all [`decode`] measures
/// to find the end of the map.
struct KeySeed<'a> {
    end: &'a mut Option<usize>,
}

impl<'de> DeserializeSeed<'de> for KeySeed<'_> {
    type Value = Key;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Key, D::Error> {
        deserializer.deserialize_identifier(self)
    }
}

impl<'de> Visitor<'de> for KeySeed<'_> {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string map key")
    }

    fn visit_borrowed_str<E: de::Error>(self, key: &'de str) -> Result<Key, E> {
        *self.end = Some(key.as_bytes().as_ptr_range().end as usize);
        Ok(Key::from_str(key))
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Key, E> {
        // Not borrowed from the input: its position is unknown.
        *self.end = None;
        Ok(Key::from_str(key))
    }
}

impl Key {
    fn from_str(key: &str) -> Self {
        match key {
            "v" => Key::Version,
            "pub" => Key::PublisherId,
            "seq" => Key::Sequence,
            "ts" => Key::PublishedAtUs,
            "kind" => Key::Kind,
            "rid" => Key::RequestId,
            "wid" => Key::WorkerId,
            "dp" => Key::DpRank,
            "ptok" => Key::PromptTokens,
            "etok" => Key::ExpectedOutputTokens,
            "stage" => Key::Stage,
            "otok" => Key::OutputTokens,
            "outcome" => Key::Outcome,
            "ctok" => Key::CachedTokens,
            "leaving" => Key::Leaving,
            _ => Key::Unknown,
        }
    }
}

/// A `kind` as read: one this version knows, or the unknown string (cut for logging).
enum WireKind {
    Known(EventKind),
    Unknown(String),
}

impl<'de> Deserialize<'de> for WireKind {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KindVisitor;

        impl Visitor<'_> for KindVisitor {
            type Value = WireKind;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an event kind string")
            }

            fn visit_str<E: de::Error>(self, kind: &str) -> Result<WireKind, E> {
                Ok(match EventKind::from_wire(kind) {
                    Some(kind) => WireKind::Known(kind),
                    None => WireKind::Unknown(truncated(kind, MAX_REPORTED_KIND_BYTES)),
                })
            }
        }

        deserializer.deserialize_str(KindVisitor)
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
fn truncated(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

macro_rules! str_enum_deserialize {
    ($ty:ident, $expecting:literal, $variants:expr) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct EnumVisitor;

                impl Visitor<'_> for EnumVisitor {
                    type Value = $ty;

                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str($expecting)
                    }

                    fn visit_str<E: de::Error>(self, value: &str) -> Result<$ty, E> {
                        $ty::from_wire(value).ok_or_else(|| E::unknown_variant(value, $variants))
                    }
                }

                deserializer.deserialize_str(EnumVisitor)
            }
        }
    };
}

str_enum_deserialize!(
    ProgressStage,
    "a progress stage string",
    &["prefill_done", "decoding"]
);
str_enum_deserialize!(
    Outcome,
    "an outcome string",
    &["finished", "cancelled", "failed"]
);
str_enum_deserialize!(
    EventKind,
    "an event kind string",
    &["admitted", "progressed", "completed", "worker_reset"]
);

/// Reads the envelope map into a [`RawEnvelope`] it borrows, so that what was seen before an
/// error is still there afterwards. With `probe`, only `v` and `kind` are read.
struct RawSeed<'a> {
    raw: &'a mut RawEnvelope,
    probe: bool,
    /// The address where the last key read ends in the input, if it was borrowed from it.
    last_key_end: &'a mut Option<usize>,
}

impl<'de> DeserializeSeed<'de> for RawSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

/// Reads one value into an empty slot, naming the key in any error.
fn fill<'de, A, T>(
    map: &mut A,
    slot: &mut Option<T>,
    key: &'static str,
    expected: &'static str,
) -> Result<(), A::Error>
where
    A: MapAccess<'de>,
    T: Deserialize<'de>,
{
    if slot.is_some() {
        return Err(de::Error::custom(format_args!("duplicate field `{key}`")));
    }
    let value = map.next_value::<T>().map_err(|err| {
        de::Error::custom(format_args!("field `{key}` must be {expected}: {err}"))
    })?;
    *slot = Some(value);
    Ok(())
}

const U16: &str = "an unsigned integer below 2^16";
const U32: &str = "an unsigned integer below 2^32";
const U32_OR_NIL: &str = "nil or an unsigned integer below 2^32";
const U64: &str = "an unsigned integer below 2^64";

impl<'de> Visitor<'de> for RawSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a lease event envelope (a map with string keys)")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let raw = self.raw;
        // Once the version is not ours or the kind is unknown, the other fields are no longer
        // checked: the answer is that error, whatever they hold.
        let mut skip_fields = self.probe;
        let last_key_end = self.last_key_end;
        while let Some(key) = map.next_key_seed(KeySeed {
            end: &mut *last_key_end,
        })? {
            match key {
                Key::Version => {
                    fill(&mut map, &mut raw.version, keys::VERSION, U16)?;
                    skip_fields |= raw.version != Some(WIRE_VERSION);
                }
                Key::Kind => {
                    fill(&mut map, &mut raw.kind, keys::KIND, "a string")?;
                    skip_fields |= matches!(raw.kind, Some(WireKind::Unknown(_)));
                }
                Key::Unknown => {
                    map.next_value::<IgnoredAny>()?;
                }
                _ if skip_fields => {
                    map.next_value::<IgnoredAny>()?;
                }
                Key::PublisherId => fill(&mut map, &mut raw.publisher_id, keys::PUBLISHER_ID, U64)?,
                Key::Sequence => fill(&mut map, &mut raw.sequence, keys::SEQUENCE, U64)?,
                Key::PublishedAtUs => fill(
                    &mut map,
                    &mut raw.published_at_us,
                    keys::PUBLISHED_AT_US,
                    U64,
                )?,
                Key::RequestId => fill(
                    &mut map,
                    &mut raw.request_id,
                    keys::REQUEST_ID,
                    "a UTF-8 string",
                )?,
                Key::WorkerId => fill(&mut map, &mut raw.worker_id, keys::WORKER_ID, U64)?,
                Key::DpRank => fill(&mut map, &mut raw.dp_rank, keys::DP_RANK, U32_OR_NIL)?,
                Key::PromptTokens => {
                    fill(&mut map, &mut raw.prompt_tokens, keys::PROMPT_TOKENS, U32)?
                }
                Key::ExpectedOutputTokens => fill(
                    &mut map,
                    &mut raw.expected_output_tokens,
                    keys::EXPECTED_OUTPUT_TOKENS,
                    U32_OR_NIL,
                )?,
                Key::Stage => fill(
                    &mut map,
                    &mut raw.stage,
                    keys::STAGE,
                    "\"prefill_done\" or \"decoding\"",
                )?,
                Key::OutputTokens => {
                    fill(&mut map, &mut raw.output_tokens, keys::OUTPUT_TOKENS, U32)?
                }
                Key::Outcome => fill(
                    &mut map,
                    &mut raw.outcome,
                    keys::OUTCOME,
                    "\"finished\", \"cancelled\" or \"failed\"",
                )?,
                Key::CachedTokens => fill(
                    &mut map,
                    &mut raw.cached_tokens,
                    keys::CACHED_TOKENS,
                    U32_OR_NIL,
                )?,
                Key::Leaving => fill(
                    &mut map,
                    &mut raw.leaving,
                    keys::LEAVING,
                    "nil or a boolean",
                )?,
            }
        }
        Ok(())
    }
}

/// Reads the same flat map from any serde format (JSON included). Unlike [`decode`], errors are
/// the format's own, and a newer version is only recognised if the body also parses.
impl<'de> Deserialize<'de> for Envelope {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut raw = RawEnvelope::default();
        RawSeed {
            raw: &mut raw,
            probe: false,
            last_key_end: &mut None,
        }
        .deserialize(deserializer)?;
        raw.validate(false).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn value_len_measures_exactly_one_value() {
        let mut values = Vec::new();
        rmp::encode::write_map_len(&mut values, 2).unwrap();
        rmp::encode::write_str(&mut values, "a").unwrap();
        rmp::encode::write_array_len(&mut values, 3).unwrap();
        rmp::encode::write_u64(&mut values, u64::MAX).unwrap();
        rmp::encode::write_bin(&mut values, &[0; 300]).unwrap();
        rmp::encode::write_ext_meta(&mut values, 4, 7).unwrap();
        values.extend_from_slice(&[1, 2, 3, 4]);
        rmp::encode::write_str(&mut values, &"x".repeat(40)).unwrap();
        rmp::encode::write_nil(&mut values).unwrap();
        assert_eq!(value_len(&values, 16), Some(values.len()));
        for cut in 0..values.len() {
            assert_eq!(value_len(&values[..cut], 16), None, "cut at {cut}");
        }
        assert_eq!(value_len(&values, 1), None, "deeper than allowed");
        values.push(0x01);
        assert_eq!(value_len(&values, 16), Some(values.len() - 1));
    }
    use super::*;

    fn admitted() -> Envelope {
        Envelope::new(
            0xdead_beef_0000_0001,
            1,
            1_700_000_000_123_456,
            Admitted {
                request_id: "req-1".into(),
                worker_id: 7,
                dp_rank: 2,
                prompt_tokens: 512,
                expected_output_tokens: Some(128),
                cached_tokens: None,
            },
        )
    }

    fn samples() -> Vec<Envelope> {
        vec![
            admitted(),
            Envelope::new(
                9,
                2,
                3,
                Admitted {
                    request_id: "r".into(),
                    worker_id: u64::MAX,
                    dp_rank: u32::MAX,
                    prompt_tokens: 0,
                    expected_output_tokens: None,
                    cached_tokens: None,
                },
            ),
            Envelope::new(
                9,
                3,
                4,
                Progressed {
                    request_id: "req-1".into(),
                    worker_id: 7,
                    dp_rank: 2,
                    stage: ProgressStage::PrefillDone,
                    output_tokens: 0,
                },
            ),
            Envelope::new(
                9,
                4,
                5,
                Progressed {
                    request_id: "req-1".into(),
                    worker_id: 7,
                    dp_rank: 2,
                    stage: ProgressStage::Decoding,
                    output_tokens: 100_000,
                },
            ),
            Envelope::new(
                9,
                5,
                6,
                Completed {
                    request_id: "req-ü".into(),
                    worker_id: 7,
                    dp_rank: 2,
                    outcome: Outcome::Cancelled,
                },
            ),
            Envelope::new(
                9,
                u64::MAX,
                u64::MAX,
                WorkerReset {
                    worker_id: 7,
                    dp_rank: None,
                    leaving: false,
                },
            ),
            Envelope::new(
                9,
                7,
                8,
                WorkerReset {
                    worker_id: 7,
                    dp_rank: Some(0),
                    leaving: false,
                },
            ),
            Envelope::new(
                9,
                8,
                9,
                WorkerReset {
                    worker_id: 7,
                    dp_rank: Some(1),
                    leaving: true,
                },
            ),
        ]
    }

    /// A small MessagePack writer for hand-made bodies.
    #[derive(Default)]
    struct Mp(Vec<u8>);

    impl Mp {
        fn map(mut self, len: u8) -> Self {
            assert!(len < 16);
            self.0.push(0x80 | len);
            self
        }
        fn str(mut self, s: &str) -> Self {
            assert!(s.len() < 32);
            self.0.push(0xa0 | s.len() as u8);
            self.0.extend_from_slice(s.as_bytes());
            self
        }
        fn uint(mut self, v: u64) -> Self {
            rmp_serde::encode::write(&mut self.0, &v).unwrap();
            self
        }
        fn raw(mut self, bytes: &[u8]) -> Self {
            self.0.extend_from_slice(bytes);
            self
        }
        fn kv(self, k: &str, v: u64) -> Self {
            self.str(k).uint(v)
        }
        fn ks(self, k: &str, v: &str) -> Self {
            self.str(k).str(v)
        }
    }

    fn decode_default(bytes: &[u8]) -> Result<Envelope, DecodeEventError> {
        decode(bytes, DEFAULT_MAX_EVENT_BYTES)
    }

    #[test]
    fn round_trip_of_every_kind() {
        let mut kinds = Vec::new();
        for envelope in samples() {
            let bytes = encode(&envelope).unwrap();
            assert_eq!(decode_default(&bytes).unwrap(), envelope);
            kinds.push(envelope.kind());
        }
        for kind in EventKind::ALL {
            assert!(kinds.contains(&kind), "no sample of {kind}");
        }
    }

    #[test]
    fn json_round_trip_uses_the_same_keys() {
        for envelope in samples() {
            let json = serde_json::to_value(&envelope).unwrap();
            for key in json.as_object().unwrap().keys() {
                assert!(keys::ALL.contains(&key.as_str()), "{key}");
            }
            let back: Envelope = serde_json::from_value(json).unwrap();
            assert_eq!(back, envelope);
        }
    }

    /// `Serialize` declares the map's length up front: a serializer that writes it (as
    /// MessagePack does) must produce what `encode` does.
    #[test]
    fn serde_messagepack_matches_the_encoder() {
        for envelope in samples() {
            let via_serde = rmp_serde::to_vec(&envelope).unwrap();
            assert_eq!(via_serde, encode(&envelope).unwrap(), "{envelope:?}");
        }
    }

    #[test]
    fn encoding_is_compact() {
        let bytes = encode(&admitted()).unwrap();
        // map(10) + keys + values; integers in their smallest width.
        assert_eq!(bytes[0], 0x8a);
        assert!(bytes.len() < 90, "{} bytes", bytes.len());
        let reset = Envelope::new(
            1,
            1,
            1,
            WorkerReset {
                worker_id: 1,
                dp_rank: None,
                leaving: false,
            },
        );
        assert_eq!(
            encode(&reset).unwrap().len(),
            1 + 3 + 5 + 5 + 4 + 5 + 13 + 5
        );
    }

    #[test]
    fn encode_into_appends() {
        let mut out = vec![0xff];
        encode_into(&admitted(), &mut out).unwrap();
        assert_eq!(out[0], 0xff);
        assert_eq!(decode_default(&out[1..]).unwrap(), admitted());
    }

    #[test]
    fn encode_refuses_what_decode_would_refuse() {
        let mut envelope = admitted();
        envelope.sequence = 0;
        assert!(matches!(
            encode(&envelope),
            Err(EncodeEventError::ZeroSequence)
        ));
        let mut envelope = admitted();
        if let LeaseEvent::Admitted(e) = &mut envelope.event {
            e.request_id.clear();
        }
        let mut out = vec![1, 2];
        assert!(matches!(
            encode_into(&envelope, &mut out),
            Err(EncodeEventError::EmptyRequestId {
                kind: EventKind::Admitted
            })
        ));
        assert_eq!(out, [1, 2]);
    }

    #[test]
    fn accessors() {
        let envelope = admitted();
        let LeaseEvent::Admitted(a) = &envelope.event else {
            unreachable!()
        };
        assert_eq!(a.worker(), WorkerWithDpRank::new(7, 2));
        assert_eq!(a.load(), RequestLoad::new(512, Some(128)));
        assert_eq!(a.to_request_id().as_str(), "req-1");
        assert_eq!(envelope.event.worker_id(), 7);
        assert_eq!(envelope.event.worker(), Some(WorkerWithDpRank::new(7, 2)));
        assert_eq!(envelope.event.dp_rank(), Some(2));
        assert_eq!(envelope.event.request_id(), Some("req-1"));
        assert_eq!(envelope.kind().as_str(), "admitted");
        let all = WorkerReset {
            worker_id: 7,
            dp_rank: None,
            leaving: false,
        };
        assert!(all.covers(WorkerWithDpRank::new(7, 3)));
        assert!(!all.covers(WorkerWithDpRank::new(8, 3)));
        assert_eq!(all.worker(), None);
        let one = WorkerReset {
            worker_id: 7,
            dp_rank: Some(1),
            leaving: false,
        };
        assert_eq!(one.worker(), Some(WorkerWithDpRank::new(7, 1)));
        assert!(one.covers(WorkerWithDpRank::new(7, 1)));
        assert!(!one.covers(WorkerWithDpRank::new(7, 0)));
        let reset = LeaseEvent::from(one);
        assert_eq!(reset.worker_id(), 7);
        assert_eq!(reset.request_id(), None);
        assert_eq!(reset.worker(), None);
        assert_eq!(
            EventKind::ALL.map(EventKind::as_str),
            ["admitted", "progressed", "completed", "worker_reset"]
        );
        for kind in EventKind::ALL {
            assert_eq!(EventKind::from_wire(kind.as_str()), Some(kind));
            assert_eq!(kind.to_string(), kind.as_str());
        }
        for stage in ProgressStage::ALL {
            assert_eq!(ProgressStage::from_wire(stage.as_str()), Some(stage));
            assert_eq!(stage.to_string(), stage.as_str());
        }
        for outcome in Outcome::ALL {
            assert_eq!(Outcome::from_wire(outcome.as_str()), Some(outcome));
            assert_eq!(outcome.to_string(), outcome.as_str());
        }
    }

    #[test]
    fn stamper_counts_from_one() {
        let stamper = EnvelopeStamper::with_publisher_id(42);
        let reset = WorkerReset {
            worker_id: 1,
            dp_rank: None,
            leaving: false,
        };
        let a = stamper.stamp(reset.clone());
        let b = stamper.stamp(reset);
        assert_eq!((a.publisher_id, a.sequence, b.sequence), (42, 1, 2));
        assert_eq!(a.version, WIRE_VERSION);
        assert!(a.published_at_us > 1_600_000_000_000_000);
        assert_ne!(
            EnvelopeStamper::new_random().publisher_id(),
            EnvelopeStamper::new_random().publisher_id()
        );
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let bytes = Mp::default()
            .map(9)
            .kv("v", 1)
            .ks("future", "x")
            .kv("pub", 5)
            .kv("seq", 6)
            .kv("ts", 7)
            .ks("kind", "worker_reset")
            .kv("wid", 3)
            // a nested map, an array, a float and nil under unknown keys
            .str("nested")
            .raw(&[0x81, 0xa1, b'a', 0x92, 0xc0, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0])
            .str("ext")
            .raw(&[0xd6, 0xff, 0, 0, 0, 1])
            .0;
        let envelope = decode_default(&bytes).unwrap();
        assert_eq!(
            envelope,
            Envelope::new(
                5,
                6,
                7,
                WorkerReset {
                    worker_id: 3,
                    dp_rank: None,
                    leaving: false,
                }
            )
        );
    }

    #[test]
    fn other_integer_widths_and_key_order_decode() {
        let bytes = Mp::default()
            .map(10)
            .ks("kind", "admitted")
            .str("etok")
            .raw(&[0xc0]) // nil: unknown
            .str("ptok")
            .raw(&[0xd2, 0, 0, 1, 0]) // int32 256
            .str("dp")
            .raw(&[0xd0, 3]) // int8 3
            .str("wid")
            .raw(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 9]) // uint64 9
            .ks("rid", "abc")
            .str("ts")
            .raw(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 4]) // int64 4
            .str("seq")
            .raw(&[0xcd, 0, 3]) // uint16 3
            .str("pub")
            .raw(&[0xce, 0, 0, 0, 2]) // uint32 2
            .str("v")
            .raw(&[0xcd, 0, 1]) // uint16 1
            .0;
        assert_eq!(
            decode_default(&bytes).unwrap(),
            Envelope::new(
                2,
                3,
                4,
                Admitted {
                    request_id: "abc".into(),
                    worker_id: 9,
                    dp_rank: 3,
                    prompt_tokens: 256,
                    expected_output_tokens: None,
                    cached_tokens: None,
                }
            )
        );
    }

    #[test]
    fn oversized() {
        let bytes = encode(&admitted()).unwrap();
        let err = decode(&bytes, bytes.len() - 1).unwrap_err();
        assert_eq!(
            err,
            DecodeEventError::Oversized {
                len: bytes.len(),
                max: bytes.len() - 1
            }
        );
        assert_eq!(err.reason(), "oversized");
        assert!(decode(&bytes, bytes.len()).is_ok());
    }

    fn assert_malformed(bytes: &[u8], needle: &str) {
        match decode_default(bytes) {
            Err(err @ DecodeEventError::Malformed(_)) => {
                assert_eq!(err.reason(), "decode");
                assert!(err.to_string().contains(needle), "{err} lacks {needle:?}");
            }
            other => panic!("expected Malformed containing {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn malformed_inputs() {
        assert_malformed(&[], "");
        assert_malformed(b"garbage that is not msgpack", "");
        assert_malformed(&[0xc1], ""); // reserved marker
        assert_malformed(&[0x93, 1, 2, 3], "map"); // an array
        assert_malformed(&[0x07], "map"); // a bare integer
        let good = encode(&admitted()).unwrap();
        for cut in 0..good.len() {
            assert!(
                matches!(
                    decode_default(&good[..cut]),
                    Err(DecodeEventError::Malformed(_))
                ),
                "truncated at {cut}"
            );
        }
        let mut trailing = good.clone();
        trailing.push(0x00);
        assert_malformed(&trailing, "trailing bytes");
        let mut trailing = good.clone();
        trailing.push(0xc1);
        assert_malformed(&trailing, "trailing bytes");
    }

    #[test]
    fn the_end_of_the_map_is_found_from_its_last_key() {
        let good = encode(&admitted()).unwrap();
        let mut raw = RawEnvelope::default();
        let mut last_key_end = None;
        RawSeed {
            raw: &mut raw,
            probe: false,
            last_key_end: &mut last_key_end,
        }
        .deserialize(&mut rmp_serde::Deserializer::from_read_ref(&good))
        .unwrap();
        assert!(last_key_end.is_some(), "keys are borrowed from the input");
        assert_eq!(map_end(&good, last_key_end), Some(good.len()));
        // Without a usable position the whole map is measured, to the same answer.
        assert_eq!(map_end(&good, None), Some(good.len()));
        assert_eq!(map_end(&good, Some(usize::MAX)), Some(good.len()));
        assert_eq!(map_end(&[0x80], None), Some(1), "an empty map");

        // A nested unknown value last, then trailing bytes: still refused.
        let nested_last = reset_with(
            |m| {
                m.ks("kind", "worker_reset")
                    .kv("wid", 7)
                    .str("future")
                    .raw(&[0x92, 0x01, 0x91, 0x02])
            },
            7,
        );
        assert!(decode_default(&nested_last).is_ok());
        for extra in [&[0x00][..], &[0xc1], &[0x92, 0x01]] {
            let mut bytes = nested_last.clone();
            bytes.extend_from_slice(extra);
            assert_malformed(&bytes, "trailing bytes");
        }
    }

    fn reset_with(extra: impl FnOnce(Mp) -> Mp, len: u8) -> Vec<u8> {
        let base = Mp::default()
            .map(len)
            .kv("v", 1)
            .kv("pub", 1)
            .kv("seq", 1)
            .kv("ts", 1);
        extra(base).0
    }

    #[test]
    fn malformed_fields_are_named() {
        // A key that is not a string, a kind that is not a string: the error says what was
        // expected.
        let bytes = reset_with(
            |m| m.ks("kind", "worker_reset").kv("wid", 1).uint(3).uint(4),
            7,
        );
        assert_malformed(&bytes, "a string map key");
        let bytes = reset_with(|m| m.kv("kind", 3).kv("wid", 1), 6);
        assert_malformed(&bytes, "an event kind string");
        // Wrong type.
        let bytes = reset_with(|m| m.ks("kind", "worker_reset").ks("wid", "seven"), 6);
        assert_malformed(&bytes, "field `wid`");
        // Out of range for u32.
        let bytes = reset_with(
            |m| m.ks("kind", "worker_reset").kv("wid", 1).kv("dp", 1 << 32),
            7,
        );
        assert_malformed(&bytes, "field `dp`");
        // Negative.
        let bytes = reset_with(|m| m.ks("kind", "worker_reset").str("wid").raw(&[0xff]), 6);
        assert_malformed(&bytes, "field `wid`");
        // Missing required field of the kind.
        let bytes = reset_with(
            |m| {
                m.ks("kind", "completed")
                    .kv("wid", 1)
                    .kv("dp", 0)
                    .ks("rid", "r")
            },
            8,
        );
        assert_malformed(&bytes, "missing field `outcome`");
        let bytes = reset_with(
            |m| {
                m.ks("kind", "admitted")
                    .kv("wid", 1)
                    .ks("rid", "r")
                    .kv("ptok", 3)
            },
            8,
        );
        assert_malformed(&bytes, "missing field `dp`");
        // Missing envelope field.
        let bytes = Mp::default()
            .map(4)
            .kv("v", 1)
            .kv("pub", 1)
            .kv("ts", 1)
            .ks("kind", "worker_reset")
            .0;
        assert_malformed(&bytes, "missing field `seq`");
        let bytes = Mp::default().map(1).ks("kind", "worker_reset").0;
        assert_malformed(&bytes, "missing field `v`");
        let bytes = reset_with(|m| m.kv("wid", 1), 5);
        assert_malformed(&bytes, "missing field `kind`");
        // Unknown enum values.
        let bytes = reset_with(
            |m| {
                m.ks("kind", "completed")
                    .kv("wid", 1)
                    .kv("dp", 0)
                    .ks("rid", "r")
                    .ks("outcome", "exploded")
            },
            9,
        );
        assert_malformed(&bytes, "field `outcome`");
        // Duplicate key.
        let bytes = reset_with(
            |m| m.ks("kind", "worker_reset").kv("wid", 1).kv("wid", 2),
            7,
        );
        assert_malformed(&bytes, "duplicate field `wid`");
        // Zero sequence, empty request id, nil rank where one is required.
        let bytes = Mp::default()
            .map(6)
            .kv("v", 1)
            .kv("pub", 1)
            .kv("seq", 0)
            .kv("ts", 1)
            .ks("kind", "worker_reset")
            .kv("wid", 1)
            .0;
        assert_malformed(&bytes, "`seq` is 0");
        let bytes = reset_with(
            |m| {
                m.ks("kind", "completed")
                    .kv("wid", 1)
                    .kv("dp", 0)
                    .ks("rid", "")
                    .ks("outcome", "failed")
            },
            9,
        );
        assert_malformed(&bytes, "`rid` is empty");
        let bytes = reset_with(
            |m| {
                m.ks("kind", "completed")
                    .kv("wid", 1)
                    .str("dp")
                    .raw(&[0xc0])
                    .ks("rid", "r")
                    .ks("outcome", "failed")
            },
            9,
        );
        assert_malformed(&bytes, "`dp` is nil");
        // A non-string key.
        let bytes = reset_with(
            |m| m.ks("kind", "worker_reset").kv("wid", 1).raw(&[0x01, 0x01]),
            7,
        );
        assert_malformed(&bytes, "");
        // Invalid UTF-8 in the request id.
        let bytes = reset_with(
            |m| {
                m.ks("kind", "completed")
                    .kv("wid", 1)
                    .kv("dp", 0)
                    .str("rid")
                    .raw(&[0xa2, 0xff, 0xfe])
                    .ks("outcome", "failed")
            },
            9,
        );
        assert_malformed(&bytes, "field `rid`");
    }

    /// The deepest unknown value the decoder takes as the last field is also one the
    /// end-of-map check can measure: one level deeper is refused for its depth, never taken
    /// for trailing bytes.
    #[test]
    fn nesting_limit_of_the_last_field() {
        let nested_last = |levels: usize| {
            let mut bytes =
                reset_with(|m| m.ks("kind", "worker_reset").kv("wid", 7).str("deep"), 7);
            bytes.extend(std::iter::repeat_n(0x91, levels));
            bytes.push(0x01);
            bytes
        };
        let accepted = (0..MAX_NESTING_DEPTH)
            .filter(|&levels| decode_default(&nested_last(levels)).is_ok())
            .count();
        assert_eq!(accepted, MAX_NESTING_DEPTH - 1);
        assert_malformed(&nested_last(MAX_NESTING_DEPTH - 1), "depth");
    }

    /// Containers with 16-bit and 32-bit lengths as the last field: measured whole, so the
    /// message is not taken for one with trailing bytes.
    #[test]
    fn wide_containers_last_are_measured() {
        let map16 = [0xde, 0x00, 0x03, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06];
        let map32 = [0xdf, 0x00, 0x00, 0x00, 0x03, 1, 2, 3, 4, 5, 6];
        let array16 = [0xdc, 0x00, 0x03, 0x01, 0x02, 0x03];
        let array32 = [0xdd, 0x00, 0x00, 0x00, 0x03, 0x01, 0x02, 0x03];
        let str16 = [0xda, 0x00, 0x02, b'o', b'k'];
        for last in [&map16[..], &map32, &array16, &array32, &str16] {
            let bytes = reset_with(
                |m| {
                    m.ks("kind", "worker_reset")
                        .kv("wid", 7)
                        .str("wide")
                        .raw(last)
                },
                7,
            );
            assert!(decode_default(&bytes).is_ok(), "{last:x?}");
            let mut trailing = bytes.clone();
            trailing.push(0x00);
            assert_malformed(&trailing, "trailing bytes");
        }
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        let mut bytes = Mp::default()
            .map(2)
            .ks("kind", "worker_reset")
            .str("deep")
            .0;
        bytes.extend(std::iter::repeat_n(0x91, 3000));
        bytes.push(0xc0);
        assert_malformed(&bytes, "depth");
    }

    #[test]
    fn unsupported_versions() {
        for found in [0u16, 2, 9, u16::MAX] {
            let mut envelope = admitted();
            envelope.version = found;
            let err = decode_default(&encode(&envelope).unwrap()).unwrap_err();
            assert_eq!(
                err,
                DecodeEventError::UnsupportedVersion {
                    found,
                    supported: WIRE_VERSION
                }
            );
            assert_eq!(err.reason(), "version");
        }
    }

    #[test]
    fn newer_version_is_detected_even_if_the_rest_is_not_v1() {
        // `v` first: the rest is skipped, even fields of the wrong type and unknown kinds.
        let bytes = Mp::default()
            .map(3)
            .kv("v", 2)
            .ks("wid", "a string in v2")
            .ks("kind", "something_new")
            .0;
        assert_eq!(
            decode_default(&bytes).unwrap_err(),
            DecodeEventError::UnsupportedVersion {
                found: 2,
                supported: 1
            }
        );
        // `v` last, after a field that fails as v1.
        let bytes = Mp::default()
            .map(3)
            .ks("wid", "a string in v2")
            .raw(&[0xa3, b'r', b'i', b'd', 0x92, 1, 2])
            .kv("v", 3)
            .0;
        assert_eq!(
            decode_default(&bytes).unwrap_err(),
            DecodeEventError::UnsupportedVersion {
                found: 3,
                supported: 1
            }
        );
        // `v` first, then the body is cut short.
        let bytes = Mp::default().map(5).kv("v", 2).ks("kind", "admitted").0;
        assert!(matches!(
            decode_default(&bytes),
            Err(DecodeEventError::UnsupportedVersion { found: 2, .. })
        ));
        // No required v1 fields at all.
        let bytes = Mp::default().map(1).kv("v", 2).0;
        assert!(matches!(
            decode_default(&bytes),
            Err(DecodeEventError::UnsupportedVersion { found: 2, .. })
        ));
    }

    #[test]
    fn unknown_kind() {
        // Everything else is a perfectly good v1 envelope.
        let bytes = reset_with(|m| m.ks("kind", "paused").kv("wid", 1), 6);
        let err = decode_default(&bytes).unwrap_err();
        assert_eq!(
            err,
            DecodeEventError::UnknownKind {
                kind: "paused".into()
            }
        );
        assert_eq!(err.reason(), "unknown_kind");
        // A new kind may use reserved names differently; the kind is still what is reported,
        // whether it comes before or after such a field.
        let bytes = reset_with(|m| m.ks("kind", "paused").ks("wid", "x"), 6);
        assert!(matches!(
            decode_default(&bytes),
            Err(DecodeEventError::UnknownKind { .. })
        ));
        let bytes = reset_with(|m| m.ks("wid", "x").ks("kind", "paused"), 6);
        assert!(matches!(
            decode_default(&bytes),
            Err(DecodeEventError::UnknownKind { .. })
        ));
        // A long kind is cut for the logs.
        let long = "k".repeat(31);
        let bytes = reset_with(|m| m.ks("kind", &long).kv("wid", 1), 6);
        assert!(matches!(
            decode_default(&bytes),
            Err(DecodeEventError::UnknownKind { kind }) if kind == long
        ));
        assert_eq!(truncated(&"é".repeat(40), 5), "éé...");
        // Unknown kind in a broken body stays malformed.
        let bytes = reset_with(|m| m.ks("kind", "paused").str("wid"), 6);
        assert!(matches!(
            decode_default(&bytes),
            Err(DecodeEventError::Malformed(_))
        ));
    }

    #[test]
    fn error_messages() {
        assert_eq!(
            DecodeEventError::UnsupportedVersion {
                found: 2,
                supported: 1
            }
            .to_string(),
            "unsupported wire version 2 (this router reads version 1)"
        );
        assert_eq!(
            DecodeEventError::Oversized {
                len: 5000,
                max: 4096
            }
            .to_string(),
            "event of 5000 bytes is larger than the limit of 4096 bytes"
        );
        assert_eq!(
            DecodeEventError::UnknownKind { kind: "x".into() }.to_string(),
            "unknown event kind \"x\""
        );
    }

    #[test]
    fn never_panics_on_mutations() {
        // Flip, drop and insert bytes of every sample at every position.
        for envelope in samples() {
            let good = encode(&envelope).unwrap();
            for i in 0..good.len() {
                for b in [
                    0x00, 0x7f, 0x80, 0x9f, 0xc0, 0xc1, 0xcf, 0xd3, 0xdb, 0xdf, 0xff,
                ] {
                    let mut flipped = good.clone();
                    flipped[i] = b;
                    let _ = decode_default(&flipped);
                    let mut inserted = good.clone();
                    inserted.insert(i, b);
                    let _ = decode_default(&inserted);
                }
                let mut dropped = good.clone();
                dropped.remove(i);
                let _ = decode_default(&dropped);
            }
        }
    }
}

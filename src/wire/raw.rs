//! What a decoder has seen of an event, and the checks that make it an [`Envelope`].
//!
//! Both readers of an event, the plain one and the full one, fill a [`RawEnvelope`]; its
//! [`validate`](RawEnvelope::validate) is the one place that says which fields each kind
//! requires, so both answer alike.

use super::{
    keys, Admitted, Completed, DecodeEventError, Envelope, EventKind, KvCleared, KvRemoved,
    KvStored, LeaseEvent, Outcome, ProgressStage, Progressed, WorkerReset, MAX_BLOCK_HASHES,
    WIRE_VERSION,
};

/// Whatever the decoder has seen of an envelope, before validation.
#[derive(Default)]
pub(super) struct RawEnvelope {
    pub(super) version: Option<u16>,
    pub(super) publisher_id: Option<u64>,
    pub(super) sequence: Option<u64>,
    pub(super) published_at_us: Option<u64>,
    pub(super) kind: Option<WireKind>,
    pub(super) request_id: Option<String>,
    pub(super) worker_id: Option<u64>,
    /// `Some(None)`: present as nil.
    pub(super) dp_rank: Option<Option<u32>>,
    pub(super) prompt_tokens: Option<u32>,
    pub(super) expected_output_tokens: Option<Option<u32>>,
    pub(super) stage: Option<ProgressStage>,
    pub(super) output_tokens: Option<u32>,
    pub(super) outcome: Option<Outcome>,
    pub(super) cached_tokens: Option<Option<u32>>,
    pub(super) leaving: Option<Option<bool>>,
    pub(super) block_hashes: Option<Option<Vec<u64>>>,
    pub(super) block_capacity: Option<Option<u32>>,
    pub(super) parent_hash: Option<Option<u64>>,
    pub(super) class: Option<Option<String>>,
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
    /// The envelope these fields make, or why they make none; with `trailing_bytes` (bytes
    /// followed the map), a version-1 event is refused as malformed.
    pub(super) fn validate(self, trailing_bytes: bool) -> Result<Envelope, DecodeEventError> {
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
        } else if kind == EventKind::KvCleared {
            LeaseEvent::KvCleared(KvCleared {
                worker_id,
                dp_rank: self.dp_rank.flatten(),
            })
        } else if matches!(kind, EventKind::KvStored | EventKind::KvRemoved) {
            let dp_rank = rank(self.dp_rank, kind)?;
            let block_hashes = match self.block_hashes.flatten() {
                Some(hashes) if !hashes.is_empty() && hashes.len() <= MAX_BLOCK_HASHES => hashes,
                Some(hashes) => {
                    return Err(DecodeEventError::Malformed(format!(
                        "field `{}` holds {} hashes: a `{kind}` event holds 1 to \
                         {MAX_BLOCK_HASHES}",
                        keys::BLOCK_HASHES,
                        hashes.len()
                    )))
                }
                None => return Err(missing(keys::BLOCK_HASHES, k)),
            };
            if kind == EventKind::KvStored {
                LeaseEvent::KvStored(KvStored {
                    worker_id,
                    dp_rank,
                    parent_hash: self.parent_hash.flatten(),
                    block_hashes,
                })
            } else {
                LeaseEvent::KvRemoved(KvRemoved {
                    worker_id,
                    dp_rank,
                    block_hashes,
                })
            }
        } else {
            let request_id = required(self.request_id, keys::REQUEST_ID, k)?;
            if request_id.is_empty() {
                return Err(DecodeEventError::Malformed(
                    "field `rid` is empty".to_owned(),
                ));
            }
            let dp_rank = rank(self.dp_rank, kind)?;
            match kind {
                EventKind::Admitted => {
                    let block_hashes = self.block_hashes.flatten().unwrap_or_default();
                    if block_hashes.len() > MAX_BLOCK_HASHES {
                        return Err(DecodeEventError::Malformed(format!(
                            "field `{}` holds {} hashes: at most {MAX_BLOCK_HASHES}, the \
                             prompt's first blocks",
                            keys::BLOCK_HASHES,
                            block_hashes.len()
                        )));
                    }
                    LeaseEvent::Admitted(Admitted {
                        request_id,
                        worker_id,
                        dp_rank,
                        prompt_tokens: required(self.prompt_tokens, keys::PROMPT_TOKENS, k)?,
                        expected_output_tokens: self.expected_output_tokens.flatten(),
                        cached_tokens: self.cached_tokens.flatten(),
                        block_hashes,
                        block_capacity: self.block_capacity.flatten(),
                        class: self.class.flatten(),
                    })
                }
                EventKind::Progressed => LeaseEvent::Progressed(Progressed {
                    request_id,
                    worker_id,
                    dp_rank,
                    stage: required(self.stage, keys::STAGE, k)?,
                    output_tokens: required(self.output_tokens, keys::OUTPUT_TOKENS, k)?,
                }),
                _ => LeaseEvent::Completed(Completed {
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

/// The rank a per-request or per-block event requires.
fn rank(slot: Option<Option<u32>>, kind: EventKind) -> Result<u32, DecodeEventError> {
    match slot {
        Some(Some(dp_rank)) => Ok(dp_rank),
        Some(None) => Err(DecodeEventError::Malformed(format!(
            "field `dp` is nil (a rank is required in a `{kind}` event)"
        ))),
        None => Err(missing(keys::DP_RANK, Some(kind))),
    }
}

/// A `kind` as read: one this version knows, or the unknown string (cut for logging).
pub(super) enum WireKind {
    /// A kind of this version.
    Known(EventKind),
    /// Another kind, cut for logging.
    Unknown(String),
}

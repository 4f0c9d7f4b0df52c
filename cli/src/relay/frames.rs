//! The engine's ZeroMQ messages, decoded: [`Frame`] (one PUB message or one replay reply) and
//! [`EngineBatch`] (its MessagePack payload). The layouts, with the versions they were read
//! from, are in the module documentation of `relay` (`mod.rs`).
//!
//! The decoding is lenient where engines differ (arrays or maps, ints or bytes as block
//! hashes, trailing fields present or not, fields this relay does not know) and strict where
//! a value would change what the index is told (a block hash that is neither int nor bytes,
//! token ids that are not u32, a block size that is not a whole number).

use bytes::Bytes;
use rmpv::Value;

/// An engine's block hash, as a fixed-size key: the value of an int, or the XXH3-128 of a
/// bytes hash (vLLM's `ExternalBlockHash` is `int | bytes` depending on version and
/// `--prefix-caching-hash-algo`). The engine's hashes are only keys here, never ours.
pub type EngineKey = u128;

/// The tag bit that keeps bytes keys apart from int keys (ints take at most 65 bits).
const BYTES_KEY: u128 = 1 << 127;

/// The `seq` of the replay socket's end marker: -1 as a signed 8-byte big-endian integer.
pub const END_SEQ: u64 = u64::MAX;

/// How deep a payload's MessagePack may nest: a batch is 4 levels deep (batch, events,
/// event, a list of hashes or extra keys and their tuples); more is not an engine's.
const MAX_DEPTH: usize = 16;

/// One message of the PUB socket: `[topic, seq (8 bytes, big-endian), payload]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub seq: u64,
    pub payload: Bytes,
}

/// Why a message's frames are not an engine's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("{0} frames, expected 3 (topic, sequence, payload)")]
    FrameCount(usize),
    #[error("a sequence frame of {0} bytes, expected 8")]
    SeqLength(usize),
}

/// A PUB message's frames.
pub fn pub_frame(frames: &[Bytes]) -> Result<Frame, FrameError> {
    match frames {
        [_topic, seq, payload] => Ok(Frame {
            seq: seq_of(seq)?,
            payload: payload.clone(),
        }),
        other => Err(FrameError::FrameCount(other.len())),
    }
}

/// A replay reply's frames, as a DEALER receives them: `["", seq, payload]` (a REQ-style
/// client sees `[seq, payload]`, accepted too). The end marker has seq [`END_SEQ`] and an
/// empty payload.
pub fn replay_frame(frames: &[Bytes]) -> Result<Frame, FrameError> {
    let frames = match frames {
        [empty, rest @ ..] if empty.is_empty() && rest.len() == 2 => rest,
        other => other,
    };
    match frames {
        [seq, payload] => Ok(Frame {
            seq: seq_of(seq)?,
            payload: payload.clone(),
        }),
        other => Err(FrameError::FrameCount(other.len())),
    }
}

fn seq_of(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// A decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineBatch {
    /// The engine's wall clock when it published the batch, in seconds since the epoch.
    pub ts: f64,
    /// `data_parallel_rank` (vLLM 0.10 on), if the batch carries one.
    pub dp_rank: Option<i64>,
    pub events: Vec<EngineEvent>,
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Stored(Stored),
    Removed(Removed),
    Cleared,
    /// A tag this relay does not know (a later engine's event kind): skipped and counted.
    Unknown(String),
}

/// `BlockStored`.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub block_hashes: Vec<EngineKey>,
    pub parent: Option<EngineKey>,
    pub token_ids: Vec<u32>,
    pub block_size: u64,
    /// The blocks' engine hashes cover more than their tokens: a LoRA (`lora_id`,
    /// `lora_name`), extra keys (multimodal inputs, a cache salt: `extra_keys`, SGLang's
    /// metadata map). Our hashes are of tokens alone, so such blocks are not relayed.
    pub keyed_beyond_tokens: bool,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq)]
pub struct Removed {
    pub block_hashes: Vec<EngineKey>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
}

/// Why a payload is not a `KVEventBatch`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PayloadError(pub String);

fn bad(message: impl Into<String>) -> PayloadError {
    PayloadError(message.into())
}

/// Decodes a payload: the batch as an array `[ts, events, data_parallel_rank?]` or a map
/// `{ts, events, data_parallel_rank?}`; each event as a tagged array `[tag, fields...]` or a
/// tagged map `{"type": tag, field: value...}`.
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, PayloadError> {
    let mut reader = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH)
        .map_err(|e| bad(format!("not MessagePack: {e}")))?;
    if !reader.is_empty() {
        return Err(bad(format!("{} bytes after the batch", reader.len())));
    }
    let (ts, events, dp) = match &value {
        Value::Array(items) if (2..=3).contains(&items.len()) => {
            (&items[0], &items[1], items.get(2).unwrap_or(&Value::Nil))
        }
        Value::Array(items) => return Err(bad(format!("a batch array of {}", items.len()))),
        Value::Map(_) => (
            field(&value, "ts").ok_or_else(|| bad("a batch map without ts"))?,
            field(&value, "events").ok_or_else(|| bad("a batch map without events"))?,
            field(&value, "data_parallel_rank").unwrap_or(&Value::Nil),
        ),
        other => return Err(bad(format!("a batch of type {}", type_name(other)))),
    };
    let ts = ts
        .as_f64()
        .or_else(|| ts.as_i64().map(|t| t as f64))
        .ok_or_else(|| bad("ts is not a number"))?;
    let dp_rank = optional(dp, "data_parallel_rank", |v| v.as_i64())?;
    let Value::Array(events) = events else {
        return Err(bad("events is not an array"));
    };
    let events = events.iter().map(event).collect::<Result<_, _>>()?;
    Ok(EngineBatch {
        ts,
        dp_rank,
        events,
    })
}

/// An event's fields by name, from either encoding.
struct Fields<'a> {
    tag: &'a str,
    positional: Option<&'a [Value]>,
    map: Option<&'a Value>,
}

impl<'a> Fields<'a> {
    /// The field `name`, at `index` in the array form (after the tag).
    fn get(&self, index: usize, name: &str) -> &'a Value {
        const NIL: &Value = &Value::Nil;
        match (self.positional, self.map) {
            (Some(items), _) => items.get(index).unwrap_or(NIL),
            (_, Some(map)) => field(map, name).unwrap_or(NIL),
            _ => NIL,
        }
    }
}

fn event(value: &Value) -> Result<EngineEvent, PayloadError> {
    let fields = match value {
        Value::Array(items) if !items.is_empty() => Fields {
            tag: items[0]
                .as_str()
                .ok_or_else(|| bad("an event array whose tag is not a string"))?,
            positional: Some(&items[1..]),
            map: None,
        },
        Value::Map(_) => Fields {
            tag: field(value, "type")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("an event map without a string \"type\""))?,
            positional: None,
            map: Some(value),
        },
        other => return Err(bad(format!("an event of type {}", type_name(other)))),
    };
    match fields.tag {
        "BlockStored" => stored(&fields).map(EngineEvent::Stored),
        "BlockRemoved" => Ok(EngineEvent::Removed(Removed {
            block_hashes: keys(fields.get(0, "block_hashes"), "block_hashes")?,
            medium: optional(fields.get(1, "medium"), "medium", |v| {
                v.as_str().map(str::to_owned)
            })?,
            group_idx: optional(fields.get(2, "group_idx"), "group_idx", Value::as_i64)?,
        })),
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Ok(EngineEvent::Unknown(other.chars().take(64).collect())),
    }
}

/// `BlockStored`: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium
/// (0.10), lora_name (vLLM) or a metadata map (SGLang), extra_keys, group_idx, ...
fn stored(fields: &Fields<'_>) -> Result<Stored, PayloadError> {
    let block_hashes = keys(fields.get(0, "block_hashes"), "block_hashes")?;
    let parent = match fields.get(1, "parent_block_hash") {
        Value::Nil => None,
        value => Some(key(value).ok_or_else(|| bad("parent_block_hash is not int or bytes"))?),
    };
    let Value::Array(tokens) = fields.get(2, "token_ids") else {
        return Err(bad("token_ids is not an array"));
    };
    let token_ids = tokens
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| bad("a token id that is not a u32"))?;
    let block_size = fields
        .get(3, "block_size")
        .as_u64()
        .ok_or_else(|| bad("block_size is not a whole number"))?;
    let lora_id = fields.get(4, "lora_id");
    let medium = optional(fields.get(5, "medium"), "medium", |v| {
        v.as_str().map(str::to_owned)
    })?;
    // Index 6 of the array: vLLM's lora_name (a string) or SGLang's metadata (a map).
    let lora_name_or_metadata = match (fields.positional, fields.map) {
        (None, Some(map)) => field(map, "lora_name")
            .filter(|v| !v.is_nil())
            .or_else(|| field(map, "metadata"))
            .unwrap_or(&Value::Nil),
        _ => fields.get(6, "lora_name"),
    };
    let extra_keys = match fields.get(7, "extra_keys") {
        Value::Array(per_block) => per_block.iter().any(|k| !k.is_nil()),
        Value::Nil => false,
        _ => return Err(bad("extra_keys is not an array")),
    };
    Ok(Stored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        keyed_beyond_tokens: !lora_id.is_nil() || !lora_name_or_metadata.is_nil() || extra_keys,
        medium,
        group_idx: optional(fields.get(8, "group_idx"), "group_idx", Value::as_i64)?,
    })
}

fn keys(value: &Value, name: &str) -> Result<Vec<EngineKey>, PayloadError> {
    let Value::Array(items) = value else {
        return Err(bad(format!("{name} is not an array")));
    };
    items
        .iter()
        .map(key)
        .collect::<Option<_>>()
        .ok_or_else(|| bad(format!("{name} holds a hash that is not int or bytes")))
}

/// An int (any sign, up to 64 bits) or a bytes hash, as a key.
pub fn key(value: &Value) -> Option<EngineKey> {
    match value {
        Value::Integer(int) => int
            .as_u64()
            .map(u128::from)
            .or_else(|| int.as_i64().map(|i| (i as i128 as u128) & !BYTES_KEY)),
        Value::Binary(bytes) => Some(xxhash_rust::xxh3::xxh3_128(bytes) | BYTES_KEY),
        _ => None,
    }
}

fn optional<T>(
    value: &Value,
    name: &str,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<Option<T>, PayloadError> {
    match value {
        Value::Nil => Ok(None),
        value => read(value)
            .map(Some)
            .ok_or_else(|| bad(format!("{name} of type {}", type_name(value)))),
    }
}

fn field<'a>(map: &'a Value, name: &str) -> Option<&'a Value> {
    let Value::Map(entries) = map else {
        return None;
    };
    entries
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Nil => "nil",
        Value::Boolean(_) => "boolean",
        Value::Integer(_) => "integer",
        Value::F32(_) | Value::F64(_) => "float",
        Value::String(_) => "string",
        Value::Binary(_) => "bytes",
        Value::Array(_) => "array",
        Value::Map(_) => "map",
        Value::Ext(..) => "extension",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, value).unwrap();
        out
    }

    fn s(text: &str) -> Value {
        Value::from(text)
    }

    fn arr(items: Vec<Value>) -> Value {
        Value::Array(items)
    }

    fn map(entries: Vec<(&str, Value)>) -> Value {
        Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    fn ints(values: &[u64]) -> Value {
        arr(values.iter().map(|&v| Value::from(v)).collect())
    }

    #[test]
    fn the_three_layouts_of_a_batch_decode_alike() {
        let tokens: Vec<u64> = (0..4).collect();
        // vLLM 0.9: [ts, events], BlockStored of 5 fields, BlockRemoved of 1.
        let old = arr(vec![
            Value::F64(1.5),
            arr(vec![
                arr(vec![
                    s("BlockStored"),
                    ints(&[7, 8]),
                    Value::Nil,
                    ints(&tokens),
                    Value::from(2),
                    Value::Nil,
                ]),
                arr(vec![s("BlockRemoved"), ints(&[7])]),
                arr(vec![s("AllBlocksCleared")]),
            ]),
        ]);
        // vLLM 0.10+: [ts, events, dp], with medium (and later fields, here lora_name,
        // extra_keys [nil, nil], group_idx 0).
        let mid = arr(vec![
            Value::F64(1.5),
            arr(vec![
                arr(vec![
                    s("BlockStored"),
                    ints(&[7, 8]),
                    Value::Nil,
                    ints(&tokens),
                    Value::from(2),
                    Value::Nil,
                    s("GPU"),
                    Value::Nil,
                    arr(vec![Value::Nil, Value::Nil]),
                    Value::from(0),
                ]),
                arr(vec![s("BlockRemoved"), ints(&[7]), s("GPU")]),
                arr(vec![s("AllBlocksCleared")]),
            ]),
            Value::from(0),
        ]);
        // vLLM after #42892: tagged maps (and a map batch, accepted too).
        let new = map(vec![
            ("ts", Value::F64(1.5)),
            (
                "events",
                arr(vec![
                    map(vec![
                        ("type", s("BlockStored")),
                        ("block_hashes", ints(&[7, 8])),
                        ("parent_block_hash", Value::Nil),
                        ("token_ids", ints(&tokens)),
                        ("block_size", Value::from(2)),
                        ("medium", s("GPU")),
                        ("kv_cache_spec_kind", s("full_attention")),
                    ]),
                    map(vec![
                        ("type", s("BlockRemoved")),
                        ("block_hashes", ints(&[7])),
                    ]),
                    map(vec![("type", s("AllBlocksCleared"))]),
                ]),
            ),
            ("data_parallel_rank", Value::from(0)),
        ]);
        let batches: Vec<EngineBatch> = [old, mid, new]
            .iter()
            .map(|v| decode_batch(&encode(v)).unwrap())
            .collect();
        for batch in &batches {
            assert_eq!(batch.ts, 1.5);
            let EngineEvent::Stored(stored) = &batch.events[0] else {
                panic!("{batch:?}")
            };
            assert_eq!(stored.block_hashes, vec![7, 8]);
            assert_eq!(stored.parent, None);
            assert_eq!(stored.token_ids, vec![0, 1, 2, 3]);
            assert_eq!(stored.block_size, 2);
            assert!(!stored.keyed_beyond_tokens);
            assert!(matches!(&batch.events[1], EngineEvent::Removed(r) if r.block_hashes == [7]));
            assert_eq!(batch.events[2], EngineEvent::Cleared);
        }
        assert_eq!(batches[0].dp_rank, None);
        assert_eq!(batches[1].dp_rank, Some(0));
    }

    #[test]
    fn hashes_may_be_ints_of_either_sign_or_bytes() {
        let a = key(&Value::from(u64::MAX)).unwrap();
        let b = key(&Value::from(-1i64)).unwrap();
        let c = key(&Value::Binary(vec![1; 32])).unwrap();
        let d = key(&Value::Binary(vec![2; 32])).unwrap();
        assert_eq!(a, u64::MAX as u128);
        let all = [a, b, c, d];
        for (i, x) in all.iter().enumerate() {
            assert!(all[i + 1..].iter().all(|y| y != x), "{all:?}");
        }
        assert_eq!(key(&s("7")), None);
    }

    #[test]
    fn lora_extra_keys_and_metadata_mark_a_store() {
        let stored = |extra: Vec<Value>| {
            let mut items = vec![
                s("BlockStored"),
                ints(&[1]),
                Value::from(9),
                ints(&[1, 2]),
                Value::from(2),
            ];
            items.extend(extra);
            let batch = arr(vec![Value::F64(0.0), arr(vec![arr(items)])]);
            match decode_batch(&encode(&batch)).unwrap().events.remove(0) {
                EngineEvent::Stored(stored) => stored,
                other => panic!("{other:?}"),
            }
        };
        assert!(!stored(vec![Value::Nil, s("GPU")]).keyed_beyond_tokens);
        assert!(stored(vec![Value::from(3)]).keyed_beyond_tokens);
        assert!(stored(vec![Value::Nil, s("GPU"), s("adapter")]).keyed_beyond_tokens);
        let salt = map(vec![("cache_salt", s("tenant-a"))]);
        assert!(stored(vec![Value::Nil, s("GPU"), salt]).keyed_beyond_tokens);
        let extra = arr(vec![arr(vec![s("mm-hash")])]);
        assert!(stored(vec![Value::Nil, s("GPU"), Value::Nil, extra]).keyed_beyond_tokens);
        assert_eq!(stored(vec![]).parent, Some(9));
    }

    #[test]
    fn malformed_payloads_are_errors_unknown_tags_are_not() {
        for bad in [
            vec![0xc1],                                  // never used in MessagePack
            encode(&Value::from(3)),                     // not a batch
            encode(&arr(vec![Value::F64(0.0)])),         // too short
            encode(&arr(vec![s("x"), arr(vec![])])),     // ts not a number
            encode(&arr(vec![Value::F64(0.0), s("x")])), // events not an array
            encode(&arr(vec![Value::F64(0.0), arr(vec![Value::from(1)])])),
            encode(&arr(vec![
                Value::F64(0.0),
                arr(vec![arr(vec![
                    s("BlockStored"),
                    ints(&[1]),
                    Value::Nil,
                    ints(&[1]),
                    s("16"),
                ])]),
            ])),
            encode(&arr(vec![
                Value::F64(0.0),
                arr(vec![arr(vec![s("BlockRemoved"), arr(vec![s("h")])])]),
            ])),
            encode(&arr(vec![
                Value::F64(0.0),
                arr(vec![arr(vec![
                    s("BlockStored"),
                    ints(&[1]),
                    Value::Nil,
                    ints(&[1 << 40]),
                    Value::from(1),
                ])]),
            ])),
        ] {
            assert!(decode_batch(&bad).is_err(), "{bad:?}");
        }
        let mut deep = Value::Nil;
        for _ in 0..100 {
            deep = arr(vec![deep]);
        }
        assert!(decode_batch(&encode(&deep)).is_err());
        let unknown = arr(vec![Value::F64(0.0), arr(vec![arr(vec![s("BlockMoved")])])]);
        let batch = decode_batch(&encode(&unknown)).unwrap();
        assert_eq!(
            batch.events,
            vec![EngineEvent::Unknown("BlockMoved".into())]
        );
    }

    #[test]
    fn frames_of_pub_and_replay() {
        let b = |x: &[u8]| Bytes::copy_from_slice(x);
        let seq = 5u64.to_be_bytes();
        let f = pub_frame(&[b(b"kv"), b(&seq), b(b"p")]).unwrap();
        assert_eq!((f.seq, &f.payload[..]), (5, &b"p"[..]));
        assert_eq!(
            pub_frame(&[b(&seq), b(b"p")]),
            Err(FrameError::FrameCount(2))
        );
        assert_eq!(
            pub_frame(&[b(b""), b(&seq[..4]), b(b"p")]),
            Err(FrameError::SeqLength(4))
        );
        let end = replay_frame(&[b(b""), b(&[0xff; 8]), b(b"")]).unwrap();
        assert_eq!((end.seq, end.payload.len()), (END_SEQ, 0));
        assert_eq!(replay_frame(&[b(&seq), b(b"p")]).unwrap().seq, 5);
    }
}

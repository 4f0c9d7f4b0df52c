//! The full decoder: any event map serde can read, and every error.
//!
//! The plain reader ([`super::plain`]) takes the events every encoder writes; everything else
//! (other key orders are fine there, but unknown keys, signed or wider integers, nested unknown
//! values, and every error) comes here. One pass over the map with a hand-written visitor:
//! keys are matched as borrowed strings (no allocation), values go straight into the typed
//! slots of a [`RawEnvelope`], and the only allocation of a successful decode is the request
//! id. The error path may take a second, lenient pass that only looks for `v` and `kind`, so
//! that a newer version or an unknown kind is reported as such.

use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::raw::{RawEnvelope, WireKind};
use super::reader::value_len;
use super::{
    keys, DecodeEventError, Envelope, EventKind, Outcome, ProgressStage, MAX_NESTING_DEPTH,
    WIRE_VERSION,
};

/// An unknown `kind` longer than this is cut in the error, which ends up in logs.
const MAX_REPORTED_KIND_BYTES: usize = 64;

/// [`decode`](super::decode) through serde alone: every input the plain reader leaves, and every error.
pub(super) fn decode_full(bytes: &[u8], max_len: usize) -> Result<Envelope, DecodeEventError> {
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
    BlockHashes,
    BlockCapacity,
    ParentHash,
    Class,
    Unknown,
}

/// Reads a map key, noting where it ends in the input when the key is borrowed from it: the
/// last key's end is where the map's last value starts, which is all [`decode`](super::decode) measures
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
            "blk" => Key::BlockHashes,
            "bcap" => Key::BlockCapacity,
            "par" => Key::ParentHash,
            "cls" => Key::Class,
            _ => Key::Unknown,
        }
    }
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
pub(super) fn truncated(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

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
    expected: &dyn fmt::Display,
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

/// The wire strings of an enum, as an error lists them: `"a", "b" or "c"`.
struct OneOf(&'static [&'static str]);

impl fmt::Display for OneOf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, name) in self.0.iter().enumerate() {
            let separator = if i == 0 {
                ""
            } else if i + 1 == self.0.len() {
                " or "
            } else {
                ", "
            };
            write!(f, "{separator}\"{name}\"")?;
        }
        Ok(())
    }
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
                    fill(&mut map, &mut raw.version, keys::VERSION, &U16)?;
                    skip_fields |= raw.version != Some(WIRE_VERSION);
                }
                Key::Kind => {
                    fill(&mut map, &mut raw.kind, keys::KIND, &"a string")?;
                    skip_fields |= matches!(raw.kind, Some(WireKind::Unknown(_)));
                }
                Key::Unknown => {
                    map.next_value::<IgnoredAny>()?;
                }
                _ if skip_fields => {
                    map.next_value::<IgnoredAny>()?;
                }
                Key::PublisherId => {
                    fill(&mut map, &mut raw.publisher_id, keys::PUBLISHER_ID, &U64)?
                }
                Key::Sequence => fill(&mut map, &mut raw.sequence, keys::SEQUENCE, &U64)?,
                Key::PublishedAtUs => fill(
                    &mut map,
                    &mut raw.published_at_us,
                    keys::PUBLISHED_AT_US,
                    &U64,
                )?,
                Key::RequestId => fill(
                    &mut map,
                    &mut raw.request_id,
                    keys::REQUEST_ID,
                    &"a UTF-8 string",
                )?,
                Key::WorkerId => fill(&mut map, &mut raw.worker_id, keys::WORKER_ID, &U64)?,
                Key::DpRank => fill(&mut map, &mut raw.dp_rank, keys::DP_RANK, &U32_OR_NIL)?,
                Key::PromptTokens => {
                    fill(&mut map, &mut raw.prompt_tokens, keys::PROMPT_TOKENS, &U32)?
                }
                Key::ExpectedOutputTokens => fill(
                    &mut map,
                    &mut raw.expected_output_tokens,
                    keys::EXPECTED_OUTPUT_TOKENS,
                    &U32_OR_NIL,
                )?,
                Key::Stage => fill(
                    &mut map,
                    &mut raw.stage,
                    keys::STAGE,
                    &OneOf(ProgressStage::WIRE_NAMES),
                )?,
                Key::OutputTokens => {
                    fill(&mut map, &mut raw.output_tokens, keys::OUTPUT_TOKENS, &U32)?
                }
                Key::Outcome => fill(
                    &mut map,
                    &mut raw.outcome,
                    keys::OUTCOME,
                    &OneOf(Outcome::WIRE_NAMES),
                )?,
                Key::CachedTokens => fill(
                    &mut map,
                    &mut raw.cached_tokens,
                    keys::CACHED_TOKENS,
                    &U32_OR_NIL,
                )?,
                Key::Leaving => fill(
                    &mut map,
                    &mut raw.leaving,
                    keys::LEAVING,
                    &"nil or a boolean",
                )?,
                Key::BlockHashes => fill(
                    &mut map,
                    &mut raw.block_hashes,
                    keys::BLOCK_HASHES,
                    &"nil or an array of unsigned integers below 2^64",
                )?,
                Key::BlockCapacity => fill(
                    &mut map,
                    &mut raw.block_capacity,
                    keys::BLOCK_CAPACITY,
                    &U32_OR_NIL,
                )?,
                Key::ParentHash => fill(
                    &mut map,
                    &mut raw.parent_hash,
                    keys::PARENT_HASH,
                    &"nil or an unsigned integer below 2^64",
                )?,
                Key::Class => fill(
                    &mut map,
                    &mut raw.class,
                    keys::CLASS,
                    &"nil or a UTF-8 string",
                )?,
            }
        }
        Ok(())
    }
}

/// Reads the same flat map from any serde format (JSON included). Unlike [`decode`](super::decode), errors are
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
    use super::*;
    use crate::wire::encode;
    use crate::wire::tests::{admitted, assert_malformed, decode_default, reset_with};

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
}

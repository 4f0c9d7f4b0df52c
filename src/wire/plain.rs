//! The plain event, read without serde.
//!
//! Nearly every event a router receives is written the way [`super::encode_into`] writes it:
//! one map of known keys, each once, with scalar values of the expected types. This reader
//! takes exactly those maps, byte by byte, and gives up (`None`) at the first thing it does
//! not expect: an unknown key, a repeated one, a `v` other than 1, an unknown `kind`, a value
//! of another type or out of range, a string that is not UTF-8, a cut. The full decoder then
//! reads the message from the start and gives the answer, errors included, so what this
//! reader accepts is only a question of speed: on every input, [`super::decode`] answers as
//! the full decoder alone would (the differential property test below holds it to that).

use super::raw::{RawEnvelope, WireKind};
use super::reader::Reader;
use super::{EventKind, Outcome, ProgressStage, MAX_BLOCK_HASHES, WIRE_VERSION};

/// The event map at the start of `bytes`, and where it ends; `None` if it is not plain.
pub(super) fn read(bytes: &[u8]) -> Option<(RawEnvelope, usize)> {
    let mut r = Reader::new(bytes);
    let pairs = r.map_len()?;
    let mut raw = RawEnvelope::default();
    for _ in 0..pairs {
        // Every key of this version is a short string.
        match r.fixstr()? {
            b"v" => {
                if r.uint()? != u64::from(WIRE_VERSION) {
                    return None;
                }
                put(&mut raw.version, WIRE_VERSION)?;
            }
            b"pub" => put(&mut raw.publisher_id, r.uint()?)?,
            b"seq" => put(&mut raw.sequence, r.uint()?)?,
            b"ts" => put(&mut raw.published_at_us, r.uint()?)?,
            b"kind" => {
                let kind = EventKind::from_wire_bytes(r.str()?)?;
                put(&mut raw.kind, WireKind::Known(kind))?;
            }
            b"rid" => {
                let rid = std::str::from_utf8(r.str()?).ok()?;
                put(&mut raw.request_id, rid.to_owned())?;
            }
            b"wid" => put(&mut raw.worker_id, r.uint()?)?,
            b"dp" => put(&mut raw.dp_rank, u32_or_nil(&mut r)?)?,
            b"ptok" => put(&mut raw.prompt_tokens, u32(&mut r)?)?,
            b"etok" => put(&mut raw.expected_output_tokens, u32_or_nil(&mut r)?)?,
            b"ctok" => put(&mut raw.cached_tokens, u32_or_nil(&mut r)?)?,
            b"stage" => {
                let stage = ProgressStage::from_wire_bytes(r.str()?)?;
                put(&mut raw.stage, stage)?;
            }
            b"otok" => put(&mut raw.output_tokens, u32(&mut r)?)?,
            b"outcome" => {
                let outcome = Outcome::from_wire_bytes(r.str()?)?;
                put(&mut raw.outcome, outcome)?;
            }
            b"leaving" => put(&mut raw.leaving, bool_or_nil(&mut r)?)?,
            b"blk" => put(&mut raw.block_hashes, hashes_or_nil(&mut r)?)?,
            b"bcap" => put(&mut raw.block_capacity, u32_or_nil(&mut r)?)?,
            b"par" => put(&mut raw.parent_hash, u64_or_nil(&mut r)?)?,
            b"cls" => put(&mut raw.class, str_or_nil(&mut r)?)?,
            _ => return None,
        }
    }
    Some((raw, r.pos()))
}

/// Fills an empty slot; a full one means a repeated key, which is not plain.
fn put<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    match slot {
        Some(_) => None,
        None => {
            *slot = Some(value);
            Some(())
        }
    }
}

/// An integer below 2^32, in any unsigned width.
fn u32(r: &mut Reader<'_>) -> Option<u32> {
    u32::try_from(r.uint()?).ok()
}

/// `Some(None)` for nil.
fn u64_or_nil(r: &mut Reader<'_>) -> Option<Option<u64>> {
    if r.nil() {
        return Some(None);
    }
    r.uint().map(Some)
}

/// `Some(None)` for nil.
fn u32_or_nil(r: &mut Reader<'_>) -> Option<Option<u32>> {
    if r.nil() {
        return Some(None);
    }
    u32(r).map(Some)
}

/// An array of unsigned integers, each in any width; `Some(None)` for nil. More than
/// [`MAX_BLOCK_HASHES`] is left to the full decoder, which gives the error.
fn hashes_or_nil(r: &mut Reader<'_>) -> Option<Option<Vec<u64>>> {
    if r.nil() {
        return Some(None);
    }
    let len = r.array_len()?;
    if len > MAX_BLOCK_HASHES {
        return None;
    }
    let mut hashes = Vec::with_capacity(len);
    for _ in 0..len {
        hashes.push(r.uint()?);
    }
    Some(Some(hashes))
}

/// A UTF-8 string; `Some(None)` for nil.
fn str_or_nil(r: &mut Reader<'_>) -> Option<Option<String>> {
    if r.nil() {
        return Some(None);
    }
    let s = std::str::from_utf8(r.str()?).ok()?;
    Some(Some(s.to_owned()))
}

/// `Some(None)` for nil.
fn bool_or_nil(r: &mut Reader<'_>) -> Option<Option<bool>> {
    if r.nil() {
        return Some(None);
    }
    r.bool().map(Some)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::full::decode_full;
    use super::super::{encode, Admitted, Envelope, LeaseEvent, DEFAULT_MAX_EVENT_BYTES};
    use super::super::{Completed, Outcome, ProgressStage, Progressed, WorkerReset};
    use super::super::{KvCleared, KvRemoved, KvStored};
    use super::*;

    fn admitted() -> Envelope {
        Envelope::new(
            u64::MAX,
            7,
            1_700_000_000_123_456,
            Admitted {
                block_hashes: Vec::new(),
                block_capacity: None,
                class: None,
                request_id: "req-7f3a".into(),
                worker_id: 3,
                dp_rank: 1,
                prompt_tokens: 512,
                expected_output_tokens: Some(128),
                cached_tokens: Some(64),
            },
        )
    }

    #[test]
    fn every_kind_the_encoder_writes_is_plain_and_read_whole() {
        let events: [LeaseEvent; 10] = [
            admitted().event,
            KvStored {
                worker_id: 1 << 40,
                dp_rank: 3,
                parent_hash: Some(u64::MAX),
                block_hashes: vec![0, 1 << 63, u64::MAX],
            }
            .into(),
            KvStored {
                worker_id: 1,
                dp_rank: 0,
                parent_hash: None,
                block_hashes: vec![7; MAX_BLOCK_HASHES],
            }
            .into(),
            KvRemoved {
                worker_id: 2,
                dp_rank: 1,
                block_hashes: vec![42],
            }
            .into(),
            KvCleared {
                worker_id: 2,
                dp_rank: None,
            }
            .into(),
            KvCleared {
                worker_id: 2,
                dp_rank: Some(5),
            }
            .into(),
            Progressed {
                request_id: "r".into(),
                worker_id: 70_000,
                dp_rank: 300,
                stage: ProgressStage::PrefillDone,
                output_tokens: u32::MAX,
            }
            .into(),
            Completed {
                request_id: "é".repeat(40),
                worker_id: 1 << 40,
                dp_rank: 0,
                outcome: Outcome::Cancelled,
            }
            .into(),
            WorkerReset {
                worker_id: 9,
                dp_rank: None,
                leaving: true,
            }
            .into(),
            WorkerReset {
                worker_id: 9,
                dp_rank: Some(2),
                leaving: false,
            }
            .into(),
        ];
        for event in events {
            let envelope = Envelope::new(1, 2, 3, event);
            let bytes = encode(&envelope).unwrap();
            let (raw, end) = read(&bytes).expect("plain");
            assert_eq!(end, bytes.len());
            assert_eq!(raw.validate(false).unwrap(), envelope);
        }
    }

    #[test]
    fn anything_unexpected_is_left_to_the_full_decoder() {
        let plain = encode(&admitted()).unwrap();
        let mut unknown_key = plain.clone();
        unknown_key[0] += 1;
        unknown_key.extend_from_slice(&[0xa1, b'x', 0x01]);
        let mut repeated = plain.clone();
        repeated[0] += 1;
        repeated.extend_from_slice(&[0xa3, b's', b'e', b'q', 0x02]);
        let swap = |from: &[u8], to: &[u8]| {
            let at = plain.windows(from.len()).position(|w| w == from).unwrap();
            [&plain[..at], to, &plain[at + from.len()..]].concat()
        };
        let cases = [
            unknown_key,
            repeated,
            swap(&[0xa1, b'v', 0x01], &[0xa1, b'v', 0x02]),
            swap(&[0xa1, b'v', 0x01], &[0xa1, b'v', 0xd0, 0x01]),
            swap(b"\xa8admitted", b"\xa8admittee"),
            swap(
                &[0xa4, b'p', b't', b'o', b'k'],
                &[0xa4, b'p', b't', b'o', b'x'],
            ),
            swap(
                &[0xa3, b'w', b'i', b'd', 0x03],
                &[0xa3, b'w', b'i', b'd', 0xc0],
            ),
            swap(b"\xa8req-7f3a", b"\xc4\x08req-7f3a"),
            swap(b"\xa8req-7f3a", b"\xa8req-7f\xff\xfe"),
            swap(
                &[0xa4, b'e', b't', b'o', b'k', 0xcc, 0x80],
                &[0xa4, b'e', b't', b'o', b'k', 0xcf, 0, 0, 0, 1, 0, 0, 0, 0],
            ),
            plain[..plain.len() - 1].to_vec(),
            [&[0x90][..], &plain[1..]].concat(),
        ];
        for (i, case) in cases.iter().enumerate() {
            assert!(read(case).is_none(), "case {i}: {case:x?}");
            // And the full decoder's answer is what `decode` gives.
            assert_eq!(
                super::super::decode(case, DEFAULT_MAX_EVENT_BYTES),
                decode_full(case, DEFAULT_MAX_EVENT_BYTES),
                "case {i}"
            );
        }
    }

    #[test]
    fn integers_of_every_unsigned_width_and_the_widest_strings_are_plain() {
        let mut bytes = Vec::new();
        rmp::encode::write_map_len(&mut bytes, 8).unwrap();
        let mut entry = |key: &str, write: &dyn Fn(&mut Vec<u8>)| {
            rmp::encode::write_str(&mut bytes, key).unwrap();
            write(&mut bytes);
        };
        entry("v", &|b| rmp::encode::write_u64(b, 1).unwrap());
        entry("pub", &|b| rmp::encode::write_u8(b, 200).unwrap());
        entry("seq", &|b| rmp::encode::write_u16(b, 2).unwrap());
        entry("ts", &|b| rmp::encode::write_u32(b, 3).unwrap());
        entry("kind", &|b| rmp::encode::write_str(b, "completed").unwrap());
        entry("rid", &|b| {
            rmp::encode::write_str(b, &"r".repeat(300)).unwrap()
        });
        entry("wid", &|b| rmp::encode::write_u64(b, u64::MAX).unwrap());
        entry("dp", &|b| {
            rmp::encode::write_u64(b, u64::from(u32::MAX)).unwrap()
        });
        let (raw, end) = read(&bytes).expect("plain");
        assert_eq!(end, bytes.len());
        assert_eq!(raw.publisher_id, Some(200));
        assert_eq!(raw.sequence, Some(2));
        assert_eq!(raw.published_at_us, Some(3));
        assert_eq!(raw.worker_id, Some(u64::MAX));
        assert_eq!(raw.dp_rank, Some(Some(u32::MAX)));
        assert_eq!(raw.request_id.as_deref().map(str::len), Some(300));
    }

    /// One MessagePack value of many types, the known strings among them.
    fn value() -> impl Strategy<Value = Vec<u8>> {
        let strings = prop::sample::select(vec![
            "admitted",
            "progressed",
            "completed",
            "worker_reset",
            "batch",
            "prefill_done",
            "decoding",
            "finished",
            "cancelled",
            "failed",
            "",
            "r-1",
        ]);
        prop_oneof![
            any::<u64>().prop_map(|n| {
                let mut b = Vec::new();
                rmp::encode::write_uint(&mut b, n).unwrap();
                b
            }),
            (0u64..4).prop_map(|n| {
                let mut b = Vec::new();
                rmp::encode::write_uint(&mut b, n).unwrap();
                b
            }),
            (0u8..4, 0u64..300).prop_map(|(width, n)| {
                let mut b = Vec::new();
                match width {
                    0 => rmp::encode::write_u8(&mut b, n as u8).unwrap(),
                    1 => rmp::encode::write_u16(&mut b, n as u16).unwrap(),
                    2 => rmp::encode::write_u32(&mut b, n as u32).unwrap(),
                    _ => rmp::encode::write_u64(&mut b, n).unwrap(),
                }
                b
            }),
            any::<i64>().prop_map(|n| {
                let mut b = Vec::new();
                rmp::encode::write_sint(&mut b, n).unwrap();
                b
            }),
            Just(vec![0xc0]),
            Just(vec![0xc2]),
            Just(vec![0xc3]),
            strings.clone().prop_map(|s| {
                let mut b = Vec::new();
                rmp::encode::write_str(&mut b, s).unwrap();
                b
            }),
            strings.prop_map(|s| {
                let mut b = vec![0xd9, s.len() as u8];
                b.extend_from_slice(s.as_bytes());
                b
            }),
            prop::collection::vec(any::<u8>(), 0..6).prop_map(|raw| {
                let mut b = vec![0xa0 | raw.len() as u8];
                b.extend_from_slice(&raw);
                b
            }),
            prop::collection::vec(any::<u8>(), 0..4).prop_map(|raw| {
                let mut b = Vec::new();
                rmp::encode::write_bin(&mut b, &raw).unwrap();
                b
            }),
            Just(vec![0x91, 0x01]),
            Just(vec![0xcb, 0, 0, 0, 0, 0, 0, 0, 0]),
        ]
    }

    fn key() -> impl Strategy<Value = Vec<u8>> {
        let mut names: Vec<&str> = super::super::keys::ALL.to_vec();
        names.extend(["x", "events", "V"]);
        prop_oneof![
            9 => prop::sample::select(names).prop_map(|k| {
                let mut b = Vec::new();
                rmp::encode::write_str(&mut b, k).unwrap();
                b
            }),
            1 => prop::sample::select(vec!["v", "rid", "kind"]).prop_map(|k| {
                let mut b = vec![0xd9, k.len() as u8];
                b.extend_from_slice(k.as_bytes());
                b
            }),
            1 => Just(vec![0x01]),
        ]
    }

    /// A map header of the true count or a wrong one, in any width.
    fn map(pairs: Vec<(Vec<u8>, Vec<u8>)>, header: u8, lie: i8, tail: Vec<u8>) -> Vec<u8> {
        let count = (pairs.len() as i64 + i64::from(lie)).max(0) as u32;
        let mut b = Vec::new();
        match header {
            0 => drop(rmp::encode::write_map_len(&mut b, count)),
            1 => {
                b.push(0xde);
                b.extend_from_slice(&(count as u16).to_be_bytes());
            }
            _ => {
                b.push(0xdf);
                b.extend_from_slice(&count.to_be_bytes());
            }
        }
        for (k, v) in pairs {
            b.extend(k);
            b.extend(v);
        }
        b.extend(tail);
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

        /// `decode` (this reader first) answers as the full decoder alone, on maps of known
        /// and unknown keys with values of every type, wrong counts and trailing bytes.
        #[test]
        fn decode_answers_as_the_full_decoder(
            pairs in prop::collection::vec((key(), value()), 0..14),
            header in 0u8..3,
            lie in prop_oneof![8 => Just(0i8), 1 => -2i8..3],
            tail in prop_oneof![8 => Just(Vec::new()), 1 => prop::collection::vec(any::<u8>(), 1..3)],
        ) {
            let bytes = map(pairs, header, lie, tail);
            prop_assert_eq!(
                super::super::decode(&bytes, DEFAULT_MAX_EVENT_BYTES),
                decode_full(&bytes, DEFAULT_MAX_EVENT_BYTES)
            );
        }

        /// The same on valid events of every kind, cut or with one byte changed.
        #[test]
        fn decode_answers_as_the_full_decoder_on_damaged_events(
            kind in 0u8..4,
            seq in 1u64..u64::MAX,
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
            cut in any::<bool>(),
        ) {
            let event: LeaseEvent = match kind {
                0 => admitted().event,
                1 => Progressed { request_id: "r-1".into(), worker_id: 3, dp_rank: 0, stage: ProgressStage::Decoding, output_tokens: 9 }.into(),
                2 => Completed { request_id: "r-1".into(), worker_id: 3, dp_rank: 0, outcome: Outcome::Failed }.into(),
                _ => WorkerReset { worker_id: 3, dp_rank: Some(1), leaving: true }.into(),
            };
            let mut bytes = encode(&Envelope::new(5, seq, 6, event)).unwrap();
            let at = at.index(bytes.len());
            if cut {
                bytes.truncate(at);
            } else {
                bytes[at] = byte;
            }
            prop_assert_eq!(
                super::super::decode(&bytes, DEFAULT_MAX_EVENT_BYTES),
                decode_full(&bytes, DEFAULT_MAX_EVENT_BYTES)
            );
        }
    }
}

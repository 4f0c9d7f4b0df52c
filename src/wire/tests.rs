//! Tests of the contract through its entry points: encode, decode, and what each refuses.

use super::*;

pub(super) fn admitted() -> Envelope {
    Envelope::new(
        0xdead_beef_0000_0001,
        1,
        1_700_000_000_123_456,
        Admitted {
            block_hashes: Vec::new(),
            block_capacity: None,
            class: None,
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
        // Every optional field of `admitted` at once.
        Envelope::new(
            9,
            1,
            2,
            Admitted {
                block_hashes: vec![0, 1 << 63, u64::MAX],
                block_capacity: Some(25_000),
                class: Some("premium".into()),
                request_id: "req-full".into(),
                worker_id: 3,
                dp_rank: 1,
                prompt_tokens: 4096,
                expected_output_tokens: Some(64),
                cached_tokens: Some(2048),
            },
        ),
        Envelope::new(
            9,
            2,
            3,
            Admitted {
                block_hashes: Vec::new(),
                block_capacity: None,
                class: None,
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
        Envelope::new(
            9,
            9,
            9,
            KvStored {
                worker_id: 7,
                dp_rank: 2,
                parent_hash: Some(u64::MAX),
                block_hashes: vec![1, u64::MAX, 1 << 40],
            },
        ),
        Envelope::new(
            9,
            10,
            9,
            KvStored {
                worker_id: 7,
                dp_rank: 0,
                parent_hash: None,
                block_hashes: (0..MAX_BLOCK_HASHES as u64).map(|i| i << 50).collect(),
            },
        ),
        Envelope::new(
            9,
            11,
            9,
            KvRemoved {
                worker_id: 7,
                dp_rank: 2,
                block_hashes: vec![u64::MAX],
            },
        ),
        Envelope::new(
            9,
            12,
            9,
            KvCleared {
                worker_id: 7,
                dp_rank: None,
            },
        ),
        Envelope::new(
            9,
            13,
            9,
            KvCleared {
                worker_id: 7,
                dp_rank: Some(3),
            },
        ),
    ]
}

/// The KV kinds' rules: blocks 1 to 256 where they are required, a rank where one is, and
/// neither an encoder nor a decoder lets a wrong count through.
#[test]
fn kv_events_need_their_blocks_and_rank() {
    let kv = |fields: fn(Mp) -> Mp, n: u8| {
        fields(
            Mp::default()
                .map(6 + n)
                .kv("v", 1)
                .kv("pub", 1)
                .kv("seq", 1)
                .kv("ts", 1)
                .kv("wid", 7),
        )
        .0
    };
    // Missing blocks, an empty array, a nil rank, a missing rank: each malformed.
    type Fields = fn(Mp) -> Mp;
    let cases: [(Fields, u8, &str); 5] = [
        (
            |m| m.ks("kind", "kv_stored").kv("dp", 0),
            1,
            "missing field `blk`",
        ),
        (
            |m| m.ks("kind", "kv_removed").kv("dp", 0),
            1,
            "missing field `blk`",
        ),
        (
            |m| {
                m.ks("kind", "kv_stored")
                    .kv("dp", 0)
                    .str("blk")
                    .raw(&[0x90])
            },
            2,
            "holds 0 hashes",
        ),
        (
            |m| {
                m.ks("kind", "kv_removed")
                    .str("dp")
                    .raw(&[0xc0])
                    .str("blk")
                    .raw(&[0x91, 1])
            },
            2,
            "field `dp` is nil",
        ),
        (
            |m| m.ks("kind", "kv_stored").str("blk").raw(&[0x91, 1]),
            1,
            "missing field `dp`",
        ),
    ];
    for (fields, n, message) in cases {
        match decode_default(&kv(fields, n)) {
            Err(DecodeEventError::Malformed(m)) => assert!(m.contains(message), "{m}"),
            other => panic!("{message}: {other:?}"),
        }
    }
    // 257 hashes: malformed.
    let mut many = kv(|m| m.ks("kind", "kv_stored").kv("dp", 0).str("blk"), 2);
    many.extend_from_slice(&[0xdc, 0x01, 0x01]);
    many.extend(std::iter::repeat_n(1u8, 257));
    assert!(matches!(
        decode(&many, 1 << 20),
        Err(DecodeEventError::Malformed(m)) if m.contains("holds 257 hashes")
    ));
    // A clear without a rank is every rank; one with a nil parent is a root chain.
    let cleared = kv(|m| m.ks("kind", "kv_cleared"), 0);
    assert_eq!(
        decode_default(&cleared).unwrap().event,
        LeaseEvent::KvCleared(KvCleared {
            worker_id: 7,
            dp_rank: None
        })
    );
    let root = kv(
        |m| {
            m.ks("kind", "kv_stored")
                .kv("dp", 1)
                .str("blk")
                .raw(&[0x91, 5])
                .str("par")
                .raw(&[0xc0])
        },
        3,
    );
    assert_eq!(
        decode_default(&root).unwrap().event,
        LeaseEvent::KvStored(KvStored {
            worker_id: 7,
            dp_rank: 1,
            parent_hash: None,
            block_hashes: vec![5]
        })
    );
    // The encoder refuses what the decoder would.
    for blocks in [0, MAX_BLOCK_HASHES + 1] {
        let event = KvRemoved {
            worker_id: 7,
            dp_rank: 0,
            block_hashes: vec![1; blocks],
        };
        assert!(matches!(
            encode(&Envelope::new(1, 1, 1, event)),
            Err(EncodeEventError::BlockCount { blocks: b, .. }) if b == blocks
        ));
    }
}

/// A small MessagePack writer for hand-made bodies.
#[derive(Default)]
pub(super) struct Mp(pub(super) Vec<u8>);

impl Mp {
    pub(super) fn map(mut self, len: u8) -> Self {
        assert!(len < 16);
        self.0.push(0x80 | len);
        self
    }
    pub(super) fn str(mut self, s: &str) -> Self {
        assert!(s.len() < 32);
        self.0.push(0xa0 | s.len() as u8);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    pub(super) fn uint(mut self, v: u64) -> Self {
        rmp_serde::encode::write(&mut self.0, &v).unwrap();
        self
    }
    pub(super) fn raw(mut self, bytes: &[u8]) -> Self {
        self.0.extend_from_slice(bytes);
        self
    }
    pub(super) fn kv(self, k: &str, v: u64) -> Self {
        self.str(k).uint(v)
    }
    pub(super) fn ks(self, k: &str, v: &str) -> Self {
        self.str(k).str(v)
    }
}

pub(super) fn decode_default(bytes: &[u8]) -> Result<Envelope, DecodeEventError> {
    decode(bytes, DEFAULT_MAX_EVENT_BYTES)
}

/// The full decoder alone reads every field of every sample (it answers whatever the plain
/// reader leaves, so it must know each key too).
#[test]
fn the_full_decoder_reads_every_field() {
    for envelope in samples() {
        let bytes = encode(&envelope).unwrap();
        assert_eq!(
            full::decode_full(&bytes, bytes.len()).unwrap(),
            envelope,
            "{envelope:?}"
        );
    }
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
    let stored = KvStored {
        worker_id: 5,
        dp_rank: 3,
        parent_hash: None,
        block_hashes: vec![1],
    };
    assert_eq!(stored.worker(), WorkerWithDpRank::new(5, 3));
    let removed = KvRemoved {
        worker_id: 6,
        dp_rank: 4,
        block_hashes: vec![1],
    };
    assert_eq!(removed.worker(), WorkerWithDpRank::new(6, 4));
    let reset = LeaseEvent::from(one);
    assert_eq!(reset.worker_id(), 7);
    assert_eq!(reset.request_id(), None);
    assert_eq!(reset.worker(), None);
    assert_eq!(
        EventKind::ALL.map(EventKind::as_str),
        [
            "admitted",
            "progressed",
            "completed",
            "worker_reset",
            "kv_stored",
            "kv_removed",
            "kv_cleared"
        ]
    );
    // The applied counters are indexed by declaration order, which ALL follows.
    for (i, kind) in EventKind::ALL.into_iter().enumerate() {
        assert_eq!(kind as usize, i);
    }
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
                block_hashes: Vec::new(),
                block_capacity: None,
                class: None,
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

/// The size limit is inclusive on both decoders: an event of exactly the limit that the plain
/// reader leaves to the full decoder (an unknown key) is read, one byte more is refused.
#[test]
fn the_size_limit_is_inclusive_for_the_full_decoder_too() {
    let mut bytes = encode(&admitted()).unwrap();
    bytes[0] += 1;
    rmp::encode::write_str(&mut bytes, "newer").unwrap();
    rmp::encode::write_u8(&mut bytes, 1).unwrap();
    assert!(plain::read(&bytes).is_none(), "left to the full decoder");
    assert_eq!(decode(&bytes, bytes.len()).unwrap(), admitted());
    assert_eq!(
        decode(&bytes, bytes.len() - 1),
        Err(DecodeEventError::Oversized {
            len: bytes.len(),
            max: bytes.len() - 1
        })
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

pub(super) fn assert_malformed(bytes: &[u8], needle: &str) {
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

pub(super) fn reset_with(extra: impl FnOnce(Mp) -> Mp, len: u8) -> Vec<u8> {
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
    // The error lists the values a field takes (a stage, an outcome).
    assert_malformed(&bytes, r#""finished", "cancelled" or "failed""#);
    let bytes = reset_with(
        |m| {
            m.ks("kind", "progressed")
                .kv("wid", 1)
                .kv("dp", 0)
                .ks("rid", "r")
                .kv("otok", 1)
                .ks("stage", "done")
        },
        10,
    );
    assert_malformed(&bytes, r#"field `stage`"#);
    assert_malformed(&bytes, r#""prefill_done" or "decoding""#);
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
        let mut bytes = reset_with(|m| m.ks("kind", "worker_reset").kv("wid", 7).str("deep"), 7);
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
    assert_eq!(super::full::truncated(&"é".repeat(40), 5), "éé...");
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

/// `cls` (1.4) on `admitted`: a string, nil or absent (none); any other type is malformed
/// and named. Both readers agree, and the plain reader takes the canonical encoding. A
/// router before 1.4 reads `cls` as an unknown key, skipped by its full decoder (its plain
/// reader gives up at the key it does not know): the same event, with no class. That is
/// shown here with `xcls`, a key this version does not know either.
#[test]
fn the_class_of_an_admission() {
    let admitted_with = |extra: fn(Mp) -> Mp| {
        extra(
            Mp::default()
                .map(10)
                .kv("v", 1)
                .kv("pub", 1)
                .kv("seq", 1)
                .kv("ts", 1)
                .ks("kind", "admitted")
                .ks("rid", "r")
                .kv("wid", 3)
                .kv("dp", 0)
                .kv("ptok", 8),
        )
        .0
    };
    let class_of = |bytes: &[u8]| match decode_default(bytes).unwrap().event {
        LeaseEvent::Admitted(a) => a.class,
        other => panic!("{other:?}"),
    };
    let premium = admitted_with(|m| m.ks("cls", "premium"));
    assert_eq!(class_of(&premium).as_deref(), Some("premium"));
    assert!(plain::read(&premium).is_some(), "the plain reader takes it");
    assert_eq!(
        class_of(&admitted_with(|m| m.str("cls").raw(&[0xc0]))),
        None
    );
    assert_eq!(
        class_of(&admitted_with(|m| m.ks("xcls", "premium"))),
        None,
        "an unknown key is skipped: what a router before 1.4 does with cls"
    );
    let bytes = admitted_with(|m| m.kv("cls", 7));
    assert_malformed(&bytes, "field `cls` must be nil or a UTF-8 string");
    // The encoder writes it after bcap, and round-trips it.
    let mut envelope = admitted();
    if let LeaseEvent::Admitted(a) = &mut envelope.event {
        a.class = Some("premium".into());
    }
    let bytes = encode(&envelope).unwrap();
    assert!(bytes.ends_with(b"\xa3cls\xa7premium"), "{bytes:02x?}");
    assert_eq!(decode_default(&bytes).unwrap(), envelope);
}

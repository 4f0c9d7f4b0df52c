//! The wire contract as other languages see it: the golden fixtures in `schemas/fixtures/`, the
//! JSON Schema in `schemas/`, encodings as Python or Go publishers produce them, and the
//! figures `schemas/README.md` states.
//!
//! Regenerate the golden fixtures (after an intended change of the encoding) with
//! `REGENERATE_FIXTURES=1 cargo test --test wire_contract`, then review the diff.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use lease_router::wire::{
    self, keys, Admitted, BatchWriter, Completed, DecodeEventError, Envelope, EventKind, KvCleared,
    KvRemoved, KvStored, LeaseEvent, Message, MessageLimits, Outcome, ProgressStage, Progressed,
    WorkerReset, BATCH_KIND, DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_EVENT_BYTES, EVENTS_KEY,
    WIRE_VERSION,
};
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::Value;

use common::Mp;

const PUBLISHER_ID: u64 = 0x8f3a_6c2e_91d4_b705;
const TS: u64 = 1_700_000_000_123_456;

fn schemas_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas")
}

fn fixtures_dir() -> PathBuf {
    schemas_dir().join("fixtures")
}

/// The golden fixtures: one per kind, plus the optional fields left out.
fn golden() -> Vec<(&'static str, Envelope)> {
    vec![
        (
            "admitted",
            Envelope::new(
                PUBLISHER_ID,
                1,
                TS,
                Admitted {
                    block_hashes: Vec::new(),
                    block_capacity: None,
                    class: None,
                    request_id: "req-7f3a".into(),
                    worker_id: 3,
                    dp_rank: 1,
                    prompt_tokens: 512,
                    expected_output_tokens: Some(128),
                    cached_tokens: None,
                },
            ),
        ),
        (
            "admitted_no_estimate",
            Envelope::new(
                PUBLISHER_ID,
                2,
                TS + 250,
                Admitted {
                    block_hashes: Vec::new(),
                    block_capacity: None,
                    class: None,
                    request_id: "req-8e21".into(),
                    worker_id: 3,
                    dp_rank: 0,
                    prompt_tokens: 70_000,
                    expected_output_tokens: None,
                    cached_tokens: None,
                },
            ),
        ),
        (
            "progressed",
            Envelope::new(
                PUBLISHER_ID,
                3,
                TS + 41_000,
                Progressed {
                    request_id: "req-7f3a".into(),
                    worker_id: 3,
                    dp_rank: 1,
                    stage: ProgressStage::Decoding,
                    output_tokens: 17,
                },
            ),
        ),
        (
            "completed",
            Envelope::new(
                PUBLISHER_ID,
                4,
                TS + 950_000,
                Completed {
                    request_id: "req-7f3a".into(),
                    worker_id: 3,
                    dp_rank: 1,
                    outcome: Outcome::Finished,
                },
            ),
        ),
        (
            "worker_reset",
            Envelope::new(
                PUBLISHER_ID,
                5,
                TS + 2_000_000,
                WorkerReset {
                    worker_id: 3,
                    dp_rank: None,
                    leaving: false,
                },
            ),
        ),
        (
            "worker_reset_leaving",
            Envelope::new(
                PUBLISHER_ID,
                7,
                TS + 3_000_000,
                WorkerReset {
                    worker_id: 3,
                    dp_rank: None,
                    leaving: true,
                },
            ),
        ),
        (
            "admitted_cached",
            Envelope::new(
                PUBLISHER_ID,
                8,
                TS + 3_000_100,
                Admitted {
                    block_hashes: Vec::new(),
                    block_capacity: None,
                    class: None,
                    request_id: "req-9c04".into(),
                    worker_id: 3,
                    dp_rank: 1,
                    prompt_tokens: 4096,
                    expected_output_tokens: Some(256),
                    cached_tokens: Some(3584),
                },
            ),
        ),
        (
            "admitted_blocks",
            Envelope::new(
                PUBLISHER_ID,
                9,
                TS + 3_000_200,
                Admitted {
                    // The tokens 100 to 139: two full blocks of 16 (the 8 after them are
                    // not hashed), as schemas/README.md's example.
                    block_hashes: lease_router::block_hashes(&(100..140).collect::<Vec<_>>(), 16),
                    block_capacity: Some(25_000),
                    class: None,
                    request_id: "req-b10c".into(),
                    worker_id: 3,
                    dp_rank: 0,
                    prompt_tokens: 40,
                    expected_output_tokens: Some(64),
                    cached_tokens: Some(16),
                },
            ),
        ),
        (
            // Wire 1.4: the request's admission class.
            "admitted_class",
            Envelope::new(
                PUBLISHER_ID,
                15,
                TS + 3_100_000,
                Admitted {
                    block_hashes: Vec::new(),
                    block_capacity: None,
                    class: Some("premium".into()),
                    request_id: "req-c1a5".into(),
                    worker_id: 3,
                    dp_rank: 0,
                    prompt_tokens: 256,
                    expected_output_tokens: Some(32),
                    cached_tokens: None,
                },
            ),
        ),
        (
            "worker_reset_rank",
            Envelope::new(
                PUBLISHER_ID,
                6,
                TS + 2_000_001,
                WorkerReset {
                    worker_id: 3,
                    dp_rank: Some(1),
                    leaving: false,
                },
            ),
        ),
        (
            "kv_stored",
            Envelope::new(
                PUBLISHER_ID,
                10,
                TS + 3_000_300,
                KvStored {
                    worker_id: 3,
                    dp_rank: 0,
                    // The tokens 100 to 147: the third block after the two of
                    // `admitted_blocks`, its parent their last.
                    parent_hash: Some(
                        lease_router::block_hashes(&(100..132).collect::<Vec<_>>(), 16)[1],
                    ),
                    block_hashes: lease_router::block_hashes(&(100..148).collect::<Vec<_>>(), 16)
                        [2..]
                        .to_vec(),
                },
            ),
        ),
        (
            "kv_stored_root",
            Envelope::new(
                PUBLISHER_ID,
                11,
                TS + 3_000_310,
                KvStored {
                    worker_id: 3,
                    dp_rank: 0,
                    parent_hash: None,
                    block_hashes: lease_router::block_hashes(&(100..132).collect::<Vec<_>>(), 16),
                },
            ),
        ),
        (
            "kv_removed",
            Envelope::new(
                PUBLISHER_ID,
                12,
                TS + 3_000_400,
                KvRemoved {
                    worker_id: 3,
                    dp_rank: 0,
                    block_hashes: lease_router::block_hashes(&(100..148).collect::<Vec<_>>(), 16)
                        [2..]
                        .to_vec(),
                },
            ),
        ),
        (
            "kv_cleared",
            Envelope::new(
                PUBLISHER_ID,
                13,
                TS + 3_000_500,
                KvCleared {
                    worker_id: 3,
                    dp_rank: Some(0),
                },
            ),
        ),
        (
            "kv_cleared_all",
            Envelope::new(
                PUBLISHER_ID,
                14,
                TS + 3_000_600,
                KvCleared {
                    worker_id: 3,
                    dp_rank: None,
                },
            ),
        ),
    ]
}

/// The golden batch (1.2): every kind, one publisher, `seq` increasing, one worker.
fn golden_batch() -> Vec<Envelope> {
    vec![
        Envelope::new(
            PUBLISHER_ID,
            21,
            TS + 5_000_000,
            Admitted {
                block_hashes: Vec::new(),
                block_capacity: None,
                class: None,
                request_id: "req-b001".into(),
                worker_id: 3,
                dp_rank: 0,
                prompt_tokens: 1200,
                expected_output_tokens: None,
                cached_tokens: Some(1024),
            },
        ),
        Envelope::new(
            PUBLISHER_ID,
            22,
            TS + 5_000_150,
            Progressed {
                request_id: "req-9c04".into(),
                worker_id: 3,
                dp_rank: 1,
                stage: ProgressStage::PrefillDone,
                output_tokens: 1,
            },
        ),
        Envelope::new(
            PUBLISHER_ID,
            23,
            TS + 5_000_400,
            Completed {
                request_id: "req-8e21".into(),
                worker_id: 3,
                dp_rank: 0,
                outcome: Outcome::Cancelled,
            },
        ),
        Envelope::new(
            PUBLISHER_ID,
            24,
            TS + 5_000_900,
            WorkerReset {
                worker_id: 3,
                dp_rank: Some(1),
                leaving: true,
            },
        ),
    ]
}

/// The name of the golden batch fixture.
const BATCH_FIXTURE: &str = "batch";

/// The JSON view of a batch, keys in the canonical order: `{"v": 1, "kind": "batch",
/// "events": [event, ...]}`, each event as its own JSON view.
struct BatchJson<'a>(&'a [Envelope]);

impl Serialize for BatchJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(3))?;
        map.serialize_entry(keys::VERSION, &WIRE_VERSION)?;
        map.serialize_entry(keys::KIND, BATCH_KIND)?;
        map.serialize_entry(EVENTS_KEY, self.0)?;
        map.end()
    }
}

fn write_fixture(dir: &Path, name: &str, bytes: &[u8], json: &impl Serialize) {
    fs::write(dir.join(format!("{name}.msgpack")), bytes).unwrap();
    let mut json = serde_json::to_string_pretty(json).unwrap();
    json.push('\n');
    fs::write(dir.join(format!("{name}.json")), json).unwrap();
}

fn regenerate() {
    let dir = fixtures_dir();
    fs::create_dir_all(&dir).unwrap();
    for (name, envelope) in golden() {
        write_fixture(&dir, name, &wire::encode(&envelope).unwrap(), &envelope);
    }
    let batch = golden_batch();
    let bytes = wire::encode_batch(&batch).unwrap();
    write_fixture(&dir, BATCH_FIXTURE, &bytes, &BatchJson(&batch));
}

fn read_json(path: &Path) -> Value {
    let text = fs::read_to_string(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

/// The `<name>` of every `<name>.msgpack` in `dir`.
fn fixture_names(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap_or_else(|err| panic!("{}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "msgpack"))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// What one fixture message decodes to.
#[derive(Debug, PartialEq)]
enum Decoded {
    Event(Envelope),
    Batch(Vec<Envelope>),
}

impl Decoded {
    fn json(&self) -> Value {
        match self {
            Decoded::Event(envelope) => serde_json::to_value(envelope).unwrap(),
            Decoded::Batch(events) => serde_json::to_value(BatchJson(events)).unwrap(),
        }
    }

    /// The envelope(s) a JSON view stands for: a batch when its `kind` is `"batch"`.
    fn from_json(json: Value) -> Self {
        if json[keys::KIND] == BATCH_KIND {
            let events = json[EVENTS_KEY].clone();
            Decoded::Batch(serde_json::from_value(events).unwrap())
        } else {
            Decoded::Event(serde_json::from_value(json).unwrap())
        }
    }
}

/// Reads one message as a router does, with the default limits; every event must be good.
fn decode_message(name: &str, bytes: &[u8]) -> Decoded {
    match wire::decode_message(bytes, MessageLimits::default()) {
        Message::Event(Ok(envelope)) => Decoded::Event(envelope),
        Message::Batch(events) => Decoded::Batch(
            events
                .map(|event| event.unwrap_or_else(|err| panic!("{name}: an event: {err}")))
                .collect(),
        ),
        Message::Event(Err(err)) => panic!("{name}: {err}"),
        Message::Refused { events, error } => panic!("{name}: {events} events refused: {error}"),
    }
}

/// Decodes `<name>.msgpack` and checks it against `<name>.json`, both ways.
fn check_against_json(dir: &Path, name: &str) -> (Vec<u8>, Decoded) {
    let bytes = fs::read(dir.join(format!("{name}.msgpack"))).unwrap();
    let decoded = decode_message(name, &bytes);
    if let Decoded::Event(envelope) = &decoded {
        // A single event reads the same through the single-event decoder.
        let single = wire::decode(&bytes, DEFAULT_MAX_EVENT_BYTES)
            .unwrap_or_else(|err| panic!("{name}.msgpack: {err}"));
        assert_eq!(&single, envelope, "{name}");
    }
    let json = read_json(&dir.join(format!("{name}.json")));
    assert_eq!(
        decoded.json(),
        json,
        "{name}: decoded msgpack differs from the JSON"
    );
    assert_eq!(
        Decoded::from_json(json),
        decoded,
        "{name}: JSON and msgpack disagree"
    );
    (bytes, decoded)
}

#[test]
fn golden_fixtures_decode_and_reencode_byte_for_byte() {
    if std::env::var_os("REGENERATE_FIXTURES").is_some_and(|v| v == "1") {
        regenerate();
    }
    let dir = fixtures_dir();
    let expected: BTreeSet<String> = golden()
        .iter()
        .map(|(n, _)| n.to_string())
        .chain([BATCH_FIXTURE.to_owned()])
        .collect();
    assert_eq!(
        fixture_names(&dir),
        expected,
        "fixtures on disk differ from the generator; run REGENERATE_FIXTURES=1"
    );
    let mut kinds = BTreeSet::new();
    for (name, envelope) in golden() {
        let (bytes, decoded) = check_against_json(&dir, name);
        let Decoded::Event(decoded) = decoded else {
            panic!("{name}: a batch, not an event");
        };
        assert_eq!(
            decoded, envelope,
            "{name}: fixture differs from the generator"
        );
        assert_eq!(
            wire::encode(&decoded).unwrap(),
            bytes,
            "{name}: re-encoding is not byte for byte the fixture"
        );
        kinds.insert(decoded.kind());
    }
    assert_eq!(kinds, EventKind::ALL.into_iter().collect());
}

#[test]
fn the_admitted_fixture_is_this_exact_layout() {
    let bytes = fs::read(fixtures_dir().join("admitted.msgpack")).unwrap();
    // Ints in their smallest width, spelled out: the encoder must not drift to another.
    let expected = Mp::default()
        .map(10)
        .str("v")
        .bytes(&[0x01])
        .str("pub")
        .uint64(PUBLISHER_ID)
        .str("seq")
        .bytes(&[0x01])
        .str("ts")
        .uint64(TS)
        .str("kind")
        .str("admitted")
        .str("rid")
        .str("req-7f3a")
        .str("wid")
        .bytes(&[0x03])
        .str("dp")
        .bytes(&[0x01])
        .str("ptok")
        .bytes(&[0xcd, 0x02, 0x00])
        .str("etok")
        .bytes(&[0xcc, 0x80])
        .0;
    assert_eq!(bytes, expected);
    assert_eq!(bytes.len(), 85);
}

/// `schemas/README.md`, the text of section `## {title}` up to the next `## `.
fn contract_section(title: &str) -> String {
    let contract = fs::read_to_string(schemas_dir().join("README.md")).unwrap();
    contract
        .split(&format!("\n## {title}\n"))
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .unwrap_or_else(|| panic!("schemas/README.md has a `## {title}` section"))
        .to_owned()
}

/// The cells of the table row of `section` whose first cell is `` `key` ``.
fn table_row<'a>(section: &'a str, key: &str) -> Vec<&'a str> {
    let start = format!("| `{key}` |");
    let line = section
        .lines()
        .find(|l| l.starts_with(&start))
        .unwrap_or_else(|| panic!("no row `{key}` in:\n{section}"));
    line.trim_matches('|').split(" | ").map(str::trim).collect()
}

/// Bytes as the README spells them: lower-case hex pairs separated by spaces.
fn hex(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn the_batch_fixture_is_this_exact_layout() {
    let (bytes, decoded) = check_against_json(&fixtures_dir(), BATCH_FIXTURE);
    let sent = golden_batch();
    assert_eq!(decoded, Decoded::Batch(sent.clone()));
    // The canonical layout, spelled out: a map of 3 in the order v, kind, events, then each
    // event exactly as it is encoded alone.
    let head = Mp::default()
        .map(3)
        .str("v")
        .bytes(&[0x01])
        .str("kind")
        .str("batch")
        .str("events")
        .0;
    let mut expected = head.clone();
    expected.push(0x94); // fixarray of 4
    for envelope in &sent {
        expected.extend_from_slice(&wire::encode(envelope).unwrap());
    }
    assert_eq!(bytes, expected);
    assert_eq!(wire::encode_batch(&sent).unwrap(), bytes);
    // The publisher's writer sends the same bytes.
    let mut writer = BatchWriter::new();
    for envelope in &sent {
        writer.push(envelope).unwrap();
    }
    assert_eq!(writer.finish().unwrap(), bytes);
    // What the fixture is meant to show: every kind of 1.2 (the KV kinds of 1.3 batch alike),
    // one publisher, `seq` rising, one worker.
    let kinds: BTreeSet<EventKind> = sent.iter().map(Envelope::kind).collect();
    let kinds_1_2 = [
        EventKind::Admitted,
        EventKind::Progressed,
        EventKind::Completed,
        EventKind::WorkerReset,
    ];
    assert_eq!(kinds, kinds_1_2.into_iter().collect());
    assert!(sent.iter().all(|e| e.publisher_id == PUBLISHER_ID));
    assert!(sent.windows(2).all(|w| w[0].sequence < w[1].sequence));
    assert!(sent.iter().all(|e| e.event.worker_id() == 3));

    // The README shows the canonical first bytes and the fixture's size.
    let section = contract_section("Batches (1.2)");
    assert!(
        section.lines().any(|l| l.trim() == hex(&head)),
        "schemas/README.md, Batches: the canonical first bytes are\n{}",
        hex(&head)
    );
    let size = format!("`fixtures/batch.msgpack` ({} bytes)", bytes.len());
    assert!(section.contains(&size), "README should say {size}");
}

/// Encodings other publishers produce, checked in as `fixtures/interop/<name>.msgpack` with the
/// envelope they must decode to as `<name>.json`.
#[test]
fn interop_fixtures_decode() {
    let dir = fixtures_dir().join("interop");
    let names = fixture_names(&dir);
    assert!(
        !names.is_empty(),
        "no interop fixtures in {}",
        dir.display()
    );
    let mut batches = 0;
    for name in names {
        let (bytes, decoded) = check_against_json(&dir, &name);
        if let Decoded::Batch(events) = decoded {
            batches += 1;
            if name == "python_batch_single" {
                // A dict built in the canonical key order packs to the canonical bytes.
                assert_eq!(bytes, wire::encode_batch(&events).unwrap(), "{name}");
            }
        }
    }
    assert!(batches >= 2, "python_batch* interop fixtures: {batches}");
    // The one whose map starts with `events` and holds an unknown key, and an event whose
    // `etok` is nil.
    let bytes = fs::read(dir.join("python_batch.msgpack")).unwrap();
    assert!(bytes.starts_with(&Mp::default().map(4).str("events").0));
    assert!(bytes
        .windows(6)
        .any(|w| w == Mp::default().str("etok").bytes(&[0xc0]).0));
}

fn fixture(name: &str) -> Envelope {
    golden()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, envelope)| envelope)
        .unwrap()
}

#[test]
fn python_style_encoding_decodes_to_the_same_event() {
    // Keys in another order, ints in other widths (signed, wider than needed), unknown fields
    // of every type, `etok` given explicitly.
    let bytes = Mp::default()
        .map(13)
        .str("kind")
        .str("admitted")
        .str("trace_id")
        .bytes(&[0xc4, 3, 1, 2, 3]) // bin
        .str("rid")
        .str("req-7f3a")
        .str("dp")
        .bytes(&[0xd0, 0x01]) // int8 1
        .str("wid")
        .bytes(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 3]) // int64 3
        .str("ptok")
        .bytes(&[0xce, 0, 0, 2, 0]) // uint32 512
        .str("etok")
        .bytes(&[0xd1, 0, 128]) // int16 128
        .str("labels")
        .bytes(&[0x82, 0xa1, b'a', 0x01, 0xa1, b'b', 0x92, 0xc3, 0xc0]) // nested map
        .str("ratio")
        .bytes(&[0xcb, 0x3f, 0xe0, 0, 0, 0, 0, 0, 0]) // float64 0.5
        .str("ts")
        .uint64(TS)
        .str("seq")
        .bytes(&[0xcd, 0, 1]) // uint16 1
        .str("pub")
        .uint64(PUBLISHER_ID)
        .str("v")
        .bytes(&[0xd2, 0, 0, 0, 1]) // int32 1
        .0;
    let decoded = wire::decode(&bytes, DEFAULT_MAX_EVENT_BYTES).unwrap();
    assert_eq!(decoded, fixture("admitted"));
    // Re-encoding gives the canonical form.
    let canonical = fs::read(fixtures_dir().join("admitted.msgpack")).unwrap();
    assert_eq!(wire::encode(&decoded).unwrap(), canonical);
}

#[test]
fn go_style_encoding_decodes_to_the_same_event() {
    // vmihailenco/msgpack writes struct fields in declaration order and uint64 fields at full
    // width; `etok` as nil when the pointer is nil and `omitempty` is not set.
    let bytes = Mp::default()
        .map(10)
        .str("v")
        .bytes(&[0xcd, 0, 1]) // uint16
        .str("pub")
        .uint64(PUBLISHER_ID)
        .str("seq")
        .uint64(2)
        .str("ts")
        .uint64(TS + 250)
        .str("kind")
        .str("admitted")
        .str("rid")
        .str("req-8e21")
        .str("wid")
        .uint64(3)
        .str("dp")
        .bytes(&[0xce, 0, 0, 0, 0]) // uint32
        .str("ptok")
        .bytes(&[0xce, 0, 1, 0x11, 0x70]) // uint32 70000
        .str("etok")
        .bytes(&[0xc0])
        .0;
    let decoded = wire::decode(&bytes, DEFAULT_MAX_EVENT_BYTES).unwrap();
    assert_eq!(decoded, fixture("admitted_no_estimate"));
}

/// A Go worker's batch as `schemas/README.md` shows it: `Batch{V uint16; Kind string; Events
/// []msgpack.RawMessage}`, each event a struct marshalled on its own by vmihailenco/msgpack.
#[test]
fn go_style_batch_decodes_to_the_same_events() {
    let stamp = |mp: Mp, seq: u64, ts: u64, kind: &str| {
        mp.str("v")
            .bytes(&[0xcd, 0, 1]) // uint16 1
            .str("pub")
            .uint64(PUBLISHER_ID)
            .str("seq")
            .uint64(seq)
            .str("ts")
            .uint64(ts)
            .str("kind")
            .str(kind)
    };
    let uint32 = |n: u32| {
        let mut out = vec![0xce];
        out.extend_from_slice(&n.to_be_bytes());
        out
    };
    // Admitted: `Etok *uint32 omitempty` nil is left out; `Ctok` set.
    let admitted = stamp(Mp::default().map(10), 21, TS + 5_000_000, "admitted")
        .str("rid")
        .str("req-b001")
        .str("wid")
        .uint64(3)
        .str("dp")
        .bytes(&uint32(0))
        .str("ptok")
        .bytes(&uint32(1200))
        .str("ctok")
        .bytes(&uint32(1024))
        .0;
    let progressed = stamp(Mp::default().map(10), 22, TS + 5_000_150, "progressed")
        .str("rid")
        .str("req-9c04")
        .str("wid")
        .uint64(3)
        .str("dp")
        .bytes(&uint32(1))
        .str("stage")
        .str("prefill_done")
        .str("otok")
        .bytes(&uint32(1))
        .0;
    let completed = stamp(Mp::default().map(9), 23, TS + 5_000_400, "completed")
        .str("rid")
        .str("req-8e21")
        .str("wid")
        .uint64(3)
        .str("dp")
        .bytes(&uint32(0))
        .str("outcome")
        .str("cancelled")
        .0;
    // `Dp *uint32 omitempty`, `Leaving bool omitempty`.
    let reset = stamp(Mp::default().map(8), 24, TS + 5_000_900, "worker_reset")
        .str("wid")
        .uint64(3)
        .str("dp")
        .bytes(&uint32(1))
        .str("leaving")
        .bytes(&[0xc3])
        .0;
    let mut bytes = Mp::default()
        .map(3)
        .str("v")
        .bytes(&[0xcd, 0, 1]) // uint16 1
        .str("kind")
        .str("batch")
        .str("events")
        .bytes(&[0x94]) // EncodeArrayLen(4)
        .0;
    for event in [admitted, progressed, completed, reset] {
        bytes.extend_from_slice(&event); // RawMessage: written as is
    }
    assert_eq!(
        decode_message("go-style batch", &bytes),
        Decoded::Batch(golden_batch())
    );
}

/// What a router does with batches that are not right, as `schemas/README.md` tells workers.
#[test]
fn batch_contract_errors_other_languages_must_expect() {
    let good: Vec<Vec<u8>> = golden_batch()
        .iter()
        .map(|e| wire::encode(e).unwrap())
        .collect();
    let batch_of = |v: u8, events: &[Vec<u8>]| {
        let mut out = Mp::default()
            .map(3)
            .str("v")
            .bytes(&[v])
            .str("kind")
            .str("batch")
            .str("events")
            .0;
        rmp::encode::write_array_len(&mut out, events.len() as u32).unwrap();
        for event in events {
            out.extend_from_slice(event);
        }
        out
    };
    let refused = |bytes: &[u8]| match wire::decode_message(bytes, MessageLimits::default()) {
        Message::Refused { events, error } => (events, error.reason()),
        other => panic!("not refused: {other:?}"),
    };
    let reasons = |bytes: &[u8]| match wire::decode_message(bytes, MessageLimits::default()) {
        Message::Batch(events) => events
            .map(|e| e.err().map(|err| err.reason()))
            .collect::<Vec<_>>(),
        other => panic!("not a batch: {other:?}"),
    };

    // Another version: every declared event dropped as `version`.
    assert_eq!(refused(&batch_of(2, &good)), (4, "version"));
    // Unreadable as a whole: every declared event dropped as `decode`.
    let whole = batch_of(1, &good);
    assert_eq!(
        refused(&whole[..whole.len() - 1]),
        (4, "decode"),
        "cut short"
    );
    let mut trailing = whole.clone();
    trailing.push(0xc0);
    assert_eq!(refused(&trailing), (4, "decode"), "bytes after the map");
    // No events: one drop.
    assert_eq!(refused(&batch_of(1, &[])), (1, "decode"), "empty events");

    // One bad event drops alone, each for its own reason.
    let unknown_kind = Mp::default()
        .map(6)
        .str("v")
        .bytes(&[0x01])
        .str("pub")
        .uint(PUBLISHER_ID)
        .str("seq")
        .bytes(&[0x19])
        .str("ts")
        .uint(TS)
        .str("kind")
        .str("migrated")
        .str("wid")
        .bytes(&[0x03])
        .0;
    let other_version = Mp::default()
        .map(2)
        .str("v")
        .bytes(&[0x02])
        .str("kind")
        .str("admitted")
        .0;
    let nested = wire::encode_batch(&golden_batch()[..2]).unwrap();
    let over = over_event();
    let bytes = batch_of(
        1,
        &[
            good[0].clone(),
            unknown_kind,
            good[1].clone(),
            other_version,
            nested,
            over,
            vec![0x2a], // not a map
            good[2].clone(),
        ],
    );
    assert_eq!(
        reasons(&bytes),
        [
            None,
            Some("unknown_kind"),
            None,
            Some("version"),
            Some("decode"),
            Some("oversized"),
            Some("decode"),
            None
        ]
    );

    // Over the batch limit: not read, one drop, whatever it holds.
    let many: Vec<Envelope> = (1..=20_000)
        .map(|seq| {
            let mut e = golden_batch()[1].clone();
            e.sequence = seq;
            e
        })
        .collect();
    let big = wire::encode_batch(&many).unwrap();
    assert!(big.len() > DEFAULT_MAX_BATCH_BYTES, "{}", big.len());
    match wire::decode_message(&big, MessageLimits::default()) {
        Message::Event(Err(err)) => assert_eq!(err.reason(), "oversized"),
        other => panic!("{other:?}"),
    }
    // A single event over the event limit stays oversized though batches may be larger.
    match wire::decode_message(&over_event(), MessageLimits::default()) {
        Message::Event(Err(err)) => assert_eq!(err.reason(), "oversized"),
        other => panic!("{other:?}"),
    }
}

/// A single event just over the default event limit.
fn over_event() -> Vec<u8> {
    let mut e = golden_batch()[0].clone();
    if let LeaseEvent::Admitted(a) = &mut e.event {
        a.request_id = "r".repeat(DEFAULT_MAX_EVENT_BYTES);
    }
    let bytes = wire::encode(&e).unwrap();
    assert!(bytes.len() > DEFAULT_MAX_EVENT_BYTES);
    bytes
}

#[test]
fn contract_errors_other_languages_must_expect() {
    // A newer major version is refused before anything else is looked at.
    let bytes = Mp::default()
        .map(2)
        .str("v")
        .bytes(&[0x02])
        .str("kind")
        .bytes(&[0x05])
        .0;
    let err = wire::decode(&bytes, DEFAULT_MAX_EVENT_BYTES).unwrap_err();
    assert_eq!(
        err,
        DecodeEventError::UnsupportedVersion {
            found: 2,
            supported: WIRE_VERSION
        }
    );
    // An unknown kind in an otherwise valid envelope.
    let bytes = Mp::default()
        .map(6)
        .str("v")
        .bytes(&[0x01])
        .str("pub")
        .bytes(&[0x01])
        .str("seq")
        .bytes(&[0x01])
        .str("ts")
        .bytes(&[0x01])
        .str("kind")
        .str("migrated")
        .str("wid")
        .bytes(&[0x01])
        .0;
    let err = wire::decode(&bytes, DEFAULT_MAX_EVENT_BYTES).unwrap_err();
    assert_eq!(err.reason(), "unknown_kind");
    // The array form (rmp_serde::to_vec of a struct, msgpack "as_array") is not accepted.
    let err = wire::decode(&[0x92, 0x01, 0x01], DEFAULT_MAX_EVENT_BYTES).unwrap_err();
    assert_eq!(err.reason(), "decode");
    // Oversized.
    let big = vec![0u8; DEFAULT_MAX_EVENT_BYTES + 1];
    assert_eq!(
        wire::decode(&big, DEFAULT_MAX_EVENT_BYTES)
            .unwrap_err()
            .reason(),
        "oversized"
    );
}

#[test]
fn every_json_file_under_schemas_parses() {
    let mut count = 0;
    let mut dirs = vec![schemas_dir()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "json") {
                read_json(&path);
                count += 1;
            }
        }
    }
    assert!(count > 1, "found {count} JSON files");
}

fn string_set(value: &Value) -> BTreeSet<String> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {value}"))
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn schema_matches_the_decoder() {
    let root = read_json(&schemas_dir().join("envelope.schema.json"));
    assert_eq!(
        root["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    // A message is a batch when its kind says so, else one event.
    assert_eq!(root["if"]["required"], serde_json::json!([keys::KIND]));
    assert_eq!(root["if"]["properties"][keys::KIND]["const"], BATCH_KIND);
    assert_eq!(root["then"]["$ref"], "#/$defs/batch");
    assert_eq!(root["else"]["$ref"], "#/$defs/event");
    let schema = &root["$defs"]["event"];
    assert!(schema["description"]
        .as_str()
        .unwrap()
        .contains(&format!("{DEFAULT_MAX_EVENT_BYTES} bytes")));
    let properties = schema["properties"].as_object().unwrap();
    let documented: BTreeSet<&str> = properties.keys().map(String::as_str).collect();
    assert_eq!(documented, keys::ALL.into_iter().collect());
    assert_eq!(properties["v"]["const"], u64::from(WIRE_VERSION));
    assert_eq!(
        string_set(&properties["kind"]["enum"]),
        EventKind::ALL
            .iter()
            .map(|k| k.as_str().to_owned())
            .collect()
    );
    assert_eq!(
        string_set(&properties["stage"]["enum"]),
        ProgressStage::ALL
            .iter()
            .map(|s| s.as_str().to_owned())
            .collect()
    );
    assert_eq!(
        string_set(&properties["outcome"]["enum"]),
        Outcome::ALL.iter().map(|o| o.as_str().to_owned()).collect()
    );
    assert_eq!(
        string_set(&schema["required"]),
        ["v", "pub", "seq", "ts", "kind", "wid"]
            .map(str::to_owned)
            .into()
    );
    assert_eq!(schema["additionalProperties"], true);
    // Each kind's required fields: exactly what the encoder always writes for it.
    let defs = root["$defs"].as_object().unwrap();
    for (name, envelope) in golden() {
        let kind = envelope.kind();
        let required = string_set(&defs[kind.as_str()]["required"]);
        let written: BTreeSet<String> = serde_json::to_value(&envelope)
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| {
                ![
                    "v", "pub", "seq", "ts", "kind", "etok", "ctok", "bcap", "cls", "leaving",
                    "par",
                ]
                .contains(&k.as_str())
            })
            // `blk` is optional in `admitted` only.
            .filter(|k| !(kind == EventKind::Admitted && k.as_str() == "blk"))
            .filter(|k| {
                !(matches!(kind, EventKind::WorkerReset | EventKind::KvCleared)
                    && k.as_str() == "dp")
            })
            .cloned()
            .collect();
        assert_eq!(required, written, "{name}");
    }
    // Every kind has its conditional branch.
    let branches = schema["allOf"].as_array().unwrap();
    let conditioned: BTreeSet<String> = branches
        .iter()
        .map(|b| {
            b["if"]["properties"]["kind"]["const"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        conditioned,
        EventKind::ALL
            .iter()
            .map(|k| k.as_str().to_owned())
            .collect()
    );
}

#[test]
fn schema_of_a_batch_matches_the_decoder() {
    let root = read_json(&schemas_dir().join("envelope.schema.json"));
    let batch = &root["$defs"]["batch"];
    let properties = batch["properties"].as_object().unwrap();
    let keys: BTreeSet<&str> = properties.keys().map(String::as_str).collect();
    let expected = [keys::VERSION, keys::KIND, EVENTS_KEY];
    assert_eq!(keys, expected.into_iter().collect());
    assert_eq!(
        string_set(&batch["required"]),
        expected.map(str::to_owned).into()
    );
    assert_eq!(properties[keys::VERSION]["const"], u64::from(WIRE_VERSION));
    assert_eq!(properties[keys::KIND]["const"], BATCH_KIND);
    let events = &properties[EVENTS_KEY];
    assert_eq!(events["type"], "array");
    assert_eq!(events["minItems"], 1);
    assert_eq!(events["items"]["$ref"], "#/$defs/event");
    assert_eq!(batch["additionalProperties"], true);
    let description = batch["description"].as_str().unwrap();
    assert!(description.contains(&format!("{DEFAULT_MAX_BATCH_BYTES} bytes")));
    assert!(description.contains(&format!(
        "each event in it at most {DEFAULT_MAX_EVENT_BYTES}"
    )));
    // `batch` is no event kind: a batch inside a batch is not an event.
    let kinds = string_set(&root["$defs"]["event"]["properties"][keys::KIND]["enum"]);
    assert!(!kinds.contains(BATCH_KIND));
    assert!(EventKind::from_wire(BATCH_KIND).is_none());
    // The JSON views of the batch fixtures have exactly these keys.
    for dir in [fixtures_dir(), fixtures_dir().join("interop")] {
        for name in fixture_names(&dir) {
            let json = read_json(&dir.join(format!("{name}.json")));
            if json[keys::KIND] == BATCH_KIND {
                let found: BTreeSet<&str> = json
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(String::as_str)
                    .collect();
                assert_eq!(found, expected.into_iter().collect(), "{name}");
            }
        }
    }
}

#[test]
fn lease_event_accessors_on_fixtures() {
    for (_, envelope) in golden() {
        assert_eq!(envelope.event.worker_id(), 3);
        match &envelope.event {
            LeaseEvent::Admitted(a) => assert_eq!(a.worker().worker_id.0, 3),
            LeaseEvent::WorkerReset(r) => assert_eq!(r.worker_id, 3),
            LeaseEvent::KvStored(_) | LeaseEvent::KvRemoved(_) | LeaseEvent::KvCleared(_) => {
                assert!(envelope.event.request_id().is_none() && envelope.event.worker().is_none())
            }
            other => assert!(other.request_id().is_some()),
        }
    }
}

/// The drop reasons a worker implementer reads about (schemas/README.md, "Drop reasons") are
/// exactly the ones the router counts, in its order; README.md's metrics point there instead
/// of listing them again.
#[test]
fn documented_drop_reasons_are_the_counted_ones() {
    use lease_router::DropReason;
    let contract = fs::read_to_string(schemas_dir().join("README.md")).unwrap();
    let section = contract
        .split("\n## Drop reasons\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("schemas/README.md has a Drop reasons section");
    let documented: Vec<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .map(|l| l.split('`').next().unwrap())
        .collect();
    let counted: Vec<&str> = DropReason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(documented, counted);

    let readme =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let dropped_row = readme
        .lines()
        .find(|l| l.starts_with("| `events_dropped_total`"))
        .expect("README.md describes events_dropped_total");
    assert!(
        dropped_row.contains("(schemas/README.md#drop-reasons)"),
        "{dropped_row}"
    );
}

/// The figures `schemas/README.md` states for batches are the router's and the Rust
/// publisher's defaults.
#[test]
fn batch_limits_in_the_contract_are_the_defaults() {
    let section = contract_section("Batches (1.2)");
    let stated = |key: &str| table_row(&section, key)[1].to_owned();
    let router = lease_router::ApplyConfig::default();
    assert_eq!(router.max_event_bytes, DEFAULT_MAX_EVENT_BYTES);
    assert_eq!(router.max_batch_bytes, DEFAULT_MAX_BATCH_BYTES);
    assert_eq!(
        stated("max_event_bytes"),
        DEFAULT_MAX_EVENT_BYTES.to_string()
    );
    assert_eq!(
        stated("max_batch_bytes"),
        format!("{DEFAULT_MAX_BATCH_BYTES} (1 MiB)")
    );
    assert_eq!(DEFAULT_MAX_BATCH_BYTES, 1 << 20);
    let publisher = lease_router::Batching::default();
    assert_eq!(stated("max_events"), publisher.max_events.to_string());
    assert_eq!(publisher.max_bytes % 1024, 0);
    assert_eq!(
        stated("max_bytes"),
        format!(
            "{} ({} KiB)",
            publisher.max_bytes,
            publisher.max_bytes / 1024
        )
    );
    let millis = u64::try_from(publisher.linger.as_millis()).unwrap();
    assert_eq!(publisher.linger, std::time::Duration::from_millis(millis));
    assert_eq!(stated("linger"), format!("{millis} ms"));
}

/// The examples of `schemas/README.md` spell the batch map with the decoder's keys.
#[test]
fn batch_examples_in_the_contract_use_the_decoders_keys() {
    let python = contract_section("Python");
    let literal = format!(
        r#"{{"{}": {}, "{}": "{}", "{}": "#,
        keys::VERSION,
        WIRE_VERSION,
        keys::KIND,
        BATCH_KIND,
        EVENTS_KEY
    );
    assert!(python.contains(&literal), "Python example lacks {literal}");
    let go = contract_section("Go");
    for tag in [keys::VERSION, keys::KIND, EVENTS_KEY] {
        let tag = format!("`msgpack:\"{tag}\"`");
        assert!(go.contains(&tag), "Go example lacks {tag}");
    }
    assert!(go.contains(&format!("Kind: \"{BATCH_KIND}\"")));
    assert!(go.contains(&format!("V: {WIRE_VERSION}")));
    // The map as the Batches section shows it.
    let batches = contract_section("Batches (1.2)");
    assert!(
        batches.contains(&literal),
        "Batches section lacks {literal}"
    );
}

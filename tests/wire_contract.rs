//! The wire contract as other languages see it: the golden fixtures in `schemas/fixtures/`, the
//! JSON Schema in `schemas/`, and encodings as Python or Go publishers produce them.
//!
//! Regenerate the golden fixtures (after an intended change of the encoding) with
//! `REGENERATE_FIXTURES=1 cargo test --test wire_contract`, then review the diff.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use lease_router::wire::{
    self, keys, Admitted, Completed, DecodeEventError, Envelope, EventKind, LeaseEvent, Outcome,
    ProgressStage, Progressed, WorkerReset, DEFAULT_MAX_EVENT_BYTES, WIRE_VERSION,
};
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
    ]
}

fn regenerate() {
    let dir = fixtures_dir();
    fs::create_dir_all(&dir).unwrap();
    for (name, envelope) in golden() {
        let bytes = wire::encode(&envelope).unwrap();
        fs::write(dir.join(format!("{name}.msgpack")), bytes).unwrap();
        let mut json = serde_json::to_string_pretty(&envelope).unwrap();
        json.push('\n');
        fs::write(dir.join(format!("{name}.json")), json).unwrap();
    }
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

/// Decodes `<name>.msgpack` and checks it against `<name>.json`, both ways.
fn check_against_json(dir: &Path, name: &str) -> (Vec<u8>, Envelope) {
    let bytes = fs::read(dir.join(format!("{name}.msgpack"))).unwrap();
    let decoded = wire::decode(&bytes, DEFAULT_MAX_EVENT_BYTES)
        .unwrap_or_else(|err| panic!("{name}.msgpack: {err}"));
    let json = read_json(&dir.join(format!("{name}.json")));
    assert_eq!(
        serde_json::to_value(&decoded).unwrap(),
        json,
        "{name}: decoded msgpack differs from the JSON"
    );
    let from_json: Envelope = serde_json::from_value(json).unwrap();
    assert_eq!(from_json, decoded, "{name}: JSON and msgpack disagree");
    (bytes, decoded)
}

#[test]
fn golden_fixtures_decode_and_reencode_byte_for_byte() {
    if std::env::var_os("REGENERATE_FIXTURES").is_some_and(|v| v == "1") {
        regenerate();
    }
    let dir = fixtures_dir();
    let expected: BTreeSet<String> = golden().iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(
        fixture_names(&dir),
        expected,
        "fixtures on disk differ from the generator; run REGENERATE_FIXTURES=1"
    );
    let mut kinds = BTreeSet::new();
    for (name, envelope) in golden() {
        let (bytes, decoded) = check_against_json(&dir, name);
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
    for name in names {
        check_against_json(&dir, &name);
    }
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
    let schema = read_json(&schemas_dir().join("envelope.schema.json"));
    assert_eq!(
        schema["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
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
    let defs = schema["$defs"].as_object().unwrap();
    for (name, envelope) in golden() {
        let kind = envelope.kind();
        let required = string_set(&defs[kind.as_str()]["required"]);
        let written: BTreeSet<String> = serde_json::to_value(&envelope)
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| {
                !["v", "pub", "seq", "ts", "kind", "etok", "ctok", "leaving"].contains(&k.as_str())
            })
            .filter(|k| !(kind == EventKind::WorkerReset && k.as_str() == "dp"))
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
fn lease_event_accessors_on_fixtures() {
    for (_, envelope) in golden() {
        assert_eq!(envelope.event.worker_id(), 3);
        match &envelope.event {
            LeaseEvent::Admitted(a) => assert_eq!(a.worker().worker_id.0, 3),
            LeaseEvent::WorkerReset(r) => assert_eq!(r.worker_id, 3),
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

//! Property tests of the wire codec and of subject parsing: the router's input is untrusted
//! bytes on untrusted subjects, so neither may ever panic, and validation must hold for every
//! input, not only the hand-picked ones of the unit tests.
//!
//! Case counts are modest so that the suite stays fast; the cargo-fuzz target under `fuzz/`
//! is the place for long runs.

use lease_router::wire::{
    self, Admitted, Completed, Envelope, LeaseEvent, Message, MessageLimits, Outcome,
    ProgressStage, Progressed, WorkerReset, DEFAULT_MAX_EVENT_BYTES, WIRE_VERSION,
};
use lease_router::wire::{KvCleared, KvRemoved, KvStored, MAX_BLOCK_HASHES};
use lease_router::{DeploymentName, SubjectPrefix, Subjects, MAX_TOKEN_LEN};
use proptest::prelude::*;

/// Large enough for every generated envelope (request ids are bounded below).
const MAX: usize = 64 * 1024;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // Failures are reported with their minimal input; no files written under tests/.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn request_id() -> impl Strategy<Value = String> {
    // Any Unicode, non-empty (the codec refuses an empty request id on both sides).
    "\\PC{1,64}"
}

fn stage() -> impl Strategy<Value = ProgressStage> {
    prop::sample::select(ProgressStage::ALL.to_vec())
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop::sample::select(Outcome::ALL.to_vec())
}

fn event() -> impl Strategy<Value = LeaseEvent> {
    prop_oneof![
        (
            request_id(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<Option<u32>>(),
            any::<Option<u32>>(),
            prop::collection::vec(any::<u64>(), 0..=MAX_BLOCK_HASHES),
            any::<Option<u32>>(),
            prop::option::of("\\PC{0,64}")
        )
            .prop_map(
                |(
                    request_id,
                    worker_id,
                    dp_rank,
                    prompt_tokens,
                    expected,
                    cached,
                    block_hashes,
                    block_capacity,
                    class,
                )| {
                    LeaseEvent::Admitted(Admitted {
                        block_hashes,
                        block_capacity,
                        class,
                        request_id,
                        worker_id,
                        dp_rank,
                        prompt_tokens,
                        expected_output_tokens: expected,
                        cached_tokens: cached,
                    })
                }
            ),
        (
            request_id(),
            any::<u64>(),
            any::<u32>(),
            stage(),
            any::<u32>()
        )
            .prop_map(|(request_id, worker_id, dp_rank, stage, output_tokens)| {
                LeaseEvent::Progressed(Progressed {
                    request_id,
                    worker_id,
                    dp_rank,
                    stage,
                    output_tokens,
                })
            }),
        (request_id(), any::<u64>(), any::<u32>(), outcome()).prop_map(
            |(request_id, worker_id, dp_rank, outcome)| {
                LeaseEvent::Completed(Completed {
                    request_id,
                    worker_id,
                    dp_rank,
                    outcome,
                })
            }
        ),
        (any::<u64>(), any::<Option<u32>>(), any::<bool>()).prop_map(
            |(worker_id, dp_rank, leaving)| {
                LeaseEvent::WorkerReset(WorkerReset {
                    worker_id,
                    dp_rank,
                    leaving,
                })
            }
        ),
        (
            any::<u64>(),
            any::<u32>(),
            any::<Option<u64>>(),
            prop::collection::vec(any::<u64>(), 1..=MAX_BLOCK_HASHES)
        )
            .prop_map(|(worker_id, dp_rank, parent_hash, block_hashes)| {
                LeaseEvent::KvStored(KvStored {
                    worker_id,
                    dp_rank,
                    parent_hash,
                    block_hashes,
                })
            }),
        (
            any::<u64>(),
            any::<u32>(),
            prop::collection::vec(any::<u64>(), 1..=MAX_BLOCK_HASHES)
        )
            .prop_map(|(worker_id, dp_rank, block_hashes)| {
                LeaseEvent::KvRemoved(KvRemoved {
                    worker_id,
                    dp_rank,
                    block_hashes,
                })
            }),
        (any::<u64>(), any::<Option<u32>>()).prop_map(
            |(worker_id, dp_rank)| LeaseEvent::KvCleared(KvCleared { worker_id, dp_rank })
        ),
    ]
}

fn envelope() -> impl Strategy<Value = Envelope> {
    (any::<u64>(), 1..=u64::MAX, any::<u64>(), event()).prop_map(
        |(publisher_id, sequence, published_at_us, event)| {
            Envelope::new(publisher_id, sequence, published_at_us, event)
        },
    )
}

/// A string made of characters that are each either valid in a subject token or not.
fn token_like() -> impl Strategy<Value = String> {
    let chars = prop_oneof![
        6 => prop::char::ranges(vec!['a'..='z', 'A'..='Z', '0'..='9'].into()),
        1 => Just('-'),
        1 => Just('_'),
        1 => Just('.'),
        1 => Just('*'),
        1 => Just('>'),
        1 => prop::sample::select(vec![' ', '\t', '\n', '\r', '\u{a0}', '\u{3000}']),
        1 => any::<char>(),
    ];
    prop::collection::vec(chars, 0..=(MAX_TOKEN_LEN + 8)).prop_map(|v| v.into_iter().collect())
}

/// The rule, written independently of the implementation.
fn is_token(s: &str) -> bool {
    (1..=MAX_TOKEN_LEN).contains(&s.len())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// What `decode_message` makes of `bytes`, checked for what must hold of any input: a
/// refused batch declares between one event and one per byte, and a readable batch yields as
/// many results as it declares.
fn read_message(
    bytes: &[u8],
    limits: MessageLimits,
) -> Result<Vec<Result<Envelope, wire::DecodeEventError>>, TestCaseError> {
    Ok(match wire::decode_message(bytes, limits) {
        Message::Event(event) => vec![event],
        Message::Refused { events, error } => {
            prop_assert!(
                (1..=bytes.len().max(1)).contains(&events),
                "{} events of {} bytes",
                events,
                bytes.len()
            );
            vec![Err(error); events.min(4)]
        }
        Message::Batch(events) => {
            let declared = events.len();
            let read: Vec<_> = events.collect();
            prop_assert_eq!(read.len(), declared);
            read
        }
    })
}

proptest! {
    #![proptest_config(config(256))]

    /// Batches (wire 1.2) of valid events come back event for event, in order.
    #[test]
    fn batches_round_trip(envelopes in prop::collection::vec(envelope(), 1..20)) {
        let bytes = wire::encode_batch(&envelopes).expect("valid envelopes batch");
        let limits = MessageLimits { max_event_bytes: MAX, max_batch_bytes: 1 << 22 };
        let read = read_message(&bytes, limits)?;
        let read: Vec<_> = read.into_iter().map(|r| r.expect("each event decodes")).collect();
        prop_assert_eq!(read, envelopes);
    }

    /// Any batch cut short is refused as a whole (never read as fewer events), and one byte
    /// flipped anywhere never panics: what is read is counted and bounded.
    #[test]
    fn broken_batches_never_panic(
        envelopes in prop::collection::vec(envelope(), 1..6),
        at in any::<prop::sample::Index>(),
        xor in 1u8..,
    ) {
        let limits = MessageLimits { max_event_bytes: MAX, max_batch_bytes: 1 << 22 };
        let mut bytes = wire::encode_batch(&envelopes).unwrap();
        for len in 0..bytes.len() {
            let read = read_message(&bytes[..len], limits)?;
            prop_assert!(read.iter().all(Result::is_err), "a {}-byte prefix read an event", len);
        }
        let i = at.index(bytes.len());
        bytes[i] ^= xor;
        read_message(&bytes, limits)?;
    }

    /// Arbitrary bytes after a batch's canonical start reach deep into the batch reader.
    #[test]
    fn batch_like_bytes_never_panic(tail in prop::collection::vec(any::<u8>(), 0..300)) {
        let one = wire::encode_batch(&[Envelope::new(1, 1, 1, LeaseEvent::WorkerReset(WorkerReset { worker_id: 1, dp_rank: None, leaving: false }))]).unwrap();
        // The canonical start, without the array header.
        let mut bytes = one[..22].to_vec();
        bytes.extend_from_slice(&tail);
        read_message(&bytes, MessageLimits::default())?;
        read_message(&tail, MessageLimits::default())?;
    }
}

proptest! {
    #![proptest_config(config(512))]

    /// Arbitrary bytes: an error or an envelope, never a panic.
    #[test]
    fn decode_never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = wire::decode(&bytes, MAX);
        let _ = wire::decode(&bytes, DEFAULT_MAX_EVENT_BYTES);
        let _ = wire::decode(&bytes, 8);
    }

    /// Bytes that look like MessagePack maps (a map marker then arbitrary content) reach
    /// deeper into the decoder than uniformly random bytes.
    #[test]
    fn decode_never_panics_on_map_like_bytes(
        marker in prop::sample::select(vec![0x80u8, 0x85, 0x89, 0x8a, 0x8f, 0xde, 0xdf]),
        tail in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut bytes = vec![marker];
        bytes.extend_from_slice(&tail);
        let _ = wire::decode(&bytes, MAX);
    }

    /// Every valid envelope survives encode then decode, unchanged.
    #[test]
    fn valid_envelopes_round_trip(envelope in envelope()) {
        let bytes = wire::encode(&envelope).expect("a valid envelope encodes");
        let decoded = wire::decode(&bytes, MAX).expect("its encoding decodes");
        prop_assert_eq!(decoded.version, WIRE_VERSION);
        prop_assert_eq!(&decoded, &envelope);
        // The encoding is canonical: encoding the decoded envelope gives the same bytes.
        prop_assert_eq!(wire::encode(&decoded).unwrap(), bytes);
    }

    /// A truncated encoding never panics, and never decodes at all: the map announces its
    /// length, so a shorter input is missing fields, never a different valid event.
    #[test]
    fn truncations_never_panic_nor_decode(envelope in envelope()) {
        let bytes = wire::encode(&envelope).unwrap();
        for len in 0..bytes.len() {
            let result = wire::decode(&bytes[..len], MAX);
            prop_assert!(result.is_err(), "a {}-byte prefix of {} decoded: {:?}", len, bytes.len(), result);
        }
    }

    /// A valid encoding with one byte flipped never panics; if it still decodes, it decodes
    /// into a complete, valid envelope (which encodes again).
    #[test]
    fn corruptions_never_panic(envelope in envelope(), at in any::<prop::sample::Index>(), xor in 1u8..) {
        let mut bytes = wire::encode(&envelope).unwrap();
        let i = at.index(bytes.len());
        bytes[i] ^= xor;
        if let Ok(decoded) = wire::decode(&bytes, MAX) {
            prop_assert_eq!(decoded.version, WIRE_VERSION);
            prop_assert!(decoded.sequence >= 1);
            prop_assert!(wire::encode(&decoded).is_ok());
        }
    }

    /// Trailing bytes after a valid encoding never panic and are always refused.
    #[test]
    fn trailing_bytes_never_change_the_event(envelope in envelope(), extra in prop::collection::vec(any::<u8>(), 1..16)) {
        let mut bytes = wire::encode(&envelope).unwrap();
        bytes.extend_from_slice(&extra);
        prop_assert!(wire::decode(&bytes, MAX).is_err());
    }

    /// Trailing bytes that are one complete MessagePack value (or several) are refused.
    #[test]
    fn trailing_complete_values_are_refused(envelope in envelope(), extra in prop::collection::vec(any::<u8>(), 1..8)) {
        let mut bytes = wire::encode(&envelope).unwrap();
        // Positive fixints: each byte is one complete value.
        bytes.extend(extra.iter().map(|b| b & 0x7f));
        prop_assert!(wire::decode(&bytes, MAX).is_err());
    }

    /// Anything longer than the limit is refused as oversized before being looked at.
    #[test]
    fn oversized_is_refused(len in 1usize..512, max in 0usize..512) {
        let bytes = vec![0xc1u8; len];
        let result = wire::decode(&bytes, max);
        if len > max {
            let oversized = matches!(result, Err(wire::DecodeEventError::Oversized { .. }));
            prop_assert!(oversized, "{:?}", result);
        } else {
            prop_assert!(result.is_err());
        }
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// A deployment name is accepted exactly when it is 1 to 128 of `[A-Za-z0-9_-]`: every
    /// separator (`.`), wildcard (`*`, `>`), whitespace or other character is refused.
    #[test]
    fn deployment_names_accept_exactly_tokens(s in token_like()) {
        let accepted = DeploymentName::new(s.clone()).is_ok();
        prop_assert_eq!(accepted, is_token(&s), "{:?}", s);
        if s.contains(['.', '*', '>']) || s.chars().any(char::is_whitespace) {
            prop_assert!(!accepted);
        }
    }

    /// A prefix is one or more dot-separated tokens: never a wildcard, whitespace, an empty
    /// token (leading, trailing or double dot) or any other character.
    #[test]
    fn prefixes_accept_exactly_dotted_tokens(s in token_like()) {
        let accepted = SubjectPrefix::new(s.clone()).is_ok();
        prop_assert_eq!(accepted, s.split('.').all(is_token), "{:?}", s);
        if s.contains(['*', '>'])
            || s.chars().any(char::is_whitespace)
            || s.is_empty()
            || s.starts_with('.')
            || s.ends_with('.')
            || s.contains("..")
        {
            prop_assert!(!accepted);
        }
    }

    /// Valid tokens are accepted (the generator above rarely builds long valid ones).
    #[test]
    fn valid_tokens_are_accepted(s in "[A-Za-z0-9_-]{1,128}") {
        prop_assert!(DeploymentName::new(s.clone()).is_ok());
        let dotted = format!("{s}.{s}");
        prop_assert!(SubjectPrefix::new(dotted).is_ok());
    }

    /// `parse_worker` returns a worker only for exactly `{prefix}.{deployment}.{canonical u64}`.
    #[test]
    fn parse_worker_only_accepts_the_exact_layout(
        worker in any::<u64>(),
        suffix in "[0-9a-z.*> _-]{0,24}",
        junk_before in "[0-9a-z.*> _-]{0,8}",
    ) {
        let subjects = Subjects::new(
            SubjectPrefix::new("acme.leases").unwrap(),
            DeploymentName::new("dep-1").unwrap(),
        );
        let subject = subjects.worker_subject(worker);
        prop_assert_eq!(subjects.parse_worker(&subject), Some(worker));

        // Any string: Some only when it is exactly base + canonical decimal.
        let candidate = format!("{junk_before}acme.leases.dep-1.{suffix}");
        let expected = if junk_before.is_empty() {
            canonical_u64(&suffix)
        } else {
            None
        };
        prop_assert_eq!(subjects.parse_worker(&candidate), expected, "{:?}", candidate);

        // Extra tokens, wildcards and non-canonical spellings of a valid worker are refused.
        for bad in [
            format!("{subject}.x"),
            format!("{subject}*"),
            format!("{subject}>"),
            format!("acme.leases.dep-1.0{worker}"),
            format!("acme.leases.dep-1.+{worker}"),
            format!("acme.leases.dep-1. {worker}"),
            format!("acme.leases.dep-2.{worker}"),
            format!("acme.leases.{worker}"),
            "acme.leases.dep-1.*".to_string(),
            "acme.leases.dep-1.>".to_string(),
        ] {
            prop_assert_eq!(subjects.parse_worker(&bad), None, "{:?}", bad);
        }
    }
}

/// Canonical decimal, written independently: digits only, no leading zero, fits in u64.
fn canonical_u64(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

#[test]
fn default_limit_is_far_below_the_server_max_payload() {
    // nats-server's default max_payload is 1 MB; the router's default event limit must be
    // well under it so that a too-large event is dropped (and counted) by the router rather
    // than refused by the server without a trace on the router's side.
    const NATS_DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;
    const { assert!(DEFAULT_MAX_EVENT_BYTES < NATS_DEFAULT_MAX_PAYLOAD) };
    assert_eq!(DEFAULT_MAX_EVENT_BYTES, 4096);
}

/// Trailing bytes that open a container and stop (`0x81`: a map of one entry, nothing after
/// it) are trailing bytes too: the decoder once took them for the end of its input.
#[test]
fn trailing_incomplete_value_is_refused() {
    let envelope = Envelope::new(
        1,
        1,
        0,
        WorkerReset {
            worker_id: 0,
            dp_rank: None,
            leaving: false,
        },
    );
    let mut bytes = wire::encode(&envelope).unwrap();
    bytes.push(0x81);
    assert!(wire::decode(&bytes, MAX).is_err());
}

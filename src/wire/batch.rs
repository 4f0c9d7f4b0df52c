//! Batches (wire 1.2): several events of one publisher in one NATS message.
//!
//! A batch is a map `{ "v": 1, "kind": "batch", "events": [event, event, ...] }` whose
//! `events` are complete event maps, each exactly the bytes a message of its own would carry,
//! in the publisher's sequence order. Only the three keys are defined; unknown keys are
//! skipped as in an event. A router before 1.2 drops a batch once, as `unknown_kind` (the
//! forward-compatibility rule for new kinds), so publishers batch only when told to.
//!
//! A router reads a batch in two steps. First the whole message: if its structure cannot be
//! read to the end (cut short, not MessagePack, `events` not an array, trailing bytes, a `v`
//! other than 1), every event it declares is dropped for that one reason. Then each event on
//! its own, through [`super::decode`]: a bad event drops that event only.

use std::marker::PhantomData;

use bytes::Bytes;

use super::reader::{value_len, whole_str, whole_uint, Reader};
use super::{
    decode, keys, plain, DecodeEventError, EncodeEventError, Envelope, Message, MessageLimits,
    MAX_NESTING_DEPTH, WIRE_VERSION,
};

/// The `kind` of a batch.
pub const BATCH_KIND: &str = "batch";

/// The key of a batch's events.
pub const EVENTS_KEY: &str = "events";

/// The default limit on the size of a batch message: the NATS server's default
/// `max_payload` (1 MiB).
pub const DEFAULT_MAX_BATCH_BYTES: usize = 1 << 20;

/// How the encoder starts every batch: `{"v": 1, "kind": "batch", "events": `, then the
/// array's header. A router recognises this prefix without a second look; other key orders
/// are recognised too, after a failed single-event decode.
const CANONICAL_PREFIX: [u8; 22] = [
    0x83, // map of 3
    0xa1, b'v', 0x01, // "v": 1
    0xa4, b'k', b'i', b'n', b'd', 0xa5, b'b', b'a', b't', b'c', b'h', // "kind": "batch"
    0xa6, b'e', b'v', b'e', b'n', b't', b's', // "events":
];

/// The longest array header (`array32`).
const MAX_ARRAY_HEADER: usize = 5;

/// The events of a batch, each decoded on its own, in order.
#[derive(Debug, Clone)]
pub struct BatchEvents<'a> {
    events: std::vec::IntoIter<Result<Envelope, DecodeEventError>>,
    /// Borrowed like the message, so that a later version may decode lazily again.
    _message: PhantomData<&'a [u8]>,
}

impl BatchEvents<'_> {
    /// Events not yet taken.
    pub fn remaining(&self) -> usize {
        self.events.len()
    }
}

impl Iterator for BatchEvents<'_> {
    type Item = Result<Envelope, DecodeEventError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.events.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.events.size_hint()
    }
}

impl ExactSizeIterator for BatchEvents<'_> {}

/// Decodes the `count` events that start `body`, each as if alone; `None` when one of them
/// cannot even be measured (the batch is then refused whole). Also returns where they end.
fn decode_events(
    body: &[u8],
    count: usize,
    max_event_bytes: usize,
) -> Option<(Vec<Result<Envelope, DecodeEventError>>, usize)> {
    // Every event takes at least a byte: a count larger than the body fails below anyway.
    let mut events = Vec::with_capacity(count.min(body.len()));
    let mut pos = 0;
    for _ in 0..count {
        let rest = body.get(pos..)?;
        // A plain event is read in the same pass that measures it.
        if let Some((raw, len)) = plain::read(rest) {
            if len <= max_event_bytes {
                events.push(raw.validate(false));
                pos += len;
                continue;
            }
        }
        let len = value_len(rest, MAX_NESTING_DEPTH)?;
        events.push(match decode(&rest[..len], max_event_bytes) {
            Err(DecodeEventError::UnknownKind { kind }) if kind == BATCH_KIND => Err(
                DecodeEventError::Malformed("a batch inside a batch is not an event".into()),
            ),
            other => other,
        });
        pos += len;
    }
    Some((events, pos))
}

fn batch_of(events: Vec<Result<Envelope, DecodeEventError>>) -> Message<'static> {
    Message::Batch(BatchEvents {
        events: events.into_iter(),
        _message: PhantomData,
    })
}

/// Whether `bytes` starts as the encoder starts every batch.
pub(super) fn starts_canonically(bytes: &[u8]) -> bool {
    bytes.starts_with(&CANONICAL_PREFIX)
}

/// A batch written as the encoder writes it (the canonical prefix, then one array of at least
/// one event, and nothing after it), read in one pass; `None` for anything else, which the
/// general reader then answers.
fn read_canonical(bytes: &[u8], max_event_bytes: usize) -> Option<Message<'static>> {
    let mut reader = Reader::new(bytes.strip_prefix(&CANONICAL_PREFIX[..])?);
    let count = reader.array_len().filter(|&n| n > 0)?;
    let body = reader.rest();
    let (events, end) = decode_events(body, count, max_event_bytes)?;
    (end == body.len()).then(|| batch_of(events))
}

/// Whether `bytes` is a map whose `kind` is `"batch"`, looking no deeper than its top level.
pub(super) fn is_batch(bytes: &[u8]) -> bool {
    let mut pairs = TopLevel::new(bytes);
    while let Some(Ok((key, value))) = pairs.next() {
        if key == keys::KIND {
            return whole_str(value) == Some(BATCH_KIND);
        }
    }
    false
}

/// The key/value pairs of the map that starts a message, each value as its raw bytes; an
/// `Err` says why the map cannot be read on, and ends it.
struct TopLevel<'a> {
    reader: Reader<'a>,
    pairs: Option<usize>,
}

impl<'a> TopLevel<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        let mut reader = Reader::new(bytes);
        let pairs = reader.map_len();
        Self { reader, pairs }
    }

    /// Where the map ended, once every pair was taken.
    fn end(&self) -> usize {
        self.reader.pos()
    }
}

impl<'a> Iterator for TopLevel<'a> {
    type Item = Result<(&'a str, &'a [u8]), &'static str>;

    fn next(&mut self) -> Option<Self::Item> {
        let Some(pairs) = self.pairs.as_mut() else {
            self.pairs = Some(0);
            return Some(Err("a message must be a MessagePack map"));
        };
        if *pairs == 0 {
            return None;
        }
        *pairs -= 1;
        let key = self.reader.pos();
        let broken = if self.reader.skip(1).is_none() {
            "the batch is cut short or malformed"
        } else if let Some(key) = whole_str(self.reader.since(key)) {
            let value = self.reader.pos();
            if self.reader.skip(MAX_NESTING_DEPTH + 1).is_some() {
                return Some(Ok((key, self.reader.since(value))));
            }
            "the batch is cut short or malformed"
        } else {
            "a batch's keys must be strings"
        };
        *pairs = 0;
        Some(Err(broken))
    }
}

/// How many events a batch declares: the length of the array under its first `events` key,
/// wherever that key is, as long as the pairs before it can be measured; 1 when that array's
/// header cannot be read (no `events`, not an array, the map broken before it).
fn declared_events(bytes: &[u8]) -> usize {
    let mut reader = Reader::new(bytes);
    for _ in 0..reader.map_len().unwrap_or(0) {
        let key = reader.pos();
        if reader.skip(1).is_none() {
            break;
        }
        if whole_str(reader.since(key)) == Some(EVENTS_KEY) {
            return reader.array_len().unwrap_or(1);
        }
        if reader.skip(MAX_NESTING_DEPTH + 1).is_none() {
            break;
        }
    }
    1
}

/// Reads a message known to be a batch (its `kind` is `"batch"`, or it starts like one).
pub(super) fn read_batch(bytes: &[u8], limits: MessageLimits) -> Message<'_> {
    if bytes.len() > limits.max_batch_bytes {
        // Not read: counted once, as any message over its limit.
        return Message::Event(Err(DecodeEventError::Oversized {
            len: bytes.len(),
            max: limits.max_batch_bytes,
        }));
    }
    match read_canonical(bytes, limits.max_event_bytes) {
        Some(batch) => batch,
        None => read_general(bytes, limits),
    }
}

/// Reads a batch in any key order, and answers every batch [`read_canonical`] leaves.
fn read_general(bytes: &[u8], limits: MessageLimits) -> Message<'_> {
    // Whatever the reason and wherever it is found, a refused batch drops every event it
    // declares, at least one and at most one per byte.
    let refused = |error: DecodeEventError| Message::Refused {
        events: declared_events(bytes).clamp(1, bytes.len().max(1)),
        error,
    };
    let malformed = |why: &str| refused(DecodeEventError::Malformed(why.into()));

    let mut version = None;
    let mut events = None;
    // Every key, as in an event: a repeated one makes the map ambiguous.
    let mut keys_seen = hashbrown::HashSet::new();
    let mut pairs = TopLevel::new(bytes);
    for pair in pairs.by_ref() {
        let (key, value) = match pair {
            Ok(pair) => pair,
            Err(why) => return malformed(why),
        };
        if !keys_seen.insert(key) {
            return malformed("duplicate key in a batch");
        }
        match key {
            keys::VERSION => version = Some(whole_uint(value)),
            EVENTS_KEY => {
                let mut reader = Reader::new(value);
                let Some(count) = reader.array_len() else {
                    return malformed("a batch's `events` must be an array");
                };
                events = Some((count, reader.rest()));
            }
            _ => {}
        }
    }
    match version {
        Some(Some(v)) if v == u64::from(WIRE_VERSION) => {}
        Some(Some(found)) => {
            return refused(DecodeEventError::UnsupportedVersion {
                found: u16::try_from(found).unwrap_or(u16::MAX),
                supported: WIRE_VERSION,
            })
        }
        Some(None) => return malformed("a batch's `v` must be an unsigned integer"),
        None => return malformed("missing field `v`"),
    }
    if pairs.end() != bytes.len() {
        return malformed("bytes after the batch");
    }
    let Some((count, body)) = events else {
        return malformed("missing field `events`");
    };
    if count == 0 {
        return malformed("a batch holds at least one event");
    }
    // Every event must be measurable before any is applied: a batch is read whole or not.
    match decode_events(body, count, limits.max_event_bytes) {
        Some((events, _)) => batch_of(events),
        None => malformed("the batch is cut short or malformed"),
    }
}

/// Builds batch messages from encoded events, without copying them again.
///
/// Room for the batch header is kept at the front of the buffer; [`BatchWriter::finish`]
/// writes the header there and hands out the message as a slice of the same allocation.
#[derive(Debug)]
pub struct BatchWriter {
    buf: Vec<u8>,
    events: usize,
}

/// Bytes kept in front of the first event for the header.
const HEADER_ROOM: usize = CANONICAL_PREFIX.len() + MAX_ARRAY_HEADER;

impl Default for BatchWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl BatchWriter {
    /// A writer with room for about 1 KiB of events before it grows.
    pub fn new() -> Self {
        Self::with_capacity(1024)
    }

    /// A writer whose buffer holds `bytes` of events before it grows.
    pub fn with_capacity(bytes: usize) -> Self {
        let mut buf = Vec::with_capacity(HEADER_ROOM + bytes);
        buf.resize(HEADER_ROOM, 0);
        Self { buf, events: 0 }
    }

    /// Appends one event; on error the writer is left as it was.
    pub fn push(&mut self, envelope: &Envelope) -> Result<(), EncodeEventError> {
        super::encode_into(envelope, &mut self.buf)?;
        self.events += 1;
        Ok(())
    }

    /// Appends one event already encoded by [`super::encode_into`].
    pub(crate) fn push_encoded(&mut self, event: &[u8]) {
        self.buf.extend_from_slice(event);
        self.events += 1;
    }

    /// Events pushed so far.
    pub fn events(&self) -> usize {
        self.events
    }

    /// Whether no event was pushed.
    pub fn is_empty(&self) -> bool {
        self.events == 0
    }

    /// The size of the message [`finish`](Self::finish) would give now, and an upper bound
    /// of it once one more event of `next` bytes is pushed.
    pub fn message_len(&self, next: usize) -> usize {
        let body = self.buf.len() - HEADER_ROOM + next;
        match self.events + usize::from(next > 0) {
            0 => 0,
            1 => body,
            n => CANONICAL_PREFIX.len() + array_header_len(n) + body,
        }
    }

    /// The message: the event itself when there is one (a plain 1.0 message), a batch when
    /// there are more, nothing when there are none. The writer is empty afterwards.
    pub fn finish(&mut self) -> Option<Bytes> {
        let events = std::mem::take(&mut self.events);
        let mut buf = std::mem::take(&mut self.buf);
        self.buf = Vec::with_capacity(buf.capacity());
        self.buf.resize(HEADER_ROOM, 0);
        let start = match events {
            0 => return None,
            1 => HEADER_ROOM,
            n => {
                let mut header = Vec::with_capacity(HEADER_ROOM);
                header.extend_from_slice(&CANONICAL_PREFIX);
                // Writing into a Vec cannot fail.
                let _ =
                    rmp::encode::write_array_len(&mut header, u32::try_from(n).unwrap_or(u32::MAX));
                let start = HEADER_ROOM - header.len();
                buf[start..HEADER_ROOM].copy_from_slice(&header);
                start
            }
        };
        Some(Bytes::from(buf).slice(start..))
    }
}

fn array_header_len(n: usize) -> usize {
    match n {
        0..=15 => 1,
        16..=0xffff => 3,
        _ => 5,
    }
}

/// The batch message of `envelopes` (at least one), always as a batch, even of one event.
pub fn encode_batch(envelopes: &[Envelope]) -> Result<Vec<u8>, EncodeEventError> {
    if envelopes.is_empty() {
        return Err(EncodeEventError::EmptyBatch);
    }
    let len = u32::try_from(envelopes.len()).map_err(|_| {
        EncodeEventError::Serialize("more than u32::MAX events in one batch".into())
    })?;
    let mut out = Vec::with_capacity(HEADER_ROOM + 96 * envelopes.len());
    out.extend_from_slice(&CANONICAL_PREFIX);
    // Writing into a Vec cannot fail.
    let _ = rmp::encode::write_array_len(&mut out, len);
    for envelope in envelopes {
        super::encode_into(envelope, &mut out)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::{Admitted, Completed, ProgressStage, Progressed, WorkerReset};
    use super::*;
    use crate::wire::{decode_message, encode, Outcome};

    fn events(n: u64) -> Vec<Envelope> {
        (1..=n)
            .map(|seq| {
                let rid = format!("r-{seq}");
                let event: crate::wire::LeaseEvent = match seq % 4 {
                    0 => Admitted {
                        block_hashes: Vec::new(),
                        block_capacity: None,
                        class: None,
                        request_id: rid,
                        worker_id: 3,
                        dp_rank: 0,
                        prompt_tokens: 512,
                        expected_output_tokens: Some(64),
                        cached_tokens: None,
                    }
                    .into(),
                    1 => Progressed {
                        request_id: rid,
                        worker_id: 3,
                        dp_rank: 1,
                        stage: ProgressStage::Decoding,
                        output_tokens: 7,
                    }
                    .into(),
                    2 => Completed {
                        request_id: rid,
                        worker_id: 3,
                        dp_rank: 0,
                        outcome: Outcome::Finished,
                    }
                    .into(),
                    _ => WorkerReset {
                        worker_id: 3,
                        dp_rank: None,
                        leaving: false,
                    }
                    .into(),
                };
                Envelope::new(42, seq, 1_700_000_000_000_000 + seq, event)
            })
            .collect()
    }

    fn limits() -> MessageLimits {
        MessageLimits::default()
    }

    /// The events of `bytes`, which must be a readable batch.
    fn batch(bytes: &[u8], limits: MessageLimits) -> Vec<Result<Envelope, DecodeEventError>> {
        match decode_message(bytes, limits) {
            Message::Batch(events) => {
                assert_eq!(events.len(), events.remaining());
                events.collect()
            }
            other => panic!("not a readable batch: {other:?}"),
        }
    }

    fn refused(bytes: &[u8]) -> (usize, DecodeEventError) {
        match decode_message(bytes, limits()) {
            Message::Refused { events, error } => (events, error),
            other => panic!("not refused: {other:?}"),
        }
    }

    /// Writes one MessagePack value.
    type Write<'a> = &'a dyn Fn(&mut Vec<u8>);

    /// A batch map written by hand: `pairs` in the given order.
    fn map(pairs: &[(&str, Write<'_>)]) -> Vec<u8> {
        let mut out = Vec::new();
        rmp::encode::write_map_len(&mut out, pairs.len() as u32).unwrap();
        for (key, value) in pairs {
            rmp::encode::write_str(&mut out, key).unwrap();
            value(&mut out);
        }
        out
    }

    fn array_of(events: &[Vec<u8>]) -> impl Fn(&mut Vec<u8>) + '_ {
        move |out: &mut Vec<u8>| {
            rmp::encode::write_array_len(out, events.len() as u32).unwrap();
            for event in events {
                out.extend_from_slice(event);
            }
        }
    }

    #[test]
    fn a_batch_decodes_to_its_events_in_order() {
        let sent = events(9);
        let bytes = encode_batch(&sent).unwrap();
        assert!(bytes.starts_with(&CANONICAL_PREFIX));
        let got: Vec<_> = batch(&bytes, limits())
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(got, sent);
        // Bigger than one event may be, smaller than a batch may be.
        let bytes = encode_batch(&events(200)).unwrap();
        assert!(bytes.len() > DEFAULT_MAX_EVENT_BYTES_FOR_TESTS);
        assert_eq!(batch(&bytes, limits()).len(), 200);
    }

    const DEFAULT_MAX_EVENT_BYTES_FOR_TESTS: usize = crate::wire::DEFAULT_MAX_EVENT_BYTES;

    #[test]
    fn single_events_are_still_single_events() {
        for envelope in events(4) {
            let bytes = encode(&envelope).unwrap();
            match decode_message(&bytes, limits()) {
                Message::Event(Ok(got)) => assert_eq!(got, envelope),
                other => panic!("{other:?}"),
            }
        }
        // And a bad one keeps its reason.
        match decode_message(&[0xc1], limits()) {
            Message::Event(Err(DecodeEventError::Malformed(_))) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_writer_sends_one_event_plain_and_more_as_a_batch() {
        let sent = events(20);
        let mut writer = BatchWriter::new();
        assert!(writer.is_empty());
        assert_eq!(writer.finish(), None, "nothing to send");
        writer.push(&sent[0]).unwrap();
        assert!(!writer.is_empty());
        let one = encode(&sent[0]).unwrap();
        assert_eq!(writer.message_len(0), one.len());
        assert_eq!(
            writer.finish().unwrap(),
            one,
            "one event: a plain 1.0 message"
        );
        assert!(writer.is_empty(), "finish empties the writer");
        for (i, envelope) in sent.iter().enumerate() {
            let next = encode(envelope).unwrap().len();
            let predicted = writer.message_len(next);
            writer.push(envelope).unwrap();
            assert_eq!(writer.events(), i + 1);
            assert_eq!(writer.message_len(0), predicted, "after {} events", i + 1);
        }
        let bytes = writer.finish().unwrap();
        assert_eq!(bytes.len(), predicted_len(&sent));
        assert_eq!(
            bytes,
            encode_batch(&sent).unwrap(),
            "the writer and encode_batch agree"
        );
        // Up to 15 events the array header is one byte.
        let mut writer = BatchWriter::new();
        for envelope in &sent[..3] {
            writer.push(envelope).unwrap();
        }
        let len = writer.message_len(0);
        assert_eq!(writer.finish().unwrap().len(), len);
        // The array header grows past 15 events: still measured right.
        let mut writer = BatchWriter::with_capacity(0);
        for envelope in events(16).iter().chain(&events(1)) {
            writer.push(envelope).unwrap();
        }
        let len = writer.message_len(0);
        assert_eq!(writer.finish().unwrap().len(), len);
    }

    fn predicted_len(sent: &[Envelope]) -> usize {
        encode_batch(sent).unwrap().len()
    }

    #[test]
    fn another_key_order_and_unknown_keys_are_a_batch_too() {
        let sent = events(3);
        let encoded: Vec<_> = sent.iter().map(|e| encode(e).unwrap()).collect();
        let bytes = map(&[
            ("extra", &|out: &mut Vec<u8>| {
                rmp::encode::write_array_len(out, 1).unwrap();
                rmp::encode::write_nil(out).unwrap();
            }),
            ("events", &array_of(&encoded)),
            ("kind", &|out: &mut Vec<u8>| {
                rmp::encode::write_str(out, "batch").unwrap()
            }),
            ("v", &|out: &mut Vec<u8>| {
                rmp::encode::write_u64(out, 1).unwrap()
            }),
        ]);
        let got: Vec<_> = batch(&bytes, limits())
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(got, sent);
        // Above the event limit it is still recognised, not refused as oversized.
        let small = MessageLimits {
            max_event_bytes: 64,
            max_batch_bytes: 4096,
        };
        assert!(bytes.len() > 64);
        assert_eq!(batch(&bytes, small).len(), 3);
    }

    #[test]
    fn a_bad_event_drops_alone_when_the_rest_can_be_read() {
        let sent = events(3);
        let mut wrong_type = Vec::new();
        rmp::encode::write_map_len(&mut wrong_type, 2).unwrap();
        rmp::encode::write_str(&mut wrong_type, "v").unwrap();
        rmp::encode::write_str(&mut wrong_type, "one").unwrap();
        rmp::encode::write_str(&mut wrong_type, "kind").unwrap();
        rmp::encode::write_str(&mut wrong_type, "admitted").unwrap();
        let nested = encode_batch(&sent[..1]).unwrap();
        let huge = {
            let mut e = sent[0].clone();
            if let crate::wire::LeaseEvent::Progressed(p) = &mut e.event {
                p.request_id = "x".repeat(200);
            }
            encode(&e).unwrap()
        };
        let encoded = vec![
            encode(&sent[0]).unwrap(),
            wrong_type,
            encode(&sent[1]).unwrap(),
            nested,
            vec![0x07], // a number, not a map
            huge,
            encode(&sent[2]).unwrap(),
        ];
        let bytes = map(&[
            ("v", &|out: &mut Vec<u8>| {
                rmp::encode::write_u8(out, 1).unwrap()
            }),
            ("kind", &|out: &mut Vec<u8>| {
                rmp::encode::write_str(out, "batch").unwrap()
            }),
            ("events", &array_of(&encoded)),
        ]);
        let limits = MessageLimits {
            max_event_bytes: 150,
            max_batch_bytes: 4096,
        };
        let got = batch(&bytes, limits);
        assert_eq!(got.len(), 7);
        assert_eq!(got[0].as_ref().unwrap(), &sent[0]);
        assert_eq!(got[2].as_ref().unwrap(), &sent[1]);
        assert_eq!(got[6].as_ref().unwrap(), &sent[2]);
        let reasons: Vec<_> = got
            .iter()
            .map(|r| r.as_ref().err().map(|e| e.reason()))
            .collect();
        assert_eq!(
            reasons,
            [
                None,
                Some("decode"),
                None,
                Some("decode"),
                Some("decode"),
                Some("oversized"),
                None
            ]
        );
        assert!(
            matches!(&got[3], Err(DecodeEventError::Malformed(m)) if m.contains("batch inside"))
        );
    }

    #[test]
    fn an_unreadable_batch_drops_every_event_it_declares() {
        let bytes = encode_batch(&events(5)).unwrap();
        for cut in CANONICAL_PREFIX.len() + 1..bytes.len() {
            let (n, error) = refused(&bytes[..cut]);
            assert_eq!((n, error.reason()), (5, "decode"), "cut at {cut}");
        }
        // Before the array's header even the count is unknown: one message, one drop.
        for cut in 1..=CANONICAL_PREFIX.len() {
            match decode_message(&bytes[..cut], limits()) {
                Message::Refused { events: 1, error } => assert_eq!(error.reason(), "decode"),
                Message::Event(Err(error)) => assert_eq!(error.reason(), "decode"),
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        let mut trailing = bytes.clone();
        trailing.push(0xc0);
        assert_eq!(refused(&trailing).0, 5, "bytes after the batch");
        // A count no message could hold is not believed: at most one per byte.
        let mut claims = CANONICAL_PREFIX.to_vec();
        claims.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x80]);
        let (n, _) = refused(&claims);
        assert!(n <= claims.len(), "{n}");
    }

    /// An event of a kind this router does not know is dropped alone as `UnknownKind` (a
    /// newer publisher's), in the encoder's layout and in another; only a batch inside a
    /// batch is malformed.
    #[test]
    fn an_unknown_kind_inside_a_batch_is_unknown_not_malformed() {
        let sent = events(1);
        let first = encode(&sent[0]).unwrap();
        let unknown = map(&[
            ("v", &|out: &mut Vec<u8>| {
                rmp::encode::write_u8(out, 1).unwrap()
            }),
            ("pub", &|out: &mut Vec<u8>| {
                rmp::encode::write_u8(out, 1).unwrap()
            }),
            ("seq", &|out: &mut Vec<u8>| {
                rmp::encode::write_u8(out, 2).unwrap()
            }),
            ("ts", &|out: &mut Vec<u8>| {
                rmp::encode::write_u8(out, 3).unwrap()
            }),
            ("kind", &|out: &mut Vec<u8>| {
                rmp::encode::write_str(out, "kv_offloaded").unwrap()
            }),
        ]);
        let mut canonical = CANONICAL_PREFIX.to_vec();
        rmp::encode::write_array_len(&mut canonical, 2).unwrap();
        canonical.extend_from_slice(&first);
        canonical.extend_from_slice(&unknown);
        let reordered = map(&[
            ("events", &array_of(&[first.clone(), unknown.clone()])),
            ("kind", &|out: &mut Vec<u8>| {
                rmp::encode::write_str(out, "batch").unwrap()
            }),
            ("v", &|out: &mut Vec<u8>| {
                rmp::encode::write_u8(out, 1).unwrap()
            }),
        ]);
        for bytes in [canonical, reordered] {
            let got = batch(&bytes, limits());
            assert_eq!(got[0].as_ref().unwrap(), &sent[0]);
            assert_eq!(
                got[1],
                Err(DecodeEventError::UnknownKind {
                    kind: "kv_offloaded".into()
                })
            );
        }
    }

    /// A batch of no events is refused in the encoder's own layout too.
    #[test]
    fn an_empty_batch_in_the_canonical_layout_is_refused() {
        let mut bytes = CANONICAL_PREFIX.to_vec();
        rmp::encode::write_array_len(&mut bytes, 0).unwrap();
        assert_eq!(
            refused(&bytes),
            (
                1,
                DecodeEventError::Malformed("a batch holds at least one event".into())
            )
        );
    }

    /// A batch's top-level values that it does not read (a newer publisher's) are skipped
    /// up to MAX_NESTING_DEPTH + 1 levels of containers, both to read the batch and to count
    /// what a refused one declares; deeper, the batch is malformed.
    #[test]
    fn the_top_level_skips_values_as_deep_as_its_bound() {
        let nested = |levels: usize| {
            move |out: &mut Vec<u8>| {
                out.extend(std::iter::repeat_n(0x91, levels));
                out.push(0x01);
            }
        };
        let sent = events(3);
        let encoded: Vec<_> = sent.iter().map(|e| encode(e).unwrap()).collect();
        let with_extra = |levels: usize, version: u8| {
            map(&[
                ("v", &move |out: &mut Vec<u8>| {
                    rmp::encode::write_u8(out, version).unwrap()
                }),
                ("kind", &|out: &mut Vec<u8>| {
                    rmp::encode::write_str(out, "batch").unwrap()
                }),
                ("extra", &nested(levels)),
                ("events", &array_of(&encoded)),
            ])
        };
        let deepest = MAX_NESTING_DEPTH + 1;
        let got: Vec<_> = batch(&with_extra(deepest, 1), limits())
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(got, sent);
        assert_eq!(
            refused(&with_extra(deepest + 1, 1)).1,
            DecodeEventError::Malformed("the batch is cut short or malformed".into())
        );
        // A newer version's batch drops every event it declares, past the deep value.
        assert_eq!(refused(&with_extra(deepest, 2)).0, 3);
    }

    #[test]
    fn a_newer_version_drops_the_whole_batch_per_event() {
        let encoded: Vec<_> = events(4).iter().map(|e| encode(e).unwrap()).collect();
        let bytes = map(&[
            ("v", &|out: &mut Vec<u8>| {
                rmp::encode::write_u8(out, 2).unwrap()
            }),
            ("kind", &|out: &mut Vec<u8>| {
                rmp::encode::write_str(out, "batch").unwrap()
            }),
            ("events", &array_of(&encoded)),
        ]);
        let (n, error) = refused(&bytes);
        assert_eq!(n, 4);
        assert_eq!(
            error,
            DecodeEventError::UnsupportedVersion {
                found: 2,
                supported: WIRE_VERSION
            }
        );
    }

    #[test]
    fn malformed_batch_envelopes_are_refused() {
        let encoded: Vec<_> = events(2).iter().map(|e| encode(e).unwrap()).collect();
        let v1 = |out: &mut Vec<u8>| rmp::encode::write_u8(out, 1).unwrap();
        let kind = |out: &mut Vec<u8>| rmp::encode::write_str(out, "batch").unwrap();
        // `{"v": 1, "kind": "batch", <pair>, "events": [..]}`, the pair written as is.
        let with_raw_pair = |pair: &[u8], events: &[Vec<u8>]| {
            let mut bytes = map(&[("v", &v1), ("kind", &kind)]);
            bytes[0] = 0x84;
            bytes.extend_from_slice(pair);
            bytes.extend_from_slice(&map(&[("events", &array_of(events))])[1..]);
            bytes
        };
        let cases: Vec<(&str, Vec<u8>, usize)> = vec![
            ("no events", map(&[("v", &v1), ("kind", &kind)]), 1),
            (
                "no version",
                map(&[("kind", &kind), ("events", &array_of(&encoded))]),
                2,
            ),
            (
                "empty",
                map(&[("v", &v1), ("kind", &kind), ("events", &array_of(&[]))]),
                1,
            ),
            (
                "events not an array",
                map(&[("v", &v1), ("kind", &kind), ("events", &kind)]),
                1,
            ),
            (
                "a string version",
                map(&[
                    ("v", &kind),
                    ("kind", &kind),
                    ("events", &array_of(&encoded)),
                ]),
                2,
            ),
            (
                "a negative version",
                map(&[
                    ("v", &|out: &mut Vec<u8>| {
                        rmp::encode::write_sint(out, -1).unwrap();
                    }),
                    ("kind", &kind),
                    ("events", &array_of(&encoded)),
                ]),
                2,
            ),
            (
                "duplicate events",
                map(&[
                    ("v", &v1),
                    ("kind", &kind),
                    ("events", &array_of(&encoded)),
                    ("events", &array_of(&encoded)),
                ]),
                2,
            ),
            // A repeated key before `events` as after it: the count is readable either way.
            (
                "a duplicate unknown key",
                map(&[
                    ("x", &v1),
                    ("v", &v1),
                    ("x", &v1),
                    ("kind", &kind),
                    ("events", &array_of(&encoded)),
                ]),
                2,
            ),
            (
                "duplicate kind",
                map(&[
                    ("v", &v1),
                    ("kind", &kind),
                    ("kind", &kind),
                    ("events", &array_of(&encoded)),
                ]),
                2,
            ),
            (
                "duplicate kind after the events",
                map(&[
                    ("v", &v1),
                    ("kind", &kind),
                    ("events", &array_of(&encoded)),
                    ("kind", &kind),
                ]),
                2,
            ),
            (
                "duplicate version before the events",
                map(&[
                    ("kind", &kind),
                    ("v", &v1),
                    ("v", &v1),
                    ("events", &array_of(&encoded)),
                ]),
                2,
            ),
            (
                "a key that is not a string, before the events",
                with_raw_pair(&[0x01, 0x01], &encoded),
                2,
            ),
            (
                "a value that is not MessagePack, before the events: no count",
                with_raw_pair(&[0xa1, b'x', 0xc1], &encoded),
                1,
            ),
        ];
        for (what, bytes, declared) in cases {
            let (n, error) = refused(&bytes);
            assert_eq!((n, error.reason()), (declared, "decode"), "{what}");
        }
    }

    /// A repeated key anywhere (before `events`, after it, repeating it): every declared
    /// event is counted, whatever the order of the keys.
    #[test]
    fn a_repeated_key_counts_every_declared_event_in_any_key_order() {
        let encoded: Vec<_> = events(3).iter().map(|e| encode(e).unwrap()).collect();
        let v1 = |out: &mut Vec<u8>| rmp::encode::write_u8(out, 1).unwrap();
        let kind = |out: &mut Vec<u8>| rmp::encode::write_str(out, "batch").unwrap();
        let events = array_of(&encoded);
        let pairs: [(&str, Write<'_>); 4] =
            [("v", &v1), ("kind", &kind), ("events", &events), ("x", &v1)];
        for repeated in 0..pairs.len() {
            for at in 0..=pairs.len() {
                let mut order = pairs.to_vec();
                order.insert(at, pairs[repeated]);
                let bytes = map(&order);
                match decode_message(&bytes, limits()) {
                    Message::Refused { events, error } => {
                        assert_eq!(
                            (events, error.reason()),
                            (3, "decode"),
                            "{repeated} at {at}"
                        );
                    }
                    other => panic!("{repeated} at {at}: {other:?}"),
                }
            }
        }
    }

    #[test]
    fn size_limits_apply_to_batches_and_events_apart() {
        let bytes = encode_batch(&events(100)).unwrap();
        let tight = MessageLimits {
            max_event_bytes: 4096,
            max_batch_bytes: bytes.len() - 1,
        };
        match decode_message(&bytes, tight) {
            Message::Event(Err(DecodeEventError::Oversized { len, max })) => {
                assert_eq!((len, max), (bytes.len(), bytes.len() - 1));
            }
            other => panic!("{other:?}"),
        }
        // A single event above the event limit is oversized even when batches may be larger.
        let one = encode(&events(1)[0]).unwrap();
        let small = MessageLimits {
            max_event_bytes: one.len() - 1,
            max_batch_bytes: 1 << 20,
        };
        match decode_message(&one, small) {
            Message::Event(Err(DecodeEventError::Oversized { max, .. })) => {
                assert_eq!(max, one.len() - 1);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_limits_are_inclusive_and_the_largest_is_named_above_both() {
        let one = encode(&events(1)[0]).unwrap();
        let exact = MessageLimits {
            max_event_bytes: one.len(),
            max_batch_bytes: 64,
        };
        assert!(matches!(decode_message(&one, exact), Message::Event(Ok(_))));
        let batch = encode_batch(&events(100)).unwrap();
        let exact = MessageLimits {
            max_event_bytes: 4096,
            max_batch_bytes: batch.len(),
        };
        assert!(batch.len() > 4096);
        assert_eq!(self::batch(&batch, exact).len(), 100);
        // Over every limit: refused unread, naming the largest.
        let small = MessageLimits {
            max_event_bytes: one.len() - 20,
            max_batch_bytes: one.len() - 10,
        };
        match decode_message(&one, small) {
            Message::Event(Err(DecodeEventError::Oversized { len, max })) => {
                assert_eq!((len, max), (one.len(), one.len() - 10));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn no_prefix_of_any_message_panics() {
        let mut bytes = encode_batch(&events(6)).unwrap();
        let single = encode(&events(1)[0]).unwrap();
        for message in [bytes.clone(), single] {
            for cut in 0..=message.len() {
                let _ = decode_message(&message[..cut], limits());
            }
        }
        // Every byte flipped in turn: whatever it reads as, it is counted and nothing panics.
        for i in 0..bytes.len() {
            bytes[i] ^= 0xff;
            match decode_message(&bytes, limits()) {
                Message::Batch(events) => {
                    let n = events.len();
                    assert_eq!(events.count(), n);
                }
                Message::Refused { events, .. } => assert!((1..=bytes.len()).contains(&events)),
                Message::Event(_) => {}
            }
            bytes[i] ^= 0xff;
        }
    }

    /// What a message reads as, in a form that compares.
    fn answer(message: Message<'_>) -> String {
        match message {
            Message::Batch(events) => format!("batch {:?}", events.collect::<Vec<_>>()),
            other => format!("{other:?}"),
        }
    }

    /// A batch of the encoder's events, some of them replaced by not-plain ones (unknown keys,
    /// signed integers, a nested value, a wrong kind, a batch), then damaged.
    fn damaged_batch(seed: u64) -> Vec<u8> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n = rng.random_range(1..40u64);
        let mut encoded: Vec<Vec<u8>> = events(n).iter().map(|e| encode(e).unwrap()).collect();
        for event in &mut encoded {
            match rng.random_range(0..12) {
                0 => {
                    event[0] += 1;
                    event.extend_from_slice(&[0xa1, b'x', 0x91, 0x91, 0x01]);
                }
                1 => {
                    let at = event.windows(4).position(|w| w == b"\xa3seq").unwrap();
                    event.splice(at + 4..at + 4, [0xd0]);
                }
                2 => *event = encode_batch(&events(2)).unwrap(),
                3 => {
                    let at = event.windows(5).position(|w| w == b"\xa4kind").unwrap();
                    event[at + 6] ^= 0x01;
                }
                4 => event[0] = 0x8f,
                _ => {}
            }
        }
        let mut bytes = encode_batch(&events(1)).unwrap();
        bytes.truncate(CANONICAL_PREFIX.len());
        match rng.random_range(0..10) {
            0 => bytes.extend_from_slice(&[0xdd, 0, 0, 0, encoded.len() as u8]),
            1 => drop(rmp::encode::write_array_len(
                &mut bytes,
                encoded.len() as u32 + 1,
            )),
            2 => drop(rmp::encode::write_array_len(&mut bytes, 0)),
            _ => drop(rmp::encode::write_array_len(
                &mut bytes,
                encoded.len() as u32,
            )),
        }
        for event in &encoded {
            bytes.extend_from_slice(event);
        }
        match rng.random_range(0..8) {
            0 => bytes.push(0xc0),
            1 => {
                let cut = rng.random_range(0..bytes.len());
                bytes.truncate(cut);
            }
            2 => {
                let at = rng.random_range(0..bytes.len());
                bytes[at] = rng.random();
            }
            _ => {}
        }
        bytes
    }

    #[test]
    fn the_canonical_reader_answers_as_the_general_one() {
        let small = MessageLimits {
            max_event_bytes: 40,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
        };
        let mut canonical = 0;
        for seed in 0..3000 {
            let bytes = damaged_batch(seed);
            for limits in [limits(), small] {
                let general = answer(read_general(&bytes, limits));
                if read_canonical(&bytes, limits.max_event_bytes).is_some() {
                    canonical += 1;
                }
                assert_eq!(
                    answer(read_batch(&bytes, limits)),
                    general,
                    "seed {seed}, {limits:?}, {bytes:x?}"
                );
            }
        }
        // Both kinds of answer were compared, often.
        assert!((500..5000).contains(&canonical), "{canonical}");
    }
}

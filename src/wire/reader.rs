//! The one MessagePack byte reader of this module.
//!
//! A cursor over a byte slice that reads headers and scalars and skips whole values, and
//! answers `None` (moving no further than it got) at the first byte it cannot take: a cut, a
//! marker of another type, a value nested too deep. The plain event reader, the batch walker
//! and the full decoder's end-of-map check are all written over it; it knows nothing of the
//! contract's keys.

use rmp::Marker;

/// A position in a MessagePack byte slice.
#[derive(Clone, Debug)]
pub(super) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `bytes`.
    #[inline]
    pub(super) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    /// How many bytes were read.
    #[inline]
    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    /// The bytes not yet read.
    #[inline]
    pub(super) fn rest(&self) -> &'a [u8] {
        &self.bytes[self.pos..]
    }

    /// The bytes from `start` (an earlier [`pos`](Self::pos)) to here.
    #[inline]
    pub(super) fn since(&self, start: usize) -> &'a [u8] {
        &self.bytes[start..self.pos]
    }

    /// Whether every byte was read.
    #[inline]
    pub(super) fn is_at_end(&self) -> bool {
        self.pos == self.bytes.len()
    }

    /// One byte.
    #[inline]
    pub(super) fn byte(&mut self) -> Option<u8> {
        let b = *self.bytes.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    /// The next `n` bytes.
    #[inline]
    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let taken = self.bytes.get(self.pos..end)?;
        self.pos = end;
        Some(taken)
    }

    /// A big-endian unsigned integer of `n` bytes (at most 8).
    #[inline]
    pub(super) fn big_endian(&mut self, n: usize) -> Option<u64> {
        Some(
            self.take(n)?
                .iter()
                .fold(0, |acc, b| (acc << 8) | u64::from(*b)),
        )
    }

    /// A length field of `n` bytes (at most 4).
    #[inline]
    fn len_field(&mut self, n: usize) -> Option<usize> {
        usize::try_from(self.big_endian(n)?).ok()
    }

    /// The number of pairs of the map whose header is next.
    #[inline]
    pub(super) fn map_len(&mut self) -> Option<usize> {
        match self.byte()? {
            b @ 0x80..=0x8f => Some(usize::from(b & 0x0f)),
            0xde => self.len_field(2),
            0xdf => self.len_field(4),
            _ => None,
        }
    }

    /// The number of values of the array whose header is next.
    #[inline]
    pub(super) fn array_len(&mut self) -> Option<usize> {
        match self.byte()? {
            b @ 0x90..=0x9f => Some(usize::from(b & 0x0f)),
            0xdc => self.len_field(2),
            0xdd => self.len_field(4),
            _ => None,
        }
    }

    /// The bytes of a string of at most 31 bytes (`fixstr`), not checked to be UTF-8.
    #[inline]
    pub(super) fn fixstr(&mut self) -> Option<&'a [u8]> {
        match self.byte()? {
            b @ 0xa0..=0xbf => self.take(usize::from(b & 0x1f)),
            _ => None,
        }
    }

    /// The bytes of a string of any width, not checked to be UTF-8.
    #[inline]
    pub(super) fn str(&mut self) -> Option<&'a [u8]> {
        let len = match self.byte()? {
            b @ 0xa0..=0xbf => usize::from(b & 0x1f),
            0xd9 => self.len_field(1)?,
            0xda => self.len_field(2)?,
            0xdb => self.len_field(4)?,
            _ => return None,
        };
        self.take(len)
    }

    /// An unsigned integer written in an unsigned format (positive fixint, `uint8` to
    /// `uint64`).
    #[inline]
    pub(super) fn uint(&mut self) -> Option<u64> {
        match self.byte()? {
            b @ 0x00..=0x7f => Some(u64::from(b)),
            0xcc => self.big_endian(1),
            0xcd => self.big_endian(2),
            0xce => self.big_endian(4),
            0xcf => self.big_endian(8),
            _ => None,
        }
    }

    /// A non-negative integer in any integer format, signed or not.
    pub(super) fn non_negative_int(&mut self) -> Option<u64> {
        let signed = |n: u64, bytes: u32| {
            let sign_bit = 1u64 << (8 * bytes - 1);
            (n & sign_bit == 0).then_some(n)
        };
        match self.rest().first()? {
            0xd0 => {
                self.pos += 1;
                signed(self.big_endian(1)?, 1)
            }
            0xd1 => {
                self.pos += 1;
                signed(self.big_endian(2)?, 2)
            }
            0xd2 => {
                self.pos += 1;
                signed(self.big_endian(4)?, 4)
            }
            0xd3 => {
                self.pos += 1;
                signed(self.big_endian(8)?, 8)
            }
            _ => self.uint(),
        }
    }

    /// Whether the next value is nil; it is read if so.
    #[inline]
    pub(super) fn nil(&mut self) -> bool {
        let nil = self.bytes.get(self.pos) == Some(&0xc0);
        self.pos += usize::from(nil);
        nil
    }

    /// A boolean.
    #[inline]
    pub(super) fn bool(&mut self) -> Option<bool> {
        match self.byte()? {
            0xc2 => Some(false),
            0xc3 => Some(true),
            _ => None,
        }
    }

    /// Moves past one whole value, of any type; `None` if it is cut short, malformed or has
    /// containers nested deeper than `depth` (a container at depth 0 must be empty).
    pub(super) fn skip(&mut self, depth: usize) -> Option<()> {
        // (payload bytes, nested values), the header read.
        let (payload, nested) = match Marker::from_u8(self.byte()?) {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                (0, 0)
            }
            Marker::U8 | Marker::I8 => (1, 0),
            Marker::U16 | Marker::I16 => (2, 0),
            Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
            Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
            Marker::FixStr(n) => (usize::from(n), 0),
            Marker::Str8 | Marker::Bin8 => (self.len_field(1)?, 0),
            Marker::Str16 | Marker::Bin16 => (self.len_field(2)?, 0),
            Marker::Str32 | Marker::Bin32 => (self.len_field(4)?, 0),
            Marker::FixArray(n) => (0, usize::from(n)),
            Marker::Array16 => (0, self.len_field(2)?),
            Marker::Array32 => (0, self.len_field(4)?),
            Marker::FixMap(n) => (0, 2 * usize::from(n)),
            Marker::Map16 => (0, 2 * self.len_field(2)?),
            Marker::Map32 => (0, 2 * self.len_field(4)?),
            // The type byte, then the data.
            Marker::FixExt1 => (1 + 1, 0),
            Marker::FixExt2 => (1 + 2, 0),
            Marker::FixExt4 => (1 + 4, 0),
            Marker::FixExt8 => (1 + 8, 0),
            Marker::FixExt16 => (1 + 16, 0),
            Marker::Ext8 => (1 + self.len_field(1)?, 0),
            Marker::Ext16 => (1 + self.len_field(2)?, 0),
            Marker::Ext32 => (1 + self.len_field(4)?, 0),
            Marker::Reserved => return None,
        };
        self.take(payload)?;
        if nested > 0 {
            let depth = depth.checked_sub(1)?;
            for _ in 0..nested {
                self.skip(depth)?;
            }
        }
        Some(())
    }
}

/// The length in bytes of the one MessagePack value that starts `bytes`, or `None` if it is
/// cut short, malformed or nested deeper than `depth` ([`Reader::skip`]).
pub(super) fn value_len(bytes: &[u8], depth: usize) -> Option<usize> {
    let mut reader = Reader::new(bytes);
    reader.skip(depth)?;
    Some(reader.pos())
}

/// The string that is the whole of `value`, if it is one (any width, UTF-8).
pub(super) fn whole_str(value: &[u8]) -> Option<&str> {
    let mut reader = Reader::new(value);
    let text = reader.str()?;
    if !reader.is_at_end() {
        return None;
    }
    std::str::from_utf8(text).ok()
}

/// The non-negative integer that is the whole of `value`, if it is one (any width, signed or
/// not).
pub(super) fn whole_uint(value: &[u8]) -> Option<u64> {
    let mut reader = Reader::new(value);
    let n = reader.non_negative_int()?;
    reader.is_at_end().then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Every value of every format, as rmp writes it: measured to its last byte, and not one
    /// byte short of it.
    #[test]
    fn every_format_is_measured() {
        let mut values: Vec<Vec<u8>> = Vec::new();
        let mut put = |write: &dyn Fn(&mut Vec<u8>)| {
            let mut b = Vec::new();
            write(&mut b);
            values.push(b);
        };
        for n in [0u64, 0x7f, 0x80, 0xff, 0x100, 0xffff, 0x1_0000, u64::MAX] {
            put(&|b| drop(rmp::encode::write_uint(b, n)));
        }
        for n in [-1i64, -32, -33, -128, -129, -32768, -32769, i64::MIN] {
            put(&|b| drop(rmp::encode::write_sint(b, n)));
        }
        put(&|b| drop(rmp::encode::write_f32(b, 1.5)));
        put(&|b| drop(rmp::encode::write_f64(b, 1.5)));
        put(&|b| rmp::encode::write_nil(b).unwrap());
        put(&|b| rmp::encode::write_bool(b, true).unwrap());
        put(&|b| rmp::encode::write_bool(b, false).unwrap());
        for len in [0usize, 31, 32, 255, 256, 65_535, 65_536] {
            put(&|b| drop(rmp::encode::write_str(b, &"s".repeat(len))));
            put(&|b| drop(rmp::encode::write_bin(b, &vec![7; len])));
        }
        for len in [1u32, 2, 4, 8, 16, 3, 255, 256, 65_536] {
            put(&|b| {
                rmp::encode::write_ext_meta(b, len, 5).unwrap();
                b.extend(std::iter::repeat_n(9, len as usize));
            });
        }
        for len in [0u32, 15, 16, 65_535, 65_536] {
            put(&|b| {
                rmp::encode::write_array_len(b, len).unwrap();
                b.extend(std::iter::repeat_n(0x01, len as usize));
            });
            put(&|b| {
                rmp::encode::write_map_len(b, len).unwrap();
                b.extend(std::iter::repeat_n(0xc0, 2 * len as usize));
            });
        }
        for value in &values {
            assert_eq!(value_len(value, 1), Some(value.len()), "{:x?}", &value[..1]);
            assert_eq!(
                value_len(&value[..value.len() - 1], 1),
                None,
                "{:x?}",
                &value[..1]
            );
        }
        assert_eq!(value_len(&[0xc1], 1), None, "the reserved marker");
        assert_eq!(value_len(&[0x90], 0), Some(1), "an empty array at depth 0");
        assert_eq!(value_len(&[0x91, 0x01], 0), None);
        assert_eq!(value_len(&[0x91, 0x91, 0x01], 1), None);
        assert_eq!(value_len(&[0x91, 0x91, 0x01], 2), Some(3));
    }

    #[test]
    fn headers_and_scalars() {
        let mut r = Reader::new(&[0x83, 0xde, 0, 3, 0xdf, 0, 0, 1, 0, 0x93, 0xdc, 1, 0, 0xdd]);
        assert_eq!(r.map_len(), Some(3));
        assert_eq!(r.map_len(), Some(3));
        assert_eq!(r.map_len(), Some(256));
        assert_eq!(r.map_len(), None, "an array is not a map");
        assert_eq!(r.pos(), 10, "the marker is read");
        assert_eq!(r.array_len(), Some(256));
        assert_eq!(r.array_len(), None, "cut");
        assert!(r.is_at_end(), "the marker of the cut header is read");
        assert_eq!(Reader::new(&[0x9f]).array_len(), Some(15));
        assert_eq!(Reader::new(&[0x8f]).map_len(), Some(15));
        assert_eq!(Reader::new(&[0x80]).array_len(), None);
        assert_eq!(Reader::new(&[0x90]).map_len(), None);
        assert_eq!(Reader::new(&[0xdd, 0, 0, 0, 2]).array_len(), Some(2));

        for n in [0u64, 0x7f, 0x80, 0xff, 0x100, 0xffff, 0x1_0000, u64::MAX] {
            let mut b = Vec::new();
            rmp::encode::write_uint(&mut b, n).unwrap();
            assert_eq!(Reader::new(&b).uint(), Some(n));
            assert_eq!(whole_uint(&b), Some(n));
        }
        for n in [
            0i64,
            1,
            0x7f,
            0x80,
            0x7fff,
            0x8000,
            i64::from(i32::MAX),
            i64::MAX,
        ] {
            for b in [
                vec![0xd0, n as u8],
                [&[0xd1][..], &(n as u16).to_be_bytes()].concat(),
                [&[0xd2][..], &(n as u32).to_be_bytes()].concat(),
                [&[0xd3][..], &n.to_be_bytes()].concat(),
            ] {
                // What the contract takes for an integer is what rmp reads as an u64.
                let rmp: Option<u64> = rmp::decode::read_int(&mut &b[..]).ok();
                assert_eq!(whole_uint(&b), rmp, "{b:x?}");
                assert_eq!(Reader::new(&b).uint(), None, "signed: {b:x?}");
            }
        }
        for n in [-1i64, -32, -33, -128, -129, i64::MIN] {
            let mut b = Vec::new();
            rmp::encode::write_sint(&mut b, n).unwrap();
            assert_eq!(whole_uint(&b), None, "{n}");
        }
        assert_eq!(whole_uint(&[0x01, 0x01]), None, "more than the integer");
        assert_eq!(whole_uint(&[0xcd, 0x01]), None, "cut");
        assert_eq!(whole_uint(&[0xd1, 0x01]), None, "cut");
        assert_eq!(whole_uint(&[0xc0]), None);

        let mut r = Reader::new(&[0xc0, 0x01, 0xc2, 0xc3, 0xc0]);
        assert!(r.nil());
        assert!(!r.nil());
        assert_eq!(r.pos(), 1, "not nil: not read");
        assert_eq!(r.bool(), None);
        assert_eq!(r.bool(), Some(false));
        assert_eq!(r.bool(), Some(true));
        assert_eq!(r.bool(), None);
        assert!(r.is_at_end());
        assert!(!r.nil());
        assert_eq!(r.byte(), None);
        assert_eq!(r.take(0), Some(&[][..]));
        assert_eq!(r.take(1), None);
    }

    #[test]
    fn strings_of_every_width() {
        for len in [0usize, 1, 31, 32, 255, 256, 65_535, 65_536] {
            let text = "é".repeat(len / 2) + &"s".repeat(len % 2);
            let mut b = Vec::new();
            rmp::encode::write_str(&mut b, &text).unwrap();
            let mut r = Reader::new(&b);
            assert_eq!(r.str(), Some(text.as_bytes()));
            assert!(r.is_at_end());
            assert_eq!(whole_str(&b), Some(text.as_str()));
            assert_eq!(Reader::new(&b).fixstr().is_some(), text.len() < 32);
            assert_eq!(Reader::new(&b[..b.len() - 1]).str(), None);
            let mut longer = b.clone();
            longer.push(0xc0);
            assert_eq!(whole_str(&longer), None);
        }
        assert_eq!(whole_str(&[0xa2, 0xff, 0xfe]), None, "not UTF-8");
        assert_eq!(
            Reader::new(&[0xa2, 0xff, 0xfe]).str(),
            Some(&[0xff, 0xfe][..])
        );
        assert_eq!(whole_str(&[0xc4, 0x00]), None, "bin is not a string");
        assert_eq!(Reader::new(&[0xd9, 0x01, b'x']).fixstr(), None);
        let mut r = Reader::new(&[0xa1, b'k', 0x01]);
        let start = r.pos();
        r.skip(0).unwrap();
        assert_eq!(r.since(start), &[0xa1, b'k']);
        assert_eq!(r.rest(), &[0x01]);
    }
}

//! A request id as a lease table keeps it.
//!
//! Ids of up to [`INLINE_KEY_BYTES`] bytes (a UUID is 36) live inside the table entry: a
//! lookup compares them without reading another cache line, an admission allocates nothing
//! and a completion frees nothing, and a lease costs no separate allocation. Longer ids go to
//! the heap. Keys compare and hash as their bytes, the same way a `&str` lookup does.

use std::fmt;
use std::hash::BuildHasher;

/// The longest id kept inline: the entry's key takes 48 bytes either way.
pub const INLINE_KEY_BYTES: usize = 46;

#[derive(Clone, PartialEq, Eq)]
pub(crate) enum LeaseKey {
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_BYTES],
    },
    Heap(Box<str>),
}

impl LeaseKey {
    pub(crate) fn new(id: &str) -> Self {
        let len = id.len();
        if len > INLINE_KEY_BYTES {
            return Self::Heap(id.into());
        }
        let mut bytes = [0; INLINE_KEY_BYTES];
        bytes[..len].copy_from_slice(id.as_bytes());
        Self::Inline {
            len: len as u8,
            bytes,
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Heap(id) => id.as_bytes(),
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            // Copied from a `&str` whole, so always UTF-8; checked here rather than trusted,
            // off the hot path (lookups compare bytes).
            Self::Inline { .. } => {
                std::str::from_utf8(self.as_bytes()).expect("a lease key is copied from a str")
            }
            Self::Heap(id) => id,
        }
    }

    /// Whether this is the key of `id`.
    pub(crate) fn is(&self, id: &str) -> bool {
        self.as_bytes() == id.as_bytes()
    }
}

/// The hash a lease table files `id` under; the same for a key and its `&str`.
pub(crate) fn hash_id(hasher: &impl BuildHasher, id: &[u8]) -> u64 {
    hasher.hash_one(id)
}

impl fmt::Display for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_ids_are_inline_long_ones_on_the_heap_and_both_read_back() {
        let uuid = "0f8fad5b-d9cb-469f-a165-70867728950e";
        let long = "x".repeat(INLINE_KEY_BYTES + 1);
        let edge = "é".repeat(INLINE_KEY_BYTES / 2);
        for id in [uuid, "", edge.as_str(), long.as_str()] {
            let key = LeaseKey::new(id);
            assert_eq!(key.as_str(), id);
            assert!(key.is(id));
            assert!(!key.is(&format!("{id}!")));
            assert_eq!(
                matches!(key, LeaseKey::Inline { .. }),
                id.len() <= INLINE_KEY_BYTES
            );
        }
        assert_eq!(std::mem::size_of::<LeaseKey>(), 48);
    }

    #[test]
    fn keys_filed_by_hash_id_are_found_by_str_after_the_table_grows() {
        // Lookups hash a `&str`, growth rehashes stored keys: both must land alike.
        let hasher = hashbrown::DefaultHashBuilder::default();
        let mut table = hashbrown::HashTable::new();
        let ids: Vec<String> = (0..2_000)
            .map(|i| format!("{i:08x}-d9cb-469f-a165-70867728950e{}", "x".repeat(i % 20)))
            .collect();
        for id in &ids {
            let key = LeaseKey::new(id);
            table.insert_unique(hash_id(&hasher, key.as_bytes()), key, |k: &LeaseKey| {
                hash_id(&hasher, k.as_bytes())
            });
        }
        for id in &ids {
            let found = table.find(hash_id(&hasher, id.as_bytes()), |k| k.is(id));
            assert_eq!(found.map(LeaseKey::as_str), Some(id.as_str()));
        }
    }

    #[test]
    fn distinct_ids_hash_apart_and_keys_print_as_their_id() {
        let hasher = hashbrown::DefaultHashBuilder::default();
        let long = "y".repeat(INLINE_KEY_BYTES + 5);
        let ids = ["a", "b", "req-1", long.as_str()];
        let hashes: std::collections::HashSet<u64> = ids
            .iter()
            .map(|id| hash_id(&hasher, LeaseKey::new(id).as_bytes()))
            .collect();
        assert_eq!(
            hashes.len(),
            ids.len(),
            "a constant hash files every id alike"
        );
        for id in ids {
            let key = LeaseKey::new(id);
            assert_eq!(
                hash_id(&hasher, key.as_bytes()),
                hash_id(&hasher, id.as_bytes())
            );
            assert_eq!(key.to_string(), id);
            assert_eq!(format!("{key:?}"), format!("{id:?}"));
        }
        assert_eq!(format!("{:?}", LeaseKey::new("q\"x")), r#""q\"x""#);
    }
}

//! The block hashes of a prompt: one scheme for workers, gateways and routers, so that a
//! block named by one is found by the others (`schemas/README.md`, "Prefix block hashes").
//!
//! XXH3-64 (seed 0) of the previous block's hash (u64, little-endian; [`ROOT_PARENT_HASH`]
//! before the first block) followed by the block's token ids (u32, little-endian each). Why
//! XXH3-64: a block of 16 tokens is 72 bytes, and an 8,192-token prompt's 512 blocks hash in
//! a few microseconds; its 64 bits make a collision among a deployment's bounded index
//! (millions of blocks) a chance of about 1 in 10^6 or less; it has bindings in every
//! language a worker is written in (Python's `xxhash`, Go's `zeebo/xxh3`); and Dynamo's KV
//! router hashes blocks with it too. It is not a cryptographic hash: a publisher may name any
//! block it likes, which is why only permitted workers publish (`SECURITY.md`).

use xxhash_rust::xxh3::xxh3_64;

/// Tokens per block where a deployment sets no other size: vLLM's default.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The parent hash of a prompt's first block.
pub const ROOT_PARENT_HASH: u64 = 0;

/// The hash of each full block of `token_ids`, in prompt order: two prompts that share
/// their first k full blocks share their first k hashes. The tokens after the last full
/// block, and every token when `block_size` is 0, are not hashed.
pub fn block_hashes(token_ids: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut bytes = Vec::with_capacity(8 + 4 * block_size);
    let mut parent = ROOT_PARENT_HASH;
    token_ids
        .chunks_exact(block_size)
        .map(|block| {
            parent = chain(&mut bytes, parent, block);
            parent
        })
        .collect()
}

/// The hash of `block` after the block whose hash is `parent`: for a caller that hashes a
/// prompt as it grows (a conversation's next turn), one block at a time.
pub fn chain_block_hash(parent: u64, block: &[u32]) -> u64 {
    chain(&mut Vec::with_capacity(8 + 4 * block.len()), parent, block)
}

fn chain(bytes: &mut Vec<u8>, parent: u64, block: &[u32]) -> u64 {
    bytes.clear();
    bytes.extend_from_slice(&parent.to_le_bytes());
    for token in block {
        bytes.extend_from_slice(&token.to_le_bytes());
    }
    xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_shares_its_hashes_and_only_full_blocks_count() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a[..32].to_vec();
        b.extend([9; 20]);
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(
            (ha.len(), hb.len()),
            (2, 3),
            "the 8 and 4 tokens left over do not count"
        );
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(
            block_hashes(&a[16..32], 16),
            ha[1..2],
            "a block's hash names its prefix"
        );
        assert!(block_hashes(&a, 0).is_empty());
        assert!(block_hashes(&a[..15], 16).is_empty());
    }

    #[test]
    fn chaining_one_block_at_a_time_gives_the_same_hashes() {
        let tokens: Vec<u32> = (1000..1064).collect();
        let mut parent = ROOT_PARENT_HASH;
        let one_by_one: Vec<u64> = tokens
            .chunks_exact(16)
            .map(|block| {
                parent = chain_block_hash(parent, block);
                parent
            })
            .collect();
        assert_eq!(one_by_one, block_hashes(&tokens, 16));
    }
}

//! Prefix identity: each full block of a token sequence is named by a hash chain (its parent
//! block's hash, its own token ids, and a salt naming everything else that shapes the KV:
//! model, layout, dtype), so equal names mean equal KV (for vLLM's automatic prefix caching
//! and SGLang's radix cache the same idea). The engine looks prompts up by these names; a
//! router can compute them from the same tokens to score where a prefix is cached.
//!
//! The hash is SHA-256 truncated to 128 bits: a collision between two different prefixes
//! (which would hand one prompt another's KV) needs about 2^64 distinct blocks, far beyond any
//! cache, so hits are not compared token by token.

use sha2::{Digest, Sha256};

use crate::BLOCK_SIZE;

/// A full block's name: 128 bits of SHA-256 over the chain (see the module doc).
pub type BlockHash = u128;

/// The salt of a cache: blocks are shared only between caches whose layout hash (model
/// fingerprint, geometry and dtype) is the same.
pub fn salt(layout_hash: &str) -> BlockHash {
    let digest = Sha256::new()
        .chain_update(b"tandem-prefix-salt\0")
        .chain_update(layout_hash.as_bytes())
        .finalize();
    truncate(&digest)
}

/// The name of the block holding `tokens` (exactly `BLOCK_SIZE` of them) after the block
/// named `parent` (the salt for the first block).
pub fn chain(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut hasher = Sha256::new();
    hasher.update(parent.to_le_bytes());
    for t in tokens {
        hasher.update(t.to_le_bytes());
    }
    truncate(&hasher.finalize())
}

/// Extends `hashes` (the names of `tokens`' first full blocks so far) to every full block of
/// `tokens`.
pub fn extend_hashes(salt: BlockHash, tokens: &[u32], hashes: &mut Vec<BlockHash>) {
    let full = tokens.len() / BLOCK_SIZE;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = hashes.last().copied().unwrap_or(salt);
        hashes.push(chain(parent, &tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]));
    }
}

/// Most names in one list of a load report's block events (256 KiB on the wire); a follower
/// gets the rest in the next report.
pub const NAMES_PER_REPORT: usize = 16 * 1024;

/// Names as they travel: 16 bytes each, little-endian, concatenated.
pub fn names_to_bytes(names: &[BlockHash]) -> Vec<u8> {
    names.iter().flat_map(|n| n.to_le_bytes()).collect()
}

/// The names in `bytes`, or `None` when its length is not a whole number of names.
pub fn names_from_bytes(bytes: &[u8]) -> Option<Vec<BlockHash>> {
    if !bytes.len().is_multiple_of(16) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(16)
            .map(|c| {
                let mut name = [0u8; 16];
                name.copy_from_slice(c);
                u128::from_le_bytes(name)
            })
            .collect(),
    )
}

/// The names of every full block of `tokens` under `salt`.
pub fn hashes(salt: BlockHash, tokens: &[u32]) -> Vec<BlockHash> {
    let mut names = Vec::with_capacity(tokens.len() / BLOCK_SIZE);
    extend_hashes(salt, tokens, &mut names);
    names
}

fn truncate(digest: &[u8]) -> BlockHash {
    let mut head = [0u8; 16];
    head.copy_from_slice(&digest[..16]);
    u128::from_le_bytes(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_name_depends_on_everything_before_it_and_on_the_salt() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[3] = 99;
        let (mut ha, mut hb) = (Vec::new(), Vec::new());
        extend_hashes(salt("m"), &a, &mut ha);
        extend_hashes(salt("m"), &b, &mut hb);
        assert_eq!(ha.len(), 2, "only full blocks are named");
        assert_ne!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1], "a change in block 0 renames block 1 too");
        let mut hc = Vec::new();
        extend_hashes(salt("another layout"), &a, &mut hc);
        assert_ne!(ha[0], hc[0]);
        // Extending is incremental and agrees with hashing all at once.
        let mut step = Vec::new();
        extend_hashes(salt("m"), &a[..20], &mut step);
        extend_hashes(salt("m"), &a, &mut step);
        assert_eq!(step, ha);
        assert_eq!(hashes(salt("m"), &a), ha);
    }

    #[test]
    fn names_round_trip_through_bytes_and_torn_lists_are_refused() {
        let names = vec![1u128, u128::MAX, 0x0102_0304];
        let bytes = names_to_bytes(&names);
        assert_eq!(bytes.len(), 48);
        assert_eq!(names_from_bytes(&bytes), Some(names));
        assert_eq!(names_from_bytes(&bytes[..47]), None);
        assert_eq!(names_from_bytes(&[]), Some(Vec::new()));
    }
}

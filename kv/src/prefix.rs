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
    }
}

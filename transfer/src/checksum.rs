//! Per block-layer checksums: CRC-32 (IEEE), SIMD-accelerated by crc32fast.

/// CRC-32 of `bytes`.
pub fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

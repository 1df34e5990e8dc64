//! The shapes every matmul kernel shares: the panel width weights are packed in, and one
//! micro-tile's operands ([`Tile`]), so the per-instruction-set kernels depend on these and
//! not on the dispatch that calls them.

/// Output features per panel: one AVX-512 vector of f32.
pub const PANEL: usize = 16;

/// Where one micro-tile reads and writes.
#[derive(Clone, Copy)]
pub(super) struct Tile {
    /// First row of x (rows are `k` apart).
    pub(super) x: *const f32,
    pub(super) k: usize,
    /// First output element (rows are `ldo` apart).
    pub(super) out: *mut f32,
    pub(super) ldo: usize,
    /// Columns to store, counted from the tile's first panel.
    pub(super) cols: usize,
    /// Null, or `k` cache lines (one per input feature, `PREFETCH_LINE` apart) to pull into L2
    /// during this tile: a slice of the next column group's weights.
    pub(super) prefetch: *const u8,
}

/// Bytes prefetched per input feature by a tile (one cache line).
pub(super) const PREFETCH_LINE: usize = 64;

//! `fast` mode's matmul for quantized weights: the activations quantized to 8 bits per
//! 32-element block (one f32 scale each, as GGML's Q8 formats), the dot products of each
//! weight group done in integers over the weights' own small integers ([`Arrangement::Quads`]),
//! and only the group's result scaled in f32.
//!
//! Output element `(r, n)` is, over its weight groups `g` in input order (`G` inputs each,
//! `u` the stored unsigned integer, `b` the format's bias, `S`/`O` the group's scale and
//! offset as in `exact` mode, `dx` the activation block's scale, `qx` its integers):
//!
//! ```text
//! acc = fma(S·dx, Σ u·qx − b·Σ qx, acc)     (integer sum, exact; S·dx one f32 product)
//! acc = fma(O, Σ x, acc)                     (asymmetric formats; Σ x over the group's f32 x)
//! ```
//!
//! The integer sums are exact and every path evaluates the same f32 operations in the same
//! order, so, as in `exact` mode, a row's result does not depend on its batch, the tile
//! shape or the instruction set; what changes is the value (the activations' rounding, well
//! under a percent of perplexity: BENCHMARKS.md). Offsets use the exact sum of the f32
//! activations rather than of their integers, which costs nothing and rounds less than
//! GGML's Q8_1.

use super::ggml::QuantKind;
#[cfg(doc)]
use super::panels::Arrangement;
use super::panels::{QuantPanels, quad_at};
use crate::backend::cpu::kernels::matmul::PANEL;

/// Inputs per activation block (one scale).
pub const ACT_BLOCK: usize = 32;
/// Inputs per partial sum of an activation's integers (the smallest weight group, Q6_K's).
pub(super) const SUM_BLOCK: usize = 16;

/// Rows of activations quantized for the integer tiles.
#[derive(Debug, Default, Clone)]
pub struct QuantizedActs {
    pub(super) rows: usize,
    pub(super) k: usize,
    /// The integers, row-major (`rows × k`), each in −127..=127.
    pub(super) q: Vec<i8>,
    /// Scale of each block of 32 (`rows × k/32`).
    pub(super) scale: Vec<f32>,
    /// Sum of the integers of each 16 (`rows × k/16`).
    pub(super) q_sum: Vec<i32>,
    /// Sum of the f32 activations of each block of 32, in order (`rows × k/32`).
    pub(super) x_sum: Vec<f32>,
}

impl QuantizedActs {
    /// Quantizes `m` rows of `k` (a multiple of 32) activations, reusing the buffers; the
    /// rows of a prefill chunk over the compute team (a row's blocks come out the same
    /// whichever thread quantizes them).
    ///
    /// # Panics
    /// If `k` is not a multiple of 32 or `x` holds fewer than `m·k` values.
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        assert!(k.is_multiple_of(ACT_BLOCK), "activations: {k} inputs");
        assert!(x.len() >= m * k, "activations: buffer size");
        self.rows = m;
        self.k = k;
        self.q.resize(m * k, 0);
        self.scale.resize(m * k / ACT_BLOCK, 0.0);
        self.q_sum.resize(m * k / SUM_BLOCK, 0);
        self.x_sum.resize(m * k / ACT_BLOCK, 0.0);
        let out = ActsOut {
            q: self.q.as_mut_ptr(),
            scale: self.scale.as_mut_ptr(),
            q_sum: self.q_sum.as_mut_ptr(),
            x_sum: self.x_sum.as_mut_ptr(),
        };
        let per_row = k / ACT_BLOCK;
        crate::backend::cpu::kernels::team::parallel_row_ranges(m, &|rows| {
            // SAFETY: the four buffers were just sized for `m` rows of blocks; the ranges are
            // disjoint rows, so disjoint blocks.
            unsafe { quantize_blocks(x, &out, rows.start * per_row..rows.end * per_row) };
        });
    }

    /// Row `r`'s integers.
    #[inline(always)]
    pub(super) fn row(&self, r: usize) -> &[i8] {
        &self.q[r * self.k..(r + 1) * self.k]
    }

    /// Where rows `row..row + R` start (see [`RowStarts`]), for tiles over `cols` inputs that
    /// read them through raw pointers.
    ///
    /// # Panics
    /// If a row lies outside the activations or `cols` exceeds their `k`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn row_starts<const R: usize>(&self, row: usize, cols: usize) -> RowStarts<R> {
        assert!(
            row + R <= self.rows && cols <= self.k,
            "tile outside the activations"
        );
        let at = |r: usize, per: usize| (row + r) * self.k / per;
        RowStarts {
            x: std::array::from_fn(|r| self.row(row + r).as_ptr()),
            scale: std::array::from_fn(|r| self.scale[at(r, ACT_BLOCK)..].as_ptr()),
            x_sum: std::array::from_fn(|r| self.x_sum[at(r, ACT_BLOCK)..].as_ptr()),
            q_sum: std::array::from_fn(|r| self.q_sum[at(r, SUM_BLOCK)..].as_ptr()),
        }
    }

    /// Σ qx over `len` (16 or 32) inputs of row `r` from input `first` (a multiple of `len`).
    #[inline(always)]
    pub(super) fn q_sum(&self, r: usize, first: usize, len: usize) -> i32 {
        let at = (r * self.k + first) / SUM_BLOCK;
        self.q_sum[at..at + len / SUM_BLOCK].iter().sum()
    }

    /// The scale of the activation block holding input `i` of row `r`.
    #[inline(always)]
    pub(super) fn scale_at(&self, r: usize, i: usize) -> f32 {
        self.scale[(r * self.k + i) / ACT_BLOCK]
    }

    /// Σ x over the block of 32 holding input `i` of row `r`.
    #[inline(always)]
    pub(super) fn x_sum_at(&self, r: usize, i: usize) -> f32 {
        self.x_sum[(r * self.k + i) / ACT_BLOCK]
    }
}

/// Where [`quantize_blocks`] writes: the buffers of a [`QuantizedActs`].
struct ActsOut {
    q: *mut i8,
    scale: *mut f32,
    q_sum: *mut i32,
    x_sum: *mut f32,
}
// SAFETY: the tasks of `QuantizedActs::quantize` write disjoint blocks through it.
unsafe impl Sync for ActsOut {}

/// Quantizes blocks `range` of `x` into `out`.
///
/// # Safety
/// `out`'s buffers hold every block of `range`, and no other thread touches those blocks
/// meanwhile.
unsafe fn quantize_blocks(x: &[f32], out: &ActsOut, range: std::ops::Range<usize>) {
    for b in range {
        let xb: &[f32; ACT_BLOCK] = x[b * ACT_BLOCK..(b + 1) * ACT_BLOCK]
            .try_into()
            .expect("blocks of 32");
        // SAFETY: block `b` lies inside every buffer and belongs to this caller alone.
        unsafe {
            let qb = &mut *out.q.add(b * ACT_BLOCK).cast::<[i8; ACT_BLOCK]>();
            let sums = quantize_block(xb, qb, &mut *out.scale.add(b));
            *out.q_sum.add(2 * b) = sums[0];
            *out.q_sum.add(2 * b + 1) = sums[1];
            *out.x_sum.add(b) = block_sum(xb);
        }
    }
}

/// Quantizes one block: its scale (`max |x| / 127`) into `scale`, `round(x / scale)` (ties
/// to even) into `q`; returns the sums of the integers of each 16.
fn quantize_block(x: &[f32; ACT_BLOCK], q: &mut [i8; ACT_BLOCK], scale: &mut f32) -> [i32; 2] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        let amax = unsafe { abs_max_avx2(x) };
        let inv = scale_for(amax, scale);
        // SAFETY: as above.
        return unsafe { quantize_block_avx2(x, q, inv) };
    }
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let inv = scale_for(amax, scale);
    quantize_block_portable(x, q, inv)
}

/// Sets a block's scale from its largest magnitude; returns the scale's inverse (0 for an
/// all-zero block).
fn scale_for(amax: f32, scale: &mut f32) -> f32 {
    let d = amax / 127.0;
    *scale = d;
    if d > 0.0 { 1.0 / d } else { 0.0 }
}

/// The largest `|x|` of a block, as the portable fold finds it: a maximum is exact whatever
/// the order, and `vmaxps` with the running maximum second passes a NaN over as
/// `f32::max` does.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn abs_max_avx2(x: &[f32; ACT_BLOCK]) -> f32 {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for c in 0..ACT_BLOCK / 8 {
        // SAFETY: 32 floats in.
        let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * c)) };
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)))
}

fn quantize_block_portable(x: &[f32; ACT_BLOCK], q: &mut [i8; ACT_BLOCK], inv: f32) -> [i32; 2] {
    let mut sums = [0i32; 2];
    for (i, (&v, q)) in x.iter().zip(q.iter_mut()).enumerate() {
        // A non-finite x makes a non-finite scale (or a 0 here), so the row's outputs are as
        // poisoned as `exact` mode's, never a panic.
        *q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
        sums[i / SUM_BLOCK] += i32::from(*q);
    }
    sums
}

/// [`quantize_block`]'s integers on AVX2: the same products, rounded to nearest even by the
/// conversion (the default rounding mode) and clamped alike (a NaN converts to `i32::MIN`
/// here and to 0 there: either way its row is poisoned by a NaN scale).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(x: &[f32; ACT_BLOCK], q: &mut [i8; ACT_BLOCK], inv: f32) -> [i32; 2] {
    use std::arch::x86_64::*;
    let inv = _mm256_set1_ps(inv);
    let (low, high) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    // SAFETY: 32 floats in.
    let ints: [__m256i; 4] = std::array::from_fn(|c| unsafe {
        let r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(8 * c)), inv));
        _mm256_min_epi32(_mm256_max_epi32(r, low), high)
    });
    let words = [
        _mm256_packs_epi32(ints[0], ints[1]),
        _mm256_packs_epi32(ints[2], ints[3]),
    ];
    // The packs interleave 128-bit halves: put the 32 bytes back in input order.
    let bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(words[0], words[1]),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
    );
    // SAFETY: `q` holds 32 bytes.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), bytes) };
    let half_sum = |a: __m256i, b: __m256i| {
        let mut lanes = [0i32; 8];
        // SAFETY: 8 i32 in the array.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), _mm256_add_epi32(a, b)) };
        lanes.iter().sum()
    };
    [half_sum(ints[0], ints[1]), half_sum(ints[2], ints[3])]
}

/// Σ x of one block in a fixed order every path follows (eight running sums over the four
/// eighths, then halves folded): the order a vector unit adds in, so it is cheap there too.
fn block_sum(x: &[f32; ACT_BLOCK]) -> f32 {
    let mut lanes = [0f32; 8];
    for chunk in x.chunks_exact(8) {
        for (l, &v) in lanes.iter_mut().zip(chunk) {
            *l += v;
        }
    }
    let quarter: [f32; 4] = std::array::from_fn(|i| lanes[i] + lanes[i + 4]);
    (quarter[0] + quarter[2]) + (quarter[1] + quarter[3])
}

/// Where `R` consecutive rows of [`QuantizedActs`] start: their integers, their scales and
/// sums of activations (one per [`ACT_BLOCK`]) and their sums of integers (one per
/// [`SUM_BLOCK`]); the x86-64 tiles read them without bounds checks.
#[cfg(target_arch = "x86_64")]
pub(crate) struct RowStarts<const R: usize> {
    pub x: [*const i8; R],
    pub scale: [*const f32; R],
    pub x_sum: [*const f32; R],
    pub q_sum: [*const i32; R],
}

/// Rows `row..row + rows` (at most 4) of the activations against one panel.
#[derive(Clone, Copy)]
pub(crate) struct PanelRows {
    pub row: usize,
    pub rows: usize,
    /// Where row `row`'s first output of the panel goes.
    pub out: *mut f32,
    pub ldo: usize,
    /// Columns of the panel to store (1..=16).
    pub cols: usize,
    /// Whether to prefetch the weights ahead (the first tile of a row block: the later
    /// ones find the panel in cache). Only the x86-64 tiles prefetch.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub prefetch: bool,
}

/// The portable integer tile, which defines the order of operations (see the module docs).
///
/// # Safety
/// `t.out` may be written at `r·ldo + c` for `r < t.rows`, `c < t.cols`.
pub(crate) unsafe fn panel_portable(acts: &QuantizedActs, w: &QuantPanels, p: usize, t: PanelRows) {
    let view = super::panels::PanelView::new(w, p);
    let kind = w.kind();
    let group = kind.group();
    let bias = kind.nibble_bias();
    let layout = *w.layout();
    for r in t.row..t.row + t.rows {
        let x = acts.row(r);
        let mut acc = [0f32; PANEL];
        for (g, at) in layout.walk().take(w.cols() / group).enumerate() {
            let first = g * group;
            let q_sum = acts.q_sum(r, first, group);
            let dx = acts.scale_at(r, first);
            let base = at.q;
            for (lane, a) in acc.iter_mut().enumerate() {
                let mut dot = 0i32;
                for within in 0..group {
                    let (at, high) = quad_at(layout.nibbles, within, lane);
                    let byte = view.bytes[base + at];
                    let u = match (layout.nibbles, high, kind) {
                        (false, _, QuantKind::Q8_0) => i32::from(byte as i8),
                        (false, _, _) => i32::from(byte),
                        (true, false, _) => i32::from(byte & 0xF),
                        (true, true, _) => i32::from(byte >> 4),
                    };
                    dot += u * i32::from(x[first + within]);
                }
                dot -= bias * q_sum;
                let (scale, offset) = view.scale_offset(g, lane);
                *a = (scale * dx).mul_add(dot as f32, *a);
                if kind.asymmetric() {
                    *a = offset.mul_add(acts.x_sum_at(r, first), *a);
                }
            }
        }
        // SAFETY: the caller lets this tile write `cols` columns of each of its rows.
        unsafe {
            std::ptr::copy_nonoverlapping(acc.as_ptr(), t.out.add((r - t.row) * t.ldo), t.cols)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_quantize_alike_on_every_path() {
        let mut state = 7u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
        };
        for case in 0..200 {
            let mut x: [f32; ACT_BLOCK] = std::array::from_fn(|_| next() * (case + 1) as f32);
            // Ties at every other step: x·inv lands on k + 0.5.
            if case % 3 == 0 {
                for (i, v) in x.iter_mut().enumerate() {
                    *v = (i as f32 - 15.5) * 2.0;
                }
                x[31] = 127.0;
            }
            let (mut a, mut b) = ([0i8; ACT_BLOCK], [0i8; ACT_BLOCK]);
            let mut scale = 0.0;
            let sums = quantize_block(&x, &mut a, &mut scale);
            let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
            assert_eq!(scale.to_bits(), (amax / 127.0).to_bits(), "case {case}");
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            assert_eq!(
                sums,
                quantize_block_portable(&x, &mut b, inv),
                "case {case}"
            );
            assert_eq!(a, b, "case {case}");
            let want: i32 = a[..16].iter().map(|&v| i32::from(v)).sum();
            assert_eq!(sums[0], want);
            let most = a.iter().map(|v| v.unsigned_abs()).max();
            assert_eq!(most, Some(127), "case {case}: the largest |x| maps to 127");
        }
        let mut zero = [5i8; ACT_BLOCK];
        let mut scale = 1.0;
        assert_eq!(
            quantize_block(&[0.0; ACT_BLOCK], &mut zero, &mut scale),
            [0, 0]
        );
        assert_eq!((zero, scale), ([0; ACT_BLOCK], 0.0));
    }
}

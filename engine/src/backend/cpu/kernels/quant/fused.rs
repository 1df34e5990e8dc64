//! AVX-512 tiles that dequantize in registers, for the few rows of a decode step: each weight
//! vector is built once (`q·S + O`, the portable loop's value) and multiplied
//! straight into the accumulators, so the integers stream from memory with nothing written
//! in between. With many rows the column-group buffer of `matmul` is cheaper (the dequant
//! is shared by the rows); both give the same bits, since each output is the same chain of
//! fused multiply-adds over the same f32 weights.

use std::arch::x86_64::*;

use super::panels::QuantPanels;
use crate::backend::cpu::kernels::matmul::PANEL;

/// One call: rows of x against `C` consecutive panels of a quantized matrix.
#[derive(Clone, Copy)]
pub(crate) struct RowTile {
    pub x: *const f32,
    pub k: usize,
    pub out: *mut f32,
    pub ldo: usize,
    /// Output columns to store, counted from the first panel.
    pub cols: usize,
}

/// Runs `mr` (1..=4) rows against panels `p..p + np` (`np` 1..=4) of `w`.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL and F16C; x holds `mr` rows of `k = w.cols` floats; `out`
/// may be written at `r·ldo + c` for `r < mr`, `c < cols`; the panels exist.
pub(crate) unsafe fn rows_avx512(w: &QuantPanels, p: usize, np: usize, mr: usize, t: RowTile) {
    debug_assert!((1..=4).contains(&mr) && (1..=4).contains(&np));
    let mut c = 0;
    while c < np && c * PANEL < t.cols {
        // Registers: R·C accumulators, C scales, C offsets, 2·C weights and a broadcast.
        let cp = match (mr, np - c) {
            (1 | 2, 4) => 4,
            (_, n) if n >= 2 => 2,
            _ => 1,
        };
        let sub = RowTile {
            out: t.out.wrapping_add(c * PANEL),
            cols: t.cols - c * PANEL,
            ..t
        };
        // SAFETY: the caller's promises, narrowed to panels p + c..p + c + cp.
        unsafe { dispatch(w, p + c, mr, cp, sub) };
        c += cp;
    }
}

/// Picks the instantiation for the tile shape and the format.
unsafe fn dispatch(w: &QuantPanels, p: usize, mr: usize, cp: usize, t: RowTile) {
    use super::ggml::QuantKind as K;
    macro_rules! by_flags {
        ($r:literal, $c:literal) => {
            match w.kind {
                K::Q8_0 => tile::<$r, $c, false, false, false, 0>(w, p, t),
                K::Q4_0 => tile::<$r, $c, true, true, false, 0>(w, p, t),
                K::Q4_1 | K::Q4K => tile::<$r, $c, true, false, true, 0>(w, p, t),
                K::Q5K => tile::<$r, $c, true, false, true, 1>(w, p, t),
                K::Q6K => tile::<$r, $c, true, true, false, 2>(w, p, t),
            }
        };
    }
    // SAFETY: forwarded from `rows_avx512`.
    unsafe {
        match (mr, cp) {
            (1, 4) => by_flags!(1, 4),
            (2, 4) => by_flags!(2, 4),
            (1, 2) => by_flags!(1, 2),
            (2, 2) => by_flags!(2, 2),
            (3, 2) => by_flags!(3, 2),
            (4, 2) => by_flags!(4, 2),
            (1, _) => by_flags!(1, 1),
            (2, _) => by_flags!(2, 1),
            (3, _) => by_flags!(3, 1),
            _ => by_flags!(4, 1),
        }
    }
}

/// `q·scale (+ offset)` for 16 lanes of integers (given as floats), one fused multiply-add
/// when there is an offset (the same bits as the portable multiply-then-add: see
/// `QuantPanels::weight`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
#[inline]
fn weight<const ASYM: bool>(q: __m512, scale: __m512, offset: __m512) -> __m512 {
    if ASYM {
        _mm512_fmadd_ps(q, scale, offset)
    } else {
        _mm512_mul_ps(q, scale)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
#[inline]
unsafe fn tile<
    const R: usize,
    const C: usize,
    const NIB: bool,
    const BIASED: bool,
    const ASYM: bool,
    const HIGH: usize,
>(
    w: &QuantPanels,
    p: usize,
    t: RowTile,
) {
    let kind = w.kind;
    debug_assert_eq!(HIGH, kind.high_bits());
    let group = kind.group();
    let groups = w.cols / group;
    let layout = *w.layout();
    let stride = layout.panel_bytes;
    let base = w.panel_ptr(p);
    let low = _mm512_set1_epi32(0xF);
    let (rot, mask) = super::x86::high_rotation::<HIGH>();
    // SAFETY: 16 i32 in the array.
    let rot = unsafe { _mm512_loadu_si512(rot.as_ptr().cast()) };
    let mask = _mm512_set1_epi32(mask);
    let nibble_values = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    for g in 0..groups {
        let (block, head, q) = (layout.block_at(g), layout.group_at(g), layout.q_at(g));
        let record = layout.record(g);
        let mut scale = [_mm512_setzero_ps(); C];
        let mut offset = [_mm512_setzero_ps(); C];
        // SAFETY (this block): panel p + c's bytes start at `base + c·stride` and hold the
        // layout's offsets; x and out as the caller promised.
        unsafe {
            for c in 0..C {
                let panel = base.add(c * stride);
                let f16x16 = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(panel.add(at).cast()));
                let d = f16x16(block);
                let m = if ASYM {
                    f16x16(block + 2 * PANEL)
                } else {
                    _mm512_setzero_ps()
                };
                (scale[c], offset[c]) = if kind.super_blocks() {
                    let i8x16 = |at: usize| {
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                            panel.add(at).cast(),
                        )))
                    };
                    let sc = i8x16(head);
                    let o = if ASYM {
                        _mm512_mul_ps(m, i8x16(head + PANEL))
                    } else {
                        m
                    };
                    (_mm512_mul_ps(d, sc), o)
                } else {
                    (d, m)
                };
                // A biased format's `(u − bias)·S` as `u·S + (−bias·S)`: `u·S` and `bias·S`
                // are exact (bias a power of two; `u` at most 6 bits, so the product fits 24
                // bits, see `PanelView::weight`) and so is their difference, the very value
                // `(u − bias)·S`; one fused multiply-add then saves the subtraction. Only a
                // zero weight's sign can differ (+0 for −0 under a negative scale), which no
                // output sees: an accumulator starting at +0 never becomes −0, and adding ±0
                // to anything else leaves it as it is.
                if BIASED {
                    offset[c] = _mm512_mul_ps(scale[c], _mm512_set1_ps(-kind.nibble_bias() as f32));
                }
                // The same bytes one tile on (scales and integers together): what this
                // tile's successor reads for this group.
                let ahead = panel.wrapping_add(C * stride + record.start);
                for line in (0..record.len()).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
                }
            }
            let first = g * group;
            if NIB {
                for j in 0..group / 2 {
                    let mut lo = [_mm512_setzero_ps(); C];
                    let mut hi = [_mm512_setzero_ps(); C];
                    for c in 0..C {
                        let src = base.add(c * stride + q + j * PANEL);
                        let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(src.cast()));
                        let (l, h) = if HIGH > 0 {
                            // The bits above the nibbles of inputs 2j and 2j + 1.
                            let at = |within| base.add(c * stride + layout.high_at(g, within));
                            let l = _mm512_and_si512(bytes, low);
                            let h = _mm512_srli_epi32::<4>(bytes);
                            (
                                _mm512_cvtepi32_ps(super::x86::with_high::<HIGH>(
                                    l,
                                    at(2 * j),
                                    rot,
                                    mask,
                                )),
                                _mm512_cvtepi32_ps(super::x86::with_high::<HIGH>(
                                    h,
                                    at(2 * j + 1),
                                    rot,
                                    mask,
                                )),
                            )
                        } else {
                            // The low nibble as a float in one operation instead of a mask
                            // and a conversion: the permute reads only the 4 low bits of
                            // each lane, and the table holds 0.0..15.0, exactly what the
                            // conversion gives.
                            (
                                _mm512_permutexvar_ps(bytes, nibble_values),
                                _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(bytes)),
                            )
                        };
                        (lo[c], hi[c]) = if BIASED {
                            (
                                weight::<true>(l, scale[c], offset[c]),
                                weight::<true>(h, scale[c], offset[c]),
                            )
                        } else {
                            (
                                weight::<ASYM>(l, scale[c], offset[c]),
                                weight::<ASYM>(h, scale[c], offset[c]),
                            )
                        };
                    }
                    let i = first + 2 * j;
                    for (r, row) in acc.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(*t.x.add(r * t.k + i));
                        for (a, wv) in row.iter_mut().zip(&lo) {
                            *a = _mm512_fmadd_ps(xv, *wv, *a);
                        }
                    }
                    for (r, row) in acc.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(*t.x.add(r * t.k + i + 1));
                        for (a, wv) in row.iter_mut().zip(&hi) {
                            *a = _mm512_fmadd_ps(xv, *wv, *a);
                        }
                    }
                }
            } else {
                for i in 0..group {
                    let mut wv = [_mm512_setzero_ps(); C];
                    for (c, v) in wv.iter_mut().enumerate() {
                        let src = base.add(c * stride + q + i * PANEL);
                        let qs = _mm512_cvtepi8_epi32(_mm_loadu_si128(src.cast()));
                        *v = weight::<ASYM>(_mm512_cvtepi32_ps(qs), scale[c], offset[c]);
                    }
                    for (r, row) in acc.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(*t.x.add(r * t.k + first + i));
                        for (a, v) in row.iter_mut().zip(&wv) {
                            *a = _mm512_fmadd_ps(xv, *v, *a);
                        }
                    }
                }
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (c, a) in row.iter().enumerate() {
            let col = c * PANEL;
            if col >= t.cols {
                break;
            }
            let valid = (t.cols - col).min(PANEL);
            // SAFETY: the caller lets this tile write `cols` columns of each of its rows.
            unsafe {
                let dst = t.out.add(r * t.ldo + col);
                if valid == PANEL {
                    _mm512_storeu_ps(dst, *a);
                } else {
                    _mm512_mask_storeu_ps(dst, ((1u32 << valid) - 1) as __mmask16, *a);
                }
            }
        }
    }
}

//! The AVX512_VNNI integer tile in 512-bit vectors: a panel's 16 lanes in one register, so
//! each group's integers take half the instructions of the 256-bit tiles (`x86_int`). Zen 4
//! executes a 512-bit operation as two 256-bit halves, so the arithmetic rate is the same;
//! what halves is the number of operations in flight for the same bytes, which lets the
//! out-of-order window hold twice the weights and so keep more of memory's latency hidden in
//! a batch-1 decode step, whose weights stream once from memory.
//!
//! The arithmetic is `x86_int`'s sequence for `vpdpbusd` lane for lane: the same exact
//! integer sums, then the same f32 operations per group in the same order (those of
//! `int8::panel_portable`), so the bits are the same. AVX-512 has no `vpsignb`, so Q8_0's
//! signed weights are moved up by 128 instead of moving their signs onto the activations.

use std::arch::x86_64::*;

use super::ggml::QuantKind;
use super::int8::{ACT_BLOCK, PanelRows, QuantizedActs, RowStarts, SUM_BLOCK};
use super::panels::QuantPanels;
use crate::backend::cpu::kernels::matmul::PANEL;

/// Bytes ahead of the current group that the tile asks to have in cache (as `x86_int`).
const PREFETCH_AHEAD: usize = 16384;

/// Whether this CPU runs [`panel_avx512_vnni`]: `x86_int`'s AVX2 set, AVX512 F, BW (byte
/// shifts and masks on 512 bits), VL and VNNI.
pub(crate) fn has_avx512_vnni() -> bool {
    use std::arch::is_x86_feature_detected as has;
    super::x86_int::has_avx2()
        && has!("avx512f")
        && has!("avx512bw")
        && has!("avx512vl")
        && has!("avx512vnni")
}

/// Calls `rows::<$r, …>` with the format's constants.
macro_rules! by_kind {
    ($r:literal, ($acts:expr, $w:expr, $p:expr, $t:expr)) => {{
        use QuantKind as K;
        let (acts, w, p, t) = ($acts, $w, $p, $t);
        match w.kind() {
            K::Q8_0 => rows::<$r, false, true, false, false, false, 32>(acts, w, p, t),
            K::Q4_0 => rows::<$r, true, false, false, true, false, 32>(acts, w, p, t),
            K::Q4_1 => rows::<$r, true, false, true, false, false, 32>(acts, w, p, t),
            K::Q4K => rows::<$r, true, false, true, false, true, 32>(acts, w, p, t),
            K::Q5K => rows::<$r, false, false, true, false, true, 32>(acts, w, p, t),
            K::Q6K => rows::<$r, false, false, false, true, true, 16>(acts, w, p, t),
        }
    }};
}

/// One panel against `t.rows` (1..=4) rows.
///
/// # Safety
/// The CPU runs [`has_avx512_vnni`]'s set; `w` is in quads; the tile may write `t.cols`
/// columns of its rows.
#[target_feature(enable = "avx2,f16c,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn panel_avx512_vnni(
    acts: &QuantizedActs,
    w: &QuantPanels,
    p: usize,
    t: PanelRows,
) {
    // SAFETY: the caller's promises.
    unsafe {
        match t.rows {
            1 => by_kind!(1, (acts, w, p, t)),
            2 => by_kind!(2, (acts, w, p, t)),
            3 => by_kind!(3, (acts, w, p, t)),
            _ => by_kind!(4, (acts, w, p, t)),
        }
    }
}

/// `R` rows against the panel's 16 lanes. The format's constants are `x86_int`'s: `NIB`
/// 4-bit quads, `SIGNED` Q8_0's signed bytes, `ASYM` an offset per group, `BIASED` stored
/// integers with a bias, `SUPER` a K format's scale per group under its block's `d`, `G`
/// inputs per group.
#[target_feature(enable = "avx2,f16c,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn rows<
    const R: usize,
    const NIB: bool,
    const SIGNED: bool,
    const ASYM: bool,
    const BIASED: bool,
    const SUPER: bool,
    const G: usize,
>(
    acts: &QuantizedActs,
    w: &QuantPanels,
    p: usize,
    t: PanelRows,
) {
    let kind = w.kind();
    let layout = *w.layout();
    debug_assert_eq!(layout.nibbles, NIB);
    debug_assert_eq!(kind.group(), G);
    let base = w.panel_ptr(p);
    let bias = kind.nibble_bias();
    debug_assert_eq!(BIASED, bias != 0);
    debug_assert_eq!(SUPER, kind.super_blocks());
    let low = _mm512_set1_epi8(0x0F);
    // The rows' integers and per-block figures, read below without bounds checks: every
    // group's first input is under `k`, so its blocks lie inside the row's.
    let RowStarts {
        x,
        scale: dx_row,
        x_sum: x_sum_row,
        q_sum: q_sum_row,
    } = acts.row_starts::<R>(t.row, w.cols());
    let mut acc = [_mm512_setzero_ps(); R];
    // A group's f32 part, run one group late as in `x86_int` (the groups still reach `acc`
    // in input order).
    let finish =
        |acc: &mut [__m512; R], dot: &[__m512i; R], scale: __m512, offset: __m512, first: usize| {
            for (r, (acc, dot)) in acc.iter_mut().zip(dot).enumerate() {
                // SAFETY: the group's blocks lie inside row `r`'s (asserted above).
                let (dx, correction, x_sum) = unsafe {
                    let dx = _mm512_set1_ps(*dx_row[r].add(first / ACT_BLOCK));
                    let correction = if BIASED || SIGNED {
                        let sums = q_sum_row[r].add(first / SUM_BLOCK);
                        let q_sum = if G == SUM_BLOCK {
                            *sums
                        } else {
                            *sums + *sums.add(1)
                        };
                        _mm512_set1_epi32(if SIGNED { 128 } else { bias } * q_sum)
                    } else {
                        _mm512_setzero_si512()
                    };
                    let x_sum = if ASYM {
                        _mm512_set1_ps(*x_sum_row[r].add(first / ACT_BLOCK))
                    } else {
                        _mm512_setzero_ps()
                    };
                    (dx, correction, x_sum)
                };
                let d = if BIASED || SIGNED {
                    _mm512_sub_epi32(*dot, correction)
                } else {
                    *dot
                };
                let s = _mm512_mul_ps(scale, dx);
                *acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(d), *acc);
                if ASYM {
                    *acc = _mm512_fmadd_ps(offset, x_sum, *acc);
                }
            }
        };
    let mut pending: Option<([__m512i; R], __m512, __m512, usize)> = None;
    for (g, at) in layout.walk().take(w.cols() / G).enumerate() {
        let (block, head, q) = (at.block, at.head, at.q);
        if t.prefetch {
            let ahead = base.wrapping_add(at.start + PREFETCH_AHEAD);
            for line in (0..at.end - at.start).step_by(64) {
                // A hint: it never faults, whatever the address.
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line).cast());
            }
        }
        let first = g * G;
        // A row's sums in up to four independent chains (by pair parity, and the a and b
        // halves), added at the end: one row's eight `vpdpbusd` of a group in one chain
        // waited on each other's latency; with more rows, their chains overlap anyway and
        // the registers are needed. Integer sums: the order changes no bit.
        let mut dots = [[_mm512_setzero_si512(); 4]; R];
        // SAFETY (this block): the offsets come from the panel's layout, inside its bytes;
        // each activation row holds `cols` integers, and `first + G` is at most `cols`.
        let (scale, offset) = unsafe {
            let f16x16 = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(base.add(at).cast()));
            let i8x16 = |at: usize| {
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(base.add(at).cast())))
            };
            let d = f16x16(block);
            let m = if ASYM {
                f16x16(block + 2 * PANEL)
            } else {
                _mm512_setzero_ps()
            };
            if SUPER {
                let o = if ASYM {
                    _mm512_mul_ps(m, i8x16(head + PANEL))
                } else {
                    m
                };
                (_mm512_mul_ps(d, i8x16(head)), o)
            } else {
                (d, m)
            }
        };
        unsafe {
            let quad = |r: usize, i: usize| {
                _mm512_set1_epi32(x[r].add(first + i).cast::<i32>().read_unaligned())
            };
            let chunk = |c: usize| _mm512_loadu_si512(base.add(q + 64 * c).cast());
            for pair in 0..G / 8 {
                let (a, b) = if NIB {
                    let v = chunk(pair);
                    (
                        _mm512_and_si512(v, low),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(v), low),
                    )
                } else {
                    (chunk(2 * pair), chunk(2 * pair + 1))
                };
                // Q8_0's signed bytes as unsigned ones 128 higher (their sums come back
                // down by 128 times the activations' sum, in `finish`): exact, like the
                // sign-moving of the 256-bit tiles, and one operation a vector.
                let (ua, ub) = if SIGNED {
                    let flip = _mm512_set1_epi8(-128);
                    (_mm512_xor_si512(a, flip), _mm512_xor_si512(b, flip))
                } else {
                    (a, b)
                };
                for (r, dots) in dots.iter_mut().enumerate() {
                    let (xa, xb) = (quad(r, 8 * pair), quad(r, 8 * pair + 4));
                    // Four products per i32 lane, summed exactly.
                    let (ca, cb) = match R {
                        1 => (2 * (pair % 2), 2 * (pair % 2) + 1),
                        2 => (0, 1),
                        _ => (0, 0),
                    };
                    dots[ca] = _mm512_dpbusd_epi32(dots[ca], ua, xa);
                    dots[cb] = _mm512_dpbusd_epi32(dots[cb], ub, xb);
                }
            }
        }
        let dot: [__m512i; R] = std::array::from_fn(|r| {
            let d = &dots[r];
            _mm512_add_epi32(_mm512_add_epi32(d[0], d[1]), _mm512_add_epi32(d[2], d[3]))
        });
        if let Some((dot, scale, offset, first)) = pending {
            finish(&mut acc, &dot, scale, offset, first);
        }
        pending = Some((dot, scale, offset, first));
    }
    if let Some((dot, scale, offset, first)) = pending {
        finish(&mut acc, &dot, scale, offset, first);
    }
    let keep: __mmask16 = if t.cols >= PANEL {
        !0
    } else {
        (1u16 << t.cols) - 1
    };
    for (r, a) in acc.iter().enumerate() {
        // SAFETY: the caller lets this tile write `cols` columns of each of its rows.
        unsafe { _mm512_mask_storeu_ps(t.out.add(r * t.ldo), keep, *a) };
    }
}

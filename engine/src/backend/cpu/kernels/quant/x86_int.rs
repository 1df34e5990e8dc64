//! The integer tiles on x86-64 in 256-bit vectors: 32 bytes of quads are four consecutive
//! inputs of 8 lanes, so one instruction sequence gives each lane its dot product over 4
//! inputs (unsigned weights × signed activations). Two sequences, one tile body compiled
//! for each (`panel_maddubs`, `panel_avx_vnni`): `vpdpbusd` where the CPU has AVX-VNNI
//! (VEX), else AVX2's `vpmaddubsw` (adjacent pairs summed to i16) and `vpmaddwd` by ones
//! (pairs of those to i32). CPUs with AVX512_VNNI take `x86_zmm`'s 512-bit tile. Q8_0's weights are signed: their magnitudes multiply the
//! activations carrying the weights' signs (`vpsignb`), as GGML does. The sums are exact
//! integers in every sequence and the f32 operations after each group are those of
//! `int8::panel_portable`, so every tile gives the same bits.
//!
//! No i16 sum of the AVX2 sequence can saturate: `vpmaddubsw` gives at most 2·u·127 per lane
//! for stored integers up to u, and the tiles add only as many of those as stay under 32767
//! before widening: a whole group of nibbles (8 · 3810), four of Q5_K's (4 · 7874), two of
//! Q6_K's (2 · 16002); Q8_0's (up to 2·128·127 = 32512) widen one by one.

use std::arch::x86_64::*;

use super::ggml::QuantKind;
use super::int8::{ACT_BLOCK, PanelRows, QuantizedActs, RowStarts, SUM_BLOCK};
use super::panels::QuantPanels;
use crate::backend::cpu::kernels::matmul::PANEL;

/// Bytes ahead of the current group that the tile asks to have in cache (as the
/// dequantizers do: a decode step streams every weight once).
const PREFETCH_AHEAD: usize = 16384;

/// The dot-product sequences as the tile bodies' `$dot` (one compiled copy each; 1 was the
/// 256-bit AVX512_VNNI copy that `x86_zmm` replaced).
const MADDUBS: u8 = 0;
const AVX_VNNI: u8 = 2;

/// Whether this CPU runs the AVX2 tile ([`panel_maddubs`]): AVX2, FMA and F16C.
pub(crate) fn has_avx2() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx2") && has!("fma") && has!("f16c")
}

/// Whether this CPU runs [`panel_avx_vnni`].
pub(crate) fn has_avx_vnni() -> bool {
    has_avx2() && std::arch::is_x86_feature_detected!("avxvnni")
}

/// Calls tile body `$rows` with `R` = `$r`, `H` = `$h` from half `$half`, with the
/// format's constants (see the body's parameters).
macro_rules! by_kind {
    ($rows:ident, $r:literal, $h:literal, $half:expr, ($acts:expr, $w:expr, $p:expr, $t:expr)) => {{
        use QuantKind as K;
        let (acts, w, p, t) = ($acts, $w, $p, $t);
        match w.kind() {
            K::Q8_0 => {
                $rows::<$r, $h, false, true, false, false, false, 32, 1>(acts, w, p, t, $half)
            }
            K::Q4_0 => {
                $rows::<$r, $h, true, false, false, true, false, 32, 4>(acts, w, p, t, $half)
            }
            K::Q4_1 => {
                $rows::<$r, $h, true, false, true, false, false, 32, 4>(acts, w, p, t, $half)
            }
            K::Q4K => $rows::<$r, $h, true, false, true, false, true, 32, 4>(acts, w, p, t, $half),
            K::Q5K => $rows::<$r, $h, false, false, true, false, true, 32, 2>(acts, w, p, t, $half),
            K::Q6K => $rows::<$r, $h, false, false, false, true, true, 16, 1>(acts, w, p, t, $half),
        }
    }};
}

/// Defines a tile's entry point `$panel` and body `$rows` compiled for `$features`, with
/// dot sequence `$dot`: the same source twice, because an instruction set extension
/// is a property of the function that holds it.
macro_rules! integer_tile {
    ($panel:ident, $rows:ident, $features:literal, $dot:expr) => {
        /// One panel against `t.rows` (1..=4) rows with this copy's dot sequence: both halves
        /// of the panel in one pass for up to two rows, one half per pass beyond (16 vector
        /// registers hold 4 rows' sums of one half).
        ///
        /// # Safety
        /// The CPU has `$features` (the `has_` function of this copy); `w` is in quads; the
        /// tile may write `t.cols` columns of its rows.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $panel(acts: &QuantizedActs, w: &QuantPanels, p: usize, t: PanelRows) {
            // SAFETY: the caller's promises.
            unsafe {
                match t.rows {
                    1 => by_kind!($rows, 1, 2, 0, (acts, w, p, t)),
                    2 => by_kind!($rows, 2, 2, 0, (acts, w, p, t)),
                    3 => {
                        by_kind!($rows, 3, 1, 0, (acts, w, p, t));
                        if t.cols > 8 {
                            by_kind!($rows, 3, 1, 1, (acts, w, p, t));
                        }
                    }
                    _ => {
                        by_kind!($rows, 4, 1, 0, (acts, w, p, t));
                        if t.cols > 8 {
                            by_kind!($rows, 4, 1, 1, (acts, w, p, t));
                        }
                    }
                }
            }
        }

        /// `R` rows against `H` halves of 8 lanes from half `first_half`. `NIB`: 4-bit quads;
        /// `SIGNED`: Q8_0's signed bytes; `ASYM`: an offset per group; `BIASED`: stored integers
        /// carry a bias; `SUPER`: a K format's super-blocks (a scale per group under the block's
        /// `d`); `G`: inputs per group; `WIDEN`: pairs of 4-input steps summed in i16
        /// before widening (pairs of at most 2·2·u·127 each, u the largest stored integer: 4 for
        /// nibbles, 2 for Q5_K's 31, 1 for Q6_K's 63).
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn $rows<
            const R: usize,
            const H: usize,
            const NIB: bool,
            const SIGNED: bool,
            const ASYM: bool,
            const BIASED: bool,
            const SUPER: bool,
            const G: usize,
            const WIDEN: usize,
        >(
            acts: &QuantizedActs,
            w: &QuantPanels,
            p: usize,
            t: PanelRows,
            first_half: usize,
        ) {
            let kind = w.kind();
            let layout = *w.layout();
            debug_assert_eq!(layout.nibbles, NIB);
            debug_assert_eq!(kind.group(), G);
            let base = w.panel_ptr(p);
            let bias = kind.nibble_bias();
            debug_assert_eq!(BIASED, bias != 0);
            debug_assert_eq!(SUPER, kind.super_blocks());
            let low = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            // The rows' integers and per-block figures, read below without bounds checks: every
            // group's first input is under `k`, so its blocks lie inside the row's.
            let RowStarts {
                x,
                scale: dx_row,
                x_sum: x_sum_row,
                q_sum: q_sum_row,
            } = acts.row_starts::<R>(t.row, w.cols());
            let mut acc = [[_mm256_setzero_ps(); H]; R];
            // The f32 part of a group's results (from input `first`), run one group late:
            // its chain of dependent conversions and multiply-adds then overlaps the next
            // group's integer work instead of stalling the loop (+8-13 % on Zen 3's AVX2
            // tile). The groups still reach `acc` in input order, so no bit changes.
            let finish = |acc: &mut [[__m256; H]; R],
                          dot: &[[__m256i; H]; R],
                          scale: &[__m256; H],
                          offset: &[__m256; H],
                          first: usize| {
                for (r, (acc, dot)) in acc.iter_mut().zip(dot).enumerate() {
                    // SAFETY: the group's blocks lie inside row `r`'s (asserted above).
                    let (dx, correction, x_sum) = unsafe {
                        let dx = _mm256_broadcast_ss(&*dx_row[r].add(first / ACT_BLOCK));
                        let correction = if BIASED {
                            let sums = q_sum_row[r].add(first / SUM_BLOCK);
                            let q_sum = if G == SUM_BLOCK {
                                *sums
                            } else {
                                *sums + *sums.add(1)
                            };
                            _mm256_set1_epi32(bias * q_sum)
                        } else {
                            _mm256_setzero_si256()
                        };
                        let x_sum = if ASYM {
                            _mm256_broadcast_ss(&*x_sum_row[r].add(first / ACT_BLOCK))
                        } else {
                            _mm256_setzero_ps()
                        };
                        (dx, correction, x_sum)
                    };
                    for h in 0..H {
                        let d = if BIASED {
                            _mm256_sub_epi32(dot[h], correction)
                        } else {
                            dot[h]
                        };
                        let s = _mm256_mul_ps(scale[h], dx);
                        acc[h] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(d), acc[h]);
                        if ASYM {
                            acc[h] = _mm256_fmadd_ps(offset[h], x_sum, acc[h]);
                        }
                    }
                }
            };
            let mut pending: Option<([[__m256i; H]; R], [__m256; H], [__m256; H], usize)> = None;
            for (g, at) in layout.walk().take(w.cols() / G).enumerate() {
                let (block, head, q) = (at.block, at.head, at.q);
                if t.prefetch && first_half == 0 {
                    let ahead = base.wrapping_add(at.start + PREFETCH_AHEAD);
                    for line in (0..at.end - at.start).step_by(64) {
                        // A hint: it never faults, whatever the address.
                        _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line).cast());
                    }
                }
                let first = g * G;
                let mut scale = [_mm256_setzero_ps(); H];
                let mut offset = [_mm256_setzero_ps(); H];
                let mut dot = [[_mm256_setzero_si256(); H]; R];
                // SAFETY (this block): the offsets come from the panel's layout, inside its bytes;
                // each activation row holds `cols` integers, and `first + G` is at most `cols`.
                unsafe {
                    for h in 0..H {
                        let l0 = 8 * (first_half + h);
                        let f16x8 =
                            |at: usize| _mm256_cvtph_ps(_mm_loadu_si128(base.add(at).cast()));
                        let i8x8 = |at: usize| {
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                base.add(at).cast(),
                            )))
                        };
                        let d = f16x8(block + 2 * l0);
                        let m = if ASYM {
                            f16x8(block + 2 * PANEL + 2 * l0)
                        } else {
                            _mm256_setzero_ps()
                        };
                        (scale[h], offset[h]) = if SUPER {
                            let o = if ASYM {
                                _mm256_mul_ps(m, i8x8(head + PANEL + l0))
                            } else {
                                m
                            };
                            (_mm256_mul_ps(d, i8x8(head + l0)), o)
                        } else {
                            (d, m)
                        };
                    }
                    let quad = |r: usize, i: usize| {
                        _mm256_set1_epi32(x[r].add(first + i).cast::<i32>().read_unaligned())
                    };
                    let half_at = |chunk: usize, h: usize| {
                        _mm256_loadu_si256(base.add(q + 64 * chunk + 32 * (first_half + h)).cast())
                    };
                    // Steps of 4 inputs two at a time: their products summed in i16 for `WIDEN`
                    // pairs (as many as cannot saturate), then widened to i32 by `vpmaddwd`.
                    let mut sum16 = [[_mm256_setzero_si256(); H]; R];
                    for pair in 0..G / 8 {
                        for h in 0..H {
                            let (a, b) = if NIB {
                                let v = half_at(pair, h);
                                (
                                    _mm256_and_si256(v, low),
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(v), low),
                                )
                            } else {
                                (half_at(2 * pair, h), half_at(2 * pair + 1, h))
                            };
                            for r in 0..R {
                                let (xa, xb) = (quad(r, 8 * pair), quad(r, 8 * pair + 4));
                                if $dot != MADDUBS {
                                    // Four products per i32 lane, summed exactly.
                                    let ((ua, xa), (ub, xb)) = if SIGNED {
                                        (
                                            (_mm256_abs_epi8(a), _mm256_sign_epi8(xa, a)),
                                            (_mm256_abs_epi8(b), _mm256_sign_epi8(xb, b)),
                                        )
                                    } else {
                                        ((a, xa), (b, xb))
                                    };
                                    dot[r][h] = _mm256_dpbusd_avx_epi32(
                                        _mm256_dpbusd_avx_epi32(dot[r][h], ua, xa),
                                        ub,
                                        xb,
                                    );
                                } else if SIGNED {
                                    // Q8_0: a pair of products may reach 32512, so each step widens.
                                    let pa = _mm256_maddubs_epi16(
                                        _mm256_abs_epi8(a),
                                        _mm256_sign_epi8(xa, a),
                                    );
                                    let pb = _mm256_maddubs_epi16(
                                        _mm256_abs_epi8(b),
                                        _mm256_sign_epi8(xb, b),
                                    );
                                    let wide = _mm256_add_epi32(
                                        _mm256_madd_epi16(pa, ones),
                                        _mm256_madd_epi16(pb, ones),
                                    );
                                    dot[r][h] = _mm256_add_epi32(dot[r][h], wide);
                                } else {
                                    let s = _mm256_add_epi16(
                                        _mm256_maddubs_epi16(a, xa),
                                        _mm256_maddubs_epi16(b, xb),
                                    );
                                    sum16[r][h] = _mm256_add_epi16(sum16[r][h], s);
                                }
                            }
                        }
                        if $dot == MADDUBS && !SIGNED && (pair + 1) % WIDEN == 0 {
                            for (dot, sum16) in dot.iter_mut().zip(sum16.iter_mut()) {
                                for h in 0..H {
                                    let wide = _mm256_madd_epi16(sum16[h], ones);
                                    dot[h] = _mm256_add_epi32(dot[h], wide);
                                    sum16[h] = _mm256_setzero_si256();
                                }
                            }
                        }
                    }
                }
                if let Some((dot, scale, offset, first)) = pending {
                    finish(&mut acc, &dot, &scale, &offset, first);
                }
                pending = Some((dot, scale, offset, first));
            }
            if let Some((dot, scale, offset, first)) = pending {
                finish(&mut acc, &dot, &scale, &offset, first);
            }
            for (r, acc) in acc.iter().enumerate() {
                for (h, a) in acc.iter().enumerate() {
                    let l0 = 8 * (first_half + h);
                    if l0 >= t.cols {
                        break;
                    }
                    let valid = (t.cols - l0).min(8);
                    // SAFETY: the caller lets this tile write `cols` columns of each of its rows.
                    unsafe {
                        let dst = t.out.add(r * t.ldo + l0);
                        if valid == 8 {
                            _mm256_storeu_ps(dst, *a);
                        } else {
                            let mut lanes = [0f32; 8];
                            _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
                            std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst, valid);
                        }
                    }
                }
            }
        }
    };
}

integer_tile!(panel_maddubs, rows_maddubs, "avx2,f16c,fma", MADDUBS);
integer_tile!(
    panel_avx_vnni,
    rows_avx_vnni,
    "avx2,f16c,fma,avxvnni",
    AVX_VNNI
);

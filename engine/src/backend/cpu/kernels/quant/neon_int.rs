//! The integer tile on aarch64 with the dot-product extension (FEAT_DotProd: Neoverse N1 and
//! later, Apple M1 and later): 16 bytes of quads are four consecutive inputs of 4 lanes, so
//! one `sdot` by element multiplies them by one quad of activations (picked from a vector of
//! four by its index, no broadcast) and adds each lane's four products into its i32. Every
//! stored integer fits a signed byte (nibbles, Q5_K's 31, Q6_K's 63, Q8_0's own sign), so
//! no format needs a sign trick, and no i32 sum can overflow. The f32 operations after each
//! group are those of `int8::panel_portable`, so the bits are too.
//!
//! Stable Rust has no intrinsic for `sdot` yet, hence the one instruction written out;
//! everything else is NEON intrinsics (and `matmul`'s f16 load).

use std::arch::aarch64::*;

use super::ggml::QuantKind;
use super::int8::{ACT_BLOCK, PanelRows, QuantizedActs, SUM_BLOCK};
use super::panels::QuantPanels;
use crate::backend::cpu::kernels::matmul::PANEL;
use crate::backend::cpu::kernels::matmul::neon::Load4;

/// Whether this CPU has the dot-product instructions.
pub(crate) fn supported() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// One panel against `t.rows` (1..=4) rows, eight lanes per pass.
///
/// # Safety
/// The CPU has the dot-product extension ([`supported`]); `w` is in quads; the tile may
/// write `t.cols` columns of its rows.
#[target_feature(enable = "neon,dotprod")]
pub(crate) unsafe fn panel_sdot(acts: &QuantizedActs, w: &QuantPanels, p: usize, t: PanelRows) {
    use QuantKind as K;
    macro_rules! by_kind {
        ($r:literal, $half:expr) => {
            match w.kind() {
                K::Q8_0 => rows::<$r, false, false, false, false, 32>(acts, w, p, t, $half),
                K::Q4_0 => rows::<$r, true, false, true, false, 32>(acts, w, p, t, $half),
                K::Q4_1 => rows::<$r, true, true, false, false, 32>(acts, w, p, t, $half),
                K::Q4K => rows::<$r, true, true, false, true, 32>(acts, w, p, t, $half),
                K::Q5K => rows::<$r, false, true, false, true, 32>(acts, w, p, t, $half),
                K::Q6K => rows::<$r, false, false, true, true, 16>(acts, w, p, t, $half),
            }
        };
    }
    for half in 0..t.cols.div_ceil(8) {
        // SAFETY: the caller's promises.
        unsafe {
            match t.rows {
                1 => by_kind!(1, half),
                2 => by_kind!(2, half),
                3 => by_kind!(3, half),
                _ => by_kind!(4, half),
            }
        }
    }
}

/// `acc` plus, per lane, the dot product of `w`'s four bytes with quad `index` (0..=3) of `x`.
#[inline(always)]
unsafe fn sdot(acc: int32x4_t, w: int8x16_t, x: int8x16_t, index: usize) -> int32x4_t {
    let mut acc = acc;
    macro_rules! at {
        ($i:literal) => {
            // SAFETY: register arithmetic only; the caller's function enables `dotprod`.
            unsafe {
                core::arch::asm!(
                    concat!("sdot {acc:v}.4s, {w:v}.16b, {x:v}.4b[", $i, "]"),
                    acc = inout(vreg) acc,
                    w = in(vreg) w,
                    x = in(vreg) x,
                    options(pure, nomem, nostack, preserves_flags)
                )
            }
        };
    }
    // `index` is a constant wherever this is inlined, so only one arm remains.
    match index {
        0 => at!(0),
        1 => at!(1),
        2 => at!(2),
        _ => at!(3),
    }
    acc
}

/// Four f16 at `p` widened to f32 (exact).
#[inline(always)]
unsafe fn f16x4(p: *const u8) -> float32x4_t {
    // SAFETY: the caller points at four readable f16 values.
    unsafe { half::f16::load4(p.cast()) }
}

/// Four i8 at `p` as f32 (exact).
#[inline(always)]
unsafe fn i8x4(p: *const u8) -> float32x4_t {
    // SAFETY: the caller points at four readable bytes.
    let word = unsafe { p.cast::<u32>().read_unaligned() };
    // SAFETY: NEON is part of every aarch64 target.
    unsafe {
        let bytes = vreinterpret_s8_u32(vdup_n_u32(word));
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(bytes))))
    }
}

/// `R` rows against lanes `8·half..8·half + 8`. `NIB`: 4-bit quads; `ASYM`: an offset per
/// group; `BIASED`: stored integers carry a bias; `SUPER`: a K format's super-blocks; `G`:
/// inputs per group.
#[target_feature(enable = "neon,dotprod")]
#[inline]
unsafe fn rows<
    const R: usize,
    const NIB: bool,
    const ASYM: bool,
    const BIASED: bool,
    const SUPER: bool,
    const G: usize,
>(
    acts: &QuantizedActs,
    w: &QuantPanels,
    p: usize,
    t: PanelRows,
    half: usize,
) {
    let kind = w.kind();
    let layout = *w.layout();
    debug_assert_eq!(layout.nibbles, NIB);
    debug_assert_eq!(kind.group(), G);
    debug_assert_eq!((ASYM, SUPER), (kind.asymmetric(), kind.super_blocks()));
    let base = w.panel_ptr(p);
    let bias = kind.nibble_bias();
    debug_assert_eq!(BIASED, bias != 0);
    assert!(
        t.row + R <= acts.rows && w.cols() <= acts.k,
        "tile outside the activations"
    );
    let x: [*const i8; R] = std::array::from_fn(|r| acts.row(t.row + r).as_ptr());
    let at_row = |r: usize, per: usize| (t.row + r) * acts.k / per;
    let dx_row: [&[f32]; R] = std::array::from_fn(|r| &acts.scale[at_row(r, ACT_BLOCK)..]);
    let x_sum_row: [&[f32]; R] = std::array::from_fn(|r| &acts.x_sum[at_row(r, ACT_BLOCK)..]);
    let q_sum_row: [&[i32]; R] = std::array::from_fn(|r| &acts.q_sum[at_row(r, SUM_BLOCK)..]);
    let l0 = 8 * half;
    let zero = vdupq_n_f32(0.0);
    let mut acc = [[zero; 2]; R];
    for (g, at) in layout.walk().take(w.cols() / G).enumerate() {
        let first = g * G;
        let mut scale = [zero; 2];
        let mut offset = [zero; 2];
        let mut dot = [[vdupq_n_s32(0); 2]; R];
        // SAFETY (this block): the offsets come from the panel's layout, inside its bytes;
        // each activation row holds `cols` integers, and `first + G` is at most `cols`.
        unsafe {
            for (c, (scale, offset)) in scale.iter_mut().zip(&mut offset).enumerate() {
                let lane = l0 + 4 * c;
                let d = f16x4(base.add(at.block + 2 * lane));
                let m = if ASYM {
                    f16x4(base.add(at.block + 2 * PANEL + 2 * lane))
                } else {
                    zero
                };
                (*scale, *offset) = if SUPER {
                    let o = if ASYM {
                        vmulq_f32(m, i8x4(base.add(at.head + PANEL + lane)))
                    } else {
                        m
                    };
                    (vmulq_f32(d, i8x4(base.add(at.head + lane))), o)
                } else {
                    (d, m)
                };
            }
            let xv: [[int8x16_t; 2]; R] = std::array::from_fn(|r| {
                let row = x[r].add(first);
                [
                    vld1q_s8(row),
                    vld1q_s8(row.add(if G > 16 { 16 } else { 0 })),
                ]
            });
            // Quad `i` (inputs 4i..4i + 4 of the group) of row `r`.
            let quad = |r: usize, i: usize| (xv[r][i / 4], i % 4);
            // Lane group `c`'s 16 bytes of the weights' 64-byte chunk `chunk`.
            let chunk_at = |chunk: usize, c: usize| {
                vreinterpretq_s8_u8(vld1q_u8(base.add(at.q + 64 * chunk + 4 * l0 + 16 * c)))
            };
            // Eight inputs a step: one chunk of nibbles, or two chunks of bytes.
            for step in 0..G / 8 {
                for c in 0..2 {
                    let (a, b) = if NIB {
                        let v = vreinterpretq_u8_s8(chunk_at(step, c));
                        (
                            vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))),
                            vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
                        )
                    } else {
                        (chunk_at(2 * step, c), chunk_at(2 * step + 1, c))
                    };
                    for (r, dot) in dot.iter_mut().enumerate() {
                        let (xa, ia) = quad(r, 2 * step);
                        let (xb, ib) = quad(r, 2 * step + 1);
                        dot[c] = sdot(sdot(dot[c], a, xa, ia), b, xb, ib);
                    }
                }
            }
        }
        for (r, (acc, dot)) in acc.iter_mut().zip(&dot).enumerate() {
            let dx = vdupq_n_f32(dx_row[r][first / ACT_BLOCK]);
            let correction = if BIASED {
                let sums = &q_sum_row[r][first / SUM_BLOCK..];
                let q_sum: i32 = sums[..G / SUM_BLOCK].iter().sum();
                vdupq_n_s32(bias * q_sum)
            } else {
                vdupq_n_s32(0)
            };
            let x_sum = vdupq_n_f32(if ASYM {
                x_sum_row[r][first / ACT_BLOCK]
            } else {
                0.0
            });
            for c in 0..2 {
                let d = vcvtq_f32_s32(vsubq_s32(dot[c], correction));
                let s = vmulq_f32(scale[c], dx);
                acc[c] = vfmaq_f32(acc[c], s, d);
                if ASYM {
                    acc[c] = vfmaq_f32(acc[c], offset[c], x_sum);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let mut lanes = [0f32; 8];
        // SAFETY: 8 floats in the array.
        unsafe {
            vst1q_f32(lanes.as_mut_ptr(), acc[0]);
            vst1q_f32(lanes.as_mut_ptr().add(4), acc[1]);
        }
        let valid = (t.cols - l0).min(8);
        // SAFETY: the caller lets this tile write `cols` columns of each of its rows.
        unsafe { std::ptr::copy_nonoverlapping(lanes.as_ptr(), t.out.add(r * t.ldo + l0), valid) };
    }
}

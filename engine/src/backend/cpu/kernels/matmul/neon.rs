//! The aarch64 micro-kernels of `linear` (Graviton, Ampere, Apple silicon under Linux): a
//! 16-output panel is four 128-bit vectors, and a tile of up to 6 rows × 1 panel keeps 24
//! accumulators, 4 weight vectors and a broadcast within the 32 vector registers (callers
//! size tiles with `panels_per_call`). The module's order holds: one accumulator lane per
//! output, one fused multiply-add (`fmla`) per input feature, in order, so these kernels
//! agree bit for bit with the x86 ones.

use super::tile::{PANEL, Tile};
use std::arch::aarch64::*;

/// Four consecutive weights widened to f32 (the f16 ones also for `quant`'s integer tile).
pub(in crate::backend::cpu::kernels) trait Load4: Copy {
    unsafe fn load4(p: *const Self) -> float32x4_t;
}

impl Load4 for f32 {
    #[inline(always)]
    unsafe fn load4(p: *const f32) -> float32x4_t {
        // SAFETY: the caller points at four readable floats.
        unsafe { vld1q_f32(p) }
    }
}

impl Load4 for half::bf16 {
    /// bf16 is the high half of an f32: widen each lane by a 16-bit left shift.
    #[inline(always)]
    unsafe fn load4(p: *const half::bf16) -> float32x4_t {
        // SAFETY: the caller points at four readable bf16 values.
        unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p as *const u16))) }
    }
}

impl Load4 for half::f16 {
    /// `fcvtl` is base AArch64 SIMD; its intrinsic takes a half-float vector type that stable
    /// Rust does not have yet, hence the one instruction written out. The conversion is exact.
    #[inline(always)]
    unsafe fn load4(p: *const half::f16) -> float32x4_t {
        // SAFETY: the caller points at four readable f16 values.
        let bits = unsafe { vld1_u16(p as *const u16) };
        let out: float32x4_t;
        // SAFETY: a register-to-register conversion; touches no memory or flags.
        unsafe {
            core::arch::asm!(
                "fcvtl {out:v}.4s, {bits:v}.4h",
                bits = in(vreg) bits,
                out = lateout(vreg) out,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        out
    }
}

/// `R` rows × `C` panels of accumulators; one broadcast per row and input feature.
#[target_feature(enable = "neon")]
pub(super) unsafe fn tile_neon<W: Load4, const R: usize, const C: usize>(t: Tile, w: *const W) {
    let zero = vdupq_n_f32(0.0);
    let mut acc = [[[zero; 4]; C]; R];
    let panel_stride = t.k * PANEL;
    for i in 0..t.k {
        let mut wv = [[zero; 4]; C];
        for (c, v) in wv.iter_mut().enumerate() {
            // SAFETY: panel c of the tile holds `k` rows of 16 weights.
            let base = unsafe { w.add(c * panel_stride + i * PANEL) };
            for (q, vq) in v.iter_mut().enumerate() {
                *vq = unsafe { W::load4(base.add(4 * q)) };
            }
        }
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: the tile's rows of x hold `k` floats each.
            let xv = vdupq_n_f32(unsafe { *t.x.add(r * t.k + i) });
            for (a, v) in row.iter_mut().zip(&wv) {
                for q in 0..4 {
                    a[q] = vfmaq_f32(a[q], xv, v[q]);
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
            let mut lanes = [0f32; PANEL];
            for (q, v) in a.iter().enumerate() {
                // SAFETY: `lanes` holds 16 floats.
                unsafe { vst1q_f32(lanes.as_mut_ptr().add(4 * q), *v) };
            }
            let valid = (t.cols - col).min(PANEL);
            // SAFETY: the tile may write `cols` columns of each of its rows.
            unsafe {
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), t.out.add(r * t.ldo + col), valid)
            };
        }
    }
}

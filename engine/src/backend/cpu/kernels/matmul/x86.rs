//! The x86-64 micro-kernels of `linear`: AVX-512 tiles of up to 6 rows × 4 panels (24 of the
//! 32 zmm registers accumulate) and AVX2 tiles sized for 16 ymm registers (6 rows × 1 panel:
//! 12 accumulators, 2 weight vectors and a broadcast). Both keep the module's order: one
//! accumulator lane per output, a fused multiply-add per input feature, in order.

use super::tile::{PANEL, Tile};
use std::arch::x86_64::*;

macro_rules! load16 {
    (f32, $p:expr) => {
        _mm512_loadu_ps($p as *const f32)
    };
    (f16, $p:expr) => {
        _mm512_cvtph_ps(_mm256_loadu_si256($p as *const __m256i))
    };
    (bf16, $p:expr) => {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256($p as *const __m256i),
        )))
    };
}

macro_rules! load8 {
    (f32, $p:expr) => {
        _mm256_loadu_ps($p as *const f32)
    };
    (f16, $p:expr) => {
        _mm256_cvtph_ps(_mm_loadu_si128($p as *const __m128i))
    };
    (bf16, $p:expr) => {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128($p as *const __m128i),
        )))
    };
}

macro_rules! tiles {
    ($avx512:ident, $avx2:ident, $ty:ty, $kind:tt) => {
        /// AVX-512: R rows × C panels of accumulators, one broadcast per row and input.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
        pub(super) unsafe fn $avx512<const R: usize, const C: usize>(t: Tile, w: *const $ty) {
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            let panel_stride = t.k * PANEL;
            for i in 0..t.k {
                if !t.prefetch.is_null() {
                    // A hint only: prefetches never fault, and the line is in bounds.
                    _mm_prefetch::<_MM_HINT_T1>(
                        t.prefetch.wrapping_add(i * super::tile::PREFETCH_LINE) as *const i8,
                    );
                }
                let mut wv = [_mm512_setzero_ps(); C];
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = unsafe { load16!($kind, w.add(c * panel_stride + i * PANEL)) };
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = _mm512_set1_ps(unsafe { *t.x.add(r * t.k + i) });
                    for (a, v) in row.iter_mut().zip(&wv) {
                        *a = _mm512_fmadd_ps(xv, *v, *a);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (c, a) in row.iter().enumerate() {
                    let col = c * PANEL;
                    if col >= t.cols {
                        break;
                    }
                    let dst = unsafe { t.out.add(r * t.ldo + col) };
                    let valid = (t.cols - col).min(PANEL);
                    if valid == PANEL {
                        unsafe { _mm512_storeu_ps(dst, *a) };
                    } else {
                        let mask: __mmask16 = ((1u32 << valid) - 1) as __mmask16;
                        unsafe { _mm512_mask_storeu_ps(dst, mask, *a) };
                    }
                }
            }
        }

        /// AVX2: each 16-wide panel as two 8-wide halves; callers keep `2·R·C + 2·C + 1` within
        /// the 16 ymm registers (see `panels_per_call`).
        #[target_feature(enable = "avx2,f16c,fma")]
        pub(super) unsafe fn $avx2<const R: usize, const C: usize>(t: Tile, w: *const $ty) {
            let mut acc = [[[_mm256_setzero_ps(); 2]; C]; R];
            let panel_stride = t.k * PANEL;
            for i in 0..t.k {
                let mut wv = [[_mm256_setzero_ps(); 2]; C];
                for (c, v) in wv.iter_mut().enumerate() {
                    let base = unsafe { w.add(c * panel_stride + i * PANEL) };
                    v[0] = unsafe { load8!($kind, base) };
                    v[1] = unsafe { load8!($kind, base.add(8)) };
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = _mm256_set1_ps(unsafe { *t.x.add(r * t.k + i) });
                    for (a, v) in row.iter_mut().zip(&wv) {
                        a[0] = _mm256_fmadd_ps(xv, v[0], a[0]);
                        a[1] = _mm256_fmadd_ps(xv, v[1], a[1]);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (c, a) in row.iter().enumerate() {
                    let col = c * PANEL;
                    if col >= t.cols {
                        break;
                    }
                    let dst = unsafe { t.out.add(r * t.ldo + col) };
                    if t.cols - col >= PANEL {
                        unsafe {
                            _mm256_storeu_ps(dst, a[0]);
                            _mm256_storeu_ps(dst.add(8), a[1]);
                        }
                    } else {
                        let mut lanes = [0f32; PANEL];
                        unsafe {
                            _mm256_storeu_ps(lanes.as_mut_ptr(), a[0]);
                            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a[1]);
                            std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst, t.cols - col);
                        }
                    }
                }
            }
        }
    };
}

tiles!(tile_avx512_f32, tile_avx2_f32, f32, f32);
tiles!(tile_avx512_f16, tile_avx2_f16, half::f16, f16);
tiles!(tile_avx512_bf16, tile_avx2_bf16, half::bf16, bf16);

//! x86-64 dequantization of one panel: the portable loop's value (`q·S`, then `+ O`), 16
//! lanes at a time on AVX-512 and two halves of 8 on AVX2, as one fused multiply-add where
//! there is an offset (the same bits: see `QuantPanels::weight`).

use std::arch::x86_64::*;

use super::{PANEL, PanelView};

/// Writes `q·scale (+ offset)` for one 16-lane input of integers.
macro_rules! store512 {
    ($asym:expr, $dst:expr, $q:expr, $scale:expr, $offset:expr) => {{
        let q = _mm512_cvtepi32_ps($q);
        let w = if $asym {
            _mm512_fmadd_ps(q, $scale, $offset)
        } else {
            _mm512_mul_ps(q, $scale)
        };
        _mm512_storeu_ps($dst, w);
    }};
}

macro_rules! store256 {
    ($asym:expr, $dst:expr, $q:expr, $scale:expr, $offset:expr) => {{
        let q = _mm256_cvtepi32_ps($q);
        let w = if $asym {
            _mm256_fmadd_ps(q, $scale, $offset)
        } else {
            _mm256_mul_ps(q, $scale)
        };
        _mm256_storeu_ps($dst, w);
    }};
}

/// Bytes ahead of the current group that the dequantizers ask to have in cache. A decode
/// step streams every weight from memory once; a hardware prefetcher alone kept one core at
/// about a third of the bandwidth the f32 kernels reach with their own prefetching.
const PREFETCH_AHEAD: usize = 16384;

/// Prefetches the bytes `PREFETCH_AHEAD` past group `g`'s (running into the next panels,
/// which follow in memory).
#[inline(always)]
fn prefetch_ahead(v: &PanelView, g: usize) {
    let record = v.layout.record(g);
    let at = v.bytes.as_ptr().wrapping_add(record.start + PREFETCH_AHEAD);
    for line in (0..record.len()).step_by(64) {
        // SAFETY: a prefetch is a hint and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(line).cast()) };
    }
}

/// # Safety
/// The CPU has AVX-512 F/BW/VL and F16C; `out` holds `cols × 16` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub(super) unsafe fn dequant_avx512(v: &PanelView, out: *mut f32) {
    unsafe {
        match (v.kind.nibbles(), v.kind.asymmetric()) {
            (true, true) => groups512::<true, true>(v, out),
            (true, false) => groups512::<true, false>(v, out),
            (false, true) => groups512::<false, true>(v, out),
            (false, false) => groups512::<false, false>(v, out),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
#[inline]
unsafe fn groups512<const NIB: bool, const ASYM: bool>(v: &PanelView, out: *mut f32) {
    let kind = v.kind;
    let group = kind.group();
    let bias = _mm512_set1_epi32(kind.nibble_bias());
    let low = _mm512_set1_epi32(0xF);
    let f16x16 = |p: *const u8| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) };
    let i8x16 = |p: *const u8| unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())) };
    let base = v.bytes.as_ptr();
    for g in 0..v.cols / group {
        prefetch_ahead(v, g);
        let (block, head) = (v.layout.block_at(g), v.layout.group_at(g));
        let q = v.layout.q_at(g);
        // SAFETY (this block): the offsets come from the panel's layout, inside its bytes;
        // `out` holds `cols × 16` floats.
        unsafe {
            let d = f16x16(base.add(block));
            let m = if ASYM {
                f16x16(base.add(block + 2 * PANEL))
            } else {
                _mm512_setzero_ps()
            };
            let (scale, offset) = if kind.super_blocks() {
                let sc = _mm512_cvtepi32_ps(i8x16(base.add(head)));
                let offset = if ASYM {
                    _mm512_mul_ps(m, _mm512_cvtepi32_ps(i8x16(base.add(head + PANEL))))
                } else {
                    m
                };
                (_mm512_mul_ps(d, sc), offset)
            } else {
                (d, m)
            };
            let first = g * group;
            if NIB {
                for j in 0..group / 2 {
                    let src = base.add(q + j * PANEL);
                    let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(src.cast()));
                    let lo = _mm512_sub_epi32(_mm512_and_si512(bytes, low), bias);
                    let hi = _mm512_sub_epi32(_mm512_srli_epi32::<4>(bytes), bias);
                    store512!(ASYM, out.add((first + 2 * j) * PANEL), lo, scale, offset);
                    store512!(
                        ASYM,
                        out.add((first + 2 * j + 1) * PANEL),
                        hi,
                        scale,
                        offset
                    );
                }
            } else {
                for i in 0..group {
                    let qs = i8x16(base.add(q + i * PANEL));
                    store512!(ASYM, out.add((first + i) * PANEL), qs, scale, offset);
                }
            }
        }
    }
}

/// # Safety
/// The CPU has AVX2 and F16C; `out` holds `cols × 16` floats.
#[target_feature(enable = "avx2,f16c,fma")]
pub(super) unsafe fn dequant_avx2(v: &PanelView, out: *mut f32) {
    unsafe {
        match (v.kind.nibbles(), v.kind.asymmetric()) {
            (true, true) => groups256::<true, true>(v, out),
            (true, false) => groups256::<true, false>(v, out),
            (false, true) => groups256::<false, true>(v, out),
            (false, false) => groups256::<false, false>(v, out),
        }
    }
}

#[target_feature(enable = "avx2,f16c,fma")]
#[inline]
unsafe fn groups256<const NIB: bool, const ASYM: bool>(v: &PanelView, out: *mut f32) {
    let kind = v.kind;
    let group = kind.group();
    let bias = _mm256_set1_epi32(kind.nibble_bias());
    let low = _mm256_set1_epi32(0xF);
    let f16x8 = |p: *const u8| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) };
    let i8x8 = |p: *const u8| unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())) };
    let base = v.bytes.as_ptr();
    for g in 0..v.cols / group {
        prefetch_ahead(v, g);
        let q = v.layout.q_at(g);
        let first = g * group;
        for half in 0..2 {
            let block = v.layout.block_at(g) + 2 * 8 * half;
            let head = v.layout.group_at(g) + 8 * half;
            // SAFETY (this block): as in `groups512`, for lanes `8·half..8·half + 8`.
            unsafe {
                let d = f16x8(base.add(block));
                let m = if ASYM {
                    f16x8(base.add(block + 2 * PANEL))
                } else {
                    _mm256_setzero_ps()
                };
                let (scale, offset) = if kind.super_blocks() {
                    let sc = _mm256_cvtepi32_ps(i8x8(base.add(head)));
                    let offset = if ASYM {
                        _mm256_mul_ps(m, _mm256_cvtepi32_ps(i8x8(base.add(head + PANEL))))
                    } else {
                        m
                    };
                    (_mm256_mul_ps(d, sc), offset)
                } else {
                    (d, m)
                };
                if NIB {
                    for j in 0..group / 2 {
                        let src = base.add(q + j * PANEL + half * 8);
                        let bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(src.cast()));
                        let lo = _mm256_sub_epi32(_mm256_and_si256(bytes, low), bias);
                        let hi = _mm256_sub_epi32(_mm256_srli_epi32::<4>(bytes), bias);
                        let at = |i: usize| out.add((first + i) * PANEL + half * 8);
                        store256!(ASYM, at(2 * j), lo, scale, offset);
                        store256!(ASYM, at(2 * j + 1), hi, scale, offset);
                    }
                } else {
                    for i in 0..group {
                        let qs = i8x8(base.add(q + i * PANEL + half * 8));
                        store256!(
                            ASYM,
                            out.add((first + i) * PANEL + half * 8),
                            qs,
                            scale,
                            offset
                        );
                    }
                }
            }
        }
    }
}

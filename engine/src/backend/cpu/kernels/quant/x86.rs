//! x86-64 dequantization of one panel: the portable loop's value (`q·S`, then `+ O`), 16
//! lanes at a time on AVX-512 and two halves of 8 on AVX2, as one fused multiply-add where
//! there is an offset (the same bits: see `QuantPanels::weight`). Q5_K's and Q6_K's high bits
//! come from a word per input, broadcast and rotated per lane into place.

use std::arch::x86_64::*;

use super::panels::PanelView;
use crate::backend::cpu::kernels::matmul::PANEL;

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
        match (v.kind.nibbles(), v.kind.asymmetric(), v.kind.high_bits()) {
            (true, true, 0) => groups512::<true, true, 0>(v, out),
            (true, true, _) => groups512::<true, true, 1>(v, out),
            (true, false, 0) => groups512::<true, false, 0>(v, out),
            (true, false, _) => groups512::<true, false, 2>(v, out),
            (false, true, _) => groups512::<false, true, 0>(v, out),
            (false, false, _) => groups512::<false, false, 0>(v, out),
        }
    }
}

/// Per-lane rotations that bring lane `l`'s `H` high bits (at `H·l` of its input's word) to
/// bits 4.., and the mask of those bits.
pub(super) fn high_rotation<const H: usize>() -> ([i32; PANEL], i32) {
    (
        std::array::from_fn(|l| (4 - (H * l) as i32).rem_euclid(32)),
        ((1 << H) - 1) << 4,
    )
}

/// `nibbles | high bits << 4` of one input in 16 lanes, from its word at `at`: one bit per
/// lane (Q5_K) is a lane mask that ORs in 16; two (Q6_K) are broadcast, rotated per lane into
/// place (`rot`) and masked in with one ternary-logic op. `mask`: the high bits' place.
///
/// # Safety
/// The CPU has AVX-512 F/BW; `at` is an input's word in a panel with `H` > 0.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) unsafe fn with_high<const H: usize>(
    nibbles: __m512i,
    at: *const u8,
    rot: __m512i,
    mask: __m512i,
) -> __m512i {
    // SAFETY: the caller's panel holds the word at `at` (2·H bytes).
    unsafe {
        if H == 1 {
            let lanes = at.cast::<u16>().read_unaligned();
            _mm512_mask_or_epi32(nibbles, lanes, nibbles, mask)
        } else {
            let word = _mm512_set1_epi32(at.cast::<i32>().read_unaligned());
            // 0xF8: A | (B & C), with A the nibbles, B the rotated word, C the mask.
            _mm512_ternarylogic_epi32::<0xF8>(nibbles, _mm512_rolv_epi32(word, rot), mask)
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
#[inline]
unsafe fn groups512<const NIB: bool, const ASYM: bool, const HIGH: usize>(
    v: &PanelView,
    out: *mut f32,
) {
    debug_assert_eq!(HIGH, v.kind.high_bits());
    let kind = v.kind;
    let group = kind.group();
    let bias = _mm512_set1_epi32(kind.nibble_bias());
    let low = _mm512_set1_epi32(0xF);
    let (rot, mask) = high_rotation::<HIGH>();
    // SAFETY: 16 i32 in the array.
    let (rot, mask) = (
        unsafe { _mm512_loadu_si512(rot.as_ptr().cast()) },
        _mm512_set1_epi32(mask),
    );
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
                    let mut lo = _mm512_and_si512(bytes, low);
                    let mut hi = _mm512_srli_epi32::<4>(bytes);
                    if HIGH > 0 {
                        let at = |within| base.add(v.layout.high_at(g, within));
                        lo = with_high::<HIGH>(lo, at(2 * j), rot, mask);
                        hi = with_high::<HIGH>(hi, at(2 * j + 1), rot, mask);
                    }
                    let lo = _mm512_sub_epi32(lo, bias);
                    let hi = _mm512_sub_epi32(hi, bias);
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
        match (v.kind.nibbles(), v.kind.asymmetric(), v.kind.high_bits()) {
            (true, true, 0) => groups256::<true, true, 0>(v, out),
            (true, true, _) => groups256::<true, true, 1>(v, out),
            (true, false, 0) => groups256::<true, false, 0>(v, out),
            (true, false, _) => groups256::<true, false, 2>(v, out),
            (false, true, _) => groups256::<false, true, 0>(v, out),
            (false, false, _) => groups256::<false, false, 0>(v, out),
        }
    }
}

#[target_feature(enable = "avx2,f16c,fma")]
#[inline]
unsafe fn groups256<const NIB: bool, const ASYM: bool, const HIGH: usize>(
    v: &PanelView,
    out: *mut f32,
) {
    debug_assert_eq!(HIGH, v.kind.high_bits());
    // Lane l's high bits (at H·l of its input's word) shifted to bits 4..: a rotation,
    // as a left and a right shift (AVX2 shifts a lane by 32 or more to 0).
    let (rot, mask) = high_rotation::<HIGH>();
    let shifts = |half: usize| {
        let left: [i32; 8] = std::array::from_fn(|l| rot[8 * half + l]);
        let right: [i32; 8] = std::array::from_fn(|l| (32 - rot[8 * half + l]) & 63);
        // SAFETY: 8 i32 in each array.
        unsafe {
            (
                _mm256_loadu_si256(left.as_ptr().cast()),
                _mm256_loadu_si256(right.as_ptr().cast()),
            )
        }
    };
    let shifts = [shifts(0), shifts(1)];
    let mask = _mm256_set1_epi32(mask);
    let high = |at: *const u8, half: usize| {
        // SAFETY: the caller's panel holds the word at `at` (2·HIGH bytes).
        let word = unsafe {
            if HIGH == 1 {
                i32::from(at.cast::<u16>().read_unaligned())
            } else {
                at.cast::<i32>().read_unaligned()
            }
        };
        let word = _mm256_set1_epi32(word);
        let (left, right) = shifts[half];
        let rotated = _mm256_or_si256(
            _mm256_sllv_epi32(word, left),
            _mm256_srlv_epi32(word, right),
        );
        _mm256_and_si256(rotated, mask)
    };
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
                        let mut lo = _mm256_and_si256(bytes, low);
                        let mut hi = _mm256_srli_epi32::<4>(bytes);
                        if HIGH > 0 {
                            let at = |within| base.add(v.layout.high_at(g, within));
                            lo = _mm256_or_si256(lo, high(at(2 * j), half));
                            hi = _mm256_or_si256(hi, high(at(2 * j + 1), half));
                        }
                        let lo = _mm256_sub_epi32(lo, bias);
                        let hi = _mm256_sub_epi32(hi, bias);
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

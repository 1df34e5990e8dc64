//! The lane-grouped arithmetic of the per-lane path: a block's scores (`Σ q·k`) and P·V for
//! the lanes that see the whole block, up to six lanes at once in registers. One dispatch
//! per operation picks the instruction set; `in_lane_groups!` walks the lanes in groups
//! whose size is the kernel's const parameter.

use tandem_kv::BLOCK_SIZE;

use super::super::Isa;

/// Most lanes one register-blocked kernel call takes (its accumulators fill 12 of AVX2's 16
/// ymm registers).
#[cfg(target_arch = "x86_64")]
const MAX_LANES_AT_ONCE: usize = 6;

/// Calls `$kernel::<N>(first_lane, args…)` over lanes `$from..$to` in groups of at most
/// [`MAX_LANES_AT_ONCE`], `N` being each group's size (a const parameter, so the group's
/// accumulators are a fixed array of registers).
#[cfg(target_arch = "x86_64")]
macro_rules! in_lane_groups {
    ($from:expr, $to:expr, $kernel:ident$([$($c:tt),+])?($($arg:expr),* $(,)?)) => {{
        let mut lane = $from;
        while lane < $to {
            let n = ($to - lane).min(MAX_LANES_AT_ONCE);
            match n {
                6 => $kernel::<6 $($(, $c)+)?>(lane, $($arg),*),
                5 => $kernel::<5 $($(, $c)+)?>(lane, $($arg),*),
                4 => $kernel::<4 $($(, $c)+)?>(lane, $($arg),*),
                3 => $kernel::<3 $($(, $c)+)?>(lane, $($arg),*),
                2 => $kernel::<2 $($(, $c)+)?>(lane, $($arg),*),
                _ => $kernel::<1 $($(, $c)+)?>(lane, $($arg),*),
            }
            lane += n;
        }
    }};
}

/// `scores[l] = Σ_i qs[l][i] · kt[i][0..16]` for lanes `from..to` of one block (K is stored
/// transposed: `kt[i]` holds dimension `i` of the block's 16 keys).
///
/// With AVX-512 up to six lanes run at once in registers, so the FMA units are not waiting on
/// one 64-long dependency chain. Every lane's sum runs over `i` in order with fused
/// multiply-adds on every path, so a lane's scores do not depend on which lanes share its
/// group nor on the instruction set: batch invariance holds.
#[inline(always)]
pub(super) unsafe fn block_scores(
    isa: Isa,
    kt: &[f32],
    qs: &[f32],
    from: usize,
    to: usize,
    d: usize,
    scores: &mut [[f32; BLOCK_SIZE]],
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the caller's slices hold `to` lanes of `d` floats and `d` rows of 16.
        unsafe { in_lane_groups!(from, to, scores_avx512(kt, qs, d, scores)) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: as above.
        unsafe { in_lane_groups!(from, to, scores_avx2(kt, qs, d, scores)) };
        return;
    }
    let _ = isa;
    for l in from..to {
        let q = &qs[l * d..(l + 1) * d];
        let out = &mut scores[l];
        *out = [0.0; BLOCK_SIZE];
        for (i, &qd) in q.iter().enumerate() {
            let krow = &kt[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            for j in 0..BLOCK_SIZE {
                out[j] = qd.mul_add(krow[j], out[j]);
            }
        }
    }
}

/// [`block_scores`] for a run of blocks (`kts[k]` the K part of block `k`), every block's
/// lanes `from..to` written from `scores[k · stride]` on. With AVX-512 the run's blocks are
/// computed together (up to six lanes of four blocks: 24 independent accumulators), so the
/// few lanes of a decode step keep the multiply-add units busy instead of waiting on one
/// 64-long chain per lane. Each score is the same chain as [`block_scores`]'s: no bit
/// changes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn block_scores_run(
    isa: Isa,
    kts: &[&[f32]],
    qs: &[f32],
    from: usize,
    to: usize,
    d: usize,
    scores: &mut [[f32; BLOCK_SIZE]],
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        debug_assert!(kts.len() <= 4 && scores.len() >= (kts.len() - 1) * stride + to);
        let k = |i: usize| kts.get(i).map_or(std::ptr::null(), |k| k.as_ptr());
        let at = [k(0), k(1), k(2), k(3)];
        // SAFETY: each of the run's K parts holds d rows of 16; the caller's slices hold
        // `to` lanes of `d` floats and the run's blocks of scores.
        unsafe {
            match kts.len() {
                4 => in_lane_groups!(from, to, scores_run_avx512[4](&at, qs, d, scores, stride)),
                3 => in_lane_groups!(from, to, scores_run_avx512[3](&at, qs, d, scores, stride)),
                2 => in_lane_groups!(from, to, scores_run_avx512[2](&at, qs, d, scores, stride)),
                _ => in_lane_groups!(from, to, scores_run_avx512[1](&at, qs, d, scores, stride)),
            }
        }
        return;
    }
    for (k, kt) in kts.iter().enumerate() {
        // SAFETY: the caller's promises, block by block.
        unsafe { block_scores(isa, kt, qs, from, to, d, &mut scores[k * stride..]) };
    }
}

/// `N` lanes of `B` blocks' scores: the accumulators of every (lane, block) in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn scores_run_avx512<const N: usize, const B: usize>(
    from: usize,
    kts: &[*const f32; 4],
    qs: &[f32],
    d: usize,
    scores: &mut [[f32; BLOCK_SIZE]],
    stride: usize,
) {
    use std::arch::x86_64::*;
    debug_assert!(qs.len() >= (from + N) * d && scores.len() >= (B - 1) * stride + from + N);
    let mut acc = [[_mm512_setzero_ps(); B]; N];
    // SAFETY: lanes from..from + N hold d floats each (asserted above).
    let lanes: [*const f32; N] =
        std::array::from_fn(|l| unsafe { qs.as_ptr().add((from + l) * d) });
    for i in 0..d {
        // SAFETY: i < d, so row i's 16 floats are inside each block's K part and input i
        // inside each lane.
        let k: [__m512; B] =
            std::array::from_fn(|b| unsafe { _mm512_loadu_ps(kts[b].add(i * BLOCK_SIZE)) });
        for (a, lane) in acc.iter_mut().zip(&lanes) {
            let q = _mm512_set1_ps(unsafe { *lane.add(i) });
            for (a, k) in a.iter_mut().zip(&k) {
                *a = _mm512_fmadd_ps(q, *k, *a);
            }
        }
    }
    for (l, a) in acc.iter().enumerate() {
        for (b, a) in a.iter().enumerate() {
            // SAFETY: block b's lane from + l lies inside `scores` (asserted above).
            unsafe { _mm512_storeu_ps(scores[b * stride + from + l].as_mut_ptr(), *a) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores_avx512<const N: usize>(
    from: usize,
    kt: &[f32],
    qs: &[f32],
    d: usize,
    scores: &mut [[f32; BLOCK_SIZE]],
) {
    use std::arch::x86_64::*;
    debug_assert!(
        kt.len() >= d * BLOCK_SIZE && qs.len() >= (from + N) * d && scores.len() >= from + N
    );
    let mut acc = [_mm512_setzero_ps(); N];
    // One base pointer per lane, so the loop below indexes rather than recomputing
    // `(from + l)·d` for every lane and input (that arithmetic was a third of this loop).
    // SAFETY: lanes from..from + N hold d floats each (asserted above).
    let lanes: [*const f32; N] =
        std::array::from_fn(|l| unsafe { qs.as_ptr().add((from + l) * d) });
    for i in 0..d {
        // SAFETY: i < d, so row i's 16 floats are inside `kt` and input i inside each lane.
        let k = unsafe { _mm512_loadu_ps(kt.as_ptr().add(i * BLOCK_SIZE)) };
        for (a, lane) in acc.iter_mut().zip(&lanes) {
            let q = unsafe { *lane.add(i) };
            *a = _mm512_fmadd_ps(_mm512_set1_ps(q), k, *a);
        }
    }
    for (l, a) in acc.iter().enumerate() {
        // SAFETY: `scores[from + l]` holds 16 floats.
        unsafe { _mm512_storeu_ps(scores[from + l].as_mut_ptr(), *a) };
    }
}

/// `acc[l] += Σ_j probs[l][j] · vb[j]` for lanes `from..to`, all of which see the block's 16
/// keys. With AVX-512 each 16-float slice of a V row is loaded once and applied to up to six
/// lanes. Every element still sums over `j` in order with fused multiply-adds, as the
/// one-lane path does, so the grouping changes no bit.
#[inline(always)]
pub(super) unsafe fn accumulate_v(
    isa: Isa,
    vb: &[f32],
    probs: &[[f32; BLOCK_SIZE]],
    from: usize,
    to: usize,
    d: usize,
    acc: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && d.is_multiple_of(16) {
        // SAFETY: `vb` holds 16 rows of d, `probs` and `acc` hold `to` lanes.
        unsafe {
            if d.is_multiple_of(64) {
                in_lane_groups!(from, to, accumulate_avx512[4](vb, probs, d, acc))
            } else if d.is_multiple_of(32) {
                in_lane_groups!(from, to, accumulate_avx512[2](vb, probs, d, acc))
            } else {
                in_lane_groups!(from, to, accumulate_avx512[1](vb, probs, d, acc))
            }
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && d.is_multiple_of(16) {
        // SAFETY: as above.
        unsafe { in_lane_groups!(from, to, accumulate_avx2(vb, probs, d, acc)) };
        return;
    }
    let _ = isa;
    for l in from..to {
        let a = &mut acc[l * d..(l + 1) * d];
        for (j, &pj) in probs[l].iter().enumerate() {
            let vrow = &vb[j * d..(j + 1) * d];
            for (x, &vv) in a.iter_mut().zip(vrow) {
                *x = pj.mul_add(vv, *x);
            }
        }
    }
}

/// `N` lanes over `C` vectors of 16 columns at a time: up to 24 accumulators in flight
/// (each a chain of 16 multiply-adds, one per key), where one vector's three lanes left the
/// units waiting on each chain's latency.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn accumulate_avx512<const N: usize, const C: usize>(
    from: usize,
    vb: &[f32],
    probs: &[[f32; BLOCK_SIZE]],
    d: usize,
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(
        vb.len() >= BLOCK_SIZE * d
            && probs.len() >= from + N
            && acc.len() >= (from + N) * d
            && d.is_multiple_of(16 * C)
    );
    let p: [&[f32; BLOCK_SIZE]; N] = std::array::from_fn(|l| &probs[from + l]);
    for c0 in (0..d).step_by(16 * C) {
        let mut regs = [[_mm512_setzero_ps(); C]; N];
        for (l, r) in regs.iter_mut().enumerate() {
            for (c, r) in r.iter_mut().enumerate() {
                // SAFETY: lane from + l has d floats in `acc`; c0 + 16·(c + 1) <= d.
                *r = unsafe { _mm512_loadu_ps(acc.as_ptr().add((from + l) * d + c0 + 16 * c)) };
            }
        }
        for j in 0..BLOCK_SIZE {
            // SAFETY: columns c0..c0 + 16·C <= d of row j < 16.
            let v: [__m512; C] = std::array::from_fn(|c| unsafe {
                _mm512_loadu_ps(vb.as_ptr().add(j * d + c0 + 16 * c))
            });
            for (r, p) in regs.iter_mut().zip(&p) {
                let pj = _mm512_set1_ps(p[j]);
                for (r, v) in r.iter_mut().zip(&v) {
                    *r = _mm512_fmadd_ps(pj, *v, *r);
                }
            }
        }
        for (l, r) in regs.iter().enumerate() {
            for (c, r) in r.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add((from + l) * d + c0 + 16 * c), *r) };
            }
        }
    }
}

/// [`scores_avx512`] for AVX2: each lane's 16 scores are two 8-wide accumulators, so six
/// lanes use 12 of the 16 ymm registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2<const N: usize>(
    from: usize,
    kt: &[f32],
    qs: &[f32],
    d: usize,
    scores: &mut [[f32; BLOCK_SIZE]],
) {
    use std::arch::x86_64::*;
    debug_assert!(
        kt.len() >= d * BLOCK_SIZE && qs.len() >= (from + N) * d && scores.len() >= from + N
    );
    let mut acc = [[_mm256_setzero_ps(); 2]; N];
    for i in 0..d {
        // SAFETY: i < d, so row i's 16 floats are inside `kt`; lanes are below from + N.
        let k0 = unsafe { _mm256_loadu_ps(kt.as_ptr().add(i * BLOCK_SIZE)) };
        let k1 = unsafe { _mm256_loadu_ps(kt.as_ptr().add(i * BLOCK_SIZE + 8)) };
        for (l, a) in acc.iter_mut().enumerate() {
            let q = _mm256_set1_ps(unsafe { *qs.get_unchecked((from + l) * d + i) });
            a[0] = _mm256_fmadd_ps(q, k0, a[0]);
            a[1] = _mm256_fmadd_ps(q, k1, a[1]);
        }
    }
    for (l, a) in acc.iter().enumerate() {
        // SAFETY: `scores[from + l]` holds 16 floats.
        unsafe {
            _mm256_storeu_ps(scores[from + l].as_mut_ptr(), a[0]);
            _mm256_storeu_ps(scores[from + l].as_mut_ptr().add(8), a[1]);
        }
    }
}

/// [`accumulate_avx512`] for AVX2: 16 columns of up to six lanes as 12 ymm accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_avx2<const N: usize>(
    from: usize,
    vb: &[f32],
    probs: &[[f32; BLOCK_SIZE]],
    d: usize,
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(
        vb.len() >= BLOCK_SIZE * d && probs.len() >= from + N && acc.len() >= (from + N) * d
    );
    for c in (0..d).step_by(16) {
        let mut regs = [[_mm256_setzero_ps(); 2]; N];
        for (l, r) in regs.iter_mut().enumerate() {
            // SAFETY: lane from + l has d floats in `acc`; c + 16 <= d.
            let base = unsafe { acc.as_ptr().add((from + l) * d + c) };
            *r = unsafe { [_mm256_loadu_ps(base), _mm256_loadu_ps(base.add(8))] };
        }
        for (j, vrow) in vb.chunks_exact(d).take(BLOCK_SIZE).enumerate() {
            // SAFETY: columns c..c + 16 <= d of row j.
            let v0 = unsafe { _mm256_loadu_ps(vrow.as_ptr().add(c)) };
            let v1 = unsafe { _mm256_loadu_ps(vrow.as_ptr().add(c + 8)) };
            for (l, r) in regs.iter_mut().enumerate() {
                let p = _mm256_set1_ps(probs[from + l][j]);
                r[0] = _mm256_fmadd_ps(p, v0, r[0]);
                r[1] = _mm256_fmadd_ps(p, v1, r[1]);
            }
        }
        for (l, r) in regs.iter().enumerate() {
            // SAFETY: as for the loads.
            let base = unsafe { acc.as_mut_ptr().add((from + l) * d + c) };
            unsafe {
                _mm256_storeu_ps(base, r[0]);
                _mm256_storeu_ps(base.add(8), r[1]);
            }
        }
    }
}

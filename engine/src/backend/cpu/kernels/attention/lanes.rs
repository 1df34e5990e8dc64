//! AVX-512 attention for a task of many query rows (a prefill chunk), 16 (row, head) lanes
//! to a vector: the online softmax's per-block bookkeeping (the block's maximum, the
//! exponentials, their sum, the rescaling) becomes a few vector operations for 16 lanes, where
//! the per-lane path (`per_lane::task_body`) runs a chain of dependent steps for each lane
//! and block, which left the multiply-add units idle for most of a prefill's attention.
//!
//! Each lane's arithmetic is the per-lane path's: the same fused multiply-add chains over the
//! same operands in the same order (scores over the head's dimensions, P·V over the block's
//! keys), the same reduction trees over a block's 16 keys, the same exponentials, the same
//! rescaling only where the maximum moved, and keys outside a lane's range neither counted
//! nor multiplied. Only which lanes share a register differs, so the bits are the same: a row
//! computes what it would in a decode step, where a task has too few lanes for this path.
//!
//! Scores are computed transposed (a vector per key, its lanes the rows' queries), since K
//! is stored transposed in the cache (dimension `i` of a block's 16 keys together): each step
//! over `i` loads one vector of queries and multiplies it by 16 broadcast key values.
//!
//! AVX-512 only: a block's 16 keys × 16 lanes of scores, then of probabilities, are 16
//! vectors that stay in its 32 registers through the softmax and P·V. AVX2's 16 registers of
//! 8 lanes cannot hold them, and spilling them made its prefill slower than the per-lane path,
//! which it keeps.

use tandem_kv::BLOCK_SIZE;

use super::geometry::{AttnSeq, Geometry, PartialOut, RowState, TaskSpan, block_kv};

/// Lanes to a vector group.
const W: usize = 16;

/// Fewest lanes (rows × heads per KV head) a task needs to take this path; a decode step's
/// task has one row, so as many lanes as query heads share a KV head.
pub(super) const MIN_LANES: usize = 8;

type Lanes = [f32; W];

/// The state of up to 16 lanes.
struct Group {
    /// Each lane's query, pre-scaled, transposed: dimension `i` of the 16 lanes at `16·i`.
    qt: Vec<f32>,
    /// Each lane's running Σ p·V, transposed like `qt`.
    acct: Vec<f32>,
    state: [RowState; W],
    /// Position of each lane's row; `None` for the padding past a task's last lane (it
    /// computes on a zero query and is never written out).
    pos: [Option<usize>; W],
}

/// The key range `lo..hi` of the block each lane counts (empty for a lane that sees none),
/// both within `0..=16`.
struct Ranges {
    lo: [i32; W],
    hi: [i32; W],
}

impl Ranges {
    #[inline(always)]
    fn active(&self, l: usize) -> bool {
        self.lo[l] < self.hi[l]
    }
}

/// `per_lane::task_body` for a task of at least [`MIN_LANES`] lanes.
///
/// # Safety
/// The CPU runs AVX-512 (F) and this is compiled for it (inlined into the task's AVX-512
/// wrapper); as `task_body`: the sequence's block ids were checked against the cache, and
/// this task alone writes its rows' heads of its KV group.
#[inline(always)]
pub(super) unsafe fn task(
    g: &Geometry,
    q: &[f32],
    s: &AttnSeq<'_>,
    span: TaskSpan,
    part: PartialOut,
) {
    let TaskSpan {
        group,
        r0,
        rows,
        first_block,
        end_block,
    } = span;
    let (d, n_rep) = (g.d, g.n_rep);
    let lanes = rows * n_rep;
    let first_pos = s.start_pos + r0;
    let last_pos = first_pos + rows - 1;
    // Lane `L` of the task is row `L / n_rep`, head `L % n_rep` of the group.
    let mut groups: Vec<Group> = (0..lanes.div_ceil(W))
        .map(|k| {
            let mut qt = vec![0f32; d * W];
            let mut pos = [None; W];
            for (l, p) in pos.iter_mut().enumerate() {
                let lane = k * W + l;
                if lane >= lanes {
                    break;
                }
                let (r, h) = (lane / n_rep, lane % n_rep);
                *p = Some(first_pos + r);
                let at = (s.q_row + r0 + r) * g.width + (group * n_rep + h) * d;
                for (i, &v) in q[at..at + d].iter().enumerate() {
                    qt[i * W + l] = v * g.scale;
                }
            }
            Group {
                qt,
                acct: vec![0f32; d * W],
                state: [RowState::START; W],
                pos,
            }
        })
        .collect();
    let (k_off, v_off) = g.kv_offsets(group);
    let mut widened = vec![0f32; g.widening_len()];
    let from = (g.window_start(first_pos) / BLOCK_SIZE).max(first_block);
    for b in from..(last_pos / BLOCK_SIZE + 1).min(end_block) {
        let first_key = b * BLOCK_SIZE;
        let block = s.block_table[b] as usize * g.block_elems;
        // SAFETY: both parts lie inside the block (checked block id, layout sizes).
        let (kt, vb) = unsafe { block_kv(g, block + k_off, block + v_off, &mut widened) };
        for grp in &mut groups {
            // Padding counts every key (its results are never read), so that the blocks
            // every row sees whole take the unmasked path in a task's last group too.
            let mut ranges = Ranges {
                lo: [0; W],
                hi: [BLOCK_SIZE as i32; W],
            };
            for (l, pos) in grp.pos.iter().enumerate() {
                let Some(pos) = *pos else { continue };
                if pos < first_key {
                    ranges.hi[l] = 0;
                    continue;
                }
                let keys = |k: usize| k.min(BLOCK_SIZE) as i32;
                ranges.hi[l] = keys(pos - first_key + 1);
                ranges.lo[l] = keys(g.window_start(pos).saturating_sub(first_key));
            }
            if (0..W).any(|l| grp.pos[l].is_some() && ranges.active(l)) {
                step(grp, kt, vb, d, &ranges, g.softcap);
            }
        }
    }
    for (k, grp) in groups.iter().enumerate() {
        for (l, pos) in grp.pos.iter().enumerate() {
            if pos.is_none() {
                break;
            }
            let lane = k * W + l;
            // SAFETY: the part holds this task's lanes, and no other task writes them.
            unsafe {
                *part.states.add(lane) = grp.state[l];
                for i in 0..d {
                    *part.acc.add(lane * d + i) = grp.acct[i * W + l];
                }
            }
        }
    }
}

impl Group {
    /// [`RowState::advance`] for each active lane (the others keep their maximum): the new
    /// maxima, each lane's correction, and the corrections as factors (1 where none).
    #[inline(always)]
    fn advance(
        &self,
        block_max: &Lanes,
        active: impl Fn(usize) -> bool,
    ) -> (Lanes, [Option<f32>; W], Lanes) {
        let mut new_max = [0f32; W];
        let mut corrections = [None; W];
        for l in 0..W {
            new_max[l] = self.state[l].max;
            if active(l) {
                (new_max[l], corrections[l]) = self.state[l].advance(block_max[l]);
            }
        }
        let factors = corrections.map(|c| c.unwrap_or(1.0));
        (new_max, corrections, factors)
    }

    /// [`RowState::fold`] for each active lane.
    #[inline(always)]
    fn fold(
        &mut self,
        new_max: &Lanes,
        corrections: &[Option<f32>; W],
        psum: &Lanes,
        active: impl Fn(usize) -> bool,
    ) {
        for l in (0..W).filter(|&l| active(l)) {
            self.state[l].fold(new_max[l], corrections[l], psum[l]);
        }
    }
}

/// One block for one group: the parent's per-lane block step, for 16 lanes at once.
#[inline(always)]
fn step(grp: &mut Group, kt: &[f32], vb: &[f32], d: usize, ranges: &Ranges, softcap: Option<f32>) {
    // SAFETY: the CPU runs AVX-512 (`task`'s promise); `qt`, `acct` and `kt` hold d rows of
    // 16, `vb` 16 rows of d.
    unsafe { x86::block_avx512(grp, kt, vb, d, ranges, softcap) };
}

mod x86 {
    //! The vector work of a block step in AVX-512 registers: the same operations as the
    //! per-lane path, lane for lane.
    use std::arch::x86_64::*;

    use super::super::super::ops::{exp_poly_avx512, tanh_poly};
    use super::{BLOCK_SIZE, Group, Ranges, W};

    type Keys = [__m512; BLOCK_SIZE];

    /// The scores of 16 keys for 16 lanes, in registers.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `qt` and `kt` hold `d` rows of 16 floats.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn scores(qt: &[f32], kt: &[f32], d: usize) -> Keys {
        debug_assert!(qt.len() >= d * W && kt.len() >= d * BLOCK_SIZE);
        let mut acc = [_mm512_setzero_ps(); BLOCK_SIZE];
        for i in 0..d {
            // SAFETY: i < d: row i of each is inside.
            unsafe {
                let qv = _mm512_loadu_ps(qt.as_ptr().add(i * W));
                let k = kt.as_ptr().add(i * BLOCK_SIZE);
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(qv, _mm512_set1_ps(*k.add(j)), *a);
                }
            }
        }
        acc
    }

    /// `tree16` of the parent module over 16 vectors.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn tree(x: &Keys, op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
        let h: [__m512; 8] = std::array::from_fn(|j| op(x[j], x[j + 8]));
        let q: [__m512; 4] = std::array::from_fn(|j| op(h[j], h[j + 4]));
        op(op(q[0], q[2]), op(q[1], q[3]))
    }

    /// The block step for 16 lanes: scores, softmax and P·V without leaving the registers,
    /// except for the per-lane running maximum and sum, which take the per-lane path's code
    /// (`Group::advance`, `Group::fold`), and a soft cap, applied through the scalar
    /// polynomial the per-lane path uses. Keys outside a lane's range are masked: `−∞` for
    /// the maximum, 0 for the probability, and no multiply-add at all for P·V.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `grp.qt` and `grp.acct` hold `d` rows of 16, `kt` `d` rows of
    /// 16 and `vb` 16 rows of `d`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn block_avx512(
        grp: &mut Group,
        kt: &[f32],
        vb: &[f32],
        d: usize,
        ranges: &Ranges,
        softcap: Option<f32>,
    ) {
        debug_assert!(grp.acct.len() >= d * W && vb.len() >= BLOCK_SIZE * d);
        // SAFETY: the caller's promises.
        let mut s = unsafe { scores(&grp.qt, kt, d) };
        if let Some(cap) = softcap {
            for v in &mut s {
                let mut x = [0f32; W];
                // SAFETY (both): 16 floats.
                unsafe { _mm512_storeu_ps(x.as_mut_ptr(), *v) };
                for x in &mut x {
                    *x = cap * tanh_poly(*x / cap);
                }
                *v = unsafe { _mm512_loadu_ps(x.as_ptr()) };
            }
        }
        // SAFETY (these loads): 16 i32 each.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_si512(ranges.lo.as_ptr().cast()),
                _mm512_loadu_si512(ranges.hi.as_ptr().cast()),
            )
        };
        let masks: [__mmask16; BLOCK_SIZE] = std::array::from_fn(|j| {
            let j = _mm512_set1_epi32(j as i32);
            _mm512_cmple_epi32_mask(lo, j) & _mm512_cmplt_epi32_mask(j, hi)
        });
        let whole = masks.iter().all(|&m| m == 0xFFFF);
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let counted: Keys = std::array::from_fn(|j| _mm512_mask_blend_ps(masks[j], neg_inf, s[j]));
        let mut block_max = [0f32; W];
        // SAFETY (this store and the ones below): 16 floats.
        unsafe {
            _mm512_storeu_ps(
                block_max.as_mut_ptr(),
                tree(&counted, |a, b| _mm512_max_ps(a, b)),
            )
        };
        let active = |l: usize| ranges.active(l);
        let (new_max, corrections, factors) = grp.advance(&block_max, active);
        let nm = unsafe { _mm512_loadu_ps(new_max.as_ptr()) };
        let p: Keys = std::array::from_fn(|j| {
            _mm512_maskz_mov_ps(masks[j], exp_poly_avx512(_mm512_sub_ps(s[j], nm)))
        });
        let mut psum = [0f32; W];
        unsafe { _mm512_storeu_ps(psum.as_mut_ptr(), tree(&p, |a, b| _mm512_add_ps(a, b))) };
        grp.fold(&new_max, &corrections, &psum, active);
        let moved = corrections.iter().any(Option::is_some);
        let rescale = moved.then(|| unsafe { _mm512_loadu_ps(factors.as_ptr()) });
        // SAFETY: the caller's promises.
        unsafe {
            pv(
                &mut grp.acct,
                &p,
                vb,
                d,
                rescale,
                (!whole).then_some(&masks),
            )
        };
    }

    /// `acct[i] = acct[i]·rescale + Σ_j p[j]·vb[j][i]` for every dimension `i` (the sum over
    /// `j` in order; lanes outside `masks[j]` keep their value for key `j`).
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `acct` holds `d` rows of 16 floats, `vb` 16 rows of `d`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pv(
        acct: &mut [f32],
        p: &Keys,
        vb: &[f32],
        d: usize,
        rescale: Option<__m512>,
        masks: Option<&[__mmask16; BLOCK_SIZE]>,
    ) {
        debug_assert!(acct.len() >= d * W && vb.len() >= BLOCK_SIZE * d);
        let mut i = 0;
        // SAFETY (both loops): dimensions i..i + N are below d.
        while i + 4 <= d {
            unsafe { pv_dims::<4>(acct, p, vb, d, i, rescale, masks) };
            i += 4;
        }
        while i < d {
            unsafe { pv_dims::<1>(acct, p, vb, d, i, rescale, masks) };
            i += 1;
        }
    }

    /// [`pv`] for dimensions `i..i + N`, their accumulators in registers (each `p[j]` loaded
    /// once serves N of them).
    ///
    /// # Safety
    /// As [`pv`], and `i + N <= d`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pv_dims<const N: usize>(
        acct: &mut [f32],
        p: &Keys,
        vb: &[f32],
        d: usize,
        i: usize,
        rescale: Option<__m512>,
        masks: Option<&[__mmask16; BLOCK_SIZE]>,
    ) {
        // SAFETY: row i + t < d of `acct`.
        let mut a: [__m512; N] =
            std::array::from_fn(|t| unsafe { _mm512_loadu_ps(acct.as_ptr().add((i + t) * W)) });
        if let Some(r) = rescale {
            a = a.map(|a| _mm512_mul_ps(a, r));
        }
        for (j, &pj) in p.iter().enumerate() {
            // SAFETY: row j < 16 of `vb`, columns i..i + N <= d.
            let v = unsafe { vb.as_ptr().add(j * d + i) };
            for (t, a) in a.iter_mut().enumerate() {
                let vt = _mm512_set1_ps(unsafe { *v.add(t) });
                *a = match masks {
                    Some(m) => _mm512_mask3_fmadd_ps(pj, vt, *a, m[j]),
                    None => _mm512_fmadd_ps(pj, vt, *a),
                };
            }
        }
        for (t, a) in a.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(acct.as_mut_ptr().add((i + t) * W), *a) };
        }
    }
}

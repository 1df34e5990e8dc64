//! The per-lane path: one task's (row, head) lanes walk their sequence's blocks one lane at a
//! time through the online softmax, scores and P·V grouped across lanes where a whole block
//! is seen (`block_ops`). Decode steps take it on every instruction set, prefill chunks
//! everywhere but AVX-512, where a task of many lanes hands over to `lanes`. Each block's
//! online-softmax bookkeeping runs in phases over the task's lanes, in AVX2 registers on
//! x86-64 (`x86`), with the portable code's operations and so its bits.

use tandem_kv::BLOCK_SIZE;

use super::super::Isa;
use std::cell::Cell;

use super::block_ops::{accumulate_v, block_scores_run};
use super::geometry::{
    AttnSeq, Geometry, PartialOut, RowState, TaskSpan, block_kv, prefetch_block,
};
#[cfg(target_arch = "x86_64")]
use super::lanes;
use super::reuse::{keep, refill, take};

/// The kernel body, compiled once per instruction set through the wrappers above: the
/// task's lanes over the keys of its blocks, left in `part` (see [`PartialOut`]).
#[inline(always)]
pub(super) unsafe fn task_body(
    isa: Isa,
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
    let d = g.d;
    let n_rep = g.n_rep;
    let lanes = rows * n_rep;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && lanes >= lanes::MIN_LANES {
        // SAFETY: this body was compiled for AVX-512 (`task_avx512`, the only caller with
        // that set); the rest are the caller's promises, which are this function's.
        return unsafe { lanes::task(g, q, s, span, part) };
    }
    let mut scratch = take(&LANE_SCRATCH);
    let LaneScratch {
        states,
        acc,
        qs,
        scores,
        probs,
        keys,
        moves,
        psums,
        lane_pos,
        widened,
    } = &mut scratch;
    refill(states, lanes, RowState::START);
    refill(acc, lanes * d, 0.0);
    // Queries of this group's heads, pre-scaled by 1/√d.
    refill(qs, lanes * d, 0.0);
    for r in 0..rows {
        let row = s.q_row + r0 + r;
        for h in 0..n_rep {
            let head = group * n_rep + h;
            let src = &q[row * g.width + head * d..row * g.width + (head + 1) * d];
            for (dst, &v) in qs[(r * n_rep + h) * d..(r * n_rep + h + 1) * d]
                .iter_mut()
                .zip(src)
            {
                *dst = v * g.scale;
            }
        }
    }
    // Blocks to a run (see below). AVX-512 only: AVX2's 16 registers hold one block's
    // chains, and its runs of one block (the next prefetched while this one computes) were
    // faster than longer ones.
    let longest = if isa == Isa::Avx512 { RUN_BLOCKS } else { 1 };
    // The scores of a run: block `k`'s lanes from `k · lanes`.
    refill(scores, longest * lanes, [0f32; BLOCK_SIZE]);
    refill(probs, lanes, [0f32; BLOCK_SIZE]);
    // Per lane, for the block at hand: its keys `skip..valid`, its running maximum's move
    // (`RowState::advance`) and its `Σ p`.
    refill(keys, lanes, (0usize, 0usize));
    refill(moves, lanes, (0f32, None::<f32>));
    refill(psums, lanes, 0f32);
    let first_pos = s.start_pos + r0;
    // Each lane's position, once (a division per lane and block showed in profiles).
    lane_pos.clear();
    lane_pos.extend((0..lanes).map(|lane| first_pos + lane / n_rep));
    let last_pos = first_pos + rows - 1;
    let blocks = last_pos / BLOCK_SIZE + 1;
    let (k_off, v_off) = g.kv_offsets(group);
    let widen = g.widening_len();
    refill(widened, longest * widen, 0.0);
    // Rows `from..to` of this task as lanes (each row is `n_rep` lanes).
    let lanes_of = |from: usize, to: usize| (from.min(rows) * n_rep, to.min(rows) * n_rep);
    // Lanes (row, head) that see at least one key of block `b`: the causal mask drops rows
    // from the front of the task, the window rows from its back.
    let seeing = |b: usize| {
        let (first_key, last_key) = (b * BLOCK_SIZE, b * BLOCK_SIZE + BLOCK_SIZE - 1);
        lanes_of(
            first_key.saturating_sub(first_pos),
            g.window
                .map_or(rows, |w| (last_key + w).saturating_sub(first_pos)),
        )
    };
    // Blocks wholly before the first row's window hold no key any row here sees.
    let from = (g.window_start(first_pos) / BLOCK_SIZE).max(first_block);
    let end = blocks.min(end_block);
    let mut run_start = from;
    while run_start < end {
        let (first_lane, end_lane) = seeing(run_start);
        if first_lane >= end_lane {
            run_start += 1;
            continue;
        }
        // A run: the next blocks that the same lanes see (every block of a decode row's
        // span), whose scores are computed together so that their independent chains of
        // multiply-adds overlap (one block's few lanes left the multiply-add units waiting
        // on each chain's latency). Each score is the same chain as alone: no bit changes.
        let mut run = 1;
        while run < longest
            && run_start + run < end
            && seeing(run_start + run) == (first_lane, end_lane)
        {
            run += 1;
        }
        let mut kts: [&[f32]; RUN_BLOCKS] = [&[]; RUN_BLOCKS];
        let mut vbs: [&[f32]; RUN_BLOCKS] = [&[]; RUN_BLOCKS];
        // Each block's own widening buffer (none for an f32 cache).
        let bufs = widened
            .chunks_mut(widen.max(1))
            .chain(std::iter::repeat_with(|| &mut [][..]));
        for ((k, buf), (kt, vb)) in bufs
            .enumerate()
            .take(run)
            .zip(kts.iter_mut().zip(vbs.iter_mut()))
        {
            let block = s.block_table[run_start + k] as usize * g.block_elems;
            // SAFETY: both parts lie inside the block (checked block id, layout sizes).
            (*kt, *vb) = unsafe { block_kv(g, block + k_off, block + v_off, buf) };
        }
        // SAFETY: each `kts[k]` holds d rows of 16; `qs` holds `lanes` lanes and `scores`
        // `run` blocks of them.
        unsafe {
            block_scores_run(
                isa,
                &kts[..run],
                &qs[..],
                first_lane,
                end_lane,
                d,
                scores,
                lanes,
            )
        };
        for k in 0..run {
            let b = run_start + k;
            // The next run's blocks, one a block: in cache by the time its scores start.
            if b + run < blocks {
                prefetch_block(g, s.block_table[b + run], k_off, v_off);
            }
            let scores = &mut scores[k * lanes..(k + 1) * lanes];
            let vb = vbs[k];
            let first_key = b * BLOCK_SIZE;
            if let Some(cap) = g.softcap {
                for sc in &mut scores[first_lane..end_lane] {
                    softcap16(sc, cap);
                }
            }
            // The online softmax in phases over the lanes rather than lane after lane: each
            // lane's steps form one long dependent chain (maximum, exponentials, sum), and a
            // phase's lanes are independent, so their chains overlap in the core instead of
            // running one after another (a 2048-token prefill spent more of its attention
            // here than in the multiply-adds). Each lane's operations are the same, so are
            // the bits.
            for lane in first_lane..end_lane {
                let pos = lane_pos[lane];
                // This lane's keys in the block: slots `skip..valid`.
                let valid = (pos - first_key + 1).min(BLOCK_SIZE);
                let skip = g.window_start(pos).saturating_sub(first_key);
                let block_max = masked_max(isa, &scores[lane], skip, valid);
                keys[lane] = (skip, valid);
                moves[lane] = states[lane].advance(block_max);
            }
            for lane in first_lane..end_lane {
                let (skip, valid) = keys[lane];
                (probs[lane], psums[lane]) =
                    block_probs(isa, &scores[lane], skip, valid, moves[lane].0);
            }
            for lane in first_lane..end_lane {
                let (skip, valid) = keys[lane];
                let (new_max, correction) = moves[lane];
                let a = &mut acc[lane * d..(lane + 1) * d];
                if let Some(c) = correction {
                    for x in a.iter_mut() {
                        *x *= c;
                    }
                }
                states[lane].fold(new_max, correction, psums[lane]);
                let p = &probs[lane];
                if skip > 0 || valid < BLOCK_SIZE {
                    // The diagonal block, or the window's first: only slots `skip..valid`
                    // count (past `valid` the block may hold stale data, never to be
                    // multiplied, even by zero).
                    for (j, &pj) in p.iter().enumerate().take(valid).skip(skip) {
                        let vrow = &vb[j * d..(j + 1) * d];
                        for (x, &vv) in a.iter_mut().zip(vrow) {
                            *x = pj.mul_add(vv, *x);
                        }
                    }
                }
            }
            // Lanes that see the whole block (a suffix by causality, a prefix by the window)
            // accumulate P·V together (see `accumulate_v`).
            let (full_from, full_to) = lanes_of(
                (first_key + BLOCK_SIZE - 1).saturating_sub(first_pos),
                g.window
                    .map_or(rows, |w| (first_key + w).saturating_sub(first_pos)),
            );
            let (full_from, full_to) = (full_from.max(first_lane), full_to.min(end_lane));
            if full_from < full_to {
                unsafe { accumulate_v(isa, vb, &probs[..], full_from, full_to, d, acc) };
            }
        }
        run_start += run;
    }
    // SAFETY: the part holds this task's `lanes` lanes, and no other task writes them.
    unsafe {
        std::ptr::copy_nonoverlapping(states.as_ptr(), part.states, lanes);
        std::ptr::copy_nonoverlapping(acc.as_ptr(), part.acc, lanes * d);
    }
    keep(&LANE_SCRATCH, scratch);
}

/// Blocks whose scores one call computes together (see `block_scores_run`).
const RUN_BLOCKS: usize = 4;

/// A task's working buffers (see `reuse`).
#[derive(Default)]
struct LaneScratch {
    states: Vec<RowState>,
    acc: Vec<f32>,
    qs: Vec<f32>,
    scores: Vec<[f32; BLOCK_SIZE]>,
    probs: Vec<[f32; BLOCK_SIZE]>,
    keys: Vec<(usize, usize)>,
    moves: Vec<(f32, Option<f32>)>,
    psums: Vec<f32>,
    lane_pos: Vec<usize>,
    widened: Vec<f32>,
}

thread_local! {
    static LANE_SCRATCH: Cell<Option<LaneScratch>> = const { Cell::new(None) };
}

/// One lane's share of a block in the online softmax, first part: the maximum of the
/// block's scores `skip..valid` (which [`RowState::advance`] takes in).
///
/// Written as whole-block operations and fixed-shape reduction trees (here and in
/// [`block_probs`]) so it compiles to a handful of vector instructions on every instruction
/// set (a scalar pass over the 16 positions, with a 16-long chain of dependent additions,
/// was most of a prefill's attention time); the tree's order is the same on every path, so
/// the bits are too.
#[inline(always)]
fn masked_max(isa: Isa, scores: &[f32; BLOCK_SIZE], skip: usize, valid: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // SAFETY: both instruction sets include AVX2 and FMA, which the CPU runs (the
        // task's `isa` is one it supports).
        return unsafe { x86::masked_max(scores, skip, valid) };
    }
    let _ = isa;
    let mut masked = [f32::NEG_INFINITY; BLOCK_SIZE];
    for (j, (m, &sc)) in masked.iter_mut().zip(scores).enumerate() {
        if j >= skip && j < valid {
            *m = sc;
        }
    }
    // The maximum is exact whatever the order; the tree only shortens the chain. A plain
    // comparison rather than `f32::max`, whose NaN rules kept the tree scalar.
    tree16(&masked, |a, b| if a > b { a } else { b })
}

/// The second part: `p = exp(score - new_max)` (0 outside `skip..valid`) and `Σ p`.
#[inline(always)]
fn block_probs(
    isa: Isa,
    scores: &[f32; BLOCK_SIZE],
    skip: usize,
    valid: usize,
    new_max: f32,
) -> ([f32; BLOCK_SIZE], f32) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // SAFETY: as in `masked_max`.
        return unsafe { x86::block_probs(scores, skip, valid, new_max) };
    }
    let _ = isa;
    let mut p = [0f32; BLOCK_SIZE];
    for (pj, &sc) in p.iter_mut().zip(scores) {
        *pj = sc - new_max;
    }
    exp16(&mut p);
    for (j, pj) in p.iter_mut().enumerate() {
        if j < skip || j >= valid {
            *pj = 0.0;
        }
    }
    let psum = tree16(&p, |a, b| a + b);
    (p, psum)
}

/// `x[0..16]` folded by halves: `x[j] ∘ x[j + 8]`, then `+4`, `+2`, `+1`.
#[inline(always)]
fn tree16(x: &[f32; BLOCK_SIZE], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut h = [0f32; 8];
    for (j, v) in h.iter_mut().enumerate() {
        *v = op(x[j], x[j + 8]);
    }
    let q = [
        op(h[0], h[4]),
        op(h[1], h[5]),
        op(h[2], h[6]),
        op(h[3], h[7]),
    ];
    op(op(q[0], q[2]), op(q[1], q[3]))
}

/// `cap·tanh(x/cap)` for 16 lanes (Gemma 2's attention soft-capping).
#[inline(always)]
fn softcap16(x: &mut [f32; BLOCK_SIZE], cap: f32) {
    for v in x.iter_mut() {
        *v = cap * super::super::ops::tanh_poly(*v / cap);
    }
}

/// `e^x` for 16 lanes: Cephes' polynomial, written so the compiler vectorizes it
/// (relative error ~1e-7; inputs below -87 give ~0, which callers mask anyway).
#[inline(always)]
pub(super) fn exp16(x: &mut [f32; BLOCK_SIZE]) {
    for v in x.iter_mut() {
        *v = super::super::ops::exp_poly(*v);
    }
}

/// [`masked_max`] and [`block_probs`] in AVX2 registers, operation for operation: the
/// compiler's own vectorization of the portable code kept its reduction trees and
/// exponentials in scalar shuffles and memory, which made this bookkeeping cost more than
/// the block's multiply-adds in a long prefill.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::super::ops::exp_poly_avx2;
    use super::BLOCK_SIZE;

    /// Lanes `skip..valid` of the block's two halves (all ones where counted).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn counted(skip: usize, valid: usize) -> [__m256; 2] {
        // Key slots fit an i32: both bounds are at most 16.
        let (skip, valid) = (skip.min(BLOCK_SIZE) as i32, valid.min(BLOCK_SIZE) as i32);
        let (lo, hi) = (_mm256_set1_epi32(skip - 1), _mm256_set1_epi32(valid));
        std::array::from_fn(|half| {
            let j = _mm256_add_epi32(
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                _mm256_set1_epi32(8 * half as i32),
            );
            // skip <= j < valid
            _mm256_castsi256_ps(_mm256_and_si256(
                _mm256_cmpgt_epi32(j, lo),
                _mm256_cmpgt_epi32(hi, j),
            ))
        })
    }

    /// `tree16` over the two halves `x[0..8]`, `x[8..16]`: `x[j] ∘ x[j + 8]`, then `+4`,
    /// `+2`, `+1`, each step the first operand from the lower positions.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn tree(
        x: [__m256; 2],
        op8: impl Fn(__m256, __m256) -> __m256,
        op4: impl Fn(__m128, __m128) -> __m128,
    ) -> f32 {
        let h = op8(x[0], x[1]);
        let q = op4(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        // [q0 ∘ q2, q1 ∘ q3], then their own ∘.
        let pair = op4(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(op4(pair, _mm_movehdup_ps(pair)))
    }

    /// The block's two halves of scores.
    ///
    /// # Safety
    /// The CPU runs AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn halves(scores: &[f32; BLOCK_SIZE]) -> [__m256; 2] {
        // SAFETY: 16 floats, two loads of 8.
        unsafe {
            [
                _mm256_loadu_ps(scores.as_ptr()),
                _mm256_loadu_ps(scores.as_ptr().add(8)),
            ]
        }
    }

    /// `super::masked_max`.
    ///
    /// # Safety
    /// The CPU runs AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn masked_max(scores: &[f32; BLOCK_SIZE], skip: usize, valid: usize) -> f32 {
        // SAFETY: the caller's promise.
        let x = unsafe { halves(scores) };
        let keep = counted(skip, valid);
        let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
        let masked: [__m256; 2] = std::array::from_fn(|h| _mm256_blendv_ps(neg_inf, x[h], keep[h]));
        // `maxps(a, b)` is `a > b ? a : b` (b when either is NaN or both are zeros): the
        // portable comparison exactly.
        tree(masked, |a, b| _mm256_max_ps(a, b), |a, b| _mm_max_ps(a, b))
    }

    /// `super::block_probs`.
    ///
    /// # Safety
    /// The CPU runs AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block_probs(
        scores: &[f32; BLOCK_SIZE],
        skip: usize,
        valid: usize,
        new_max: f32,
    ) -> ([f32; BLOCK_SIZE], f32) {
        // SAFETY: the caller's promise.
        let x = unsafe { halves(scores) };
        let keep = counted(skip, valid);
        let m = _mm256_set1_ps(new_max);
        let p: [__m256; 2] =
            std::array::from_fn(|h| _mm256_and_ps(exp_poly_avx2(_mm256_sub_ps(x[h], m)), keep[h]));
        let mut out = [0f32; BLOCK_SIZE];
        // SAFETY: 16 floats, two stores of 8.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr(), p[0]);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), p[1]);
        }
        let psum = tree(p, |a, b| _mm256_add_ps(a, b), |a, b| _mm_add_ps(a, b));
        (out, psum)
    }
}

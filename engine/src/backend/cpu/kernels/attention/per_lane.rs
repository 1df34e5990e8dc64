//! The per-lane path: one task's (row, head) lanes walk their sequence's blocks one lane at a
//! time through the online softmax, scores and P·V grouped across lanes where a whole block
//! is seen (`block_ops`). Decode steps take it on every instruction set, prefill chunks
//! everywhere but AVX-512, where a task of many lanes hands over to `lanes`.

use tandem_kv::BLOCK_SIZE;

use super::super::Isa;
use super::block_ops::{accumulate_v, block_scores};
use super::geometry::{
    AttnSeq, Geometry, PartialOut, RowState, TaskSpan, block_kv, prefetch_block,
};
#[cfg(target_arch = "x86_64")]
use super::lanes;

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
    let mut states = vec![RowState::START; lanes];
    let mut acc = vec![0f32; lanes * d];
    // Queries of this group's heads, pre-scaled by 1/√d.
    let mut qs = vec![0f32; lanes * d];
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
    let mut scores = vec![[0f32; BLOCK_SIZE]; lanes];
    let mut probs = vec![[0f32; BLOCK_SIZE]; lanes];
    let first_pos = s.start_pos + r0;
    let last_pos = first_pos + rows - 1;
    let blocks = last_pos / BLOCK_SIZE + 1;
    let (k_off, v_off) = g.kv_offsets(group);
    let mut widened = g.widening_buffer();
    // Rows `from..to` of this task as lanes (each row is `n_rep` lanes).
    let lanes_of = |from: usize, to: usize| (from.min(rows) * n_rep, to.min(rows) * n_rep);
    // Blocks wholly before the first row's window hold no key any row here sees.
    let from = (g.window_start(first_pos) / BLOCK_SIZE).max(first_block);
    for b in from..blocks.min(end_block) {
        let first_key = b * BLOCK_SIZE;
        let last_key = first_key + BLOCK_SIZE - 1;
        // Lanes (row, head) that see at least one key of this block: the causal mask drops
        // rows from the front of the task, the window rows from its back.
        let (first_lane, end_lane) = lanes_of(
            first_key.saturating_sub(first_pos),
            g.window
                .map_or(rows, |w| (last_key + w).saturating_sub(first_pos)),
        );
        if first_lane >= end_lane {
            continue;
        }
        if b + 1 < blocks {
            prefetch_block(g, s.block_table[b + 1], k_off, v_off);
        }
        let block = s.block_table[b] as usize * g.block_elems;
        // SAFETY: both parts lie inside the block (checked block id, layout sizes).
        let (kt, vb) = unsafe { block_kv(g, block + k_off, block + v_off, &mut widened) };
        // SAFETY: `kt` holds d rows of 16; `qs` and `scores` hold `lanes` lanes.
        unsafe { block_scores(isa, kt, &qs, first_lane, end_lane, d, &mut scores) };
        if let Some(cap) = g.softcap {
            for sc in &mut scores[first_lane..end_lane] {
                softcap16(sc, cap);
            }
        }
        for lane in first_lane..end_lane {
            let pos = first_pos + lane / n_rep;
            // This lane's keys in the block: slots `skip..valid`.
            let valid = (pos - first_key + 1).min(BLOCK_SIZE);
            let skip = g.window_start(pos).saturating_sub(first_key);
            let st = &mut states[lane];
            let (new_max, correction, p, psum) = block_softmax(&scores[lane], skip, valid, st);
            let a = &mut acc[lane * d..(lane + 1) * d];
            if let Some(c) = correction {
                for x in a.iter_mut() {
                    *x *= c;
                }
            }
            st.fold(new_max, correction, psum);
            probs[lane] = p;
            if skip > 0 || valid < BLOCK_SIZE {
                // The diagonal block, or the window's first: only slots `skip..valid` count
                // (past `valid` the block may hold stale data, never to be multiplied, even
                // by zero).
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
            (last_key).saturating_sub(first_pos),
            g.window
                .map_or(rows, |w| (first_key + w).saturating_sub(first_pos)),
        );
        let (full_from, full_to) = (full_from.max(first_lane), full_to.min(end_lane));
        if full_from < full_to {
            unsafe { accumulate_v(isa, vb, &probs, full_from, full_to, d, &mut acc) };
        }
    }
    // SAFETY: the part holds this task's `lanes` lanes, and no other task writes them.
    unsafe {
        std::ptr::copy_nonoverlapping(states.as_ptr(), part.states, lanes);
        std::ptr::copy_nonoverlapping(acc.as_ptr(), part.acc, lanes * d);
    }
}

/// One lane's share of a block in the online softmax: the running maximum updated with the
/// block's scores `skip..valid` and the factor earlier sums shrink by
/// ([`RowState::advance`]), `p = exp(score - max)` (0 outside `skip..valid`) and `Σ p`.
///
/// Written as whole-block operations and fixed-shape reduction trees so it compiles to a
/// handful of vector instructions on every instruction set (a scalar pass over the 16
/// positions, with a 16-long chain of dependent additions, was most of a prefill's attention
/// time); the tree's order is the same on every path, so the bits are too.
#[inline(always)]
fn block_softmax(
    scores: &[f32; BLOCK_SIZE],
    skip: usize,
    valid: usize,
    state: &RowState,
) -> (f32, Option<f32>, [f32; BLOCK_SIZE], f32) {
    let mut masked = [f32::NEG_INFINITY; BLOCK_SIZE];
    for (j, (m, &sc)) in masked.iter_mut().zip(scores).enumerate() {
        if j >= skip && j < valid {
            *m = sc;
        }
    }
    // The maximum is exact whatever the order; the tree only shortens the chain. A plain
    // comparison rather than `f32::max`, whose NaN rules kept the tree scalar.
    let block_max = tree16(&masked, |a, b| if a > b { a } else { b });
    let (new_max, correction) = state.advance(block_max);
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
    (new_max, correction, p, tree16(&p, |a, b| a + b))
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

//! Key spans: every (row, head) attends over its keys in spans of [`SPAN_BLOCKS`] blocks,
//! each span through the online softmax from a fresh state, and folds the spans' results in
//! ascending order ([`fold`]) before dividing by the sum ([`write_out`]).
//!
//! Why spans: a decode step at batch 1 has as many attention tasks as KV heads (three for
//! SmolLM2), fewer than a machine has cores, so most cores waited while a few streamed the
//! whole cache. Cut at span boundaries, the same row's keys become several tasks whose
//! results fold afterwards (FlashDecoding's split). The boundaries are fixed positions, not a
//! function of the batch or the thread count, and the fold runs in the same order whether
//! the spans ran in parallel or in turn within one task: a row's bits do not depend on how
//! its work was divided (batch invariance, as before).

use super::super::{Isa, SharedMut};
use super::geometry::RowState;

/// Blocks of 16 keys to a span: 128 keys, short enough that a 500-token context gives a
/// two-core step a dozen tasks, long enough that the fold (a multiply-add per dimension per
/// span) stays far below the span's own work (two per dimension per key).
pub(super) const SPAN_BLOCKS: usize = 8;

/// Folds lane results of one span (`part`, `part_acc`) into the running ones of the spans
/// before it (`total`, `total_acc`): rescaled to the larger maximum and added. A span that
/// held no key of the lane changes nothing; the first that did is taken as it is.
///
/// Fused multiply-adds on every instruction set (`mul_add` rounds once everywhere), so the
/// bits do not depend on which one runs it.
#[inline(always)]
fn fold_lane(total: &mut RowState, total_acc: &mut [f32], part: &RowState, part_acc: &[f32]) {
    if part.sum == 0.0 {
        return;
    }
    if total.sum == 0.0 {
        *total = *part;
        total_acc.copy_from_slice(part_acc);
        return;
    }
    if part.max <= total.max {
        let c = (part.max - total.max).exp();
        for (t, &p) in total_acc.iter_mut().zip(part_acc) {
            *t = p.mul_add(c, *t);
        }
        total.sum = part.sum.mul_add(c, total.sum);
    } else {
        let c = (total.max - part.max).exp();
        for (t, &p) in total_acc.iter_mut().zip(part_acc) {
            *t = t.mul_add(c, p);
        }
        total.sum = total.sum.mul_add(c, part.sum);
        total.max = part.max;
    }
}

/// [`fold_lane`] for every lane (`d` values each).
#[inline(always)]
fn fold_body(
    total: &mut [RowState],
    total_acc: &mut [f32],
    part: &[RowState],
    part_acc: &[f32],
    d: usize,
) {
    let accs = total_acc.chunks_exact_mut(d).zip(part_acc.chunks_exact(d));
    for ((t, p), (ta, pa)) in total.iter_mut().zip(part).zip(accs) {
        fold_lane(t, ta, p, pa);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn fold_fma(
    total: &mut [RowState],
    total_acc: &mut [f32],
    part: &[RowState],
    part_acc: &[f32],
    d: usize,
) {
    fold_body(total, total_acc, part, part_acc, d)
}

/// Folds one span's lanes into the running lanes (see [`fold_lane`]).
pub(super) fn fold(
    isa: Isa,
    total: &mut [RowState],
    total_acc: &mut [f32],
    part: &[RowState],
    part_acc: &[f32],
    d: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        // SAFETY: both instruction sets imply FMA, and `isa` is one this CPU runs.
        return unsafe { fold_fma(total, total_acc, part, part_acc, d) };
    }
    let _ = isa;
    fold_body(total, total_acc, part, part_acc, d)
}

/// Where a unit's lanes go in the output: rows from `row0`, `n_rep` heads a row from head
/// `head0`, rows `width` floats apart.
pub(super) struct LaneDest {
    pub(super) row0: usize,
    pub(super) head0: usize,
    pub(super) n_rep: usize,
    pub(super) width: usize,
}

/// Writes each lane's Σ p·V divided by its Σ p.
///
/// # Safety
/// `out` holds every row and head the lanes map to, and no other task writes them.
pub(super) unsafe fn write_out(
    states: &[RowState],
    acc: &[f32],
    d: usize,
    dest: &LaneDest,
    out: SharedMut,
) {
    for (lane, (state, a)) in states.iter().zip(acc.chunks_exact(d)).enumerate() {
        let row = dest.row0 + lane / dest.n_rep;
        let head = dest.head0 + lane % dest.n_rep;
        let inv = 1.0 / state.sum;
        let at = row * dest.width + head * d;
        for (i, &v) in a.iter().enumerate() {
            // SAFETY: the caller's promise.
            unsafe { *out.0.add(at + i) = v * inv };
        }
    }
}

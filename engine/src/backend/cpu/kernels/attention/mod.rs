//! Paged attention on the CPU: each query row attends to its sequence's keys by walking the
//! block table, reading K and V where they lie in the cache (no gather into a contiguous
//! tensor), with an online softmax (Milakov & Gimelshein 2018, as in FlashAttention).
//!
//! One arithmetic serves prefill chunks and decode steps: a sequence contributes `q_len` query
//! rows starting at position `start_pos`. Every row's result depends only on its own query,
//! its position and the cache, in a fixed block order: the output is the same whether the row
//! ran in a batch of one or sixty-four, in one chunk or several. A task of many rows on
//! AVX-512 computes it 16 rows (and heads) to a vector (`lanes`); every other task one row and
//! head at a time (`task_body`); the two give the same bits, which the tests check.
//!
//! Keys are taken in spans of a fixed number of blocks whose results fold in order
//! (`spans`), so a decode step's few rows can spread over every thread without changing a
//! bit.
//!
//! The files: `geometry` (what a task reads), `per_lane` (the per-lane path), `block_ops` (its
//! lane-grouped scores and P·V), `lanes` (the AVX-512 path for many lanes), `spans` (the
//! key spans and their fold), `reuse` (working buffers kept per thread).

mod block_ops;
mod geometry;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod per_lane;
mod reuse;
mod spans;

use std::cell::Cell;

use tandem_kv::{BLOCK_SIZE, KvCache};

use super::{Isa, SharedMut, isa};
use geometry::{Geometry, PartialOut, RowState, TaskSpan};
use per_lane::task_body;
use reuse::{refill, with_reused};
use spans::{LaneDest, SPAN_BLOCKS, fold, write_out};

pub use geometry::{AttnParams, AttnSeq};

/// Query rows handled by one task: their states stay in L1 while K/V blocks stream past.
const ROWS_PER_TASK: usize = 16;

/// `out[row, head] = softmax(q·Kᵀ·scale) · V` over each sequence's own cached keys (causal,
/// and within the window if `params` sets one). `q` and `out` are `rows × (heads·head_dim)`.
pub fn paged_attention(
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    params: AttnParams,
    out: &mut [f32],
) {
    paged_attention_on(isa(), cache, layer, q, seqs, n_heads, params, out)
}

/// [`paged_attention`] on a given instruction set, one this CPU runs; every set gives the
/// same bits.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_on(
    isa: Isa,
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    params: AttnParams,
    out: &mut [f32],
) {
    attend(
        isa,
        cache,
        layer,
        q,
        seqs,
        n_heads,
        params,
        out,
        Split::WhenFewUnits,
    )
}

/// Whether units' key spans run as separate tasks: when there are too few units to keep
/// every thread busy (the tests also ask for never and always: the bits are the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    WhenFewUnits,
    #[cfg_attr(not(test), allow(dead_code))]
    Never,
    #[cfg_attr(not(test), allow(dead_code))]
    Always,
}

impl Split {
    fn applies(self, units: usize) -> bool {
        match self {
            Split::WhenFewUnits => units < 4 * super::team::threads(),
            Split::Never => false,
            Split::Always => true,
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn attend(
    isa: Isa,
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    seqs: &[AttnSeq<'_>],
    n_heads: usize,
    params: AttnParams,
    out: &mut [f32],
    split: Split,
) {
    assert!(
        isa.supported(),
        "attention: this CPU cannot run the {isa} kernels"
    );
    assert!(params.window != Some(0), "attention window of zero keys");
    let layout = cache.layout();
    assert_eq!(
        layout.block_size, BLOCK_SIZE,
        "kernels assume 16-slot blocks"
    );
    let kv_heads = layout.num_kv_heads;
    let d = layout.head_dim;
    let width = n_heads * d;
    let total_rows: usize = seqs.iter().map(|s| s.q_row + s.q_len).max().unwrap_or(0);
    assert!(q.len() >= total_rows * width && out.len() >= total_rows * width);
    for s in seqs {
        let needed = (s.start_pos + s.q_len).div_ceil(BLOCK_SIZE);
        assert!(
            s.block_table.len() >= needed,
            "block table shorter than the sequence"
        );
        // Blocks before the window's start are never read (and may have been freed).
        let first_read = params
            .window
            .map_or(0, |w| (s.start_pos + 1).saturating_sub(w) / BLOCK_SIZE);
        assert!(
            s.block_table[first_read.min(s.block_table.len())..]
                .iter()
                .all(|&b| (b as usize) < cache.num_blocks())
        );
    }
    let geom = Geometry {
        layer_base: cache.layer_bytes_ptr(layer),
        dtype: layout.dtype,
        block_elems: layout.block_layer_elems(),
        kv_heads,
        n_rep: n_heads / kv_heads,
        d,
        width,
        scale: params.scale,
        softcap: params.softcap,
        window: params.window,
    };
    run_units(isa, &geom, q, seqs, SharedMut(out.as_mut_ptr()), split);
}

/// One sequence's rows `r0..r0 + rows` for the heads of KV group `group`, over key spans
/// `first_span..end_span`; `split`: one task per span, the spans' results kept from
/// `scratch` on (else one task runs them in turn).
struct Unit {
    seq: usize,
    group: usize,
    r0: usize,
    rows: usize,
    first_span: usize,
    end_span: usize,
    /// The blocks its rows read: `first_block..end_block`, inside its spans.
    first_block: usize,
    end_block: usize,
    split: bool,
    scratch: usize,
}

impl Unit {
    fn lanes(&self, g: &Geometry) -> usize {
        self.rows * g.n_rep
    }

    fn span(&self, c: usize) -> TaskSpan {
        TaskSpan {
            group: self.group,
            r0: self.r0,
            rows: self.rows,
            first_block: c * SPAN_BLOCKS,
            end_block: (c + 1) * SPAN_BLOCKS,
        }
    }

    fn dest(&self, g: &Geometry, s: &AttnSeq<'_>) -> LaneDest {
        LaneDest {
            row0: s.q_row + self.r0,
            head0: self.group * g.n_rep,
            n_rep: g.n_rep,
            width: g.width,
        }
    }
}

/// Most floats of partial results a unit may keep to run its spans as separate tasks.
const SPLIT_SCRATCH: usize = 1 << 16;

/// Floats of one lane's part of a split span: `d` accumulators and a [`RowState`].
const fn part_floats(d: usize) -> usize {
    d + size_of::<RowState>() / size_of::<f32>()
}

/// Cuts the work into units, splits the units' spans into tasks when there are too few
/// units to keep every thread busy, runs them, and folds the split units' spans.
fn run_units(
    isa: Isa,
    g: &Geometry,
    q: &[f32],
    seqs: &[AttnSeq<'_>],
    out: SharedMut,
    split: Split,
) {
    with_reused(&UNIT_SCRATCH, |scratch| {
        run_units_in(isa, g, q, seqs, out, split, scratch)
    })
}

/// The caller's buffers of [`run_units`] (see `reuse`).
#[derive(Default)]
struct UnitScratch {
    units: Vec<Unit>,
    tasks: Vec<(usize, Option<usize>)>,
    /// The split spans' parts.
    parts: Vec<f32>,
    total: Vec<RowState>,
    total_acc: Vec<f32>,
}

/// A task's buffers of [`run_whole`] (see `reuse`).
#[derive(Default)]
struct WholeScratch {
    part_states: Vec<RowState>,
    part_acc: Vec<f32>,
    total: Vec<RowState>,
    total_acc: Vec<f32>,
}

thread_local! {
    static UNIT_SCRATCH: Cell<Option<UnitScratch>> = const { Cell::new(None) };
    static WHOLE_SCRATCH: Cell<Option<WholeScratch>> = const { Cell::new(None) };
}

fn run_units_in(
    isa: Isa,
    g: &Geometry,
    q: &[f32],
    seqs: &[AttnSeq<'_>],
    out: SharedMut,
    split: Split,
    scratch: &mut UnitScratch,
) {
    let UnitScratch {
        units,
        tasks,
        parts,
        total,
        total_acc,
    } = scratch;
    units.clear();
    for (si, s) in seqs.iter().enumerate() {
        for group in 0..g.kv_heads {
            for r0 in (0..s.q_len).step_by(ROWS_PER_TASK) {
                let rows = (s.q_len - r0).min(ROWS_PER_TASK);
                let first_pos = s.start_pos + r0;
                let first_block = g.window_start(first_pos) / BLOCK_SIZE;
                let end_block = (first_pos + rows - 1) / BLOCK_SIZE + 1;
                units.push(Unit {
                    seq: si,
                    group,
                    r0,
                    rows,
                    first_span: first_block / SPAN_BLOCKS,
                    end_span: end_block.div_ceil(SPAN_BLOCKS),
                    first_block,
                    end_block,
                    split: false,
                    scratch: 0,
                });
            }
        }
    }
    // Which units split changes no bit (see `spans`), only how the work spreads.
    let mut scratch_len = 0;
    if split.applies(units.len()) {
        for u in units.iter_mut() {
            let size = (u.end_span - u.first_span) * u.lanes(g) * part_floats(g.d);
            if u.end_span - u.first_span > 1 && size <= SPLIT_SCRATCH {
                u.split = true;
                u.scratch = scratch_len;
                scratch_len += size;
            }
        }
    }
    tasks.clear();
    for (i, u) in units.iter().enumerate() {
        if u.split {
            tasks.extend((u.first_span..u.end_span).map(|c| (i, Some(c))));
        } else {
            tasks.push((i, None));
        }
    }
    // Longest first (a split unit's last span may hold a single block), so that the
    // short ones fill the gaps at the end: the order changes no bit.
    let blocks_of = |&(i, span): &(usize, Option<usize>)| {
        let u: &Unit = &units[i];
        match span {
            Some(c) => {
                ((c + 1) * SPAN_BLOCKS).min(u.end_block) - (c * SPAN_BLOCKS).max(u.first_block)
            }
            None => u.end_block - u.first_block,
        }
    };
    tasks.sort_by_key(|t| std::cmp::Reverse(blocks_of(t)));
    // Each split span's part: its lanes' accumulators, then their states. Every task
    // writes its whole part before the fold reads it, so stale values never count.
    if parts.len() < scratch_len {
        parts.resize(scratch_len, 0.0);
    }
    let scratch_ptr = SharedMut(parts.as_mut_ptr());
    let part_of = |u: &Unit, c: usize| {
        // The whole wrapper, not its pointer field, is what the closure may share.
        let base = &scratch_ptr;
        let lanes = u.lanes(g);
        let at = u.scratch + (c - u.first_span) * lanes * part_floats(g.d);
        // SAFETY: inside the unit's share of `parts`, `spans · lanes · (d + 2)` floats:
        // each span's accumulators, then its states (a `RowState` is two f32s, aligned as
        // one).
        unsafe {
            PartialOut {
                acc: base.0.add(at),
                states: base.0.add(at + lanes * g.d).cast::<RowState>(),
            }
        }
    };
    let (units, tasks) = (&*units, &*tasks);
    super::team::parallel_for(tasks.len(), &|t| {
        let (i, span) = tasks[t];
        let u = &units[i];
        let s = &seqs[u.seq];
        match span {
            // SAFETY: block ids were checked against the cache; the part is this span's.
            Some(c) => unsafe { run_task(isa, g, q, s, u.span(c), part_of(u, c)) },
            // SAFETY: as above; the unit's rows and heads are written by this task alone.
            None => unsafe { run_whole(isa, g, q, s, u, out) },
        }
    });
    let fold_unit = |u: &Unit, total: &mut Vec<RowState>, total_acc: &mut Vec<f32>| {
        let lanes = u.lanes(g);
        refill(total, lanes, RowState::START);
        refill(total_acc, lanes * g.d, 0.0);
        for c in u.first_span..u.end_span {
            let part = part_of(u, c);
            // SAFETY: the span's task has finished writing its part.
            let (states, acc) = unsafe {
                (
                    std::slice::from_raw_parts(part.states, lanes),
                    std::slice::from_raw_parts(part.acc, lanes * g.d),
                )
            };
            fold(isa, total, total_acc, states, acc, g.d);
        }
        // SAFETY: the unit's rows and heads are written by this task alone.
        unsafe { write_out(total, total_acc, g.d, &u.dest(g, &seqs[u.seq]), out) };
    };
    // A fold is a multiply-add per float of each span's part: a decode step's few (three
    // units of 2-4 spans at batch 1) cost less than handing them to the team.
    let split_units = || units.iter().filter(|u| u.split);
    let fold_floats: usize = split_units()
        .map(|u| (u.end_span - u.first_span) * u.lanes(g) * g.d)
        .sum();
    if fold_floats <= FOLD_INLINE_FLOATS {
        split_units().for_each(|u| fold_unit(u, total, total_acc));
    } else {
        let split: Vec<&Unit> = split_units().collect();
        super::team::parallel_for(split.len(), &|i| {
            let (mut total, mut total_acc) = (Vec::new(), Vec::new());
            fold_unit(split[i], &mut total, &mut total_acc)
        });
    }
}

/// Floats of split spans' parts up to which one thread folds them all.
const FOLD_INLINE_FLOATS: usize = 1 << 14;

/// A unit's spans in turn within one task, folded as they come.
///
/// # Safety
/// As [`run_task`]'s; the unit's rows and heads of `out` are this task's alone.
unsafe fn run_whole(isa: Isa, g: &Geometry, q: &[f32], s: &AttnSeq<'_>, u: &Unit, out: SharedMut) {
    with_reused(&WHOLE_SCRATCH, |scratch| {
        let WholeScratch {
            part_states,
            part_acc,
            total,
            total_acc,
        } = scratch;
        let lanes = u.lanes(g);
        refill(part_states, lanes, RowState::START);
        refill(part_acc, lanes * g.d, 0.0);
        refill(total, lanes, RowState::START);
        refill(total_acc, lanes * g.d, 0.0);
        let part = PartialOut {
            acc: part_acc.as_mut_ptr(),
            states: part_states.as_mut_ptr(),
        };
        for c in u.first_span..u.end_span {
            // SAFETY: the caller's promises; the part holds the unit's lanes.
            unsafe { run_task(isa, g, q, s, u.span(c), part) };
            fold(isa, total, total_acc, part_states, part_acc, g.d);
        }
        // SAFETY: the caller's promise.
        unsafe { write_out(total, total_acc, g.d, &u.dest(g, s), out) };
    })
}

/// Defines `$name`, [`task_body`] compiled with the target features `$features`, so that the
/// body's vector code (inlined helpers included) uses that instruction set.
#[cfg(target_arch = "x86_64")]
macro_rules! task_for_isa {
    ($name:ident, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $name(
            isa: Isa,
            g: &Geometry,
            q: &[f32],
            s: &AttnSeq<'_>,
            span: TaskSpan,
            part: PartialOut,
        ) {
            // SAFETY: the caller's promises, which are `task_body`'s.
            unsafe { task_body(isa, g, q, s, span, part) }
        }
    };
}

#[cfg(target_arch = "x86_64")]
task_for_isa!(task_avx512, "avx512f,avx512bw,avx512vl,fma");
#[cfg(target_arch = "x86_64")]
task_for_isa!(task_avx2, "avx2,fma");

/// Runs one task with the kernel body compiled for `isa`: the one place the attention kernels
/// choose by instruction set (the body's helpers test `isa` where they differ).
unsafe fn run_task(
    isa: Isa,
    g: &Geometry,
    q: &[f32],
    s: &AttnSeq<'_>,
    span: TaskSpan,
    part: PartialOut,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { task_avx512(isa, g, q, s, span, part) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { task_avx2(isa, g, q, s, span, part) },
        _ => unsafe { task_body(isa, g, q, s, span, part) },
    }
}

#[cfg(test)]
mod tests;

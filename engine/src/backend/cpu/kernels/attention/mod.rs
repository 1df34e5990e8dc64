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
//! The files: `geometry` (what a task reads), `per_lane` (the per-lane path), `block_ops` (its
//! lane-grouped scores and P·V), `lanes` (the AVX-512 path for many lanes).

mod block_ops;
mod geometry;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod per_lane;

use tandem_kv::{BLOCK_SIZE, KvCache};

use super::{Isa, SharedMut, isa};
use geometry::{Geometry, TaskSpan};
use per_lane::task_body;

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
    let mut tasks = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for g in 0..kv_heads {
            for r0 in (0..s.q_len).step_by(ROWS_PER_TASK) {
                tasks.push((si, g, r0));
            }
        }
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
    let out_ptr = SharedMut(out.as_mut_ptr());
    let run = |&(si, g, r0): &(usize, usize, usize)| {
        let s = &seqs[si];
        let rows = (s.q_len - r0).min(ROWS_PER_TASK);
        // SAFETY: block ids were checked against the cache above; each task writes only the
        // rows [r0, r0 + rows) of its sequence and the heads of its KV group.
        unsafe { run_task(isa, &geom, q, s, TaskSpan { group: g, r0, rows }, out_ptr) }
    };
    super::team::parallel_for(tasks.len(), &|i| run(&tasks[i]));
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
            out: SharedMut,
        ) {
            // SAFETY: the caller's promises, which are `task_body`'s.
            unsafe { task_body(isa, g, q, s, span, out) }
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
    out: SharedMut,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { task_avx512(isa, g, q, s, span, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { task_avx2(isa, g, q, s, span, out) },
        _ => unsafe { task_body(isa, g, q, s, span, out) },
    }
}

#[cfg(test)]
mod tests;

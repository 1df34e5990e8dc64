//! What every attention task reads: a sequence's query rows ([`AttnSeq`]) and the layer's
//! options ([`AttnParams`]), where a layer's blocks lie and how they are laid out
//! (`Geometry`), a task's share of the work (`TaskSpan`) and where it leaves its results
//! (`PartialOut`), one (row, head)'s online-softmax state (`RowState`), and reading (or
//! prefetching) a block's K and V. A leaf that both paths,
//! the per-lane one and `lanes`, build on.

use tandem_kv::{BLOCK_SIZE, KvDtype};

/// The query rows of one sequence in a batch.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// First row of this sequence in `q` and `out`.
    pub q_row: usize,
    /// Number of query rows (1 for a decode step).
    pub q_len: usize,
    /// Position of the first query row; keys `0..start_pos + q_len` are in the cache.
    pub start_pos: usize,
    /// Physical block of each logical block of the sequence.
    pub block_table: &'a [u32],
}

/// What a layer's attention does besides `softmax(q·Kᵀ)·V` over every earlier key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParams {
    /// Scores are `q·k · scale` (`1/√head_dim` unless the model says otherwise).
    pub scale: f32,
    /// Scores become `cap·tanh(score/cap)` before the softmax (Gemma 2).
    pub softcap: Option<f32>,
    /// Each position sees only the last `window` keys, its own included.
    pub window: Option<usize>,
}

impl AttnParams {
    /// Plain causal attention over heads of `head_dim`.
    pub fn causal(head_dim: usize) -> Self {
        Self {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
        }
    }
}

pub(super) struct Geometry {
    pub(super) layer_base: *const u8,
    pub(super) dtype: KvDtype,
    pub(super) block_elems: usize,
    pub(super) kv_heads: usize,
    pub(super) n_rep: usize,
    pub(super) d: usize,
    pub(super) width: usize,
    pub(super) scale: f32,
    pub(super) softcap: Option<f32>,
    pub(super) window: Option<usize>,
}
// SAFETY: the cache outlives the call; tasks only read through `layer_base`.
unsafe impl Sync for Geometry {}

/// One task's share: query rows `r0..r0 + rows` of a sequence, heads of KV group `group`,
/// over the keys of blocks `first_block..end_block` (one key span, `spans`).
#[derive(Debug, Clone, Copy)]
pub(super) struct TaskSpan {
    pub(super) group: usize,
    pub(super) r0: usize,
    pub(super) rows: usize,
    pub(super) first_block: usize,
    pub(super) end_block: usize,
}

/// Where a task leaves its lanes' results over its key span, not yet divided by the sum:
/// lane `l`'s state at `states[l]`, its Σ p·V at `acc[l·d..(l + 1)·d]` (lane `l` is row
/// `l / n_rep`, head `l % n_rep` of the group).
#[derive(Debug, Clone, Copy)]
pub(super) struct PartialOut {
    pub(super) acc: *mut f32,
    pub(super) states: *mut RowState,
}
// SAFETY: each task writes only its own lanes' part, which no other task touches until the
// parallel region ends.
unsafe impl Send for PartialOut {}
unsafe impl Sync for PartialOut {}

/// Online-softmax state of one (row, head). Both paths (`task_body` and `lanes`) advance it
/// through these two functions, so they cannot drift apart.
/// `repr(C)`: split spans keep their states in a buffer of f32s (`spans`).
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C)]
pub(super) struct RowState {
    pub(super) max: f32,
    pub(super) sum: f32,
}

impl RowState {
    pub(super) const START: RowState = RowState {
        max: f32::NEG_INFINITY,
        sum: 0.0,
    };

    /// The running maximum once a block whose maximum is `block_max` is in, and the factor
    /// the row's earlier sums shrink by if it moved (`None` where it did not: nothing is
    /// multiplied then, and since `x·1 = x` that changes no bit).
    #[inline(always)]
    pub(super) fn advance(&self, block_max: f32) -> (f32, Option<f32>) {
        let new_max = self.max.max(block_max);
        (
            new_max,
            (new_max != self.max).then(|| (self.max - new_max).exp()),
        )
    }

    /// Takes the block in: the sum shrinks by `correction`, then adds the block's `Σ p`.
    #[inline(always)]
    pub(super) fn fold(&mut self, new_max: f32, correction: Option<f32>, psum: f32) {
        if let Some(c) = correction {
            self.sum *= c;
        }
        self.sum += psum;
        self.max = new_max;
    }
}

impl Geometry {
    /// The first key position `pos` sees: keys `pos - window < k ≤ pos`.
    #[inline(always)]
    pub(super) fn window_start(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// Where KV group `group`'s K part (`d` rows of 16) and V part (16 rows of `d`) start in
    /// a block, in elements.
    #[inline(always)]
    pub(super) fn kv_offsets(&self, group: usize) -> (usize, usize) {
        let (d, b) = (self.d, BLOCK_SIZE);
        (group * d * b, self.kv_heads * d * b + group * b * d)
    }

    /// Floats of the buffer [`block_kv`] widens a half-precision cache's block into (exactly:
    /// every bf16 and f16 value is an f32, so the arithmetic is the f32 cache's): a block's K
    /// and V parts; none for f32.
    pub(super) fn widening_len(&self) -> usize {
        match self.dtype {
            KvDtype::F32 => 0,
            KvDtype::Bf16 | KvDtype::F16 => 2 * self.d * BLOCK_SIZE,
        }
    }
}

/// Asks for the K and V parts (elements `k_off` and `v_off` on, `d·16` each) of block `id` to
/// be brought into cache while the block before it is computed. A decode step's attention
/// streams its sequence's whole cache, whose blocks lie wherever the pool put them, and the
/// hardware prefetchers, which follow addresses in order, miss every jump from one block to
/// the next: at a 1500-token context that left the step's attention at about half the
/// memory bandwidth. Into L2, not L1 (`prefetcht2`): a block's two parts are 128 lines at
/// once (f32, d = 64), more than L1 has fill buffers, and asking L1 for them stalled the
/// loads of the block at hand (on Zen 4, batch-1 steps 11-13 % and batch-8 steps 21 %
/// faster than with `prefetcht0`; `prefetcht1` in between).
#[inline(always)]
pub(super) fn prefetch_block(g: &Geometry, id: u32, k_off: usize, v_off: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T2, _mm_prefetch};
        let size = g.dtype.size_in_bytes();
        let block = g
            .layer_base
            .wrapping_add(id as usize * g.block_elems * size);
        for part in [k_off, v_off] {
            let at = block.wrapping_add(part * size);
            for line in (0..g.d * BLOCK_SIZE * size).step_by(64) {
                // SAFETY: a prefetch is a hint and never faults, whatever the address.
                unsafe { _mm_prefetch::<_MM_HINT_T2>(at.wrapping_add(line).cast()) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (g, id, k_off, v_off);
}

/// The K part (`d` rows of 16) and V part (16 rows of `d`) of one block for one KV group,
/// starting at elements `k_at` and `v_at` of the layer: the cache itself when it is f32,
/// else widened into `buf` (`2·d·16` floats).
///
/// # Safety
/// Both parts lie inside the layer's blocks.
#[inline(always)]
pub(super) unsafe fn block_kv<'a>(
    g: &Geometry,
    k_at: usize,
    v_at: usize,
    buf: &'a mut [f32],
) -> (&'a [f32], &'a [f32]) {
    use half::slice::HalfFloatSliceExt;
    let n = g.d * BLOCK_SIZE;
    // SAFETY (each arm): the caller's bounds, in elements of the cache's dtype; the storage
    // is page-aligned, so every element is aligned.
    unsafe {
        match g.dtype {
            KvDtype::F32 => {
                let base = g.layer_base.cast::<f32>();
                (
                    std::slice::from_raw_parts(base.add(k_at), n),
                    std::slice::from_raw_parts(base.add(v_at), n),
                )
            }
            KvDtype::Bf16 => {
                let base = g.layer_base.cast::<half::bf16>();
                let (kb, vb) = buf.split_at_mut(n);
                std::slice::from_raw_parts(base.add(k_at), n).convert_to_f32_slice(kb);
                std::slice::from_raw_parts(base.add(v_at), n).convert_to_f32_slice(vb);
                (kb, vb)
            }
            KvDtype::F16 => {
                let base = g.layer_base.cast::<half::f16>();
                let (kb, vb) = buf.split_at_mut(n);
                std::slice::from_raw_parts(base.add(k_at), n).convert_to_f32_slice(kb);
                std::slice::from_raw_parts(base.add(v_at), n).convert_to_f32_slice(vb);
                (kb, vb)
            }
        }
    }
}

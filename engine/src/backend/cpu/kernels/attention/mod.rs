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

#[cfg(target_arch = "x86_64")]
mod lanes;

use super::{Isa, SharedMut, isa};
use tandem_kv::{BLOCK_SIZE, KvCache, KvDtype};

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

struct Geometry {
    layer_base: *const u8,
    dtype: KvDtype,
    block_elems: usize,
    kv_heads: usize,
    n_rep: usize,
    d: usize,
    width: usize,
    scale: f32,
    softcap: Option<f32>,
    window: Option<usize>,
}
// SAFETY: the cache outlives the call; tasks only read through `layer_base`.
unsafe impl Sync for Geometry {}

#[allow(clippy::too_many_arguments)]
/// One task's share: query rows `r0..r0 + rows` of a sequence, heads of KV group `group`.
#[derive(Debug, Clone, Copy)]
struct TaskSpan {
    group: usize,
    r0: usize,
    rows: usize,
}

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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn task_avx512(
    isa: Isa,
    g: &Geometry,
    q: &[f32],
    s: &AttnSeq<'_>,
    span: TaskSpan,
    out: SharedMut,
) {
    unsafe { task_body(isa, g, q, s, span, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2(
    isa: Isa,
    g: &Geometry,
    q: &[f32],
    s: &AttnSeq<'_>,
    span: TaskSpan,
    out: SharedMut,
) {
    unsafe { task_body(isa, g, q, s, span, out) }
}

/// Online-softmax state of one (row, head). Both paths (`task_body` and `lanes`) advance it
/// through these two functions, so they cannot drift apart.
#[derive(Debug, Clone, Copy)]
struct RowState {
    max: f32,
    sum: f32,
}

impl RowState {
    const START: RowState = RowState {
        max: f32::NEG_INFINITY,
        sum: 0.0,
    };

    /// The running maximum once a block whose maximum is `block_max` is in, and the factor
    /// the row's earlier sums shrink by if it moved (`None` where it did not: nothing is
    /// multiplied then, and since `x·1 = x` that changes no bit).
    #[inline(always)]
    fn advance(&self, block_max: f32) -> (f32, Option<f32>) {
        let new_max = self.max.max(block_max);
        (
            new_max,
            (new_max != self.max).then(|| (self.max - new_max).exp()),
        )
    }

    /// Takes the block in: the sum shrinks by `correction`, then adds the block's `Σ p`.
    #[inline(always)]
    fn fold(&mut self, new_max: f32, correction: Option<f32>, psum: f32) {
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
    fn window_start(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// Where KV group `group`'s K part (`d` rows of 16) and V part (16 rows of `d`) start in
    /// a block, in elements.
    #[inline(always)]
    fn kv_offsets(&self, group: usize) -> (usize, usize) {
        let (d, b) = (self.d, BLOCK_SIZE);
        (group * d * b, self.kv_heads * d * b + group * b * d)
    }

    /// The buffer [`block_kv`] widens a half-precision cache's blocks into (exactly: every
    /// bf16 and f16 value is an f32), so the arithmetic is the f32 cache's; empty for f32.
    fn widening_buffer(&self) -> Vec<f32> {
        match self.dtype {
            KvDtype::F32 => Vec::new(),
            KvDtype::Bf16 | KvDtype::F16 => vec![0f32; 2 * self.d * BLOCK_SIZE],
        }
    }
}

/// The kernel body, compiled once per instruction set through the wrappers above.
#[inline(always)]
unsafe fn task_body(
    isa: Isa,
    g: &Geometry,
    q: &[f32],
    s: &AttnSeq<'_>,
    span: TaskSpan,
    out: SharedMut,
) {
    let TaskSpan { group, r0, rows } = span;
    let d = g.d;
    let n_rep = g.n_rep;
    let lanes = rows * n_rep;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && lanes >= lanes::MIN_LANES {
        // SAFETY: this body was compiled for AVX-512 (`task_avx512`, the only caller with
        // that set); the rest are the caller's promises, which are this function's.
        return unsafe { lanes::task(g, q, s, span, out) };
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
    for b in g.window_start(first_pos) / BLOCK_SIZE..blocks {
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
    for r in 0..rows {
        let row = s.q_row + r0 + r;
        for h in 0..n_rep {
            let lane = r * n_rep + h;
            let head = group * n_rep + h;
            let inv = 1.0 / states[lane].sum;
            for i in 0..d {
                // SAFETY: (row, head) belongs to this task alone.
                unsafe { *out.0.add(row * g.width + head * d + i) = acc[lane * d + i] * inv };
            }
        }
    }
}

/// Asks for the K and V parts (elements `k_off` and `v_off` on, `d·16` each) of block `id` to
/// be brought into cache while the block before it is computed. A decode step's attention
/// streams its sequence's whole cache, whose blocks lie wherever the pool put them, and the
/// hardware prefetchers, which follow addresses in order, miss every jump from one block to
/// the next: at a 1500-token context that left the step's attention at about half the
/// memory bandwidth.
#[inline(always)]
fn prefetch_block(g: &Geometry, id: u32, k_off: usize, v_off: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let size = g.dtype.size_in_bytes();
        let block = g
            .layer_base
            .wrapping_add(id as usize * g.block_elems * size);
        for part in [k_off, v_off] {
            let at = block.wrapping_add(part * size);
            for line in (0..g.d * BLOCK_SIZE * size).step_by(64) {
                // SAFETY: a prefetch is a hint and never faults, whatever the address.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line).cast()) };
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
unsafe fn block_kv<'a>(
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

/// `scores[l] = Σ_i qs[l][i] · kt[i][0..16]` for lanes `from..to` of one block (K is stored
/// transposed: `kt[i]` holds dimension `i` of the block's 16 keys).
///
/// With AVX-512 up to six lanes run at once in registers, so the FMA units are not waiting on
/// one 64-long dependency chain. Every lane's sum runs over `i` in order with fused
/// multiply-adds on every path, so a lane's scores do not depend on which lanes share its
/// group nor on the instruction set: batch invariance holds.
#[inline(always)]
unsafe fn block_scores(
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
        let mut l = from;
        while l < to {
            let n = (to - l).min(6);
            // SAFETY: the caller's slices hold `to` lanes of `d` floats and `d` rows of 16.
            unsafe {
                match n {
                    6 => scores_avx512::<6>(kt, qs, l, d, scores),
                    5 => scores_avx512::<5>(kt, qs, l, d, scores),
                    4 => scores_avx512::<4>(kt, qs, l, d, scores),
                    3 => scores_avx512::<3>(kt, qs, l, d, scores),
                    2 => scores_avx512::<2>(kt, qs, l, d, scores),
                    _ => scores_avx512::<1>(kt, qs, l, d, scores),
                }
            }
            l += n;
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        let mut l = from;
        while l < to {
            let n = (to - l).min(6);
            // SAFETY: as above.
            unsafe {
                match n {
                    6 => scores_avx2::<6>(kt, qs, l, d, scores),
                    5 => scores_avx2::<5>(kt, qs, l, d, scores),
                    4 => scores_avx2::<4>(kt, qs, l, d, scores),
                    3 => scores_avx2::<3>(kt, qs, l, d, scores),
                    2 => scores_avx2::<2>(kt, qs, l, d, scores),
                    _ => scores_avx2::<1>(kt, qs, l, d, scores),
                }
            }
            l += n;
        }
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scores_avx512<const N: usize>(
    kt: &[f32],
    qs: &[f32],
    from: usize,
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
unsafe fn accumulate_v(
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
        let mut l = from;
        while l < to {
            let n = (to - l).min(6);
            // SAFETY: `vb` holds 16 rows of d, `probs` and `acc` hold `to` lanes.
            unsafe {
                match n {
                    6 => accumulate_avx512::<6>(vb, probs, l, d, acc),
                    5 => accumulate_avx512::<5>(vb, probs, l, d, acc),
                    4 => accumulate_avx512::<4>(vb, probs, l, d, acc),
                    3 => accumulate_avx512::<3>(vb, probs, l, d, acc),
                    2 => accumulate_avx512::<2>(vb, probs, l, d, acc),
                    _ => accumulate_avx512::<1>(vb, probs, l, d, acc),
                }
            }
            l += n;
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && d.is_multiple_of(16) {
        let mut l = from;
        while l < to {
            let n = (to - l).min(6);
            // SAFETY: as above.
            unsafe {
                match n {
                    6 => accumulate_avx2::<6>(vb, probs, l, d, acc),
                    5 => accumulate_avx2::<5>(vb, probs, l, d, acc),
                    4 => accumulate_avx2::<4>(vb, probs, l, d, acc),
                    3 => accumulate_avx2::<3>(vb, probs, l, d, acc),
                    2 => accumulate_avx2::<2>(vb, probs, l, d, acc),
                    _ => accumulate_avx2::<1>(vb, probs, l, d, acc),
                }
            }
            l += n;
        }
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn accumulate_avx512<const N: usize>(
    vb: &[f32],
    probs: &[[f32; BLOCK_SIZE]],
    from: usize,
    d: usize,
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(
        vb.len() >= BLOCK_SIZE * d && probs.len() >= from + N && acc.len() >= (from + N) * d
    );
    for c in (0..d).step_by(16) {
        let mut regs = [_mm512_setzero_ps(); N];
        for (l, r) in regs.iter_mut().enumerate() {
            // SAFETY: lane from + l has d floats in `acc`; c + 16 <= d.
            *r = unsafe { _mm512_loadu_ps(acc.as_ptr().add((from + l) * d + c)) };
        }
        for (j, vrow) in vb.chunks_exact(d).take(BLOCK_SIZE).enumerate() {
            // SAFETY: columns c..c + 16 <= d of row j.
            let v = unsafe { _mm512_loadu_ps(vrow.as_ptr().add(c)) };
            for (l, r) in regs.iter_mut().enumerate() {
                *r = _mm512_fmadd_ps(_mm512_set1_ps(probs[from + l][j]), v, *r);
            }
        }
        for (l, r) in regs.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(acc.as_mut_ptr().add((from + l) * d + c), *r) };
        }
    }
}

/// [`scores_avx512`] for AVX2: each lane's 16 scores are two 8-wide accumulators, so six
/// lanes use 12 of the 16 ymm registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2<const N: usize>(
    kt: &[f32],
    qs: &[f32],
    from: usize,
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
    vb: &[f32],
    probs: &[[f32; BLOCK_SIZE]],
    from: usize,
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
        *v = cap * super::ops::tanh_poly(*v / cap);
    }
}

/// `e^x` for 16 lanes: Cephes' polynomial, written so the compiler vectorizes it
/// (relative error ~1e-7; inputs below -87 give ~0, which callers mask anyway).
#[inline(always)]
fn exp16(x: &mut [f32; BLOCK_SIZE]) {
    for v in x.iter_mut() {
        *v = super::ops::exp_poly(*v);
    }
}

#[cfg(test)]
mod tests;

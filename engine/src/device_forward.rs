//! The GPU forward pass as a sequence of kernel launches and GEMMs, generic over the device
//! that runs them ([`LaunchDevice`]): the CUDA device (`gpu::CudaDevice`, feature `cuda`)
//! in production, and in tests an emulated device that runs the same CUDA kernels on the CPU
//! (`engine/tests/gpu_forward_on_cpu.rs`). So the whole pass (batch layout, buffer sizes,
//! argument order, launch shapes, the GEMM mapping) is checked against the CPU engine on
//! every machine, not only where a GPU is lent.
//!
//! Layouts: activations are row-major `rows × width`; the residual stream and everything
//! kernels combine are f32, GEMM inputs bf16; the KV cache is bf16
//! `[layer][block][K|V][kv_head][slot][head_dim]`, 16 slots per block.

use half::bf16;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kernels::{Matrix, RopeTable};
use crate::kv::BLOCK_SIZE;
use crate::model::{Model, SeqInput};

/// Grid and block size of one launch (1-D).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub blocks: u32,
    pub threads: u32,
}

impl Launch {
    /// Enough blocks of `threads` for `n` threads (at least one block).
    pub fn covering(n: usize, threads: u32) -> Self {
        Self {
            blocks: (n as u32).div_ceil(threads).max(1),
            threads,
        }
    }

    /// One block per row.
    pub fn per_row(rows: usize, threads: u32) -> Self {
        Self {
            blocks: rows.max(1) as u32,
            threads,
        }
    }
}

/// What the forward pass needs from a device: buffers, the kernels of `gpu/kernels.cu` (one
/// method each, arguments in the kernel's order and types), and `out = x · Wᵀ` GEMMs.
#[allow(clippy::too_many_arguments)]
pub trait LaunchDevice {
    type F32;
    type Bf16;
    type I32;
    type U32;

    fn upload_f32(&self, host: &[f32]) -> Result<Self::F32>;
    fn upload_bf16(&self, host: &[bf16]) -> Result<Self::Bf16>;
    fn upload_i32(&self, host: &[i32]) -> Result<Self::I32>;
    fn upload_u32(&self, host: &[u32]) -> Result<Self::U32>;
    fn zeros_f32(&self, n: usize) -> Result<Self::F32>;
    fn zeros_bf16(&self, n: usize) -> Result<Self::Bf16>;
    /// Waits for queued work, then copies `buf` to the host.
    fn download_f32(&self, buf: &Self::F32) -> Result<Vec<f32>>;
    fn synchronize(&self) -> Result<()>;

    fn embed_rows(
        &self,
        at: Launch,
        table: &Self::Bf16,
        tokens: &Self::U32,
        out: &mut Self::F32,
        rows: i32,
        hidden: i32,
    ) -> Result<()>;
    fn rms_norm_bf16(
        &self,
        at: Launch,
        x: &Self::F32,
        weight: &Self::F32,
        out: &mut Self::Bf16,
        rows: i32,
        hidden: i32,
        eps: f32,
    ) -> Result<()>;
    fn rope_qk(
        &self,
        at: Launch,
        qkv: &mut Self::F32,
        positions: &Self::I32,
        inv_freq: &Self::F32,
        rows: i32,
        row_width: i32,
        q_heads: i32,
        kv_heads: i32,
        head_dim: i32,
    ) -> Result<()>;
    fn kv_write(
        &self,
        at: Launch,
        qkv: &Self::F32,
        batch: &BatchBuffers<Self>,
        cache: &mut Self::Bf16,
        layer_offset: i64,
        shape: &AttnShape,
    ) -> Result<()>;
    fn paged_attention(
        &self,
        at: Launch,
        qkv: &Self::F32,
        batch: &BatchBuffers<Self>,
        cache: &Self::Bf16,
        layer_offset: i64,
        out: &mut Self::Bf16,
        shape: &AttnShape,
    ) -> Result<()>;
    fn silu_mul_bf16(
        &self,
        at: Launch,
        gate_up: &Self::F32,
        out: &mut Self::Bf16,
        rows: i32,
        f: i32,
    ) -> Result<()>;
    fn add_in_place(&self, at: Launch, x: &mut Self::F32, y: &Self::F32, n: i64) -> Result<()>;
    fn gather_rows(
        &self,
        at: Launch,
        x: &Self::F32,
        rows_idx: &Self::I32,
        out: &mut Self::F32,
        count: i32,
        width: i32,
    ) -> Result<()>;
    /// `out[rows × n] (f32) = x[rows × k] (bf16) · Wᵀ`, `W` row-major `n × k`
    /// ([`crate::blas_layout::linear_call`] on cuBLAS).
    fn gemm(
        &self,
        x: &Self::Bf16,
        w: &Self::Bf16,
        out: &mut Self::F32,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()>;
}

/// The per-token description of a batch, on the device (the KV write and attention read it).
pub struct BatchBuffers<D: LaunchDevice + ?Sized> {
    pub positions: D::I32,
    pub token_seq: D::I32,
    /// `sequences × max_blocks` physical block ids, zero-padded.
    pub tables: D::I32,
    pub max_blocks: i32,
}

/// The attention geometry the KV write and attention kernels take.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub rows: i32,
    pub row_width: i32,
    pub q_width: i32,
    pub q_heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
}

/// One transformer block's weights on a device.
pub struct DeviceLayer<D: LaunchDevice> {
    pub attn_norm: D::F32,
    pub qkv: D::Bf16,
    pub o: D::Bf16,
    pub ffn_norm: D::F32,
    pub gate_up: D::Bf16,
    pub down: D::Bf16,
}

/// A model's weights on a device: bf16 matrices (row-major, output features by input
/// features), f32 norms and RoPE frequencies.
pub struct DeviceWeights<D: LaunchDevice> {
    pub embed: D::Bf16,
    pub lm_head: Option<D::Bf16>,
    pub final_norm: D::F32,
    pub layers: Vec<DeviceLayer<D>>,
    pub inv_freq: D::F32,
}

fn upload_matrix<D: LaunchDevice>(dev: &D, m: &Matrix) -> Result<D::Bf16> {
    let values: Vec<bf16> = (0..m.rows)
        .flat_map(|r| (0..m.cols).map(move |c| bf16::from_f32(m.get(r, c))))
        .collect();
    dev.upload_bf16(&values)
}

impl<D: LaunchDevice> DeviceWeights<D> {
    /// Copies a loaded model's weights to `dev`, matrices rounded to bf16.
    pub fn upload(dev: &D, model: &Model) -> Result<Self> {
        let w = model.weights();
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            layers.push(DeviceLayer {
                attn_norm: dev.upload_f32(&l.attn_norm)?,
                qkv: upload_matrix(dev, &l.qkv)?,
                o: upload_matrix(dev, &l.o)?,
                ffn_norm: dev.upload_f32(&l.ffn_norm)?,
                gate_up: upload_matrix(dev, &l.gate_up)?,
                down: upload_matrix(dev, &l.down)?,
            });
        }
        Ok(Self {
            embed: upload_matrix(dev, &w.embed)?,
            lm_head: w
                .lm_head
                .as_ref()
                .map(|m| upload_matrix(dev, m))
                .transpose()?,
            final_norm: dev.upload_f32(&w.final_norm)?,
            inv_freq: dev.upload_f32(RopeTable::new(model.config()).inv_freq())?,
            layers,
        })
    }
}

/// Elements of one block of one layer (K and V) in the device cache.
pub fn block_layer_elems(cfg: &ModelConfig) -> usize {
    2 * cfg.num_key_value_heads * BLOCK_SIZE * cfg.head_dim
}

/// The host-side description of a batch: every token row with its position and sequence,
/// the zero-padded block tables, and the rows whose logits are wanted.
struct HostBatch {
    tokens: Vec<u32>,
    positions: Vec<i32>,
    token_seq: Vec<i32>,
    tables: Vec<i32>,
    max_blocks: usize,
    wanted: Vec<i32>,
}

fn describe_batch(
    cfg: &ModelConfig,
    cache_blocks: usize,
    seqs: &[SeqInput<'_>],
) -> Result<HostBatch> {
    let max_blocks = seqs
        .iter()
        .map(|s| s.block_table.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let mut b = HostBatch {
        tokens: Vec::new(),
        positions: Vec::new(),
        token_seq: Vec::new(),
        tables: vec![0i32; seqs.len() * max_blocks],
        max_blocks,
        wanted: Vec::new(),
    };
    for (si, s) in seqs.iter().enumerate() {
        let end = s.start_pos + s.tokens.len();
        if s.tokens.is_empty()
            || end > cfg.max_position_embeddings
            || s.block_table.len() * BLOCK_SIZE < end
        {
            return Err(EngineError::InvalidKv(
                "batch entry does not fit its block table or the context".into(),
            ));
        }
        if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(EngineError::UnknownToken {
                id: bad,
                vocab: cfg.vocab_size,
            });
        }
        if s.block_table.iter().any(|&b| b as usize >= cache_blocks) {
            return Err(EngineError::InvalidKv(
                "block id outside the GPU cache".into(),
            ));
        }
        for (j, &block) in s.block_table.iter().enumerate() {
            b.tables[si * max_blocks + j] = block as i32;
        }
        for (i, &t) in s.tokens.iter().enumerate() {
            b.tokens.push(t);
            b.positions.push((s.start_pos + i) as i32);
            b.token_seq.push(si as i32);
        }
        if s.logits {
            b.wanted.push((b.tokens.len() - 1) as i32);
        }
    }
    Ok(b)
}

/// Runs one batch (same contract as [`Model::forward`]): K/V of every token into `cache`
/// (`cache_blocks` blocks per layer), last-token logits of every sequence that asked.
pub fn forward<D: LaunchDevice>(
    dev: &D,
    cfg: &ModelConfig,
    w: &DeviceWeights<D>,
    cache: &mut D::Bf16,
    cache_blocks: usize,
    seqs: &[SeqInput<'_>],
) -> Result<Vec<Vec<f32>>> {
    let (h, d) = (cfg.hidden_size, cfg.head_dim);
    let (qw, kw) = (cfg.q_width(), cfg.kv_width());
    let qkv_w = qw + 2 * kw;
    let f = cfg.intermediate_size;
    if d > 256 {
        // The attention kernel keeps head_dim / 32 values per lane in 8 registers.
        return Err(EngineError::Unsupported(format!(
            "head_dim {d} > 256 on the GPU"
        )));
    }
    let host = describe_batch(cfg, cache_blocks, seqs)?;
    let t = host.tokens.len();
    let tokens = dev.upload_u32(&host.tokens)?;
    let batch = BatchBuffers::<D> {
        positions: dev.upload_i32(&host.positions)?,
        token_seq: dev.upload_i32(&host.token_seq)?,
        tables: dev.upload_i32(&host.tables)?,
        max_blocks: host.max_blocks as i32,
    };
    let mut x = dev.zeros_f32(t * h)?;
    let mut normed = dev.zeros_bf16(t * h)?;
    let mut qkv = dev.zeros_f32(t * qkv_w)?;
    let mut attn = dev.zeros_bf16(t * qw)?;
    let mut proj = dev.zeros_f32(t * h)?;
    let mut gate_up = dev.zeros_f32(t * 2 * f)?;
    let mut act = dev.zeros_bf16(t * f)?;
    let (rows, hidden, eps) = (t as i32, h as i32, cfg.rms_norm_eps as f32);
    let shape = AttnShape {
        rows,
        row_width: qkv_w as i32,
        q_width: qw as i32,
        q_heads: cfg.num_attention_heads as i32,
        kv_heads: cfg.num_key_value_heads as i32,
        head_dim: d as i32,
        scale: 1.0 / (d as f32).sqrt(),
    };
    // Grid-stride kernels are capped at 2^22 threads: enough to fill any GPU.
    let elementwise = |n: usize| Launch::covering(n.min(1 << 22), 256);
    dev.embed_rows(
        Launch::per_row(t, 256),
        &w.embed,
        &tokens,
        &mut x,
        rows,
        hidden,
    )?;
    let layer_elems = cache_blocks * block_layer_elems(cfg);
    for (l, layer) in w.layers.iter().enumerate() {
        let layer_offset = (l * layer_elems) as i64;
        let norm_at = Launch::per_row(t, 256);
        dev.rms_norm_bf16(
            norm_at,
            &x,
            &layer.attn_norm,
            &mut normed,
            rows,
            hidden,
            eps,
        )?;
        dev.gemm(&normed, &layer.qkv, &mut qkv, t, qkv_w, h)?;
        dev.rope_qk(
            Launch::per_row(t, 128),
            &mut qkv,
            &batch.positions,
            &w.inv_freq,
            rows,
            shape.row_width,
            shape.q_heads,
            shape.kv_heads,
            shape.head_dim,
        )?;
        dev.kv_write(
            Launch::per_row(t, 128),
            &qkv,
            &batch,
            cache,
            layer_offset,
            &shape,
        )?;
        // One warp per (token, query head).
        let attn_at = Launch::covering(t * cfg.num_attention_heads * 32, 128);
        dev.paged_attention(
            attn_at,
            &qkv,
            &batch,
            cache,
            layer_offset,
            &mut attn,
            &shape,
        )?;
        dev.gemm(&attn, &layer.o, &mut proj, t, h, qw)?;
        dev.add_in_place(elementwise(t * h), &mut x, &proj, (t * h) as i64)?;
        dev.rms_norm_bf16(norm_at, &x, &layer.ffn_norm, &mut normed, rows, hidden, eps)?;
        dev.gemm(&normed, &layer.gate_up, &mut gate_up, t, 2 * f, h)?;
        dev.silu_mul_bf16(elementwise(t * f), &gate_up, &mut act, rows, f as i32)?;
        dev.gemm(&act, &layer.down, &mut proj, t, h, f)?;
        dev.add_in_place(elementwise(t * h), &mut x, &proj, (t * h) as i64)?;
    }
    if host.wanted.is_empty() {
        dev.synchronize()?;
        return Ok(Vec::new());
    }
    let s = host.wanted.len();
    let wanted = dev.upload_i32(&host.wanted)?;
    let mut last = dev.zeros_f32(s * h)?;
    let mut last_normed = dev.zeros_bf16(s * h)?;
    let count = s as i32;
    dev.gather_rows(
        Launch::per_row(s, 256),
        &x,
        &wanted,
        &mut last,
        count,
        hidden,
    )?;
    dev.rms_norm_bf16(
        Launch::per_row(s, 256),
        &last,
        &w.final_norm,
        &mut last_normed,
        count,
        hidden,
        eps,
    )?;
    let vocab = cfg.vocab_size;
    let mut logits = dev.zeros_f32(s * vocab)?;
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    dev.gemm(&last_normed, head, &mut logits, s, vocab, h)?;
    let host_logits = dev.download_f32(&logits)?;
    Ok(host_logits
        .chunks_exact(vocab)
        .map(<[f32]>::to_vec)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_shapes_cover_their_work() {
        assert_eq!(Launch::covering(0, 256).blocks, 1);
        assert_eq!(Launch::covering(257, 256).blocks, 2);
        assert_eq!(Launch::per_row(0, 128).blocks, 1);
        assert_eq!(Launch::per_row(5, 128).blocks, 5);
    }
}

//! The GPU forward pass as a sequence of kernel launches and GEMMs, generic over the device
//! that runs them ([`LaunchDevice`]): the CUDA device (`gpu::CudaDevice`, feature `cuda`)
//! in production, and in tests an emulated device that runs the same CUDA kernels on the CPU
//! (`engine/tests/gpu_forward_on_cpu.rs`). So the whole pass (batch layout, buffer sizes,
//! argument lists, launch shapes, the GEMM mapping) is checked against the CPU engine on
//! every machine, not only where a GPU is lent.
//!
//! Layouts: activations are row-major `rows × width`; the residual stream and everything
//! kernels combine are f32, GEMM inputs bf16; the KV cache is bf16
//! `[layer][block][K|V][kv_head][slot][head_dim]`, 16 slots per block.
//!
//! The activations live in [`StepBuffers`], kept across steps and grown only when a batch has
//! more rows than any before; each layer ends with a hook, so the caller can move that
//! layer's KV while the device computes the next one.

use half::bf16;

use tandem_kv::BLOCK_SIZE;

use super::attention::{self, Plan, StepInputs};
use super::launch::{Kernel, KernelArg, Launch, LaunchDevice, Scratch};
use crate::backend::Logits;
use crate::backend::cpu::kernels::{Matrix, RopeTable};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::model::{Model, SeqInput};

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

/// The activation buffers of a forward pass (see the module docs).
pub struct StepBuffers<D: LaunchDevice> {
    rows: usize,
    allocations: usize,
    act: Option<Activations<D>>,
    partials: Scratch<D>,
    logits: Scratch<D>,
    /// The host buffer the next pass's logits come down into (handed back after sampling).
    host_logits: Vec<f32>,
}

struct Activations<D: LaunchDevice> {
    x: D::F32,
    normed: D::Bf16,
    qkv: D::F32,
    attn: D::Bf16,
    gate_up: D::F32,
    act: D::Bf16,
    last: D::F32,
    last_normed: D::Bf16,
}

impl<D: LaunchDevice> Default for StepBuffers<D> {
    fn default() -> Self {
        Self {
            rows: 0,
            allocations: 0,
            act: None,
            partials: Scratch::default(),
            logits: Scratch::default(),
            host_logits: Vec::new(),
        }
    }
}

impl<D: LaunchDevice> StepBuffers<D> {
    /// Token rows the buffers hold now.
    pub fn capacity(&self) -> usize {
        self.rows
    }

    /// Takes back a pass's logits buffer (see [`Logits`]), to fill next pass (the larger of
    /// it and the one kept: a pass without logits hands back an empty one).
    pub fn recycle_logits(&mut self, logits: Logits) {
        let buffer = logits.into_buffer();
        if buffer.capacity() > self.host_logits.capacity() {
            self.host_logits = buffer;
        }
    }

    /// How many times the buffers were (re)allocated.
    pub fn allocations(&self) -> usize {
        self.allocations
    }

    /// Buffers for at least `rows` rows: the current ones, or new ones of the next power of
    /// two. Kernels write every row they are given before anything reads it, so reused
    /// buffers need no clearing.
    fn ensure(&mut self, dev: &D, cfg: &ModelConfig, rows: usize) -> Result<StepParts<'_, D>> {
        if self.act.is_none() || rows > self.rows {
            let n = rows.next_power_of_two().max(16);
            let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
            let qkv_w = cfg.q_width() + 2 * cfg.kv_width();
            self.act = Some(Activations {
                x: dev.zeros_f32(n * h)?,
                normed: dev.zeros_bf16(n * h)?,
                qkv: dev.zeros_f32(n * qkv_w)?,
                attn: dev.zeros_bf16(n * cfg.q_width())?,
                gate_up: dev.zeros_f32(n * 2 * f)?,
                act: dev.zeros_bf16(n * f)?,
                last: dev.zeros_f32(n * h)?,
                last_normed: dev.zeros_bf16(n * h)?,
            });
            self.rows = n;
            self.allocations += 1;
        }
        let act = self
            .act
            .as_mut()
            .ok_or_else(|| EngineError::Unsupported("step buffers missing".into()))?;
        Ok((
            act,
            &mut self.partials,
            &mut self.logits,
            &mut self.host_logits,
        ))
    }
}

/// What [`StepBuffers::ensure`] lends a pass: the activations, the attention's partial
/// results, the device logits and the host buffer they come down into.
type StepParts<'a, D> = (
    &'a mut Activations<D>,
    &'a mut Scratch<D>,
    &'a mut Scratch<D>,
    &'a mut Vec<f32>,
);

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
    /// Per sequence: first row, token count, first position.
    spans: Vec<(usize, usize, usize)>,
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
        spans: Vec::with_capacity(seqs.len()),
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
        let first_row = b.tokens.len() - s.tokens.len();
        b.spans.push((first_row, s.tokens.len(), s.start_pos));
        b.wanted
            .extend(s.logit_rows().map(|r| (first_row + r) as i32));
    }
    Ok(b)
}

/// A grid-stride launch over `n` elements, capped at 2^22 threads: enough to fill any GPU.
fn elementwise(n: usize) -> Launch {
    Launch::covering(n.min(1 << 22), 256)
}

/// `out = bf16(rmsnorm(x) * weight)` for `rows` rows of `hidden` (one block per row).
fn rms_norm<D: LaunchDevice>(
    dev: &D,
    x: &D::F32,
    weight: &D::F32,
    out: &mut D::Bf16,
    rows: i32,
    hidden: i32,
    eps: f32,
) -> Result<()> {
    use KernelArg::*;
    // SAFETY: rms_norm_bf16(float*, float*, bf16*, int, int, float); the callers size x and
    // out for `rows` rows of `hidden`, and weight for `hidden`.
    unsafe {
        dev.launch(
            Kernel::RmsNormBf16,
            Launch::per_row(rows as usize, 1024),
            &mut [
                F32(x),
                F32(weight),
                Bf16Mut(out),
                Int(rows),
                Int(hidden),
                Float(eps),
            ],
        )
    }
}

/// Runs one batch (same contract as [`Model::forward`]): K/V of every token into `cache`
/// (`cache_blocks` blocks per layer), the logits rows every sequence asked for, in order.
/// `after_layer(l, cache)` runs once layer `l`'s work is queued (its KV written on the
/// device's queue, not necessarily done): work it queues runs after that layer.
#[allow(clippy::too_many_arguments)]
pub fn forward<D: LaunchDevice>(
    dev: &D,
    cfg: &ModelConfig,
    w: &DeviceWeights<D>,
    cache: &mut D::Bf16,
    cache_blocks: usize,
    seqs: &[SeqInput<'_>],
    buffers: &mut StepBuffers<D>,
    after_layer: &mut dyn FnMut(usize, &D::Bf16) -> Result<()>,
) -> Result<Logits> {
    use KernelArg::*;
    let (h, d) = (cfg.hidden_size, cfg.head_dim);
    let (qw, kw) = (cfg.q_width(), cfg.kv_width());
    let qkv_w = qw + 2 * kw;
    let f = cfg.intermediate_size;
    if d > 256 {
        // The CUDA-core attention keeps head_dim / 32 values per lane in 8 registers.
        return Err(EngineError::Unsupported(format!(
            "head_dim {d} > 256 on the GPU"
        )));
    }
    let host = describe_batch(cfg, cache_blocks, seqs)?;
    let t = host.tokens.len();
    let tokens = dev.upload_u32(&host.tokens)?;
    let positions = dev.upload_i32(&host.positions)?;
    let token_seq = dev.upload_i32(&host.token_seq)?;
    let tables = dev.upload_i32(&host.tables)?;
    let max_blocks = host.max_blocks as i32;
    let plan = attention::tensor_core_path(dev, cfg)
        .then(|| Plan::new(cfg, &host.spans, dev.multiprocessors()));
    let tiles = plan
        .as_ref()
        .map(|p| dev.upload_i32(&p.tiles))
        .transpose()?;
    let (
        Activations {
            x,
            normed,
            qkv,
            attn,
            gate_up,
            act,
            last,
            last_normed,
        },
        partials,
        logits,
        host_logits,
    ) = buffers.ensure(dev, cfg, t)?;
    let (rows, hidden, eps) = (t as i32, h as i32, cfg.rms_norm_eps as f32);
    let row_width = qkv_w as i32;
    let (q_heads, kv_heads, head_dim) = (
        cfg.num_attention_heads as i32,
        cfg.num_key_value_heads as i32,
        d as i32,
    );
    let (rope_launch, rope_heads_per_block) = Launch::rope(
        t,
        cfg.num_attention_heads + cfg.num_key_value_heads,
        dev.multiprocessors(),
    );
    let rope_heads_per_block = rope_heads_per_block as i32;
    // SAFETY (every launch below): each argument list is its kernel's parameter list in
    // `kernels.cu` (the emulated device of the tests checks every type), and every buffer was
    // sized above for this batch; `describe_batch` checked the tokens against the vocabulary
    // and the block tables against the cache.
    unsafe {
        dev.launch(
            Kernel::EmbedRows,
            Launch::per_row(t, 256),
            &mut [
                Bf16(&w.embed),
                U32s(&tokens),
                F32Mut(x),
                Int(rows),
                Int(hidden),
            ],
        )?;
    }
    let layer_elems = cache_blocks * block_layer_elems(cfg);
    for (l, layer) in w.layers.iter().enumerate() {
        let layer_offset = (l * layer_elems) as i64;
        rms_norm(dev, x, &layer.attn_norm, normed, rows, hidden, eps)?;
        dev.gemm(normed, &layer.qkv, qkv, t, qkv_w, h, false)?;
        unsafe {
            dev.launch(
                Kernel::RopeKvWrite,
                rope_launch,
                &mut [
                    F32Mut(qkv),
                    I32s(&positions),
                    F32(&w.inv_freq),
                    I32s(&token_seq),
                    I32s(&tables),
                    Int(max_blocks),
                    Bf16Mut(cache),
                    Long(layer_offset),
                    Int(rows),
                    Int(row_width),
                    Int(q_heads),
                    Int(kv_heads),
                    Int(head_dim),
                    Int(rope_heads_per_block),
                ],
            )?;
        }
        let inputs = StepInputs {
            qkv,
            positions: &positions,
            token_seq: &token_seq,
            tables: &tables,
            max_blocks,
            rows: t,
            tiles: tiles.as_ref().zip(plan.as_ref()),
        };
        unsafe {
            attention::launch(dev, cfg, &inputs, cache, layer_offset, attn, partials)?;
        }
        // The residual adds are the o and down projections' beta = 1.
        dev.gemm(attn, &layer.o, x, t, h, qw, true)?;
        rms_norm(dev, x, &layer.ffn_norm, normed, rows, hidden, eps)?;
        dev.gemm(normed, &layer.gate_up, gate_up, t, 2 * f, h, false)?;
        unsafe {
            dev.launch(
                Kernel::SiluMulBf16,
                elementwise(t * f),
                &mut [F32(gate_up), Bf16Mut(act), Int(rows), Int(f as i32)],
            )?;
        }
        dev.gemm(act, &layer.down, x, t, h, f, true)?;
        after_layer(l, cache)?;
    }
    if host.wanted.is_empty() {
        dev.synchronize()?;
        return Ok(Logits::default());
    }
    let s = host.wanted.len();
    let wanted = dev.upload_i32(&host.wanted)?;
    let count = s as i32;
    unsafe {
        dev.launch(
            Kernel::GatherRows,
            Launch::per_row(s, 256),
            &mut [F32(x), I32s(&wanted), F32Mut(last), Int(count), Int(hidden)],
        )?;
    }
    rms_norm(dev, last, &w.final_norm, last_normed, count, hidden, eps)?;
    let vocab = cfg.vocab_size;
    // Kept across steps: the GEMM writes every element it is given.
    let logits = logits.at_least(dev, s * vocab)?;
    let head = w.lm_head.as_ref().unwrap_or(&w.embed);
    dev.gemm(last_normed, head, logits, s, vocab, h, false)?;
    let mut out = std::mem::take(host_logits);
    dev.download_f32_into(logits, s * vocab, &mut out)?;
    Logits::new(out, vocab)
}

//! The Llama forward pass on the GPU: the same batch shape as the CPU engine (a flat list of
//! token rows from several sequences, each with its start position and block table), bf16
//! weights, cuBLAS projections with f32 accumulation, NVRTC kernels for the rest, and a paged
//! bf16 KV cache in device memory.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{GpuContext, GpuKvCache, cuda_err};
use crate::blas_layout::{Op, linear_call};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kernels::{Matrix, RopeTable};
use crate::kv::BLOCK_SIZE;
use crate::model::{Model, SeqInput};

struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    qkv: CudaSlice<bf16>,
    o: CudaSlice<bf16>,
    ffn_norm: CudaSlice<f32>,
    gate_up: CudaSlice<bf16>,
    down: CudaSlice<bf16>,
}

/// A model's weights on the device.
pub struct GpuModel {
    pub cfg: ModelConfig,
    gpu: Arc<GpuContext>,
    embed: CudaSlice<bf16>,
    lm_head: Option<CudaSlice<bf16>>,
    final_norm: CudaSlice<f32>,
    layers: Vec<GpuLayer>,
    inv_freq: CudaSlice<f32>,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("layers", &self.layers.len())
            .finish_non_exhaustive()
    }
}

fn upload_matrix(gpu: &GpuContext, m: &Matrix) -> Result<CudaSlice<bf16>> {
    let values: Vec<bf16> = (0..m.rows)
        .flat_map(|r| (0..m.cols).map(move |c| bf16::from_f32(m.get(r, c))))
        .collect();
    gpu.stream
        .clone_htod(&values)
        .map_err(|e| cuda_err("upload", e))
}

fn upload_f32(gpu: &GpuContext, v: &[f32]) -> Result<CudaSlice<f32>> {
    gpu.stream.clone_htod(v).map_err(|e| cuda_err("upload", e))
}

fn grid(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(threads).max(1), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl GpuModel {
    /// Copies a loaded model's weights to the device as bf16.
    pub fn upload(gpu: Arc<GpuContext>, model: &Model) -> Result<Self> {
        let w = model.weights();
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            layers.push(GpuLayer {
                attn_norm: upload_f32(&gpu, &l.attn_norm)?,
                qkv: upload_matrix(&gpu, &l.qkv)?,
                o: upload_matrix(&gpu, &l.o)?,
                ffn_norm: upload_f32(&gpu, &l.ffn_norm)?,
                gate_up: upload_matrix(&gpu, &l.gate_up)?,
                down: upload_matrix(&gpu, &l.down)?,
            });
        }
        let cfg = model.config().clone();
        Ok(Self {
            embed: upload_matrix(&gpu, &w.embed)?,
            lm_head: w
                .lm_head
                .as_ref()
                .map(|m| upload_matrix(&gpu, m))
                .transpose()?,
            final_norm: upload_f32(&gpu, &w.final_norm)?,
            inv_freq: upload_f32(&gpu, RopeTable::new(&cfg).inv_freq())?,
            layers,
            cfg,
            gpu,
        })
    }

    /// Seeded random bf16 weights generated on the device (shapes too large to build on the
    /// host, such as Llama-3.1-8B). Same value distribution as the CPU dummy weights.
    pub fn dummy(gpu: Arc<GpuContext>, cfg: ModelConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let h = cfg.hidden_size;
        let mut next = 0u64;
        let mut random = |rows: usize, cols: usize, std: f32| -> Result<CudaSlice<bf16>> {
            next += 1;
            let n = rows * cols;
            let mut out = gpu
                .stream
                .alloc_zeros::<bf16>(n)
                .map_err(|e| cuda_err("allocation", e))?;
            let (n64, s, amp) = (
                n as i64,
                seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ next,
                std * 3f32.sqrt(),
            );
            let mut b = gpu.stream.launch_builder(&gpu.kernels.fill_uniform_bf16);
            b.arg(&mut out).arg(&n64).arg(&s).arg(&amp);
            // SAFETY: the kernel writes n elements of `out`.
            unsafe { b.launch(grid(n.min(1 << 24), 256)) }.map_err(|e| cuda_err("launch", e))?;
            Ok(out)
        };
        let fan_in = |n: usize| 1.0 / (n as f32).sqrt();
        let embed = random(cfg.vocab_size, h, 1.0)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            layers.push(GpuLayer {
                attn_norm: upload_f32(&gpu, &vec![1.0; h])?,
                qkv: random(cfg.q_width() + 2 * cfg.kv_width(), h, fan_in(h))?,
                o: random(h, cfg.q_width(), fan_in(cfg.q_width()))?,
                ffn_norm: upload_f32(&gpu, &vec![1.0; h])?,
                gate_up: random(2 * cfg.intermediate_size, h, fan_in(h))?,
                down: random(h, cfg.intermediate_size, fan_in(cfg.intermediate_size))?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(random(cfg.vocab_size, h, fan_in(h))?)
        };
        Ok(Self {
            final_norm: upload_f32(&gpu, &vec![1.0; h])?,
            inv_freq: upload_f32(&gpu, RopeTable::new(&cfg).inv_freq())?,
            embed,
            lm_head,
            layers,
            cfg,
            gpu,
        })
    }

    pub fn gpu(&self) -> &Arc<GpuContext> {
        &self.gpu
    }

    /// Bytes of weights read by one decode step.
    pub fn weight_bytes(&self) -> usize {
        let cfg = &self.cfg;
        cfg.num_parameters() * 2
    }

    /// `out[rows × n] (f32) = x[rows × k] (bf16) · Wᵀ` with W row-major `n × k` (bf16).
    fn gemm(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let stream = &self.gpu.stream;
        let (alpha, beta) = (1f32, 0f32);
        let call = linear_call(rows, n, k);
        let op = |o: Op| match o {
            Op::N => blas_sys::cublasOperation_t::CUBLAS_OP_N,
            Op::T => blas_sys::cublasOperation_t::CUBLAS_OP_T,
        };
        let (a, _ga) = w.device_ptr(stream);
        let (b, _gb) = x.device_ptr(stream);
        let (c, _gc) = out.device_ptr_mut(stream);
        // SAFETY: the buffers hold n·k, rows·k and rows·n elements, checked by the callers;
        // `linear_call` maps the row-major product onto these column-major arguments.
        unsafe {
            blas::gemm_ex(
                *self.gpu.blas.handle(),
                op(call.transa),
                op(call.transb),
                call.m as i32,
                call.n as i32,
                call.k as i32,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                call.lda as i32,
                b as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                call.ldb as i32,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                call.ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cuda_err("cuBLAS gemm", e))
    }

    /// Runs one batch (same contract as [`Model::forward`]): K/V of every token into the
    /// cache, last-token logits of every sequence that asked.
    pub fn forward(&self, cache: &mut GpuKvCache, seqs: &[SeqInput<'_>]) -> Result<Vec<Vec<f32>>> {
        let cfg = &self.cfg;
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qw, kw) = (cfg.q_width(), cfg.kv_width());
        let qkv_w = qw + 2 * kw;
        let f = cfg.intermediate_size;
        let stream = &self.gpu.stream;
        let k = &self.gpu.kernels;
        if d > 256 {
            return Err(EngineError::Unsupported(format!(
                "head_dim {d} > 256 on the GPU"
            )));
        }
        // Host-side batch description.
        let max_blocks = seqs
            .iter()
            .map(|s| s.block_table.len())
            .max()
            .unwrap_or(1)
            .max(1);
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut token_seq = Vec::new();
        let mut tables = vec![0i32; seqs.len() * max_blocks];
        let mut wanted = Vec::new();
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
            if s.block_table
                .iter()
                .any(|&b| b as usize >= cache.num_blocks)
            {
                return Err(EngineError::InvalidKv(
                    "block id outside the GPU cache".into(),
                ));
            }
            for (j, &b) in s.block_table.iter().enumerate() {
                tables[si * max_blocks + j] = b as i32;
            }
            for (i, &t) in s.tokens.iter().enumerate() {
                tokens.push(t);
                positions.push((s.start_pos + i) as i32);
                token_seq.push(si as i32);
            }
            if s.logits {
                wanted.push((tokens.len() - 1) as i32);
            }
        }
        let t = tokens.len();
        let up = |e| cuda_err("batch upload", e);
        let tokens_d = stream.clone_htod(&tokens).map_err(up)?;
        let positions_d = stream.clone_htod(&positions).map_err(up)?;
        let token_seq_d = stream.clone_htod(&token_seq).map_err(up)?;
        let tables_d = stream.clone_htod(&tables).map_err(up)?;
        let alloc = |e| cuda_err("activation allocation", e);
        let mut x = stream.alloc_zeros::<f32>(t * h).map_err(alloc)?;
        let mut normed = stream.alloc_zeros::<bf16>(t * h).map_err(alloc)?;
        let mut qkv = stream.alloc_zeros::<f32>(t * qkv_w).map_err(alloc)?;
        let mut attn = stream.alloc_zeros::<bf16>(t * qw).map_err(alloc)?;
        let mut proj = stream.alloc_zeros::<f32>(t * h).map_err(alloc)?;
        let mut gate_up = stream.alloc_zeros::<f32>(t * 2 * f).map_err(alloc)?;
        let mut act = stream.alloc_zeros::<bf16>(t * f).map_err(alloc)?;
        let launch = |e| cuda_err("kernel launch", e);
        let (rows, hidden, eps) = (t as i32, h as i32, cfg.rms_norm_eps as f32);
        let mut b = stream.launch_builder(&k.embed_rows);
        b.arg(&self.embed)
            .arg(&tokens_d)
            .arg(&mut x)
            .arg(&rows)
            .arg(&hidden);
        // SAFETY: every kernel below reads and writes within the sizes allocated above.
        unsafe { b.launch(per_row(t, 256)) }.map_err(launch)?;
        let (row_width, q_heads, kv_heads, head_dim) = (
            qkv_w as i32,
            cfg.num_attention_heads as i32,
            cfg.num_key_value_heads as i32,
            d as i32,
        );
        let (q_width, max_blocks_i, scale) =
            (qw as i32, max_blocks as i32, 1.0 / (d as f32).sqrt());
        let (f_i, n_x) = (f as i32, (t * h) as i64);
        for (l, layer) in self.layers.iter().enumerate() {
            let layer_offset = cache.layer_offset(l);
            let mut b = stream.launch_builder(&k.rms_norm_bf16);
            b.arg(&x)
                .arg(&layer.attn_norm)
                .arg(&mut normed)
                .arg(&rows)
                .arg(&hidden)
                .arg(&eps);
            unsafe { b.launch(per_row(t, 256)) }.map_err(launch)?;
            self.gemm(&normed, &layer.qkv, &mut qkv, t, qkv_w, h)?;
            let mut b = stream.launch_builder(&k.rope_qk);
            b.arg(&mut qkv)
                .arg(&positions_d)
                .arg(&self.inv_freq)
                .arg(&rows)
                .arg(&row_width)
                .arg(&q_heads)
                .arg(&kv_heads)
                .arg(&head_dim);
            unsafe { b.launch(per_row(t, 128)) }.map_err(launch)?;
            let mut b = stream.launch_builder(&k.kv_write);
            b.arg(&qkv)
                .arg(&positions_d)
                .arg(&token_seq_d)
                .arg(&tables_d)
                .arg(&max_blocks_i)
                .arg(&mut *cache.data)
                .arg(&layer_offset)
                .arg(&rows)
                .arg(&row_width)
                .arg(&q_width)
                .arg(&kv_heads)
                .arg(&head_dim);
            unsafe { b.launch(per_row(t, 128)) }.map_err(launch)?;
            let mut b = stream.launch_builder(&k.paged_attention);
            b.arg(&qkv)
                .arg(&positions_d)
                .arg(&token_seq_d)
                .arg(&tables_d)
                .arg(&max_blocks_i)
                .arg(&*cache.data)
                .arg(&layer_offset)
                .arg(&mut attn)
                .arg(&rows)
                .arg(&row_width)
                .arg(&q_heads)
                .arg(&kv_heads)
                .arg(&head_dim)
                .arg(&scale);
            unsafe { b.launch(grid(t * cfg.num_attention_heads * 32, 128)) }.map_err(launch)?;
            self.gemm(&attn, &layer.o, &mut proj, t, h, qw)?;
            let mut b = stream.launch_builder(&k.add_in_place);
            b.arg(&mut x).arg(&proj).arg(&n_x);
            unsafe { b.launch(grid((t * h).min(1 << 22), 256)) }.map_err(launch)?;
            let mut b = stream.launch_builder(&k.rms_norm_bf16);
            b.arg(&x)
                .arg(&layer.ffn_norm)
                .arg(&mut normed)
                .arg(&rows)
                .arg(&hidden)
                .arg(&eps);
            unsafe { b.launch(per_row(t, 256)) }.map_err(launch)?;
            self.gemm(&normed, &layer.gate_up, &mut gate_up, t, 2 * f, h)?;
            let mut b = stream.launch_builder(&k.silu_mul_bf16);
            b.arg(&gate_up).arg(&mut act).arg(&rows).arg(&f_i);
            unsafe { b.launch(grid((t * f).min(1 << 22), 256)) }.map_err(launch)?;
            self.gemm(&act, &layer.down, &mut proj, t, h, f)?;
            let mut b = stream.launch_builder(&k.add_in_place);
            b.arg(&mut x).arg(&proj).arg(&n_x);
            unsafe { b.launch(grid((t * h).min(1 << 22), 256)) }.map_err(launch)?;
        }
        if wanted.is_empty() {
            self.gpu.synchronize()?;
            return Ok(Vec::new());
        }
        let s = wanted.len();
        let wanted_d = stream.clone_htod(&wanted).map_err(up)?;
        let mut last = stream.alloc_zeros::<f32>(s * h).map_err(alloc)?;
        let (count, mut last_normed) =
            (s as i32, stream.alloc_zeros::<bf16>(s * h).map_err(alloc)?);
        let mut b = stream.launch_builder(&k.gather_rows);
        b.arg(&x)
            .arg(&wanted_d)
            .arg(&mut last)
            .arg(&count)
            .arg(&hidden);
        unsafe { b.launch(per_row(s, 256)) }.map_err(launch)?;
        let mut b = stream.launch_builder(&k.rms_norm_bf16);
        b.arg(&last)
            .arg(&self.final_norm)
            .arg(&mut last_normed)
            .arg(&count)
            .arg(&hidden)
            .arg(&eps);
        unsafe { b.launch(per_row(s, 256)) }.map_err(launch)?;
        let vocab = cfg.vocab_size;
        let mut logits = stream.alloc_zeros::<f32>(s * vocab).map_err(alloc)?;
        self.gemm(
            &last_normed,
            self.lm_head.as_ref().unwrap_or(&self.embed),
            &mut logits,
            s,
            vocab,
            h,
        )?;
        let host = stream
            .clone_dtoh(&logits)
            .map_err(|e| cuda_err("download", e))?;
        Ok(host.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }
}

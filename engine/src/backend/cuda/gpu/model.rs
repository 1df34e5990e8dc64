//! The Llama forward pass on the GPU: the same batch shape as the CPU engine (a flat list of
//! token rows from several sequences, each with its start position and block table), bf16
//! weights, cuBLAS projections with f32 accumulation, NVRTC kernels for the rest, and a paged
//! bf16 KV cache in device memory. The pass itself is [`super::super::forward`], run here on
//! a [`CudaDevice`]. The engine runs the same pass through `DeviceBackend`; this standalone
//! model serves the GPU examples (checks and benchmarks, with weights made on the device).

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;

use super::device::CudaDevice;
use tandem_kv::cuda::DevicePool;

use super::super::forward::{self, DeviceLayer, DeviceWeights, StepBuffers};
use super::super::launch::{Kernel, KernelArg, Launch, LaunchDevice};
use super::GpuContext;
use crate::backend::Logits;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::{Model, SeqInput};

/// A model's weights on the device.
pub struct GpuModel {
    pub cfg: ModelConfig,
    device: CudaDevice,
    weights: DeviceWeights<CudaDevice>,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("layers", &self.weights.layers.len())
            .finish_non_exhaustive()
    }
}

impl GpuModel {
    /// Copies a loaded model's weights to the device as bf16.
    pub fn upload(gpu: Arc<GpuContext>, model: &Model) -> Result<Self> {
        let device = CudaDevice { gpu };
        Ok(Self {
            weights: DeviceWeights::upload(&device, model)?,
            cfg: model.config().clone(),
            device,
        })
    }

    /// Seeded random bf16 weights generated on the device (shapes too large to build on the
    /// host, such as Llama-3.1-8B). Same value distribution as the CPU dummy weights.
    pub fn dummy(gpu: Arc<GpuContext>, cfg: ModelConfig, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let device = CudaDevice { gpu: gpu.clone() };
        let h = cfg.hidden_size;
        let mut next = 0u64;
        let mut random = |rows: usize, cols: usize, std: f32| -> Result<CudaSlice<bf16>> {
            next += 1;
            let n = rows * cols;
            let mut out = device.zeros_bf16(n)?;
            let (n64, s, amp) = (
                n as i64,
                seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ next,
                std * 3f32.sqrt(),
            );
            // SAFETY: fill_uniform_bf16(bf16*, long long, unsigned long long, float) writes
            // the n elements of `out`.
            unsafe {
                device.launch(
                    Kernel::FillUniformBf16,
                    Launch::covering(n.min(1 << 24), 256),
                    &mut [
                        KernelArg::Bf16Mut(&mut out),
                        KernelArg::Long(n64),
                        KernelArg::ULong(s),
                        KernelArg::Float(amp),
                    ],
                )?;
            }
            Ok(out)
        };
        let fan_in = |n: usize| 1.0 / (n as f32).sqrt();
        let embed = random(cfg.vocab_size, h, 1.0)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            layers.push(DeviceLayer {
                attn_norm: device.upload_f32(&vec![1.0; h])?,
                qkv: random(cfg.q_width() + 2 * cfg.kv_width(), h, fan_in(h))?,
                o: random(h, cfg.q_width(), fan_in(cfg.q_width()))?,
                ffn_norm: device.upload_f32(&vec![1.0; h])?,
                gate_up: random(2 * cfg.intermediate_size, h, fan_in(h))?,
                down: random(h, cfg.intermediate_size, fan_in(cfg.intermediate_size))?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(random(cfg.vocab_size, h, fan_in(h))?)
        };
        let weights = DeviceWeights {
            final_norm: device.upload_f32(&vec![1.0; h])?,
            inv_freq: device
                .upload_f32(crate::backend::cpu::kernels::RopeTable::new(&cfg).inv_freq())?,
            embed,
            lm_head,
            layers,
        };
        Ok(Self {
            cfg,
            device,
            weights,
        })
    }

    pub fn gpu(&self) -> &Arc<GpuContext> {
        &self.device.gpu
    }

    /// Bytes of weights read by one decode step.
    pub fn weight_bytes(&self) -> usize {
        self.cfg.num_parameters() * 2
    }

    /// Runs one batch (same contract as [`Model::forward`]): K/V of every token into the
    /// cache, last-token logits of every sequence that asked; `buffers` are kept across
    /// calls.
    pub fn forward(
        &self,
        cache: &mut DevicePool,
        seqs: &[SeqInput<'_>],
        buffers: &mut StepBuffers<CudaDevice>,
    ) -> Result<Logits> {
        let blocks = cache.layout().num_blocks;
        forward::forward(
            &self.device,
            &self.cfg,
            &self.weights,
            cache.data_mut(),
            blocks,
            seqs,
            buffers,
            &mut |_, _| Ok(()),
        )
    }
}

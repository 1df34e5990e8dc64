//! The GPU engine's compute: the forward pass on the device, with the CPU cache kept as host
//! staging so that every KV transport works unchanged. After a forward pass that did prompt
//! work, the blocks it wrote are copied to the host cache layer by layer and the per-layer hook
//! runs (the prefill worker sends from there); a sequence admitted with KV received from a
//! peer has its blocks copied to the device before its first decode step.
//!
//! With the `cuda-ipc` transport none of that staging happens: the prefill worker copies
//! device to device from [`GpuBackend::device_kv`] into the decode worker's exported pool.
//!
//! The staging itself is [`crate::device_staging`] (one transfer per layer), run here on a
//! [`CudaDevice`].

use std::sync::Arc;

use tandem_kv::cuda::DevicePool;

use super::{CudaDevice, GpuContext, GpuModel};
use crate::device_staging::KvStaging;
use crate::engine::ChunkInfo;
use crate::error::Result;
use crate::model::{Model, SeqInput};
use tandem_kv::{BLOCK_SIZE, DeviceKv, ExportedKv, KvCache};

/// A model's weights and KV cache on one device.
pub struct GpuBackend {
    gpu: Arc<GpuContext>,
    device: CudaDevice,
    model: GpuModel,
    cache: DevicePool,
}

impl std::fmt::Debug for GpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend")
            .field("sms", &self.gpu.sms)
            .field("blocks", &self.cache.layout().num_blocks)
            .finish_non_exhaustive()
    }
}

impl GpuBackend {
    /// Uploads `model` and allocates `num_blocks` KV blocks (the host cache's count, so block
    /// ids mean the same on both sides).
    pub fn new(gpu: Arc<GpuContext>, model: &Model, num_blocks: usize) -> Result<Self> {
        let cache = super::device_pool(&gpu, model.config(), super::PoolSize::Blocks(num_blocks))?;
        let model = GpuModel::upload(gpu.clone(), model)?;
        Ok(Self {
            device: CudaDevice { gpu: gpu.clone() },
            gpu,
            model,
            cache,
        })
    }

    /// One forward pass on the device. With `export`, `on_layer` runs for every layer, as
    /// the CPU forward does; with `host_copy` too, the KV the batch wrote is first copied to
    /// `host` (transports that copy device to device read the device pool instead).
    pub fn forward(
        &mut self,
        host: &mut KvCache,
        seqs: &[SeqInput<'_>],
        chunks: &[ChunkInfo],
        export: bool,
        host_copy: bool,
        on_layer: &mut dyn FnMut(usize, &KvCache, &[ChunkInfo]),
    ) -> Result<Vec<Vec<f32>>> {
        let logits = self.model.forward(&mut self.cache, seqs)?;
        if export {
            let blocks = written_blocks(chunks);
            let pool = self.cache.layout();
            let mut staging = if host_copy {
                KvStaging::new(&self.device, &pool, &blocks)?
            } else {
                None
            };
            for layer in 0..pool.num_layers {
                if let Some(staging) = staging.as_mut() {
                    staging.download_layer(
                        &self.device,
                        &pool,
                        self.cache.data(),
                        host,
                        layer,
                        &blocks,
                    )?;
                }
                on_layer(layer, host, chunks);
            }
        }
        Ok(logits)
    }

    /// The device pool's address and geometry.
    pub fn device_kv(&self) -> DeviceKv {
        self.cache.describe()
    }

    /// An IPC handle to the device pool (see `tandem_kv::cuda::ipc`).
    pub fn export_kv(&self) -> Result<ExportedKv> {
        Ok(self.cache.export()?)
    }

    /// Copies `blocks` of every layer from `host` to the device (see
    /// [`crate::device_staging`]).
    pub fn upload_blocks(&mut self, host: &KvCache, blocks: &[u32]) -> Result<()> {
        let pool = self.cache.layout();
        match KvStaging::new(&self.device, &pool, blocks)? {
            Some(mut staging) => {
                staging.upload_all(&self.device, &pool, host, self.cache.data_mut(), blocks)
            }
            None => Ok(()),
        }
    }
}

/// The physical blocks that hold the positions the chunks computed.
fn written_blocks(chunks: &[ChunkInfo]) -> Vec<u32> {
    let mut out = Vec::new();
    for c in chunks {
        if c.len == 0 {
            continue;
        }
        let first = c.start_pos / BLOCK_SIZE;
        let last = (c.start_pos + c.len - 1) / BLOCK_SIZE;
        out.extend(c.blocks.iter().skip(first).take(last + 1 - first));
    }
    out
}

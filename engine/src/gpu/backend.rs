//! The GPU engine's compute: the forward pass on the device, with the CPU cache kept as host
//! staging so that every KV transport works unchanged. After a forward pass that did prompt
//! work, the blocks it wrote are copied to the host cache layer by layer and the per-layer hook
//! runs (the prefill worker sends from there); a sequence admitted with KV received from a
//! peer has its blocks copied to the device before its first decode step.
//!
//! With the `cuda-ipc` transport none of that staging happens: the prefill worker copies
//! device to device from [`GpuBackend::device_kv`] into the decode worker's exported pool.
//!
//! Staging moves a layer's blocks in one transfer: a gather (or scatter) kernel packs them
//! into a dense device buffer, so a 2048-token Llama-3.1-8B prompt costs 32 transfers of 8 MiB
//! rather than 4096 of 64 KiB.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use super::{GpuContext, GpuKvCache, GpuModel, cuda_err};
use crate::engine::ChunkInfo;
use crate::error::{EngineError, Result};
use crate::kv::staging::{from_device_layout, to_device_layout};
use crate::kv::{BLOCK_SIZE, DeviceKv, ExportedKv, KvCache};
use crate::model::{Model, SeqInput};

/// A model's weights and KV cache on one device.
pub struct GpuBackend {
    gpu: Arc<GpuContext>,
    model: GpuModel,
    cache: GpuKvCache,
}

impl std::fmt::Debug for GpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend")
            .field("sms", &self.gpu.sms)
            .field("blocks", &self.cache.num_blocks)
            .finish_non_exhaustive()
    }
}

impl GpuBackend {
    /// Uploads `model` and allocates `num_blocks` KV blocks (the host cache's count, so block
    /// ids mean the same on both sides).
    pub fn new(gpu: Arc<GpuContext>, model: &Model, num_blocks: usize) -> Result<Self> {
        let cache = GpuKvCache::with_blocks(&gpu, model.config(), num_blocks)?;
        let model = GpuModel::upload(gpu.clone(), model)?;
        Ok(Self { gpu, model, cache })
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
            let mut staging = if host_copy {
                Staging::new(&self.gpu, &self.cache, &blocks)?
            } else {
                None
            };
            for layer in 0..self.cache.num_layers {
                if let Some(staging) = staging.as_mut() {
                    self.download(host, layer, &blocks, staging)?;
                }
                on_layer(layer, host, chunks);
            }
        }
        Ok(logits)
    }

    /// The device pool's address and geometry.
    pub fn device_kv(&self) -> DeviceKv {
        self.cache.describe(&self.gpu)
    }

    /// An IPC handle to the device pool (see [`super::ipc`]).
    pub fn export_kv(&self) -> Result<ExportedKv> {
        self.cache.export(&self.gpu)
    }

    /// Copies `blocks` of every layer from `host` to the device: per layer, the blocks are
    /// converted into one buffer, copied over in one transfer and scattered by one launch.
    pub fn upload_blocks(&mut self, host: &KvCache, blocks: &[u32]) -> Result<()> {
        let Some(mut staging) = Staging::new(&self.gpu, &self.cache, blocks)? else {
            return Ok(());
        };
        let layout = host.layout().clone();
        let n = layout.block_layer_elems();
        for layer in 0..self.cache.num_layers {
            for (&block, buf) in blocks.iter().zip(staging.host.chunks_mut(n)) {
                to_device_layout(&layout, host.block_layer(layer, block)?, buf)?;
            }
            self.gpu
                .stream
                .memcpy_htod(&staging.host[..], &mut staging.device)
                .map_err(|e| cuda_err("KV upload", e))?;
            let (layer_offset, config) = (self.cache.layer_offset(layer), staging.launch_config());
            let mut b = self
                .gpu
                .stream
                .launch_builder(&self.gpu.kernels.scatter_kv_blocks);
            b.arg(&staging.device)
                .arg(&staging.ids)
                .arg(&staging.count)
                .arg(&staging.block_elems)
                .arg(&mut *self.cache.data)
                .arg(&layer_offset);
            // SAFETY: `Staging::new` checked every id against the pool; `device` holds `count`
            // blocks of `block_elems`.
            unsafe { b.launch(config) }.map_err(|e| cuda_err("KV scatter", e))?;
            // The buffers are reused for the next layer: wait for the copy and the scatter.
            self.gpu.synchronize()?;
        }
        Ok(())
    }

    /// Copies `layer`'s `blocks` to `host`: one gather launch into a dense buffer, one
    /// device-to-host transfer, then the layout conversion on the host.
    fn download(
        &self,
        host: &mut KvCache,
        layer: usize,
        blocks: &[u32],
        staging: &mut Staging,
    ) -> Result<()> {
        let layout = host.layout().clone();
        let n = layout.block_layer_elems();
        let (layer_offset, config) = (self.cache.layer_offset(layer), staging.launch_config());
        let mut b = self
            .gpu
            .stream
            .launch_builder(&self.gpu.kernels.gather_kv_blocks);
        b.arg(&*self.cache.data)
            .arg(&layer_offset)
            .arg(&staging.ids)
            .arg(&staging.count)
            .arg(&staging.block_elems)
            .arg(&mut staging.device);
        // SAFETY: as in `upload_blocks`.
        unsafe { b.launch(config) }.map_err(|e| cuda_err("KV gather", e))?;
        self.gpu
            .stream
            .memcpy_dtoh(&staging.device, &mut staging.host[..])
            .map_err(|e| cuda_err("KV download", e))?;
        self.gpu.synchronize()?;
        for (&block, buf) in blocks.iter().zip(staging.host.chunks(n)) {
            from_device_layout(&layout, buf, host.block_layer_mut(layer, block)?)?;
        }
        Ok(())
    }
}

/// The buffers that move a list of blocks of one layer between the device pool and the host
/// cache: the block ids on the device, the blocks densely packed on the device and on the host.
struct Staging {
    ids: CudaSlice<i32>,
    device: CudaSlice<bf16>,
    host: Vec<bf16>,
    count: i32,
    block_elems: i32,
}

impl Staging {
    /// `None` for no blocks (nothing to copy, and a zero-block launch would be invalid).
    /// Every block must lie in `cache`: the kernels index it unchecked.
    fn new(gpu: &GpuContext, cache: &GpuKvCache, blocks: &[u32]) -> Result<Option<Self>> {
        if blocks.is_empty() {
            return Ok(None);
        }
        if let Some(bad) = blocks.iter().find(|&&b| b as usize >= cache.num_blocks) {
            return Err(EngineError::InvalidKv(format!(
                "block {bad} is outside the GPU cache of {} blocks",
                cache.num_blocks
            )));
        }
        let block_elems = cache.block_layer_elems();
        let ids: Vec<i32> = blocks.iter().map(|&b| b as i32).collect();
        let elems = block_elems * blocks.len();
        let stream = &gpu.stream;
        Ok(Some(Self {
            ids: stream
                .clone_htod(&ids)
                .map_err(|e| cuda_err("block id upload", e))?,
            device: stream
                .alloc_zeros::<bf16>(elems)
                .map_err(|e| cuda_err("staging allocation", e))?,
            host: vec![bf16::ZERO; elems],
            count: blocks.len() as i32,
            block_elems: block_elems as i32,
        }))
    }

    /// One CUDA block per listed cache block.
    fn launch_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.count as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
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

//! The paged KV cache in device memory, and its export to other processes on the node.
//!
//! The pool is one plain `cuMemAlloc` allocation, not one from the stream-ordered allocator
//! that cudarc uses when the device has memory pools: `cuIpcGetMemHandle` refuses pool
//! memory, and the `cuda-ipc` transport needs a handle to this one. It is allocated once at
//! start-up, so the synchronous allocation costs nothing per request.

use std::mem::ManuallyDrop;

use cudarc::driver::{CudaSlice, DevicePtr, result};
use half::bf16;

use super::{GpuContext, cuda_err, ipc};
use crate::config::ModelConfig;
use crate::device_staging::PoolGeometry;
use crate::error::{EngineError, Result};
use crate::kv::{BLOCK_SIZE, DeviceKv, ExportedKv};

/// `[layer][block][K|V][kv_head][slot][head_dim]`, bf16.
pub struct GpuKvCache {
    /// Freed by hand in `Drop` (cudarc would free it as pool memory).
    pub data: ManuallyDrop<CudaSlice<bf16>>,
    pub num_blocks: usize,
    pub num_layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl std::fmt::Debug for GpuKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuKvCache")
            .field("blocks", &self.num_blocks)
            .finish_non_exhaustive()
    }
}

impl GpuKvCache {
    pub fn new(gpu: &GpuContext, cfg: &ModelConfig, budget_bytes: usize) -> Result<Self> {
        let per_block = cfg.num_hidden_layers * 2 * cfg.kv_width() * BLOCK_SIZE * 2;
        let num_blocks = budget_bytes / per_block;
        if num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "a GPU KV budget of {budget_bytes} bytes holds no block"
            )));
        }
        Self::with_blocks(gpu, cfg, num_blocks)
    }

    /// A cache of exactly `num_blocks` blocks, zeroed.
    pub fn with_blocks(gpu: &GpuContext, cfg: &ModelConfig, num_blocks: usize) -> Result<Self> {
        let per_block = cfg.num_hidden_layers * 2 * cfg.kv_width() * BLOCK_SIZE * 2;
        let elems = num_blocks * per_block / 2;
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        // SAFETY: a fresh allocation of `elems` bf16 values, handed to one CudaSlice that
        // `Drop` leaks and frees with the matching `cuMemFree`.
        let mut data = unsafe {
            let ptr = result::malloc_sync(elems * 2).map_err(|e| cuda_err("KV allocation", e))?;
            gpu.stream.upgrade_device_ptr::<bf16>(ptr, elems)
        };
        gpu.stream
            .memset_zeros(&mut data)
            .map_err(|e| cuda_err("KV zeroing", e))?;
        Ok(Self {
            data: ManuallyDrop::new(data),
            num_blocks,
            num_layers: cfg.num_hidden_layers,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        })
    }

    /// Elements of one block of one layer (K and V).
    pub fn block_layer_elems(&self) -> usize {
        2 * self.kv_heads * BLOCK_SIZE * self.head_dim
    }

    /// The pool's shape, for host staging.
    pub fn geometry(&self) -> PoolGeometry {
        PoolGeometry {
            num_layers: self.num_layers,
            num_blocks: self.num_blocks,
            block_elems: self.block_layer_elems(),
        }
    }

    /// Element offset of `(layer, block)`: where a transport copies that block.
    pub fn block_offset(&self, layer: usize, block: u32) -> usize {
        (layer * self.num_blocks + block as usize) * self.block_layer_elems()
    }

    /// The pool's address and geometry, and the stream that writes it.
    pub fn describe(&self, gpu: &GpuContext) -> DeviceKv {
        let (base, _sync) = self.data.device_ptr(&gpu.stream);
        DeviceKv {
            base,
            num_blocks: self.num_blocks,
            num_layers: self.num_layers,
            block_layer_bytes: self.block_layer_elems() * 2,
            stream: gpu.stream.cu_stream() as usize,
            context: gpu.ctx.cu_ctx() as usize,
        }
    }

    /// An IPC handle to the pool, for a prefill worker on this node to copy into.
    pub fn export(&self, gpu: &GpuContext) -> Result<ExportedKv> {
        let kv = self.describe(gpu);
        Ok(ExportedKv {
            ipc_handle: ipc::export_handle(kv.base)?.to_vec(),
            num_blocks: kv.num_blocks,
            block_layer_bytes: kv.block_layer_bytes,
        })
    }
}

impl Drop for GpuKvCache {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the pointer came from `malloc_sync` in `with_blocks`.
        let data = unsafe { ManuallyDrop::take(&mut self.data) };
        let _ = data.stream().context().bind_to_thread();
        let ptr = data.leak();
        // SAFETY: `leak` waited for the pool's pending work; nothing else frees it.
        let _ = unsafe { result::free_sync(ptr) };
    }
}

//! Host staging of a device KV pool, generic over the device ([`LaunchDevice`]): a GPU
//! engine keeps the CPU cache as the transports' view of its KV, so after a forward pass with
//! prompt work the blocks it wrote are copied device → host, and KV received from a peer is
//! copied host → device before its first step. Each layer's blocks move in one transfer:
//! a gather (or scatter) kernel packs them into a dense buffer, so a 2048-token
//! Llama-3.1-8B prompt costs 32 transfers of 8 MiB rather than 4096 of 64 KiB. The layouts
//! differ (`tandem_kv::staging` converts on the host).
//!
//! Like [`crate::device_forward`], this runs on CUDA in production and on an emulated device
//! in the tests.

use half::bf16;

use crate::device_launch::{Kernel, KernelArg, Launch, LaunchDevice};
use crate::error::{EngineError, Result};
use tandem_kv::staging::{from_device_layout, to_device_layout};
use tandem_kv::{DevicePoolLayout, KvCache};

/// The buffers that move one list of blocks between the pool and the host cache, layer by
/// layer: the block ids on the device, and the blocks packed densely on both sides.
pub struct KvStaging<D: LaunchDevice> {
    ids: D::I32,
    device: D::Bf16,
    host: Vec<bf16>,
    count: i32,
    block_elems: i32,
}

impl<D: LaunchDevice> KvStaging<D> {
    /// `None` for no blocks (nothing to copy; a zero-block launch would be invalid). Every
    /// block must lie in the pool: the kernels index it unchecked.
    pub fn new(dev: &D, pool: &DevicePoolLayout, blocks: &[u32]) -> Result<Option<Self>> {
        if blocks.is_empty() {
            return Ok(None);
        }
        if let Some(bad) = blocks.iter().find(|&&b| b as usize >= pool.num_blocks) {
            return Err(EngineError::InvalidKv(format!(
                "block {bad} is outside the GPU cache of {} blocks",
                pool.num_blocks
            )));
        }
        let ids: Vec<i32> = blocks.iter().map(|&b| b as i32).collect();
        let elems = pool.block_layer_elems * blocks.len();
        Ok(Some(Self {
            ids: dev.upload_i32(&ids)?,
            device: dev.zeros_bf16(elems)?,
            host: vec![bf16::ZERO; elems],
            count: blocks.len() as i32,
            block_elems: pool.block_layer_elems as i32,
        }))
    }

    /// One CUDA block per listed cache block.
    fn launch(&self) -> Launch {
        Launch {
            blocks: self.count as u32,
            threads: 256,
        }
    }

    /// Copies `layer`'s `blocks` (the list this staging was made for) from the pool to `host`.
    pub fn download_layer(
        &mut self,
        dev: &D,
        pool: &DevicePoolLayout,
        cache: &D::Bf16,
        host: &mut KvCache,
        layer: usize,
        blocks: &[u32],
    ) -> Result<()> {
        let layout = host.layout().clone();
        let n = layout.block_layer_elems();
        let at = self.launch();
        let offset = pool.layer_offset(layer) as i64;
        // SAFETY: gather_kv_blocks(bf16*, long long, int*, int, int, bf16*); `new` checked
        // every id against the pool and sized `device` for `count` blocks.
        unsafe {
            dev.launch(
                Kernel::GatherKvBlocks,
                at,
                &mut [
                    KernelArg::Bf16(cache),
                    KernelArg::Long(offset),
                    KernelArg::I32s(&self.ids),
                    KernelArg::Int(self.count),
                    KernelArg::Int(self.block_elems),
                    KernelArg::Bf16Mut(&mut self.device),
                ],
            )?;
        }
        dev.download_bf16_into(&self.device, &mut self.host)?;
        for (&block, buf) in blocks.iter().zip(self.host.chunks(n)) {
            from_device_layout(&layout, buf, host.block_layer_mut(layer, block)?)?;
        }
        Ok(())
    }

    /// Copies every layer of `blocks` (the list this staging was made for) from `host` into
    /// the pool.
    pub fn upload_all(
        &mut self,
        dev: &D,
        pool: &DevicePoolLayout,
        host: &KvCache,
        cache: &mut D::Bf16,
        blocks: &[u32],
    ) -> Result<()> {
        let layout = host.layout().clone();
        let n = layout.block_layer_elems();
        let at = self.launch();
        for layer in 0..pool.num_layers {
            for (&block, buf) in blocks.iter().zip(self.host.chunks_mut(n)) {
                to_device_layout(&layout, host.block_layer(layer, block)?, buf)?;
            }
            dev.upload_bf16_into(&self.host, &mut self.device)?;
            let offset = pool.layer_offset(layer) as i64;
            // SAFETY: scatter_kv_blocks(bf16*, int*, int, int, bf16*, long long); as above.
            unsafe {
                dev.launch(
                    Kernel::ScatterKvBlocks,
                    at,
                    &mut [
                        KernelArg::Bf16(&self.device),
                        KernelArg::I32s(&self.ids),
                        KernelArg::Int(self.count),
                        KernelArg::Int(self.block_elems),
                        KernelArg::Bf16Mut(cache),
                        KernelArg::Long(offset),
                    ],
                )?;
            }
            // The buffers are reused for the next layer: wait for the copy and the scatter.
            dev.synchronize()?;
        }
        Ok(())
    }
}

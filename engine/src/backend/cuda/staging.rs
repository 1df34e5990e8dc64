//! Host staging of a device KV pool, generic over the device ([`LaunchDevice`]): a GPU
//! engine keeps the CPU cache as the transports' view of its KV, so after a forward pass with
//! prompt work the blocks it wrote are copied device → host, and KV received from a peer is
//! copied host → device before its first step. Each layer's blocks move in one transfer:
//! a gather (or scatter) kernel packs them into a dense buffer, so a 2048-token
//! Llama-3.1-8B prompt costs 32 transfers of 8 MiB rather than 4096 of 64 KiB. The layouts
//! differ (`tandem_kv::staging` converts on the host).
//!
//! Downloads are split in two so they overlap compute: [`KvStaging::gather`] queues a layer's
//! packing into one of two device slots, and [`KvStaging::download_after`] brings a slot down
//! once the work before its event is done, while later layers keep the device busy.
//!
//! Like [`super::forward`], this runs on CUDA in production and on an emulated device in the
//! tests.

use half::bf16;
use tandem_kv::staging::{from_device_layout, to_device_layout};
use tandem_kv::{DevicePoolLayout, KvCache};

use super::launch::{Kernel, KernelArg, Launch, LaunchDevice};
use crate::error::{EngineError, Result};

/// The buffers that move one list of blocks between the pool and the host cache, layer by
/// layer: the block ids on the device, and the blocks packed densely on both sides (two
/// device slots, so one layer can come down while the next is packed).
pub struct KvStaging<D: LaunchDevice> {
    ids: D::I32,
    device: [D::Bf16; 2],
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
            device: [dev.zeros_bf16(elems)?, dev.zeros_bf16(elems)?],
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

    /// Copies `layer`'s `blocks` (the list this staging was made for) from the pool to `host`,
    /// waiting for it.
    pub fn download_layer(
        &mut self,
        dev: &D,
        pool: &DevicePoolLayout,
        cache: &D::Bf16,
        host: &mut KvCache,
        layer: usize,
        blocks: &[u32],
    ) -> Result<()> {
        self.gather(dev, pool, cache, layer, 0)?;
        let done = dev.record_event()?;
        self.download_after(dev, &done, 0, host, layer, blocks)
    }

    /// Queues the packing of `layer`'s blocks into device slot `slot` (0 or 1), after the work
    /// already queued (the layer that wrote them).
    pub fn gather(
        &mut self,
        dev: &D,
        pool: &DevicePoolLayout,
        cache: &D::Bf16,
        layer: usize,
        slot: usize,
    ) -> Result<()> {
        let at = self.launch();
        let offset = pool.layer_offset(layer) as i64;
        let out = self
            .device
            .get_mut(slot)
            .ok_or_else(|| EngineError::InvalidKv(format!("staging slot {slot} of 2")))?;
        // SAFETY: gather_kv_blocks(bf16*, long long, int*, int, int, bf16*); `new` checked
        // every id against the pool and sized each slot for `count` blocks.
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
                    KernelArg::Bf16Mut(out),
                ],
            )
        }
    }

    /// Brings slot `slot` down once the work before `event` (its gather) is done, and writes
    /// it into `host` as `layer` of `blocks`.
    pub fn download_after(
        &mut self,
        dev: &D,
        event: &D::Event,
        slot: usize,
        host: &mut KvCache,
        layer: usize,
        blocks: &[u32],
    ) -> Result<()> {
        let layout = host.layout().clone();
        let n = layout.block_layer_elems();
        let buf = self
            .device
            .get(slot)
            .ok_or_else(|| EngineError::InvalidKv(format!("staging slot {slot} of 2")))?;
        dev.download_bf16_after(event, buf, &mut self.host)?;
        for (&block, packed) in blocks.iter().zip(self.host.chunks(n)) {
            from_device_layout(&layout, packed, host.block_layer_mut(layer, block)?)?;
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
            dev.upload_bf16_into(&self.host, &mut self.device[0])?;
            let offset = pool.layer_offset(layer) as i64;
            // SAFETY: scatter_kv_blocks(bf16*, int*, int, int, bf16*, long long); as above.
            unsafe {
                dev.launch(
                    Kernel::ScatterKvBlocks,
                    at,
                    &mut [
                        KernelArg::Bf16(&self.device[0]),
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

//! [`DeviceBackend`]: the engine's compute on a device (CUDA in production, an emulated device
//! in the tests), behind [`ComputeBackend`].
//!
//! The forward pass runs on the device with the model's bf16 weights and a paged bf16 KV pool
//! in device memory; its activations are kept across steps ([`StepBuffers`]). The host
//! [`KvCache`] is only staging for the KV transports:
//!
//! - After each layer of a pass with prompt work, the blocks that layer wrote are packed on
//!   the device and brought down while the device computes the next layer, then handed to
//!   the per-layer hook (the prefill worker sends them) and released from host memory
//!   ([`KvCache::discard`]): the host holds a layer's KV only while it is being sent.
//! - KV received from a peer into the host cache is uploaded before its first step and
//!   released the same way.
//! - With `cuda-ipc` or `nccl` (device-to-device), none of that happens: the hook runs right
//!   after each layer is queued, and the transports copy from [`ComputeBackend::device_kv`]
//!   on the same stream.

use tandem_kv::{BLOCK_SIZE, DeviceKv, DevicePoolLayout, ExportedKv, KvCache, KvLocation};

use super::forward::{self, DeviceWeights, StepBuffers};
use super::launch::LaunchDevice;
use super::staging::KvStaging;
use crate::backend::{Batch, ComputeBackend, Logits, OnLayer};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::types::ChunkInfo;

/// A model's weights, KV pool and step buffers on one device.
pub struct DeviceBackend<D: LaunchDevice> {
    dev: D,
    name: &'static str,
    cfg: ModelConfig,
    weights: DeviceWeights<D>,
    pool: D::Pool,
    layout: DevicePoolLayout,
    buffers: StepBuffers<D>,
    /// Whether prompt KV comes down to the host after each layer (off while every transfer
    /// in flight copies device to device).
    host_kv_export: bool,
}

impl<D: LaunchDevice> std::fmt::Debug for DeviceBackend<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBackend")
            .field("device", &self.name)
            .field("blocks", &self.layout.num_blocks)
            .finish_non_exhaustive()
    }
}

impl<D: LaunchDevice> DeviceBackend<D> {
    /// Uploads `model` to `dev` and allocates `num_blocks` KV blocks (the host cache's count,
    /// so block ids mean the same on both sides).
    pub fn new(dev: D, name: &'static str, model: &Model, num_blocks: usize) -> Result<Self> {
        let cfg = model.config().clone();
        // The device kernels implement the Llama block; a family that changes it runs on the
        // CPU engine until its operations have device kernels.
        if let Some(what) = device_lacks(&cfg) {
            return Err(EngineError::Unsupported(format!(
                "a {} model on the GPU engine, whose kernels lack {what}; run it with --device cpu",
                cfg.arch
            )));
        }
        let layout = DevicePoolLayout {
            num_layers: cfg.num_hidden_layers,
            num_blocks,
            block_layer_elems: forward::block_layer_elems(&cfg),
        };
        Ok(Self {
            weights: DeviceWeights::upload(&dev, model)?,
            pool: dev.alloc_pool(layout)?,
            dev,
            name,
            cfg,
            layout,
            buffers: StepBuffers::default(),
            host_kv_export: true,
        })
    }

    /// The step buffers (their size and how often they were allocated, for tests).
    pub fn buffers(&self) -> &StepBuffers<D> {
        &self.buffers
    }

    /// The device KV pool's memory (tests read it back).
    pub fn pool(&self) -> &D::Bf16 {
        D::pool_data(&self.pool)
    }
}

impl<D> ComputeBackend for DeviceBackend<D>
where
    D: LaunchDevice + Send,
    D::Pool: Send,
    D::F32: Send,
    D::Bf16: Send,
    D::I32: Send,
    D::U32: Send,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn host_cache_is_kv(&self) -> bool {
        // The device pool is the KV; the host cache stages what a pass brings down.
        false
    }

    fn frees_host_during_forward(&self) -> bool {
        true
    }

    fn forward(
        &mut self,
        host: &mut KvCache,
        batch: &Batch<'_>,
        on_layer: &mut OnLayer<'_>,
    ) -> Result<Logits> {
        let Self {
            dev,
            cfg,
            weights,
            pool,
            layout,
            buffers,
            host_kv_export,
            ..
        } = self;
        let chunks = batch.chunks;
        // The KV of prompt work is what transports send; decode steps need no hook.
        let export = batch.prompt_work;
        let blocks = if export && *host_kv_export {
            written_blocks(chunks)
        } else {
            Vec::new()
        };
        let mut staging = KvStaging::new(&*dev, layout, &blocks)?;
        // The layer whose KV is on its way down, and the event after its packing.
        let mut pending: Option<(usize, D::Event)> = None;
        let finish = |dev: &D,
                      staging: &mut KvStaging<D>,
                      host: &mut KvCache,
                      (layer, done): (usize, D::Event),
                      on_layer: &mut OnLayer<'_>|
         -> Result<()> {
            staging.download_after(dev, &done, layer % 2, host, layer, &blocks)?;
            on_layer(layer, host, chunks);
            // The hook's senders copied what they needed: the host need not keep it.
            host.discard(layer, &blocks)?;
            Ok(())
        };
        let mut after_layer = |layer: usize, kv: &D::Bf16| -> Result<()> {
            if !export {
                return Ok(());
            }
            let Some(staging) = staging.as_mut() else {
                // Device-to-device transports (or nothing written): their copies queue on the
                // device after this layer.
                on_layer(layer, host, chunks);
                return Ok(());
            };
            staging.gather(dev, layout, kv, layer, layer % 2)?;
            let packed = dev.record_event()?;
            // Bring the previous layer down while the device computes this one.
            if let Some(previous) = pending.replace((layer, packed)) {
                finish(dev, staging, host, previous, on_layer)?;
            }
            Ok(())
        };
        let num_blocks = layout.num_blocks;
        let logits = forward::forward(
            &*dev,
            cfg,
            weights,
            D::pool_data_mut(pool),
            num_blocks,
            batch.seqs,
            buffers,
            &mut after_layer,
        )?;
        if let (Some(last), Some(staging)) = (pending, staging.as_mut()) {
            finish(dev, staging, host, last, on_layer)?;
        }
        Ok(logits)
    }

    fn recycle_logits(&mut self, logits: Logits) {
        self.buffers.recycle_logits(logits);
    }

    fn import_blocks(
        &mut self,
        host: &mut KvCache,
        blocks: &[u32],
        location: KvLocation,
    ) -> Result<()> {
        if location == KvLocation::Device {
            return Ok(());
        }
        if let Some(mut staging) = KvStaging::new(&self.dev, &self.layout, blocks)? {
            let pool = D::pool_data_mut(&mut self.pool);
            staging.upload_all(&self.dev, &self.layout, host, pool, blocks)?;
        }
        // On the device now: the host copy was only on its way there.
        for layer in 0..self.layout.num_layers {
            host.discard(layer, blocks)?;
        }
        Ok(())
    }

    fn device_kv(&self) -> Option<DeviceKv> {
        D::describe_pool(&self.pool)
    }

    fn export_device_kv(&self) -> Result<Option<ExportedKv>> {
        D::export_pool(&self.pool)
    }

    fn set_host_kv_export(&mut self, on: bool) {
        self.host_kv_export = on;
    }
}

/// The physical blocks that hold the positions the chunks computed.
pub fn written_blocks(chunks: &[ChunkInfo]) -> Vec<u32> {
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

/// What `cfg` needs that the device kernels do not have, if anything.
pub fn device_lacks(cfg: &ModelConfig) -> Option<&'static str> {
    if cfg.attention_bias {
        Some("biases on the Q, K and V projections")
    } else if cfg.qk_norm {
        Some("per-head RMSNorm of Q and K")
    } else if cfg.arch.is_gemma() {
        Some("Gemma's post-norms, GeGLU and soft-capping")
    } else if cfg.has_window() {
        Some("sliding-window attention")
    } else {
        None
    }
}

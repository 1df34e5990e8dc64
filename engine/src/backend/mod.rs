//! The compute seam: one [`ComputeBackend`] trait between the engine's scheduler and wherever
//! the forward pass runs. The scheduler plans a [`Batch`]; the backend runs it over the KV
//! cache, calling a hook as each layer's KV is complete (so a prefill worker ships it while
//! later layers compute), and makes KV received from a peer visible to later passes.
//!
//! - [`cpu`]: the batch-invariant CPU kernels over the host cache itself.
//! - [`cuda`]: the forward pass as device launches, generic over the device, with the host
//!   cache as staging only; the CUDA device behind the `cuda` feature, an emulated one in the
//!   tests.
//!
//! [`for_device`] (in `select`) picks one from the engine's configured `Device`: the one
//! place the engine looks at the `cuda` feature. The engine never asks a backend its name to
//! decide what to do; it asks what the backend can do ([`ComputeBackend::host_cache_is_kv`],
//! [`ComputeBackend::frees_host_during_forward`]).

pub mod cpu;
pub mod cuda;
mod logits;
mod select;

use tandem_kv::{DeviceKv, ExportedKv, KvCache, KvLocation};

use crate::error::Result;
use crate::model::SeqInput;
use crate::types::ChunkInfo;

pub use logits::Logits;
pub use select::for_device;

/// One forward pass as the scheduler planned it.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    /// The token rows of each sequence, with positions and block tables.
    pub seqs: &'a [SeqInput<'a>],
    /// The same chunks, as the per-layer hook reports them.
    pub chunks: &'a [ChunkInfo],
    /// Whether the pass computes prompt positions (KV that transports may send); without
    /// prompt work a device backend calls no hook.
    pub prompt_work: bool,
}

/// The per-layer hook: `(layer, host view of the KV, chunks)`, once the layer's KV is complete
/// for the whole batch.
pub type OnLayer<'a> = dyn FnMut(usize, &KvCache, &[ChunkInfo]) + 'a;

/// Where an engine's forward pass runs.
pub trait ComputeBackend: Send {
    /// `cpu` or `cuda`, for logs and errors only: what the engine does depends on the
    /// capabilities below, never on the name.
    fn name(&self) -> &'static str;

    /// Whether the host cache is the KV the forward pass reads (the CPU), rather than a
    /// staging copy of a device pool that holds only the blocks a pass brings down. Only
    /// then can KV read from another worker join the prefix cache, and can a host transport
    /// send a cached prefix it did not compute.
    fn host_cache_is_kv(&self) -> bool;

    /// Whether the host's cores are free while a forward pass runs (a device computes), so
    /// host work such as grammar masks is worth running beside it rather than before it.
    fn frees_host_during_forward(&self) -> bool;

    /// Runs `batch`: writes every token's K and V, calls `on_layer` per layer (see
    /// [`OnLayer`]; every layer on the CPU, every layer of a pass with prompt work on a
    /// device), and returns the logits of the sequences that asked. `host` is the cache the
    /// transports read and write: the KV itself on the CPU, staging on a device.
    fn forward(
        &mut self,
        host: &mut KvCache,
        batch: &Batch<'_>,
        on_layer: &mut OnLayer<'_>,
    ) -> Result<Logits>;

    /// Takes back a pass's logits once sampled: a backend may fill the same buffer next
    /// pass instead of new memory (a device backend's are tens of MB a step).
    fn recycle_logits(&mut self, logits: Logits) {
        drop(logits);
    }

    /// Makes the KV of `blocks` that arrived at `location` visible to later passes (a device
    /// backend uploads host KV; the CPU refuses KV that is in device memory).
    fn import_blocks(
        &mut self,
        host: &mut KvCache,
        blocks: &[u32],
        location: KvLocation,
    ) -> Result<()>;

    /// Copies every layer of block `src` into `dst`: the copy-on-write of a prompt's last,
    /// partly filled block when an `n > 1` request's sequences part. A backend without it
    /// says so, and the engine recomputes that block's tokens instead.
    fn copy_block(&mut self, host: &mut KvCache, src: u32, dst: u32) -> Result<()> {
        let _ = (host, src, dst);
        Err(crate::error::EngineError::Unsupported(format!(
            "copying KV blocks on the {} backend",
            self.name()
        )))
    }

    /// The device KV pool, for transports that copy device to device.
    fn device_kv(&self) -> Option<DeviceKv> {
        None
    }

    /// An IPC export of the device KV pool.
    fn export_device_kv(&self) -> Result<Option<ExportedKv>> {
        Ok(None)
    }

    /// Whether prompt KV comes down to the host cache (a prefill worker turns it off while
    /// every transfer in flight copies device to device). No effect on the CPU.
    fn set_host_kv_export(&mut self, on: bool) {
        let _ = on;
    }
}

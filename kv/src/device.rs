//! A GPU engine's KV pool as the transports see it: its geometry ([`DevicePoolLayout`]), a
//! handle to its memory and the stream that writes it ([`DeviceKv`]), its export to other
//! processes on the node ([`ExportedKv`]), and the copy plan of one layer's blocks from one
//! device pool to another (the `cuda-ipc` transport).
//!
//! Device pools are layer-major, then block; each (layer, block) piece is one contiguous run
//! of `block_layer_bytes` (K then V, bf16, each `[kv_head][slot][head_dim]`). Blocks that
//! follow each other on both sides are merged into one copy, so a prompt whose blocks were
//! handed out in order moves each layer in a few large copies instead of one per block.
//!
//! Handles are typed (the CUDA stream, which owns its context), never raw integers; without
//! the `cuda` feature a [`DeviceKv`] cannot exist, so code that asks for one compiles
//! everywhere and the type system says it never runs.

use crate::error::{KvError, Result};
use crate::layout::KvLayout;

/// Geometry of a device pool: `[layer][block][K|V][kv_head][slot][head_dim]`, bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePoolLayout {
    pub num_layers: usize,
    pub num_blocks: usize,
    /// Elements of one block of one layer (K and V).
    pub block_layer_elems: usize,
}

impl DevicePoolLayout {
    /// Bytes of one device element (bf16).
    pub const ELEM_BYTES: usize = 2;

    /// The device pool of `num_blocks` blocks for a cache of `layout`'s shape.
    pub fn for_layout(layout: &KvLayout, num_blocks: usize) -> Self {
        Self {
            num_layers: layout.num_layers,
            num_blocks,
            block_layer_elems: 2 * layout.num_kv_heads * layout.block_size * layout.head_dim,
        }
    }

    pub fn block_layer_bytes(&self) -> usize {
        self.block_layer_elems * Self::ELEM_BYTES
    }

    /// Elements of the whole pool.
    pub fn elems(&self) -> usize {
        self.num_layers * self.num_blocks * self.block_layer_elems
    }

    /// Bytes of the whole pool.
    pub fn bytes(&self) -> usize {
        self.elems() * Self::ELEM_BYTES
    }

    /// Element offset of the first block of `layer`.
    pub fn layer_offset(&self, layer: usize) -> usize {
        layer * self.num_blocks * self.block_layer_elems
    }

    /// Element offset of `(layer, block)`: where a transport copies that block.
    pub fn piece_offset(&self, layer: usize, block: u32) -> usize {
        self.layer_offset(layer) + block as usize * self.block_layer_elems
    }

    /// Byte offset of `(layer, block)` from the pool's base.
    pub fn piece_byte_offset(&self, layer: usize, block: u32) -> usize {
        self.piece_offset(layer, block) * Self::ELEM_BYTES
    }
}

/// A GPU engine's KV pool: its geometry, its memory, and the stream its forward pass runs on
/// (copies out of it are queued there, after the pass that wrote it). Cloning shares the
/// stream; the memory belongs to the pool it describes.
#[derive(Clone)]
pub struct DeviceKv {
    pub layout: DevicePoolLayout,
    // Uninhabited without CUDA: there is nothing to read, and no value to read it from.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    handle: DeviceHandle,
}

#[cfg(feature = "cuda")]
#[derive(Clone)]
struct DeviceHandle {
    base: cudarc::driver::sys::CUdeviceptr,
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
}

/// Without CUDA there is no device pool to describe.
#[cfg(not(feature = "cuda"))]
#[derive(Clone)]
enum DeviceHandle {}

impl std::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKv")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl DeviceKv {
    pub fn num_layers(&self) -> usize {
        self.layout.num_layers
    }

    pub fn num_blocks(&self) -> usize {
        self.layout.num_blocks
    }

    pub fn block_layer_bytes(&self) -> usize {
        self.layout.block_layer_bytes()
    }
}

#[cfg(feature = "cuda")]
impl DeviceKv {
    /// A pool of `layout` at `base`, written by `stream`.
    ///
    /// # Safety
    /// `base` must be a device allocation of at least `layout.bytes()` bytes in `stream`'s
    /// context that outlives every use of this handle.
    pub unsafe fn new(
        layout: DevicePoolLayout,
        base: cudarc::driver::sys::CUdeviceptr,
        stream: std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Self {
        Self {
            layout,
            handle: DeviceHandle { base, stream },
        }
    }

    /// Device address of the pool's first byte.
    pub fn base(&self) -> cudarc::driver::sys::CUdeviceptr {
        self.handle.base
    }

    /// The stream that writes the pool.
    pub fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        &self.handle.stream
    }

    /// The context that owns the pool.
    pub fn context(&self) -> &std::sync::Arc<cudarc::driver::CudaContext> {
        self.handle.stream.context()
    }

    /// Waits until the pool's stream has run everything queued on it.
    pub fn synchronize(&self) -> Result<()> {
        self.handle
            .stream
            .synchronize()
            .map_err(|e| crate::cuda::cuda_err("stream synchronize", e))
    }
}

/// A pool exported to other processes on the node: the 64-byte IPC handle of its allocation
/// and its block count (the decode worker publishes both; the layout hash covers the rest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedKv {
    pub ipc_handle: Vec<u8>,
    pub num_blocks: usize,
    pub block_layer_bytes: usize,
}

/// Where a prefilled sequence's KV arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLocation {
    /// In the host cache (grpc, tcp and shm transports; on a GPU engine it is uploaded).
    Host,
    /// Already in the device pool (`cuda-ipc`, `nccl`).
    Device,
}

/// One device-to-device copy: byte offsets into the source and destination pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    pub src_offset: usize,
    pub dst_offset: usize,
    pub bytes: usize,
}

/// The copies that move `layer`'s `(source block, destination block)` pairs from a pool of
/// `src_blocks` blocks into one of `dst_blocks` blocks, merged where both sides are
/// consecutive. Refuses pairs outside either pool or a layer outside `layers`.
pub fn plan_layer_copy(
    layer: usize,
    layers: usize,
    block_layer_bytes: usize,
    src_blocks: usize,
    dst_blocks: usize,
    pairs: &[(u32, u32)],
) -> Result<Vec<CopyRun>> {
    if layer >= layers {
        return Err(KvError::InvalidKv(format!(
            "layer {layer} of a {layers}-layer pool"
        )));
    }
    let mut runs: Vec<CopyRun> = Vec::new();
    let mut last: Option<(u32, u32)> = None;
    for &(src, dst) in pairs {
        if src as usize >= src_blocks || dst as usize >= dst_blocks {
            return Err(KvError::InvalidKv(format!(
                "block pair {src}→{dst} outside pools of {src_blocks} and {dst_blocks} blocks"
            )));
        }
        let follows = last
            .is_some_and(|(s, d)| s.checked_add(1) == Some(src) && d.checked_add(1) == Some(dst));
        match runs.last_mut() {
            Some(run) if follows => run.bytes += block_layer_bytes,
            _ => runs.push(CopyRun {
                src_offset: (layer * src_blocks + src as usize) * block_layer_bytes,
                dst_offset: (layer * dst_blocks + dst as usize) * block_layer_bytes,
                bytes: block_layer_bytes,
            }),
        }
        last = Some((src, dst));
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_blocks_merge_into_one_copy() {
        let runs = plan_layer_copy(1, 2, 100, 10, 20, &[(3, 7), (4, 8), (5, 9)]).unwrap();
        assert_eq!(
            runs,
            vec![CopyRun {
                src_offset: (10 + 3) * 100,
                dst_offset: (20 + 7) * 100,
                bytes: 300,
            }]
        );
    }

    #[test]
    fn a_gap_on_either_side_starts_a_new_copy() {
        // Source gap after the first pair, destination gap after the second.
        let runs = plan_layer_copy(0, 1, 8, 16, 16, &[(0, 0), (2, 1), (3, 3), (4, 4)]).unwrap();
        let starts: Vec<(usize, usize, usize)> = runs
            .iter()
            .map(|r| (r.src_offset / 8, r.dst_offset / 8, r.bytes / 8))
            .collect();
        assert_eq!(starts, vec![(0, 0, 1), (2, 1, 1), (3, 3, 2)]);
        let total: usize = runs.iter().map(|r| r.bytes).sum();
        assert_eq!(total, 4 * 8, "every block is copied exactly once");
    }

    #[test]
    fn out_of_range_blocks_and_layers_are_refused() {
        assert!(plan_layer_copy(0, 1, 8, 4, 4, &[(4, 0)]).is_err());
        assert!(plan_layer_copy(0, 1, 8, 4, 4, &[(0, 4)]).is_err());
        assert!(plan_layer_copy(1, 1, 8, 4, 4, &[(0, 0)]).is_err());
        assert!(plan_layer_copy(0, 1, 8, 4, 4, &[]).unwrap().is_empty());
    }

    #[test]
    fn descending_blocks_do_not_merge() {
        let runs = plan_layer_copy(0, 1, 4, 8, 8, &[(5, 5), (4, 4)]).unwrap();
        assert_eq!(runs.len(), 2);
    }
}

//! Where a GPU engine's KV pool sits in device memory, as plain numbers that a transport can
//! carry without linking CUDA, and the copy plan of one layer's blocks from one device pool to
//! another (the `cuda-ipc` transport).
//!
//! Both pools use the GPU cache's layout: layer-major, then block, each (layer, block) piece
//! one contiguous run of `block_layer_bytes` (K then V, bf16). Blocks that follow each other
//! on both sides are merged into one copy, so a prompt whose blocks were handed out in order
//! moves each layer in a few large copies instead of one per block.

use crate::error::{EngineError, Result};

/// A GPU engine's KV pool: its base address, geometry, and the stream and context its
/// forward pass runs on (copies out of it are queued there, after the pass that wrote it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceKv {
    /// `CUdeviceptr` of the pool's first byte.
    pub base: u64,
    pub num_blocks: usize,
    pub num_layers: usize,
    pub block_layer_bytes: usize,
    /// Raw `CUstream` of the engine's forward pass.
    pub stream: usize,
    /// Raw `CUcontext` that owns the pool.
    pub context: usize,
}

impl DeviceKv {
    /// Bytes of the whole pool.
    pub fn bytes(&self) -> usize {
        self.num_layers * self.num_blocks * self.block_layer_bytes
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
        return Err(EngineError::InvalidKv(format!(
            "layer {layer} of a {layers}-layer pool"
        )));
    }
    let mut runs: Vec<CopyRun> = Vec::new();
    let mut last: Option<(u32, u32)> = None;
    for &(src, dst) in pairs {
        if src as usize >= src_blocks || dst as usize >= dst_blocks {
            return Err(EngineError::InvalidKv(format!(
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

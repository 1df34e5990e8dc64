//! The paged KV cache in device memory.
//!
//! The pool is one plain `cuMemAlloc` allocation, not one from the stream-ordered allocator
//! that cudarc uses when the device has memory pools: `cuIpcGetMemHandle` refuses pool
//! memory, and the `cuda-ipc` transport needs a handle to this one. It is allocated once at
//! start-up, so the synchronous allocation costs nothing per request.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, result};
use half::bf16;

use super::{cuda_err, ipc};
use crate::device::{DeviceKv, DevicePoolLayout, ExportedKv};
use crate::error::{KvError, Result};
use crate::layout::KvLayout;

/// A device KV pool of [`DevicePoolLayout`]'s geometry, written on one stream.
pub struct DevicePool {
    /// Freed by hand in `Drop` (cudarc would free it as pool memory).
    data: ManuallyDrop<CudaSlice<bf16>>,
    layout: DevicePoolLayout,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePool")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl DevicePool {
    /// As many blocks of `kv`'s shape as `budget_bytes` holds, zeroed.
    pub fn with_budget(
        stream: &Arc<CudaStream>,
        kv: &KvLayout,
        budget_bytes: usize,
    ) -> Result<Self> {
        let per_block = DevicePoolLayout::for_layout(kv, 1).bytes();
        let num_blocks = budget_bytes / per_block;
        if num_blocks == 0 {
            return Err(KvError::Config(format!(
                "a GPU KV budget of {budget_bytes} bytes holds no block of {per_block}"
            )));
        }
        Self::new(stream, DevicePoolLayout::for_layout(kv, num_blocks))
    }

    /// A pool of exactly `layout`'s blocks on `stream`'s device, zeroed.
    pub fn new(stream: &Arc<CudaStream>, layout: DevicePoolLayout) -> Result<Self> {
        let elems = layout.elems();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        // SAFETY: a fresh allocation of `elems` bf16 values, handed to one CudaSlice that
        // `Drop` leaks and frees with the matching `cuMemFree`.
        let mut data = unsafe {
            let ptr = result::malloc_sync(elems.max(1) * DevicePoolLayout::ELEM_BYTES)
                .map_err(|e| cuda_err("KV allocation", e))?;
            stream.upgrade_device_ptr::<bf16>(ptr, elems)
        };
        stream
            .memset_zeros(&mut data)
            .map_err(|e| cuda_err("KV zeroing", e))?;
        Ok(Self {
            data: ManuallyDrop::new(data),
            layout,
            stream: stream.clone(),
        })
    }

    pub fn layout(&self) -> DevicePoolLayout {
        self.layout
    }

    /// The pool's memory, for kernels that read it.
    pub fn data(&self) -> &CudaSlice<bf16> {
        &self.data
    }

    /// The pool's memory, for kernels that write it.
    pub fn data_mut(&mut self) -> &mut CudaSlice<bf16> {
        &mut self.data
    }

    /// The pool's address and geometry, and the stream that writes it.
    pub fn describe(&self) -> DeviceKv {
        let (base, _sync) = self.data.device_ptr(&self.stream);
        // SAFETY: `base` is this pool's allocation of `layout.bytes()` bytes in the stream's
        // context; the engine keeps the pool for as long as it hands out descriptions.
        unsafe { DeviceKv::new(self.layout, base, self.stream.clone()) }
    }

    /// An IPC handle to the pool, for a prefill worker on this node to copy into.
    pub fn export(&self) -> Result<ExportedKv> {
        let kv = self.describe();
        Ok(ExportedKv {
            ipc_handle: ipc::export_handle(&kv)?.to_vec(),
            num_blocks: self.layout.num_blocks,
            block_layer_bytes: self.layout.block_layer_bytes(),
        })
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the pointer came from `malloc_sync` in `new`.
        let data = unsafe { ManuallyDrop::take(&mut self.data) };
        let _ = data.stream().context().bind_to_thread();
        let ptr = data.leak();
        // SAFETY: `leak` waited for the pool's pending work; nothing else frees it.
        let _ = unsafe { result::free_sync(ptr) };
    }
}

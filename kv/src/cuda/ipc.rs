//! CUDA IPC: the `cuda-ipc` KV transport between two processes on one node. The decode
//! worker exports a handle to its device KV pool ([`export_handle`]); the prefill worker opens
//! it once ([`OpenedPeer::open`]) and, after each forward pass, copies every finished layer's
//! blocks device to device into the blocks the decode worker reserved, on the stream of its
//! forward pass. It then commits over gRPC as the shared-memory transport does.

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};

use super::{check, cuda_err};
use crate::device::{CopyRun, DeviceKv};
use crate::error::Result;

/// The 64 opaque bytes that name a pool's allocation to other processes.
pub fn export_handle(pool: &DeviceKv) -> Result<[u8; 64]> {
    pool.context()
        .bind_to_thread()
        .map_err(|e| cuda_err("bind context", e))?;
    // SAFETY: `pool.base()` is the base of a live cuMemAlloc'd buffer (see `DeviceKv::new`).
    unsafe {
        let mut handle: sys::CUipcMemHandle = std::mem::zeroed();
        check(
            "cuIpcGetMemHandle",
            sys::cuIpcGetMemHandle(&mut handle, pool.base()),
        )?;
        let mut out = [0u8; 64];
        for (o, &b) in out.iter_mut().zip(handle.reserved.iter()) {
            *o = b as u8;
        }
        Ok(out)
    }
}

/// A peer's allocation mapped into this process (closed on drop, never freed here).
#[derive(Debug)]
pub struct OpenedPeer {
    pub ptr: sys::CUdeviceptr,
    context: Arc<CudaContext>,
}

impl OpenedPeer {
    /// Opens a handle from [`export_handle`] in `context` (which becomes current on the
    /// calling thread).
    pub fn open(handle: &[u8], context: &Arc<CudaContext>) -> Result<Self> {
        if handle.len() != 64 {
            return Err(cuda_err(
                "IPC handle",
                format!("{} bytes, expected 64", handle.len()),
            ));
        }
        context
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        // SAFETY: the handle came from a live allocation of another process on this node;
        // a stale or foreign one makes the driver return an error, not map memory.
        unsafe {
            let mut h: sys::CUipcMemHandle = std::mem::zeroed();
            for (r, &b) in h.reserved.iter_mut().zip(handle.iter()) {
                *r = b as _;
            }
            let mut ptr: sys::CUdeviceptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
            check(
                "cuIpcOpenMemHandle",
                sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags),
            )?;
            Ok(Self {
                ptr,
                context: context.clone(),
            })
        }
    }

    /// Queues `runs` from `src` (a pool of this process) into the peer's pool on `src`'s
    /// stream, after the forward pass that wrote them.
    ///
    /// # Safety
    /// Every run must lie inside both pools, in blocks the peer reserved for us, and the
    /// source must stay unchanged until the stream reaches these copies.
    pub unsafe fn copy_runs(&self, src: &DeviceKv, runs: &[CopyRun]) -> Result<()> {
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        for run in runs {
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    self.ptr + run.dst_offset as u64,
                    src.base() + run.src_offset as u64,
                    run.bytes,
                    src.stream().cu_stream(),
                )
            })?;
        }
        Ok(())
    }
}

impl Drop for OpenedPeer {
    fn drop(&mut self) {
        // SAFETY: the pointer came from cuIpcOpenMemHandle in `context` and is closed once.
        if self.context.bind_to_thread().is_ok() {
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

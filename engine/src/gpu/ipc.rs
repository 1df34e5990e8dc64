//! CUDA IPC: the `cuda-ipc` KV transport between two processes on one node. The decode
//! worker exports a handle to its device KV pool; the prefill worker opens it once and copies
//! each finished layer's blocks device to device (`cuMemcpyDtoDAsync`) into the reserved
//! blocks, then commits over gRPC as the shared-memory transport does.

use cudarc::driver::sys;

use super::cuda_err;
use crate::error::Result;

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_err(what, format!("{r:?}")))
    }
}

/// The 64 opaque bytes that name a device allocation to other processes.
pub fn export_handle(ptr: sys::CUdeviceptr) -> Result<[u8; 64]> {
    // SAFETY: `ptr` is the base of a live cuMemAlloc'd buffer owned by the caller.
    unsafe {
        let mut handle: sys::CUipcMemHandle = std::mem::zeroed();
        check(
            "cuIpcGetMemHandle",
            sys::cuIpcGetMemHandle(&mut handle, ptr),
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
}

impl OpenedPeer {
    /// Opens a handle from [`export_handle`] in the current context.
    pub fn open(handle: &[u8; 64]) -> Result<Self> {
        // SAFETY: the handle came from a live allocation of another process on this node.
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
            Ok(Self { ptr })
        }
    }

    /// Copies `bytes` from `src` (this process) to `offset` bytes into the peer's buffer on
    /// `stream`.
    ///
    /// # Safety
    /// `src..src+bytes` must be valid device memory and `offset + bytes` within the peer's
    /// allocation, in blocks the peer reserved for us.
    pub unsafe fn copy_in(
        &self,
        offset: usize,
        src: sys::CUdeviceptr,
        bytes: usize,
        stream: sys::CUstream,
    ) -> Result<()> {
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(self.ptr + offset as u64, src, bytes, stream)
        })
    }
}

impl Drop for OpenedPeer {
    fn drop(&mut self) {
        // SAFETY: the pointer came from cuIpcOpenMemHandle and is closed once.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

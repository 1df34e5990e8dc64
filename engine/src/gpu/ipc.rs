//! CUDA IPC: the `cuda-ipc` KV transport between two processes on one node. The decode
//! worker exports a handle to its device KV pool ([`export_handle`]); the prefill worker opens
//! it once ([`OpenedPeer::open`]) and, after each forward pass, copies every finished layer's
//! blocks device to device into the blocks the decode worker reserved, on the stream of its
//! forward pass. It then commits over gRPC as the shared-memory transport does.
//!
//! The raw driver calls live here so that the transport crate needs no CUDA types: pointers,
//! streams and contexts cross as integers (see [`crate::kv::DeviceKv`]).

use cudarc::driver::sys;

use super::cuda_err;
use crate::error::Result;
use crate::kv::CopyRun;

pub(crate) fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_err(what, format!("{r:?}")))
    }
}

/// Makes `context` current on this thread.
pub(crate) fn make_current(context: usize) -> Result<()> {
    // SAFETY: `context` is a live CUcontext of this process (from `DeviceKv::context`).
    check("cuCtxSetCurrent", unsafe {
        sys::cuCtxSetCurrent(context as sys::CUcontext)
    })
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
    context: usize,
}

impl OpenedPeer {
    /// Opens a handle from [`export_handle`] in `context` (a raw `CUcontext` of this
    /// process, which becomes current on the calling thread).
    pub fn open(handle: &[u8], context: usize) -> Result<Self> {
        if handle.len() != 64 {
            return Err(cuda_err(
                "IPC handle",
                format!("{} bytes, expected 64", handle.len()),
            ));
        }
        make_current(context)?;
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
            Ok(Self { ptr, context })
        }
    }

    /// Queues `runs` from the pool at `src_base` (this process) into the peer's pool on
    /// `stream` (a raw `CUstream` of `context`).
    ///
    /// # Safety
    /// Every run must lie inside both pools, in blocks the peer reserved for us, and the
    /// source must stay unchanged until the stream reaches these copies.
    pub unsafe fn copy_runs(&self, src_base: u64, runs: &[CopyRun], stream: usize) -> Result<()> {
        make_current(self.context)?;
        for run in runs {
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    self.ptr + run.dst_offset as u64,
                    src_base + run.src_offset as u64,
                    run.bytes,
                    stream as sys::CUstream,
                )
            })?;
        }
        Ok(())
    }
}

/// Waits until `stream` (a raw `CUstream` of `context`) has run everything queued on it.
pub fn synchronize(stream: usize, context: usize) -> Result<()> {
    make_current(context)?;
    // SAFETY: a live stream of this process.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream as sys::CUstream)
    })
}

impl Drop for OpenedPeer {
    fn drop(&mut self) {
        // SAFETY: the pointer came from cuIpcOpenMemHandle in `context` and is closed once.
        if make_current(self.context).is_ok() {
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

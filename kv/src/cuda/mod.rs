//! The CUDA pieces of the KV cache (cargo feature `cuda`): the device pool's allocation
//! ([`DevicePool`]), its IPC export and the peer mappings of the `cuda-ipc` transport
//! ([`ipc`]), and the NCCL links of the `nccl` transport ([`nccl`], feature `nccl`). Both the
//! engine (which computes into the pool) and the transports (which move it) use them, so they
//! live here rather than in either.
//!
//! Like the rest of tandem's GPU path, CUDA and NCCL load at run time (cudarc's dynamic
//! loading): building needs no toolkit. Contexts and streams travel as cudarc's typed handles.

pub mod ipc;
#[cfg(feature = "nccl")]
pub mod nccl;
mod pool;

pub use pool::DevicePool;

use std::sync::Arc;

use cudarc::driver::{CudaStream, sys};

use crate::error::{KvError, Result};

pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Display) -> KvError {
    KvError::Device(format!("CUDA {what}: {e}"))
}

/// A driver call's result as ours.
pub(crate) fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_err(what, format!("{r:?}")))
    }
}

/// Whether the CUDA driver library loads and reports at least one device.
pub fn device_present() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    let present = unsafe { sys::is_culib_present() };
    present && cudarc::driver::CudaContext::device_count().is_ok_and(|n| n > 0)
}

/// Seconds of the best of three device-to-device copies of `bytes` on `stream`: the
/// reference the GPU transports' rates are set against.
pub fn local_copy_seconds(stream: &Arc<CudaStream>, bytes: usize) -> Result<f64> {
    let a = stream
        .alloc_zeros::<u8>(bytes)
        .map_err(|e| cuda_err("allocation", e))?;
    let mut b = stream
        .alloc_zeros::<u8>(bytes)
        .map_err(|e| cuda_err("allocation", e))?;
    let sync = || stream.synchronize().map_err(|e| cuda_err("synchronize", e));
    let mut best = f64::MAX;
    for _ in 0..3 {
        sync()?;
        let t = std::time::Instant::now();
        stream
            .memcpy_dtod(&a, &mut b)
            .map_err(|e| cuda_err("copy", e))?;
        sync()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

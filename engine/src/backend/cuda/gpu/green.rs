//! Green contexts: a fixed number of a GPU's streaming multiprocessors for one worker, so a
//! prefill and a decode worker can share one device without either starving the other
//! (the GPU analogue of pinning the workers to separate CPU cores).
//!
//! The worker asks for `n` SMs; the driver splits the device's SM resource into a group of at
//! least `n` (rounded to its granularity) and the rest; work submitted to the green context's
//! stream runs only on that group.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};

use super::cuda_err;
use crate::error::{EngineError, Result};

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_err(what, format!("{r:?}")))
    }
}

/// A stream on a green context of `sms` SMs of `ctx`'s device.
pub fn stream_with_sms(ctx: &Arc<CudaContext>, sms: u32) -> Result<Arc<CudaStream>> {
    if sms == 0 {
        return Err(EngineError::Config(
            "a green context needs at least one SM".into(),
        ));
    }
    ctx.bind_to_thread()
        .map_err(|e| cuda_err("bind context", e))?;
    // SAFETY: plain driver calls on out-parameters we own; every result is checked.
    unsafe {
        let mut device_sms: sys::CUdevResource = std::mem::zeroed();
        check(
            "cuDeviceGetDevResource",
            sys::cuDeviceGetDevResource(
                ctx.cu_device(),
                &mut device_sms,
                sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
            ),
        )?;
        let mut group: sys::CUdevResource = std::mem::zeroed();
        let mut remaining: sys::CUdevResource = std::mem::zeroed();
        let mut groups: std::ffi::c_uint = 1;
        check(
            "cuDevSmResourceSplitByCount",
            sys::cuDevSmResourceSplitByCount(
                &mut group,
                &mut groups,
                &device_sms,
                &mut remaining,
                0,
                sms,
            ),
        )?;
        if groups != 1 {
            return Err(cuda_err(
                "green context",
                format!("could not carve a group of {sms} SMs"),
            ));
        }
        let mut desc: sys::CUdevResourceDesc = std::mem::zeroed();
        check(
            "cuDevResourceGenerateDesc",
            sys::cuDevResourceGenerateDesc(&mut desc, &mut group, 1),
        )?;
        let mut green: sys::CUgreenCtx = std::mem::zeroed();
        let flags = sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as std::ffi::c_uint;
        check(
            "cuGreenCtxCreate",
            sys::cuGreenCtxCreate(&mut green, desc, ctx.cu_device(), flags),
        )?;
        let mut stream: sys::CUstream = std::mem::zeroed();
        let non_blocking = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as std::ffi::c_uint;
        check(
            "cuGreenCtxStreamCreate",
            sys::cuGreenCtxStreamCreate(&mut stream, green, non_blocking, 0),
        )?;
        // The green context lives as long as the process: workers hold one for their lifetime.
        Ok(ctx.wrap_borrowed_stream(stream))
    }
}

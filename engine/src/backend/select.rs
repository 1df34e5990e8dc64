//! Picks the compute backend for the engine's configured device: the one place the engine
//! looks at the `cuda` feature.

use std::sync::Arc;

use super::{ComputeBackend, cpu};
use crate::device::Device;
use crate::error::Result;
use crate::model::Model;

/// The backend for `device`, with `num_blocks` KV blocks (the host cache's count).
pub fn for_device(
    device: &Device,
    model: &Arc<Model>,
    num_blocks: usize,
) -> Result<Box<dyn ComputeBackend>> {
    device.ensure_supported()?;
    match *device {
        Device::Cpu => Ok(Box::new(cpu::CpuBackend::new(model.clone()))),
        #[cfg(feature = "cuda")]
        Device::Cuda {
            ordinal,
            green_context_sms,
        } => {
            let gpu = Arc::new(super::cuda::gpu::GpuContext::new(
                ordinal,
                green_context_sms,
            )?);
            let device = super::cuda::gpu::CudaDevice::new(gpu);
            let backend = super::cuda::DeviceBackend::new(device, "cuda", model, num_blocks)?;
            tracing::info!(?backend, "engine on the GPU");
            Ok(Box::new(backend))
        }
        // `ensure_supported` refused it above: this build has no CUDA.
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => {
            let _ = num_blocks;
            Err(crate::error::EngineError::Unsupported(
                "this build has no CUDA support".into(),
            ))
        }
    }
}

//! The engine's device side: putting the compute on the configured device, and what the KV
//! transports need from a GPU engine (the device pool's address, its IPC export, whether
//! prompt KV must be staged on the host, and where received KV sits).

use super::Engine;
use crate::error::{EngineError, Result};
use tandem_kv::{DeviceKv, ExportedKv, KvLocation};

#[cfg(feature = "cuda")]
use crate::device::Device;

/// A prefilled sequence's KV: the reserved blocks it was written into, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedKv {
    pub blocks: Vec<u32>,
    pub location: KvLocation,
}

impl ReceivedKv {
    /// KV received into the host cache.
    pub fn host(blocks: Vec<u32>) -> Self {
        Self {
            blocks,
            location: KvLocation::Host,
        }
    }
}

impl Engine {
    /// Moves the compute to the configured device (nothing to do on the CPU).
    pub(super) fn attach_device(&mut self) -> Result<()> {
        self.config.device.ensure_supported()?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda {
            ordinal,
            green_context_sms,
        } = self.config.device
        {
            let gpu = std::sync::Arc::new(crate::gpu::GpuContext::new(ordinal, green_context_sms)?);
            let backend = crate::gpu::GpuBackend::new(gpu, &self.model, self.cache.num_blocks())?;
            tracing::info!(?backend, "engine on the GPU");
            self.gpu = Some(backend);
        }
        Ok(())
    }

    /// The device KV pool, when the engine runs on a GPU.
    pub fn device_kv(&self) -> Option<DeviceKv> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            return Some(gpu.device_kv());
        }
        None
    }

    /// An IPC export of the device KV pool (`None` on the CPU).
    pub fn export_device_kv(&self) -> Result<Option<ExportedKv>> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            return gpu.export_kv().map(Some);
        }
        Ok(None)
    }

    /// Whether a GPU engine copies prompt KV to the host cache after each forward pass with
    /// prompt work (on by default; a prefill worker turns it off while every transfer in
    /// flight copies device to device). No effect on the CPU, where the host cache is the KV.
    pub fn set_host_kv_export(&mut self, on: bool) {
        self.host_kv_export = on;
    }

    /// Makes received KV visible to the forward pass: uploads it on a GPU engine when it
    /// arrived in the host cache; refuses device-resident KV on a CPU engine.
    pub(super) fn place_received_kv(&mut self, blocks: &[u32], kv: KvLocation) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = self.gpu.as_mut() {
            if kv == KvLocation::Host {
                gpu.upload_blocks(&self.cache, blocks)?;
            }
            return Ok(());
        }
        let _ = blocks;
        match kv {
            KvLocation::Host => Ok(()),
            KvLocation::Device => Err(EngineError::InvalidKv(
                "the KV arrived in device memory but this engine runs on the CPU".into(),
            )),
        }
    }
}

//! The CUDA path (cargo feature `cuda`): the Llama forward pass with bf16 weights and a paged
//! bf16 KV cache in GPU memory, cuBLAS for the projections and NVRTC-compiled kernels for the
//! rest, plus green contexts (a fixed SM share per worker). The device KV pool, its IPC
//! export and the NCCL links are `tandem_kv::cuda`'s: the transports use them too.
//!
//! Everything loads CUDA at run time (cudarc's dynamic loading): building needs no toolkit,
//! and a binary with this feature still starts, and reports it, on a machine without a GPU.
//! [`available`] says whether a device can be used.

mod device;
pub mod green;
mod model;

pub use device::CudaDevice;
pub use model::GpuModel;

use std::sync::{Arc, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::KERNELS_SRC;
use super::launch::Kernel;
use crate::error::{EngineError, Result};

pub(crate) use crate::error::cuda_err;

/// The device pool of `num_blocks` blocks for a model of `cfg`'s shape.
pub fn pool_layout(
    cfg: &crate::config::ModelConfig,
    num_blocks: usize,
) -> tandem_kv::DevicePoolLayout {
    tandem_kv::DevicePoolLayout {
        num_layers: cfg.num_hidden_layers,
        num_blocks,
        block_layer_elems: super::forward::block_layer_elems(cfg),
    }
}

/// A zeroed device pool for `cfg`'s shape: `num_blocks` blocks, or as many as `budget_bytes`
/// holds.
pub fn device_pool(
    gpu: &GpuContext,
    cfg: &crate::config::ModelConfig,
    size: PoolSize,
) -> Result<tandem_kv::cuda::DevicePool> {
    let num_blocks = match size {
        PoolSize::Blocks(n) => n,
        PoolSize::Budget(bytes) => bytes / pool_layout(cfg, 1).bytes(),
    };
    if num_blocks == 0 {
        return Err(EngineError::Config(format!(
            "a device KV pool of {size:?} holds no block"
        )));
    }
    Ok(tandem_kv::cuda::DevicePool::new(
        &gpu.stream,
        pool_layout(cfg, num_blocks),
    )?)
}

/// How large a device pool to allocate.
#[derive(Debug, Clone, Copy)]
pub enum PoolSize {
    Blocks(usize),
    Budget(usize),
}

/// Whether the CUDA driver library can be loaded and reports at least one device.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(tandem_kv::cuda::device_present)
}

/// Whether NVRTC can be loaded (kernels compile without a GPU).
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles the kernels to PTX (for `arch`, e.g. `compute_90`; `None` lets NVRTC choose).
pub fn compile_kernels(arch: Option<&'static str>) -> Result<cudarc::nvrtc::Ptx> {
    let opts = CompileOptions {
        arch,
        // Exact division and square roots keep the GPU close to the CPU reference.
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ..CompileOptions::default()
    };
    compile_ptx_with_opts(KERNELS_SRC, opts).map_err(|e| cuda_err("kernel compilation", e))
}

/// The compiled kernels of one context.
pub(crate) struct Kernels {
    pub embed_rows: CudaFunction,
    pub rms_norm_bf16: CudaFunction,
    pub rope_qk: CudaFunction,
    pub kv_write: CudaFunction,
    pub paged_attention: CudaFunction,
    pub silu_mul_bf16: CudaFunction,
    pub add_in_place: CudaFunction,
    pub gather_rows: CudaFunction,
    pub fill_uniform_bf16: CudaFunction,
    pub gather_kv_blocks: CudaFunction,
    pub scatter_kv_blocks: CudaFunction,
}

impl Kernels {
    pub(crate) fn function(&self, kernel: Kernel) -> &CudaFunction {
        match kernel {
            Kernel::EmbedRows => &self.embed_rows,
            Kernel::RmsNormBf16 => &self.rms_norm_bf16,
            Kernel::RopeQk => &self.rope_qk,
            Kernel::KvWrite => &self.kv_write,
            Kernel::PagedAttention => &self.paged_attention,
            Kernel::SiluMulBf16 => &self.silu_mul_bf16,
            Kernel::AddInPlace => &self.add_in_place,
            Kernel::GatherRows => &self.gather_rows,
            Kernel::FillUniformBf16 => &self.fill_uniform_bf16,
            Kernel::GatherKvBlocks => &self.gather_kv_blocks,
            Kernel::ScatterKvBlocks => &self.scatter_kv_blocks,
        }
    }
}

/// A device, the stream the forward pass runs on, cuBLAS and the kernels.
pub struct GpuContext {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// A second stream for bringing KV down while `stream` computes later layers.
    pub copy_stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    pub(crate) kernels: Kernels,
    /// Streaming multiprocessors this context computes on (all of them, or a green share).
    pub sms: u32,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("sms", &self.sms)
            .finish_non_exhaustive()
    }
}

impl GpuContext {
    /// Opens device `ordinal`. With `green_sms`, work is confined to a green context of that
    /// many SMs (see [`green`]); otherwise the whole device (or the MPS share the environment
    /// sets) is used.
    pub fn new(ordinal: usize, green_sms: Option<u32>) -> Result<Self> {
        if !available() {
            return Err(EngineError::Unsupported(
                "no CUDA device (or no CUDA driver library) on this machine".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("context", e))?;
        let total_sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| cuda_err("device attribute", e))? as u32;
        let (stream, sms) = match green_sms {
            Some(n) => (green::stream_with_sms(&ctx, n)?, n.min(total_sms)),
            None => (ctx.default_stream(), total_sms),
        };
        let major = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| cuda_err("device attribute", e))?;
        let arch = match major {
            9 => Some("compute_90"),
            8 => Some("compute_80"),
            10 => Some("compute_100"),
            _ => None,
        };
        let module = ctx
            .load_module(compile_kernels(arch)?)
            .map_err(|e| cuda_err("module load", e))?;
        let f = |kernel: Kernel| {
            module
                .load_function(kernel.name())
                .map_err(|e| cuda_err(&format!("kernel {}", kernel.name()), e))
        };
        let kernels = Kernels {
            embed_rows: f(Kernel::EmbedRows)?,
            rms_norm_bf16: f(Kernel::RmsNormBf16)?,
            rope_qk: f(Kernel::RopeQk)?,
            kv_write: f(Kernel::KvWrite)?,
            paged_attention: f(Kernel::PagedAttention)?,
            silu_mul_bf16: f(Kernel::SiluMulBf16)?,
            add_in_place: f(Kernel::AddInPlace)?,
            gather_rows: f(Kernel::GatherRows)?,
            fill_uniform_bf16: f(Kernel::FillUniformBf16)?,
            gather_kv_blocks: f(Kernel::GatherKvBlocks)?,
            scatter_kv_blocks: f(Kernel::ScatterKvBlocks)?,
        };
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err("cuBLAS", e))?;
        let copy_stream = stream
            .context()
            .new_stream()
            .map_err(|e| cuda_err("copy stream", e))?;
        Ok(Self {
            ctx,
            stream,
            copy_stream,
            blas,
            kernels,
            sms,
        })
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("synchronize", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels compile wherever NVRTC can be loaded, GPU or not (skips otherwise).
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !nvrtc_available() {
            assert!(
                std::env::var_os("TANDEM_REQUIRE_NVRTC").is_none(),
                "TANDEM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
            );
            eprintln!("skipping: libnvrtc not found (set LD_LIBRARY_PATH to a CUDA 13 lib folder)");
            return;
        }
        let ptx = compile_kernels(Some("compute_90")).expect("kernels compile");
        let text = ptx.to_src();
        for kernel in Kernel::ALL {
            let name = kernel.name();
            assert!(text.contains(name), "{name} missing from the PTX");
        }
    }

    #[test]
    fn no_device_is_a_clear_error() {
        if available() {
            return;
        }
        let err = GpuContext::new(0, None).unwrap_err().to_string();
        assert!(err.contains("no CUDA device"), "{err}");
    }
}

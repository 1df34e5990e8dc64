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

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, PinnedHostSlice};
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

/// The compiled kernels of one context, in [`Kernel::ALL`]'s order.
pub(crate) struct Kernels(Vec<CudaFunction>);

impl Kernels {
    pub(crate) fn function(&self, kernel: Kernel) -> &CudaFunction {
        &self.0[kernel as usize]
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
    /// Compute capability 8.0 or later: bf16 `mma.sync` (the tensor-core attention).
    pub bf16_mma: bool,
    /// Page-locked host memory the logits come down through, kept across steps.
    pub(crate) logits_staging: Mutex<Option<PinnedHostSlice<f32>>>,
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
        let kernels = Kernels(Kernel::ALL.into_iter().map(f).collect::<Result<_>>()?);
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
            bf16_mma: major >= 8,
            logits_staging: Mutex::new(None),
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

    /// Whether NVRTC loads here; a test that needs it skips where not, unless
    /// TANDEM_REQUIRE_NVRTC says it must be there (CI's NVRTC stage).
    fn nvrtc_here() -> bool {
        if nvrtc_available() {
            return true;
        }
        assert!(
            std::env::var_os("TANDEM_REQUIRE_NVRTC").is_none(),
            "TANDEM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
        );
        eprintln!("skipping: libnvrtc not found (set LD_LIBRARY_PATH to a CUDA 13 lib folder)");
        false
    }

    /// The kernels compile wherever NVRTC can be loaded, GPU or not (skips otherwise).
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !nvrtc_here() {
            return;
        }
        let ptx = compile_kernels(Some("compute_90")).expect("kernels compile");
        let text = ptx.to_src();
        for kernel in Kernel::ALL {
            let name = kernel.name();
            assert!(text.contains(name), "{name} missing from the PTX");
        }
    }

    /// ptxas' resource report for the kernels compiled to sm_90 machine code: the lines
    /// after each "Compiling entry function" line, per kernel.
    fn ptxas_report() -> Vec<(String, String)> {
        use cudarc::nvrtc::result;
        let src = std::ffi::CString::new(KERNELS_SRC).expect("no NUL in the source");
        let prog = result::create_program(&src, None).expect("program");
        let opts = ["--gpu-architecture=sm_90", "--ptxas-options=-v"];
        // SAFETY: `prog` is live until destroyed below; the options are plain strings.
        let log = unsafe {
            let compiled = result::compile_program(prog, &opts);
            let log = result::get_program_log(prog).expect("log");
            result::destroy_program(prog).expect("destroy");
            (compiled, log)
        };
        let text: String = log
            .1
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8 as char)
            .collect();
        if let Err(e) = log.0 {
            panic!("kernels do not compile to sm_90: {e:?}\n{text}");
        }
        let mut out: Vec<(String, String)> = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                let name = rest.split('\'').next().unwrap_or_default().to_string();
                out.push((name, String::new()));
            } else if let Some((_, report)) = out.last_mut() {
                report.push_str(line);
                report.push('\n');
            }
        }
        out
    }

    /// The hot kernels keep everything in registers: a zero-byte stack frame and no spills
    /// in ptxas' report (a register array indexed at run time would land in local memory).
    /// Not rope_kv_write: the exact cosf/sinf it needs keep a 32-byte frame for their
    /// reduction of huge arguments (past about 1e5 radians), a path positions rarely reach.
    #[test]
    fn hot_kernels_have_no_stack_frame_or_spills() {
        if !nvrtc_here() {
            return;
        }
        let report = ptxas_report();
        for kernel in [
            Kernel::FlashAttention,
            Kernel::AttentionCombine,
            Kernel::RmsNormBf16,
        ] {
            let (_, lines) = report
                .iter()
                .find(|(name, _)| name == kernel.name())
                .unwrap_or_else(|| panic!("{} not in ptxas' report:\n{report:?}", kernel.name()));
            eprintln!("{}: {}", kernel.name(), lines.replace('\n', " "));
            assert!(
                lines.contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
                "{}: {lines}",
                kernel.name()
            );
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

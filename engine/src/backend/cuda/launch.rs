//! The device interface that tandem's GPU code is written against ([`LaunchDevice`]): device
//! buffers, transfers, events, the KV pool, launches of the kernels in `kernels.cu`
//! ([`Kernel`]) and GEMMs.
//!
//! A launch is a kernel, a grid and its arguments as a list of [`KernelArg`], in the kernel's
//! parameter order. The lists are written once, by the code that launches (the forward pass,
//! KV staging); a device only turns them into its own call. So the CUDA device
//! (`gpu::CudaDevice`) and the emulated device of the tests (which runs the kernels on the
//! CPU and checks every argument's type against the kernel's parameters) launch the very
//! same lists.

use half::bf16;
use tandem_kv::{DeviceKv, DevicePoolLayout, ExportedKv};

use crate::error::Result;

/// Grid and block size of one launch (1-D).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub blocks: u32,
    pub threads: u32,
}

impl Launch {
    /// Enough blocks of `threads` for `n` threads (at least one block).
    pub fn covering(n: usize, threads: u32) -> Self {
        Self {
            blocks: (n as u32).div_ceil(threads).max(1),
            threads,
        }
    }

    /// One block per row.
    pub fn per_row(rows: usize, threads: u32) -> Self {
        Self {
            blocks: rows.max(1) as u32,
            threads,
        }
    }

    /// `rope_kv_write`'s launch for `rows` tokens of `heads` Q and K heads, and the heads each
    /// block takes: a block per token once the tokens alone give every SM two blocks; fewer
    /// tokens (a decode step) split their heads between blocks, so one token is not a lone
    /// block walking 40 heads on one SM while the rest idle.
    pub fn rope(rows: usize, heads: usize, multiprocessors: usize) -> (Self, usize) {
        let (rows, heads) = (rows.max(1), heads.max(1));
        let wanted = 2 * multiprocessors.max(1);
        let groups = wanted.div_ceil(rows).clamp(1, heads);
        let per_block = heads.div_ceil(groups);
        let groups = heads.div_ceil(per_block);
        (Self::per_row(rows * groups, 128), per_block)
    }
}

/// The kernels of `kernels.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    EmbedRows,
    RmsNormBf16,
    RopeKvWrite,
    PagedAttention,
    SiluMulBf16,
    GatherRows,
    FillUniformBf16,
    GatherKvBlocks,
    ScatterKvBlocks,
    FlashAttention,
    AttentionCombine,
}

impl Kernel {
    /// Every kernel, in declaration order (`kernel as usize` indexes it).
    pub const ALL: [Kernel; 11] = [
        Kernel::EmbedRows,
        Kernel::RmsNormBf16,
        Kernel::RopeKvWrite,
        Kernel::PagedAttention,
        Kernel::SiluMulBf16,
        Kernel::GatherRows,
        Kernel::FillUniformBf16,
        Kernel::GatherKvBlocks,
        Kernel::ScatterKvBlocks,
        Kernel::FlashAttention,
        Kernel::AttentionCombine,
    ];

    /// The kernel's name in `kernels.cu`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::EmbedRows => "embed_rows",
            Kernel::RmsNormBf16 => "rms_norm_bf16",
            Kernel::RopeKvWrite => "rope_kv_write",
            Kernel::PagedAttention => "paged_attention",
            Kernel::SiluMulBf16 => "silu_mul_bf16",
            Kernel::GatherRows => "gather_rows",
            Kernel::FillUniformBf16 => "fill_uniform_bf16",
            Kernel::GatherKvBlocks => "gather_kv_blocks",
            Kernel::ScatterKvBlocks => "scatter_kv_blocks",
            Kernel::FlashAttention => "flash_attention",
            Kernel::AttentionCombine => "attention_combine",
        }
    }
}

/// One argument of a launch: a device buffer (read, or written: `…Mut`) or a scalar, typed as
/// the kernel's parameter (`float*`, `bf16*`, `int*`, `unsigned int*`, `int`, `long long`,
/// `unsigned long long`, `float`).
pub enum KernelArg<'a, D: LaunchDevice + ?Sized> {
    F32(&'a D::F32),
    F32Mut(&'a mut D::F32),
    Bf16(&'a D::Bf16),
    Bf16Mut(&'a mut D::Bf16),
    I32s(&'a D::I32),
    U32s(&'a D::U32),
    Int(i32),
    Long(i64),
    ULong(u64),
    Float(f32),
}

/// What tandem's GPU code needs from a device.
pub trait LaunchDevice {
    type F32;
    type Bf16;
    type I32;
    type U32;
    /// A point in the device's queue of work.
    type Event;
    /// A device KV pool ([`DevicePoolLayout`]'s geometry, bf16).
    type Pool;

    /// Streaming multiprocessors: how many blocks fill the device (attention splits long
    /// contexts until a launch has about two per multiprocessor).
    fn multiprocessors(&self) -> usize;
    /// Whether the tensor-core kernels run here (bf16 `mma.sync`, compute capability 8.0+);
    /// where not, attention takes the CUDA-core kernel.
    fn bf16_mma(&self) -> bool;

    /// A zeroed KV pool of `layout`.
    fn alloc_pool(&self, layout: DevicePoolLayout) -> Result<Self::Pool>;
    fn pool_data(pool: &Self::Pool) -> &Self::Bf16;
    fn pool_data_mut(pool: &mut Self::Pool) -> &mut Self::Bf16;
    /// The pool as transports see it, where they can reach device memory (not emulated).
    fn describe_pool(pool: &Self::Pool) -> Option<DeviceKv>;
    /// An IPC export of the pool for another process on the node, where there is one.
    fn export_pool(pool: &Self::Pool) -> Result<Option<ExportedKv>>;

    fn upload_f32(&self, host: &[f32]) -> Result<Self::F32>;
    fn upload_bf16(&self, host: &[bf16]) -> Result<Self::Bf16>;
    fn upload_i32(&self, host: &[i32]) -> Result<Self::I32>;
    fn upload_u32(&self, host: &[u32]) -> Result<Self::U32>;
    fn zeros_f32(&self, n: usize) -> Result<Self::F32>;
    fn zeros_bf16(&self, n: usize) -> Result<Self::Bf16>;
    /// Waits for queued work, then copies the first `n` elements of `buf` into `host`, which
    /// ends up `n` long (its memory reused where it has the room).
    fn download_f32_into(&self, buf: &Self::F32, n: usize, host: &mut Vec<f32>) -> Result<()>;
    /// Waits for queued work, then copies `buf` into `host` (of the same length).
    fn download_bf16_into(&self, buf: &Self::Bf16, host: &mut [bf16]) -> Result<()>;
    /// Copies `host` into `buf` (of the same length); `host` may be reused on return.
    fn upload_bf16_into(&self, host: &[bf16], buf: &mut Self::Bf16) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
    /// Marks everything queued so far.
    fn record_event(&self) -> Result<Self::Event>;
    /// Copies `buf` into `host` (of the same length) once the work before `event` is done,
    /// without waiting for work queued after it: the forward pass keeps computing later
    /// layers while an earlier layer's KV comes down.
    fn download_bf16_after(
        &self,
        event: &Self::Event,
        buf: &Self::Bf16,
        host: &mut [bf16],
    ) -> Result<()>;

    /// Queues `kernel` over `at` with `args`, in the kernel's parameter order.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters, and every buffer must be as large as the
    /// launch reads and writes: the kernels index them unchecked.
    unsafe fn launch(
        &self,
        kernel: Kernel,
        at: Launch,
        args: &mut [KernelArg<'_, Self>],
    ) -> Result<()>;

    /// `out[rows × n] (f32) = x[rows × k] (bf16) · Wᵀ`, `W` row-major `n × k`
    /// ([`crate::backend::cuda::blas::linear_call`] on cuBLAS); with `accumulate`, added to
    /// what `out` holds (beta 1: the residual stream takes a projection without a kernel of
    /// its own).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        x: &Self::Bf16,
        w: &Self::Bf16,
        out: &mut Self::F32,
        rows: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()>;
}

/// A device f32 buffer kept across steps, grown when a step needs more, never shrunk: the
/// splits' partial results, the logits.
pub struct Scratch<D: LaunchDevice> {
    buf: Option<D::F32>,
    len: usize,
}

impl<D: LaunchDevice> Default for Scratch<D> {
    fn default() -> Self {
        Self { buf: None, len: 0 }
    }
}

impl<D: LaunchDevice> Scratch<D> {
    /// The buffer, of `n` elements at least (contents unspecified).
    pub fn at_least(&mut self, dev: &D, n: usize) -> Result<&mut D::F32> {
        if self.buf.is_none() || n > self.len {
            self.len = n.max(1);
            self.buf = Some(dev.zeros_f32(self.len)?);
        }
        Ok(self.buf.as_mut().expect("allocated just above"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_shapes_cover_their_work() {
        assert_eq!(Launch::covering(0, 256).blocks, 1);
        assert_eq!(Launch::covering(257, 256).blocks, 2);
        assert_eq!(Launch::per_row(0, 128).blocks, 1);
        assert_eq!(Launch::per_row(5, 128).blocks, 5);
    }

    #[test]
    fn rope_splits_heads_only_when_tokens_are_few() {
        // Llama-3.1-8B: 32 Q + 8 K heads, an H100's 132 SMs.
        let (launch, per_block) = Launch::rope(1, 40, 132);
        assert_eq!((launch.blocks, per_block), (40, 1));
        let (launch, per_block) = Launch::rope(8, 40, 132);
        assert_eq!((launch.blocks, per_block), (8 * 20, 2));
        let (launch, per_block) = Launch::rope(2048, 40, 132);
        assert_eq!((launch.blocks, per_block), (2048, 40));
        // Every (token, head) is some block's: groups x per_block covers the heads.
        for rows in [1, 3, 8, 50, 131, 264, 1000] {
            for heads in [1, 3, 40, 56] {
                let (launch, per_block) = Launch::rope(rows, heads, 132);
                let groups = launch.blocks as usize / rows;
                assert_eq!(launch.blocks as usize, rows * groups);
                assert!(groups * per_block >= heads && (groups - 1) * per_block < heads);
            }
        }
    }

    #[test]
    fn all_lists_the_kernels_in_declaration_order() {
        for (i, k) in Kernel::ALL.into_iter().enumerate() {
            assert_eq!(k as usize, i, "{k:?}");
        }
    }

    #[test]
    fn every_kernel_is_in_the_source_under_its_name() {
        let source = include_str!("kernels.cu");
        for k in Kernel::ALL {
            let decl = format!("__global__ void {}(", k.name());
            assert!(source.contains(&decl), "{decl} missing from kernels.cu");
        }
    }
}

//! [`CudaDevice`]: the CUDA implementation of [`LaunchDevice`], so the generic forward pass
//! ([`crate::device_forward`]) runs on a GPU: cudarc buffers on the context's stream, the
//! NVRTC kernels launched with exactly the arguments `kernels.cu` declares, and cuBLAS
//! bf16 GEMMs with f32 accumulation; and [`StagingDevice`] for the host staging of its KV.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig, PushKernelArg,
};
use half::bf16;

use super::{GpuContext, cuda_err};
use crate::blas_layout::{Op, linear_call};
use crate::device_forward::{AttnShape, BatchBuffers, Launch, LaunchDevice};
use crate::device_staging::StagingDevice;
use crate::error::Result;

/// A GPU context as a [`LaunchDevice`].
#[derive(Debug, Clone)]
pub struct CudaDevice {
    pub gpu: Arc<GpuContext>,
}

fn config(at: Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (at.blocks, 1, 1),
        block_dim: (at.threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaDevice {
    fn builder<'a>(&'a self, kernel: &'a CudaFunction) -> LaunchArgs<'a> {
        self.gpu.stream.launch_builder(kernel)
    }
}

/// Launches a filled builder.
///
/// # Safety
/// The arguments must be those the kernel declares, and every buffer must be as large as
/// the launch reads and writes (the generic forward pass sizes them).
unsafe fn go(mut b: LaunchArgs<'_>, at: Launch, what: &str) -> Result<()> {
    // SAFETY: as the caller promised.
    unsafe { b.launch(config(at)) }
        .map(|_| ())
        .map_err(|e| cuda_err(&format!("{what} launch"), e))
}

impl LaunchDevice for CudaDevice {
    type F32 = CudaSlice<f32>;
    type Bf16 = CudaSlice<bf16>;
    type I32 = CudaSlice<i32>;
    type U32 = CudaSlice<u32>;

    fn upload_f32(&self, host: &[f32]) -> Result<Self::F32> {
        self.gpu
            .stream
            .clone_htod(host)
            .map_err(|e| cuda_err("upload", e))
    }
    fn upload_bf16(&self, host: &[bf16]) -> Result<Self::Bf16> {
        self.gpu
            .stream
            .clone_htod(host)
            .map_err(|e| cuda_err("upload", e))
    }
    fn upload_i32(&self, host: &[i32]) -> Result<Self::I32> {
        self.gpu
            .stream
            .clone_htod(host)
            .map_err(|e| cuda_err("upload", e))
    }
    fn upload_u32(&self, host: &[u32]) -> Result<Self::U32> {
        self.gpu
            .stream
            .clone_htod(host)
            .map_err(|e| cuda_err("upload", e))
    }
    fn zeros_f32(&self, n: usize) -> Result<Self::F32> {
        self.gpu
            .stream
            .alloc_zeros::<f32>(n)
            .map_err(|e| cuda_err("allocation", e))
    }
    fn zeros_bf16(&self, n: usize) -> Result<Self::Bf16> {
        self.gpu
            .stream
            .alloc_zeros::<bf16>(n)
            .map_err(|e| cuda_err("allocation", e))
    }
    fn download_f32(&self, buf: &Self::F32) -> Result<Vec<f32>> {
        self.gpu
            .stream
            .clone_dtoh(buf)
            .map_err(|e| cuda_err("download", e))
    }
    fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
    }

    fn embed_rows(
        &self,
        at: Launch,
        table: &Self::Bf16,
        tokens: &Self::U32,
        out: &mut Self::F32,
        rows: i32,
        hidden: i32,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.embed_rows);
        b.arg(table).arg(tokens).arg(out).arg(&rows).arg(&hidden);
        // SAFETY: embed_rows(bf16*, u32*, f32*, int, int).
        unsafe { go(b, at, "embed_rows") }
    }

    fn rms_norm_bf16(
        &self,
        at: Launch,
        x: &Self::F32,
        weight: &Self::F32,
        out: &mut Self::Bf16,
        rows: i32,
        hidden: i32,
        eps: f32,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.rms_norm_bf16);
        b.arg(x)
            .arg(weight)
            .arg(out)
            .arg(&rows)
            .arg(&hidden)
            .arg(&eps);
        // SAFETY: rms_norm_bf16(f32*, f32*, bf16*, int, int, float).
        unsafe { go(b, at, "rms_norm_bf16") }
    }

    fn rope_qk(
        &self,
        at: Launch,
        qkv: &mut Self::F32,
        positions: &Self::I32,
        inv_freq: &Self::F32,
        rows: i32,
        row_width: i32,
        q_heads: i32,
        kv_heads: i32,
        head_dim: i32,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.rope_qk);
        b.arg(qkv)
            .arg(positions)
            .arg(inv_freq)
            .arg(&rows)
            .arg(&row_width)
            .arg(&q_heads)
            .arg(&kv_heads)
            .arg(&head_dim);
        // SAFETY: rope_qk(f32*, int*, f32*, int × 5).
        unsafe { go(b, at, "rope_qk") }
    }

    fn kv_write(
        &self,
        at: Launch,
        qkv: &Self::F32,
        batch: &BatchBuffers<Self>,
        cache: &mut Self::Bf16,
        layer_offset: i64,
        s: &AttnShape,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.kv_write);
        b.arg(qkv)
            .arg(&batch.positions)
            .arg(&batch.token_seq)
            .arg(&batch.tables)
            .arg(&batch.max_blocks)
            .arg(cache)
            .arg(&layer_offset)
            .arg(&s.rows)
            .arg(&s.row_width)
            .arg(&s.q_width)
            .arg(&s.kv_heads)
            .arg(&s.head_dim);
        // SAFETY: kv_write(f32*, int*, int*, int*, int, bf16*, long long, int × 5).
        unsafe { go(b, at, "kv_write") }
    }

    fn paged_attention(
        &self,
        at: Launch,
        qkv: &Self::F32,
        batch: &BatchBuffers<Self>,
        cache: &Self::Bf16,
        layer_offset: i64,
        out: &mut Self::Bf16,
        s: &AttnShape,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.paged_attention);
        b.arg(qkv)
            .arg(&batch.positions)
            .arg(&batch.token_seq)
            .arg(&batch.tables)
            .arg(&batch.max_blocks)
            .arg(cache)
            .arg(&layer_offset)
            .arg(out)
            .arg(&s.rows)
            .arg(&s.row_width)
            .arg(&s.q_heads)
            .arg(&s.kv_heads)
            .arg(&s.head_dim)
            .arg(&s.scale);
        // SAFETY: paged_attention(f32*, int*, int*, int*, int, bf16*, long long, bf16*,
        // int × 5, float).
        unsafe { go(b, at, "paged_attention") }
    }

    fn silu_mul_bf16(
        &self,
        at: Launch,
        gate_up: &Self::F32,
        out: &mut Self::Bf16,
        rows: i32,
        f: i32,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.silu_mul_bf16);
        b.arg(gate_up).arg(out).arg(&rows).arg(&f);
        // SAFETY: silu_mul_bf16(f32*, bf16*, int, int).
        unsafe { go(b, at, "silu_mul_bf16") }
    }

    fn add_in_place(&self, at: Launch, x: &mut Self::F32, y: &Self::F32, n: i64) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.add_in_place);
        b.arg(x).arg(y).arg(&n);
        // SAFETY: add_in_place(f32*, f32*, long long).
        unsafe { go(b, at, "add_in_place") }
    }

    fn gather_rows(
        &self,
        at: Launch,
        x: &Self::F32,
        rows_idx: &Self::I32,
        out: &mut Self::F32,
        count: i32,
        width: i32,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.gather_rows);
        b.arg(x).arg(rows_idx).arg(out).arg(&count).arg(&width);
        // SAFETY: gather_rows(f32*, int*, f32*, int, int).
        unsafe { go(b, at, "gather_rows") }
    }

    fn gemm(
        &self,
        x: &Self::Bf16,
        w: &Self::Bf16,
        out: &mut Self::F32,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let stream = &self.gpu.stream;
        let (alpha, beta) = (1f32, 0f32);
        let call = linear_call(rows, n, k);
        let op = |o: Op| match o {
            Op::N => blas_sys::cublasOperation_t::CUBLAS_OP_N,
            Op::T => blas_sys::cublasOperation_t::CUBLAS_OP_T,
        };
        let (a, _ga) = w.device_ptr(stream);
        let (b, _gb) = x.device_ptr(stream);
        let (c, _gc) = out.device_ptr_mut(stream);
        // SAFETY: the buffers hold n·k, rows·k and rows·n elements (the forward pass sizes
        // them); `linear_call` maps the row-major product onto these column-major arguments.
        unsafe {
            blas::gemm_ex(
                *self.gpu.blas.handle(),
                op(call.transa),
                op(call.transb),
                call.m as i32,
                call.n as i32,
                call.k as i32,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                call.lda as i32,
                b as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                call.ldb as i32,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                call.ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| cuda_err("cuBLAS gemm", e))
    }
}

impl StagingDevice for CudaDevice {
    fn gather_kv_blocks(
        &self,
        at: Launch,
        cache: &Self::Bf16,
        layer_offset: i64,
        ids: &Self::I32,
        count: i32,
        block_elems: i32,
        out: &mut Self::Bf16,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.gather_kv_blocks);
        b.arg(cache)
            .arg(&layer_offset)
            .arg(ids)
            .arg(&count)
            .arg(&block_elems)
            .arg(out);
        // SAFETY: gather_kv_blocks(bf16*, long long, int*, int, int, bf16*); `KvStaging`
        // checked every id against the pool and sized `out` for `count` blocks.
        unsafe { go(b, at, "gather_kv_blocks") }
    }

    fn scatter_kv_blocks(
        &self,
        at: Launch,
        staged: &Self::Bf16,
        ids: &Self::I32,
        count: i32,
        block_elems: i32,
        cache: &mut Self::Bf16,
        layer_offset: i64,
    ) -> Result<()> {
        let mut b = self.builder(&self.gpu.kernels.scatter_kv_blocks);
        b.arg(staged)
            .arg(ids)
            .arg(&count)
            .arg(&block_elems)
            .arg(cache)
            .arg(&layer_offset);
        // SAFETY: scatter_kv_blocks(bf16*, int*, int, int, bf16*, long long); as above.
        unsafe { go(b, at, "scatter_kv_blocks") }
    }

    fn download_bf16_into(&self, buf: &Self::Bf16, host: &mut [bf16]) -> Result<()> {
        self.gpu
            .stream
            .memcpy_dtoh(buf, host)
            .map_err(|e| cuda_err("KV download", e))?;
        self.gpu.synchronize()
    }

    fn upload_bf16_into(&self, host: &[bf16], buf: &mut Self::Bf16) -> Result<()> {
        self.gpu
            .stream
            .memcpy_htod(host, buf)
            .map_err(|e| cuda_err("KV upload", e))
    }
}

//! [`CudaDevice`]: the CUDA implementation of [`LaunchDevice`], so the generic forward pass
//! ([`super::super::forward`]) and KV staging ([`super::super::staging`]) run on a GPU:
//! cudarc buffers on the context's stream, the NVRTC kernels launched with the argument
//! lists their callers give, and cuBLAS bf16 GEMMs with f32 accumulation.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;
use tandem_kv::cuda::DevicePool;
use tandem_kv::{DeviceKv, DevicePoolLayout, ExportedKv};

use super::super::blas::{Op, linear_call};
use super::super::launch::{Kernel, KernelArg, Launch, LaunchDevice};
use super::{GpuContext, cuda_err};
use crate::error::Result;

/// A GPU context as a [`LaunchDevice`].
#[derive(Debug, Clone)]
pub struct CudaDevice {
    pub gpu: Arc<GpuContext>,
}

impl CudaDevice {
    pub fn new(gpu: Arc<GpuContext>) -> Self {
        Self { gpu }
    }
}

impl LaunchDevice for CudaDevice {
    type F32 = CudaSlice<f32>;
    type Bf16 = CudaSlice<bf16>;
    type I32 = CudaSlice<i32>;
    type U32 = CudaSlice<u32>;
    type Event = CudaEvent;
    type Pool = DevicePool;

    fn multiprocessors(&self) -> usize {
        self.gpu.sms as usize
    }
    fn bf16_mma(&self) -> bool {
        self.gpu.bf16_mma
    }
    fn alloc_pool(&self, layout: DevicePoolLayout) -> Result<DevicePool> {
        Ok(DevicePool::new(&self.gpu.stream, layout)?)
    }
    fn pool_data(pool: &DevicePool) -> &Self::Bf16 {
        pool.data()
    }
    fn pool_data_mut(pool: &mut DevicePool) -> &mut Self::Bf16 {
        pool.data_mut()
    }
    fn describe_pool(pool: &DevicePool) -> Option<DeviceKv> {
        Some(pool.describe())
    }
    fn export_pool(pool: &DevicePool) -> Result<Option<ExportedKv>> {
        Ok(Some(pool.export()?))
    }
    fn record_event(&self) -> Result<CudaEvent> {
        self.gpu
            .stream
            .record_event(None)
            .map_err(|e| cuda_err("event", e))
    }
    fn download_bf16_after(
        &self,
        event: &CudaEvent,
        buf: &Self::Bf16,
        host: &mut [bf16],
    ) -> Result<()> {
        // The copy runs on a stream of its own, so the layers queued after `event` keep the
        // device busy meanwhile.
        let copy = &self.gpu.copy_stream;
        copy.wait(event).map_err(|e| cuda_err("stream wait", e))?;
        copy.memcpy_dtoh(buf, host)
            .map_err(|e| cuda_err("KV download", e))?;
        copy.synchronize().map_err(|e| cuda_err("KV download", e))
    }

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
    fn download_f32_into(&self, buf: &Self::F32, n: usize, out: &mut Vec<f32>) -> Result<()> {
        if n > buf.len() {
            return Err(cuda_err("download", "beyond the buffer"));
        }
        // Through page-locked memory kept for the next step: a direct DMA, where a fresh
        // pageable buffer of a batch's logits (65 MB at batch 128 and a 128k vocabulary)
        // costs a staged copy and page faults on every step.
        let mut staging = self
            .gpu
            .logits_staging
            .lock()
            .map_err(|_| cuda_err("download", "staging lock poisoned"))?;
        if staging.as_ref().is_none_or(|s| s.len() < n) {
            // SAFETY: contents unset until the copy below writes the first n elements,
            // the only ones read. Flags 0: cached memory (write-combined reads crawl).
            let fresh = unsafe { self.gpu.ctx.alloc_pinned_with_flags::<f32>(n.max(1), 0) }
                .map_err(|e| cuda_err("pinned allocation", e))?;
            *staging = Some(fresh);
        }
        let host = staging
            .as_mut()
            .ok_or_else(|| cuda_err("download", "no staging buffer"))?;
        self.gpu
            .stream
            .memcpy_dtoh(&buf.slice(..n), host)
            .map_err(|e| cuda_err("download", e))?;
        // as_slice waits for the copy (an event recorded after it on the stream).
        let values = host.as_slice().map_err(|e| cuda_err("download", e))?;
        // One pass over the values: a recycled buffer keeps its memory (clear frees nothing),
        // a fresh one is written once, not zeroed first.
        out.clear();
        out.extend_from_slice(&values[..n]);
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        self.gpu.synchronize()
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

    unsafe fn launch(
        &self,
        kernel: Kernel,
        at: Launch,
        args: &mut [KernelArg<'_, Self>],
    ) -> Result<()> {
        let mut b = self
            .gpu
            .stream
            .launch_builder(self.gpu.kernels.function(kernel));
        for arg in args.iter_mut() {
            match arg {
                KernelArg::F32(s) => b.arg(*s),
                KernelArg::F32Mut(s) => b.arg(&mut **s),
                KernelArg::Bf16(s) => b.arg(*s),
                KernelArg::Bf16Mut(s) => b.arg(&mut **s),
                KernelArg::I32s(s) => b.arg(*s),
                KernelArg::U32s(s) => b.arg(*s),
                KernelArg::Int(v) => b.arg(&*v),
                KernelArg::Long(v) => b.arg(&*v),
                KernelArg::ULong(v) => b.arg(&*v),
                KernelArg::Float(v) => b.arg(&*v),
            };
        }
        let config = LaunchConfig {
            grid_dim: (at.blocks, 1, 1),
            block_dim: (at.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as the caller promised (the arguments are the kernel's parameters, the
        // buffers large enough).
        unsafe { b.launch(config) }
            .map(|_| ())
            .map_err(|e| cuda_err(&format!("{} launch", kernel.name()), e))
    }

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
    ) -> Result<()> {
        let stream = &self.gpu.stream;
        let (alpha, beta) = (1f32, if accumulate { 1f32 } else { 0f32 });
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

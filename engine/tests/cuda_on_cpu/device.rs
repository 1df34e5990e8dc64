//! [`EmulatedDevice`]: a `LaunchDevice` whose buffers are bytes on the host and whose every
//! kernel launch is one run of the CUDA-on-CPU harness, so the engine's device code
//! (`backend::cuda`: the forward pass, the staging, the backend) runs unchanged in the tests, with the argument lists
//! the CUDA device launches. Buffers go to the harness typed (`float*`, `bf16*`, `int*`,
//! `unsigned int*`), and it refuses any argument whose type differs from the kernel's
//! parameter. GEMMs apply cuBLAS's column-major definition to the exact arguments the CUDA
//! device passes.

use half::bf16;
use tandem_engine::backend::cuda::blas::{linear_call, reference_gemm};
use tandem_engine::backend::cuda::launch::{Kernel, KernelArg, Launch, LaunchDevice};
use tandem_engine::{EngineError, Result};
use tandem_kv::{DeviceKv, DevicePoolLayout, ExportedKv};

use super::{Arg, bf16_bytes, bf16s, f32_bytes, f32s, i32_bytes, try_launch};

/// Device buffers are plain bytes on the host; every launch is one harness run.
pub struct EmulatedDevice;

thread_local! {
    static LAUNCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Kernel launches and GEMMs run so far on this thread (tests run on threads of their own):
/// where a hook fell within a pass.
pub fn launches_on_this_thread() -> usize {
    LAUNCHES.with(|n| n.get())
}

fn count_launch() {
    LAUNCHES.with(|n| n.set(n.get() + 1));
}

pub type Bytes = Vec<u8>;

impl LaunchDevice for EmulatedDevice {
    type F32 = Bytes;
    type Bf16 = Bytes;
    type I32 = Bytes;
    type U32 = Bytes;
    /// Every launch runs to completion: a point in the queue is already reached.
    type Event = ();
    type Pool = Bytes;

    /// Few, so that short batches take the split-context path in the tests.
    fn multiprocessors(&self) -> usize {
        2
    }
    fn bf16_mma(&self) -> bool {
        true
    }
    fn alloc_pool(&self, layout: DevicePoolLayout) -> Result<Bytes> {
        Ok(vec![0; layout.bytes()])
    }
    fn pool_data(pool: &Bytes) -> &Bytes {
        pool
    }
    fn pool_data_mut(pool: &mut Bytes) -> &mut Bytes {
        pool
    }
    fn describe_pool(_: &Bytes) -> Option<DeviceKv> {
        None
    }
    fn export_pool(_: &Bytes) -> Result<Option<ExportedKv>> {
        Ok(None)
    }
    fn record_event(&self) -> Result<()> {
        Ok(())
    }
    fn download_bf16_after(&self, _: &(), buf: &Bytes, host: &mut [bf16]) -> Result<()> {
        self.download_bf16_into(buf, host)
    }

    fn upload_f32(&self, host: &[f32]) -> Result<Bytes> {
        Ok(f32_bytes(host))
    }
    fn upload_bf16(&self, host: &[bf16]) -> Result<Bytes> {
        Ok(bf16_bytes(host))
    }
    fn upload_i32(&self, host: &[i32]) -> Result<Bytes> {
        Ok(i32_bytes(host))
    }
    fn upload_u32(&self, host: &[u32]) -> Result<Bytes> {
        Ok(host.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn zeros_f32(&self, n: usize) -> Result<Bytes> {
        Ok(vec![0; n * 4])
    }
    fn zeros_bf16(&self, n: usize) -> Result<Bytes> {
        Ok(vec![0; n * 2])
    }
    fn download_f32_into(&self, buf: &Bytes, n: usize, host: &mut Vec<f32>) -> Result<()> {
        let values = f32s(buf);
        if values.len() < n {
            return Err(EngineError::InvalidKv("download beyond the buffer".into()));
        }
        host.clear();
        host.extend_from_slice(&values[..n]);
        Ok(())
    }
    fn download_bf16_into(&self, buf: &Bytes, host: &mut [bf16]) -> Result<()> {
        let values = bf16s(buf);
        if values.len() != host.len() {
            return Err(EngineError::InvalidKv("download length mismatch".into()));
        }
        host.copy_from_slice(&values);
        Ok(())
    }
    fn upload_bf16_into(&self, host: &[bf16], buf: &mut Bytes) -> Result<()> {
        if host.len() * 2 != buf.len() {
            return Err(EngineError::InvalidKv("upload length mismatch".into()));
        }
        *buf = bf16_bytes(host);
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    unsafe fn launch(
        &self,
        kernel: Kernel,
        at: Launch,
        args: &mut [KernelArg<'_, Self>],
    ) -> Result<()> {
        count_launch();
        let request: Vec<Arg> = args
            .iter()
            .map(|a| match a {
                KernelArg::F32(b) => Arg::F32s((*b).clone()),
                KernelArg::F32Mut(b) => Arg::F32s((**b).clone()),
                KernelArg::Bf16(b) => Arg::Bf16s((*b).clone()),
                KernelArg::Bf16Mut(b) => Arg::Bf16s((**b).clone()),
                KernelArg::I32s(b) => Arg::I32s((*b).clone()),
                KernelArg::U32s(b) => Arg::U32s((*b).clone()),
                KernelArg::Int(v) => Arg::I32(*v),
                KernelArg::Long(v) => Arg::I64(*v),
                KernelArg::ULong(v) => Arg::U64(*v),
                KernelArg::Float(v) => Arg::F32(*v),
            })
            .collect();
        let name = kernel.name();
        let buffers = try_launch(name, at.blocks, at.threads, &request)
            .map_err(|e| EngineError::Unsupported(format!("{name}: {e}")))?;
        // The harness returns every buffer in argument order: copy back the written ones.
        let mut returned = buffers.into_iter();
        for a in args.iter_mut() {
            match a {
                KernelArg::F32Mut(b) | KernelArg::Bf16Mut(b) => {
                    **b = returned.next().expect("one buffer per buffer argument");
                }
                KernelArg::F32(_)
                | KernelArg::Bf16(_)
                | KernelArg::I32s(_)
                | KernelArg::U32s(_) => {
                    returned.next();
                }
                _ => {}
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        x: &Bytes,
        w: &Bytes,
        out: &mut Bytes,
        rows: usize,
        n: usize,
        k: usize,
        accumulate: bool,
    ) -> Result<()> {
        count_launch();
        let widen = |b: &Bytes| -> Vec<f32> { bf16s(b).iter().map(|v| v.to_f32()).collect() };
        let (x, w) = (widen(x), widen(w));
        assert!(
            x.len() >= rows * k && w.len() >= n * k,
            "gemm inputs too small"
        );
        let mut c = f32s(out);
        assert!(c.len() >= rows * n, "gemm output too small");
        // A = W, B = x, C = out: the CUDA device's cublasGemmEx arguments.
        let beta = if accumulate { 1.0 } else { 0.0 };
        reference_gemm(&linear_call(rows, n, k), &w, &x, beta, &mut c);
        *out = f32_bytes(&c);
        Ok(())
    }
}

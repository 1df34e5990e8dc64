//! CUDA IPC: the `cuda-ipc` KV transport between two processes on one node. The decode
//! worker exports a handle to its device KV pool ([`export_handle`]); the prefill worker opens
//! it once ([`OpenedPeer::open`]) and, after each forward pass, copies every finished layer's
//! blocks device to device into the blocks the decode worker reserved, on the stream of its
//! forward pass. It then commits over gRPC as the shared-memory transport does.
//!
//! A layer's blocks go over in one kernel launch (`copy_runs`, compiled with NVRTC when the
//! peer is opened): a 2048-token prompt is 4096 (block, layer) pieces of 64 KiB for
//! Llama-3.1-8B, and one `cuMemcpyDtoDAsync` each spent ~5 µs of driver time per piece
//! (12 GB/s, against ~1400 GB/s for one local copy of the same bytes).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg, sys};

use super::{check, cuda_err};
use crate::device::{CopyRun, DeviceKv};
use crate::error::Result;

/// The 64 opaque bytes that name a pool's allocation to other processes.
pub fn export_handle(pool: &DeviceKv) -> Result<[u8; 64]> {
    pool.context()
        .bind_to_thread()
        .map_err(|e| cuda_err("bind context", e))?;
    // SAFETY: `pool.base()` is the base of a live cuMemAlloc'd buffer (see `DeviceKv::new`).
    unsafe {
        let mut handle: sys::CUipcMemHandle = std::mem::zeroed();
        check(
            "cuIpcGetMemHandle",
            sys::cuIpcGetMemHandle(&mut handle, pool.base()),
        )?;
        let mut out = [0u8; 64];
        for (o, &b) in out.iter_mut().zip(handle.reserved.iter()) {
            *o = b as u8;
        }
        Ok(out)
    }
}

/// One CUDA block per run (grid-stride over runs), 16-byte words; offsets and lengths are
/// multiples of 16 (checked by the host before it launches this), runs at most
/// [`PIECE_BYTES`] (the host cuts longer ones, so a layer of consecutive blocks, one run,
/// still spreads over the whole GPU).
const COPY_RUNS_SRC: &str = r#"
struct alignas(16) words4 { unsigned int x, y, z, w; };
extern "C" __global__ void copy_runs(unsigned long long dst_base, unsigned long long src_base,
                                     const unsigned long long* __restrict__ runs, int count) {
    for (int r = blockIdx.x; r < count; r += gridDim.x) {
        const unsigned long long* run = runs + 3ull * r;
        words4* dst = (words4*)(dst_base + run[0]);
        const words4* src = (const words4*)(src_base + run[1]);
        unsigned long long words = run[2] / 16, i = threadIdx.x, step = blockDim.x;
        // Four loads in flight per thread before their stores.
        for (; i + 3 * step < words; i += 4 * step) {
            words4 a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
            dst[i] = a;
            dst[i + step] = b;
            dst[i + 2 * step] = c;
            dst[i + 3 * step] = d;
        }
        for (; i < words; i += step) dst[i] = src[i];
    }
}
"#;

/// `COPY_RUNS_SRC` compiled once per process (a context loads it when it opens a peer).
fn copy_runs_ptx() -> std::result::Result<cudarc::nvrtc::Ptx, String> {
    static PTX: OnceLock<std::result::Result<cudarc::nvrtc::Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| cudarc::nvrtc::compile_ptx(COPY_RUNS_SRC).map_err(|e| e.to_string()))
        .clone()
}

/// Whether one launch of `copy_runs` can take `runs`: every offset and length a multiple of
/// its 16-byte word (the pool's pieces are; anything else goes one copy at a time).
pub fn runs_fit_the_kernel(runs: &[CopyRun]) -> bool {
    runs.iter()
        .all(|r| r.src_offset % 16 == 0 && r.dst_offset % 16 == 0 && r.bytes % 16 == 0)
}

/// The most bytes one CUDA block of the copy kernel moves.
const PIECE_BYTES: usize = 64 << 10;

/// `runs` as the kernel reads them: (destination offset, source offset, bytes) triples, each
/// run cut into pieces of at most [`PIECE_BYTES`].
fn encode_runs(runs: &[CopyRun]) -> Vec<u64> {
    let mut out = Vec::with_capacity(runs.len() * 3);
    for r in runs {
        let mut done = 0;
        while done < r.bytes {
            let bytes = PIECE_BYTES.min(r.bytes - done);
            out.extend([
                (r.dst_offset + done) as u64,
                (r.src_offset + done) as u64,
                bytes as u64,
            ]);
            done += bytes;
        }
    }
    out
}

/// A peer's allocation mapped into this process (closed on drop, never freed here).
#[derive(Debug)]
pub struct OpenedPeer {
    pub ptr: sys::CUdeviceptr,
    context: Arc<CudaContext>,
    /// The copy kernel in `context`; None where NVRTC is missing (copies go one at a time).
    copy_kernel: Option<CudaFunction>,
}

impl OpenedPeer {
    /// Opens a handle from [`export_handle`] in `context` (which becomes current on the
    /// calling thread).
    pub fn open(handle: &[u8], context: &Arc<CudaContext>) -> Result<Self> {
        if handle.len() != 64 {
            return Err(cuda_err(
                "IPC handle",
                format!("{} bytes, expected 64", handle.len()),
            ));
        }
        context
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        // SAFETY: the handle came from a live allocation of another process on this node;
        // a stale or foreign one makes the driver return an error, not map memory.
        unsafe {
            let mut h: sys::CUipcMemHandle = std::mem::zeroed();
            for (r, &b) in h.reserved.iter_mut().zip(handle.iter()) {
                *r = b as _;
            }
            let mut ptr: sys::CUdeviceptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
            check(
                "cuIpcOpenMemHandle",
                sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags),
            )?;
            let copy_kernel = copy_runs_ptx()
                .and_then(|ptx| {
                    let module = context.load_module(ptx).map_err(|e| e.to_string())?;
                    module.load_function("copy_runs").map_err(|e| e.to_string())
                })
                .inspect_err(|e| {
                    tracing::warn!(error = %e, "cuda-ipc copy kernel unavailable: one copy per piece")
                })
                .ok();
            Ok(Self {
                ptr,
                context: context.clone(),
                copy_kernel,
            })
        }
    }

    /// Queues `runs` from `src` (a pool of this process) into the peer's pool on `src`'s
    /// stream, after the forward pass that wrote them.
    ///
    /// # Safety
    /// Every run must lie inside both pools, in blocks the peer reserved for us, and the
    /// source must stay unchanged until the stream reaches these copies.
    pub unsafe fn copy_runs(&self, src: &DeviceKv, runs: &[CopyRun]) -> Result<()> {
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        if runs.is_empty() {
            return Ok(());
        }
        if let Some(kernel) = self
            .copy_kernel
            .as_ref()
            .filter(|_| runs_fit_the_kernel(runs))
        {
            let stream = src.stream();
            let pieces = encode_runs(runs);
            let count = (pieces.len() / 3) as i32;
            let table = stream
                .clone_htod(&pieces)
                .map_err(|e| cuda_err("copy table upload", e))?;
            let (dst_base, src_base) = (self.ptr, src.base());
            let mut launch = stream.launch_builder(kernel);
            launch.arg(&dst_base).arg(&src_base).arg(&table).arg(&count);
            let config = LaunchConfig {
                grid_dim: (count.min(1024) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: copy_runs(u64, u64, const u64*, int) with `count` triples in `table`;
            // the caller promised the runs lie inside both pools.
            unsafe { launch.launch(config) }.map_err(|e| cuda_err("copy_runs launch", e))?;
            return Ok(());
        }
        for run in runs {
            check("cuMemcpyDtoDAsync", unsafe {
                sys::cuMemcpyDtoDAsync_v2(
                    self.ptr + run.dst_offset as u64,
                    src.base() + run.src_offset as u64,
                    run.bytes,
                    src.stream().cu_stream(),
                )
            })?;
        }
        Ok(())
    }
}

impl Drop for OpenedPeer {
    fn drop(&mut self) {
        // SAFETY: the pointer came from cuIpcOpenMemHandle in `context` and is closed once.
        if self.context.bind_to_thread().is_ok() {
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_go_to_the_kernel_only_in_whole_words() {
        let run = |src_offset, dst_offset, bytes| CopyRun {
            src_offset,
            dst_offset,
            bytes,
        };
        assert!(runs_fit_the_kernel(&[
            run(0, 65536, 65536),
            run(131072, 0, 16)
        ]));
        assert!(!runs_fit_the_kernel(&[run(0, 0, 65536), run(8, 0, 16)]));
        assert!(!runs_fit_the_kernel(&[run(0, 4, 16)]));
        assert!(!runs_fit_the_kernel(&[run(0, 0, 24)]));
        assert_eq!(
            encode_runs(&[run(1, 2, 3), run(4, 5, 6)]),
            vec![2, 1, 3, 5, 4, 6]
        );
        // A run of a layer's consecutive blocks is cut into pieces for many CUDA blocks.
        let long = encode_runs(&[run(16, 32, 2 * PIECE_BYTES + 48)]);
        let piece = PIECE_BYTES as u64;
        assert_eq!(
            long,
            vec![
                32,
                16,
                piece,
                32 + piece,
                16 + piece,
                piece,
                32 + 2 * piece,
                16 + 2 * piece,
                48
            ]
        );
    }

    /// The kernel compiles wherever NVRTC loads (CI's NVRTC stage); skips elsewhere.
    #[test]
    fn the_copy_kernel_compiles() {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert!(
                std::env::var_os("TANDEM_REQUIRE_NVRTC").is_none(),
                "TANDEM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
            );
            return;
        }
        let ptx = copy_runs_ptx().expect("copy_runs compiles");
        assert!(ptx.to_src().contains("copy_runs"));
    }
}

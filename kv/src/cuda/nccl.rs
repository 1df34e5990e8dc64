//! NCCL point-to-point links for the `nccl` KV transport (cargo feature `nccl`): a two-rank
//! communicator between one prefill worker (rank 1, sends) and one decode worker (rank 0,
//! receives), on GPUs that cannot open each other's memory (other devices, other nodes).
//! Like the rest of the GPU path it loads `libnccl.so` at run time.
//!
//! Only raw sends and receives of device byte ranges live here; the transfer protocol (what
//! each message means, where it lands) is in the transport crate.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, sys as cu};
use cudarc::nccl::{result, sys};

use super::{check, cuda_err};
use crate::error::{KvError, Result};

/// KV moves as bytes.
const UINT8: sys::ncclDataType_t = sys::ncclDataType_t::ncclUint8;

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> KvError {
    KvError::Device(format!("NCCL {what}: {e:?}"))
}

fn bind(context: &CudaContext) -> Result<()> {
    context
        .bind_to_thread()
        .map_err(|e| cuda_err("bind context", e))
}

/// Whether `libnccl.so` can be loaded (it needs that exact name on the loader path).
pub fn available() -> bool {
    // SAFETY: only probes whether the shared library can be opened.
    unsafe { sys::is_culib_present() }
}

/// A fresh communicator id (128 opaque bytes), made by the receiving side.
pub fn unique_id() -> Result<Vec<u8>> {
    if !available() {
        return Err(KvError::Device(
            "libnccl.so cannot be loaded (link it as libnccl.so on LD_LIBRARY_PATH)".into(),
        ));
    }
    let id = result::get_uniqueid().map_err(|e| nccl_err("unique id", e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// One end of a two-rank communicator, with the stream its operations use (and so its
/// context).
#[derive(Debug)]
pub struct NcclLink {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    pub rank: usize,
    /// `true` once the communicator was aborted. Every NCCL call on it holds this lock, so an
    /// abort from another thread ([`NcclAbort`]) never overlaps a call, and none follows it.
    aborted: Arc<Mutex<bool>>,
}

/// Aborts a link from another thread: the link's owner may be blocked waiting for a message
/// from a peer that is gone, and the abort ends that wait (its stream's NCCL work ends).
#[derive(Debug, Clone)]
pub struct NcclAbort {
    comm: sys::ncclComm_t,
    context: Arc<CudaContext>,
    aborted: Arc<Mutex<bool>>,
}

// SAFETY: `comm` is only used under the `aborted` lock, shared with the link, and never after
// it was aborted (the link's `Drop` aborts it under that lock too, so it is never freed first).
unsafe impl Send for NcclAbort {}
unsafe impl Sync for NcclAbort {}

impl NcclAbort {
    /// Aborts the communicator unless it already was (idempotent).
    pub fn abort(&self) {
        // This runs on a thread that may have no context, or another one, current: bind the
        // link's own (a green context is not the device's primary one).
        if let Err(e) = bind(&self.context) {
            tracing::warn!(error = %e, "could not bind the nccl link's context to abort it");
        }
        abort_once(self.comm, &self.aborted);
    }
}

fn lock(aborted: &Mutex<bool>) -> MutexGuard<'_, bool> {
    // A panic while holding the lock cannot leave the flag half-written: keep going.
    aborted.lock().unwrap_or_else(|e| e.into_inner())
}

/// Aborts `comm` under its lock, once.
fn abort_once(comm: sys::ncclComm_t, aborted: &Mutex<bool>) {
    let mut done = lock(aborted);
    if !*done {
        *done = true;
        // SAFETY: the communicator was initialised in `join` and is released once, here.
        let _ = unsafe { result::comm_abort(comm) };
    }
}

// SAFETY: the communicator is used from one thread at a time (the owner holds it behind a
// mutex or on its own thread); NCCL communicators may move between threads.
unsafe impl Send for NcclLink {}

impl NcclLink {
    /// Joins the communicator `id` as `rank` of 2 on `stream`. Blocks until the other rank
    /// joins too.
    pub fn join(id: &[u8], rank: usize, stream: Arc<CudaStream>) -> Result<Self> {
        if id.len() != 128 {
            return Err(nccl_err(
                "unique id",
                format!("{} bytes, expected 128", id.len()),
            ));
        }
        bind(stream.context())?;
        let mut raw = sys::ncclUniqueId { internal: [0; 128] };
        for (r, &b) in raw.internal.iter_mut().zip(id) {
            *r = b as _;
        }
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success; rank < nranks.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), 2, raw, rank as i32)
                .map_err(|e| nccl_err("communicator init", e))?;
            comm.assume_init()
        };
        Ok(Self {
            comm,
            stream,
            rank,
            aborted: Arc::new(Mutex::new(false)),
        })
    }

    /// A handle that aborts this link from another thread.
    pub fn abort_handle(&self) -> NcclAbort {
        NcclAbort {
            comm: self.comm,
            context: self.stream.context().clone(),
            aborted: self.aborted.clone(),
        }
    }

    fn peer(&self) -> i32 {
        1 - self.rank as i32
    }

    /// Queues a send of `bytes` at `ptr` to the other rank.
    ///
    /// # Safety
    /// `ptr..ptr+bytes` must be device memory that stays unchanged until the stream runs it.
    pub unsafe fn send(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: as the caller promised.
        self.p2p("send", |peer, comm, stream| unsafe {
            result::send(ptr as *const c_void, bytes, UINT8, peer, comm, stream)
        })
    }

    /// Queues a receive of `bytes` into `ptr` from the other rank.
    ///
    /// # Safety
    /// `ptr..ptr+bytes` must be device memory nobody else writes until the stream runs it.
    pub unsafe fn recv(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: as the caller promised.
        self.p2p("recv", |peer, comm, stream| unsafe {
            result::recv(ptr as *mut c_void, bytes, UINT8, peer, comm, stream)
        })
    }

    /// Runs one point-to-point call to the other rank in the link's context and stream.
    fn p2p(
        &self,
        what: &str,
        call: impl FnOnce(
            i32,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let aborted = lock(&self.aborted);
        if *aborted {
            return Err(nccl_err(what, "the link was aborted"));
        }
        bind(self.stream.context())?;
        call(
            self.peer(),
            self.comm,
            self.stream.cu_stream() as sys::cudaStream_t,
        )
        .map(|_| ())
        .map_err(|e| nccl_err(what, e))
    }

    /// Waits for everything queued on the link's stream, at most `limit`. A peer that died
    /// mid-message never completes its half and NCCL has no timeout of its own, so past the
    /// limit the communicator is aborted (every queued operation on it ends) and the link is
    /// dead: the caller drops it and opens a new one.
    pub fn synchronize_within(&self, limit: Duration) -> Result<()> {
        bind(self.stream.context())?;
        let deadline = Instant::now() + limit;
        loop {
            // SAFETY: a live stream of this process.
            let r = unsafe { cu::cuStreamQuery(self.stream.cu_stream()) };
            match r {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(50));
                }
                cu::CUresult::CUDA_ERROR_NOT_READY => {
                    abort_once(self.comm, &self.aborted);
                    return Err(nccl_err(
                        "link",
                        format!("the peer did not complete within {limit:?}; link aborted"),
                    ));
                }
                other => return check("cuStreamQuery", other),
            }
        }
    }

    /// Copies `host` to device memory at `ptr` on the link's stream (ordered before later
    /// sends; pageable memory is staged before this returns, so `host` may be reused).
    ///
    /// # Safety
    /// `ptr..ptr+host.len()` must be device memory owned by the caller.
    pub unsafe fn upload(&self, ptr: u64, host: &[u8]) -> Result<()> {
        bind(self.stream.context())?;
        check("cuMemcpyHtoDAsync", unsafe {
            cu::cuMemcpyHtoDAsync_v2(
                ptr,
                host.as_ptr().cast(),
                host.len(),
                self.stream.cu_stream(),
            )
        })
    }

    /// Copies device memory at `ptr` into `host`, waiting for the stream first.
    ///
    /// # Safety
    /// `ptr..ptr+host.len()` must be device memory.
    pub unsafe fn download(&self, ptr: u64, host: &mut [u8]) -> Result<()> {
        // Waiting for the next message is idle time, not a stall: no limit here.
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("stream synchronize", e))?;
        check("cuMemcpyDtoH", unsafe {
            cu::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, host.len())
        })
    }
}

impl Drop for NcclLink {
    fn drop(&mut self) {
        // Abort rather than destroy: destroy waits for pending operations, which a dead or
        // out-of-step peer never completes, and a link is dropped exactly when that happened.
        abort_once(self.comm, &self.aborted);
    }
}

/// A device buffer for protocol messages and for draining data nobody may keep.
#[derive(Debug)]
pub struct DeviceScratch {
    pub ptr: u64,
    pub bytes: usize,
    context: Arc<CudaContext>,
}

impl DeviceScratch {
    pub fn new(bytes: usize, context: &Arc<CudaContext>) -> Result<Self> {
        bind(context)?;
        // SAFETY: a fresh allocation, freed in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(1)) }
            .map_err(|e| cuda_err("scratch allocation", e))?;
        Ok(Self {
            ptr,
            bytes,
            context: context.clone(),
        })
    }
}

impl Drop for DeviceScratch {
    fn drop(&mut self) {
        if bind(&self.context).is_ok() {
            // SAFETY: allocated in `new`, freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
        }
    }
}

/// A non-blocking stream of its own on `context` (the decode side receives beside the
/// forward pass, not behind it).
pub fn receive_stream(context: &Arc<CudaContext>) -> Result<Arc<CudaStream>> {
    context
        .new_stream()
        .map_err(|e| cuda_err("stream creation", e))
}

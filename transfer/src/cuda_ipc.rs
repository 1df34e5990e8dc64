//! `cuda-ipc`: the decode worker's KV pool in device memory, written in place by a prefill
//! worker on the same node. The decode worker publishes a CUDA IPC handle to its pool; the
//! prefill worker opens it once (on its engine thread, in its engine's context) and, for each
//! layer of a prompt, queues device-to-device copies from its own pool into the reserved blocks
//! on the stream of its forward pass, then waits for them before the commit. No host memory
//! is touched on either side. The opened pools and owner-tag files are kept across requests
//! by [`CudaIpcTransport`].
//!
//! The writes are fenced like `shm`'s: before queuing a block's copy the sender checks the
//! block's owner tag (in the tag file beside the decode worker's host pool) still names its
//! lease; the decode worker clears the tags and quarantines the blocks of a lease that ended
//! early. Every step's copies are waited for at its last layer, so none outlives the
//! quarantine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use tandem_kv::cuda::ipc::OpenedPeer;
use tandem_kv::shm::OwnerTags;
use tandem_kv::{DeviceKv, plan_layer_copy};
use tandem_proto::v1::{Transport, WorkerInfo};

use crate::device::{DeviceCopy, DeviceSender};
use crate::error::TransferError;
use crate::inplace::InPlace;
use crate::reach::Reach;
use crate::sender::KvSender;
use crate::transport::{KvTransport, OpenFuture, Opening};
use crate::verify::VerifiedDecode;

/// The `cuda-ipc` transport: a prefill worker's opened device pools and owner-tag files.
#[derive(Debug, Default)]
pub(crate) struct CudaIpcTransport(Arc<Opened>);

/// What is opened once per decode worker; shared with the senders, which open device pools
/// on the engine thread.
#[derive(Debug, Default)]
struct Opened {
    pools: Mutex<HashMap<Vec<u8>, Arc<OpenedPeer>>>,
    tags: Mutex<HashMap<PathBuf, Arc<OwnerTags>>>,
}

impl Opened {
    /// The owner tags of a verified decode worker's pool, opened the first time: only inside
    /// our shared-memory folder, without following links.
    fn tags(
        &self,
        reach: &Reach,
        info: &WorkerInfo,
        blocks: usize,
    ) -> Result<Arc<OwnerTags>, TransferError> {
        let pool = PathBuf::from(&info.shm_path);
        let mut tags = self.tags.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = tags.get(&pool) {
            return Ok(t.clone());
        }
        let dir = reach.shm_dir()?;
        let t = Arc::new(OwnerTags::open_peer(
            dir,
            Path::new(&info.shm_path),
            blocks,
        )?);
        tags.insert(pool, t.clone());
        Ok(t)
    }

    /// The peer pool behind `handle`, opened in `context` the first time.
    fn pool(
        &self,
        handle: &[u8],
        context: &Arc<CudaContext>,
    ) -> Result<Arc<OpenedPeer>, TransferError> {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pools.get(handle) {
            return Ok(p.clone());
        }
        let peer = Arc::new(
            OpenedPeer::open(handle, context)
                .map_err(|e| TransferError::Connect(format!("opening the decode pool: {e}")))?,
        );
        pools.insert(handle.to_vec(), peer.clone());
        Ok(peer)
    }
}

impl KvTransport for CudaIpcTransport {
    fn kind(&self) -> Transport {
        Transport::CudaIpc
    }

    fn open<'a>(&'a self, op: Opening<'a>) -> OpenFuture<'a> {
        let opened = self.sender(op).map(|s| Box::new(s) as Box<dyn KvSender>);
        Box::pin(std::future::ready(opened))
    }

    fn forget(&self, decode: &VerifiedDecode) {
        let info = &decode.info;
        self.0
            .pools
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&info.cuda_ipc_handle);
        self.0
            .tags
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&PathBuf::from(&info.shm_path));
    }
}

impl CudaIpcTransport {
    fn sender(&self, op: Opening<'_>) -> Result<DeviceSender<IpcCopy>, TransferError> {
        let info = &op.decode.info;
        if info.cuda_ipc_handle.is_empty() || info.cuda_pool_blocks == 0 {
            return Err(TransferError::Connect(
                "the decode worker has no device KV pool (cuda-ipc needs it on a GPU)".into(),
            ));
        }
        if info.shm_path.is_empty() {
            return Err(TransferError::Connect(
                "the decode worker has no owner-tag file (cuda-ipc needs its shm folder)".into(),
            ));
        }
        let pool_blocks = info.cuda_pool_blocks as usize;
        let copy = IpcCopy {
            tags: self.0.tags(op.reach, info, pool_blocks)?,
            opened: self.0.clone(),
            handle: info.cuda_ipc_handle.clone(),
            pool_blocks,
        };
        Ok(DeviceSender::new(
            copy,
            InPlace::new(op, Transport::CudaIpc)?,
        ))
    }
}

/// Copies a lease's blocks from this engine's device pool into the decode worker's.
struct IpcCopy {
    opened: Arc<Opened>,
    tags: Arc<OwnerTags>,
    /// The decode worker's device pool, from its verified info.
    handle: Vec<u8>,
    pool_blocks: usize,
}

impl DeviceCopy for IpcCopy {
    fn copy_layer(
        &mut self,
        t: &InPlace,
        layer: usize,
        src: &DeviceKv,
        blocks: &[(u32, u32)],
    ) -> Result<(), TransferError> {
        let mut pairs = Vec::with_capacity(blocks.len());
        for &(lb, physical) in blocks {
            let block = t.block(lb)?;
            // The fence: write only while the decode worker still says this block is ours.
            if self.tags.get(block) != t.fence {
                return Err(TransferError::Cancelled);
            }
            pairs.push((physical, block));
        }
        let runs = plan_layer_copy(
            layer,
            t.layers,
            src.block_layer_bytes(),
            src.num_blocks(),
            self.pool_blocks,
            &pairs,
        )?;
        let peer = self.opened.pool(&self.handle, src.context())?;
        // SAFETY: the runs lie inside both pools (checked by the plan), the destination blocks
        // are reserved for our lease (owner tags), and the copies are queued on the stream of
        // the forward pass that wrote the source, before anything can reuse it.
        unsafe { peer.copy_runs(src, &runs) }?;
        if layer + 1 == t.layers {
            // The decode worker may read the blocks as soon as we commit.
            src.synchronize()?;
        }
        Ok(())
    }
}

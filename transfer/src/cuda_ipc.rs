//! `cuda-ipc`: the decode worker's KV pool in device memory, written in place by a prefill
//! worker on the same node. The decode worker publishes a CUDA IPC handle to its pool; the
//! prefill worker opens it once (on its engine thread, in its engine's context) and, for each
//! layer of a prompt, queues device-to-device copies from its own pool into the reserved blocks
//! on the stream of its forward pass, then waits for them before the commit. No host memory
//! is touched on either side.
//!
//! The writes are fenced like `shm`'s: before queuing a block's copy the sender checks the
//! block's owner tag (in the tag file beside the decode worker's host pool) still names its
//! lease; the decode worker clears the tags and quarantines the blocks of a lease that ended
//! early. Every step's copies are waited for at its last layer, so none outlives the
//! quarantine.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use tandem_kv::cuda::ipc::OpenedPeer;
use tandem_kv::shm::OwnerTags;
use tandem_kv::{DeviceKv, plan_layer_copy};
use tandem_proto::v1::{Transport, WorkerInfo};

use crate::error::TransferError;
use crate::inplace::InPlace;
use crate::peers::{Opening, Peers};
use crate::sender::{FirstToken, KvSender, SendFuture};

/// A prefill worker's opened device pools and owner-tag files, kept across requests.
#[derive(Debug, Default)]
pub(crate) struct CudaIpcPeers {
    opened: Mutex<HashMap<Vec<u8>, Arc<OpenedPeer>>>,
    tags: Mutex<HashMap<PathBuf, Arc<OwnerTags>>>,
}

impl CudaIpcPeers {
    /// The owner tags of a verified decode worker's pool, opened the first time.
    fn tags(
        &self,
        peers: &Peers,
        info: &WorkerInfo,
        blocks: usize,
    ) -> Result<Arc<OwnerTags>, TransferError> {
        let pool = PathBuf::from(&info.shm_path);
        let mut tags = self.tags.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = tags.get(&pool) {
            return Ok(t.clone());
        }
        let t = Arc::new(peers.open_tags(info, blocks)?);
        tags.insert(pool, t.clone());
        Ok(t)
    }

    /// The peer pool behind `handle`, opened in `context` the first time.
    fn open(
        &self,
        handle: &[u8],
        context: &Arc<CudaContext>,
    ) -> Result<Arc<OpenedPeer>, TransferError> {
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = opened.get(handle) {
            return Ok(p.clone());
        }
        let peer = Arc::new(
            OpenedPeer::open(handle, context)
                .map_err(|e| TransferError::Connect(format!("opening the decode pool: {e}")))?,
        );
        opened.insert(handle.to_vec(), peer.clone());
        Ok(peer)
    }

    pub(crate) fn forget(&self, info: &WorkerInfo) {
        self.opened
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&info.cuda_ipc_handle);
        self.tags
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&PathBuf::from(&info.shm_path));
    }
}

/// Copies a lease's blocks from this engine's device pool into the decode worker's.
pub(crate) struct CudaIpcSender {
    peers: Arc<CudaIpcPeers>,
    tags: Arc<OwnerTags>,
    /// The decode worker's device pool, from its verified info.
    handle: Vec<u8>,
    pool_blocks: usize,
    transfer: InPlace,
}

impl CudaIpcSender {
    pub(crate) fn new(op: Opening<'_>) -> Result<Self, TransferError> {
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
        let tags = op.peers.cuda.tags(op.peers, info, pool_blocks)?;
        Ok(Self {
            peers: op.peers.cuda.clone(),
            tags,
            handle: info.cuda_ipc_handle.clone(),
            pool_blocks,
            transfer: InPlace::new(op, Transport::CudaIpc)?,
        })
    }
}

impl KvSender for CudaIpcSender {
    fn send_layer(&mut self, _: usize, _: &[(u32, &[u8])]) -> Result<(), TransferError> {
        Err(self.transfer.host_bytes_refused())
    }

    fn reads_device(&self) -> bool {
        true
    }

    fn send_device_layer(
        &mut self,
        layer: usize,
        src: &DeviceKv,
        blocks: &[(u32, u32)],
    ) -> Result<(), TransferError> {
        let t = &mut self.transfer;
        t.start_device_layer(layer, src)?;
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
        let peer = self.peers.open(&self.handle, src.context())?;
        // SAFETY: the runs lie inside both pools (checked by the plan), the destination blocks
        // are reserved for our lease (owner tags), and the copies are queued on the stream of
        // the forward pass that wrote the source, before anything can reuse it.
        unsafe { peer.copy_runs(src, &runs) }?;
        t.mark(
            layer,
            blocks.iter().map(|&(lb, _)| lb),
            src.block_layer_bytes(),
        );
        if layer + 1 == t.layers {
            // The decode worker may read the blocks as soon as we commit.
            src.synchronize()?;
        }
        Ok(())
    }

    fn commit(self: Box<Self>, first: FirstToken) -> SendFuture {
        self.transfer.commit(first, Vec::new())
    }
}

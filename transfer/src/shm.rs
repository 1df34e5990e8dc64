//! The `shm` transport: the decode worker's KV pool lives in a file under /dev/shm that
//! prefill workers on the same host map and write into directly, one copy per block and no
//! serialization, each block fenced by its owner tag (the lease's
//! [`crate::LeaseToken::fence`]; the files and their lifecycle are `tandem_kv::shm`'s). A
//! prefill worker maps only the very pool file a verified decode worker advertised in its
//! `GetInfo`, from its own shared-memory folder, and keeps the mapping across requests
//! ([`ShmTransport`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tandem_kv::shm::{OwnerTags, open_peer_file};
use tandem_kv::{KvBlockWriter, KvCache, KvLayout, KvStorage};
use tandem_proto::v1::{Transport, WorkerInfo};

use crate::checksum::crc32;
use crate::error::TransferError;
use crate::inplace::InPlace;
use crate::reach::Reach;
use crate::sender::{FirstToken, KvSender, SendFuture};
use crate::transport::{KvTransport, OpenFuture, Opening};
use crate::verify::VerifiedDecode;

/// The `shm` transport: a prefill worker's mappings of decode workers' pools, opened once per
/// pool file.
#[derive(Debug, Default)]
pub(crate) struct ShmTransport {
    peers: Mutex<HashMap<(PathBuf, u64, u64), Arc<ShmPeer>>>,
}

#[derive(Debug)]
struct ShmPeer {
    writer: KvBlockWriter,
    tags: OwnerTags,
    /// Keeps the mapping alive.
    _cache: KvCache,
}

impl ShmTransport {
    /// The shared pool of a verified decode worker, mapped from our shared-memory folder the
    /// first time.
    fn peer(
        &self,
        reach: &Reach,
        info: &WorkerInfo,
        layout: &KvLayout,
    ) -> Result<Arc<ShmPeer>, TransferError> {
        if info.shm_path.is_empty() {
            return Err(TransferError::Connect(
                "the decode worker has no shared-memory pool".into(),
            ));
        }
        let dir = reach.shm_dir()?;
        let path = PathBuf::from(&info.shm_path);
        let key = (path.clone(), info.shm_device, info.shm_inode);
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get(&key) {
            return Ok(p.clone());
        }
        let bytes = info.shm_bytes;
        let block_bytes = layout.block_bytes() as u64;
        if bytes == 0 || !bytes.is_multiple_of(block_bytes) {
            return Err(TransferError::LayoutMismatch(format!(
                "shared pool of {bytes} bytes is not whole blocks of {block_bytes}"
            )));
        }
        let blocks = (bytes / block_bytes) as usize;
        let pool = open_peer_file(dir, &path, bytes, Some((info.shm_device, info.shm_inode)))?;
        let storage = KvStorage::open_shared_file(&pool, bytes as usize, &path)?;
        let cache = KvCache::new(layout.clone(), blocks, storage)?;
        let peer = Arc::new(ShmPeer {
            writer: cache.block_writer(),
            tags: OwnerTags::open_peer(dir, &path, blocks)?,
            _cache: cache,
        });
        // A decode worker that restarted has a new file: forget the old one's mapping.
        peers.retain(|(p, ..), _| p != &path);
        peers.insert(key, peer.clone());
        Ok(peer)
    }
}

impl KvTransport for ShmTransport {
    fn kind(&self) -> Transport {
        Transport::Shm
    }

    fn open<'a>(&'a self, op: Opening<'a>) -> OpenFuture<'a> {
        let opened = ShmSender::new(self, op).map(|s| Box::new(s) as Box<dyn KvSender>);
        Box::pin(std::future::ready(opened))
    }

    /// Forgets the pool (its decode worker restarted, or answered with a layout error).
    fn forget(&self, decode: &VerifiedDecode) {
        if decode.info.shm_path.is_empty() {
            return;
        }
        let path = Path::new(&decode.info.shm_path);
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(p, ..), _| p != path);
    }
}

/// Writes a lease's blocks straight into the decode worker's shared pool.
struct ShmSender {
    peer: Arc<ShmPeer>,
    transfer: InPlace,
    /// Layer-major CRC-32 of every (layer, logical block) written.
    checksums: Vec<u32>,
}

impl ShmSender {
    fn new(shm: &ShmTransport, op: Opening<'_>) -> Result<Self, TransferError> {
        let peer = shm.peer(op.reach, &op.decode.info, op.layout)?;
        let n = op.layout.num_layers * op.dest.block_ids.len();
        Ok(Self {
            peer,
            checksums: vec![0; n],
            transfer: InPlace::new(op, Transport::Shm)?,
        })
    }
}

impl KvSender for ShmSender {
    fn send_layer(&mut self, layer: usize, blocks: &[(u32, &[u8])]) -> Result<(), TransferError> {
        let t = &mut self.transfer;
        t.start();
        t.check_layer(layer)?;
        let nblocks = t.dest.block_ids.len();
        for &(lb, bytes) in blocks {
            let block = t.block(lb)?;
            // The fence: write only while the decode worker still says this block is ours.
            if self.peer.tags.get(block) != t.fence {
                return Err(TransferError::Cancelled);
            }
            // SAFETY: the owner tag names our lease, so the decode worker reserved this block
            // for us and reads it only after our commit.
            unsafe { self.peer.writer.write(layer, block, bytes)? };
            self.checksums[layer * nblocks + lb as usize] = crc32(bytes);
            t.mark(layer, [lb], bytes.len());
        }
        Ok(())
    }

    fn commit(self: Box<Self>, first: FirstToken) -> SendFuture {
        self.transfer.commit(first, self.checksums)
    }
}

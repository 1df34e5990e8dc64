//! Shared memory: the decode worker's KV pool lives in a file under /dev/shm that prefill
//! workers on the same host map and write into directly, one copy per block and no
//! serialization. Beside it, an owner-tag file holds one `u64` per block: the lease that may
//! be written into it, or 0. A prefill worker checks the tag before each block write and the
//! decode worker clears the tags (and waits a short quarantine) before reusing the blocks of
//! a lease that ended early, so a late or stalled writer can never touch another request's
//! KV.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::MmapMut;
use tandem_engine::kv::{KvBlockWriter, KvCache, KvLayout, KvStorage};
use tandem_proto::v1::{KvDestination, Transport};

use crate::checksum::crc32;
use crate::error::TransferError;
use crate::inplace::InPlace;
use crate::sender::{KvSender, Peers, SendFuture};

/// The owner-tag file that sits beside a shared KV pool.
#[derive(Debug)]
pub struct OwnerTags {
    map: MmapMut,
    count: usize,
}

/// Path of the tag file of a pool file.
pub fn tags_path(pool: &Path) -> PathBuf {
    let mut name = pool.as_os_str().to_owned();
    name.push(".tags");
    PathBuf::from(name)
}

impl OwnerTags {
    /// Creates the tag file for `blocks` blocks, all unowned.
    pub fn create(path: &Path, blocks: usize) -> Result<Self, TransferError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        file.set_len((blocks.max(1) * 8) as u64)?;
        // SAFETY: our own fresh file; peers only touch it through atomics.
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(Self { map, count: blocks })
    }

    /// Maps an existing tag file of exactly `blocks` blocks.
    pub fn open(path: &Path, blocks: usize) -> Result<Self, TransferError> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        if file.metadata()?.len() != (blocks.max(1) * 8) as u64 {
            return Err(TransferError::LayoutMismatch(format!(
                "{} is not a tag file for {blocks} blocks",
                path.display()
            )));
        }
        // SAFETY: as in `create`.
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(Self { map, count: blocks })
    }

    fn slot(&self, block: u32) -> Option<&AtomicU64> {
        if block as usize >= self.count {
            return None;
        }
        // SAFETY: the mapping is page-aligned and holds `count` u64 slots; AtomicU64 has the
        // layout of u64, and every access (in every process) is atomic.
        Some(unsafe { &*(self.map.as_ptr().cast::<AtomicU64>().add(block as usize)) })
    }

    pub fn set(&self, block: u32, lease: u64) {
        if let Some(s) = self.slot(block) {
            s.store(lease, Ordering::Release);
        }
    }

    pub fn get(&self, block: u32) -> u64 {
        self.slot(block).map_or(0, |s| s.load(Ordering::Acquire))
    }
}

/// A prefill worker's mappings of decode workers' pools, opened once per pool file.
#[derive(Debug, Default)]
pub(crate) struct ShmPeers {
    peers: Mutex<HashMap<PathBuf, Arc<ShmPeer>>>,
}

#[derive(Debug)]
pub(crate) struct ShmPeer {
    writer: KvBlockWriter,
    tags: OwnerTags,
    /// Keeps the mapping alive.
    _cache: KvCache,
}

impl ShmPeers {
    pub(crate) fn get(
        &self,
        path: &Path,
        bytes: u64,
        layout: &KvLayout,
    ) -> Result<Arc<ShmPeer>, TransferError> {
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get(path) {
            return Ok(p.clone());
        }
        let block_bytes = layout.block_bytes() as u64;
        if bytes == 0 || !bytes.is_multiple_of(block_bytes) {
            return Err(TransferError::LayoutMismatch(format!(
                "shared pool of {bytes} bytes is not whole blocks of {block_bytes}"
            )));
        }
        let blocks = (bytes / block_bytes) as usize;
        let storage = KvStorage::open_shared(path, bytes as usize)?;
        let cache = KvCache::new(layout.clone(), blocks, storage)?;
        let peer = Arc::new(ShmPeer {
            writer: cache.block_writer(),
            tags: OwnerTags::open(&tags_path(path), blocks)?,
            _cache: cache,
        });
        peers.insert(path.to_owned(), peer.clone());
        Ok(peer)
    }

    /// Forgets a pool (its decode worker restarted, or answered with a layout error).
    pub(crate) fn forget(&self, path: &Path) {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(path);
    }
}

/// Writes a lease's blocks straight into the decode worker's shared pool.
pub(crate) struct ShmSender {
    peer: Arc<ShmPeer>,
    transfer: InPlace,
    /// Layer-major CRC-32 of every (layer, logical block) written.
    checksums: Vec<u32>,
}

impl ShmSender {
    pub(crate) fn new(
        peers: &Peers,
        dest: KvDestination,
        layout: &KvLayout,
        request_id: &str,
        num_tokens: usize,
    ) -> Result<Self, TransferError> {
        if dest.shm_path.is_empty() {
            return Err(TransferError::Connect(
                "the decode worker has no shared-memory pool".into(),
            ));
        }
        let peer = peers
            .shm
            .get(Path::new(&dest.shm_path), dest.shm_bytes, layout)?;
        let n = layout.num_layers * dest.block_ids.len();
        Ok(Self {
            peer,
            checksums: vec![0; n],
            transfer: InPlace::new(peers, dest, layout, request_id, num_tokens, Transport::Shm)?,
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
            if self.peer.tags.get(block) != t.dest.lease_id {
                return Err(TransferError::Cancelled(t.dest.lease_id));
            }
            // SAFETY: the owner tag names our lease, so the decode worker reserved this block
            // for us and reads it only after our commit.
            unsafe { self.peer.writer.write(layer, block, bytes)? };
            self.checksums[layer * nblocks + lb as usize] = crc32(bytes);
            t.mark(layer, [lb], bytes.len());
        }
        Ok(())
    }

    fn commit(self: Box<Self>, first_token: u32, first_logprob: f32) -> SendFuture {
        self.transfer
            .commit(first_token, first_logprob, self.checksums)
    }
}

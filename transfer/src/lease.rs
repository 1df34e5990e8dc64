//! The decode worker's reservations ("leases"): blocks reserved for one request's prompt KV,
//! what has arrived, and the commit that hands them to the engine.
//!
//! Each lease has a read/write lock on its state: in-process writers (gRPC and TCP receivers)
//! hold the read side while they copy into the blocks, and commit or cancel takes the write
//! side, so no byte lands in a block after its lease ended. Remote writers (shared memory)
//! are fenced by owner tags instead (see `shm`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use tandem_engine::kv::KvBlockWriter;
use tandem_proto::v1::{KvCommit, Transport};
use tokio::sync::oneshot;

use crate::checksum::crc32;
use crate::error::TransferError;
use crate::shm::OwnerTags;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    Committed,
    Cancelled,
}

/// What a verified commit hands to the request waiting on the lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Commit {
    pub first_token: u32,
    pub first_logprob: f32,
    /// KV bytes received (or, for shared memory, verified in place).
    pub bytes: u64,
    pub transport: Transport,
}

/// A device KV pool that the `nccl` transport receives into: its base address, block count,
/// and bytes per (layer, block) piece (layer-major, as in [`tandem_engine::kv::DeviceKv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePool {
    pub base: u64,
    pub num_blocks: usize,
    pub piece: usize,
}

/// How far a lease got, for timeouts and metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    pub bytes: u64,
    pub idle: Duration,
}

/// One reservation.
#[derive(Debug)]
pub struct Lease {
    pub id: u64,
    /// Physical block of each logical block of the prompt.
    pub blocks: Vec<u32>,
    pub num_tokens: usize,
    pub request_id: String,
    state: RwLock<State>,
    /// `layers × blocks` flags of pieces received and checked.
    received: Mutex<Vec<bool>>,
    bytes: AtomicU64,
    last_progress: Mutex<Instant>,
    commit_tx: Mutex<Option<oneshot::Sender<Result<Commit, String>>>>,
}

impl Lease {
    /// Bytes so far and time since the last piece arrived.
    pub fn progress(&self) -> Progress {
        let last = *self.last_progress.lock().unwrap_or_else(|p| p.into_inner());
        Progress {
            bytes: self.bytes.load(Ordering::Relaxed),
            idle: last.elapsed(),
        }
    }

    fn touch(&self) {
        *self.last_progress.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }
}

/// All open leases of one decode worker.
#[derive(Debug)]
pub struct LeaseTable {
    leases: Mutex<HashMap<u64, Arc<Lease>>>,
    writer: KvBlockWriter,
    layout_hash: String,
    next_id: AtomicU64,
    tags: Option<OwnerTags>,
    /// Bytes of one (layer, block) piece of the device pool, when a GPU engine exported it
    /// (the `cuda-ipc` transport writes there).
    device_block_layer_bytes: Option<usize>,
}

impl LeaseTable {
    /// `tags` is set when the pool is shared with prefill workers through shared memory.
    pub fn new(writer: KvBlockWriter, layout_hash: String, tags: Option<OwnerTags>) -> Self {
        Self {
            leases: Mutex::new(HashMap::new()),
            writer,
            layout_hash,
            // Start from the clock so lease ids from a restarted worker do not repeat.
            next_id: AtomicU64::new(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64 | 1),
            ),
            tags,
            device_block_layer_bytes: None,
        }
    }

    /// Accepts `cuda-ipc` commits into a device pool whose (layer, block) pieces are
    /// `block_layer_bytes` long.
    pub fn with_device_pool(mut self, block_layer_bytes: usize) -> Self {
        self.device_block_layer_bytes = Some(block_layer_bytes);
        self
    }

    pub fn layout_hash(&self) -> &str {
        &self.layout_hash
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Lease>>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a lease over blocks the engine reserved; the receiver resolves on commit.
    ///
    /// The receiver yields the commit, or why the transfer failed (corrupt or incomplete data).
    pub fn create(
        &self,
        blocks: Vec<u32>,
        num_tokens: usize,
        request_id: &str,
    ) -> (Arc<Lease>, oneshot::Receiver<Result<Commit, String>>) {
        let id = self.next_id.fetch_add(2, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let layers = self.writer.layout().num_layers;
        let lease = Arc::new(Lease {
            id,
            received: Mutex::new(vec![false; layers * blocks.len()]),
            blocks,
            num_tokens,
            request_id: request_id.to_string(),
            state: RwLock::new(State::Open),
            bytes: AtomicU64::new(0),
            last_progress: Mutex::new(Instant::now()),
            commit_tx: Mutex::new(Some(tx)),
        });
        if let Some(tags) = &self.tags {
            for &b in &lease.blocks {
                tags.set(b, id);
            }
        }
        self.map().insert(id, lease.clone());
        (lease, rx)
    }

    /// Checks a transfer's opening: the lease exists and the sender's layout is ours.
    pub fn check_header(
        &self,
        lease_id: u64,
        layout_hash: &str,
    ) -> Result<Arc<Lease>, TransferError> {
        if layout_hash != self.layout_hash {
            return Err(TransferError::LayoutMismatch(format!(
                "sender layout {layout_hash} differs from this worker's {}",
                self.layout_hash
            )));
        }
        self.map()
            .get(&lease_id)
            .cloned()
            .ok_or(TransferError::UnknownLease(lease_id))
    }

    /// Writes some blocks of one layer (`payload` holds them back to back) after checking
    /// indices, sizes and checksums. Returns the bytes written.
    pub fn write_blocks(
        &self,
        lease: &Lease,
        layer: usize,
        logical: &[u32],
        checksums: &[u32],
        payload: &[u8],
    ) -> Result<u64, TransferError> {
        let result = self.write_blocks_checked(lease, layer, logical, checksums, payload);
        if let Err(e @ TransferError::Corrupt(_)) = &result {
            // Bad data poisons the whole request: fail it now rather than at the lease timeout.
            self.fail(lease, e.to_string());
        }
        result
    }

    fn write_blocks_checked(
        &self,
        lease: &Lease,
        layer: usize,
        logical: &[u32],
        checksums: &[u32],
        payload: &[u8],
    ) -> Result<u64, TransferError> {
        let layout = self.writer.layout();
        let bb = layout.block_layer_bytes();
        if layer >= layout.num_layers {
            return Err(TransferError::Corrupt(format!(
                "layer {layer} of {}",
                layout.num_layers
            )));
        }
        if logical.len() != checksums.len() || payload.len() != logical.len() * bb {
            return Err(TransferError::Corrupt(format!(
                "{} blocks, {} checksums, {} payload bytes (block is {bb} bytes)",
                logical.len(),
                checksums.len(),
                payload.len()
            )));
        }
        let state = lease.state.read().unwrap_or_else(|p| p.into_inner());
        match *state {
            State::Open => {}
            State::Cancelled => return Err(TransferError::Cancelled(lease.id)),
            State::Committed => {
                return Err(TransferError::Protocol(format!(
                    "lease {} already committed",
                    lease.id
                )));
            }
        }
        for ((&lb, &crc), bytes) in logical.iter().zip(checksums).zip(payload.chunks_exact(bb)) {
            let Some(&block) = lease.blocks.get(lb as usize) else {
                return Err(TransferError::Corrupt(format!(
                    "logical block {lb} outside the lease of {}",
                    lease.blocks.len()
                )));
            };
            let got = crc32(bytes);
            if got != crc {
                return Err(TransferError::Corrupt(format!(
                    "checksum of layer {layer} block {lb}: {got:08x} != {crc:08x}"
                )));
            }
            // SAFETY: the block belongs to this open lease, and the state read guard keeps
            // commit and cancel (which end the lease's ownership) out until we are done.
            unsafe { self.writer.write(layer, block, bytes)? };
            let mut received = lease.received.lock().unwrap_or_else(|p| p.into_inner());
            received[layer * lease.blocks.len() + lb as usize] = true;
        }
        let n = payload.len() as u64;
        lease.bytes.fetch_add(n, Ordering::Relaxed);
        lease.touch();
        Ok(n)
    }

    /// Verifies a commit and hands the KV to the waiting request. In-process transports must
    /// have delivered every (layer, block); shared memory is verified by its checksums.
    pub fn commit(&self, c: &KvCommit) -> Result<u64, TransferError> {
        let lease = self.check_header(c.lease_id, &c.kv_layout_hash)?;
        let mut state = lease.state.write().unwrap_or_else(|p| p.into_inner());
        if *state != State::Open {
            return Err(TransferError::Cancelled(lease.id));
        }
        let transport = Transport::try_from(c.transport).unwrap_or(Transport::Unspecified);
        let bytes = match self.verify(&lease, c, transport) {
            Ok(bytes) => bytes,
            Err(e) => {
                drop(state);
                self.fail(&lease, e.to_string());
                return Err(e);
            }
        };
        *state = State::Committed;
        drop(state);
        self.end(&lease);
        let commit = Commit {
            first_token: c.first_token,
            first_logprob: c.first_logprob,
            bytes,
            transport,
        };
        if let Some(tx) = lease
            .commit_tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            // The request may have gone away meanwhile; its cleanup releases the blocks.
            let _ = tx.send(Ok(commit));
        }
        Ok(bytes)
    }

    fn verify(
        &self,
        lease: &Lease,
        c: &KvCommit,
        transport: Transport,
    ) -> Result<u64, TransferError> {
        if c.num_tokens as usize != lease.num_tokens {
            return Err(TransferError::Corrupt(format!(
                "commit for {} tokens, lease holds {}",
                c.num_tokens, lease.num_tokens
            )));
        }
        let layers = self.writer.layout().num_layers;
        let nblocks = lease.blocks.len();
        if transport == Transport::Shm {
            if c.checksums.len() != layers * nblocks {
                return Err(TransferError::Incomplete(format!(
                    "{} checksums for {} block-layers",
                    c.checksums.len(),
                    layers * nblocks
                )));
            }
            // The pieces were written by another process: read them back once, on every
            // core (this is the commit's tail latency).
            (0..layers * nblocks).into_par_iter().try_for_each(|i| {
                let (layer, lb) = (i / nblocks, i % nblocks);
                // SAFETY: the caller holds the state write guard, which excludes in-process
                // writers; the remote sender finished before committing.
                let bytes = unsafe { self.writer.read(layer, lease.blocks[lb])? };
                let got = crc32(bytes);
                let want = c.checksums[i];
                if got != want {
                    return Err(TransferError::Corrupt(format!(
                        "checksum of layer {layer} block {lb}: {got:08x} != {want:08x}"
                    )));
                }
                Ok(())
            })?;
            Ok((layers * nblocks * self.writer.layout().block_layer_bytes()) as u64)
        } else if transport == Transport::CudaIpc {
            // The pieces went device to device; reading them back to the host would cost more
            // than the copy. The sender fenced each block on its owner tag and counted the
            // bytes: they must cover every (layer, block) of the lease.
            let Some(piece) = self.device_block_layer_bytes else {
                return Err(TransferError::Protocol(
                    "this worker has no device KV pool to receive cuda-ipc".into(),
                ));
            };
            let expected = (layers * nblocks * piece) as u64;
            if c.bytes != expected {
                return Err(TransferError::Incomplete(format!(
                    "cuda-ipc commit covers {} bytes, the lease needs {expected}",
                    c.bytes
                )));
            }
            Ok(expected)
        } else {
            let received = lease.received.lock().unwrap_or_else(|p| p.into_inner());
            let missing = received.iter().filter(|r| !**r).count();
            if missing > 0 {
                return Err(TransferError::Incomplete(format!(
                    "{missing} of {} block-layers never arrived",
                    received.len()
                )));
            }
            Ok(lease.bytes.load(Ordering::Relaxed))
        }
    }

    /// Ends an open lease because its transfer went wrong, telling the waiting request why.
    /// The waiter releases the blocks.
    fn fail(&self, lease: &Lease, reason: String) {
        let mut state = lease.state.write().unwrap_or_else(|p| p.into_inner());
        if *state != State::Open {
            return;
        }
        *state = State::Cancelled;
        drop(state);
        self.end(lease);
        if let Some(tx) = lease
            .commit_tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = tx.send(Err(reason));
        }
    }

    /// Counts as progress on an open lease (its prompt is queued at a live prefill worker).
    /// Receives one layer of a lease's blocks straight into this worker's device pool (the
    /// `nccl` transport). `land` gets the device address of each of `logical`'s blocks in
    /// `pool`, or `None` when they must be drained instead (lease unknown or ended, layer or
    /// block outside it, a pool that is not ours), and must finish every write before it
    /// returns: the lease is held open meanwhile, so no commit or cancel can hand the blocks on.
    /// Received pieces count toward the commit. Returns whether the data was kept.
    pub fn receive_device(
        &self,
        lease_id: u64,
        layer: usize,
        logical: &[u32],
        pool: &DevicePool,
        land: impl FnOnce(Option<&[u64]>) -> Result<(), TransferError>,
    ) -> Result<bool, TransferError> {
        let lease = self.map().get(&lease_id).cloned();
        let layers = self.writer.layout().num_layers;
        let Some(lease) = lease else {
            land(None)?;
            return Ok(false);
        };
        let state = lease.state.read().unwrap_or_else(|p| p.into_inner());
        let targets: Option<Vec<u64>> = (*state == State::Open
            && layer < layers
            && self.device_block_layer_bytes == Some(pool.piece))
        .then(|| {
            logical
                .iter()
                .map(|&lb| {
                    let block = *lease.blocks.get(lb as usize)? as usize;
                    (block < pool.num_blocks).then(|| {
                        pool.base + ((layer * pool.num_blocks + block) * pool.piece) as u64
                    })
                })
                .collect()
        })
        .flatten();
        land(targets.as_deref())?;
        if targets.is_none() {
            return Ok(false);
        }
        let mut received = lease.received.lock().unwrap_or_else(|p| p.into_inner());
        let nblocks = lease.blocks.len();
        for &lb in logical {
            received[layer * nblocks + lb as usize] = true;
        }
        drop(received);
        lease
            .bytes
            .fetch_add((logical.len() * pool.piece) as u64, Ordering::Relaxed);
        lease.touch();
        Ok(true)
    }

    /// Waits until every piece of an open lease has been received, up to `timeout` (a
    /// device transport's commit can overtake its last receive). Returns whether it has.
    pub async fn wait_received(&self, lease_id: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let complete = match self.map().get(&lease_id) {
                Some(l) => l
                    .received
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .all(|r| *r),
                None => return false,
            };
            if complete || Instant::now() >= deadline {
                return complete;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Returns whether the lease is still open.
    pub fn renew(&self, lease_id: u64) -> bool {
        let Some(lease) = self.map().get(&lease_id).cloned() else {
            return false;
        };
        lease.touch();
        true
    }

    /// Ends an open lease (request cancelled, lease expired, transfer failed). Returns its
    /// blocks for the caller to release, or `None` if it had already committed or ended.
    pub fn cancel(&self, lease_id: u64) -> Option<Vec<u32>> {
        let lease = self.map().get(&lease_id).cloned()?;
        let mut state = lease.state.write().unwrap_or_else(|p| p.into_inner());
        if *state != State::Open {
            return None;
        }
        *state = State::Cancelled;
        drop(state);
        self.end(&lease);
        Some(lease.blocks.clone())
    }

    /// Whether remote writers can still be writing into a cancelled lease's blocks (so they
    /// must sit in quarantine before reuse).
    pub fn has_remote_writers(&self) -> bool {
        self.tags.is_some()
    }

    fn end(&self, lease: &Lease) {
        if let Some(tags) = &self.tags {
            for &b in &lease.blocks {
                tags.set(b, 0);
            }
        }
        self.map().remove(&lease.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_engine::kv::{KvCache, KvDtype, KvLayout};

    fn setup() -> (KvCache, LeaseTable) {
        let layout = KvLayout {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 4,
            block_size: 16,
            dtype: KvDtype::F32,
            model_fingerprint: "m".into(),
        };
        let hash = layout.hash();
        let cache = KvCache::with_budget(layout.clone(), 8 * layout.block_bytes()).unwrap();
        let table = LeaseTable::new(cache.block_writer(), hash, None);
        (cache, table)
    }

    fn commit_msg(table: &LeaseTable, lease: &Lease, transport: Transport) -> KvCommit {
        KvCommit {
            lease_id: lease.id,
            kv_layout_hash: table.layout_hash().into(),
            first_token: 7,
            first_logprob: -0.5,
            num_tokens: lease.num_tokens as u32,
            transport: transport as i32,
            ..Default::default()
        }
    }

    #[test]
    fn full_transfer_commits_and_lands_in_the_blocks() {
        let (cache, table) = setup();
        let bb = cache.layout().block_layer_bytes();
        let (lease, mut rx) = table.create(vec![5, 2], 20, "r1");
        let payload = |layer: usize| -> Vec<u8> {
            (0..2 * bb).map(|i| (i % 200) as u8 + layer as u8).collect()
        };
        for layer in 0..2 {
            let p = payload(layer);
            let crcs = [crc32(&p[..bb]), crc32(&p[bb..])];
            table
                .write_blocks(&lease, layer, &[0, 1], &crcs, &p)
                .unwrap();
        }
        assert_eq!(
            table
                .commit(&commit_msg(&table, &lease, Transport::Tcp))
                .unwrap(),
            4 * bb as u64
        );
        let c = rx.try_recv().unwrap().unwrap();
        assert_eq!((c.first_token, c.bytes), (7, 4 * bb as u64));
        assert_eq!(
            cache.block_layer_bytes(1, 2).unwrap(),
            &payload(1)[bb..],
            "logical 1 of layer 1 went to block 2"
        );
        assert_eq!(cache.block_layer_bytes(0, 5).unwrap(), &payload(0)[..bb]);
        assert!(table.is_empty());
        assert!(
            table.cancel(lease.id).is_none(),
            "a committed lease cannot be cancelled"
        );
    }

    #[test]
    fn bad_transfers_are_refused() {
        let (cache, table) = setup();
        let bb = cache.layout().block_layer_bytes();
        let payload = vec![1u8; bb];
        let good = crc32(&payload);
        let bad_cases: [(usize, u32, u32, &[u8]); 4] = [
            (0, 0, good ^ 1, &payload),
            (0, 3, good, &payload),
            (9, 0, good, &payload),
            (0, 0, good, &payload[1..]),
        ];
        for (layer, lb, crc, data) in bad_cases {
            let (lease, _rx) = table.create(vec![0], 5, "r");
            assert!(matches!(
                table.write_blocks(&lease, layer, &[lb], &[crc], data),
                Err(TransferError::Corrupt(_))
            ));
        }
        let (lease, mut rx) = table.create(vec![0], 5, "r");
        assert!(
            table
                .write_blocks(&lease, 0, &[0], &[good ^ 1], &payload)
                .is_err()
        );
        assert!(matches!(
            table.check_header(lease.id, "other"),
            Err(TransferError::LayoutMismatch(_))
        ));
        assert!(matches!(
            table.check_header(12345, table.layout_hash()),
            Err(TransferError::UnknownLease(_))
        ));
        // The first corrupt piece failed the lease and told the waiting request why.
        let why = rx.try_recv().unwrap().unwrap_err();
        assert!(why.contains("checksum"), "{why}");
        assert!(matches!(
            table.write_blocks(&lease, 0, &[0], &[good], &payload),
            Err(TransferError::Cancelled(_))
        ));
        assert!(table.cancel(lease.id).is_none(), "already ended");

        // An incomplete transfer fails at commit.
        let (lease, mut rx) = table.create(vec![1], 5, "r2");
        table
            .write_blocks(&lease, 0, &[0], &[good], &payload)
            .unwrap();
        let mut wrong_len = commit_msg(&table, &lease, Transport::Grpc);
        wrong_len.num_tokens = 6;
        assert!(table.commit(&wrong_len).is_err());
        assert!(rx.try_recv().unwrap().is_err());

        // Cancel returns the blocks once; writes after it are refused.
        let (lease, _rx) = table.create(vec![2], 5, "r3");
        table
            .write_blocks(&lease, 0, &[0], &[good], &payload)
            .unwrap();
        assert!(matches!(
            table.commit(&commit_msg(&table, &lease, Transport::Grpc)),
            Err(TransferError::Incomplete(_))
        ));
        let (lease, _rx) = table.create(vec![2], 5, "r4");
        assert_eq!(table.cancel(lease.id), Some(vec![2]));
        assert!(table.cancel(lease.id).is_none());
        assert!(matches!(
            table.write_blocks(&lease, 1, &[0], &[good], &payload),
            Err(TransferError::Cancelled(_))
        ));
    }

    #[test]
    fn cuda_ipc_commits_must_cover_the_device_pieces() {
        let (_cache, table) = setup();
        let (lease, _rx) = table.create(vec![1, 2], 20, "r");
        let refused = table.commit(&commit_msg(&table, &lease, Transport::CudaIpc));
        assert!(
            refused
                .unwrap_err()
                .to_string()
                .contains("no device KV pool"),
            "a worker without a device pool refuses cuda-ipc"
        );

        let (_cache, table) = setup();
        let table = table.with_device_pool(100);
        let (lease, mut rx) = table.create(vec![1, 2], 20, "r");
        let mut short = commit_msg(&table, &lease, Transport::CudaIpc);
        short.bytes = 2 * 2 * 100 - 1;
        let why = table.commit(&short).unwrap_err().to_string();
        assert!(why.contains("covers 399 bytes"), "{why}");
        assert!(
            rx.try_recv().unwrap().is_err(),
            "a short commit fails the lease"
        );

        let (lease, mut rx) = table.create(vec![3, 4], 20, "r");
        let mut whole = commit_msg(&table, &lease, Transport::CudaIpc);
        whole.bytes = 2 * 2 * 100;
        assert_eq!(table.commit(&whole).unwrap(), 400);
        let commit = rx.try_recv().unwrap().unwrap();
        assert_eq!(commit.transport, Transport::CudaIpc);
    }

    #[test]
    fn shm_commits_are_verified_by_checksum_in_place() {
        let (mut cache, table) = setup();
        let bb = cache.layout().block_layer_bytes();
        let (lease, mut rx) = table.create(vec![3], 16, "r");
        let mut checksums = Vec::new();
        for layer in 0..2 {
            let data = vec![layer as u8 + 9; bb];
            cache.write_block_layer_bytes(layer, 3, &data).unwrap();
            checksums.push(crc32(&data));
        }
        let mut c = commit_msg(&table, &lease, Transport::Shm);
        c.checksums = vec![checksums[0], checksums[1] ^ 0xff];
        assert!(matches!(table.commit(&c), Err(TransferError::Corrupt(_))));
        assert!(
            rx.try_recv().unwrap().is_err(),
            "a bad checksum fails the lease"
        );
        let (lease, mut rx) = table.create(vec![3], 16, "r2");
        let mut c = commit_msg(&table, &lease, Transport::Shm);
        c.checksums = checksums;
        table.commit(&c).unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap().transport, Transport::Shm);
    }
}

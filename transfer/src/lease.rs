//! The decode worker's reservations ("leases"): blocks reserved for one request's prompt KV,
//! what has arrived, and the commit that hands them to the engine.
//!
//! Each lease has a read/write lock on its state: in-process writers (the gRPC and TCP
//! receivers, the `nccl` receiver thread) hold the read side while they write the blocks, and
//! commit or cancel takes the write side, so no byte lands in a block after its lease ended.
//! Remote writers (`shm`, `cuda-ipc`) are fenced by owner tags instead (see `shm`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockWriteGuard};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use sha2::{Digest, Sha256};
use tandem_kv::KvBlockWriter;
use tandem_proto::limits::LEASE_TOKEN_BYTES;
use tandem_proto::v1::{KvCommit, Transport};
use tokio::sync::oneshot;

use crate::checksum::crc32;
use crate::error::TransferError;
use crate::sender::{FirstToken, other_choices_from_proto, top_logprobs_from_proto};
use tandem_kv::shm::OwnerTags;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    Committed,
    Cancelled,
}

/// A lease's capability: 128 random bits from the OS. Holding it is the only way to write
/// the lease's blocks or commit them, so nothing else names a lease on the wire, and it is
/// never logged (its `Debug` is redacted; logs use the request id).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken([u8; LEASE_TOKEN_BYTES]);

impl std::fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseToken(<redacted>)")
    }
}

impl LeaseToken {
    /// A fresh capability.
    pub fn generate() -> Result<Self, TransferError> {
        tandem_auth::random_bytes::<LEASE_TOKEN_BYTES>()
            .map(Self)
            .map_err(|e| TransferError::Protocol(e.to_string()))
    }

    /// A capability as it came over the wire; anything but 16 bytes names no lease.
    pub fn from_wire(bytes: &[u8]) -> Result<Self, TransferError> {
        <[u8; LEASE_TOKEN_BYTES]>::try_from(bytes)
            .map(Self)
            .map_err(|_| TransferError::UnknownLease)
    }

    pub fn as_bytes(&self) -> &[u8; LEASE_TOKEN_BYTES] {
        &self.0
    }

    /// The value written to the owner tags of the lease's blocks (shared memory, cuda-ipc):
    /// derived one way from the capability, so a process that can read the tag file learns
    /// nothing it could commit with. Never 0 (0 means "no owner").
    pub fn fence(&self) -> u64 {
        let digest = Sha256::new()
            .chain_update(b"tandem/v1/fence")
            .chain_update(self.0)
            .finalize();
        let mut head = [0u8; 8];
        head.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(head).max(1)
    }
}

/// What a verified commit hands to the request waiting on the lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Commit {
    pub first_token: u32,
    pub first_logprob: f32,
    /// The first token's alternatives (as many as the request asked for).
    pub first_top_logprobs: Vec<(u32, f32)>,
    /// The first tokens of choices 1.. of an `n > 1` request.
    pub other_choices: Vec<FirstToken>,
    /// KV bytes received (or, for shared memory, verified in place).
    pub bytes: u64,
    pub transport: Transport,
}

/// A device KV pool that the `nccl` transport receives into: its base address, block count,
/// and bytes per (layer, block) piece (layer-major, as in [`tandem_kv::DeviceKv`]).
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
    /// Since the lease was opened.
    pub age: Duration,
}

/// A new lease, and the receiver that resolves on its commit (or says why it failed).
pub type Opened = (Arc<Lease>, oneshot::Receiver<Result<Commit, String>>);

/// Blocks held in open leases, per caller (the address a reservation came from), bounded by
/// [`LeaseTable::with_caller_quota`]. A claim is taken before blocks are reserved and given
/// back when its lease ends (committed blocks belong to the engine, not to the caller).
#[derive(Debug, Default)]
struct Quota {
    max_blocks: Option<usize>,
    held: Mutex<HashMap<String, usize>>,
}

/// Blocks one caller may hold in an open lease; released on drop.
#[derive(Debug)]
pub struct QuotaClaim {
    quota: Arc<Quota>,
    caller: String,
    blocks: usize,
}

impl Drop for QuotaClaim {
    fn drop(&mut self) {
        let mut held = self.quota.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.caller) {
            *n = n.saturating_sub(self.blocks);
            if *n == 0 {
                held.remove(&self.caller);
            }
        }
    }
}

/// One reservation.
#[derive(Debug)]
pub struct Lease {
    token: LeaseToken,
    /// `token.fence()`, computed once.
    fence: u64,
    /// Physical block of each logical block of the prompt that the lease receives.
    pub blocks: Vec<u32>,
    /// Physical blocks of the prompt's cached prefix that the decode worker holds for the
    /// request (logical blocks 0.., before `blocks`): never written by the peer, readable by
    /// the lease's holder ([`LeaseTable::read_cached`]) while the lease is open.
    pub cached: Vec<u32>,
    pub num_tokens: usize,
    pub request_id: String,
    state: RwLock<State>,
    /// `layers × blocks` flags of pieces received and checked.
    received: Mutex<Vec<bool>>,
    bytes: AtomicU64,
    /// The sender has begun to send KV (a transport saw its first KV frame): from then on
    /// only arriving KV counts as progress, not the router's renewals.
    sending: AtomicBool,
    opened: Instant,
    last_progress: Mutex<Instant>,
    commit_tx: Mutex<Option<oneshot::Sender<Result<Commit, String>>>>,
    claim: Mutex<Option<QuotaClaim>>,
}

impl Lease {
    /// The capability, for the one party that must get it (the router, in the Lease event).
    pub fn token(&self) -> &LeaseToken {
        &self.token
    }

    /// Bytes so far, time since the last piece arrived, and age.
    pub fn progress(&self) -> Progress {
        let last = *self.last_progress.lock().unwrap_or_else(|p| p.into_inner());
        Progress {
            bytes: self.bytes.load(Ordering::Relaxed),
            idle: last.elapsed(),
            age: self.opened.elapsed(),
        }
    }

    /// The sender has begun to send this lease's KV: a transfer that stalls from here on
    /// expires within the lease period whatever the renewals (see [`LeaseTable::renew`]).
    pub fn note_sending(&self) {
        self.sending.store(true, Ordering::Relaxed);
        self.touch();
    }

    fn touch(&self) {
        *self.last_progress.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }
}

/// All open leases of one decode worker.
#[derive(Debug)]
pub struct LeaseTable {
    leases: Mutex<HashMap<LeaseToken, Arc<Lease>>>,
    writer: KvBlockWriter,
    layout_hash: String,
    tags: Option<OwnerTags>,
    /// Bytes of one (layer, block) piece of the device pool, when a GPU engine exported it
    /// (the `cuda-ipc` transport writes there).
    device_block_layer_bytes: Option<usize>,
    quota: Arc<Quota>,
}

impl LeaseTable {
    /// `tags` is set when the pool is shared with prefill workers through shared memory.
    pub fn new(writer: KvBlockWriter, layout_hash: String, tags: Option<OwnerTags>) -> Self {
        Self {
            leases: Mutex::new(HashMap::new()),
            writer,
            layout_hash,
            tags,
            device_block_layer_bytes: None,
            quota: Arc::default(),
        }
    }

    /// Accepts `cuda-ipc` commits into a device pool whose (layer, block) pieces are
    /// `block_layer_bytes` long.
    pub fn with_device_pool(mut self, block_layer_bytes: usize) -> Self {
        self.device_block_layer_bytes = Some(block_layer_bytes);
        self
    }

    /// Lets one caller hold at most `max_blocks` blocks in open leases.
    pub fn with_caller_quota(mut self, max_blocks: usize) -> Self {
        self.quota = Arc::new(Quota {
            max_blocks: Some(max_blocks),
            held: Mutex::default(),
        });
        self
    }

    pub fn layout_hash(&self) -> &str {
        &self.layout_hash
    }

    /// Bytes of one (layer, block) piece of the host pool.
    pub fn piece_bytes(&self) -> usize {
        self.writer.layout().block_layer_bytes()
    }

    pub fn num_layers(&self) -> usize {
        self.writer.layout().num_layers
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<LeaseToken, Arc<Lease>>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, token: &LeaseToken) -> Option<Arc<Lease>> {
        self.map().get(token).cloned()
    }

    /// Takes `blocks` of `caller`'s quota for a lease about to be opened, or refuses: for now
    /// when the caller already holds too many in open leases (`QuotaExceeded`), for good when
    /// `blocks` alone is more than the quota (`BeyondQuota`).
    pub fn claim(&self, caller: &str, blocks: usize) -> Result<QuotaClaim, TransferError> {
        if let Some(max) = self.quota.max_blocks
            && blocks > max
        {
            return Err(TransferError::BeyondQuota(format!(
                "the prompt needs {blocks} KV blocks and one caller may hold at most {max} in \
                 reservations"
            )));
        }
        let mut held = self.quota.held.lock().unwrap_or_else(|p| p.into_inner());
        let now = held.get(caller).copied().unwrap_or(0);
        if let Some(max) = self.quota.max_blocks
            && now + blocks > max
        {
            return Err(TransferError::QuotaExceeded(format!(
                "this caller holds {now} KV blocks in reservations awaiting their KV and may \
                 hold at most {max}; {blocks} more were asked for"
            )));
        }
        *held.entry(caller.to_string()).or_default() += blocks;
        Ok(QuotaClaim {
            quota: Arc::clone(&self.quota),
            caller: caller.to_string(),
            blocks,
        })
    }

    /// Opens a lease over blocks the engine reserved, outside any caller's quota (tests and
    /// tools); the receiver resolves on commit.
    pub fn create(
        &self,
        blocks: Vec<u32>,
        num_tokens: usize,
        request_id: &str,
    ) -> Result<Opened, TransferError> {
        self.create_claimed(None, blocks, Vec::new(), num_tokens, request_id)
    }

    /// Opens a lease over `blocks` after the held prefix `cached` (both counted against
    /// `claim` until it ends); the caller keeps the blocks of both and releases them.
    pub fn create_claimed(
        &self,
        claim: Option<QuotaClaim>,
        blocks: Vec<u32>,
        cached: Vec<u32>,
        num_tokens: usize,
        request_id: &str,
    ) -> Result<Opened, TransferError> {
        let token = LeaseToken::generate()?;
        let (tx, rx) = oneshot::channel();
        let layers = self.writer.layout().num_layers;
        let now = Instant::now();
        let lease = Arc::new(Lease {
            fence: token.fence(),
            token,
            received: Mutex::new(vec![false; layers * blocks.len()]),
            blocks,
            cached,
            num_tokens,
            request_id: request_id.to_string(),
            state: RwLock::new(State::Open),
            bytes: AtomicU64::new(0),
            sending: AtomicBool::new(false),
            opened: now,
            last_progress: Mutex::new(now),
            commit_tx: Mutex::new(Some(tx)),
            claim: Mutex::new(claim),
        });
        if let Some(tags) = &self.tags {
            for &b in &lease.blocks {
                tags.set(b, lease.fence);
            }
        }
        self.map().insert(token, lease.clone());
        Ok((lease, rx))
    }

    /// Checks a transfer's opening: the sender's layout is ours and it holds a live lease.
    /// A token that names no open lease gets the same answer whether it never existed or
    /// ended, and touches nothing.
    pub fn check_header(
        &self,
        lease: &[u8],
        layout_hash: &str,
    ) -> Result<Arc<Lease>, TransferError> {
        if layout_hash != self.layout_hash {
            return Err(TransferError::LayoutMismatch(format!(
                "sender layout {layout_hash} differs from this worker's {}",
                self.layout_hash
            )));
        }
        let token = LeaseToken::from_wire(lease)?;
        self.get(&token).ok_or(TransferError::UnknownLease)
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
            State::Cancelled => return Err(TransferError::Cancelled),
            State::Committed => {
                return Err(TransferError::Protocol(
                    "the lease is already committed".into(),
                ));
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
    /// have delivered every (layer, block); shared memory is verified by its checksums,
    /// `cuda-ipc` by the bytes its sender counted.
    pub fn commit(&self, c: &KvCommit) -> Result<u64, TransferError> {
        let lease = self.check_header(&c.lease, &c.kv_layout_hash)?;
        let state = lease.state.write().unwrap_or_else(|p| p.into_inner());
        if *state != State::Open {
            return Err(TransferError::Cancelled);
        }
        let transport = Transport::try_from(c.transport).unwrap_or(Transport::Unspecified);
        let verified = top_logprobs_from_proto(&c.first_top_logprobs).and_then(|top| {
            let others = other_choices_from_proto(&c.other_choices)?;
            Ok(((top, others), self.verify(&lease, c, transport)?))
        });
        let ((first_top_logprobs, other_choices), bytes) = match verified {
            Ok(bytes) => bytes,
            Err(e) => {
                drop(state);
                self.fail(&lease, e.to_string());
                return Err(e);
            }
        };
        let commit = Commit {
            first_token: c.first_token,
            first_logprob: c.first_logprob,
            first_top_logprobs,
            other_choices,
            bytes,
            transport,
        };
        self.settle(&lease, state, Ok(commit));
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
        let state = lease.state.write().unwrap_or_else(|p| p.into_inner());
        if *state != State::Open {
            return;
        }
        self.settle(lease, state, Err(reason));
    }

    /// Ends an open lease, whose state the caller holds, with `outcome` (committed or
    /// failed), and tells the waiting request.
    fn settle(
        &self,
        lease: &Lease,
        mut state: RwLockWriteGuard<'_, State>,
        outcome: Result<Commit, String>,
    ) {
        *state = if outcome.is_ok() {
            State::Committed
        } else {
            State::Cancelled
        };
        drop(state);
        self.end(lease);
        if let Some(tx) = lease
            .commit_tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            // The request may have gone away meanwhile; its cleanup releases the blocks.
            let _ = tx.send(outcome);
        }
    }

    /// Receives one layer of a lease's blocks straight into this worker's device pool (the
    /// `nccl` transport). `land` gets the device address of each of `logical`'s blocks in
    /// `pool`, or `None` when they must be drained instead (lease unknown or ended, layer or
    /// block outside it, a pool that is not ours), and must finish every write before it
    /// returns: the lease is held open meanwhile, so no commit or cancel can hand the blocks on.
    /// Received pieces count toward the commit. Returns whether the data was kept.
    pub fn receive_device(
        &self,
        lease: &LeaseToken,
        layer: usize,
        logical: &[u32],
        pool: &DevicePool,
        land: impl FnOnce(Option<&[u64]>) -> Result<(), TransferError>,
    ) -> Result<bool, TransferError> {
        let lease = self.get(lease);
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
    pub async fn wait_received(&self, lease: &[u8], timeout: Duration) -> bool {
        let Ok(token) = LeaseToken::from_wire(lease) else {
            return false;
        };
        let deadline = Instant::now() + timeout;
        loop {
            let complete = match self.get(&token) {
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

    /// Reads blocks of the cached prefix an open lease holds (PullKv): `logical` indexes
    /// [`Lease::cached`], and the answer is their bytes of `layer` back to back with a CRC-32
    /// of each. Refused when this worker's cache is its device pool (the host copy may be
    /// stale).
    pub fn read_cached(
        &self,
        lease: &Lease,
        layer: usize,
        logical: std::ops::Range<usize>,
    ) -> Result<(Vec<u8>, Vec<u32>), TransferError> {
        if self.device_block_layer_bytes.is_some() {
            return Err(TransferError::Unsupported(
                "this decode worker's cached KV lives in its device pool".into(),
            ));
        }
        let layout = self.writer.layout();
        if layer >= layout.num_layers || logical.end > lease.cached.len() || logical.is_empty() {
            return Err(TransferError::Protocol(format!(
                "layer {layer}, blocks {logical:?}: the lease holds {} cached blocks of {} layers",
                lease.cached.len(),
                layout.num_layers
            )));
        }
        let bb = layout.block_layer_bytes();
        let mut payload = Vec::with_capacity(logical.len() * bb);
        let mut checksums = Vec::with_capacity(logical.len());
        let state = lease.state.read().unwrap_or_else(|p| p.into_inner());
        if *state != State::Open {
            return Err(TransferError::UnknownLease);
        }
        for &block in &lease.cached[logical] {
            // SAFETY: the lease's holder keeps its cached blocks until the lease ends, and
            // cancel or commit (after which they may be released) waits for this read guard;
            // a held cached block is full and never written.
            let bytes = unsafe { self.writer.read(layer, block)? };
            checksums.push(crc32(bytes));
            payload.extend_from_slice(bytes);
        }
        drop(state);
        lease.touch();
        Ok((payload, checksums))
    }

    /// Counts as progress on an open lease whose KV has not started to arrive (its prompt is
    /// queued or computing at a live prefill worker). Once KV has begun to arrive only more
    /// KV counts: a transfer that stalls mid-way (a link that went silent) must end within the
    /// lease period, however faithfully the router renews. Returns whether the lease is
    /// still open.
    pub fn renew(&self, lease: &[u8]) -> bool {
        let Some(lease) = LeaseToken::from_wire(lease).ok().and_then(|t| self.get(&t)) else {
            return false;
        };
        if !lease.sending.load(Ordering::Relaxed) && lease.bytes.load(Ordering::Relaxed) == 0 {
            lease.touch();
        }
        true
    }

    /// Ends an open lease (request cancelled, lease expired, transfer failed). Returns its
    /// blocks for the caller to release, or `None` if it had already committed or ended.
    pub fn cancel(&self, lease: &LeaseToken) -> Option<Vec<u32>> {
        let lease = self.get(lease)?;
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
        self.map().remove(&lease.token);
        // The blocks are the engine's or back in the pool now: no longer the caller's.
        drop(lease.claim.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

#[cfg(test)]
#[path = "lease_tests.rs"]
mod tests;

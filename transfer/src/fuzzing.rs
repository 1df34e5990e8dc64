//! Entry point of the `kv_frame` fuzz target (`fuzz/`, libFuzzer through cargo-fuzz) and of
//! the test that replays its corpus on every build: the bytes a KV peer sends, read by each
//! reader this crate has of a peer's stream. It takes arbitrary bytes and must return,
//! whatever they are, without a panic, an abort, a wait, or an allocation that the bytes'
//! declared sizes asked for before they were checked. Errors are the expected outcome of
//! most inputs and are dropped.
//!
//! The first byte picks the reader; the rest is the stream:
//! - 0, the TCP listener, from a stranger: everything after its challenge (a hello that
//!   must prove the deployment secret, and whatever follows it);
//! - 1, the TCP listener, from an authenticated sender: the harness writes the hello (the
//!   open lease, the proof), the input is every frame after it (blocks, commit);
//! - 2, the TCP sender, from the listener: its challenge, then its answer to the commit;
//! - 3, the `nccl` receiver: layer messages (header, block indices, pieces) as the link
//!   delivers them; a header whose lease is 16 zero bytes names the open lease;
//! - 4, the prefill worker reading back cached KV (`PullKv`): length-delimited `KvBlocks`,
//!   into the range that the next byte asks for.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prost::Message;
use tandem_auth::{InternalAuth, Secret};
use tandem_kv::{KvCache, KvDtype, KvLayout};
use tandem_proto::PROTOCOL_VERSION;
use tandem_proto::v1::{KvBlocks, KvCommit, Transport};

use crate::error::TransferError;
use crate::frame::{self, HeaderWriter, Kind};
use crate::lease::{DevicePool, Lease, LeaseTable};
use crate::nccl_wire::{HEADER_BYTES, Link, MESSAGE_AREA_BYTES, receive_layer};
use crate::pull::Assembly;
use crate::tcp::{TcpLimits, challenge_nonce, receive, remote_error};

/// The challenge every fuzzed connection answers.
const NONCE: [u8; 32] = [7; 32];
/// Bytes of a (layer, block) piece of the fuzz pools.
const PIECE: usize = 128;
/// Blocks of the fuzz pools.
const POOL_BLOCKS: usize = 8;
/// The physical blocks each fuzz lease receives, in logical order.
pub const LEASE_BLOCKS: [u32; 2] = [5, 2];
/// The physical blocks of the cached prefix each fuzz lease holds (what `PullKv` reads).
pub const LEASE_CACHED: [u32; 2] = [1, 6];
/// Prompt tokens of each fuzz lease (what its commit must say).
pub const LEASE_TOKENS: u32 = 20;

/// The KV layout of the fuzz pools: two layers of 128-byte pieces.
pub fn layout() -> KvLayout {
    KvLayout {
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 2,
        block_size: 16,
        dtype: KvDtype::F16,
        model_fingerprint: "fuzz".into(),
    }
}

/// A pool and its lease table, shared by every input (each opens a lease of its own and
/// ends it). The cache is kept because the table writes into its storage.
struct Pool {
    _cache: KvCache,
    table: Arc<LeaseTable>,
}

/// The host pool's table, or (`device`) the table of a device pool of [`PIECE`]-byte pieces
/// that the `nccl` receiver lands in.
fn pool(device: bool) -> Option<&'static Arc<LeaseTable>> {
    static HOST: OnceLock<Option<Pool>> = OnceLock::new();
    static DEVICE: OnceLock<Option<Pool>> = OnceLock::new();
    let make = || {
        let layout = layout();
        let cache =
            KvCache::with_budget(layout.clone(), POOL_BLOCKS * layout.block_bytes()).ok()?;
        let table = LeaseTable::new(cache.block_writer(), layout.hash(), None);
        let table = if device {
            table.with_device_pool(PIECE)
        } else {
            table
        };
        Some(Pool {
            _cache: cache,
            table: Arc::new(table),
        })
    };
    let pool = if device { &DEVICE } else { &HOST };
    pool.get_or_init(make).as_ref().map(|p| &p.table)
}

/// Runs `f` with a lease opened for it in the host pool's table (blocks [`LEASE_BLOCKS`]
/// for [`LEASE_TOKENS`] tokens after the held prefix [`LEASE_CACHED`]), and ends the lease
/// after. `None` when the pool could not be made.
pub fn with_lease<T>(f: impl FnOnce(&Arc<LeaseTable>, &Lease) -> T) -> Option<T> {
    with_lease_in(false, f)
}

fn with_lease_in<T>(device: bool, f: impl FnOnce(&Arc<LeaseTable>, &Lease) -> T) -> Option<T> {
    let table = pool(device)?;
    let (lease, _commit) = table
        .create_claimed(
            None,
            LEASE_BLOCKS.to_vec(),
            LEASE_CACHED.to_vec(),
            LEASE_TOKENS as usize,
            "fuzz",
        )
        .ok()?;
    let out = f(table, &lease);
    table.cancel(lease.token());
    Some(out)
}

/// The deployment's credentials in every fuzzed connection.
pub fn auth() -> &'static InternalAuth {
    static AUTH: OnceLock<InternalAuth> = OnceLock::new();
    AUTH.get_or_init(|| match Secret::new("tandem-fuzz-secret-of-enough-bytes") {
        Ok(secret) => InternalAuth::with_secret(&secret),
        Err(_) => InternalAuth::none(),
    })
}

/// Runs `f` on the one runtime of every input (the readers are async, each read has a
/// timeout, and a pull's answer is a spawned task). `None` when it could not be built.
pub fn block_on<F: Future>(f: F) -> Option<F::Output> {
    static RUNTIME: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    let runtime = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .ok()
    });
    runtime.as_ref().map(|r| r.block_on(f))
}

/// Limits that a reader of bytes already in memory never reaches.
const LIMITS: TcpLimits = TcpLimits {
    max_connections: 1,
    hello_timeout: Duration::from_secs(5),
    read_timeout: Duration::from_secs(5),
};

/// The hello an authenticated sender opens its transfer into `lease` with.
pub fn hello(lease: &[u8]) -> Vec<u8> {
    let mut h = HeaderWriter::default();
    h.u32(PROTOCOL_VERSION)
        .bytes(lease)
        .str(&layout().hash())
        .str("fuzz")
        .bytes(&auth().kv_hello_proof(&NONCE, lease));
    frame::encode(Kind::Hello, &h.0)
}

/// The bytes a KV peer sends, read by the reader the first byte picks (see the module's
/// documentation).
pub fn kv_frame(data: &[u8]) {
    let Some((&pick, stream)) = data.split_first() else {
        return;
    };
    match pick % 5 {
        0 => drop(tcp_listener(stream, false)),
        1 => drop(tcp_listener(stream, true)),
        2 => tcp_sender(stream),
        3 => drop(nccl_receiver(stream)),
        _ => drop(pulled(stream)),
    }
}

/// What a reader made of a stream: `None` when the harness could not set it up.
type Outcome<T> = Option<Result<T, TransferError>>;

/// The TCP listener's receive into an open lease; its bytes received.
fn tcp_listener(stream: &[u8], authenticated: bool) -> Outcome<u64> {
    with_lease(|table, lease| {
        let mut bytes = if authenticated {
            hello(lease.token().as_bytes())
        } else {
            Vec::new()
        };
        bytes.extend_from_slice(stream);
        block_on(receive(&mut &bytes[..], table, auth(), &NONCE, LIMITS))
    })
    .flatten()
}

fn tcp_sender(mut stream: &[u8]) {
    block_on(async {
        let Ok(Some(challenge)) = frame::read_control(&mut stream, LIMITS.read_timeout).await
        else {
            return;
        };
        if challenge_nonce("fuzz", &challenge).is_err() {
            return;
        }
        // The answers to the commit: each frame ends the read of its own stream in the
        // sender; here they follow one another until the bytes run out.
        while let Ok(Some(reply)) = frame::read_control(&mut stream, LIMITS.read_timeout).await {
            if reply.kind == Kind::Error {
                let _ = remote_error(&reply);
            }
        }
    });
}

/// Device memory as one byte vector (message area, drain, pool) and the wire as the input:
/// each receive takes the next bytes of the size it names, as NCCL matches sizes.
struct WireLink<'a> {
    wire: &'a [u8],
    memory: Vec<u8>,
    lease: [u8; 16],
}

const DRAIN: u64 = MESSAGE_AREA_BYTES as u64;
const DEVICE_POOL: DevicePool = DevicePool {
    base: DRAIN + PIECE as u64,
    num_blocks: POOL_BLOCKS,
    piece: PIECE,
};

impl WireLink<'_> {
    /// The device memory at `ptr`, which every address the receiver uses must be inside.
    fn region(&mut self, ptr: u64, bytes: usize) -> &mut [u8] {
        let at = usize::try_from(ptr).unwrap_or(usize::MAX);
        match at
            .checked_add(bytes)
            .filter(|&end| end <= self.memory.len())
        {
            Some(end) => &mut self.memory[at..end],
            None => panic!("an nccl receive of {bytes} bytes at {ptr} is outside device memory"),
        }
    }
}

impl Link for WireLink<'_> {
    fn send(&mut self, _: u64, _: usize) -> Result<(), TransferError> {
        Err(TransferError::Protocol("a receiver does not send".into()))
    }

    fn recv(&mut self, ptr: u64, bytes: usize) -> Result<(), TransferError> {
        if self.wire.len() < bytes {
            return Err(TransferError::Protocol("the link closed".into()));
        }
        let (message, rest) = self.wire.split_at(bytes);
        self.wire = rest;
        let lease = self.lease;
        let region = self.region(ptr, bytes);
        region.copy_from_slice(message);
        // A header naming the zero lease names the open one (the fuzzer cannot guess it).
        if ptr == 0 && bytes == HEADER_BYTES && region[8..24] == [0; 16] {
            region[8..24].copy_from_slice(&lease);
        }
        Ok(())
    }

    fn upload(&mut self, ptr: u64, host: &[u8]) -> Result<(), TransferError> {
        self.region(ptr, host.len()).copy_from_slice(host);
        Ok(())
    }

    fn download(&mut self, ptr: u64, host: &mut [u8]) -> Result<(), TransferError> {
        host.copy_from_slice(self.region(ptr, host.len()));
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), TransferError> {
        Ok(())
    }

    fn message_area(&self) -> u64 {
        0
    }

    fn drain_area(&self) -> u64 {
        DRAIN
    }
}

/// The `nccl` receiver's layer messages into an open lease, then its commit; the bytes the
/// commit counted.
fn nccl_receiver(stream: &[u8]) -> Outcome<u64> {
    with_lease_in(true, |table, lease| {
        let layers = layout().num_layers;
        let mut link = WireLink {
            wire: stream,
            memory: vec![0; DEVICE_POOL.base as usize + layers * POOL_BLOCKS * PIECE],
            lease: *lease.token().as_bytes(),
        };
        // Each message takes at least its header's bytes from the input, or ends the loop.
        while !link.wire.is_empty() && receive_layer(&mut link, table, &DEVICE_POOL).is_ok() {}
        table.commit(&KvCommit {
            lease: lease.token().as_bytes().to_vec(),
            kv_layout_hash: layout().hash(),
            num_tokens: LEASE_TOKENS,
            transport: Transport::Nccl as i32,
            ..KvCommit::default()
        })
    })
}

/// A pull's answer assembled; the blocks' bytes.
fn pulled(stream: &[u8]) -> Outcome<Vec<u8>> {
    let (&range, mut stream) = stream.split_first()?;
    // The range a prefill worker asks for: bounded by its own request, never by the peer.
    let (first, blocks) = (usize::from(range & 3), 1 + usize::from(range >> 2 & 3));
    let mut into = Assembly::new(&layout(), first, blocks);
    while !stream.is_empty() {
        let msg = KvBlocks::decode_length_delimited(&mut stream)
            .map_err(|e| TransferError::Protocol(e.to_string()));
        if let Err(e) = msg.and_then(|msg| into.add(&msg)) {
            return Some(Err(e));
        }
    }
    Some(into.finish())
}

#[cfg(test)]
mod tests;

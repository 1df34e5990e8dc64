//! `nccl`: KV between GPUs that cannot open each other's memory. Per (prefill, decode) pair
//! one two-rank NCCL communicator: the prefill worker asks the decode worker for one
//! (`OpenNccl`); the decode worker makes the id and starts a receiver thread that joins as
//! rank 0 on a stream of its own and receives layer messages into its device pool through
//! the lease table ([`crate::nccl_wire`]); the prefill worker joins as rank 1 on its engine
//! thread, at its first transfer, on the stream of its forward pass, and sends each layer's
//! blocks right after the forward pass that wrote them. The commit goes over gRPC; the
//! decode worker waits for the last receive before checking it.
//!
//! The prefill side's communicators are kept across requests by [`NcclTransport`]; the
//! decode side's receiver threads are [`spawn_nccl_receiver`]'s, one per prefill worker
//! ([`NcclReceivers`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_kv::DeviceKv;
use tandem_kv::cuda::nccl::{self, DeviceScratch, NcclAbort, NcclLink, receive_stream};
use tandem_proto::v1::{OpenNcclRequest, Transport};

use crate::device::{DeviceCopy, DeviceSender};
use crate::error::TransferError;
use crate::inplace::InPlace;
use crate::lease::{DevicePool, LeaseTable, LeaseToken};
use crate::nccl_wire::{self, Link, MESSAGE_AREA_BYTES};
use crate::reach::Reach;
use crate::receivers::{AbortLink, ReceiverSlot, Receivers};
use crate::sender::KvSender;
use crate::transport::{KvTransport, OpenFuture, Opening};
use crate::verify::VerifiedDecode;

/// How long a queued send or receive may take before the link is declared dead and
/// aborted (a peer died mid-message; NCCL itself would wait forever).
const STALL_LIMIT: Duration = Duration::from_secs(30);

/// Whether this build can use NCCL here (`libnccl.so` loads).
pub fn nccl_supported() -> bool {
    nccl::available()
}

/// A joined communicator and its scratch, seen as a [`Link`].
pub struct DeviceLink<'a> {
    link: &'a NcclLink,
    scratch: &'a DeviceScratch,
}

impl<'a> DeviceLink<'a> {
    /// `scratch` must hold [`MESSAGE_AREA_BYTES`] plus one piece.
    pub fn new(link: &'a NcclLink, scratch: &'a DeviceScratch) -> Self {
        Self { link, scratch }
    }
}

impl Link for DeviceLink<'_> {
    fn send(&mut self, ptr: u64, bytes: usize) -> Result<(), TransferError> {
        // SAFETY: the protocol sends only scratch it staged and pool blocks it was given.
        Ok(unsafe { self.link.send(ptr, bytes) }?)
    }
    fn recv(&mut self, ptr: u64, bytes: usize) -> Result<(), TransferError> {
        // SAFETY: receives land in scratch or in blocks the lease table handed out.
        Ok(unsafe { self.link.recv(ptr, bytes) }?)
    }
    fn upload(&mut self, ptr: u64, host: &[u8]) -> Result<(), TransferError> {
        // SAFETY: `ptr` lies in our message area (the protocol bounds the sizes).
        Ok(unsafe { self.link.upload(ptr, host) }?)
    }
    fn download(&mut self, ptr: u64, host: &mut [u8]) -> Result<(), TransferError> {
        // SAFETY: as for `upload`.
        Ok(unsafe { self.link.download(ptr, host) }?)
    }
    fn synchronize(&mut self) -> Result<(), TransferError> {
        Ok(self.link.synchronize_within(STALL_LIMIT)?)
    }
    fn message_area(&self) -> u64 {
        self.scratch.ptr
    }
    fn drain_area(&self) -> u64 {
        self.scratch.ptr + MESSAGE_AREA_BYTES as u64
    }
}

/// One decode worker's communicator, as the prefill worker holds it.
struct PeerLink {
    id: Vec<u8>,
    joined: Option<(NcclLink, DeviceScratch)>,
    /// A failed link is never reused: the next request opens a new one.
    broken: bool,
}

/// The `nccl` transport: a prefill worker's communicators, one per decode worker, kept across
/// requests.
#[derive(Default)]
pub(crate) struct NcclTransport {
    links: tokio::sync::Mutex<HashMap<String, Arc<Mutex<PeerLink>>>>,
}

impl std::fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclTransport").finish_non_exhaustive()
    }
}

impl NcclTransport {
    /// The communicator with the decode worker at `endpoint`, asked for the first time it is
    /// needed (held under the lock, so concurrent requests do not open two).
    async fn link(
        &self,
        reach: &Reach,
        endpoint: &str,
        request_id: &str,
    ) -> Result<Arc<Mutex<PeerLink>>, TransferError> {
        let mut links = self.links.lock().await;
        if let Some(l) = links.get(endpoint)
            && !l.lock().unwrap_or_else(|p| p.into_inner()).broken
        {
            return Ok(l.clone());
        }
        let mut client = reach.decode_client(endpoint)?;
        let id = client
            .open_nccl(OpenNcclRequest {
                prefill_id: request_id.to_string(),
            })
            .await
            .map_err(|s| TransferError::Connect(format!("OpenNccl: {}", s.message())))?
            .into_inner()
            .unique_id;
        let link = Arc::new(Mutex::new(PeerLink {
            id,
            joined: None,
            broken: false,
        }));
        links.insert(endpoint.to_string(), link.clone());
        Ok(link)
    }
}

impl KvTransport for NcclTransport {
    fn kind(&self) -> Transport {
        Transport::Nccl
    }

    fn open<'a>(&'a self, op: Opening<'a>) -> OpenFuture<'a> {
        Box::pin(async move {
            let link = self
                .link(op.reach, &op.decode.endpoint, op.request_id)
                .await?;
            let sender = DeviceSender::new(NcclCopy { link }, InPlace::new(op, Transport::Nccl)?);
            Ok(Box::new(sender) as Box<dyn KvSender>)
        })
    }

    fn forget(&self, decode: &VerifiedDecode) {
        if let Ok(mut links) = self.links.try_lock() {
            links.remove(&decode.endpoint);
        }
    }
}

/// Sends a lease's blocks from this engine's device pool over the pair's communicator.
struct NcclCopy {
    link: Arc<Mutex<PeerLink>>,
}

impl DeviceCopy for NcclCopy {
    fn copy_layer(
        &mut self,
        t: &InPlace,
        layer: usize,
        src: &DeviceKv,
        blocks: &[(u32, u32)],
    ) -> Result<(), TransferError> {
        let mut logical = Vec::with_capacity(blocks.len());
        let mut sources = Vec::with_capacity(blocks.len());
        for &(lb, physical) in blocks {
            t.block(lb)?;
            if physical as usize >= src.num_blocks() {
                return Err(TransferError::Protocol(format!(
                    "physical block {physical} outside a pool of {}",
                    src.num_blocks()
                )));
            }
            logical.push(lb);
            sources.push(src.base() + src.layout.piece_byte_offset(layer, physical) as u64);
        }
        let mut peer = self.link.lock().unwrap_or_else(|p| p.into_inner());
        let last = layer + 1 == t.layers;
        if let Err(e) = send_on(&mut peer, src, &t.lease, layer, &logical, &sources, last) {
            // The pair's message stream is out of step or dead: drop it (aborted if it
            // stalled) so that the next request opens a fresh one.
            peer.broken = true;
            peer.joined = None;
            return Err(e);
        }
        Ok(())
    }
}

/// Joins the pair's communicator if needed and queues one layer's messages; at the last
/// layer, waits for them (the decode worker may read the blocks once we commit).
fn send_on(
    peer: &mut PeerLink,
    src: &DeviceKv,
    lease: &LeaseToken,
    layer: usize,
    logical: &[u32],
    sources: &[u64],
    last: bool,
) -> Result<(), TransferError> {
    if peer.broken {
        return Err(TransferError::Connect(
            "the nccl link failed earlier".into(),
        ));
    }
    if peer.joined.is_none() {
        // Blocks until the decode worker's receiver (already waiting) joins too.
        let link = NcclLink::join(&peer.id, 1, src.stream().clone())?;
        let scratch =
            DeviceScratch::new(MESSAGE_AREA_BYTES + src.block_layer_bytes(), src.context())?;
        peer.joined = Some((link, scratch));
    }
    let Some((link, scratch)) = peer.joined.as_ref() else {
        return Err(TransferError::Connect("nccl link not joined".into()));
    };
    let mut wire = DeviceLink { link, scratch };
    nccl_wire::send_layer(
        &mut wire,
        lease,
        layer,
        src.block_layer_bytes(),
        logical,
        sources,
    )?;
    if last {
        wire.synchronize()?;
    }
    Ok(())
}

impl AbortLink for NcclAbort {
    fn abort(&self) {
        NcclAbort::abort(self);
    }
}

/// The decode worker's receivers, one per prefill worker (see [`crate::receivers`]).
pub type NcclReceivers = Receivers<NcclAbort>;

/// Starts receiving `nccl` transfers from one prefill worker into the device pool `kv`:
/// makes a communicator id and, on a thread of its own, joins it as rank 0 on a new stream
/// and receives layer messages through `table` until the link fails or a newer link from the
/// same prefill worker replaces it (`receivers`). Returns the id for the prefill worker to
/// join with.
pub fn spawn_nccl_receiver(
    table: Arc<LeaseTable>,
    kv: DeviceKv,
    prefill: String,
    receivers: &NcclReceivers,
) -> Result<Vec<u8>, TransferError> {
    let id = nccl::unique_id()?;
    let pool = DevicePool {
        base: kv.base(),
        num_blocks: kv.num_blocks(),
        piece: kv.block_layer_bytes(),
    };
    let joining = id.clone();
    let slot: ReceiverSlot<NcclAbort> = receivers.replace(&prefill);
    std::thread::Builder::new()
        .name("nccl-receive".into())
        .spawn(move || {
            let run = || -> Result<(), TransferError> {
                let stream = receive_stream(kv.context())?;
                let link = NcclLink::join(&joining, 0, stream)?;
                if !slot.joined(link.abort_handle()) {
                    tracing::info!(%prefill, "nccl link replaced before it came up");
                    return Ok(());
                }
                let scratch = DeviceScratch::new(MESSAGE_AREA_BYTES + pool.piece, kv.context())?;
                tracing::info!(%prefill, "nccl link up");
                let mut wire = DeviceLink {
                    link: &link,
                    scratch: &scratch,
                };
                loop {
                    let got = nccl_wire::receive_layer(&mut wire, &table, &pool)?;
                    if !got.kept {
                        tracing::debug!(
                            layer = got.header.layer,
                            "nccl blocks drained: their lease had ended"
                        );
                    }
                }
            };
            if let Err(e) = run() {
                tracing::warn!(%prefill, error = %e, "nccl link ended");
            }
        })?;
    Ok(id)
}

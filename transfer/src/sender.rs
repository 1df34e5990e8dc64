//! The sending half: one [`KvSender`] per request, made by [`connect`] for the transport the
//! router chose, and the [`Peers`] cache of connections and mappings it draws on.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Mutex;

use tandem_engine::KvLocation;
use tandem_engine::kv::{DeviceKv, KvLayout};
use tandem_proto::v1::{KvDestination, Transport};
use tonic::transport::{Channel, Endpoint};

use crate::error::TransferError;
use crate::grpc::GrpcSender;
use crate::shm::{ShmPeers, ShmSender};
use crate::tcp::TcpSender;

/// HTTP/2 flow-control windows for KV streams (client and server side).
pub const GRPC_STREAM_WINDOW: u32 = 8 << 20;
pub const GRPC_CONNECTION_WINDOW: u32 = 32 << 20;

/// What a finished transfer cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SendStats {
    pub bytes: u64,
    /// From the first byte handed over to the commit's acknowledgement.
    pub seconds: f64,
    pub transport: Transport,
}

/// The future returned by [`KvSender::commit`].
pub type SendFuture = Pin<Box<dyn Future<Output = Result<SendStats, TransferError>> + Send>>;

/// Moves one request's KV to its decode worker.
///
/// `send_layer` runs on the engine's thread (never inside an async runtime) right after a
/// layer's KV is in the cache; it copies what it needs before returning, so the engine may
/// reuse its blocks at once. Dropping a sender without committing abandons the transfer.
pub trait KvSender: Send {
    /// Ships `(logical block, bytes)` pieces of one layer.
    fn send_layer(&mut self, layer: usize, blocks: &[(u32, &[u8])]) -> Result<(), TransferError>;

    /// Whether this sender copies from the engine's device KV pool ([`Self::send_device_layer`])
    /// instead of taking host bytes.
    fn reads_device(&self) -> bool {
        false
    }

    /// Ships one layer's blocks straight from a GPU engine's pool `src`, as `(logical block,
    /// physical block in src)` pairs. The copies are queued on `src.stream`, after the forward
    /// pass that wrote them.
    fn send_device_layer(
        &mut self,
        layer: usize,
        src: &DeviceKv,
        blocks: &[(u32, u32)],
    ) -> Result<(), TransferError> {
        let _ = (layer, src, blocks);
        Err(TransferError::Protocol(
            "this transport sends host bytes, not device memory".into(),
        ))
    }

    /// Finishes: every piece has been sent; the decode worker verifies and admits the request
    /// with this first token.
    fn commit(self: Box<Self>, first_token: u32, first_logprob: f32) -> SendFuture;
}

/// Connections and mappings a prefill worker keeps across requests.
#[derive(Debug, Default)]
pub struct Peers {
    pub(crate) shm: ShmPeers,
    #[cfg(feature = "cuda")]
    pub(crate) cuda: std::sync::Arc<crate::cuda_ipc::CudaIpcPeers>,
    #[cfg(feature = "nccl")]
    pub(crate) nccl: crate::nccl::NcclPeers,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Peers {
    pub fn new() -> Self {
        Self::default()
    }

    /// A gRPC channel to `endpoint`, shared by every request to it (connects lazily and
    /// reconnects on its own).
    pub fn channel(&self, endpoint: &str) -> Result<Channel, TransferError> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = channels.get(endpoint) {
            return Ok(c.clone());
        }
        let channel = Endpoint::from_shared(endpoint.to_string())
            .map_err(|e| TransferError::Connect(format!("bad endpoint {endpoint}: {e}")))?
            .tcp_nodelay(true)
            // KV moves in megabyte messages: HTTP/2's default 64 KiB windows would stall
            // every stream on flow-control round trips.
            .initial_stream_window_size(GRPC_STREAM_WINDOW)
            .initial_connection_window_size(GRPC_CONNECTION_WINDOW)
            .connect_lazy();
        channels.insert(endpoint.to_string(), channel.clone());
        Ok(channel)
    }

    /// Drops what is cached for a decode worker that failed (it may have restarted).
    pub fn forget(&self, dest: &KvDestination) {
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&dest.decode_endpoint);
        if !dest.shm_path.is_empty() {
            self.shm.forget(std::path::Path::new(&dest.shm_path));
        }
        #[cfg(feature = "cuda")]
        self.cuda.forget(dest);
        #[cfg(feature = "nccl")]
        self.nccl.forget(dest);
    }
}

/// Opens a transfer to `dest` for a prompt of `num_tokens` tokens. Refuses a destination
/// whose layout differs from ours before any byte moves.
pub async fn connect(
    peers: &Peers,
    dest: &KvDestination,
    layout: &KvLayout,
    request_id: &str,
    num_tokens: usize,
) -> Result<Box<dyn KvSender>, TransferError> {
    let ours = layout.hash();
    if dest.kv_layout_hash != ours {
        return Err(TransferError::LayoutMismatch(format!(
            "destination expects layout {}, this worker has {ours}",
            dest.kv_layout_hash
        )));
    }
    let needed = tandem_engine::kv::blocks_for(num_tokens);
    if dest.block_ids.len() != needed {
        return Err(TransferError::Protocol(format!(
            "lease has {} blocks, the prompt needs {needed}",
            dest.block_ids.len()
        )));
    }
    let transport = Transport::try_from(dest.transport).unwrap_or(Transport::Unspecified);
    Ok(match transport {
        Transport::Grpc => {
            Box::new(GrpcSender::start(peers, dest.clone(), layout, request_id, num_tokens).await?)
        }
        Transport::Tcp => {
            Box::new(TcpSender::start(dest.clone(), layout, request_id, num_tokens).await?)
        }
        Transport::Shm => Box::new(ShmSender::new(
            peers,
            dest.clone(),
            layout,
            request_id,
            num_tokens,
        )?),
        #[cfg(feature = "cuda")]
        Transport::CudaIpc => Box::new(crate::cuda_ipc::CudaIpcSender::new(
            peers,
            dest.clone(),
            layout,
            request_id,
            num_tokens,
        )?),
        #[cfg(feature = "nccl")]
        Transport::Nccl => Box::new(
            crate::nccl::NcclSender::start(peers, dest.clone(), layout, request_id, num_tokens)
                .await?,
        ),
        #[cfg(not(feature = "cuda"))]
        Transport::CudaIpc => return Err(not_built("cuda-ipc", "cuda")),
        #[cfg(not(feature = "nccl"))]
        Transport::Nccl => return Err(not_built("nccl", "nccl")),
        Transport::Unspecified => {
            return Err(TransferError::Protocol("no transport chosen".into()));
        }
    })
}

/// Where a transport leaves the KV on the decode side: the device transports write the GPU
/// pool directly, the others the host cache (which a GPU engine then uploads).
pub fn kv_location(t: Transport) -> KvLocation {
    match t {
        Transport::CudaIpc | Transport::Nccl => KvLocation::Device,
        Transport::Grpc | Transport::Tcp | Transport::Shm | Transport::Unspecified => {
            KvLocation::Host
        }
    }
}

/// The name used in metrics and flags.
pub fn transport_name(t: Transport) -> &'static str {
    match t {
        Transport::Grpc => "grpc",
        Transport::Tcp => "tcp",
        Transport::Shm => "shm",
        Transport::CudaIpc => "cuda-ipc",
        Transport::Nccl => "nccl",
        Transport::Unspecified => "none",
    }
}

/// The refusal of a device transport this build does not have.
// `nccl` implies `cuda`: with it, every device transport is built.
#[cfg(not(feature = "nccl"))]
fn not_built(transport: &str, feature: &str) -> TransferError {
    TransferError::Connect(format!(
        "{transport} needs a worker built with the `{feature}` feature and running on a GPU"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_transports_leave_the_kv_in_the_device_pool() {
        for t in [Transport::CudaIpc, Transport::Nccl] {
            assert_eq!(kv_location(t), KvLocation::Device, "{t:?}");
        }
        for t in [Transport::Grpc, Transport::Tcp, Transport::Shm] {
            assert_eq!(kv_location(t), KvLocation::Host, "{t:?}");
        }
    }
}

//! The sending half: one [`KvSender`] per request, made by [`connect`] for the transport the
//! router chose, and the [`Peers`] cache of connections and mappings it draws on.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_auth::{AuthChannel, InternalAuth};
use tandem_engine::KvLocation;
use tandem_engine::kv::{DeviceKv, KvLayout};
use tandem_proto::PROTOCOL_VERSION;
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::{InfoRequest, KvDestination, Role, Transport, WorkerInfo};
use tonic::transport::Channel;

use crate::error::TransferError;
use crate::grpc::GrpcSender;
use crate::lease::LeaseToken;
use crate::shm::{ShmPeers, ShmSender};
use crate::tcp::TcpSender;

/// HTTP/2 flow-control windows for KV streams (client and server side).
pub const GRPC_STREAM_WINDOW: u32 = 8 << 20;
pub const GRPC_CONNECTION_WINDOW: u32 = 32 << 20;
/// How long a decode worker may take to answer the `GetInfo` that verifies it.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(10);

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

/// A decode worker as a prefill worker knows it after an authenticated `GetInfo`: every
/// address a transfer uses comes from here, never from the caller of `Prefill`.
#[derive(Debug)]
pub struct VerifiedDecode {
    /// The gRPC endpoint it answered at.
    pub endpoint: String,
    /// Its answer, whose proof checked out.
    pub info: WorkerInfo,
    /// `host:port` of its KV TCP listener, if it has one: its advertised host, or the
    /// endpoint's.
    pub kv_tcp_addr: Option<String>,
}

/// Everything a transport needs to open one request's transfer.
pub(crate) struct Opening<'a> {
    pub peers: &'a Peers,
    pub decode: &'a VerifiedDecode,
    pub dest: KvDestination,
    pub lease: LeaseToken,
    pub layout: &'a KvLayout,
    pub request_id: &'a str,
    pub num_tokens: usize,
}

/// Connections, verified decode workers and mappings a prefill worker keeps across requests.
#[derive(Debug)]
pub struct Peers {
    auth: InternalAuth,
    /// Where decode workers' shared pools may be (the `shm` and `cuda-ipc` transports).
    shm_dir: Option<PathBuf>,
    pub(crate) shm: ShmPeers,
    #[cfg(feature = "cuda")]
    pub(crate) cuda: std::sync::Arc<crate::cuda_ipc::CudaIpcPeers>,
    #[cfg(feature = "nccl")]
    pub(crate) nccl: crate::nccl::NcclPeers,
    channels: Mutex<HashMap<String, Channel>>,
    decode: Mutex<HashMap<String, Arc<VerifiedDecode>>>,
}

impl Peers {
    /// Peers reached with `auth`'s credentials; shared pools are mapped only from `shm_dir`.
    pub fn new(auth: InternalAuth, shm_dir: Option<PathBuf>) -> Self {
        Self {
            auth,
            shm_dir,
            shm: ShmPeers::default(),
            #[cfg(feature = "cuda")]
            cuda: Default::default(),
            #[cfg(feature = "nccl")]
            nccl: Default::default(),
            channels: Mutex::default(),
            decode: Mutex::default(),
        }
    }

    pub fn auth(&self) -> &InternalAuth {
        &self.auth
    }

    /// The shared pool of a verified decode worker, mapped from our shared-memory folder.
    pub(crate) fn shm_peer(
        &self,
        info: &WorkerInfo,
        layout: &KvLayout,
    ) -> Result<Arc<crate::shm::ShmPeer>, TransferError> {
        if info.shm_path.is_empty() {
            return Err(TransferError::Connect(
                "the decode worker has no shared-memory pool".into(),
            ));
        }
        let dir = self.shm_dir.as_deref().ok_or_else(|| {
            TransferError::Connect("this prefill worker has no shared-memory folder".into())
        })?;
        self.shm.get(dir, info, layout)
    }

    /// Opens a decode worker's owner-tag file (cuda-ipc fences with it): only inside our
    /// shared-memory folder, without following links.
    #[cfg(feature = "cuda")]
    pub(crate) fn open_tags(
        &self,
        info: &WorkerInfo,
        blocks: usize,
    ) -> Result<crate::shm::OwnerTags, TransferError> {
        let dir = self.shm_dir.as_deref().ok_or_else(|| {
            TransferError::Connect("this prefill worker has no shared-memory folder".into())
        })?;
        crate::shm::OwnerTags::open_peer(dir, Path::new(&info.shm_path), blocks)
    }

    /// A gRPC channel to `endpoint`, shared by every request to it (connects lazily and
    /// reconnects on its own).
    pub fn channel(&self, endpoint: &str) -> Result<Channel, TransferError> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = channels.get(endpoint) {
            return Ok(c.clone());
        }
        let channel = self
            .auth
            .endpoint(endpoint)
            .map_err(|e| TransferError::Connect(format!("bad endpoint {endpoint}: {e}")))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            // KV moves in megabyte messages: HTTP/2's default 64 KiB windows would stall
            // every stream on flow-control round trips.
            .initial_stream_window_size(GRPC_STREAM_WINDOW)
            .initial_connection_window_size(GRPC_CONNECTION_WINDOW)
            .connect_lazy();
        channels.insert(endpoint.to_string(), channel.clone());
        Ok(channel)
    }

    /// A client of the decode worker at `endpoint` whose calls carry our tokens.
    pub fn decode_client(
        &self,
        endpoint: &str,
    ) -> Result<DecodeServiceClient<AuthChannel>, TransferError> {
        Ok(DecodeServiceClient::new(
            self.auth.channel(self.channel(endpoint)?),
        ))
    }

    /// The decode worker `dest` names, verified: it answered our challenge with a proof of
    /// the deployment secret (once per endpoint and worker instance).
    pub async fn verified_decode(
        &self,
        dest: &KvDestination,
    ) -> Result<Arc<VerifiedDecode>, TransferError> {
        let endpoint = dest.decode_endpoint.as_str();
        let cached = self
            .decode
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(endpoint)
            .cloned();
        if let Some(d) = cached
            && (dest.decode_instance.is_empty() || d.info.instance_id == dest.decode_instance)
        {
            return Ok(d);
        }
        let challenge =
            tandem_auth::challenge().map_err(|e| TransferError::Protocol(e.to_string()))?;
        let mut client = self.decode_client(endpoint)?;
        let request = InfoRequest {
            include_tokenizer: false,
            challenge: challenge.to_vec(),
        };
        let info = match tokio::time::timeout(VERIFY_TIMEOUT, client.get_info(request)).await {
            Err(_) => {
                return Err(TransferError::Connect(format!(
                    "{endpoint} did not answer GetInfo within {} s",
                    VERIFY_TIMEOUT.as_secs()
                )));
            }
            Ok(Err(status)) if status.code() == tonic::Code::Unauthenticated => {
                return Err(TransferError::Unauthenticated(format!(
                    "{endpoint} refused this worker's credentials: {}",
                    status.message()
                )));
            }
            Ok(Err(status)) => {
                return Err(TransferError::Connect(format!(
                    "GetInfo at {endpoint}: {}",
                    status.message()
                )));
            }
            Ok(Ok(info)) => info.into_inner(),
        };
        self.auth
            .verify_worker_info(&challenge, &info)
            .map_err(|_| {
                TransferError::Unauthenticated(format!(
                    "{endpoint} did not prove that it is a decode worker of this deployment"
                ))
            })?;
        if info.role != Role::Decode as i32 || info.protocol_version != PROTOCOL_VERSION {
            return Err(TransferError::Unauthenticated(format!(
                "{endpoint} is not a decode worker speaking protocol {PROTOCOL_VERSION}"
            )));
        }
        if !dest.decode_instance.is_empty() && info.instance_id != dest.decode_instance {
            return Err(TransferError::Connect(format!(
                "the decode worker at {endpoint} restarted after the lease was granted"
            )));
        }
        let kv_tcp_addr = (info.kv_tcp_port != 0).then(|| {
            let host = if info.advertise_host.is_empty() {
                endpoint
                    .parse::<tonic::codegen::http::Uri>()
                    .ok()
                    .and_then(|u| u.host().map(str::to_string))
                    .unwrap_or_default()
            } else {
                info.advertise_host.clone()
            };
            format!("{host}:{}", info.kv_tcp_port)
        });
        let verified = Arc::new(VerifiedDecode {
            endpoint: endpoint.to_string(),
            info,
            kv_tcp_addr,
        });
        self.decode
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(endpoint.to_string(), verified.clone());
        Ok(verified)
    }

    /// Drops what is cached for a decode worker that failed (it may have restarted).
    pub fn forget(&self, dest: &KvDestination) {
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&dest.decode_endpoint);
        let known = self
            .decode
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&dest.decode_endpoint);
        let Some(known) = known else { return };
        if !known.info.shm_path.is_empty() {
            self.shm.forget(Path::new(&known.info.shm_path));
        }
        #[cfg(feature = "cuda")]
        self.cuda.forget(&known.info);
        #[cfg(feature = "nccl")]
        self.nccl.forget(dest);
    }
}

/// Opens a transfer to `dest` for a prompt of `num_tokens` tokens. Refuses a destination
/// whose layout differs from ours, or whose decode worker cannot prove it belongs to the
/// deployment, before any byte moves.
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
    let lease = LeaseToken::from_wire(&dest.lease).map_err(|_| {
        TransferError::Protocol("a KV destination needs its lease's 16-byte capability".into())
    })?;
    let transport = Transport::try_from(dest.transport).unwrap_or(Transport::Unspecified);
    if transport == Transport::Unspecified {
        return Err(TransferError::Protocol("no transport chosen".into()));
    }
    let decode = peers.verified_decode(dest).await?;
    if decode.info.kv_layout_hash != ours {
        return Err(TransferError::LayoutMismatch(format!(
            "the decode worker has layout {}, this worker {ours}",
            decode.info.kv_layout_hash
        )));
    }
    let op = Opening {
        peers,
        decode: &decode,
        dest: dest.clone(),
        lease,
        layout,
        request_id,
        num_tokens,
    };
    Ok(match transport {
        Transport::Grpc => Box::new(GrpcSender::start(op).await?),
        Transport::Tcp => Box::new(TcpSender::start(op).await?),
        Transport::Shm => Box::new(ShmSender::new(op)?),
        #[cfg(feature = "cuda")]
        Transport::CudaIpc => Box::new(crate::cuda_ipc::CudaIpcSender::new(op)?),
        #[cfg(feature = "nccl")]
        Transport::Nccl => Box::new(crate::nccl::NcclSender::start(op).await?),
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

//! What a prefill worker keeps across requests to reach decode workers ([`Peers`]): gRPC
//! channels, decode workers verified by an authenticated `GetInfo` ([`VerifiedDecode`]), and
//! each transport's mappings (shared pools, device pools, NCCL links), plus the [`Opening`]
//! every transport is opened from. The per-transport caches are the transports' own types;
//! this module only holds them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_auth::{AuthChannel, InternalAuth};
use tandem_kv::KvLayout;
use tandem_proto::PROTOCOL_VERSION;
use tandem_proto::v1::decode_service_client::DecodeServiceClient;
use tandem_proto::v1::{InfoRequest, KvDestination, Role, WorkerInfo};
use tonic::transport::Channel;

use crate::error::TransferError;
use crate::lease::LeaseToken;
use crate::shm::ShmPeers;

/// HTTP/2 flow-control windows for KV streams (client and server side).
pub const GRPC_STREAM_WINDOW: u32 = 8 << 20;
pub const GRPC_CONNECTION_WINDOW: u32 = 32 << 20;
/// How long a decode worker may take to answer the `GetInfo` that verifies it.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// It refused to have its cached prefix read back (`PullKv`: its cache is on its GPU), so
    /// this worker no longer asks.
    pub refuses_pull: std::sync::atomic::AtomicBool,
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
    ) -> Result<tandem_kv::shm::OwnerTags, TransferError> {
        let dir = self.shm_dir.as_deref().ok_or_else(|| {
            TransferError::Connect("this prefill worker has no shared-memory folder".into())
        })?;
        Ok(tandem_kv::shm::OwnerTags::open_peer(
            dir,
            Path::new(&info.shm_path),
            blocks,
        )?)
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
            refuses_pull: Default::default(),
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

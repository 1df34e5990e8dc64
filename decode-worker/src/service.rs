//! The `DecodeService` implementation and the worker's assembly: engine over a (shared-memory)
//! KV cache, lease table, gRPC server with health, KV TCP listener, graceful drain.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tandem_auth::InternalAuth;
use tandem_engine::{Engine, EngineConfig, Model};
use tandem_kv::shm::{
    OwnerTags, POOL_PREFIX, default_shm_dir, file_identity, sweep_stale, tags_path,
};
use tandem_kv::{DeviceKv, KvCache, KvStorage};
use tandem_proto::PROTOCOL_VERSION;
use tandem_proto::v1::decode_service_server::{DecodeService, DecodeServiceServer};
use tandem_proto::v1::*;
use tandem_text::TextTokenizer;
use tandem_transfer::{LeaseTable, TcpLimits, kv_rpcs, serve_tcp};
use tandem_worker::convert::{kv_layout_to_proto, tokenizer_spec};
use tandem_worker::{EngineHandle, spawn_engine};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status, Streaming};

/// Why the worker could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("engine: {0}")]
    Engine(#[from] tandem_engine::EngineError),
    #[error("KV cache: {0}")]
    Kv(#[from] tandem_kv::KvError),
    #[error("KV transfer setup: {0}")]
    Transfer(#[from] tandem_transfer::TransferError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("gRPC server: {0}")]
    Server(#[from] tonic::transport::Error),
    #[error("internal authentication: {0}")]
    Auth(#[from] tandem_auth::AuthError),
    #[error("{0}")]
    Config(String),
}

/// How this worker runs, beyond the engine's sizing.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    pub worker_id: String,
    /// Host peers reach the KV TCP port at ("" = the address they used for gRPC).
    pub advertise_host: String,
    /// Put the KV pool in a shared-memory file in this folder (the `shm` transport).
    pub shm_dir: Option<PathBuf>,
    /// Lease time without progress when the request names none.
    pub default_lease_ttl: Duration,
    /// How long blocks of a lease that ended early wait before reuse (a remote writer may
    /// still be finishing one block copy).
    pub quarantine: Duration,
    /// How long shutdown waits for running requests.
    pub drain_timeout: Duration,
    /// The longest a reservation may wait for KV without progress, whatever the caller asks.
    pub max_lease_ttl: Duration,
    /// The longest a reservation may stay open, renewals included.
    pub max_lease_lifetime: Duration,
    /// Share of the KV pool one caller (one address) may hold in reservations awaiting
    /// their KV, in (0, 1].
    pub caller_lease_share: f64,
    /// How long a disaggregated request waits for room to reserve its blocks (in the pool
    /// and in its caller's share) before it is refused as busy; zero refuses at once.
    pub reserve_wait: Duration,
    /// Bounds of the raw TCP KV listener.
    pub kv_tcp: TcpLimits,
    /// Who may call: call tokens, the info proof, the KV hello.
    pub auth: InternalAuth,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            worker_id: "decode".into(),
            advertise_host: String::new(),
            shm_dir: default_shm_dir(),
            default_lease_ttl: Duration::from_secs(30),
            quarantine: Duration::from_millis(200),
            drain_timeout: Duration::from_secs(30),
            max_lease_ttl: Duration::from_secs(60),
            max_lease_lifetime: Duration::from_secs(600),
            caller_lease_share: 0.9,
            reserve_wait: Duration::from_secs(120),
            kv_tcp: TcpLimits::default(),
            auth: InternalAuth::none(),
        }
    }
}

pub(crate) struct Inner {
    pub engine: EngineHandle,
    pub leases: Arc<LeaseTable>,
    pub tokenizer: Arc<TextTokenizer>,
    pub model: Arc<Model>,
    pub config: DecodeConfig,
    pub info: WorkerInfo,
    pub draining: AtomicBool,
    /// The engine's device KV pool, on a GPU (nccl receives into it).
    pub device_kv: Option<DeviceKv>,
    /// Per calling address, the turn to reserve blocks: requests that must wait for room
    /// wait in arrival order, and only the first of them tries again (see `generate`). One
    /// entry per address that ever reserved: the internal plane's authenticated routers.
    pub reserve_turns: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// One nccl receiver per prefill worker; a new link replaces (aborts) the old one.
    #[cfg(feature = "nccl")]
    pub nccl_receivers: tandem_transfer::NcclReceivers,
}

/// The gRPC face of the worker.
#[derive(Clone)]
pub struct DecodeWorker {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for DecodeWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeWorker")
            .field("id", &self.inner.config.worker_id)
            .finish()
    }
}

impl DecodeWorker {
    /// Builds the engine (its pool in shared memory when configured) and starts its thread.
    pub fn new(
        model: Arc<Model>,
        tokenizer: TextTokenizer,
        engine_config: EngineConfig,
        config: DecodeConfig,
        kv_tcp_port: u16,
    ) -> Result<Self, DecodeError> {
        let layout = model.kv_layout();
        let num_blocks = engine_config.kv_budget_bytes / layout.block_bytes();
        if num_blocks == 0 {
            return Err(DecodeError::Config(format!(
                "a KV budget of {} bytes holds no block of {} bytes",
                engine_config.kv_budget_bytes,
                layout.block_bytes()
            )));
        }
        let bytes = num_blocks * layout.block_bytes();
        let (storage, tags, shm_path) = match &config.shm_dir {
            Some(dir) => {
                for stale in sweep_stale(dir) {
                    tracing::info!(file = %stale.display(), "removed a shared KV file left by a decode worker that is gone");
                }
                let path = dir.join(format!(
                    "{POOL_PREFIX}{}-{}",
                    sanitize(&config.worker_id),
                    std::process::id()
                ));
                let storage = KvStorage::create_shared(&path, bytes)?;
                let tags = OwnerTags::create(&tags_path(&path), num_blocks)?;
                (storage, Some(tags), path.to_string_lossy().into_owned())
            }
            None => (KvStorage::anonymous(bytes)?, None, String::new()),
        };
        let (shm_device, shm_inode) = match &config.shm_dir {
            Some(_) => file_identity(std::path::Path::new(&shm_path))?,
            None => (0, 0),
        };
        let cache = KvCache::new(layout.clone(), num_blocks, storage)?;
        let writer = cache.block_writer();
        let engine = Engine::with_cache(model.clone(), tokenizer.clone(), engine_config, cache)?;
        let mut transports = vec![Transport::Grpc as i32];
        if kv_tcp_port != 0 {
            transports.push(Transport::Tcp as i32);
        }
        if !shm_path.is_empty() {
            transports.push(Transport::Shm as i32);
        }
        // On a GPU the device pool receives directly: cuda-ipc (exported; its writes are
        // fenced by the owner tags, so it needs the shared-memory folder too) and nccl.
        let device_kv = engine.device_kv();
        // An export failure costs only cuda-ipc (the worker says so and does not advertise it).
        let export = engine.export_device_kv().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot export the device KV pool: cuda-ipc is off");
            None
        });
        let cuda_ipc = match (&tags, export) {
            (Some(_), Some(export)) => {
                transports.push(Transport::CudaIpc as i32);
                Some(export)
            }
            (None, Some(_)) => {
                tracing::warn!("no shared-memory folder: cuda-ipc is off for this GPU worker");
                None
            }
            _ => None,
        };
        #[cfg(feature = "nccl")]
        if device_kv.is_some() && tandem_transfer::nccl_supported() {
            transports.push(Transport::Nccl as i32);
        }
        if !(config.caller_lease_share > 0.0 && config.caller_lease_share <= 1.0) {
            return Err(DecodeError::Config(format!(
                "the share of the pool one caller may hold must be in (0, 1], got {}",
                config.caller_lease_share
            )));
        }
        let quota = ((num_blocks as f64 * config.caller_lease_share).ceil() as usize).max(1);
        let mut leases = LeaseTable::new(writer, layout.hash(), tags).with_caller_quota(quota);
        if let Some(kv) = &device_kv {
            leases = leases.with_device_pool(kv.block_layer_bytes());
        }
        let leases = Arc::new(leases);
        let cfg = model.config();
        let info = WorkerInfo {
            worker_id: config.worker_id.clone(),
            role: Role::Decode as i32,
            model_name: model.name().to_string(),
            kv_layout_hash: layout.hash(),
            kv_layout: Some(kv_layout_to_proto(&layout)),
            context_length: cfg.max_position_embeddings as u32,
            vocab_size: cfg.vocab_size as u32,
            tokenizer: None,
            transports,
            shm_path,
            shm_bytes: if config.shm_dir.is_some() {
                bytes as u64
            } else {
                0
            },
            kv_tcp_port: u32::from(kv_tcp_port),
            advertise_host: config.advertise_host.clone(),
            total_blocks: num_blocks as u32,
            protocol_version: PROTOCOL_VERSION,
            cuda_ipc_handle: cuda_ipc
                .as_ref()
                .map(|e| e.ipc_handle.clone())
                .unwrap_or_default(),
            cuda_pool_blocks: cuda_ipc.as_ref().map_or(0, |e| e.num_blocks as u32),
            instance_id: tandem_auth::random_bytes::<16>()?.to_vec(),
            shm_device,
            shm_inode,
            proof: Vec::new(),
        };
        let handle = spawn_engine(engine)?;
        Ok(Self {
            inner: Arc::new(Inner {
                engine: handle,
                leases,
                tokenizer: Arc::new(tokenizer),
                model,
                config,
                info,
                draining: AtomicBool::new(false),
                device_kv,
                reserve_turns: Default::default(),
                #[cfg(feature = "nccl")]
                nccl_receivers: Default::default(),
            }),
        })
    }

    pub fn leases(&self) -> &Arc<LeaseTable> {
        &self.inner.leases
    }

    fn load_report(&self, asked: &LoadRequest) -> LoadReport {
        self.inner.engine.load_report(
            self.inner.leases.len() as u32,
            self.inner.draining.load(Ordering::Relaxed),
            &self.inner.info.instance_id,
            asked.block_events_after,
            asked.snapshot_from_block,
        )
    }

    /// Removes the shared-memory pool and tag files now (the mappings stay valid): at
    /// shutdown, so that they go even if the engine thread still holds the pool when the
    /// process exits.
    fn remove_shared_files(&self) {
        let pool = &self.inner.info.shm_path;
        if pool.is_empty() {
            return;
        }
        let pool = std::path::Path::new(pool);
        for path in [pool.to_path_buf(), tags_path(pool)] {
            match std::fs::remove_file(&path) {
                Ok(()) => tracing::debug!(file = %path.display(), "removed"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "cannot remove a shared KV file")
                }
            }
        }
    }
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[tonic::async_trait]
impl DecodeService for DecodeWorker {
    type GenerateStream = tokio_stream::wrappers::ReceiverStream<Result<GenerateEvent, Status>>;
    type PullKvStream = tandem_transfer::PullStream;

    async fn get_info(&self, req: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        let req = req.into_inner();
        let mut info = self.inner.info.clone();
        if req.include_tokenizer {
            info.tokenizer = Some(tokenizer_spec(&self.inner.tokenizer)?);
        }
        self.inner
            .config
            .auth
            .sign_worker_info(&mut info, &req.challenge);
        Ok(Response::new(info))
    }

    async fn get_load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(self.load_report(&req.into_inner())))
    }

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        if self.inner.draining.load(Ordering::Relaxed) {
            return Err(Status::unavailable("this decode worker is shutting down"));
        }
        // Reservations are counted per calling address (see `caller_lease_share`).
        let caller = req
            .remote_addr()
            .map_or_else(|| "unknown".to_string(), |a| a.ip().to_string());
        crate::generate::start(self.inner.clone(), req.into_inner(), caller)
            .await
            .map(Response::new)
    }

    async fn push_kv(&self, req: Request<Streaming<KvMessage>>) -> Result<Response<KvAck>, Status> {
        kv_rpcs::push_kv(&self.inner.leases, req).await
    }

    async fn commit_kv(&self, req: Request<KvCommit>) -> Result<Response<KvAck>, Status> {
        kv_rpcs::commit_kv(&self.inner.leases, req).await
    }

    async fn open_nccl(
        &self,
        req: Request<OpenNcclRequest>,
    ) -> Result<Response<OpenNcclResponse>, Status> {
        #[cfg(feature = "nccl")]
        if let Some(kv) = self.inner.device_kv.clone()
            && tandem_transfer::nccl_supported()
        {
            let prefill = req.into_inner().prefill_id;
            let unique_id = tandem_transfer::spawn_nccl_receiver(
                self.inner.leases.clone(),
                kv,
                prefill,
                &self.inner.nccl_receivers,
            )?;
            return Ok(Response::new(OpenNcclResponse { unique_id }));
        }
        let _ = req;
        Err(Status::failed_precondition(match self.inner.device_kv {
            None => "this decode worker cannot receive over nccl: its engine runs on the CPU",
            Some(_) if cfg!(feature = "nccl") => {
                "this decode worker cannot receive over nccl: libnccl.so cannot be loaded"
            }
            Some(_) => "this decode worker was built without the nccl feature",
        }))
    }

    async fn renew_lease(
        &self,
        req: Request<RenewLeaseRequest>,
    ) -> Result<Response<RenewLeaseResponse>, Status> {
        Ok(kv_rpcs::renew_lease(&self.inner.leases, req))
    }

    async fn pull_kv(
        &self,
        req: Request<PullKvRequest>,
    ) -> Result<Response<Self::PullKvStream>, Status> {
        kv_rpcs::pull_kv(&self.inner.leases, req)
    }
}

/// Runs the worker on the given listeners until `shutdown` resolves, then drains.
pub async fn serve(
    worker: DecodeWorker,
    grpc: TcpListener,
    kv: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), DecodeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<DecodeServiceServer<DecodeWorker>>()
        .await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    if let Some(kv) = kv {
        let table = worker.inner.leases.clone();
        let mut rx = stop_rx.clone();
        let config = &worker.inner.config;
        tokio::spawn(serve_tcp(
            kv,
            table,
            config.auth.clone(),
            config.kv_tcp,
            async move {
                let _ = rx.changed().await;
            },
        ));
    }
    let drain_worker = worker.clone();
    let mut grpc_stop = stop_rx.clone();
    let drain = async move {
        shutdown.await;
        tracing::info!("shutting down: draining");
        drain_worker.inner.draining.store(true, Ordering::Relaxed);
        health
            .set_not_serving::<DecodeServiceServer<DecodeWorker>>()
            .await;
        let deadline = tokio::time::Instant::now() + drain_worker.inner.config.drain_timeout;
        loop {
            let load = drain_worker.load_report(&LoadRequest::default());
            if (load.running == 0 && load.waiting == 0 && load.leases == 0)
                || tokio::time::Instant::now() >= deadline
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = stop_tx.send(true);
    };
    tokio::spawn(drain);
    let files = worker.clone();
    // KV messages are at most 1 MiB of payload; prompts of a long context are a few MiB.
    let svc = DecodeServiceServer::new(worker.clone()).max_decoding_message_size(4 << 20);
    let served = worker
        .inner
        .config
        .auth
        .server_builder()?
        .initial_stream_window_size(tandem_transfer::GRPC_STREAM_WINDOW)
        .initial_connection_window_size(tandem_transfer::GRPC_CONNECTION_WINDOW)
        .add_service(health_service)
        .add_service(svc)
        .serve_with_incoming_shutdown(
            // Token events are small writes: without TCP_NODELAY each waits on Nagle and the
            // peer's delayed ACK (~40 ms per hop, measured).
            tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
            async move {
                let _ = grpc_stop.changed().await;
            },
        )
        .await;
    files.remove_shared_files();
    served?;
    Ok(())
}

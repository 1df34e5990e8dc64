//! The `DecodeService` implementation and the worker's assembly: engine over a (shared-memory)
//! KV cache, lease table, gRPC server with health, KV TCP listener, graceful drain.

use std::path::Path;
use std::sync::Arc;

use tandem_engine::{Engine, EngineConfig, Model};
use tandem_kv::shm::{OwnerTags, POOL_PREFIX, file_identity, sweep_stale, tags_path};
use tandem_kv::{KvCache, KvStorage};
use tandem_proto::v1::decode_service_server::{DecodeService, DecodeServiceServer};
use tandem_proto::v1::*;
use tandem_text::TextTokenizer;
use tandem_transfer::{LeaseTable, kv_rpcs, serve_tcp};
use tandem_worker::{
    EngineThreadOptions, Serving, WorkerCore, serve_until_drained, spawn_engine, worker_info,
};
use tokio::net::TcpListener;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::{Request, Response, Status, Streaming};

use crate::config::{DecodeConfig, DecodeError};
use crate::state::Inner;

/// The gRPC face of the worker.
#[derive(Clone)]
pub struct DecodeWorker {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for DecodeWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.core.fmt(f)
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
        let info = WorkerInfo {
            shm_path,
            shm_bytes: if config.shm_dir.is_some() {
                bytes as u64
            } else {
                0
            },
            kv_tcp_port: u32::from(kv_tcp_port),
            advertise_host: config.advertise_host.clone(),
            cuda_ipc_handle: cuda_ipc
                .as_ref()
                .map(|e| e.ipc_handle.clone())
                .unwrap_or_default(),
            cuda_pool_blocks: cuda_ipc.as_ref().map_or(0, |e| e.num_blocks as u32),
            shm_device,
            shm_inode,
            ..worker_info(
                &config.worker_id,
                Role::Decode,
                &model,
                num_blocks,
                transports,
            )?
        };
        let core = WorkerCore::new(
            spawn_engine(
                engine,
                EngineThreadOptions {
                    lend_slack: config.lend_slack,
                    calibration_tokens: config.calibration_tokens,
                },
            )?,
            model,
            tokenizer,
            info,
            config.auth.clone(),
        );
        Ok(Self {
            inner: Arc::new(Inner {
                core: Arc::new(core),
                leases,
                config,
                device_kv,
                reserve_turns: Default::default(),
                #[cfg(feature = "nccl")]
                nccl_receivers: Default::default(),
            }),
        })
    }

    /// Waits for the engine's start-up calibration (see `tandem_worker::pacing`) unless
    /// `shutdown` comes first: whether to serve.
    pub async fn calibrated_until(
        &self,
        shutdown: &mut std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> bool {
        self.inner.core.engine.calibrated_until(shutdown).await
    }

    pub fn leases(&self) -> &Arc<LeaseTable> {
        &self.inner.leases
    }

    fn load_report(&self, asked: &LoadRequest) -> LoadReport {
        self.inner
            .core
            .load_report(self.inner.leases.len() as u32, asked)
    }

    /// Removes the shared-memory pool and tag files now (the mappings stay valid): at
    /// shutdown, so that they go even if the engine thread still holds the pool when the
    /// process exits.
    fn remove_shared_files(&self) {
        let pool = &self.inner.core.info.shm_path;
        if pool.is_empty() {
            return;
        }
        let pool = Path::new(pool);
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
        self.inner
            .core
            .info_for(&req.into_inner())
            .map(Response::new)
    }

    async fn get_load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(self.load_report(&req.into_inner())))
    }

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.inner.core.refuse_while_draining()?;
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

/// Runs the worker on the given listeners until `shutdown` resolves, then drains: running
/// requests finish and open leases end (up to the drain timeout); the shared KV files go.
pub async fn serve(
    worker: DecodeWorker,
    grpc: TcpListener,
    kv: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), DecodeError> {
    let (stopped, _) = tokio::sync::watch::channel(false);
    let inner = worker.inner.clone();
    if let Some(kv) = kv {
        let mut stop = stopped.subscribe();
        tokio::spawn(serve_tcp(
            kv,
            inner.leases.clone(),
            inner.config.auth.clone(),
            inner.config.kv_tcp,
            async move {
                let _ = stop.changed().await;
            },
        ));
    }
    let idle = {
        let worker = worker.clone();
        move || {
            let load = worker.load_report(&LoadRequest::default());
            load.running == 0 && load.waiting == 0 && load.leases == 0
        }
    };
    let serving = Serving {
        service_name: <DecodeServiceServer<DecodeWorker> as NamedService>::NAME,
        // KV messages are at most 1 MiB of payload; prompts of a long context are a few MiB.
        routes: Routes::new(
            DecodeServiceServer::new(worker.clone()).max_decoding_message_size(4 << 20),
        ),
        drain_timeout: inner.config.drain_timeout,
        idle: Box::new(idle),
        shutdown,
    };
    let server = inner
        .config
        .auth
        .server_builder()?
        .initial_stream_window_size(tandem_transfer::GRPC_STREAM_WINDOW)
        .initial_connection_window_size(tandem_transfer::GRPC_CONNECTION_WINDOW);
    let served = serve_until_drained(inner.core.clone(), server, grpc, serving, stopped).await;
    worker.remove_shared_files();
    served?;
    Ok(())
}

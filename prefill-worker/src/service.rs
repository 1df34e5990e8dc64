//! The `PrefillService` implementation and the worker's assembly.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tandem_auth::InternalAuth;
use tandem_engine::engine::validate_request;
use tandem_engine::{Engine, EngineConfig, Model};
use tandem_proto::v1::prefill_service_server::{PrefillService, PrefillServiceServer};
use tandem_proto::v1::*;
use tandem_text::TextTokenizer;
use tandem_transfer::{
    FirstToken, Peers, PulledPrefix, TransferError, connect, pull_cached_prefix,
    top_logprobs_to_proto, transport_name,
};
use tandem_worker::convert::{engine_status, prompt_logprobs_to_proto, sampling_from_proto};
use tandem_worker::requests::{prefill_first_block, prefill_stop};
use tandem_worker::{
    EngineThreadOptions, KvShipment, SeqEvent, Serving, WorkerCore, serve_until_drained,
    spawn_engine, worker_info,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Why the worker could not start or serve.
pub type PrefillError = tandem_worker::WorkerError;

/// How this worker runs, beyond the engine's sizing.
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    pub worker_id: String,
    pub drain_timeout: Duration,
    /// Where decode workers' shared-memory pools may be mapped from.
    pub shm_dir: Option<std::path::PathBuf>,
    /// Who may call, and the credentials this worker shows decode workers.
    pub auth: InternalAuth,
    /// Read back the part of a decode worker's cached prefix this worker lacks (else
    /// compute it).
    pub pull_prefix: bool,
    /// Prompt tokens of made-up work the cost model is fitted to at start-up (0: none; see
    /// `tandem_worker::pacing`).
    pub calibration_tokens: usize,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            worker_id: "prefill".into(),
            drain_timeout: Duration::from_secs(30),
            shm_dir: tandem_kv::shm::default_shm_dir(),
            auth: InternalAuth::none(),
            pull_prefix: true,
            calibration_tokens: 0,
        }
    }
}

/// A failed transfer as the router sees it: `ABORTED`, the code of a failure on the way to
/// (or at) the decode worker, so that it does not count against this worker's health. A
/// request the transfer found invalid stays `INVALID_ARGUMENT`, and a destination whose KV
/// layout differs from ours (a pairing the router should not make) `FAILED_PRECONDITION`.
fn transfer_status(e: TransferError) -> Status {
    let status = Status::from(e);
    match status.code() {
        tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition => status,
        _ => Status::aborted(format!(
            "KV transfer to the decode worker failed: {}",
            status.message()
        )),
    }
}

struct Inner {
    core: Arc<WorkerCore>,
    peers: Peers,
    config: PrefillConfig,
    in_flight: AtomicUsize,
}

/// The gRPC face of the worker.
#[derive(Clone)]
pub struct PrefillWorker {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PrefillWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.core.fmt(f)
    }
}

impl PrefillWorker {
    pub fn new(
        model: Arc<Model>,
        tokenizer: TextTokenizer,
        engine_config: EngineConfig,
        config: PrefillConfig,
    ) -> Result<Self, PrefillError> {
        let engine = Engine::new(model.clone(), tokenizer.clone(), engine_config)?;
        let mut transports = vec![
            Transport::Grpc as i32,
            Transport::Tcp as i32,
            Transport::Shm as i32,
        ];
        // Device-to-device copies need this engine's KV on a GPU.
        if engine.device_kv().is_some() {
            transports.push(Transport::CudaIpc as i32);
            #[cfg(feature = "nccl")]
            if tandem_transfer::nccl_supported() {
                transports.push(Transport::Nccl as i32);
            }
        }
        let info = worker_info(
            &config.worker_id,
            Role::Prefill,
            &model,
            engine.total_blocks(),
            transports,
        )?;
        let core = WorkerCore::new(
            spawn_engine(
                engine,
                EngineThreadOptions {
                    lend_slack: false,
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
                peers: Peers::new(config.auth.clone(), config.shm_dir.clone()),
                config,
                in_flight: AtomicUsize::new(0),
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
}

/// Counts a request in flight for the drain.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[tonic::async_trait]
impl PrefillService for PrefillWorker {
    async fn get_info(&self, req: Request<InfoRequest>) -> Result<Response<WorkerInfo>, Status> {
        self.inner
            .core
            .info_for(&req.into_inner())
            .map(Response::new)
    }

    async fn get_load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(
            self.inner.core.load_report(0, &req.into_inner()),
        ))
    }

    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        self.inner.core.refuse_while_draining()?;
        let req = req.into_inner();
        let span =
            tracing::info_span!("prefill", request_id = %req.request_id, tokens = req.prompt.len());
        self.inner.in_flight.fetch_add(1, Ordering::Relaxed);
        let _guard = InFlight(&self.inner.in_flight);
        prefill(&self.inner, req)
            .instrument(span)
            .await
            .map(Response::new)
    }
}

/// Runs one prompt. If the caller goes away, this future is dropped with the event receiver,
/// which stops the transfer before the next layer and aborts the sequence.
async fn prefill(inner: &Inner, req: PrefillRequest) -> Result<PrefillResponse, Status> {
    let sampling = sampling_from_proto(req.sampling.as_ref());
    let stop = prefill_stop(req.stop.as_ref());
    validate_request(
        inner.core.model.config(),
        inner.core.engine.pool().total(),
        &req.prompt,
        &sampling,
        &stop,
    )
    .map_err(|e| engine_status(&e))?;
    let dest = req
        .destination
        .ok_or_else(|| Status::invalid_argument("a prefill needs a KV destination"))?;
    let layout = inner.core.model.kv_layout();
    let started = Instant::now();
    let (window_first, first_block) = prefill_first_block(
        inner.core.model.config(),
        req.prompt.len(),
        dest.first_block,
    )?;
    let wanted_first = dest.first_block as usize;
    let sender = match connect(
        &inner.peers,
        &dest,
        &layout,
        &req.request_id,
        req.prompt.len(),
        first_block,
    )
    .await
    {
        Ok(s) => s,
        Err(e) => {
            inner.peers.forget(&dest);
            return Err(transfer_status(e));
        }
    };
    let pulled = if window_first == 0 && sampling.prompt_logprobs.is_none() {
        pull_missing_prefix(inner, &dest, &req.prompt, &req.request_id, wanted_first).await
    } else {
        None
    };
    let (pulled_tokens, pulled_bytes) = pulled.as_ref().map_or((0, 0), |p| {
        (
            (p.blocks * tandem_kv::BLOCK_SIZE) as u32,
            p.data.len() as u64,
        )
    });
    let (events_tx, mut events) = mpsc::unbounded_channel();
    inner
        .core
        .engine
        .add(
            req.prompt,
            sampling,
            stop,
            Some(KvShipment {
                sender,
                first_block,
                pulled,
            }),
            None,
            events_tx,
        )
        .await
        .map_err(|e| engine_status(&e))?;
    let Some(event) = events.recv().await else {
        return Err(Status::internal("the engine dropped the request"));
    };
    match event {
        SeqEvent::Prefilled {
            output,
            others,
            sender,
            queue_seconds,
            compute_seconds,
        } => {
            let first_token = |o: &tandem_engine::StepOutput| FirstToken {
                token: o.token,
                logprob: o.logprob,
                top_logprobs: o.top_logprobs.clone(),
                other_choices: Vec::new(),
            };
            let first = FirstToken {
                other_choices: others.iter().map(first_token).collect(),
                ..first_token(&output)
            };
            let other_choices = first.others_to_proto();
            let stats = sender.commit(first).await.map_err(|e| {
                inner.peers.forget(&dest);
                transfer_status(e)
            })?;
            tracing::debug!(
                bytes = stats.bytes,
                transfer_s = stats.seconds,
                transport = transport_name(stats.transport),
                total_s = started.elapsed().as_secs_f64(),
                "prefilled"
            );
            Ok(PrefillResponse {
                first_token: output.token,
                first_logprob: output.logprob,
                first_top_logprobs: top_logprobs_to_proto(&output.top_logprobs),
                other_choices,
                prompt_logprobs: prompt_logprobs_to_proto(&output.prompt_logprobs),
                cached_tokens: output.cached_tokens as u32,
                pulled_tokens,
                pulled_bytes,
                kv_bytes: stats.bytes,
                transfer_seconds: stats.seconds,
                compute_seconds,
                queue_seconds,
                transport: stats.transport as i32,
            })
        }
        SeqEvent::TransferFailed(reason) => {
            inner.peers.forget(&dest);
            Err(Status::aborted(reason))
        }
        SeqEvent::Failed(reason) => Err(Status::unavailable(reason)),
        SeqEvent::Token(_) => Err(Status::internal("a prefill produced a decode token")),
    }
}

/// The blocks of the decode worker's cached prefix (the `cached` blocks before the lease) that
/// this worker's own cache lacks, read from the decode worker so that the prompt computes only
/// what follows them. `None` when nothing is missing, when this engine cannot take KV into its
/// cache (no prefix caching, or a GPU engine), or when the pull fails: the prompt then computes
/// those blocks, which costs time and nothing else.
async fn pull_missing_prefix(
    inner: &Inner,
    dest: &KvDestination,
    prompt: &[u32],
    request_id: &str,
    cached: usize,
) -> Option<PulledPrefix> {
    if cached == 0 || !inner.config.pull_prefix || !inner.core.engine.imports_prefix_kv() {
        return None;
    }
    let have = inner.core.engine.cached_prefix_blocks(prompt);
    if have >= cached {
        return None;
    }
    let layout = inner.core.model.kv_layout();
    match pull_cached_prefix(&inner.peers, dest, &layout, request_id, have, cached).await {
        Ok(None) => None,
        Ok(Some(pulled)) => {
            tracing::debug!(
                from = have,
                to = cached,
                bytes = pulled.data.len(),
                seconds = pulled.seconds,
                "pulled the cached prefix this worker lacked"
            );
            Some(pulled)
        }
        Err(e) => {
            tracing::warn!(error = %e, from = have, to = cached, "could not pull the decode worker's cached prefix: computing it");
            None
        }
    }
}

/// Runs the worker on `grpc` until `shutdown` resolves, then drains: requests in flight
/// finish (up to the drain timeout).
pub async fn serve(
    worker: PrefillWorker,
    grpc: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), PrefillError> {
    let inner = worker.inner.clone();
    let serving = Serving {
        service_name: <PrefillServiceServer<PrefillWorker> as NamedService>::NAME,
        routes: Routes::new(PrefillServiceServer::new(worker)),
        drain_timeout: inner.config.drain_timeout,
        idle: Box::new({
            let inner = inner.clone();
            move || inner.in_flight.load(Ordering::Relaxed) == 0
        }),
        shutdown,
    };
    let server = inner.core.auth.server_builder()?;
    let (stopped, _) = tokio::sync::watch::channel(false);
    serve_until_drained(inner.core.clone(), server, grpc, serving, stopped).await?;
    Ok(())
}

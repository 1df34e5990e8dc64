//! What the prefill and decode services do alike: the state both hold ([`WorkerCore`]: the
//! engine, the model, the tokenizer, what `GetInfo` says, the credentials, whether the worker
//! drains), the answers to `GetInfo` and `GetLoad`, the refusal of new work while draining,
//! and serving the gRPC service with health until shutdown and a bounded drain.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tandem_auth::{AuthError, GuardedServer, InternalAuth};
use tandem_engine::Model;
use tandem_proto::PROTOCOL_VERSION;
use tandem_proto::v1::{InfoRequest, LoadReport, LoadRequest, Role, WorkerInfo};
use tandem_text::TextTokenizer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::Status;
use tonic::service::Routes;
use tonic_health::ServingStatus;

use crate::actor::EngineHandle;
use crate::convert::{kv_layout_to_proto, tokenizer_spec};

/// The state every worker service holds, whatever its role.
pub struct WorkerCore {
    pub engine: EngineHandle,
    pub model: Arc<Model>,
    pub tokenizer: Arc<TextTokenizer>,
    /// What `GetInfo` answers (without the tokenizer and the proof, added per call).
    pub info: WorkerInfo,
    /// Who may call, and the credentials this worker shows its peers.
    pub auth: InternalAuth,
    draining: AtomicBool,
}

impl std::fmt::Debug for WorkerCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerCore")
            .field("worker_id", &self.info.worker_id)
            .field("draining", &self.is_draining())
            .finish()
    }
}

impl WorkerCore {
    pub fn new(
        engine: EngineHandle,
        model: Arc<Model>,
        tokenizer: TextTokenizer,
        info: WorkerInfo,
        auth: InternalAuth,
    ) -> Self {
        Self {
            engine,
            model,
            tokenizer: Arc::new(tokenizer),
            info,
            auth,
            draining: AtomicBool::new(false),
        }
    }

    /// The answer to `GetInfo`: this worker's info, with its tokenizer when asked, signed over
    /// the caller's challenge.
    pub fn info_for(&self, req: &InfoRequest) -> Result<WorkerInfo, Status> {
        let mut info = self.info.clone();
        if req.include_tokenizer {
            info.tokenizer = Some(tokenizer_spec(&self.tokenizer)?);
        }
        self.auth.sign_worker_info(&mut info, &req.challenge);
        Ok(info)
    }

    /// The answer to `GetLoad`; `leases` counts the reservations a decode worker holds.
    /// A router's elastic thread planner rides on it: `asked.compute_threads` sets how many
    /// of a CPU engine's compute threads take part.
    pub fn load_report(&self, leases: u32, asked: &LoadRequest) -> LoadReport {
        if let Some((before, now)) = self.engine.set_compute_threads(asked.compute_threads)
            && before != now
        {
            tracing::info!(
                from = before,
                to = now,
                "compute threads moved by the router's planner"
            );
        }
        self.engine.load_report(
            leases,
            self.is_draining(),
            &self.info.instance_id,
            asked.block_events_after,
            asked.snapshot_from_block,
        )
    }

    /// Whether the worker is shutting down (it finishes what it has and takes nothing new).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// `UNAVAILABLE` while draining, so the router sends the work elsewhere.
    pub fn refuse_while_draining(&self) -> Result<(), Status> {
        if self.is_draining() {
            let role = Role::try_from(self.info.role).map_or("", |r| match r {
                Role::Prefill => "prefill ",
                Role::Decode => "decode ",
                _ => "",
            });
            return Err(Status::unavailable(format!(
                "this {role}worker is shutting down"
            )));
        }
        Ok(())
    }
}

/// The `GetInfo` fields every worker fills alike: who it is, the model and its KV layout, the
/// transports it takes, its pool's size, the protocol, and a fresh instance id (so the router
/// notices a restart behind the same address).
pub fn worker_info(
    worker_id: &str,
    role: Role,
    model: &Model,
    total_blocks: usize,
    transports: Vec<i32>,
) -> Result<WorkerInfo, AuthError> {
    let layout = model.kv_layout();
    let cfg = model.config();
    Ok(WorkerInfo {
        worker_id: worker_id.to_string(),
        role: role as i32,
        model_name: model.name().to_string(),
        kv_layout_hash: layout.hash(),
        kv_layout: Some(kv_layout_to_proto(&layout)),
        context_length: cfg.max_position_embeddings as u32,
        vocab_size: cfg.vocab_size as u32,
        tokenizer: None,
        transports,
        total_blocks: total_blocks as u32,
        protocol_version: PROTOCOL_VERSION,
        instance_id: tandem_auth::random_bytes::<16>()?.to_vec(),
        ..WorkerInfo::default()
    })
}

/// How a worker's gRPC service runs and stops.
pub struct Serving<F> {
    /// The worker's service by its gRPC name (health reports it) and its routes.
    pub service_name: &'static str,
    pub routes: Routes,
    /// The longest shutdown waits for work in progress.
    pub drain_timeout: Duration,
    /// Whether nothing is left to finish.
    pub idle: Box<dyn Fn() -> bool + Send + Sync>,
    /// Resolves when the worker is asked to stop.
    pub shutdown: F,
}

/// Serves `serving.routes` (and gRPC health) on `grpc` with `server` until shutdown; then the
/// worker drains: it says NOT_SERVING, refuses new work, waits until idle or the drain
/// timeout, and stops. `stopped` fires when the drain ends, for listeners that run beside the
/// gRPC server.
pub async fn serve_until_drained<F>(
    core: Arc<WorkerCore>,
    mut server: GuardedServer,
    grpc: TcpListener,
    serving: Serving<F>,
    stopped: watch::Sender<bool>,
) -> Result<(), tonic::transport::Error>
where
    F: Future<Output = ()> + Send + 'static,
{
    let Serving {
        service_name,
        routes,
        drain_timeout,
        idle,
        shutdown,
    } = serving;
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status(service_name, ServingStatus::Serving)
        .await;
    let mut stop = stopped.subscribe();
    tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutting down: draining");
        core.draining.store(true, Ordering::Relaxed);
        health
            .set_service_status(service_name, ServingStatus::NotServing)
            .await;
        let deadline = tokio::time::Instant::now() + drain_timeout;
        while !idle() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = stopped.send(true);
    });
    server
        .add_routes(routes.add_service(health_service))
        .serve_with_incoming_shutdown(
            // Token events are small writes: without TCP_NODELAY each waits on Nagle and the
            // peer's delayed ACK (~40 ms per hop, measured).
            tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
            async move {
                let _ = stop.changed().await;
            },
        )
        .await
}

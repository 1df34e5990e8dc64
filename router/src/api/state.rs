//! `AppState`, what every handler shares: the configuration, the worker pool, the flow's
//! context, the admission bounds, the tokenization slots and the metrics recorder; and
//! `RequestId`, the id the middleware gives each request.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::admission::Admission;
use crate::config::RouterConfig;
use crate::error::ApiError;
use crate::flow::FlowContext;
use crate::model::ServedModel;
use crate::routing::SloAsked;
use crate::workers::WorkerPool;

/// Shared by every handler.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

struct Shared {
    config: RouterConfig,
    pool: Arc<WorkerPool>,
    flow: Arc<FlowContext>,
    admission: Admission,
    /// Tokenizations and chat-template renderings running at once: one per core, so that
    /// huge prompts queue here instead of occupying every blocking thread.
    tokenizing: Arc<tokio::sync::Semaphore>,
    prometheus: PrometheusHandle,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("config", &self.0.config)
            .finish_non_exhaustive()
    }
}

impl AppState {
    pub fn new(config: RouterConfig, pool: Arc<WorkerPool>, prometheus: PrometheusHandle) -> Self {
        let flow = Arc::new(FlowContext {
            pool: Arc::clone(&pool),
            agg_threshold: config.agg_threshold,
            placement: config.placement,
            calibration: Default::default(),
            pressure: Default::default(),
            fallback: config.fallback,
            lease_ttl_ms: config.lease_ttl_ms,
            routing: config.routing,
            kv_overlap_weight: config.kv_overlap_weight,
            decode_turn: Default::default(),
            prefill_turn: Default::default(),
        });
        let admission = Admission::new(
            config.max_concurrent_requests,
            config.max_queued_requests,
            config.max_queue_wait,
        );
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        AppState(Arc::new(Shared {
            config,
            pool,
            flow,
            admission,
            tokenizing: Arc::new(tokio::sync::Semaphore::new(cores)),
            prometheus,
        }))
    }

    /// Tokenizes (or renders and tokenizes) with `f` on the blocking pool, at most one job
    /// per core at a time.
    pub async fn encode<F, T>(&self, model: &Arc<ServedModel>, f: F) -> Result<T, ApiError>
    where
        F: FnOnce(&ServedModel) -> Result<T, ApiError> + Send + 'static,
        T: Send + 'static,
    {
        let _slot = Arc::clone(&self.0.tokenizing)
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Internal)?;
        crate::model::encode_blocking(Arc::clone(model), f).await
    }

    pub fn config(&self) -> &RouterConfig {
        &self.0.config
    }

    pub fn pool(&self) -> &Arc<WorkerPool> {
        &self.0.pool
    }

    /// The running and waiting places every generation request takes one of.
    pub(super) fn admission(&self) -> &Admission {
        &self.0.admission
    }

    /// What the flow of each request borrows from the router.
    pub(super) fn flow(&self) -> &Arc<FlowContext> {
        &self.0.flow
    }

    /// The recorder behind `GET /metrics`.
    pub(super) fn prometheus(&self) -> &PrometheusHandle {
        &self.0.prometheus
    }

    /// The served model, or 503 while no decode worker has handed over its tokenizer.
    pub fn model(&self) -> Result<Arc<ServedModel>, ApiError> {
        self.0.pool.model().ok_or(ApiError::Starting)
    }

    /// Checks the `model` field of an OpenAI request (absent means the served model, and so
    /// does `tgi`: TGI's own client sends that name whatever the model, and TGI ignores it).
    pub fn check_model_name(
        &self,
        model: &ServedModel,
        asked: Option<&str>,
    ) -> Result<(), ApiError> {
        match asked {
            Some(TGI_CLIENT_MODEL) => Ok(()),
            Some(name) if name != model.name => Err(ApiError::ModelNotFound(name.to_string())),
            _ => Ok(()),
        }
    }
}

/// The `model` TGI's Python client (`text_generation`) puts in every chat request.
pub(crate) const TGI_CLIENT_MODEL: &str = "tgi";

/// The request id of the request being served: the client's `x-request-id` when it is
/// sane, else a fresh one (every gRPC call and log line of the request carries it); and the
/// latency targets its headers asked for.
#[derive(Debug, Clone)]
pub struct RequestId(pub String, pub SloAsked);

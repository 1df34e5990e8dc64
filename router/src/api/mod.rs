//! The HTTP surface: the axum `Router`, its shared state, the middleware every request goes
//! through (request id + tracing span, API key, body limit), the small routes (`/health`,
//! `/metrics`, `/v1/models`), and the launch step the four generation routes share.
//!
//! Route families: `/v1/*`, `/tokenize` and `/detokenize` speak OpenAI/vLLM and render errors
//! OpenAI style; `/`, `/generate`, `/generate_stream` and `/info` speak TGI and render errors
//! TGI style (validation → 422). The API key,
//! when configured, guards both families; `/health` and `/metrics` stay open so that probes
//! and scrapers need no secret.

pub mod error;
pub mod extract;
pub mod info;
pub mod logprobs;
pub mod openai;
pub mod sse;
pub mod structured;
pub mod tgi;
pub mod validate;

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tracing::Instrument;

use crate::admission::{Admission, InFlight};
use crate::config::RouterConfig;
use crate::flow::{self, FinishOut, FlowContext, FlowEvent, FlowPending, FlowRequest, FlowStream};
use crate::metrics as m;
use crate::model::ServedModel;
use crate::workers::WorkerPool;
use error::{ApiError, ApiFlavor};

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
            fallback: config.fallback,
            lease_ttl_ms: config.lease_ttl_ms,
            routing: config.routing,
            kv_overlap_weight: config.kv_overlap_weight,
            decode_turn: Default::default(),
            prefill_turn: Default::default(),
        });
        let admission = Admission::new(config.max_concurrent_requests, config.max_queued_requests);
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

    /// The served model, or 503 while no decode worker has handed over its tokenizer.
    pub fn model(&self) -> Result<Arc<ServedModel>, ApiError> {
        self.0.pool.model().ok_or(ApiError::Starting)
    }

    /// Checks the `model` field of an OpenAI request (absent means the served model).
    pub fn check_model_name(
        &self,
        model: &ServedModel,
        asked: Option<&str>,
    ) -> Result<(), ApiError> {
        match asked {
            Some(name) if name != model.name => Err(ApiError::ModelNotFound(name.to_string())),
            _ => Ok(()),
        }
    }
}

/// The request id of the request being served: the client's `x-request-id` when it is
/// sane, else a fresh one. Every gRPC call and log line of the request carries it.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// Builds the whole HTTP application.
pub fn app(state: AppState) -> Router {
    let guarded = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(info::model))
        .route("/tokenize", post(info::tokenize))
        .route("/detokenize", post(info::detokenize))
        .route("/info", get(info::tgi_info))
        .route("/", post(tgi::compat))
        .route("/generate", post(tgi::generate))
        .route("/generate_stream", post(tgi::generate_stream))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(guarded)
        .route("/health", get(health))
        .route("/metrics", get(prometheus_metrics))
        .fallback(route_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config().body_limit_bytes))
        .layer(middleware::from_fn(request_context))
        .with_state(state)
}

fn flavor_of_path(path: &str) -> ApiFlavor {
    if path.starts_with("/generate") || path == "/" || path == "/info" {
        ApiFlavor::Tgi
    } else {
        ApiFlavor::OpenAi
    }
}

async fn route_not_found(req: Request) -> Response {
    ApiError::RouteNotFound.into_response_for(flavor_of_path(req.uri().path()))
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::MethodNotAllowed.into_response_for(flavor_of_path(req.uri().path()))
}

/// Whether a client-supplied request id is safe to log and echo.
fn is_sane_request_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}

fn new_request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Assigns the request id, opens the request's span, and echoes the id on the response.
async fn request_context(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| is_sane_request_id(v))
        .map_or_else(new_request_id, str::to_string);
    req.extensions_mut().insert(RequestId(id.clone()));
    let span = tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.uri().path());
    let mut response = next.run(req).instrument(span).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}

/// 401 unless the configured API key is presented.
async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.config().api_key {
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        if !key.accepts_authorization(presented) {
            tracing::info!("request refused: missing or wrong API key");
            record_rejection(&ApiError::Unauthorized);
            let mut response =
                ApiError::Unauthorized.into_response_for(flavor_of_path(req.uri().path()));
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    next.run(req).await
}

/// `GET /health`: 200 when the router can serve (model known, a decode worker routable),
/// else 503 with what is missing. Open, no API key.
async fn health(State(state): State<AppState>) -> Response {
    let (decode, prefill) = state.pool().healthy_counts();
    let (decode_total, prefill_total) = state.pool().worker_counts();
    let ready = state.pool().model().is_some() && decode > 0;
    let body = json!({
        "status": if ready { "ok" } else { "unavailable" },
        "model_ready": state.pool().model().is_some(),
        "decode_workers_healthy": decode,
        "decode_workers": decode_total,
        "prefill_workers_healthy": prefill,
        "prefill_workers": prefill_total,
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

/// `GET /metrics`: Prometheus text. Open, no API key. The recorder's series, then the
/// per-worker families of the workers in the pool now (see `render_worker_families`).
async fn prometheus_metrics(State(state): State<AppState>) -> Response {
    let mut text = state.0.prometheus.render();
    text.push_str(&m::render_worker_families(&state.0.pool.worker_samples()));
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
}

/// Counts a request refused before any worker was involved.
pub fn record_rejection(e: &ApiError) {
    if e.is_server_side() {
        tracing::warn!(error = %e, "request refused");
    } else {
        tracing::info!(error = %e, "request refused");
    }
    metrics::counter!(m::REQUESTS_TOTAL, "mode" => "none", "outcome" => e.kind()).increment(1);
}

/// Takes a running slot for a request that passed its cheap checks (429 when every place is
/// taken, 503 after waiting past the deadline). Tokenization and template rendering happen
/// after this, so overload is refused before any of that work.
pub async fn admit(state: &AppState, deadline: Option<Instant>) -> Result<InFlight, ApiError> {
    let admit = state.0.admission.admit();
    match deadline {
        Some(d) => tokio::time::timeout_at(d.into(), admit)
            .await
            .unwrap_or(Err(ApiError::QueueTimeout)),
        None => admit.await,
    }
}

/// Starts an admitted request.
pub fn start(state: &AppState, request: FlowRequest, in_flight: InFlight) -> FlowPending {
    flow::start(Arc::clone(&state.0.flow), request, in_flight)
}

/// One choice of a whole generation, for the non-streaming routes.
#[derive(Debug)]
pub struct Collected {
    /// The text of the non-special tokens.
    pub text: String,
    pub finish: FinishOut,
    /// The id of the last token, if any (TGI tells EOS from stop sequences by it).
    pub last_token: Option<u32>,
    /// Every token as it was generated (TGI's `details.tokens`).
    pub tokens: Vec<crate::flow::TokenOut>,
    /// The choice it was generated as (its seed is the request's plus this), whatever
    /// [`CollectedAll::best`] numbers it.
    pub generated_as: u32,
}

impl Collected {
    /// The mean logprob of its tokens, how `best_of` ranks choices (OpenAI: "the highest log
    /// probability per token"); a choice without tokens ranks last.
    pub fn mean_logprob(&self) -> f64 {
        if self.tokens.is_empty() {
            return f64::NEG_INFINITY;
        }
        let sum: f64 = self.tokens.iter().map(|t| f64::from(t.logprob)).sum();
        sum / self.tokens.len() as f64
    }
}

/// Every choice of a whole generation, by choice index.
#[derive(Debug)]
pub struct CollectedAll {
    pub choices: Vec<Collected>,
    /// The last finish: its `total_completion_tokens` counts every choice.
    pub finish: FinishOut,
}

impl CollectedAll {
    /// The `keep` best choices by [`Collected::mean_logprob`], best first (ties keep their
    /// order), numbered again from 0.
    pub fn best(mut self, keep: usize) -> Self {
        self.choices
            .sort_by(|a, b| b.mean_logprob().total_cmp(&a.mean_logprob()));
        self.choices.truncate(keep.max(1));
        for (i, c) in (0..).zip(self.choices.iter_mut()) {
            c.finish.choice = i;
            for t in &mut c.tokens {
                t.choice = i;
            }
        }
        self
    }
}

/// Reads a started generation to its end. Nothing has been sent yet, so a failure here
/// still becomes a real HTTP status.
pub async fn collect(mut stream: FlowStream) -> Result<CollectedAll, ApiError> {
    let mut texts: std::collections::BTreeMap<u32, (String, Vec<crate::flow::TokenOut>)> =
        std::collections::BTreeMap::new();
    let mut done: Vec<Collected> = Vec::new();
    while let Some(event) = stream.events.recv().await {
        let finish = match event {
            FlowEvent::Token(token, finish) => {
                let (text, tokens) = texts.entry(token.choice).or_default();
                if !token.special {
                    text.push_str(&token.text);
                }
                tokens.push(token);
                match finish {
                    Some(finish) => finish,
                    None => continue,
                }
            }
            FlowEvent::Finished(finish) => finish,
            FlowEvent::Failed(e) => return Err(e),
        };
        let (text, tokens) = texts.remove(&finish.choice).unwrap_or_default();
        let last = finish.last;
        done.push(Collected {
            generated_as: finish.choice,
            text,
            last_token: tokens.last().map(|t| t.id),
            tokens,
            finish: finish.clone(),
        });
        if last {
            done.sort_by_key(|c| c.finish.choice);
            return Ok(CollectedAll {
                choices: done,
                finish,
            });
        }
    }
    tracing::error!("event stream ended without a finish");
    Err(ApiError::WorkerFailed)
}

/// The request deadline from the configured timeout.
pub fn deadline_from(state: &AppState, arrival: Instant) -> Option<Instant> {
    state.config().request_timeout.map(|t| arrival + t)
}

/// Unix seconds now (the `created` field).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids() {
        assert!(is_sane_request_id("benchmark-serving-12"));
        assert!(is_sane_request_id("a.b:c_d"));
        assert!(!is_sane_request_id(""));
        assert!(!is_sane_request_id("has space"));
        assert!(!is_sane_request_id("new\nline"));
        assert!(!is_sane_request_id(&"x".repeat(129)));
        assert_eq!(new_request_id().len(), 32);
    }
}

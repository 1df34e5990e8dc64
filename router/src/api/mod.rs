//! The HTTP surface: the axum `Router`, the middleware every request goes through (request
//! id + tracing span, API key, body limit), and the small routes (`/health`, `/metrics`, and
//! the 404/405 fallbacks). The state every handler shares is `state`'s; the launch step the
//! four generation routes share is `launch`'s; each route family has its own file.
//!
//! Route families: `/v1/*`, `/tokenize` and `/detokenize` speak OpenAI/vLLM and render errors
//! OpenAI style; `/`, `/generate`, `/generate_stream` and `/info` speak TGI and render errors
//! TGI style (validation → 422). The API key,
//! when configured, guards both families; `/health` and `/metrics` stay open so that probes
//! and scrapers need no secret.

pub mod extract;
pub mod info;
pub mod launch;
pub mod logprobs;
pub mod openai;
pub mod openai_request;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tgi;
pub mod tools;
pub mod validate;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tracing::Instrument;

use crate::error::{ApiError, ApiFlavor};
use crate::metrics as m;
use crate::routing::SloAsked;
use launch::record_rejection;
use state::{AppState, RequestId};

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

/// Assigns the request id, reads the request's latency targets (400 for a bad one), opens
/// the request's span, and echoes the id on the response.
async fn request_context(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| is_sane_request_id(v))
        .map_or_else(new_request_id, str::to_string);
    let span = tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.uri().path());
    let mut response = match SloAsked::from_headers(req.headers()) {
        Ok(slo) => {
            req.extensions_mut().insert(RequestId(id.clone(), slo));
            next.run(req).instrument(span).await
        }
        Err(message) => {
            let e = ApiError::Invalid {
                message,
                param: None,
            };
            span.in_scope(|| record_rejection(&e));
            e.into_response_for(flavor_of_path(req.uri().path()))
        }
    };
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
    let mut text = state.prometheus().render();
    text.push_str(&m::render_worker_families(&state.pool().worker_samples()));
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
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

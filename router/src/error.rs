//! `ApiError`: every way an HTTP request can fail, and the one table that turns each into a
//! status code, an error type and a body, in OpenAI style (`/v1/*`) or TGI style (`/generate*`).
//!
//! It sits at the crate root, below every other module, because each layer makes these
//! errors: admission (overload), the model (tokenization), the flow (worker failures) and the
//! HTTP routes (validation). It imports none of them, so none of them has to import the HTTP
//! layer to fail a request.
//!
//! Public messages never carry diagnostics from workers or the OS (paths, addresses, gRPC
//! details): those are logged where the error is made, and the client gets a fixed sentence
//! plus the request id it can quote (reliability.md, Dynamo `error.rs`).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tonic::Code;

/// Which API family renders the error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiFlavor {
    /// `{"error": {"message", "type", "param", "code"}}`, validation → 400.
    OpenAi,
    /// `{"error": "...", "error_type": "..."}`, validation → 422 (as TGI does).
    Tgi,
}

/// Seconds a client should wait before retrying an overload or availability error.
pub const RETRY_AFTER_SECONDS: u32 = 1;

/// A failed request, as the client will see it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// Bad input: a value out of range, a missing field, a prompt too long.
    #[error("{message}")]
    Invalid {
        message: String,
        /// The request field at fault, when there is one.
        param: Option<String>,
    },
    /// The `model` field names a model this router does not serve (404, as vLLM and OpenAI).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("missing or invalid API key: send `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error("request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("request body must be JSON: send `Content-Type: application/json`")]
    UnsupportedMediaType,
    /// The body did not arrive within `--body-read-timeout-ms`.
    #[error("the request body did not arrive within {ms} ms")]
    BodyTimeout { ms: u128 },
    #[error("no route for this path")]
    RouteNotFound,
    #[error("method not allowed on this path")]
    MethodNotAllowed,
    /// Every in-flight and queue slot is taken.
    #[error("the server is overloaded: too many requests in flight and queued; retry later")]
    Overloaded,
    /// Waited in the queue for `--max-queue-wait-ms` without a running slot: overload, as
    /// a full queue is.
    #[error(
        "waited {ms} ms for a free slot, the longest this server queues a request; retry later"
    )]
    QueueWait { ms: u128 },
    /// Waited in the queue until the request deadline.
    #[error("timed out waiting for a free slot; retry later")]
    QueueTimeout,
    /// A worker answered ResourceExhausted (no free KV blocks, full batch).
    #[error("the workers are out of capacity for this request; retry later")]
    WorkerBusy,
    /// No healthy, compatible decode worker.
    #[error("no healthy decode worker is available; retry later")]
    NoDecodeWorker,
    /// No healthy prefill worker and `--fallback error`.
    #[error("no healthy prefill worker is available; retry later")]
    NoPrefillWorker,
    /// The router has not yet reached any decode worker (startup).
    #[error("the router is starting and has not reached its workers yet; retry later")]
    Starting,
    /// A worker answered Unavailable, or could not be reached.
    #[error("a worker became unavailable while serving this request; retry later")]
    WorkerUnavailable,
    /// A worker answered InvalidArgument to a request the router had accepted.
    #[error("a worker rejected this request as invalid")]
    WorkerRejected,
    /// Any other worker failure, or a broken protocol exchange.
    #[error("a worker failed while serving this request")]
    WorkerFailed,
    /// The request deadline passed, or a worker answered DeadlineExceeded.
    #[error("the request timed out")]
    Timeout,
    #[error("internal error")]
    Internal,
}

/// One row of the table: how a variant is rendered.
struct Rendering {
    status: StatusCode,
    /// OpenAI `type`.
    openai_type: &'static str,
    /// TGI `error_type`; also the metric label for outcomes.
    tgi_type: &'static str,
    retry_after: bool,
}

impl ApiError {
    /// A validation error on `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::Invalid {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// A validation error about the request as a whole.
    pub fn invalid_body(message: impl Into<String>) -> Self {
        ApiError::Invalid {
            message: message.into(),
            param: None,
        }
    }

    /// The table. Keep it the only place that knows status codes.
    fn rendering(&self) -> Rendering {
        use ApiError::*;
        let (status, openai_type, tgi_type, retry_after) = match self {
            Invalid { .. } => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "validation",
                false,
            ),
            ModelNotFound(_) => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "validation",
                false,
            ),
            Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "authentication",
                false,
            ),
            PayloadTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "validation",
                false,
            ),
            UnsupportedMediaType => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                "validation",
                false,
            ),
            BodyTimeout { .. } => (
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "body_timeout",
                false,
            ),
            RouteNotFound => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "not_found",
                false,
            ),
            MethodNotAllowed => (
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "not_found",
                false,
            ),
            Overloaded | QueueWait { .. } | WorkerBusy => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "overloaded",
                true,
            ),
            QueueTimeout | NoDecodeWorker | NoPrefillWorker | Starting | WorkerUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable_error",
                "unavailable",
                true,
            ),
            WorkerRejected => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "validation",
                false,
            ),
            WorkerFailed => (
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "generation",
                false,
            ),
            Timeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_error",
                "timeout",
                false,
            ),
            Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                "internal",
                false,
            ),
        };
        Rendering {
            status,
            openai_type,
            tgi_type,
            retry_after,
        }
    }

    /// The HTTP status for `flavor` (TGI answers validation errors with 422).
    pub fn status(&self, flavor: ApiFlavor) -> StatusCode {
        let r = self.rendering();
        if flavor == ApiFlavor::Tgi && r.status == StatusCode::BAD_REQUEST {
            StatusCode::UNPROCESSABLE_ENTITY
        } else {
            r.status
        }
    }

    /// A short stable name of the failure class, for metric labels and logs.
    pub fn kind(&self) -> &'static str {
        self.rendering().tgi_type
    }

    /// Whether the worker (not the client) was at fault: drives log severity.
    pub fn is_server_side(&self) -> bool {
        self.rendering().status.is_server_error()
    }

    /// A gRPC status from a worker, mapped by code (never by message). The caller logs the
    /// status itself, which the client never sees.
    pub fn from_worker_status(status: &tonic::Status) -> Self {
        match status.code() {
            Code::InvalidArgument | Code::OutOfRange => ApiError::WorkerRejected,
            Code::ResourceExhausted => ApiError::WorkerBusy,
            Code::Unavailable => ApiError::WorkerUnavailable,
            Code::DeadlineExceeded => ApiError::Timeout,
            _ => ApiError::WorkerFailed,
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::Invalid { param, .. } => param.as_deref(),
            ApiError::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// The OpenAI-style body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn openai_body(&self) -> serde_json::Value {
        let r = self.rendering();
        let code = match self {
            ApiError::ModelNotFound(_) => json!("model_not_found"),
            _ => json!(self.status(ApiFlavor::OpenAi).as_u16()),
        };
        json!({
            "error": {
                "message": self.to_string(),
                "type": r.openai_type,
                "param": self.param(),
                "code": code,
            }
        })
    }

    /// The TGI-style body: `{"error": "...", "error_type": "..."}`.
    pub fn tgi_body(&self) -> serde_json::Value {
        json!({ "error": self.to_string(), "error_type": self.rendering().tgi_type })
    }

    /// The full response for `flavor`, with `Retry-After` where the table says so.
    pub fn into_response_for(self, flavor: ApiFlavor) -> Response {
        let status = self.status(flavor);
        let body = match flavor {
            ApiFlavor::OpenAi => self.openai_body(),
            ApiFlavor::Tgi => self.tgi_body(),
        };
        let mut response = (status, axum::Json(body)).into_response();
        if self.rendering().retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
        }
        response
    }
}

/// OpenAI rendering is the default (handlers of `/v1/*` return `Result<_, ApiError>`).
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.into_response_for(ApiFlavor::OpenAi)
    }
}

/// The same error rendered TGI style, for `/generate` and `/generate_stream`.
#[derive(Debug)]
pub struct TgiError(pub ApiError);

impl From<ApiError> for TgiError {
    fn from(e: ApiError) -> Self {
        TgiError(e)
    }
}

impl IntoResponse for TgiError {
    fn into_response(self) -> Response {
        self.0.into_response_for(ApiFlavor::Tgi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_body_golden() {
        let e = ApiError::invalid("max_tokens", "max_tokens must be at least 1, got 0");
        assert_eq!(
            e.openai_body().to_string(),
            r#"{"error":{"message":"max_tokens must be at least 1, got 0","type":"invalid_request_error","param":"max_tokens","code":400}}"#
        );
        assert_eq!(
            ApiError::ModelNotFound("x".into())
                .openai_body()
                .to_string(),
            r#"{"error":{"message":"The model `x` does not exist.","type":"invalid_request_error","param":"model","code":"model_not_found"}}"#
        );
    }

    #[test]
    fn tgi_validation_is_422() {
        let e = ApiError::invalid_body("inputs must not be empty");
        assert_eq!(e.status(ApiFlavor::Tgi), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(e.status(ApiFlavor::OpenAi), StatusCode::BAD_REQUEST);
        assert_eq!(
            e.tgi_body().to_string(),
            r#"{"error":"inputs must not be empty","error_type":"validation"}"#
        );
    }

    #[test]
    fn overload_and_unavailable_carry_retry_after() {
        for e in [
            ApiError::Overloaded,
            ApiError::NoDecodeWorker,
            ApiError::WorkerBusy,
        ] {
            let r = e.into_response_for(ApiFlavor::OpenAi);
            assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        }
        let r = ApiError::WorkerFailed.into_response_for(ApiFlavor::OpenAi);
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
    }

    #[test]
    fn worker_codes_map_by_code() {
        let cases = [
            (Code::InvalidArgument, StatusCode::BAD_REQUEST),
            (Code::ResourceExhausted, StatusCode::TOO_MANY_REQUESTS),
            (Code::Unavailable, StatusCode::SERVICE_UNAVAILABLE),
            (Code::DeadlineExceeded, StatusCode::GATEWAY_TIMEOUT),
            (Code::Internal, StatusCode::BAD_GATEWAY),
            (Code::Unknown, StatusCode::BAD_GATEWAY),
        ];
        for (code, want) in cases {
            let status = tonic::Status::new(code, "/secret/path at 0xdeadbeef");
            let e = ApiError::from_worker_status(&status);
            assert_eq!(e.status(ApiFlavor::OpenAi), want, "{code:?}");
            assert!(!e.to_string().contains("secret"), "diagnostic leaked: {e}");
        }
    }
}

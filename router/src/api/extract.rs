//! `ApiJson<T>`: the JSON body extractor of every generation route. It replaces axum's `Json`
//! so that each way a body can be wrong (content type, size, UTF-8, syntax, field types) gets
//! an `ApiError` with the same body shape as every other error, naming the bad field.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;

use super::AppState;
use super::error::ApiError;

/// A request body parsed as JSON into `T`; rejections are `ApiError`s.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        if !is_json_content_type(req.headers().get(header::CONTENT_TYPE)) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let limit = state.config().body_limit_bytes;
        // A slow body holds a connection and its memory: it gets a deadline of its own.
        let timeout = state.config().body_read_timeout;
        let read = tokio::time::timeout(timeout, Bytes::from_request(req, state))
            .await
            .map_err(|_| ApiError::BodyTimeout {
                ms: timeout.as_millis(),
            })?;
        let bytes = read.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge { limit }
            } else {
                tracing::debug!(error = %rejection, "could not read the request body");
                ApiError::invalid_body("could not read the request body")
            }
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// `application/json`, with or without parameters (`; charset=utf-8`), or any `+json` type.
fn is_json_content_type(value: Option<&axum::http::HeaderValue>) -> bool {
    let Some(Ok(value)) = value.map(|v| v.to_str()) else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Parses `bytes` as `T`, with messages that name the offending field and never echo more
/// of the body than serde's own short description of the bad value.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if std::str::from_utf8(bytes).is_err() {
        return Err(ApiError::invalid_body(
            "the request body is not valid UTF-8",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_data() && path != "." {
            ApiError::invalid(path.clone(), format!("invalid value for `{path}`: {inner}"))
        } else if inner.is_data() {
            ApiError::invalid_body(format!("invalid request body: {inner}"))
        } else {
            ApiError::invalid_body(format!("the request body is not valid JSON: {inner}"))
        }
    })?;
    de.end()
        .map_err(|e| ApiError::invalid_body(format!("the request body is not valid JSON: {e}")))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Body {
        max_tokens: Option<i64>,
        prompt: String,
    }

    fn err_of(bytes: &[u8]) -> ApiError {
        match parse_json::<Body>(bytes) {
            Ok(b) => panic!("parsed {b:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = err_of(br#"{"prompt": "hi", "max_tokens": "10"}"#);
        match &e {
            ApiError::Invalid { param, message } => {
                assert_eq!(param.as_deref(), Some("max_tokens"));
                assert!(message.contains("invalid type: string"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn syntax_utf8_trailing_and_nesting() {
        for body in [
            &b"{\"prompt\": \"hi\""[..],
            &b"{\"prompt\": \"\xff\xfe\"}"[..],
            &b"{\"prompt\": \"hi\"} x"[..],
            &b""[..],
        ] {
            assert!(matches!(err_of(body), ApiError::Invalid { .. }));
        }
        let deep = "[".repeat(10_000);
        assert!(matches!(err_of(deep.as_bytes()), ApiError::Invalid { .. }));
        // A lone surrogate escape is rejected by serde_json, not passed on.
        assert!(matches!(
            err_of(br#"{"prompt": "\ud800"}"#),
            ApiError::Invalid { .. }
        ));
    }

    #[test]
    fn content_types() {
        let ok = |s: &str| is_json_content_type(Some(&HeaderValue::from_str(s).unwrap()));
        assert!(ok("application/json"));
        assert!(ok("Application/JSON; charset=utf-8"));
        assert!(ok("application/vnd.api+json"));
        assert!(!ok("text/plain"));
        assert!(!ok("application/x-www-form-urlencoded"));
        assert!(!is_json_content_type(None));
    }
}

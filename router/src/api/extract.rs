//! `ApiJson<T>`: the JSON body extractor of every generation route. It replaces axum's `Json`
//! so that each way a body can be wrong (content type, size, UTF-8, syntax, field types) gets
//! an `ApiError` with the same body shape as every other error, naming the bad field.
//!
//! A body type may `#[serde(flatten)]` a part of its fields (the OpenAI requests do). serde
//! reads such a part from a buffer once the whole object is read, so an error in it would
//! name neither the field nor its place; the body type names its part (`JsonBody`), and a
//! failed body is read again as that part alone, which finds the error where the client
//! wrote it. Of the two errors, the one that comes first in the body is the one a body
//! without flattening would have met, and is the one reported. What flattening does change:
//! such a body must be an object (plain fields also read a list, as the fields in order),
//! and the fields it does not know are buffered within serde_json's nesting limit of 128
//! (plain fields skipped them at any depth).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::state::AppState;
use crate::error::ApiError;

/// A request body parsed as JSON into `T`; rejections are `ApiError`s.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// A deserialization error and the field it happened in.
pub type PathError = serde_path_to_error::Error<serde_json::Error>;

/// A type a request body is parsed into.
pub trait JsonBody: DeserializeOwned {
    /// For a type that `#[serde(flatten)]`s parts of its fields: the error that reading
    /// `bytes` as those parts alone meets first ([`first_error`] of each part, [`earlier`]
    /// of them). None for a type that flattens nothing.
    fn flattened_error(_bytes: &[u8]) -> Option<PathError> {
        None
    }
}

/// Bodies taken as any JSON (the tokenizer routes, which check their fields themselves).
impl JsonBody for Value {}

/// The error that reading `bytes` as `P` meets first, as if `P` flattened nothing; None if
/// `bytes` read as `P`.
pub fn first_error<P: JsonBody>(bytes: &[u8]) -> Option<PathError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let whole = serde_path_to_error::deserialize::<_, P>(&mut de).err()?;
    Some(earlier(P::flattened_error(bytes), whole))
}

/// Of a flattened part's error and another, the one a body without flattening meets first:
/// the part's if it stands earlier, or at the same place and is a field's bad value (a
/// value is checked as soon as it is read, before what follows it: the end of the object,
/// where a flattened part fails when read with the rest, or a syntax error).
pub fn earlier(flattened: Option<PathError>, other: PathError) -> PathError {
    let place = |e: &PathError| (e.inner().line(), e.inner().column());
    let bad_value = |e: &PathError| e.inner().is_data() && e.path().iter().next().is_some();
    match flattened {
        Some(f) if place(&f) < place(&other) || (place(&f) == place(&other) && bad_value(&f)) => f,
        _ => other,
    }
}

impl<T: JsonBody> FromRequest<AppState> for ApiJson<T> {
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
pub fn parse_json<T: JsonBody>(bytes: &[u8]) -> Result<T, ApiError> {
    if std::str::from_utf8(bytes).is_err() {
        return Err(ApiError::invalid_body(
            "the request body is not valid UTF-8",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let e = earlier(T::flattened_error(bytes), e);
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

    impl JsonBody for Body {}

    /// Options nested in a body.
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Options {
        include_usage: Option<bool>,
    }

    /// The fields of `Flattened`, all plain.
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Plain {
        max_tokens: Option<i64>,
        stream: Option<bool>,
        stop_token_ids: Option<Vec<u32>>,
        seed: Option<u64>,
        options: Option<Options>,
        tags: Option<Value>,
    }

    impl JsonBody for Plain {}

    /// `Plain`'s fields, most of them in a flattened part.
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Flattened {
        max_tokens: Option<i64>,
        #[serde(flatten)]
        part: Part,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Part {
        stream: Option<bool>,
        stop_token_ids: Option<Vec<u32>>,
        #[serde(flatten)]
        inner: Inner,
    }

    impl JsonBody for Part {
        fn flattened_error(bytes: &[u8]) -> Option<PathError> {
            first_error::<Inner>(bytes)
        }
    }

    /// A part of the part, flattened again.
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        seed: Option<u64>,
        options: Option<Options>,
        tags: Option<Value>,
    }

    impl JsonBody for Inner {}

    impl JsonBody for Flattened {
        fn flattened_error(bytes: &[u8]) -> Option<PathError> {
            first_error::<Part>(bytes)
        }
    }

    /// What a client would see of parsing `body` as `T`: nothing, or the error's field and
    /// message.
    fn seen<T: JsonBody>(body: &str) -> Option<(Option<String>, String)> {
        match parse_json::<T>(body.as_bytes()) {
            Ok(_) => None,
            Err(ApiError::Invalid { param, message }) => Some((param, message)),
            Err(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_flattened_part_fails_as_plain_fields_do() {
        for body in [
            r#"{"stream": "yes"}"#,
            r#"{"max_tokens": 3, "stop_token_ids": [1, -2]}"#,
            r#"{"stop_token_ids": [4294967296], "max_tokens": "x"}"#,
            r#"{"max_tokens": "x", "seed": -1}"#,
            r#"{"options": {"include_usage": 1}}"#,
            r#"{"seed": 1.5, "stream": true"#,
            r#"{"stream": true, "unknown": [1, 2}"#,
            r#"{"stream": true, "stream": false}"#,
            r#"{"tags": 1, "seed": 2, "tags": 3}"#,
            r#"{"stop_token_ids": "x"}"#,
            r#"{"seed": "x"}"#,
            r#"{"max_tokens": 1, "seed": 2"#,
            r#"{"max_tokens": 1, "options": 2"#,
            r#"{"stream": 3"#,
            r#"{"max_tokens": 1, "stream": [1], "seed": "x""#,
            r#"{"seed": 1} x"#,
            r#"{"tags": null, "stream": null, "user": {"a": [1]}}"#,
            r#"{"tags": {"x": [1, 2.5, "z"]}, "seed": 18446744073709551615}"#,
        ] {
            assert_eq!(seen::<Flattened>(body), seen::<Plain>(body), "{body}");
        }
        assert_eq!(
            seen::<Flattened>(r#"{"max_tokens": 2, "stream": "yes"}"#).map(|(p, _)| p),
            Some(Some("stream".to_string()))
        );
        // Not an object: the body's own error, which names the body's type, not the part's.
        let (param, message) = seen::<Flattened>("5").unwrap_or_default();
        assert_eq!(param, None);
        assert!(message.contains("expected struct Flattened"), "{message}");
    }

    /// Where flattening does differ: serde reads a flattened body as a map, never as a list,
    /// and buffers the fields it does not know, with serde_json's nesting limit (128).
    #[test]
    fn a_flattened_body_is_an_object_and_its_unknown_fields_are_nested_at_most_128_deep() {
        let refused_as_a_whole = |body: &str| {
            let seen = seen::<Flattened>(body);
            assert!(
                matches!(&seen, Some((None, m)) if m.starts_with("invalid request body") || m.starts_with("the request body is not valid JSON")),
                "{seen:?}"
            );
        };
        // Plain fields take a list as the fields in order (and fail on the first mismatch).
        assert!(seen::<Plain>("[1, 2]").is_some_and(|(p, _)| p.as_deref() == Some("[1]")));
        refused_as_a_whole("[1, 2]");
        let deep = |depth: usize| {
            format!(
                r#"{{"metadata": {}1{}, "stream": true}}"#,
                "[".repeat(depth),
                "]".repeat(depth)
            )
        };
        assert_eq!(seen::<Flattened>(&deep(100)), None);
        assert_eq!(seen::<Plain>(&deep(200)), None);
        refused_as_a_whole(&deep(200));
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

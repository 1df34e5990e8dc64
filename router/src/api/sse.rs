//! Server-sent events and the `x-tandem-*` response headers.
//!
//! The SSE framing is written by hand rather than with axum's `Sse` so that each API gets
//! its exact line shape (`data: {...}` for OpenAI, `data:{...}` for TGI, as bench-spec §3
//! shows), and so that a stream always ends with a terminal event — `[DONE]` or an explicit
//! error — even when the request task vanished (never a silent EOF).
//!
//! Keep-alives: a stream with nothing to send for `--sse-keepalive-ms` gets an SSE comment
//! (`: keep-alive`), which clients and proxies see as traffic and SSE parsers skip. That
//! covers a long wait for the first token (a deep prefill queue: after one interval without a
//! head the response commits to 200, and a later failure arrives as an error event instead
//! of a status) and a gap in the middle (a sequence preempted for KV space waits, then
//! resumes).

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::Response;
use tokio::sync::{mpsc, oneshot};

use crate::error::{ApiError, ApiFlavor};
use crate::flow::{FlowEvent, FlowPending, Head, transport_name};
use crate::metrics as m;

/// The comment a quiet stream gets.
pub const KEEPALIVE: &str = ": keep-alive\n\n";

/// Sets `x-tandem-mode`, `x-tandem-kv-bytes`, `x-tandem-transport` and, after a fallback,
/// `x-tandem-fallback`.
pub fn tandem_headers(head: &Head, headers: &mut HeaderMap) {
    headers.insert(
        "x-tandem-mode",
        HeaderValue::from_static(head.mode.as_str()),
    );
    headers.insert("x-tandem-kv-bytes", HeaderValue::from(head.kv_bytes));
    headers.insert(
        "x-tandem-transport",
        HeaderValue::from_static(transport_name(head.transport)),
    );
    if let Some(reason) = head.fallback {
        headers.insert(
            "x-tandem-fallback",
            HeaderValue::from_static(reason.as_str()),
        );
    }
}

/// One `data:` event; `space` puts a space after the colon (OpenAI style).
pub fn data_event(payload: &str, space: bool) -> String {
    let sep = if space { " " } else { "" };
    format!("data:{sep}{payload}\n\n")
}

/// Turns flow events into the bytes of one API's event stream.
pub trait StreamFormatter: Send + 'static {
    /// Learns the head (mode, transport), when it arrives after the stream started.
    fn on_head(&mut self, head: &Head) {
        let _ = head;
    }
    /// The text for `event`, and whether the stream is complete after it.
    fn format(&mut self, event: FlowEvent) -> (String, bool);
    /// The terminal text when the events stopped without a terminal event.
    fn broken(&mut self) -> String;
}

/// Where a stream's body is.
enum Stage {
    /// Committed to 200 before the head: keep-alives until it comes.
    WaitingHead(
        oneshot::Receiver<Result<Head, ApiError>>,
        mpsc::Receiver<FlowEvent>,
    ),
    Streaming(mpsc::Receiver<FlowEvent>),
    Done,
}

/// The SSE response of a started generation. Waits up to `keepalive` for the head: an error
/// by then is a real HTTP status in `flavor`; after it the response is a 200 stream that
/// sends keep-alives until the first token (see the module doc).
pub async fn stream_response<F: StreamFormatter>(
    pending: FlowPending,
    mut formatter: F,
    keepalive: Option<Duration>,
    flavor: ApiFlavor,
) -> Response {
    let (mut head_rx, events) = pending.into_parts();
    let head = match keepalive {
        None => Some((&mut head_rx).await),
        Some(k) => tokio::time::timeout(k, &mut head_rx).await.ok(),
    };
    match head {
        Some(Ok(Ok(head))) => {
            formatter.on_head(&head);
            body(Stage::Streaming(events), formatter, keepalive, Some(&head))
        }
        Some(Ok(Err(e))) => e.into_response_for(flavor),
        Some(Err(_)) => {
            tracing::error!("request task ended without an answer");
            ApiError::Internal.into_response_for(flavor)
        }
        None => body(
            Stage::WaitingHead(head_rx, events),
            formatter,
            keepalive,
            None,
        ),
    }
}

/// The next piece of a stream's body.
async fn next<F: StreamFormatter>(
    stage: Stage,
    formatter: &mut F,
    keepalive: Option<Duration>,
) -> Option<(String, Stage)> {
    let quiet = || {
        metrics::counter!(m::SSE_KEEPALIVES_TOTAL).increment(1);
        KEEPALIVE.to_string()
    };
    match stage {
        Stage::Done => None,
        Stage::WaitingHead(mut head_rx, events) => {
            let wait = keepalive.unwrap_or(Duration::from_secs(15));
            match tokio::time::timeout(wait, &mut head_rx).await {
                Err(_) => Some((quiet(), Stage::WaitingHead(head_rx, events))),
                Ok(Ok(Ok(head))) => {
                    formatter.on_head(&head);
                    Some((String::new(), Stage::Streaming(events)))
                }
                Ok(Ok(Err(e))) => Some((formatter.format(FlowEvent::Failed(e)).0, Stage::Done)),
                Ok(Err(_)) => Some((formatter.broken(), Stage::Done)),
            }
        }
        Stage::Streaming(mut events) => {
            let got = match keepalive {
                None => Some(events.recv().await),
                Some(k) => tokio::time::timeout(k, events.recv()).await.ok(),
            };
            match got {
                None => Some((quiet(), Stage::Streaming(events))),
                Some(Some(event)) => {
                    let (text, done) = formatter.format(event);
                    let stage = if done {
                        Stage::Done
                    } else {
                        Stage::Streaming(events)
                    };
                    Some((text, stage))
                }
                Some(None) => Some((formatter.broken(), Stage::Done)),
            }
        }
    }
}

fn body<F: StreamFormatter>(
    stage: Stage,
    formatter: F,
    keepalive: Option<Duration>,
    head: Option<&Head>,
) -> Response {
    let stream = futures::stream::unfold(
        (stage, formatter),
        move |(stage, mut formatter)| async move {
            let (text, stage) = next(stage, &mut formatter, keepalive).await?;
            Some((Ok::<_, Infallible>(Bytes::from(text)), (stage, formatter)))
        },
    );
    let mut response = Response::new(Body::from_stream(stream));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Reverse proxies (nginx) must not buffer token streams.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    if let Some(head) = head {
        tandem_headers(head, headers);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing() {
        assert_eq!(data_event("{}", true), "data: {}\n\n");
        assert_eq!(data_event("{}", false), "data:{}\n\n");
    }
}

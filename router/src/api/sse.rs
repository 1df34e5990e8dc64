//! Server-sent events and the `x-tandem-*` response headers.
//!
//! The SSE framing is written by hand rather than with axum's `Sse` so that each API gets
//! its exact line shape (`data: {...}` for OpenAI, `data:{...}` for TGI, as bench-spec §3
//! shows), and so that a stream always ends with a terminal event — `[DONE]` or an explicit
//! error — even when the request task vanished (never a silent EOF).

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::Response;
use tokio::sync::mpsc;

use crate::flow::{FlowEvent, Head, transport_name};

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
    /// The text for `event`, and whether the stream is complete after it.
    fn format(&mut self, event: FlowEvent) -> (String, bool);
    /// The terminal text when the events stopped without a terminal event.
    fn broken(&mut self) -> String;
}

/// The SSE response for a started generation.
pub fn event_stream<F: StreamFormatter>(
    head: &Head,
    events: mpsc::Receiver<FlowEvent>,
    formatter: F,
) -> Response {
    let stream = futures::stream::unfold(
        (events, formatter, false),
        |(mut events, mut formatter, done)| async move {
            if done {
                return None;
            }
            let (text, done) = match events.recv().await {
                Some(event) => formatter.format(event),
                None => (formatter.broken(), true),
            };
            Some((
                Ok::<_, Infallible>(Bytes::from(text)),
                (events, formatter, done),
            ))
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
    tandem_headers(head, headers);
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

//! A scriptable streaming server for the bench's own tests and client benchmark: it answers
//! POSTs on any path with scripted chunks at scripted times, records what it received, and
//! counts open streams. Not a model server: it never looks at prompts beyond counting their
//! words.
//!
//! [`synthetic`] builds the usual shapes (OpenAI completions/chat SSE with usage and
//! `[DONE]`, TGI `generate_stream` events) from the request's `max_tokens`;
//! [`synthetic_tandem`] adds the accounting tandem's router reports in its usage (cached
//! prompt tokens from a simulated prefix cache, KV bytes and blocks "transferred").

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Method, Request, Response, StatusCode, header};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// One chunk written to the response after `delay` (counted from the previous chunk).
#[derive(Debug, Clone)]
pub struct ScriptedEvent {
    pub delay: Duration,
    pub bytes: Bytes,
    /// How many token events the chunk carries (for the server's counters only).
    pub tokens: u64,
}

impl ScriptedEvent {
    /// A chunk of text after `delay`, carrying `tokens` token events.
    pub fn new(delay: Duration, text: impl Into<String>, tokens: u64) -> Self {
        Self {
            delay,
            bytes: Bytes::from(text.into()),
            tokens,
        }
    }
}

/// The whole answer to one request.
#[derive(Debug, Clone)]
pub struct ScriptedResponse {
    pub status: u16,
    pub events: Vec<ScriptedEvent>,
}

/// A request as the server saw it.
#[derive(Debug, Clone)]
pub struct ReceivedRequest {
    pub path: String,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The JSON body (`Value::Null` if it was not JSON).
    pub body: Value,
}

impl ReceivedRequest {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// `max_tokens`, `max_completion_tokens` or TGI's `parameters.max_new_tokens`.
    pub fn requested_tokens(&self) -> Option<u64> {
        self.body
            .get("max_tokens")
            .or_else(|| self.body.get("max_completion_tokens"))
            .or_else(|| self.body.pointer("/parameters/max_new_tokens"))
            .and_then(Value::as_u64)
    }
}

/// Decides the answer to each request.
pub type Responder = Arc<dyn Fn(&ReceivedRequest) -> ScriptedResponse + Send + Sync>;

/// Counters of a running server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ServerStats {
    /// Most response streams open at the same time.
    pub peak_streams: usize,
    /// Streams opened in total.
    pub streams: u64,
    /// Token events written.
    pub tokens: u64,
}

#[derive(Default)]
struct Counters {
    open: AtomicUsize,
    peak: AtomicUsize,
    streams: AtomicU64,
    tokens: AtomicU64,
}

/// Requests kept for inspection; beyond this they are only counted.
const MAX_RECORDED: usize = 10_000;

struct ServerState {
    responder: Responder,
    counters: Counters,
    received: Mutex<Vec<ReceivedRequest>>,
}

/// Keeps `open` accurate however a stream ends (finished, or dropped by a client).
struct OpenStream(Arc<ServerState>);

impl OpenStream {
    fn new(state: Arc<ServerState>) -> Self {
        let open = state.counters.open.fetch_add(1, Ordering::SeqCst) + 1;
        state.counters.peak.fetch_max(open, Ordering::SeqCst);
        state.counters.streams.fetch_add(1, Ordering::Relaxed);
        Self(state)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.counters.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running fake server on 127.0.0.1.
pub struct FakeServer {
    addr: SocketAddr,
    state: Arc<ServerState>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for FakeServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl FakeServer {
    /// Binds 127.0.0.1 on a free port and serves `responder`.
    pub async fn start(responder: Responder) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        Self::start_on(listener, responder)
    }

    /// Serves `responder` on an already bound listener.
    pub fn start_on(listener: TcpListener, responder: Responder) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let state = Arc::new(ServerState {
            responder,
            counters: Counters::default(),
            received: Mutex::new(Vec::new()),
        });
        let shutdown = CancellationToken::new();
        let app = axum::Router::new().fallback({
            let state = state.clone();
            move |request: Request<Body>| handle(state.clone(), request)
        });
        let token = shutdown.clone();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(token.cancelled_owned());
            if let Err(error) = serve.await {
                tracing::warn!(%error, "fake server stopped");
            }
        });
        Ok(Self {
            addr,
            state,
            shutdown,
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The requests received so far (the first 10,000).
    pub fn requests(&self) -> Vec<ReceivedRequest> {
        self.state
            .received
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    pub fn stats(&self) -> ServerStats {
        stats(&self.state)
    }

    /// Stops accepting and waits (at most 5 s) for the server task.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
    }
}

fn stats(state: &ServerState) -> ServerStats {
    ServerStats {
        peak_streams: state.counters.peak.load(Ordering::SeqCst),
        streams: state.counters.streams.load(Ordering::Relaxed),
        tokens: state.counters.tokens.load(Ordering::Relaxed),
    }
}

async fn handle(state: Arc<ServerState>, request: Request<Body>) -> Response<Body> {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_string();
    if parts.method == Method::GET {
        let body = match path.as_str() {
            "/v1/models" => {
                json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            }
            "/stats" => json!(stats(&state)),
            _ => return plain(StatusCode::NOT_FOUND, "not found"),
        };
        return plain(StatusCode::OK, &body.to_string());
    }
    let bytes = axum::body::to_bytes(body, 64 << 20)
        .await
        .unwrap_or_default();
    let received = ReceivedRequest {
        path,
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
            .collect(),
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    };
    let scripted = (state.responder)(&received);
    if let Ok(mut log) = state.received.lock()
        && log.len() < MAX_RECORDED
    {
        log.push(received);
    }
    let status = StatusCode::from_u16(scripted.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if status != StatusCode::OK {
        let text: Vec<u8> = scripted
            .events
            .iter()
            .flat_map(|e| e.bytes.to_vec())
            .collect();
        return Response::builder()
            .status(status)
            .body(Body::from(text))
            .unwrap_or_default();
    }
    let guard = OpenStream::new(state);
    let stream = futures::stream::unfold(
        (scripted.events.into_iter(), guard),
        |(mut events, guard)| async move {
            let event = events.next()?;
            if !event.delay.is_zero() {
                tokio::time::sleep(event.delay).await;
            }
            guard
                .0
                .counters
                .tokens
                .fetch_add(event.tokens, Ordering::Relaxed);
            Some((Ok::<Bytes, Infallible>(event.bytes), (events, guard)))
        },
    );
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_default()
}

fn plain(status: StatusCode, text: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(text.to_string()))
        .unwrap_or_default()
}

/// `data: {completions chunk}\n\n` carrying `text`.
pub fn completion_chunk(text: &str) -> String {
    let chunk = json!({"id": "cmpl-0", "object": "text_completion", "model": "fake-model",
        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

/// `data: {chat chunk}\n\n` with `delta.content` = `content`.
pub fn chat_chunk(content: &str) -> String {
    let chunk = json!({"id": "chatcmpl-0", "object": "chat.completion.chunk", "model": "fake-model",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

/// The trailing usage chunk of `stream_options.include_usage`.
pub fn usage_chunk(prompt_tokens: u64, completion_tokens: u64) -> String {
    let chunk = json!({"id": "cmpl-0", "object": "text_completion", "model": "fake-model", "choices": [],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens}});
    format!("data: {chunk}\n\n")
}

/// The usage chunk as tandem's router sends it: OpenAI's `prompt_tokens_details` plus the
/// `tandem` object.
pub fn tandem_usage_chunk(
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
    kv_bytes: u64,
    kv_blocks: u64,
) -> String {
    let chunk = json!({"id": "cmpl-0", "object": "text_completion", "model": "fake-model", "choices": [],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens},
                  "tandem": {"mode": "disaggregated", "kv_bytes": kv_bytes, "transport": "shm",
                             "fallback_reason": null, "cached_tokens": cached_tokens,
                             "kv_blocks": kv_blocks}}});
    format!("data: {chunk}\n\n")
}

/// `data: [DONE]\n\n`.
pub fn done_chunk() -> String {
    "data: [DONE]\n\n".to_string()
}

/// One TGI `generate_stream` event; `generated_text` is set on the final one.
pub fn tgi_event(index: u64, text: &str, generated_text: Option<&str>) -> String {
    let event = json!({"index": index,
        "token": {"id": index, "text": text, "logprob": -0.1, "special": false},
        "generated_text": generated_text, "details": null});
    format!("data:{event}\n\n")
}

/// Timing of [`synthetic`] streams.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyntheticTiming {
    /// Before the first token.
    pub ttft: Duration,
    /// Between later tokens.
    pub itl: Duration,
    /// Token events per network write (1 = one write per token).
    pub events_per_write: usize,
}

/// Answers every request with `max_tokens` token events in the format its path implies
/// (`/generate_stream`: TGI; `…/chat/completions`: chat; anything else: completions), each
/// token the word `w{k}`, then usage and `[DONE]` for OpenAI paths.
pub fn synthetic(timing: SyntheticTiming) -> Responder {
    synthetic_responder(timing, None)
}

/// KV bytes per prompt token [`synthetic_tandem`] reports as transferred.
pub const FAKE_KV_BYTES_PER_TOKEN: u64 = 64;
/// Tokens per KV block [`synthetic_tandem`] reports.
pub const FAKE_KV_BLOCK_TOKENS: u64 = 16;
/// Prompts the simulated prefix cache remembers.
const PREFIX_CACHE_PROMPTS: usize = 1024;

/// [`synthetic`], with usage as tandem's router reports it. Prompt tokens are the prompt's
/// whitespace-separated words (all message contents for chat); cached tokens are the longest
/// word prefix shared with an earlier prompt, as a prefix cache would find; the uncached rest
/// is "transferred" at [`FAKE_KV_BYTES_PER_TOKEN`] bytes, in [`FAKE_KV_BLOCK_TOKENS`]-token
/// blocks.
pub fn synthetic_tandem(timing: SyntheticTiming) -> Responder {
    synthetic_responder(timing, Some(Arc::new(Mutex::new(Vec::new()))))
}

/// The words of a request's prompt: `prompt`, or every message's text for chat.
fn prompt_words(body: &Value) -> Vec<String> {
    let mut text = String::new();
    if let Some(prompt) = body.get("prompt").and_then(Value::as_str) {
        text.push_str(prompt);
    }
    for message in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        match message.get("content") {
            Some(Value::String(content)) => text.push_str(content),
            Some(Value::Array(parts)) => {
                for part in parts {
                    text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""));
                }
            }
            _ => {}
        }
        // Message boundaries separate words, as a chat template would.
        text.push(' ');
    }
    text.split_whitespace().map(str::to_string).collect()
}

/// Looks `words` up in, then adds it to, the simulated prefix cache; returns the cached count.
fn cached_prefix(cache: &Mutex<Vec<Vec<String>>>, words: Vec<String>) -> u64 {
    let Ok(mut seen) = cache.lock() else {
        return 0;
    };
    let cached = seen
        .iter()
        .map(|old| old.iter().zip(&words).take_while(|(a, b)| a == b).count())
        .max()
        .unwrap_or(0);
    if seen.len() >= PREFIX_CACHE_PROMPTS {
        seen.remove(0);
    }
    seen.push(words);
    cached as u64
}

fn synthetic_responder(
    timing: SyntheticTiming,
    prefix_cache: Option<Arc<Mutex<Vec<Vec<String>>>>>,
) -> Responder {
    // Chunks repeat every 100 tokens: render them once, so the server stays far cheaper than
    // the client it is measuring.
    let words: Vec<String> = (0..100).map(|k| format!("w{k} ")).collect();
    let completion: Vec<String> = words.iter().map(|w| completion_chunk(w)).collect();
    let chat: Vec<String> = words.iter().map(|w| chat_chunk(w)).collect();
    Arc::new(move |request: &ReceivedRequest| {
        let n = request.requested_tokens().unwrap_or(16);
        let per_write = timing.events_per_write.max(1) as u64;
        let is_chat = request.path.ends_with("chat/completions");
        let is_tgi = request.path.ends_with("generate_stream");
        let mut events = Vec::new();
        let mut pending = String::new();
        let mut pending_tokens = 0;
        let mut generated = String::new();
        for k in 0..n {
            let slot = (k % 100) as usize;
            let last = k + 1 == n;
            if is_tgi {
                generated.push_str(&words[slot]);
                pending.push_str(&tgi_event(
                    k,
                    &words[slot],
                    last.then_some(generated.as_str()),
                ));
            } else if is_chat {
                pending.push_str(&chat[slot]);
            } else {
                pending.push_str(&completion[slot]);
            }
            pending_tokens += 1;
            if pending_tokens == per_write || last {
                let delay = if events.is_empty() {
                    timing.ttft
                } else {
                    timing.itl
                };
                events.push(ScriptedEvent::new(
                    delay,
                    std::mem::take(&mut pending),
                    pending_tokens,
                ));
                pending_tokens = 0;
            }
        }
        if !is_tgi {
            let usage = match &prefix_cache {
                None => usage_chunk(1, n),
                Some(cache) => {
                    let words = prompt_words(&request.body);
                    let prompt = words.len() as u64;
                    let cached = cached_prefix(cache, words).min(prompt);
                    let moved = prompt - cached;
                    tandem_usage_chunk(
                        prompt,
                        n,
                        cached,
                        moved * FAKE_KV_BYTES_PER_TOKEN,
                        moved.div_ceil(FAKE_KV_BLOCK_TOKENS),
                    )
                }
            };
            let tail = format!("{usage}{}", done_chunk());
            events.push(ScriptedEvent::new(Duration::ZERO, tail, 0));
        }
        ScriptedResponse {
            status: 200,
            events,
        }
    })
}

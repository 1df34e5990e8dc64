//! The benchmark as an HTTP client of the router: the requests it sends on each generation
//! route, how it reads their answers (whole bodies and SSE streams) and how it classifies
//! and counts how each ended. Also the seeded prompt generator, so a run's mix repeats.
//!
//! Everything here is bounded by a timeout: a request that never ends is counted as lost,
//! never waited on.

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};

/// The served model name the router is given, so requests can name it.
pub const SERVED: &str = "tandem";
/// Longest any single request of the benchmark may take before it counts as hung.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// A generation route of the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    Completions,
    Chat,
    Generate,
    GenerateStream,
}

impl Route {
    pub fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
            Route::Generate => "/generate",
            Route::GenerateStream => "/generate_stream",
        }
    }

    /// TGI's routes answer (and fail) in TGI's shapes, not OpenAI's.
    pub fn is_tgi(self) -> bool {
        matches!(self, Route::Generate | Route::GenerateStream)
    }
}

/// One request the benchmark sends through the router.
#[derive(Debug, Clone)]
pub struct Call {
    pub route: Route,
    pub stream: bool,
    pub prompt: String,
    pub max_tokens: u32,
    pub ignore_eos: bool,
    /// Sampled (with a seed) instead of greedy.
    pub sample: bool,
    /// Drop the request: after the first event (streams) or after this long (others).
    pub cancel_after: Option<Duration>,
    pub request_id: String,
}

impl Call {
    /// A greedy completion that runs to `max_tokens` (EOS ignored), so its length is known.
    pub fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Self {
        Self {
            route: Route::Completions,
            stream,
            prompt: prompt.to_string(),
            max_tokens,
            ignore_eos: true,
            sample: false,
            cancel_after: None,
            request_id: String::new(),
        }
    }

    fn body(&self) -> Value {
        let temperature = if self.sample { 0.8 } else { 0.0 };
        match self.route {
            Route::Completions => {
                let mut body = json!({
                    "model": SERVED, "prompt": self.prompt, "max_tokens": self.max_tokens,
                    "stream": self.stream, "temperature": temperature, "seed": 7,
                    "ignore_eos": self.ignore_eos,
                });
                // Streaming options belong to streams only: the router (like OpenAI and
                // vLLM) refuses `stream_options` on a request that does not stream.
                if self.stream {
                    body["stream_options"] = json!({"include_usage": true});
                }
                body
            }
            Route::Chat => {
                let mut body = json!({
                    "model": SERVED, "messages": [{"role": "user", "content": self.prompt}],
                    "max_tokens": self.max_tokens, "stream": self.stream,
                    "temperature": temperature, "seed": 7, "ignore_eos": self.ignore_eos,
                });
                if self.stream {
                    body["stream_options"] = json!({"include_usage": true});
                }
                body
            }
            Route::Generate | Route::GenerateStream => {
                let mut parameters = json!({
                    "max_new_tokens": self.max_tokens, "details": true,
                    "ignore_eos_token": self.ignore_eos,
                });
                // TGI refuses a temperature without sampling, so greedy sends none.
                if self.sample {
                    parameters["do_sample"] = json!(true);
                    parameters["temperature"] = json!(temperature);
                    parameters["seed"] = json!(7);
                }
                json!({"inputs": self.prompt, "parameters": parameters})
            }
        }
    }
}

/// How a request ended, as its client saw it.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Complete: a 200 with a full body, or a stream that ended with `[DONE]` or a final
    /// TGI event. `disaggregated` from `x-tandem-mode`, or for an OpenAI stream whose head
    /// went out before the mode was chosen (a keep-alive while the prompt waited), from its
    /// usage chunk's `tandem.mode`; `mode_said`: one of the two said the mode (a TGI stream
    /// with such an early head does not).
    Ok {
        disaggregated: bool,
        mode_said: bool,
        text: String,
    },
    /// An explicit error: a status with an error body, or a stream's error event.
    Error { status: u16, in_stream: bool },
    /// Neither: a connection that broke, a stream that stopped without a terminal event, or
    /// nothing within the timeout.
    Lost(String),
    /// The client dropped it on purpose.
    Cancelled,
}

/// What a stream's events said so far.
#[derive(Debug, Default)]
struct StreamState {
    buffer: Vec<u8>,
    events: usize,
    error: bool,
    done: bool,
    text: String,
    /// `usage.tandem.mode` of an OpenAI stream's usage chunk.
    mode: Option<String>,
}

impl StreamState {
    /// Consumes the whole events in the buffer (chunks may split an event anywhere).
    fn feed(&mut self, bytes: &[u8], tgi: bool) {
        self.buffer.extend_from_slice(bytes);
        while let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buffer.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(payload) = line.strip_prefix("data:") else {
                    continue; // keep-alive comments and blank lines
                };
                self.data(payload.trim(), tgi);
            }
        }
    }

    fn data(&mut self, payload: &str, tgi: bool) {
        self.events += 1;
        if payload == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(payload) else {
            return;
        };
        if v.get("error").is_some_and(|e| !e.is_null()) {
            self.error = true;
        } else if tgi {
            if let Some(t) = v["token"]["text"].as_str() {
                self.text.push_str(t);
            }
            // TGI has no [DONE]: the last event is the one with the whole text.
            self.done |= v["generated_text"].is_string();
        } else {
            if let Some(t) = v["choices"][0]["text"]
                .as_str()
                .or_else(|| v["choices"][0]["delta"]["content"].as_str())
            {
                self.text.push_str(t);
            }
            if let Some(mode) = v["usage"]["tandem"]["mode"].as_str() {
                self.mode = Some(mode.to_string());
            }
        }
    }

    fn terminal(&self) -> bool {
        self.error || self.done
    }
}

/// The router's HTTP front as the benchmark's clients use it; cheap to clone into tasks.
#[derive(Clone)]
pub struct RouterClient {
    pub http: reqwest::Client,
    base: String,
}

impl RouterClient {
    pub fn new(port: u16) -> anyhow::Result<Self> {
        Self::at(&format!("http://127.0.0.1:{port}"))
    }

    /// A client of the router at `base` (`http://HOST:PORT`).
    pub fn at(base: &str) -> anyhow::Result<Self> {
        Ok(Self {
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(16)
                // Under the router's 2 s header timeout, which also closes idle keep-alive
                // connections: a request sent on one the router is closing would be lost to
                // the race, not to the router (HTTP clients retry only idempotent requests).
                .pool_idle_timeout(std::time::Duration::from_secs(1))
                .build()?,
            base: base.to_string(),
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends `call` and reads its answer to the end, in at most `timeout`.
    pub async fn run(&self, call: &Call, timeout: Duration) -> Outcome {
        self.run_telling(call, timeout, None).await
    }

    /// [`Self::run`], telling `first_event` when a stream's first event arrived.
    pub async fn run_telling(
        &self,
        call: &Call,
        timeout: Duration,
        first_event: Option<tokio::sync::oneshot::Sender<()>>,
    ) -> Outcome {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut request = self.http.post(self.url(call.route.path()));
        if !call.request_id.is_empty() {
            request = request.header("x-request-id", &call.request_id);
        }
        let request = request.json(&call.body()).send();
        // A request dropped before its head: a client that gives up early.
        if let (Some(after), false) = (call.cancel_after, call.stream) {
            let answer = async {
                let response = request.await?;
                let mode = response.headers().get("x-tandem-mode").cloned();
                response.bytes().await.map(|_| mode)
            };
            return match tokio::time::timeout(after, answer).await {
                Err(_) => Outcome::Cancelled,
                // It finished before the client gave up; its body is not judged.
                Ok(Ok(mode)) => Outcome::Ok {
                    disaggregated: mode.as_ref().is_some_and(|m| m == "disaggregated"),
                    mode_said: mode.is_some(),
                    text: String::new(),
                },
                Ok(Err(e)) => Outcome::Lost(format!("before the cancel: {e}")),
            };
        }
        let response = match tokio::time::timeout_at(deadline, request).await {
            Err(_) => return Outcome::Lost("no response head in time".into()),
            Ok(Err(e)) => return Outcome::Lost(format!("request failed: {e}")),
            Ok(Ok(r)) => r,
        };
        let status = response.status().as_u16();
        let header_mode = response
            .headers()
            .get("x-tandem-mode")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let disaggregated = header_mode.as_deref() == Some("disaggregated");
        if status != 200 {
            let body = tokio::time::timeout_at(deadline, response.text()).await;
            let error_body = match body {
                Ok(Ok(text)) => {
                    serde_json::from_str::<Value>(&text).is_ok_and(|v| v.get("error").is_some())
                }
                _ => false,
            };
            return match error_body {
                true => Outcome::Error {
                    status,
                    in_stream: false,
                },
                false => Outcome::Lost(format!("status {status} without an error body")),
            };
        }
        if !call.stream {
            return whole_body(response, deadline, call.route, disaggregated).await;
        }
        let mut first_event = first_event;
        let mut state = StreamState::default();
        let mut body = response.bytes_stream();
        loop {
            match tokio::time::timeout_at(deadline, body.next()).await {
                Err(_) => return Outcome::Lost("stream hung (no terminal event in time)".into()),
                Ok(None) => break,
                Ok(Some(Err(_))) if state.terminal() => break,
                Ok(Some(Err(e))) => return Outcome::Lost(format!("stream broke: {e}")),
                Ok(Some(Ok(bytes))) => {
                    state.feed(&bytes, call.route.is_tgi());
                    if state.events > 0 {
                        if let Some(tx) = first_event.take() {
                            let _ = tx.send(());
                        }
                        if call.cancel_after.is_some() && !state.terminal() {
                            return Outcome::Cancelled;
                        }
                    }
                }
            }
        }
        if state.error {
            Outcome::Error {
                status,
                in_stream: true,
            }
        } else if state.done {
            let mode = header_mode.or(state.mode);
            Outcome::Ok {
                disaggregated: mode.as_deref() == Some("disaggregated"),
                mode_said: mode.is_some(),
                text: state.text,
            }
        } else {
            Outcome::Lost("stream ended without [DONE], a final event or an error event".into())
        }
    }
}

/// A 200 that is not a stream: complete once its body holds the generated text.
async fn whole_body(
    response: reqwest::Response,
    deadline: tokio::time::Instant,
    route: Route,
    disaggregated: bool,
) -> Outcome {
    let body = match tokio::time::timeout_at(deadline, response.text()).await {
        Err(_) => return Outcome::Lost("body not complete in time".into()),
        Ok(Err(e)) => return Outcome::Lost(format!("body failed: {e}")),
        Ok(Ok(b)) => b,
    };
    let Ok(v) = serde_json::from_str::<Value>(&body) else {
        return Outcome::Lost("a 200 whose body is not JSON".into());
    };
    let text = if route.is_tgi() {
        v["generated_text"].as_str()
    } else {
        v["choices"][0]["text"]
            .as_str()
            .or_else(|| v["choices"][0]["message"]["content"].as_str())
    };
    match text {
        Some(t) => Outcome::Ok {
            disaggregated,
            mode_said: true,
            text: t.to_string(),
        },
        None => Outcome::Lost("a 200 without the generated text".into()),
    }
}

/// Outcome counts.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    pub ok: usize,
    pub disaggregated: usize,
    /// Complete, but nothing in the response said the mode (see [`Outcome::Ok`]).
    pub mode_unsaid: usize,
    pub errors: usize,
    /// Errors that arrived as an event of a stream already under way (after a 200).
    pub stream_errors: usize,
    pub lost: usize,
    pub cancelled: usize,
    statuses: HashMap<u16, usize>,
    /// Why the first few lost requests were lost.
    pub lost_why: Vec<String>,
}

impl Tally {
    pub fn of<'a>(outcomes: impl IntoIterator<Item = &'a Outcome>) -> Self {
        let mut tally = Self::default();
        for o in outcomes {
            tally.add(o);
        }
        tally
    }

    pub fn add(&mut self, o: &Outcome) {
        match o {
            Outcome::Ok {
                disaggregated,
                mode_said,
                ..
            } => {
                self.ok += 1;
                self.disaggregated += usize::from(*disaggregated);
                self.mode_unsaid += usize::from(!*mode_said);
            }
            Outcome::Error { status, in_stream } => {
                self.errors += 1;
                self.stream_errors += usize::from(*in_stream);
                *self.statuses.entry(*status).or_default() += 1;
            }
            Outcome::Lost(why) => {
                self.lost += 1;
                if self.lost_why.len() < 5 {
                    self.lost_why.push(why.clone());
                }
            }
            Outcome::Cancelled => self.cancelled += 1,
        }
    }

    pub fn total(&self) -> usize {
        self.ok + self.errors + self.lost + self.cancelled
    }

    /// Error statuses with their counts, `3×502, 1×503`; empty without errors.
    pub fn statuses(&self) -> String {
        let mut s: Vec<_> = self.statuses.iter().collect();
        s.sort();
        let s: Vec<_> = s.iter().map(|(k, v)| format!("{v}×{k}")).collect();
        s.join(", ")
    }
}

/// A deterministic generator (splitmix64), so a run's request mix can be repeated.
pub struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const WORDS: [&str; 16] = [
    "the", "river", "quietly", "carried", "seven", "paper", "boats", "past", "an", "old", "mill",
    "where", "nobody", "had", "worked", "since",
];

/// `words` words drawn from a small vocabulary.
pub fn prompt_text(rng: &mut Rng, words: usize) -> String {
    let words: Vec<_> = (0..words)
        .map(|_| WORDS[rng.below(WORDS.len() as u64) as usize])
        .collect();
    words.join(" ")
}

/// A prompt of `n` token ids, every one inside any vocabulary of 203 ids or more.
pub fn token_prompt(n: u32) -> Vec<u32> {
    (0..n).map(|i| 3 + i % 200).collect()
}

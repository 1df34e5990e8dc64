//! One streamed request per backend, as vLLM's request functions
//! (`vllm/benchmarks/lib/endpoint_request_func.py` 0.13.0 for `openai`/`openai-chat`, the
//! legacy `backend_request_func.py` for `tgi`): the request body, the parsing of the stream
//! (cut into messages by `sse`) into token events, and the TTFT/ITL/latency timestamps taken
//! as the events arrive.
//!
//! Nothing a server sends can panic this code: malformed JSON, a non-200 answer, a reset
//! connection or an error event all become a failed [`RequestOutput`] with vLLM's error text.

use std::time::Instant;

use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::accounting::{Accounting, UsageExtras};
use crate::metrics::RequestOutput;
pub use crate::sse::{LineSplitter, SseSplitter};

/// The error vLLM records when a 200 stream carried no token event.
pub const NO_VALID_CHUNK: &str =
    "Never received a valid chunk to calculate TTFT.This response will be marked as failed!";

/// Which API the server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// OpenAI completions (`/v1/completions`).
    Openai,
    /// vLLM's server; the completions client, as in vLLM.
    Vllm,
    /// OpenAI chat completions (`/v1/chat/completions`).
    #[value(name = "openai-chat")]
    OpenaiChat,
    /// TGI's `/generate_stream`.
    Tgi,
}

impl Backend {
    /// The name written to the result JSON and file names.
    pub fn name(self) -> &'static str {
        match self {
            Self::Openai => "openai",
            Self::Vllm => "vllm",
            Self::OpenaiChat => "openai-chat",
            Self::Tgi => "tgi",
        }
    }

    /// The suffix vLLM requires of the request URL for this backend.
    pub fn required_url_suffix(self) -> &'static str {
        match self {
            Self::Openai | Self::Vllm => "completions",
            Self::OpenaiChat => "chat/completions",
            Self::Tgi => "generate_stream",
        }
    }

    /// vLLM's `_validate_api_url`.
    pub fn validate_url(self, url: &str) -> Result<(), String> {
        let suffix = self.required_url_suffix();
        if url.ends_with(suffix) {
            Ok(())
        } else {
            let api = match self {
                Self::Openai | Self::Vllm => "OpenAI Completions API",
                Self::OpenaiChat => "OpenAI Chat Completions API",
                Self::Tgi => "TGI generate_stream API",
            };
            Err(format!("{api} URL must end with '{suffix}'. (got {url})"))
        }
    }

    /// Whether `--ignore-eos` is forced for the random dataset (vLLM 0.12+, openai backends).
    pub fn is_openai(self) -> bool {
        !matches!(self, Self::Tgi)
    }
}

/// Per-request inputs, as vLLM's `RequestFuncInput`.
#[derive(Debug, Clone)]
pub struct RequestInput {
    pub prompt: String,
    pub prompt_len: usize,
    pub output_len: usize,
    /// The `model` field (`--served-model-name`, else `--model`).
    pub model: String,
    pub ignore_eos: bool,
    pub logprobs: Option<u32>,
    /// `--temperature`; vLLM 0.10–0.14 send 0.0 when it is not given.
    pub temperature: Option<f64>,
    /// `--extra-body`, merged last into the body (into `parameters` for TGI).
    pub extra_body: Option<Map<String, Value>>,
    /// Sent as `x-request-id` when set.
    pub request_id: Option<String>,
    /// Multi-turn: the whole conversation, sent as `messages` by the chat backend (the other
    /// backends send `prompt`, which then holds the same conversation as plain text).
    pub messages: Option<Vec<ChatMessage>>,
}

/// Who said a message of a multi-turn conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatRole {
    System,
    User,
    Assistant,
    /// A tool's result (an agent's turn).
    Tool,
}

/// One message of a multi-turn conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: ChatRole,
    pub content: String,
}

/// The chat `messages` array: user turns as text parts (as vLLM sends its one prompt),
/// assistant turns as plain strings, which every OpenAI-compatible server accepts.
fn chat_messages(input: &RequestInput) -> Value {
    match &input.messages {
        None => json!([{"role": "user", "content": [{"type": "text", "text": input.prompt}]}]),
        Some(messages) => Value::Array(
            messages
                .iter()
                .map(|m| match m.role {
                    ChatRole::User => {
                        json!({"role": "user", "content": [{"type": "text", "text": m.content}]})
                    }
                    ChatRole::Assistant => json!({"role": "assistant", "content": m.content}),
                    ChatRole::System => json!({"role": "system", "content": m.content}),
                    // The calls are in the text (the model was told of the tools in its
                    // system prompt), so the result answers no structured call id.
                    ChatRole::Tool => {
                        json!({"role": "tool", "tool_call_id": "call_0", "content": m.content})
                    }
                })
                .collect(),
        ),
    }
}

/// The JSON body vLLM sends for `input`.
pub fn request_body(backend: Backend, input: &RequestInput) -> Value {
    let mut body = Map::new();
    match backend {
        Backend::Openai | Backend::Vllm => {
            body.insert("model".into(), json!(input.model));
            body.insert("prompt".into(), json!(input.prompt));
            body.insert(
                "temperature".into(),
                json!(input.temperature.unwrap_or(0.0)),
            );
            body.insert("repetition_penalty".into(), json!(1.0));
            body.insert("max_tokens".into(), json!(input.output_len));
            body.insert("logprobs".into(), json!(input.logprobs));
            body.insert("stream".into(), json!(true));
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
        Backend::OpenaiChat => {
            body.insert("model".into(), json!(input.model));
            body.insert("messages".into(), chat_messages(input));
            body.insert(
                "temperature".into(),
                json!(input.temperature.unwrap_or(0.0)),
            );
            body.insert("max_completion_tokens".into(), json!(input.output_len));
            body.insert("stream".into(), json!(true));
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
        Backend::Tgi => {
            // TGI refuses temperature 0 and top_p 1, hence vLLM's 0.01 / 0.99.
            let mut parameters = Map::new();
            parameters.insert("max_new_tokens".into(), json!(input.output_len));
            parameters.insert("do_sample".into(), json!(true));
            parameters.insert(
                "temperature".into(),
                json!(input.temperature.unwrap_or(0.01)),
            );
            parameters.insert("top_p".into(), json!(0.99));
            parameters.insert("truncate".into(), json!(input.prompt_len));
            parameters.insert("ignore_eos_token".into(), json!(input.ignore_eos));
            if let Some(extra) = &input.extra_body {
                parameters.extend(extra.clone());
            }
            body.insert("inputs".into(), json!(input.prompt));
            body.insert("parameters".into(), Value::Object(parameters));
            return Value::Object(body);
        }
    }
    if input.ignore_eos {
        body.insert("ignore_eos".into(), json!(true));
    }
    if let Some(extra) = &input.extra_body {
        body.extend(extra.clone());
    }
    Value::Object(body)
}

#[derive(Deserialize)]
struct OpenAiChunk {
    #[serde(default)]
    choices: Option<Vec<OpenAiChoice>>,
    #[serde(default)]
    usage: Option<OpenAiUsage>,
    /// tandem's router puts its object here on a finish chunk when usage is not streamed.
    #[serde(default)]
    tandem: Option<Value>,
}

#[derive(Deserialize)]
struct OpenAiChoice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    delta: Option<OpenAiDelta>,
}

#[derive(Deserialize)]
struct OpenAiDelta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct OpenAiUsage {
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(flatten)]
    extras: UsageExtras,
}

/// What a message did to the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Done,
}

/// Accumulates token events of one request; fed message by message with arrival times.
#[derive(Debug)]
pub struct StreamState {
    backend: Backend,
    start: Instant,
    last: Instant,
    ttft: Option<f64>,
    itl: Vec<f64>,
    text: String,
    output_tokens: Option<usize>,
    accounting: Accounting,
    /// TGI: the `generated_text` of the latest event (`None` inside: JSON null).
    tgi_final_text: Option<Option<String>>,
    tgi_events: usize,
}

impl StreamState {
    pub fn new(backend: Backend, start: Instant) -> Self {
        Self {
            backend,
            start,
            last: start,
            ttft: None,
            itl: Vec::new(),
            text: String::new(),
            output_tokens: None,
            accounting: Accounting::default(),
            tgi_final_text: None,
            tgi_events: 0,
        }
    }

    fn token_event(&mut self, now: Instant) {
        if self.ttft.is_none() {
            self.ttft = Some(now.duration_since(self.start).as_secs_f64());
        } else {
            self.itl.push(now.duration_since(self.last).as_secs_f64());
        }
        self.last = now;
    }

    /// Handles one SSE message (OpenAI) or line (TGI) that arrived at `now`.
    /// An `Err` is the failure text: the request fails, as an exception does in vLLM.
    pub fn on_message(&mut self, message: &str, now: Instant) -> Result<Flow, String> {
        let message = message.trim();
        // SSE comments (`: ping`) keep connections alive; they are not events.
        if message.is_empty() || message.starts_with(':') {
            return Ok(Flow::Continue);
        }
        if self.backend == Backend::Tgi {
            return self.on_tgi_line(message, now);
        }
        // vLLM strips `data: `; a server writing `data:` without the space is accepted too.
        let data = message.strip_prefix("data:").unwrap_or(message);
        let data = data.strip_prefix(' ').unwrap_or(data);
        if data == "[DONE]" {
            return Ok(Flow::Done);
        }
        let chunk: OpenAiChunk = serde_json::from_str(data)
            .map_err(|e| format!("JSONDecodeError: {e}: {}", truncate(data)))?;
        if let Some(usage) = &chunk.usage {
            self.accounting.read_usage(&usage.extras);
        }
        if let Some(tandem) = &chunk.tandem {
            self.accounting.read_tandem(tandem);
        }
        let choices = chunk.choices.unwrap_or_default();
        if let Some(choice) = choices.first() {
            // Any non-empty `choices` is a token event, even with empty text.
            let piece = if self.backend == Backend::OpenaiChat {
                let delta = choice.delta.as_ref().ok_or("KeyError: 'delta'")?;
                delta.content.as_deref()
            } else {
                choice.text.as_deref()
            };
            self.token_event(now);
            self.text.push_str(piece.unwrap_or(""));
        } else if let Some(usage) = chunk.usage {
            self.output_tokens = usage.completion_tokens.map(|n| n as usize);
            // vLLM's chat client (≤ 0.14) also moves the last timestamp on the usage chunk.
            if self.backend == Backend::OpenaiChat {
                self.last = now;
            }
        } else if self.backend == Backend::OpenaiChat {
            self.last = now;
        }
        Ok(Flow::Continue)
    }

    fn on_tgi_line(&mut self, line: &str, now: Instant) -> Result<Flow, String> {
        let data = line.strip_prefix("data:").unwrap_or(line);
        let event: Value = serde_json::from_str(data)
            .map_err(|e| format!("JSONDecodeError: {e}: {}", truncate(data)))?;
        // Every data line is a token event, the final EOS event included.
        self.token_event(now);
        self.tgi_events += 1;
        self.tgi_final_text = event
            .get("generated_text")
            .map(|text| text.as_str().map(str::to_string));
        if self.tgi_final_text.is_none() {
            // vLLM fails with KeyError only if this turns out to be the last event.
            self.text = truncate(data).to_string();
        }
        Ok(Flow::Continue)
    }

    /// The request's output once the stream ended normally (HTTP 200).
    pub fn finish(self, output: &mut RequestOutput) {
        let latency = self.last.duration_since(self.start).as_secs_f64();
        match self.backend {
            Backend::Tgi => {
                if self.tgi_events == 0 {
                    output.error = "NameError: name 'data' is not defined (empty stream)".into();
                    return;
                }
                match self.tgi_final_text {
                    Some(text) => {
                        output.generated_text = text.unwrap_or_default();
                        output.success = true;
                    }
                    None => {
                        output.error =
                            format!("KeyError: 'generated_text' (last event: {})", self.text);
                        return;
                    }
                }
            }
            Backend::OpenaiChat => {
                // vLLM's chat client (≤ 0.14) counts any 200 as a success.
                output.generated_text = self.text;
                output.success = true;
                output.output_tokens = self.output_tokens;
            }
            Backend::Openai | Backend::Vllm => {
                output.generated_text = self.text;
                output.output_tokens = self.output_tokens;
                if self.ttft.is_some() {
                    output.success = true;
                } else {
                    output.error = NO_VALID_CHUNK.into();
                }
            }
        }
        self.accounting.write_to(output);
        output.ttft = self.ttft.unwrap_or(0.0);
        output.itl = self.itl;
        output.latency = latency;
    }
}

fn truncate(text: &str) -> &str {
    match text.char_indices().nth(200) {
        Some((index, _)) => &text[..index],
        None => text,
    }
}

/// Where and how to send requests.
#[derive(Debug, Clone)]
pub struct Target {
    pub backend: Backend,
    pub url: String,
    /// Extra headers (`--header`, `Authorization`), sent on every request.
    pub headers: reqwest::header::HeaderMap,
}

/// Sends one request and times its stream. `epoch` is the benchmark's clock origin for
/// `start_time`. Never fails: every problem becomes a failed output.
pub async fn send_request(
    client: &reqwest::Client,
    target: &Target,
    input: &RequestInput,
    epoch: Instant,
) -> RequestOutput {
    let body = match serde_json::to_vec(&request_body(target.backend, input)) {
        Ok(body) => body,
        Err(e) => {
            return RequestOutput {
                prompt_len: input.prompt_len,
                error: format!("cannot serialize request: {e}"),
                ..Default::default()
            };
        }
    };
    let mut request = client
        .post(&target.url)
        .headers(target.headers.clone())
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body);
    if let Some(id) = &input.request_id {
        request = request.header("x-request-id", id);
    }
    let start = Instant::now();
    let mut output = RequestOutput {
        prompt_len: input.prompt_len,
        start_time: start.duration_since(epoch).as_secs_f64(),
        ..Default::default()
    };
    if let Err(error) = stream_response(request, target.backend, start, &mut output).await {
        output.success = false;
        output.error = error;
    }
    if target.backend == Backend::Tgi && input.ignore_eos && output.success {
        // The legacy TGI client trusts the requested length when EOS is ignored.
        output.output_tokens = Some(input.output_len);
    }
    output
}

async fn stream_response(
    request: reqwest::RequestBuilder,
    backend: Backend,
    start: Instant,
    output: &mut RequestOutput,
) -> Result<(), String> {
    let response = request
        .send()
        .await
        .map_err(|e| format!("ClientConnectorError: {}", error_chain(&e)))?;
    let status = response.status();
    if status != reqwest::StatusCode::OK {
        // vLLM records aiohttp's `response.reason`, the HTTP reason phrase.
        output.error = status.canonical_reason().unwrap_or("").to_string();
        return Ok(());
    }
    let mut state = StreamState::new(backend, start);
    let mut sse = SseSplitter::default();
    let mut lines = LineSplitter::default();
    let mut messages = Vec::new();
    let mut stream = response.bytes_stream();
    let mut done = false;
    while !done {
        let Some(chunk) = stream.next().await else {
            break;
        };
        let chunk = chunk.map_err(|e| format!("ClientPayloadError: {}", error_chain(&e)))?;
        match backend {
            Backend::Tgi => lines.push(&chunk, &mut messages),
            _ => sse.push(&chunk, &mut messages),
        }
        done = handle_messages(&mut state, &mut messages)?;
    }
    if !done {
        match backend {
            Backend::Tgi => lines.finish(&mut messages),
            _ => sse.finish(&mut messages),
        }
        handle_messages(&mut state, &mut messages)?;
    }
    state.finish(output);
    Ok(())
}

/// Processes queued messages with one timestamp taken per message; `Ok(true)` on `[DONE]`.
fn handle_messages(state: &mut StreamState, messages: &mut Vec<String>) -> Result<bool, String> {
    for message in messages.drain(..) {
        if state.on_message(&message, Instant::now())? == Flow::Done {
            return Ok(true);
        }
    }
    Ok(false)
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn input() -> RequestInput {
        RequestInput {
            prompt: "hi".into(),
            prompt_len: 3,
            output_len: 5,
            model: "m".into(),
            ignore_eos: true,
            logprobs: None,
            temperature: None,
            extra_body: serde_json::from_str("{\"top_k\": 1}").ok(),
            request_id: None,
            messages: None,
        }
    }

    #[test]
    fn bodies_match_vllm() {
        let body = request_body(Backend::Openai, &input());
        let keys: Vec<&str> = body
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(
            keys,
            [
                "model",
                "prompt",
                "temperature",
                "repetition_penalty",
                "max_tokens",
                "logprobs",
                "stream",
                "stream_options",
                "ignore_eos",
                "top_k"
            ]
        );
        assert_eq!(body["max_tokens"], 5);
        assert_eq!(body["stream_options"]["include_usage"], true);
        let chat = request_body(Backend::OpenaiChat, &input());
        assert_eq!(chat["messages"][0]["content"][0]["text"], "hi");
        assert_eq!(chat["max_completion_tokens"], 5);
        let tgi = request_body(Backend::Tgi, &input());
        assert_eq!(tgi["inputs"], "hi");
        assert_eq!(tgi["parameters"]["max_new_tokens"], 5);
        assert_eq!(tgi["parameters"]["truncate"], 3);
        assert_eq!(tgi["parameters"]["ignore_eos_token"], true);
        assert_eq!(tgi["parameters"]["temperature"], 0.01);
    }

    #[test]
    fn url_suffixes_are_checked() {
        assert!(
            Backend::Openai
                .validate_url("http://h/v1/completions")
                .is_ok()
        );
        assert!(
            Backend::Openai
                .validate_url("http://h/generate_stream")
                .is_err()
        );
        assert!(
            Backend::OpenaiChat
                .validate_url("http://h/v1/chat/completions")
                .is_ok()
        );
        assert!(
            Backend::OpenaiChat
                .validate_url("http://h/v1/completions")
                .is_err()
        );
        assert!(
            Backend::Tgi
                .validate_url("http://h/generate_stream")
                .is_ok()
        );
    }

    #[test]
    fn completions_events_usage_and_done() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut state = StreamState::new(Backend::Openai, t0);
        let msgs = [
            (100, r#"data: {"choices":[{"text":"a"}]}"#),
            (110, ": ping"),
            (130, r#"data: {"choices":[{"text":""}]}"#),
            (160, r#"data: {"choices":[{"text":"b"}]}"#),
            (
                170,
                r#"data: {"choices":[],"usage":{"completion_tokens":3}}"#,
            ),
        ];
        for (ms, m) in msgs {
            assert_eq!(state.on_message(m, at(ms)).unwrap(), Flow::Continue);
        }
        assert_eq!(
            state.on_message("data: [DONE]", at(180)).unwrap(),
            Flow::Done
        );
        let mut out = RequestOutput::default();
        state.finish(&mut out);
        assert!(out.success);
        assert_eq!(out.generated_text, "ab");
        assert_eq!(out.output_tokens, Some(3));
        assert!((out.ttft - 0.1).abs() < 1e-9);
        assert_eq!(out.itl.len(), 2);
        assert!((out.itl[0] - 0.03).abs() < 1e-9 && (out.itl[1] - 0.03).abs() < 1e-9);
        // Latency ends at the last token event, not at the usage chunk.
        assert!((out.latency - 0.16).abs() < 1e-9);
    }

    #[test]
    fn chat_role_chunk_sets_ttft_and_usage_moves_latency() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut state = StreamState::new(Backend::OpenaiChat, t0);
        state
            .on_message(
                r#"data: {"choices":[{"delta":{"role":"assistant"}}]}"#,
                at(50),
            )
            .unwrap();
        state
            .on_message(r#"data: {"choices":[{"delta":{"content":"x"}}]}"#, at(70))
            .unwrap();
        state
            .on_message(
                r#"data: {"choices":[],"usage":{"completion_tokens":1}}"#,
                at(90),
            )
            .unwrap();
        let mut out = RequestOutput::default();
        state.finish(&mut out);
        assert!(out.success);
        assert_eq!(out.generated_text, "x");
        assert!((out.ttft - 0.05).abs() < 1e-9);
        assert!((out.latency - 0.09).abs() < 1e-9);
        // A chunk without `delta` is an exception in vLLM.
        let mut state = StreamState::new(Backend::OpenaiChat, t0);
        assert!(
            state
                .on_message(r#"data: {"choices":[{"text":"x"}]}"#, at(1))
                .is_err()
        );
    }

    #[test]
    fn no_token_event_fails_and_malformed_json_errors() {
        let t0 = Instant::now();
        let mut state = StreamState::new(Backend::Openai, t0);
        state
            .on_message(r#"data: {"error":{"message":"boom"}}"#, t0)
            .unwrap();
        let mut out = RequestOutput::default();
        state.finish(&mut out);
        assert!(!out.success);
        assert_eq!(out.error, NO_VALID_CHUNK);
        let mut state = StreamState::new(Backend::Openai, t0);
        let err = state.on_message("data: {not json", t0).unwrap_err();
        assert!(err.starts_with("JSONDecodeError"), "{err}");
    }

    #[test]
    fn tgi_counts_every_data_line_and_takes_final_text() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut state = StreamState::new(Backend::Tgi, t0);
        let token = |i: u32, text: &str, generated: &str| {
            format!(
                "data:{{\"index\":{i},\"token\":{{\"id\":{i},\"text\":\"{text}\",\"logprob\":0.0,\"special\":false}},\"generated_text\":{generated},\"details\":null}}"
            )
        };
        state.on_message(&token(1, "a", "null"), at(40)).unwrap();
        state.on_message(":", at(45)).unwrap();
        state.on_message(&token(2, "b", "null"), at(60)).unwrap();
        state
            .on_message(&token(3, "</s>", "\"ab\""), at(90))
            .unwrap();
        let mut out = RequestOutput::default();
        state.finish(&mut out);
        assert!(out.success);
        assert_eq!(out.generated_text, "ab");
        assert_eq!(out.output_tokens, None);
        assert_eq!(out.itl.len(), 2);
        assert!((out.latency - 0.09).abs() < 1e-9);
        // An error event last (no generated_text) fails the request.
        let mut state = StreamState::new(Backend::Tgi, t0);
        state.on_message(&token(1, "a", "null"), at(10)).unwrap();
        state
            .on_message(
                r#"data:{"error":"overloaded","error_type":"overloaded"}"#,
                at(20),
            )
            .unwrap();
        let mut out = RequestOutput::default();
        state.finish(&mut out);
        assert!(!out.success);
        assert!(out.error.contains("generated_text") && out.error.contains("overloaded"));
    }

    /// The stream hands every accounting field to `accounting`, from a usage chunk or from a
    /// `tandem` object on any chunk.
    #[test]
    fn usage_accounting_of_tandem_and_openai_servers() {
        let t0 = Instant::now();
        let run = |messages: &[&str]| {
            let mut state = StreamState::new(Backend::Openai, t0);
            for m in messages {
                state.on_message(m, t0).unwrap();
            }
            let mut out = RequestOutput::default();
            state.finish(&mut out);
            out
        };
        let token = r#"data: {"choices":[{"text":"a"}]}"#;
        let out = run(&[
            token,
            r#"data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":3},"tandem":{"mode":"disaggregated","kv_bytes":4096,"transport":"shm","fallback_reason":null,"cached_tokens":3,"kv_blocks":2,"prefill_pulled_tokens":1}}}"#,
        ]);
        assert!(out.success);
        assert_eq!(out.output_tokens, Some(2));
        assert_eq!(out.server_prompt_tokens, Some(5));
        assert_eq!(out.cached_tokens, Some(3));
        assert_eq!(out.kv_bytes, Some(4096));
        assert_eq!(out.kv_blocks, Some(2));
        assert_eq!(out.pulled_tokens, Some(1));
        let tandem = out.tandem.unwrap();
        assert_eq!(tandem.mode.as_deref(), Some("disaggregated"));
        assert_eq!(tandem.transport.as_deref(), Some("shm"));
        assert_eq!(tandem.fallback_reason, None);
        // Another server: usage without any extras.
        let out = run(&[
            token,
            r#"data: {"choices":[],"usage":{"completion_tokens":1}}"#,
        ]);
        assert!(out.success);
        assert_eq!(
            (out.server_prompt_tokens, out.cached_tokens, out.kv_bytes),
            (None, None, None)
        );
        assert!(out.tandem.is_none() && out.kv_blocks.is_none());
        // Only tandem's count, on a finish chunk, and odd shapes that are ignored, not fatal.
        let out = run(&[
            r#"data: {"choices":[{"text":""}],"tandem":{"mode":"aggregated","kv_bytes":0,"transport":null,"fallback_reason":"no_prefill_worker","cached_tokens":7}}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":"x","prompt_tokens_details":null,"tandem":[1]}}"#,
        ]);
        assert!(out.success);
        assert_eq!(out.cached_tokens, Some(7));
        assert_eq!(out.kv_bytes, Some(0));
        assert_eq!(out.server_prompt_tokens, None);
        assert_eq!(
            out.tandem.unwrap().fallback_reason.as_deref(),
            Some("no_prefill_worker")
        );
    }
}

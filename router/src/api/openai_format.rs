//! The OpenAI response objects: whole responses, stream chunks (with the first chunk's
//! role, per-token logprobs, the finish chunk and the usage chunk), and the `tandem` usage
//! extension, built by one formatter per request. With `n > 1` every chunk carries its
//! choice's `index`; the usage (and the `tandem` object) comes once, after the last choice
//! ends, counting every choice's tokens.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;
use tandem_proto::v1::FinishReason;
use tandem_text::{ParsedReply, ReplyOptions};

use super::Kind;
use super::reply::{self, ChoiceReply, Delta};
use crate::api::launch::CollectedAll;
use crate::api::logprobs::{Logprobs, LogprobsBuilder, LogprobsShape, vllm_prompt_logprobs};
use crate::api::sse::{StreamFormatter, data_event};
use crate::error::ApiError;
use crate::flow::{FinishOut, FlowEvent, Head, TokenOut, transport_name};
use crate::model::ServedModel;

/// `system_fingerprint` of chat responses.
const SYSTEM_FINGERPRINT: &str = concat!("tandem-", env!("CARGO_PKG_VERSION"));

/// The `tandem` extension object.
#[derive(Debug, Serialize, PartialEq)]
pub struct TandemUsage {
    pub mode: &'static str,
    pub kv_bytes: u64,
    pub transport: Option<&'static str>,
    pub fallback_reason: Option<&'static str>,
    /// Prompt tokens whose KV came from a worker's prefix cache.
    pub cached_tokens: u32,
    /// KV blocks moved from the prefill worker to the decode worker.
    pub kv_blocks: u32,
    /// Prompt tokens whose KV the decode worker's cache already held (not moved, or not
    /// computed when it ran the prompt itself).
    pub decode_cached_tokens: u32,
    /// Prompt tokens of the decode worker's cached prefix that the prefill worker read back
    /// from it instead of computing them (part of `cached_tokens`).
    pub prefill_pulled_tokens: u32,
}

#[derive(Debug, Serialize)]
struct PromptTokensDetails {
    cached_tokens: u32,
}

#[derive(Debug, Serialize)]
struct CompletionTokensDetails {
    reasoning_tokens: u32,
}

#[derive(Debug, Serialize)]
struct Usage {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
    prompt_tokens_details: PromptTokensDetails,
    /// With a reasoning model: the completion's tokens spent thinking.
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_tokens_details: Option<CompletionTokensDetails>,
    tandem: TandemUsage,
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<Value>,
    finish_reason: Option<&'static str>,
}

/// A chunk's delta: OpenAI's, or reshaped for TGI's client.
#[derive(Serialize)]
#[serde(untagged)]
enum DeltaOut {
    OpenAi(Delta),
    Tgi(Value),
}

#[derive(Serialize)]
struct ChatChunkChoice {
    index: u32,
    delta: DeltaOut,
    logprobs: Option<Value>,
    finish_reason: Option<&'static str>,
}

#[derive(Serialize)]
struct ChatMessageOut<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessageOut<'a>,
    logprobs: Option<Value>,
    finish_reason: &'static str,
}

/// One streamed chunk; `usage` is absent, null, or set.
#[derive(Serialize)]
struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_fingerprint: Option<&'static str>,
    choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tandem: Option<TandemUsage>,
}

fn finish_reason(f: &FinishOut) -> &'static str {
    match f.reason {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// A parsed chat reply's finish reason: `length`, or `stop` / `tool_calls`.
fn choice_reason(options: &ReplyOptions, f: &FinishOut, made_calls: bool) -> &'static str {
    match f.reason {
        FinishReason::Length => "length",
        _ => reply::stop_reason(options, made_calls),
    }
}

/// Builds the OpenAI objects of one request.
pub(super) struct OpenAiFormatter {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) include_usage: bool,
    /// Known once the first token is in (a stream may start before).
    pub(super) head: Option<Head>,
    pub(super) prompt_tokens: u32,
    /// Choices whose first chunk (with the assistant role, or the echo) went out.
    pub(super) started: HashSet<u32>,
    /// Completions with `echo`: the prompt's text, sent before each choice's first token's.
    pub(super) echo: Option<String>,
    /// The prompt's tokens, when its logprobs are reported (else empty).
    pub(super) prompt: Vec<u32>,
    /// Whether they open each choice's legacy logprobs (`echo` with `logprobs`).
    pub(super) echo_logprobs: bool,
    /// Whether the response carries vLLM's `prompt_logprobs`.
    pub(super) vllm_prompt_logprobs: bool,
    /// The model whose tokenizer names prompt tokens.
    pub(super) served: Arc<ServedModel>,
    /// When the request asked for logprobs: their shape, a builder per choice, and the model
    /// whose tokenizer writes the tokens' text.
    pub(super) logprobs: Option<(
        LogprobsShape,
        HashMap<u32, LogprobsBuilder>,
        Arc<ServedModel>,
    )>,
    /// A chat reply taken apart (reasoning, content, tool calls); `None` passes text as is.
    pub(super) reply: Option<ReplyOptions>,
    /// Each streamed choice's reply.
    pub(super) replies: HashMap<u32, ChoiceReply>,
    /// Reasoning tokens of the choices that ended (streamed, or in the whole response).
    pub(super) reasoning_tokens: u32,
    /// The request came from TGI's own client (`model: "tgi"`): chat chunks in its shape.
    pub(super) tgi_client: bool,
}

impl OpenAiFormatter {
    /// The `logprobs` object for `tokens` of one choice (none unless asked for).
    fn logprobs_of<'t>(
        &mut self,
        choice: u32,
        tokens: impl IntoIterator<Item = &'t TokenOut>,
    ) -> Option<Value> {
        let (shape, builders, model) = self.logprobs.as_mut()?;
        let mut out = Logprobs::default();
        let builder = match builders.entry(choice) {
            std::collections::hash_map::Entry::Occupied(b) => b.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let builder = v.insert(LogprobsBuilder::new(*shape));
                if self.echo_logprobs {
                    let entries = self.head.as_ref().map_or(&[][..], |h| &h.prompt_logprobs);
                    builder.push_prompt(model, &self.prompt, entries, &mut out);
                }
                builder
            }
        };
        for token in tokens {
            builder.push(model, token, &mut out);
        }
        Some(out.to_json(*shape))
    }

    fn tandem(&self, f: &FinishOut) -> TandemUsage {
        TandemUsage {
            mode: self.head.as_ref().map_or("none", |h| h.mode.as_str()),
            kv_bytes: f.kv_bytes,
            transport: f.transport.map(|t| transport_name(Some(t))),
            fallback_reason: self
                .head
                .as_ref()
                .and_then(|h| h.fallback)
                .map(|r| r.as_str()),
            cached_tokens: f.cached_tokens,
            kv_blocks: f.kv_blocks,
            decode_cached_tokens: f.decode_cached_tokens,
            prefill_pulled_tokens: f.prefill_pulled_tokens,
        }
    }

    fn usage(&self, f: &FinishOut) -> Usage {
        let prompt = if f.prompt_tokens > 0 {
            f.prompt_tokens
        } else {
            self.prompt_tokens
        };
        Usage {
            prompt_tokens: prompt,
            completion_tokens: f.total_completion_tokens,
            total_tokens: prompt.saturating_add(f.total_completion_tokens),
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: f.cached_tokens,
            },
            completion_tokens_details: self
                .reply
                .as_ref()
                .filter(|r| r.reasoning || r.starts_thinking)
                .map(|_| CompletionTokensDetails {
                    reasoning_tokens: self.reasoning_tokens,
                }),
            tandem: self.tandem(f),
        }
    }

    fn envelope<C: Serialize>(
        &self,
        choices: Vec<C>,
        usage: Option<Option<Usage>>,
        tandem: Option<TandemUsage>,
    ) -> String {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        let envelope = Envelope {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            system_fingerprint: (self.kind == Kind::Chat).then_some(SYSTEM_FINGERPRINT),
            choices,
            usage,
            tandem,
        };
        serde_json::to_string(&envelope).unwrap_or_default()
    }

    /// One chunk of one choice: a token's text (if any) and, on its last, the finish reason.
    fn chunk(&mut self, token: Option<&TokenOut>, finish: Option<&FinishOut>) -> String {
        let index = token.map_or_else(|| finish.map_or(0, |f| f.choice), |t| t.choice);
        let first = self.started.insert(index);
        let text = token.filter(|t| !t.special).map_or("", |t| t.text.as_str());
        let echoed;
        let text = match self.echo.as_deref().filter(|_| first) {
            Some(prompt) => {
                echoed = format!("{prompt}{text}");
                echoed.as_str()
            }
            None => text,
        };
        let logprobs = token.and_then(|t| self.logprobs_of(index, [t]));
        let reason = finish.map(finish_reason);
        let usage = self.include_usage.then_some(None);
        let tandem = finish
            .filter(|f| f.last && !self.include_usage)
            .map(|f| self.tandem(f));
        let json = match self.kind {
            Kind::Completion => self.envelope(
                vec![CompletionChoice {
                    index,
                    text,
                    logprobs,
                    finish_reason: reason,
                }],
                usage,
                tandem,
            ),
            Kind::Chat => {
                // A choice's first chunk also opens its assistant message.
                let role = first.then_some("assistant");
                let mut delta = Delta {
                    role,
                    ..Delta::default()
                };
                let mut reason = reason;
                match self.reply.as_ref() {
                    None => {
                        delta.content = (token.is_some() || role.is_some()).then(|| text.into())
                    }
                    Some(options) => {
                        let reply = self
                            .replies
                            .entry(index)
                            .or_insert_with(|| ChoiceReply::new(options));
                        // Special tokens (EOS) are no text, as in the whole response.
                        let text = token.filter(|t| !t.special).map(|_| text);
                        reply.delta(text, finish.is_some(), &mut delta);
                        if let Some(f) = finish {
                            reason = Some(choice_reason(options, f, reply.made_calls()));
                            self.reasoning_tokens = self
                                .reasoning_tokens
                                .saturating_add(reply.reasoning_tokens());
                        }
                        if role.is_some() && delta.is_empty() {
                            delta.content = Some(String::new());
                        }
                        // A token that settled nothing yet (text held at a possible marker)
                        // sends nothing, unless it carries logprobs.
                        if delta.is_empty()
                            && role.is_none()
                            && logprobs.is_none()
                            && finish.is_none()
                        {
                            return String::new();
                        }
                    }
                }
                if self.tgi_client {
                    return self.tgi_chunks(index, delta, logprobs, reason, usage, tandem);
                }
                self.envelope(
                    vec![ChatChunkChoice {
                        index,
                        delta: DeltaOut::OpenAi(delta),
                        logprobs,
                        finish_reason: reason,
                    }],
                    usage,
                    tandem,
                )
            }
        };
        data_event(&json, true)
    }

    /// A chat chunk for TGI's client: one event per call in the delta, the logprobs, finish
    /// reason and extension on the last.
    fn tgi_chunks(
        &self,
        index: u32,
        delta: Delta,
        logprobs: Option<Value>,
        reason: Option<&'static str>,
        usage: Option<Option<Usage>>,
        tandem: Option<TandemUsage>,
    ) -> String {
        let deltas = reply::tgi_deltas(delta);
        let last = deltas.len().saturating_sub(1);
        let (mut logprobs, mut usage, mut tandem) = (logprobs, usage, tandem);
        let mut out = String::new();
        for (i, delta) in deltas.into_iter().enumerate() {
            let end = i == last;
            let usage = if end {
                usage.take()
            } else {
                self.include_usage.then_some(None)
            };
            let json = self.envelope(
                vec![ChatChunkChoice {
                    index,
                    delta: DeltaOut::Tgi(delta),
                    logprobs: if end { logprobs.take() } else { None },
                    finish_reason: if end { reason } else { None },
                }],
                usage,
                if end { tandem.take() } else { None },
            );
            out.push_str(&data_event(&json, true));
        }
        out
    }

    /// After the last chunk: the usage chunk when asked for, then `[DONE]` (not for TGI's
    /// client, which parses every `data:` line as JSON: its stream ends with the chunk that
    /// has the finish reason, as TGI's did).
    fn tail(&mut self, f: &FinishOut) -> String {
        let mut out = String::new();
        if self.include_usage {
            let json = match self.kind {
                Kind::Completion => self.envelope(
                    Vec::<CompletionChoice>::new(),
                    Some(Some(self.usage(f))),
                    None,
                ),
                Kind::Chat => self.envelope(
                    Vec::<ChatChunkChoice>::new(),
                    Some(Some(self.usage(f))),
                    None,
                ),
            };
            out.push_str(&data_event(&json, true));
        }
        if !self.tgi_client {
            out.push_str(&data_event("[DONE]", true));
        }
        out
    }

    /// The non-streaming response object: every choice in `done`, in order.
    pub(super) fn full_response(&mut self, done: &CollectedAll) -> Value {
        let mut choices = Vec::with_capacity(done.choices.len());
        let mut reasoning_tokens = 0u32;
        for c in &done.choices {
            let index = c.finish.choice;
            let logprobs = self.logprobs_of(index, &c.tokens);
            let text = match &self.echo {
                Some(prompt) => format!("{prompt}{}", c.text),
                None => c.text.clone(),
            };
            let reason = finish_reason(&c.finish);
            choices.push(match self.kind {
                Kind::Completion => serde_json::json!(CompletionChoice {
                    index,
                    text: &text,
                    logprobs,
                    finish_reason: Some(reason),
                }),
                Kind::Chat => match self.reply.as_ref() {
                    None => serde_json::json!(ChatChoice {
                        index,
                        message: ChatMessageOut {
                            role: "assistant",
                            content: &text,
                        },
                        logprobs,
                        finish_reason: reason,
                    }),
                    Some(options) => {
                        let texts = c.tokens.iter().filter(|t| !t.special);
                        let parsed =
                            ParsedReply::parse(options, texts.map(|t| t.text.as_str()));
                        reasoning_tokens = reasoning_tokens.saturating_add(parsed.reasoning_tokens);
                        serde_json::json!({
                            "index": index,
                            "message": reply::message(options, &parsed),
                            "logprobs": logprobs,
                            "finish_reason": choice_reason(options, &c.finish, !parsed.calls.is_empty()),
                        })
                    }
                },
            });
        }
        self.reasoning_tokens = reasoning_tokens;
        let usage = serde_json::to_value(self.usage(&done.finish)).unwrap_or(Value::Null);
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        };
        let mut body = serde_json::json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        });
        if self.kind == Kind::Chat {
            // OpenAI's field (TGI's client requires it): what served the answer.
            body["system_fingerprint"] = Value::from(SYSTEM_FINGERPRINT);
        }
        if self.vllm_prompt_logprobs {
            // vLLM puts them in each completion choice, and at the top of a chat response.
            let entries = self.head.as_ref().map_or(&[][..], |h| &h.prompt_logprobs);
            let list = vllm_prompt_logprobs(&self.served, &self.prompt, entries);
            match self.kind {
                Kind::Completion => {
                    if let Some(choices) = body["choices"].as_array_mut() {
                        for c in choices {
                            c["prompt_logprobs"] = list.clone();
                        }
                    }
                }
                Kind::Chat => body["prompt_logprobs"] = list,
            }
        }
        body
    }
}

/// The error event that ends a broken OpenAI stream, then `[DONE]`.
pub fn stream_error(e: &ApiError) -> String {
    let mut out = data_event(&e.openai_body().to_string(), true);
    out.push_str(&data_event("[DONE]", true));
    out
}

impl StreamFormatter for OpenAiFormatter {
    fn on_head(&mut self, head: &Head) {
        self.head = Some(head.clone());
    }

    fn format(&mut self, event: FlowEvent) -> (String, bool) {
        match event {
            FlowEvent::Token(t, None) => (self.chunk(Some(&t), None), false),
            FlowEvent::Token(t, Some(f)) => {
                let mut out = self.chunk(Some(&t), Some(&f));
                if f.last {
                    out.push_str(&self.tail(&f));
                }
                (out, f.last)
            }
            FlowEvent::Finished(f) => {
                let mut out = self.chunk(None, Some(&f));
                if f.last {
                    out.push_str(&self.tail(&f));
                }
                (out, f.last)
            }
            FlowEvent::Failed(e) => (stream_error(&e), true),
        }
    }

    fn broken(&mut self) -> String {
        tracing::error!("event stream ended without a finish; sending an error event");
        stream_error(&ApiError::WorkerFailed)
    }
}

//! The OpenAI routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming and
//! not) and `GET /v1/models`.
//!
//! OpenAI's sampling fields: `temperature`, `top_p`, `seed`, `stop`, `presence_penalty` and
//! `frequency_penalty` ([-2, 2], over generated tokens), `logit_bias` (token id → [-100,
//! 100]), and logprobs (`logprobs: true` + `top_logprobs` ≤ 20 on chat, `logprobs: N` ≤ 20 on
//! completions; shapes in `logprobs`). Accepted beyond OpenAI's fields, as vLLM does:
//! `ignore_eos`, `top_k` (-1/0 = off), `repetition_penalty`, `stop_token_ids`, `min_tokens`
//! (≤ the completion budget), `echo` (the prompt's text before the completion's), and
//! structured output (`response_format`, vLLM's `guided_*` and `structured_outputs`: see
//! `structured`), `n` ≤ 16 choices and `best_of` (≥ `n`, not streamed: that many are
//! generated and the `n` with the highest mean token logprob returned), the prompt prefilled
//! once for all of them, and prompt logprobs: `echo` with `logprobs` on completions (the
//! prompt's tokens open the legacy object), vLLM's `prompt_logprobs: N` (≤ 20, not streamed).
//! Chat takes tools (`tools`, `tool_choice`, `parallel_tool_calls`: see `tools`), returns a
//! reasoning model's thinking apart (`reasoning_content`), and passes `chat_template_kwargs`
//! to the template; `openai_reply` shapes the parsed reply.
//! Refused with a 400 naming the field (rather than silently ignored):
//! `guided_whitespace_pattern`, `suffix`, a `tool_choice` other than `none`/`auto` on
//! completions, legacy `functions`/`function_call` that ask for functions, `stream_options`
//! without `stream`, non-text content parts.
//! Other unknown fields are ignored, as OpenAI clients send many (`user`, `metadata`…). A
//! `model` that is not the served one gets 404 `model_not_found`; an absent `model` (or `tgi`,
//! what TGI's client sends) means the served one. Chat responses carry `system_fingerprint`.
//!
//! The bodies as clients send them are `openai_request`'s; this file validates them into a
//! `FlowRequest` and answers.
//!
//! Where the `tandem` extension goes: non-streaming, in `usage.tandem`; streaming with
//! `stream_options.include_usage`, in the usage chunk's `usage.tandem`; streaming without
//! it, as a top-level `tandem` object on the final chunk (the one with `finish_reason`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use axum::Extension;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tandem_proto::v1::StopParams;
use tandem_text::{RenderOptions, ReplyOptions, ToolMode};

use super::extract::ApiJson;
use super::launch::{admit, collect, deadline_from, record_rejection, start, unix_now};
use super::logprobs::LogprobsShape;
use super::openai_request::{ChatRequest, CompletionRequest, OpenAiSampling};
use super::sse::{StreamFormatter, stream_response, tandem_headers};
use super::state::{AppState, RequestId};
use super::structured::{self, Structured};
use super::tools;
use super::validate::{self, refuse_unimplemented};
use crate::admission::InFlight;
use crate::error::{ApiError, ApiFlavor};
use crate::flow::FlowRequest;
use crate::model::ServedModel;

/// Default `max_tokens` of `/v1/completions` (OpenAI's); chat defaults to the room left.
const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;

/// What a route makes of its own fields before the shared ones are validated.
struct RouteSampling {
    logprobs: Option<LogprobsShape>,
    top_logprobs: u32,
    guide: Option<Structured>,
    /// Completions with `echo` and `logprobs: N`: the prompt's logprobs with N alternatives.
    echo_logprobs: Option<u32>,
}

/// What the shared fields validate into.
struct Params {
    sampling: tandem_proto::v1::SamplingParams,
    logprobs: Option<LogprobsShape>,
    /// Its grammar compiles (checked after admission).
    guide: Option<Structured>,
    /// Validated against the completion budget once it is known.
    min_tokens: Option<i64>,
    stop_strings: Vec<String>,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    stream: bool,
    include_usage: bool,
    /// Choices returned; `sampling.n` (best_of) are generated.
    choices: u32,
    /// vLLM's `prompt_logprobs` field goes in the response.
    vllm_prompt_logprobs: bool,
    /// The prompt's tokens open the completion's legacy logprobs (`echo` + `logprobs`).
    echo_logprobs: bool,
    /// Chat: how the reply is taken apart (set once the prompt is rendered); `None` passes
    /// the text as is.
    reply: Option<ReplyOptions>,
    /// Chat from TGI's own client (`model: "tgi"`): stream chunks in its shape.
    tgi_client: bool,
}

/// Validates the shared fields (`f`) with what the route made of its own (`route`).
fn params(
    f: OpenAiSampling,
    route: RouteSampling,
    model: &ServedModel,
) -> Result<Params, ApiError> {
    let stream = f.stream.unwrap_or(false);
    let (choices, best_of) = validate::n_and_best_of(f.n, f.best_of, stream)?;
    if f.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "`stream_options` is only allowed with `stream: true`",
        ));
    }
    let include_usage = f
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let vllm_prompt_logprobs = match f.prompt_logprobs {
        None => None,
        Some(_) if stream => {
            return Err(ApiError::invalid(
                "prompt_logprobs",
                "`prompt_logprobs` cannot be used with `stream`",
            ));
        }
        Some(n) => Some(validate::top_logprobs(Some(n), "prompt_logprobs")?),
    };
    let prompt_logprobs = match (vllm_prompt_logprobs, route.echo_logprobs) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let sampling = tandem_proto::v1::SamplingParams {
        presence_penalty: validate::openai_penalty(f.presence_penalty, "presence_penalty")?,
        frequency_penalty: validate::openai_penalty(f.frequency_penalty, "frequency_penalty")?,
        logit_bias: validate::logit_bias(f.logit_bias, model)?,
        top_logprobs: route.top_logprobs,
        guide: route.guide.as_ref().map(Structured::to_proto),
        n: best_of,
        prompt_logprobs,
        ..validate::sampling(
            validate::temperature(f.temperature, 1.0)?,
            validate::top_p(f.top_p)?,
            validate::top_k(f.top_k)?,
            f.seed,
            validate::repetition_penalty(f.repetition_penalty)?,
        )
    };
    Ok(Params {
        sampling,
        logprobs: route.logprobs,
        guide: route.guide,
        min_tokens: f.min_tokens,
        stop_strings: validate::stop_strings(f.stop)?,
        stop_token_ids: validate::stop_token_ids(f.stop_token_ids, model)?,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        stream,
        include_usage,
        choices,
        vllm_prompt_logprobs: vllm_prompt_logprobs.is_some(),
        echo_logprobs: route.echo_logprobs.is_some(),
        reply: None,
        tgi_client: false,
    })
}

/// A completion prompt: text to tokenize, or ids taken as they are.
#[derive(Debug, PartialEq)]
enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// Accepts a string, a list of token ids, or a one-element list of either.
fn parse_prompt(value: Option<Value>) -> Result<PromptInput, ApiError> {
    let empty = || ApiError::invalid("prompt", "`prompt` must not be empty");
    let batched = || {
        ApiError::invalid(
            "prompt",
            "batched prompts are not supported: send one prompt per request",
        )
    };
    let shape = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, a list of token ids, or a one-element list of either",
        )
    };
    match value {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) if s.is_empty() => Err(empty()),
        Some(Value::String(s)) => Ok(PromptInput::Text(s)),
        Some(Value::Array(items)) => match items.first() {
            None => Err(empty()),
            Some(Value::String(_)) | Some(Value::Array(_)) if items.len() > 1 => Err(batched()),
            Some(Value::String(_)) | Some(Value::Array(_)) => {
                parse_prompt(items.into_iter().next())
            }
            Some(Value::Number(_)) => token_ids(&items).map(PromptInput::Ids).ok_or_else(shape),
            Some(_) => Err(shape()),
        },
        Some(_) => Err(shape()),
    }
}

/// Flattens message content: a string, a list of text parts (joined by newlines), or null.
pub(crate) fn message_text(content: Option<Value>, i: usize) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => texts.push(t.clone()),
                    _ => {
                        return Err(ApiError::invalid(
                            param,
                            "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(ApiError::invalid(
            param,
            "message content must be a string or a list of text parts",
        )),
    }
}

/// The request for the flow; `budget` is the completion budget and the field that named it
/// (for `min_tokens`' error).
fn flow_request(
    model: &ServedModel,
    id: &RequestId,
    prompt: Vec<u32>,
    budget: (u32, &str),
    p: &Params,
    arrival: Instant,
    state: &AppState,
) -> Result<FlowRequest, ApiError> {
    let (max_tokens, max_tokens_param) = budget;
    Ok(FlowRequest {
        request_id: id.0.clone(),
        slo: state.config().slo.for_request(id.1, prompt.len()),
        prompt,
        sampling: p.sampling.clone(),
        stop: StopParams {
            max_tokens,
            stop_token_ids: p.stop_token_ids.clone(),
            stop_strings: p.stop_strings.clone(),
            ignore_eos: p.ignore_eos,
            min_tokens: validate::min_tokens(p.min_tokens, max_tokens, max_tokens_param)?,
        },
        eos_token_ids: model.eos_token_ids.clone(),
        hold_every_token: false,
        arrival,
        deadline: deadline_from(state, arrival),
    })
}

/// Which OpenAI object family a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    Extension(id): Extension<RequestId>,
    body: Result<ApiJson<CompletionRequest>, ApiError>,
) -> Response {
    let arrival = Instant::now();
    let prepared = async {
        let model = state.model()?;
        let ApiJson(body) = body?;
        state.check_model_name(&model, body.model.as_deref())?;
        refuse_unimplemented(&body.sampling.unimplemented)?;
        let echo = body.echo == Some(true);
        if body.suffix.is_some() {
            return Err(validate::unsupported("suffix", "no insertion"));
        }
        if body.sampling.top_logprobs.is_some() {
            return Err(ApiError::invalid(
                "top_logprobs",
                "completions take the number of alternatives as `logprobs`",
            ));
        }
        let requested = validate::max_tokens(body.max_tokens, "max_tokens")?;
        // `logprobs: N` (0 too) asks for the tokens' logprobs and N alternatives each.
        let (shape, top) = match body.logprobs {
            None => (None, 0),
            Some(n) => (
                Some(LogprobsShape::Completion),
                validate::top_logprobs(Some(n), "logprobs")?,
            ),
        };
        let guide = body.sampling.structured.parse()?;
        let route = RouteSampling {
            logprobs: shape,
            top_logprobs: top,
            guide,
            echo_logprobs: (echo && shape.is_some()).then_some(top),
        };
        let p = params(body.sampling, route, &model)?;
        let prompt = parse_prompt(body.prompt)?;
        if let PromptInput::Ids(ids) = &prompt {
            validate::prompt_ids(ids, &model, "prompt")?;
        }
        // The cheap checks passed: hold a slot before tokenizing, so that overload is
        // refused before that work, and tokenization is bounded like everything else.
        let in_flight = admit(&state, deadline_from(&state, arrival)).await?;
        structured::check(&state, &model, p.guide.as_ref()).await?;
        let (prompt, echoed) = match prompt {
            PromptInput::Ids(ids) if echo => {
                let (ids, text) = state
                    .encode(&model, move |m| {
                        let text = m.decode(&ids, "prompt")?;
                        Ok((ids, text))
                    })
                    .await?;
                (ids, Some(text))
            }
            PromptInput::Ids(ids) => (ids, None),
            PromptInput::Text(text) => {
                let echoed = echo.then(|| text.clone());
                let ids = state
                    .encode(&model, move |m| m.encode_prompt(&text))
                    .await?;
                (ids, echoed)
            }
        };
        let fields = validate::Fields {
            prompt: "prompt",
            max_tokens: "max_tokens",
        };
        let budget = validate::completion_budget(
            prompt.len(),
            requested,
            Some(DEFAULT_COMPLETION_MAX_TOKENS),
            &model,
            fields,
        )?;
        let req = flow_request(
            &model,
            &id,
            prompt,
            (budget, "max_tokens"),
            &p,
            arrival,
            &state,
        )?;
        Ok((model, req, p, in_flight, echoed))
    }
    .await;
    match prepared {
        Ok((model, req, p, in_flight, echoed)) => {
            let kind = Kind::Completion;
            respond(&state, kind, &model, req, &p, in_flight, echoed).await
        }
        Err(e) => {
            record_rejection(&e);
            e.into_response()
        }
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    Extension(id): Extension<RequestId>,
    body: Result<ApiJson<ChatRequest>, ApiError>,
) -> Response {
    let arrival = Instant::now();
    let prepared = async {
        let model = state.model()?;
        let ApiJson(mut body) = body?;
        state.check_model_name(&model, body.model.as_deref())?;
        // Chat takes `tool_choice`; what is left of the unimplemented fields is refused.
        let tool_choice = body.sampling.unimplemented.tool_choice.take();
        refuse_unimplemented(&body.sampling.unimplemented)?;
        let tools = tools::parse(
            body.tools.take(),
            tool_choice,
            body.parallel_tool_calls,
            model.tool_syntax,
        )?;
        let wants_logprobs = body.logprobs == Some(true);
        let top = validate::top_logprobs(body.sampling.top_logprobs, "top_logprobs")?;
        if top > 0 && !wants_logprobs {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ));
        }
        // `max_completion_tokens` is OpenAI's newer name and wins when both are given.
        let requested = match body.max_completion_tokens {
            Some(n) => validate::max_tokens(Some(n), "max_completion_tokens")?,
            None => validate::max_tokens(body.max_tokens, "max_tokens")?,
        };
        let guide = match (body.sampling.structured.parse()?, tools.guide) {
            (Some(asked), Some(_)) => {
                return Err(ApiError::invalid(
                    asked.param,
                    format!(
                        "`{}` cannot be combined with a `tool_choice` that requires a call (its grammar is the call's)",
                        asked.param
                    ),
                ));
            }
            (asked, tool) => asked.or(tool),
        };
        let route = RouteSampling {
            logprobs: wants_logprobs.then_some(LogprobsShape::Chat),
            top_logprobs: top,
            guide,
            echo_logprobs: None,
        };
        let mut p = params(body.sampling, route, &model)?;
        let messages = match body.messages {
            None => return Err(ApiError::invalid("messages", "`messages` is required")),
            Some(m) if m.is_empty() => {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` must not be empty",
                ));
            }
            Some(m) => m,
        };
        let mut conversation = Vec::with_capacity(messages.len());
        for (i, msg) in messages.into_iter().enumerate() {
            validate::chat_role(&msg.role, i)?;
            let calls = tools::message_tool_calls(msg.tool_calls, &msg.role, i)?;
            let call_id = tools::message_tool_call_id(msg.tool_call_id, i)?;
            let content = message_text(msg.content, i)?;
            conversation.push(tools::chat_message(msg.role, content, calls, call_id));
        }
        let render = RenderOptions {
            tools: tools.rendered,
            kwargs: body.chat_template_kwargs.unwrap_or_default(),
        };
        // As for completions: the template and the tokenizer run only for admitted requests.
        let in_flight = admit(&state, deadline_from(&state, arrival)).await?;
        structured::check(&state, &model, p.guide.as_ref()).await?;
        let rendered = state
            .encode(&model, move |m| m.render_chat(&conversation, true, &render))
            .await?;
        let reply = ReplyOptions {
            reasoning: model.reasoning,
            starts_thinking: rendered.starts_thinking,
            tools: tools.mode,
        };
        let passthrough = !reply.reasoning && !reply.starts_thinking && reply.tools == ToolMode::Off;
        p.reply = (!passthrough).then_some(reply);
        p.tgi_client = body.model.as_deref() == Some(super::state::TGI_CLIENT_MODEL);
        let prompt = rendered.ids;
        let param = if body.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        let fields = validate::Fields {
            prompt: "messages",
            max_tokens: param,
        };
        let budget = validate::completion_budget(prompt.len(), requested, None, &model, fields)?;
        let req = flow_request(&model, &id, prompt, (budget, param), &p, arrival, &state)?;
        Ok((model, req, p, in_flight))
    }
    .await;
    match prepared {
        Ok((model, req, p, in_flight)) => {
            respond(&state, Kind::Chat, &model, req, &p, in_flight, None).await
        }
        Err(e) => {
            record_rejection(&e);
            e.into_response()
        }
    }
}

/// Starts the admitted request and answers streaming or not.
async fn respond(
    state: &AppState,
    kind: Kind,
    model: &Arc<ServedModel>,
    req: FlowRequest,
    p: &Params,
    in_flight: InFlight,
    echo: Option<String>,
) -> Response {
    let prompt_tokens = u32::try_from(req.prompt.len()).unwrap_or(u32::MAX);
    let id = match kind {
        Kind::Completion => format!("cmpl-{}", req.request_id),
        Kind::Chat => format!("chatcmpl-{}", req.request_id),
    };
    let prompt = if p.echo_logprobs || p.vllm_prompt_logprobs {
        req.prompt.clone()
    } else {
        Vec::new()
    };
    let pending = start(state, req, in_flight);
    let formatter = OpenAiFormatter {
        prompt,
        echo_logprobs: p.echo_logprobs,
        vllm_prompt_logprobs: p.vllm_prompt_logprobs,
        served: Arc::clone(model),
        kind,
        id,
        created: unix_now(),
        model: model.name.clone(),
        include_usage: p.include_usage,
        head: None,
        prompt_tokens,
        started: HashSet::new(),
        echo,
        logprobs: p
            .logprobs
            .map(|shape| (shape, HashMap::new(), Arc::clone(model))),
        reply: p.reply.clone(),
        replies: HashMap::new(),
        reasoning_tokens: 0,
        tgi_client: p.tgi_client,
    };
    if p.stream {
        let keepalive = state.config().sse_keepalive;
        return stream_response(pending, formatter, keepalive, ApiFlavor::OpenAi).await;
    }
    let started = match pending.head().await {
        Ok(s) => s,
        Err(e) => return e.into_response_for(ApiFlavor::OpenAi),
    };
    let head = started.head.clone();
    let mut formatter = formatter;
    formatter.on_head(&head);
    match collect(started).await {
        Ok(done) => {
            let done = if p.choices < p.sampling.n {
                done.best(p.choices as usize)
            } else {
                done
            };
            let body = formatter.full_response(&done);
            let mut response = (StatusCode::OK, axum::Json(body)).into_response();
            tandem_headers(&head, response.headers_mut());
            response
        }
        Err(e) => e.into_response_for(ApiFlavor::OpenAi),
    }
}

/// `GET /v1/models`.
pub async fn models(State(state): State<AppState>) -> Response {
    match state.model() {
        Ok(model) => axum::Json(serde_json::json!({
            "object": "list",
            "data": [{
                "id": model.name,
                "object": "model",
                "created": model.created,
                "owned_by": "tandem",
                "max_model_len": model.context_length,
            }],
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

#[path = "openai_format.rs"]
mod format;
#[path = "openai_reply.rs"]
mod reply;
use format::OpenAiFormatter;

#[cfg(test)]
#[path = "openai_tests.rs"]
mod tests;

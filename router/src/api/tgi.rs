//! The TGI routes: `POST /generate` and `POST /generate_stream`, taking the body vLLM's
//! benchmark sends (`{"inputs", "parameters": {...}}`) and answering in TGI's shapes:
//! one `data:{"index","token","generated_text","details"}` event per token, the last one
//! carrying the full `generated_text` (and `details` when asked). Errors are TGI style,
//! validation → 422.
//!
//! Sampling follows TGI: greedy unless `do_sample` or a warper (`temperature` ≠ 1, `top_p`,
//! `top_k`) is given; `temperature` and `top_k` must be strictly positive. `truncate` keeps
//! the last N prompt tokens. `best_of` (≤ 16, sampling only, not streamed) generates that many
//! sequences from one prefill and returns the one with the highest mean token logprob, the
//! others in `details.best_of_sequences`. `top_n_tokens` adds each token's most
//! likely alternatives (`details.top_tokens`, a stream event's `top_tokens`);
//! `frequency_penalty` is OpenAI's; `grammar` (`json` with a schema, `regex`) constrains the
//! output. `decoder_input_details` (not streamed, as TGI) fills `details.prefill` with the
//! prompt's tokens and their logprobs (the first has none). Refused with a 422 naming the
//! field: `return_full_text`, `typical_p` < 1, `watermark`, `adapter_id`. The event `index` counts tokens from 1, as TGI's does.
//! `finish_reason` is `eos_token` when the last token is an EOS id, `stop_sequence` for any
//! other stop, `length` at `max_new_tokens`.

use std::sync::Arc;
use std::time::Instant;

use axum::Extension;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tandem_proto::v1::{FinishReason, StopParams};

use super::extract::{ApiJson, JsonBody};
use super::launch::{Collected, admit, collect, deadline_from, record_rejection, start};
use super::sse::{StreamFormatter, data_event, stream_response, tandem_headers};
use super::state::{AppState, RequestId};
use super::structured;
use super::validate::{self, StopField};
use crate::admission::InFlight;
use crate::error::{ApiError, ApiFlavor, TgiError};
use crate::flow::{FinishOut, FlowEvent, FlowRequest, TokenOut};
use crate::model::ServedModel;

/// TGI's default `max_new_tokens`.
const DEFAULT_MAX_NEW_TOKENS: u32 = 100;

/// `POST /generate(_stream)` body.
#[derive(Debug, Deserialize)]
pub struct TgiRequest {
    pub inputs: String,
    pub parameters: Option<TgiParameters>,
}

impl JsonBody for TgiRequest {}

/// TGI's `parameters`.
#[derive(Debug, Default, Deserialize)]
pub struct TgiParameters {
    pub max_new_tokens: Option<i64>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub truncate: Option<i64>,
    pub ignore_eos_token: Option<bool>,
    pub best_of: Option<i64>,
    pub details: Option<bool>,
    pub seed: Option<u64>,
    pub stop: Option<Vec<String>>,
    pub repetition_penalty: Option<f64>,
    pub return_full_text: Option<bool>,
    pub typical_p: Option<f64>,
    pub watermark: Option<bool>,
    pub top_n_tokens: Option<u32>,
    pub decoder_input_details: Option<bool>,
    pub frequency_penalty: Option<f64>,
    /// TGI's structured output: `{"type": "json"|"regex", "value": …}`.
    pub grammar: Option<serde_json::Value>,
    pub adapter_id: Option<String>,
}

/// A validated, admitted TGI request, ready to start.
struct Prepared {
    request: FlowRequest,
    /// `decoder_input_details`: the prompt's tokens are reported.
    prompt_details: bool,
    in_flight: InFlight,
    details: bool,
    seed: Option<u64>,
    ignore_eos: bool,
    eos_token_ids: Vec<u32>,
    /// Alternatives per token to report (`top_n_tokens`), and the model that names them.
    top_n: u32,
    model: Arc<ServedModel>,
}

fn strictly_positive(value: Option<f64>, param: &str) -> Result<(), ApiError> {
    match value {
        Some(v) if !(v.is_finite() && v > 0.0) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be strictly positive, got {v}"),
        )),
        _ => Ok(()),
    }
}

fn refuse_unsupported(p: &TgiParameters) -> Result<(), ApiError> {
    let checks = [
        (
            p.return_full_text == Some(true),
            "return_full_text",
            "only the generated text is returned",
        ),
        (
            p.typical_p.is_some_and(|t| t < 1.0),
            "typical_p",
            "no typical sampling",
        ),
        (p.watermark == Some(true), "watermark", "no watermarking"),
        (p.adapter_id.is_some(), "adapter_id", "no LoRA adapters"),
    ];
    match checks.into_iter().find(|(bad, _, _)| *bad) {
        Some((_, param, why)) => Err(validate::unsupported(param, why)),
        None => Ok(()),
    }
}

async fn prepare(
    state: &AppState,
    id: &RequestId,
    arrival: Instant,
    body: Result<ApiJson<TgiRequest>, ApiError>,
    stream: bool,
) -> Result<Prepared, ApiError> {
    let model = state.model()?;
    let ApiJson(body) = body?;
    let p = body.parameters.unwrap_or_default();
    refuse_unsupported(&p)?;
    if body.inputs.is_empty() {
        return Err(ApiError::invalid("inputs", "`inputs` must not be empty"));
    }
    let (_, best_of) = validate::n_and_best_of(None, p.best_of, stream)?;
    let prompt_details = p.decoder_input_details == Some(true);
    if prompt_details && stream {
        return Err(ApiError::invalid(
            "decoder_input_details",
            "`decoder_input_details` cannot be used when streaming tokens",
        ));
    }
    strictly_positive(p.temperature, "temperature")?;
    if p.top_k.is_some_and(|k| k <= 0) {
        return Err(ApiError::invalid(
            "top_k",
            "`top_k` must be strictly positive",
        ));
    }
    let requested = validate::max_tokens(p.max_new_tokens, "max_new_tokens")?;
    let truncate = match p.truncate {
        Some(t) if t < 1 => {
            return Err(ApiError::invalid(
                "truncate",
                format!("`truncate` must be at least 1, got {t}"),
            ));
        }
        Some(t) => Some(usize::try_from(t).unwrap_or(usize::MAX)),
        None => None,
    };
    // TGI samples when asked to or when any warper is set; otherwise it is greedy.
    let warped = p.temperature.is_some_and(|t| t != 1.0) || p.top_p.is_some() || p.top_k.is_some();
    let temperature = if p.do_sample == Some(true) || warped {
        validate::temperature(p.temperature, 1.0)?
    } else {
        0.0
    };
    if best_of > 1 && temperature == 0.0 {
        // As TGI: greedy sequences would all be the same one.
        return Err(ApiError::invalid(
            "best_of",
            "`best_of` > 1 needs sampling (`do_sample` or a sampling parameter)",
        ));
    }
    let top_n = validate::top_logprobs(p.top_n_tokens.map(i64::from), "top_n_tokens")?;
    let guide = structured::tgi_grammar(p.grammar.as_ref())?;
    let sampling = tandem_proto::v1::SamplingParams {
        frequency_penalty: validate::openai_penalty(p.frequency_penalty, "frequency_penalty")?,
        top_logprobs: top_n,
        guide: guide.as_ref().map(structured::Structured::to_proto),
        n: best_of,
        prompt_logprobs: prompt_details.then_some(0),
        ..validate::sampling(
            temperature,
            validate::top_p(p.top_p)?,
            validate::top_k(p.top_k)?,
            p.seed,
            validate::repetition_penalty(p.repetition_penalty)?,
        )
    };
    let stop_strings = validate::stop_strings(p.stop.map(StopField::Many))?;
    let inputs = body.inputs;
    // The cheap checks passed: hold a slot, then tokenize (see `admit`).
    let in_flight = admit(state, deadline_from(state, arrival)).await?;
    structured::check(state, &model, guide.as_ref()).await?;
    let mut prompt = state
        .encode(&model, move |m| m.encode_prompt(&inputs))
        .await?;
    if let Some(t) = truncate
        && prompt.len() > t
    {
        prompt.drain(..prompt.len() - t);
    }
    let max_tokens = validate::completion_budget(
        prompt.len(),
        requested,
        Some(DEFAULT_MAX_NEW_TOKENS),
        &model,
        validate::Fields {
            prompt: "inputs",
            max_tokens: "max_new_tokens",
        },
    )?;
    let ignore_eos = p.ignore_eos_token.unwrap_or(false);
    Ok(Prepared {
        prompt_details,
        in_flight,
        request: FlowRequest {
            request_id: id.0.clone(),
            slo: state.config().slo.for_request(id.1, prompt.len()),
            prompt,
            sampling,
            // With stop strings the last token cannot be foreseen, and a TGI stream must end
            // on a token event: hold each token until the next event.
            hold_every_token: !stop_strings.is_empty(),
            stop: StopParams {
                max_tokens,
                stop_token_ids: Vec::new(),
                stop_strings,
                ignore_eos,
                min_tokens: 0,
            },
            eos_token_ids: model.eos_token_ids.clone(),
            arrival,
            deadline: deadline_from(state, arrival),
        },
        details: p.details.unwrap_or(false),
        seed: p.seed,
        ignore_eos,
        eos_token_ids: model.eos_token_ids.clone(),
        top_n,
        model,
    })
}

/// `POST /generate`.
pub async fn generate(
    State(state): State<AppState>,
    Extension(id): Extension<RequestId>,
    body: Result<ApiJson<TgiRequest>, ApiError>,
) -> Response {
    generate_whole(state, id, body, false).await
}

/// A whole generation; `as_list` answers with a one-element list (TGI's `POST /`).
async fn generate_whole(
    state: AppState,
    id: RequestId,
    body: Result<ApiJson<TgiRequest>, ApiError>,
    as_list: bool,
) -> Response {
    let prepared = match prepare(&state, &id, Instant::now(), body, false).await {
        Ok(p) => p,
        Err(e) => {
            record_rejection(&e);
            return TgiError(e).into_response();
        }
    };
    let best_of = prepared.request.sampling.n;
    let prompt = if prepared.prompt_details {
        prepared.request.prompt.clone()
    } else {
        Vec::new()
    };
    let started = match start(&state, prepared.request, prepared.in_flight)
        .head()
        .await
    {
        Ok(s) => s,
        Err(e) => return TgiError(e).into_response(),
    };
    let head = started.head.clone();
    let done = match collect(started).await {
        Ok(done) => done,
        Err(e) => return TgiError(e).into_response(),
    };
    // The best sequence answers; with best_of the others follow in the details.
    let mut ranked = done.best(best_of as usize).choices.into_iter();
    let Some(best) = ranked.next() else {
        return TgiError(ApiError::WorkerFailed).into_response();
    };
    let others: Vec<Collected> = ranked.collect();
    let (ignore_eos, eos, seed) = (prepared.ignore_eos, &prepared.eos_token_ids, prepared.seed);
    let top_n = (prepared.top_n > 0).then_some(&*prepared.model);
    // The prompt's tokens: the first has no logprob (nothing predicts it).
    let prefill: Vec<TgiInputToken> = prompt
        .iter()
        .enumerate()
        .map(|(i, &id)| TgiInputToken {
            id,
            text: prepared.model.token_text(id),
            logprob: i
                .checked_sub(1)
                .and_then(|e| head.prompt_logprobs.get(e))
                .map(|e| e.logprob),
        })
        .collect();
    let sequence = |c| tgi_sequence(c, ignore_eos, eos, seed, top_n, &prefill);
    fn tgi_sequence<'a>(
        c: &'a Collected,
        ignore_eos: bool,
        eos_token_ids: &[u32],
        seed: Option<u64>,
        top_n: Option<&ServedModel>,
        prefill: &[TgiInputToken],
    ) -> TgiSequence<'a> {
        TgiSequence {
            finish_reason: tgi_finish_reason(&c.finish, c.last_token, ignore_eos, eos_token_ids),
            generated_tokens: c.finish.completion_tokens,
            // Sequence i samples with seed + i (TGI reports each sequence's seed).
            seed: seed.map(|s| s.wrapping_add(u64::from(c.generated_as))),
            prefill: prefill.to_vec(),
            tokens: c
                .tokens
                .iter()
                .map(|t| TgiToken {
                    id: t.id,
                    text: &t.text,
                    logprob: t.logprob,
                    special: t.special,
                })
                .collect(),
            top_tokens: top_n.map(|model| c.tokens.iter().map(|t| top_tokens(model, t)).collect()),
        }
    }
    let best_of_sequences = (best_of > 1).then(|| {
        others
            .iter()
            .map(|c| TgiBestOf {
                generated_text: &c.text,
                sequence: sequence(c),
            })
            .collect()
    });
    let details = TgiDetails {
        sequence: sequence(&best),
        best_of_sequences,
    };
    let body = TgiGenerateResponse {
        generated_text: &best.text,
        details: prepared.details.then_some(details),
    };
    let mut response = if as_list {
        axum::Json([body]).into_response()
    } else {
        axum::Json(body).into_response()
    };
    tandem_headers(&head, response.headers_mut());
    response
}

/// `POST /` body: TGI's compatibility route, `/generate` or `/generate_stream` by `stream`.
#[derive(Debug, Deserialize)]
pub struct TgiCompatRequest {
    pub inputs: String,
    pub parameters: Option<TgiParameters>,
    #[serde(default)]
    pub stream: bool,
}

impl JsonBody for TgiCompatRequest {}

/// `POST /`: what TGI's `Client(base_url)` calls; a non-streaming answer comes as a
/// one-element list, as TGI sends it (its client reads `payload[0]`).
pub async fn compat(
    state: State<AppState>,
    request_id: Extension<RequestId>,
    body: Result<ApiJson<TgiCompatRequest>, ApiError>,
) -> Response {
    let (stream, body) = match body {
        Ok(ApiJson(b)) => (
            b.stream,
            Ok(ApiJson(TgiRequest {
                inputs: b.inputs,
                parameters: b.parameters,
            })),
        ),
        Err(e) => (false, Err(e)),
    };
    if stream {
        generate_stream(state, request_id, body).await
    } else {
        let (State(state), Extension(id)) = (state, request_id);
        generate_whole(state, id, body, true).await
    }
}

/// `POST /generate_stream`.
pub async fn generate_stream(
    State(state): State<AppState>,
    Extension(id): Extension<RequestId>,
    body: Result<ApiJson<TgiRequest>, ApiError>,
) -> Response {
    let prepared = match prepare(&state, &id, Instant::now(), body, true).await {
        Ok(p) => p,
        Err(e) => {
            record_rejection(&e);
            return TgiError(e).into_response();
        }
    };
    let formatter = TgiFormatter {
        generated: String::new(),
        count: 0,
        last_token: None,
        details: prepared.details,
        seed: prepared.seed,
        ignore_eos: prepared.ignore_eos,
        eos_token_ids: prepared.eos_token_ids,
        top_n: (prepared.top_n > 0).then_some(prepared.model),
    };
    let pending = start(&state, prepared.request, prepared.in_flight);
    let keepalive = state.config().sse_keepalive;
    stream_response(pending, formatter, keepalive, ApiFlavor::Tgi).await
}

fn tgi_finish_reason(
    f: &FinishOut,
    last_token: Option<u32>,
    ignore_eos: bool,
    eos_token_ids: &[u32],
) -> &'static str {
    match f.reason {
        FinishReason::Length => "length",
        _ if !ignore_eos && last_token.is_some_and(|t| eos_token_ids.contains(&t)) => "eos_token",
        _ => "stop_sequence",
    }
}

/// `/generate`'s `details`, as TGI's client parses them (`prefill` and `tokens` required).
#[derive(Serialize)]
struct TgiDetails<'a> {
    #[serde(flatten)]
    sequence: TgiSequence<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    best_of_sequences: Option<Vec<TgiBestOf<'a>>>,
}

/// What TGI reports of one generated sequence.
#[derive(Serialize)]
struct TgiSequence<'a> {
    finish_reason: &'static str,
    generated_tokens: u32,
    seed: Option<u64>,
    prefill: Vec<TgiInputToken>,
    tokens: Vec<TgiToken<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_tokens: Option<Vec<Vec<TgiTopToken>>>,
}

/// One of `best_of`'s other sequences (TGI's `BestOfSequence`).
#[derive(Serialize)]
struct TgiBestOf<'a> {
    generated_text: &'a str,
    #[serde(flatten)]
    sequence: TgiSequence<'a>,
}

/// One of a position's most likely tokens (TGI's `Token`).
#[derive(Debug, Serialize, PartialEq)]
struct TgiTopToken {
    id: u32,
    text: String,
    logprob: f32,
    special: bool,
}

/// `token`'s alternatives, named by the model's tokenizer.
fn top_tokens(model: &ServedModel, token: &TokenOut) -> Vec<TgiTopToken> {
    token
        .top_logprobs
        .iter()
        .map(|&(id, logprob)| TgiTopToken {
            id,
            text: model.token_text(id),
            logprob,
            special: model.is_special(id),
        })
        .collect()
}

#[derive(Serialize)]
struct TgiGenerateResponse<'a> {
    generated_text: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<TgiDetails<'a>>,
}

/// One prompt token in `details.prefill` (TGI's `InputToken`).
#[derive(Serialize, Clone)]
struct TgiInputToken {
    id: u32,
    text: String,
    logprob: Option<f32>,
}

#[derive(Serialize)]
struct TgiToken<'a> {
    id: u32,
    text: &'a str,
    logprob: f32,
    special: bool,
}

/// One `/generate_stream` event, fields in TGI's order.
#[derive(Serialize)]
struct TgiStreamEvent<'a> {
    index: u32,
    token: TgiToken<'a>,
    generated_text: Option<&'a str>,
    details: Option<TgiStreamDetails>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_tokens: Option<Vec<TgiTopToken>>,
}

/// The last stream event's `details` (TGI's `StreamDetails`: no token lists).
#[derive(Debug, Serialize)]
struct TgiStreamDetails {
    finish_reason: &'static str,
    generated_tokens: u32,
    seed: Option<u64>,
}

struct TgiFormatter {
    generated: String,
    count: u32,
    last_token: Option<u32>,
    details: bool,
    seed: Option<u64>,
    ignore_eos: bool,
    eos_token_ids: Vec<u32>,
    /// Set when the request asked for `top_n_tokens`.
    top_n: Option<Arc<ServedModel>>,
}

impl TgiFormatter {
    fn event(&mut self, token: &TokenOut, finish: Option<&FinishOut>) -> String {
        self.count += 1;
        if !token.special {
            self.generated.push_str(&token.text);
        }
        self.last_token = Some(token.id);
        let details = finish.filter(|_| self.details).map(|f| TgiStreamDetails {
            finish_reason: tgi_finish_reason(
                f,
                self.last_token,
                self.ignore_eos,
                &self.eos_token_ids,
            ),
            generated_tokens: f.completion_tokens,
            seed: self.seed,
        });
        let event = TgiStreamEvent {
            index: self.count,
            token: TgiToken {
                id: token.id,
                text: &token.text,
                logprob: token.logprob,
                special: token.special,
            },
            generated_text: finish.map(|_| self.generated.as_str()),
            details,
            top_tokens: self.top_n.as_ref().map(|m| top_tokens(m, token)),
        };
        data_event(&serde_json::to_string(&event).unwrap_or_default(), false)
    }
}

/// The error event that ends a broken TGI stream.
pub fn stream_error(e: &ApiError) -> String {
    data_event(&e.tgi_body().to_string(), false)
}

impl StreamFormatter for TgiFormatter {
    fn format(&mut self, event: FlowEvent) -> (String, bool) {
        match event {
            FlowEvent::Token(t, finish) => {
                let done = finish.is_some();
                (self.event(&t, finish.as_ref()), done)
            }
            FlowEvent::Finished(f) => {
                // Only when the worker ended for a reason the router could not foresee: a
                // TGI stream must still end on an event with `generated_text`, so it gets
                // an empty special token.
                tracing::warn!(
                    "generation finished without a final token; closing with an empty token event"
                );
                let token = TokenOut {
                    choice: 0,
                    id: self.last_token.unwrap_or_default(),
                    text: String::new(),
                    logprob: 0.0,
                    index: self.count,
                    special: true,
                    top_logprobs: Vec::new(),
                };
                let last = self.last_token;
                let out = self.event(&token, Some(&f));
                self.last_token = last;
                (out, true)
            }
            FlowEvent::Failed(e) => (stream_error(&e), true),
        }
    }

    fn broken(&mut self) -> String {
        tracing::error!("event stream ended without a finish; sending an error event");
        stream_error(&ApiError::WorkerFailed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proto::v1::Transport;

    fn token(id: u32, text: &str, index: u32) -> TokenOut {
        TokenOut {
            choice: 0,
            id,
            text: text.into(),
            logprob: -0.5,
            index,
            special: false,
            top_logprobs: Vec::new(),
        }
    }

    fn finish(reason: FinishReason, n: u32) -> FinishOut {
        FinishOut {
            choice: 0,
            last: true,
            reason,
            prompt_tokens: 3,
            completion_tokens: n,
            total_completion_tokens: n,
            kv_bytes: 0,
            transport: Some(Transport::Shm),
            cached_tokens: 0,
            kv_blocks: 0,
            decode_cached_tokens: 0,
            prefill_pulled_tokens: 0,
        }
    }

    fn formatter(details: bool) -> TgiFormatter {
        TgiFormatter {
            generated: String::new(),
            count: 0,
            last_token: None,
            details,
            seed: Some(7),
            ignore_eos: false,
            eos_token_ids: vec![2],
            top_n: None,
        }
    }

    #[test]
    fn stream_events_golden() {
        let mut f = formatter(true);
        let (a, done_a) = f.format(FlowEvent::Token(token(72, "Hi", 0), None));
        let (b, done_b) = f.format(FlowEvent::Token(
            token(35, " \"x\"", 1),
            Some(finish(FinishReason::Length, 2)),
        ));
        assert!(!done_a && done_b);
        assert_eq!(
            a,
            "data:{\"index\":1,\"token\":{\"id\":72,\"text\":\"Hi\",\"logprob\":-0.5,\"special\":false},\"generated_text\":null,\"details\":null}\n\n"
        );
        assert_eq!(
            b,
            "data:{\"index\":2,\"token\":{\"id\":35,\"text\":\" \\\"x\\\"\",\"logprob\":-0.5,\"special\":false},\"generated_text\":\"Hi \\\"x\\\"\",\"details\":{\"finish_reason\":\"length\",\"generated_tokens\":2,\"seed\":7}}\n\n"
        );
    }

    #[test]
    fn details_only_when_asked_and_eos_reason() {
        let mut f = formatter(false);
        let (out, _) = f.format(FlowEvent::Token(
            token(2, "", 0),
            Some(finish(FinishReason::Stop, 1)),
        ));
        assert!(
            out.contains("\"generated_text\":\"\",\"details\":null"),
            "{out}"
        );
        let stop = finish(FinishReason::Stop, 1);
        assert_eq!(tgi_finish_reason(&stop, Some(2), false, &[2]), "eos_token");
        assert_eq!(
            tgi_finish_reason(&stop, Some(2), true, &[2]),
            "stop_sequence"
        );
        assert_eq!(
            tgi_finish_reason(&stop, Some(9), false, &[2]),
            "stop_sequence"
        );
    }

    #[test]
    fn error_event_golden() {
        let mut f = formatter(false);
        let (out, done) = f.format(FlowEvent::Failed(ApiError::WorkerFailed));
        assert!(done);
        assert_eq!(
            out,
            "data:{\"error\":\"a worker failed while serving this request\",\"error_type\":\"generation\"}\n\n"
        );
        assert!(f.broken().starts_with("data:{\"error\""));
    }
}

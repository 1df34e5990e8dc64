//! The routes that answer from the served model without running it: OpenAI's
//! `GET /v1/models/{id}`, vLLM's `POST /tokenize` and `POST /detokenize`, TGI's `GET /info`,
//! and TGI's `POST /tokenize` (told apart from vLLM's by its `inputs` field). Tokenization runs
//! on the blocking pool like a prompt's, so a huge text queues rather than stalls the server.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tandem_text::ChatMessage;

use super::extract::ApiJson;
use super::state::AppState;
use super::validate;
use crate::error::{ApiError, TgiError};
use crate::routing::PlacementKind;
use clap::ValueEnum;

/// `GET /v1/models/{id}`: the served model's object, or 404 `model_not_found`.
pub async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    let model = match state.model() {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    if id != model.name {
        return ApiError::ModelNotFound(id).into_response();
    }
    axum::Json(json!({
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "tandem",
        "max_model_len": model.context_length,
    }))
    .into_response()
}

/// vLLM's `/tokenize` body: a completion prompt or a conversation.
#[derive(Debug, Deserialize)]
struct VllmTokenize {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<super::openai_request::ChatMessageIn>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    return_token_strs: Option<bool>,
}

/// TGI's `/tokenize` body.
#[derive(Debug, Deserialize)]
struct TgiTokenize {
    inputs: String,
}

/// `POST /tokenize`: vLLM's (`prompt` or `messages` → `{count, max_model_len, tokens}`) or,
/// when the body has `inputs`, TGI's (a list of `{id, text, start, stop}`).
pub async fn tokenize(
    State(state): State<AppState>,
    body: Result<ApiJson<Value>, ApiError>,
) -> Response {
    let tgi = matches!(&body, Ok(ApiJson(v)) if v.get("inputs").is_some());
    let result = if tgi {
        tgi_tokenize(&state, body).await
    } else {
        vllm_tokenize(&state, body).await
    };
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) if tgi => TgiError(e).into_response(),
        Err(e) => e.into_response(),
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: Value) -> Result<T, ApiError> {
    serde_json::from_value(body)
        .map_err(|e| ApiError::invalid_body(format!("bad request body: {e}")))
}

async fn vllm_tokenize(
    state: &AppState,
    body: Result<ApiJson<Value>, ApiError>,
) -> Result<Value, ApiError> {
    let model = state.model()?;
    let ApiJson(body) = body?;
    let req: VllmTokenize = parse(body)?;
    state.check_model_name(&model, req.model.as_deref())?;
    let tokens = match (req.prompt, req.messages) {
        (Some(prompt), None) => {
            let special = req.add_special_tokens.unwrap_or(true);
            state
                .encode(&model, move |m| m.encode_text(&prompt, special))
                .await?
        }
        (None, Some(messages)) => {
            let mut conversation = Vec::with_capacity(messages.len());
            for (i, msg) in messages.into_iter().enumerate() {
                validate::chat_role(&msg.role, i)?;
                let text = super::openai::message_text(msg.content, i)?;
                conversation.push(ChatMessage::new(msg.role, text));
            }
            let open_turn = req.add_generation_prompt.unwrap_or(true);
            state
                .encode(&model, move |m| {
                    m.encode_conversation(&conversation, open_turn)
                })
                .await?
        }
        _ => {
            return Err(ApiError::invalid_body(
                "give either `prompt` or `messages` to tokenize",
            ));
        }
    };
    let mut out = json!({
        "count": tokens.len(),
        "max_model_len": model.context_length,
        "tokens": tokens,
    });
    if req.return_token_strs == Some(true) {
        let ids = tokens.clone();
        let pieces = state.encode(&model, move |m| Ok(m.pieces(&ids))).await?;
        out["token_strs"] = json!(pieces);
    }
    Ok(out)
}

async fn tgi_tokenize(
    state: &AppState,
    body: Result<ApiJson<Value>, ApiError>,
) -> Result<Value, ApiError> {
    let model = state.model()?;
    let ApiJson(body) = body?;
    let req: TgiTokenize = parse(body)?;
    if req.inputs.is_empty() {
        return Err(ApiError::invalid("inputs", "`inputs` must not be empty"));
    }
    let inputs = req.inputs;
    let tokens = state
        .encode(&model, move |m| m.tokenize_with_offsets(&inputs))
        .await?;
    Ok(Value::Array(
        tokens
            .into_iter()
            .map(|(id, text, start, stop)| json!({"id": id, "text": text, "start": start, "stop": stop}))
            .collect(),
    ))
}

/// vLLM's `/detokenize` body.
#[derive(Debug, Deserialize)]
struct Detokenize {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `POST /detokenize`: `{tokens}` → `{prompt}`.
pub async fn detokenize(
    State(state): State<AppState>,
    body: Result<ApiJson<Value>, ApiError>,
) -> Response {
    let result = async {
        let model = state.model()?;
        let ApiJson(body) = body?;
        let req: Detokenize = parse(body)?;
        state.check_model_name(&model, req.model.as_deref())?;
        let tokens = req.tokens;
        let text = state
            .encode(&model, move |m| m.decode(&tokens, "tokens"))
            .await?;
        Ok::<_, ApiError>(json!({ "prompt": text }))
    }
    .await;
    match result {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /info`: TGI's description of the deployment, with the limits tandem enforces, and
/// its placement, latency targets and what SLO placement has learned.
pub async fn tgi_info(State(state): State<AppState>) -> Response {
    let model = match state.model() {
        Ok(m) => m,
        Err(e) => return TgiError(e).into_response(),
    };
    let context = model.context_length;
    let slo = state.config().slo;
    let calibration = state
        .flow()
        .calibration
        .lock()
        .map(|c| *c)
        .unwrap_or_default();
    // TTFT's lines: every prompt length together, and per length class that has learned
    // anything, from its lowest prompt length.
    let lines = |kind| {
        let ((offset_ms, slope), classes) = calibration.lines(kind);
        let classes: Vec<_> = classes
            .into_iter()
            .map(|(from_tokens, (offset_ms, slope))| {
                json!({ "from_prompt_tokens": from_tokens, "offset_ms": offset_ms, "slope": slope })
            })
            .collect();
        json!({
            "ttft": { "offset_ms": offset_ms, "slope": slope },
            "ttft_by_prompt_length": classes,
        })
    };
    axum::Json(json!({
        "model_id": model.name,
        "model_sha": null,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": state.config().max_concurrent_requests,
        "max_best_of": tandem_proto::limits::MAX_CHOICES,
        "max_stop_sequences": tandem_proto::limits::MAX_STOP_STRINGS,
        "max_input_tokens": context.saturating_sub(1),
        "max_total_tokens": context,
        "validation_workers": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "max_client_batch_size": 1,
        "router": "tandem-router",
        "version": env!("CARGO_PKG_VERSION"),
        "sha": null,
        "docker_label": null,
        "placement": state.config().placement.to_possible_value().map(|v| v.get_name().to_string()),
        "slo": {
            "ttft_ms": slo.ttft_ms,
            "ttft_per_token_ms": slo.ttft_per_token_ms,
            "tpot_ms": slo.tpot_ms,
        },
        // Measured TTFT ≈ offset + slope × predicted, as SLO placement has learned it.
        "slo_calibration": {
            "aggregated": lines(PlacementKind::Aggregated),
            "disaggregated": lines(PlacementKind::Disaggregated),
            "split": lines(PlacementKind::Split),
        },
    }))
    .into_response()
}

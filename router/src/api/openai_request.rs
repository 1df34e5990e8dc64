//! The bodies of `POST /v1/completions` and `POST /v1/chat/completions` as clients send
//! them. The fields both share (sampling, stopping, streaming, structured output, and the
//! ones tandem refuses) are one struct, `OpenAiSampling`, flattened into each request; what
//! they validate into is `openai`'s.
//!
//! Unknown fields are ignored, as OpenAI clients send many (`user`, `metadata`…). A flattened
//! struct's fields are read by serde only after the whole object, where an error in them
//! names neither the field nor its place: both requests name `OpenAiSampling` as their
//! flattened part (`JsonBody`), and `ApiJson` reads a body again as that part alone to find
//! such an error where the client wrote it.

use serde::Deserialize;
use serde_json::Value;

use super::extract::{JsonBody, PathError, earlier, first_error};
use super::structured::OpenAiStructured;
use super::validate::{StopField, UnimplementedFields};

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// The fields both OpenAI generation requests share.
#[derive(Debug, Default, Deserialize)]
pub struct OpenAiSampling {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub seed: Option<u64>,
    pub ignore_eos: Option<bool>,
    pub top_k: Option<i64>,
    pub repetition_penalty: Option<f64>,
    pub min_tokens: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Chat's number of alternatives per token; completions refuse it (theirs is `logprobs`).
    pub top_logprobs: Option<i64>,
    /// vLLM's `prompt_logprobs`.
    pub prompt_logprobs: Option<i64>,
    #[serde(flatten)]
    pub structured: OpenAiStructured,
    #[serde(flatten)]
    pub unimplemented: UnimplementedFields,
}

impl JsonBody for OpenAiSampling {
    fn flattened_error(bytes: &[u8]) -> Option<PathError> {
        match (
            first_error::<OpenAiStructured>(bytes),
            first_error::<UnimplementedFields>(bytes),
        ) {
            (Some(structured), Some(unimplemented)) => {
                Some(earlier(Some(structured), unimplemented))
            }
            (structured, unimplemented) => structured.or(unimplemented),
        }
    }
}

impl JsonBody for OpenAiStructured {}

impl JsonBody for UnimplementedFields {}

/// `POST /v1/completions` body.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<Value>,
    pub max_tokens: Option<i64>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub sampling: OpenAiSampling,
}

impl JsonBody for CompletionRequest {
    fn flattened_error(bytes: &[u8]) -> Option<PathError> {
        first_error::<OpenAiSampling>(bytes)
    }
}

/// One chat message as clients send it (an assistant's `tool_calls`, a tool result's
/// `tool_call_id`; raw JSON, checked by `tools`).
#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<Value>,
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<Value>,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub parallel_tool_calls: Option<bool>,
    /// Variables for the chat template (`enable_thinking: false` and the like).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(flatten)]
    pub sampling: OpenAiSampling,
}

impl JsonBody for ChatRequest {
    fn flattened_error(bytes: &[u8]) -> Option<PathError> {
        first_error::<OpenAiSampling>(bytes)
    }
}

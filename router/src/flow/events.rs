//! What the flow tells the HTTP layer: the response head (how the request ran, known with
//! its first token), then one event per token or finish, or the error that broke the stream
//! after the head.

use tandem_proto::v1::{FinishReason, Transport};

use super::request::FlowRequest;
use crate::error::ApiError;
use crate::routing::FallbackReason;

/// How the request ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    Disaggregated,
    Aggregated,
}

impl RunMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RunMode::Disaggregated => "disaggregated",
            RunMode::Aggregated => "aggregated",
        }
    }
}

/// What is known when the response head goes out: after the first token (and, when
/// disaggregated, the prefill's answer).
#[derive(Debug, Clone)]
pub struct Head {
    pub mode: RunMode,
    /// KV bytes the prefill worker reports sending (0 aggregated).
    pub kv_bytes: u64,
    /// The KV transport used (None aggregated).
    pub transport: Option<Transport>,
    pub fallback: Option<FallbackReason>,
    /// When the request asked for prompt logprobs: one entry per prompt token from the
    /// second on (from the prefill worker's answer, or the first token aggregated).
    pub prompt_logprobs: Vec<PromptEntry>,
    /// Disaggregated: prompt tokens the prefill worker found in its prefix cache.
    pub cached_tokens: u32,
    /// KV blocks moved from the prefill worker to the decode worker (0 aggregated).
    pub kv_blocks: u32,
    /// Prompt tokens whose KV the decode worker's prefix cache already held, so they were
    /// not moved (disaggregated) or not computed (run on the decode worker).
    pub decode_cached_tokens: u32,
    /// Of `cached_tokens`, those the prefill worker read back from the decode worker's cached
    /// prefix for this request instead of computing them (0 aggregated).
    pub prefill_pulled_tokens: u32,
}

/// One prompt token's logprob given the tokens before it (see `tandem-engine`'s
/// `PromptLogprob`: the raw model output).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptEntry {
    pub logprob: f32,
    /// 1-based rank in the vocabulary.
    pub rank: u32,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// A worker's prompt logprobs, kept only as far as the request allows: one per prompt token
/// after the first, as many alternatives as asked (a worker's extras are dropped).
pub(super) fn prompt_entries(
    req: &FlowRequest,
    wire: Vec<tandem_proto::v1::PromptLogprob>,
) -> Vec<PromptEntry> {
    let Some(k) = req.sampling.prompt_logprobs else {
        return Vec::new();
    };
    wire.into_iter()
        .take(req.prompt.len().saturating_sub(1))
        .map(|e| PromptEntry {
            logprob: e.logprob,
            rank: e.rank,
            top_logprobs: e
                .top_logprobs
                .into_iter()
                .take(k as usize)
                .map(|t| (t.id, t.logprob))
                .collect(),
        })
        .collect()
}

/// The name of a transport in headers and usage (`shm`, `tcp`, `grpc`, `cuda-ipc`, `nccl`,
/// or `none`).
pub fn transport_name(t: Option<Transport>) -> &'static str {
    match t {
        Some(Transport::Shm) => "shm",
        Some(Transport::Tcp) => "tcp",
        Some(Transport::Grpc) => "grpc",
        Some(Transport::CudaIpc) => "cuda-ipc",
        Some(Transport::Nccl) => "nccl",
        Some(Transport::Unspecified) | None => "none",
    }
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    /// Which of the request's choices it belongs to.
    pub choice: u32,
    pub id: u32,
    pub text: String,
    pub logprob: f32,
    pub index: u32,
    pub special: bool,
    /// The most likely tokens at this position, most likely first (as many as the request's
    /// `top_logprobs`, never more: a worker's extra ones are dropped).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The end of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishOut {
    /// The choice that ended.
    pub choice: u32,
    /// Whether it was the request's last choice to end (the stream ends after it).
    pub last: bool,
    /// `Stop` covers EOS, stop tokens and stop strings; `Length` is max_tokens.
    pub reason: FinishReason,
    pub prompt_tokens: u32,
    /// This choice's tokens.
    pub completion_tokens: u32,
    /// The tokens of every choice that has ended so far (all of them on the last finish).
    pub total_completion_tokens: u32,
    pub kv_bytes: u64,
    pub transport: Option<Transport>,
    /// Prompt tokens whose KV came from a prefix cache (not computed).
    pub cached_tokens: u32,
    /// See [`Head::kv_blocks`].
    pub kv_blocks: u32,
    /// See [`Head::decode_cached_tokens`].
    pub decode_cached_tokens: u32,
    /// See [`Head::prefill_pulled_tokens`].
    pub prefill_pulled_tokens: u32,
}

/// What the HTTP layer receives after the head.
#[derive(Debug)]
pub enum FlowEvent {
    /// A token; the finish rides along when this token is known to be the last.
    Token(TokenOut, Option<FinishOut>),
    /// The finish, when it could not ride on the last token.
    Finished(FinishOut),
    /// The generation broke after the head was sent: end the stream with this error.
    Failed(ApiError),
}

//! The vocabulary the scheduler, a sequence and the compute backends share: a sequence's id,
//! why it ended, what one step produced for it, and which positions a pass wrote. A leaf:
//! it imports nothing from the engine, so the compute seam (`backend`) and `sequence` depend
//! on these words and not on the scheduler.

use serde::{Deserialize, Serialize};
use tandem_kv::BLOCK_SIZE;

use crate::sampling::PromptLogprob;

/// Identifies a sequence inside one engine.
pub type SeqId = u64;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// max_tokens, or the context is full.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One generated token of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    pub id: SeqId,
    /// The request it answers (the id its `add_*` call returned) and which of its choices.
    pub request: SeqId,
    pub choice: u32,
    pub token: u32,
    /// As the sampling module defines it.
    pub logprob: f32,
    /// The request's `top_logprobs` most likely tokens, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// On choice 0's first token, when the request asked: one entry per prompt token from
    /// the second on (empty when the prompt ran elsewhere).
    pub prompt_logprobs: Vec<PromptLogprob>,
    /// Prompt tokens whose KV came from the prefix cache when the prompt ran here.
    pub cached_tokens: usize,
    /// Text this token completes (may be empty, never half a character).
    pub text: String,
    /// Set on the sequence's last token; its blocks are already free.
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What a per-layer callback learns: which positions of which sequences now have this
/// layer's KV in the cache.
#[derive(Debug, Clone)]
pub struct ChunkInfo {
    pub id: SeqId,
    pub start_pos: usize,
    pub len: usize,
    /// The sequence's block table (covers at least `start_pos + len` tokens).
    pub blocks: Vec<u32>,
}

impl ChunkInfo {
    /// Logical block indices this chunk wrote into (the last may be partly filled).
    pub fn logical_blocks(&self) -> std::ops::Range<usize> {
        self.start_pos / BLOCK_SIZE..(self.start_pos + self.len).div_ceil(BLOCK_SIZE)
    }
}

//! What one request may ask for: the one definition of these bounds. The router refuses
//! anything outside them itself, naming the field, before a worker sees it; the workers'
//! engines check requests against the same constants, and the transports size the wire
//! headers of a commit by them.
//!
//! A crate of its own, with no dependencies, so that the engine takes these bounds without
//! taking the gRPC stack; `tandem_proto::limits` re-exports it for the plane's crates.

/// `temperature` at most (0 is greedy).
pub const MAX_TEMPERATURE: f32 = 100.0;
/// `repetition_penalty` at most (it must also be > 0).
pub const MAX_REPETITION_PENALTY: f32 = 10.0;
/// Stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;
/// Bytes (UTF-8) per stop string.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// `stop_token_ids` per request.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// `presence_penalty` and `frequency_penalty` in [-MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY].
pub const MAX_OPENAI_PENALTY: f32 = 2.0;
/// `logit_bias` entries per request.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// A `logit_bias` value in [-MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE].
pub const MAX_LOGIT_BIAS_VALUE: f32 = 100.0;
/// Alternatives reported per token (`top_logprobs`, completions' `logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Choices per request (`n`, `best_of`): they share the prompt's KV.
pub const MAX_CHOICES: usize = 16;
/// Bytes of a lease capability.
pub const LEASE_TOKEN_BYTES: usize = 16;

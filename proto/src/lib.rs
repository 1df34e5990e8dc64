//! tandem's wire contract: the gRPC services of the prefill and decode workers and the KV
//! transfer messages (package `tandem.v1`), generated at build time from `proto/`.
//!
//! Versioned by package name; `PROTOCOL_VERSION` is exchanged at handshake so a router never
//! pairs workers that speak different revisions.

/// Bumped on any incompatible change to the messages or the raw TCP framing.
/// 2: leases are 128-bit capabilities; KV destinations name the decode worker, not addresses;
/// the raw TCP hello answers the listener's challenge.
/// 3: the first token travels with its top logprobs (a longer raw TCP commit header); prefill
/// requests carry the stop parameters (min_tokens).
/// 4: requests may ask for `n` choices: their first tokens travel together (another raw TCP
/// commit header), token and finish events name their choice; and for prompt logprobs.
/// 5: prefix caching across the plane: load reports carry block events, a decode worker's
/// lease skips the blocks its cache holds (`first_block`), and may run a short uncached
/// suffix itself (`LocalPrefill`).
/// 6: a prefill worker reads back the part of a lease's cached prefix it lacks
/// (`DecodeService.PullKv`) instead of recomputing it.
pub const PROTOCOL_VERSION: u32 = 6;

/// What one request may ask for: the one definition of these bounds. The router refuses
/// anything outside them itself, naming the field, before a worker sees it; the workers'
/// engines check requests against the same constants, and the transports size the wire
/// headers of a commit by them.
pub mod limits {
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
}

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tandem.v1");
}

pub use v1::*;

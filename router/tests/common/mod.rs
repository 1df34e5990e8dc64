//! Test harness: scripted fake prefill and decode workers (real tonic servers on
//! 127.0.0.1:0, each on its own thread and runtime so that `kill` drops every connection as a
//! crashed process would), and an in-process router on a pre-bound listener.
//!
//! `fake_decode` and `fake_prefill` are the scripted workers and `servers` serves them;
//! `harness` starts routers (in process, or the binary); `http` is the tests' client side.
//! This file holds what they share: the fake model, its tokenizer, and the prompt logprobs
//! both fakes report.

#![allow(dead_code)]

mod fake_decode;
mod fake_prefill;
mod harness;
mod http;
mod servers;

pub use fake_decode::*;
pub use fake_prefill::*;
pub use harness::*;
pub use http::*;
pub use servers::*;

use std::sync::Mutex;

use tandem_proto::v1::{PromptLogprob, SamplingParams, TopLogprob};
use tandem_text::TextTokenizer;

pub const MODEL: &str = "fake-model";
pub const CONTEXT: u32 = 128;
pub const KV_BYTES: u64 = 4096;
pub const KV_TCP_PORT: u32 = 7301;
/// EOS of the byte-level test tokenizer (`<|im_end|>`).
pub const EOS: u32 = 2;

/// The test tokenizer: one token per byte, id = 3 + byte.
pub fn tokenizer() -> TextTokenizer {
    TextTokenizer::byte_level()
}

/// `(id, text)` per byte of `text`, as the fake decode worker streams them.
pub fn text_tokens(text: &str) -> Vec<(u32, String)> {
    text.bytes()
        .map(|b| (3 + u32::from(b), (b as char).to_string()))
        .collect()
}

/// Locks a test mutex, ignoring poisoning (a failed assertion elsewhere must not cascade).
pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the fakes report for prompt logprobs when asked: prompt token i (from 1) at
/// -0.1 × i, rank i, and one alternative more than asked (id + k at -0.1 × i - k).
pub fn fake_prompt_logprobs(
    prompt: &[u32],
    sampling: Option<&SamplingParams>,
) -> Vec<PromptLogprob> {
    let Some(k) = sampling.and_then(|s| s.prompt_logprobs) else {
        return Vec::new();
    };
    (1..prompt.len())
        .map(|i| PromptLogprob {
            logprob: -0.1 * i as f32,
            rank: i as u32,
            top_logprobs: (1..=k + 1)
                .map(|a| TopLogprob {
                    id: prompt[i] + a,
                    logprob: -0.1 * i as f32 - a as f32,
                })
                .collect(),
        })
        .collect()
}

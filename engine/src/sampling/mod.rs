//! Sampling parameters, their validation, and the sampler: logit bias, repetition,
//! presence and frequency penalties, tokens held back by `min_tokens`, greedy, temperature,
//! top-k, top-p, seeded randomness, and the log-probabilities reported with each token.
//!
//! The sampler draws exactly one random number per sampled token (none when greedy), so a
//! seeded request gives the same tokens whether its first token was sampled by a prefill
//! worker and the rest by a decode worker, or all by one engine.
//!
//! Reported log-probabilities are the log-softmax of the logits after the request's own
//! adjustments (its grammar's mask, logit bias, penalties, `min_tokens`) and before
//! temperature, top-k and top-p:
//! the distribution the request asks the model for, whatever randomness then picks from it.
//! So greedy always picks the top-1 reported token, and a token's logprob does not change
//! with the temperature. (vLLM's default reports the raw model output instead; OpenAI does
//! not say.)
//!
//! The bounds a request is checked against are `tandem_limits`, the ones the router
//! refuses first: one definition, so a request the router admits is never refused by a worker
//! for its parameters.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tandem_limits::{
    MAX_CHOICES, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_OPENAI_PENALTY, MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_BYTES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MAX_TOP_LOGPROBS,
};
use tandem_text::GuideSpec;

use crate::error::{EngineError, Result};

/// How to pick each next token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p; 1 disables.
    pub top_p: f32,
    /// Seed of the request's random stream; `None` draws one.
    pub seed: Option<u64>,
    /// HF-style penalty on tokens already in the prompt or output; 1 disables.
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids.
    pub logit_bias: Vec<(u32, f32)>,
    /// How many most likely tokens to report with each token (0: none).
    pub top_logprobs: usize,
    /// A grammar the output must match (structured output).
    pub guide: Option<GuideSpec>,
    /// Choices to generate from the one prompt (1..=MAX_CHOICES); choice `i` draws from the
    /// seed `seed + i` (see [`Sampler::for_choice`]).
    pub n: usize,
    /// Prompt logprobs with this many alternatives each (see [`PromptLogprob`]).
    pub prompt_logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            top_logprobs: 0,
            guide: None,
            n: 1,
            prompt_logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks every bound; `vocab` bounds the ids of `logit_bias`.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let bad = |param, reason: String| Err(EngineError::InvalidSampling { param, reason });
        for (param, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !value.is_finite() || value.abs() > MAX_OPENAI_PENALTY {
                return bad(
                    param,
                    format!("{value} is not in [-{MAX_OPENAI_PENALTY}, {MAX_OPENAI_PENALTY}]"),
                );
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return bad("logit_bias", format!("at most {MAX_LOGIT_BIAS} entries"));
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab {
                return bad(
                    "logit_bias",
                    format!("{id} is outside the vocabulary of {vocab}"),
                );
            }
            if !bias.is_finite() || bias.abs() > MAX_LOGIT_BIAS_VALUE {
                return bad(
                    "logit_bias",
                    format!("{bias} is not in [-{MAX_LOGIT_BIAS_VALUE}, {MAX_LOGIT_BIAS_VALUE}]"),
                );
            }
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return bad(
                "top_logprobs",
                format!("{} is more than {MAX_TOP_LOGPROBS}", self.top_logprobs),
            );
        }
        if let Some(k) = self.prompt_logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return bad(
                "prompt_logprobs",
                format!("{k} is more than {MAX_TOP_LOGPROBS}"),
            );
        }
        if !(1..=MAX_CHOICES).contains(&self.n) {
            return bad("n", format!("{} is not in [1, {MAX_CHOICES}]", self.n));
        }
        if !self.temperature.is_finite() || !(0.0..=MAX_TEMPERATURE).contains(&self.temperature) {
            return bad(
                "temperature",
                format!("{} is not in [0, {MAX_TEMPERATURE}]", self.temperature),
            );
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return bad("top_p", format!("{} is not in (0, 1]", self.top_p));
        }
        if !self.repetition_penalty.is_finite()
            || self.repetition_penalty <= 0.0
            || self.repetition_penalty > MAX_REPETITION_PENALTY
        {
            return bad(
                "repetition_penalty",
                format!(
                    "{} is not in (0, {MAX_REPETITION_PENALTY}]",
                    self.repetition_penalty
                ),
            );
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// When to stop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopParams {
    /// Generated tokens at most (≥ 1).
    pub max_tokens: usize,
    /// Extra token ids that end generation (the model's EOS ids are added unless ignore_eos).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; not included in the output.
    pub stop_strings: Vec<String>,
    /// Keep generating through EOS (benchmarks use it for fixed output lengths).
    pub ignore_eos: bool,
    /// No EOS, stop token or stop string ends generation before this many tokens.
    pub min_tokens: usize,
}

impl Default for StopParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
        }
    }
}

impl StopParams {
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let bad = |param, reason: String| Err(EngineError::InvalidSampling { param, reason });
        if self.max_tokens == 0 {
            return bad("max_tokens", "must be at least 1".into());
        }
        if self.min_tokens > self.max_tokens {
            return bad(
                "min_tokens",
                format!(
                    "{} is more than max_tokens ({})",
                    self.min_tokens, self.max_tokens
                ),
            );
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return bad(
                "stop_token_ids",
                format!("at most {MAX_STOP_TOKEN_IDS} stop token ids"),
            );
        }
        if let Some(id) = self.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
            return bad(
                "stop_token_ids",
                format!("{id} is outside the vocabulary of {vocab}"),
            );
        }
        if self.stop_strings.len() > MAX_STOP_STRINGS {
            return bad("stop", format!("at most {MAX_STOP_STRINGS} stop strings"));
        }
        if self
            .stop_strings
            .iter()
            .any(|s| s.len() > MAX_STOP_STRING_BYTES)
        {
            return bad(
                "stop",
                format!("stop strings are limited to {MAX_STOP_STRING_BYTES} bytes"),
            );
        }
        Ok(())
    }
}

/// The random stream of one request.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Self {
        Self::resumed(params, 0)
    }

    /// The sampler of choice `choice` of an `n > 1` request that has already sampled
    /// `tokens` tokens: seeded with `seed + choice` (each choice reproducible on its own,
    /// and choice 0 the same as an `n = 1` request), or from the OS without a seed.
    pub fn for_choice(params: &SamplingParams, choice: usize, tokens: usize) -> Self {
        let seed = params.seed.map(|s| s.wrapping_add(choice as u64));
        Self::seeded(seed, params.is_greedy(), tokens)
    }

    /// A sampler that has already sampled `tokens` tokens (continuing another engine's run).
    pub fn resumed(params: &SamplingParams, tokens: usize) -> Self {
        Self::seeded(params.seed, params.is_greedy(), tokens)
    }

    fn seeded(seed: Option<u64>, greedy: bool, tokens: usize) -> Self {
        let rng = match seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let mut s = Self { rng };
        if !greedy {
            for _ in 0..tokens {
                let _: f32 = s.rng.random();
            }
        }
        s
    }

    /// Picks the next token from `logits` (modified in place). `history` is the prompt
    /// followed by the tokens generated so far (`history[prompt_len..]`); `suppressed` ids
    /// cannot be picked (a stop token before `min_tokens`).
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        history: &[u32],
        prompt_len: usize,
        suppressed: &[u32],
    ) -> SampledToken {
        adjust_logits(logits, params, history, prompt_len, suppressed);
        let normalizer = log_normalizer(logits);
        let top_logprobs = top_n(logits, params.top_logprobs)
            .into_iter()
            .map(|id| (id, logits[id as usize] - normalizer))
            .collect();
        let token = self.pick(logits, params);
        SampledToken {
            token,
            logprob: logits[token as usize] - normalizer,
            top_logprobs,
        }
    }

    /// Draws from the adjusted logits (greedy, or temperature, top-k and top-p).
    /// The temperature divides logit differences inside each `exp` (the order, and so top-k,
    /// does not depend on it), leaving `logits` as they were for the reported logprobs.
    fn pick(&mut self, logits: &[f32], params: &SamplingParams) -> u32 {
        if params.is_greedy() {
            return argmax(logits);
        }
        let inv_t = 1.0 / params.temperature;
        let mut candidates: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit_desc = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if params.top_k > 0 && params.top_k < candidates.len() {
            candidates.select_nth_unstable_by(params.top_k - 1, by_logit_desc);
            candidates.truncate(params.top_k);
        }
        if params.top_p < 1.0 {
            // Sorting 1024 is enough unless they do not reach top_p; then sort all.
            let head = 1024.min(candidates.len());
            if head < candidates.len() {
                candidates.select_nth_unstable_by(head - 1, by_logit_desc);
            }
            candidates[..head].sort_unstable_by(by_logit_desc);
            let max = logits[candidates[0] as usize];
            let total: f32 = candidates
                .iter()
                .map(|&c| ((logits[c as usize] - max) * inv_t).exp())
                .sum();
            let mut cum = 0.0;
            let mut keep = head;
            for (i, &c) in candidates[..head].iter().enumerate() {
                cum += ((logits[c as usize] - max) * inv_t).exp() / total;
                if cum >= params.top_p {
                    keep = i + 1;
                    break;
                }
            }
            if keep == head && head < candidates.len() && cum < params.top_p {
                candidates.sort_unstable_by(by_logit_desc);
                cum = 0.0;
                keep = candidates.len();
                for (i, &c) in candidates.iter().enumerate() {
                    cum += ((logits[c as usize] - max) * inv_t).exp() / total;
                    if cum >= params.top_p {
                        keep = i + 1;
                        break;
                    }
                }
            }
            candidates.truncate(keep);
        } else {
            candidates.sort_unstable();
        }
        let max = candidates
            .iter()
            .map(|&c| logits[c as usize])
            .fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = candidates
            .iter()
            .map(|&c| ((logits[c as usize] - max) * inv_t).exp())
            .collect();
        let total: f32 = weights.iter().sum();
        let u: f32 = self.rng.random::<f32>() * total;
        let mut acc = 0.0;
        let mut chosen = candidates[candidates.len() - 1];
        for (&c, &w) in candidates.iter().zip(&weights) {
            acc += w;
            if u < acc {
                chosen = c;
                break;
            }
        }
        chosen
    }
}

/// One sampled token, with its log-probability and the most likely tokens at its position
/// (most likely first, the lower id first on a tie), as the module doc defines them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SampledToken {
    pub token: u32,
    pub logprob: f32,
    pub top_logprobs: Vec<(u32, f32)>,
}

impl SampledToken {
    /// A token without alternatives.
    pub fn new(token: u32, logprob: f32) -> Self {
        Self {
            token,
            logprob,
            top_logprobs: Vec::new(),
        }
    }
}

/// The request's own changes to the model's logits, in a fixed order: logit bias, the
/// repetition penalty (prompt and output), presence and frequency penalties (output only),
/// and the suppressed ids last so that no bias brings them back.
fn adjust_logits(
    logits: &mut [f32],
    params: &SamplingParams,
    history: &[u32],
    prompt_len: usize,
    suppressed: &[u32],
) {
    for &(id, bias) in &params.logit_bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += bias;
        }
    }
    if params.repetition_penalty != 1.0 {
        apply_repetition_penalty(logits, history, params.repetition_penalty);
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in history.get(prompt_len..).unwrap_or(&[]) {
            *counts.entry(t).or_default() += 1;
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.presence_penalty + params.frequency_penalty * n as f32;
            }
        }
    }
    for &id in suppressed {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// log Σ exp(logits): a token's logprob is its logit minus this.
fn log_normalizer(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return 0.0;
    }
    max + crate::backend::cpu::kernels::sum_exp(logits, max).ln()
}

/// A prompt token's logprob given the tokens before it, from the model's raw logits (no
/// request adjustments apply to a prompt), with its 1-based rank in the vocabulary (ties
/// rank the lower id first) and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprob {
    pub logprob: f32,
    pub rank: u32,
    pub top_logprobs: Vec<(u32, f32)>,
}

impl PromptLogprob {
    /// The entry for `token` from the logits `row` of the position before it.
    pub fn of(row: &[f32], token: u32, top: usize) -> Self {
        let normalizer = log_normalizer(row);
        let own = row
            .get(token as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY);
        let above = row
            .iter()
            .enumerate()
            .filter(|&(i, &v)| v > own || (v == own && (i as u32) < token))
            .count();
        Self {
            logprob: own - normalizer,
            rank: u32::try_from(above + 1).unwrap_or(u32::MAX),
            top_logprobs: top_n(row, top)
                .into_iter()
                .map(|id| (id, row[id as usize] - normalizer))
                .collect(),
        }
    }
}

/// The ids of the `n` largest logits, largest first (the lower id first on a tie).
fn top_n(logits: &[f32], n: usize) -> Vec<u32> {
    let mut top: Vec<u32> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (i, &v) in logits.iter().enumerate() {
        if top.len() == n && v <= logits[top[n - 1] as usize] {
            continue;
        }
        // Strictly greater goes first, so an equal logit stays behind the lower id.
        let at = top.partition_point(|&t| logits[t as usize] >= v);
        top.insert(at, i as u32);
        top.truncate(n);
    }
    top
}

fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    let mut seen = vec![false; logits.len()];
    for &t in history {
        if let Some(flag) = seen.get_mut(t as usize)
            && !*flag
        {
            *flag = true;
            let l = &mut logits[t as usize];
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// Index of the largest logit; the lowest index wins a tie, so greedy is deterministic.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests;

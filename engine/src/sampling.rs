//! Sampling parameters, their validation, and the sampler: repetition penalty, greedy,
//! temperature, top-k, top-p, seeded randomness.
//!
//! The sampler draws exactly one random number per sampled token (none when greedy), so a
//! seeded request gives the same tokens whether its first token was sampled by a prefill
//! worker and the rest by a decode worker, or all by one engine.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |param, reason: String| Err(EngineError::InvalidSampling { param, reason });
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
}

impl Default for StopParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// Bounds that keep one request from costing the server unbounded work per token. (The
/// router refuses the same bounds first: `tandem-worker` tests that they agree with
/// `tandem_proto::limits`.)
pub const MAX_STOP_STRINGS: usize = 16;
/// Bytes per stop string.
pub const MAX_STOP_STRING_LEN: usize = 256;
pub const MAX_STOP_TOKEN_IDS: usize = 64;
pub const MAX_TEMPERATURE: f32 = 100.0;
pub const MAX_REPETITION_PENALTY: f32 = 10.0;

impl StopParams {
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let bad = |param, reason: String| Err(EngineError::InvalidSampling { param, reason });
        if self.max_tokens == 0 {
            return bad("max_tokens", "must be at least 1".into());
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
            .any(|s| s.len() > MAX_STOP_STRING_LEN)
        {
            return bad(
                "stop",
                format!("stop strings are limited to {MAX_STOP_STRING_LEN} bytes"),
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
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        Self { rng }
    }

    /// A sampler that has already sampled `tokens` tokens (continuing another engine's run).
    pub fn resumed(params: &SamplingParams, tokens: usize) -> Self {
        let mut s = Self::new(params);
        if !params.is_greedy() {
            for _ in 0..tokens {
                let _: f32 = s.rng.random();
            }
        }
        s
    }

    /// Picks the next token from `logits` (modified in place). Returns the token and its
    /// log-probability under the distribution it was drawn from.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        history: &[u32],
    ) -> (u32, f32) {
        if params.repetition_penalty != 1.0 {
            apply_repetition_penalty(logits, history, params.repetition_penalty);
        }
        if params.is_greedy() {
            let token = argmax(logits);
            return (token, log_softmax_at(logits, token as usize));
        }
        let inv_t = 1.0 / params.temperature;
        for l in logits.iter_mut() {
            *l *= inv_t;
        }
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
                .map(|&c| (logits[c as usize] - max).exp())
                .sum();
            let mut cum = 0.0;
            let mut keep = head;
            for (i, &c) in candidates[..head].iter().enumerate() {
                cum += (logits[c as usize] - max).exp() / total;
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
                    cum += (logits[c as usize] - max).exp() / total;
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
            .map(|&c| (logits[c as usize] - max).exp())
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
        let logprob =
            (weights[candidates.iter().position(|&c| c == chosen).unwrap_or(0)] / total).ln();
        (chosen, logprob)
    }
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

fn log_softmax_at(logits: &[f32], i: usize) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = crate::backend::cpu::kernels::sum_exp(logits, max);
    logits[i] - max - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(seed),
            repetition_penalty: 1.0,
        }
    }

    #[test]
    fn greedy_picks_the_max_and_first_of_ties() {
        let mut s = Sampler::new(&SamplingParams::greedy());
        let (t, lp) = s.sample(&mut [0.1, 3.0, 3.0, -1.0], &SamplingParams::greedy(), &[]);
        assert_eq!(t, 1);
        assert!(lp < 0.0 && lp > -1.0);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0, 4.0, 1.0, 0.5, 0.1, -3.0];
        for seed in 0..200 {
            let p = params(1.0, 2, 1.0, seed);
            let (t, _) = Sampler::new(&p).sample(&mut logits.clone(), &p, &[]);
            assert!(t < 2, "top_k=2 gave {t}");
            let p = params(1.0, 0, 0.5, seed);
            let (t, _) = Sampler::new(&p).sample(&mut logits.clone(), &p, &[]);
            assert_eq!(t, 0, "top_p=0.5 keeps only the first (p≈0.71)");
        }
    }

    #[test]
    fn seeds_reproduce_and_resume() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(1.0, 0, 1.0, 42);
        let run = |mut s: Sampler, n: usize| -> Vec<u32> {
            (0..n)
                .map(|_| s.sample(&mut logits.clone(), &p, &[]).0)
                .collect()
        };
        let a = run(Sampler::new(&p), 10);
        assert_eq!(a, run(Sampler::new(&p), 10));
        assert_eq!(a[3..], run(Sampler::resumed(&p, 3), 7)[..]);
        assert_ne!(a, run(Sampler::new(&params(1.0, 0, 1.0, 43)), 10));
    }

    #[test]
    fn temperature_spreads_choices() {
        let logits = [1.0, 1.0, 1.0, 1.0];
        let p = params(1.0, 0, 1.0, 7);
        let mut s = Sampler::new(&p);
        let mut counts = [0; 4];
        for _ in 0..400 {
            counts[s.sample(&mut logits.clone(), &p, &[]).0 as usize] += 1;
        }
        assert!(counts.iter().all(|&c| c > 60), "{counts:?}");
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let p = SamplingParams {
            repetition_penalty: 4.0,
            ..SamplingParams::greedy()
        };
        let (t, _) = Sampler::new(&p).sample(&mut [2.0, 1.0, -1.0], &p, &[0, 0]);
        assert_eq!(t, 1, "2.0/4 < 1.0");
    }

    #[test]
    fn validation_rejects_out_of_range() {
        for bad in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(EngineError::InvalidSampling { .. })),
                "{bad:?}"
            );
        }
        assert!(SamplingParams::default().validate().is_ok());
        let stop = StopParams {
            max_tokens: 0,
            ..Default::default()
        };
        assert!(stop.validate(10).is_err());
        let stop = StopParams {
            stop_token_ids: vec![10],
            ..Default::default()
        };
        assert!(stop.validate(10).is_err());
        let stop = StopParams {
            stop_strings: vec!["x".repeat(300)],
            ..Default::default()
        };
        assert!(stop.validate(10).is_err());
    }
}

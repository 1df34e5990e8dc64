//! Calibration: a few passes of made-up work at start-up, timed, so that the cost model a
//! worker fits to its passes (`tandem_cost`) can price prompts and decode steps before the
//! first request has run, instead of after the first long prompt (which on a CPU takes
//! seconds, and until then a router placing by latency targets has nothing to go on). The
//! passes vary in shape (prompts of three lengths, one of them chunked where the token budget
//! is smaller; decode batches of one row and of several) so that the fit can tell its four
//! costs apart, which passes of a single shape cannot.
//!
//! The work leaves no trace: its blocks are not named in the prefix cache (a later prompt
//! must not find made-up tokens there), the counters are as before, and every sequence is
//! gone when it returns. A first pass warms the weights and the threads and is not reported:
//! the first pass after loading runs slower than any later one.

use std::time::{Duration, Instant};

use tandem_kv::BLOCK_SIZE;

use super::{Engine, StepShape};
use crate::error::Result;
use crate::sampling::{SamplingParams, StopParams};
use crate::types::SeqId;

/// Decode rows of the batched decode passes (fewer where the engine runs fewer at once).
const DECODE_BATCH: usize = 8;
/// Prompt length of the decode passes' sequences, and of the warm-up pass.
const SHORT_PROMPT: usize = 16;
/// Tokens each decode sequence generates: its first comes from the prompt's pass, the rest
/// are decode passes.
const DECODE_TOKENS: usize = 5;

/// What a calibration ran.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CalibrationRun {
    /// Passes reported (the warm-up not among them).
    pub passes: u64,
    /// Prompt tokens computed in them.
    pub prompt_tokens: u64,
    /// Wall time, warm-up included.
    pub elapsed: Duration,
}

impl Engine {
    /// Runs made-up work of about `prompt_tokens` prompt tokens and a few decode passes (see
    /// the module doc), calling `observe(shape, elapsed)` after each pass but the first.
    /// Stops adding work once `budget` has passed. Does nothing (and reports nothing) with
    /// `prompt_tokens` 0 or while real requests are queued or running.
    pub fn calibrate(
        &mut self,
        prompt_tokens: usize,
        budget: Duration,
        observe: &mut dyn FnMut(&StepShape, Duration),
    ) -> Result<CalibrationRun> {
        let started = Instant::now();
        if prompt_tokens == 0 || self.has_work() {
            return Ok(CalibrationRun::default());
        }
        let salt = self.prefix_salt.take();
        let stats = self.stats.clone();
        let mut report = CalibrationRun::default();
        let result = self.run_calibration(prompt_tokens, budget, started, observe, &mut report);
        // Whatever is left (an error, the budget spent) goes, and nothing of it stays counted.
        let left: Vec<SeqId> = self.seqs.values().map(|s| s.request).collect();
        for id in left {
            self.abort(id);
        }
        self.prefix_salt = salt;
        self.stats = stats;
        report.elapsed = started.elapsed();
        result.map(|()| report)
    }

    fn run_calibration(
        &mut self,
        prompt_tokens: usize,
        budget: Duration,
        started: Instant,
        observe: &mut dyn FnMut(&StepShape, Duration),
        report: &mut CalibrationRun,
    ) -> Result<()> {
        let longest = self.longest_calibration_prompt();
        if longest < SHORT_PROMPT {
            return Ok(());
        }
        // The warm-up, unreported.
        self.add_made_up(SHORT_PROMPT, 2, 0)?;
        while self.has_work() {
            self.step()?;
        }
        let batch = DECODE_BATCH.min(self.config.max_running).max(1);
        let mut groups: Vec<(usize, usize, usize)> = vec![(1, SHORT_PROMPT, DECODE_TOKENS)];
        if batch > 1 {
            groups.push((batch, SHORT_PROMPT, DECODE_TOKENS));
        }
        // Three prompt lengths that add up to the tokens asked for (each at most what the pool
        // and the context hold), one output token each: about 1/8, 1/4 and the rest.
        let eighth = (prompt_tokens / 8).clamp(SHORT_PROMPT, longest);
        let quarter = (prompt_tokens / 4).clamp(SHORT_PROMPT, longest);
        let rest = prompt_tokens
            .saturating_sub(eighth + quarter)
            .clamp(SHORT_PROMPT, longest);
        groups.extend([(1, eighth, 1), (1, quarter, 1), (1, rest, 1)]);
        for (group, (count, len, tokens)) in groups.into_iter().enumerate() {
            if started.elapsed() >= budget {
                break;
            }
            for i in 0..count {
                self.add_made_up(len, tokens, group * DECODE_BATCH + i + 1)?;
            }
            while self.has_work() && started.elapsed() < budget {
                let pass = Instant::now();
                self.step()?;
                let elapsed = pass.elapsed();
                let shape = self.last_pass;
                report.passes += 1;
                report.prompt_tokens += shape.other_tokens as u64;
                observe(&shape, elapsed);
            }
        }
        Ok(())
    }

    /// The longest made-up prompt the pool and the context hold with room to spare (half
    /// the free blocks: a decode worker's pool is never filled by it).
    fn longest_calibration_prompt(&self) -> usize {
        let by_pool = (self.free_blocks() / 2).saturating_mul(BLOCK_SIZE);
        let by_context = self.context_len().saturating_sub(DECODE_TOKENS + 1);
        by_pool.min(by_context).saturating_sub(BLOCK_SIZE)
    }

    /// Queues a made-up prompt of `len` tokens generating `tokens`, its token ids spread over
    /// the vocabulary by `seed` (distinct prompts: no pass runs the same rows twice).
    fn add_made_up(&mut self, len: usize, tokens: usize, seed: usize) -> Result<SeqId> {
        let vocab = self.model.config().vocab_size.max(1);
        let prompt = (0..len)
            .map(|i| ((i.wrapping_mul(7919) + seed.wrapping_mul(104_729) + 1) % vocab) as u32)
            .collect();
        let stop = StopParams {
            max_tokens: tokens.max(1),
            ignore_eos: true,
            ..StopParams::default()
        };
        self.add_request(prompt, SamplingParams::greedy(), stop)
    }
}

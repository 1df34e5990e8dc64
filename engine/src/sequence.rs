//! One request's state inside an engine: its tokens, how many of them have KV in the cache,
//! its blocks, and the text-side state (detokenizer, stop strings) that turns sampled tokens
//! into output deltas and finish reasons. The choices of an `n > 1` request are sequences of
//! their own that name the request (its choice 0's id).

use tandem_text::{Allowed, Guide, IncrementalDetokenizer, StopStringMatcher, TextTokenizer};

use crate::sampling::{PromptLogprob, SampledToken, Sampler, SamplingParams, StopParams};
use crate::types::{FinishReason, SeqId, StepOutput};

#[derive(Debug)]
pub(crate) struct Sequence {
    pub id: SeqId,
    /// The request this sequence answers: its own id for choice 0, choice 0's for the others.
    pub request: SeqId,
    /// Which of the request's `sampling.n` choices this is.
    pub choice: u32,
    /// The prompt followed by every generated token.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose KV is in the cache.
    pub computed: usize,
    pub blocks: Vec<u32>,
    pub sampling: SamplingParams,
    pub stop: StopParams,
    pub sampler: Sampler,
    /// Token ids that end generation (EOS unless ignored, plus the request's own).
    pub stop_ids: Vec<u32>,
    detok: IncrementalDetokenizer,
    stop_matcher: StopStringMatcher,
    /// Times this sequence lost its blocks and was recomputed.
    pub preemptions: u32,
    /// The grammar the output must match, following every token pushed.
    pub guide: Option<Guide>,
    /// Prompt logprobs computed so far (from the second prompt token on), handed out with
    /// the first generated token.
    pub prompt_logprobs: Vec<PromptLogprob>,
    /// Whether they went out (recomputing the prompt after a preemption does not redo them).
    pub prompt_logprobs_sent: bool,
    /// The prefix-cache names of its full blocks so far (`tandem_kv::prefix`).
    pub block_names: Vec<tandem_kv::BlockHash>,
    /// Prompt tokens whose KV came from the prefix cache at admission.
    pub cached_tokens: usize,
    /// Whether it may take a cached prefix at admission instead of computing it (not when a
    /// device engine ships its KV over a host transport: the host then holds only what a
    /// pass writes).
    pub may_reuse_prefix: bool,
}

impl Sequence {
    pub fn new(
        id: SeqId,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        stop: StopParams,
        eos: &[u32],
        sampler: Sampler,
    ) -> Self {
        let mut stop_ids = stop.stop_token_ids.clone();
        if !stop.ignore_eos {
            stop_ids.extend_from_slice(eos);
        }
        let detok = IncrementalDetokenizer::new(&prompt, true);
        let stop_matcher = StopStringMatcher::new(&stop.stop_strings);
        Self {
            id,
            request: id,
            choice: 0,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks: Vec::new(),
            sampling,
            stop,
            sampler,
            stop_ids,
            detok,
            stop_matcher,
            preemptions: 0,
            guide: None,
            prompt_logprobs: Vec::new(),
            prompt_logprobs_sent: false,
            block_names: Vec::new(),
            cached_tokens: 0,
            may_reuse_prefix: true,
        }
    }

    /// Whether the prompt's logprobs are still to be computed (choice 0 reports them).
    pub fn wants_prompt_logprobs(&self) -> bool {
        self.choice == 0 && self.sampling.prompt_logprobs.is_some() && !self.prompt_logprobs_sent
    }

    /// Choice `choice` of this sequence's request, before its first token: the same prompt,
    /// parameters and grammar state (copied), its own `sampler`, no blocks yet.
    pub fn choice_of(&self, id: SeqId, choice: u32, sampler: Sampler) -> Self {
        let prompt = self.tokens[..self.prompt_len].to_vec();
        let mut child = Sequence::new(
            id,
            prompt,
            self.sampling.clone(),
            self.stop.clone(),
            &[],
            sampler,
        )
        .with_guide(self.guide.as_ref().map(Guide::copy));
        child.stop_ids = self.stop_ids.clone();
        child.request = self.request;
        child.choice = choice;
        child.prompt_logprobs_sent = true;
        child.may_reuse_prefix = self.may_reuse_prefix;
        child
    }

    /// Whether this sequence is about to take its request's first token and must start the
    /// request's other choices from the same logits.
    pub fn forks_now(&self) -> bool {
        self.choice == 0 && self.sampling.n > 1 && self.generated() == 0
    }

    /// The sequence with a grammar to follow.
    pub fn with_guide(mut self, guide: Option<Guide>) -> Self {
        self.guide = guide;
        self
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Samples the next token from this sequence's logits row; until `min_tokens` are
    /// generated its stop ids cannot be picked. A grammar's `allowed` set, computed while the
    /// forward pass ran, is applied (or computed now when not given).
    pub fn sample(&mut self, logits: &mut [f32], allowed: Option<Allowed>) -> SampledToken {
        let allowed = match (allowed, &mut self.guide) {
            (Some(a), _) => Some(Ok(a)),
            (None, Some(guide)) => Some(guide.allowed()),
            (None, None) => None,
        };
        match allowed {
            Some(Ok(a)) => a.apply(logits),
            // The token then fails to advance the guide, which ends the sequence.
            Some(Err(e)) => {
                tracing::error!(seq = self.id, error = %e, "the grammar could not mask the logits")
            }
            None => {}
        }
        let suppressed: &[u32] = if self.generated() < self.stop.min_tokens {
            &self.stop_ids
        } else {
            &[]
        };
        self.sampler.sample(
            logits,
            &self.sampling,
            &self.tokens,
            self.prompt_len,
            suppressed,
        )
    }

    /// Appends a sampled token and works out what the client sees and whether it ends here.
    pub fn push_token(
        &mut self,
        sampled: SampledToken,
        tokenizer: &TextTokenizer,
        context: usize,
    ) -> StepOutput {
        let SampledToken {
            token,
            logprob,
            top_logprobs,
        } = sampled;
        self.tokens.push(token);
        let mut finish = None;
        let mut text = String::new();
        // Before `min_tokens`, stop strings do not apply (and stop ids were suppressed).
        let may_stop = self.generated() > self.stop.min_tokens;
        // A complete grammar ends the sequence like a stop (its last token's text is kept);
        // a token the grammar refuses ends it too, loudly.
        let grammar_done = self.guide.as_mut().is_some_and(|g| {
            g.advance(token).map_or_else(
                |e| {
                    tracing::error!(seq = self.id, error = %e, "the grammar refused a token");
                    true
                },
                |()| g.is_finished(),
            )
        });
        if self.stop_ids.contains(&token) {
            finish = Some(FinishReason::Stop);
            text.push_str(&self.flush(tokenizer, false));
        } else {
            let delta = self.detok.push(tokenizer, token).unwrap_or_else(|e| {
                tracing::warn!(seq = self.id, error = %e, "detokenization failed");
                String::new()
            });
            let stopped = if may_stop {
                let m = self.stop_matcher.push(&delta);
                text.push_str(&m.emit);
                m.stopped.is_some()
            } else {
                text.push_str(&delta);
                false
            };
            if stopped {
                finish = Some(FinishReason::Stop);
            } else if grammar_done {
                finish = Some(FinishReason::Stop);
                text.push_str(&self.flush(tokenizer, true));
            } else if self.generated() >= self.stop.max_tokens || self.tokens.len() >= context {
                finish = Some(FinishReason::Length);
                text.push_str(&self.flush(tokenizer, true));
            }
        }
        let prompt_logprobs = if self.prompt_logprobs_sent {
            Vec::new()
        } else {
            self.prompt_logprobs_sent = true;
            std::mem::take(&mut self.prompt_logprobs)
        };
        StepOutput {
            id: self.id,
            request: self.request,
            choice: self.choice,
            prompt_logprobs,
            cached_tokens: self.cached_tokens,
            token,
            logprob,
            top_logprobs,
            text,
            finish,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
        }
    }

    /// Text still held by the detokenizer and the stop matcher at the end of generation.
    fn flush(&mut self, tokenizer: &TextTokenizer, include_detok: bool) -> String {
        let mut out = String::new();
        if include_detok {
            let rest = self.detok.finish(tokenizer).unwrap_or_default();
            let m = self.stop_matcher.push(&rest);
            out.push_str(&m.emit);
            if m.stopped.is_some() {
                return out;
            }
        }
        out.push_str(&self.stop_matcher.finish());
        out
    }
}

//! Admission: checking a request against the model and the pool, and queueing it. The checks
//! are free functions as well, because a decode worker runs them (and computes a first
//! token's output) on its own threads without waiting for the engine's.

use tandem_kv::blocks_for;
use tandem_text::{Guide, TextTokenizer};

use super::Engine;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::guides::compile_guide;
use crate::sampling::{SampledToken, Sampler, SamplingParams, StopParams};
use crate::sequence::Sequence;
use crate::types::{SeqId, StepOutput};

impl Engine {
    /// Checks a request against the model and the pool; the typed errors map to 4xx.
    pub fn validate_request(
        &self,
        prompt: &[u32],
        sampling: &SamplingParams,
        stop: &StopParams,
    ) -> Result<()> {
        validate_request(
            self.model.config(),
            self.pool().total(),
            prompt,
            sampling,
            stop,
        )
    }

    /// Queues a request; it runs in the coming steps.
    pub fn add_request(
        &mut self,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        stop: StopParams,
    ) -> Result<SeqId> {
        self.add_request_guided(prompt, sampling, stop, None)
    }

    /// [`Engine::add_request`] with the request's grammar already compiled (by [`compile_guide`],
    /// off the engine's thread); `None` compiles it here if the request has one.
    pub fn add_request_guided(
        &mut self,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        stop: StopParams,
        guide: Option<Guide>,
    ) -> Result<SeqId> {
        self.validate_request(&prompt, &sampling, &stop)?;
        let guide = self.guide_for(&sampling, guide)?;
        let id = self.allocate_id();
        let sampler = Sampler::new(&sampling);
        let mut seq =
            Sequence::new(id, prompt, sampling, stop, &self.eos, sampler).with_guide(guide);
        if let Some(salt) = self.prefix_salt {
            // Named now, so the queue's load can leave out what the cache holds.
            tandem_kv::prefix::extend_hashes(salt, &seq.tokens, &mut seq.block_names);
        }
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(id)
    }

    /// The compiled guide a request runs with: the given one, else compiled now.
    pub(super) fn guide_for(
        &self,
        sampling: &SamplingParams,
        given: Option<Guide>,
    ) -> Result<Option<Guide>> {
        match (&sampling.guide, given) {
            (None, _) => Ok(None),
            (Some(_), Some(guide)) => Ok(Some(guide)),
            (Some(spec), None) => compile_guide(&self.guides, spec).map(Some),
        }
    }
}

/// Checks a request against a model and a pool of `total_blocks` blocks: what every entry
/// point (engine, worker RPC) refuses before any work is queued.
pub fn validate_request(
    cfg: &ModelConfig,
    total_blocks: usize,
    prompt: &[u32],
    sampling: &SamplingParams,
    stop: &StopParams,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if let Some(&id) = prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(EngineError::UnknownToken {
            id,
            vocab: cfg.vocab_size,
        });
    }
    sampling.validate(cfg.vocab_size)?;
    stop.validate(cfg.vocab_size)?;
    let context = cfg.max_position_embeddings;
    if prompt.len() + stop.max_tokens > context {
        return Err(EngineError::ContextExceeded {
            prompt: prompt.len(),
            max_tokens: stop.max_tokens,
            context,
        });
    }
    let needed = blocks_for(prompt.len() + 1);
    if needed > total_blocks {
        return Err(EngineError::SequenceTooLong {
            needed,
            total: total_blocks,
        });
    }
    Ok(())
}

/// The output a first token sampled elsewhere produces (text delta, finish), computed the way
/// [`Engine::add_prefilled`] will, but without an engine: a decode worker streams it the
/// moment the KV commit arrives instead of waiting for the current forward pass to end.
/// `guide` is the request's grammar, compiled and not yet advanced, if it has one.
pub fn first_token_output(
    tokenizer: &TextTokenizer,
    context: usize,
    prompt: &[u32],
    first: SampledToken,
    sampling: &SamplingParams,
    stop: &StopParams,
    guide: Option<Guide>,
) -> StepOutput {
    let eos = tokenizer.info().eos_token_ids.clone();
    let mut seq = Sequence::new(
        0,
        prompt.to_vec(),
        sampling.clone(),
        stop.clone(),
        &eos,
        Sampler::resumed(sampling, 0),
    )
    .with_guide(guide);
    seq.computed = seq.prompt_len;
    seq.push_token(first, tokenizer, context)
}

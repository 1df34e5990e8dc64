//! The choices of an `n > 1` request: when choice 0 samples its first token, choices 1..
//! sample theirs from the same logits and grammar mask and become sequences of their own
//! that share the prompt's full blocks and get a copy of its last, partly filled one.

use tandem_kv::{BLOCK_SIZE, FREED_BLOCK};
use tandem_text::Allowed;

use super::Engine;
use crate::sampling::{SampledToken, Sampler};
use crate::sequence::Sequence;
use crate::types::{SeqId, StepOutput};

impl Engine {
    /// Starts choices 1.. of the request whose choice 0 (`parent`) is about to sample its
    /// first token from `row`: each samples its own from the same logits and grammar mask.
    pub(super) fn fork_choices(
        &mut self,
        parent: SeqId,
        row: &[f32],
        allowed: Option<&Allowed>,
    ) -> Vec<StepOutput> {
        let Some(seq) = self.seqs.get(&parent) else {
            return Vec::new();
        };
        let (n, blocks) = (seq.sampling.n, seq.blocks.clone());
        let mut outputs = Vec::with_capacity(n - 1);
        for choice in 1..n {
            let child_id = self.allocate_id();
            let seq = &self.seqs[&parent];
            let sampler = Sampler::for_choice(&seq.sampling, choice, 0);
            let mut child = seq.choice_of(child_id, choice as u32, sampler);
            let mut logits = row.to_vec();
            let first = child.sample(&mut logits, allowed.cloned());
            outputs.push(self.admit_choice(child, first, &blocks));
        }
        outputs
    }

    /// Gives a new choice its first token and, unless that ends it, the prompt's KV from its
    /// request's choice 0 (`prompt_blocks`): the full blocks shared, the partly filled last
    /// one copied (or, where the backend cannot copy or no block is free, its tokens
    /// recomputed in a coming step).
    pub(super) fn admit_choice(
        &mut self,
        mut child: Sequence,
        first: SampledToken,
        prompt_blocks: &[u32],
    ) -> StepOutput {
        let out = child.push_token(first, &self.tokenizer, self.context_len());
        if out.finish.is_some() {
            return out;
        }
        let prompt_len = child.prompt_len;
        let full = (prompt_len / BLOCK_SIZE).min(prompt_blocks.len());
        let shared: Vec<u32> = prompt_blocks[..full]
            .iter()
            .copied()
            .filter(|&b| b != FREED_BLOCK)
            .collect();
        if let Err(e) = self.pool().share(&shared) {
            // A bookkeeping bug: the choice recomputes its prompt instead.
            tracing::error!(error = %e, "sharing a prompt's blocks failed");
            child.blocks.clear();
            child.computed = 0;
        } else {
            child.blocks = prompt_blocks[..full].to_vec();
            child.computed = full * BLOCK_SIZE;
            let last = prompt_blocks
                .get(full)
                .filter(|_| prompt_len > full * BLOCK_SIZE);
            let copy = last.and_then(|_| self.pool().allocate_one().ok());
            if let (Some(&last), Some(copy)) = (last, copy) {
                match self.backend.copy_block(&mut self.cache, last, copy) {
                    Ok(()) => {
                        child.blocks.push(copy);
                        child.computed = prompt_len;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "recomputing a shared prompt's last block");
                        self.free_blocks_of(vec![copy]);
                    }
                }
            }
            if full * BLOCK_SIZE == prompt_len {
                // No partly filled block: the next token starts a new one.
                child.computed = prompt_len;
            }
        }
        let id = child.id;
        self.seqs.insert(id, child);
        self.running.push(id);
        out
    }
}

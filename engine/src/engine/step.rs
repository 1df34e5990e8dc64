//! One forward pass, as four named phases: **plan** (the scheduler's pick, as the rows the
//! model computes), **masks** (the grammars of the sequences that sample this step),
//! **forward** (the backend runs the batch, with the masks computed beside it when the
//! device leaves the host's cores free), and **absorb** (each sequence advances, keeps its
//! prompt logprobs and samples its token).

use std::collections::HashMap;

use tandem_kv::{FREED_BLOCK, KvCache};
use tandem_text::{Allowed, Guide, TextError};

use super::schedule::Planned;
use super::{Engine, StepShape};
use crate::backend::{Batch, Logits};
use crate::error::Result;
use crate::model::SeqInput;
use crate::sampling::PromptLogprob;
use crate::types::{ChunkInfo, SeqId, StepOutput};

/// A planned chunk and which of its rows' logits the pass returns.
#[derive(Debug, Clone, Copy)]
struct Row {
    planned: Planned,
    /// The chunk ends the sequence's tokens: its last row samples.
    samples: bool,
    /// Every row that predicts a prompt token comes back too (prompt logprobs).
    all_rows: bool,
}

/// What a pass computes, for the cost fit: a chunk's rows that return logits count as
/// sampled rows (the head runs on them), the rest as other tokens.
fn pass_shape(rows: &[Row]) -> StepShape {
    rows.iter().fold(StepShape::default(), |shape, row| {
        let (start, len) = (row.planned.start as u64, row.planned.len as u64);
        let mut chunk = StepShape::chunk(start, len, row.samples);
        if row.all_rows {
            chunk.sampled_rows += chunk.other_tokens;
            chunk.other_tokens = 0.0;
        }
        shape.plus(chunk)
    })
}

/// A grammar taken from its sequence for the pass, with the mask it computed.
type Masked = (SeqId, Guide, std::result::Result<Allowed, TextError>);

impl Engine {
    /// One forward pass. Returns a token for every sequence that produced one.
    pub fn step(&mut self) -> Result<Vec<StepOutput>> {
        self.step_with(&mut |_, _, _| {})
    }

    /// One forward pass; `on_layer(layer, cache, chunks)` runs when each layer's KV is in the
    /// cache for every chunk of the batch (the hook for layer-by-layer KV transfer).
    pub fn step_with(
        &mut self,
        on_layer: &mut dyn FnMut(usize, &KvCache, &[ChunkInfo]),
    ) -> Result<Vec<StepOutput>> {
        let rows = self.plan();
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.last_pass = pass_shape(&rows);
        let guides = self.take_guides(&rows);
        let (logits, masked) = self.forward(&rows, guides, on_layer);
        let allowed = self.restore_guides(masked);
        let mut logits = logits?;
        self.stats.steps += 1;
        let outputs = self.absorb(&rows, &mut logits, allowed);
        self.backend.recycle_logits(logits);
        Ok(outputs)
    }

    /// Runs steps until request `id` finishes (every choice of it); returns its outputs
    /// (other sequences advance too).
    pub fn run_to_completion(&mut self, id: SeqId) -> Result<Vec<StepOutput>> {
        let mut mine = Vec::new();
        while self.seqs.values().any(|s| s.request == id) {
            for out in self.step()? {
                if out.request == id {
                    mine.push(out);
                }
            }
        }
        Ok(mine)
    }

    /// Plan: the scheduler's pick, with the logits each chunk needs.
    fn plan(&mut self) -> Vec<Row> {
        self.schedule()
            .into_iter()
            .map(|planned| {
                let seq = &self.seqs[&planned.id];
                let end = planned.start + planned.len;
                Row {
                    planned,
                    samples: end == seq.tokens.len(),
                    all_rows: seq.wants_prompt_logprobs() && planned.start + 1 < seq.prompt_len,
                }
            })
            .collect()
    }

    /// Masks, first half: the grammars of the sequences that sample this step leave their
    /// sequences while they compute their masks (which depend only on the tokens so far).
    fn take_guides(&mut self, rows: &[Row]) -> Vec<(SeqId, Guide)> {
        let mut guides = Vec::new();
        for row in rows.iter().filter(|r| r.samples) {
            if let Some(guide) = self
                .seqs
                .get_mut(&row.planned.id)
                .and_then(|seq| seq.guide.take())
            {
                guides.push((row.planned.id, guide));
            }
        }
        guides
    }

    /// Forward: the backend runs the batch. On a device the grammars compute their masks on
    /// a CPU thread while the device computes; on the CPU the forward pass already has every
    /// core and an extra thread only competes with it (measured: scripts/bench-structured),
    /// so they are computed first, in turn.
    fn forward(
        &mut self,
        rows: &[Row],
        guides: Vec<(SeqId, Guide)>,
        on_layer: &mut dyn FnMut(usize, &KvCache, &[ChunkInfo]),
    ) -> (Result<Logits>, Vec<Masked>) {
        let chunks: Vec<ChunkInfo> = rows
            .iter()
            .map(|r| ChunkInfo {
                id: r.planned.id,
                start_pos: r.planned.start,
                len: r.planned.len,
                blocks: self.seqs[&r.planned.id].blocks.clone(),
            })
            .collect();
        let inputs: Vec<SeqInput<'_>> = rows
            .iter()
            .map(|r| {
                let seq = &self.seqs[&r.planned.id];
                let Planned { start, len, .. } = r.planned;
                SeqInput {
                    tokens: &seq.tokens[start..start + len],
                    start_pos: start,
                    block_table: &seq.blocks,
                    logits: r.samples,
                    all_logits: r.all_rows,
                }
            })
            .collect();
        let batch = Batch {
            seqs: &inputs,
            chunks: &chunks,
            prompt_work: rows
                .iter()
                .any(|r| r.planned.start < self.seqs[&r.planned.id].prompt_len),
        };
        if guides.is_empty() || !self.backend.frees_host_during_forward() {
            let masked = compute_masks(guides);
            let logits = self.backend.forward(&mut self.cache, &batch, on_layer);
            return (logits, masked);
        }
        let (backend, cache) = (&mut self.backend, &mut self.cache);
        std::thread::scope(|s| {
            let masks = s.spawn(move || compute_masks(guides));
            let logits = backend.forward(cache, &batch, on_layer);
            // llguidance catches its own panics; one here would be a bug, and losing the
            // guides would free those sequences of their grammars: propagate it.
            let masked = masks
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p));
            (logits, masked)
        })
    }

    /// Masks, second half: each grammar goes back to its sequence; the masks are kept for
    /// sampling (a grammar that failed to mask is logged and its sequence samples freely).
    fn restore_guides(&mut self, masked: Vec<Masked>) -> HashMap<SeqId, Allowed> {
        let mut allowed = HashMap::new();
        for (id, guide, mask) in masked {
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.guide = Some(guide);
            }
            match mask {
                Ok(mask) => {
                    allowed.insert(id, mask);
                }
                Err(e) => tracing::error!(seq = id, error = %e, "the grammar could not mask"),
            }
        }
        allowed
    }

    /// Absorb: every planned sequence takes its computed tokens, its prompt logprobs from
    /// the rows that predict prompt tokens, and, if its chunk ends its tokens, samples one.
    fn absorb(
        &mut self,
        rows: &[Row],
        logits: &mut Logits,
        mut allowed: HashMap<SeqId, Allowed>,
    ) -> Vec<StepOutput> {
        let mut outputs = Vec::new();
        let mut logits = logits.iter_mut();
        for row in rows {
            let Planned { id, start, len } = row.planned;
            if !self.advance(id, len) {
                continue;
            }
            if row.all_rows {
                let seq = self.seqs.get_mut(&id).expect("advanced ids are in seqs");
                // The rows before the sampling row: each predicts the next prompt token.
                let k = seq.sampling.prompt_logprobs.unwrap_or(0);
                for p in start..start + len - usize::from(row.samples) {
                    let Some(logits_row) = logits.next() else {
                        break;
                    };
                    if let Some(&next) = seq.tokens.get(p + 1).filter(|_| p + 1 < seq.prompt_len) {
                        seq.prompt_logprobs
                            .push(PromptLogprob::of(logits_row, next, k));
                    }
                }
            }
            if !row.samples {
                continue;
            }
            let Some(logits_row) = logits.next() else {
                break;
            };
            self.sample(id, logits_row, allowed.remove(&id), &mut outputs);
        }
        outputs
    }

    /// Counts `len` more computed tokens of `id` (a decode token or prompt work), names the
    /// blocks they filled, and gives back the blocks every layer's window has left behind
    /// (a prefill worker has shipped what the decode side needs during this pass). False if
    /// the sequence is gone.
    fn advance(&mut self, id: SeqId, len: usize) -> bool {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        if seq.pending() == 1
            && len == 1
            && seq.computed + 1 == seq.tokens.len()
            && seq.computed >= seq.prompt_len
        {
            self.stats.decode_tokens += 1;
        } else {
            self.stats.prefill_tokens += len as u64;
        }
        let before = seq.computed;
        seq.computed += len;
        Self::name_full_blocks(self.prefix_salt, &self.pool, seq, before);
        let first_needed = self
            .model
            .config()
            .first_needed_block(seq.computed)
            .min(seq.blocks.len());
        let leaving: Vec<u32> = seq.blocks[..first_needed]
            .iter_mut()
            .filter(|b| **b != FREED_BLOCK)
            .map(|b| std::mem::replace(b, FREED_BLOCK))
            .collect();
        if !leaving.is_empty()
            && let Err(e) = self.pool.lock().release(&leaving)
        {
            tracing::error!(error = %e, "releasing blocks outside the window failed");
        }
        true
    }

    /// Samples `id`'s next token from its logits row (forking its other choices first when
    /// this is its first token) and ends the sequence if the token finishes it.
    fn sample(
        &mut self,
        id: SeqId,
        logits_row: &mut [f32],
        mask: Option<Allowed>,
        outputs: &mut Vec<StepOutput>,
    ) {
        if self.seqs.get(&id).is_some_and(|seq| seq.forks_now()) {
            let choices = self.fork_choices(id, logits_row, mask.as_ref());
            outputs.extend(choices);
        }
        let context = self.context_len();
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let sampled = seq.sample(logits_row, mask);
        let out = seq.push_token(sampled, &self.tokenizer, context);
        if out.finish.is_some() {
            self.finish(id);
        }
        outputs.push(out);
    }
}

/// Each grammar's mask of the tokens it allows next.
fn compute_masks(guides: Vec<(SeqId, Guide)>) -> Vec<Masked> {
    guides
        .into_iter()
        .map(|(id, mut guide)| {
            let allowed = guide.allowed();
            (id, guide, allowed)
        })
        .collect()
}

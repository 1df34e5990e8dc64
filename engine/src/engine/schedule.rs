//! Scheduling: which sequences run in the next pass and how many tokens each, under the
//! token budget, the running limit and the pool; growing a sequence's blocks and preempting
//! the youngest when the pool runs dry.

use tandem_kv::{BLOCK_SIZE, blocks_for};

use super::Engine;
use crate::sequence::Sequence;
use crate::types::SeqId;

/// One sequence's share of a pass: its tokens `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Planned {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
}

/// Prompt tokens per step of a sequence computing its prompt logprobs: every row's logits
/// is kept for the step (vocabulary × 4 bytes each), so its chunks stay this short.
const PROMPT_LOGPROBS_CHUNK: usize = 256;

/// Waiting sequences looked at for a prompt that ends within the pass, from the front: a
/// bound on the scan, not on fairness (the rest are admitted in order after).
const ENDING_SCAN: usize = 64;

/// Which work of the running sequences a planning pass takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// Decode rows (at most one pending token).
    Decode,
    /// Whole remainders of prompts that fit the budget, shortest first.
    PromptsEnding,
    /// The next chunk of every other prompt, oldest first.
    PromptChunks,
}

impl Engine {
    /// Picks this step's work: the decode rows of running sequences first (a prompt chunk
    /// must never crowd a stream out of its step); then prompts that end within the pass,
    /// running or waiting (each shortest first; a waiting prompt counts only the tokens its
    /// cached prefix lacks); then the next chunk of the other prompts under way, oldest
    /// first; then waiting ones; as the budget, the prompt allowance, the running limit and
    /// the pool allow.
    ///
    /// Prompts that end go before longer ones because otherwise a 16-token prompt queued
    /// behind a 2048-token one waits for that whole prompt: seconds on a CPU, and the whole
    /// of a long prefill when a paced allowance lends prompts a few dozen tokens a pass. A
    /// long prompt yields only to prompts that finish in the same pass, so each delays it
    /// once, by its own tokens. A conversation's next turn is mostly its cached history: by
    /// its whole length it would never end within a paced allowance, and waited seconds
    /// behind a first turn's chunks on a decode worker.
    ///
    /// Not the fewest tokens left first for every chunk: in both runs of the mixed load of
    /// BENCHMARKS.md ("Goodput under latency targets") with it, an aggregated worker let a
    /// wave of streams' first tokens wait seconds (P99 TTFT 1.5-2.5 s against 0.26-0.29 s),
    /// though this order saw it once too; kept until runs tell the two apart.
    pub(super) fn schedule(&mut self) -> Vec<Planned> {
        let mut plan = Vec::new();
        let mut budget = self.config.max_batch_tokens;
        let ids = self.running.clone();
        self.plan_running(&ids, Work::Decode, &mut plan, &mut budget);
        // Prompts get what the allowance lends them; a pass without decode rows at least a
        // block (a chunk is whole blocks), so that it is never empty while prompts wait.
        if let Some(allowance) = self.prompt_allowance {
            budget = budget.min(if plan.is_empty() {
                allowance.max(BLOCK_SIZE)
            } else {
                allowance
            });
        }
        let mut ending = ids.clone();
        ending.sort_by_key(|id| self.seqs.get(id).map_or(usize::MAX, Sequence::pending));
        self.plan_running(&ending, Work::PromptsEnding, &mut plan, &mut budget);
        self.admit_ending(&mut plan, &mut budget);
        self.plan_running(&ids, Work::PromptChunks, &mut plan, &mut budget);
        self.admit_waiting(&mut plan, &mut budget);
        // A prompt chunk's growth may have preempted a sequence planned before it.
        plan.retain(|p| self.running.contains(&p.id));
        plan
    }

    /// `work` of the running sequences among `ids` (a snapshot), in that order.
    fn plan_running(
        &mut self,
        ids: &[SeqId],
        work: Work,
        plan: &mut Vec<Planned>,
        budget: &mut usize,
    ) {
        for &id in ids {
            if *budget == 0 {
                break;
            }
            // Preempted since the snapshot (by another's growth), or planned already.
            if !self.running.contains(&id) || plan.iter().any(|p| p.id == id) {
                continue;
            }
            let seq = &self.seqs[&id];
            let pending = seq.pending();
            let row_budget = row_budget(seq, *budget);
            let wanted = match work {
                Work::Decode => pending <= 1,
                Work::PromptsEnding => pending > 1 && pending <= row_budget,
                Work::PromptChunks => pending > 1,
            };
            if !wanted {
                continue;
            }
            let start = seq.computed;
            let len = chunk_len(pending, row_budget);
            if len == 0 {
                continue;
            }
            if !self.grow(id, start + len) {
                // `id` itself was preempted, and every younger sequence with it.
                continue;
            }
            plan.push(Planned { id, start, len });
            *budget -= len;
        }
    }

    /// Admits, shortest first (queue order between equals), the waiting sequences among the
    /// first [`ENDING_SCAN`] whose whole prompt, less its cached prefix, fits the budget.
    ///
    /// Shortest first because a prefill worker's budget holds a whole 2048-token prompt:
    /// in queue order, a 16-token prompt behind four of them waited for all four passes
    /// (tens of seconds on a CPU core) although it fitted beside any of them. A longer
    /// prompt left out still gets what the shorter ones leave of the budget, as a chunk
    /// (`admit_waiting`), so each shorter one delays it once, by its own tokens.
    fn admit_ending(&mut self, plan: &mut Vec<Planned>, budget: &mut usize) {
        let mut candidates = self.waiting_by_tokens_left();
        candidates.sort_by_key(|&(left, _)| left);
        for (left, id) in candidates {
            if *budget == 0 {
                break;
            }
            let Some(at) = self.waiting.iter().position(|w| *w == id) else {
                continue;
            };
            let fits = self
                .seqs
                .get(&id)
                .is_some_and(|seq| left <= row_budget(seq, *budget));
            if fits {
                self.admit(at, plan, budget);
            }
        }
    }

    /// The first [`ENDING_SCAN`] waiting sequences with the prompt tokens each would still
    /// compute once admitted (less its cached prefix), in queue order.
    fn waiting_by_tokens_left(&self) -> Vec<(usize, SeqId)> {
        let pool = self.pool();
        self.waiting
            .iter()
            .take(ENDING_SCAN)
            .filter_map(|id| {
                let seq = self.seqs.get(id)?;
                Some((self.uncached_pending(&pool, seq), *id))
            })
            .collect()
    }

    /// Admits waiting sequences from the front while the budget, the running limit and the
    /// pool allow.
    fn admit_waiting(&mut self, plan: &mut Vec<Planned>, budget: &mut usize) {
        while self.admit(0, plan, budget) {}
    }

    /// Admits the waiting sequence at `at` in the queue with a chunk of its prompt under the
    /// budget, if the running limit allows and the pool has its blocks; keeps a few blocks
    /// spare so that admissions do not immediately force preemptions. Returns whether it was
    /// admitted.
    fn admit(&mut self, at: usize, plan: &mut Vec<Planned>, budget: &mut usize) -> bool {
        if *budget == 0 || self.running.len() >= self.config.max_running {
            return false;
        }
        let watermark = (self.pool().total() / 100).max(1);
        let Some(&id) = self.waiting.get(at) else {
            return false;
        };
        self.reuse_cached_prefix(id);
        let seq = &self.seqs[&id];
        let len = chunk_len(seq.pending(), row_budget(seq, *budget));
        let needed = blocks_for(seq.computed + len).saturating_sub(seq.blocks.len());
        let blocked =
            len == 0 || (needed + watermark > self.pool().free_count() && !self.running.is_empty());
        let allocated = if blocked {
            None
        } else {
            self.pool().allocate(needed).ok()
        };
        let Some(new_blocks) = allocated else {
            // Not this step: the cached prefix goes back (still cached) until it is.
            self.drop_cached_prefix(id);
            return false;
        };
        self.waiting.remove(at);
        let seq = self.seqs.get_mut(&id).expect("waiting ids are in seqs");
        seq.blocks.extend(new_blocks);
        if self.prefix_salt.is_some() && seq.generated() == 0 && !seq.wants_prompt_logprobs() {
            // Counted when a prompt is admitted, not each time it waits another step.
            self.stats.prefix_query_tokens += seq.prompt_len as u64;
            self.stats.prefix_hit_tokens += seq.cached_tokens as u64;
        }
        plan.push(Planned {
            id,
            start: seq.computed,
            len,
        });
        self.running.push(id);
        *budget -= len;
        true
    }

    /// Makes sure `id` has blocks for `tokens` tokens, preempting the youngest running
    /// sequences if needed. Returns false if `id` itself had to be preempted.
    fn grow(&mut self, id: SeqId, tokens: usize) -> bool {
        loop {
            let seq = &self.seqs[&id];
            let needed = blocks_for(tokens).saturating_sub(seq.blocks.len());
            if needed == 0 {
                return true;
            }
            let allocated = self.pool().allocate(needed);
            if let Ok(new_blocks) = allocated {
                self.seqs
                    .get_mut(&id)
                    .expect("running ids are in seqs")
                    .blocks
                    .extend(new_blocks);
                return true;
            }
            let Some(&victim) = self.running.last() else {
                return false;
            };
            self.preempt(victim);
            if victim == id {
                return false;
            }
        }
    }

    /// Frees a running sequence's blocks and puts it first in the queue: it is recomputed
    /// from its tokens when admitted again.
    fn preempt(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let blocks = std::mem::take(&mut seq.blocks);
        seq.computed = 0;
        if !seq.prompt_logprobs_sent {
            // Recomputed with the prompt.
            seq.prompt_logprobs.clear();
        }
        seq.preemptions += 1;
        self.stats.preemptions += 1;
        tracing::debug!(
            seq = id,
            tokens = seq.tokens.len(),
            "preempted: KV freed, will recompute"
        );
        self.free_blocks_of(blocks);
        self.waiting.push_front(id);
    }
}

/// The token budget of `seq` this step.
fn row_budget(seq: &Sequence, budget: usize) -> usize {
    if seq.wants_prompt_logprobs() {
        budget.min(PROMPT_LOGPROBS_CHUNK)
    } else {
        budget
    }
}

/// Tokens to run for a sequence with `pending` tokens left under `budget`: all of them if
/// they fit, else a whole number of blocks (so exported blocks are full), else nothing.
fn chunk_len(pending: usize, budget: usize) -> usize {
    if pending <= budget {
        pending
    } else {
        budget / BLOCK_SIZE * BLOCK_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_whole_blocks_unless_last() {
        assert_eq!(chunk_len(10, 100), 10);
        assert_eq!(chunk_len(100, 40), 32);
        assert_eq!(chunk_len(100, 15), 0);
        assert_eq!(chunk_len(1, 1), 1);
    }
}

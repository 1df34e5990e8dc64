//! The prefix cache as the engine uses it: which leading blocks of a prompt may come from the
//! cache, taking them at admission (and giving them back if admission waits), naming the
//! full blocks a sequence computes, holding a cached prefix for a decode worker's lease, and
//! importing a prefix another worker computed. The pool itself (lookup, eviction) is
//! `tandem_kv`'s.

use tandem_kv::{BLOCK_SIZE, BlockHash, BlockPool, FREED_BLOCK, SharedPool};

use super::Engine;
use crate::error::{EngineError, Result};
use crate::sequence::Sequence;
use crate::types::SeqId;

/// The most leading full blocks of a `tokens`-long sequence that may come from the prefix
/// cache: never the block with the last token, which must run for its logits.
fn reusable_blocks(tokens: usize) -> usize {
    tokens.saturating_sub(1) / BLOCK_SIZE
}

/// The names of `prompt`'s blocks that may come from the prefix cache.
fn reusable_names(salt: BlockHash, prompt: &[u32]) -> Vec<BlockHash> {
    tandem_kv::prefix::hashes(salt, &prompt[..reusable_blocks(prompt.len()) * BLOCK_SIZE])
}

impl Engine {
    /// For a thread that reserves KV outside the engine (a decode worker's lease): the
    /// blocks of the longest cached prefix of `prompt`, each held once for the caller (who
    /// releases them or hands them to [`Engine::add_prefilled`] as `ReceivedKv::cached`).
    /// Whole blocks only, and never the one with the last prompt token, whose logits are
    /// needed.
    pub fn hold_cached_prefix(pool: &SharedPool, salt: BlockHash, prompt: &[u32]) -> Vec<u32> {
        pool.lock().lookup(&reusable_names(salt, prompt))
    }

    /// How many leading blocks of `prompt` the cache holds now (whole blocks, never the one
    /// with the last prompt token), without holding them.
    pub fn cached_prefix_blocks(pool: &SharedPool, salt: BlockHash, prompt: &[u32]) -> usize {
        pool.lock().cached_run(&reusable_names(salt, prompt))
    }

    /// The salt of this engine's block names; `None` when it does not cache prefixes.
    pub fn prefix_salt(&self) -> Option<BlockHash> {
        self.prefix_salt
    }

    /// Whether KV read from another worker can join this engine's prefix cache
    /// ([`Self::import_cached_prefix`]): it caches prefixes, and its host cache is its KV.
    pub fn imports_prefix_kv(&self) -> bool {
        self.prefix_salt.is_some() && self.backend.host_cache_is_kv()
    }

    /// Puts KV read from another worker (a decode worker's cached prefix, pulled by a prefill
    /// worker) into the prefix cache: `data` holds logical blocks `first..` of `prompt`,
    /// block-major (each block's layers in order), and they are named from the prompt's own
    /// tokens and left idle, so the prompt's admission finds them like blocks it computed.
    /// The peer is as trusted as for the KV it is about to receive for this very prompt (an
    /// authenticated member of the deployment; layout hash and per-piece checksums matched),
    /// and batch invariance makes its KV the bytes this engine would compute. Returns the
    /// blocks added: 0 when the cache no longer holds the prefix before `first` (they could
    /// never be reached), when no block is free, or when this engine cannot import.
    pub fn import_cached_prefix(
        &mut self,
        prompt: &[u32],
        first: usize,
        data: &[u8],
    ) -> Result<usize> {
        let Some(salt) = self.prefix_salt.filter(|_| self.imports_prefix_kv()) else {
            return Ok(0);
        };
        let layout = self.cache.layout().clone();
        let piece = layout.block_layer_bytes();
        let per_block = piece * layout.num_layers;
        let end = first + data.len() / per_block;
        if data.is_empty()
            || !data.len().is_multiple_of(per_block)
            || end > reusable_blocks(prompt.len())
        {
            return Err(EngineError::InvalidKv(format!(
                "{} bytes of prefix KV from block {first} for a prompt of {} tokens",
                data.len(),
                prompt.len()
            )));
        }
        let names = tandem_kv::prefix::hashes(salt, &prompt[..end * BLOCK_SIZE]);
        // Hold what is cached already, so that the blocks taken below cannot evict it.
        let (held, fresh) = {
            let mut pool = self.pool();
            let held = pool.lookup(&names);
            let fresh = match held.len() {
                n if n < first => None,
                n => pool.allocate(end - n).ok(),
            };
            (held, fresh)
        };
        let Some(fresh) = fresh else {
            self.free_blocks_of(held);
            return Ok(0);
        };
        let start = held.len();
        let written = (start..end).zip(&fresh).try_for_each(|(i, &block)| {
            let at = (i - first) * per_block;
            (0..layout.num_layers).try_for_each(|layer| {
                let bytes = &data[at + layer * piece..at + (layer + 1) * piece];
                self.cache.write_block_layer_bytes(layer, block, bytes)
            })
        });
        if written.is_ok() {
            let mut pool = self.pool();
            for (i, &block) in (start..end).zip(&fresh) {
                if let Err(e) = pool.name(block, names[i]) {
                    tracing::error!(error = %e, "naming an imported block failed");
                }
            }
        }
        // Released last block first: under pressure the tail of a prefix goes before its head.
        let imported = fresh.len();
        let mut all = held;
        all.extend(fresh);
        all.reverse();
        self.free_blocks_of(all);
        written?;
        Ok(imported)
    }

    /// Makes request `id` compute its whole prompt even where the cache holds a prefix of it
    /// (every choice; on a device engine whose prefill ships KV over a host transport, which
    /// can send only what a pass brought down).
    pub fn compute_whole_prompt(&mut self, id: SeqId) {
        for seq in self.seqs.values_mut().filter(|s| s.request == id) {
            seq.may_reuse_prefix = false;
        }
    }

    /// Prompt tokens still to compute (queued prefill work, for load balancing): the rest of
    /// every prompt under way, and every waiting one less the prefix the cache holds for it
    /// now (which it takes when admitted).
    pub fn pending_prefill_tokens(&self) -> usize {
        self.pending_prompts().iter().sum()
    }

    /// The prompt tokens [`Self::pending_prefill_tokens`] counts, prompt by prompt, fewest
    /// first (the order in which the scheduler finishes prompts beside decode rows).
    pub fn pending_prompts(&self) -> Vec<usize> {
        let pool = self.pool.lock();
        let mut pending: Vec<usize> = self
            .seqs
            .values()
            .filter(|s| s.pending() > 1 || s.computed == 0)
            .map(|s| s.pending() - self.cached_now(&pool, s))
            .collect();
        pending.sort_unstable();
        pending
    }

    /// Prompts with tokens still to compute (those [`Self::pending_prefill_tokens`] counts):
    /// with those tokens, the mean length of a queued prompt, which tells a router whether a
    /// new prompt would go before them (the scheduler admits the shortest first).
    pub fn pending_prefill_prompts(&self) -> usize {
        self.seqs
            .values()
            .filter(|s| s.pending() > 1 || s.computed == 0)
            .count()
    }

    /// The prompt tokens a waiting sequence would still compute once admitted: its pending
    /// tokens less the cached prefix admission would take (a conversation's next turn is
    /// mostly its history, already cached). `pool` is the engine's, locked by the caller.
    pub(super) fn uncached_pending(&self, pool: &BlockPool, seq: &Sequence) -> usize {
        seq.pending().saturating_sub(self.cached_now(pool, seq))
    }

    /// Tokens of a waiting sequence's prefix that the cache holds (what
    /// [`Self::reuse_cached_prefix`] would find), without holding them.
    fn cached_now(&self, pool: &BlockPool, seq: &Sequence) -> usize {
        if self.prefix_salt.is_none()
            || seq.computed > 0
            || !seq.blocks.is_empty()
            || seq.wants_prompt_logprobs()
            || !seq.may_reuse_prefix
        {
            return 0;
        }
        let usable = reusable_blocks(seq.tokens.len()).min(seq.block_names.len());
        pool.cached_run(&seq.block_names[..usable]) * BLOCK_SIZE
    }

    /// A waiting sequence that holds no blocks takes the longest cached prefix of its tokens
    /// (leaving at least the last token to compute) and skips computing it.
    pub(super) fn reuse_cached_prefix(&mut self, id: SeqId) {
        let Some(salt) = self.prefix_salt else {
            return;
        };
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        // Prompt logprobs need every prompt row computed.
        if !seq.blocks.is_empty()
            || seq.computed > 0
            || seq.wants_prompt_logprobs()
            || !seq.may_reuse_prefix
        {
            return;
        }
        tandem_kv::prefix::extend_hashes(salt, &seq.tokens, &mut seq.block_names);
        let usable = reusable_blocks(seq.tokens.len());
        let found = self
            .pool
            .lock()
            .lookup(&seq.block_names[..usable.min(seq.block_names.len())]);
        seq.computed = found.len() * BLOCK_SIZE;
        seq.blocks = found;
        if seq.generated() == 0 {
            seq.cached_tokens = seq.computed;
        }
    }

    /// Undoes [`Self::reuse_cached_prefix`] for a sequence that stays waiting.
    pub(super) fn drop_cached_prefix(&mut self, id: SeqId) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        if seq.computed > 0 && seq.computed == seq.blocks.len() * BLOCK_SIZE {
            let blocks = std::mem::take(&mut seq.blocks);
            seq.computed = 0;
            seq.cached_tokens = 0;
            self.free_blocks_of(blocks);
        }
    }

    /// Names the full blocks `seq` computed since `from` tokens, so later prompts find them.
    pub(super) fn name_full_blocks(
        salt: Option<BlockHash>,
        pool: &SharedPool,
        seq: &mut Sequence,
        from: usize,
    ) {
        let Some(salt) = salt else {
            return;
        };
        let full = seq.computed / BLOCK_SIZE;
        if full <= from / BLOCK_SIZE {
            return;
        }
        tandem_kv::prefix::extend_hashes(salt, &seq.tokens[..seq.computed], &mut seq.block_names);
        let mut pool = pool.lock();
        for i in from / BLOCK_SIZE..full.min(seq.blocks.len()) {
            let block = seq.blocks[i];
            if block != FREED_BLOCK
                && let Err(e) = pool.name(block, seq.block_names[i])
            {
                tracing::error!(error = %e, "naming a computed block failed");
            }
        }
    }
}

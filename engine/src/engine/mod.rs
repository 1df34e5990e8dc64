//! `Engine`: the scheduler around a model and its KV cache. Each [`Engine::step`] runs one
//! forward pass over a batch built like vLLM's chunked-prefill scheduler: every running
//! sequence contributes its next decode token first, then prompts are prefilled in chunks
//! under the token budget. Sequences join and leave between any two steps.
//!
//! The same engine serves the three roles: a prefill worker (prompts with one output token,
//! KV handed out per layer through [`Engine::step_with`]), a decode worker (KV imported into
//! reserved blocks, then [`Engine::add_prefilled`]), and aggregated serving (both).
//!
//! The engine's jobs, one file each:
//! - this file: the engine's state, its sizing ([`EngineConfig`]), counters and accessors;
//! - `admission`: checking a request and queueing it;
//! - `schedule`: picking each step's work under the token budget, growing and preempting;
//! - `prefix`: the prefix cache (reusing, naming and importing cached blocks);
//! - `choices`: the `n > 1` choices of a request forking from its first token;
//! - `kv_io`: KV that crosses the engine's edge (reservations, received blocks, exports);
//! - `step`: one forward pass as named phases (plan, masks, forward, absorb);
//! - `calibration`: made-up passes at start-up that a worker's cost model is fitted to.
//!
//! When the pool runs dry the youngest running sequence is preempted: its blocks are freed
//! and it is recomputed from its tokens later (counted in [`EngineStats::preemptions`]).
//!
//! A request with `n > 1` choices is prefilled once: when its first token is sampled, choices
//! 1.. sample theirs from the same logits (each with its own seed) and become sequences of
//! their own that share the prompt's full blocks (reference-counted in the pool) and get a
//! copy of its last, partly filled block (copy on write: every choice writes its next token
//! there). A backend that cannot copy blocks recomputes that block's few tokens instead.
//!
//! Prefix caching (on unless [`EngineConfig::prefix_caching`] is off; not for sliding-window
//! models): every full block a sequence computes or receives is named by its hash chain
//! (`tandem_kv::prefix`); when its last holder lets go it stays cached in the pool and is
//! evicted least recently used only when blocks are needed. A sequence being admitted looks
//! its tokens up and starts computing at the first block not found (at least its last token
//! always runs, for its logits); chunked prefill is unchanged. Batch invariance makes a
//! cached block bit-identical to a recomputed one, so caching never changes the output. On a
//! device the cache is the device pool; a prompt whose KV leaves over a host transport is
//! computed whole there ([`Engine::compute_whole_prompt`]): the host holds only the blocks a
//! pass brings down.

mod admission;
mod calibration;
mod choices;
mod kv_io;
mod prefix;
mod schedule;
mod step;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, MutexGuard};

use serde::{Deserialize, Serialize};
use tandem_kv::{BLOCK_SIZE, BlockPool, FREED_BLOCK, KvCache, SharedPool};
use tandem_text::{GuideFactory, TextTokenizer};

use crate::backend::{self, ComputeBackend};
use crate::device::Device;
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::sequence::Sequence;
use crate::types::SeqId;

pub use admission::{first_token_output, validate_request};
pub use calibration::CalibrationRun;
pub use kv_io::ReceivedKv;
pub use tandem_cost::StepShape;

/// Engine sizing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Reuse the KV of full blocks whose prefix was computed before (see the module doc).
    #[serde(default = "prefix_caching_default")]
    pub prefix_caching: bool,
    /// Bytes of KV cache; the pool holds as many blocks as fit.
    pub kv_budget_bytes: usize,
    /// Tokens per forward pass (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Where the forward pass runs.
    #[serde(default)]
    pub device: Device,
}

fn prefix_caching_default() -> bool {
    true
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            prefix_caching: true,
            kv_budget_bytes: 1 << 30,
            max_batch_tokens: 2048,
            max_running: 256,
            device: Device::Cpu,
        }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<()> {
        if self.max_batch_tokens < BLOCK_SIZE {
            return Err(EngineError::Config(format!(
                "max_batch_tokens must be at least {BLOCK_SIZE}"
            )));
        }
        if self.max_running == 0 || self.max_running > self.max_batch_tokens {
            return Err(EngineError::Config(format!(
                "max_running must be in 1..={} (max_batch_tokens)",
                self.max_batch_tokens
            )));
        }
        Ok(())
    }
}

/// Counters for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineStats {
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and those found there (not computed).
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
}

/// A sequence that decodes in the next pass (see [`Engine::decode_streams`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeStream {
    pub id: SeqId,
    /// The request it answers (see [`crate::StepOutput::request`]).
    pub request: SeqId,
    /// Tokens it has generated.
    pub generated: usize,
    /// Tokens it may still generate (its `max_tokens` left).
    pub remaining: usize,
}

/// A model, its KV cache and the sequences sharing them.
pub struct Engine {
    model: Arc<Model>,
    tokenizer: TextTokenizer,
    cache: KvCache,
    pool: SharedPool,
    config: EngineConfig,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// Sequences holding blocks, oldest first (preemption takes from the back).
    running: Vec<SeqId>,
    next_id: SeqId,
    eos: Vec<u32>,
    guides: GuideFactory,
    stats: EngineStats,
    /// The salt of this cache's block names, when prefix caching is on.
    prefix_salt: Option<tandem_kv::BlockHash>,
    /// Where the forward pass runs (`cache` is the KV itself on the CPU, staging on a GPU).
    backend: Box<dyn ComputeBackend>,
    /// Prompt tokens a pass may add beside its decode rows (`None`: the token budget alone;
    /// see [`Engine::set_prompt_allowance`]).
    prompt_allowance: Option<usize>,
    /// The shape of the last pass (for the worker's cost fit).
    last_pass: StepShape,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.model.name())
            .field("backend", &self.backend.name())
            .field("blocks", &self.pool().total())
            .field("free", &self.pool().free_count())
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .finish()
    }
}

impl Engine {
    /// An engine with a private KV cache sized by `config.kv_budget_bytes`.
    pub fn new(model: Arc<Model>, tokenizer: TextTokenizer, config: EngineConfig) -> Result<Self> {
        let cache = KvCache::with_budget(model.kv_layout(), config.kv_budget_bytes)?;
        Self::with_cache(model, tokenizer, config, cache)
    }

    /// An engine over a given cache (for example one in shared memory).
    pub fn with_cache(
        model: Arc<Model>,
        tokenizer: TextTokenizer,
        config: EngineConfig,
        cache: KvCache,
    ) -> Result<Self> {
        config.validate()?;
        if let Some(why) = cache.layout().mismatch(&model.kv_layout()) {
            return Err(EngineError::LayoutMismatch(why));
        }
        if config.device != Device::Cpu && cache.layout().dtype != tandem_kv::KvDtype::F32 {
            return Err(EngineError::Unsupported(format!(
                "a {} KV cache on the GPU engine, which keeps bf16 on the device and stages \
                 f32 on the host; --kv-dtype bf16 and f16 run on the CPU engine",
                cache.layout().dtype.name()
            )));
        }
        let backend = backend::for_device(&config.device, &model, cache.num_blocks())?;
        Self::with_backend(model, tokenizer, config, cache, backend)
    }

    /// An engine over a given cache and backend (tests drive the device backend on an
    /// emulated device this way).
    pub fn with_backend(
        model: Arc<Model>,
        tokenizer: TextTokenizer,
        config: EngineConfig,
        cache: KvCache,
        backend: Box<dyn ComputeBackend>,
    ) -> Result<Self> {
        config.validate()?;
        if let Some(why) = cache.layout().mismatch(&model.kv_layout()) {
            return Err(EngineError::LayoutMismatch(why));
        }
        let eos = tokenizer.info().eos_token_ids.clone();
        let guides = GuideFactory::new(&tokenizer);
        // A sliding window frees blocks as it moves: no caching.
        let prefix_salt = (config.prefix_caching && model.config().kv_window().is_none())
            .then(|| tandem_kv::prefix::salt(&cache.layout().hash()));
        Ok(Self {
            prefix_salt,
            pool: SharedPool::new(cache.num_blocks()),
            model,
            tokenizer,
            cache,
            config,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            eos,
            guides,
            stats: EngineStats::default(),
            backend,
            prompt_allowance: None,
            last_pass: StepShape::default(),
        })
    }

    /// The grammar compiler of this engine's tokenizer (clones share its trie, built on
    /// first use).
    pub fn guides(&self) -> GuideFactory {
        self.guides.clone()
    }

    /// Whether the host cache is the KV the forward pass reads (the CPU) rather than a
    /// staging copy of a device pool that holds only what a pass brings down (a GPU).
    pub fn host_cache_is_kv(&self) -> bool {
        self.backend.host_cache_is_kv()
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    pub fn total_blocks(&self) -> usize {
        self.pool().total()
    }

    pub fn free_blocks(&self) -> usize {
        self.pool().free_count()
    }

    pub fn used_blocks(&self) -> usize {
        self.pool().used_count()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn context_len(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    /// Caps the prompt tokens of each pass (`None`: only the token budget does; 0: the next
    /// pass runs its decode rows alone, and a pass without any still takes a block). A
    /// decode worker sizes it so its streams' steps stay within their TPOT target, lending
    /// prompts the rest (Sarathi-Serve's stall-free batching), and bounds a pass without
    /// streams too: a new stream's prompt that arrives meanwhile waits for it.
    pub fn set_prompt_allowance(&mut self, tokens: Option<usize>) {
        self.prompt_allowance = tokens;
    }

    /// The shape of the last pass: its sampled rows, other tokens and attention pairs.
    pub fn last_pass(&self) -> StepShape {
        self.last_pass
    }

    /// The decode rows the next pass runs (running sequences past their prompt) and their
    /// context, as a pass shape; and where the first prompt under way stands (its computed
    /// tokens), for sizing the chunk beside them.
    pub fn decode_load(&self) -> (StepShape, u64) {
        let (mut rows, mut context, mut prompt_at) = (0u64, 0u64, None);
        for seq in self.running.iter().filter_map(|id| self.seqs.get(id)) {
            if seq.pending() <= 1 {
                rows += 1;
                context += seq.tokens.len() as u64;
            } else {
                prompt_at.get_or_insert(seq.computed as u64);
            }
        }
        (StepShape::decode(rows, context), prompt_at.unwrap_or(0))
    }

    /// The sequences the next pass decodes a token for (past their prompt), with what they
    /// have generated and may still generate: a decode worker paces its prompt chunks to
    /// each stream's TPOT target from these.
    pub fn decode_streams(&self) -> Vec<DecodeStream> {
        self.running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .filter(|seq| seq.pending() <= 1)
            .map(|seq| DecodeStream {
                id: seq.id,
                request: seq.request,
                generated: seq.generated(),
                remaining: seq.stop.max_tokens.saturating_sub(seq.generated()),
            })
            .collect()
    }

    /// Removes a request (every choice of it) wherever it is and frees its blocks. Returns
    /// whether it existed.
    pub fn abort(&mut self, request: SeqId) -> bool {
        let ids: Vec<SeqId> = self
            .seqs
            .values()
            .filter(|s| s.request == request)
            .map(|s| s.id)
            .collect();
        for id in &ids {
            if let Some(seq) = self.seqs.remove(id) {
                self.free_blocks_of(seq.blocks);
            }
        }
        self.waiting.retain(|w| !ids.contains(w));
        self.running.retain(|r| !ids.contains(r));
        !ids.is_empty()
    }

    /// Ends a sequence that produced its last token: it leaves the batch and lets go of its
    /// blocks.
    fn finish(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        if let Some(seq) = self.seqs.remove(&id) {
            self.free_blocks_of(seq.blocks);
        }
    }

    fn free_blocks_of(&mut self, mut blocks: Vec<u32>) {
        blocks.retain(|&b| b != FREED_BLOCK);
        if let Err(e) = self.pool().release(&blocks) {
            // A bookkeeping bug, not a request error: log loudly, keep serving.
            tracing::error!(error = %e, "releasing blocks failed");
        }
    }

    fn pool(&self) -> MutexGuard<'_, BlockPool> {
        self.pool.lock()
    }

    fn allocate_id(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        assert!(EngineConfig::default().validate().is_ok());
        let bad = EngineConfig {
            max_batch_tokens: 8,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = EngineConfig {
            max_running: 0,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }
}

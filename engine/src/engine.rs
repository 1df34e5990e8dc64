//! `Engine`: the scheduler around a model and its KV cache. Each [`Engine::step`] runs one
//! forward pass over a batch built like vLLM's chunked-prefill scheduler: every running
//! sequence contributes its next decode token first, then prompts are prefilled in chunks
//! under the token budget. Sequences join and leave between any two steps.
//!
//! The same engine serves the three roles: a prefill worker (prompts with one output token,
//! KV handed out per layer through [`Engine::step_with`]), a decode worker (KV imported into
//! reserved blocks, then [`Engine::add_prefilled`]), and aggregated serving (both).
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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tandem_text::{Allowed, Guide, GuideFactory, TextTokenizer};

use std::sync::MutexGuard;
use tandem_kv::{
    BLOCK_SIZE, BlockPool, DeviceKv, ExportedKv, FREED_BLOCK, KvCache, KvLocation, SharedPool,
    blocks_for,
};

use crate::backend::{self, Batch, ComputeBackend};
use crate::device::Device;
use crate::error::{EngineError, Result};
use crate::guides::compile_guide;
use crate::model::{Model, SeqInput};
use crate::sampling::{PromptLogprob, SampledToken, Sampler, SamplingParams, StopParams};
use crate::sequence::Sequence;

/// A prefilled sequence's KV: the blocks that hold it (the first `cached` of them held from
/// this engine's own prefix cache, the rest reserved and written by a peer), and where the
/// written ones are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedKv {
    pub blocks: Vec<u32>,
    pub location: KvLocation,
    /// Leading blocks that came from [`Engine::hold_cached_prefix`], not from the peer.
    pub cached: usize,
}

impl ReceivedKv {
    /// KV received into the host cache.
    pub fn host(blocks: Vec<u32>) -> Self {
        Self {
            blocks,
            location: KvLocation::Host,
            cached: 0,
        }
    }
}

/// The most leading full blocks of a `tokens`-long sequence that may come from the prefix
/// cache: never the block with the last token, which must run for its logits.
fn reusable_blocks(tokens: usize) -> usize {
    tokens.saturating_sub(1) / BLOCK_SIZE
}

/// The names of `prompt`'s blocks that may come from the prefix cache.
fn reusable_names(salt: tandem_kv::BlockHash, prompt: &[u32]) -> Vec<tandem_kv::BlockHash> {
    tandem_kv::prefix::hashes(salt, &prompt[..reusable_blocks(prompt.len()) * BLOCK_SIZE])
}

/// Identifies a sequence inside one engine.
pub type SeqId = u64;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// max_tokens, or the context is full.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One generated token of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    pub id: SeqId,
    /// The request it answers (the id its `add_*` call returned) and which of its choices.
    pub request: SeqId,
    pub choice: u32,
    pub token: u32,
    /// As the sampling module defines it.
    pub logprob: f32,
    /// The request's `top_logprobs` most likely tokens, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// On choice 0's first token, when the request asked: one entry per prompt token from
    /// the second on (empty when the prompt ran elsewhere).
    pub prompt_logprobs: Vec<PromptLogprob>,
    /// Prompt tokens whose KV came from the prefix cache when the prompt ran here.
    pub cached_tokens: usize,
    /// Text this token completes (may be empty, never half a character).
    pub text: String,
    /// Set on the sequence's last token; its blocks are already free.
    pub finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

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

/// What a per-layer callback learns: which positions of which sequences now have this
/// layer's KV in the cache.
#[derive(Debug, Clone)]
pub struct ChunkInfo {
    pub id: SeqId,
    pub start_pos: usize,
    pub len: usize,
    /// The sequence's block table (covers at least `start_pos + len` tokens).
    pub blocks: Vec<u32>,
}

impl ChunkInfo {
    /// Logical block indices this chunk wrote into (the last may be partly filled).
    pub fn logical_blocks(&self) -> std::ops::Range<usize> {
        self.start_pos / BLOCK_SIZE..(self.start_pos + self.len).div_ceil(BLOCK_SIZE)
    }
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
        })
    }

    /// The grammar compiler of this engine's tokenizer (clones share its trie, built on
    /// first use).
    pub fn guides(&self) -> GuideFactory {
        self.guides.clone()
    }

    /// Which backend computes (`cpu` or `cuda`).
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// The device KV pool, when the engine runs on a GPU.
    pub fn device_kv(&self) -> Option<DeviceKv> {
        self.backend.device_kv()
    }

    /// An IPC export of the device KV pool (`None` on the CPU).
    pub fn export_device_kv(&self) -> Result<Option<ExportedKv>> {
        self.backend.export_device_kv()
    }

    /// Whether a GPU engine copies prompt KV to the host cache after each layer with prompt
    /// work (on by default; a prefill worker turns it off while every transfer in flight
    /// copies device to device). No effect on the CPU, where the host cache is the KV.
    pub fn set_host_kv_export(&mut self, on: bool) {
        self.backend.set_host_kv_export(on);
    }

    /// Makes received KV visible to the forward pass (see [`ComputeBackend::import_blocks`]).
    fn place_received_kv(&mut self, blocks: &[u32], kv: KvLocation) -> Result<()> {
        self.backend.import_blocks(&mut self.cache, blocks, kv)
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// For a thread that reserves KV outside the engine (a decode worker's lease): the
    /// blocks of the longest cached prefix of `prompt`, each held once for the caller (who
    /// releases them or hands them to [`Engine::add_prefilled`] as `ReceivedKv::cached`).
    /// Whole blocks only, and never the one with the last prompt token, whose logits are
    /// needed.
    pub fn hold_cached_prefix(
        pool: &SharedPool,
        salt: tandem_kv::BlockHash,
        prompt: &[u32],
    ) -> Vec<u32> {
        pool.lock().lookup(&reusable_names(salt, prompt))
    }

    /// How many leading blocks of `prompt` the cache holds now (whole blocks, never the one
    /// with the last prompt token), without holding them.
    pub fn cached_prefix_blocks(
        pool: &SharedPool,
        salt: tandem_kv::BlockHash,
        prompt: &[u32],
    ) -> usize {
        pool.lock().cached_run(&reusable_names(salt, prompt))
    }

    /// Whether KV read from another worker can join this engine's prefix cache
    /// ([`Self::import_cached_prefix`]): it caches prefixes, and its host cache is its KV.
    pub fn imports_prefix_kv(&self) -> bool {
        self.prefix_salt.is_some() && self.backend.name() == "cpu"
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

    /// The salt of this engine's block names; `None` when it does not cache prefixes.
    pub fn prefix_salt(&self) -> Option<tandem_kv::BlockHash> {
        self.prefix_salt
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

    /// Prompt tokens not yet run (queued prefill work, for load balancing): every sequence
    /// still in its prompt counts what is left of it.
    /// Prompt tokens still to compute: the rest of every prompt under way, and every waiting
    /// one less the prefix the cache holds for it now (which it takes when admitted).
    pub fn pending_prefill_tokens(&self) -> usize {
        let pool = self.pool.lock();
        self.seqs
            .values()
            .filter(|s| s.pending() > 1 || s.computed == 0)
            .map(|s| s.pending() - self.cached_now(&pool, s))
            .sum()
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

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn context_len(&self) -> usize {
        self.model.config().max_position_embeddings
    }

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
    fn guide_for(&self, sampling: &SamplingParams, given: Option<Guide>) -> Result<Option<Guide>> {
        match (&sampling.guide, given) {
            (None, _) => Ok(None),
            (Some(_), Some(guide)) => Ok(Some(guide)),
            (Some(spec), None) => compile_guide(&self.guides, spec).map(Some),
        }
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

    /// Reserves blocks for `prompt_len` tokens whose KV another engine will write (the decode
    /// side of a disaggregated request): the blocks its first decode step reads, which are all
    /// of them unless a sliding window has passed the first ones.
    pub fn reserve(&mut self, prompt_len: usize) -> Result<Vec<u32>> {
        let first = self.model.config().first_needed_block(prompt_len);
        Ok(self
            .pool
            .reserve_blocks(blocks_for(prompt_len).saturating_sub(first))?)
    }

    /// Returns reserved blocks that will not be used (lease expired, request failed).
    pub fn release(&mut self, blocks: &[u32]) -> Result<()> {
        Ok(self.pool.release(blocks)?)
    }

    /// The block pool, shared with threads that reserve and release blocks while the engine
    /// computes (so a reservation never waits for a forward pass).
    pub fn shared_pool(&self) -> SharedPool {
        self.pool.clone()
    }

    /// Writes one received block of one layer. The block must be allocated (reserved).
    pub fn import_block_layer(&mut self, layer: usize, block: u32, bytes: &[u8]) -> Result<()> {
        if !self.pool().is_allocated(block) {
            return Err(EngineError::InvalidKv(format!(
                "block {block} is not reserved"
            )));
        }
        Ok(self.cache.write_block_layer_bytes(layer, block, bytes)?)
    }

    /// Direct access to the cache for transports that copy in place (checked by the caller
    /// against a reservation).
    pub fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// Admits a request whose prompt KV already sits in `kv.blocks` (of the host cache, or
    /// of the device pool) and whose first tokens were sampled elsewhere, one per choice
    /// (`sampling.n` of them). Returns its id and the output for each choice's first token
    /// (which may already finish that choice; the blocks are freed with the last holder).
    /// `guide` is the request's grammar compiled elsewhere, not yet advanced (`None`:
    /// compiled here).
    pub fn add_prefilled(
        &mut self,
        prompt: Vec<u32>,
        firsts: Vec<SampledToken>,
        kv: ReceivedKv,
        sampling: SamplingParams,
        stop: StopParams,
        guide: Option<Guide>,
    ) -> Result<(SeqId, Vec<StepOutput>)> {
        let ReceivedKv {
            blocks,
            location,
            cached,
        } = kv;
        self.validate_request(&prompt, &sampling, &stop)?;
        if firsts.len() != sampling.n {
            return Err(EngineError::InvalidKv(format!(
                "{} first tokens for {} choices",
                firsts.len(),
                sampling.n
            )));
        }
        let vocab = self.model.config().vocab_size;
        for first in &firsts {
            if let Some(&id) = std::iter::once(&first.token)
                .chain(first.top_logprobs.iter().map(|(id, _)| id))
                .find(|&&id| id as usize >= vocab)
            {
                return Err(EngineError::UnknownToken { id, vocab });
            }
            if first.top_logprobs.len() > sampling.top_logprobs {
                return Err(EngineError::InvalidKv(format!(
                    "the first token came with {} alternatives; {} were asked for",
                    first.top_logprobs.len(),
                    sampling.top_logprobs
                )));
            }
        }
        // A sliding-window model's KV arrives for the blocks its first decode step reads
        // (`first_needed_block` on, as `reserve` counts them): the table is padded in front.
        let first_block = self.model.config().first_needed_block(prompt.len());
        if blocks.len() < blocks_for(prompt.len()) - first_block || {
            let pool = self.pool();
            blocks.iter().any(|&b| !pool.is_allocated(b))
        } {
            return Err(EngineError::InvalidKv(
                "blocks do not cover the prompt or are not reserved".into(),
            ));
        }
        if cached > 0 && (first_block > 0 || cached >= blocks.len()) {
            return Err(EngineError::InvalidKv(format!(
                "{cached} cached blocks of {} (window from block {first_block})",
                blocks.len()
            )));
        }
        let mut padded = vec![FREED_BLOCK; first_block];
        padded.extend(blocks);
        let blocks = padded;
        let received = &blocks[first_block + cached..];
        self.place_received_kv(received, location)?;
        let id = self.allocate_id();
        let guide = self.guide_for(&sampling, guide)?;
        let sampler = Sampler::resumed(&sampling, 1);
        let mut seq =
            Sequence::new(id, prompt, sampling, stop, &self.eos, sampler).with_guide(guide);
        seq.computed = seq.prompt_len;
        seq.blocks = blocks;
        seq.cached_tokens = cached * BLOCK_SIZE;
        if self.prefix_salt.is_some() {
            self.stats.prefix_query_tokens += seq.prompt_len as u64;
            self.stats.prefix_hit_tokens += seq.cached_tokens as u64;
        }
        // The received blocks join the prefix cache like computed ones, named from the
        // prompt's own tokens: the peer is an authenticated member of the deployment whose KV
        // this request already trusts, the layout hash it matched is in every name, and the
        // next turn of a conversation then finds its history here (prefix-aware P/D).
        Self::name_full_blocks(self.prefix_salt, &self.pool, &mut seq, 0);
        let mut firsts = firsts.into_iter();
        let own = firsts.next().ok_or(EngineError::EmptyPrompt)?;
        let mut outputs = Vec::with_capacity(seq.sampling.n);
        for (choice, first) in (1..).zip(firsts) {
            let sampler = Sampler::for_choice(&seq.sampling, choice as usize, 1);
            let child_id = self.allocate_id();
            let child = seq.choice_of(child_id, choice, sampler);
            outputs.push(self.admit_choice(child, first, &seq.blocks));
        }
        let out = seq.push_token(own, &self.tokenizer, self.context_len());
        if out.finish.is_some() {
            self.free_blocks_of(seq.blocks);
        } else {
            self.seqs.insert(id, seq);
            self.running.push(id);
        }
        outputs.insert(0, out);
        Ok((id, outputs))
    }

    /// Starts choices 1.. of the request whose choice 0 (`parent`) is about to sample its
    /// first token from `row`: each samples its own from the same logits and grammar mask.
    fn fork_choices(
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
    fn admit_choice(
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
        let plan = self.schedule();
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        let chunks: Vec<ChunkInfo> = plan
            .iter()
            .map(|&(id, start, len)| ChunkInfo {
                id,
                start_pos: start,
                len,
                blocks: self.seqs[&id].blocks.clone(),
            })
            .collect();
        // The grammars of the sequences that sample this step compute their masks (they
        // depend only on the tokens so far). On a GPU that happens on a CPU thread while the
        // device runs the forward pass; on the CPU the forward pass already has every core and
        // an extra thread only competes with it (measured: scripts/bench-structured), so they
        // are computed first, in turn.
        let mut guided: Vec<(SeqId, Guide)> = Vec::new();
        for &(id, start, len) in &plan {
            if let Some(seq) = self.seqs.get_mut(&id)
                && start + len == seq.tokens.len()
                && let Some(guide) = seq.guide.take()
            {
                guided.push((id, guide));
            }
        }
        let overlap = self.backend.name() != "cpu";
        let mut wants_logits = Vec::with_capacity(plan.len());
        let inputs: Vec<SeqInput<'_>> = plan
            .iter()
            .map(|&(id, start, len)| {
                let seq = &self.seqs[&id];
                let logits = start + len == seq.tokens.len();
                // Every row of a chunk that predicts prompt tokens, for prompt logprobs.
                let all_logits = seq.wants_prompt_logprobs() && start + 1 < seq.prompt_len;
                wants_logits.push((logits, all_logits));
                SeqInput {
                    tokens: &seq.tokens[start..start + len],
                    start_pos: start,
                    block_table: &seq.blocks,
                    logits,
                    all_logits,
                }
            })
            .collect();
        let batch = Batch {
            seqs: &inputs,
            chunks: &chunks,
            prompt_work: plan
                .iter()
                .any(|(id, start, _)| *start < self.seqs[id].prompt_len),
        };
        let masks = |guided: Vec<(SeqId, Guide)>| {
            guided
                .into_iter()
                .map(|(id, mut g)| {
                    let allowed = g.allowed();
                    (id, g, allowed)
                })
                .collect::<Vec<_>>()
        };
        let (logits, guided) = if guided.is_empty() || !overlap {
            let guided = masks(guided);
            let logits = self.backend.forward(&mut self.cache, &batch, on_layer);
            (logits, guided)
        } else {
            let (backend, cache) = (&mut self.backend, &mut self.cache);
            std::thread::scope(|s| {
                let masks = s.spawn(move || masks(guided));
                let logits = backend.forward(cache, &batch, on_layer);
                // llguidance catches its own panics; one here would be a bug, and losing the
                // guides would free those sequences of their grammars: propagate it.
                let masks = masks
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p));
                (logits, masks)
            })
        };
        let mut allowed: HashMap<SeqId, Allowed> = HashMap::new();
        for (id, guide, mask) in guided {
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
        let logits = logits?;
        self.stats.steps += 1;

        let mut outputs = Vec::new();
        let mut logits = logits.into_iter();
        let context = self.context_len();
        for (&(id, start, len), (wants, all_rows)) in plan.iter().zip(wants_logits) {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
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
            // Blocks every layer's window has left behind go back to the pool (the prefill
            // worker has shipped what the decode side needs during this pass).
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
            if all_rows {
                // The rows before the sampling row: each predicts the next prompt token.
                let k = seq.sampling.prompt_logprobs.unwrap_or(0);
                for p in start..start + len - usize::from(wants) {
                    let Some(row) = logits.next() else { break };
                    if let Some(&next) = seq.tokens.get(p + 1).filter(|_| p + 1 < seq.prompt_len) {
                        seq.prompt_logprobs.push(PromptLogprob::of(&row, next, k));
                    }
                }
            }
            if !wants {
                continue;
            }
            let Some(mut row) = logits.next() else { break };
            let mask = allowed.remove(&id);
            if seq.forks_now() {
                let choices = self.fork_choices(id, &row, mask.as_ref());
                outputs.extend(choices);
            }
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            let sampled = seq.sample(&mut row, mask);
            let out = seq.push_token(sampled, &self.tokenizer, context);
            if out.finish.is_some() {
                self.finish(id);
            }
            outputs.push(out);
        }
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

    /// Picks this step's work: `(sequence, start position, token count)`.
    fn schedule(&mut self) -> Vec<(SeqId, usize, usize)> {
        let mut plan = Vec::new();
        let mut budget = self.config.max_batch_tokens;
        // 1. Running sequences: decode tokens, and the next chunk of prompts in progress.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let start = seq.computed;
            let len = chunk_len(seq.pending(), row_budget(seq, budget));
            if len == 0 {
                break;
            }
            if !self.grow(id, start + len) {
                // `id` itself was preempted; everything after it in `running` too.
                break;
            }
            plan.push((id, start, len));
            budget -= len;
            i += 1;
        }
        // 2. Admit waiting sequences while the budget, the running limit and the pool allow;
        // keep a few blocks spare so admissions do not immediately force preemptions.
        let watermark = (self.pool().total() / 100).max(1);
        while budget > 0 && self.running.len() < self.config.max_running {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            self.reuse_cached_prefix(id);
            let seq = &self.seqs[&id];
            let len = chunk_len(seq.pending(), row_budget(seq, budget));
            let needed = blocks_for(seq.computed + len).saturating_sub(seq.blocks.len());
            let blocked = len == 0
                || (needed + watermark > self.pool().free_count() && !self.running.is_empty());
            let allocated = if blocked {
                None
            } else {
                self.pool().allocate(needed).ok()
            };
            let Some(new_blocks) = allocated else {
                // Not this step: the cached prefix goes back (still cached) until it is.
                self.drop_cached_prefix(id);
                break;
            };
            self.waiting.pop_front();
            let seq = self.seqs.get_mut(&id).expect("waiting ids are in seqs");
            seq.blocks.extend(new_blocks);
            if self.prefix_salt.is_some() && seq.generated() == 0 && !seq.wants_prompt_logprobs() {
                // Counted when a prompt is admitted, not each time it waits another step.
                self.stats.prefix_query_tokens += seq.prompt_len as u64;
                self.stats.prefix_hit_tokens += seq.cached_tokens as u64;
            }
            plan.push((id, seq.computed, len));
            self.running.push(id);
            budget -= len;
        }
        plan
    }

    /// A waiting sequence that holds no blocks takes the longest cached prefix of its tokens
    /// (leaving at least the last token to compute) and skips computing it.
    fn reuse_cached_prefix(&mut self, id: SeqId) {
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
    fn drop_cached_prefix(&mut self, id: SeqId) {
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
    fn name_full_blocks(
        salt: Option<tandem_kv::BlockHash>,
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

/// Prompt tokens per step of a sequence computing its prompt logprobs: every row's logits
/// is kept for the step (vocabulary × 4 bytes each), so its chunks stay this short.
const PROMPT_LOGPROBS_CHUNK: usize = 256;

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

/// Checks a request against a model and a pool of `total_blocks` blocks: what every entry
/// point (engine, worker RPC) refuses before any work is queued.
pub fn validate_request(
    cfg: &crate::config::ModelConfig,
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

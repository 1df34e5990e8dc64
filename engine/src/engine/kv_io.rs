//! KV that crosses the engine's edge: blocks reserved for a peer to write (a decode worker's
//! lease), single block-layers written as they arrive, device pools exported for
//! device-to-device transports, and admitting a sequence whose prompt KV and first tokens
//! came from elsewhere ([`Engine::add_prefilled`]) or whose prompt's first part did
//! ([`Engine::add_partly_prefilled`]).

use tandem_kv::{
    BLOCK_SIZE, DeviceKv, ExportedKv, FREED_BLOCK, KvCache, KvLocation, SharedPool, blocks_for,
};
use tandem_text::Guide;

use super::Engine;
use crate::error::{EngineError, Result};
use crate::sampling::{SampledToken, Sampler, SamplingParams, StopParams};
use crate::sequence::Sequence;
use crate::types::{SeqId, StepOutput};

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

impl Engine {
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
        self.check_first_tokens(&firsts, &sampling)?;
        let blocks = self.check_received_blocks(prompt.len(), blocks, cached)?;
        let first_block = self.model.config().first_needed_block(prompt.len());
        let received = &blocks[first_block + cached..];
        self.backend
            .import_blocks(&mut self.cache, received, location)?;
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

    /// Queues a request whose prompt's first `computed` tokens (whole blocks) have their KV
    /// in `kv` (the first `kv.cached` blocks from this engine's prefix cache, the rest written
    /// by a peer) and whose other prompt tokens run here, in chunks like any queued prompt's:
    /// a prompt split between a prefill worker and this one. `kv.blocks` cover the whole
    /// prompt (those past `computed` reserved for the rest). Models with a sliding window and
    /// requests for prompt logprobs cannot be split (their first rows would be missing).
    pub fn add_partly_prefilled(
        &mut self,
        prompt: Vec<u32>,
        computed: usize,
        kv: ReceivedKv,
        sampling: SamplingParams,
        stop: StopParams,
        guide: Option<Guide>,
    ) -> Result<SeqId> {
        let ReceivedKv {
            blocks,
            location,
            cached,
        } = kv;
        self.validate_request(&prompt, &sampling, &stop)?;
        let window = self.model.config().first_needed_block(prompt.len()) > 0;
        if computed == 0
            || !computed.is_multiple_of(BLOCK_SIZE)
            || computed >= prompt.len()
            || cached * BLOCK_SIZE > computed
            || window
            || sampling.prompt_logprobs.is_some()
        {
            return Err(EngineError::InvalidKv(format!(
                "a prompt of {} tokens cannot resume at token {computed} ({cached} cached \
                 blocks{})",
                prompt.len(),
                if window { ", sliding window" } else { "" }
            )));
        }
        let blocks = self.check_received_blocks(prompt.len(), blocks, cached)?;
        self.backend.import_blocks(
            &mut self.cache,
            &blocks[cached..computed / BLOCK_SIZE],
            location,
        )?;
        let guide = self.guide_for(&sampling, guide)?;
        let id = self.allocate_id();
        let sampler = Sampler::new(&sampling);
        let mut seq =
            Sequence::new(id, prompt, sampling, stop, &self.eos, sampler).with_guide(guide);
        seq.computed = computed;
        seq.blocks = blocks;
        seq.cached_tokens = cached * BLOCK_SIZE;
        // Named like computed blocks (see `add_prefilled`); the rest as they are computed.
        Self::name_full_blocks(self.prefix_salt, &self.pool, &mut seq, 0);
        // It waits its turn like any prompt (the running limit, the token budget); holding
        // its blocks, it never takes cached ones or needs new ones for its prompt.
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(id)
    }

    /// The first tokens sampled elsewhere, one per choice, each naming tokens of this
    /// vocabulary and no more alternatives than the request asked for.
    fn check_first_tokens(&self, firsts: &[SampledToken], sampling: &SamplingParams) -> Result<()> {
        if firsts.len() != sampling.n {
            return Err(EngineError::InvalidKv(format!(
                "{} first tokens for {} choices",
                firsts.len(),
                sampling.n
            )));
        }
        let vocab = self.model.config().vocab_size;
        for first in firsts {
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
        Ok(())
    }

    /// Checks that `blocks` (the first `cached` from this engine's prefix cache) are reserved
    /// and cover a `prompt_len`-token prompt, and returns the sequence's block table. A
    /// sliding-window model's KV arrives for the blocks its first decode step reads
    /// (`first_needed_block` on, as `reserve` counts them): the table is padded in front.
    fn check_received_blocks(
        &self,
        prompt_len: usize,
        blocks: Vec<u32>,
        cached: usize,
    ) -> Result<Vec<u32>> {
        let first_block = self.model.config().first_needed_block(prompt_len);
        if blocks.len() < blocks_for(prompt_len) - first_block || {
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
        Ok(padded)
    }
}

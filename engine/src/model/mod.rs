//! The decoder (the Llama block and the families' changes to it: see
//! [`crate::config::Architecture`]) over the paged KV cache.
//!
//! Follows HF transformers' `modeling_llama.py` (pre-norm blocks, rotate-half RoPE, SwiGLU)
//! and the families' own files where they differ, with the projections fused (QKV, gate/up)
//! so each layer makes four passes over its weights. A batch is a flat list of token rows from several sequences (vLLM's varlen
//! layout): prefill chunks and decode steps mix freely, and attention sorts out which keys
//! each row sees. The forward pass itself belongs to a backend (`backend::cpu` for
//! [`Model::forward`], `backend::cuda` on a device).

mod bounds;
mod gguf;
mod hf;
mod identity;
mod load;
mod tensors;
mod trial;
mod weights;

pub use gguf::{load_gguf, load_gguf_model};
pub(crate) use hf::hf_weights;
pub use hf::{load_hf_dir, load_hf_model};
pub use load::{LoadOptions, ModelSource, dummy_model, load_model};
pub use weights::{LayerExtras, LayerWeights, Weights};

use tandem_kv::{BLOCK_SIZE, KvDtype, KvLayout};

use crate::backend::cpu::kernels::{Arrangement, RopeTable};
use crate::config::{ModelConfig, WeightFormat};

/// A loaded model: configuration, weights and the identity that KV peers compare.
#[derive(Debug)]
pub struct Model {
    cfg: ModelConfig,
    weights: Weights,
    rope: RopeTable,
    /// The windowed layers' table when their RoPE base differs (Gemma 3).
    rope_local: Option<RopeTable>,
    format: WeightFormat,
    fingerprint: String,
    name: String,
    kv_dtype: KvDtype,
}

/// One sequence's share of a forward pass.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// Tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// Must already cover every position up to the last token.
    pub block_table: &'a [u32],
    /// Whether to compute logits for the last token.
    pub logits: bool,
    /// Whether to compute logits for every token (prompt logprobs); they come before the
    /// last token's, which `logits` still governs.
    pub all_logits: bool,
}

impl SeqInput<'_> {
    /// Rows of logits the forward pass returns for this sequence, in position order.
    pub fn logit_rows(&self) -> std::ops::Range<usize> {
        let n = self.tokens.len();
        match (self.all_logits, self.logits) {
            (true, _) => 0..n,
            (false, true) => n.saturating_sub(1)..n,
            (false, false) => 0..0,
        }
    }
}

impl Model {
    /// A model over `weights`, whose quantized matrices it first moves into one huge-page
    /// mapping ([`Weights::gather_quantized`]).
    pub fn new(
        cfg: ModelConfig,
        mut weights: Weights,
        format: WeightFormat,
        fingerprint: String,
        name: String,
    ) -> Self {
        match weights.gather_quantized() {
            Ok(0) => {}
            Ok(bytes) => tracing::debug!(bytes, "quantized weights in one huge-page mapping"),
            Err(e) => tracing::warn!(
                error = %e,
                "quantized weights stay in separate buffers (no memory for one mapping)"
            ),
        }
        let rope = RopeTable::new(&cfg);
        let rope_local = RopeTable::local(&cfg);
        let fast = weights
            .matrices()
            .any(|m| m.arrangement() == Some(Arrangement::Quads));
        let fingerprint = if fast {
            identity::fast_fingerprint(&fingerprint)
        } else {
            fingerprint
        };
        Self {
            cfg,
            weights,
            rope,
            rope_local,
            format,
            fingerprint,
            name,
            kv_dtype: KvDtype::F32,
        }
    }

    /// The same model keeping its KV cache in `dtype` (f32 by default; bf16 and f16 halve the
    /// cache and the bytes every transport moves, at the cost of rounding K and V).
    pub fn with_kv_dtype(mut self, dtype: KvDtype) -> Self {
        self.kv_dtype = dtype;
        self
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The storage that was asked for (`--weights`).
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// The same model with every matrix widened to f32: the reference for a quantized one
    /// (its own fingerprint, so KV peers never mix the two).
    pub fn to_f32(&self) -> Model {
        let fingerprint = format!("{}-f32", self.fingerprint);
        Model::new(
            self.cfg.clone(),
            self.weights.to_f32(),
            WeightFormat::F32,
            fingerprint,
            format!("{}-f32", self.name),
        )
        .with_kv_dtype(self.kv_dtype)
    }

    /// The storage formats the matrices ended up in, with how many matrix parts use each
    /// (`q4_1×210 q8_0×1` for SmolLM2's Q4_1 GGUF).
    pub fn storage_summary(&self) -> String {
        let mut counts: Vec<(&'static str, usize)> = Vec::new();
        for m in self.weights.matrices() {
            for f in m.formats() {
                match counts.iter_mut().find(|(name, _)| *name == f) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((f, 1)),
                }
            }
        }
        counts.sort_by_key(|c| std::cmp::Reverse(c.1));
        counts
            .iter()
            .map(|(f, n)| format!("{f}×{n}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// A short human name (preset or file stem).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Identity of the weights; part of the KV layout hash.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Bytes of weights read by one decode step (every matrix once, plus the LM head).
    pub fn weight_bytes(&self) -> usize {
        self.weights.size_in_bytes()
    }

    /// The KV layout this model writes.
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            num_layers: self.cfg.num_hidden_layers,
            num_kv_heads: self.cfg.num_key_value_heads,
            head_dim: self.cfg.head_dim,
            block_size: BLOCK_SIZE,
            dtype: self.kv_dtype,
            model_fingerprint: self.fingerprint.clone(),
        }
    }

    /// RoPE frequencies of this model (of its global layers, where local ones differ).
    pub(crate) fn rope(&self) -> &RopeTable {
        &self.rope
    }

    /// RoPE frequencies of the windowed layers, when they have a base of their own.
    pub(crate) fn rope_local(&self) -> Option<&RopeTable> {
        self.rope_local.as_ref()
    }

    /// RoPE frequencies of layer `l`.
    pub(crate) fn layer_rope(&self, l: usize) -> &RopeTable {
        match (&self.rope_local, self.cfg.layer_window(l)) {
            (Some(local), Some(_)) => local,
            _ => &self.rope,
        }
    }
}

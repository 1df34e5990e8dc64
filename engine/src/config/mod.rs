//! Model configuration: the decoder's family and hyper-parameters, read from an HF
//! `config.json` (`hf`), from GGUF metadata (`gguf`), or taken from a preset (`presets`, for
//! dummy weights of real shapes).

mod gguf;
mod hf;
mod presets;
#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

use crate::backend::cpu::kernels::QuantKind;
use crate::error::{EngineError, Result};

/// How the weight matrices are stored, so that fewer bytes are read per decode step. f16 and
/// bf16 weights are widened to f32 inside the matmul kernel; GGML formats are dequantized
/// there (`exact` mode) or run as integer dot products over 8-bit activations (`fast`; see
/// `backend::cpu::kernels::compute` and `quant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeightFormat {
    /// As the file stores them: a GGUF's tensors in their own formats (Q8_0, Q4_0, Q4_1,
    /// Q4_K, Q5_K, Q6_K, f16, bf16, f32), an HF folder's in its dtype; dummy weights in f32.
    #[default]
    Native,
    F32,
    F16,
    Bf16,
    /// Every matrix in this GGML format, quantized at load where the file holds another.
    Quant(QuantKind),
}

impl WeightFormat {
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Native => "native",
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Quant(k) => k.name(),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "native" => Ok(WeightFormat::Native),
            "f32" | "float32" => Ok(WeightFormat::F32),
            "f16" | "float16" | "half" => Ok(WeightFormat::F16),
            "bf16" | "bfloat16" => Ok(WeightFormat::Bf16),
            other => QuantKind::parse(other).map(WeightFormat::Quant).ok_or_else(|| {
                EngineError::Config(format!(
                    "unknown weight format `{other}` (native, f32, f16, bf16, q8_0, q4_0, q4_1, \
                     q4_k, q5_k or q6_k)"
                ))
            }),
        }
    }
}

/// How RoPE frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3.1's frequency-dependent scaling (`rope_type: llama3`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Positions divided by `factor` (`rope_type: linear`; Gemma 3's global layers).
    Linear { factor: f64 },
    /// Each inverse frequency divided by its own factor: how llama.cpp's converter stores
    /// Llama 3's scaling in a GGUF (the `rope_freqs.weight` tensor, `head_dim / 2` values).
    Frequencies { divisors: Vec<f32> },
}

/// The decoder families the engine runs: the Llama block, and what each other family changes
/// in it. Anything a family's config asks for beyond these is refused at load, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2/3, SmolLM, Mistral.
    #[default]
    Llama,
    /// Qwen2 and Qwen2.5: biases on the Q, K and V projections.
    Qwen2,
    /// Qwen3 (dense): per-head RMSNorm of Q and K before RoPE, head_dim set on its own.
    Qwen3,
    /// Phi-3: the Llama block with Q/K/V and gate/up stored fused.
    Phi3,
    /// Gemma 2: embeddings scaled by √hidden, RMSNorm of the attention and MLP outputs
    /// before each residual add, GeGLU, soft-capped attention scores and logits, local
    /// (sliding-window) and global layers alternating.
    Gemma2,
    /// Gemma 3 (text): Gemma 2's block with per-head Q/K norms instead of soft-capping, five
    /// local layers per global one, and a RoPE base of their own for the local layers.
    Gemma3,
}

impl Architecture {
    /// Every family, in the order error messages list them.
    pub const ALL: [Architecture; 6] = [
        Self::Llama,
        Self::Qwen2,
        Self::Qwen3,
        Self::Phi3,
        Self::Gemma2,
        Self::Gemma3,
    ];

    /// The name GGUF metadata uses (`general.architecture`), which prefixes its keys.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3",
        }
    }

    fn from_gguf(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Gemma's block: embeddings scaled by √hidden, norms after attention and after the MLP
    /// as well as before them, and norm weights stored as offsets from 1 in HF checkpoints.
    pub fn is_gemma(self) -> bool {
        matches!(self, Architecture::Gemma2 | Architecture::Gemma3)
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The activation of the gated MLP: `act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU (Llama, Qwen, Mistral, Phi-3).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// The largest size of each config field [`ModelConfig::validate`] accepts, in the order it
/// checks them. A config is a file a stranger may have written, and the engine sizes tables
/// (RoPE frequencies, layers, KV blocks) and products of these numbers from it before any
/// weight is read: bounded, no product overflows and no table outgrows memory. Each bound is
/// many times the largest published model's (vocabularies of 262 144, widths of 16 384 and
/// 53 248, 126 layers, 128 heads, head_dim 256, contexts of 10 M).
pub const SIZE_BOUNDS: [(&str, usize); 8] = [
    ("vocab_size", 1 << 22),
    ("hidden_size", 1 << 17),
    ("intermediate_size", 1 << 19),
    ("num_hidden_layers", 1 << 12),
    ("num_attention_heads", 1 << 12),
    ("num_key_value_heads", 1 << 12),
    ("head_dim", 1 << 14),
    ("max_position_embeddings", 1 << 27),
];

/// The resolved hyper-parameters of a decoder.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelConfig {
    /// The family; part of the KV layout's fingerprint, so workers of different families
    /// refuse each other.
    #[serde(default)]
    pub arch: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Of the global layers' RoPE (local layers with their own base use none).
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on the Q, K and V projections (Qwen2; Llama configs with `attention_bias`).
    #[serde(default)]
    pub attention_bias: bool,
    /// Per-head RMSNorm of Q and K before RoPE (Qwen3, Gemma 3).
    #[serde(default)]
    pub qk_norm: bool,
    #[serde(default)]
    pub activation: Activation,
    /// Windowed layers attend to the last `sliding_window` positions, the query's own
    /// included (keys `pos - window < k ≤ pos`, as HF's masks have it).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// With a window: layer `l` attends globally when `(l + 1) % every == 0` and through the
    /// window otherwise (Gemma 2: 2, Gemma 3: 6); unset, every layer is windowed (Mistral).
    #[serde(default)]
    pub global_layer_every: Option<usize>,
    /// Attention scores are scaled by `1/√query_pre_attn_scalar` (Gemma) instead of `1/√head_dim`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// Scores become `cap·tanh(score/cap)` before the softmax (Gemma 2).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Logits become `cap·tanh(logit/cap)` (Gemma 2).
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// RoPE base of the windowed layers, when it differs from `rope_theta` (Gemma 3).
    #[serde(default)]
    pub rope_local_theta: Option<f64>,
}

impl ModelConfig {
    /// The attention window of layer `l`, or `None` when it attends to the whole context.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        let window = self.sliding_window?;
        match self.global_layer_every {
            Some(every) if (l + 1).is_multiple_of(every) => None,
            _ => Some(window),
        }
    }

    /// Whether some layer attends through a window shorter than the context.
    pub fn has_window(&self) -> bool {
        (0..self.num_hidden_layers).any(|l| {
            self.layer_window(l)
                .is_some_and(|w| w < self.max_position_embeddings)
        })
    }

    /// The window when every layer attends through one shorter than the context (Mistral,
    /// Phi-3): then a sequence's blocks before its window are never read again and are freed,
    /// and a prefill ships only the blocks the decode side will read. `None` when some layer
    /// attends globally (Gemma), since a block holds every layer.
    pub fn kv_window(&self) -> Option<usize> {
        let window = self.sliding_window?;
        let every_layer = (0..self.num_hidden_layers).all(|l| self.layer_window(l).is_some());
        (every_layer && window < self.max_position_embeddings).then_some(window)
    }

    /// The first logical block a sequence still needs once `next_pos` is the next position to
    /// compute (its first query sees keys from `next_pos + 1 - window`); 0 without a
    /// [`Self::kv_window`].
    pub fn first_needed_block(&self, next_pos: usize) -> usize {
        self.kv_window().map_or(0, |w| {
            (next_pos + 1).saturating_sub(w) / tandem_kv::BLOCK_SIZE
        })
    }

    /// The factor attention scores are multiplied by.
    pub fn attention_scale(&self) -> f32 {
        let scalar = self.query_pre_attn_scalar.unwrap_or(self.head_dim as f64);
        (1.0 / scalar.sqrt()) as f32
    }

    /// Rejects shapes the kernels cannot run, and sizes past [`SIZE_BOUNDS`].
    pub fn validate(&self) -> Result<()> {
        let fail = |m: String| Err(EngineError::Config(m));
        if self.num_hidden_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return fail("layers, hidden size and vocabulary must be non-zero".into());
        }
        let sizes = [
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.max_position_embeddings,
        ];
        if let Some(((name, bound), size)) = SIZE_BOUNDS
            .iter()
            .zip(sizes)
            .find(|((_, bound), size)| size > bound)
        {
            return fail(format!(
                "{name} {size} is past the {bound} tandem takes (no model it runs comes near)"
            ));
        }
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return fail(format!(
                "{} attention heads cannot be grouped over {} KV heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return fail(format!("head_dim {} must be even", self.head_dim));
        }
        if self.max_position_embeddings == 0 {
            return fail("context length must be non-zero".into());
        }
        if self.sliding_window == Some(0) || self.global_layer_every == Some(0) {
            return fail("a sliding window and its layer pattern must be non-zero".into());
        }
        let positive = |v: Option<f64>| v.is_none_or(|x| x.is_finite() && x > 0.0);
        if !positive(self.query_pre_attn_scalar)
            || !positive(self.attn_logit_softcapping)
            || !positive(self.final_logit_softcapping)
            || !positive(self.rope_local_theta)
            || !positive(Some(self.rope_theta))
            || !positive(Some(self.rms_norm_eps))
        {
            return fail(
                "attention scalar, soft-caps, RoPE bases and the norm epsilon must be positive"
                    .into(),
            );
        }
        if let Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            ..
        }) = self.rope_scaling
            && ![factor, low_freq_factor, high_freq_factor]
                .into_iter()
                .all(|x| positive(Some(x)))
        {
            return fail("rope_scaling's factors must be positive".into());
        }
        Ok(())
    }

    /// Elements of K (or V) per token per layer.
    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Elements of Q per token.
    pub fn q_width(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Number of weight elements, as loaded (tied embeddings counted once).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let qkv = self.q_width() + 2 * self.kv_width();
        let per_layer = h * qkv
            + self.q_width() * h
            + 3 * h * self.intermediate_size
            + if self.arch.is_gemma() { 4 * h } else { 2 * h }
            + if self.attention_bias { qkv } else { 0 }
            + if self.qk_norm { 2 * self.head_dim } else { 0 };
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        per_layer * self.num_hidden_layers + embed + head + h
    }
}

//! [`ModelConfig`] from GGUF metadata: the `<architecture>.*` keys llama.cpp's converter
//! writes, with the same defaults its loader assumes where a key is absent.

use super::{Activation, Architecture, ModelConfig, RopeScaling};
use crate::error::{EngineError, Result};

impl ModelConfig {
    /// Reads the `<architecture>.*` keys of GGUF metadata; `has_tensor` tells which optional
    /// tensors the file holds (an untied LM head, Q/K/V biases).
    pub fn from_gguf(
        meta: &tandem_text::gguf::GgufMetadata,
        has_tensor: &dyn Fn(&str) -> bool,
    ) -> Result<Self> {
        let name = meta.get_str("general.architecture").unwrap_or("none");
        let arch = Architecture::from_gguf(name).ok_or_else(|| {
            EngineError::Unsupported(format!(
                "GGUF architecture `{name}` (supported: {})",
                Architecture::ALL.map(Architecture::name).join(", ")
            ))
        })?;
        let key = |k: &str| format!("{name}.{k}");
        let req = |k: &str| {
            meta.get_u64(&key(k))
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::Config(format!("GGUF metadata lacks {}", key(k))))
        };
        let heads = req("attention.head_count")?;
        let hidden = req("embedding_length")?;
        let vocab = match meta.get_u64(&key("vocab_size")) {
            Some(v) => v as usize,
            None => meta.get_strings("tokenizer.ggml.tokens")?.len(),
        };
        let gemma = arch.is_gemma();
        let layers = req("block_count")?;
        let head_dim = meta
            .get_u64(&key("attention.key_length"))
            .map_or(hidden / heads.max(1), |v| v as usize);
        let float = |k: &str| meta.get_f64(&key(k));
        // llama.cpp's converter writes no query_pre_attn_scalar: its Gemma code scales by
        // hidden/heads for the 27B models (46 layers in Gemma 2, 62 in Gemma 3) and by
        // head_dim otherwise, as their HF configs say. The same rule here.
        let query_pre_attn_scalar = gemma.then(|| {
            let is_27b = matches!(
                (arch, layers),
                (Architecture::Gemma2, 46) | (Architecture::Gemma3, 62)
            );
            if is_27b {
                (hidden / heads.max(1)) as f64
            } else {
                head_dim as f64
            }
        });
        let rope_scaling = match meta.get_str(&key("rope.scaling.type")) {
            None | Some("none") => None,
            Some("linear") => match float("rope.scaling.factor") {
                Some(factor) if factor.is_finite() && factor > 0.0 => {
                    Some(RopeScaling::Linear { factor })
                }
                _ => {
                    return Err(EngineError::Unsupported(format!(
                        "GGUF {name} with linear RoPE scaling but no positive factor"
                    )));
                }
            },
            Some(kind) => {
                return Err(EngineError::Unsupported(format!(
                    "GGUF {name} with RoPE scaling `{kind}`"
                )));
            }
        };
        let window = meta
            .get_u64(&key("attention.sliding_window"))
            .map(|w| w as usize);
        let pattern = meta
            .get_u64(&key("attention.sliding_window_pattern"))
            .map(|p| p as usize);
        let cfg = ModelConfig {
            arch,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: req("feed_forward_length")?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: meta
                .get_u64(&key("attention.head_count_kv"))
                .map_or(heads, |v| v as usize),
            head_dim,
            rms_norm_eps: meta
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(if gemma { 1e-6 } else { 1e-5 }),
            rope_theta: meta.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            max_position_embeddings: req("context_length")?,
            tie_word_embeddings: !has_tensor("output.weight"),
            rope_scaling,
            attention_bias: has_tensor("blk.0.attn_q.bias"),
            qk_norm: matches!(arch, Architecture::Qwen3 | Architecture::Gemma3),
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            sliding_window: window,
            global_layer_every: match arch {
                Architecture::Gemma2 => Some(pattern.unwrap_or(2)),
                Architecture::Gemma3 => Some(pattern.unwrap_or(6)),
                _ => None,
            },
            query_pre_attn_scalar,
            attn_logit_softcapping: float("attn_logit_softcapping"),
            final_logit_softcapping: float("final_logit_softcapping"),
            // llama.cpp fixes Gemma 3's local RoPE base at 10 000, as its HF configs do.
            rope_local_theta: (arch == Architecture::Gemma3).then_some(10_000.0),
        };
        if has_tensor("rope_factors_long.weight") {
            return Err(EngineError::Unsupported(format!(
                "GGUF {name} with long-context RoPE factors (longrope)"
            )));
        }
        if let Some(dims) = meta.get_u64(&key("rope.dimension_count"))
            && dims as usize != cfg.head_dim
        {
            return Err(EngineError::Unsupported(format!(
                "GGUF {name} with RoPE on {dims} of {} dimensions per head",
                cfg.head_dim
            )));
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

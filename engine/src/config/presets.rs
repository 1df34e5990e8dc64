//! Preset shapes of real models, for `dummy:<preset>` weights and benchmarks.

use super::{Activation, Architecture, ModelConfig, RopeScaling};
use crate::error::{EngineError, Result};

impl ModelConfig {
    /// The preset shapes (`dummy:<preset>` models, benchmarks).
    pub const PRESETS: [&str; 11] = [
        "tiny",
        "tiny-window",
        "smollm2-135m",
        "llama-3.2-1b",
        "llama-3.1-8b",
        "qwen2.5-0.5b",
        "qwen3-0.6b",
        "mistral-7b",
        "phi3-mini",
        "gemma2-2b",
        "gemma3-1b",
    ];

    /// A named preset shape, one of [`Self::PRESETS`] (`smollm2` also names SmolLM2's).
    pub fn preset(name: &str) -> Result<Self> {
        let llama3_scaling = |factor| {
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            })
        };
        let cfg = match name {
            // The built-in test model: byte-level vocabulary, small enough for debug builds,
            // a context long enough for 32k-token chunked-prefill tests.
            "tiny" => ModelConfig {
                arch: Architecture::Llama,
                vocab_size: 259,
                hidden_size: 64,
                intermediate_size: 176,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                head_dim: 16,
                rms_norm_eps: 1e-5,
                rope_theta: 10_000.0,
                max_position_embeddings: 40_960,
                tie_word_embeddings: true,
                rope_scaling: None,
                attention_bias: false,
                qk_norm: false,
                ..Default::default()
            },
            // The test model with every layer attending through a 48-key window (a
            // Mistral-style sliding window), for the tests of window-sized KV.
            "tiny-window" => ModelConfig {
                sliding_window: Some(48),
                ..Self::preset("tiny")?
            },
            "smollm2-135m" | "smollm2" => ModelConfig {
                arch: Architecture::Llama,
                vocab_size: 49_152,
                hidden_size: 576,
                intermediate_size: 1536,
                num_hidden_layers: 30,
                num_attention_heads: 9,
                num_key_value_heads: 3,
                head_dim: 64,
                rms_norm_eps: 1e-5,
                rope_theta: 100_000.0,
                max_position_embeddings: 8192,
                tie_word_embeddings: true,
                rope_scaling: None,
                attention_bias: false,
                qk_norm: false,
                ..Default::default()
            },
            "llama-3.2-1b" => ModelConfig {
                arch: Architecture::Llama,
                vocab_size: 128_256,
                hidden_size: 2048,
                intermediate_size: 8192,
                num_hidden_layers: 16,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 64,
                rms_norm_eps: 1e-5,
                rope_theta: 500_000.0,
                max_position_embeddings: 131_072,
                tie_word_embeddings: true,
                rope_scaling: llama3_scaling(32.0),
                attention_bias: false,
                qk_norm: false,
                ..Default::default()
            },
            "llama-3.1-8b" => ModelConfig {
                arch: Architecture::Llama,
                vocab_size: 128_256,
                hidden_size: 4096,
                intermediate_size: 14_336,
                num_hidden_layers: 32,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 128,
                rms_norm_eps: 1e-5,
                rope_theta: 500_000.0,
                max_position_embeddings: 131_072,
                tie_word_embeddings: false,
                rope_scaling: llama3_scaling(8.0),
                attention_bias: false,
                qk_norm: false,
                ..Default::default()
            },
            "qwen2.5-0.5b" => ModelConfig {
                arch: Architecture::Qwen2,
                vocab_size: 151_936,
                hidden_size: 896,
                intermediate_size: 4864,
                num_hidden_layers: 24,
                num_attention_heads: 14,
                num_key_value_heads: 2,
                head_dim: 64,
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 32_768,
                tie_word_embeddings: true,
                rope_scaling: None,
                attention_bias: true,
                qk_norm: false,
                ..Default::default()
            },
            "qwen3-0.6b" => ModelConfig {
                arch: Architecture::Qwen3,
                vocab_size: 151_936,
                hidden_size: 1024,
                intermediate_size: 3072,
                num_hidden_layers: 28,
                num_attention_heads: 16,
                num_key_value_heads: 8,
                head_dim: 128,
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 40_960,
                tie_word_embeddings: true,
                rope_scaling: None,
                attention_bias: false,
                qk_norm: true,
                ..Default::default()
            },
            "mistral-7b" => ModelConfig {
                arch: Architecture::Llama,
                vocab_size: 32_768,
                hidden_size: 4096,
                intermediate_size: 14_336,
                num_hidden_layers: 32,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 128,
                rms_norm_eps: 1e-5,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 32_768,
                tie_word_embeddings: false,
                rope_scaling: None,
                attention_bias: false,
                qk_norm: false,
                ..Default::default()
            },
            "phi3-mini" => ModelConfig {
                arch: Architecture::Phi3,
                vocab_size: 32_064,
                hidden_size: 3072,
                intermediate_size: 8192,
                num_hidden_layers: 32,
                num_attention_heads: 32,
                num_key_value_heads: 32,
                head_dim: 96,
                rms_norm_eps: 1e-5,
                rope_theta: 10_000.0,
                max_position_embeddings: 4096,
                sliding_window: Some(2047),
                tie_word_embeddings: false,
                rope_scaling: None,
                attention_bias: false,
                qk_norm: false,
                ..Default::default()
            },
            // Gemma 2 2B: local (4096-token window) and global layers alternate.
            "gemma2-2b" => ModelConfig {
                arch: Architecture::Gemma2,
                vocab_size: 256_000,
                hidden_size: 2304,
                intermediate_size: 9216,
                num_hidden_layers: 26,
                num_attention_heads: 8,
                num_key_value_heads: 4,
                head_dim: 256,
                rms_norm_eps: 1e-6,
                rope_theta: 10_000.0,
                max_position_embeddings: 8192,
                tie_word_embeddings: true,
                rope_scaling: None,
                attention_bias: false,
                qk_norm: false,
                activation: Activation::GeluTanh,
                sliding_window: Some(4096),
                global_layer_every: Some(2),
                query_pre_attn_scalar: Some(256.0),
                attn_logit_softcapping: Some(50.0),
                final_logit_softcapping: Some(30.0),
                rope_local_theta: None,
            },
            // Gemma 3 1B: five local layers (512-token window, RoPE base 10 000) per global one.
            "gemma3-1b" => ModelConfig {
                arch: Architecture::Gemma3,
                vocab_size: 262_144,
                hidden_size: 1152,
                intermediate_size: 6912,
                num_hidden_layers: 26,
                num_attention_heads: 4,
                num_key_value_heads: 1,
                head_dim: 256,
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 32_768,
                tie_word_embeddings: true,
                rope_scaling: None,
                attention_bias: false,
                qk_norm: true,
                activation: Activation::GeluTanh,
                sliding_window: Some(512),
                global_layer_every: Some(6),
                query_pre_attn_scalar: Some(256.0),
                attn_logit_softcapping: None,
                final_logit_softcapping: None,
                rope_local_theta: Some(10_000.0),
            },
            other => {
                return Err(EngineError::Config(format!(
                    "unknown preset `{other}` ({})",
                    Self::PRESETS.join(", ")
                )));
            }
        };
        Ok(cfg)
    }
}

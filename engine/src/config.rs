//! Model configuration: the decoder's family and hyper-parameters, read from an HF
//! `config.json`, from GGUF metadata, or taken from a preset (for dummy weights of real shapes).

use serde::{Deserialize, Serialize};

use crate::backend::cpu::kernels::QuantKind;
use crate::error::{EngineError, Result};

/// How the weight matrices are stored. Compute is f32 on the CPU whatever the storage: f16 and
/// bf16 weights are widened inside the matmul kernel and GGML formats dequantized there (see
/// `backend::cpu::kernels::quant`), so fewer bytes are read per decode step.
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

/// Llama 3's long-context RoPE frequency scaling (`rope_type: llama3`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// The decoder families the engine runs: the Llama block, and what each other family changes
/// in it. Anything a family's config asks for beyond these is refused at load, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2/3, SmolLM, Mistral (within its attention window).
    #[default]
    Llama,
    /// Qwen2 and Qwen2.5: biases on the Q, K and V projections.
    Qwen2,
    /// Qwen3 (dense): per-head RMSNorm of Q and K before RoPE, head_dim set on its own.
    Qwen3,
    /// Phi-3: the Llama block with Q/K/V and gate/up stored fused.
    Phi3,
}

impl Architecture {
    /// The name GGUF metadata uses (`general.architecture`), which prefixes its keys.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
        }
    }

    fn from_gguf(name: &str) -> Option<Self> {
        [Self::Llama, Self::Qwen2, Self::Qwen3, Self::Phi3]
            .into_iter()
            .find(|a| a.name() == name)
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The resolved hyper-parameters of a decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on the Q, K and V projections (Qwen2; Llama configs with `attention_bias`).
    #[serde(default)]
    pub attention_bias: bool,
    /// Per-head RMSNorm of Q and K before RoPE (Qwen3).
    #[serde(default)]
    pub qk_norm: bool,
}

/// The subset of an HF `config.json` that the supported families need.
#[derive(Debug, Deserialize)]
struct HfConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    rope_scaling: Option<serde_json::Value>,
    model_type: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    partial_rotary_factor: Option<f64>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
}

impl ModelConfig {
    /// Parses an HF `config.json`.
    pub fn from_hf_json(json: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(json)
            .map_err(|e| EngineError::Config(format!("config.json: {e}")))?;
        let model_type = hf.model_type.as_deref().unwrap_or("llama");
        let arch = match model_type {
            "llama" | "mistral" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "phi3" => Architecture::Phi3,
            other => {
                return Err(EngineError::Unsupported(format!(
                    "model_type `{other}` (supported: llama, mistral, qwen2, qwen3, phi3)"
                )));
            }
        };
        if let Some(f) = hf.partial_rotary_factor
            && f != 1.0
        {
            return Err(EngineError::Unsupported(format!(
                "{model_type} with partial_rotary_factor {f} (RoPE on part of each head)"
            )));
        }
        if hf.mlp_bias == Some(true) {
            return Err(EngineError::Unsupported(format!(
                "{model_type} with mlp_bias: true"
            )));
        }
        if hf.use_sliding_window == Some(true) {
            return Err(EngineError::Unsupported(format!(
                "{model_type} with use_sliding_window: true (sliding-window attention)"
            )));
        }
        let rope_scaling = match &hf.rope_scaling {
            Some(v)
                if v.get("rope_type")
                    .or_else(|| v.get("type"))
                    .and_then(|t| t.as_str())
                    == Some("llama3") =>
            {
                let num = |k: &str| v.get(k).and_then(|x| x.as_f64());
                Some(RopeScaling {
                    factor: num("factor").unwrap_or(8.0),
                    low_freq_factor: num("low_freq_factor").unwrap_or(1.0),
                    high_freq_factor: num("high_freq_factor").unwrap_or(4.0),
                    original_max_position_embeddings: num("original_max_position_embeddings")
                        .unwrap_or(8192.0)
                        as usize,
                })
            }
            Some(v) if !v.is_null() => {
                return Err(EngineError::Unsupported(format!("rope_scaling {v}")));
            }
            _ => None,
        };
        let mut max_position_embeddings = hf.max_position_embeddings.unwrap_or(4096);
        // Mistral's and Phi-3's sliding window: attention inside the window is plain causal
        // attention, so a context capped at the window runs the model exactly; longer prompts
        // are refused (as too long) rather than attended over keys the model never sees.
        if matches!(model_type, "mistral" | "phi3")
            && let Some(window) = hf.sliding_window
            && window < max_position_embeddings
        {
            tracing::info!(
                window,
                max_position_embeddings,
                "sliding-window attention: context capped at the window"
            );
            max_position_embeddings = window;
        }
        let cfg = ModelConfig {
            arch,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-5),
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            rope_scaling,
            attention_bias: arch == Architecture::Qwen2 || hf.attention_bias == Some(true),
            qk_norm: arch == Architecture::Qwen3,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the `<architecture>.*` keys of GGUF metadata; `has_tensor` tells which optional
    /// tensors the file holds (an untied LM head, Q/K/V biases).
    pub fn from_gguf(
        meta: &tandem_text::gguf::GgufMetadata,
        has_tensor: &dyn Fn(&str) -> bool,
    ) -> Result<Self> {
        let name = meta.get_str("general.architecture").unwrap_or("none");
        let arch = Architecture::from_gguf(name).ok_or_else(|| {
            EngineError::Unsupported(format!(
                "GGUF architecture `{name}` (supported: llama, qwen2, qwen3, phi3)"
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
        let cfg = ModelConfig {
            arch,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: req("feed_forward_length")?,
            num_hidden_layers: req("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: meta
                .get_u64(&key("attention.head_count_kv"))
                .map_or(heads, |v| v as usize),
            head_dim: meta
                .get_u64(&key("attention.key_length"))
                .map_or(hidden / heads.max(1), |v| v as usize),
            rms_norm_eps: meta
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
            rope_theta: meta.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            max_position_embeddings: req("context_length")?,
            tie_word_embeddings: !has_tensor("output.weight"),
            rope_scaling: None,
            attention_bias: has_tensor("blk.0.attn_q.bias"),
            qk_norm: arch == Architecture::Qwen3,
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
        if let Some(kind) = meta.get_str(&key("rope.scaling.type"))
            && kind != "none"
        {
            return Err(EngineError::Unsupported(format!(
                "GGUF {name} with RoPE scaling `{kind}`"
            )));
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// The preset shapes (`dummy:<preset>` models, benchmarks).
    pub const PRESETS: [&str; 8] = [
        "tiny",
        "smollm2-135m",
        "llama-3.2-1b",
        "llama-3.1-8b",
        "qwen2.5-0.5b",
        "qwen3-0.6b",
        "mistral-7b",
        "phi3-mini",
    ];

    /// A named preset shape, one of [`Self::PRESETS`] (`smollm2` also names SmolLM2's).
    pub fn preset(name: &str) -> Result<Self> {
        let llama3_scaling = |factor| {
            Some(RopeScaling {
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
                tie_word_embeddings: false,
                rope_scaling: None,
                attention_bias: false,
                qk_norm: false,
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

    /// Rejects shapes the kernels cannot run.
    pub fn validate(&self) -> Result<()> {
        let fail = |m: String| Err(EngineError::Config(m));
        if self.num_hidden_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return fail("layers, hidden size and vocabulary must be non-zero".into());
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
            + 2 * h
            + if self.attention_bias { qkv } else { 0 }
            + if self.qk_norm { 2 * self.head_dim } else { 0 };
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        per_layer * self.num_hidden_layers + embed + head + h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_sized() {
        for name in ModelConfig::PRESETS {
            let cfg = ModelConfig::preset(name).unwrap();
            cfg.validate().unwrap();
        }
        // Published sizes: Qwen2.5-0.5B 494 M parameters, Qwen3-0.6B 596 M (tied embeddings).
        let q25 = ModelConfig::preset("qwen2.5-0.5b")
            .unwrap()
            .num_parameters();
        assert!((490_000_000..498_000_000).contains(&q25), "{q25}");
        let q3 = ModelConfig::preset("qwen3-0.6b").unwrap().num_parameters();
        assert!((592_000_000..600_000_000).contains(&q3), "{q3}");
        // Mistral-7B-v0.3 7.25 B, Phi-3-mini 3.82 B.
        let m7 = ModelConfig::preset("mistral-7b").unwrap().num_parameters();
        assert!((7_240_000_000..7_260_000_000).contains(&m7), "{m7}");
        let phi = ModelConfig::preset("phi3-mini").unwrap().num_parameters();
        assert!((3_815_000_000..3_830_000_000).contains(&phi), "{phi}");
        let smol = ModelConfig::preset("smollm2-135m").unwrap();
        let params = smol.num_parameters();
        assert!((134_000_000..136_000_000).contains(&params), "{params}");
        let l8 = ModelConfig::preset("llama-3.1-8b").unwrap();
        assert!((8_000_000_000..8_100_000_000).contains(&l8.num_parameters()));
        assert!(ModelConfig::preset("gpt-5").is_err());
    }

    #[test]
    fn parses_hf_config() {
        let json = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":49152,"hidden_size":576,
            "intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,
            "rms_norm_eps":1e-05,"rope_theta":100000,"max_position_embeddings":8192,"tie_word_embeddings":true}"#;
        let cfg = ModelConfig::from_hf_json(json).unwrap();
        assert_eq!(cfg, ModelConfig::preset("smollm2-135m").unwrap());
        let scaled = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,
            "high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#;
        assert_eq!(
            ModelConfig::from_hf_json(scaled)
                .unwrap()
                .rope_scaling
                .unwrap()
                .factor,
            32.0
        );
        assert!(ModelConfig::from_hf_json(r#"{"model_type":"gpt2"}"#).is_err());
        let bad_heads = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":3,"num_key_value_heads":2}"#;
        assert!(matches!(
            ModelConfig::from_hf_json(bad_heads),
            Err(EngineError::Config(_))
        ));
    }

    #[test]
    fn families_from_hf_config() {
        let base = |extra: &str| {
            format!(
                r#"{{"vocab_size":151936,"hidden_size":896,"intermediate_size":4864,
                "num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,
                "rms_norm_eps":1e-06,"rope_theta":1000000.0,"max_position_embeddings":32768,
                "tie_word_embeddings":true,"sliding_window":32768,"use_sliding_window":false,
                {extra}}}"#
            )
        };
        let qwen2 = ModelConfig::from_hf_json(&base(r#""model_type":"qwen2""#)).unwrap();
        assert_eq!(qwen2, ModelConfig::preset("qwen2.5-0.5b").unwrap());
        let qwen3 = ModelConfig::from_hf_json(&base(
            r#""model_type":"qwen3","head_dim":128,"attention_bias":false"#,
        ))
        .unwrap();
        assert!(qwen3.qk_norm && !qwen3.attention_bias && qwen3.head_dim == 128);
        assert_eq!(qwen3.arch, Architecture::Qwen3);

        // Mistral's window caps the context (exact inside it); none leaves it alone.
        let mistral = |window: &str| {
            ModelConfig::from_hf_json(&format!(
                r#"{{"model_type":"mistral","vocab_size":32000,"hidden_size":64,
                "intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,
                "num_key_value_heads":2,"max_position_embeddings":32768,"sliding_window":{window}}}"#
            ))
            .unwrap()
        };
        assert_eq!(mistral("4096").max_position_embeddings, 4096);
        assert_eq!(mistral("null").max_position_embeddings, 32768);
        let phi3 = ModelConfig::from_hf_json(
            &base(r#""model_type":"phi3","sliding_window":2047"#)
                .replace(r#""sliding_window":32768,"#, ""),
        )
        .unwrap();
        assert_eq!(
            (phi3.arch, phi3.max_position_embeddings),
            (Architecture::Phi3, 2047)
        );

        // What no family here runs is refused by name.
        for (extra, named) in [
            (
                r#""model_type":"qwen2","use_sliding_window":true"#,
                "use_sliding_window",
            ),
            (r#""model_type":"llama","mlp_bias":true"#, "mlp_bias"),
            (r#""model_type":"gemma2""#, "gemma2"),
            (
                r#""model_type":"qwen2","rope_scaling":{"type":"yarn","factor":4.0}"#,
                "yarn",
            ),
            (
                r#""model_type":"phi3","rope_scaling":{"type":"longrope","short_factor":[1.0],"long_factor":[1.0]}"#,
                "longrope",
            ),
            (
                r#""model_type":"phi3","partial_rotary_factor":0.75"#,
                "partial_rotary_factor",
            ),
        ] {
            let json = base(extra).replace(r#""use_sliding_window":false,"#, "");
            let err = ModelConfig::from_hf_json(&json).unwrap_err().to_string();
            assert!(err.contains(named), "{extra}: {err}");
        }
    }

    #[test]
    fn families_from_gguf_metadata() {
        use tandem_text::gguf::{GgufMetadata, GgufValue};
        let meta = |arch: &str, extra: &[(&str, GgufValue)]| {
            let mut m = GgufMetadata::default();
            let mut put = |k: &str, v: GgufValue| m.entries.insert(k.to_string(), v);
            put("general.architecture", GgufValue::String(arch.into()));
            for (k, v) in [
                ("block_count", 28u64),
                ("context_length", 40960),
                ("embedding_length", 1024),
                ("feed_forward_length", 3072),
                ("attention.head_count", 16),
                ("attention.head_count_kv", 8),
                ("attention.key_length", 128),
                ("vocab_size", 151936),
            ] {
                put(&format!("{arch}.{k}"), GgufValue::U64(v));
            }
            put(&format!("{arch}.rope.freq_base"), GgufValue::F32(1e6));
            put(
                &format!("{arch}.attention.layer_norm_rms_epsilon"),
                GgufValue::F32(1e-6),
            );
            for (k, v) in extra {
                put(k, v.clone());
            }
            m
        };
        let none = |_: &str| false;
        let qwen3 = ModelConfig::from_gguf(&meta("qwen3", &[]), &none).unwrap();
        // GGUF stores the epsilon as an f32.
        let want = ModelConfig {
            rms_norm_eps: f64::from(1e-6f32),
            ..ModelConfig::preset("qwen3-0.6b").unwrap()
        };
        assert_eq!(qwen3, want);
        let bias = |name: &str| name == "blk.0.attn_q.bias";
        let qwen2 = ModelConfig::from_gguf(&meta("qwen2", &[]), &bias).unwrap();
        assert!(qwen2.attention_bias && !qwen2.qk_norm && qwen2.arch == Architecture::Qwen2);
        let err = ModelConfig::from_gguf(&meta("gemma2", &[]), &none).unwrap_err();
        assert!(err.to_string().contains("gemma2"), "{err}");
        let longrope = |name: &str| name == "rope_factors_long.weight";
        let err = ModelConfig::from_gguf(&meta("phi3", &[]), &longrope).unwrap_err();
        assert!(err.to_string().contains("longrope"), "{err}");
        let partial = [("phi3.rope.dimension_count", GgufValue::U64(96))];
        let err = ModelConfig::from_gguf(&meta("phi3", &partial), &none).unwrap_err();
        assert!(err.to_string().contains("96 of 128"), "{err}");
        let yarn = [("qwen2.rope.scaling.type", GgufValue::String("yarn".into()))];
        let err = ModelConfig::from_gguf(&meta("qwen2", &yarn), &bias).unwrap_err();
        assert!(err.to_string().contains("yarn"), "{err}");
    }

    #[test]
    fn dtype_names() {
        assert_eq!("BF16".parse::<WeightFormat>().unwrap(), WeightFormat::Bf16);
        assert_eq!(
            "Q4_K".parse::<WeightFormat>().unwrap(),
            WeightFormat::Quant(QuantKind::Q4K)
        );
        for f in [
            "native", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k",
        ] {
            assert_eq!(f.parse::<WeightFormat>().unwrap().name(), f);
        }
        assert!("int4".parse::<WeightFormat>().is_err());
    }
}

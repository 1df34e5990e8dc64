//! Model configuration: the Llama-family hyper-parameters, read from an HF `config.json`, from
//! GGUF metadata, or taken from a preset (for dummy weights of real shapes).

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

/// The resolved hyper-parameters of a Llama-family decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
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
}

/// The subset of an HF `config.json` that a Llama model needs.
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
}

impl ModelConfig {
    /// Parses an HF `config.json`.
    pub fn from_hf_json(json: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(json)
            .map_err(|e| EngineError::Config(format!("config.json: {e}")))?;
        if let Some(t) = &hf.model_type
            && !matches!(t.as_str(), "llama" | "mistral")
        {
            return Err(EngineError::Unsupported(format!(
                "model_type `{t}`: only the Llama family (llama, mistral) is supported"
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
        let cfg = ModelConfig {
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
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            rope_scaling,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the `llama.*` keys of GGUF metadata.
    pub fn from_gguf(
        meta: &tandem_text::gguf::GgufMetadata,
        has_output_weight: bool,
    ) -> Result<Self> {
        let arch = meta.get_str("general.architecture").unwrap_or("none");
        if arch != "llama" {
            return Err(EngineError::Unsupported(format!(
                "GGUF architecture `{arch}`: only `llama` is supported"
            )));
        }
        let req = |k: &str| {
            meta.get_u64(&format!("llama.{k}"))
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::Config(format!("GGUF metadata lacks llama.{k}")))
        };
        let heads = req("attention.head_count")?;
        let hidden = req("embedding_length")?;
        let vocab = match meta.get_u64("llama.vocab_size") {
            Some(v) => v as usize,
            None => meta.get_strings("tokenizer.ggml.tokens")?.len(),
        };
        let cfg = ModelConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: req("feed_forward_length")?,
            num_hidden_layers: req("block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: meta
                .get_u64("llama.attention.head_count_kv")
                .map_or(heads, |v| v as usize),
            head_dim: meta
                .get_u64("llama.attention.key_length")
                .map_or(hidden / heads.max(1), |v| v as usize),
            rms_norm_eps: meta
                .get_f64("llama.attention.layer_norm_rms_epsilon")
                .unwrap_or(1e-5),
            rope_theta: meta.get_f64("llama.rope.freq_base").unwrap_or(10_000.0),
            max_position_embeddings: req("context_length")?,
            tie_word_embeddings: !has_output_weight,
            rope_scaling: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A named preset shape: `tiny`, `smollm2-135m`, `llama-3.2-1b`, `llama-3.1-8b`.
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
            },
            "smollm2-135m" | "smollm2" => ModelConfig {
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
            },
            "llama-3.2-1b" => ModelConfig {
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
            },
            "llama-3.1-8b" => ModelConfig {
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
            },
            other => {
                return Err(EngineError::Config(format!(
                    "unknown preset `{other}` (tiny, smollm2-135m, llama-3.2-1b, llama-3.1-8b)"
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
        let per_layer = h * (self.q_width() + 2 * self.kv_width())
            + self.q_width() * h
            + 3 * h * self.intermediate_size
            + 2 * h;
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
        for name in ["tiny", "smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"] {
            let cfg = ModelConfig::preset(name).unwrap();
            cfg.validate().unwrap();
        }
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

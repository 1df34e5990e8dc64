//! [`ModelConfig`] from an HF `config.json`: the keys each supported family uses, and a
//! refusal by name for every option the engine does not run.

use serde::Deserialize;

use super::{Activation, Architecture, ModelConfig, RopeScaling};
use crate::error::{EngineError, Result};

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
    hidden_act: Option<String>,
    /// Gemma's name for the activation (it wins over `hidden_act` there).
    hidden_activation: Option<String>,
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    /// Gemma 3: one global layer in this many.
    sliding_window_pattern: Option<usize>,
    /// Newer Gemma 3 configs spell the pattern out per layer.
    layer_types: Option<Vec<String>>,
    rope_local_base_freq: Option<f64>,
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
            "gemma2" => Architecture::Gemma2,
            "gemma3_text" => Architecture::Gemma3,
            "gemma3" => {
                return Err(EngineError::Unsupported(
                    "model_type `gemma3` (the multimodal checkpoint; its text-only \
                     `gemma3_text` form is supported)"
                        .into(),
                ));
            }
            other => {
                return Err(EngineError::Unsupported(format!(
                    "model_type `{other}` (supported: llama, mistral, qwen2, qwen3, phi3, gemma2, \
                     gemma3_text)"
                )));
            }
        };
        let refusal = |what: String| EngineError::Unsupported(format!("{model_type} with {what}"));
        let unsupported = |what: String| Err(refusal(what));
        if let Some(f) = hf.partial_rotary_factor
            && f != 1.0
        {
            return unsupported(format!(
                "partial_rotary_factor {f} (RoPE on part of each head)"
            ));
        }
        if hf.mlp_bias == Some(true) {
            return unsupported("mlp_bias: true".into());
        }
        if hf.use_sliding_window == Some(true) {
            return unsupported("use_sliding_window: true (Qwen's windowed upper layers)".into());
        }
        let gemma = arch.is_gemma();
        let act_name = if gemma {
            hf.hidden_activation.as_deref().or(hf.hidden_act.as_deref())
        } else {
            hf.hidden_act.as_deref()
        };
        let activation = match (act_name, gemma) {
            (None | Some("silu"), false) => Activation::Silu,
            (None | Some("gelu_pytorch_tanh" | "gelu_tanh"), true) => Activation::GeluTanh,
            (Some(other), _) => return unsupported(format!("hidden activation `{other}`")),
        };
        let rope_scaling = parse_rope_scaling(hf.rope_scaling.as_ref()).map_err(refusal)?;
        // Windows: Mistral's and Phi-3's on every layer, Gemma's on its local layers. Qwen's
        // `sliding_window` is only a setting of the refused `use_sliding_window` above.
        let (sliding_window, global_layer_every) = match arch {
            Architecture::Llama | Architecture::Phi3 => (hf.sliding_window, None),
            Architecture::Gemma2 => (hf.sliding_window, Some(2)),
            Architecture::Gemma3 => {
                let every = match (&hf.layer_types, hf.sliding_window_pattern) {
                    (Some(types), _) => pattern_of(types).map_err(refusal)?,
                    (None, Some(p)) => p,
                    (None, None) => 6,
                };
                (hf.sliding_window, Some(every))
            }
            Architecture::Qwen2 | Architecture::Qwen3 => (None, None),
        };
        if !gemma && (hf.attn_logit_softcapping.is_some() || hf.final_logit_softcapping.is_some()) {
            return unsupported("logit soft-capping".into());
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
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(if gemma { 1e-6 } else { 1e-5 }),
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(4096),
            // Gemma's configs leave it out: their LM head is always the embedding table.
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(gemma),
            rope_scaling,
            attention_bias: arch == Architecture::Qwen2 || hf.attention_bias == Some(true),
            qk_norm: matches!(arch, Architecture::Qwen3 | Architecture::Gemma3),
            activation,
            sliding_window,
            global_layer_every,
            query_pre_attn_scalar: if gemma {
                hf.query_pre_attn_scalar
            } else {
                None
            },
            attn_logit_softcapping: hf.attn_logit_softcapping,
            final_logit_softcapping: hf.final_logit_softcapping,
            rope_local_theta: (arch == Architecture::Gemma3)
                .then_some(hf.rope_local_base_freq.unwrap_or(10_000.0)),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// `rope_scaling` of a config: none, Llama 3's, or linear; anything else is an error naming it.
pub(super) fn parse_rope_scaling(
    value: Option<&serde_json::Value>,
) -> std::result::Result<Option<RopeScaling>, String> {
    let Some(v) = value.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let num = |k: &str| v.get(k).and_then(|x| x.as_f64());
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str());
    match kind {
        Some("llama3") => Ok(Some(RopeScaling::Llama3 {
            factor: num("factor").unwrap_or(8.0),
            low_freq_factor: num("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: num("high_freq_factor").unwrap_or(4.0),
            original_max_position_embeddings: num("original_max_position_embeddings")
                .unwrap_or(8192.0) as usize,
        })),
        Some("linear") => match num("factor") {
            Some(factor) if factor.is_finite() && factor > 0.0 => {
                Ok(Some(RopeScaling::Linear { factor }))
            }
            _ => Err(format!("rope_scaling {v} (linear needs a positive factor)")),
        },
        Some("default") => Ok(None),
        _ => Err(format!("rope_scaling {v}")),
    }
}

/// The `every` of a `layer_types` list whose global layers are every `every`-th one.
fn pattern_of(types: &[String]) -> std::result::Result<usize, String> {
    let global = |t: &String| t == "full_attention";
    if let Some(t) = types
        .iter()
        .find(|t| !global(t) && t.as_str() != "sliding_attention")
    {
        return Err(format!("layer type `{t}`"));
    }
    let every = types
        .iter()
        .position(global)
        .map_or(types.len() + 1, |i| i + 1);
    let regular = types
        .iter()
        .enumerate()
        .all(|(l, t)| global(t) == (l + 1).is_multiple_of(every));
    if regular {
        Ok(every)
    } else {
        Err("layer_types whose global layers are not every n-th layer".into())
    }
}

//! An HF folder: `config.json`, `*.safetensors` and `tokenizer.json`, and the weights of its
//! tensors under their HF names.
//!
//! A model file is data a stranger may have written: the safetensors header (its 8-byte
//! length, then the JSON of each tensor's dtype, shape and byte range) is checked against the
//! file's length by the safetensors crate, and every tensor's shape is then checked against
//! what the config gives it before its bytes are converted and packed (which allocate several
//! times the tensor's size). So the memory a load takes follows from the config, whose sizes
//! are bounded (`ModelConfig::validate`), and from bytes that are really in the file.

use std::path::Path;

use candle_core::safetensors::{MmapedSafetensors, SliceSafetensors};
use candle_core::{DType, Device, Tensor};
use tandem_text::TextTokenizer;

use super::Model;
use super::identity::{file_identity, fingerprint};
use super::tensors::{Loaded, fuse, into_matrix};
use super::weights::{LayerExtras, LayerWeights, Weights};
use crate::config::{Architecture, ModelConfig, WeightFormat};
use crate::error::{EngineError, Result};

/// Loads an HF folder: `config.json`, `*.safetensors`, `tokenizer.json`.
pub fn load_hf_dir(dir: &Path, format: WeightFormat) -> Result<(Model, TextTokenizer)> {
    let tokenizer = TextTokenizer::from_hf_dir(dir)?;
    Ok((load_hf_model(dir, format)?, tokenizer))
}

/// The model of an HF folder (`config.json` and `*.safetensors`), without its tokenizer.
pub fn load_hf_model(dir: &Path, format: WeightFormat) -> Result<Model> {
    let config_path = dir.join("config.json");
    let json =
        std::fs::read_to_string(&config_path).map_err(|e| EngineError::io(&config_path, e))?;
    let cfg = ModelConfig::from_hf_json(&json)?;
    let files = super::bounds::safetensors_files(dir)?;
    if files.is_empty() {
        return Err(EngineError::load(dir, "no *.safetensors file"));
    }
    // SAFETY: the files are only read; a concurrent writer would be a user error.
    let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| EngineError::load(dir, e))?;
    let weights = hf_weights(&cfg, format, &st, dir)?;
    let mut identity = String::new();
    for f in &files {
        identity.push_str(&file_identity(f)?);
    }
    let fingerprint = fingerprint(&cfg, format, &identity);
    let name = dir
        .file_name()
        .and_then(|s| s.to_str())
        .unwrap_or("model")
        .to_string();
    Ok(Model::new(cfg, weights, format, fingerprint, name))
}

/// Where an HF model's tensors come from: its files, mapped, or one buffer (the fuzz target,
/// which holds a whole safetensors file in memory).
pub(crate) trait TensorSource {
    /// A tensor's shape as the header declares it (nothing is converted).
    fn shape(&self, name: &str) -> candle_core::Result<Vec<usize>>;
    /// A tensor, converted from the file's bytes.
    fn tensor(&self, name: &str) -> candle_core::Result<Tensor>;
}

impl TensorSource for MmapedSafetensors {
    fn shape(&self, name: &str) -> candle_core::Result<Vec<usize>> {
        Ok(self.get(name)?.shape().to_vec())
    }

    fn tensor(&self, name: &str) -> candle_core::Result<Tensor> {
        self.load(name, &Device::Cpu)
    }
}

impl TensorSource for SliceSafetensors<'_> {
    fn shape(&self, name: &str) -> candle_core::Result<Vec<usize>> {
        Ok(self.get(name)?.shape().to_vec())
    }

    fn tensor(&self, name: &str) -> candle_core::Result<Tensor> {
        self.load(name, &Device::Cpu)
    }
}

/// The shape a tensor must have.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// `rows × cols`, exactly.
    Matrix(usize, usize),
    /// This many values, in whatever shape (a norm or a bias; checkpoints store them 1-D).
    Values(usize),
}

/// The weights of `cfg` from the tensors of `st` (errors name `origin`).
pub(crate) fn hf_weights(
    cfg: &ModelConfig,
    format: WeightFormat,
    st: &impl TensorSource,
    origin: &Path,
) -> Result<Weights> {
    let tensor = |name: &str, want: Want| -> Result<Tensor> {
        let fail = |reason: String| EngineError::load(origin, format!("{name}: {reason}"));
        let shape = st.shape(name).map_err(|e| fail(e.to_string()))?;
        // Checked before the bytes are converted: a tensor of another shape than the config
        // says fails here rather than after its conversion and packing took memory.
        let fits = match want {
            Want::Matrix(rows, cols) => shape == [rows, cols],
            Want::Values(n) => shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) == Some(n),
        };
        if !fits {
            let expected = match want {
                Want::Matrix(rows, cols) => format!("[{rows}, {cols}]"),
                Want::Values(n) => format!("{n} values"),
            };
            return Err(fail(format!("shape {shape:?}, expected {expected}")));
        }
        st.tensor(name).map_err(|e| fail(e.to_string()))
    };
    let matrix = |name: &str, rows: usize, cols: usize| {
        Loaded::from_tensor(name, &tensor(name, Want::Matrix(rows, cols))?, format)
    };
    let vector = |name: &str, len: usize| -> Result<Vec<f32>> {
        Ok(tensor(name, Want::Values(len))?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let h = cfg.hidden_size;
    let (q, kv, ffn) = (cfg.q_width(), cfg.kv_width(), cfg.intermediate_size);
    // Gemma checkpoints store each RMSNorm weight as an offset from 1 (the model multiplies
    // by `1 + w`); the engine keeps the multiplier, as llama.cpp's converter does.
    let gemma = cfg.arch.is_gemma();
    let norm = |name: &str, len: usize| -> Result<Vec<f32>> {
        let mut w = vector(name, len)?;
        if gemma {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(w)
    };
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        let mut extras = LayerExtras::default();
        if cfg.attention_bias {
            let b = |s: &str, len| vector(&format!("model.layers.{l}.self_attn.{s}.bias"), len);
            extras.qkv_bias = Some([b("q_proj", q)?, b("k_proj", kv)?, b("v_proj", kv)?].concat());
        }
        if cfg.qk_norm {
            extras.q_norm = Some(norm(&p("self_attn.q_norm"), cfg.head_dim)?);
            extras.k_norm = Some(norm(&p("self_attn.k_norm"), cfg.head_dim)?);
        }
        // Gemma's `post_attention_layernorm` normalizes the attention output; its MLP's input
        // norm is `pre_feedforward_layernorm`. In the Llama block the former is the latter.
        let ffn_norm = if gemma {
            extras.post_attn_norm = Some(norm(&p("post_attention_layernorm"), h)?);
            extras.post_ffn_norm = Some(norm(&p("post_feedforward_layernorm"), h)?);
            norm(&p("pre_feedforward_layernorm"), h)?
        } else {
            vector(&p("post_attention_layernorm"), h)?
        };
        // Phi-3 stores Q/K/V and gate/up already fused, in the engine's order.
        let fused = cfg.arch == Architecture::Phi3;
        let (qkv, gate_up) = if fused {
            (
                into_matrix(matrix(&p("self_attn.qkv_proj"), q + 2 * kv, h)?)?,
                into_matrix(matrix(&p("mlp.gate_up_proj"), 2 * ffn, h)?)?,
            )
        } else {
            (
                fuse(vec![
                    matrix(&p("self_attn.q_proj"), q, h)?,
                    matrix(&p("self_attn.k_proj"), kv, h)?,
                    matrix(&p("self_attn.v_proj"), kv, h)?,
                ])?,
                fuse(vec![
                    matrix(&p("mlp.gate_proj"), ffn, h)?,
                    matrix(&p("mlp.up_proj"), ffn, h)?,
                ])?,
            )
        };
        layers.push(LayerWeights {
            attn_norm: norm(&p("input_layernorm"), h)?,
            qkv,
            o: into_matrix(matrix(&p("self_attn.o_proj"), h, q)?)?,
            ffn_norm,
            gate_up,
            down: into_matrix(matrix(&p("mlp.down_proj"), h, ffn)?)?,
            extras,
        });
    }
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(into_matrix(matrix("lm_head.weight", cfg.vocab_size, h)?)?)
    };
    let weights = Weights {
        embed: into_matrix(matrix("model.embed_tokens.weight", cfg.vocab_size, h)?)?,
        layers,
        final_norm: norm("model.norm.weight", h)?,
        lm_head,
    };
    weights
        .validate(cfg)
        .map_err(|e| EngineError::load(origin, e))?;
    Ok(weights)
}

//! Loading a GGUF file: the decoder's tensors read as `--weights` asks (by default each in
//! its own format, so a Q4_1 file takes about its size in memory), a Llama file's Q/K rows put
//! back in the HF RoPE order (llama.cpp's converter permutes them for Llama only), the
//! tokenizer and chat template rebuilt from the metadata, Llama 3's RoPE scaling from its
//! `rope_freqs` tensor. In a Gemma file `ffn_norm` is the
//! MLP's input norm (HF's `pre_feedforward_layernorm`).
//!
//! The header is read once, by `tandem_text::gguf::read_file` under the load's
//! [`ModelLimits`], and its tensor directory checked against the file (`bounds`) before
//! candle reads a tensor; every error names the file.

use std::fs::File;
use std::path::Path;

use candle_core::Device;
use candle_core::quantized::gguf_file;
use tandem_text::gguf::{GgufFile, GgufMetadata};
use tandem_text::{ModelLimits, TextTokenizer};

use super::Model;
use super::bounds::{check_parameters, gguf_content, gguf_weight_bytes, in_file};
use super::identity::{file_identity, fingerprint};
use super::tensors::{Loaded, fuse, into_matrix, unpermute};
use super::weights::{LayerExtras, LayerWeights, Weights};
use crate::config::{Architecture, ModelConfig, RopeScaling, WeightFormat};
use crate::error::{EngineError, Result};

/// An open GGUF file and its tensor directory.
struct GgufReader<'a> {
    path: &'a Path,
    file: File,
    content: gguf_file::Content,
    format: WeightFormat,
}

impl GgufReader<'_> {
    fn qtensor(&mut self, name: &str) -> Result<candle_core::quantized::QTensor> {
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| EngineError::load(self.path, format!("{name}: {e}")))
    }

    /// A 2-D weight, stored as the format asks.
    fn matrix(&mut self, name: &str) -> Result<Loaded> {
        let qt = self.qtensor(name)?;
        let (rows, cols) = match qt.shape().dims() {
            [r, c] => (*r, *c),
            other => {
                return Err(EngineError::load(
                    self.path,
                    format!("{name}: shape {other:?}, expected a matrix"),
                ));
            }
        };
        Loaded::from_qtensor(name, rows, cols, &qt, self.format)
    }

    /// A 1-D weight (norms), always f32.
    fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        let qt = self.qtensor(name)?;
        Ok(qt
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }
}

/// Loads a GGUF file (a supported architecture: see [`Architecture`]) as a model named `name`,
/// with the tokenizer its metadata describes, under `limits`.
pub fn load_gguf(
    path: &Path,
    format: WeightFormat,
    name: &str,
    limits: &ModelLimits,
) -> Result<(Model, TextTokenizer)> {
    let header = read_header(path, limits)?;
    let tokenizer = TextTokenizer::from_gguf_metadata_with(&header.metadata, limits)
        .map_err(|e| in_file(path, e.into()))?;
    Ok((model_of(path, &header, format, name)?, tokenizer))
}

/// The model of a GGUF file without its tokenizer (when another one is given).
pub fn load_gguf_model(
    path: &Path,
    format: WeightFormat,
    name: &str,
    limits: &ModelLimits,
) -> Result<Model> {
    model_of(path, &read_header(path, limits)?, format, name)
}

/// The metadata and tensor directory of the GGUF file at `path`; errors name it.
fn read_header(path: &Path, limits: &ModelLimits) -> Result<GgufFile> {
    tandem_text::gguf::read_file(path, limits).map_err(|e| match e {
        tandem_text::TextError::Io { path, source } => EngineError::io(path, source),
        other => in_file(path, other.into()),
    })
}

/// The model of a GGUF file whose header was read already.
fn model_of(path: &Path, header: &GgufFile, format: WeightFormat, name: &str) -> Result<Model> {
    let meta: &GgufMetadata = &header.metadata;
    let content = gguf_content(path, header)?;
    let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let has_tensor = |name: &str| content.tensor_infos.contains_key(name);
    let mut cfg = ModelConfig::from_gguf(meta, &has_tensor).map_err(|e| in_file(path, e))?;
    check_parameters(&cfg, gguf_weight_bytes(header), path)?;
    let has_output = has_tensor("output.weight");
    let has_rope_freqs = has_tensor("rope_freqs.weight");
    let mut reader = GgufReader {
        path,
        file,
        content,
        format,
    };
    // Llama 3.1+ files carry their RoPE scaling as per-frequency divisors rather than as
    // metadata; without them the model would run with the wrong positions.
    if has_rope_freqs {
        let divisors = reader.vector("rope_freqs.weight")?;
        if divisors.len() != cfg.head_dim / 2
            || divisors.iter().any(|d| !(d.is_finite() && *d > 0.0))
        {
            return Err(EngineError::load(
                path,
                format!(
                    "rope_freqs.weight: {} values, expected {} positive ones",
                    divisors.len(),
                    cfg.head_dim / 2
                ),
            ));
        }
        if cfg.rope_scaling.is_some() {
            return Err(EngineError::Unsupported(format!(
                "GGUF {} with both RoPE scaling metadata and rope_freqs",
                cfg.arch
            )));
        }
        cfg.rope_scaling = Some(RopeScaling::Frequencies { divisors });
    }
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("blk.{l}.{s}.weight");
        let permuted = cfg.arch == Architecture::Llama;
        // Phi-3 files keep Q/K/V in one tensor and gate/up in `ffn_up`, in the engine's order.
        let fused = cfg.arch == Architecture::Phi3;
        let (qkv, gate_up) = if fused {
            (
                into_matrix(reader.matrix(&p("attn_qkv"))?)?,
                into_matrix(reader.matrix(&p("ffn_up"))?)?,
            )
        } else {
            let (mut q, mut k) = (reader.matrix(&p("attn_q"))?, reader.matrix(&p("attn_k"))?);
            if permuted {
                q = q.unpermute_rows(cfg.num_attention_heads);
                k = k.unpermute_rows(cfg.num_key_value_heads);
            }
            let v = reader.matrix(&p("attn_v"))?;
            let gate_up = fuse(vec![
                reader.matrix(&p("ffn_gate"))?,
                reader.matrix(&p("ffn_up"))?,
            ])?;
            (fuse(vec![q, k, v])?, gate_up)
        };
        let mut extras = LayerExtras::default();
        if cfg.attention_bias {
            let bias = |reader: &mut GgufReader, s: &str, heads: usize| -> Result<Vec<f32>> {
                let b = reader.vector(&format!("blk.{l}.{s}.bias"))?;
                Ok(if permuted && heads > 0 {
                    unpermute(&b, b.len(), heads)
                } else {
                    b
                })
            };
            let mut qkv = bias(&mut reader, "attn_q", cfg.num_attention_heads)?;
            qkv.extend(bias(&mut reader, "attn_k", cfg.num_key_value_heads)?);
            qkv.extend(bias(&mut reader, "attn_v", 0)?);
            extras.qkv_bias = Some(qkv);
        }
        if cfg.qk_norm {
            extras.q_norm = Some(reader.vector(&p("attn_q_norm"))?);
            extras.k_norm = Some(reader.vector(&p("attn_k_norm"))?);
        }
        // Gemma's norms after attention and after the MLP (its converter already stored each
        // norm weight as `1 + w`, the multiplier the engine keeps).
        if cfg.arch.is_gemma() {
            extras.post_attn_norm = Some(reader.vector(&p("post_attention_norm"))?);
            extras.post_ffn_norm = Some(reader.vector(&p("post_ffw_norm"))?);
        }
        layers.push(LayerWeights {
            attn_norm: reader.vector(&p("attn_norm"))?,
            qkv,
            o: into_matrix(reader.matrix(&p("attn_output"))?)?,
            ffn_norm: reader.vector(&p("ffn_norm"))?,
            gate_up,
            down: into_matrix(reader.matrix(&p("ffn_down"))?)?,
            extras,
        });
    }
    let lm_head = if has_output {
        Some(into_matrix(reader.matrix("output.weight")?)?)
    } else {
        None
    };
    let weights = Weights {
        embed: into_matrix(reader.matrix("token_embd.weight")?)?,
        layers,
        final_norm: reader.vector("output_norm.weight")?,
        lm_head,
    };
    weights
        .validate(&cfg)
        .map_err(|e| EngineError::load(path, e))?;
    let fingerprint = fingerprint(&cfg, format, &file_identity(path)?);
    Ok(Model::new(
        cfg,
        weights,
        format,
        fingerprint,
        name.to_string(),
    ))
}

//! Weight containers: one `Matrix` per fused projection and f32 norm vectors.

use crate::backend::cpu::kernels::Matrix;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// The weights of one decoder block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// Q, K and V projections stacked: `(q_width + 2·kv_width) × hidden`.
    pub qkv: Matrix,
    pub o: Matrix,
    pub ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: `2·intermediate × hidden`.
    pub gate_up: Matrix,
    pub down: Matrix,
    /// The family's extra per-layer vectors (empty for Llama).
    pub extras: LayerExtras,
}

/// What a family adds to the Llama block, per layer.
#[derive(Debug, Clone, Default)]
pub struct LayerExtras {
    /// Q, K and V biases stacked like `qkv`'s rows (Qwen2).
    pub qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of Q and of K, `head_dim` each (Qwen3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// RMSNorm weights of the attention output and of the MLP output, applied before each
    /// residual add (Gemma; `hidden` each).
    pub post_attn_norm: Option<Vec<f32>>,
    pub post_ffn_norm: Option<Vec<f32>>,
}

impl LayerExtras {
    fn floats(&self) -> usize {
        [
            &self.qkv_bias,
            &self.q_norm,
            &self.k_norm,
            &self.post_attn_norm,
            &self.post_ffn_norm,
        ]
        .into_iter()
        .flatten()
        .map(Vec::len)
        .sum()
    }

    /// Checks that exactly the vectors the config asks for are there, at their widths.
    fn validate(&self, cfg: &ModelConfig, layer: usize) -> Result<()> {
        let check = |what: &str, v: &Option<Vec<f32>>, wanted: bool, len: usize| match v {
            Some(v) if wanted && v.len() == len => Ok(()),
            None if !wanted => Ok(()),
            Some(v) if wanted => Err(EngineError::Config(format!(
                "layer {layer} {what}: {} values, expected {len}",
                v.len()
            ))),
            _ => Err(EngineError::Config(format!(
                "layer {layer} {what}: {} for a {} model",
                if wanted { "missing" } else { "unexpected" },
                cfg.arch
            ))),
        };
        let qkv = cfg.q_width() + 2 * cfg.kv_width();
        check("q/k/v bias", &self.qkv_bias, cfg.attention_bias, qkv)?;
        check("q_norm", &self.q_norm, cfg.qk_norm, cfg.head_dim)?;
        check("k_norm", &self.k_norm, cfg.qk_norm, cfg.head_dim)?;
        let gemma = cfg.arch.is_gemma();
        check(
            "post-attention norm",
            &self.post_attn_norm,
            gemma,
            cfg.hidden_size,
        )?;
        check("post-MLP norm", &self.post_ffn_norm, gemma, cfg.hidden_size)
    }
}

/// All weights of a model.
#[derive(Debug, Clone)]
pub struct Weights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `None` when the embeddings are tied.
    pub lm_head: Option<Matrix>,
}

impl Weights {
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Every matrix: the layers' projections, the embeddings, the LM head when untied.
    pub fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down])
            .chain(std::iter::once(&self.embed))
            .chain(self.lm_head.as_ref())
    }

    /// Moves every quantized matrix's bytes into one mapping backed by huge pages where the
    /// OS gives them (see `quant::arena`: fewer TLB misses while a decode step streams the
    /// weights); returns its size. On an error every matrix keeps its own buffer.
    pub fn gather_quantized(&mut self) -> std::io::Result<usize> {
        let mut panels: Vec<_> = self
            .layers
            .iter_mut()
            .flat_map(|l| [&mut l.qkv, &mut l.o, &mut l.gate_up, &mut l.down])
            .chain(std::iter::once(&mut self.embed))
            .chain(self.lm_head.as_mut())
            .flat_map(Matrix::quant_parts_mut)
            .collect();
        crate::backend::cpu::kernels::quant::gather_panels(&mut panels)
    }

    /// Bytes of all matrices and vectors (tied embeddings once).
    pub fn size_in_bytes(&self) -> usize {
        let m = |x: &Matrix| x.size_in_bytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                m(&l.qkv)
                    + m(&l.o)
                    + m(&l.gate_up)
                    + m(&l.down)
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len() + l.extras.floats())
            })
            .sum();
        layers + m(&self.embed) + self.lm_head.as_ref().map_or(0, m) + 4 * self.final_norm.len()
    }

    /// Every matrix widened to f32 (the reference a quantized model is checked against).
    pub fn to_f32(&self) -> Weights {
        Weights {
            embed: self.embed.to_f32(),
            layers: self
                .layers
                .iter()
                .map(|l| LayerWeights {
                    attn_norm: l.attn_norm.clone(),
                    qkv: l.qkv.to_f32(),
                    o: l.o.to_f32(),
                    ffn_norm: l.ffn_norm.clone(),
                    gate_up: l.gate_up.to_f32(),
                    down: l.down.to_f32(),
                    extras: l.extras.clone(),
                })
                .collect(),
            final_norm: self.final_norm.clone(),
            lm_head: self.lm_head.as_ref().map(Matrix::to_f32),
        }
    }

    /// Bytes one decode step reads: the layers' matrices and norms, the LM head (the
    /// embedding table when tied) and the final norm. An untied embedding table only has
    /// rows looked up, so it does not count.
    pub fn bytes_read_per_step(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv.size_in_bytes()
                    + l.o.size_in_bytes()
                    + l.gate_up.size_in_bytes()
                    + l.down.size_in_bytes()
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len() + l.extras.floats())
            })
            .sum();
        layers + self.lm_head().size_in_bytes() + 4 * self.final_norm.len()
    }

    /// Checks every shape against the config.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        let h = cfg.hidden_size;
        let check = |name: &str, m: &Matrix, rows: usize, cols: usize| {
            if m.rows != rows || m.cols != cols {
                return Err(EngineError::Config(format!(
                    "{name}: shape {}x{}, expected {rows}x{cols}",
                    m.rows, m.cols
                )));
            }
            Ok(())
        };
        check("embed", &self.embed, cfg.vocab_size, h)?;
        if let Some(head) = &self.lm_head {
            check("lm_head", head, cfg.vocab_size, h)?;
        }
        if self.layers.len() != cfg.num_hidden_layers {
            return Err(EngineError::Config(format!(
                "{} layers loaded, config says {}",
                self.layers.len(),
                cfg.num_hidden_layers
            )));
        }
        for (i, l) in self.layers.iter().enumerate() {
            check(
                &format!("layer {i} qkv"),
                &l.qkv,
                cfg.q_width() + 2 * cfg.kv_width(),
                h,
            )?;
            check(&format!("layer {i} o"), &l.o, h, cfg.q_width())?;
            check(
                &format!("layer {i} gate_up"),
                &l.gate_up,
                2 * cfg.intermediate_size,
                h,
            )?;
            check(
                &format!("layer {i} down"),
                &l.down,
                h,
                cfg.intermediate_size,
            )?;
            if l.attn_norm.len() != h || l.ffn_norm.len() != h {
                return Err(EngineError::Config(format!("layer {i}: norm width")));
            }
            l.extras.validate(cfg, i)?;
        }
        if self.final_norm.len() != h {
            return Err(EngineError::Config("final norm width".into()));
        }
        Ok(())
    }
}

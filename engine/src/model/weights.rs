//! Weight containers: one `Matrix` per fused projection, f32 norm vectors, and the
//! conversions from loaded tensors.

use half::{bf16, f16};

use crate::backend::cpu::kernels::{Matrix, WeightData};
use crate::config::{ModelConfig, WeightDtype};
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
                    + 4 * (l.attn_norm.len() + l.ffn_norm.len())
            })
            .sum();
        layers + m(&self.embed) + self.lm_head.as_ref().map_or(0, m) + 4 * self.final_norm.len()
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
        }
        if self.final_norm.len() != h {
            return Err(EngineError::Config("final norm width".into()));
        }
        Ok(())
    }
}

/// Stores f32 values in the chosen weight dtype.
pub(crate) fn to_weight_data(values: Vec<f32>, dtype: WeightDtype) -> WeightData {
    match dtype {
        WeightDtype::F32 => WeightData::F32(values),
        WeightDtype::F16 => WeightData::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
        WeightDtype::Bf16 => WeightData::Bf16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
    }
}

/// llama.cpp stores Q and K rows permuted for its interleaved RoPE; this restores the HF
/// rotate-half order: `(heads, rows/heads/2, 2, cols)` → swap axes 1 and 2.
pub(crate) fn unpermute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let per_head = rows / heads;
    let half = per_head / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for pair in 0..2 {
                let src = h * per_head + i * 2 + pair;
                let dst = h * per_head + pair * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_moves_interleaved_pairs_to_halves() {
        // One head of 4 rows, 1 column: llama.cpp order [r0, r2, r1, r3] → HF [r0, r1, r2, r3].
        let w = [0.0, 2.0, 1.0, 3.0];
        assert_eq!(unpermute_rows(&w, 4, 1, 1), vec![0.0, 1.0, 2.0, 3.0]);
        // Two heads keep their own rows.
        let w2 = [0.0, 2.0, 1.0, 3.0, 10.0, 12.0, 11.0, 13.0];
        assert_eq!(
            unpermute_rows(&w2, 8, 1, 2),
            vec![0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
        );
    }
}

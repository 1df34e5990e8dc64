//! A straightforward reference forward pass, for the tests only: one sequence, a contiguous
//! KV cache grown by concatenation, no batching, no paging, and candle's own ops (its BLAS
//! matmul and softmax) instead of the engine's kernels. `tests/reference.rs` checks the
//! paged, batched engine against it.

use candle_core::{D, DType, Device, Tensor};

use tandem_engine::Model;
use tandem_engine::Result;
use tandem_engine::backend::cpu::kernels::{Matrix, RopeTable};

/// Contiguous per-layer K and V of one sequence: `[kv_heads, seq, head_dim]`.
#[derive(Debug, Default)]
pub struct ReferenceCache {
    kv: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

/// The reference implementation over a model's weights.
pub struct ReferenceModel<'a> {
    model: &'a Model,
    rope: RopeTable,
}

impl std::fmt::Debug for ReferenceModel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceModel").finish_non_exhaustive()
    }
}

fn matrix(m: &Matrix) -> Result<Tensor> {
    let values: Vec<f32> = (0..m.rows)
        .flat_map(|r| (0..m.cols).map(move |c| m.get(r, c)))
        .collect();
    Ok(Tensor::from_vec(values, (m.rows, m.cols), &Device::Cpu)?)
}

fn rms_norm(x: &Tensor, w: &[f32], eps: f64) -> Result<Tensor> {
    let w = Tensor::from_slice(w, w.len(), &Device::Cpu)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(&w)?)
}

/// `[t, heads·d]` → rotate-half RoPE per head with the given tables.
fn rope(x: &Tensor, heads: usize, d: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let t = x.dim(0)?;
    let x = x.reshape((t, heads, d))?;
    let x1 = x.narrow(2, 0, d / 2)?;
    let x2 = x.narrow(2, d / 2, d / 2)?;
    let cos = cos.unsqueeze(1)?;
    let sin = sin.unsqueeze(1)?;
    let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let b = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Ok(Tensor::cat(&[a, b], 2)?.reshape((t, heads * d))?)
}

impl<'a> ReferenceModel<'a> {
    pub fn new(model: &'a Model) -> Self {
        Self {
            model,
            rope: RopeTable::new(model.config()),
        }
    }

    /// Runs `tokens` after what `cache` holds; returns the logits of every new position,
    /// `[tokens, vocab]`.
    pub fn forward(&self, tokens: &[u32], cache: &mut ReferenceCache) -> Result<Tensor> {
        let cfg = self.model.config();
        let w = self.model.weights();
        let dev = Device::Cpu;
        let d = cfg.head_dim;
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let (qw, kw) = (cfg.q_width(), cfg.kv_width());
        let t = tokens.len();
        let start = cache.len;
        let positions: Vec<usize> = (start..start + t).collect();
        let (cos, sin) = self.rope.cos_sin(&positions);
        let cos = Tensor::from_vec(cos, (t, d / 2), &dev)?;
        let sin = Tensor::from_vec(sin, (t, d / 2), &dev)?;
        if cache.kv.is_empty() {
            cache.kv = vec![None; cfg.num_hidden_layers];
        }
        let embed = matrix(&w.embed)?;
        let ids = Tensor::from_slice(tokens, t, &dev)?;
        let mut x = embed.index_select(&ids, 0)?;
        // Causal mask over [t, start + t]: row i sees keys 0..=start+i.
        let total = start + t;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| {
                (0..total).map(move |j| {
                    if j <= start + i {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, total), &dev)?;
        for (l, layer) in w.layers.iter().enumerate() {
            let normed = rms_norm(&x, &layer.attn_norm, cfg.rms_norm_eps)?;
            let qkv = normed.matmul(&matrix(&layer.qkv)?.t()?)?;
            let q = rope(&qkv.narrow(1, 0, qw)?, nh, d, &cos, &sin)?;
            let k = rope(&qkv.narrow(1, qw, kw)?, nkv, d, &cos, &sin)?;
            let v = qkv.narrow(1, qw + kw, kw)?;
            let k = k.reshape((t, nkv, d))?.transpose(0, 1)?.contiguous()?;
            let v = v.reshape((t, nkv, d))?.transpose(0, 1)?.contiguous()?;
            let (k_all, v_all) = match cache.kv[l].take() {
                Some((pk, pv)) => (Tensor::cat(&[pk, k], 1)?, Tensor::cat(&[pv, v], 1)?),
                None => (k, v),
            };
            cache.kv[l] = Some((k_all.clone(), v_all.clone()));
            // Repeat KV heads for grouped-query attention.
            let rep = nh / nkv;
            let k_rep = k_all
                .unsqueeze(1)?
                .repeat((1, rep, 1, 1))?
                .reshape((nh, total, d))?;
            let v_rep = v_all
                .unsqueeze(1)?
                .repeat((1, rep, 1, 1))?
                .reshape((nh, total, d))?;
            let q = q.reshape((t, nh, d))?.transpose(0, 1)?.contiguous()?;
            let scores = (q.matmul(&k_rep.t()?)? / (d as f64).sqrt())?.broadcast_add(&mask)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let attn = probs.matmul(&v_rep)?.transpose(0, 1)?.reshape((t, qw))?;
            x = (x + attn.matmul(&matrix(&layer.o)?.t()?)?)?;
            let normed = rms_norm(&x, &layer.ffn_norm, cfg.rms_norm_eps)?;
            let gu = normed.matmul(&matrix(&layer.gate_up)?.t()?)?;
            let f = cfg.intermediate_size;
            let gate = gu.narrow(1, 0, f)?;
            let up = gu.narrow(1, f, f)?;
            let act = (candle_nn::ops::silu(&gate)? * up)?;
            x = (x + act.matmul(&matrix(&layer.down)?.t()?)?)?;
        }
        cache.len = total;
        let x = rms_norm(&x, &w.final_norm, cfg.rms_norm_eps)?;
        let logits = x.matmul(&matrix(w.lm_head())?.t()?)?;
        Ok(logits.to_dtype(DType::F32)?)
    }
}

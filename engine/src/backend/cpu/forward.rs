//! [`Model::forward`] on the CPU: one batch of token rows through every layer with the
//! batch-invariant kernels, K and V written into the paged cache as each layer computes them.

use tandem_kv::{BLOCK_SIZE, KvCache, Parallel, TokenKv};

use super::kernels::attention::{AttnParams, AttnSeq, paged_attention};
use super::kernels::team::{parallel_for, parallel_rows};
use super::kernels::{
    add_in_place, gelu_tanh_mul, linear, rms_norm, rms_norm_heads, silu_mul, softcap,
};
use crate::config::Activation;
use crate::error::{EngineError, Result};
use crate::model::{Model, SeqInput};

impl Model {
    /// Runs one batch. Writes each token's K/V into the cache, calls `on_layer(l, cache)` when
    /// layer `l` is complete for the whole batch (so a transport can ship it while later
    /// layers compute), and returns the logits rows every sequence asked for, in order
    /// ([`SeqInput::logit_rows`]).
    pub fn forward(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        on_layer: &mut dyn FnMut(usize, &KvCache),
    ) -> Result<Vec<Vec<f32>>> {
        let cfg = self.config();
        if cache.layout().model_fingerprint != self.fingerprint() {
            return Err(EngineError::LayoutMismatch(
                "cache belongs to another model".into(),
            ));
        }
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (qw, kw) = (cfg.q_width(), cfg.kv_width());
        let qkv_w = qw + 2 * kw;
        let f = cfg.intermediate_size;
        let mut positions = Vec::new();
        let mut attn_seqs = Vec::with_capacity(seqs.len());
        for s in seqs {
            let end = s.start_pos + s.tokens.len();
            if s.tokens.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            if end > cfg.max_position_embeddings {
                return Err(EngineError::ContextExceeded {
                    prompt: end,
                    max_tokens: 0,
                    context: cfg.max_position_embeddings,
                });
            }
            // Entries before the first block this pass reads may be freed (sliding windows).
            let first_read = cfg.first_needed_block(s.start_pos);
            if s.block_table.len() * BLOCK_SIZE < end
                || s.block_table
                    .iter()
                    .skip(first_read)
                    .any(|&b| b as usize >= cache.num_blocks())
            {
                return Err(EngineError::InvalidKv(
                    "block table does not cover the sequence".into(),
                ));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(EngineError::UnknownToken {
                    id: bad,
                    vocab: cfg.vocab_size,
                });
            }
            attn_seqs.push(AttnSeq {
                q_row: positions.len(),
                q_len: s.tokens.len(),
                start_pos: s.start_pos,
                block_table: s.block_table,
            });
            positions.extend(s.start_pos..end);
        }
        let t = positions.len();
        let global_angles = self.rope().cos_sin(&positions);
        // Gemma 3's local layers turn at their own base.
        let local_angles = self.rope_local().map(|r| r.cos_sin(&positions));

        let mut x = vec![0f32; t * h];
        let tokens = seqs.iter().flat_map(|s| s.tokens.iter());
        // Gemma scales the embeddings by √hidden (rounded to f32 first, as its reference does).
        let embed_scale = cfg.arch.is_gemma().then(|| (h as f32).sqrt());
        for (row, &tok) in x.chunks_exact_mut(h).zip(tokens) {
            self.weights().embed.row_into(tok as usize, row);
            if let Some(scale) = embed_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        let mut normed = vec![0f32; t * h];
        let mut qkv = vec![0f32; t * qkv_w];
        let mut q = vec![0f32; t * qw];
        let mut attn = vec![0f32; t * qw];
        let mut proj = vec![0f32; t * h];
        let mut gate_up = vec![0f32; t * 2 * f];
        let mut act = vec![0f32; t * f];
        let eps = cfg.rms_norm_eps as f32;

        // The per-row operations below run over row ranges on the compute team when a pass
        // has many rows (a prefill chunk); each row's arithmetic is the same either way.
        let half = d / 2;
        let norm = |x: &[f32], weight: &[f32], out: &mut [f32]| {
            parallel_rows(out, h, &|r0, rows| {
                rms_norm(&x[r0 * h..r0 * h + rows.len()], weight, eps, rows);
            });
        };
        let residual = |x: &mut [f32], proj: &[f32]| {
            parallel_rows(x, h, &|r0, rows| {
                add_in_place(rows, &proj[r0 * h..r0 * h + rows.len()]);
            });
        };
        // A prefill chunk's KV writes go over the team by block; a decode step's few tokens
        // stay on this thread.
        let kv_writers: Parallel = if t >= 32 {
            &parallel_for
        } else {
            &|tasks, task| (0..tasks).for_each(task)
        };
        for (l, layer) in self.weights().layers.iter().enumerate() {
            let window = cfg.layer_window(l);
            let (cos, sin) = match (&local_angles, window) {
                (Some(local), Some(_)) => (&local.0, &local.1),
                _ => (&global_angles.0, &global_angles.1),
            };
            let rope = self.layer_rope(l);
            norm(&x, &layer.attn_norm, &mut normed);
            linear(&normed, t, &layer.qkv, &mut qkv);
            // The family's additions, RoPE, all per row: Qwen2's biases, Qwen3's per-head
            // norms of Q and K (before RoPE, as its reference does).
            parallel_rows(&mut qkv, qkv_w, &|r0, rows| {
                let n = rows.len() / qkv_w;
                let extras = &layer.extras;
                if let Some(bias) = &extras.qkv_bias {
                    for row in rows.chunks_exact_mut(qkv_w) {
                        add_in_place(row, bias);
                    }
                }
                if let (Some(qn), Some(kn)) = (&extras.q_norm, &extras.k_norm) {
                    rms_norm_heads(rows, qkv_w, 0, cfg.num_attention_heads, qn, eps);
                    rms_norm_heads(rows, qkv_w, qw, cfg.num_key_value_heads, kn, eps);
                }
                let (cos, sin) = (
                    &cos[r0 * half..(r0 + n) * half],
                    &sin[r0 * half..(r0 + n) * half],
                );
                rope.apply(rows, qkv_w, 0, cfg.num_attention_heads, cos, sin);
                rope.apply(rows, qkv_w, qw, cfg.num_key_value_heads, cos, sin);
            });
            parallel_rows(&mut q, qw, &|r0, rows| {
                let src = qkv[r0 * qkv_w..].chunks_exact(qkv_w);
                for (row, qrow) in src.zip(rows.chunks_exact_mut(qw)) {
                    qrow.copy_from_slice(&row[..qw]);
                }
            });
            let tokens: Vec<TokenKv> = attn_seqs
                .iter()
                .flat_map(|a| {
                    let qkv = &qkv;
                    (0..a.q_len).map(move |i| {
                        let pos = a.start_pos + i;
                        let row = &qkv[(a.q_row + i) * qkv_w..(a.q_row + i + 1) * qkv_w];
                        TokenKv {
                            block: a.block_table[pos / BLOCK_SIZE],
                            slot: pos % BLOCK_SIZE,
                            k: &row[qw..qw + kw],
                            v: &row[qw + kw..],
                        }
                    })
                })
                .collect();
            cache.write_tokens(l, &tokens, kv_writers)?;
            let params = AttnParams {
                scale: cfg.attention_scale(),
                softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
                window,
            };
            let heads = cfg.num_attention_heads;
            paged_attention(cache, l, &q, &attn_seqs, heads, params, &mut attn);
            linear(&attn, t, &layer.o, &mut proj);
            // Gemma normalizes each sub-block's output before adding it to the residual.
            let sub_block_out = |proj: &[f32], post: &Option<Vec<f32>>, normed: &mut [f32]| {
                if let Some(w) = post {
                    norm(proj, w, normed);
                    true
                } else {
                    false
                }
            };
            if sub_block_out(&proj, &layer.extras.post_attn_norm, &mut normed) {
                residual(&mut x, &normed);
            } else {
                residual(&mut x, &proj);
            }

            norm(&x, &layer.ffn_norm, &mut normed);
            linear(&normed, t, &layer.gate_up, &mut gate_up);
            parallel_rows(&mut act, f, &|r0, rows| {
                let gate_up = &gate_up[2 * f * r0..2 * (f * r0 + rows.len())];
                match cfg.activation {
                    Activation::Silu => silu_mul(gate_up, f, rows),
                    Activation::GeluTanh => gelu_tanh_mul(gate_up, f, rows),
                }
            });
            linear(&act, t, &layer.down, &mut proj);
            if sub_block_out(&proj, &layer.extras.post_ffn_norm, &mut normed) {
                residual(&mut x, &normed);
            } else {
                residual(&mut x, &proj);
            }
            on_layer(l, cache);
        }

        // Final norm and LM head only for the rows that need logits.
        let wanted: Vec<usize> = attn_seqs
            .iter()
            .zip(seqs)
            .flat_map(|(a, s)| s.logit_rows().map(move |r| a.q_row + r))
            .collect();
        let mut last = vec![0f32; wanted.len() * h];
        for (dst, &row) in last.chunks_exact_mut(h).zip(&wanted) {
            rms_norm(
                &x[row * h..(row + 1) * h],
                &self.weights().final_norm,
                eps,
                dst,
            );
        }
        let head = self.weights().lm_head();
        let vocab = head.rows;
        let mut logits = vec![0f32; wanted.len() * vocab];
        linear(&last, wanted.len(), head, &mut logits);
        if let Some(cap) = cfg.final_logit_softcapping {
            softcap(&mut logits, cap as f32);
        }
        Ok(logits
            .chunks_exact(vocab.max(1))
            .map(<[f32]>::to_vec)
            .collect())
    }
}

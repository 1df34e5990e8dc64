//! The families' weights as GGUF files, written as llama.cpp's converter writes them.

use std::path::Path;

use candle_core::{Device, Tensor};

use super::fixtures::{VOCAB, arch_of, hf_tensors};

/// The same weights as a GGUF file, with llama.cpp's names and keys for the family (and a
/// byte-level tokenizer), as its converter writes them: Q and K rows in HF order (only Llama
/// files get them permuted).
pub fn write_gguf(path: &Path, cfg: &serde_json::Value) {
    write_gguf_with(path, cfg, Vec::new(), Vec::new());
}

/// [`write_gguf`] with `extra` tensors besides the model's and metadata `overrides`.
pub fn write_gguf_with(
    path: &Path,
    cfg: &serde_json::Value,
    extra: Vec<(String, candle_core::quantized::QTensor)>,
    overrides: Vec<(String, candle_core::quantized::gguf_file::Value)>,
) {
    use candle_core::quantized::{GgmlDType, QTensor, gguf_file::Value};
    let family = cfg["model_type"].as_str().unwrap();
    // llama.cpp writes Mistral as `llama`, with Q and K rows permuted for its RoPE.
    let arch = arch_of(family);
    let gemma = arch.starts_with("gemma");
    let get = |k: &str| cfg[k].as_u64().unwrap() as u32;
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
    ];
    // Byte-level tokens: every byte's character, then a special one.
    let mut tokens: Vec<Value> = (0..256u32)
        .map(|b| {
            let c = char::from_u32(if b < 33 || (127..161).contains(&b) || b == 173 {
                256 + b
            } else {
                b
            })
            .unwrap();
            Value::String(c.to_string())
        })
        .collect();
    tokens.push(Value::String("<|endoftext|>".into()));
    meta.push(("tokenizer.ggml.tokens".into(), Value::Array(tokens)));
    meta.push(("tokenizer.ggml.merges".into(), Value::Array(Vec::new())));
    for (key, value) in [
        ("block_count", get("num_hidden_layers")),
        ("context_length", get("max_position_embeddings")),
        ("embedding_length", get("hidden_size")),
        ("feed_forward_length", get("intermediate_size")),
        ("attention.head_count", get("num_attention_heads")),
        ("attention.head_count_kv", get("num_key_value_heads")),
        ("vocab_size", VOCAB as u32),
    ] {
        meta.push((format!("{arch}.{key}"), Value::U32(value)));
    }
    if let Some(d) = cfg["head_dim"].as_u64() {
        meta.push((format!("{arch}.attention.key_length"), Value::U32(d as u32)));
    }
    meta.push((format!("{arch}.rope.freq_base"), Value::F32(1e6)));
    meta.push((
        format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(1e-6),
    ));
    let float = |k: &str| cfg[k].as_f64().map(|v| Value::F32(v as f32));
    for (key, value) in [
        (
            "attention.sliding_window",
            cfg["sliding_window"].as_u64().map(|w| Value::U32(w as u32)),
        ),
        (
            "attention.sliding_window_pattern",
            cfg["sliding_window_pattern"]
                .as_u64()
                .map(|p| Value::U32(p as u32)),
        ),
        ("attn_logit_softcapping", float("attn_logit_softcapping")),
        ("final_logit_softcapping", float("final_logit_softcapping")),
    ] {
        if let (true, Some(value)) = (gemma, value) {
            meta.push((format!("{arch}.{key}"), value));
        }
    }

    let rename = |hf: &str| -> String {
        let fixed = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
            return g.to_string();
        }
        let rest = hf.strip_prefix("model.layers.").unwrap();
        let (layer, name) = rest.split_once('.').unwrap();
        // Gemma's `post_attention_layernorm` is the attention output's norm; its MLP input
        // norm (`pre_feedforward_layernorm`) is llama.cpp's `ffn_norm`.
        let gemma_names: &[(&str, &str)] = if gemma {
            &[
                (
                    "post_attention_layernorm.weight",
                    "post_attention_norm.weight",
                ),
                ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
                ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
            ]
        } else {
            &[]
        };
        let name = gemma_names
            .iter()
            .chain(&[
                ("input_layernorm.weight", "attn_norm.weight"),
                ("post_attention_layernorm.weight", "ffn_norm.weight"),
                ("self_attn.q_proj.", "attn_q."),
                ("self_attn.k_proj.", "attn_k."),
                ("self_attn.v_proj.", "attn_v."),
                ("self_attn.o_proj.", "attn_output."),
                ("self_attn.q_norm.", "attn_q_norm."),
                ("self_attn.k_norm.", "attn_k_norm."),
                ("self_attn.qkv_proj.", "attn_qkv."),
                ("mlp.gate_up_proj.", "ffn_up."),
                ("mlp.gate_proj.", "ffn_gate."),
                ("mlp.up_proj.", "ffn_up."),
                ("mlp.down_proj.", "ffn_down."),
            ])
            .fold(name.to_string(), |n, (h, g)| {
                if n.contains(h) {
                    n.replacen(h, g, 1)
                } else {
                    n
                }
            });
        format!("blk.{layer}.{name}")
    };
    let heads = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let mut tensors: Vec<(String, QTensor)> = hf_tensors(cfg)
        .into_iter()
        .map(|(name, t)| {
            let t = match (arch, name.rsplit('.').nth(1)) {
                ("llama", Some("q_proj")) => permute(&t, heads("num_attention_heads")),
                ("llama", Some("k_proj")) => permute(&t, heads("num_key_value_heads")),
                // llama.cpp's Gemma converter stores every norm weight as `1 + w`.
                (_, Some(n)) if gemma && n.ends_with("norm") => (t + 1.0).unwrap(),
                _ => t,
            };
            (
                rename(&name),
                QTensor::quantize(&t, GgmlDType::F32).unwrap(),
            )
        })
        .collect();
    tensors.extend(extra);
    for (key, value) in overrides {
        meta.retain(|(k, _)| *k != key);
        meta.push((key, value));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path).unwrap();
    candle_core::quantized::gguf_file::write(&mut file, &meta_refs, &tensor_refs).unwrap();
}

/// llama.cpp's row order for RoPE pairs: within each head, row `pair·half + i` of the HF
/// order goes to `2i + pair`.
fn permute(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    let (per_head, half) = (rows / heads, rows / heads / 2);
    let order: Vec<u32> = (0..rows)
        .map(|dst| {
            let (h, r) = (dst / per_head, dst % per_head);
            (h * per_head + (r % 2) * half + r / 2) as u32
        })
        .collect();
    let index = Tensor::new(order.as_slice(), &Device::Cpu).unwrap();
    let out = w.index_select(&index, 0).unwrap();
    assert_eq!(out.dims2().unwrap(), (rows, cols));
    out
}

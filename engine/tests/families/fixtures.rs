//! The families under test and their weights: small shapes that exercise what is particular
//! to each, seeded values, the HF tensor names and `config.json` of each family, and the
//! candle-transformers model of each family that the engine is compared with.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

pub const VOCAB: usize = 300;

/// The families under test, each with a small shape that exercises what is particular to it.
pub fn families() -> Vec<(&'static str, serde_json::Value)> {
    let base = serde_json::json!({
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "sliding_window": 512, "max_window_layers": 2,
        "use_sliding_window": false,
    });
    let with = |extra: serde_json::Value| {
        let mut v = base.clone();
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    vec![
        // Q/K/V biases, an untied LM head.
        (
            "qwen2",
            with(serde_json::json!({"model_type": "qwen2", "tie_word_embeddings": false})),
        ),
        // Per-head Q/K norms, head_dim (32) set apart from hidden / heads (16), tied head.
        (
            "qwen3",
            with(serde_json::json!({"model_type": "qwen3", "head_dim": 32,
                "attention_bias": false, "tie_word_embeddings": true})),
        ),
        // The Llama block under Mistral's name (its window no shorter than the context).
        (
            "mistral",
            with(serde_json::json!({"model_type": "mistral", "tie_word_embeddings": false})),
        ),
        // Q/K/V and gate/up stored fused.
        (
            "phi3",
            with(
                serde_json::json!({"model_type": "phi3", "tie_word_embeddings": false,
                "num_key_value_heads": 4}),
            ),
        ),
        // Scaled embeddings, (1 + w) norms before and after each sub-block, GeGLU, attention
        // and final soft-caps low enough to bend the values, head_dim apart from hidden/heads.
        // (candle's Gemma 2 masks windows only inside a chunk, so its window here is longer
        // than the test; the window itself is checked against plain attention in the kernel's
        // tests and, at decode, against candle's Gemma 3 below.)
        (
            "gemma2",
            with(serde_json::json!({"model_type": "gemma2", "head_dim": 32,
                "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                "attention_bias": false, "tie_word_embeddings": true})),
        ),
        // Per-head (1 + w) Q/K norms, a local layer (40-key window, RoPE base 10 000: the decode
        // steps below run past the window) then a global one (base 10⁶). One KV head, as in
        // Gemma 3 1B (candle's Gemma 3 caches a strided V, which it only accepts with one).
        (
            "gemma3_text",
            with(
                serde_json::json!({"model_type": "gemma3_text", "head_dim": 32,
                "num_key_value_heads": 1,
                "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32,
                "attn_logit_softcapping": null, "final_logit_softcapping": null,
                "sliding_window": 40, "sliding_window_pattern": 2,
                "rope_local_base_freq": 10000.0, "attention_bias": false,
                "tie_word_embeddings": true}),
            ),
        ),
    ]
}

/// Seeded values in ±scale (a counter hash: no dependency on a random-number crate's stream).
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = (seed << 32 ^ i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Writes `config.json` and `model.safetensors` with the HF names of `cfg`'s family.
pub fn write_hf_folder(dir: &Path, cfg: &serde_json::Value) {
    candle_core::safetensors::save(&hf_tensors(cfg), dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

/// Seeded weights of `cfg`'s shape under their HF names.
pub fn hf_tensors(cfg: &serde_json::Value) -> HashMap<String, Tensor> {
    let get = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (h, f, layers) = (
        get("hidden_size"),
        get("intermediate_size"),
        get("num_hidden_layers"),
    );
    let (heads, kv) = (get("num_attention_heads"), get("num_key_value_heads"));
    let d = cfg["head_dim"].as_u64().map_or(h / heads, |v| v as usize);
    let family = cfg["model_type"].as_str().unwrap();
    let gemma = family.starts_with("gemma");
    // Gemma's norm weights are offsets from 1.
    let norm_center = if gemma { 0.0 } else { 1.0 };
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut seed = 0;
    let mut add = |name: String, shape: &[usize], scale: f32, center: f32| {
        seed += 1;
        let n = shape.iter().product();
        let v: Vec<f32> = values(n, seed, scale).iter().map(|x| x + center).collect();
        tensors.insert(name, Tensor::from_vec(v, shape, &Device::Cpu).unwrap());
    };
    add("model.embed_tokens.weight".into(), &[VOCAB, h], 1.0, 0.0);
    add("model.norm.weight".into(), &[h], 0.2, norm_center);
    if !cfg["tie_word_embeddings"].as_bool().unwrap() {
        add("lm_head.weight".into(), &[VOCAB, h], 0.15, 0.0);
    }
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let fan = |n: usize| 1.7 / (n as f32).sqrt();
        add(p("input_layernorm.weight"), &[h], 0.2, norm_center);
        add(p("post_attention_layernorm.weight"), &[h], 0.2, norm_center);
        if gemma {
            add(p("pre_feedforward_layernorm.weight"), &[h], 0.2, 0.0);
            add(p("post_feedforward_layernorm.weight"), &[h], 0.2, 0.0);
        }
        add(p("self_attn.q_proj.weight"), &[heads * d, h], fan(h), 0.0);
        add(p("self_attn.k_proj.weight"), &[kv * d, h], fan(h), 0.0);
        add(p("self_attn.v_proj.weight"), &[kv * d, h], fan(h), 0.0);
        add(
            p("self_attn.o_proj.weight"),
            &[h, heads * d],
            fan(heads * d),
            0.0,
        );
        add(p("mlp.gate_proj.weight"), &[f, h], fan(h), 0.0);
        add(p("mlp.up_proj.weight"), &[f, h], fan(h), 0.0);
        add(p("mlp.down_proj.weight"), &[h, f], fan(f), 0.0);
        if family == "qwen2" {
            add(p("self_attn.q_proj.bias"), &[heads * d], 0.3, 0.0);
            add(p("self_attn.k_proj.bias"), &[kv * d], 0.3, 0.0);
            add(p("self_attn.v_proj.bias"), &[kv * d], 0.3, 0.0);
        }
        if family == "qwen3" || family == "gemma3_text" {
            add(p("self_attn.q_norm.weight"), &[d], 0.3, norm_center);
            add(p("self_attn.k_norm.weight"), &[d], 0.3, norm_center);
        }
    }
    if family == "phi3" {
        // Phi-3's checkpoints hold the projections fused: Q, K, V rows; gate, then up rows.
        for l in 0..layers {
            let p = |s: &str| format!("model.layers.{l}.{s}.weight");
            let mut take = |s: &str| tensors.remove(&p(s)).unwrap();
            let qkv = Tensor::cat(
                &[
                    take("self_attn.q_proj"),
                    take("self_attn.k_proj"),
                    take("self_attn.v_proj"),
                ],
                0,
            )
            .unwrap();
            let gate_up = Tensor::cat(&[take("mlp.gate_proj"), take("mlp.up_proj")], 0).unwrap();
            tensors.insert(p("self_attn.qkv_proj"), qkv);
            tensors.insert(p("mlp.gate_up_proj"), gate_up);
        }
    }
    tensors
}

/// candle-transformers' model of the family, from the same folder; `forward(tokens, offset)`
/// returns the last position's logits and keeps its own KV cache.
pub enum Reference {
    Qwen2(candle_transformers::models::qwen2::ModelForCausalLM),
    Qwen3(candle_transformers::models::qwen3::ModelForCausalLM),
    Mistral(candle_transformers::models::mistral::Model),
    Phi3(candle_transformers::models::phi3::Model),
    Gemma2(candle_transformers::models::gemma2::Model),
    Gemma3(candle_transformers::models::gemma3::Model),
}

impl Reference {
    pub fn load(dir: &Path, cfg: &serde_json::Value) -> Self {
        let file = dir.join("model.safetensors");
        // SAFETY: the test wrote the file and nothing changes it while mapped.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[file], DType::F32, &Device::Cpu) }
            .unwrap();
        let json = cfg.to_string();
        match cfg["model_type"].as_str().unwrap() {
            "qwen2" => {
                let c = serde_json::from_str(&json).unwrap();
                Reference::Qwen2(
                    candle_transformers::models::qwen2::ModelForCausalLM::new(&c, vb).unwrap(),
                )
            }
            "qwen3" => {
                let c = serde_json::from_str(&json).unwrap();
                Reference::Qwen3(
                    candle_transformers::models::qwen3::ModelForCausalLM::new(&c, vb).unwrap(),
                )
            }
            "mistral" => {
                let c = serde_json::from_str(&json).unwrap();
                Reference::Mistral(
                    candle_transformers::models::mistral::Model::new(&c, vb).unwrap(),
                )
            }
            "phi3" => {
                let c = serde_json::from_str(&json).unwrap();
                Reference::Phi3(candle_transformers::models::phi3::Model::new(&c, vb).unwrap())
            }
            "gemma2" => {
                let c = serde_json::from_str(&json).unwrap();
                Reference::Gemma2(
                    candle_transformers::models::gemma2::Model::new(false, &c, vb).unwrap(),
                )
            }
            "gemma3_text" => {
                let c = serde_json::from_str(&json).unwrap();
                Reference::Gemma3(
                    candle_transformers::models::gemma3::Model::new(false, &c, vb).unwrap(),
                )
            }
            other => panic!("no reference for {other}"),
        }
    }

    pub fn forward(&mut self, tokens: &[u32], offset: usize) -> Vec<f32> {
        let input = Tensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = match self {
            Reference::Qwen2(m) => m.forward(&input, offset),
            Reference::Qwen3(m) => m.forward(&input, offset),
            Reference::Mistral(m) => m.forward(&input, offset),
            Reference::Phi3(m) => m.forward(&input, offset),
            Reference::Gemma2(m) => m.forward(&input, offset),
            Reference::Gemma3(m) => m.forward(&input, offset),
        };
        logits.unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }
}

/// The engine's family of an HF `model_type` (Mistral is the Llama block).
pub fn arch_of(model_type: &str) -> &str {
    match model_type {
        "mistral" => "llama",
        "gemma3_text" => "gemma3",
        other => other,
    }
}

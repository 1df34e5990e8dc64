//! Each model family against an implementation written by others: candle-transformers' model
//! of that family, loaded from the same safetensors folder (seeded random weights of a small
//! shape, HF tensor names). The engine's logits must match for a chunked prefill, a batch
//! mixing that prefill's second chunk with a new sequence, and several decode steps.
//! Then, per family: greedy disaggregated output equals aggregated output, and the KV layout
//! tells the families apart.
//!
//! x86-64 only (where candle-transformers is a dev-dependency): the comparison checks model
//! math, which `across_isas` pins to the same bits on every instruction set.
#![cfg(target_arch = "x86_64")]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use tandem_engine::config::{ModelConfig, WeightFormat};
use tandem_engine::model::{dummy_model, load_hf_model};
use tandem_engine::{Engine, EngineConfig, Model, SamplingParams, SeqInput, StopParams};
use tandem_kv::{BLOCK_SIZE, KvCache, blocks_for};
use tandem_text::TextTokenizer;

mod common;

const VOCAB: usize = 300;

/// The families under test, each with a small shape that exercises what is particular to it.
fn families() -> Vec<(&'static str, serde_json::Value)> {
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
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = (seed << 32 ^ i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Writes `config.json` and `model.safetensors` with the HF names of `cfg`'s family.
fn write_hf_folder(dir: &Path, cfg: &serde_json::Value) {
    candle_core::safetensors::save(&hf_tensors(cfg), dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

/// Seeded weights of `cfg`'s shape under their HF names.
fn hf_tensors(cfg: &serde_json::Value) -> HashMap<String, Tensor> {
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
enum Reference {
    Qwen2(candle_transformers::models::qwen2::ModelForCausalLM),
    Qwen3(candle_transformers::models::qwen3::ModelForCausalLM),
    Mistral(candle_transformers::models::mistral::Model),
    Phi3(candle_transformers::models::phi3::Model),
    Gemma2(candle_transformers::models::gemma2::Model),
    Gemma3(candle_transformers::models::gemma3::Model),
}

impl Reference {
    fn load(dir: &Path, cfg: &serde_json::Value) -> Self {
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

    fn forward(&mut self, tokens: &[u32], offset: usize) -> Vec<f32> {
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
fn arch_of(model_type: &str) -> &str {
    match model_type {
        "mistral" => "llama",
        "gemma3_text" => "gemma3",
        other => other,
    }
}

/// max|a − b| / max|b|
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    num / b.iter().map(|y| y.abs()).fold(1e-6, f32::max)
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % VOCAB as u32)
        .collect()
}

fn seq<'a>(tokens: &'a [u32], start_pos: usize, block_table: &'a [u32]) -> SeqInput<'a> {
    SeqInput {
        tokens,
        start_pos,
        block_table,
        logits: true,
        all_logits: false,
    }
}

/// The stated tolerance: both sides compute in f32, in different orders of summation.
const TOLERANCE: f32 = 1e-4;

#[test]
fn every_family_matches_candle_transformers_through_chunks_batches_and_decode() {
    for (family, cfg) in families() {
        let dir = tempfile::tempdir().unwrap();
        write_hf_folder(dir.path(), &cfg);
        let model = load_hf_model(dir.path(), WeightFormat::F32).unwrap();
        assert_eq!(model.config().arch.name(), arch_of(family));
        let (mut ref_a, mut ref_b) = (
            Reference::load(dir.path(), &cfg),
            Reference::load(dir.path(), &cfg),
        );
        let layout = model.kv_layout();
        let mut cache = KvCache::with_budget(layout.clone(), 32 * layout.block_bytes()).unwrap();
        let (a, b) = (tokens(1, 37), tokens(2, 21));
        let ta: Vec<u32> = (0..blocks_for(48) as u32).collect();
        let tb: Vec<u32> = (10..10 + blocks_for(32) as u32).rev().collect();
        let mut run =
            |inputs: &[SeqInput<'_>]| model.forward(&mut cache, inputs, &mut |_, _| {}).unwrap();

        // Step 1: the first chunk of A's prompt.
        let out = run(&[seq(&a[..20], 0, &ta)]);
        let err = rel_err(&out[0], &ref_a.forward(&a[..20], 0));
        assert!(err < TOLERANCE, "{family} chunk 1: {err}");
        // Step 2: the rest of A's prompt beside all of B's.
        let out = run(&[seq(&a[20..], 20, &ta), seq(&b, 0, &tb)]);
        let err_a = rel_err(&out[0], &ref_a.forward(&a[20..], 20));
        let err_b = rel_err(&out[1], &ref_b.forward(&b, 0));
        assert!(
            err_a < TOLERANCE && err_b < TOLERANCE,
            "{family} mixed batch: {err_a} {err_b}"
        );
        // Decode steps for both: fixed next tokens, so both sides see the same sequence (A's
        // last ones past Gemma 3's 40-key window).
        for step in 0..8u32 {
            let (pa, pb) = (a.len() + step as usize, b.len() + step as usize);
            let na = [(7 * step + 3) % VOCAB as u32];
            let nb = [(11 * step + 5) % VOCAB as u32];
            let out = run(&[seq(&na, pa, &ta), seq(&nb, pb, &tb)]);
            let err_a = rel_err(&out[0], &ref_a.forward(&na, pa));
            let err_b = rel_err(&out[1], &ref_b.forward(&nb, pb));
            assert!(
                err_a < TOLERANCE && err_b < TOLERANCE,
                "{family} decode step {step}: {err_a} {err_b}"
            );
        }
        assert!(a.len() + 8 <= ta.len() * BLOCK_SIZE);
    }
}

/// A preset's family and attention shape with two layers, a small vocabulary and a narrower
/// residual stream (so 7 B shapes stay cheap), and its window (if any) shortened to `window`.
fn preset_model(preset: &str, window: usize) -> Arc<Model> {
    let full = ModelConfig::preset(preset).unwrap();
    let cfg = ModelConfig {
        num_hidden_layers: 2,
        vocab_size: 512,
        hidden_size: full.hidden_size.min(512),
        intermediate_size: full.intermediate_size.min(768),
        sliding_window: full.sliding_window.map(|_| window),
        ..full
    };
    Arc::new(dummy_model(cfg, WeightFormat::F32, 4, preset).unwrap())
}

fn engine(model: &Arc<Model>) -> Engine {
    let config = EngineConfig {
        kv_budget_bytes: 64 * model.kv_layout().block_bytes(),
        ..Default::default()
    };
    Engine::new(model.clone(), TextTokenizer::byte_level(), config).unwrap()
}

#[test]
fn every_family_decodes_disaggregated_exactly_as_aggregated() {
    // Windows of 20 keys: the 45-token prompt and its decode steps run past them.
    for preset in [
        "qwen2.5-0.5b",
        "qwen3-0.6b",
        "mistral-7b",
        "phi3-mini",
        "gemma2-2b",
        "gemma3-1b",
    ] {
        let model = preset_model(preset, 20);
        let prompt: Vec<u32> = (0..45u32).map(|i| (i * 37 + 11) % 512).collect();
        let mut agg = engine(&model);
        let stop = StopParams {
            max_tokens: 12,
            ignore_eos: true,
            ..Default::default()
        };
        let id = agg
            .add_request(prompt.clone(), SamplingParams::greedy(), stop)
            .unwrap();
        let aggregated: Vec<u32> = agg
            .run_to_completion(id)
            .unwrap()
            .iter()
            .map(|o| o.token)
            .collect();
        let disaggregated = common::handoff(|| engine(&model), &prompt, 12);
        assert_eq!(aggregated, disaggregated, "{preset}");
    }
}

#[test]
fn the_kv_layout_tells_families_of_one_shape_apart() {
    let llama_shaped = |preset: &str| ModelConfig {
        arch: tandem_engine::config::Architecture::Llama,
        attention_bias: false,
        qk_norm: false,
        ..ModelConfig::preset(preset).unwrap()
    };
    for preset in ["qwen2.5-0.5b", "qwen3-0.6b", "gemma2-2b", "gemma3-1b"] {
        let family = ModelConfig {
            num_hidden_layers: 1,
            vocab_size: 64,
            hidden_size: 256,
            intermediate_size: 256,
            ..ModelConfig::preset(preset).unwrap()
        };
        let llama = ModelConfig {
            num_hidden_layers: 1,
            vocab_size: 64,
            hidden_size: 256,
            intermediate_size: 256,
            ..llama_shaped(preset)
        };
        let a = dummy_model(family, WeightFormat::F32, 1, "same").unwrap();
        let b = dummy_model(llama, WeightFormat::F32, 1, "same").unwrap();
        assert!(
            a.kv_layout().mismatch(&b.kv_layout()).is_some(),
            "{preset} and a Llama of its shape must refuse each other's KV"
        );
    }
}

/// The same weights as a GGUF file, with llama.cpp's names and keys for the family (and a
/// byte-level tokenizer), as its converter writes them: Q and K rows in HF order (only Llama
/// files get them permuted).
fn write_gguf(path: &Path, cfg: &serde_json::Value) {
    write_gguf_with(path, cfg, Vec::new(), Vec::new());
}

/// [`write_gguf`] with `extra` tensors besides the model's and metadata `overrides`.
fn write_gguf_with(
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

#[test]
fn a_gguf_of_each_family_computes_what_its_hf_folder_does() {
    for (family, cfg) in families() {
        let dir = tempfile::tempdir().unwrap();
        write_hf_folder(dir.path(), &cfg);
        let gguf = dir.path().join("model.gguf");
        write_gguf(&gguf, &cfg);
        let from_hf = load_hf_model(dir.path(), WeightFormat::F32).unwrap();
        let (from_gguf, _tokenizer) =
            tandem_engine::model::load_gguf(&gguf, WeightFormat::Native, family).unwrap();
        assert_eq!(from_gguf.config().arch, from_hf.config().arch);
        let prompt = tokens(3, 40);
        let mut logits = Vec::new();
        for model in [&from_hf, &from_gguf] {
            let layout = model.kv_layout();
            let mut cache = KvCache::with_budget(layout.clone(), 8 * layout.block_bytes()).unwrap();
            let table: Vec<u32> = (0..blocks_for(40) as u32).collect();
            let out = model
                .forward(&mut cache, &[seq(&prompt, 0, &table)], &mut |_, _| {})
                .unwrap();
            logits.push(out.into_iter().next().unwrap());
        }
        assert_eq!(
            logits[0], logits[1],
            "{family}: the same f32 weights, the same bits"
        );
    }
}

#[test]
fn a_sliding_window_sequence_holds_only_its_windows_blocks() {
    // Every layer windowed (Phi-3's and Mistral v0.1's case): blocks the window has passed are
    // freed as the prompt's chunks and the decode steps advance, and the tokens are those of
    // the disaggregated path, which ships only the last window's blocks.
    let model = preset_model("phi3-mini", 32);
    assert_eq!(model.config().kv_window(), Some(32));
    let prompt: Vec<u32> = (0..150u32).map(|i| (i * 29 + 3) % 512).collect();
    let config = EngineConfig {
        kv_budget_bytes: 64 * model.kv_layout().block_bytes(),
        max_batch_tokens: 48,
        max_running: 8,
        ..Default::default()
    };
    let mut engine = Engine::new(model.clone(), TextTokenizer::byte_level(), config).unwrap();
    let stop = StopParams {
        max_tokens: 40,
        ignore_eos: true,
        ..Default::default()
    };
    let id = engine
        .add_request(prompt.clone(), SamplingParams::greedy(), stop)
        .unwrap();
    let mut tokens = Vec::new();
    let mut most = 0;
    while engine.has_work() {
        tokens.extend(engine.step().unwrap().into_iter().map(|o| o.token));
        most = most.max(engine.used_blocks());
    }
    // Between steps, at most the window's blocks (three when it is unaligned); without the
    // freeing, the 190 positions would hold 12.
    assert!(most <= 3, "{most} blocks held at once");
    assert_eq!(engine.used_blocks(), 0);
    assert!(!engine.has_work() && tokens.len() == 40, "{id}");
    let disaggregated = common::handoff(
        || {
            Engine::new(
                model.clone(),
                TextTokenizer::byte_level(),
                EngineConfig {
                    kv_budget_bytes: 64 * model.kv_layout().block_bytes(),
                    ..Default::default()
                },
            )
            .unwrap()
        },
        &prompt,
        40,
    );
    assert_eq!(tokens, disaggregated);
    // Gemma's global layers read every block: nothing is freed there.
    assert_eq!(preset_model("gemma2-2b", 32).config().kv_window(), None);
}

#[test]
fn a_llama3_gguf_runs_with_its_rope_frequency_factors() {
    // Llama 3.1's scaling, with an original context short enough that this small head's
    // frequencies fall in all three of its bands (kept, divided, blended).
    let cfg = {
        let mut c = families()
            .into_iter()
            .find(|(f, _)| *f == "mistral")
            .unwrap()
            .1;
        c["model_type"] = "llama".into();
        c["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64});
        c
    };
    let dir = tempfile::tempdir().unwrap();
    write_hf_folder(dir.path(), &cfg);
    let from_hf = load_hf_model(dir.path(), WeightFormat::F32).unwrap();
    // llama.cpp's converter: one divisor per frequency, `rope_freqs.weight`.
    let d = 16usize;
    let (old_ctx, factor, low, high) = (64f64, 8f64, 1f64, 4f64);
    let divisors: Vec<f32> = (0..d / 2)
        .map(|i| {
            let freq = 1.0 / 1e6f64.powf((2 * i) as f64 / d as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < old_ctx / high {
                1.0
            } else if wavelen > old_ctx / low {
                factor as f32
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect();
    assert!(divisors.contains(&1.0) && divisors.contains(&8.0));
    assert!(divisors.iter().any(|&v| v > 1.0 && v < 8.0));
    let freqs = |divisors: &[f32]| {
        let t = Tensor::new(divisors, &Device::Cpu).unwrap();
        candle_core::quantized::QTensor::quantize(&t, candle_core::quantized::GgmlDType::F32)
            .unwrap()
    };
    let prompt = tokens(5, 60);
    let logits = |model: &Model| {
        let layout = model.kv_layout();
        let mut cache = KvCache::with_budget(layout.clone(), 8 * layout.block_bytes()).unwrap();
        let table: Vec<u32> = (0..blocks_for(60) as u32).collect();
        model
            .forward(&mut cache, &[seq(&prompt, 0, &table)], &mut |_, _| {})
            .unwrap()
            .remove(0)
    };
    let want = logits(&from_hf);
    let scaled = dir.path().join("scaled.gguf");
    write_gguf_with(
        &scaled,
        &cfg,
        vec![("rope_freqs.weight".into(), freqs(&divisors))],
        Vec::new(),
    );
    let (model, _) = tandem_engine::model::load_gguf(&scaled, WeightFormat::Native, "s").unwrap();
    let err = rel_err(&logits(&model), &want);
    assert!(err < 1e-5, "with rope_freqs: {err}");
    // Without the tensor the file is a plain Llama 2-style RoPE: visibly other logits.
    let plain = dir.path().join("plain.gguf");
    write_gguf(&plain, &cfg);
    let (model, _) = tandem_engine::model::load_gguf(&plain, WeightFormat::Native, "p").unwrap();
    assert!(rel_err(&logits(&model), &want) > 1e-3);
    // A tensor of the wrong length is refused by name.
    let bad = dir.path().join("bad.gguf");
    write_gguf_with(
        &bad,
        &cfg,
        vec![("rope_freqs.weight".into(), freqs(&divisors[..3]))],
        Vec::new(),
    );
    let err = tandem_engine::model::load_gguf(&bad, WeightFormat::Native, "b").unwrap_err();
    assert!(err.to_string().contains("rope_freqs"), "{err}");
}

#[test]
fn a_gguf_whose_vocabulary_cannot_be_rebuilt_loads_with_a_given_tokenizer() {
    use candle_core::quantized::gguf_file::Value;
    use tandem_engine::model::{LoadOptions, ModelSource, load_model};
    let cfg = families().remove(0).1;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rwkv-vocab.gguf");
    let model = (
        "tokenizer.ggml.model".to_string(),
        Value::String("rwkv".into()),
    );
    write_gguf_with(&path, &cfg, Vec::new(), vec![model]);
    let source = ModelSource::Path(path.clone());
    let err = load_model(&source, &LoadOptions::default()).unwrap_err();
    assert!(err.to_string().contains("rwkv"), "{err}");
    let json = dir.path().join("tokenizer.json");
    std::fs::write(&json, TextTokenizer::byte_level().to_json().unwrap()).unwrap();
    let opts = LoadOptions {
        tokenizer: Some(json),
        ..LoadOptions::default()
    };
    let (model, tokenizer) = load_model(&source, &opts).unwrap();
    assert_eq!(model.config().arch.name(), "qwen2");
    assert_eq!(
        tokenizer.vocab_size(),
        TextTokenizer::byte_level().vocab_size()
    );
}

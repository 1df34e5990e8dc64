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

use std::sync::Arc;

use candle_core::{Device, Tensor};
use tandem_engine::config::{ModelConfig, WeightFormat};
use tandem_engine::model::{dummy_model, load_hf_model};
use tandem_engine::{Engine, EngineConfig, Model, SamplingParams, SeqInput, StopParams};
use tandem_kv::{BLOCK_SIZE, KvCache, blocks_for};
use tandem_text::TextTokenizer;

#[path = "../common/mod.rs"]
mod common;
mod fixtures;
mod gguf;

use fixtures::{Reference, VOCAB, arch_of, families, write_hf_folder};
use gguf::{write_gguf, write_gguf_with};

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

#[test]
fn a_gguf_of_each_family_computes_what_its_hf_folder_does() {
    for (family, cfg) in families() {
        let dir = tempfile::tempdir().unwrap();
        write_hf_folder(dir.path(), &cfg);
        let gguf = dir.path().join("model.gguf");
        write_gguf(&gguf, &cfg);
        let from_hf = load_hf_model(dir.path(), WeightFormat::F32).unwrap();
        let (from_gguf, _tokenizer) = tandem_engine::model::load_gguf(
            &gguf,
            WeightFormat::Native,
            family,
            &Default::default(),
        )
        .unwrap();
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
    let (model, _) =
        tandem_engine::model::load_gguf(&scaled, WeightFormat::Native, "s", &Default::default())
            .unwrap();
    let err = rel_err(&logits(&model), &want);
    assert!(err < 1e-5, "with rope_freqs: {err}");
    // Without the tensor the file is a plain Llama 2-style RoPE: visibly other logits.
    let plain = dir.path().join("plain.gguf");
    write_gguf(&plain, &cfg);
    let (model, _) =
        tandem_engine::model::load_gguf(&plain, WeightFormat::Native, "p", &Default::default())
            .unwrap();
    assert!(rel_err(&logits(&model), &want) > 1e-3);
    // A tensor of the wrong length is refused by name.
    let bad = dir.path().join("bad.gguf");
    write_gguf_with(
        &bad,
        &cfg,
        vec![("rope_freqs.weight".into(), freqs(&divisors[..3]))],
        Vec::new(),
    );
    let err = tandem_engine::model::load_gguf(&bad, WeightFormat::Native, "b", &Default::default())
        .unwrap_err();
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

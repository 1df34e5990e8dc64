//! KV caches in bf16 and f16 (`--kv-dtype`): half the bytes per token, K and V rounded once
//! when written and widened exactly when read, so batching, chunking and a handoff between
//! engines still give one engine's tokens, and the logits stay near the f32 cache's.

use std::collections::HashMap;
use std::sync::Arc;

use tandem_engine::config::{ModelConfig, WeightFormat};
use tandem_engine::model::dummy_model;
use tandem_engine::{Engine, EngineConfig, EngineError, Model, SamplingParams, StopParams};
use tandem_kv::{KvCache, KvDtype};
use tandem_text::TextTokenizer;

mod common;

fn model(kv: KvDtype) -> Arc<Model> {
    let cfg = ModelConfig::preset("tiny").unwrap();
    Arc::new(
        dummy_model(cfg, WeightFormat::F32, 4, "tiny")
            .unwrap()
            .with_kv_dtype(kv),
    )
}

fn engine(model: &Arc<Model>) -> Engine {
    let config = EngineConfig {
        kv_budget_bytes: 96 * model.kv_layout().block_bytes(),
        max_batch_tokens: 128,
        max_running: 16,
        ..Default::default()
    };
    Engine::new(model.clone(), TextTokenizer::byte_level(), config).unwrap()
}

fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| 3 + ((i * 37 + j * 11) % 250) as u32)
        .collect()
}

fn stop(max_tokens: usize) -> StopParams {
    StopParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

fn alone(model: &Arc<Model>, p: &[u32], n: usize) -> Vec<u32> {
    let mut e = engine(model);
    let id = e
        .add_request(p.to_vec(), SamplingParams::greedy(), stop(n))
        .unwrap();
    let tokens = e.run_to_completion(id).unwrap();
    tokens.iter().map(|o| o.token).collect()
}

#[test]
fn half_caches_take_half_the_bytes_and_have_their_own_layout() {
    let f32_layout = model(KvDtype::F32).kv_layout();
    for kv in [KvDtype::Bf16, KvDtype::F16] {
        let layout = model(kv).kv_layout();
        assert_eq!(2 * layout.block_bytes(), f32_layout.block_bytes());
        assert_ne!(layout.hash(), f32_layout.hash());
        // An engine refuses a cache laid out for another dtype (a peer's, say).
        let cache = KvCache::with_budget(f32_layout.clone(), 8 * f32_layout.block_bytes()).unwrap();
        let err = Engine::with_cache(
            model(kv),
            TextTokenizer::byte_level(),
            EngineConfig::default(),
            cache,
        )
        .unwrap_err();
        assert!(
            matches!(err, EngineError::LayoutMismatch(ref why) if why.contains("dtype")),
            "{err}"
        );
    }
}

#[test]
fn batching_and_chunking_keep_each_sequence_its_solo_tokens() {
    for kv in [KvDtype::Bf16, KvDtype::F16] {
        let model = model(kv);
        let mut e = engine(&model);
        // A 200-token prompt runs in chunks (128-token passes) beside the others' decodes.
        let lens = [5, 200, 33, 1, 70];
        let ids: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                e.add_request(prompt(i, len), SamplingParams::greedy(), stop(10))
                    .unwrap()
            })
            .collect();
        let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
        let mut guard = 0;
        while e.has_work() {
            for o in e.step().unwrap() {
                got.entry(o.id).or_default().push(o.token);
            }
            guard += 1;
            assert!(guard < 1000);
        }
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(
                got[id],
                alone(&model, &prompt(i, lens[i]), 10),
                "{kv:?} sequence {i}"
            );
        }
    }
}

#[test]
fn a_half_cache_hands_over_to_another_engine() {
    for kv in [KvDtype::Bf16, KvDtype::F16] {
        let model = model(kv);
        let p = prompt(9, 50);
        let got = common::handoff(|| engine(&model), &p, 12);
        assert_eq!(got, alone(&model, &p, 12), "{kv:?}");
    }
}

#[test]
fn logits_stay_near_the_f32_cache() {
    let p = prompt(3, 90);
    let logits = |kv| {
        let model = model(kv);
        let layout = model.kv_layout();
        let mut cache = KvCache::with_budget(layout.clone(), 8 * layout.block_bytes()).unwrap();
        let table: Vec<u32> = (0..8).collect();
        let input = tandem_engine::SeqInput {
            tokens: &p,
            start_pos: 0,
            block_table: &table,
            logits: true,
            all_logits: false,
        };
        model
            .forward(&mut cache, &[input], &mut |_, _| {})
            .unwrap()
            .remove(0)
    };
    let reference = logits(KvDtype::F32);
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    // bf16 keeps 8 significant bits, f16 11: errors of a few parts in 1e3 and 1e4.
    for (kv, tolerance) in [(KvDtype::Bf16, 2e-2), (KvDtype::F16, 3e-3)] {
        let got = logits(kv);
        let err = got
            .iter()
            .zip(&reference)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        assert!(err < tolerance, "{kv:?}: relative error {err}");
        assert!(err > 0.0, "{kv:?}: the cache was meant to round");
    }
}

//! Weights kept in GGML formats: in `exact` mode each format computes the logits of its own
//! tensors widened to f32 bit for bit (tolerance zero: the kernels dequantize exactly as ggml
//! does and sum in the f32 kernels' order); in `fast` mode (8-bit activations) it stays close
//! to them. In both modes a format is batch-invariant (chunked or not, in any batch) and hands
//! its KV from one engine to another with the same greedy tokens as one engine alone. The
//! process's mode is `TANDEM_COMPUTE`'s (`scripts/test-isas` runs this file in both).

use std::sync::Arc;

use tandem_engine::backend::cpu::kernels::{ComputeMode, QuantKind, compute_mode};
use tandem_engine::config::{ModelConfig, WeightFormat};
use tandem_engine::model::dummy_model;
use tandem_engine::{Engine, EngineConfig, Model, SamplingParams, SeqInput, StopParams};
use tandem_kv::{BlockPool, KvCache, blocks_for};
use tandem_text::TextTokenizer;

mod common;

/// A shape every format can hold: rows a multiple of the K formats' 256-element blocks.
fn config() -> ModelConfig {
    ModelConfig {
        vocab_size: 259,
        hidden_size: 256,
        intermediate_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        ..ModelConfig::preset("tiny").unwrap()
    }
}

fn model(kind: QuantKind) -> Arc<Model> {
    Arc::new(dummy_model(config(), WeightFormat::Quant(kind), 11, "tiny-quant").unwrap())
}

fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| 3 + ((i * 31 + j * 7) % 250) as u32)
        .collect()
}

fn engine(model: &Arc<Model>) -> Engine {
    let config = EngineConfig {
        kv_budget_bytes: 128 * model.kv_layout().block_bytes(),
        max_batch_tokens: 256,
        max_running: 16,
        ..Default::default()
    };
    Engine::new(model.clone(), TextTokenizer::byte_level(), config).unwrap()
}

fn stop(max_tokens: usize) -> StopParams {
    StopParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Last-token logits of each prompt, all in one batch, prefilled in chunks of `chunk`.
fn batch_logits(model: &Model, prompts: &[Vec<u32>], chunk: usize) -> Vec<Vec<f32>> {
    let layout = model.kv_layout();
    let mut cache = KvCache::with_budget(layout.clone(), 64 * layout.block_bytes()).unwrap();
    let mut pool = BlockPool::new(64);
    let tables: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| pool.allocate(blocks_for(p.len())).unwrap())
        .collect();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut last = vec![Vec::new(); prompts.len()];
    let mut start = 0;
    while start < longest {
        let inputs: Vec<(usize, SeqInput<'_>)> = prompts
            .iter()
            .zip(&tables)
            .enumerate()
            .filter(|(_, (p, _))| start < p.len())
            .map(|(i, (p, t))| {
                let end = (start + chunk).min(p.len());
                let input = SeqInput {
                    tokens: &p[start..end],
                    start_pos: start,
                    block_table: t,
                    logits: end == p.len(),
                    all_logits: false,
                };
                (i, input)
            })
            .collect();
        let seqs: Vec<SeqInput<'_>> = inputs.iter().map(|(_, s)| *s).collect();
        let out = model.forward(&mut cache, &seqs, &mut |_, _| {}).unwrap();
        let mut out = out.into_iter();
        for (i, s) in &inputs {
            if s.logits {
                last[*i] = out.next().unwrap();
            }
        }
        start += chunk;
    }
    last
}

#[test]
fn every_format_computes_the_logits_of_its_weights_widened_to_f32() {
    let prompts = vec![prompt(0, 1), prompt(1, 37), prompt(2, 80)];
    for kind in QuantKind::ALL {
        let native = model(kind);
        let widened = native.to_f32();
        assert!(
            native.weights().bytes_read_per_step() * 3 < widened.weights().bytes_read_per_step(),
            "{kind}: {} bytes vs {} in f32",
            native.weights().bytes_read_per_step(),
            widened.weights().bytes_read_per_step()
        );
        let got = batch_logits(&native, &prompts, 1000);
        let want = batch_logits(&widened, &prompts, 1000);
        match compute_mode() {
            ComputeMode::Exact => assert_eq!(got, want, "{kind}: logits differ from the f32 copy"),
            ComputeMode::Fast => {
                for (g, w) in got.iter().zip(&want) {
                    let err: f32 = g.iter().zip(w).map(|(a, b)| (a - b).powi(2)).sum();
                    let norm: f32 = w.iter().map(|b| b * b).sum();
                    let relative = (err / norm).sqrt();
                    assert!(
                        relative < 0.05,
                        "{kind}: fast logits {relative} away from f32"
                    );
                }
            }
        }
        // Chunked prefill in a mixed batch gives the same bits too.
        assert_eq!(batch_logits(&native, &prompts, 16), got, "{kind}: chunking");
    }
}

#[test]
fn every_format_decodes_disaggregated_as_one_engine_does() {
    for kind in QuantKind::ALL {
        let model = model(kind);
        let p = prompt(5, 40);
        let alone = {
            let mut e = engine(&model);
            let id = e
                .add_request(p.clone(), SamplingParams::greedy(), stop(12))
                .unwrap();
            let tokens: Vec<u32> = e
                .run_to_completion(id)
                .unwrap()
                .iter()
                .map(|o| o.token)
                .collect();
            tokens
        };
        let got = common::handoff(|| engine(&model), &p, 12);
        assert_eq!(got, alone, "{kind}");
    }
}

#[test]
fn formats_are_part_of_the_kv_identity() {
    let a = model(QuantKind::Q4_1);
    let b = model(QuantKind::Q8_0);
    assert_ne!(a.kv_layout().hash(), b.kv_layout().hash());
    assert_ne!(a.kv_layout().hash(), a.to_f32().kv_layout().hash());
    assert_eq!(a.storage_summary(), "q4_1×9");
}

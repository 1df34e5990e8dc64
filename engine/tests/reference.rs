//! The paged, batched engine against the straightforward reference forward (one sequence,
//! contiguous cache, candle ops): logits within 1e-4 relative, for mixed-length batches,
//! chunked prefills, sequences joining mid-way, scattered block tables, and every dtype path.

use std::sync::Arc;

use tandem_engine::config::{ModelConfig, WeightFormat};
use tandem_engine::model::dummy_model;
mod candle_reference;

use candle_reference::{ReferenceCache, ReferenceModel};
use tandem_engine::{Model, SeqInput};
use tandem_kv::{BLOCK_SIZE, BlockPool, KvCache, blocks_for};

fn tiny() -> Arc<Model> {
    Arc::new(
        dummy_model(
            ModelConfig::preset("tiny").unwrap(),
            WeightFormat::F32,
            0,
            "tiny",
        )
        .unwrap(),
    )
}

/// A smaller-vocabulary SmolLM2 shape: real head_dim 64, 9 heads over 3 KV heads, 4 layers.
fn smol_shaped() -> Arc<Model> {
    let cfg = ModelConfig {
        num_hidden_layers: 4,
        vocab_size: 2048,
        ..ModelConfig::preset("smollm2-135m").unwrap()
    };
    Arc::new(dummy_model(cfg, WeightFormat::F32, 5, "smol4").unwrap())
}

fn tokens(seed: u32, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % vocab as u32)
        .collect()
}

/// max|a − b| / max|b|
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let den = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    num / den.max(1e-6)
}

fn reference_logits(model: &Model, toks: &[u32]) -> Vec<Vec<f32>> {
    let r = ReferenceModel::new(model);
    let mut cache = ReferenceCache::default();
    r.forward(toks, &mut cache)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
}

struct Paged {
    cache: KvCache,
    pool: BlockPool,
}

impl Paged {
    fn new(model: &Model, blocks: usize) -> Self {
        let layout = model.kv_layout();
        let cache = KvCache::with_budget(layout.clone(), blocks * layout.block_bytes()).unwrap();
        // Scatter the pool so block tables are far from the identity.
        let mut pool = BlockPool::new(blocks);
        let all = pool.allocate(blocks).unwrap();
        let mut shuffled = all.clone();
        shuffled.reverse();
        shuffled.swap(0, blocks / 2);
        pool.release(&shuffled).unwrap();
        Self { cache, pool }
    }

    fn table(&mut self, tokens: usize) -> Vec<u32> {
        self.pool.allocate(blocks_for(tokens)).unwrap()
    }
}

fn check_model(model: Arc<Model>, lens: &[usize], tol: f32) {
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(i as u32, n, vocab))
        .collect();
    let mut paged = Paged::new(&model, 256);
    let tables: Vec<Vec<u32>> = prompts.iter().map(|p| paged.table(p.len() + 8)).collect();
    // One batch with every prompt.
    let inputs: Vec<SeqInput<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqInput {
            tokens: p,
            start_pos: 0,
            block_table: t,
            logits: true,
            all_logits: false,
        })
        .collect();
    let got = model
        .forward(&mut paged.cache, &inputs, &mut |_, _| {})
        .unwrap();
    for (p, g) in prompts.iter().zip(&got) {
        let want = reference_logits(&model, p);
        let err = rel_err(g, want.last().unwrap());
        assert!(
            err < tol,
            "prompt of {} tokens: relative error {err}",
            p.len()
        );
    }
}

#[test]
fn mixed_length_batch_matches_reference() {
    check_model(tiny(), &[1, 5, 16, 17, 33, 64], 1e-4);
}

#[test]
fn mixed_length_batch_matches_reference_at_real_head_dim() {
    check_model(smol_shaped(), &[3, 20, 40], 1e-4);
}

#[test]
fn half_precision_weights_match_their_own_reference() {
    for dtype in [WeightFormat::F16, WeightFormat::Bf16] {
        let model =
            Arc::new(dummy_model(ModelConfig::preset("tiny").unwrap(), dtype, 3, "tiny").unwrap());
        check_model(model, &[7, 30], 1e-4);
    }
}

#[test]
fn chunked_prefill_matches_reference_and_is_bit_identical_to_one_pass() {
    let model = tiny();
    let prompt = tokens(9, 100, 259);
    let want = reference_logits(&model, &prompt);
    let mut paged = Paged::new(&model, 64);
    let table = paged.table(100);
    let mut last = Vec::new();
    let mut pos = 0;
    for chunk in [32, 32, 36] {
        let input = SeqInput {
            tokens: &prompt[pos..pos + chunk],
            start_pos: pos,
            block_table: &table,
            logits: true,
            all_logits: false,
        };
        let out = model
            .forward(&mut paged.cache, &[input], &mut |_, _| {})
            .unwrap();
        pos += chunk;
        let err = rel_err(&out[0], &want[pos - 1]);
        assert!(err < 1e-4, "after {pos} tokens: {err}");
        last = out[0].clone();
    }
    let table2 = paged.table(100);
    let one = SeqInput {
        tokens: &prompt,
        start_pos: 0,
        block_table: &table2,
        logits: true,
        all_logits: false,
    };
    let whole = model
        .forward(&mut paged.cache, &[one], &mut |_, _| {})
        .unwrap();
    assert_eq!(whole[0], last, "chunking must not change a single bit");
}

#[test]
fn sequences_joining_midway_match_reference_step_by_step() {
    let model = tiny();
    let vocab = 259;
    let a: Vec<u32> = tokens(1, 40, vocab);
    let b: Vec<u32> = tokens(2, 23, vocab);
    let want_a = reference_logits(&model, &a);
    let want_b = reference_logits(&model, &b);
    let mut paged = Paged::new(&model, 64);
    let ta = paged.table(40);
    let tb = paged.table(23);
    // Step 1: A's prompt (first 30 tokens).
    let out = model
        .forward(
            &mut paged.cache,
            &[SeqInput {
                tokens: &a[..30],
                start_pos: 0,
                block_table: &ta,
                logits: true,
                all_logits: false,
            }],
            &mut |_, _| {},
        )
        .unwrap();
    assert!(rel_err(&out[0], &want_a[29]) < 1e-4);
    // Steps 2..: A decodes one token per step; B joins at step 3 with its whole prompt,
    // then decodes alongside A.
    let mut pb = 0;
    for (step, pa) in (0..10).zip(30..) {
        let mut inputs = vec![SeqInput {
            tokens: &a[pa..pa + 1],
            start_pos: pa,
            block_table: &ta,
            logits: true,
            all_logits: false,
        }];
        let b_len = match step {
            0 | 1 => 0,
            2 => 15,
            _ => 1,
        };
        if b_len > 0 {
            inputs.push(SeqInput {
                tokens: &b[pb..pb + b_len],
                start_pos: pb,
                block_table: &tb,
                logits: true,
                all_logits: false,
            });
        }
        let out = model
            .forward(&mut paged.cache, &inputs, &mut |_, _| {})
            .unwrap();
        assert!(rel_err(&out[0], &want_a[pa]) < 1e-4, "A at {pa}");
        if b_len > 0 {
            pb += b_len;
            assert!(rel_err(&out[1], &want_b[pb - 1]) < 1e-4, "B at {}", pb - 1);
        }
    }
}

#[test]
fn logits_are_bit_identical_whatever_the_batch() {
    let model = tiny();
    let vocab = 259;
    let target = tokens(42, 37, vocab);
    let mut paged = Paged::new(&model, 128);
    let alone_table = paged.table(37);
    let alone = model
        .forward(
            &mut paged.cache,
            &[SeqInput {
                tokens: &target,
                start_pos: 0,
                block_table: &alone_table,
                logits: true,
                all_logits: false,
            }],
            &mut |_, _| {},
        )
        .unwrap();
    let others: Vec<Vec<u32>> = (0..7)
        .map(|i| tokens(100 + i, 5 + 9 * i as usize, vocab))
        .collect();
    let tables: Vec<Vec<u32>> = others.iter().map(|o| paged.table(o.len())).collect();
    let table = paged.table(37);
    let mut inputs: Vec<SeqInput<'_>> = others
        .iter()
        .zip(&tables)
        .map(|(o, t)| SeqInput {
            tokens: o,
            start_pos: 0,
            block_table: t,
            logits: true,
            all_logits: false,
        })
        .collect();
    inputs.insert(
        3,
        SeqInput {
            tokens: &target,
            start_pos: 0,
            block_table: &table,
            logits: true,
            all_logits: false,
        },
    );
    let batched = model
        .forward(&mut paged.cache, &inputs, &mut |_, _| {})
        .unwrap();
    assert_eq!(batched[3], alone[0]);
}

#[test]
fn long_prompt_of_32k_tokens_prefills_in_chunks_within_budget() {
    let model = tiny();
    let n = 32 * 1024;
    let layout = model.kv_layout();
    // The budget: exactly the blocks this prompt needs, plus one.
    let blocks = n / BLOCK_SIZE + 1;
    let mut cache = KvCache::with_budget(layout.clone(), blocks * layout.block_bytes()).unwrap();
    let mut pool = BlockPool::new(cache.num_blocks());
    let table = pool.allocate(blocks_for(n)).unwrap();
    let prompt = tokens(7, n, 259);
    let mut pos = 0;
    let mut last = Vec::new();
    while pos < n {
        let chunk = 4096.min(n - pos);
        let input = SeqInput {
            tokens: &prompt[pos..pos + chunk],
            start_pos: pos,
            block_table: &table,
            logits: pos + chunk == n,
            all_logits: false,
        };
        last = model.forward(&mut cache, &[input], &mut |_, _| {}).unwrap();
        pos += chunk;
    }
    assert_eq!(last.len(), 1);
    assert!(last[0].iter().all(|v| v.is_finite()));
    assert_eq!(pool.free_count(), cache.num_blocks() - blocks_for(n));
}

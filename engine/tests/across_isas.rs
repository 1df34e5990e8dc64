//! The same logits, bit for bit, on every instruction set and every CPU architecture.
//!
//! A prefill worker and a decode worker may run on different CPUs (an AVX-512 host and an
//! AVX2 one, or x86 and aarch64). Greedy output stays token-for-token identical only if their
//! kernels agree bit for bit, which the kernels promise by summing every element in one fixed
//! order on every path. This test holds them to it: it runs fixed scenarios (a chunked prefill
//! beside decode steps, f32, bf16, f16, Q4_1, Q8_0 and Q4_0 weights, bf16 and f16 KV caches,
//! GQA at head_dim 64) and compares a SHA-256
//! of every logit's bits with `golden/logits.sha256`, which was written on x86-64. CI runs it
//! under each x86 instruction set (`TANDEM_ISA`) and on aarch64 under qemu.
//!
//! Quantized weights compute per the process's mode (`TANDEM_COMPUTE`): their lines carry
//! `@exact` or `@fast`, and a run checks the lines of its own mode (scripts/test-isas runs
//! both). If a change to the kernels alters the order of a sum on purpose, rewrite the mode's
//! lines with `TANDEM_BLESS=1 TANDEM_COMPUTE=<mode> cargo test -p tandem-engine --test
//! across_isas` and say why in the commit.

use std::fmt::Write;
use std::sync::Arc;

use sha2::{Digest, Sha256};
use tandem_engine::backend::cpu::kernels::{QuantKind, compute_mode, isa};
use tandem_engine::config::{ModelConfig, WeightFormat};
use tandem_engine::model::dummy_model;
use tandem_engine::{Model, SeqInput};
use tandem_kv::{BlockPool, KvCache, KvDtype, blocks_for};

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/logits.sha256");

/// SmolLM2's attention shape (head_dim 64, 9 query heads over 3 KV heads), 3 layers, a small
/// vocabulary.
fn model(dtype: WeightFormat, kv: KvDtype) -> Arc<Model> {
    let cfg = ModelConfig {
        num_hidden_layers: 3,
        vocab_size: 1000,
        ..ModelConfig::preset("smollm2-135m").unwrap()
    };
    Arc::new(dummy_model(cfg, dtype, 7, "isa").unwrap().with_kv_dtype(kv))
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % 1000)
        .collect()
}

/// Logits of a batch that mixes a prompt prefilled in two chunks with a sequence decoding,
/// then three decode steps of both.
fn scenario(model: &Model) -> Vec<Vec<f32>> {
    let layout = model.kv_layout();
    let mut cache = KvCache::with_budget(layout.clone(), 16 * layout.block_bytes()).unwrap();
    let mut pool = BlockPool::new(16);
    let a = tokens(1, 45);
    let b = tokens(2, 20);
    let table_a = pool.allocate(blocks_for(a.len() + 4)).unwrap();
    let table_b = pool.allocate(blocks_for(b.len() + 4)).unwrap();
    let mut logits = Vec::new();
    let mut forward = |inputs: &[SeqInput<'_>]| {
        let out = model.forward(&mut cache, inputs, &mut |_, _| {}).unwrap();
        logits.extend(out);
    };
    forward(&[SeqInput {
        tokens: &b,
        start_pos: 0,
        block_table: &table_b,
        logits: true,
        all_logits: false,
    }]);
    // First chunk of `a` beside nothing, then its second chunk beside b's first decode step.
    forward(&[SeqInput {
        tokens: &a[..30],
        start_pos: 0,
        block_table: &table_a,
        logits: false,
        all_logits: false,
    }]);
    let mut next_b = vec![7u32];
    forward(&[
        SeqInput {
            tokens: &next_b,
            start_pos: b.len(),
            block_table: &table_b,
            logits: true,
            all_logits: false,
        },
        SeqInput {
            tokens: &a[30..],
            start_pos: 30,
            block_table: &table_a,
            logits: true,
            all_logits: false,
        },
    ]);
    for step in 0..3 {
        let next_a = [11 + step as u32];
        next_b = vec![20 + step as u32];
        forward(&[
            SeqInput {
                tokens: &next_a,
                start_pos: a.len() + step,
                block_table: &table_a,
                logits: true,
                all_logits: false,
            },
            SeqInput {
                tokens: &next_b,
                start_pos: b.len() + 1 + step,
                block_table: &table_b,
                logits: true,
                all_logits: false,
            },
        ]);
    }
    logits
}

fn digest(logits: &[Vec<f32>]) -> String {
    let mut h = Sha256::new();
    for row in logits {
        for v in row {
            h.update(v.to_bits().to_le_bytes());
        }
    }
    h.finalize().iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[test]
fn logits_match_the_x86_golden_digests_bit_for_bit() {
    let mut lines = Vec::new();
    let q = |k| WeightFormat::Quant(k);
    for (dtype, kv) in [
        (WeightFormat::F32, KvDtype::F32),
        (WeightFormat::Bf16, KvDtype::F32),
        (WeightFormat::F16, KvDtype::F32),
        (q(QuantKind::Q4_1), KvDtype::F32),
        (q(QuantKind::Q8_0), KvDtype::F32),
        (q(QuantKind::Q4_0), KvDtype::F32),
        (WeightFormat::F32, KvDtype::Bf16),
        (WeightFormat::F32, KvDtype::F16),
    ] {
        let logits = scenario(&model(dtype, kv));
        assert!(logits.iter().flatten().all(|v| v.is_finite()));
        let mut name = match kv {
            KvDtype::F32 => dtype.name().to_string(),
            other => format!("{}+kv-{}", dtype.name(), other.name()),
        };
        if matches!(dtype, WeightFormat::Quant(_)) {
            name = format!("{name}@{}", compute_mode());
        }
        lines.push((name, digest(&logits)));
    }
    let golden = std::fs::read_to_string(GOLDEN).unwrap_or_default();
    let mut known: Vec<(String, String)> = golden
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if std::env::var_os("TANDEM_BLESS").is_some() {
        for (name, digest) in lines {
            match known.iter_mut().find(|(k, _)| *k == name) {
                Some(entry) => entry.1 = digest,
                None => known.push((name, digest)),
            }
        }
        let text = known.iter().fold(String::new(), |mut s, (k, v)| {
            let _ = writeln!(s, "{k} {v}");
            s
        });
        std::fs::write(GOLDEN, text).unwrap();
        return;
    }
    for (name, digest) in &lines {
        let want = known
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str());
        assert_eq!(
            want,
            Some(digest.as_str()),
            "{name}: logits on {} kernels ({}) differ from the x86-64 golden digests: the \
             kernels no longer sum in the promised order on this path (see this file's docs)",
            isa(),
            std::env::consts::ARCH
        );
    }
}

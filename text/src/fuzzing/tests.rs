//! The fuzz targets on every build: each replays its committed corpus (`fuzz/corpus/<name>/`,
//! the seeds and everything a fuzzing run kept) and the inputs that once broke it
//! (`fuzz/regressions/<name>/`), then runs a bounded, seeded mutation loop over the seeds
//! (the short run CI can afford without libFuzzer). `TANDEM_BLESS=1` writes the generated
//! seeds (a GGUF with a tokenizer and a template, a tokenizer.json).

use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::gguf::{GgufValue, write_metadata};
use crate::tokenizer::CHATML_TEMPLATE;

/// Mutated inputs per target and run.
const MUTATIONS: usize = 300;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// Every file of the target's corpus and regressions.
fn inputs(target: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for kind in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(fuzz_dir().join(kind).join(target)) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            out.push(std::fs::read(&path).unwrap());
        }
    }
    out
}

/// Flips, inserts, deletes and splices bytes of `seed` (never more than doubling it).
fn mutate(seed: &[u8], rng: &mut StdRng) -> Vec<u8> {
    let mut out = seed.to_vec();
    for _ in 0..rng.random_range(1..8) {
        let at = if out.is_empty() {
            0
        } else {
            rng.random_range(0..out.len())
        };
        match rng.random_range(0..5) {
            0 if !out.is_empty() => out[at] ^= 1 << rng.random_range(0..8),
            1 if !out.is_empty() => out[at] = rng.random(),
            2 if out.len() < 2 * seed.len() + 16 => out.insert(at, rng.random()),
            3 if !out.is_empty() => {
                out.remove(at);
            }
            // A run of 0xff: counts and lengths at their largest.
            _ if out.len() >= at + 8 => out[at..at + 8].fill(0xff),
            _ => {}
        }
    }
    out
}

/// Runs `body` on `input`; an input that makes it panic is written out (to commit under
/// `fuzz/regressions/<target>/` once fixed) and fails the test.
fn one(target: &str, body: fn(&[u8]), input: &[u8]) {
    if std::panic::catch_unwind(|| body(input)).is_err() {
        let dir = std::env::temp_dir().join("tandem-fuzz-found");
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join(format!("{target}-{:016x}", fnv(input)));
        let _ = std::fs::write(&path, input);
        panic!(
            "{target} panicked on an input, written to {}",
            path.display()
        );
    }
}

/// The corpus, then mutations of it; the corpus must not be empty (seeds are committed).
fn run(target: &str, body: fn(&[u8])) {
    let corpus = inputs(target);
    assert!(
        !corpus.is_empty(),
        "no corpus for {target} in {:?}",
        fuzz_dir()
    );
    for input in &corpus {
        one(target, body, input);
    }
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for i in 0..MUTATIONS {
        let input = mutate(&corpus[i % corpus.len()], &mut rng);
        one(target, body, &input);
    }
}

#[test]
fn gguf_metadata_survives_its_corpus() {
    if std::env::var_os("TANDEM_BLESS").is_some() {
        bless_gguf();
    }
    run("gguf_metadata", gguf_metadata);
}

#[test]
fn chat_template_survives_its_corpus() {
    run("chat_template", chat_template);
}

#[test]
fn tokenizer_json_survives_its_corpus() {
    if std::env::var_os("TANDEM_BLESS").is_some() {
        let json = TextTokenizer::byte_level().to_json().unwrap();
        write_seed("tokenizer_json", "byte_level.json", json.as_bytes());
    }
    run("tokenizer_json", tokenizer_json);
}

#[test]
fn guide_survives_its_corpus() {
    run("guide", guide);
}

#[test]
fn reply_survives_its_corpus() {
    run("reply", reply);
}

fn write_seed(target: &str, name: &str, bytes: &[u8]) {
    let dir = fuzz_dir().join("corpus").join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

/// A small byte-level BPE vocabulary with merges and a chat template, as a GGUF.
fn bless_gguf() {
    let s = |v: &str| GgufValue::String(v.into());
    let mut tokens: Vec<GgufValue> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .into_iter()
        .map(s)
        .collect();
    tokens.extend(
        ["h", "e", "l", "o", "he", "hel", "1", "2"]
            .into_iter()
            .map(s),
    );
    let mut types = vec![GgufValue::I32(3); 3];
    types.extend(std::iter::repeat_n(GgufValue::I32(1), tokens.len() - 3));
    let entries = vec![
        ("general.architecture", s("llama")),
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("smollm")),
        ("tokenizer.ggml.tokens", GgufValue::Array(tokens)),
        ("tokenizer.ggml.token_type", GgufValue::Array(types)),
        (
            "tokenizer.ggml.merges",
            GgufValue::Array(vec![s("h e"), s("he l")]),
        ),
        ("tokenizer.ggml.bos_token_id", GgufValue::U32(1)),
        ("tokenizer.ggml.eos_token_id", GgufValue::U32(2)),
        ("tokenizer.chat_template", s(CHATML_TEMPLATE)),
    ];
    let mut buf = Vec::new();
    write_metadata(&mut buf, &entries, 0).unwrap();
    write_seed("gguf_metadata", "bpe_chatml.gguf", &buf);
}

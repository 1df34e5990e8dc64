//! The fuzz targets on every build: each replays its committed corpus (`fuzz/corpus/<name>/`,
//! the seeds and everything a fuzzing run kept) and the inputs that once broke it
//! (`fuzz/regressions/<name>/`), then runs a bounded, seeded mutation loop over the seeds
//! (the short run CI can afford without libFuzzer; see `replay`, which every crate's fuzz
//! tests share). `TANDEM_BLESS=1` writes the generated seeds (a GGUF with a tokenizer and a
//! template, a tokenizer.json).

use super::replay::{blessing, run, write_seed};
use super::*;
use crate::gguf::{GgufValue, write_metadata};
use crate::tokenizer::CHATML_TEMPLATE;

#[test]
fn gguf_metadata_survives_its_corpus() {
    if blessing() {
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
    if blessing() {
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
